"""The FlashAttention-4 peer of the GPU forward benchmark (bench/gpu/peer_fa4.py, issue 14.1) gives
FA4 the very block pattern bsattn runs. These tests check, on the CPU with torch and without FA4,
that the index tensors it builds are that pattern: bsattn's block lists -> bool block mask ->
FA4's full-block lists, compared with a brute-force expansion per query head (FA4's head
broadcast: heads dim 1 = shared by all heads), for patterns per query head, per KV head and
shared, with tail blocks, empty and full rows; and that the peer's calls (block-sparse, causal,
window, varlen, dense) mean the masks the benchmark's reference uses, through a stand-in of FA4's
entry points that implements their documented semantics with dense float32 attention.

Runs under pytest (tests/python/run.sh) or alone: python3 tests/python/test_bench_fa4_pattern.py
"""
import math
import os
import sys

try:
    import pytest
    torch = pytest.importorskip("torch")
except ImportError:  # run as a script without pytest
    pytest = None
    import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench", "gpu"))
import peer_fa4  # noqa: E402

HQ, HKV = 8, 2


def lists_of(gen, hs, nqb, nkb):
    """bsattn block lists [1, Hs, nQB] / [1, Hs, nQB, nKB]: random ascending rows (some empty,
    some full) with garbage past each row's count, as the format allows."""
    keep = torch.rand(hs, nqb, nkb, generator=gen) < 0.4
    keep[:, 0] = False          # an empty row
    keep[:, -1] = True          # a full row
    cnt = keep.sum(-1).to(torch.int32)
    idx = torch.randint(0, nkb, (hs, nqb, nkb), generator=gen, dtype=torch.int32)
    for h in range(hs):
        for qb in range(nqb):
            sel = [kb for kb in range(nkb) if keep[h, qb, kb]]
            idx[h, qb, :len(sel)] = torch.tensor(sel, dtype=torch.int32)
    return cnt[None], idx[None], keep


def test_block_mask_of_reads_only_the_counted_entries():
    gen = torch.Generator().manual_seed(1)
    for hs, nqb, nkb in ((1, 5, 7), (HKV, 9, 9), (HQ, 4, 11)):
        cnt, idx, keep = lists_of(gen, hs, nqb, nkb)
        blk = peer_fa4.block_mask_of(cnt, idx, nkb)
        assert blk.dtype == torch.bool and tuple(blk.shape) == (hs, nqb, nkb)
        for h in range(hs):
            for qb in range(nqb):
                want = {int(i) for i in idx[0, h, qb, :int(cnt[0, h, qb])]}
                got = {kb for kb in range(nkb) if blk[h, qb, kb]}
                assert got == want, (hs, h, qb)
        assert torch.equal(blk, keep)


def test_fa4_lists_are_the_pattern_of_every_query_head():
    """Brute force: for each query head h and row qb, FA4 (head h, or head 0 when its heads dim is
    1) attends exactly the blocks the pattern of sparsity head h // (Hq / Hs) keeps."""
    gen = torch.Generator().manual_seed(2)
    for hs in (1, HKV, HQ):
        for nqb, nkb in ((6, 6), (3, 10), (11, 4)):
            keep = torch.rand(hs, nqb, nkb, generator=gen) < 0.3
            keep[:, 1] = True
            keep[:, 2] = False
            cnt, idx = peer_fa4.fa4_lists(keep, HQ)
            H = 1 if hs == 1 else HQ
            assert cnt.dtype == idx.dtype == torch.int32
            assert tuple(cnt.shape) == (1, H, nqb) and tuple(idx.shape) == (1, H, nqb, nkb)
            assert cnt.is_contiguous() and idx.is_contiguous()
            for h in range(HQ):
                fh = 0 if H == 1 else h
                for qb in range(nqb):
                    c = int(cnt[0, fh, qb])
                    row = [int(i) for i in idx[0, fh, qb]]
                    assert row[:c] == sorted(set(row[:c])), "ascending and unique"
                    assert all(0 <= i < nkb for i in row), "in range"
                    assert all(i == 0 for i in row[c:]), "unused slots zero"
                    want = [kb for kb in range(nkb) if keep[h // (HQ // hs), qb, kb]]
                    assert row[:c] == want, (hs, h, qb)


def test_bench_lists_round_trip():
    """The driver's lists (exactly k ascending blocks per row) come back unchanged for patterns per
    query head and shared, and repeated over the group for patterns per KV head."""
    gen = torch.Generator().manual_seed(3)
    nqb, nkb, k = 7, 9, 3
    for hs in (1, HKV, HQ):
        sel = torch.rand(hs, nqb, nkb, generator=gen).argsort(-1)[..., :k].sort(-1).values.int()
        idx = torch.zeros(1, hs, nqb, nkb, dtype=torch.int32)
        idx[0, :, :, :k] = sel
        cnt = torch.full((1, hs, nqb), k, dtype=torch.int32)
        fcnt, fidx = peer_fa4.fa4_lists(peer_fa4.block_mask_of(cnt, idx, nkb), HQ)
        g = 1 if hs == 1 else HQ // hs
        assert torch.equal(fcnt, cnt.repeat_interleave(g, 1))
        assert torch.equal(fidx, idx.repeat_interleave(g, 1))


# --- a stand-in for flash_attn.cute (4.0.0b36's documented semantics, dense float32) ---------------

def _attend(q, k, v, keep):
    """q [Sq, Hq, D], k/v [Sk, Hkv, D], keep [Hq or 1, Sq, Sk] -> O [Sq, Hq, D] (float32)."""
    g = q.shape[1] // k.shape[1]
    qh = q.float().transpose(0, 1)
    kh = k.float().transpose(0, 1).repeat_interleave(g, 0)
    vh = v.float().transpose(0, 1).repeat_interleave(g, 0)
    s = (qh @ kh.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    return (torch.softmax(s.masked_fill(~keep, float("-inf")), -1) @ vh).transpose(0, 1)


def _window_keep(sq, sk, causal, window_size):
    left, right = window_size
    if causal:
        right = 0
    qp = torch.arange(sq)[:, None] + sk - sq
    kp = torch.arange(sk)[None, :]
    keep = torch.ones(sq, sk, dtype=torch.bool)
    if left is not None:
        keep &= kp >= qp - left
    if right is not None:
        keep &= kp <= qp + right
    return keep[None]


def fake_flash_attn_func(q, k, v, causal=False, window_size=(None, None), block_sparse_tensors=None):
    outs = []
    for b in range(q.shape[0]):
        sq, sk = q.shape[1], k.shape[1]
        keep = _window_keep(sq, sk, causal, window_size)
        bst = block_sparse_tensors
        if bst is not None:
            bq, bk = bst.block_size
            full = peer_fa4.block_mask_of(bst.full_block_cnt, bst.full_block_idx, -(-sk // bk))
            part = peer_fa4.block_mask_of(bst.mask_block_cnt, bst.mask_block_idx, -(-sk // bk))
            assert not part.any(), "the peer gives its pattern as full blocks only"
            blocks = full.repeat_interleave(bq, 1)[:, :sq].repeat_interleave(bk, 2)[:, :, :sk]
            keep = keep & blocks
        outs.append(_attend(q[b], k[b], v[b], keep).to(q.dtype))
    return torch.stack(outs), None


def fake_flash_attn_varlen_func(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                                causal=False):
    out = torch.empty_like(q)
    for b in range(len(cu_seqlens_q) - 1):
        a, e = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        ka, ke = int(cu_seqlens_k[b]), int(cu_seqlens_k[b + 1])
        assert e - a <= max_seqlen_q and ke - ka <= max_seqlen_k
        out[a:e] = _attend(q[a:e], k[ka:ke], v[ka:ke], _window_keep(e - a, ke - ka, causal, (None, None))).to(q.dtype)
    return out, None


class FakeBST:
    def __init__(self, **kw):
        self.__dict__.update(kw)


def _with_fake_fa4(fn):
    saved = dict(peer_fa4._STATE)
    peer_fa4._STATE.clear()
    peer_fa4._STATE.update(mod=(fake_flash_attn_func, fake_flash_attn_varlen_func, FakeBST), version="fake")
    try:
        fn()
    finally:
        peer_fa4._STATE.clear()
        peer_fa4._STATE.update(saved)


def _reference(kind, q, k, v, *, blk=None, bq=None, bk=None, window=None, docs=None):
    """The benchmark's masks (bench_forward.spot_errors), written independently here."""
    T = q.shape[-3]
    qp = torch.arange(T)[:, None]
    kp = torch.arange(T)[None, :]
    if kind == "random":
        hq, hs = q.shape[-2], blk.shape[0]
        keep = blk.repeat_interleave(hq // hs, 0).repeat_interleave(bq, 1)[:, :T].repeat_interleave(bk, 2)[:, :, :T]
    else:
        keep = (kp <= qp)[None]
        if kind == "window":
            keep = keep & (qp - kp < window)[None]
        if kind == "docs":
            doc = torch.repeat_interleave(torch.arange(len(docs)), torch.tensor(docs))
            keep = keep & (doc[:, None] == doc[None, :])[None]
    return _attend(q.reshape(T, q.shape[-2], -1), k.reshape(T, k.shape[-2], -1), v.reshape(T, v.shape[-2], -1), keep)


def test_peer_calls_mean_the_benchmark_masks():
    def body():
        gen = torch.Generator().manual_seed(4)
        S, D = 200, 16  # tails: 200 = 3 x 64 + 8
        q = torch.randn(1, S, HQ, D, generator=gen)
        k = torch.randn(1, S, HKV, D, generator=gen)
        v = torch.randn(1, S, HKV, D, generator=gen)
        for hs in (1, HKV, HQ):
            for bq, bk in ((64, 64), (32, 64), (128, 32)):
                blk = torch.rand(hs, -(-S // bq), -(-S // bk), generator=gen) < 0.5
                blk[..., 0] = True
                got = peer_fa4.runner("random", q, k, v, blk=blk, bq=bq, bk=bk)()
                want = _reference("random", q, k, v, blk=blk, bq=bq, bk=bk)
                assert torch.allclose(got[0], want, atol=1e-5), (hs, bq, bk)
        dense = peer_fa4.runner("random", q, k, v, blk=torch.ones(1, 4, 4, dtype=torch.bool), bq=64, bk=64)()
        assert torch.allclose(dense[0], _attend(q[0], k[0], v[0], torch.ones(1, S, S, dtype=torch.bool)), atol=1e-5)
        for kind in ("causal", "window"):
            got = peer_fa4.runner(kind, q, k, v, window=37)()
            assert torch.allclose(got[0], _reference(kind, q, k, v, window=37), atol=1e-5), kind
        docs = (1, 60, 7, 132)
        T = sum(docs)
        qv, kv, vv = (torch.randn(T, h, D, generator=gen) for h in (HQ, HKV, HKV))
        cu = torch.tensor([0, *docs]).cumsum(0).to(torch.int32)
        got = peer_fa4.runner("docs", qv, kv, vv, cu_seqlens=cu, max_seqlen=max(docs))()
        assert torch.allclose(got, _reference("docs", qv, kv, vv, docs=docs), atol=1e-5)
    _with_fake_fa4(body)


def test_without_fa4_the_peer_reports_and_refuses():
    ok, note = peer_fa4.available()
    if ok:  # FA4 installed here: nothing to check about its absence
        return
    assert isinstance(note, str) and note
    try:
        peer_fa4.runner("causal", None, None, None)
    except RuntimeError as e:
        assert "not importable" in str(e)
    else:
        raise AssertionError("runner must refuse without flash_attn.cute")


if __name__ == "__main__":
    tests = [f for n, f in sorted(globals().items()) if n.startswith("test_") and callable(f)]
    for t in tests:
        t()
        print(f"ok  {t.__name__}")
    print(f"{len(tests)} passed")
