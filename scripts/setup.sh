#!/usr/bin/env bash
# Installs what building bsattn needs on Debian 12 (apt packages, the pinned CUTLASS headers)
# and puts nvcc on PATH. Idempotent and quick when everything is present. Source it to keep
# the PATH change (./bsattn and scripts/test do); running it directly also works.

bsattn_setup() {
  local packages=(nlohmann-json3-dev libgtest-dev libbenchmark-dev ninja-build cmake g++)
  local missing=() p
  for p in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if ((${#missing[@]})); then
    local sudo=()
    [ "$(id -u)" -eq 0 ] || sudo=(sudo)
    echo "setup: installing ${missing[*]}" >&2
    "${sudo[@]}" apt-get update -qq &&
      DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq "${missing[@]}" >/dev/null || return 1
  fi

  if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
    export PATH="/usr/local/cuda/bin:$PATH"
  fi

  # CUTLASS / CuTe headers for the GPU code, from the pinned PyPI package (never vendored).
  # BSATTN_SETUP_CUDA=0: a CPU-only build (./bsattn on a machine without a GPU) needs none.
  if [ "${BSATTN_SETUP_CUDA:-1}" != 0 ] && command -v nvcc >/dev/null 2>&1; then
    local want=4.2.0.0 have
    have=$(python3 -c "import importlib.metadata as m; print(m.version('nvidia-cutlass'))" 2>/dev/null || true)
    if [ "$have" != "$want" ]; then
      echo "setup: pip install nvidia-cutlass==$want" >&2
      # Debian's system Python refuses global installs (PEP 668): fall back to the user site.
      python3 -m pip install -q "nvidia-cutlass==$want" 2>/dev/null ||
        python3 -m pip install -q --user --break-system-packages "nvidia-cutlass==$want" || return 1
    fi
  fi
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  set -euo pipefail
  bsattn_setup
else
  bsattn_setup || return 1
fi
