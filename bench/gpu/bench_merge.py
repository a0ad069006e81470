#!/usr/bin/env python3
"""GPU benchmark of bsattn.merge_states (issue 12.3) against the copy ceiling.

The kernel reads N partial results (O [N, B, S, H, D] and LSE [N, B, H, S]) once and writes one;
its bandwidth is (bytes read + bytes written) / time, reported against the H200's copy ceiling of
4.21 TB/s. Large merges (cascade / context-parallel prefill) should run near the ceiling; a decode
step's merge (B * H row-heads of one token, well under 1 MB) is bound by the launch and a DRAM
latency or two, so its row reports the time, next to an empty launch's. Each configuration is
checked against a torch float32 reference first; times are the median of --iters CUDA-event
timings after warm-up, of the GPU only (a spin kernel ahead of each call hides the host's part).

  python3 bench/gpu/bench_merge.py --lib build/bench/gpu/libbsattn_bench.so [--out table.md]
"""
import argparse
import ctypes
import os
import statistics

import torch

P = argparse.ArgumentParser()
P.add_argument("--lib", required=True)
P.add_argument("--iters", type=int, default=50)
P.add_argument("--ceiling", type=float, default=4.21, help="copy ceiling in TB/s")
P.add_argument("--out", default="", help="write the result table (markdown) here")
ARGS = P.parse_args()

LIB = ctypes.CDLL(os.path.abspath(ARGS.lib))
LIB.bsattn_bench_merge_states.restype = ctypes.c_int
LIB.bsattn_bench_merge_states.argtypes = [ctypes.c_int] * 6 + [ctypes.c_void_p] * 5
LIB.bsattn_bench_error.restype = ctypes.c_char_p

DTYPES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
# (name, N, B, S, H, D, dtype)
CONFIGS = [
    ("decode B32 split 2", 2, 32, 1, 32, 128, torch.bfloat16),
    ("decode B32 split 8", 8, 32, 1, 32, 128, torch.bfloat16),
    ("decode B1 split 16", 16, 1, 1, 32, 128, torch.bfloat16),
    ("prefill S32768 N2", 2, 1, 32768, 32, 128, torch.bfloat16),
    ("prefill S16384 N4", 4, 1, 16384, 32, 128, torch.bfloat16),
    ("prefill S4096 B8 N8", 8, 8, 4096, 8, 128, torch.bfloat16),
    ("prefill S32768 N2 D64", 2, 1, 32768, 32, 64, torch.bfloat16),
    ("prefill S16384 N2 D256", 2, 1, 16384, 32, 256, torch.bfloat16),
    ("prefill S16384 N2 f32", 2, 1, 16384, 32, 128, torch.float32),
]


def merge(outs, lses, out, lse):
    N, B, S, H, D = outs.shape
    s = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    args = [ctypes.c_void_p(t.data_ptr()) for t in (outs, lses, out, lse)]
    if LIB.bsattn_bench_merge_states(N, B, S, H, D, DTYPES[outs.dtype], *args, s) != 0:
        raise RuntimeError(LIB.bsattn_bench_error().decode())


def reference(outs, lses):
    lse = torch.logsumexp(lses, dim=0)  # [B, H, S]
    w = torch.exp(lses - lse).nan_to_num(0.0)  # [N, B, H, S]; empty rows give 0
    out = (w.permute(0, 1, 3, 2)[..., None] * outs.float()).sum(0)
    return out.to(outs.dtype), lse


# GPU clock cycles of the spin kernel queued before each timed call (about 100 us on the H200).
SPIN_CYCLES = 200_000


def time_ms(fn, iters):
    """Median GPU time of fn. A spin kernel queued first keeps the GPU busy while the host issues fn,
    so the events bracket fn's kernels alone: without it they also took the host's call overhead
    (Python, ctypes, validation), which made every decode merge read 22 us."""
    for _ in range(5):
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


def main():
    torch.manual_seed(0)
    header = "| config | N | B | S | H | D | dtype | MB read + written | time (us) | TB/s | of 4.21 TB/s |"
    rule = "|---|---|---|---|---|---|---|---|---|---|---|"
    empty_us = 1e3 * time_ms(lambda: torch.cuda._sleep(0), ARGS.iters)
    print(f"{torch.cuda.get_device_name()}; median of {ARGS.iters} CUDA-event timings after warm-up, GPU time only; "
          f"an empty launch measures {empty_us:.1f} us", flush=True)
    print(header + "\n" + rule)
    rows = []
    for name, N, B, S, H, D, dtype in CONFIGS:
        outs = torch.randn(N, B, S, H, D, device="cuda", dtype=dtype)
        lses = torch.randn(N, B, H, S, device="cuda") * 3
        lses[torch.rand_like(lses) < 0.05] = float("-inf")  # some empty parts
        out = torch.full((B, S, H, D), float("nan"), device="cuda", dtype=dtype)
        lse = torch.full((B, H, S), float("nan"), device="cuda")
        merge(outs, lses, out, lse)
        want, want_lse = reference(outs, lses)
        torch.cuda.synchronize()
        tol = dict(rtol=1.6e-2, atol=1e-3) if dtype != torch.float32 else dict(rtol=1e-5, atol=1e-6)
        if not (torch.allclose(out.float(), want.float(), **tol) and torch.allclose(lse, want_lse, rtol=1e-5,
                                                                                     atol=1e-5, equal_nan=True)):
            raise SystemExit(f"mismatch against the torch reference: {name}")
        ms = time_ms(lambda: merge(outs, lses, out, lse), ARGS.iters)
        moved = sum(t.numel() * t.element_size() for t in (outs, lses, out, lse))
        tbs = moved / (ms * 1e-3) / 1e12
        row = (f"| {name} | {N} | {B} | {S} | {H} | {D} | {str(dtype).split('.')[-1]} | {moved / 1e6:.1f} | "
               f"{ms * 1e3:.1f} | {tbs:.2f} | {100 * tbs / ARGS.ceiling:.0f} % |")
        print(row, flush=True)
        rows.append(row)
        del outs, lses, out, lse, want, want_lse
        torch.cuda.empty_cache()
    if ARGS.out:
        with open(ARGS.out, "w") as f:
            f.write(header + "\n" + rule + "\n" + "\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
