#!/usr/bin/env python3
"""The fixed cost of a one-sequence decode step (issue 12's B = 1 targets): B = 1, one query,
Hq 32 / Hkv 8, D 128, bf16, KV blocks of 128, at L = 8192 and 131072, with no sparsity (dense)
and with block lists keeping k = 0, 1, 4, 16 or all blocks per KV head (the first k blocks). The
k = 0 row reads no K/V at all: its time is what a step costs before any byte of the cache.
bsattn's normal Plan through the shim (bsattn_bench_plan_kv_lists / run_kv_lists); GPU time of
one step by CUDA events with the queue filled 1 ms ahead (benchlib.timed), median of 30; at
L = 8192 the inputs rotate over 8 copies (the 34 MB of a step would otherwise stay in L2).
BSATTN_GPU_DECODE_SPLITS=N (read once by the library) forces the splits;
BSATTN_GPU_DECODE_CLUSTER=0 merges the splits through the workspace rather than in clusters.
A second argument lists the lengths (default 8192,131072; below 16384 the inputs rotate), a third
the KV block size (default 128; the sparse rows keep that many blocks of it).

  python3 bench/gpu/bench_decode_fixed.py build-gpu/bench/gpu/libbsattn_bench.so [2048,4096,8192] [64]
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402

LIB = benchlib.load(sys.argv[1], need=("bsattn_bench_plan_kv_lists", "bsattn_bench_run_kv_lists"))
HQ, HKV, D = 32, 8, 128
BK = int(sys.argv[3]) if len(sys.argv) > 3 else 128
LENGTHS = [int(x) for x in (sys.argv[2] if len(sys.argv) > 2 else "8192,131072").split(",")]
for L in LENGTHS:
    nkb = L // BK
    sets = [(torch.randn(1, 1, HQ, D, dtype=torch.bfloat16, device="cuda"),
             torch.randn(1, L, HKV, D, dtype=torch.bfloat16, device="cuda"),
             torch.randn(1, L, HKV, D, dtype=torch.bfloat16, device="cuda")) for _ in range(8 if L < 16384 else 1)]
    for k in (None, 0, 1, 4, 16, nkb):
        sparse = k is not None
        plan = benchlib.Plan(LIB, LIB.bsattn_bench_plan_kv_lists(1, 1, L, HQ, HKV, D, 0, 0, 0, 0, int(sparse), BK, 1, HKV))
        cnt = torch.full((1, HKV, 1), k or 0, dtype=torch.int32, device="cuda") if sparse else None
        idx = torch.arange(nkb, dtype=torch.int32, device="cuda").repeat(1, HKV, 1, 1).contiguous() if sparse else None
        s = benchlib.stream()
        calls = []
        for q, kk, vv in sets:
            out = torch.empty_like(q)
            a = [benchlib.ptr(t) for t in (q, kk, vv, None, None, cnt, idx, out)]
            calls.append(lambda a=a: benchlib.ok(LIB, LIB.bsattn_bench_run_kv_lists(plan.h, *a, None, s)))
        calls[0]()
        plan.check()
        ms = benchlib.timed(calls, 30, queue_us=1000)
        kept = nkb if k is None else k
        print(f"L={L} block={BK} kept={'dense' if k is None else k} splits_env={os.environ.get('BSATTN_GPU_DECODE_SPLITS', '-')} "
              f"cluster_env={os.environ.get('BSATTN_GPU_DECODE_CLUSTER', '-')}: "
              f"{ms * 1e3:.1f} us, {2 * kept * BK * HKV * D * 2 / ms / 1e9:.2f} TB/s", flush=True)
