#!/usr/bin/env bash
# Runs a command from the repository root as a clone with nothing beside it sees the world: in a
# private mount namespace whose view of the repository's parent folder holds the repository alone
# (an empty tmpfs over the parent, the repository bound back in under its own name). A path that
# leads outside the repository, such as a model read from a folder beside the clone, is then absent, so CI
# catches it instead of passing on what happens to lie beside its clone. Nothing outside the new
# namespace changes, and absolute paths into the repository (build trees) still resolve.
#
# Usage: scripts/isolated.sh COMMAND [ARGS...]
# Needs root (or CAP_SYS_ADMIN) and util-linux's unshare; refuses a repository at the root of the
# file system. Exit status: the command's; 2 when the view cannot be made.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)
parent=$(dirname "$root")
name=$(basename "$root")
if [[ $# -eq 0 ]]; then
  echo "usage: $0 COMMAND [ARGS...]" >&2
  exit 2
fi
if [[ $parent == / ]]; then
  echo "isolated.sh: the repository is at the root of the file system; there is nothing beside it to hide" >&2
  exit 2
fi
if ! command -v unshare >/dev/null || [[ $(id -u) -ne 0 ]]; then
  echo "isolated.sh: needs root and unshare (util-linux) to make a private mount namespace" >&2
  exit 2
fi

# Inside: an open descriptor keeps the repository reachable while the tmpfs hides its old path, and
# a bind mount of that descriptor (not canonicalized: its path now names the empty tmpfs) puts it
# back as the parent's only entry.
exec unshare --mount --propagation private -- bash -c '
  set -e
  exec 3<"$1"
  mount -t tmpfs -o size=1m,mode=755 smartgen-isolated "$2"
  mkdir "$2/$3"
  mount --no-canonicalize --bind /proc/self/fd/3 "$2/$3"
  exec 3<&-
  cd "$2/$3"
  shift 3
  echo "isolated.sh: $(pwd) has nothing beside it: $(ls -A ..)" >&2
  exec "$@"' isolated "$root" "$parent" "$name" "$@"
