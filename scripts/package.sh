#!/usr/bin/env bash
# Builds SmartGen's packages from one source tarball (packaging/README.md):
#   Debian  a source package (3.0 quilt: smartgen_<v>.orig.tar.gz + packaging/debian) and its
#           binaries libsmartgen0, libsmartgen-dev, smartgen-tools, the Java and Go ones
#           (dpkg-buildpackage), then lintian
#   RPM     smartgen, smartgen-devel, smartgen-tools from the same tarball (rpmbuild), then rpmlint
# With NVIDIA's toolkit at /usr/local/cuda (nvcc; not a Debian package) the CUDA plugin's package
# is built too: libsmartgen-cuda0 (profile pkg.smartgen.cuda) and smartgen-cuda (--with cuda);
# --no-cuda leaves it out.
# The tarball is the committed tree (git archive of HEAD), plus uncommitted changes to tracked files
# when there are some (git stash create), so a package never holds a file git does not know.
#
# Usage: scripts/package.sh [--out DIR] [--deb] [--rpm] [--jobs N] [--sign-key ID]
#   --out DIR      where the packages and logs go (default build/packages)
#   --deb/--rpm    only that family (default both)
#   --jobs N       parallel compile jobs (default: the number of cores)
#   --sign-key ID  sign the .rpms with this GPG key (a release); without it they are signed with a
#                  throwaway key made for the run (so the signing step is exercised and rpmlint's
#                  no-signature check holds), which nobody should trust
# Environment: SMARTGEN_PACKAGE_BUILD_DIR, the folder the two builds compile in (default
# ~/.cache/smartgen/package-build; fixed so that every clone's builds hit the compiler cache).
# Prints the packages with their sizes, and lintian's and rpmlint's findings. Exits nonzero when a
# build fails or either linter reports an error.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$(pwd)

out=$ROOT/build/packages
want_deb=0
want_rpm=0
jobs=$(nproc)
sign_key=""
cuda=1
while [[ $# -gt 0 ]]; do
  case $1 in
    --out) out=$(realpath -m "$2"); shift 2 ;;
    --deb) want_deb=1; shift ;;
    --rpm) want_rpm=1; shift ;;
    --jobs) jobs=$2; shift 2 ;;
    --sign-key) sign_key=$2; shift 2 ;;
    --no-cuda) cuda=0; shift ;;
    -h | --help) sed -n '2,23p' "$0"; exit 0 ;;
    *) echo "package.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
done
if [[ $want_deb -eq 0 && $want_rpm -eq 0 ]]; then want_deb=1; want_rpm=1; fi
if [[ $cuda -eq 1 && ! -x /usr/local/cuda/bin/nvcc ]]; then
  echo "package.sh: no /usr/local/cuda/bin/nvcc: the CUDA plugin's package is left out"
  cuda=0
fi
deb_profiles=""
rpm_with=()
if [[ $cuda -eq 1 ]]; then
  deb_profiles=pkg.smartgen.cuda
  rpm_with=(--with cuda)
fi

# One version, from the header: the spec gets it as a macro; Debian's changelog must agree with it.
version=$(sed -nE 's/^#define SG_VERSION_(MAJOR|MINOR|PATCH) ([0-9]+)$/\2/p' include/smartgen/smartgen.h | paste -sd.)
deb_version=$(sed -nE '1s/^smartgen \(([^)]+)\).*/\1/p' packaging/debian/changelog)
[[ ${deb_version%-*} == "$version" ]] || { echo "package.sh: debian/changelog says $deb_version, the header $version" >&2; exit 1; }

rm -rf "$out"
mkdir -p "$out"
work=$out/work
mkdir -p "$work"
# The Debian and RPM builds compile in one fixed folder, whatever the clone's path: their compiler
# lines carry the source's absolute path (dpkg's -ffile-prefix-map, rpm's debug source map), so from
# a folder of the clone's own, a fresh clone elsewhere missed ccache on all of the ~150 compilations
# (scripts/ccache-env.sh). One package.sh at a time uses the folder (flock).
build_root=${SMARTGEN_PACKAGE_BUILD_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/smartgen/package-build}
mkdir -p "$build_root"
exec 9>"$build_root.lock"
flock 9
rm -rf "$build_root/deb" "$build_root/rpm"
tarball=$work/smartgen-$version.tar.gz
tree=$(git stash create 2>/dev/null || true)
git archive --format=tar.gz --prefix="smartgen-$version/" -o "$tarball" "${tree:-HEAD}"
echo "package.sh: source tarball $(basename "$tarball") from ${tree:-HEAD} ($(du -h "$tarball" | cut -f1))"

lint_failed=0
if [[ $want_deb -eq 1 ]]; then
  deb=$build_root/deb
  mkdir -p "$deb"
  cp "$tarball" "$deb/smartgen_$version.orig.tar.gz"
  tar -xzf "$tarball" -C "$deb"
  cp -r packaging/debian "$deb/smartgen-$version/debian"
  echo "package.sh: dpkg-buildpackage (log: $out/deb-build.log)"
  if ! (cd "$deb/smartgen-$version" && DEB_BUILD_OPTIONS="parallel=$jobs nocheck" \
          dpkg-buildpackage -us -uc -sa ${deb_profiles:+-P$deb_profiles} >"$out/deb-build.log" 2>&1); then
    tail -40 "$out/deb-build.log"
    echo "package.sh: the Debian build failed" >&2
    exit 1
  fi
  cp "$deb"/*.deb "$deb"/*.dsc "$deb"/*.debian.tar.* "$deb"/*.orig.tar.gz "$deb"/*.changes "$deb"/*.buildinfo "$out"/
  changes=$(ls "$out"/*.changes)
  # --fail-on error: warnings are reported (and explained in packaging/README.md), errors fail.
  if lintian --fail-on error --info "$changes" >"$out/lintian.txt" 2>&1; then
    echo "package.sh: lintian: no errors ($(grep -c '^W:' "$out/lintian.txt" || true) warnings, $out/lintian.txt)"
  else
    echo "package.sh: lintian reports errors:"
    lint_failed=1
  fi
  grep -E '^(E|W):' "$out/lintian.txt" | sort -u || true
fi

if [[ $want_rpm -eq 1 ]]; then
  rpmtop=$build_root/rpm
  mkdir -p "$rpmtop"/{BUILD,RPMS,SOURCES,SPECS,SRPMS}
  cp "$tarball" "$rpmtop/SOURCES/"
  # The spec in the source RPM carries the version written out, so it rebuilds on its own.
  sed "s/%{smartgen_version}/$version/" packaging/rpm/smartgen.spec >"$rpmtop/SPECS/smartgen.spec"
  echo "package.sh: rpmbuild (log: $out/rpm-build.log)"
  # --nodeps: this is a Debian machine, its build dependencies are dpkg's, not in an rpm database.
  if ! rpmbuild --nodeps --define "_topdir $rpmtop" --define "_smp_mflags -j$jobs" "${rpm_with[@]}" \
         -ba "$rpmtop/SPECS/smartgen.spec" >"$out/rpm-build.log" 2>&1; then
    tail -40 "$out/rpm-build.log"
    echo "package.sh: the RPM build failed" >&2
    exit 1
  fi
  find "$rpmtop/RPMS" "$rpmtop/SRPMS" -name '*.rpm' -exec cp {} "$out"/ \;
  export GNUPGHOME=$work/gnupg
  mkdir -p -m 700 "$GNUPGHOME"
  if [[ -z $sign_key ]]; then
    sign_key="SmartGen throwaway signing key <throwaway@smartgen.dev>"
    gpg --batch --pinentry-mode loopback --passphrase '' --quick-gen-key "$sign_key" rsa3072 sign 1d >/dev/null 2>&1
  fi
  # Debian's rpm looks for gpg2; Debian calls it gpg.
  if ! rpmsign --define "__gpg $(command -v gpg)" --define "_gpg_name $sign_key" --addsign "$out"/*.rpm >"$out/rpmsign.log" 2>&1; then
    cat "$out/rpmsign.log"
    echo "package.sh: signing the .rpms failed" >&2
    exit 1
  fi
  # rpmlint verifies the signatures against rpm's keyring: a private one (through a private HOME's
  # .rpmmacros) that holds the signing key, so the host's rpm database is left alone.
  lint_home=$work/rpmlint-home
  mkdir -p "$lint_home"
  echo "%_dbpath $lint_home/rpmdb" >"$lint_home/.rpmmacros"
  gpg --batch --armor --export "$sign_key" >"$work/signing-key.asc"
  HOME=$lint_home rpm --initdb
  HOME=$lint_home rpm --import "$work/signing-key.asc"
  if HOME=$lint_home rpmlint "$out"/*.rpm >"$out/rpmlint.txt" 2>&1; then
    echo "package.sh: rpmlint: no errors ($out/rpmlint.txt)"
  else
    # rpmlint exits nonzero for errors only (its summary line counts them).
    echo "package.sh: rpmlint reports errors:"
    lint_failed=1
  fi
  grep -E ': (E|W): ' "$out/rpmlint.txt" | sort -u || true
  tail -1 "$out/rpmlint.txt"
fi

echo
echo "package.sh: packages in $out"
for f in "$out"/*.deb "$out"/*.rpm; do
  [[ -e $f ]] || continue
  printf '  %-60s %8s\n' "$(basename "$f")" "$(du -h "$f" | cut -f1)"
done
[[ $lint_failed -eq 0 ]]
