#!/usr/bin/env python3
"""Where a backward step's cycles go: the backward kernel of a timeline build (CMake
-DBSATTN_GPU_TIMELINE=ON, src/gpu/fwd/timeline.cuh) records clock64 at ten points of each of the
first 64 steps of its first 256 CTAs, per consumer warpgroup (its first thread): stage landed, S and
dP issued, S done, dV issued, dP done, dS stored, step barrier passed, dQ done, dQ handed to its
reduction, dK / dV done. This prints, per shape, the step period and the median cycles from each
point to the next over the steady steps (from the third step on), for each warpgroup, and the
share of the step each phase takes. bf16, S 16384, Hq 32 / Hkv 8, D 128, blocks of 128.

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
EVENTS = ("stage landed", "S, dP issued", "S done", "dV issued", "dP done", "dS stored", "step barrier",
          "dQ done", "dQ handed", "dK, dV done")
OFFSET = 2 * MAX_CTAS * SLOTS * 2 + MAX_CTAS * TILES * 3
buffer = torch.zeros(OFFSET + BWD_CTAS * 2 * BWD_STEPS * len(EVENTS), dtype=torch.int64, device="cuda")
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
    t = buffer[OFFSET:].view(BWD_CTAS, 2, BWD_STEPS, len(EVENTS)).cpu().long()
    report(shape, t)


def report(shape, t):
    print(f"\n{shape}: per step, median cycles (steady steps 2-62 of CTAs with 8+ steps; clock64 of each"
          " consumer warpgroup's first thread)")
    for wg in range(2):
        periods, phases = [], [[] for _ in EVENTS]
        for cta in range(BWD_CTAS):
            rows = t[cta, wg]
            steps = int((rows[:, 0] > 0).sum())
            if steps < 8:
                continue
            for i in range(2, steps - 1):
                r, nxt = rows[i], rows[i + 1]
                if (r <= 0).any():
                    continue
                periods.append(int(nxt[0] - r[0]))
                for e in range(len(EVENTS)):
                    end = nxt[0] if e + 1 == len(EVENTS) else r[e + 1]
                    phases[e].append(int(end - r[e]))
        if not periods:
            print(f"  warpgroup {wg}: no steady steps recorded")
            continue
        period = statistics.median(periods)
        print(f"  warpgroup {wg}: step period {period:.0f} cycles ({len(periods)} steps)")
        for e, name in enumerate(EVENTS):
            m = statistics.median(phases[e])
            nxt = EVENTS[(e + 1) % len(EVENTS)] + (" (next step)" if e + 1 == len(EVENTS) else "")
            print(f"    {name:>13s} -> {nxt:<26s} {m:7.0f}  {100 * m / period:5.1f} %")


for shape in sys.argv[2:] or ["causal", "rand0.25"]:
    run(shape)
