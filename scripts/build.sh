# Sourced by ./bsattn and scripts/test: configures a build directory (Release, Ninja) when it has
# not been, then lets ninja bring the given targets up to date.
# usage: bsattn_build [--quiet] [target...]   (no target: everything)
# Env: BSATTN_BUILD_DIR (default build/ in the checkout), BSATTN_CMAKE_ARGS (extra configure
# arguments, used when the directory is first configured).

bsattn_build() {
  local quiet=0
  if [ "${1:-}" = "--quiet" ]; then
    quiet=1
    shift
  fi
  local root build log
  root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
  build="${BSATTN_BUILD_DIR:-$root/build}"
  log="$build/build.log"
  mkdir -p "$build"
  if [ ! -f "$build/build.ninja" ]; then
    local extra=()
    read -r -a extra <<<"${BSATTN_CMAKE_ARGS:-}"
    cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
      -DPython3_EXECUTABLE="$(command -v python3)" "${extra[@]}" >"$log" 2>&1 || {
      cat "$log" >&2
      return 1
    }
  fi
  local targets=()
  [ $# -gt 0 ] && targets=(--target "$@")
  if ((quiet)); then
    if ! cmake --build "$build" "${targets[@]}" -- -n 2>/dev/null | grep -q "no work to do"; then
      echo "bsattn: building in ${build#"$root"/}/ (the first time takes a minute or more; log: ${build#"$root"/}/build.log)" >&2
    fi
    cmake --build "$build" "${targets[@]}" >"$log" 2>&1 || {
      cat "$log" >&2
      return 1
    }
  else
    cmake --build "$build" "${targets[@]}"
  fi
}
