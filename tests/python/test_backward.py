"""The backward (issue 13) from Python on the CPU engine: bsattn.attention_backward with NumPy and
PyTorch tensors, and torch.autograd through bsattn.attention, against a float64 NumPy backward of
the same attended pairs (the reference module's masks and block expansion)."""

from types import SimpleNamespace

import numpy as np
import pytest
from conftest import per_head, random_blocks, random_qkv, reference

import bsattn


def backward_sequence(q, k, v, dout, partial, full, block_size, spec, scale=None, dlse=None):
    """float64 (dq, dk, dv) of one sequence: q [Sq, Hq, D], k, v [Skv, Hkv, D], dout like q, dlse
    [Hq, Sq] or None; partial / full bool [Hq, nQB, nKB]. dS = P * (dP - rowsum(dO * O) + dLSE)."""
    sq, hq, d = q.shape
    skv, hkv, _ = k.shape
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    tm = reference.token_mask(sq, skv, spec)
    dq, dk, dv = np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
    for h in range(hq):
        g = h // (hq // hkv)
        attended = (reference.expand_blocks(full[h], sq, skv, *block_size) |
                    (reference.expand_blocks(partial[h], sq, skv, *block_size) & tm))
        s = np.where(attended, scale * q[:, h] @ k[:, g].T, -np.inf)
        m = s.max(axis=1, initial=-np.inf)
        live = np.isfinite(m)
        p = np.zeros_like(s)
        p[live] = np.exp(s[live] - m[live, None])
        p[live] /= p[live].sum(axis=1, keepdims=True)
        o = p @ v[:, g]
        dp = dout[:, h] @ v[:, g].T
        delta = (dout[:, h] * o).sum(axis=1, keepdims=True) - (0 if dlse is None else dlse[h][:, None])
        ds = p * (dp - delta)
        dq[:, h] = scale * ds @ k[:, g]
        dk[:, g] += scale * ds.T @ q[:, h]
        dv[:, g] += p.T @ dout[:, h]
    return dq, dk, dv


def as64(*arrays):
    return tuple(np.asarray(a, np.float64) for a in arrays)


def assert_grads_close(actual, expected, atol):
    for name, a, e in zip(("dq", "dk", "dv"), actual, expected):
        np.testing.assert_allclose(np.asarray(a, np.float64), e, atol=atol * max(1.0, np.abs(e).max()), rtol=0,
                                   err_msg=name)


def test_numpy_batched_gqa_partial_and_full(rng):
    """Block lists with partial (masked) and full blocks, GQA, a causal mask and tails."""
    block_size = (64, 32)
    q, k, v = random_qkv(rng, (2, 150, 4, 32), (2, 200, 2, 32))
    dout = rng.standard_normal(q.shape).astype(np.float32)
    shape = (2, 4, 3, 7)
    selected = random_blocks(rng, shape, 0.6)
    full = selected & random_blocks(rng, shape, 0.4)
    partial = selected & ~full
    tensors = (*reference.block_lists(partial), *reference.block_lists(full))
    sparsity = bsattn.from_flash_attention(tensors, block_size)
    mask = bsattn.Mask(causal=True)
    out, lse = bsattn.attention(q, k, v, sparsity, mask=mask, return_lse=True)
    dq, dk, dv = bsattn.attention_backward(q, k, v, out, lse, dout, sparsity, mask=mask)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape and dq.dtype == np.float32
    spec = reference.MaskSpec(causal=True)
    expected = [np.zeros(t.shape) for t in (q, k, v)]
    for b in range(2):
        grads = backward_sequence(*as64(q[b], k[b], v[b], dout[b]), per_head(partial, b, 4), per_head(full, b, 4),
                                  block_size, spec)
        for e, g in zip(expected, grads):
            e[b] = g
    assert_grads_close((dq, dk, dv), expected, 1e-4)


def test_numpy_varlen_with_empty_sequence_and_bf16(rng):
    """Varlen block lists, an empty query sequence, MQA; bfloat16 inputs (fp32 accumulation)."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    block_size = (64, 32)
    seqlens_q, seqlens_k = [70, 0, 130], [50, 40, 200]
    cu_q, cu_k = np.cumsum([0] + seqlens_q).astype(np.int32), np.cumsum([0] + seqlens_k).astype(np.int32)
    q, k, v = random_qkv(rng, (cu_q[-1], 4, 32), (cu_k[-1], 1, 32))
    dout = rng.standard_normal(q.shape)
    q, k, v, dout = (t.astype(ml_dtypes.bfloat16) for t in (q, k, v, dout))
    dense = [random_blocks(rng, (1, -(-sq // block_size[0]), -(-sk // block_size[1])))
             for sq, sk in zip(seqlens_q, seqlens_k)]
    counts, indices, _, _ = reference.varlen_block_lists(dense)
    fields = SimpleNamespace(mask_block_cnt=counts, mask_block_idx=indices, full_block_cnt=None, full_block_idx=None,
                             cu_total_m_blocks=None, cu_block_idx_offsets=None)
    sparsity = bsattn.from_flash_attention(fields, block_size)
    kwargs = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, mask=bsattn.Mask(window=(40, 10)))
    out, lse = bsattn.attention(q, k, v, sparsity, return_lse=True, **kwargs)
    dq, dk, dv = bsattn.attention_backward(q, k, v, out, lse, dout, sparsity, **kwargs)
    spec = reference.MaskSpec(window_left=40, window_right=10)
    expected = [np.zeros(t.shape) for t in (q, k, v)]
    for b in range(3):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        pattern = per_head(dense[b][None], 0, 4)
        grads = backward_sequence(*as64(q[qs], k[ks], v[ks], dout[qs]), pattern, np.zeros_like(pattern),
                                  block_size, spec)
        expected[0][qs], expected[1][ks], expected[2][ks] = grads
    # bf16 O feeds rowsum(dO * O) and the gradients are rounded to bf16.
    assert_grads_close((dq, dk, dv), expected, 3e-2)


def test_errors_name_the_argument(rng):
    q, k, v = random_qkv(rng, (1, 64, 2, 32), (1, 64, 2, 32))
    out, lse = bsattn.attention(q, k, v, return_lse=True)
    with pytest.raises(bsattn.BsattnError) as error:
        bsattn.attention_backward(q, k, v, out, lse[:, :1], q)
    assert error.value.argument == "backward.lse"
    with pytest.raises(bsattn.BsattnError) as error:
        bsattn.attention_backward(q, k, v, out, lse, q[:, :32])
    assert error.value.argument == "backward.dout"
    summaries = bsattn.build_summaries(k, v, 64)
    with pytest.raises(bsattn.BsattnError, match="backward of proxy routes is not supported") as error:
        bsattn.attention_backward(q, k, v, out, lse, q, bsattn.from_dense_block_mask(np.ones((1, 1), bool), 64),
                                  proxy=summaries)
    assert error.value.argument == "problem.proxy"


# ---- PyTorch ---------------------------------------------------------------------------------

def torch_case(rng, dtype_name="float32"):
    torch = pytest.importorskip("torch")
    block_size = (64, 64)
    q, k, v = (torch.from_numpy(t) for t in random_qkv(rng, (1, 130, 4, 32), (1, 170, 2, 32)))
    dense = torch.from_numpy(random_blocks(rng, (1, 2, 3, 3), 0.7))
    sparsity = bsattn.from_dense_block_mask(dense, block_size)
    dtype = getattr(torch, dtype_name)
    return torch, [t.to(dtype) for t in (q, k, v)], dense.numpy(), sparsity, block_size


def expected_torch(q, k, v, dout, dense, block_size, spec, dlse=None):
    pattern = per_head(dense, 0, q.shape[2])
    return backward_sequence(*as64(q[0].float().numpy(), k[0].float().numpy(), v[0].float().numpy(),
                                   dout[0].float().numpy()), pattern, np.zeros_like(pattern), block_size, spec,
                             dlse=None if dlse is None else dlse[0].double().numpy())


def test_torch_functional_with_dlse(rng):
    torch, (q, k, v), dense, sparsity, block_size = torch_case(rng)
    mask = bsattn.Mask(causal=True)
    out, lse = bsattn.attention(q, k, v, sparsity, mask=mask, return_lse=True)
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    dq, dk, dv = bsattn.attention_backward(q, k, v, out, lse, dout, sparsity, mask=mask, dlse=dlse)
    assert isinstance(dq, torch.Tensor)
    expected = expected_torch(q, k, v, dout, dense, block_size, reference.MaskSpec(causal=True), dlse)
    assert_grads_close([t[0].numpy() for t in (dq, dk, dv)], expected, 1e-4)


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_torch_autograd(rng, dtype_name):
    torch, (q, k, v), dense, sparsity, block_size = torch_case(rng, dtype_name)
    for t in (q, k, v):
        t.requires_grad_(True)
    mask = bsattn.Mask(causal=True, alignment="top_left")
    out = bsattn.attention(q, k, v, sparsity, mask=mask)
    dout = torch.randn_like(out)
    (out * dout).sum().backward()
    expected = expected_torch(q.detach(), k.detach(), v.detach(), dout, dense, block_size,
                              reference.MaskSpec(causal=True, top_left=True))
    assert q.grad.dtype == q.dtype
    atol = 1e-4 if dtype_name == "float32" else 3e-2
    assert_grads_close([t.grad[0].float().numpy() for t in (q, k, v)], expected, atol)


def test_torch_compile_autograd_with_lse_in_the_loss(rng):
    """torch.compile(fullgraph=True) of a loss using both O and the LSE, backward included, gives
    eager's gradients, which match the float64 reference."""
    torch, (q, k, v), dense, sparsity, block_size = torch_case(rng)
    for t in (q, k, v):
        t.requires_grad_(True)
    mask = bsattn.Mask(causal=True)
    dout = torch.randn(q.shape)
    dlse = torch.randn(q.shape[0], q.shape[2], q.shape[1])

    def loss(q, k, v):
        out, lse = bsattn.attention(q, k, v, sparsity, mask=mask, return_lse=True)
        return (out * dout).sum() + (lse * dlse).sum()

    eager = torch.autograd.grad(loss(q, k, v), (q, k, v))
    compiled = torch.autograd.grad(torch.compile(loss, fullgraph=True)(q, k, v), (q, k, v))
    for e, c in zip(eager, compiled):
        torch.testing.assert_close(c, e, atol=1e-5, rtol=1e-5)
    expected = expected_torch(q.detach(), k.detach(), v.detach(), dout, dense, block_size,
                              reference.MaskSpec(causal=True), dlse)
    assert_grads_close([g[0].numpy() for g in eager], expected, 1e-4)


def test_opcheck_backward_op(rng):
    """The backward custom op's schema, fake implementation and registration (what torch.compile
    relies on), with and without dLSE."""
    torch = pytest.importorskip("torch")
    from bsattn import _api

    q, k, v = (torch.from_numpy(t) for t in random_qkv(rng, (1, 70, 2, 16), (1, 90, 1, 16)))
    slots, options = _api._flatten(None, bsattn.Mask(causal=True), None, scale=None, out_dtype=None, return_lse=True,
                                   validate=True, num_threads=0, max_seqlen_q=None, max_seqlen_k=None,
                                   cu_seqlens_q=None, cu_seqlens_k=None, seqused_k=None, block_table=None,
                                   seq_lens_kv=None)
    arguments = (q, k, v, [slots[n] for n in _api.SLOT_NAMES], *(options[n] for n in _api.OPTION_NAMES))
    out, lse = torch.ops.bsattn.attention(*arguments)
    for dlse in (None, torch.randn_like(lse)):
        torch.library.opcheck(torch.ops.bsattn.attention_backward.default,
                              (*arguments, out, lse, torch.randn_like(out), dlse))


@pytest.mark.filterwarnings("ignore:Input #.*not a double precision")  # bsattn has no float64
def test_torch_autograd_of_a_sum_and_gradcheck(rng):
    """dO arriving as an expanded view (the gradient of a sum), and torch.autograd.gradcheck of the
    custom op's formula in float64 terms of float32 inputs (loose tolerances)."""
    torch, (q, k, v), _, sparsity, _ = torch_case(rng)
    q, k, v = (t[:, :40, :, :8].contiguous().requires_grad_(True) for t in (q, k, v))
    out = bsattn.attention(q, k, v, bsattn.AllBlocks((64, 64)), mask=bsattn.Mask(causal=True))
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))

    def f(q, k, v):
        return bsattn.attention(q, k, v, mask=bsattn.Mask(causal=True))

    torch.autograd.gradcheck(f, (q.detach().requires_grad_(), k.detach().requires_grad_(),
                                 v.detach().requires_grad_()), eps=1e-2, atol=2e-3, rtol=2e-2)
