# Sourced, not run: puts every CMake build that follows behind ccache (scripts/test.sh's phases,
# scripts/fuzz.sh, the package builds of scripts/package.sh, a developer's own configure).
#   ccache_env ROOT     exports the launcher and ccache's settings for a clone at ROOT
#   ccache_phase_start  zeroes the statistics (call at the start of a phase)
#   ccache_phase_report prints "ccache: H hits of N compilations (P%)" for the phase
# The release, asan, tsan and fuzz trees compile the same sources with different flags, and a fresh
# clone recompiles everything: with the cache, a machine that ran the suite once compiles only what
# changed. base_dir is the clone itself, so a clone in another folder hits the same entries (ccache
# rewrites the absolute paths under it to relative ones; hash_dir off keeps the build folder's path
# out of the hash, though it then stays in the debug info, where nothing reads it). The sloppiness
# lets a clone whose files are all seconds old use the direct mode, which otherwise distrusts headers
# modified just before the compilation. The size is bounded (SMARTGEN_CCACHE_MAXSIZE, default 6G:
# the five trees take about 2 GB); a CCACHE_DIR the caller set is used as it is.
# Without ccache on the machine nothing changes and the builds run uncached.

ccache_env() {
  local root=$1
  if ! command -v ccache >/dev/null 2>&1; then
    echo "ccache-env: ccache is not installed; building without a compiler cache" >&2
    return 0
  fi
  export CCACHE_DIR=${CCACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/smartgen-ccache}
  export CCACHE_BASEDIR=$root
  export CCACHE_NOHASHDIR=1
  export CCACHE_SLOPPINESS=include_file_mtime,include_file_ctime,time_macros,pch_defines,file_stat_matches
  export CCACHE_MAXSIZE=${SMARTGEN_CCACHE_MAXSIZE:-6G}
  export CMAKE_C_COMPILER_LAUNCHER=ccache
  export CMAKE_CXX_COMPILER_LAUNCHER=ccache
  export CMAKE_CUDA_COMPILER_LAUNCHER=ccache
  mkdir -p "$CCACHE_DIR"
  ccache --max-size "$CCACHE_MAXSIZE" >/dev/null
}

ccache_phase_start() {
  command -v ccache >/dev/null 2>&1 && [[ -n ${CCACHE_DIR:-} ]] && ccache --zero-stats >/dev/null || true
}

ccache_phase_report() {
  command -v ccache >/dev/null 2>&1 && [[ -n ${CCACHE_DIR:-} ]] || return 0
  # --print-stats: one "name<TAB>value" a line (ccache 4.x).
  ccache --print-stats 2>/dev/null | awk -F'\t' '
    $1 == "direct_cache_hit" || $1 == "preprocessed_cache_hit" { hits += $2 }
    $1 == "cache_miss" { misses += $2 }
    END {
      n = hits + misses
      if (n == 0) { print "ccache: no compilations"; exit }
      printf "ccache: %d hits of %d compilations (%.0f%%)\n", hits, n, 100 * hits / n
    }'
}
