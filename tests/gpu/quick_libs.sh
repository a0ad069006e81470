#!/usr/bin/env bash
# Quick benchmark libraries of git revisions, built on the development machine for
# device_session.sh's STEP=ab / bwd-ab (bf16, D 128 kernels only, target bsattn_bench: about 6
# minutes each on 2 cores, 56 MB, 5 MB xz-compressed). Each revision is checked out in a worktree
# of its own (removed afterwards) and built in BUILD_ROOT/NAME; the library goes to DIR/NAME.so.xz
# (DIR defaults to .device/libs, an ignored folder a device call can carry). HEAD_DIMS (default 128)
# widens it, e.g. HEAD_DIMS="64;128;256" for STEP=peers's D 64 and D 256 rows (PEER_LIB).
#   tests/gpu/quick_libs.sh base=HEAD~1 v1=HEAD      then carry .device and run
#   STEP=ab LIBS=".device/libs/base.so.xz .device/libs/v1.so.xz" ONLY=... bash tests/gpu/device_session.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
DIR=${DIR:-.device/libs}
BUILD_ROOT=${BUILD_ROOT:-/tmp/bsattn-quick}
JOBS=${JOBS:-$(nproc)}
[ $# -gt 0 ] || { sed -n '2,8p' "$0"; exit 2; }
mkdir -p "$DIR" "$BUILD_ROOT"
for spec in "$@"; do
  name=${spec%%=*}
  rev=${spec#*=}
  [ -n "$name" ] && [ "$name" != "$spec" ] || { echo "expected NAME=REV, got '$spec'" >&2; exit 2; }
  commit=$(git rev-parse --verify "$rev^{commit}")
  tree=$BUILD_ROOT/$name.src
  git worktree remove --force "$tree" 2>/dev/null || true
  git worktree add --detach -q "$tree" "$commit"
  echo "[$(date +%H:%M:%S)] $name = $(git log --oneline -1 "$commit")"
  cmake -S "$tree" -B "$BUILD_ROOT/$name" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBSATTN_ENABLE_CUDA=ON \
    -DBSATTN_BUILD_TOOLS=OFF -DBSATTN_GPU_DTYPES=bf16 -DBSATTN_GPU_HEAD_DIMS="${HEAD_DIMS:-128}" > "$BUILD_ROOT/$name.log" 2>&1
  cmake --build "$BUILD_ROOT/$name" -j "$JOBS" --target bsattn_bench >> "$BUILD_ROOT/$name.log" 2>&1 ||
    { grep -E "error" "$BUILD_ROOT/$name.log" | head -20; exit 1; }
  # ptxas serialising wgmma (C7510-C7515: e.g. a register operand of a wgmma in flight written by
  # another instruction) makes a kernel about half as fast and is only an info line: refuse it.
  if grep -q "C751[0-9]" "$BUILD_ROOT/$name.log"; then
    grep "C751[0-9]" "$BUILD_ROOT/$name.log" | sed 's/Potential Performance Loss: //' | (c++filt 2>/dev/null || cat) | cut -c1-400 | sort | uniq -c >&2
    echo "$name: ptxas serialised wgmma (above); no library written" >&2
    exit 1
  fi
  xz -6 -T0 -c "$BUILD_ROOT/$name/bench/gpu/libbsattn_bench.so" > "$DIR/$name.so.xz"
  git worktree remove --force "$tree"
  echo "[$(date +%H:%M:%S)] $DIR/$name.so.xz"
done
