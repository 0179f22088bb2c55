#!/usr/bin/env bash
# The Debian packages on a clean machine: a minimal bookworm root (debootstrap, from Debian's
# archive) gets libsmartgen0, libsmartgen-dev, smartgen-tools and the bindings' packages
# (libsmartgen-jni, libsmartgen-java, golang-smartgen-dev) with apt-get resolving their
# dependencies from the archive, and then, inside it, examples/c/transfer_pair.c built with
# `pkg-config --cflags --libs smartgen` runs a two-process transfer, a CMake project using
# find_package(SmartGen) builds and runs, and smartgen-info runs. A package whose dependencies are
# wrong fails here as it would for a user.
#
#   clean_root_deb.sh PACKAGES_DIR SOURCE_DIR [CACHE_DIR]
# CACHE_DIR (default ~/.cache/smartgen/clean-root, outside the clone, so a fresh clone on a machine
# that ran this before skips the debootstrap: about 100 s here) keeps the debootstrapped root (with
# the build tools the checks need, gcc, pkg-config, cmake, but none of SmartGen's dependencies)
# between runs; every run works on an overlay of it, so the cached root stays clean. A root older
# than 7 days is made anew, so it does not drift far from the archive. Needs root (chroot, mount);
# exits 77 (skipped, with the reason) without root, debootstrap or the archive.
set -euo pipefail
packages=$(realpath "$1")
src=$(realpath "$2")
cache=$(realpath -m "${3:-${XDG_CACHE_HOME:-$HOME/.cache}/smartgen/clean-root}")
mirror=${SMARTGEN_DEBIAN_MIRROR:-http://deb.debian.org/debian}

skip() { echo "SKIP: $*"; exit 77; }
[[ $(id -u) -eq 0 ]] || skip "needs root (debootstrap, chroot and mounts)"
command -v debootstrap >/dev/null || skip "debootstrap not installed (scripts/setup-deps.sh installs it)"
ls "$packages"/libsmartgen0_*.deb "$packages"/libsmartgen-dev_*.deb "$packages"/smartgen-tools_*.deb >/dev/null ||
  { echo "FAIL: no SmartGen .debs in $packages (run scripts/package.sh)"; exit 1; }

base=$cache/bookworm
if [[ ! -f $base/.smartgen-ready || -n $(find "$base/.smartgen-ready" -mtime +7 2>/dev/null) ]]; then
  rm -rf "$base"
  mkdir -p "$cache"
  echo "clean-root: debootstrap bookworm (minbase + gcc, pkg-config, cmake) into $base"
  start=$(date +%s)
  if ! debootstrap --variant=minbase --include=gcc,libc6-dev,pkg-config,cmake,make bookworm "$base" "$mirror" \
        >"$cache/debootstrap.log" 2>&1; then
    tail -5 "$cache/debootstrap.log"
    skip "debootstrap from $mirror failed (no archive?)"
  fi
  touch "$base/.smartgen-ready"
  echo "clean-root: root ready in $(( $(date +%s) - start )) s"
fi

work=$(mktemp -d)
root=$work/root
mounts=()
cleanup() {
  local m
  for (( i=${#mounts[@]}-1; i>=0; i-- )); do umount -l "${mounts[$i]}" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT
mkdir -p "$root" "$work/upper" "$work/overlay-work"
if mount -t overlay overlay -o "lowerdir=$base,upperdir=$work/upper,workdir=$work/overlay-work" "$root" 2>/dev/null; then
  mounts+=("$root")
else
  cp -a "$base/." "$root/"  # no overlayfs here: a copy costs a few seconds more
fi
for d in proc sys dev dev/pts; do
  mkdir -p "$root/$d"
done
mount -t proc proc "$root/proc" && mounts+=("$root/proc")
mount --rbind /sys "$root/sys" && mounts+=("$root/sys")
mount --rbind /dev "$root/dev" && mounts+=("$root/dev")
cp /etc/resolv.conf "$root/etc/resolv.conf"
mkdir -p "$root/tmp/debs" "$root/tmp/src"
debs=(libsmartgen0 libsmartgen-dev smartgen-tools libsmartgen-jni libsmartgen-java golang-smartgen-dev python3-smartgen)
for d in "${debs[@]}"; do
  cp "$packages/${d}"_*.deb "$root/tmp/debs/" || { echo "FAIL: no $d package in $packages"; exit 1; }
done
# The CUDA plugin's package, when package.sh could build it (NVIDIA's toolkit on the host).
cuda_deb=$(ls "$packages"/libsmartgen-cuda0_*.deb 2>/dev/null | head -1 || true)
[ -z "$cuda_deb" ] || cp "$cuda_deb" "$root/tmp/debs/"
cp "$src/examples/c/transfer_pair.c" "$src/tests/packaging/cuda_probe.c" "$root/tmp/src/"
cp -r "$src/tests/install/consumer" "$root/tmp/src/consumer"

in_root() { chroot "$root" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 "$@"; }
fail=0
step() {
  local what=$1
  shift
  if out=$("$@" 2>&1); then
    echo "ok: $what"
  else
    echo "FAIL: $what"
    echo "$out" | tail -25
    fail=1
  fi
}
step "apt-get update" in_root apt-get update -q
step "apt-get install the .debs, dependencies from the archive" \
  in_root sh -c 'DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends /tmp/debs/*.deb'
echo "clean-root: pulled in: $(in_root dpkg-query -W -f '${Package} ' libfabric1 libmimalloc2.0 libssl3 2>/dev/null)"
step "transfer_pair.c builds with pkg-config --cflags --libs smartgen" \
  in_root sh -c 'cd /tmp/src && gcc -std=c99 -Wall -Werror -o transfer_pair transfer_pair.c $(pkg-config --cflags --libs smartgen)'
step "transfer_pair runs a two-process transfer (tcp)" in_root timeout 120 /tmp/src/transfer_pair --provider tcp
step "a find_package(SmartGen 0.2) project configures, builds and runs" \
  in_root sh -c 'cmake -S /tmp/src/consumer -B /tmp/consumer >/dev/null && cmake --build /tmp/consumer >/dev/null && /tmp/consumer/consumer'
step "smartgen-info runs" in_root smartgen-info
# The bindings' packages: where Debian's JVMs and Go look (no JRE or Go toolchain in this root).
step "the JNI libraries are on the JVM's JNI path and find libsmartgen.so.0" \
  in_root sh -c 'ldd /usr/lib/*/jni/libsmartgen_jni.so | grep -q "libsmartgen.so.0 => /"'
step "smartgen.jar is in /usr/share/java" in_root test -f /usr/share/java/smartgen.jar
step "io.smartgen:smartgen (pom, and the jar it links to) is in /usr/share/maven-repo" \
  in_root sh -c 'set -- /usr/share/maven-repo/io/smartgen/smartgen/*/smartgen-*.pom /usr/share/maven-repo/io/smartgen/smartgen/*/smartgen-*.jar
                 [ $# = 2 ] && test -f "$1" && test -f "$2"'
step "python3 -c 'import smartgen' (python3-smartgen; python3 from the archive)" \
  in_root python3 -c 'import smartgen; assert smartgen.version().startswith("0."), smartgen.version()'
step "a Python context opens and closes (no NumPy in this root: the module needs none)" \
  in_root python3 -c 'import smartgen; smartgen.Context("tcp", allow_unauthenticated=True).close()'
step "the Go sources are in /usr/share/gocode/src/<module path>" \
  in_root test -f /usr/share/gocode/src/github.com/smartgen/smartgen/bindings/go/go.mod
if [ -n "$cuda_deb" ]; then
  step "the CUDA plugin loads beside libsmartgen with no toolkit and names the missing driver" \
    in_root sh -c 'cd /tmp/src && gcc -std=c99 -Wall -Werror -o cuda_probe cuda_probe.c $(pkg-config --cflags --libs smartgen) && ./cuda_probe'
  debs+=(libsmartgen-cuda0)
else
  echo "clean-root: no libsmartgen-cuda0 package (no nvcc on the host): its check is skipped"
fi
echo "clean-root: installed $(in_root dpkg-query -W -f '${Package} ${Version}, ' "${debs[@]}")"
exit $fail
