#!/usr/bin/env bash
# Checks deploy/systemd's units with `systemd-analyze verify` (skipped where it is absent):
# a copy of each, its ExecStart pointed at the ternfleet binary given (default: the debug
# build the tests use), must verify with no message at all.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=$(realpath "${1:-target/debug/ternfleet}")
command -v systemd-analyze >/dev/null || { echo "verify-units: no systemd-analyze; skipped"; exit 0; }
[ -x "$bin" ] || { echo "verify-units: $bin is not built" >&2; exit 1; }
d=$(mktemp -d)
trap 'rm -rf "$d"' EXIT
for u in deploy/systemd/*.service; do
  sed "s|/usr/local/bin/ternfleet|$bin|" "$u" >"$d/$(basename "$u")"
done
out=$(cd "$d" && systemd-analyze verify ./ternfleet-node@n1.service ./ternfleet-coordinator.service 2>&1) || true
if [ -n "$out" ]; then
  echo "verify-units: systemd-analyze verify says:" >&2
  echo "$out" >&2
  exit 1
fi
echo "verify-units: deploy/systemd/*.service verified"
