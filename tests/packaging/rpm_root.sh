#!/usr/bin/env bash
# The RPM packages installed into a scratch root (rpm --root, its own database). There is no RPM
# distribution to boot here, so this does not prove the Requires resolve against Fedora's or
# RHEL's libfabric/mimalloc/OpenSSL packages (--nodeps: the host's libraries are dpkg's); it does
# check what the packages hold, what they provide and require (rpm's own elfdeps), that the
# installed smartgen.pc and CMake files point inside the root's prefix, and that a program built
# against that root links and runs with the installed library.
#
#   rpm_root.sh PACKAGES_DIR SOURCE_DIR
set -euo pipefail
packages=$(realpath "$1")
src=$(realpath "$2")
command -v rpm >/dev/null || { echo "SKIP: rpm not installed (scripts/setup-deps.sh installs it)"; exit 77; }
shopt -s nullglob
rpms=("$packages"/smartgen-[0-9]*.x86_64.rpm "$packages"/smartgen-devel-*.x86_64.rpm "$packages"/smartgen-tools-*.x86_64.rpm
      "$packages"/python3-smartgen-*.x86_64.rpm)
[[ ${#rpms[@]} -eq 4 ]] || { echo "FAIL: want smartgen, -devel, -tools and python3-smartgen .rpms in $packages, found ${#rpms[@]}"; exit 1; }

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
root=$work/root
fail=0
ok() { echo "ok: $*"; }
bad() { echo "FAIL: $*"; fail=1; }

libdir=$(rpm --eval '%{_libdir}')
rpm --root "$root" --dbpath /var/lib/rpm --initdb
if rpm --root "$root" --dbpath /var/lib/rpm -i --nodeps "${rpms[@]}" 2>"$work/install.log"; then
  ok "the four packages install into a scratch root"
else
  bad "rpm -i: $(cat "$work/install.log")"
fi
installed=$(rpm --root "$root" --dbpath /var/lib/rpm -qa --qf '%{NAME}-%{VERSION}-%{RELEASE}\n' | sort | paste -sd' ')
echo "rpm-root: installed $installed"

# What each package holds.
want_files=(
  "smartgen:$libdir/libsmartgen.so.0"
  "smartgen-devel:/usr/include/smartgen/smartgen.h"
  "smartgen-devel:$libdir/libsmartgen.so"
  "smartgen-devel:$libdir/pkgconfig/smartgen.pc"
  "smartgen-devel:$libdir/cmake/SmartGen/SmartGenConfig.cmake"
  "smartgen-tools:/usr/bin/smartgen-info"
  "smartgen-tools:/usr/bin/smartgen-bench"
  "smartgen-tools:/usr/bin/smartgen-profile"
  "python3-smartgen:$libdir/python$(/usr/bin/python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')/site-packages/smartgen/__init__.py"
)
for pair in "${want_files[@]}"; do
  pkg=${pair%%:*}
  file=${pair#*:}
  owner=$(rpm --root "$root" --dbpath /var/lib/rpm -qf "$file" --qf '%{NAME}\n' 2>/dev/null || true)
  [[ $owner == "$pkg" ]] && ok "$file in $pkg" || bad "$file owned by '$owner', want $pkg"
done

# Provides and Requires come from rpm's elfdeps, not the spec.
provides=$(rpm -qp --provides "$packages"/smartgen-[0-9]*.x86_64.rpm 2>/dev/null)
for p in 'libsmartgen.so.0()(64bit)' 'libsmartgen.so.0(SMARTGEN_0.1)(64bit)' 'libsmartgen.so.0(SMARTGEN_0.2)(64bit)' \
  'libsmartgen.so.0(SMARTGEN_0.3)(64bit)'; do
  grep -qxF "$p" <<<"$provides" && ok "smartgen provides $p" || bad "smartgen does not provide $p (got: $(paste -sd' ' <<<"$provides"))"
done
requires=$(rpm -qp --requires "$packages"/smartgen-[0-9]*.x86_64.rpm 2>/dev/null)
for r in 'libfabric.so.1()(64bit)' 'libcrypto.so.3()(64bit)'; do
  grep -qxF "$r" <<<"$requires" && ok "smartgen requires $r" || bad "smartgen does not require $r"
done
tools_requires=$(rpm -qp --requires "$packages"/smartgen-tools-*.x86_64.rpm 2>/dev/null)
grep -qxF 'libsmartgen.so.0()(64bit)' <<<"$tools_requires" && ok "smartgen-tools requires libsmartgen.so.0()(64bit)" ||
  bad "smartgen-tools does not require libsmartgen.so.0()(64bit)"
devel_requires=$(rpm -qp --requires "$packages"/smartgen-devel-*.x86_64.rpm 2>/dev/null)
grep -qE '^smartgen\(x86-64\) = ' <<<"$devel_requires" && ok "smartgen-devel requires the same smartgen" ||
  bad "smartgen-devel does not require smartgen(x86-64) = its version"

# The consumer files point inside the root.
export PKG_CONFIG_PATH=$root$libdir/pkgconfig
pc_libdir=$(realpath -m "$(pkg-config --variable=libdir smartgen)")
[[ $pc_libdir == "$root$libdir" ]] && ok "smartgen.pc's libdir is inside the root ($pc_libdir)" ||
  bad "smartgen.pc's libdir is $pc_libdir, not $root$libdir"
# shellcheck disable=SC2046 # pkg-config's output is meant to be split
if gcc -std=c99 -Wall -Werror -o "$work/transfer_pair" "$src/examples/c/transfer_pair.c" $(pkg-config --cflags --libs smartgen) 2>"$work/gcc.log" &&
   LD_LIBRARY_PATH=$root$libdir SG_LOG_LEVEL=error timeout 60 "$work/transfer_pair" --provider tcp >"$work/tp.log" 2>&1; then
  ok "transfer_pair built against the root's smartgen.pc runs a transfer with the root's library"
else
  bad "transfer_pair against the root: $(tail -5 "$work/gcc.log" "$work/tp.log")"
fi
# SmartGen_DIR, not CMAKE_PREFIX_PATH: CMake on Debian does not search lib64 (Debian is multiarch),
# CMake on an RPM distribution does.
if cmake -S "$src/tests/install/consumer" -B "$work/consumer" -DSmartGen_DIR="$root$libdir/cmake/SmartGen" >"$work/cmake.log" 2>&1 &&
   cmake --build "$work/consumer" >>"$work/cmake.log" 2>&1; then
  linked=$(grep -rhoE "[^ ]*libsmartgen\.so[^ ]*" "$work/consumer/CMakeFiles/consumer.dir/link.txt" | head -1)
  [[ $(realpath -m "$linked") == "$root"* ]] && ok "find_package(SmartGen) resolves inside the root ($linked)" ||
    bad "find_package(SmartGen) linked $linked, outside the root"
  "$work/consumer/consumer" >/dev/null && ok "the find_package consumer runs" || bad "the find_package consumer failed"
else
  bad "find_package(SmartGen) against the root: $(tail -10 "$work/cmake.log")"
fi
# The Python module from the root, with the root's library (the host's python3 is the ABI it was built for).
py3ver=$(/usr/bin/python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')
if out=$(PYTHONPATH=$root$libdir/python$py3ver/site-packages LD_LIBRARY_PATH=$root$libdir /usr/bin/python3 -c \
    'import smartgen; print(smartgen.__file__, smartgen.version()); smartgen.Context("tcp", allow_unauthenticated=True).close()' 2>&1) &&
   [[ $out == "$root"* ]]; then
  ok "python3 imports smartgen from the root and opens a context ($out)"
else
  bad "python3 -c 'import smartgen' against the root: $out"
fi
exit $fail
