#!/usr/bin/env bash
# Builds the ternfleet container image without a registry (none is reachable from our
# machines): the release binary built here, the shared libraries it links (as `ldd` lists
# them) and a non-root user, on `scratch`. Prints the image's size.
#
#   docker/build-image.sh            # tag ternfleet:latest (TERNFLEET_IMAGE=NAME:TAG to change)
set -euo pipefail
cd "$(dirname "$0")/.."
tag=${TERNFLEET_IMAGE:-ternfleet:latest}
command -v docker >/dev/null || { echo "build-image: docker is not installed" >&2; exit 1; }

echo "build-image: cargo build --release --bin ternfleet" >&2
cargo build --release -p ternfleet-coordinator --bin ternfleet >&2
bin=target/release/ternfleet

ctx=$(mktemp -d)
trap 'rm -rf "$ctx"' EXIT
root=$ctx/rootfs home=$ctx/home
mkdir -p "$home/data" "$home/certs" "$home/bundles"
. docker/rootfs.sh
stage_rootfs "$root" "$bin"
cp docker/Dockerfile "$ctx/Dockerfile"

echo "build-image: docker build -t $tag" >&2
docker build -q -t "$tag" "$ctx" >&2
size=$(docker image inspect --format '{{.Size}}' "$tag")
echo "build-image: $tag, $((size / 1024 / 1024)) MiB ($size bytes)"
