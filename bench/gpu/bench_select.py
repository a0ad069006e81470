#!/usr/bin/env python3
"""GPU benchmark of block selection (SPEC §7) next to the attention it feeds.

Per configuration (MHA, bf16, one pattern per query head): the time of build_summaries, of
select_blocks with each policy (top_k at the given density, tau = 0, mass = 0.9), and of bsattn's
attention on the top_k selection (block lists of the same blocks), and the share of summaries +
selection in the whole. Issue 11's target: <= 3 % at density 0.175, S = 32768, H = 40. Times are
the median of --iters CUDA-event timings after warm-up, of the GPU only (a spin kernel ahead of
each call hides the host's part). Each top_k mask is checked to hold exactly k blocks per row
before it is timed.

  python3 bench/gpu/bench_select.py --lib build/bench/gpu/libbsattn_bench.so [--out table.md]
"""
import argparse
import ctypes
import os
import statistics

import torch

P = argparse.ArgumentParser()
P.add_argument("--lib", required=True)
P.add_argument("--iters", type=int, default=30)
P.add_argument("--density", type=float, default=0.175)
P.add_argument("--out", default="", help="write the result table (markdown) here")
ARGS = P.parse_args()

LIB = ctypes.CDLL(os.path.abspath(ARGS.lib))
LIB.bsattn_bench_error.restype = ctypes.c_char_p
LIB.bsattn_bench_summaries.restype = ctypes.c_int
LIB.bsattn_bench_summaries.argtypes = [ctypes.c_int] * 6 + [ctypes.c_void_p] * 5
LIB.bsattn_bench_select.restype = ctypes.c_int
LIB.bsattn_bench_select.argtypes = [ctypes.c_int] * 9 + [ctypes.c_double] + [ctypes.c_int] * 2 + [ctypes.c_void_p] * 4
LIB.bsattn_bench_plan.restype = ctypes.c_void_p
LIB.bsattn_bench_plan.argtypes = [ctypes.c_int] * 12
LIB.bsattn_bench_run.restype = ctypes.c_int
LIB.bsattn_bench_run.argtypes = [ctypes.c_void_p] * 9
LIB.bsattn_bench_free.argtypes = [ctypes.c_void_p]

# (B, S, H, D, block)
CONFIGS = [(1, 10800, 40, 128, 64), (1, 32768, 40, 128, 64), (1, 32768, 40, 128, 128)]


def ptr(t):
    return ctypes.c_void_p(t.data_ptr())


def stream():
    return ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)


def check(status):
    if status != 0:
        raise RuntimeError(LIB.bsattn_bench_error().decode())


# GPU clock cycles of the spin kernel queued before each timed call (about 100 us on the H200).
SPIN_CYCLES = 200_000


def time_ms(fn, iters):
    """Median GPU time of fn. A spin kernel queued first keeps the GPU busy while the host issues fn,
    so the events bracket fn's kernels alone, not the host's call overhead (Python, ctypes,
    validation: 10-20 us): in the pipeline the stages are queued without a host sync."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(SPIN_CYCLES)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def block_lists(bits, nkb):
    """(counts [1, H, nQB], indices [1, H, nQB, nKB]) int32 of a [1, H, nQB, W] bitmask."""
    shifts = torch.arange(32, device=bits.device, dtype=torch.int64)
    dense = ((bits.to(torch.int64)[..., None] >> shifts) & 1).flatten(-2)[..., :nkb].bool()
    counts = dense.sum(-1, dtype=torch.int32)
    order = torch.where(dense, torch.arange(nkb, device=bits.device), nkb + torch.arange(nkb, device=bits.device))
    indices = order.sort(-1).values.clamp(max=nkb - 1).to(torch.int32).contiguous()
    return counts.contiguous(), indices, dense


def main():
    torch.manual_seed(0)
    dtype = torch.bfloat16
    header = ("| S | H | D | block | summaries (us) | top_k (us) | tau (us) | mass (us) | attention at top_k (ms) "
              "| summaries + top_k of the whole |")
    rule = "|---|---|---|---|---|---|---|---|---|---|"
    print(f"{torch.cuda.get_device_name()}; density {ARGS.density}; median of {ARGS.iters} CUDA-event timings",
          flush=True)
    print(header)
    print(rule)
    rows = []
    for B, S, H, D, block in CONFIGS:
        q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=dtype) for _ in range(3))
        out = torch.empty_like(q)
        nqb, nkb = -(-S // block), -(-S // block)
        ks = torch.empty(B, nkb, H, D, device="cuda", dtype=dtype)
        vs = torch.empty_like(ks)
        bits = torch.empty(B, H, nqb, -(-nkb // 32), device="cuda", dtype=torch.int32)
        top_k = max(1, round(ARGS.density * nkb))

        def summaries():
            check(LIB.bsattn_bench_summaries(B, S, H, D, 0, block, ptr(k), ptr(v), ptr(ks), ptr(vs), stream()))

        def select(policy, value):
            check(LIB.bsattn_bench_select(B, S, H, H, D, 0, block, block, policy, value, 0, 0, ptr(q), ptr(ks),
                                          ptr(bits), stream()))

        summaries()
        us = {}
        for name, policy, value in (("tau", 1, 0.0), ("mass", 2, 0.9), ("top_k", 0, top_k)):
            select(policy, value)  # top_k last: its bits feed the attention below
            us[name] = 1e3 * time_ms(lambda: select(policy, value), ARGS.iters)
        counts, indices, dense = block_lists(bits, nkb)
        torch.cuda.synchronize()
        if not bool((counts == top_k).all()):
            raise SystemExit(f"top_k selected {counts.min().item()}..{counts.max().item()} blocks, expected {top_k}")
        t_summaries = 1e3 * time_ms(summaries, ARGS.iters)
        plan = LIB.bsattn_bench_plan(B, S, H, H, D, 0, block, block, 1, H, 0, -1)
        if not plan:
            raise RuntimeError(LIB.bsattn_bench_error().decode())
        try:
            attention_ms = time_ms(lambda: check(LIB.bsattn_bench_run(plan, ptr(q), ptr(k), ptr(v), ptr(out), None,
                                                                      ptr(counts), ptr(indices), stream())),
                                   ARGS.iters)
        finally:
            LIB.bsattn_bench_free(plan)
        share = (t_summaries + us["top_k"]) / (t_summaries + us["top_k"] + 1e3 * attention_ms)
        row = (f"| {S} | {H} | {D} | {block} | {t_summaries:.1f} | {us['top_k']:.1f} | {us['tau']:.1f} | "
               f"{us['mass']:.1f} | {attention_ms:.3f} | {100 * share:.1f} % |")
        print(row, flush=True)
        rows.append(row)
        del q, k, v, out, ks, vs, bits, counts, indices, dense
    if ARGS.out:
        with open(ARGS.out, "w") as f:
            f.write(header + "\n" + rule + "\n" + "\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
