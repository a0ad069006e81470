"""bsattn.merge_state / merge_states: attention over disjoint subsets of each row's KV blocks,
merged by LSE, against a NumPy float64 merge, the float64 attention reference over the union and
one bsattn pass over the union; the -inf / NaN rules, in place, errors; PyTorch CPU and CUDA."""

import numpy as np
import pytest

import bsattn
from conftest import assert_close, assert_lse_close, random_blocks, random_qkv, reference, reference_batched

ml_dtypes = pytest.importorskip("ml_dtypes")


def reference_merge(outs, lses):
    """float64 merge of stacked parts: outs [N, B, S, H, D] or [N, T, H, D], lses [N, B, H, S] or
    [N, H, T]. Returns (out, lse) in the layouts of one part."""
    o = np.asarray(outs, np.float64)
    lse = np.moveaxis(np.asarray(lses, np.float64), -2, -1)  # LSE per O row: [N, ..., S/T, H]
    m = lse.max(axis=0)
    empty = np.isneginf(m)
    shift = np.where(empty, 0.0, m)
    w = np.exp(lse - shift)  # 0 for empty parts
    total = w.sum(axis=0)
    weighted = np.where(w[..., None] > 0, w[..., None] * o, 0.0).sum(axis=0)
    out = np.where(empty[..., None], 0.0, weighted / np.where(empty, 1.0, total)[..., None])
    merged_lse = np.where(empty, -np.inf, shift + np.log(np.where(empty, 1.0, total)))
    return out, np.moveaxis(merged_lse, -1, -2)


def split_blocks(rng, dense, parts):
    """`parts` disjoint dense block masks whose union is `dense`; part 0 takes every block of the
    first row (so the other parts have an empty row there)."""
    owner = rng.integers(0, parts, dense.shape)
    owner[..., 0, :] = 0
    return [dense & (owner == i) for i in range(parts)]


@pytest.mark.parametrize("parts", [1, 2, 3])
def test_split_kv_merges_into_the_whole(rng, parts):
    block_size = (32, 32)
    q, k, v = random_qkv(rng, (2, 100, 4, 32), (2, 150, 2, 32))
    dense = random_blocks(rng, (1, 2, 4, 5), density=0.6)
    dense[0, 1, 2] = False  # a row empty in every part
    mask = bsattn.Mask(causal=True)
    results = [bsattn.attention(q, k, v, bsattn.from_dense_block_mask(d, block_size), mask=mask, return_lse=True)
               for d in split_blocks(rng, dense, parts)]
    outs, lses = np.stack([r[0] for r in results]), np.stack([r[1] for r in results])

    out, lse = bsattn.merge_states(outs, lses)
    assert out.shape == q.shape and out.dtype == np.float32 and lse.shape == (2, 4, 100)
    expected, expected_lse = reference_merge(outs, lses)
    np.testing.assert_allclose(out, expected, atol=1e-6, rtol=1e-5)
    assert_lse_close(lse, expected_lse)
    whole, whole_lse = reference_batched(q, k, v, dense, None, block_size, reference.MaskSpec(causal=True))
    assert_close(out, whole, np.float32)
    assert_lse_close(lse, whole_lse)
    one_pass, one_pass_lse = bsattn.attention(q, k, v, bsattn.from_dense_block_mask(dense, block_size), mask=mask,
                                              return_lse=True)
    np.testing.assert_allclose(out, one_pass, atol=1e-5, rtol=1e-4)
    assert np.all(out[:, 64:96, 2:4] == 0) and np.all(np.isneginf(lse[:, 2:4, 64:96]))
    if parts == 2:
        pair, pair_lse = bsattn.merge_state(results[0][0], results[0][1], results[1][0], results[1][1])
        np.testing.assert_array_equal(pair, out)
        np.testing.assert_array_equal(pair_lse, lse)


def test_varlen_bf16_parts(rng):
    seqlens = [70, 0, 33]
    cu = np.cumsum([0] + seqlens).astype(np.int32)
    total, heads, dim = int(cu[-1]), 3, 40
    outs = rng.standard_normal((3, total, heads, dim)).astype(ml_dtypes.bfloat16)
    lses = (3 * rng.standard_normal((3, heads, total))).astype(np.float32)
    lses[rng.random(lses.shape) < 0.2] = -np.inf
    lses[:, :, 5] = -np.inf  # a row empty in every part
    out, lse = bsattn.merge_states(outs, lses)
    assert out.dtype == ml_dtypes.bfloat16 and out.shape == (total, heads, dim) and lse.shape == (heads, total)
    expected, expected_lse = reference_merge(outs, lses)
    np.testing.assert_allclose(np.asarray(out, np.float64), expected, atol=1e-5, rtol=1e-2)
    assert_lse_close(lse, expected_lse)
    assert np.all(np.asarray(out[5], np.float64) == 0)


def test_rules_and_in_place():
    # One token row per rule, H = 1, D = 2: every part empty; a NaN LSE; one part of two.
    out_a = np.array([[[[1.0, 2.0]], [[1.0, 2.0]], [[np.nan, np.nan]]]], np.float32)
    out_b = np.array([[[[3.0, 4.0]], [[3.0, 4.0]], [[5.0, 6.0]]]], np.float32)
    lse_a = np.array([[[-np.inf, np.nan, -np.inf]]], np.float32)
    lse_b = np.array([[[-np.inf, 0.0, 2.0]]], np.float32)
    out, lse = bsattn.merge_state(out_a, lse_a, out_b, lse_b, out=out_a, lse=lse_a)
    assert out is out_a and lse is lse_a  # in place
    np.testing.assert_array_equal(out[0, 0, 0], [0.0, 0.0])
    assert np.all(np.isnan(out[0, 1, 0])) and np.isnan(lse[0, 0, 1])
    np.testing.assert_array_equal(out[0, 2, 0], [5.0, 6.0])
    assert lse[0, 0, 0] == -np.inf and lse[0, 0, 2] == 2.0


def test_errors():
    out = np.zeros((1, 4, 2, 8), np.float32)
    lse = np.zeros((1, 2, 4), np.float32)
    with pytest.raises(bsattn.BsattnError) as error:
        bsattn.merge_state(out, lse, np.zeros((1, 4, 3, 8), np.float32), lse)
    assert error.value.argument == "out_b"
    with pytest.raises(bsattn.BsattnError) as error:
        bsattn.merge_state(out, lse, out, lse.astype(np.float16))
    assert error.value.argument == "lse_b"
    with pytest.raises(bsattn.BsattnError) as error:
        bsattn.merge_states(out[None], np.zeros((2, 1, 2, 4), np.float32))
    assert error.value.argument == "lses"
    with pytest.raises(bsattn.BsattnError) as error:
        bsattn.merge_states(out[None], lse[None], out=np.zeros((1, 4, 2, 8), np.float16))
    assert error.value.argument == "out"


def test_torch_cpu(rng):
    torch = pytest.importorskip("torch")
    outs = torch.randn(4, 2, 9, 3, 64, dtype=torch.float16)
    lses = torch.randn(4, 2, 3, 9) * 2
    lses[lses < -2] = -float("inf")
    out, lse = bsattn.merge_states(outs, lses)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float16 and lse.dtype == torch.float32
    expected, expected_lse = reference_merge(outs.float().numpy(), lses.numpy())
    np.testing.assert_allclose(out.float().numpy(), expected, atol=1e-4, rtol=2e-3)
    assert_lse_close(lse.numpy(), expected_lse)
    # Transposed views (any strides with a contiguous last dimension) and a given output.
    a = outs[0].transpose(1, 2).contiguous().transpose(1, 2)
    target = torch.empty_like(outs[0])
    pair, _ = bsattn.merge_state(a, lses[0], outs[1], lses[1], out=target)
    assert pair is target
    expected, _ = reference_merge(outs[:2].float().numpy(), lses[:2].numpy())
    np.testing.assert_allclose(pair.float().numpy(), expected, atol=1e-4, rtol=2e-3)


def test_torch_cuda_matches_cpu():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available() or not bsattn.built_with_cuda:
        pytest.skip("needs a CUDA device and bsattn built with BSATTN_ENABLE_CUDA=ON")
    generator = torch.Generator().manual_seed(5)
    outs = torch.randn(3, 1001, 8, 128, generator=generator).to(torch.bfloat16)
    lses = torch.randn(3, 8, 1001, generator=generator) * 3
    lses[torch.rand(3, 8, 1001, generator=generator) < 0.2] = -float("inf")
    lses[:, :, 7] = -float("inf")
    cpu_out, cpu_lse = bsattn.merge_states(outs, lses)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        gpu_outs, gpu_lses = outs.cuda(), lses.cuda()
        gpu_out, gpu_lse = bsattn.merge_states(gpu_outs, gpu_lses)
        # In place into part 0, on the current stream.
        bsattn.merge_state(gpu_outs[0], gpu_lses[0], gpu_outs[1], gpu_lses[1], out=gpu_outs[0], lse=gpu_lses[0])
    stream.synchronize()
    torch.testing.assert_close(gpu_out.cpu(), cpu_out, atol=1e-6, rtol=1 / 128)
    torch.testing.assert_close(gpu_lse.cpu(), cpu_lse, atol=2e-6, rtol=2e-6)
    assert torch.all(gpu_out[7] == 0) and torch.all(torch.isneginf(gpu_lse[:, 7]))
    pair, pair_lse = bsattn.merge_state(outs[0], lses[0], outs[1], lses[1])
    torch.testing.assert_close(gpu_outs[0].cpu(), pair, atol=1e-6, rtol=1 / 128)
    torch.testing.assert_close(gpu_lses[0].cpu(), pair_lse, atol=2e-6, rtol=2e-6)
