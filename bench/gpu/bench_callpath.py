#!/usr/bin/env python3
"""The cost of one call (issue 14 point 3): wall time per call from PyTorch at S = 1024, H = 8,
D = 128, bf16, causal (B = 1), for bsattn.attention (validate False / True, plan cached after the
first call), a bsattn.Plan, torch SDPA, compiled FlexAttention and FlashAttention-4 (when
importable), plus the host time of the C++ Plan::run (through the bench shim).

Per row: `wall` = time of N back-to-back calls, torch.cuda.synchronize() only before and after the
loop, divided by N (what a training or serving loop pays per call: the larger of the host cost and
the GPU time); `host` = the same loop's time until its last call returned, before the final sync
(the host cost per call, while the GPU queue does not fill up); `gpu` = median CUDA-event time of
one call, for reference. Every output is first checked against SDPA. Targets: bsattn
validate=False wall <= 40 us, C++ Plan::run host <= 8 us.

  PYTHONPATH=<site with bsattn> python3 bench/gpu/bench_callpath.py \\
      --lib build-gpu/bench/gpu/libbsattn_bench.so [--iters 2000] [--out callpath.md]
"""
import argparse
import ctypes
import os
import statistics
import time

import torch

import bsattn

P = argparse.ArgumentParser()
P.add_argument("--lib", default="", help="libbsattn_bench.so for the C++ Plan::run host time (row left out if empty)")
P.add_argument("--iters", type=int, default=2000)
P.add_argument("--seqlen", type=int, default=1024)
P.add_argument("--heads", type=int, default=8)
P.add_argument("--head-dim", type=int, default=128)
P.add_argument("--out", default="")
ARGS = P.parse_args()
S, H, D = ARGS.seqlen, ARGS.heads, ARGS.head_dim


def measure(fn, iters):
    """(wall us, host us, gpu us) per call."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    issued = time.perf_counter()
    torch.cuda.synchronize()
    done = time.perf_counter()
    events = []
    for _ in range(50):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        events.append((a, b))
    torch.cuda.synchronize()
    gpu = statistics.median(a.elapsed_time(b) for a, b in events) * 1e3
    return (done - start) / iters * 1e6, (issued - start) / iters * 1e6, gpu


def peers(q, k, v):
    """(name, fn returning [B, S, H, D]) for every peer that imports and runs here."""
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, S, D] views of the same storage
    sdpa = torch.nn.functional.scaled_dot_product_attention
    rows = [("torch SDPA (is_causal)", lambda: sdpa(qh, kh, vh, is_causal=True).transpose(1, 2))]
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        block_mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, S, S, device="cuda")
        flex = torch.compile(flex_attention, dynamic=False)
        rows.append(("FlexAttention (compiled)", lambda: flex(qh, kh, vh, block_mask=block_mask).transpose(1, 2)))
    except Exception as e:  # noqa: BLE001 - a peer that cannot run is reported, not fatal
        print(f"FlexAttention skipped: {type(e).__name__}: {str(e)[:160]}")
    fa4 = None
    for module, label in (("flash_attn.cute", "FlashAttention-4 (flash_attn.cute)"),
                          ("flash_attn_interface", "FlashAttention-3 (flash_attn_interface)")):
        try:
            fa4 = (__import__(module, fromlist=["flash_attn_func"]).flash_attn_func, label)
            break
        except Exception:  # noqa: BLE001
            continue
    if fa4 is None:
        print("FlashAttention-4: not importable here (flash_attn.cute / flash_attn_interface); row skipped")
    else:
        func, label = fa4

        def fa_call():
            r = func(q, k, v, causal=True)
            return r[0] if isinstance(r, tuple) else r

        rows.append((label, fa_call))
    return rows


def cpp_rows(q, k, v):
    """Host time of the C++ Plan::run, validate False and True, through the bench shim."""
    if not ARGS.lib:
        return []
    lib = ctypes.CDLL(os.path.abspath(ARGS.lib))
    lib.bsattn_bench_plan_kv.restype = ctypes.c_void_p
    lib.bsattn_bench_plan_kv.argtypes = [ctypes.c_int] * 10
    lib.bsattn_bench_set_validate.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.bsattn_bench_host_time.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int, ctypes.POINTER(ctypes.c_double)]
    lib.bsattn_bench_free.argtypes = [ctypes.c_void_p]
    lib.bsattn_bench_error.restype = ctypes.c_char_p
    handle = lib.bsattn_bench_plan_kv(1, S, S, H, H, D, 1, 0, 0, 0)
    if not handle:
        raise RuntimeError(lib.bsattn_bench_error().decode())
    out = torch.empty_like(q)
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    rows = []
    for validate in (0, 1):
        if lib.bsattn_bench_set_validate(handle, validate) != 0:
            raise RuntimeError(lib.bsattn_bench_error().decode())
        us = ctypes.c_double()
        iters = ARGS.iters if not validate else max(100, ARGS.iters // 10)
        if lib.bsattn_bench_host_time(handle, *(ctypes.c_void_p(t.data_ptr()) for t in (q, k, v, out)), stream, iters,
                                      ctypes.byref(us)) != 0:
            raise RuntimeError(lib.bsattn_bench_error().decode())
        rows.append(f"| C++ Plan::run, validate={bool(validate)} (host time, target <= 8 us) | — | {us.value:.1f} | — |")
    lib.bsattn_bench_free(handle)
    return rows


def main():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, S, H, D, dtype=torch.bfloat16, device="cuda") for _ in range(3))
    mask = bsattn.Mask(causal=True)
    plan = bsattn.Plan(q, k, v, mask=mask, validate=False)
    ours = [
        ("bsattn.attention, validate=False (target <= 40 us)", lambda: bsattn.attention(q, k, v, mask=mask,
                                                                                       validate=False)),
        ("bsattn.attention, validate=True", lambda: bsattn.attention(q, k, v, mask=mask, validate=True)),
        ("bsattn.Plan call (validate=False)", lambda: plan(q, k, v)),
    ]
    calls = ours + peers(q, k, v)
    reference = calls[len(ours)][1]().float()
    rows = [f"S = {S}, H = {H}, D = {D}, bf16, causal, B = 1; {ARGS.iters} calls per row; "
            f"torch {torch.__version__}, {torch.cuda.get_device_name()}", "",
            "| call | wall us / call | host us / call | GPU us / call |", "| --- | --- | --- | --- |"]
    for name, fn in calls:
        diff = (fn().float() - reference).abs().max().item()
        if not diff <= 2e-2:
            print(f"{name}: max |diff| vs SDPA {diff:.3e}: MISMATCH, not timed")
            continue
        iters = ARGS.iters if "validate=True" not in name else max(100, ARGS.iters // 10)
        wall, host, gpu = measure(fn, iters)
        rows.append(f"| {name} | {wall:.1f} | {host:.1f} | {gpu:.1f} |")
        print(rows[-1], flush=True)
    for row in cpp_rows(q, k, v):
        rows.append(row)
        print(row, flush=True)
    if ARGS.out:
        with open(ARGS.out, "w") as f:
            f.write("\n".join(rows) + "\n")


main()
