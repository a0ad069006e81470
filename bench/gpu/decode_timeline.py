#!/usr/bin/env python3
"""Where a one-sequence decode step's time goes, per CTA: the forward kernel and route preparation
of a timeline build (CMake -DBSATTN_GPU_TIMELINE=ON, src/gpu/fwd/timeline.cuh) write %globaltimer
at a few points (each CTA's first tile; each preparation block); this prints, per event, the
median / min / max over the CTAs of its time after route preparation's first block started (us). B = 1, one query, Hq 32 / Hkv 8, D 128, bf16, KV blocks
of 128, dense or block lists keeping k blocks per KV head (bench_decode_fixed.py's rows). The step
is run back to back (no queue ahead), the last one's marks are read.

  python3 bench/gpu/decode_timeline.py build-timeline/bench/gpu/libbsattn_bench.so
"""
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402

EVENTS = ["entry", "barriers ready", "dependency met", "tile decoded", "Q issued", "loader has tile",
          "loader issued", "consumer has tile", "consumer has Q", "first S GEMM", "loop done", "stored",
          "split arrived", "split merged", "consumer exit"]
PREPARE = ["prepare entry", "prepare row open", "prepare counted", "prepare written", "overflow published"]
SLOTS, MAX_CTAS, TILES = 16, 1024, 64  # timeline.cuh: kTimelineSlots, kTimelineCtas, kTimelineTiles
buffer = torch.zeros(2 * MAX_CTAS * SLOTS * 2 + MAX_CTAS * TILES * 3, dtype=torch.int64, device="cuda")
os.environ["BSATTN_GPU_TIMELINE_BUFFER"] = str(buffer.data_ptr())  # read at the first launch
LIB = benchlib.load(sys.argv[1], need=("bsattn_bench_plan_kv_lists", "bsattn_bench_run_kv_lists"))
HQ, HKV, D, BK = 32, 8, 128, 128

for L, k in ((8192, None), (8192, 0), (8192, 4), (131072, None)):
    nkb = L // BK
    sparse = k is not None
    q = torch.randn(1, 1, HQ, D, dtype=torch.bfloat16, device="cuda")
    kk = torch.randn(1, L, HKV, D, dtype=torch.bfloat16, device="cuda")
    vv = torch.randn(1, L, HKV, D, dtype=torch.bfloat16, device="cuda")
    plan = benchlib.Plan(LIB, LIB.bsattn_bench_plan_kv_lists(1, 1, L, HQ, HKV, D, 0, 0, 0, 0, int(sparse), BK, 1, HKV))
    cnt = torch.full((1, HKV, 1), k or 0, dtype=torch.int32, device="cuda") if sparse else None
    idx = torch.arange(nkb, dtype=torch.int32, device="cuda").repeat(1, HKV, 1, 1).contiguous() if sparse else None
    out = torch.empty_like(q)
    s = benchlib.stream()
    a = [benchlib.ptr(t) for t in (q, kk, vv, None, None, cnt, idx, out)]
    for _ in range(20):
        benchlib.ok(LIB, LIB.bsattn_bench_run_kv_lists(plan.h, *a, None, s))
    torch.cuda.synchronize()
    buffer.zero_()
    for _ in range(5):
        benchlib.ok(LIB, LIB.bsattn_bench_run_kv_lists(plan.h, *a, None, s))
    torch.cuda.synchronize()
    plan.check()
    t = buffer[:2 * MAX_CTAS * SLOTS * 2].view(2, MAX_CTAS, SLOTS, 2)[:, :, :, 0].cpu().tolist()
    ctas = [row for row in t[0] if row[0] != 0]
    blocks = [row for row in t[1] if row[0] != 0]
    start = min(row[0] for row in blocks + ctas)
    end = max(max(row) for row in ctas)
    print(f"L={L} kept={'dense' if k is None else k}: {len(blocks)} preparation blocks, {len(ctas)} CTAs, "
          f"first mark to last {(end - start) / 1e3:.1f} us")
    # A slot keeps an earlier step's time when this step did not mark it (the merging split
    # differs from step to step): only marks of this step (after its first) are counted.
    for rows, names in ((blocks, PREPARE), (ctas, EVENTS)):
        for e, name in enumerate(names):
            v = [(row[e] - start) / 1e3 for row in rows if row[e] >= start]
            if v:
                print(f"  {name:18s} median {statistics.median(v):6.2f}  min {min(v):6.2f}  max {max(v):6.2f}  ({len(v)})")
    sys.stdout.flush()
