# Shared by docker/test-compose.sh and docker/chaos.sh: a compose project of its own (host
# ports picked by Docker), bounded waits, and cleanup on every exit. Source it from the
# repository root after setting `project`.
export TERNFLEET_IMAGE=${TERNFLEET_IMAGE:-ternfleet:latest}
export TERNFLEET_HTTP_PORT= TERNFLEET_GRPC_PORT= # empty: Docker picks free host ports
dc=(docker-compose -p "$project" -f docker/docker-compose.yml)

cleanup() {
  mkdir -p target
  "${dc[@]}" logs --no-color >"target/compose-$project.log" 2>&1 || true
  "${dc[@]}" down -v --remove-orphans -t 10 >/dev/null 2>&1 || true
}

# Waits (at most $1 s) for the coordinator's healthcheck to pass.
healthy() {
  local t0=$SECONDS id
  id=$("${dc[@]}" ps -q coordinator)
  while [ "$(docker inspect -f '{{.State.Health.Status}}' "$id" 2>/dev/null)" != healthy ]; do
    if [ $((SECONDS - t0)) -gt "${1:-600}" ]; then
      echo "compose: the coordinator is not healthy after ${1:-600} s" >&2
      "${dc[@]}" ps >&2
      "${dc[@]}" logs --tail 30 >&2
      exit 1
    fi
    sleep 1
  done
}

# The coordinator's published HTTP port.
http_port() { "${dc[@]}" port coordinator 8080 | sed 's/.*://'; }

# `ternfleet ctl ARGS --json` inside the coordinator's container.
ctl() {
  "${dc[@]}" exec -T coordinator /usr/local/bin/ternfleet ctl --addr 127.0.0.1:50052 \
    --certs /certs --id operator "$@" --json
}

# The committed placement's version.
placement_version() {
  ctl placement show | python3 -c 'import json,sys; print(json.load(sys.stdin)["placement_version"])'
}

# The container id of a service.
cid() { "${dc[@]}" ps -q "$1"; }

# The model fetched, the image built, cleanup armed for every exit.
prepare() {
  [ -f models/gemma-3-270m-q4_k_m.gguf ] || scripts/fetch-model.sh gemma >&2
  docker/build-image.sh
  trap cleanup EXIT
}
