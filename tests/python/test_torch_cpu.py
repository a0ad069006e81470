"""The PyTorch integration on the CPU engine: FlexAttention agreement, the custom ops
(opcheck, torch.compile), out=, plans. Skipped when PyTorch is not installed."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import bsattn  # noqa: E402
from conftest import reference  # noqa: E402
from flex_cases import CASES, bsattn_on_flex_layout, flex_reference, make_case  # noqa: E402


@pytest.mark.parametrize("name", CASES)
def test_matches_flex_attention(name):
    q, k, v, block_mask, mask = make_case(name, "cpu", torch.float32)
    expected = flex_reference(q, k, v, block_mask)
    torch.testing.assert_close(bsattn_on_flex_layout(q, k, v, block_mask, mask), expected, atol=2e-5, rtol=1e-4)


def test_torch_and_numpy_agree_on_varlen():
    rng = np.random.default_rng(7)
    cu_q = np.array([0, 50, 50, 170], np.int32)
    cu_k = np.array([0, 80, 100, 230], np.int32)
    q, k, v = (rng.standard_normal((n, 2, 32)).astype(np.float32) for n in (170, 230, 230))
    kwargs = dict(mask=bsattn.Mask(causal=True), return_lse=True)
    out, lse = bsattn.attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **kwargs)
    t = torch.from_numpy
    out_t, lse_t = bsattn.attention(t(q), t(k), t(v), cu_seqlens_q=t(cu_q), cu_seqlens_k=t(cu_k), **kwargs)
    np.testing.assert_array_equal(out_t.numpy(), out)
    np.testing.assert_array_equal(lse_t.numpy(), lse)


def op_arguments(q, k, v, sparsity=None, mask=None, **options):
    from bsattn import _api

    slots, flat = _api._flatten(sparsity, mask, None, scale=None, out_dtype=None, return_lse=True, validate=True,
                                num_threads=0, max_seqlen_q=None, max_seqlen_k=None, cu_seqlens_q=None,
                                cu_seqlens_k=None, seqused_k=None, block_table=None, seq_lens_kv=None)
    flat.update(options)
    return (q, k, v, [slots[n] for n in _api.SLOT_NAMES], *(flat[n] for n in _api.OPTION_NAMES))


def test_opcheck():
    q, k, v = torch.randn(1, 64, 2, 32), torch.randn(1, 96, 2, 32), torch.randn(1, 96, 2, 32)
    dense = torch.tensor([[[[True, False]]]])
    arguments = op_arguments(q, k, v, bsattn.from_dense_block_mask(dense, (64, 64)), bsattn.Mask(causal=True))
    torch.library.opcheck(torch.ops.bsattn.attention.default, arguments)
    out, lse = torch.empty_like(q), torch.empty(1, 2, 64)
    torch.library.opcheck(torch.ops.bsattn.attention_out.default, (*arguments, out, lse))


def test_compile_fullgraph_matches_eager():
    q, k, v, block_mask, mask = make_case("document", "cpu", torch.float32, seqlen=200)

    def run(q, k, v):
        return bsattn_on_flex_layout(q, k, v, block_mask, mask, return_lse=True)

    compiled = torch.compile(run, fullgraph=True)
    out, lse = compiled(q, k, v)
    expected_out, expected_lse = run(q, k, v)
    torch.testing.assert_close(out, expected_out, atol=0, rtol=0)
    torch.testing.assert_close(lse, expected_lse, atol=0, rtol=0)


def test_compile_with_out_argument():
    q, k, v = torch.randn(2, 100, 2, 32), torch.randn(2, 100, 2, 32), torch.randn(2, 100, 2, 32)

    @torch.compile(fullgraph=True)
    def run(q, k, v, out):
        bsattn.attention(q, k, v, mask=bsattn.Mask(causal=True), out=out)
        return out * 2

    out = torch.zeros_like(q)
    doubled = run(q, k, v, out)
    expected = bsattn.attention(q, k, v, mask=bsattn.Mask(causal=True))
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
    torch.testing.assert_close(doubled, 2 * expected, atol=0, rtol=0)


def test_inputs_requiring_grad_and_dtypes():
    q = torch.randn(1, 64, 2, 64, dtype=torch.bfloat16, requires_grad=True)
    k, v = torch.randn(1, 64, 2, 64, dtype=torch.bfloat16), torch.randn(1, 64, 2, 64, dtype=torch.bfloat16)
    out = bsattn.attention(q, k, v, mask=bsattn.Mask(causal=True))
    assert out.dtype == torch.bfloat16
    expected, _ = reference.attend_sequence(
        reference.Sequence(q[0].detach().double().numpy(), k[0].double().numpy(), v[0].double().numpy()),
        np.ones((2, 1, 1), bool), np.zeros((2, 1, 1), bool), (128, 128), reference.MaskSpec(causal=True))
    np.testing.assert_allclose(out[0].detach().float().numpy(), expected, atol=3e-2, rtol=3e-2)


def test_plan_with_torch_tensors_and_errors():
    q, k, v = torch.randn(1, 130, 2, 32), torch.randn(1, 130, 2, 32), torch.randn(1, 130, 2, 32)
    dense = torch.rand(1, 2, 3, 3) < 0.5
    plan = bsattn.Plan(q, k, v, bsattn.from_dense_block_mask(dense, 64), validate=False)
    expected = bsattn.attention(q, k, v, bsattn.from_dense_block_mask(dense, 64))
    torch.testing.assert_close(plan(q, k, v), expected, atol=0, rtol=0)
    counts = torch.ones(1, 1, 3, dtype=torch.int32)
    indices = torch.full((1, 1, 3, 1), 9, dtype=torch.int32)
    with pytest.raises(bsattn.BsattnError, match=r"partial\.indices"):
        bsattn.attention(q, k, v, bsattn.BlockLists(counts, indices, block_size=64))


def test_compile_with_dynamic_sequence_length():
    compiled = torch.compile(lambda q, k, v: bsattn.attention(q, k, v, mask=bsattn.Mask(causal=True)),
                             fullgraph=True, dynamic=True)
    for seqlen in (64, 100, 130):
        q, k, v = (torch.randn(1, seqlen, 2, 32) for _ in range(3))
        expected = bsattn.attention(q, k, v, mask=bsattn.Mask(causal=True))
        torch.testing.assert_close(compiled(q, k, v), expected, atol=0, rtol=0)


def test_backward_of_proxy_routes_is_refused_loudly():
    """Autograd works (tests/python/test_backward.py) except where the backward does not exist."""
    q = torch.randn(1, 64, 2, 32, requires_grad=True)
    k, v = torch.randn(1, 64, 2, 32), torch.randn(1, 64, 2, 32)
    out = bsattn.attention(q, k, v, bsattn.from_dense_block_mask(torch.ones(1, 1, dtype=torch.bool), 64),
                           proxy=bsattn.build_summaries(k, v, 64))
    with pytest.raises(bsattn.BsattnError, match="backward of proxy routes is not supported"):
        out.sum().backward()


def test_kv_valid_booleans_pack_like_numpy():
    valid = np.random.default_rng(5).random((2, 100)) < 0.5
    words_numpy = bsattn.Mask(kv_valid=valid).kv_valid
    words_torch = bsattn.Mask(kv_valid=torch.from_numpy(valid)).kv_valid
    assert words_torch.dtype == torch.int32
    np.testing.assert_array_equal(words_torch.numpy().view(np.uint32), words_numpy)


def test_mixing_numpy_metadata_with_torch_tensors_is_named():
    q = torch.randn(1, 64, 2, 32)
    with pytest.raises(bsattn.BsattnError, match=r"doc_q.*PyTorch"):
        bsattn.attention(q, q, q, mask=bsattn.Mask(doc_ids=(np.zeros((1, 64)), np.zeros((1, 64)))))
