# Sourced by docker/build-image.sh and benches/too-big-for-one-box.sh: the parts of a
# `FROM scratch` image assembled on the host (no registry is reachable from our machines).

# stage_rootfs ROOT BIN...: each BIN (stripped of debug info) into ROOT/usr/local/bin, the
# shared libraries it links (as `ldd` lists them) and the dynamic loader at the paths it
# looks for them, a world-writable /tmp, and /etc/passwd and /etc/group naming root and the
# non-root user `ternfleet` (uid 10001).
stage_rootfs() {
  local root=$1 bin lib
  shift
  mkdir -p "$root/usr/local/bin" "$root/etc" "$root/tmp"
  chmod 1777 "$root/tmp"
  for bin in "$@"; do
    # Debug info stays on the host: the image gets a stripped copy.
    objcopy --strip-debug "$bin" "$root/usr/local/bin/$(basename "$bin")" 2>/dev/null \
      || cp "$bin" "$root/usr/local/bin/$(basename "$bin")"
    for lib in $(ldd "$bin" | awk '$2 == "=>" && $3 ~ /^\// { print $3 } $1 ~ /^\// { print $1 }'); do
      mkdir -p "$root$(dirname "$lib")"
      cp -L "$lib" "$root$lib"
    done
  done
  printf 'root:x:0:0:root:/:/nonexistent\nternfleet:x:10001:10001:ternfleet:/data:/nonexistent\n' >"$root/etc/passwd"
  printf 'root:x:0:\nternfleet:x:10001:\n' >"$root/etc/group"
}
