#!/usr/bin/env bash
# Installs the Debian packages SmartGen's build and tests need. Idempotent: when every package is
# already installed (checked with dpkg-query) it does nothing, unless --force is given.
#
# Usage: scripts/setup-deps.sh [--force]
set -euo pipefail

PACKAGES=(
  cmake
  ninja-build
  g++
  gcc
  pkg-config
  libfabric-dev
  libfabric-bin
  libmimalloc-dev
  libgtest-dev
  googletest
  libssl-dev
  libcurl4-openssl-dev
  etcd-server
  iproute2
  jq
  nlohmann-json3-dev
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
  bindgen
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

# Rust: a toolchain already on PATH (or rustup's in ~/.cargo/bin) is used as it is; otherwise
# Debian's (rustc 1.63, the bindings' minimum).
if ! command -v cargo >/dev/null 2>&1 && [[ ! -x "$HOME/.cargo/bin/cargo" ]]; then
  PACKAGES+=(cargo rustc)
fi

force=0
for arg in "$@"; do
  case "$arg" in
    --force) force=1 ;;
    -h|--help)
      echo "usage: $0 [--force]   (installs: ${PACKAGES[*]})"
      exit 0 ;;
    *) echo "$0: unknown argument '$arg'" >&2; exit 2 ;;
  esac
done

missing=()
for pkg in "${PACKAGES[@]}"; do
  status=$(dpkg-query -W -f='${db:Status-Status}' "$pkg" 2>/dev/null || true)
  if [[ "$status" != "installed" ]]; then
    missing+=("$pkg")
  fi
done

if [[ $force -eq 0 && ${#missing[@]} -eq 0 ]]; then
  echo "setup-deps: all ${#PACKAGES[@]} packages already installed"
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
