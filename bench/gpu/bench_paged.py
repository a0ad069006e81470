#!/usr/bin/env python3
"""Paged KV against contiguous KV on the GPU (issue 12): the same K/V, once as [B, Skv, Hkv, D]
and once scattered over the pages of a cache [num_pages, page_size, Hkv, D] through a shuffled
block table, attended by bsattn's forward kernel (dense blocks, causal mask aligned bottom-right).
Decode shapes run through the same (prefill) kernel until the decode kernel exists. Every paged
result is first checked against the contiguous one; times are the median of >= 20 CUDA-event
timings. --timing queued (the default, as the forward and backward benchmarks since 2026-12-06):
after 1 s of back-to-back calls, the timed calls queued back to back behind a GPU sleep
(benchlib.timed_settled), so the clocks are those the 700 W limit settles to and the host's launch
path is outside the events. --timing synced: each call queued behind --queue-us of GPU sleep and
synced after (benchlib.timed, the method until 2026-12-06): the GPU idles between calls and its
clocks start high. bf16, Hq 32 / Hkv 8, D 128.

  python3 bench/gpu/bench_paged.py --lib build-gpu/bench/gpu/libbsattn_bench.so [--out paged.md] [--timing synced]
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import load, ok, page, Plan, ptr, stream, timed, timed_settled  # noqa: E402

P = argparse.ArgumentParser()
P.add_argument("--lib", required=True)
P.add_argument("--iters", type=int, default=20)
P.add_argument("--out", default="")
P.add_argument("--timing", default="queued", choices=["queued", "synced"],
               help="queued: settled, back to back (benchlib.timed_settled); synced: one call at a time")
P.add_argument("--queue-us", type=float, default=2000.0,
               help="--timing synced: GPU sleep queued before each timed call (0: none)")
ARGS = P.parse_args()

LIB = load(ARGS.lib, need=("bsattn_bench_plan_kv", "bsattn_bench_run_kv"))
HQ, HKV, D = 32, 8, 128


def run(batch, sq, skv, page_size, q, k, v, out, gen):
    paged = page_size > 0
    if paged:
        kc, vc, table, lens, per_seq, num_pages = page(k, v, page_size, gen)
    else:
        kc, vc, table, lens, per_seq, num_pages = k, v, None, None, 0, 0
    plan = Plan(LIB, LIB.bsattn_bench_plan_kv(batch, sq, skv, HQ, HKV, D, 1, page_size, per_seq, num_pages))
    s = stream()

    def call():
        ok(LIB, LIB.bsattn_bench_run_kv(plan.h, ptr(q), ptr(kc), ptr(vc), ptr(table), ptr(lens), ptr(out), s))

    call()
    torch.cuda.synchronize()
    result = out.clone()
    if ARGS.timing == "synced":
        ms = timed(call, ARGS.iters, queue_us=ARGS.queue_us)
    else:
        ms = timed_settled(call, ARGS.iters)
    return ms, result


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
        out = torch.empty_like(q)
        pairs = batch * sum(min(skv, qi + skv - sq + 1) for qi in range(sq))
        flops = 4.0 * D * pairs * HQ
        kv_bytes = 2 * k.numel() * k.element_size()
        base_ms, base = run(batch, sq, skv, 0, q, k, v, out, gen)
        rows.append(f"| {name} | contiguous | {base_ms:.3f} | {flops / base_ms / 1e9:.0f} | "
                    f"{kv_bytes / base_ms / 1e9:.2f} | 1.000 | — |")
        print(rows[-1], flush=True)
        for ps in (16, 64, 256):
            ms, res = run(batch, sq, skv, ps, q, k, v, out, gen)
            diff = (res.float() - base.float()).abs().max().item()
            ok = diff <= 1e-2 and torch.isfinite(res).all().item()
            rows.append(f"| {name} | paged, pages of {ps} | {ms:.3f} | {flops / ms / 1e9:.0f} | "
                        f"{kv_bytes / ms / 1e9:.2f} | {ms / base_ms:.3f} | "
                        f"{diff:.1e}{'' if ok else ' MISMATCH'} |")
            print(rows[-1], flush=True)
    if ARGS.out:
        with open(ARGS.out, "w") as f:
            f.write("\n".join(rows) + "\n")


main()
