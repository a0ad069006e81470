"""Context parallelism: block-sparse attention over a sequence sharded across processes (issue 15).

Each rank holds a shard of the sequence's Q, K and V and the block pattern of its own query
rows over the whole key sequence. The pattern says which key shards a rank's rows use, so a rank
receives only those (dense context parallelism moves every shard), attends each with the
single-process `bsattn.attention` as it arrives, and combines the partial results with
`bsattn.merge_states`. Output and LSE are those rows of the single-process call::

    out, lse = bsattn.distributed.attention(q, k, v, block_mask, block_size=(128, 128),
                                            causal=True, layout="zigzag", return_lse=True)

Shards. The global sequence of S tokens is cut into chunks: ``layout="contiguous"`` gives rank r
chunk r of ``world`` chunks; ``"zigzag"`` cuts ``2 * world`` chunks and gives rank r chunks r and
``2 * world - 1 - r`` (in that order in its tensors), which balances causal work. A chunk is a
whole number of Q and KV blocks. With ``causal=True`` the mask is the causal one of the whole
sequence (square: both alignments agree); ``cu_seqlens`` (int, ``[n + 1]``, ending at S) packs
documents into the one sequence (batch 1): a query sees only keys of its own document, as the
varlen single-process call with those offsets computes, and a key chunk that shares no document
with a rank's query chunks is not sent to it.

Inputs per rank: ``q [B, S_local, Hq, D]``, ``k``/``v [B, S_local, Hkv, D]`` (with ``cu_seqlens``
also the varlen layout ``[S_local, H, D]``, answered in the varlen call's layout); ``block_mask``:
the rank's query rows (in its local order) over the global key blocks, as a boolean array
``[Bs, Hs, S_local / Bq, S / Bk]`` (``Bs`` 1 or B, the usual ``Hs`` rule) or as a batched
`bsattn.sparsity` object of that geometry (`BlockLists`, `Bitmask`, `BSR`, `AllBlocks`; a
``full`` set is attended like the partial one); None attends every block.

Communication goes through ``group``: a ``torch.distributed`` process group (gloo on CPUs, NCCL
on GPUs; ``None``: the default group) when the tensors are PyTorch tensors, or any object with
``rank``, ``world``, ``all_gather(obj) -> list`` and ``exchange(sends, recvs)`` (see `Exchange`).
`attention_backward` gives this rank's dQ, dK, dV of the same scheme: the key chunks travel as in
the forward, and the gradients of the chunks a rank used go back to their owners.
"""

import functools

from . import _tensors
from ._api import attention as _attention
from ._merge import merge_states
from .adapters import _with_batch_and_heads, from_dense_block_mask
from .mask import Mask

_LAYOUTS = ("contiguous", "zigzag")


class Chunks:
    """Which chunks of the global sequence a rank holds (layout, world size, chunk length)."""

    def __init__(self, layout, world, local_tokens):
        if layout not in _LAYOUTS:
            raise _tensors.fail("layout", f"expected one of {_LAYOUTS}, got {layout!r}")
        self.per_rank = 1 if layout == "contiguous" else 2
        if local_tokens % self.per_rank:
            raise _tensors.fail("q", f"a zigzag shard holds two equal chunks: {local_tokens} tokens is odd")
        self.layout, self.world = layout, world
        self.count = world * self.per_rank
        self.size = local_tokens // self.per_rank

    def owner(self, chunk):
        return chunk if chunk < self.world else self.count - 1 - chunk

    def of_rank(self, rank):
        return [rank] if self.per_rank == 1 else [rank, self.count - 1 - rank]


def _library(t):
    if _tensors.is_torch(t):
        import torch

        return torch
    import numpy

    return numpy


def _cat(lib, parts, axis):
    return lib.cat(parts, dim=axis) if lib.__name__ == "torch" else lib.concatenate(parts, axis=axis)


class Exchange:
    """The communication a rank needs, on ``torch.distributed`` (the reference implementation of
    the interface ``group`` may provide instead):

    * ``all_gather(obj)``: every rank's ``obj`` (a small picklable list), in rank order;
    * ``exchange(sends, recvs)``: ``sends`` is ``[(peer, chunk, k, v)]`` to send, ``recvs``
      ``[(peer, chunk, k_like, v_like)]`` to receive (buffers of that shape and dtype); posts them
      all and returns an iterator of ``(chunk, k, v)`` for each received chunk as it arrives, so
      the caller attends its own chunks while the others travel.
    """

    def __init__(self, group=None):
        import torch.distributed as dist

        self._dist, self._group = dist, group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)

    def all_gather(self, obj):
        out = [None] * self.world
        self._dist.all_gather_object(out, obj, group=self._group)
        return out

    def _global(self, peer):
        return peer if self._group is None else self._dist.get_global_rank(self._group, peer)

    def exchange(self, sends, recvs):
        dist = self._dist
        ops, received = [], []  # posted now; the generator below waits
        for peer, _, k, v in sends:
            ops += [dist.P2POp(dist.isend, k.contiguous(), self._global(peer), self._group),
                    dist.P2POp(dist.isend, v.contiguous(), self._global(peer), self._group)]
        for peer, chunk, k_like, v_like in recvs:
            k, v = k_like.new_empty(k_like.shape), v_like.new_empty(v_like.shape)
            ops += [dist.P2POp(dist.irecv, k, self._global(peer), self._group),
                    dist.P2POp(dist.irecv, v, self._global(peer), self._group)]
            received.append((chunk, k, v))
        works = dist.batch_isend_irecv(ops) if ops else []
        first_recv = 2 * len(sends)

        def arrivals():
            for i, (chunk, k, v) in enumerate(received):
                works[first_recv + 2 * i].wait()
                works[first_recv + 2 * i + 1].wait()
                yield chunk, k, v
            for w in works[:first_recv]:
                w.wait()

        return arrivals()


def _host(t):
    import numpy

    return t.detach().cpu().numpy() if _tensors.is_torch(t) else numpy.asarray(t)


def _dense_pattern(sparsity, q_blocks, k_blocks, validate):
    """A batched `bsattn.sparsity` object as a dense boolean NumPy block mask [Bs, Hs, nQB, nKB]
    (None for AllBlocks). The pattern is small next to Q, K and V, so it is read on the host;
    with ``validate`` it is checked as a single-process call checks its pattern (SPEC §3, §8):
    lists no wider than the key blocks, counts within the width, a row's entries ascending and
    unique within the key blocks, BSR offsets non-decreasing from 0 and ending within the
    indices, no block in both sets (without, out-of-range entries are dropped)."""
    import numpy as np

    from .sparsity import BSR, AllBlocks, Bitmask, BlockLists

    if isinstance(sparsity, AllBlocks):
        return None
    if not isinstance(sparsity, (BlockLists, Bitmask, BSR)) or "proxy" in sparsity.sets:
        raise _tensors.fail("block_mask", f"expected a boolean block mask or batched BlockLists, Bitmask or BSR "
                                          f"without a proxy set, got {sparsity!r}")
    if "cu_total_m_blocks" in sparsity.extra:
        raise _tensors.fail("block_mask", "expected a batched pattern (the rank's query blocks x the global key blocks)")
    dense = None
    for name in ("partial", "full"):
        if name not in sparsity.sets:
            continue
        fields = [sparsity.sets[name][f] for f in sparsity.set_fields]
        if isinstance(sparsity, BlockLists):
            counts, indices = (_host(x) for x in fields)
            bs, hs, nqb, width = indices.shape
            got = np.zeros((bs, hs, nqb, k_blocks), bool)
            listed = np.arange(width) < counts[..., None]
            if validate:
                if width > k_blocks:
                    raise _tensors.fail("block_mask", f"block lists of width {width}: expected at most {k_blocks} "
                                                      f"(the global key blocks)")
                _expect_entries(counts, 0, width, "block counts", "the lists' width")
                _expect_entries(indices[listed], 0, k_blocks - 1, "block indices", "the global key blocks")
                _expect_ascending(indices[..., 1:] > indices[..., :-1], listed[..., 1:], "block indices")
            keep = listed & (indices >= 0) & (indices < k_blocks)
            b, h, r, i = np.nonzero(keep)
            got[b, h, r, indices[b, h, r, i]] = True
        elif isinstance(sparsity, Bitmask):
            words = _host(fields[0]).astype(np.uint32)
            bits = (words[..., None] >> np.arange(32, dtype=np.uint32)) & 1
            got = bits.reshape(*words.shape[:-1], -1)[..., :k_blocks].astype(bool)
        else:
            indptr, indices = (_host(x) for x in fields)
            rows = sparsity.batch * sparsity.heads * q_blocks
            if len(indptr) != rows + 1:
                raise _tensors.fail("block_mask", f"a BSR of batch {sparsity.batch}, heads {sparsity.heads} and "
                                                  f"{q_blocks} query blocks has {rows + 1} indptr entries, got {len(indptr)}")
            got = np.zeros((rows, k_blocks), bool)
            if validate:
                if indptr[0] != 0 or indptr[-1] > len(indices):
                    raise _tensors.fail("block_mask", f"BSR offsets from {int(indptr[0])} to {int(indptr[-1])}: "
                                                      f"expected 0 to at most {len(indices)} (the indices' length)")
                _expect_entries(np.diff(indptr), 0, k_blocks, "BSR row lengths", "the global key blocks")
                _expect_entries(indices[:indptr[-1]], 0, k_blocks - 1, "BSR indices", "the global key blocks")
            row_of = np.repeat(np.arange(rows), np.diff(indptr))
            if validate and indptr[-1] > 1:
                same_row = row_of[1:] == row_of[:-1]
                _expect_ascending(indices[1:indptr[-1]] > indices[:indptr[-1] - 1], same_row, "BSR indices")
            used = indices[:indptr[-1]]  # the offsets may end before the indices do
            ok = (used >= 0) & (used < k_blocks)
            got[row_of[ok], used[ok]] = True
            got = got.reshape(sparsity.batch, sparsity.heads, q_blocks, k_blocks)
        if validate and dense is not None and (dense & got).any():
            b, h, r, c = (int(x[0]) for x in np.nonzero(dense & got))
            raise _tensors.fail("block_mask", f"key block {c} of row (b={b}, h={h}, query block {r}) is in both the "
                                              f"partial and the full set")
        dense = got if dense is None else dense | got
    return dense


def _expect_ascending(above_previous, checked, what):
    """A row's entries ascending and unique: every checked entry above the one before it."""
    import numpy as np

    bad = np.argwhere(checked & ~above_previous)
    if len(bad):
        at = tuple(int(x) for x in bad[0][:-1]) + (int(bad[0][-1]) + 1,)
        raise _tensors.fail("block_mask", f"{what}: the entry at {at} is not above the one before it (a row's "
                                          f"entries ascend, each block once)")


def _expect_entries(values, low, high, what, bound):
    """Every value within [low, high]; else an error naming block_mask, the first bad value and where."""
    import numpy as np

    bad = np.flatnonzero((values < low) | (values > high))
    if len(bad):
        raise _tensors.fail("block_mask", f"{what}: {int(values.flat[bad[0]])} at position {int(bad[0])}, "
                                          f"expected {low}..{high} ({bound})")


def _pair_pattern(block_mask, rows, cols):
    if block_mask is None:
        return None
    return block_mask[:, :, rows[0]:rows[1], cols[0]:cols[1]]


def _any(pattern):
    return bool(pattern.any())


class _Shards:
    """What forward and backward share: the checked shard geometry, the rank's pattern, the key
    chunks each rank uses (all-gathered), and the attention problem of each chunk pair."""

    def __init__(self, q, k, v, block_mask, block_size, causal, cu_seqlens, layout, group, validate):
        self.lib = lib = _library(q)
        if len(q.shape) != 4 or len(k.shape) != 4 or len(v.shape) != 4:
            raise _tensors.fail("q", "expected batched q [B, S_local, Hq, D] and k, v [B, S_local, Hkv, D]")
        self.comm = comm = group if group is not None and hasattr(group, "exchange") else Exchange(group)
        self.rank, self.world = comm.rank, comm.world
        self.batch, local_tokens = int(q.shape[0]), int(q.shape[1])
        if int(k.shape[1]) != local_tokens or int(v.shape[1]) != local_tokens:
            raise _tensors.fail("k", f"a rank holds the same tokens of Q, K and V: {local_tokens} query tokens, "
                                     f"{int(k.shape[1])} key tokens")
        self.chunks = chunks = Chunks(layout, self.world, local_tokens)
        self.bq, self.bk = bq, bk = (block_size, block_size) if isinstance(block_size, int) else block_size
        if chunks.size % bq or chunks.size % bk:
            raise _tensors.fail("block_size", f"a chunk of {chunks.size} tokens is not a whole number of blocks "
                                              f"({bq}, {bk})")
        total = chunks.size * chunks.count
        if block_mask is not None and hasattr(block_mask, "sets"):
            if tuple(block_mask.block_size) != (bq, bk):
                raise _tensors.fail("block_size", f"the pattern's blocks are {tuple(block_mask.block_size)}, "
                                                  f"block_size says {(bq, bk)}")
            block_mask = _dense_pattern(block_mask, local_tokens // bq, total // bk, validate)
            if block_mask is not None and lib.__name__ == "torch":
                block_mask = lib.from_numpy(block_mask).to(q.device)
        if block_mask is not None:
            block_mask = _with_batch_and_heads(block_mask)
            want = (local_tokens // bq, total // bk)
            if len(block_mask.shape) != 4 or tuple(int(x) for x in block_mask.shape[2:]) != want:
                raise _tensors.fail("block_mask", f"expected [Bs, Hs, {want[0]}, {want[1]}] (local query blocks x "
                                                  f"global key blocks), got {tuple(block_mask.shape)}")
        self.block_mask, self.causal = block_mask, causal
        self.doc = None
        if cu_seqlens is not None:
            if self.batch != 1:
                raise _tensors.fail("cu_seqlens", f"packed documents take batch 1, got {self.batch}")
            offsets = [int(x) for x in (cu_seqlens.tolist() if hasattr(cu_seqlens, "tolist") else cu_seqlens)]
            if offsets[0] != 0 or offsets[-1] != total or any(b < a for a, b in zip(offsets, offsets[1:])):
                raise _tensors.fail("cu_seqlens", f"expected non-decreasing offsets from 0 to {total}, got {offsets}")
            self.doc = [d for d, (a, b) in enumerate(zip(offsets, offsets[1:])) for _ in range(b - a)]
        self.device = {"device": q.device} if lib.__name__ == "torch" else {}
        self.mine = chunks.of_rank(self.rank)
        self.tokens_of = {c: (i * chunks.size, (i + 1) * chunks.size) for i, c in enumerate(self.mine)}
        self.needs = sorted({kc for qc in self.mine for kc in range(chunks.count) if self.used(qc, kc)})
        self.all_needs = comm.all_gather(self.needs)

    def pattern(self, qc, kc):
        q_blocks, k_blocks = self.chunks.size // self.bq, self.chunks.size // self.bk
        i = self.mine.index(qc)
        return _pair_pattern(self.block_mask, (i * q_blocks, (i + 1) * q_blocks), (kc * k_blocks, (kc + 1) * k_blocks))

    def used(self, qc, kc):
        if self.causal and kc > qc:
            return False
        if self.doc is not None:  # documents are contiguous: a chunk holds its first to last token's
            first, last = (lambda c: self.doc[c * self.chunks.size]), (lambda c: self.doc[(c + 1) * self.chunks.size - 1])
            if last(qc) < first(kc) or last(kc) < first(qc):
                return False  # no document in common
        return self.block_mask is None or _any(self.pattern(qc, kc))

    def pairs(self, kc):
        """(query chunk, its local token range, keywords of the single-process call) for every
        chunk of this rank whose rows use key chunk kc."""
        lib, size = self.lib, self.chunks.size
        for qc in self.mine:
            if not self.used(qc, kc):
                continue
            ids = None
            if self.doc is not None:
                as_ids = ((lambda x: lib.tensor(x, dtype=lib.int32, **self.device)) if lib.__name__ == "torch"
                          else (lambda x: lib.asarray(x, dtype=lib.int32)))
                ids = (as_ids([self.doc[qc * size:(qc + 1) * size]]), as_ids([self.doc[kc * size:(kc + 1) * size]]))
            sub = self.pattern(qc, kc)
            yield qc, self.tokens_of[qc], {
                "mask": Mask(causal=self.causal and kc == qc, alignment="top_left", doc_ids=ids),
                "sparsity": None if sub is None else from_dense_block_mask(sub, (self.bq, self.bk))}

    def own(self, t, c):
        return t[:, slice(*self.tokens_of[c])]

    def fetch(self, k, v):
        """Posts the sends of this rank's chunks to the ranks that use them and the receives of the
        chunks it uses; returns (sends, iterator of received (chunk, k, v))."""
        sends = [(peer, c, self.own(k, c), self.own(v, c)) for peer in range(self.world) if peer != self.rank
                 for c in self.all_needs[peer] if c in self.tokens_of]
        recvs = [(self.chunks.owner(c), c, k[:, :self.chunks.size], v[:, :self.chunks.size])
                 for c in self.needs if c not in self.tokens_of]
        return sends, self.comm.exchange(sends, recvs)

    def kv_bytes(self, k, chunks):
        return chunks * 2 * self.batch * self.chunks.size * int(k.shape[2]) * int(k.shape[3]) * k.dtype.itemsize

    def cast(self, t, like):
        return t.to(like.dtype) if self.lib.__name__ == "torch" else t.astype(like.dtype)

    def zeros(self, shape):
        return self.lib.zeros(shape, dtype=self.lib.float32, **self.device)


def _varlen_to_batched(cu_seqlens, *tensors):
    """The varlen layout of one packed sequence ([S_local, H, D]; LSE [H, S_local]) as batch 1."""
    varlen = cu_seqlens is not None and len(tensors[0].shape) == 3
    return varlen, [t if t is None or not varlen else t[None] for t in tensors]


def attention(q, k, v, block_mask=None, *, block_size=(128, 128), causal=False, cu_seqlens=None, layout="contiguous",
              scale=None, group=None, validate=True, return_lse=False, return_stats=False):
    """This rank's rows of block-sparse attention over the sharded sequence (module docstring).
    PyTorch tensors that require gradients go through a `torch.autograd.Function` whose backward
    is `attention_backward`. ``validate``: check the pattern's values (block-list counts and
    entries, BSR rows) on the host, where it is read; the chunk pairs' calls, whose patterns are
    made from it, run unvalidated (on a GPU, no pair waits for its checks).

    Returns ``out`` (Q's shape and dtype), plus ``lse`` fp32 ``[B, Hq, S_local]`` with
    ``return_lse``, plus with ``return_stats`` a dict: ``bytes_received`` / ``bytes_sent`` (K and V
    moved for this rank), ``all_gather_bytes`` (what gathering every other shard would have
    brought it) and ``chunks_received``.
    """
    keywords = dict(block_size=block_size, causal=causal, cu_seqlens=cu_seqlens, layout=layout, scale=scale,
                    group=group, validate=validate)
    if _tensors.is_torch(q) and _needs_autograd(q, k, v):  # gradients through attention_backward
        stats = {}
        out, lse = _torch_function().apply(q, k, v, block_mask, keywords, stats)
    else:
        out, lse, stats = _forward(q, k, v, block_mask, **keywords)
    result = (out, lse) if return_lse else (out,)
    if return_stats:
        result += (stats,)
    return result[0] if len(result) == 1 else result


def _needs_autograd(*tensors):
    import torch

    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


@functools.cache
def _torch_function():
    """torch.autograd.Function of the sharded attention: the forward saves O and LSE, the backward
    is `attention_backward` (the LSE is an output without a gradient)."""
    import torch

    class DistributedAttention(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, block_mask, keywords, stats):
            out, lse, moved = _forward(q, k, v, block_mask, **keywords)
            stats.update(moved)
            ctx.save_for_backward(q, k, v, out, lse)
            ctx.block_mask, ctx.keywords = block_mask, keywords
            ctx.mark_non_differentiable(lse)
            return out, lse

        @staticmethod
        def backward(ctx, dout, _dlse):
            q, k, v, out, lse = ctx.saved_tensors
            dq, dk, dv = attention_backward(q, k, v, out, lse, dout.contiguous(), ctx.block_mask, **ctx.keywords)
            return dq, dk, dv, None, None, None

    return DistributedAttention


def _forward(q, k, v, block_mask, *, block_size, causal, cu_seqlens, layout, scale, group, validate):
    """(out, lse, stats) of `attention`."""
    varlen, (q, k, v) = _varlen_to_batched(cu_seqlens, q, k, v)
    sh = _Shards(q, k, v, block_mask, block_size, causal, cu_seqlens, layout, group, validate)
    lib = sh.lib
    parts = {c: ([], []) for c in sh.mine}

    def attend(kc, kk, vv):
        for qc, (lo, hi), call in sh.pairs(kc):
            out, lse = _attention(q[:, lo:hi], kk, vv, call["sparsity"], mask=call["mask"], scale=scale,
                                  return_lse=True, out_dtype=lib.float32, validate=False)
            parts[qc][0].append(out)
            parts[qc][1].append(lse)

    sends, arrivals = sh.fetch(k, v)
    for c in sh.mine:  # own chunks while the others travel
        if c in sh.needs:
            attend(c, sh.own(k, c), sh.own(v, c))
    received = 0
    for c, kk, vv in arrivals:
        attend(c, kk, vv)
        received += 1

    outs, lses = [], []
    size, heads_q, dim = sh.chunks.size, int(q.shape[2]), int(q.shape[3])
    for c in sh.mine:
        o, l = parts[c]
        if not o:  # no key block of this chunk's rows: O = 0, LSE = -inf, as the single call leaves them
            o = sh.zeros((sh.batch, size, heads_q, dim))
            l = lib.full((sh.batch, heads_q, size), float("-inf"), dtype=lib.float32, **sh.device)
        elif len(o) == 1:
            o, l = o[0], l[0]
        else:
            o, l = merge_states(lib.stack(o), lib.stack(l))
        outs.append(o)
        lses.append(l)
    out, lse = sh.cast(_cat(lib, outs, 1), q), _cat(lib, lses, 2)
    if varlen:  # the varlen call's layout: out [S_local, Hq, D], lse [Hq, S_local]
        out, lse = out[0], lse[0]
    stats = {"bytes_received": sh.kv_bytes(k, received), "bytes_sent": sh.kv_bytes(k, len(sends)),
             "chunks_received": received, "all_gather_bytes": sh.kv_bytes(k, sh.chunks.count - len(sh.mine))}
    return out, lse, stats


def attention_backward(q, k, v, out, lse, dout, block_mask=None, *, block_size=(128, 128), causal=False,
                       cu_seqlens=None, layout="contiguous", scale=None, group=None, validate=True):
    """This rank's gradients ``(dq, dk, dv)`` (its shards' shapes and dtypes) of `attention` for
    the loss gradient ``dout``; ``out`` and ``lse`` are what `attention` returned on this rank,
    the other arguments as given to it.

    The same key chunks travel as in the forward; each chunk pair's single-process backward
    (`bsattn.attention_backward` on the pair, with the whole rows' O and LSE, which makes the
    pair's share of every gradient exact) adds to dQ here and to the pair's key chunk's dK, dV,
    which go back to the chunk's owner and are summed there (fp32 throughout).
    """
    from ._api import attention_backward as _attention_backward

    varlen, (q, k, v, out, dout) = _varlen_to_batched(cu_seqlens, q, k, v, out, dout)
    if varlen:
        lse = lse[None]
    sh = _Shards(q, k, v, block_mask, block_size, causal, cu_seqlens, layout, group, validate)
    lib = sh.lib
    dq = sh.zeros(tuple(q.shape))
    dkv = {}

    def differentiate(kc, kk, vv):
        for qc, (lo, hi), call in sh.pairs(kc):
            gq, gk, gv = _attention_backward(q[:, lo:hi], kk, vv, out[:, lo:hi], lse[:, :, lo:hi], dout[:, lo:hi],
                                             call["sparsity"], mask=call["mask"], scale=scale, validate=False,
                                             dq=sh.zeros(tuple(q[:, lo:hi].shape)), dk=sh.zeros(tuple(kk.shape)),
                                             dv=sh.zeros(tuple(vv.shape)))
            dq[:, lo:hi] += gq
            if kc in dkv:
                dkv[kc][0][...] += gk
                dkv[kc][1][...] += gv
            else:
                dkv[kc] = (gk, gv)

    _, arrivals = sh.fetch(k, v)
    for c in sh.mine:
        if c in sh.needs:
            differentiate(c, sh.own(k, c), sh.own(v, c))
    for c, kk, vv in arrivals:
        differentiate(c, kk, vv)

    # The key chunks' gradients go home: to each owner the sums of the chunks of its this rank used;
    # from each rank that used one of this rank's chunks, its sum.
    like = sh.zeros((sh.batch, sh.chunks.size) + tuple(k.shape[2:]))
    sends = [(sh.chunks.owner(c), c, gk, gv) for c, (gk, gv) in dkv.items() if c not in sh.tokens_of]
    recvs = [(peer, c, like, like) for peer in range(sh.world) if peer != sh.rank
             for c in sh.all_needs[peer] if c in sh.tokens_of]
    dk, dv = sh.zeros(tuple(k.shape)), sh.zeros(tuple(v.shape))
    for c, (gk, gv) in dkv.items():
        if c in sh.tokens_of:
            sh.own(dk, c)[...] += gk
            sh.own(dv, c)[...] += gv
    for c, gk, gv in sh.comm.exchange(sends, recvs):
        sh.own(dk, c)[...] += gk
        sh.own(dv, c)[...] += gv
    grads = sh.cast(dq, q), sh.cast(dk, k), sh.cast(dv, v)
    return tuple(g[0] for g in grads) if varlen else grads
