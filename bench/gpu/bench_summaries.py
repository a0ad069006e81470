#!/usr/bin/env python3
"""GPU benchmark of bsattn.build_summaries (proxy summaries, SPEC §6) against the copy ceiling.

The kernel reads K and V once and writes two [B, nKB, Hkv, D] summaries; its bandwidth is
(bytes of K + V read + bytes of summaries written) / time, reported against the H200's copy
ceiling of 4.21 TB/s (target >= 80 %). Each configuration is checked against a torch reference
(fp32 mean of K / sum of V per block, rounded to the dtype) before it is timed; times are the
median of --iters CUDA-event timings after warm-up, on inputs larger than L2.

  python3 bench/gpu/bench_summaries.py --lib build/bench/gpu/libbsattn_bench.so [--out table.md]
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
LIB.bsattn_bench_summaries.restype = ctypes.c_int
LIB.bsattn_bench_summaries.argtypes = [ctypes.c_int] * 6 + [ctypes.c_void_p] * 5
LIB.bsattn_bench_error.restype = ctypes.c_char_p

# (B, S, Hkv, D, block_kv)
CONFIGS = [(1, 32768, 8, 128, 64), (1, 32768, 8, 128, 128), (1, 32768, 40, 128, 64), (1, 32768, 40, 128, 128),
           (1, 10800, 40, 128, 64), (1, 32768, 8, 64, 64), (1, 32768, 8, 256, 64)]


def summaries(k, v, bk, ks, vs):
    B, S, H, D = k.shape
    s = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    if LIB.bsattn_bench_summaries(B, S, H, D, int(k.dtype == torch.float16), bk, ctypes.c_void_p(k.data_ptr()),
                                  ctypes.c_void_p(v.data_ptr()), ctypes.c_void_p(ks.data_ptr()),
                                  ctypes.c_void_p(vs.data_ptr()), s) != 0:
        raise RuntimeError(LIB.bsattn_bench_error().decode())


def reference(k, v, bk):
    B, S, H, D = k.shape
    nkb = -(-S // bk)
    pad = nkb * bk - S
    kf = torch.nn.functional.pad(k.float(), (0, 0, 0, 0, 0, pad)).view(B, nkb, bk, H, D)
    vf = torch.nn.functional.pad(v.float(), (0, 0, 0, 0, 0, pad)).view(B, nkb, bk, H, D)
    counts = torch.clamp(S - torch.arange(nkb, device=k.device) * bk, max=bk).float().view(1, nkb, 1, 1)
    return (kf.sum(2) / counts).to(k.dtype), vf.sum(2).to(v.dtype)


def time_ms(fn, iters):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def main():
    torch.manual_seed(0)
    dtype = torch.bfloat16
    rows = []
    header = "| B | S | Hkv | D | block | MB read + written | time (us) | TB/s | of 4.21 TB/s |"
    print(f"{torch.cuda.get_device_name()}; median of {ARGS.iters} CUDA-event timings after warm-up", flush=True)
    print(header)
    print("|---|---|---|---|---|---|---|---|---|")
    for B, S, H, D, bk in CONFIGS:
        k = torch.randn(B, S, H, D, device="cuda", dtype=dtype)
        v = torch.randn(B, S, H, D, device="cuda", dtype=dtype)
        nkb = -(-S // bk)
        ks = torch.full((B, nkb, H, D), float("nan"), device="cuda", dtype=dtype)
        vs = torch.full_like(ks, float("nan"))
        summaries(k, v, bk, ks, vs)
        rk, rv = reference(k, v, bk)
        torch.cuda.synchronize()
        # One rounding of an fp32 sum in another order: within an ulp of the dtype.
        ok = all(torch.allclose(x.float(), r.float(), rtol=1.6e-2, atol=1e-3) for x, r in ((ks, rk), (vs, rv)))
        if not ok or torch.isnan(ks).any() or torch.isnan(vs).any():
            raise SystemExit(f"mismatch against the torch reference at B={B} S={S} Hkv={H} D={D} block={bk}")
        ms = time_ms(lambda: summaries(k, v, bk, ks, vs), ARGS.iters)
        moved = 2 * k.numel() * k.element_size() + 2 * ks.numel() * ks.element_size()
        tbs = moved / (ms * 1e-3) / 1e12
        row = (f"| {B} | {S} | {H} | {D} | {bk} | {moved / 1e6:.1f} | {ms * 1e3:.1f} | {tbs:.2f} | "
               f"{100 * tbs / ARGS.ceiling:.0f} % |")
        print(row, flush=True)
        rows.append(row)
        del k, v, ks, vs, rk, rv
    if ARGS.out:
        with open(ARGS.out, "w") as f:
            f.write(header + "\n|---|---|---|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
