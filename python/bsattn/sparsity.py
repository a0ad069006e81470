"""Block sparsity (SPEC §3): which KV blocks each query block attends, in one of four formats.

Every class holds a block size ``(Bq, Bk)`` and up to three block sets in its format:

* ``partial``: the token mask (`bsattn.Mask`) is evaluated on these blocks;
* ``full``: every in-range token of these blocks is attended, the mask is not consulted;
* ``proxy``: an explicit set of blocks that contribute one summary term each (SPEC §6).

A block in no set is skipped. Integer tensors of any integer dtype are converted to int32 once,
here. The adapters in `bsattn.adapters` build these objects from other libraries' structures.
"""

from . import _tensors


def _block_size(block_size):
    if isinstance(block_size, int):
        return block_size, block_size
    bq, bk = block_size
    return int(bq), int(bk)


class Sparsity:
    """Base class: a format name, a block size and the tensors of each block set."""

    format = None
    #: The tensor fields of one block set in this format, in constructor order.
    set_fields = ()

    def __init__(self, block_size, sets, extra=None):
        self.block_size = _block_size(block_size)
        # {"partial" | "full" | "proxy": {field: tensor}}, only the sets that were given.
        self.sets = {}
        for kind, tensors in sets.items():
            if all(t is None for t in tensors):
                continue
            if any(t is None for t in tensors):
                missing = [f for f, t in zip(self.set_fields, tensors) if t is None]
                raise _tensors.fail(f"{kind}.{missing[0]}", f"the {kind} set needs {' and '.join(self.set_fields)}")
            self.sets[kind] = {f: _tensors.to_int32(t) for f, t in zip(self.set_fields, tensors)}
        self.extra = {name: _tensors.to_int32(t) for name, t in (extra or {}).items() if t is not None}

    def slots(self):
        """Extension input slots: '<set>.<field>' and extra metadata tensors."""
        slots = {f"{kind}.{field}": t for kind, tensors in self.sets.items() for field, t in tensors.items()}
        slots.update(self.extra)
        return slots

    def geometry(self):
        """(sparsity_batch, sparsity_heads) as the tensors' shapes give them."""
        return 1, 1

    def _first(self, field):
        for kind in ("partial", "full", "proxy"):
            if kind in self.sets:
                return self.sets[kind][field]
        raise _tensors.fail(f"partial.{field}", "no block set was given")

    def __repr__(self):
        shapes = {f"{k}.{f}": list(_tensors.shape_of(t)) for k, s in self.sets.items() for f, t in s.items()}
        return f"{type(self).__name__}(block_size={self.block_size}, {shapes})"


class AllBlocks(Sparsity):
    """No sparsity tensors: every KV block is partial, the token mask alone decides (dense)."""

    format = "all_blocks"

    def __init__(self, block_size=(128, 128)):
        super().__init__(block_size, {})


class BlockLists(Sparsity):
    """FlexAttention / FlashAttention block lists (SPEC §3.1).

    ``counts [Bs, Hs, nQB]`` and ``indices [Bs, Hs, nQB, L]``: row (b, h, qb) attends
    ``indices[b, h, qb, :counts[b, h, qb]]`` (ascending, unique). ``Bs`` is 1 or the batch,
    ``Hs`` is 1, the KV heads or the query heads.
    """

    format = "block_lists"
    set_fields = ("counts", "indices")

    def __init__(self, counts=None, indices=None, *, block_size, full_counts=None, full_indices=None,
                 proxy_counts=None, proxy_indices=None):
        super().__init__(block_size, {"partial": (counts, indices), "full": (full_counts, full_indices),
                                      "proxy": (proxy_counts, proxy_indices)})

    def geometry(self):
        counts = self._first("counts")
        shape = _tensors.shape_of(counts)
        if len(shape) != 3:
            raise _tensors.fail("partial.counts", f"expected [Bs, Hs, nQB], got {list(shape)}")
        return shape[0], shape[1]


class VarlenBlockLists(Sparsity):
    """Packed varlen block lists (SPEC §3.2): ``counts [Hs, total_m_blocks]``,
    ``indices [Hs, total_n_blocks]``; row (b, qb) of head h reads
    ``counts[h, cu_total_m_blocks[b] + qb]`` and its indices start at
    ``indices[h, cu_block_idx_offsets[b] + qb * nKB(b)]``. The two offset tensors are derived
    from the sequence lengths when omitted (see `bsattn.varlen_block_offsets`).
    """

    format = "varlen_block_lists"
    set_fields = ("counts", "indices")

    def __init__(self, counts=None, indices=None, *, block_size, cu_total_m_blocks=None, cu_block_idx_offsets=None,
                 full_counts=None, full_indices=None, proxy_counts=None, proxy_indices=None):
        super().__init__(block_size, {"partial": (counts, indices), "full": (full_counts, full_indices),
                                      "proxy": (proxy_counts, proxy_indices)},
                         {"cu_total_m_blocks": cu_total_m_blocks, "cu_block_idx_offsets": cu_block_idx_offsets})

    def geometry(self):
        shape = _tensors.shape_of(self._first("counts"))
        if len(shape) != 2:
            raise _tensors.fail("partial.counts", f"expected [Hs, total_m_blocks], got {list(shape)}")
        return 1, shape[0]


class BSR(Sparsity):
    """FlashInfer-style block compressed sparse rows (SPEC §3.3): ``indptr [R + 1]``,
    ``indices [nnz]``. Rows run in block-list order: batched ``(b, h, qb)`` over
    ``[batch, heads, nQB]``; varlen ``(h, m)`` over ``[heads, total_m_blocks]``.
    """

    format = "bsr"
    set_fields = ("indptr", "indices")

    def __init__(self, indptr=None, indices=None, *, block_size, heads=1, batch=1, cu_total_m_blocks=None,
                 full_indptr=None, full_indices=None, proxy_indptr=None, proxy_indices=None):
        super().__init__(block_size, {"partial": (indptr, indices), "full": (full_indptr, full_indices),
                                      "proxy": (proxy_indptr, proxy_indices)},
                         {"cu_total_m_blocks": cu_total_m_blocks})
        self.heads, self.batch = int(heads), int(batch)

    def geometry(self):
        return self.batch, self.heads


class Bitmask(Sparsity):
    """Packed bitmask (SPEC §3.4): uint32 words ``[Bs, Hs, nQB, W]`` (varlen
    ``[Hs, total_m_blocks, W]``); bit r of word w selects KV block ``32 w + r``. int32 words
    (PyTorch has no general uint32) are read as the same bits.
    """

    format = "bitmask"
    set_fields = ("bits",)

    def __init__(self, bits=None, *, block_size, full_bits=None, proxy_bits=None, cu_total_m_blocks=None):
        super().__init__(block_size, {"partial": (bits,), "full": (full_bits,), "proxy": (proxy_bits,)},
                         {"cu_total_m_blocks": cu_total_m_blocks})

    def geometry(self):
        shape = _tensors.shape_of(self._first("bits"))
        if len(shape) == 4:
            return shape[0], shape[1]
        if len(shape) == 3:
            return 1, shape[0]
        raise _tensors.fail("partial.bits", f"expected [Bs, Hs, nQB, W] or [Hs, total_m_blocks, W], got {list(shape)}")
