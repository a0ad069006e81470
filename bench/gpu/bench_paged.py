#!/usr/bin/env python3
"""Paged KV against contiguous KV on the GPU (issue 12): the same K/V, once as [B, Skv, Hkv, D]
and once scattered over the pages of a cache [num_pages, page_size, Hkv, D] through a shuffled
block table, attended by bsattn's forward kernel (dense blocks, causal mask aligned bottom-right).
Decode shapes run through the same (prefill) kernel until the decode kernel exists. Every paged
result is first checked against the contiguous one. Timing (--timing):
  interleaved (the default): the four layouts of a shape (contiguous, pages of 16 / 64 / 256)
    take turns, after 1 s of back-to-back calls of all four: each of --rounds rounds times
    --iters calls of each layout back to back (benchlib.timed_back_to_back, the rotation's order
    shifted every round); a layout's time is the median over rounds of its round medians, and its
    ratio the median of its per-round ratios to the contiguous layout. Each layout settled in its
    own process (the method of the morning of 2026-12-06) moved the pages-of-64 ratio by up to 6 %
    between processes on one build (bench/RESULTS.md, 2026-12-06 19:3x): drift between the rows
    then enters the ratio.
  queued: each layout on its own, settled then timed back to back (benchlib.timed_settled).
  synced: each call queued behind --queue-us of GPU sleep and synced after (benchlib.timed, the
    method until 2026-12-06): the GPU idles between calls and its clocks start high.
bf16, Hq 32 / Hkv 8, D 128.

  python3 bench/gpu/bench_paged.py --lib build-gpu/bench/gpu/libbsattn_bench.so [--out paged.md] [--timing queued]
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import load, ok, page, Plan, ptr, stream, timed, timed_rotated, timed_settled  # noqa: E402

P = argparse.ArgumentParser()
P.add_argument("--lib", required=True)
P.add_argument("--iters", type=int, default=20, help="timed calls per layout (interleaved: per round)")
P.add_argument("--rounds", type=int, default=7, help="--timing interleaved: rounds of the four layouts")
P.add_argument("--out", default="")
P.add_argument("--timing", default="interleaved", choices=["interleaved", "queued", "synced"],
               help="interleaved: the layouts take turns, back to back; queued: each settled on its own; synced: "
                    "one call at a time")
P.add_argument("--queue-us", type=float, default=2000.0,
               help="--timing synced: GPU sleep queued before each timed call (0: none)")
ARGS = P.parse_args()

LIB = load(ARGS.lib, need=("bsattn_bench_plan_kv", "bsattn_bench_run_kv"))
HQ, HKV, D = 32, 8, 128


def layout(batch, sq, skv, page_size, q, k, v, out, gen):
    """The plan and call of one KV layout (page_size 0: contiguous), and its output."""
    if page_size > 0:
        kc, vc, table, lens, per_seq, num_pages = page(k, v, page_size, gen)
    else:
        kc, vc, table, lens, per_seq, num_pages = k, v, None, None, 0, 0
    plan = Plan(LIB, LIB.bsattn_bench_plan_kv(batch, sq, skv, HQ, HKV, D, 1, page_size, per_seq, num_pages))
    s = stream()

    def call():
        ok(LIB, LIB.bsattn_bench_run_kv(plan.h, ptr(q), ptr(kc), ptr(vc), ptr(table), ptr(lens), ptr(out), s))

    call()  # the plan and the caches live as long as the call (its closure)
    torch.cuda.synchronize()
    return call, out.clone()


def timed_layouts(calls):
    """ms per layout and each layout's ratio to the first (contiguous), by ARGS.timing."""
    if ARGS.timing != "interleaved":
        ms = [timed(c, ARGS.iters, queue_us=ARGS.queue_us) if ARGS.timing == "synced" else
              timed_settled(c, ARGS.iters) for c in calls]
        return ms, [m / ms[0] for m in ms]
    return timed_rotated(calls, ARGS.iters, ARGS.rounds)


def main():
    gen = torch.Generator().manual_seed(0)
    shapes = [("prefill B=1 S=8192 causal", 1, 8192, 8192), ("prefill B=1 S=8191 causal (a tail)", 1, 8191, 8191),
              ("chunked prefill B=4 Sq=2048 Skv=32768", 4, 2048, 32768),
              ("chunked prefill B=1 Sq=512 Skv=32768", 1, 512, 32768),
              ("decode B=32 Sq=1 Skv=32768 (prefill kernel)", 32, 1, 32768),
              ("decode B=32 Sq=4 Skv=8191 (prefill kernel)", 32, 4, 8191)]
    rows = ["| shape | KV layout | ms | effective TFLOP/s | K+V TB/s | paged / contiguous time | max abs diff vs contiguous |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, batch, sq, skv in shapes:
        torch.manual_seed(1)
        q = torch.randn(batch, sq, HQ, D, dtype=torch.bfloat16, device="cuda")
        k = torch.randn(batch, skv, HKV, D, dtype=torch.bfloat16, device="cuda")
        v = torch.randn(batch, skv, HKV, D, dtype=torch.bfloat16, device="cuda")
        pairs = batch * sum(min(skv, qi + skv - sq + 1) for qi in range(sq))
        flops = 4.0 * D * pairs * HQ
        kv_bytes = 2 * k.numel() * k.element_size()
        sizes = (0, 16, 64, 256)
        made = [layout(batch, sq, skv, ps, q, k, v, torch.empty_like(q), gen) for ps in sizes]
        base = made[0][1]
        ms, ratio = timed_layouts([m[0] for m in made])
        for j, ps in enumerate(sizes):
            if ps == 0:
                rows.append(f"| {name} | contiguous | {ms[0]:.3f} | {flops / ms[0] / 1e9:.0f} | "
                            f"{kv_bytes / ms[0] / 1e9:.2f} | 1.000 | — |")
            else:
                res = made[j][1]
                diff = (res.float() - base.float()).abs().max().item()
                good = diff <= 1e-2 and torch.isfinite(res).all().item()
                rows.append(f"| {name} | paged, pages of {ps} | {ms[j]:.3f} | {flops / ms[j] / 1e9:.0f} | "
                            f"{kv_bytes / ms[j] / 1e9:.2f} | {ratio[j]:.3f} | "
                            f"{diff:.1e}{'' if good else ' MISMATCH'} |")
            print(rows[-1], flush=True)
        del made
    if ARGS.out:
        with open(ARGS.out, "w") as f:
            f.write("\n".join(rows) + "\n")


main()
