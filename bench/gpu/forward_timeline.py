#!/usr/bin/env python3
"""Where a prefill kernel's time goes across its CTAs: the forward kernel of a timeline build
(CMake -DBSATTN_GPU_TIMELINE=ON, src/gpu/fwd/timeline.cuh) records %globaltimer at the start and
end of each CTA's first 64 tiles (with the tile's work item and route count). This prints, per
shape, the kernel's span, how the CTAs' busy spans end (median, last: the tail), the gaps between
a CTA's tiles, and the time per route of short and long tiles. bf16, Hq 32 / Hkv 8, D 128.

  python3 bench/gpu/forward_timeline.py build-tl/bench/gpu/libbsattn_bench.so [causal|rand0.1|window|docs|...]
"""
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402

SLOTS, MAX_CTAS, TILES = 16, 1024, 64  # timeline.cuh: kTimelineSlots, kTimelineCtas, kTimelineTiles
buffer = torch.zeros(2 * MAX_CTAS * SLOTS * 2 + MAX_CTAS * TILES * 3, dtype=torch.int64, device="cuda")
os.environ["BSATTN_GPU_TIMELINE_BUFFER"] = str(buffer.data_ptr())  # read at the first launch
LIB = benchlib.load(sys.argv[1], need=("bsattn_bench_plan", "bsattn_bench_run"))
HQ, HKV, D, BLOCK = 32, 8, 128, 128
# name: (batch, seqlen, causal, density or None, window_left or -1, pattern heads). "window" and
# "rand0.13" have the same routes per tile (33 against about 33), masked (two per tile) or not.
# Patterns per query head run the single-CTA kernel, one pattern for all heads the CTA pairs.
SHAPES = {"causal": (1, 32768, True, None, -1, 1), "rand0.1": (1, 32768, False, 0.1, -1, HQ),
          "rand0.5": (1, 32768, False, 0.5, -1, HQ), "causal8k": (4, 8192, True, None, -1, 1),
          "window": (1, 32768, True, None, 4095, 1), "rand0.13": (1, 32768, False, 0.13, -1, HQ),
          "rand0.1-shared": (1, 32768, False, 0.1, -1, 1), "rand0.5-shared": (1, 32768, False, 0.5, -1, 1),
          "docs": None}
# "docs": issue 14's 16 packed documents (bench_forward.py's DOCS), causal within each, varlen.
DOCS = (6000, 1, 3517, 5120, 129, 4096, 777, 2048, 5999, 64, 1500, 300, 1023, 1300, 17, 889)


def lists(heads, seqlen, density, gen):
    nb = seqlen // BLOCK
    keep = torch.rand(1, heads, nb, nb, generator=gen, device="cuda") < density
    counts = keep.sum(-1).to(torch.int32)
    order = torch.argsort((~keep).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return counts.contiguous(), order.contiguous()


def prepared_run(name):
    """The shape's plan and a function that runs it once on the timeline stream."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    s = benchlib.stream()
    if name == "docs":
        total = sum(DOCS)
        q = torch.randn(total, HQ, D, dtype=torch.bfloat16, device="cuda", generator=gen)
        k = torch.randn(total, HKV, D, dtype=torch.bfloat16, device="cuda", generator=gen)
        v = torch.randn(total, HKV, D, dtype=torch.bfloat16, device="cuda", generator=gen)
        out, lse = torch.empty_like(q), torch.empty(HQ, total, device="cuda")
        cu = torch.tensor((0,) + DOCS, device="cuda").cumsum(0).to(torch.int32)
        plan = benchlib.Plan(LIB, LIB.bsattn_bench_plan_varlen(len(DOCS), max(DOCS), total, HQ, HKV, D, 0, BLOCK,
                                                               BLOCK, 1, -1))
        args = [benchlib.ptr(t) for t in (q, k, v, cu, out, lse)]
        return plan, lambda: benchlib.ok(LIB, LIB.bsattn_bench_run_varlen(plan.h, *args, s)), (q, k, v, out, lse, cu)
    batch, seqlen, causal, density, window_left, heads = SHAPES[name]
    q = torch.randn(batch, seqlen, HQ, D, dtype=torch.bfloat16, device="cuda", generator=gen)
    k = torch.randn(batch, seqlen, HKV, D, dtype=torch.bfloat16, device="cuda", generator=gen)
    v = torch.randn(batch, seqlen, HKV, D, dtype=torch.bfloat16, device="cuda", generator=gen)
    out = torch.empty_like(q)
    cnt, idx = lists(heads, seqlen, density, gen) if density else (None, None)
    plan = benchlib.Plan(LIB, LIB.bsattn_bench_plan(batch, seqlen, HQ, HKV, D, 0, BLOCK, BLOCK, 1 if density else 0,
                                                    heads, int(causal), window_left))
    args = [benchlib.ptr(t) for t in (q, k, v, out, None, cnt, idx)]
    return plan, lambda: benchlib.ok(LIB, LIB.bsattn_bench_run(plan.h, *args, s)), (q, k, v, out, cnt, idx)


for name in sys.argv[2:] or SHAPES:
    plan, run, keep_alive = prepared_run(name)
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    buffer.zero_()
    run()
    torch.cuda.synchronize()
    plan.check()
    tiles = buffer[2 * MAX_CTAS * SLOTS * 2:].view(MAX_CTAS, TILES, 3).cpu().tolist()
    ctas = [[t for t in row if t[0] and t[1]] for row in tiles]
    ctas = [row for row in ctas if row]
    start = min(t[0] for row in ctas for t in row)
    ends = sorted((row[-1][1] - start) / 1e3 for row in ctas)
    gaps = [(b[0] - a[1]) / 1e3 for row in ctas for a, b in zip(row, row[1:])]
    per_route = {}
    fit = []  # (routes, tile us): tile time = c + r x routes by least squares
    for row in ctas:
        for t in row:
            count = t[2] >> 32
            if count:
                per_route.setdefault(min(count // 8 * 8, 64), []).append((t[1] - t[0]) / 1e3 / count)
                fit.append((count, (t[1] - t[0]) / 1e3))
    print(f"{name}: {len(ctas)} CTAs, {sum(len(r) for r in ctas)} tiles recorded (first {TILES} per CTA); "
          f"CTA ends median {statistics.median(ends):.1f} us, last {ends[-1]:.1f} us (tail "
          f"{ends[-1] - statistics.median(ends):.1f}); gaps between tiles median "
          f"{statistics.median(gaps) if gaps else 0:.2f} us, max {max(gaps) if gaps else 0:.2f}")
    for bucket in sorted(per_route):
        vals = per_route[bucket]
        print(f"  tiles of {bucket}-{bucket + 7} routes: {len(vals)}, {statistics.median(vals):.3f} us per route")
    if len({n for n, _ in fit}) > 1:
        slope, intercept = statistics.linear_regression([n for n, _ in fit], [us for _, us in fit])
        print(f"  tile time = {intercept:.2f} us + {slope:.3f} us x routes (least squares over {len(fit)} tiles)")
    else:
        print(f"  every tile has {fit[0][0]} routes: {statistics.median(us for _, us in fit):.2f} us per tile (median)")
    sys.stdout.flush()
