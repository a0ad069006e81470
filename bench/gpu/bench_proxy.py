#!/usr/bin/env python3
"""Proxy compensation overhead on the GPU (issue 11.3) and where it goes: bsattn's forward with
proxy terms on the eligible blocks against the exact run with the same selected set (no mask, so
every unselected block is eligible). bf16, D 128 (--head-dim 64 or 256), MHA H 40, one random
pattern per head, density 0.175 (each (head, Q block) row selects round(0.175 * nKB) blocks, the
diagonal one always), blocks (Q x KV) 64 x 64 and 128 x 128 (--blocks: e.g. 128x64, where 128-row
tiles take their 64-token routes two per step), S 10800 and 32768. Summaries come from bsattn's
build_summaries.

Three runs per shape, each checked first on rows of a few (head, Q block) pairs against a float64
torch reference (exact: softmax over the selected tokens; proxy: plus one term p_j = exp(s_j) per
unselected block with weight n_j in the denominator and p_j * v_summary_j in the numerator):
  exact        proxy off;
  proxy-empty  an explicit proxy set with no block: the proxy kernel and proxy route preparation
               on the exact work alone (what the kernel variant costs without proxy steps);
  proxy        every unselected block compensated (the configuration of the target).
Per run: the total (--timing rotated, the default: the three runs settled together, then --rounds
rounds of --iters back-to-back calls each, the runs taking turns, median; --timing synced: an
event pair and a sync around each call, the method until 2026-12-06), route preparation and the
longest-first ordering timed on their own (bsattn_bench_prepare_time), and from torch.profiler
(when it records kernels) the attention kernel's GPU time and that of every kernel of the call.
The split of the overhead, proxy - exact = route preparation + kernel variant (proxy-empty - exact
kernel) + proxy steps (proxy - proxy-empty kernel), follows each shape (the profiler's 5 calls are
not settled: at S 32768 their kernel times moved by up to 8 % on 2026-12-06 22:13, so read the
split with the totals beside it). Target: overhead <= 8 %. Under a minute.

  python3 bench/gpu/bench_proxy.py --lib build-gpu/bench/gpu/libbsattn_bench.so [--out proxy.md]
"""
import argparse
import ctypes
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402

P = argparse.ArgumentParser()
P.add_argument("--lib", required=True)
P.add_argument("--iters", type=int, default=20)
P.add_argument("--out", default="")
P.add_argument("--head-dim", type=int, default=128, choices=(64, 128, 256))
P.add_argument("--blocks", default="64x64,128x128", help="Q x KV block shapes, comma-separated")
P.add_argument("--timing", default="rotated", choices=["rotated", "synced"], help="the totals' method (timed_variants)")
P.add_argument("--rounds", type=int, default=7, help="--timing rotated: rounds of the three variants")
ARGS = P.parse_args()

LIB = benchlib.load(ARGS.lib, need=("bsattn_bench_plan", "bsattn_bench_set_proxy", "bsattn_bench_summaries"))
_V, _I = ctypes.c_void_p, ctypes.c_int
for name, res, args in (
        ("bsattn_bench_run_proxy_set", _I, [_V] * 10),
        ("bsattn_bench_prepare_time", _I, [_V] * 10 + [_I, ctypes.POINTER(ctypes.c_double),
                                                      ctypes.POINTER(ctypes.c_double),
                                                      ctypes.POINTER(ctypes.c_longlong)])):
    if not hasattr(LIB, name):
        raise RuntimeError(f"{ARGS.lib} lacks {name}: rebuild the bench target (bench/gpu/bench_shim.cpp)")
    getattr(LIB, name).restype, getattr(LIB, name).argtypes = res, args
H, D, DENSITY = 40, ARGS.head_dim, 0.175
VARIANTS = ("exact", "proxy-empty", "proxy")
ptr = benchlib.ptr


def ok(rc):
    benchlib.ok(LIB, rc)


def pattern(S, bq, bk, gen):
    """counts [1, H, nQB], indices [1, H, nQB, nKB] (ascending, -1 padded), selection mask [H, nQB, nKB]."""
    nqb, nkb = (S + bq - 1) // bq, (S + bk - 1) // bk
    keep = max(1, round(DENSITY * nkb))
    score = torch.rand(H, nqb, nkb, generator=gen)
    diag = torch.arange(nqb)
    score[:, diag, diag * bq // bk] = 2.0  # the diagonal block (its first row's) is always selected
    chosen = score.topk(keep, dim=-1).indices.sort(dim=-1).values
    sel = torch.zeros(H, nqb, nkb, dtype=torch.bool)
    sel.scatter_(-1, chosen, True)
    idx = torch.full((1, H, nqb, nkb), -1, dtype=torch.int32)
    idx[0, :, :, :keep] = chosen.to(torch.int32)
    cnt = torch.full((1, H, nqb), keep, dtype=torch.int32)
    return cnt.cuda(), idx.cuda(), sel


def reference_rows(q, k, v, ks, vs, sel, bq, block, h, qb, proxy):
    """float64 O rows of (head h, Q block qb); `block`: the KV block."""
    S = q.shape[1]
    rows = slice(qb * bq, min(S, (qb + 1) * bq))
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


def timed_variants(fns):
    """Median ms per call of each variant, by --timing: "rotated" (benchlib.timed_rotated: settled
    together, then --rounds rounds of back-to-back calls, the variants taking turns) or "synced"
    (an event pair and a sync around each call, the variants interleaved: the method until
    2026-12-06, whose idle GPU between calls also holds the host's launch path and the clocks' first
    milliseconds)."""
    if ARGS.timing == "rotated":
        return benchlib.timed_rotated(fns, ARGS.iters, ARGS.rounds)[0]
    for fn in fns:
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    times = [[] for _ in fns]
    for _ in range(ARGS.iters):
        for i, fn in enumerate(fns):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times[i].append(a.elapsed_time(b))
    return [sorted(t)[len(t) // 2] for t in times]


def kernel_ms(fn, reps=5):
    """GPU ms per call from torch.profiler: the attention kernel (forward_kernel_ws*) and every
    kernel of the call together, or (None, None) where the profiler records no kernels (no CUPTI)."""
    try:
        from torch.profiler import ProfilerActivity, profile
        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                fn()
            torch.cuda.synchronize()
        forward = every = 0.0
        for e in prof.key_averages():
            for attr in ("self_device_time_total", "self_cuda_time_total", "device_time_total", "cuda_time_total"):
                t = getattr(e, attr, None)
                if t:
                    every += t
                    forward += t if "forward_kernel_ws" in e.key else 0.0
                    break
        return (forward / reps / 1e3, every / reps / 1e3) if forward > 0 else (None, None)
    except Exception as exc:  # a profiler that cannot run leaves the column empty, not the benchmark
        print(f"  (torch.profiler: {exc})", file=sys.stderr)
        return None, None


def fmt(x, spec):
    return format(x, spec) if x is not None else "n/a"


def main():
    gen = torch.Generator().manual_seed(0)
    stream = benchlib.stream()
    rows = [benchlib.header("bench_proxy.py"), "",
            "| S | block | run | total ms | prepare us | order us | kernel ms | all kernels ms | routes / row | "
            "max abs err vs float64 |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    notes = []
    print("\n".join(rows), flush=True)
    for S in (10800, 32768):
        torch.manual_seed(S)
        q = torch.randn(1, S, H, D, dtype=torch.bfloat16, device="cuda")
        k = torch.randn(1, S, H, D, dtype=torch.bfloat16, device="cuda")
        v = torch.randn(1, S, H, D, dtype=torch.bfloat16, device="cuda")
        for bq, block in (tuple(int(x) for x in b.split("x")) for b in ARGS.blocks.split(",")):
            nqb, nkb = (S + bq - 1) // bq, (S + block - 1) // block
            cnt, idx, sel = pattern(S, bq, block, gen)
            no_cnt = torch.zeros_like(cnt)  # the empty explicit proxy set
            no_idx = torch.full_like(idx, -1)
            ks = torch.empty(1, nkb, H, D, dtype=torch.bfloat16, device="cuda")
            vs = torch.empty_like(ks)
            ok(LIB.bsattn_bench_summaries(1, S, H, D, 0, block, ptr(k), ptr(v), ptr(ks), ptr(vs), stream))
            tile_m = 128 if bq % 128 == 0 else 64  # plan.cpp's choose_tiles
            route_rows = H * ((S + tile_m - 1) // tile_m)
            plans, outs, calls, proxy_sets = {}, {}, {}, {}
            for name in VARIANTS:
                plan = benchlib.Plan(LIB, LIB.bsattn_bench_plan(1, S, H, H, D, 0, bq, block, 1, H, 0, -1))
                out = torch.full_like(q, float("nan"))
                if name == "proxy":
                    ok(LIB.bsattn_bench_set_proxy(plan.h, 1, ptr(ks), ptr(vs)))
                    proxy_sets[name] = (None, None)
                    calls[name] = lambda h=plan.h, o=out: ok(LIB.bsattn_bench_run(
                        h, ptr(q), ptr(k), ptr(v), ptr(o), None, ptr(cnt), ptr(idx), stream))
                elif name == "proxy-empty":
                    ok(LIB.bsattn_bench_set_proxy(plan.h, 2, ptr(ks), ptr(vs)))
                    proxy_sets[name] = (no_cnt, no_idx)
                    calls[name] = lambda h=plan.h, o=out: ok(LIB.bsattn_bench_run_proxy_set(
                        h, ptr(q), ptr(k), ptr(v), ptr(o), ptr(cnt), ptr(idx), ptr(no_cnt), ptr(no_idx), stream))
                else:
                    proxy_sets[name] = (None, None)
                    calls[name] = lambda h=plan.h, o=out: ok(LIB.bsattn_bench_run(
                        h, ptr(q), ptr(k), ptr(v), ptr(o), None, ptr(cnt), ptr(idx), stream))
                plans[name], outs[name] = plan, out
            errs = {}
            for name in VARIANTS:
                calls[name]()
                plans[name].check()
                assert torch.isfinite(outs[name]).all().item(), f"{name}: non-finite output"
                err = 0.0
                for h in (0, H // 2, H - 1):
                    for qb in (0, nqb // 2, nqb - 1):
                        ref, r = reference_rows(q, k, v, ks, vs, sel, bq, block, h, qb, name == "proxy")
                        err = max(err, (outs[name][0, r, h].double() - ref).abs().max().item())
                errs[name] = err
            totals = dict(zip(VARIANTS, timed_variants([calls[n] for n in VARIANTS])))
            prep, order, kern, kern_all, records = {}, {}, {}, {}, {}
            for name in VARIANTS:
                pm, om, rec = ctypes.c_double(), ctypes.c_double(), ctypes.c_longlong()
                pc, pi = proxy_sets[name]
                ok(LIB.bsattn_bench_prepare_time(plans[name].h, ptr(q), ptr(k), ptr(v), ptr(outs[name]), ptr(cnt),
                                                 ptr(idx), ptr(pc), ptr(pi), stream, 10, ctypes.byref(pm),
                                                 ctypes.byref(om), ctypes.byref(rec)))
                prep[name], order[name] = pm.value, om.value
                records[name] = rec.value / route_rows
                kern[name], kern_all[name] = kernel_ms(calls[name])
            for name in VARIANTS:
                bad = "" if errs[name] <= 2e-2 else " MISMATCH"
                rows.append(f"| {S} | {bq} x {block} | {name} | {totals[name]:.3f} | {1e3 * prep[name]:.1f} | "
                            f"{1e3 * order[name]:.1f} | {fmt(kern[name], '.3f')} | {fmt(kern_all[name], '.3f')} | "
                            f"{records[name]:.1f} | "
                            f"{errs[name]:.1e}{bad} |")
                print(rows[-1], flush=True)
            over = totals["proxy"] - totals["exact"]
            line = (f"S {S}, blocks {bq} x {block}: overhead {over:+.3f} ms ({100 * over / totals['exact']:+.1f} %) = "
                    f"route preparation {prep['proxy'] - prep['exact']:+.3f} ms")
            if all(kern[n] is not None for n in VARIANTS):
                line += (f" + kernel variant {kern['proxy-empty'] - kern['exact']:+.3f} ms"
                         f" + proxy steps {kern['proxy'] - kern['proxy-empty']:+.3f} ms")
            notes.append(line)
            print(line, flush=True)
            del plans, outs, calls
    benchlib.write(ARGS.out, rows + [""] + notes)


main()
