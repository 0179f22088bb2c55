#!/usr/bin/env bash
# Installs the Debian packages SmartGen needs, sized to the job. Idempotent: when every package is
# already installed (checked with dpkg-query) it does nothing, unless --force is given.
#
# Usage: scripts/setup-deps.sh [--for demo|test] [--force]
#   --for demo   what scripts/demo.sh needs: the library's build (compiler, CMake, Ninja, libfabric,
#                mimalloc, OpenSSL, libcurl, nlohmann-json), jq for its tables, and iproute2 for the
#                10 Gbit/s rows (network namespaces, tc)
#   --for test   (default) everything scripts/test.sh runs: the above, GoogleTest, etcd, clang and
#                libFuzzer, the bindings' languages, the ABI and packaging tools
set -euo pipefail

DEMO_PACKAGES=(
  cmake
  ninja-build
  g++
  gcc
  pkg-config
  libfabric-dev
  libmimalloc-dev
  libssl-dev
  libcurl4-openssl-dev
  nlohmann-json3-dev
  iproute2
  jq
  # Every build tree compiles through ccache (scripts/ccache-env.sh): the release, asan, tsan and fuzz
  # trees and a fresh clone in another folder share one bounded cache.
  ccache
)

TEST_PACKAGES=(
  libfabric-bin
  libgtest-dev
  googletest
  etcd-server
  clang-14
  libclang-rt-14-dev
  llvm-14
  # The bindings (bindings/, docs/bindings.md): SWIG for Go and Java, Go, the JDK and JUnit 5,
  # bindgen for smartgen-sys (Rust's compiler: below).
  swig
  golang-go
  openjdk-17-jdk-headless
  default-jdk-headless
  junit5
  # Maven and the plugins its default build uses, from Debian (/usr/share/maven-repo): the install
  # test builds a Maven project outside the repository against the installed binding, offline.
  maven
  libmaven-compiler-plugin-java
  libmaven-jar-plugin-java
  libmaven-resources-plugin-java
  libsurefire-java
  bindgen
  # Python (bindings/python): headers for the extension, NumPy, torch (CPU) and pytest for its tests.
  python3-dev
  python3-numpy
  python3-pytest
  python3-torch
  # The ABI gate (tests/abi/check_abi.sh): abidw / abidiff.
  abigail-tools
  # Packages (scripts/package.sh, tests/packaging): Debian's and RPM's tools, their linters, the
  # signing key's gpg and debootstrap for the clean-root install test.
  debhelper
  lintian
  rpm
  rpmlint
  gpg
  debootstrap
)

force=0 job=test
while [[ $# -gt 0 ]]; do
  case "$1" in
    --force) force=1; shift ;;
    --for)
      [[ $# -ge 2 && ( $2 == demo || $2 == test ) ]] || { echo "$0: --for needs demo or test" >&2; exit 2; }
      job=$2; shift 2 ;;
    -h|--help)
      echo "usage: $0 [--for demo|test] [--force]"
      echo "  demo installs: ${DEMO_PACKAGES[*]}"
      echo "  test installs those and: ${TEST_PACKAGES[*]} (and cargo rustc without a Rust toolchain)"
      exit 0 ;;
    *) echo "$0: unknown argument '$1'" >&2; exit 2 ;;
  esac
done

PACKAGES=("${DEMO_PACKAGES[@]}")
if [[ $job == test ]]; then
  PACKAGES+=("${TEST_PACKAGES[@]}")
  # Rust: a toolchain already on PATH (or rustup's in ~/.cargo/bin) is used as it is; otherwise
  # Debian's (rustc 1.63, the bindings' minimum).
  if ! command -v cargo >/dev/null 2>&1 && [[ ! -x "$HOME/.cargo/bin/cargo" ]]; then
    PACKAGES+=(cargo rustc)
  fi
fi

missing=()
for pkg in "${PACKAGES[@]}"; do
  status=$(dpkg-query -W -f='${db:Status-Status}' "$pkg" 2>/dev/null || true)
  if [[ "$status" != "installed" ]]; then
    missing+=("$pkg")
  fi
done

if [[ $force -eq 0 && ${#missing[@]} -eq 0 ]]; then
  echo "setup-deps: all ${#PACKAGES[@]} packages for the $job already installed"
  exit 0
fi

if [[ $(id -u) -eq 0 ]]; then
  SUDO=()
elif command -v sudo >/dev/null 2>&1; then
  SUDO=(sudo)
else
  echo "setup-deps: not root and sudo is not available; missing: ${missing[*]}" >&2
  exit 1
fi

export DEBIAN_FRONTEND=noninteractive
if [[ $force -eq 1 ]]; then
  echo "setup-deps: --force: installing ${PACKAGES[*]}"
else
  echo "setup-deps: missing: ${missing[*]}"
fi
"${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update
"${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${PACKAGES[@]}"
