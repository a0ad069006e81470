"""FlashAttention-4 (flash-attn-4, CuTe DSL: `flash_attn.cute`) as a peer of bench_forward.py.

FA4 runs the very pattern bsattn runs, given the way ../shared/BENCH.md's FA4 figures were taken:
block patterns as `BlockSparseTensorsTorch` *full-block* lists (no mask_mod; the partial "mask"
lists are empty), one pattern per query head (heads dim = Hq) or shared by all heads (heads dim
1, which keeps FA4's GQA packing); a pattern per KV head is repeated over the query heads of its
group (FA4's heads dim must be 1 or Hq). Causal and causal + sliding window use FA4's own
arguments (`causal=True`, `window_size=(W - 1, 0)`: kv in (q - W, q]), packed documents its varlen
call (`flash_attn_varlen_func`, cu_seqlens), and a pattern that keeps every block its dense call.

Written against flash-attn-4 4.0.0b36 (the version ../shared/tools/fa4-peer.sh installs).
`flash_attn.cute` is imported lazily: this module imports (and its pattern conversion runs, on
any device) without it, so the driver and the CPU unit test (tests/python/
test_bench_fa4_pattern.py) work where FA4 is not installed.
"""
import torch

_STATE = {}  # "mod": (flash_attn_func, flash_attn_varlen_func, BlockSparseTensorsTorch) or "note"


def available():
    """(True, version) when flash_attn.cute imports, else (False, why). Imports once."""
    if "mod" not in _STATE and "note" not in _STATE:
        try:
            from flash_attn.cute import flash_attn_func, flash_attn_varlen_func
            from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch
            import flash_attn.cute as fc
            _STATE["mod"] = (flash_attn_func, flash_attn_varlen_func, BlockSparseTensorsTorch)
            _STATE["version"] = getattr(fc, "__version__", "?")
        except Exception as e:  # noqa: BLE001 - any import failure means: no FA4 peer
            _STATE["note"] = f"{type(e).__name__}: {str(e)[:160]}"
    if "mod" in _STATE:
        return True, _STATE["version"]
    return False, _STATE["note"]


def block_mask_of(cnt, idx, nkb):
    """The bool block mask [Hs, nQB, nKB] of bsattn's block lists (SPEC §3 format 1, batch 1):
    row (h, qb) keeps idx[0, h, qb, :cnt[0, h, qb]]."""
    hs, nqb = cnt.shape[1], cnt.shape[2]
    L = idx.shape[3]
    valid = torch.arange(L, device=idx.device) < cnt[0, :, :, None]          # [Hs, nQB, L]
    blk = torch.zeros(hs, nqb, nkb + 1, dtype=torch.bool, device=idx.device)  # column nkb: the unused slots
    col = torch.where(valid, idx[0].long(), torch.full_like(idx[0].long(), nkb))
    blk.scatter_(2, col, True)
    return blk[:, :, :nkb]


def fa4_lists(blk, hq):
    """FA4 full-block lists of a bool block mask [Hs, nQB, nKB]: (cnt [1, H, nQB] int32,
    idx [1, H, nQB, nKB] int32), kept blocks first in ascending order, the rest of a row zero.
    H = 1 for a shared pattern (Hs = 1), else Hq (Hs = Hkv: each pattern repeated over its group)."""
    hs = blk.shape[0]
    if hs != 1 and hs != hq:
        if hq % hs:
            raise ValueError(f"{hs} sparsity heads do not divide {hq} query heads")
        blk = blk.repeat_interleave(hq // hs, dim=0)  # query head h uses pattern h // (hq / hs)
    cnt = blk.sum(-1, dtype=torch.int32)
    order = torch.sort((~blk).to(torch.int8), dim=-1, stable=True).indices.to(torch.int32)
    idx = torch.where(torch.arange(blk.shape[-1], device=blk.device) < cnt[..., None], order, 0).to(torch.int32)
    return cnt[None].contiguous(), idx[None].contiguous()


def sparse_tensors(blk, hq, bq, bk):
    """FA4's BlockSparseTensorsTorch for a bool block mask: empty partial ("mask") lists, the
    pattern as full-block lists, block_size (bq, bk) so that FA4 fits its tiles to the blocks."""
    bst = _STATE["mod"][2]
    cnt, idx = fa4_lists(blk, hq)
    return bst(mask_block_cnt=torch.zeros_like(cnt), mask_block_idx=torch.zeros_like(idx),
               full_block_cnt=cnt, full_block_idx=idx, block_size=(bq, bk))


def runner(kind, q, k, v, *, blk=None, bq=128, bk=128, window=None, cu_seqlens=None, max_seqlen=None):
    """A no-argument callable that runs FA4 on q [B, S, Hq, D] / k, v [B, S, Hkv, D] (or packed
    [total, H, D] with cu_seqlens for kind "docs") and returns O in q's layout. kind: "random"
    (blk: the bool block mask bsattn runs), "causal", "window" (causal + window of `window`
    tokens), "docs" (causal within each packed sequence). The block-sparse tensors are built here,
    once, outside the timed call (as FlexAttention's BlockMask is)."""
    ok, note = available()
    if not ok:
        raise RuntimeError(f"flash_attn.cute not importable: {note}")
    func, varlen_func, _ = _STATE["mod"]
    hq = q.shape[-2]
    if kind == "random" and bool(blk.all()):
        kind = "dense"  # every block kept: FA4's dense path
    if kind == "random":
        bst = sparse_tensors(blk, hq, bq, bk)
        return lambda: func(q, k, v, block_sparse_tensors=bst)[0]
    if kind == "dense":
        return lambda: func(q, k, v)[0]
    if kind == "causal":
        return lambda: func(q, k, v, causal=True)[0]
    if kind == "window":
        return lambda: func(q, k, v, causal=True, window_size=(window - 1, 0))[0]
    if kind == "docs":
        return lambda: varlen_func(q, k, v, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens, max_seqlen_q=max_seqlen,
                                   max_seqlen_k=max_seqlen, causal=True)[0]
    raise ValueError(f"unknown kind {kind}")
