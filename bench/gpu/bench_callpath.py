#!/usr/bin/env python3
"""The cost of one call (issue 14 point 3): wall time per call from PyTorch at S = 1024, H = 8,
D = 128, bf16, causal (B = 1), for bsattn.attention (validate False / True, plan cached after the
first call), a bsattn.Plan, torch SDPA, compiled FlexAttention and FlashAttention-4 (when
importable), plus the host time of the C++ Plan::run (through the bench shim).

Per row: `wall` = time of N back-to-back calls, torch.cuda.synchronize() only before and after the
loop, divided by N (what a training or serving loop pays per call: the larger of the host cost and
the GPU time). `host` = the host's cost of one call: the calls are issued in bursts of --burst (32)
back to back, the GPU drained (synchronize) before each burst outside the clock, and the row gives
the median over bursts of (burst time / burst). A burst is kept short so that the launch queue
never fills: in one long loop of calls to a kernel slower than the host, the host soon waits for
queue slots and the loop's time is the GPU's, not the host's (the earlier method measured 30 us of
"host time" for the C++ Plan::run that way, the GPU time of the ~35 us kernel). `gpu` = median
CUDA-event time of one call, for reference. Every output is first checked against SDPA. The C++
rows time Plan::run the same way in the shim (bsattn_bench_host_time: bursts of --burst runs, the
stream synchronised between bursts outside the clock, median per-call time; the fastest burst is
printed too). Targets: bsattn validate=False wall <= 40 us, C++ Plan::run host <= 8 us.

  PYTHONPATH=<site with bsattn> python3 bench/gpu/bench_callpath.py \\
      --lib build-gpu/bench/gpu/libbsattn_bench.so [--iters 2000] [--burst 32] [--out callpath.md]

--cpp-only: the C++ rows alone (no bsattn package needed: the shim and torch for the buffers).
"""
import argparse
import ctypes
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402

P = argparse.ArgumentParser()
P.add_argument("--lib", default="", help="libbsattn_bench.so for the C++ Plan::run host time (row left out if empty)")
P.add_argument("--iters", type=int, default=2000, help="calls per row for the wall column")
P.add_argument("--burst", type=int, default=32, help="calls per burst for the host column (the queue must not fill)")
P.add_argument("--seqlen", type=int, default=1024)
P.add_argument("--heads", type=int, default=8)
P.add_argument("--head-dim", type=int, default=128)
P.add_argument("--out", default="")
P.add_argument("--cpp-only", action="store_true", help="only the C++ Plan::run rows (no bsattn package)")
ARGS = P.parse_args()
if not ARGS.cpp_only:
    import bsattn
S, H, D = ARGS.seqlen, ARGS.heads, ARGS.head_dim


def measure(fn, iters):
    """(wall us, host us, gpu us) per call. wall: `iters` calls back to back, synchronised only
    before and after. host: bursts of ARGS.burst calls, synchronize() before each burst outside
    the clock, the median per-call time over max(20, iters // burst) bursts (a short burst never
    fills the launch queue, so the host is never throttled to the GPU's pace). gpu: median
    CUDA-event time of one call."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / iters * 1e6
    bursts = []
    for _ in range(max(20, iters // ARGS.burst)):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(ARGS.burst):
            fn()
        bursts.append((time.perf_counter() - t0) / ARGS.burst * 1e6)
    torch.cuda.synchronize()
    events = []
    for _ in range(50):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        events.append((a, b))
    torch.cuda.synchronize()
    gpu = statistics.median(a.elapsed_time(b) for a, b in events) * 1e3
    return wall, statistics.median(bursts), gpu


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
    """Host time of the C++ Plan::run, validate False and True, through the bench shim
    (bsattn_bench_host_time: bursts of ARGS.burst runs, the stream synchronised between bursts
    outside the clock; the median per-call time over bursts, and the fastest burst)."""
    if not ARGS.lib:
        return []
    lib = benchlib.load(ARGS.lib, need=("bsattn_bench_plan_kv", "bsattn_bench_host_time", "bsattn_bench_set_validate"))
    plan = benchlib.Plan(lib, lib.bsattn_bench_plan_kv(1, S, S, H, H, D, 1, 0, 0, 0))
    out = torch.empty_like(q)
    rows = []
    for validate in (0, 1):
        benchlib.ok(lib, lib.bsattn_bench_set_validate(plan.h, validate))
        us = (ctypes.c_double * 2)()
        iters = ARGS.iters if not validate else max(100, ARGS.iters // 10)
        bursts = max(20, iters // ARGS.burst)
        benchlib.ok(lib, lib.bsattn_bench_host_time(plan.h, *(benchlib.ptr(t) for t in (q, k, v, out)),
                                                    benchlib.stream(), bursts, ARGS.burst, us))
        rows.append(f"| C++ Plan::run, validate={bool(validate)} (host time, target <= 8 us; fastest burst "
                    f"{us[1]:.1f}) | — | {us[0]:.1f} | — |")
    # Block lists (one pattern per head, half the blocks of each row): validate = True checks their
    # values on the device and reads back one flag word (issue 14: one small copy, no metadata copy).
    if not hasattr(lib, "bsattn_bench_host_time_lists"):
        return rows
    lists = benchlib.Plan(lib, lib.bsattn_bench_plan_kv_lists(1, S, S, H, H, D, 0, 0, 0, 0, 1, 128, 1, H))
    nqb = S // 128
    chosen = torch.rand(H, nqb, nqb, device="cuda").argsort(dim=-1)[..., : nqb // 2].sort(dim=-1).values
    idx = torch.zeros(1, H, nqb, nqb, dtype=torch.int32, device="cuda")
    idx[0, :, :, : nqb // 2] = chosen.int()
    cnt = torch.full((1, H, nqb), nqb // 2, dtype=torch.int32, device="cuda")
    for validate in (0, 1):
        benchlib.ok(lib, lib.bsattn_bench_set_validate(lists.h, validate))
        us = (ctypes.c_double * 2)()
        iters = ARGS.iters if not validate else max(100, ARGS.iters // 10)
        benchlib.ok(lib, lib.bsattn_bench_host_time_lists(lists.h, *(benchlib.ptr(t) for t in (q, k, v, cnt, idx, out)),
                                                          benchlib.stream(), max(20, iters // ARGS.burst), ARGS.burst,
                                                          us))
        rows.append(f"| C++ Plan::run, block lists, validate={bool(validate)} (host time; fastest burst "
                    f"{us[1]:.1f}) | — | {us[0]:.1f} | — |")
    return rows


def main():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, S, H, D, dtype=torch.bfloat16, device="cuda") for _ in range(3))
    rows = [f"S = {S}, H = {H}, D = {D}, bf16, causal, B = 1; wall: {ARGS.iters} calls per row back to back; "
            f"host: median over bursts of {ARGS.burst} calls (GPU drained between bursts); "
            f"torch {torch.__version__}, {torch.cuda.get_device_name()}", "",
            "| call | wall us / call | host us / call | GPU us / call |", "| --- | --- | --- | --- |"]
    if not ARGS.cpp_only:
        rows += python_rows(q, k, v)
    for row in cpp_rows(q, k, v):
        rows.append(row)
        print(row, flush=True)
    if ARGS.out:
        with open(ARGS.out, "w") as f:
            f.write("\n".join(rows) + "\n")


def python_rows(q, k, v):
    """bsattn's PyTorch calls and the peers, each checked against SDPA first."""
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
    rows = []
    for name, fn in calls:
        diff = (fn().float() - reference).abs().max().item()
        if not diff <= 2e-2:
            print(f"{name}: max |diff| vs SDPA {diff:.3e}: MISMATCH, not timed")
            continue
        iters = ARGS.iters if "validate=True" not in name else max(100, ARGS.iters // 10)
        wall, host, gpu = measure(fn, iters)
        rows.append(f"| {name} | {wall:.1f} | {host:.1f} | {gpu:.1f} |")
        print(rows[-1], flush=True)
    return rows


main()
