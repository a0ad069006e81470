#!/usr/bin/env bash
# The Python package test (ctest: python_package). In a venv under WORK_DIR (default
# build/python-test): installs the pinned build requirements of pyproject.toml, `pip install`s the
# repository with its test and bf16 extras (scikit-build-core builds the extension, CPU engine
# only, incrementally in WORK_DIR/build), then runs pytest on tests/python. Needs python3 >= 3.11
# with venv and network access to PyPI; on Debian it installs python3-venv when that is missing.
#
# BSATTN_PY_SANITIZE=address builds the extension with -DBSATTN_SANITIZE=address and runs pytest
# with the sanitizer runtimes preloaded (scripts/test-sanitizers; leak checks off: the interpreter
# keeps its allocations to the end).
#
# usage: tests/python/run.sh [WORK_DIR] [pytest arguments...]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
work=$(mkdir -p "${1:-$root/build/python-test}" && cd "${1:-$root/build/python-test}" && pwd)
shift $(($# > 0 ? 1 : 0))
python=${PYTHON:-python3}

venv="$work/venv"
if [ ! -x "$venv/bin/python" ]; then
  if ! "$python" -m venv "$venv" >/dev/null 2>&1; then
    # Debian ships venv/ensurepip in a separate package.
    rm -rf "$venv"
    if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
      echo "python_package: installing python3-venv" >&2
      apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null
    fi
    "$python" -m venv "$venv"
  fi
fi

requires=$("$venv/bin/python" - "$root/pyproject.toml" <<'PY'
import sys
import tomllib

with open(sys.argv[1], "rb") as f:
    print("\n".join(tomllib.load(f)["build-system"]["requires"]))
PY
)
mapfile -t requires <<<"$requires"
"$venv/bin/python" -m pip install -q --disable-pip-version-check "${requires[@]}"

# The wheel build: no CUDA (fast, and this machine may have nvcc without a GPU), two jobs.
cmake_args=()
preload=()
case "${BSATTN_PY_SANITIZE:-}" in
  "") ;;
  address)
    cmake_args=(-C "cmake.define.BSATTN_SANITIZE=address")
    preload=(env LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libubsan.so)"
             ASAN_OPTIONS="detect_leaks=0:abort_on_error=1" UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1")
    ;;
  *) echo "python_package: BSATTN_PY_SANITIZE='$BSATTN_PY_SANITIZE' is not address" >&2; exit 1 ;;
esac
BSATTN_ENABLE_CUDA=OFF CMAKE_BUILD_PARALLEL_LEVEL=2 "$venv/bin/python" -m pip install -q --disable-pip-version-check \
  --no-build-isolation -C build-dir="$work/build" "${cmake_args[@]}" "$root[test,bf16]"

cd "$root"
exec "${preload[@]}" "$venv/bin/python" -m pytest -p no:cacheprovider -q tests/python "$@"
