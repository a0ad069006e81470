#!/usr/bin/env python3
"""Proxy compensation overhead on the GPU (issue 11.3): bsattn's forward with proxy terms on the
eligible blocks against the exact run with the same selected set (no mask, so every unselected
block is eligible). bf16, D 128, MHA H 40, one random pattern per head, density 0.175 (each
(head, Q block) row selects round(0.175 * nKB) blocks, the diagonal one always), blocks 64 x 64
and 128 x 128, S 10800 and 32768. Summaries come from bsattn's build_summaries. Before timing,
rows of a few (head, Q block) pairs of both runs are checked against a float64 torch reference
(exact: softmax over the selected tokens; proxy: plus one term p_j = exp(s_j) per unselected
block with weight n_j in the denominator and p_j * v_summary_j in the numerator). Times are the
median of >= 20 CUDA-event timings after warm-up, exact and proxy interleaved. Target: overhead
<= 8 %.

  python3 bench/gpu/bench_proxy.py --lib build-gpu/bench/gpu/libbsattn_bench.so [--out proxy.md]
"""
import argparse
import ctypes
import math
import os
import statistics

import torch

P = argparse.ArgumentParser()
P.add_argument("--lib", required=True)
P.add_argument("--iters", type=int, default=20)
P.add_argument("--out", default="")
ARGS = P.parse_args()

LIB = ctypes.CDLL(os.path.abspath(ARGS.lib))
LIB.bsattn_bench_plan.restype = ctypes.c_void_p
LIB.bsattn_bench_plan.argtypes = [ctypes.c_int] * 12
LIB.bsattn_bench_run.restype = ctypes.c_int
LIB.bsattn_bench_run.argtypes = [ctypes.c_void_p] * 9
LIB.bsattn_bench_set_proxy.restype = ctypes.c_int
LIB.bsattn_bench_set_proxy.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
LIB.bsattn_bench_summaries.restype = ctypes.c_int
LIB.bsattn_bench_summaries.argtypes = [ctypes.c_int] * 6 + [ctypes.c_void_p] * 5
LIB.bsattn_bench_check.restype = ctypes.c_int
LIB.bsattn_bench_check.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
LIB.bsattn_bench_free.argtypes = [ctypes.c_void_p]
LIB.bsattn_bench_error.restype = ctypes.c_char_p
H, D, DENSITY = 40, 128, 0.175


def ptr(t):
    return ctypes.c_void_p(t.data_ptr()) if t is not None else None


def ok(rc):
    if rc != 0:
        raise RuntimeError(LIB.bsattn_bench_error().decode())


def pattern(S, block, gen):
    """counts [1, H, nQB], indices [1, H, nQB, nKB] (ascending, -1 padded), selection mask [H, nQB, nKB]."""
    nqb = nkb = (S + block - 1) // block
    keep = max(1, round(DENSITY * nkb))
    score = torch.rand(H, nqb, nkb, generator=gen)
    diag = torch.arange(nqb)
    score[:, diag, diag] = 2.0  # the diagonal block is always selected
    chosen = score.topk(keep, dim=-1).indices.sort(dim=-1).values
    sel = torch.zeros(H, nqb, nkb, dtype=torch.bool)
    sel.scatter_(-1, chosen, True)
    idx = torch.full((1, H, nqb, nkb), -1, dtype=torch.int32)
    idx[0, :, :, :keep] = chosen.to(torch.int32)
    cnt = torch.full((1, H, nqb), keep, dtype=torch.int32)
    return cnt.cuda(), idx.cuda(), sel


def reference_rows(q, k, v, ks, vs, sel, block, h, qb, proxy):
    """float64 O rows of (head h, Q block qb)."""
    S = q.shape[1]
    rows = slice(qb * block, min(S, (qb + 1) * block))
    scale = 1.0 / math.sqrt(D)
    qr = q[0, rows, h].double()
    blocks = sel[h, qb].nonzero().flatten().tolist()
    toks = torch.cat([torch.arange(j * block, min(S, (j + 1) * block)) for j in blocks]).cuda()
    s = qr @ k[0, toks, h].double().T * scale
    m = s.max(dim=1, keepdim=True).values
    if proxy:
        other = (~sel[h, qb]).nonzero().flatten().cuda()
        sp = qr @ ks[0, other, h].double().T * scale
        n = torch.clamp(S - other * block, max=block).double()
        m = torch.maximum(m, sp.max(dim=1, keepdim=True).values)
    p = torch.exp(s - m)
    num, den = p @ v[0, toks, h].double(), p.sum(dim=1, keepdim=True)
    if proxy:
        pp = torch.exp(sp - m)
        num = num + pp @ vs[0, other, h].double()
        den = den + (pp * n).sum(dim=1, keepdim=True)
    return num / den, rows


def timed_pair(fns, iters):
    """Median ms of each fn, the runs interleaved so that clocks and thermals hit all alike."""
    for fn in fns:
        for _ in range(3):
            fn()
    times = [[] for _ in fns]
    for _ in range(iters):
        for i, fn in enumerate(fns):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times[i].append(a.elapsed_time(b))
    return [statistics.median(t) for t in times]


def main():
    gen = torch.Generator().manual_seed(0)
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    rows = ["| S | block | exact ms | proxy ms | overhead | exact eff. TFLOP/s | max abs err exact / proxy vs float64 |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    for S in (10800, 32768):
        torch.manual_seed(S)
        q = torch.randn(1, S, H, D, dtype=torch.bfloat16, device="cuda")
        k = torch.randn(1, S, H, D, dtype=torch.bfloat16, device="cuda")
        v = torch.randn(1, S, H, D, dtype=torch.bfloat16, device="cuda")
        for block in (64, 128):
            nkb = (S + block - 1) // block
            cnt, idx, sel = pattern(S, block, gen)
            ks = torch.empty(1, nkb, H, D, dtype=torch.bfloat16, device="cuda")
            vs = torch.empty_like(ks)
            ok(LIB.bsattn_bench_summaries(1, S, H, D, 0, block, ptr(k), ptr(v), ptr(ks), ptr(vs), stream))
            outs = {}
            handles = {}
            for proxy in (False, True):
                h = LIB.bsattn_bench_plan(1, S, H, H, D, 0, block, block, 1, H, 0, -1)
                if not h:
                    raise RuntimeError(LIB.bsattn_bench_error().decode())
                if proxy:
                    ok(LIB.bsattn_bench_set_proxy(h, 1, ptr(ks), ptr(vs)))
                handles[proxy] = h
                outs[proxy] = torch.full_like(q, float("nan"))
            calls = [lambda p=p: ok(LIB.bsattn_bench_run(handles[p], ptr(q), ptr(k), ptr(v), ptr(outs[p]), None,
                                                         ptr(cnt), ptr(idx), stream)) for p in (False, True)]
            for p, call in zip((False, True), calls):
                call()
                ok(LIB.bsattn_bench_check(handles[p], stream))
            errs = []
            for p in (False, True):
                assert torch.isfinite(outs[p]).all().item(), "non-finite output"
                err = 0.0
                for h in (0, H // 2, H - 1):
                    for qb in (0, nkb // 2, nkb - 1):
                        ref, r = reference_rows(q, k, v, ks, vs, sel, block, h, qb, p)
                        err = max(err, (outs[p][0, r, h].double() - ref).abs().max().item())
                errs.append(err)
            exact_ms, proxy_ms = timed_pair(calls, ARGS.iters)
            tokens = torch.clamp(S - torch.arange(nkb) * block, max=block).double()  # per block, Q and KV alike
            pairs = (sel.double() * tokens[None, :, None] * tokens[None, None, :]).sum().item()
            flops = 4.0 * D * pairs
            bad = "" if max(errs) <= 2e-2 else " MISMATCH"
            rows.append(f"| {S} | {block} x {block} | {exact_ms:.3f} | {proxy_ms:.3f} | "
                        f"{100 * (proxy_ms / exact_ms - 1):+.1f} % | {flops / exact_ms / 1e9:.0f} | "
                        f"{errs[0]:.1e} / {errs[1]:.1e}{bad} |")
            print(rows[-1], flush=True)
            for h in handles.values():
                LIB.bsattn_bench_free(h)
    if ARGS.out:
        with open(ARGS.out, "w") as f:
            f.write("\n".join(rows) + "\n")


main()
