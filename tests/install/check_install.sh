#!/usr/bin/env bash
# Installs a built tree into a scratch prefix and uses it the two ways users do: pkg-config
# (examples/c/transfer_pair.c, a real two-process transfer) and find_package(SmartGen) (a small
# CMake project). Also checks what the install holds and that a request for another major is refused.
#   check_install.sh BUILD_DIR SOURCE_DIR
set -euo pipefail
build=$1
src=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
prefix=$work/prefix
fail=0
pass=0
ok() { pass=$((pass + 1)); }
bad() { echo "FAIL: $*"; fail=$((fail + 1)); }

cmake --install "$build" --prefix "$prefix" >"$work/install.log"
libdir=$(dirname "$(find "$prefix" -name 'libsmartgen.so.0' | head -1)")
[ -n "$libdir" ] && [ -d "$libdir" ] && ok || { bad "libsmartgen.so.0 not installed"; cat "$work/install.log"; exit 1; }
for f in libsmartgen.so libsmartgen.so.0 pkgconfig/smartgen.pc cmake/SmartGen/SmartGenConfig.cmake \
         cmake/SmartGen/SmartGenConfigVersion.cmake cmake/SmartGen/SmartGenTargets.cmake; do
  [ -e "$libdir/$f" ] && ok || bad "$libdir/$f missing"
done
[ -f "$prefix/include/smartgen/smartgen.h" ] && ok || bad "header missing"
for t in smartgen-info smartgen-bench smartgen-profile; do
  [ -x "$prefix/bin/$t" ] && ok || bad "tool $t missing"
done
soname=$(readelf -d "$libdir/libsmartgen.so.0" | sed -n 's/.*Library soname: \[\(.*\)\]/\1/p')
[ "$soname" = libsmartgen.so.0 ] && ok || bad "SONAME '$soname'"

export PKG_CONFIG_PATH=$libdir/pkgconfig
version=$(pkg-config --modversion smartgen)
header_version=$(sed -nE 's/#define SG_VERSION_(MAJOR|MINOR|PATCH) ([0-9]+)/\2/p' "$src/include/smartgen/smartgen.h" | paste -sd.)
[ "$version" = "$header_version" ] && ok || bad "smartgen.pc says $version, the header $header_version"
# shellcheck disable=SC2046 # pkg-config's output is meant to be split
gcc -std=c99 -Wall -Werror -o "$work/transfer_pair" "$src/examples/c/transfer_pair.c" $(pkg-config --cflags --libs smartgen) \
  && ok || bad "transfer_pair does not build with pkg-config --cflags --libs smartgen"
if LD_LIBRARY_PATH=$libdir SG_LOG_LEVEL=error timeout 60 "$work/transfer_pair" --provider tcp >"$work/tp.log" 2>&1; then
  ok
else
  bad "transfer_pair built from the install failed:"; tail -20 "$work/tp.log"
fi

# The build tree itself, uninstalled: smartgen-uninstalled.pc points into it (with a run path), and
# no installed smartgen.pc may be found instead (its paths would be outside the tree).
[ ! -e "$libdir/pkgconfig/smartgen-uninstalled.pc" ] && ok || bad "smartgen-uninstalled.pc was installed"
tree_flags=$(PKG_CONFIG_PATH=$build pkg-config --cflags --libs smartgen)
case "$tree_flags" in
  *"-L$build "*"-I$src/include"*|*"-I$src/include"*"-L$build "*) ok ;;
  *) bad "PKG_CONFIG_PATH=$build pkg-config gives '$tree_flags', not the build tree" ;;
esac
# shellcheck disable=SC2086 # pkg-config's output is meant to be split
if gcc -std=c99 -Wall -Werror -o "$work/transfer_pair_tree" "$src/examples/c/transfer_pair.c" $tree_flags &&
   SG_LOG_LEVEL=error timeout 60 "$work/transfer_pair_tree" --provider tcp >"$work/tp_tree.log" 2>&1; then
  ok
else
  bad "transfer_pair built against the uninstalled tree failed:"; tail -20 "$work/tp_tree.log" 2>/dev/null
fi

# Each binding's interop program (docs/bindings.md), copied out of the repository into a project of
# that ecosystem's own kind, built against this install with the ecosystem's usual steps, then run
# as both sides of a transfer pair over memory the program allocated itself. This scratch prefix is
# not on the loader's path, as /usr/lib of the packages is: the programs run with LD_LIBRARY_PATH.
# shellcheck source=../interop/pair.sh
. "$src/tests/interop/pair.sh"
interop_make_key "$work"
PAIR_ARGS=(--layers 4 --tokens 256 --blocks 80 --timeout-s 60)
# launcher NAME COMMAND...: a script running COMMAND with the install's library path.
launcher() {
  local name=$1
  shift
  printf '#!/bin/sh\nLD_LIBRARY_PATH=%q exec' "$libdir" >"$work/launch-$name"
  printf ' %q' "$@" >>"$work/launch-$name"
  printf ' "$@"\n' >>"$work/launch-$name"
  chmod +x "$work/launch-$name"
}
# pair LANG: both sides of a pair through $work/launch-LANG; true when both report every byte.
pair() {
  local dir="$work/pair-$1" why
  mkdir -p "$dir"
  if ! interop_run_pair "$work/launch-$1" "$work/launch-$1" "$dir" 120; then
    bad "$1: the pair did not run"
    return
  fi
  why=$(interop_pair_verdict "$1" "$1" "$dir")
  if [ -z "$why" ]; then
    ok
    echo "install: $1 outside the repository: $(tail -n 1 "$dir/decode.out")"
  else
    bad "$1 interop pair built outside the repository: $why"
    interop_print_logs "$dir"
  fi
}
trap 'interop_kill_children; rm -rf "$work"' EXIT

# Cargo: a package with the smartgen crate by path (no registry here), which finds the installed
# library through pkg-config alone (no SMARTGEN_LIB_DIR).
if command -v cargo >/dev/null && command -v rustc >/dev/null; then
  mkdir -p "$work/cargo_consumer/src"
  cat >"$work/cargo_consumer/Cargo.toml" <<EOT
[package]
name = "consumer"
version = "0.1.0"
edition = "2021"
[dependencies]
smartgen = { path = "$src/bindings/rust/smartgen" }
[workspace]
EOT
  cp "$src"/bindings/rust/smartgen/examples/interop/*.rs "$work/cargo_consumer/src/"
  if (cd "$work/cargo_consumer" && env -u SMARTGEN_LIB_DIR -u LD_LIBRARY_PATH CARGO_TARGET_DIR="$work/cargo_target" \
        cargo build --offline --quiet >"$work/cargo.log" 2>&1); then
    launcher rust "$work/cargo_target/debug/consumer"
    pair rust
  else
    bad "a Cargo project against the install (pkg-config) does not build:"; tail -20 "$work/cargo.log"
  fi
fi

# Go: a module with the binding by a replace directive (no proxy here), built with the flags cgo
# takes from pkg-config alone (no CGO_CFLAGS / CGO_LDFLAGS).
if command -v go >/dev/null; then
  mkdir -p "$work/go_consumer"
  cat >"$work/go_consumer/go.mod" <<EOT
module example.com/consumer

go 1.19

require github.com/smartgen/smartgen/bindings/go v0.0.0
replace github.com/smartgen/smartgen/bindings/go => $src/bindings/go
EOT
  cp "$src"/bindings/go/cmd/smartgen-interop/*.go "$work/go_consumer/"
  if (cd "$work/go_consumer" && env -u CGO_CFLAGS -u CGO_LDFLAGS GOFLAGS=-mod=mod GOPROXY=off GOSUMDB=off \
        GOCACHE="$work/gocache" GOPATH="$work/gopath" go build -o consumer . >"$work/go.log" 2>&1); then
    launcher go "$work/go_consumer/consumer"
    pair go
  else
    bad "a Go module against the install (cgo pkg-config) does not build:"; tail -20 "$work/go.log"
  fi
fi

# Maven: a project depending on io.smartgen:smartgen:VERSION, resolved from the install's
# share/maven-repo (on Debian: /usr/share/maven-repo, with the plugins Maven itself needs), built
# offline with `mvn package`. The JNI library comes from java.library.path, as on Debian.
jni_dir=$libdir/jni
if [ -f "$prefix/share/java/smartgen-$version.jar" ] && command -v mvn >/dev/null; then
  [ -f "$prefix/share/maven-repo/io/smartgen/smartgen/$version/smartgen-$version.pom" ] && ok ||
    bad "no io.smartgen:smartgen:$version in $prefix/share/maven-repo"
  m=$work/maven_consumer
  mkdir -p "$m/src/main"
  cp -r "$src/bindings/java/src/interop/java" "$m/src/main/java"
  cat >"$m/settings.xml" <<EOT
<settings>
  <localRepository>$work/m2</localRepository>
  <mirrors>
    <mirror><id>debian</id><mirrorOf>*,!smartgen</mirrorOf><url>file:///usr/share/maven-repo</url></mirror>
  </mirrors>
  <profiles>
    <profile>
      <id>install</id>
      <repositories><repository><id>smartgen</id><url>file://$prefix/share/maven-repo</url></repository></repositories>
    </profile>
  </profiles>
  <activeProfiles><activeProfile>install</activeProfile></activeProfiles>
</settings>
EOT
  cat >"$m/pom.xml" <<EOT
<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>com.example</groupId>
  <artifactId>consumer</artifactId>
  <version>1</version>
  <properties>
    <maven.compiler.release>17</maven.compiler.release>
    <project.build.sourceEncoding>UTF-8</project.build.sourceEncoding>
  </properties>
  <dependencies>
    <dependency><groupId>io.smartgen</groupId><artifactId>smartgen</artifactId><version>$version</version></dependency>
  </dependencies>
</project>
EOT
  if (cd "$m" && mvn -B -q -s settings.xml package >"$work/maven.log" 2>&1); then
    launcher java java "-Djava.library.path=$jni_dir" \
      -cp "$m/target/consumer-1.jar:$work/m2/io/smartgen/smartgen/$version/smartgen-$version.jar" io.smartgen.interop.Interop
    pair java
    # And with the prefix's own jar and nothing else set (no java.library.path, no LD_LIBRARY_PATH):
    # the loader finds <libdir>/jni beside the jar, the JNI library finds the prefix's libsmartgen
    # through its RUNPATH (0.5 needed -Djava.library.path for a prefix install).
    printf '#!/bin/sh\nunset LD_LIBRARY_PATH\nexec java -cp %q io.smartgen.interop.Interop "$@"\n' \
      "$m/target/consumer-1.jar:$prefix/share/java/smartgen.jar" >"$work/launch-java"
    pair java
  else
    bad "a Maven project against the install does not build:"; tail -20 "$work/maven.log"
  fi
fi

if cmake -S "$src/tests/install/consumer" -B "$work/consumer" -DCMAKE_PREFIX_PATH="$prefix" >"$work/consumer.log" 2>&1 &&
   cmake --build "$work/consumer" >>"$work/consumer.log" 2>&1; then
  ok
  # The imported target carries the library's path; the consumer runs without LD_LIBRARY_PATH only
  # through its build rpath, which is what this checks too.
  "$work/consumer/consumer" && ok || bad "the find_package consumer failed"
else
  bad "find_package(SmartGen 0.2) consumer does not configure or build:"; tail -20 "$work/consumer.log"
fi
# The Go binding's sources, as golang-smartgen-dev installs them (a build with the Go binding).
if [ -f "$src/bindings/go/go.mod" ] && grep -q "SMARTGEN_INSTALL_GO_SOURCES:BOOL=ON" "$build/CMakeCache.txt"; then
  [ -f "$prefix/share/gocode/src/github.com/smartgen/smartgen/bindings/go/go.mod" ] && ok ||
    bad "the Go binding's sources are not under $prefix/share/gocode/src"
fi
# The Python package under the prefix (a build with the Python binding): importable from its
# site-packages with nothing else set, its extension finding the prefix's library (0.5's had no
# RUNPATH, so the import failed unless LD_LIBRARY_PATH named the prefix).
pypkg=$(find "$prefix" -path '*/site-packages/smartgen/__init__.py' 2>/dev/null | head -1)
if [ -n "$pypkg" ]; then
  site=$(dirname "$(dirname "$pypkg")")
  loaded=$(env -u LD_LIBRARY_PATH PYTHONPATH="$site" python3 -c 'import smartgen, smartgen._native as n, re
print([l.split()[-1] for l in open("/proc/self/maps") if re.search(r"libsmartgen\.so", l)][0])' 2>"$work/python.log") &&
    case $loaded in "$prefix"/*) ok ;; *) bad "the Python package under $site loaded $loaded, not the prefix's library" ;; esac ||
    { bad "the Python package under $site does not import:"; tail -5 "$work/python.log"; }
fi
mkdir -p "$work/major"
printf 'cmake_minimum_required(VERSION 3.16)\nproject(m C)\nfind_package(SmartGen 1.0 REQUIRED)\n' >"$work/major/CMakeLists.txt"
if cmake -S "$work/major" -B "$work/major/build" -DCMAKE_PREFIX_PATH="$prefix" >"$work/major.log" 2>&1; then
  bad "find_package(SmartGen 1.0) accepted a $version install"
else
  grep -q "compatible with requested version" "$work/major.log" && ok || { bad "find_package(SmartGen 1.0) failed for another reason:"; tail -5 "$work/major.log"; }
fi

echo "install: $pass passed, $fail failed (prefix layout: ${libdir#"$prefix"/})"
[ "$fail" = 0 ]
