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
varlen single-process call with those offsets computes.

Inputs per rank: ``q [B, S_local, Hq, D]``, ``k``/``v [B, S_local, Hkv, D]`` (with ``cu_seqlens``
also the varlen layout ``[S_local, H, D]``, answered in the varlen call's layout); ``block_mask``:
the rank's query rows (in its local order) over the global key blocks, as a boolean array
``[Bs, Hs, S_local / Bq, S / Bk]`` (``Bs`` 1 or B, the usual ``Hs`` rule) or as a batched
`bsattn.sparsity` object of that geometry (`BlockLists`, `Bitmask`, `BSR`, `AllBlocks`; a
``full`` set is attended like the partial one); None attends every block.

Communication goes through ``group``: a ``torch.distributed`` process group (gloo on CPUs, NCCL
on GPUs; ``None``: the default group) when the tensors are PyTorch tensors, or any object with
``rank``, ``world``, ``all_gather(obj) -> list`` and ``exchange(sends, recvs)`` (see `Exchange`).
Forward only: the backward of this scheme is a follow-up (the single-process backward exists).
"""

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


def _stack(lib, parts):
    return lib.stack(parts)


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


def _dense_pattern(sparsity, q_blocks, k_blocks):
    """A batched `bsattn.sparsity` object as a dense boolean NumPy block mask [Bs, Hs, nQB, nKB]
    (None for AllBlocks). The pattern is small next to Q, K and V, so it is read on the host."""
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
            keep = (np.arange(width) < counts[..., None]) & (indices >= 0) & (indices < k_blocks)
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
            row_of = np.repeat(np.arange(rows), np.diff(indptr))
            ok = (indices >= 0) & (indices < k_blocks)
            got[row_of[ok], indices[ok]] = True
            got = got.reshape(sparsity.batch, sparsity.heads, q_blocks, k_blocks)
        dense = got if dense is None else dense | got
    return dense


def _pair_pattern(block_mask, rows, cols):
    if block_mask is None:
        return None
    return block_mask[:, :, rows[0]:rows[1], cols[0]:cols[1]]


def _any(pattern):
    return bool(pattern.any())


def attention(q, k, v, block_mask=None, *, block_size=(128, 128), causal=False, cu_seqlens=None, layout="contiguous",
              scale=None, group=None, return_lse=False, return_stats=False):
    """This rank's rows of block-sparse attention over the sharded sequence (module docstring).

    Returns ``out`` (Q's shape and dtype), plus ``lse`` fp32 ``[B, Hq, S_local]`` with
    ``return_lse``, plus with ``return_stats`` a dict: ``bytes_received`` / ``bytes_sent`` (K and V
    moved for this rank), ``all_gather_bytes`` (what gathering every other shard would have
    brought it) and ``chunks_received``.
    """
    lib = _library(q)
    varlen_layout = cu_seqlens is not None and len(q.shape) == 3
    if varlen_layout:  # [S_local, H, D]: one packed sequence
        q, k, v = q[None], k[None], v[None]
    if len(q.shape) != 4 or len(k.shape) != 4 or len(v.shape) != 4:
        raise _tensors.fail("q", "expected batched q [B, S_local, Hq, D] and k, v [B, S_local, Hkv, D]")
    comm = group if group is not None and hasattr(group, "exchange") else Exchange(group)
    rank, world = comm.rank, comm.world
    batch, local_tokens = int(q.shape[0]), int(q.shape[1])
    if int(k.shape[1]) != local_tokens or int(v.shape[1]) != local_tokens:
        raise _tensors.fail("k", f"a rank holds the same tokens of Q, K and V: {local_tokens} query tokens, "
                                 f"{int(k.shape[1])} key tokens")
    chunks = Chunks(layout, world, local_tokens)
    bq, bk = (block_size, block_size) if isinstance(block_size, int) else block_size
    if chunks.size % bq or chunks.size % bk:
        raise _tensors.fail("block_size", f"a chunk of {chunks.size} tokens is not a whole number of blocks "
                                          f"({bq}, {bk})")
    total = chunks.size * chunks.count
    q_blocks, k_blocks = chunks.size // bq, chunks.size // bk
    if block_mask is not None and hasattr(block_mask, "sets"):
        if tuple(block_mask.block_size) != (bq, bk):
            raise _tensors.fail("block_size", f"the pattern's blocks are {tuple(block_mask.block_size)}, "
                                              f"block_size says {(bq, bk)}")
        block_mask = _dense_pattern(block_mask, local_tokens // bq, total // bk)
        if block_mask is not None and lib.__name__ == "torch":
            block_mask = lib.from_numpy(block_mask).to(q.device)
    if block_mask is not None:
        block_mask = _with_batch_and_heads(block_mask)
        want = (local_tokens // bq, total // bk)
        if len(block_mask.shape) != 4 or tuple(int(x) for x in block_mask.shape[2:]) != want:
            raise _tensors.fail("block_mask", f"expected [Bs, Hs, {want[0]}, {want[1]}] (local query blocks x global "
                                              f"key blocks), got {tuple(block_mask.shape)}")
    doc = None
    if cu_seqlens is not None:
        if batch != 1:
            raise _tensors.fail("cu_seqlens", f"packed documents take batch 1, got {batch}")
        offsets = [int(x) for x in (cu_seqlens.tolist() if hasattr(cu_seqlens, "tolist") else cu_seqlens)]
        if offsets[0] != 0 or offsets[-1] != total or any(b < a for a, b in zip(offsets, offsets[1:])):
            raise _tensors.fail("cu_seqlens", f"expected non-decreasing offsets from 0 to {total}, got {offsets}")
        ids = [0] * total
        for d, (a, b) in enumerate(zip(offsets, offsets[1:])):
            ids[a:b] = [d] * (b - a)
        doc = ids

    mine = chunks.of_rank(rank)
    local_rows = {c: (i * q_blocks, (i + 1) * q_blocks) for i, c in enumerate(mine)}
    local_tokens_of = {c: (i * chunks.size, (i + 1) * chunks.size) for i, c in enumerate(mine)}

    def pattern(qc, kc):
        return _pair_pattern(block_mask, local_rows[qc], (kc * k_blocks, (kc + 1) * k_blocks))

    def used(qc, kc):
        if causal and kc > qc:
            return False
        return block_mask is None or _any(pattern(qc, kc))

    needs = sorted({kc for qc in mine for kc in range(chunks.count) if used(qc, kc)})
    all_needs = comm.all_gather(needs)
    sends = [(peer, c, k[:, slice(*local_tokens_of[c])], v[:, slice(*local_tokens_of[c])])
             for peer in range(world) if peer != rank for c in all_needs[peer] if c in local_tokens_of]
    recvs = [(chunks.owner(c), c, k[:, :chunks.size], v[:, :chunks.size]) for c in needs if c not in local_tokens_of]

    f32 = lib.float32
    parts = {c: ([], []) for c in mine}

    def attend(kc, kk, vv):
        for qc in mine:
            if not used(qc, kc):
                continue
            lo, hi = local_tokens_of[qc]
            ids = None
            if doc is not None:
                as_ids = (lambda x: lib.tensor(x, dtype=lib.int32, device=q.device)) if lib.__name__ == "torch" else (
                    lambda x: lib.asarray(x, dtype=lib.int32))
                ids = (as_ids([doc[qc * chunks.size:(qc + 1) * chunks.size]]),
                       as_ids([doc[kc * chunks.size:(kc + 1) * chunks.size]]))
            mask = Mask(causal=causal and kc == qc, alignment="top_left", doc_ids=ids)
            sub = pattern(qc, kc)
            sparsity = None if sub is None else from_dense_block_mask(sub, (bq, bk))
            out, lse = _attention(q[:, lo:hi], kk, vv, sparsity, mask=mask, scale=scale, return_lse=True,
                                  out_dtype=f32)
            parts[qc][0].append(out)
            parts[qc][1].append(lse)

    arrivals = comm.exchange(sends, recvs)
    for c in mine:
        if c in needs:
            lo, hi = local_tokens_of[c]
            attend(c, k[:, lo:hi], v[:, lo:hi])
    received = 0
    for c, kk, vv in arrivals:
        attend(c, kk, vv)
        received += 1

    outs, lses = [], []
    heads_q, dim = int(q.shape[2]), int(q.shape[3])
    for c in mine:
        o, l = parts[c]
        if not o:  # no key block of this chunk's rows: O = 0, LSE = -inf, as the single call leaves them
            where = {"device": q.device} if lib.__name__ == "torch" else {}
            o = lib.zeros((batch, chunks.size, heads_q, dim), dtype=f32, **where)
            l = lib.full((batch, heads_q, chunks.size), float("-inf"), dtype=f32, **where)
        elif len(o) == 1:
            o, l = o[0], l[0]
        else:
            o, l = merge_states(_stack(lib, o), _stack(lib, l))
        outs.append(o)
        lses.append(l)
    out = _cat(lib, outs, 1)
    out = out.to(q.dtype) if lib.__name__ == "torch" else out.astype(q.dtype)
    lse = _cat(lib, lses, 2)
    if varlen_layout:  # the varlen call's layout: out [S_local, Hq, D], lse [Hq, S_local]
        out, lse = out[0], lse[0]
    kv_bytes = lambda n: n * 2 * batch * chunks.size * int(k.shape[2]) * int(k.shape[3]) * k.dtype.itemsize  # noqa: E731
    stats = {"bytes_received": kv_bytes(received), "bytes_sent": kv_bytes(len(sends)), "chunks_received": received,
             "all_gather_bytes": kv_bytes(chunks.count - len(mine))}
    result = (out, lse) if return_lse else (out,)
    if return_stats:
        result += (stats,)
    return result[0] if len(result) == 1 else result
