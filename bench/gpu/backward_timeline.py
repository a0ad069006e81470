#!/usr/bin/env python3
"""Where a backward step's cycles go: the backward kernel of a timeline build (CMake
-DBSATTN_GPU_TIMELINE=ON, src/gpu/fwd/timeline.cuh) records clock64 at twelve points of each of the
first 64 steps of its first 256 CTAs, per consumer warp (its first lane): stage landed, setup done,
S issued, dP issued, S done, dV issued, dP done, dS stored, step barrier passed, dQ done, dQ handed
to its reduction, dK / dV done. This prints, per shape, the step period and, for each warp, the
median cycles from the step's start (the first warp past its stage wait) to each event over the
steady steps (the third on). bf16, S 16384, Hq 32 / Hkv 8, D 128, blocks of 128.

  python3 bench/gpu/backward_timeline.py build-tl/bench/gpu/libbsattn_bench.so [causal|rand0.25|...]
"""
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402

# timeline.cuh: kTimelineSlots, kTimelineCtas, kTimelineTiles, then the backward region.
SLOTS, MAX_CTAS, TILES = 16, 1024, 64
BWD_CTAS, BWD_STEPS = 256, 64
EVENTS = ("stage landed", "setup done", "S issued", "dP issued", "S done", "dV issued", "dP done", "dS stored", "step barrier",
          "dQ done", "dQ handed", "dK, dV done")
OFFSET = 2 * MAX_CTAS * SLOTS * 2 + MAX_CTAS * TILES * 3
buffer = torch.zeros(OFFSET + BWD_CTAS * 8 * BWD_STEPS * len(EVENTS), dtype=torch.int64, device="cuda")
os.environ["BSATTN_GPU_TIMELINE_BUFFER"] = str(buffer.data_ptr())  # read at the first launch
LIB = benchlib.load(sys.argv[1], need=("bsattn_bench_plan", "bsattn_bench_run_backward"))
HQ, HKV, D, BLOCK, S = 32, 8, 128, 128, 16384


def pattern(density, gen):
    """Block lists [1, Hkv, nQB] / [1, Hkv, nQB, nKB]: round(density * nKB) random blocks per row."""
    n = S // BLOCK
    keep = max(1, round(density * n))
    chosen = torch.rand(HKV, n, n, generator=gen, device="cuda").argsort(-1)[..., :keep].sort(-1).values
    idx = torch.zeros(1, HKV, n, n, dtype=torch.int32, device="cuda")
    idx[0, :, :, :keep] = chosen.to(torch.int32)
    return torch.full((1, HKV, n), keep, dtype=torch.int32, device="cuda"), idx


def run(shape):
    gen = torch.Generator(device="cuda").manual_seed(1)
    q, dout = (torch.randn(1, S, HQ, D, dtype=torch.bfloat16, device="cuda", generator=gen) for _ in range(2))
    k, v = (torch.randn(1, S, HKV, D, dtype=torch.bfloat16, device="cuda", generator=gen) for _ in range(2))
    causal = shape == "causal"
    cnt = idx = None
    if not causal:
        cnt, idx = pattern(float(shape.removeprefix("rand")), gen)
    plan = benchlib.Plan(LIB, LIB.bsattn_bench_plan(1, S, HQ, HKV, D, 0, BLOCK, BLOCK, 0 if causal else 1,
                                                    1 if causal else HKV, int(causal), -1))
    benchlib.ok(LIB, LIB.bsattn_bench_set_backward(plan.h, 0))
    p = benchlib.ptr
    out, lse = torch.empty_like(q), torch.empty(1, HQ, S, device="cuda")
    benchlib.ok(LIB, LIB.bsattn_bench_run(plan.h, p(q), p(k), p(v), p(out), p(lse), p(cnt), p(idx), benchlib.stream()))
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    args = [p(t) for t in (q, k, v, cnt, idx, out, lse, dout, dq, dk, dv)]
    for _ in range(3):  # warm; the last run's marks stay
        buffer.zero_()
        benchlib.ok(LIB, LIB.bsattn_bench_run_backward(plan.h, *args, benchlib.stream()))
    torch.cuda.synchronize()
    plan.check()
    t = buffer[OFFSET:].view(BWD_CTAS, 2, 4, BWD_STEPS, len(EVENTS)).cpu().long()
    report(shape, t)


def report(shape, t):
    """t: [cta, warpgroup, warp, step, event] clock64. Per steady step (the third on, CTAs with 8+
    steps), each warp's events relative to the step's start (the first warp whose stage landed):
    the median over steps, one column per warp; and the step period."""
    rel = [[[] for _ in range(8)] for _ in EVENTS]
    periods = []
    for cta in range(BWD_CTAS):
        rows = t[cta].reshape(8, BWD_STEPS, len(EVENTS))
        steps = int((rows[:, :, 0] > 0).all(0).sum())
        if steps < 8:
            continue
        for i in range(2, steps - 1):
            step, nxt = rows[:, i], rows[:, i + 1]
            if (step <= 0).any():
                continue
            t0 = int(step[:, 0].min())
            periods.append(int(nxt[:, 0].min()) - t0)
            for e in range(len(EVENTS)):
                for w in range(8):
                    rel[e][w].append(int(step[w, e]) - t0)
    if not periods:
        print(f"\n{shape}: no steady steps recorded")
        return
    period = statistics.median(periods)
    print(f"\n{shape}: step period {period:.0f} cycles (median of {len(periods)} steady steps); median cycles"
          " from the step's start to each event, per consumer warp (warpgroup.warp)")
    print(f"  {'event':>13s}" + "".join(f"{f'{w // 4}.{w % 4}':>7s}" for w in range(8)))
    for e, name in enumerate(EVENTS):
        print(f"  {name:>13s}" + "".join(f"{statistics.median(rel[e][w]):7.0f}" for w in range(8)))


for shape in sys.argv[2:] or ["causal", "rand0.25"]:
    run(shape)
