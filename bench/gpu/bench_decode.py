#!/usr/bin/env python3
"""Decode on the GPU (issue 12's targets): bsattn against FlashAttention-4 and FlexAttention in
the same run. bf16, Hq 32 / Hkv 8, D 128, KV blocks of 128 tokens.

Rows (the letters select them with --rows):
  a    dense decode, B = 32 sequences, L = 32768 cached tokens, 1 query each: TB/s of K+V read
       (bytes = 2 * B * L * Hkv * D * 2); target >= 4.0 TB/s
  b    block-sparse decode, same shape, density 0.25: round(0.25 * 256) random KV blocks kept per
       (sequence, KV head), the pattern shared by the 4 query heads of the group (bsattn: block
       lists [B, Hkv, 1, nKB]); TB/s of the kept K+V; target >= 3.5 TB/s
  c    B = 1, L = 131072, dense (split-KV needed); target >= 3.5 TB/s
  d    a and b with K/V in a paged cache, pages of 64 and of 16 (a shuffled block table; every
       paged result checked against the contiguous one): paged / contiguous time; targets <= 1.05
       (pages of 64), <= 1.15 (pages of 16)
  e    one decode step, B = 1, L = 8192: GPU time; target <= 20 us (K/V rotated over 8 copies, so
       that the 34 MB of one step is not served from L2)
  f    speculative decoding: 4 and 16 queries per sequence, B = 32, L = 8191, causal aligned
       bottom-right (query i sees the first L - Sq + 1 + i tokens); TB/s of K+V read

bsattn runs through its normal Plan (the shim's bsattn_bench_plan_kv_lists / run_kv_lists:
plan() picks the kernel for the problem; this driver does not care which). FlashAttention-4
(flash_attn.cute, imported as bench/gpu/peer_fa4.py does; its column shows "—" when it is not
importable): flash_attn_func with num_splits=0 (its split-KV heuristic; num_splits=1 when that
fails or mismatches), the sparse rows as full-block lists repeated over the query heads (FA4
takes a pattern per query head or one for all heads), paged rows through flash_attn_varlen_func
with page_table / seqused_k. FlexAttention: flex_attention under torch.compile, a BlockMask of the
same blocks (full blocks) for the sparse rows, a bottom-right causal mask_mod for row f; no paged
rows (FlexAttention has no paged K/V input).

Every result (bsattn and peers) is checked against a float32 reference (softmax over the kept
tokens, per sequence) before it is timed; a mismatch is reported and the row is not timed. Times:
median of --iters (>= 20) CUDA-event timings after warm-up; before each timed call the stream
sleeps --queue-us on the GPU (torch.cuda._sleep) so that all the call's launches are queued when
its start event fires: the events bracket GPU execution only (what "GPU time" means for row e),
not the host's launch cost. --budget: peers (whose first call compiles, seconds each) are not
started once the run is that many seconds old (bsattn rows always run): bsattn on every row
first, then the peers by priority (a, b, c, e, f, then the paged rows).

  python3 bench/gpu/bench_decode.py --lib build-gpu/bench/gpu/libbsattn_bench.so [--out decode.md]
      [--rows a,b,c,d,e,f] [--peers all|none|fa4|flex] [--iters 20] [--budget 50] [--queue-us 1000]
"""
import argparse
import math
import os
import sys
import time
from dataclasses import dataclass, field

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402
import peer_fa4  # noqa: E402  (imports flash_attn.cute only when asked)

P = argparse.ArgumentParser()
P.add_argument("--lib", required=True)
P.add_argument("--rows", default="a,b,c,d,e,f", help="comma list of a,b,c,d,e,f (d implies the contiguous a, b)")
P.add_argument("--peers", default="all", choices=["all", "none", "fa4", "flex"])
P.add_argument("--iters", type=int, default=20)
P.add_argument("--budget", type=float, default=50.0, help="seconds after which no peer is started (0: no limit)")
P.add_argument("--queue-us", type=float, default=1000.0, help="GPU sleep before each timed call (0: none)")
P.add_argument("--out", default="")
ARGS = P.parse_args()
ARGS.iters = max(20, ARGS.iters)
ROWS = set(ARGS.rows.split(","))
if not ROWS <= set("abcdef"):
    P.error("--rows: a comma list of a, b, c, d, e, f")

T0 = time.perf_counter()
DEV = "cuda"
HQ, HKV, D, BK = 32, 8, 128, 128
G = HQ // HKV
TOL = 2e-2  # relative L2 error accepted against the float32 reference (bf16 output)
LIB = benchlib.load(ARGS.lib, need=("bsattn_bench_plan_kv_lists", "bsattn_bench_run_kv_lists"))


@dataclass
class Row:
    key: str         # a, b, c, d64a, ...
    name: str
    B: int
    L: int
    sq: int = 1
    density: float = None  # None: dense
    causal: bool = False
    page: int = 0          # page size; 0: contiguous
    base: str = ""         # paged rows: the contiguous row they are compared with
    target: tuple = None   # ("TB/s", x) | ("us", x) | ("paged", x)
    rotate: int = 1        # copies of the inputs taken in turn (keeps a small step out of L2)
    res: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)


def rows_wanted():
    rows = []
    want = set(ROWS) | ({"a", "b"} if "d" in ROWS else set())
    if "a" in want:
        rows.append(Row("a", "(a) dense, B=32, L=32768", 32, 32768, target=("TB/s", 4.0)))
    if "b" in want:
        rows.append(Row("b", "(b) blocks 128, density 0.25, B=32, L=32768", 32, 32768, density=0.25,
                        target=("TB/s", 3.5)))
    if "c" in want:
        rows.append(Row("c", "(c) dense, B=1, L=131072", 1, 131072, target=("TB/s", 3.5)))
    if "e" in want:
        rows.append(Row("e", "(e) one decode step, B=1, L=8192", 1, 8192, target=("us", 20.0), rotate=8))
    if "f" in want:
        for sq in (4, 16):
            rows.append(Row(f"f{sq}", f"(f) {sq} queries, causal, B=32, L=8191", 32, 8191, sq=sq, causal=True))
    if "d" in ROWS:
        for base, label, dens in (("a", "dense", None), ("b", "density 0.25", 0.25)):
            for ps, tgt in ((64, 1.05), (16, 1.15)):
                rows.append(Row(f"{base}-p{ps}", f"(d) {label}, B=32, L=32768, pages of {ps}", 32, 32768,
                                density=dens, page=ps, base=base, target=("paged", tgt)))
    return rows


# Inputs are shared by rows of the same (B, L, Sq) (a, b and their paged rows read the same K/V).
INPUTS = {}


def inputs_of(row):
    key = (row.B, row.L, row.sq)
    if key not in INPUTS:
        torch.manual_seed(hash(key) % 10000)
        sets = []
        for _ in range(row.rotate):
            q = torch.randn(row.B, row.sq, HQ, D, dtype=torch.bfloat16, device=DEV)
            k = torch.randn(row.B, row.L, HKV, D, dtype=torch.bfloat16, device=DEV)
            v = torch.randn(row.B, row.L, HKV, D, dtype=torch.bfloat16, device=DEV)
            sets.append((q, k, v))
        INPUTS[key] = {"sets": sets, "paged": {}}
    return INPUTS[key]


PATTERNS = {}


def pattern_of(row):
    """(cnt [B, Hkv, 1], idx [B, Hkv, 1, nKB] int32 (kept blocks ascending, then zeros), blk
    [B, Hkv, nKB] bool, kept tokens over all (sequence, KV head)) of a sparse row."""
    key = (row.B, row.L, row.density)
    if key not in PATTERNS:
        nkb = -(-row.L // BK)
        keep = max(1, round(row.density * nkb))
        g = torch.Generator(device=DEV).manual_seed(12)
        chosen = torch.rand(row.B, HKV, nkb, generator=g, device=DEV).argsort(-1)[..., :keep].sort(-1).values
        idx = torch.zeros(row.B, HKV, 1, nkb, dtype=torch.int32, device=DEV)
        idx[:, :, 0, :keep] = chosen.to(torch.int32)
        cnt = torch.full((row.B, HKV, 1), keep, dtype=torch.int32, device=DEV)
        blk = torch.zeros(row.B, HKV, nkb, dtype=torch.bool, device=DEV)
        blk.scatter_(2, chosen, True)
        tokens = (row.L - torch.arange(nkb, device=DEV) * BK).clamp(max=BK)
        kept = int((blk.long() * tokens).sum().item())
        PATTERNS[key] = (cnt, idx, blk, kept)
    return PATTERNS[key]


def reference(q, k, v, blk=None, causal=False):
    """float32 O [B, Sq, Hq, D]: per sequence, softmax over the tokens of the kept blocks of the
    query's KV head (blk [B, Hkv, nKB]) and, when causal, kv <= i + L - Sq (bottom-right)."""
    B, sq = q.shape[:2]
    L = k.shape[1]
    out = torch.empty(B, sq, HQ, D, dtype=torch.float32, device=q.device)
    kpos = torch.arange(L, device=q.device)
    allowed = kpos[None, :] <= torch.arange(sq, device=q.device)[:, None] + (L - sq) if causal else None
    for b in range(B):
        s = torch.einsum("qhgd,khd->hgqk", q[b].float().view(sq, HKV, G, D), k[b].float()) / math.sqrt(D)
        if blk is not None:
            tok = blk[b].repeat_interleave(BK, dim=-1)[:, :L]  # [Hkv, L]
            s = s.masked_fill(~tok[:, None, None, :], float("-inf"))
        if allowed is not None:
            s = s.masked_fill(~allowed[None, None], float("-inf"))
        o = torch.einsum("hgqk,khd->qhgd", torch.softmax(s, -1), v[b].float())
        out[b] = o.reshape(sq, HQ, D)
    return out


def paged_of(row, x):
    """The row's K/V copies in a page cache of row.page tokens per page (made once per page size;
    rows a and b share it)."""
    if row.page not in x["paged"]:
        gen = torch.Generator().manual_seed(row.page)
        _, k, v = x["sets"][0]
        x["paged"][row.page] = benchlib.page(k, v, row.page, gen)
    return x["paged"][row.page]


def bsattn_row(row):
    """Checks and times bsattn on a row; fills row.res["bsattn"] = (ms, rel err)."""
    x = inputs_of(row)
    sparse = row.density is not None
    cnt = idx = blk = None
    if sparse:
        cnt, idx, blk, _ = pattern_of(row)
    pg = paged_of(row, x) if row.page else None
    per_seq, num_pages = (pg[4], pg[5]) if pg else (0, 0)
    plan = benchlib.Plan(LIB, LIB.bsattn_bench_plan_kv_lists(row.B, row.sq, row.L, HQ, HKV, D, int(row.causal), row.page,
                                                             per_seq, num_pages, int(sparse), BK, row.B, HKV))
    s = benchlib.stream()
    calls, outs = [], []
    for q, k, v in x["sets"]:
        out = torch.full_like(q, float("nan"))
        kk, vv, table, lens = (pg[0], pg[1], pg[2], pg[3]) if pg else (k, v, None, None)
        args = [benchlib.ptr(t) for t in (q, kk, vv, table, lens, cnt, idx, out)]
        calls.append(lambda a=args: benchlib.ok(LIB, LIB.bsattn_bench_run_kv_lists(plan.h, *a, None, s)))
        outs.append(out)
    calls[0]()
    plan.check()
    q, k, v = x["sets"][0]
    ref = x.get("ref_" + (row.base or row.key))  # a paged row reads its contiguous row's K/V
    if ref is None:
        ref = reference(q, k, v, blk, row.causal)
        x["ref_" + row.key] = ref
    err = benchlib.rel_err(outs[0], ref)
    row.res["ref0"] = ref
    if row.page:
        base = x.get("out_" + row.base)
        if base is not None:
            diff = (outs[0].float() - base.float()).abs().max().item()
            if not diff <= 1e-2:
                row.notes.append(f"paged differs from contiguous by {diff:.1e}")
    if not (err < TOL and torch.isfinite(outs[0]).all().item()):
        row.notes.append(f"bsattn MISMATCH vs reference ({err:.1e}): not timed")
        row.res["bsattn"] = (None, err)
        return
    if not row.page:
        x["out_" + row.key] = outs[0].clone()
    ms = benchlib.timed(calls, ARGS.iters, queue_us=ARGS.queue_us)
    plan.check()
    row.res["bsattn"] = (ms, err)


def fa4_calls(row, x, num_splits):
    """FlashAttention-4's calls on the row's input copies (one per copy)."""
    from flash_attn.cute import flash_attn_func, flash_attn_varlen_func
    from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch
    kw = {"num_splits": num_splits}
    if row.causal:
        kw["causal"] = True
    if row.density is not None:
        _, _, blk, _ = pattern_of(row)
        lists = [peer_fa4.fa4_lists(blk[b][:, None, :], HQ) for b in range(row.B)]  # [1, Hq, 1(, nKB)] each
        cnt = torch.cat([c for c, _ in lists]).contiguous()
        idx = torch.cat([i for _, i in lists]).contiguous()
        kw["block_sparse_tensors"] = BlockSparseTensorsTorch(
            mask_block_cnt=torch.zeros_like(cnt), mask_block_idx=torch.zeros_like(idx), full_block_cnt=cnt,
            full_block_idx=idx, block_size=(128, BK))
    calls = []
    for q, k, v in x["sets"]:
        if row.page:
            kc, vc, table, lens = paged_of(row, x)[:4]
            calls.append(lambda q=q, kc=kc, vc=vc, t=table, n=lens: flash_attn_varlen_func(
                q, kc, vc, page_table=t, seqused_k=n, **kw)[0])
        else:
            calls.append(lambda q=q, k=k, v=v: flash_attn_func(q, k, v, **kw)[0])
    return calls


FLEX = {}


def flex_calls(row, x):
    """FlexAttention's calls (compiled) on the row's input copies, O in q's layout."""
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
    if "fn" not in FLEX:
        import torch._dynamo as dynamo  # binds `dynamo` only (a bare `import torch._dynamo` would make torch local)
        dynamo.config.recompile_limit = 64  # one compile per shape / mask
        dynamo.config.cache_size_limit = 64
        FLEX["fn"] = torch.compile(flex_attention, dynamic=False)
    fa = FLEX["fn"]
    bm = None
    if row.density is not None:
        _, _, blk, _ = pattern_of(row)
        lists = [peer_fa4.fa4_lists(blk[b][:, None, :], HQ) for b in range(row.B)]
        cnt = torch.cat([c for c, _ in lists]).contiguous()
        idx = torch.cat([i for _, i in lists]).contiguous()
        bm = BlockMask.from_kv_blocks(torch.zeros_like(cnt), torch.zeros_like(idx), cnt, idx, BLOCK_SIZE=(128, BK),
                                      mask_mod=None, seq_lengths=(row.sq, row.L))
    elif row.causal:
        off = row.L - row.sq

        def mod(b, h, qi, ki):
            return ki <= qi + off
        bm = create_block_mask(mod, None, None, row.sq, row.L, device=DEV, BLOCK_SIZE=(128, BK))
    calls = []
    for q, k, v in x["sets"]:
        qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
        calls.append(lambda qh=qh, kh=kh, vh=vh: fa(qh, kh, vh, block_mask=bm, enable_gqa=True).transpose(1, 2))
    return calls


def peer_row(row, peer):
    """Checks and times one peer on a row; fills row.res[peer] = (ms, rel err) or a note."""
    x = inputs_of(row)
    ref = row.res.get("ref0")
    if ref is None:
        q, k, v = x["sets"][0]
        ref = reference(q, k, v, pattern_of(row)[2] if row.density is not None else None, row.causal)
    variants = [0, 1] if peer == "fa4" else [None]
    last = ""
    for ns in variants:
        try:
            calls = fa4_calls(row, x, ns) if peer == "fa4" else flex_calls(row, x)
            o = calls[0]()  # compiles on first use: untimed
            torch.cuda.synchronize()
            err = benchlib.rel_err(o, ref)
            del o
        except Exception as e:  # noqa: BLE001 - a peer that cannot run this row is reported, not fatal
            last = f"{type(e).__name__}: {str(e)[:150]}"
            print(f"  {peer} failed on {row.key}" + (f" (num_splits={ns})" if ns is not None else "") + f": {last}",
                  flush=True)
            continue
        if not err < TOL:
            last = f"mismatch vs reference {err:.1e}"
            print(f"  {peer} on {row.key}" + (f" (num_splits={ns})" if ns is not None else "") + f": {last}", flush=True)
            continue
        ms = benchlib.timed(calls, ARGS.iters, queue_us=ARGS.queue_us)
        row.res[peer] = (ms, err)
        if peer == "fa4":
            row.notes.append(f"FA4 num_splits={'auto' if ns == 0 else ns}")
        return
    row.notes.append(f"{peer}: {last[:100]}")


def fmt_time(r, key):
    return f"{r[key][0] * 1e3:.1f}" if key in r and r[key][0] is not None else "—"


def fmt_tbs(r, key, nbytes):
    return f"{nbytes / (r[key][0] * 1e-3) / 1e12:.2f}" if key in r and r[key][0] is not None else "—"


def table(rows, fa4_note):
    byk = {r.key: r for r in rows}
    lines = [benchlib.header(f"bf16, Hq {HQ} / Hkv {HKV}, D {D}, KV blocks {BK}; median of {ARGS.iters} CUDA-event "
                             f"timings, " + (f"GPU queue filled {ARGS.queue_us:.0f} us ahead" if ARGS.queue_us > 0 and
                                             benchlib.queue_ahead_available() else
                                             "no queue-ahead (events include host launch time)")), "",
             "| row | bsattn us | bsattn TB/s | FA4 us | FA4 TB/s | Flex us | Flex TB/s | paged / contiguous: bsattn; FA4 "
             "| target | bsattn vs target (>= 1 meets) | rel err vs float32: bsattn / FA4 / Flex | notes |",
             "|" + " --- |" * 12]
    for r in rows:
        nbytes = kv_bytes_of(r)
        res = r.res
        ratio, vs, tgt = "—", "—", "—"
        if r.page and r.base in byk:
            parts = []
            for key in ("bsattn", "fa4"):
                a, b = res.get(key, (None,))[0], byk[r.base].res.get(key, (None,))[0]
                parts.append(f"{a / b:.3f}" if a and b else "—")
            ratio = "; ".join(parts)
        if r.target:
            kind, val = r.target
            ms = res.get("bsattn", (None,))[0]
            if kind == "TB/s":
                tgt = f">= {val} TB/s"
                vs = f"{nbytes / (ms * 1e-3) / 1e12 / val:.2f}" if ms else "—"
            elif kind == "us":
                tgt = f"<= {val:.0f} us"
                vs = f"{val / (ms * 1e3):.2f}" if ms else "—"
            else:
                tgt = f"paged / contiguous <= {val}"
                b = byk[r.base].res.get("bsattn", (None,))[0] if r.base in byk else None
                vs = f"{val / (ms / b):.2f}" if ms and b else "—"
        errs = " / ".join(f"{res[k][1]:.1e}" if k in res else "—" for k in ("bsattn", "fa4", "flex"))
        lines.append(f"| {r.name} | {fmt_time(res, 'bsattn')} | {fmt_tbs(res, 'bsattn', nbytes)} | {fmt_time(res, 'fa4')} "
                     f"| {fmt_tbs(res, 'fa4', nbytes)} | {fmt_time(res, 'flex')} | {fmt_tbs(res, 'flex', nbytes)} "
                     f"| {ratio} | {tgt} | {vs} | {errs} | {'; '.join(r.notes) or '—'} |")
    lines.append("")
    lines.append("TB/s: bytes of K+V a step reads (dense: 2 * B * L * Hkv * D * 2; sparse: the kept blocks' tokens) / "
                 "time. FA4 gets the sparse pattern repeated over the query heads of a group (it takes one per query "
                 "head or one for all heads); FlexAttention has no paged rows.")
    if fa4_note:
        lines.append(f"FlashAttention-4 not importable ({fa4_note}): its columns are empty.")
    return lines


def kv_bytes_of(row):
    """Bytes of K+V one step reads: every token (dense) or the tokens of the kept blocks."""
    if row.density is None:
        return row.B * row.L * 2 * HKV * D * 2
    return pattern_of(row)[3] * 2 * D * 2


def main():
    fa4_ok, fa4_note = peer_fa4.available()
    want_fa4 = ARGS.peers in ("all", "fa4") and fa4_ok
    want_flex = ARGS.peers in ("all", "flex")
    print(f"{benchlib.header()}  FlashAttention-4: {fa4_note if fa4_ok else 'not importable: ' + fa4_note}", flush=True)
    rows = rows_wanted()

    def save():
        benchlib.write(ARGS.out, table(rows, None if fa4_ok or ARGS.peers in ("none", "flex") else fa4_note))

    for r in rows:  # bsattn on every row first (cheap: no compilation)
        try:
            bsattn_row(r)
        except Exception as e:  # noqa: BLE001 - reported in the row, the run goes on
            print(f"  bsattn failed on {r.key}: {e}", flush=True)
            r.notes.append(f"bsattn failed: {str(e)[:120]}")
        ms, err = r.res.get("bsattn", (None, float("nan")))
        nbytes = kv_bytes_of(r)
        print(f"[{time.perf_counter() - T0:5.1f} s] {r.key:7s} bsattn "
              + (f"{ms * 1e3:9.1f} us {nbytes / (ms * 1e-3) / 1e12:5.2f} TB/s" if ms else "not timed")
              + f"  rel err {err:.1e}", flush=True)
        save()
    # Peers by priority: the contiguous rows a, b, c, e, f, then the paged rows (FA4 only).
    order = [r for r in rows if not r.page] + [r for r in rows if r.page]
    tasks = []
    for r in order:
        if want_fa4:
            tasks.append((r, "fa4"))
        if want_flex and not r.page:
            tasks.append((r, "flex"))
    for r, peer in tasks:
        if ARGS.budget > 0 and time.perf_counter() - T0 > ARGS.budget:
            r.notes.append(f"{peer} not run (--budget {ARGS.budget:.0f} s)")
            continue
        t = time.perf_counter()
        peer_row(r, peer)
        ms = r.res.get(peer, (None,))[0]
        nbytes = kv_bytes_of(r)
        print(f"[{time.perf_counter() - T0:5.1f} s] {r.key:7s} {peer:6s} "
              + (f"{ms * 1e3:9.1f} us {nbytes / (ms * 1e-3) / 1e12:5.2f} TB/s" if ms else "not timed")
              + f"  ({time.perf_counter() - t:.1f} s with compilation)", flush=True)
        save()
    lines = table(rows, None if fa4_ok or ARGS.peers in ("none", "flex") else fa4_note)
    print("\n".join(lines))
    benchlib.write(ARGS.out, lines)


if __name__ == "__main__":
    main()
