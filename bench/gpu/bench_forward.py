#!/usr/bin/env python3
"""GPU forward benchmark of bsattn against FlexAttention (same BlockMask), cuDNN SDPA and
FlashAttention-4 (same block pattern, as full-block lists: bench/gpu/peer_fa4.py).

bsattn runs through libbsattn_bench.so (bench/gpu/bench_shim.cpp) on the
very torch tensors the peers read. Every configuration is checked against a peer and against a
float32 reference on slices of query rows before it is timed; FlashAttention-4 is checked against
bsattn's output and the same reference before it is timed. Times are the median of >= 20
CUDA-event timings after warm-up; inputs are larger than L2.

  python3 bench/gpu/bench_forward.py --lib build-gpu/bench/gpu/libbsattn_bench.so [--peers all|core|none]
      [--rows forward|issue14|all]

--rows: "forward" (default) the issue-3 table; "issue14" the rows of issue 14 against
FlashAttention-4 (patterns per query head and shared by all heads, causal, causal + window,
packed documents (varlen), MHA H 40 with blocks of 64, D 64 / 256, other block shapes, S 8192,
dense); "all" both. --peers all|core|none, or a comma list of flex,cudnn,fa4 (those on every
row). FlashAttention-4 (`flash_attn.cute`) is imported lazily: where it is not importable its
column stays empty and the table says why.

Timing (bsattn and every peer alike; bench/RESULTS.md, 2026-12-06 16:30-17:00): after 3 warm-up
calls and --settle seconds (default 1) of back-to-back calls, --iters calls are queued behind a
GPU sleep and run back to back with an event between each two; the median of those per-call GPU
times. Under the 700 W limit an H100's clocks are high for the first tens of milliseconds after an
idle phase and then fall, more for kernels that draw more power per clock; and an event pair
around a call on an idle GPU also holds the host's launch path (FlashAttention-4's ~100-250 us
per call from Python). The method until 2026-12-06 (a sync after each call, no settling) had
both in it: --timing synced. --power adds each kernel's settled SM clock, board power
and GFLOP per joule over 2 s back to back.

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
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402
import peer_fa4  # noqa: E402  (imports flash_attn.cute only when asked)

P = argparse.ArgumentParser()
P.add_argument("--lib", required=True)
P.add_argument("--peers", default="all",
               help="all | core (peers on the core rows only) | none | comma list of flex,cudnn,fa4 (on every row)")
P.add_argument("--rows", default="forward", choices=["forward", "issue14", "all"],
               help="forward: the issue-3 table; issue14: the rows measured against FlashAttention-4; all: both")
P.add_argument("--iters", type=int, default=20)
P.add_argument("--only", default="", help="comma-separated config name prefixes")
P.add_argument("--out", default="", help="write the result table (markdown) here")
P.add_argument("--compare", nargs="+", default=[], help="other library builds timed against --lib, interleaved")
P.add_argument("--rounds", type=int, default=5, help="interleaved rounds per configuration with --compare")
P.add_argument("--timing", default="queued", choices=["queued", "synced"],
               help="queued: the timed calls run back to back behind a GPU sleep, an event between each two "
                    "(GPU time per call, the host's launch path hidden); synced: an event pair around each call "
                    "and a sync after it (the method until 2026-12-06)")
P.add_argument("--settle", type=float, default=1.0,
               help="queued timing: seconds of back-to-back calls before each timing (0: none; --compare rounds "
                    "never settle), so that every kernel is timed at the clocks the power limit settles to")
P.add_argument("--power", action="store_true",
               help="after timing, run bsattn and FlashAttention-4 back to back for 2 s each and report the SM "
                    "clock, board power and power-cap share nvidia-smi samples (the 'power' table)")
ARGS = P.parse_args()
PEER_NAMES = ("flex", "cudnn", "fa4")
if ARGS.peers not in ("all", "core", "none") and not set(ARGS.peers.split(",")) <= set(PEER_NAMES):
    P.error(f"--peers: all, core, none or a comma list of {','.join(PEER_NAMES)}")


def load(path):
    lib = ctypes.CDLL(os.path.abspath(path))
    lib.bsattn_bench_plan.restype = ctypes.c_void_p
    lib.bsattn_bench_plan.argtypes = [ctypes.c_int] * 12
    lib.bsattn_bench_run.restype = ctypes.c_int
    lib.bsattn_bench_run.argtypes = [ctypes.c_void_p] * 9
    lib.bsattn_bench_check.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    lib.bsattn_bench_free.argtypes = [ctypes.c_void_p]
    lib.bsattn_bench_error.restype = ctypes.c_char_p
    if hasattr(lib, "bsattn_bench_plan_varlen"):  # older builds lack it
        lib.bsattn_bench_plan_varlen.restype = ctypes.c_void_p
        lib.bsattn_bench_plan_varlen.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64] + [ctypes.c_int] * 8
        lib.bsattn_bench_run_varlen.restype = ctypes.c_int
        lib.bsattn_bench_run_varlen.argtypes = [ctypes.c_void_p] * 8
    if hasattr(lib, "bsattn_bench_plan_documents"):  # older builds lack it
        lib.bsattn_bench_plan_documents.restype = ctypes.c_void_p
        lib.bsattn_bench_plan_documents.argtypes = [ctypes.c_int] * 8
        lib.bsattn_bench_run_documents.restype = ctypes.c_int
        lib.bsattn_bench_run_documents.argtypes = [ctypes.c_void_p] * 8
    return lib


LIBS = [load(p) for p in [ARGS.lib] + ARGS.compare]

DEV = "cuda"
B, HQ, HKV = 1, 32, 8
W = 4096  # the sliding window of the "window" rows: kv in (q - W, q]
TOL = 2e-2  # bf16: relative L2 error accepted against a peer or the reference


@dataclass
class Row:
    """One configuration. kind: random (block lists, `density` of the KV blocks per row), causal,
    window (causal + sliding window W), docs (packed sequences of lengths `docs`, causal within
    each, varlen), docids (the same documents as one sequence with a document id per token: the
    kernels that read token tensors; FlashAttention-4 runs its varlen call on the same tokens).
    hs: random patterns one per KV head ("kv"), per query head ("q") or one shared by all heads
    ("1"). tier: which rows `--peers core` gives peers."""
    name: str
    S: int
    D: int = 128
    bq: int = 128
    bk: int = 128
    kind: str = "random"
    density: float = None
    tier: str = "core"
    hs: str = "kv"
    hq: int = HQ
    hkv: int = HKV
    docs: tuple = ()

    def heads(self):
        return {"kv": self.hkv, "q": self.hq, "1": 1}[self.hs]

    def tokens(self):
        return sum(self.docs) if self.kind in ("docs", "docids") else self.S


def ptr(t):
    return ctypes.c_void_p(t.data_ptr()) if t is not None else None


def stream():
    return ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)


class Ours:
    """bsattn on batched inputs: block lists (random rows) or all blocks + built-in mask."""

    def __init__(self, row, lib=LIBS[0]):
        self.lib = lib
        fmt, hs, causal, window_left = (1, row.heads(), False, -1) if row.kind == "random" else \
            (0, 1, True, W - 1 if row.kind == "window" else -1)
        self.h = lib.bsattn_bench_plan(B, row.S, row.hq, row.hkv, row.D, 0, row.bq, row.bk, fmt, hs, int(causal),
                                       window_left)
        if not self.h:
            raise RuntimeError(lib.bsattn_bench_error().decode())

    def __call__(self, x, out):
        if self.lib.bsattn_bench_run(self.h, ptr(x.q), ptr(x.k), ptr(x.v), ptr(out), ptr(x.lse), ptr(x.cnt), ptr(x.idx),
                                     stream()) != 0:
            raise RuntimeError(self.lib.bsattn_bench_error().decode())

    def check(self):
        if self.lib.bsattn_bench_check(self.h, stream()) != 0:
            raise RuntimeError(self.lib.bsattn_bench_error().decode())

    def __del__(self):
        if getattr(self, "h", None):
            self.lib.bsattn_bench_free(self.h)


class OursVarlen(Ours):
    """bsattn on packed sequences (kind docs): all blocks, causal within each sequence (the shim's
    varlen entry points; check and free are Ours')."""

    def __init__(self, row, lib=LIBS[0]):
        self.lib = lib
        if not hasattr(lib, "bsattn_bench_plan_varlen"):
            raise RuntimeError("this libbsattn_bench.so has no varlen entry points (rebuild it)")
        self.h = lib.bsattn_bench_plan_varlen(len(row.docs), max(row.docs), row.tokens(), row.hq, row.hkv, row.D, 0,
                                              row.bq, row.bk, 1, -1)
        if not self.h:
            raise RuntimeError(lib.bsattn_bench_error().decode())

    def __call__(self, x, out):
        if self.lib.bsattn_bench_run_varlen(self.h, ptr(x.q), ptr(x.k), ptr(x.v), ptr(x.cu), ptr(out), ptr(x.lse),
                                            stream()) != 0:
            raise RuntimeError(self.lib.bsattn_bench_error().decode())


class OursDocuments(Ours):
    """bsattn on the documents of a docids row as one batched sequence: all blocks, causal and a
    document id per token (check and free are Ours')."""

    def __init__(self, row, lib=LIBS[0]):
        self.lib = lib
        if not hasattr(lib, "bsattn_bench_plan_documents"):
            raise RuntimeError("this libbsattn_bench.so has no document-id entry points (rebuild it)")
        self.h = lib.bsattn_bench_plan_documents(row.tokens(), row.hq, row.hkv, row.D, 0, row.bq, row.bk, 1)
        if not self.h:
            raise RuntimeError(lib.bsattn_bench_error().decode())

    def __call__(self, x, out):
        if self.lib.bsattn_bench_run_documents(self.h, ptr(x.q), ptr(x.k), ptr(x.v), ptr(x.doc), ptr(out), ptr(x.lse),
                                               stream()) != 0:
            raise RuntimeError(self.lib.bsattn_bench_error().decode())


def ours_for(row, lib=LIBS[0]):
    return {"docs": OursVarlen, "docids": OursDocuments}.get(row.kind, Ours)(row, lib)


def document_ids(docs):
    """Token i's document: 0 for the first docs[0] tokens, then 1, ... (int64, on the GPU)."""
    return torch.repeat_interleave(torch.arange(len(docs), device=DEV), torch.tensor(docs, device=DEV))


def time_ms(fn, iters, settle=None):
    return benchlib.timed_by(ARGS.timing, fn, iters, ARGS.settle if settle is None else settle)


def rel_err(a, b):
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm()).item()


def random_pattern(S, bq, bk, hs, density, seed):
    """Exactly round(density * nKB) random KV blocks per row (ascending), per sparsity head."""
    nqb, nkb = -(-S // bq), -(-S // bk)
    k = max(1, round(density * nkb))
    g = torch.Generator(device=DEV).manual_seed(seed)
    scores = torch.rand(hs, nqb, nkb, generator=g, device=DEV)
    sel = scores.argsort(dim=-1)[..., :k].sort(dim=-1).values.int()
    idx = torch.zeros(1, hs, nqb, nkb, dtype=torch.int32, device=DEV)
    idx[0, :, :, :k] = sel
    cnt = torch.full((1, hs, nqb), k, dtype=torch.int32, device=DEV)
    return cnt, idx, k


def make_inputs(row, seed):
    """Q, K, V, LSE and the pattern of a row; blk is the bool block mask [Hs, nQB, nKB] bsattn's
    block lists encode (what FlashAttention-4 gets), cu the cu_seqlens of packed documents."""
    torch.manual_seed(seed)
    T, D = row.tokens(), row.D
    lead = (T,) if row.kind == "docs" else (B, T)
    x = SimpleNamespace(cnt=None, idx=None, kb=0, blk=None, cu=None, doc=None)
    x.q = torch.randn(*lead, row.hq, D, device=DEV, dtype=torch.bfloat16)
    x.k = torch.randn(*lead, row.hkv, D, device=DEV, dtype=torch.bfloat16)
    x.v = torch.randn(*lead, row.hkv, D, device=DEV, dtype=torch.bfloat16)
    x.lse = torch.empty(row.hq, T, device=DEV) if row.kind == "docs" else torch.empty(B, row.hq, T, device=DEV)
    if row.kind == "random":
        x.cnt, x.idx, x.kb = random_pattern(row.S, row.bq, row.bk, row.heads(), row.density, 7)
        x.blk = peer_fa4.block_mask_of(x.cnt, x.idx, -(-row.S // row.bk))
    if row.kind in ("docs", "docids"):
        x.cu = torch.tensor([0] + list(row.docs), device=DEV).cumsum(0).to(torch.int32)
    if row.kind == "docids":
        x.doc = document_ids(row.docs).to(torch.int32)[None].contiguous()
    return x


def pairs_of(row, x):
    """Kept (q, kv) pairs over all query heads (tails of partial blocks counted exactly)."""
    S, hq = row.S, row.hq
    if row.kind == "random":
        qlen = (S - torch.arange(x.blk.shape[1], device=DEV) * row.bq).clamp(max=row.bq).double()
        klen = (S - torch.arange(x.blk.shape[2], device=DEV) * row.bk).clamp(max=row.bk).double()
        per_pattern = (x.blk.double() * qlen[:, None] * klen[None, :]).sum().item()
        return per_pattern * (hq // row.heads()) * B
    if row.kind == "causal":
        return S * (S + 1) // 2 * hq * B
    if row.kind in ("docs", "docids"):
        return sum(n * (n + 1) // 2 for n in row.docs) * hq
    # causal sliding window: kv in (q - W, q]
    per_head = sum(min(q + 1, W) for q in range(0, min(S, W))) + max(0, S - W) * W
    return per_head * hq * B


def flex_runner(row, x, qh, kh, vh):
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
    import torch._dynamo
    # One compile per shape / block size / mask: more than dynamo's default limit of 8 here.
    torch._dynamo.config.recompile_limit = 64
    torch._dynamo.config.cache_size_limit = 64
    fa = torch.compile(flex_attention, dynamic=False)
    S, bq, bk = row.tokens(), row.bq, row.bk
    if row.kind == "random":
        g = row.hq // x.cnt.shape[1]
        full_cnt = x.cnt.repeat_interleave(g, dim=1).contiguous()
        full_idx = x.idx.repeat_interleave(g, dim=1).contiguous()
        bm = BlockMask.from_kv_blocks(torch.zeros_like(full_cnt), torch.zeros_like(full_idx), full_cnt, full_idx,
                                      BLOCK_SIZE=(bq, bk), mask_mod=None, seq_lengths=(S, S))
    else:
        if row.kind == "causal":
            def mod(b, h, q, kv):
                return q >= kv
        elif row.kind in ("docs", "docids"):
            doc = document_ids(row.docs)

            def mod(b, h, q, kv):
                return (q >= kv) & (doc[q] == doc[kv])
        else:
            def mod(b, h, q, kv):
                return (q >= kv) & (q - kv < W)
        bm = create_block_mask(mod, None, None, S, S, device=DEV, BLOCK_SIZE=(bq, bk))

    def run():
        return fa(qh, kh, vh, block_mask=bm, enable_gqa=True)
    return run


def cudnn(qh, kh, vh, causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return F.scaled_dot_product_attention(qh, kh, vh, is_causal=causal, enable_gqa=True)


def spot_errors(row, x, outs, rows=128):
    """Relative L2 error of each output (name -> O in Q's layout) against a float32 reference
    with an explicit token mask, on query heads 0 and Hq - 1 and the first and last `rows`
    tokens (every kind of row; independent of every engine and peer)."""
    T, hq, hkv = row.tokens(), row.hq, row.hkv
    q, k, v = (t.reshape(T, t.shape[-2], row.D) for t in (x.q, x.k, x.v))
    pos = torch.cat([torch.arange(0, min(rows, T)), torch.arange(max(T - rows, 0), T)]).unique().to(DEV)
    kpos = torch.arange(T, device=DEV)
    if row.kind in ("docs", "docids"):
        doc = document_ids(row.docs)
    errs = {n: [] for n in outs}
    for h in (0, hq - 1):
        hk = h // (hq // hkv)
        if row.kind == "random":
            pattern = x.blk[h // (hq // row.heads())]
            keep = pattern[pos // row.bq][:, kpos // row.bk]
        else:
            keep = kpos[None, :] <= pos[:, None]
            if row.kind == "window":
                keep &= pos[:, None] - kpos[None, :] < W
            if row.kind in ("docs", "docids"):
                keep &= doc[pos][:, None] == doc[kpos][None, :]
        s = (q[pos, h].float() @ k[:, hk].float().T) / math.sqrt(row.D)
        ref = torch.softmax(s.masked_fill(~keep, float("-inf")), -1) @ v[:, hk].float()
        for n, o in outs.items():
            errs[n].append((o.reshape(T, hq, row.D)[pos, h].float() - ref).norm().item() ** 2 / ref.norm().item() ** 2)
    return {n: math.sqrt(sum(e) / len(e)) for n, e in errs.items()}


def reference_check(D):
    """bsattn vs a float32 reference with an explicit dense mask (small problem, tails excluded), at
    head dim D: the first timed row's, which a library built for some head dims only (quick builds)
    has."""
    S, bq, bk = 1024, 128, 128
    row = Row("reference", S, D, bq, bk, "random", 0.3)
    torch.manual_seed(0)
    x = SimpleNamespace(cu=None)
    x.q = torch.randn(B, S, HQ, D, device=DEV, dtype=torch.bfloat16)
    x.k = torch.randn(B, S, HKV, D, device=DEV, dtype=torch.bfloat16)
    x.v = torch.randn(B, S, HKV, D, device=DEV, dtype=torch.bfloat16)
    out = torch.full_like(x.q, float("nan"))
    x.lse = torch.full((B, HQ, S), float("nan"), device=DEV)
    x.cnt, x.idx, kb = random_pattern(S, bq, bk, HKV, 0.3, 1)
    ours = Ours(row)
    ours(x, out)
    ours.check()
    blk = torch.zeros(HKV, S // bq, S // bk, dtype=torch.bool, device=DEV)
    blk.scatter_(2, x.idx[0, :, :, :kb].long(), True)
    dense = blk.repeat_interleave(bq, 1).repeat_interleave(bk, 2).repeat_interleave(HQ // HKV, 0)
    qh, kh, vh = (t.transpose(1, 2).float() for t in (x.q, x.k, x.v))
    kh = kh.repeat_interleave(HQ // HKV, 1)
    vh = vh.repeat_interleave(HQ // HKV, 1)
    s = (qh @ kh.transpose(-1, -2)) / math.sqrt(D)
    s = s.masked_fill(~dense[None], float("-inf"))
    ref_lse = torch.logsumexp(s, -1)
    ref = (torch.softmax(s, -1) @ vh).transpose(1, 2)
    err = rel_err(out, ref)
    lerr = (x.lse - ref_lse).abs().max().item()
    ok = err < 1e-2 and lerr < 1e-2 and not torch.isnan(out).any().item()
    print(f"reference check (S={S}, D={D}, random 0.3, GQA {HQ}/{HKV}): rel L2 {err:.2e}, LSE max err {lerr:.2e} -> "
          f"{'OK' if ok else 'FAIL'}", flush=True)
    return ok


def compare_variants(row, x, ref, out):
    """Median times of LIBS[0] and every --compare build, timed in interleaved rounds."""
    base = ref if ref is not None else out  # without peers: the variants against the main build
    runs = []
    for lib in LIBS:
        o = ours_for(row, lib)
        res = torch.full_like(out, float("nan"))
        o(x, res)
        o.check()
        e = rel_err(res, base)
        if not e < TOL:
            print(f"  MISMATCH {row.name} ({lib._name}): rel L2 {e:.3e}", flush=True)
        runs.append((o, res))
    times = [[] for _ in LIBS]
    for r in range(ARGS.rounds):
        order = range(len(runs)) if r % 2 == 0 else reversed(range(len(runs)))  # ABBA: no order bias
        for j in order:
            o, res = runs[j]
            times[j].append(time_ms(lambda: o(x, res), max(5, ARGS.iters // ARGS.rounds), settle=0))
    med = [statistics.median(ts) for ts in times]
    return med[0], med[1:]


def forward_rows():
    """The issue-3 table: one pattern per KV head."""
    rows = []
    for S in (8192, 32768):
        for d in (0.1, 0.25, 0.5, 1.0):
            rows.append(Row(f"S{S}-rand{d}", S, density=d))
        rows.append(Row(f"S{S}-causal", S, kind="causal"))
        rows.append(Row(f"S{S}-causal-win{W}", S, kind="window"))
    for D in (64, 256):
        rows.append(Row(f"S16384-D{D}-rand0.25", 16384, D, density=0.25, tier="all"))
    for bq, bk in ((64, 64), (128, 64), (64, 128), (256, 128)):
        rows.append(Row(f"S16384-blk{bq}x{bk}-rand0.25", 16384, 128, bq, bk, density=0.25, tier="all"))
    # Every block and a causal mask named with blocks of 64: a forward-only plan keeps them (only a
    # plan for the backward takes blocks of 128: docs/GPU.md, "Tiles").
    rows.append(Row("S16384-blk64x64-causal", 16384, 128, 64, 64, kind="causal", tier="all"))
    return rows


# Issue 14's packed documents: 16 sequences of 1 to 6000 tokens, 32 800 in all.
DOCS = (6000, 1, 3517, 5120, 129, 4096, 777, 2048, 5999, 64, 1500, 300, 1023, 1300, 17, 889)


def issue14_rows():
    """Issue 14's rows against FlashAttention-4 (Hq 32 / Hkv 8, D 128, blocks 128 unless said):
    patterns per query head ("qhead") and shared by all heads ("shared")."""
    rows = []
    for d in (0.1, 0.5):
        for hs, tag in (("q", "qhead"), ("1", "shared")):
            rows.append(Row(f"i14-S32768-rand{d}-{tag}", 32768, density=d, hs=hs))
    rows.append(Row("i14-S32768-dense", 32768, density=1.0, hs="1"))
    rows.append(Row("i14-S32768-causal", 32768, kind="causal"))
    rows.append(Row(f"i14-S32768-causal-win{W}", 32768, kind="window"))
    rows.append(Row("i14-docs16-causal-varlen", sum(DOCS), kind="docs", docs=DOCS))
    for S in (10800, 32768):  # issue 11's Sol shape: MHA H 40, blocks 64 x 64, a pattern per head
        rows.append(Row(f"i14-MHA40-S{S}-blk64-rand0.175", S, 128, 64, 64, density=0.175, hs="q", hq=40, hkv=40))
    for hs, tag in (("q", "qhead"), ("1", "shared")):
        for D in (64, 256):
            rows.append(Row(f"i14-S16384-D{D}-rand0.25-{tag}", 16384, D, density=0.25, hs=hs))
        for bq, bk in ((128, 64), (64, 128), (256, 128)):
            rows.append(Row(f"i14-S16384-blk{bq}x{bk}-rand0.25-{tag}", 16384, 128, bq, bk, density=0.25, hs=hs))
        rows.append(Row(f"i14-S8192-rand0.1-{tag}", 8192, density=0.1, hs=hs))
    rows.append(Row("i14-S8192-causal", 8192, kind="causal"))
    rows.append(Row("i14-docs16-causal-docids", sum(DOCS), kind="docids", docs=DOCS))
    return rows


def peers_for(row):
    if ARGS.peers == "all":
        return set(PEER_NAMES)
    if ARGS.peers == "core":
        return set(PEER_NAMES) if row.tier == "core" else set()
    if ARGS.peers == "none":
        return set()
    return set(ARGS.peers.split(","))


def fmt_peer(r, pn):
    return f"{r[pn]:.3f} ({r[pn + '_tf']:.0f})" if pn in r else "—"


def fa4_peer(row, x, out, notes):
    """FlashAttention-4 on the row's inputs and pattern: (median ms or None, rel L2 vs the
    reference, the timed callable or None). Checked against bsattn's output `out` and the
    reference first; a failure or a mismatch goes into `notes` and leaves the row untimed."""
    try:
        # docids: FA4's varlen call on the same tokens, packed views of the batched tensors.
        kind, q, k, v = ("docs", x.q[0], x.k[0], x.v[0]) if row.kind == "docids" else (row.kind, x.q, x.k, x.v)
        f4 = peer_fa4.runner(kind, q, k, v, blk=x.blk, bq=row.bq, bk=row.bk, window=W, cu_seqlens=x.cu,
                             max_seqlen=max(row.docs) if row.docs else None)
        o4 = f4()  # compiles on first use of a configuration: untimed
        torch.cuda.synchronize()
        e_ours = rel_err(o4, out)
        spot = spot_errors(row, x, {"fa4": o4})["fa4"]
        del o4
        if e_ours < TOL and spot < TOL:
            return time_ms(f4, ARGS.iters), spot, f4
        print(f"  MISMATCH {row.name}: FlashAttention-4 rel L2 vs bsattn {e_ours:.3e}, vs reference {spot:.3e}: "
              "not timed", flush=True)
        notes.append(f"fa4 mismatch (vs bsattn {e_ours:.1e}, vs reference {spot:.1e}): not timed")
        return None, spot, None
    except Exception as e:  # noqa: BLE001 - e.g. a block size or head dim FA4 does not support
        msg = f"{type(e).__name__}: {str(e)[:200]}"
        print(f"  FlashAttention-4 failed on {row.name}: {msg}", flush=True)
        notes.append(f"fa4 fails: {msg[:100]}")
        return None, float("nan"), None


POWER_HEADER = ("| config | kernel | TF/s back to back | SM MHz | board W | power-capped samples | GFLOP per J | C |\n"
                "| --- | --- | --- | --- | --- | --- | --- | --- |\n")


def power_line(name, flops, runs):
    """Table rows of --power: each (label, callable, median ms) run back to back for 2 s."""
    lines = []
    for label, fn, ms in runs:
        if fn is None or ms is None:
            continue
        p = benchlib.power_profile(fn, ms)
        if p is None:
            lines.append(f"| {name} | {label} | — | nvidia-smi gave no samples | | | | |")
            continue
        tf = flops / p["ms"] / 1e9
        lines.append(f"| {name} | {label} | {tf:.0f} | {p['mhz']:.0f} | {p['watts']:.0f} | {p['capped']:.0%} "
                     f"| {tf * 1e3 / p['watts']:.0f} | {p['temp']:.0f} |")
    return "\n".join(lines)


def table_of(rows, dense_time, fa4_note):
    """The markdown result table (fa4_note: why FlashAttention-4's columns are empty, or None)."""
    # time(d) / time(1.0) of random rows whose dense row (same S, D, blocks, heads) came later.
    for r in rows:
        if r["kind"] == "random" and r["dkey"] in dense_time:
            r["ratio_d"] = f"{r['ms'] / dense_time[r['dkey']]:.3f}"
    hdr = ("| config | bsattn ms | bsattn TF/s | FlexAttention ms (TF/s) | cuDNN ms (TF/s) | FlashAttention-4 ms (TF/s) "
           "| bsattn/Flex speed-up | bsattn/cuDNN speed-up | bsattn/FA4 speed-up | time(d)/time(1.0) | rel err vs peer "
           "| rel err vs reference: bsattn / FA4 | notes |")
    lines = [hdr, "|" + " --- |" * 13]

    def e(v):
        return "—" if v != v else format(v, ".1e")
    for r in rows:
        sp = [f"{r[pn] / r['ms']:.2f}x" if pn in r else "—" for pn in PEER_NAMES]
        lines.append(f"| {r['name']} | {r['ms']:.3f} | {r['tflops']:.0f} | {fmt_peer(r, 'flex')} | {fmt_peer(r, 'cudnn')} "
                     f"| {fmt_peer(r, 'fa4')} | {' | '.join(sp)} | {r['ratio_d'] or '—'} | {e(r['err'])} "
                     f"| {e(r['spot'])} / {e(r['fa4_spot'])} | {'; '.join(r['notes']) or '—'} |")
    if fa4_note:
        lines.append(f"\nFlashAttention-4 not importable ({fa4_note}): its columns are empty "
                     "(`source .peers/b/fa4-peer.sh install .peers` puts flash_attn.cute on PYTHONPATH).")
    return "\n".join(lines)


def main():
    fa4_ok, fa4_note = peer_fa4.available()
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}  date {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
          f"  FlashAttention-4: {fa4_note if fa4_ok else 'not importable'}", flush=True)
    configs = (forward_rows() if ARGS.rows in ("forward", "all") else []) + \
        (issue14_rows() if ARGS.rows in ("issue14", "all") else [])
    if ARGS.only:
        pre = ARGS.only.split(",")
        configs = [c for c in configs if any(c.name.startswith(p) for p in pre)]
    if not reference_check(configs[0].D if configs else 128):
        sys.exit(1)

    rows = []
    power_rows = []
    dense_time = {}
    fa4_wanted = False
    for row in configs:
        name, kind, d = row.name, row.kind, row.density
        x = make_inputs(row, hash(name) % 1000)
        out = torch.full_like(x.q, float("nan"))
        notes = []
        try:
            ours = ours_for(row)
            ours(x, out)
            ours.check()
        except RuntimeError as e:
            print(f"  bsattn failed on {name}: {e}", flush=True)
            continue
        torch.cuda.synchronize()
        flops = 4.0 * row.D * pairs_of(row, x)
        # Torch's [B, H, S, D] views (packed documents: one sequence of all tokens).
        qh, kh, vh = (t.transpose(1, 2) if t.dim() == 4 else t[None].transpose(1, 2) for t in (x.q, x.k, x.v))
        as_q = (lambda o: o.transpose(1, 2)) if kind != "docs" else (lambda o: o.transpose(1, 2)[0])
        # Peers: correctness of ours against them first.
        peer = {}
        want = peers_for(row)
        ref = None
        if "flex" in want:
            try:
                fr = flex_runner(row, x, qh, kh, vh)
                ref = as_q(fr())
                peer["flex"] = time_ms(fr, ARGS.iters)
            except Exception as e:  # noqa: BLE001
                print(f"  flex failed on {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                notes.append("flex failed")
        if "cudnn" in want and ((kind == "random" and d == 1.0) or kind == "causal"):
            causal = kind == "causal"
            try:
                cref = as_q(cudnn(qh, kh, vh, causal))
                ref = cref if ref is None else ref
                peer["cudnn"] = time_ms(lambda: cudnn(qh, kh, vh, causal), ARGS.iters)
            except Exception as e:  # noqa: BLE001
                print(f"  cudnn failed on {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                notes.append("cudnn failed")
        err = float("nan")
        if ref is not None:
            err = rel_err(out, ref)
            if not err < TOL:
                print(f"  MISMATCH {name}: rel L2 vs peer {err:.3e}", flush=True)
        spot = spot_errors(row, x, {"bsattn": out})["bsattn"]
        if not spot < TOL:
            print(f"  MISMATCH {name}: bsattn rel L2 vs float32 reference {spot:.3e}", flush=True)
            notes.append(f"bsattn vs reference {spot:.1e}")
        fa4_spot = float("nan")
        fa4_run = None
        if "fa4" in want:
            fa4_wanted = True
            if fa4_ok:  # else: the note under the table says why its column is empty
                t4, fa4_spot, fa4_run = fa4_peer(row, x, out, notes)
                if t4 is not None:
                    peer["fa4"] = t4
        run = lambda: ours(x, out)  # noqa: E731
        if ARGS.compare:
            t, extra = compare_variants(row, x, ref, out)
        else:
            t = time_ms(run, ARGS.iters)
        ours.check()
        tf = flops / t / 1e9
        if ARGS.power:
            power_rows.append(power_line(name, flops, [("bsattn", run, t), ("FlashAttention-4", fa4_run, peer.get("fa4"))]))
            print(power_rows[-1], flush=True)
        dkey = (row.S, row.D, row.bq, row.bk, row.hs, row.hq)
        if kind == "random" and d == 1.0:
            dense_time[dkey] = t
        ratio_d = f"{t / dense_time[dkey]:.3f}" if kind == "random" and dkey in dense_time else ""
        r = dict(name=name, ms=t, tflops=tf, err=err, spot=spot, fa4_spot=fa4_spot, ratio_d=ratio_d, notes=notes,
                 kind=kind, dkey=dkey)
        for pn, pt in peer.items():
            r[pn] = pt
            r[pn + "_tf"] = flops / pt / 1e9
        rows.append(r)
        line = f"{name:36s} bsattn {t:8.3f} ms {tf:6.1f} TF/s" + (f"  err {err:.1e}" if err == err else "")
        if ARGS.compare:
            line += "".join(f" | variant{j + 1} {flops / e / 1e9:6.1f} TF/s x{t / e:.3f}" for j, e in enumerate(extra))
        for pn, pt in peer.items():
            line += f" | {pn} {pt:8.3f} ms {flops / pt / 1e9:6.1f} TF/s  x{pt / t:.2f}"
        print(line, flush=True)
        if ARGS.out:  # after every row, so that a run cut short by a time limit leaves its table
            with open(ARGS.out, "w") as f:
                f.write(table_of(rows, dense_time, None) + "\n")
        fr = None
        del x, out, qh, kh, vh, ref
        torch.cuda.empty_cache()

    table = table_of(rows, dense_time, fa4_note if fa4_wanted and not fa4_ok else None)
    if power_rows:
        table += "\n\n" + POWER_HEADER + "\n".join(power_rows)
    print(table)
    if ARGS.out:
        with open(ARGS.out, "w") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    main()
