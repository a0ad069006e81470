"""Sparsity from other libraries' structures. Each adapter only renames: the tensors are used as
they are (no copy) unless their integer dtype needs converting to int32.

The token mask does not travel: FlexAttention's ``mask_mod`` is a Python function, so pass the
equivalent `bsattn.Mask` (causal, window, documents) to `bsattn.attention` alongside.
"""

import numpy as np

from . import _tensors
from .sparsity import BSR, BlockLists, VarlenBlockLists


def from_block_mask(block_mask):
    """A ``torch.nn.attention.flex_attention.BlockMask`` (or any object with its fields:
    ``kv_num_blocks``, ``kv_indices``, ``full_kv_num_blocks``, ``full_kv_indices``,
    ``BLOCK_SIZE``) as `BlockLists`: FlexAttention's partial blocks (mask_mod evaluated) are
    bsattn's partial blocks and its full blocks bsattn's full blocks.

    FlexAttention tensors are ``[B, H, S, D]``; bsattn reads ``[B, S, H, D]``, so pass
    ``q.transpose(1, 2)`` (a view: no copy).
    """
    block_size = block_mask.BLOCK_SIZE
    block_size = (block_size, block_size) if isinstance(block_size, int) else tuple(block_size)
    return BlockLists(block_mask.kv_num_blocks, block_mask.kv_indices, block_size=block_size,
                      full_counts=getattr(block_mask, "full_kv_num_blocks", None),
                      full_indices=getattr(block_mask, "full_kv_indices", None))


_FLASH_FIELDS = ("mask_block_cnt", "mask_block_idx", "full_block_cnt", "full_block_idx", "cu_total_m_blocks",
                 "cu_block_idx_offsets")


def from_flash_attention(block_sparse_tensors, block_size=(128, 128)):
    """FlashAttention (CuTe) ``BlockSparseTensors``: an object with the fields
    ``mask_block_cnt``, ``mask_block_idx``, ``full_block_cnt``, ``full_block_idx`` (and, for the
    packed varlen form, ``cu_total_m_blocks``, ``cu_block_idx_offsets``), or a tuple of them in
    that order. Batched counts ``[B, H, num_m_blocks]`` give `BlockLists`; packed varlen counts
    ``[H, total_m_blocks]`` give `VarlenBlockLists`.
    """
    if isinstance(block_sparse_tensors, (tuple, list)) and not hasattr(block_sparse_tensors, "_fields"):
        fields = dict(zip(_FLASH_FIELDS, block_sparse_tensors))
    else:
        fields = {name: getattr(block_sparse_tensors, name, None) for name in _FLASH_FIELDS}
    counts = fields["mask_block_cnt"] if fields["mask_block_cnt"] is not None else fields["full_block_cnt"]
    if counts is None:
        raise _tensors.fail("mask_block_cnt", "no block counts were given")
    sets = dict(counts=fields["mask_block_cnt"], indices=fields["mask_block_idx"],
                full_counts=fields["full_block_cnt"], full_indices=fields["full_block_idx"])
    if len(_tensors.shape_of(counts)) == 2:
        return VarlenBlockLists(block_size=block_size, cu_total_m_blocks=fields["cu_total_m_blocks"],
                                cu_block_idx_offsets=fields["cu_block_idx_offsets"], **sets)
    return BlockLists(block_size=block_size, **sets)


def from_flashinfer_bsr(indptr, indices, R, C, *, heads=1, batch=1):
    """FlashInfer's block sparse row layout (``BlockSparseAttentionWrapper.plan(indptr, indices,
    M, N, R, C, ...)``): ``indptr [M / R + 1]``, ``indices [nnz]``, blocks of R query rows by C
    key columns, one pattern for every head. The blocks are partial: a `bsattn.Mask` (e.g.
    FlashInfer's ``causal=True``) applies inside them.
    """
    return BSR(indptr, indices, block_size=(R, C), heads=heads, batch=batch)


def _lists_from_dense(dense):
    """(counts, indices) of a boolean ``[..., nQB, nKB]`` block mask: the selected blocks of
    each row first, ascending (a stable sort of "not selected")."""
    if _tensors.is_torch(dense):
        import torch

        dense = dense.to(torch.bool)
        counts = dense.sum(-1, dtype=torch.int32)
        indices = torch.argsort((~dense).to(torch.uint8), dim=-1, stable=True).to(torch.int32)
        return counts, indices
    xp = np
    if _tensors.framework(dense) == "cupy":
        import cupy as xp
    dense = xp.asarray(dense).astype(bool)
    counts = dense.sum(-1, dtype=np.int32)
    indices = xp.argsort(~dense, axis=-1, kind="stable").astype(np.int32)
    return counts, indices


def _with_batch_and_heads(dense):
    rank = len(_tensors.shape_of(dense))
    if rank == 4:
        return dense
    if rank == 3:
        return dense[None]
    if rank == 2:
        return dense[None, None]
    raise _tensors.fail("block_mask", f"expected [nQB, nKB], [Hs, nQB, nKB] or [Bs, Hs, nQB, nKB], got rank {rank}")


def from_dense_block_mask(block_mask, block_size, *, full=None):
    """A dense boolean block mask ``[Bs, Hs, nQB, nKB]`` (or ``[Hs, nQB, nKB]``, ``[nQB, nKB]``):
    True selects a block. ``full`` (same shape) marks blocks the caller vouches are entirely
    visible, so the token mask is not evaluated there; they are attended whether or not
    ``block_mask`` selects them. Returns `BlockLists`.
    """
    block_mask = _with_batch_and_heads(block_mask)
    if full is None:
        counts, indices = _lists_from_dense(block_mask)
        return BlockLists(counts, indices, block_size=block_size)
    full = _with_batch_and_heads(full)
    if _tensors.is_torch(full):
        import torch

        full = full.to(torch.bool)
        partial = block_mask.to(torch.bool) & ~full
    else:
        full = full.astype(bool)
        partial = block_mask.astype(bool) & ~full
    counts, indices = _lists_from_dense(partial)
    full_counts, full_indices = _lists_from_dense(full)
    return BlockLists(counts, indices, block_size=block_size, full_counts=full_counts, full_indices=full_indices)
