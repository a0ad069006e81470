#!/usr/bin/env bash
# SASS of a built library or object file on the development machine, which has nvcc but neither
# a GPU nor cuobjdump / nvdisasm: both come from their PyPI wheels (nvidia-cuda-cuobjdump,
# nvidia-cuda-nvdisasm, pinned), unpacked once under ${BSATTN_SASS_TOOLS:-~/.cache/bsattn-sass}.
#   tests/gpu/sass_local.sh FILE                 per kernel: instructions, HGMMA, those that close a
#                                                wgmma group (gsb0: all of them where ptxas serialised
#                                                the wgmma, C751x), local loads / stores
#   tests/gpu/sass_local.sh FILE 'Traits<cutlass::bfloat16_t, 64, 2, 128'
#                                                the SASS of the kernels whose demangled name holds
#                                                the text
set -euo pipefail
file=${1:?usage: tests/gpu/sass_local.sh FILE [NAME_TEXT]}
tools=${BSATTN_SASS_TOOLS:-$HOME/.cache/bsattn-sass}
if [ ! -x "$tools/nvidia/cu13/bin/cuobjdump" ] || [ ! -x "$tools/nvidia/cu13/bin/nvdisasm" ]; then
  mkdir -p "$tools/wheels"
  python3 -m pip download -q --no-deps -d "$tools/wheels" nvidia-cuda-cuobjdump==13.5.37 \
    nvidia-cuda-nvdisasm==13.5.37 >&2
  for w in "$tools"/wheels/*.whl; do python3 -m zipfile -e "$w" "$tools"; done
  chmod +x "$tools"/nvidia/cu13/bin/*
fi
export PATH="$tools/nvidia/cu13/bin:$PATH"
cuobjdump -sass "$file" | python3 -c '
import re, subprocess, sys
want = sys.argv[1] if len(sys.argv) > 1 else None
parts = re.split(r"\n\s+Function : ", sys.stdin.read())[1:]
names = [p.split("\n", 1)[0].strip() for p in parts]
plain = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True).stdout.split("\n")
def report(name, body):
    code = re.findall(r"/\*[0-9a-f]{4,}\*/\s+([^;]*);", body)
    if want is not None:
        if want in name:
            print("Function :", name)
            print("\n".join(code))
        return
    hgmma = sum("HGMMA" in c for c in code)
    # A GEMM is a group of HGMMA of which the last carries gsb0; serialised, every one does.
    closing = sum("HGMMA" in c and "gsb0" in c for c in code)
    local = sum(bool(re.match(r"(@!?U?P\w+\s+)?(LDL|STL)", c)) for c in code)
    print(f"{len(code):6d} instructions  HGMMA {hgmma:4d}  closing a group {closing:4d}  LDL/STL {local:3d}  {name[:300]}")
try:
    for name, body in zip(plain, parts):
        report(name, body)
except BrokenPipeError:  # a reader that stopped early (| head)
    sys.stderr.close()
' ${2:+"$2"}
