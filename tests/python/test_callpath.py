"""The eager PyTorch call path (issue 14.3): a repeated `bsattn.attention` call finds its plan and
C++ tensor layout by signature (shapes, strides, dtypes, devices, options) and passes only data
pointers. These tests check that the cached path gives exactly the result of the uncached one
(the NumPy path, which binds every tensor through DLPack) and of the float64 reference when the
tensors change under it: new data pointers, new values behind the same pointers, new shapes and
strides, new sparsity objects, given outputs; and that every call is still validated in C++.
CPU engine here; the GPU variant (another stream) is in test_torch_gpu.py."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import bsattn  # noqa: E402
from bsattn import torch_ops  # noqa: E402
from conftest import assert_close, assert_lse_close, reference, reference_batched  # noqa: E402


def uncached(q, k, v, sparsity=None, **kwargs):
    """The same call through the NumPy path: every tensor exported through DLPack, one-shot plan."""
    numpy_sparsity = None
    if sparsity is not None:
        numpy_sparsity = bsattn.BlockLists(*(t.numpy() for t in sparsity.sets["partial"].values()),
                                           block_size=sparsity.block_size)
    out, lse = bsattn.attention(q.numpy(), k.numpy(), v.numpy(), numpy_sparsity, return_lse=True, **kwargs)
    return torch.from_numpy(out), torch.from_numpy(lse)


def random_lists(gen, heads, nqb, nkb):
    """BlockLists with a random ascending selection per row (at least one block), padded with -1."""
    dense = torch.rand(1, heads, nqb, nkb, generator=gen) < 0.5
    dense[..., 0] = True
    counts = dense.sum(-1).to(torch.int32)
    order = torch.argsort((~dense).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    indices = torch.where(torch.arange(nkb) < counts[..., None], order, torch.full_like(order, -1))
    return dense, bsattn.BlockLists(counts, indices, block_size=(64, 64))


def test_repeated_calls_follow_new_pointers_values_and_shapes():
    gen = torch.Generator().manual_seed(3)
    mask = bsattn.Mask(causal=True)
    torch_ops._calls.clear()
    results = []
    for seqlen in (200, 200, 133, 200):  # the same signature twice, another, then the first again
        q, k, v = (torch.randn(2, seqlen, 4, 32, generator=gen) for _ in range(3))
        out, lse = bsattn.attention(q, k, v, mask=mask, return_lse=True, validate=False)
        expected_out, expected_lse = uncached(q, k, v, mask=mask)
        assert torch.equal(out, expected_out) and torch.equal(lse, expected_lse)
        results.append((q, k, v, out))
        reference_out, reference_lse = reference_batched(
            q.numpy(), k.numpy(), v.numpy(), np.ones((1, 1, 4, 4), bool), block_size=(128, 128),
            spec=reference.MaskSpec(causal=True))
        assert_close(out.numpy(), reference_out, np.float32)
        assert_lse_close(lse.numpy(), reference_lse)
    assert len(torch_ops._calls) == 2
    # New values behind the same pointers.
    q, k, v, _ = results[0]
    q.mul_(-0.5)
    out, lse = bsattn.attention(q, k, v, mask=mask, return_lse=True, validate=False)
    assert torch.equal(out, uncached(q, k, v, mask=mask)[0])


def test_new_sparsity_objects_and_metadata_values_are_read_each_call():
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 256, 2, 64, generator=gen) for _ in range(3))
    for trial in range(3):  # a new BlockLists of the same shapes each time: one signature
        dense, sparsity = random_lists(gen, 2, 4, 4)
        out, lse = bsattn.attention(q, k, v, sparsity, return_lse=True, validate=trial == 0)
        assert torch.equal(out, uncached(q, k, v, sparsity)[0])
        expected, expected_lse = reference_batched(q.numpy(), k.numpy(), v.numpy(), dense.numpy())
        assert_close(out.numpy(), expected, np.float32)
        assert_lse_close(lse.numpy(), expected_lse)
    # The same metadata tensors rewritten in place.
    counts, indices = sparsity.sets["partial"].values()
    counts.fill_(1)
    indices[..., 0] = 3
    out = bsattn.attention(q, k, v, sparsity, validate=False)
    assert torch.equal(out, uncached(q, k, v, sparsity)[0])


def test_strided_views_dtypes_and_given_outputs():
    gen = torch.Generator().manual_seed(9)
    base = torch.randn(1, 3, 150, 4, 64, generator=gen)
    q, k, v = base[:, 0], base[:, 1, :, ::2], base[:, 2, :, 1::2]  # padded token strides, GQA 4 / 2
    contiguous = [t.contiguous() for t in (q, k, v)]
    mask = bsattn.Mask(window=(40, 0), causal=True)
    expected_out, expected_lse = uncached(*contiguous, mask=mask)
    for args in ((q, k, v), tuple(contiguous), (q, k, v)):
        out, lse = bsattn.attention(*args, mask=mask, return_lse=True)
        assert torch.equal(out, expected_out) and torch.equal(lse, expected_lse)
    out = torch.full((1, 150, 4, 64), float("nan"))
    lse = torch.full((1, 4, 150), float("nan"))
    version = out._version
    for _ in range(2):
        result = bsattn.attention(q, k, v, mask=mask, out=out, lse=lse, validate=False)
        assert result is out and torch.equal(out, expected_out) and torch.equal(lse, expected_lse)
    assert out._version > version  # in-place writes are visible to autograd's version counter
    half = [t.to(torch.bfloat16) for t in contiguous]
    expected_half = bsattn.attention(*(t.float().numpy() for t in half), mask=mask)
    assert_close(bsattn.attention(*half, mask=mask).float().numpy(), expected_half, "bfloat16")


def test_each_cached_call_is_still_validated():
    gen = torch.Generator().manual_seed(11)
    storage = torch.randn(1 * 64 * 2 * 32 + 1, generator=gen)
    aligned = storage[:-1].view(1, 64, 2, 32)
    k, v = torch.randn(1, 64, 2, 32), torch.randn(1, 64, 2, 32)
    bsattn.attention(aligned, k, v, validate=False)  # makes the signature's entry
    misaligned = storage[1:].view(1, 64, 2, 32)  # the same signature, a base 4 bytes off
    out = torch.full_like(aligned, 7.0)
    with pytest.raises(bsattn.BsattnError) as error:
        bsattn.attention(misaligned, k, v, out=out, validate=False)
    assert error.value.argument == "q" and torch.all(out == 7.0)
    with pytest.raises(bsattn.BsattnError) as error:  # an output aliasing an input
        bsattn.attention(aligned, k, v, out=k, validate=False)
    assert error.value.argument == "outputs.out"
    _, sparsity = random_lists(gen, 1, 1, 1)
    bsattn.attention(aligned, k, v, sparsity)
    counts, indices = sparsity.sets["partial"].values()
    indices.fill_(5)  # out of range: a value check of the cached call names it
    with pytest.raises(bsattn.BsattnError) as error:
        bsattn.attention(aligned, k, v, sparsity, out=out)
    assert error.value.argument.startswith("partial.indices") and torch.all(out == 7.0)


def test_calls_the_direct_path_must_leave_to_the_dispatcher():
    q, k, v = (torch.randn(1, 64, 2, 32, requires_grad=True) for _ in range(3))
    assert not torch_ops.direct_call_allowed(q, k, v)
    out = bsattn.attention(q, k, v, mask=bsattn.Mask(causal=True))
    out.sum().backward()  # the autograd formula needs the op
    assert q.grad is not None
    with torch.no_grad():
        assert torch_ops.direct_call_allowed(q, k, v)
    compiled = torch.compile(lambda q, k, v: bsattn.attention(q, k, v), fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(compiled(q, k, v), bsattn.attention(q, k, v))


def test_plan_calls_take_the_cached_path_and_still_refuse_other_problems():
    gen = torch.Generator().manual_seed(13)
    q, k, v = (torch.randn(1, 96, 2, 32, generator=gen) for _ in range(3))
    _, sparsity = random_lists(gen, 2, 2, 2)
    plan = bsattn.Plan(q, k, v, sparsity, mask=bsattn.Mask(causal=True), return_lse=True, validate=False)
    for _ in range(3):
        q, k, v = (torch.randn(1, 96, 2, 32, generator=gen) for _ in range(3))
        dense, sparsity = random_lists(gen, 2, 2, 2)
        out, lse = plan(q, k, v, sparsity)
        expected, expected_lse = reference_batched(q.numpy(), k.numpy(), v.numpy(), dense.numpy(),
                                                   spec=reference.MaskSpec(causal=True))
        assert_close(out.numpy(), expected, np.float32)
        assert_lse_close(lse.numpy(), expected_lse)
    assert len(plan._calls) == 1
    with pytest.raises(bsattn.BsattnError) as error:
        plan(q[:, :64], k, v, sparsity)
    assert error.value.argument == "problem.max_seqlen_q"


@pytest.mark.skipif(not (torch.cuda.is_available() and bsattn.built_with_cuda), reason="needs CUDA and a GPU build")
@pytest.mark.parametrize("validate", [False, True])
def test_cached_cuda_calls_follow_new_tensors_and_streams(validate):
    """One signature, called with new tensors on the current stream and on another one; every
    output against SDPA in float32 on the same inputs (outputs are fresh tensors each call)."""
    def expected(q, k, v):
        qh, kh, vh = (t.float().transpose(1, 2) for t in (q, k, v))
        return torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, is_causal=True).transpose(1, 2)

    mask = bsattn.Mask(causal=True)
    side = torch.cuda.Stream()
    for step in range(4):
        q, k, v = (torch.randn(1, 1000, 8, 128, dtype=torch.bfloat16, device="cuda") for _ in range(3))
        if step % 2:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                out = bsattn.attention(q, k, v, mask=mask, validate=validate)
            torch.cuda.current_stream().wait_stream(side)
        else:
            out = bsattn.attention(q, k, v, mask=mask, validate=validate)
        torch.testing.assert_close(out.float(), expected(q, k, v), atol=2e-2, rtol=2e-2)
