"""The Python package on the CPU engine with NumPy arrays, against the float64 reference."""

from types import SimpleNamespace

import numpy as np
import pytest
from conftest import (assert_close, assert_lse_close, random_blocks, random_qkv, reference, reference_batched,
                      reference_varlen)

import bsattn


def blocks_shape(bs, hs, sq, skv, block_size):
    return (bs, hs, -(-sq // block_size[0]), -(-skv // block_size[1]))


def split_partial_full(rng, shape):
    """Disjoint random partial and full patterns."""
    selected = random_blocks(rng, shape, 0.6)
    full = selected & random_blocks(rng, shape, 0.4)
    return selected & ~full, full


# ---- Adapters ----------------------------------------------------------------------------

def test_flex_block_mask_fields(rng):
    """A BlockMask-shaped object (the fields FlexAttention's BlockMask has) with partial and full
    blocks; list entries past each count are garbage and must not be read."""
    block_size = (64, 32)
    q, k, v = random_qkv(rng, (2, 150, 4, 32), (2, 200, 4, 32))
    partial, full = split_partial_full(rng, blocks_shape(2, 4, 150, 200, block_size))
    counts, indices = reference.block_lists(partial, pad_value=3)
    full_counts, full_indices = reference.block_lists(full, pad_value=0)
    block_mask = SimpleNamespace(kv_num_blocks=counts, kv_indices=indices, full_kv_num_blocks=full_counts,
                                 full_kv_indices=full_indices, BLOCK_SIZE=block_size)
    mask = bsattn.Mask(causal=True)
    out = bsattn.attention(q, k, v, bsattn.from_block_mask(block_mask), mask=mask)
    expected, _ = reference_batched(q, k, v, partial, full, block_size, reference.MaskSpec(causal=True))
    assert_close(out, expected, np.float32)


def test_flex_block_mask_broadcast_batch_and_heads(rng):
    block_size = (128, 128)
    q, k, v = random_qkv(rng, (3, 300, 2, 64), (3, 300, 2, 64))
    partial = random_blocks(rng, blocks_shape(1, 1, 300, 300, block_size))
    counts, indices = reference.block_lists(partial)
    block_mask = SimpleNamespace(kv_num_blocks=counts, kv_indices=indices, full_kv_num_blocks=None,
                                 full_kv_indices=None, BLOCK_SIZE=block_size)
    out = bsattn.attention(q, k, v, bsattn.from_block_mask(block_mask))
    expected, _ = reference_batched(q, k, v, partial, None, block_size)
    assert_close(out, expected, np.float32)


def test_flash_attention_batched_tuple(rng):
    block_size = (64, 64)
    q, k, v = random_qkv(rng, (2, 130, 2, 64), (2, 190, 2, 64))
    partial, full = split_partial_full(rng, blocks_shape(2, 2, 130, 190, block_size))
    tensors = (*reference.block_lists(partial), *reference.block_lists(full))
    sparsity = bsattn.from_flash_attention(tensors, block_size)
    assert isinstance(sparsity, bsattn.BlockLists)
    out = bsattn.attention(q, k, v, sparsity, mask=bsattn.Mask(causal=True))
    expected, _ = reference_batched(q, k, v, partial, full, block_size, reference.MaskSpec(causal=True))
    assert_close(out, expected, np.float32)


@pytest.mark.parametrize("give_offsets", [True, False])
def test_flash_attention_varlen_packed_with_empty_sequence(rng, give_offsets):
    block_size = (64, 32)
    seqlens_q, seqlens_k = [70, 0, 130], [50, 40, 200]
    cu_q, cu_k = np.cumsum([0] + seqlens_q).astype(np.int32), np.cumsum([0] + seqlens_k).astype(np.int32)
    q, k, v = random_qkv(rng, (cu_q[-1], 4, 32), (cu_k[-1], 2, 32))
    hs = 2
    dense = [random_blocks(rng, (hs, -(-sq // block_size[0]), -(-sk // block_size[1])))
             for sq, sk in zip(seqlens_q, seqlens_k)]
    counts, indices, cu_m, cu_n = reference.varlen_block_lists(dense)
    fields = SimpleNamespace(mask_block_cnt=counts, mask_block_idx=indices, full_block_cnt=None,
                             full_block_idx=None, cu_total_m_blocks=cu_m if give_offsets else None,
                             cu_block_idx_offsets=cu_n if give_offsets else None)
    sparsity = bsattn.from_flash_attention(fields, block_size)
    assert isinstance(sparsity, bsattn.VarlenBlockLists)
    out, lse = bsattn.attention(q, k, v, sparsity, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, mask=bsattn.Mask(causal=True),
                                return_lse=True)
    expected, expected_lse = reference_varlen(q, k, v, cu_q, cu_k, dense, block_size, reference.MaskSpec(causal=True))
    assert out.shape == q.shape and lse.shape == (4, cu_q[-1])
    assert_close(out, expected, np.float32)
    assert_lse_close(lse, expected_lse)


def test_flashinfer_bsr_causal(rng):
    block_size = (16, 16)
    q, k, v = random_qkv(rng, (1, 100, 4, 64), (1, 100, 4, 64))
    dense = random_blocks(rng, blocks_shape(1, 1, 100, 100, block_size))
    indptr, indices = reference.bsr(dense)
    sparsity = bsattn.from_flashinfer_bsr(indptr, indices, 16, 16)
    out = bsattn.attention(q, k, v, sparsity, mask=bsattn.Mask(causal=True))
    expected, _ = reference_batched(q, k, v, dense, None, block_size, reference.MaskSpec(causal=True))
    assert_close(out, expected, np.float32)


def test_bsr_per_head_with_full_set(rng):
    block_size = (32, 64)
    q, k, v = random_qkv(rng, (2, 96, 2, 32), (2, 200, 2, 32))
    partial, full = split_partial_full(rng, blocks_shape(2, 2, 96, 200, block_size))
    sparsity = bsattn.BSR(*reference.bsr(partial), block_size=block_size, heads=2, batch=2,
                          full_indptr=reference.bsr(full)[0], full_indices=reference.bsr(full)[1])
    out = bsattn.attention(q, k, v, sparsity, mask=bsattn.Mask(window=(40, 10)))
    spec = reference.MaskSpec(window_left=40, window_right=10)
    expected, _ = reference_batched(q, k, v, partial, full, block_size, spec)
    assert_close(out, expected, np.float32)


@pytest.mark.parametrize("rank", [2, 3, 4])
def test_dense_block_mask(rng, rank):
    block_size = (64, 64)
    q, k, v = random_qkv(rng, (2, 200, 2, 32), (2, 260, 2, 32))
    shape = blocks_shape(2 if rank == 4 else 1, 2 if rank >= 3 else 1, 200, 260, block_size)
    partial, full = split_partial_full(rng, shape)
    selected = (partial | full).reshape(shape[4 - rank:])
    sparsity = bsattn.from_dense_block_mask(selected, block_size, full=full.reshape(shape[4 - rank:]))
    out = bsattn.attention(q, k, v, sparsity, mask=bsattn.Mask(causal=True, alignment="top_left"))
    expected, _ = reference_batched(q, k, v, partial, full, block_size,
                                    reference.MaskSpec(causal=True, top_left=True))
    assert_close(out, expected, np.float32)


@pytest.mark.parametrize("word_dtype", [np.uint32, np.int32])
def test_bitmask(rng, word_dtype):
    block_size = (16, 16)
    q, k, v = random_qkv(rng, (1, 80, 2, 64), (1, 600, 2, 64))  # 38 KV blocks: two words per row
    dense = random_blocks(rng, blocks_shape(1, 2, 80, 600, block_size))
    words = reference.bitmask(dense)
    words[..., -1] |= np.uint32(1 << 31)  # a bit past nKB: ignored
    out = bsattn.attention(q, k, v, bsattn.Bitmask(words.view(word_dtype), block_size=block_size))
    expected, _ = reference_batched(q, k, v, dense, None, block_size)
    assert_close(out, expected, np.float32)


# ---- Mask options, GQA, dtypes -------------------------------------------------------------

MASKS = {
    "causal": (dict(causal=True), reference.MaskSpec(causal=True)),
    "causal_top_left": (dict(causal=True, alignment="top_left"), reference.MaskSpec(causal=True, top_left=True)),
    "sliding_window": (dict(causal=True, window=(48, 0)),
                       reference.MaskSpec(causal=True, window_left=48, window_right=0)),
    "window_both_sides": (dict(window=(20, 30)), reference.MaskSpec(window_left=20, window_right=30)),
    "window_with_sinks": (dict(causal=True, window=(16, None), sink_tokens=8),
                          reference.MaskSpec(causal=True, window_left=16, sink_tokens=8)),
}


@pytest.mark.parametrize("name", list(MASKS))
def test_mask_options(rng, name):
    block_size = (64, 32)
    q, k, v = random_qkv(rng, (2, 100, 2, 32), (2, 140, 2, 32))
    dense = random_blocks(rng, blocks_shape(1, 2, 100, 140, block_size), 0.7)
    options, spec = MASKS[name]
    out, lse = bsattn.attention(q, k, v, bsattn.BlockLists(*reference.block_lists(dense), block_size=block_size),
                                mask=bsattn.Mask(**options), return_lse=True)
    expected, expected_lse = reference_batched(q, k, v, dense, None, block_size, spec)
    assert_close(out, expected, np.float32)
    assert_lse_close(lse, expected_lse)


@pytest.mark.parametrize("valid_as", ["words", "booleans"])
def test_document_ids_and_kv_valid(rng, valid_as):
    b, s = 2, 120
    q, k, v = random_qkv(rng, (b, s, 2, 32), (b, s, 2, 32))
    doc = np.sort(rng.integers(0, 4, (b, s)), axis=1)  # int64: converted
    valid = rng.random((b, s)) < 0.8
    kv_valid = reference.bitmask(valid) if valid_as == "words" else valid
    mask = bsattn.Mask(causal=True, doc_ids=(doc, doc), kv_valid=kv_valid)
    out = bsattn.attention(q, k, v, mask=mask)
    dense = np.ones((1, 1, 1, 1), bool)
    expected, _ = reference_batched(q, k, v, dense, None, (128, 128), reference.MaskSpec(causal=True),
                                    doc_ids=(doc, doc), kv_valid=valid)
    assert_close(out, expected, np.float32)


@pytest.mark.parametrize("sparsity_heads", [1, 2, 8])
def test_gqa(rng, sparsity_heads):
    block_size = (64, 64)
    q, k, v = random_qkv(rng, (1, 190, 8, 64), (1, 190, 2, 64))
    dense = random_blocks(rng, blocks_shape(1, sparsity_heads, 190, 190, block_size))
    out = bsattn.attention(q, k, v, bsattn.BlockLists(*reference.block_lists(dense), block_size=block_size),
                           mask=bsattn.Mask(causal=True), scale=0.05)
    expected, _ = reference_batched(q, k, v, dense, None, block_size, reference.MaskSpec(causal=True), scale=0.05)
    assert_close(out, expected, np.float32)


def test_float16_and_strided_inputs(rng):
    """fp16 in, fp32 out; Q and K/V as [B, H, S, D] storage viewed as [B, S, H, D]."""
    q, k, v = (x.transpose(0, 2, 1, 3) for x in random_qkv(rng, (2, 4, 96, 64), (2, 4, 96, 64), np.float16))
    out = bsattn.attention(q, k, v, mask=bsattn.Mask(causal=True), out_dtype=np.float32)
    assert out.dtype == np.float32
    dense = np.ones(blocks_shape(1, 1, 96, 96, (128, 128)), bool)
    expected, _ = reference_batched(q, k, v, dense, None, (128, 128), reference.MaskSpec(causal=True))
    assert_close(out, expected, np.float16)


def test_bfloat16_numpy(rng):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    q, k, v = random_qkv(rng, (1, 64, 2, 64), (1, 64, 2, 64), ml_dtypes.bfloat16)
    out = bsattn.attention(q, k, v, mask=bsattn.Mask(causal=True))
    assert out.dtype == ml_dtypes.bfloat16
    dense = np.ones((1, 1, 1, 1), bool)
    expected, _ = reference_batched(q, k, v, dense, None, (128, 128), reference.MaskSpec(causal=True))
    assert_close(out, expected, ml_dtypes.bfloat16)


# ---- Layouts, outputs, proxies ------------------------------------------------------------

def test_paged_kv(rng):
    page_size, b, hkv, d = 16, 2, 2, 32
    seq_lens = np.array([70, 33], np.int32)
    num_pages = 12
    k_cache, v_cache = (rng.standard_normal((num_pages, page_size, hkv, d)).astype(np.float32) for _ in range(2))
    table = np.full((b, 8), -1, np.int32)  # padded rows: entries past the length are never read
    pages = rng.permutation(num_pages)
    table[0, :5], table[1, :3] = pages[:5], pages[5:8]
    q = rng.standard_normal((b, 20, 4, d)).astype(np.float32)
    out = bsattn.attention(q, k_cache, v_cache, block_table=table, seq_lens_kv=seq_lens, mask=bsattn.Mask(causal=True))
    for i in range(b):
        rows = np.concatenate([np.arange(p * page_size, (p + 1) * page_size) for p in table[i, :5] if p >= 0])
        k = k_cache.reshape(-1, hkv, d)[rows][: seq_lens[i]]
        v = v_cache.reshape(-1, hkv, d)[rows][: seq_lens[i]]
        dense = np.ones((1, 1, 1, 1), bool)
        expected, _ = reference_batched(q[i:i + 1], k[None], v[None], dense, None, (128, 128),
                                        reference.MaskSpec(causal=True))
        assert_close(out[i:i + 1], expected, np.float32)


def test_out_and_lse_arguments_are_written(rng):
    q, k, v = random_qkv(rng, (1, 64, 2, 32), (1, 64, 2, 32))
    out = np.full(q.shape, np.nan, np.float32)
    lse = np.full((1, 2, 64), np.nan, np.float32)
    result, result_lse = bsattn.attention(q, k, v, out=out, lse=lse, return_lse=True)
    assert result is out and result_lse is lse
    expected, expected_lse = reference_batched(q, k, v, np.ones((1, 1, 1, 1), bool), None, (128, 128))
    assert_close(out, expected, np.float32)
    assert_lse_close(lse, expected_lse)


def test_empty_rows_have_zero_output_and_minus_infinity_lse(rng):
    block_size = (64, 64)
    q, k, v = random_qkv(rng, (1, 128, 1, 32), (1, 128, 1, 32))
    dense = np.array([[[[True, False], [False, False]]]])
    out, lse = bsattn.attention(q, k, v, bsattn.from_dense_block_mask(dense, block_size), return_lse=True)
    assert np.all(out[0, 64:] == 0) and np.all(np.isneginf(lse[0, 0, 64:]))
    assert np.all(np.isfinite(lse[0, 0, :64]))


def test_build_summaries(rng):
    k, v = (rng.standard_normal((2, 100, 2, 32)).astype(np.float32) for _ in range(2))
    summaries = bsattn.build_summaries(k, v, 32)
    assert summaries.k_summary.shape == (2, 4, 2, 32)
    for j in range(4):
        np.testing.assert_allclose(summaries.k_summary[:, j], k[:, 32 * j:32 * j + 32].mean(axis=1), atol=1e-5)
        np.testing.assert_allclose(summaries.v_summary[:, j], v[:, 32 * j:32 * j + 32].sum(axis=1), atol=1e-4)


def test_proxy_eligible_and_explicit(rng):
    block_size = (64, 32)
    q, k, v = random_qkv(rng, (1, 128, 2, 32), (1, 150, 2, 32))
    summaries = bsattn.build_summaries(k, v, block_size[1])
    dense = random_blocks(rng, blocks_shape(1, 2, 128, 150, block_size))
    lists = reference.block_lists(dense)
    out = bsattn.attention(q, k, v, bsattn.BlockLists(*lists, block_size=block_size), proxy=summaries)
    expected, _ = reference_batched(q, k, v, dense, None, block_size, proxy="eligible", summaries=summaries)
    assert_close(out, expected, np.float32)

    chosen = random_blocks(rng, dense.shape)
    proxy_counts, proxy_indices = reference.block_lists(chosen)
    sparsity = bsattn.BlockLists(*lists, block_size=block_size, proxy_counts=proxy_counts, proxy_indices=proxy_indices)
    out = bsattn.attention(q, k, v, sparsity, proxy=summaries)
    expected, _ = reference_batched(q, k, v, dense, None, block_size, proxy=chosen, summaries=summaries)
    assert_close(out, expected, np.float32)


def test_varlen_block_offsets():
    cu_q = np.array([0, 70, 70, 200], np.int32)
    cu_k = np.array([0, 50, 90, 290], np.int32)
    m_blocks, offsets = bsattn.varlen_block_offsets(cu_q, (64, 32), cu_seqlens_k=cu_k)
    assert m_blocks.tolist() == [0, 2, 2, 5]
    assert offsets.tolist() == [0, 4, 4, 4 + 3 * 7]


def test_varlen_block_offsets_paged():
    # Paged KV: the lengths alone decide the offsets; no block table is needed.
    cu_q = np.array([0, 100, 164], np.int32)
    m_blocks, offsets = bsattn.varlen_block_offsets(cu_q, (64, 64), seq_lens_kv=np.array([300, 5], np.int32))
    assert m_blocks.tolist() == [0, 2, 3]
    assert offsets.tolist() == [0, 2 * 5, 2 * 5 + 1 * 1]


# ---- Plans ---------------------------------------------------------------------------------

def test_plan_reuse_with_new_values(rng):
    block_size = (64, 64)
    shape = blocks_shape(1, 2, 130, 130, block_size)
    q, k, v = random_qkv(rng, (2, 130, 2, 32), (2, 130, 2, 32))
    first = random_blocks(rng, shape)
    plan = bsattn.Plan(q, k, v, bsattn.BlockLists(*reference.block_lists(first), block_size=block_size),
                       mask=bsattn.Mask(causal=True), validate=False)
    assert plan.tiles["tile_m"] == 64 and plan.workspace_bytes > 0
    for _ in range(3):
        q, k, v = random_qkv(rng, (2, 130, 2, 32), (2, 130, 2, 32))
        dense = random_blocks(rng, shape)
        out = plan(q, k, v, bsattn.BlockLists(*reference.block_lists(dense), block_size=block_size))
        expected, _ = reference_batched(q, k, v, dense, None, block_size, reference.MaskSpec(causal=True))
        assert_close(out, expected, np.float32)
    # Arguments given at planning time are reused.
    out = plan(q, k, v)
    expected, _ = reference_batched(q, k, v, first, None, block_size, reference.MaskSpec(causal=True))
    assert_close(out, expected, np.float32)


def test_plan_rejects_another_problem(rng):
    q, k, v = random_qkv(rng, (1, 64, 2, 32), (1, 64, 2, 32))
    plan = bsattn.Plan(q, k, v)
    q2, k2, v2 = random_qkv(rng, (1, 80, 2, 32), (1, 80, 2, 32))
    with pytest.raises(bsattn.BsattnError, match="max_seqlen_q") as error:
        plan(q2, k2, v2)
    assert error.value.argument == "problem.max_seqlen_q"


# ---- Errors --------------------------------------------------------------------------------

def test_out_of_range_index_names_the_argument(rng):
    block_size = (64, 64)
    q, k, v = random_qkv(rng, (1, 128, 1, 32), (1, 128, 1, 32))
    counts = np.array([[[1, 1]]], np.int32)
    indices = np.array([[[[0, 0], [5, 0]]]], np.int32)
    with pytest.raises(bsattn.BsattnError, match=r"partial\.indices.*5") as error:
        bsattn.attention(q, k, v, bsattn.BlockLists(counts, indices, block_size=block_size))
    assert isinstance(error.value, ValueError)
    assert error.value.argument == "partial.indices"


def test_structural_errors(rng):
    q, k, v = random_qkv(rng, (1, 64, 2, 32), (1, 64, 2, 32))
    with pytest.raises(bsattn.BsattnError, match="q"):
        bsattn.attention(q[0], k, v)
    with pytest.raises(bsattn.BsattnError, match="float64"):
        bsattn.attention(q.astype(np.float64), k, v)
    with pytest.raises(bsattn.BsattnError, match="v"):
        bsattn.attention(q, k, v[:, :, :1])
    read_only = np.empty_like(q)
    read_only.flags.writeable = False
    with pytest.raises(bsattn.BsattnError, match="out"):
        bsattn.attention(q, k, v, out=read_only)
    with pytest.raises(bsattn.BsattnError, match="proxy"):
        bsattn.attention(q, k, v, bsattn.BlockLists(np.zeros((1, 1, 1), np.int32), np.zeros((1, 1, 1, 1), np.int32),
                                                    block_size=64, proxy_counts=np.zeros((1, 1, 1), np.int32),
                                                    proxy_indices=np.zeros((1, 1, 1, 1), np.int32)))
    with pytest.raises(bsattn.BsattnError, match="cu_seqlens_k"):
        bsattn.attention(q[0], k[0], v[0], cu_seqlens_q=np.array([0, 64], np.int32))
    with pytest.raises(bsattn.BsattnError, match="alignment"):
        bsattn.Mask(alignment="middle")


def test_varlen_queries_with_paged_kv_and_seqused_k(rng):
    """Varlen Q over a paged cache, and varlen Q over packed KV of which only seqused_k is used."""
    page_size, hkv, d = 16, 2, 32
    cu_q = np.array([0, 10, 10, 40], np.int32)
    lengths = np.array([50, 7, 33], np.int32)
    k_cache, v_cache = (rng.standard_normal((12, page_size, hkv, d)).astype(np.float32) for _ in range(2))
    table = rng.permutation(12)[:12].reshape(3, 4).astype(np.int32)
    q = rng.standard_normal((40, 4, d)).astype(np.float32)
    mask = bsattn.Mask(causal=True)
    paged = bsattn.attention(q, k_cache, v_cache, cu_seqlens_q=cu_q, block_table=table, seq_lens_kv=lengths, mask=mask)

    gathered = [np.concatenate([c[p] for p in row])[:n] for c in (k_cache, v_cache) for row, n in zip(table, lengths)]
    k = np.concatenate(gathered[:3] + [np.zeros((5, hkv, d), np.float32)])  # a used prefix per sequence
    v = np.concatenate(gathered[3:] + [np.zeros((5, hkv, d), np.float32)])
    cu_k = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    cu_k_padded = cu_k.copy()
    cu_k_padded[-1] += 5
    used = bsattn.attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k_padded, seqused_k=lengths, mask=mask)

    dense = [np.ones((1, 1, 1), bool)] * 3
    expected, _ = reference_varlen(q, k, v, cu_q, cu_k, dense, (128, 128), reference.MaskSpec(causal=True))
    assert_close(paged, expected, np.float32)
    assert_close(used, expected, np.float32)


@pytest.mark.parametrize("fmt", ["bitmask", "bsr"])
def test_varlen_bitmask_and_bsr(rng, fmt):
    """Varlen rows in SPEC §3.2 order: head-major, then the Q blocks of each sequence."""
    block_size = (32, 16)
    seqlens_q, seqlens_k = [40, 0, 90], [100, 30, 20]
    cu_q, cu_k = np.cumsum([0] + seqlens_q).astype(np.int32), np.cumsum([0] + seqlens_k).astype(np.int32)
    q, k, v = random_qkv(rng, (cu_q[-1], 2, 32), (cu_k[-1], 2, 32))
    dense = [random_blocks(rng, (2, -(-sq // 32), -(-sk // 16))) for sq, sk in zip(seqlens_q, seqlens_k)]
    max_kv_blocks = max(d.shape[2] for d in dense)
    padded = np.concatenate([np.pad(d, ((0, 0), (0, 0), (0, max_kv_blocks - d.shape[2]))) for d in dense], axis=1)
    if fmt == "bitmask":
        sparsity = bsattn.Bitmask(reference.bitmask(padded), block_size=block_size)
    else:
        sparsity = bsattn.BSR(*reference.bsr(padded), block_size=block_size, heads=2)
    out = bsattn.attention(q, k, v, sparsity, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    expected, _ = reference_varlen(q, k, v, cu_q, cu_k, dense, block_size)
    assert_close(out, expected, np.float32)
