#!/usr/bin/env python3
"""GPU forward benchmark of bsattn against FlexAttention (same BlockMask) and cuDNN SDPA.

bsattn runs through libbsattn_bench.so (bench/gpu/bench_shim.cpp) on the very torch tensors the
peers read. Every configuration is checked against a peer (or a float32 reference) before it is
timed; times are the median of >= 20 CUDA-event timings after warm-up; inputs are larger than L2.

  python3 bench/gpu/bench_forward.py --lib build-gpu/bench/gpu/libbsattn_bench.so [--peers all|core|none]

--compare LIB...: also time other builds of the library (kernel variants) on the same inputs,
interleaved with the main one in rounds (order reversed every other round), so that clock and
thermal drift hit every variant alike.
"""
import argparse
import ctypes
import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

P = argparse.ArgumentParser()
P.add_argument("--lib", required=True)
P.add_argument("--peers", default="all", choices=["all", "core", "none"])
P.add_argument("--iters", type=int, default=20)
P.add_argument("--only", default="", help="comma-separated config name prefixes")
P.add_argument("--out", default="", help="write the result table (markdown) here")
P.add_argument("--compare", nargs="+", default=[], help="other library builds timed against --lib, interleaved")
P.add_argument("--rounds", type=int, default=5, help="interleaved rounds per configuration with --compare")
ARGS = P.parse_args()


def load(path):
    lib = ctypes.CDLL(os.path.abspath(path))
    lib.bsattn_bench_plan.restype = ctypes.c_void_p
    lib.bsattn_bench_plan.argtypes = [ctypes.c_int] * 12
    lib.bsattn_bench_run.restype = ctypes.c_int
    lib.bsattn_bench_run.argtypes = [ctypes.c_void_p] * 9
    lib.bsattn_bench_check.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    lib.bsattn_bench_free.argtypes = [ctypes.c_void_p]
    lib.bsattn_bench_error.restype = ctypes.c_char_p
    return lib


LIBS = [load(p) for p in [ARGS.lib] + ARGS.compare]

DEV = "cuda"
B, HQ, HKV = 1, 32, 8


def ptr(t):
    return ctypes.c_void_p(t.data_ptr()) if t is not None else None


class Ours:
    def __init__(self, S, D, bq, bk, fmt, hs, causal, window_left, dtype, lib=LIBS[0]):
        self.lib = lib
        self.h = lib.bsattn_bench_plan(B, S, HQ, HKV, D, int(dtype == torch.float16), bq, bk, fmt, hs,
                                       int(causal), window_left)
        if not self.h:
            raise RuntimeError(lib.bsattn_bench_error().decode())

    def __call__(self, q, k, v, out, lse, cnt, idx):
        s = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        lib = self.lib
        if lib.bsattn_bench_run(self.h, ptr(q), ptr(k), ptr(v), ptr(out), ptr(lse), ptr(cnt), ptr(idx), s) != 0:
            raise RuntimeError(lib.bsattn_bench_error().decode())

    def check(self):
        s = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        if self.lib.bsattn_bench_check(self.h, s) != 0:
            raise RuntimeError(self.lib.bsattn_bench_error().decode())

    def __del__(self):
        if getattr(self, "h", None):
            self.lib.bsattn_bench_free(self.h)


def time_ms(fn, iters):
    for _ in range(3):
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


def random_pattern(S, bq, bk, hs, density, seed):
    """Exactly round(density * nKB) random KV blocks per row (ascending), per sparsity head."""
    nqb, nkb = S // bq, S // bk
    k = max(1, round(density * nkb))
    g = torch.Generator(device=DEV).manual_seed(seed)
    scores = torch.rand(hs, nqb, nkb, generator=g, device=DEV)
    sel = scores.argsort(dim=-1)[..., :k].sort(dim=-1).values.int()
    idx = torch.zeros(1, hs, nqb, nkb, dtype=torch.int32, device=DEV)
    idx[0, :, :, :k] = sel
    cnt = torch.full((1, hs, nqb), k, dtype=torch.int32, device=DEV)
    return cnt, idx, k


def flex_runner(S, D, bq, bk, kind, cnt, idx, window):
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
    import torch._dynamo
    # One compile per shape / block size / mask: more than dynamo's default limit of 8 here.
    torch._dynamo.config.recompile_limit = 64
    torch._dynamo.config.cache_size_limit = 64
    fa = torch.compile(flex_attention, dynamic=False)
    if kind == "random":
        g = HQ // cnt.shape[1]
        full_cnt = cnt.repeat_interleave(g, dim=1).contiguous()
        full_idx = idx.repeat_interleave(g, dim=1).contiguous()
        bm = BlockMask.from_kv_blocks(torch.zeros_like(full_cnt), torch.zeros_like(full_idx), full_cnt, full_idx,
                                      BLOCK_SIZE=(bq, bk), mask_mod=None, seq_lengths=(S, S))
    else:
        if kind == "causal":
            def mod(b, h, q, kv):
                return q >= kv
        else:
            def mod(b, h, q, kv):
                return (q >= kv) & (q - kv < window)
        bm = create_block_mask(mod, None, None, S, S, device=DEV, BLOCK_SIZE=(bq, bk))

    def run(qh, kh, vh):
        return fa(qh, kh, vh, block_mask=bm, enable_gqa=True)
    return run


def cudnn(qh, kh, vh, causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return F.scaled_dot_product_attention(qh, kh, vh, is_causal=causal, enable_gqa=True)


def pairs_of(kind, S, bq, bk, k_blocks, window):
    if kind == "random":
        return (S // bq) * k_blocks * bq * bk * HQ * B
    if kind == "causal":
        return S * (S + 1) // 2 * HQ * B
    # causal sliding window: kv in (q - window, q]
    w = window
    per_head = sum(min(q + 1, w) for q in range(0, min(S, w))) + max(0, S - w) * w
    return per_head * HQ * B


def reference_check():
    """bsattn vs a float32 reference with an explicit dense mask (small problem, tails excluded)."""
    S, D, bq, bk = 1024, 128, 128, 128
    torch.manual_seed(0)
    q = torch.randn(B, S, HQ, D, device=DEV, dtype=torch.bfloat16)
    k = torch.randn(B, S, HKV, D, device=DEV, dtype=torch.bfloat16)
    v = torch.randn(B, S, HKV, D, device=DEV, dtype=torch.bfloat16)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((B, HQ, S), float("nan"), device=DEV)
    cnt, idx, kb = random_pattern(S, bq, bk, HKV, 0.3, 1)
    ours = Ours(S, D, bq, bk, 1, HKV, False, -1, torch.bfloat16)
    ours(q, k, v, out, lse, cnt, idx)
    ours.check()
    blk = torch.zeros(HKV, S // bq, S // bk, dtype=torch.bool, device=DEV)
    blk.scatter_(2, idx[0, :, :, :kb].long(), True)
    dense = blk.repeat_interleave(bq, 1).repeat_interleave(bk, 2).repeat_interleave(HQ // HKV, 0)
    qh, kh, vh = (t.transpose(1, 2).float() for t in (q, k, v))
    kh = kh.repeat_interleave(HQ // HKV, 1)
    vh = vh.repeat_interleave(HQ // HKV, 1)
    s = (qh @ kh.transpose(-1, -2)) / math.sqrt(D)
    s = s.masked_fill(~dense[None], float("-inf"))
    ref_lse = torch.logsumexp(s, -1)
    ref = (torch.softmax(s, -1) @ vh).transpose(1, 2)
    err = ((out.float() - ref).norm() / ref.norm()).item()
    lerr = (lse - ref_lse).abs().max().item()
    ok = err < 1e-2 and lerr < 1e-2 and not torch.isnan(out).any().item()
    print(f"reference check (S={S}, random 0.3, GQA {HQ}/{HKV}): rel L2 {err:.2e}, LSE max err {lerr:.2e} -> "
          f"{'OK' if ok else 'FAIL'}", flush=True)
    return ok


def plan_args(kind, W):
    """Ours(...) format, sparsity heads, causal and window_left of a configuration kind."""
    return (1, HKV, False, -1) if kind == "random" else (0, 1, True, W - 1 if kind == "window" else -1)


def compare_variants(name, S, D, bq, bk, kind, W, q, k, v, lse, cnt, idx, ref, out):
    """Median times of LIBS[0] and every --compare build, timed in interleaved rounds."""
    base = ref if ref is not None else out  # without peers: the variants against the main build
    runs = []
    for lib in LIBS:
        o = Ours(S, D, bq, bk, *plan_args(kind, W), torch.bfloat16, lib)
        res = torch.full_like(out, float("nan"))
        o(q, k, v, res, lse, cnt, idx)
        o.check()
        e = ((res.float() - base.float()).norm() / base.float().norm()).item()
        if not e < 2e-2:
            print(f"  MISMATCH {name} ({lib._name}): rel L2 {e:.3e}", flush=True)
        runs.append((o, res))
    times = [[] for _ in LIBS]
    for r in range(ARGS.rounds):
        order = range(len(runs)) if r % 2 == 0 else reversed(range(len(runs)))  # ABBA: no order bias
        for j in order:
            o, res = runs[j]
            times[j].append(time_ms(lambda: o(q, k, v, res, lse, cnt, idx), max(5, ARGS.iters // ARGS.rounds)))
    med = [statistics.median(ts) for ts in times]
    return med[0], med[1:]


def main():
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}  date {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
          flush=True)
    if not reference_check():
        sys.exit(1)
    W = 4096
    configs = []
    for S in (8192, 32768):
        for d in (0.1, 0.25, 0.5, 1.0):
            configs.append((f"S{S}-rand{d}", S, 128, 128, 128, "random", d, "core"))
        configs.append((f"S{S}-causal", S, 128, 128, 128, "causal", None, "core"))
        configs.append((f"S{S}-causal-win{W}", S, 128, 128, 128, "window", None, "core"))
    for D in (64, 256):
        configs.append((f"S16384-D{D}-rand0.25", 16384, D, 128, 128, "random", 0.25, "all"))
    for bq, bk in ((64, 64), (128, 64), (64, 128), (256, 128)):
        configs.append((f"S16384-blk{bq}x{bk}-rand0.25", 16384, 128, bq, bk, "random", 0.25, "all"))
    if ARGS.only:
        pre = ARGS.only.split(",")
        configs = [c for c in configs if any(c[0].startswith(p) for p in pre)]

    rows = []
    dense_time = {}
    for name, S, D, bq, bk, kind, d, tier in configs:
        torch.manual_seed(hash(name) % 1000)
        q = torch.randn(B, S, HQ, D, device=DEV, dtype=torch.bfloat16)
        k = torch.randn(B, S, HKV, D, device=DEV, dtype=torch.bfloat16)
        v = torch.randn(B, S, HKV, D, device=DEV, dtype=torch.bfloat16)
        out = torch.full_like(q, float("nan"))
        lse = torch.empty(B, HQ, S, device=DEV)
        qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
        if kind == "random":
            cnt, idx, kb = random_pattern(S, bq, bk, HKV, d, 7)
        else:
            cnt = idx = None
            kb = 0
        ours = Ours(S, D, bq, bk, *plan_args(kind, W), torch.bfloat16)
        flops = 4.0 * D * pairs_of(kind, S, bq, bk, kb, W)
        run = lambda: ours(q, k, v, out, lse, cnt, idx)
        run()
        ours.check()
        torch.cuda.synchronize()
        # Peers: correctness of ours against them first.
        peer = {}
        want_peers = ARGS.peers == "all" or (ARGS.peers == "core" and tier == "core")
        ref = None
        if want_peers:
            try:
                fr = flex_runner(S, D, bq, bk, kind, cnt, idx, W)
                ref = fr(qh, kh, vh).transpose(1, 2)
                peer["flex"] = time_ms(lambda: fr(qh, kh, vh), ARGS.iters)
            except Exception as e:  # noqa: BLE001
                print(f"  flex failed on {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            if (kind == "random" and d == 1.0) or kind == "causal":
                causal = kind == "causal"
                try:
                    cref = cudnn(qh, kh, vh, causal).transpose(1, 2)
                    ref = cref if ref is None else ref
                    peer["cudnn"] = time_ms(lambda: cudnn(qh, kh, vh, causal), ARGS.iters)
                except Exception as e:  # noqa: BLE001
                    print(f"  cudnn failed on {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
        err = float("nan")
        if ref is not None:
            err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            if not err < 2e-2:
                print(f"  MISMATCH {name}: rel L2 vs peer {err:.3e}", flush=True)
        if ARGS.compare:
            t, extra = compare_variants(name, S, D, bq, bk, kind, W, q, k, v, lse, cnt, idx, ref, out)
        else:
            t = time_ms(run, ARGS.iters)
        ours.check()
        tf = flops / t / 1e9
        if kind == "random" and d == 1.0:
            dense_time[S] = t
        ratio_d = ""
        if kind == "random" and S in dense_time:
            ratio_d = f"{t / dense_time[S]:.3f}"
        row = dict(name=name, ms=t, tflops=tf, err=err, ratio_d=ratio_d)
        for pn, pt in peer.items():
            row[pn] = pt
            row[pn + "_tf"] = flops / pt / 1e9
        rows.append(row)
        line = f"{name:28s} bsattn {t:8.3f} ms {tf:6.1f} TF/s" + (f"  err {err:.1e}" if err == err else "")
        if ARGS.compare:
            line += "".join(f" | variant{j + 1} {flops / e / 1e9:6.1f} TF/s x{t / e:.3f}" for j, e in enumerate(extra))
        for pn, pt in peer.items():
            line += f" | {pn} {pt:8.3f} ms {flops / pt / 1e9:6.1f} TF/s  x{pt / t:.2f}"
        print(line, flush=True)
        del q, k, v, out, lse, qh, kh, vh, ref
        torch.cuda.empty_cache()

    # time(d) / time(1.0) per S (filled in once density 1.0 was timed: it comes last per S).
    for r in rows:
        for S in dense_time:
            if r["name"].startswith(f"S{S}-rand"):
                r["ratio_d"] = f"{r['ms'] / dense_time[S]:.3f}"
    hdr = "| config | bsattn ms | bsattn TF/s | FlexAttention ms (TF/s) | cuDNN ms (TF/s) | bsattn/Flex speed-up | bsattn/cuDNN speed-up | time(d)/time(1.0) | rel err vs peer |"
    lines = [hdr, "|" + " --- |" * 9]
    for r in rows:
        fx = f"{r['flex']:.3f} ({r['flex_tf']:.0f})" if "flex" in r else "—"
        cd = f"{r['cudnn']:.3f} ({r['cudnn_tf']:.0f})" if "cudnn" in r else "—"
        sf = f"{r['flex'] / r['ms']:.2f}x" if "flex" in r else "—"
        sc = f"{r['cudnn'] / r['ms']:.2f}x" if "cudnn" in r else "—"
        lines.append(f"| {r['name']} | {r['ms']:.3f} | {r['tflops']:.0f} | {fx} | {cd} | {sf} | {sc} | {r['ratio_d'] or '—'} | {'—' if r['err'] != r['err'] else format(r['err'], '.1e')} |")
    table = "\n".join(lines)
    print(table)
    if ARGS.out:
        with open(ARGS.out, "w") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    main()
