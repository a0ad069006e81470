"""bsattn.selected_attention / bsattn.SelectedAttention (issue 11.4): summaries -> select -> attend
in one call equals build_summaries, select_blocks and attention called separately, bit for bit
(batched and varlen, GQA with heads "q" and "kv", every policy, proxy on and off), and the float64
reference on the selected pattern; paged K/V equals contiguous; the planned object follows new
values and refuses another problem; argument errors; PyTorch CPU tensors; on a CUDA device
(skipped without one or without a CUDA build) the current stream and a CUDA graph replayed with
new Q/K/V values."""

import numpy as np
import pytest

import bsattn
import reference
from conftest import assert_close, assert_lse_close, reference_batched

POLICIES = [dict(top_k=2), dict(tau=0.3), dict(mass=0.7)]


def words_to_dense(bits, kv_blocks):
    words = np.asarray(bits).view(np.uint32)
    dense = (words[..., None] >> np.arange(32, dtype=np.uint32)) & 1
    return dense.reshape(*words.shape[:-1], -1)[..., :kv_blocks].astype(bool)


def separate_calls(q, k, v, block, policy, *, causal=False, heads="q", proxy=False, sinks=0, local=0, **layout):
    """(out, lse, bitmask) of the three calls made one after the other."""
    kv_layout = {name: layout[name] for name in ("cu_seqlens_k",) if name in layout}
    summaries = bsattn.build_summaries(k, v, block[1], **kv_layout)
    bits = bsattn.select_blocks(q, summaries.k_summary, block, causal=causal, heads=heads, sinks=sinks, local=local,
                                max_seqlen_k=k.shape[-3] if "cu_seqlens_q" not in layout else None, **policy,
                                **layout)
    out, lse = bsattn.attention(q, k, v, bits, mask=bsattn.Mask(causal=causal), proxy=summaries if proxy else None,
                                return_lse=True, **layout)
    return out, lse, bits, summaries


@pytest.mark.parametrize("policy", POLICIES, ids=["top_k", "tau", "mass"])
@pytest.mark.parametrize("heads", ["q", "kv"])
@pytest.mark.parametrize("proxy", [False, True])
def test_one_call_equals_the_separate_calls_and_the_reference(rng, policy, heads, proxy):
    block = (32, 48)
    q = rng.standard_normal((2, 203, 4, 16)).astype(np.float32)
    k, v = (rng.standard_normal((2, 203, 2, 16)).astype(np.float32) for _ in range(2))
    causal = heads == "kv"
    out, lse = bsattn.selected_attention(q, k, v, block, causal=causal, heads=heads, proxy=proxy, sinks=1,
                                         return_lse=True, **policy)
    want_out, want_lse, bits, summaries = separate_calls(q, k, v, block, policy, causal=causal, heads=heads,
                                                         proxy=proxy, sinks=1)
    np.testing.assert_array_equal(out, want_out)
    np.testing.assert_array_equal(lse, want_lse)

    dense = words_to_dense(bits.sets["partial"]["bits"], 5)
    ref_out, ref_lse = reference_batched(q, k, v, dense, block_size=block, spec=reference.MaskSpec(causal=causal),
                                         proxy="eligible" if proxy else None,
                                         summaries=tuple(summaries) if proxy else None)
    assert_close(out, ref_out, np.float32)
    assert_lse_close(lse, ref_lse)


def test_varlen(rng):
    lengths_q, lengths_k = [70, 0, 131], [90, 20, 131]
    cu_q, cu_k = (np.cumsum([0] + n).astype(np.int32) for n in (lengths_q, lengths_k))
    q = rng.standard_normal((int(cu_q[-1]), 6, 16)).astype(np.float32)
    k, v = (rng.standard_normal((int(cu_k[-1]), 2, 16)).astype(np.float32) for _ in range(2))
    layout = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    for heads in ("q", "kv"):
        out, lse = bsattn.selected_attention(q, k, v, 32, top_k=2, causal=True, heads=heads, return_lse=True,
                                             **layout)
        want_out, want_lse, _, _ = separate_calls(q, k, v, (32, 32), dict(top_k=2), causal=True, heads=heads,
                                                  **layout)
        np.testing.assert_array_equal(out, want_out)
        np.testing.assert_array_equal(lse, want_lse)
        assert np.isinf(lse[:, cu_q[1]:cu_q[2]]).all() and np.isfinite(out).all()


def test_paged_kv_equals_contiguous(rng):
    page_size, b, hkv, d, length = 16, 2, 2, 32, 96
    pages = rng.permutation(16)
    table = np.full((b, 8), -1, np.int32)  # padded rows: entries past the length are never read
    table[0, :6], table[1, :6] = pages[:6], pages[6:12]
    k_cache, v_cache = (rng.standard_normal((16, page_size, hkv, d)).astype(np.float32) for _ in range(2))
    k, v = (np.stack([cache[table[i, :6]].reshape(length, hkv, d) for i in range(b)]) for cache in (k_cache, v_cache))
    q = rng.standard_normal((b, length, 4, d)).astype(np.float32)
    options = dict(top_k=2, causal=True, proxy=True, return_lse=True)
    paged = bsattn.selected_attention(q, k_cache, v_cache, 32, block_table=table,
                                      seq_lens_kv=np.full(b, length, np.int32), **options)
    contiguous = bsattn.selected_attention(q, k, v, 32, **options)
    for got, want in zip(paged, contiguous):
        np.testing.assert_array_equal(got, want)


def test_planned_object_follows_new_values_and_refuses_another_problem(rng):
    shape_q, shape_kv = (1, 160, 4, 32), (1, 160, 4, 32)
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in (shape_q, shape_kv, shape_kv))
    selected = bsattn.SelectedAttention(q, k, v, 32, top_k=2, proxy=True)
    assert selected.workspace_bytes > 0
    bitmasks = []
    for step in range(3):
        q[...], k[...], v[...] = (rng.standard_normal(s) + 0.3 * step for s in (shape_q, shape_kv, shape_kv))
        out = np.full(shape_q, np.nan, np.float32)
        assert selected(q, k, v, out=out) is out
        want_out, _, bits, _ = separate_calls(q, k, v, (32, 32), dict(top_k=2), proxy=True)
        np.testing.assert_array_equal(out, want_out)
        bitmasks.append(np.asarray(bits.sets["partial"]["bits"]).copy())
    assert any((a != b).any() for a, b in zip(bitmasks, bitmasks[1:]))

    with pytest.raises(bsattn.BsattnError) as error:
        selected(q[:, :96], k, v)
    assert error.value.argument == "problem.max_seqlen_q"
    with pytest.raises(bsattn.BsattnError) as error:
        selected(q, k, v, top_k=3)
    assert error.value.argument == "options.top_k"


def test_repeated_calls_share_one_cached_object(rng):
    q, k, v = (rng.standard_normal((1, 100, 2, 16)).astype(np.float32) for _ in range(3))
    from bsattn import _selected

    bsattn.selected_attention(q, k, v, 16, tau=0.0)
    cached = len(_selected._cached)
    for _ in range(3):
        q[...] = rng.standard_normal(q.shape)
        out = bsattn.selected_attention(q, k, v, 16, tau=0.0)
        np.testing.assert_array_equal(out, separate_calls(q, k, v, (16, 16), dict(tau=0.0))[0])
    assert len(_selected._cached) == cached


def test_errors(rng):
    q, k, v = (rng.standard_normal((1, 64, 2, 16)).astype(np.float32) for _ in range(3))
    cases = [
        (dict(), "policy"),
        (dict(top_k=1, tau=0.5), "policy"),
        (dict(top_k=0), "options.top_k"),
        (dict(tau=float("nan")), "options.tau"),
        (dict(mass=1.5), "options.mass"),
        (dict(top_k=1, sinks=-1), "options.sinks"),
        (dict(top_k=1, heads="both"), "heads"),
    ]
    for arguments, argument in cases:
        with pytest.raises(bsattn.BsattnError) as error:
            bsattn.selected_attention(q, k, v, 32, **arguments)
        assert error.value.argument == argument, arguments
    with pytest.raises(bsattn.BsattnError) as error:
        bsattn.selected_attention(q, k[:, :, :1].repeat(3, axis=2), v, 32, top_k=1)
    assert error.value.argument.startswith("problem.heads")
    out = np.full(q.shape, 7.0, np.float32)
    with pytest.raises(bsattn.BsattnError) as error:
        bsattn.selected_attention(q, k, v.astype(np.float16), 32, top_k=1, out=out)
    assert error.value.argument == "v"
    assert (out == 7.0).all()


def test_torch_cpu(rng):
    torch = pytest.importorskip("torch")
    q, k, v = (rng.standard_normal((2, 150, 4, 64)).astype(np.float32) for _ in range(3))
    tq, tk, tv = (torch.from_numpy(x).to(torch.bfloat16) for x in (q, k, v))
    out, lse = bsattn.selected_attention(tq, tk, tv, 64, mass=0.8, causal=True, proxy=True, return_lse=True)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    want_out, want_lse, _, _ = separate_calls(tq, tk, tv, (64, 64), dict(mass=0.8), causal=True, proxy=True)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)


def _cuda(torch):
    if not torch.cuda.is_available() or not bsattn.built_with_cuda:
        pytest.skip("needs a CUDA device and a bsattn built with BSATTN_ENABLE_CUDA=ON")


@pytest.mark.parametrize("proxy", [False, True])
def test_torch_cuda_current_stream(rng, proxy):
    torch = pytest.importorskip("torch")
    _cuda(torch)
    q = torch.randn(2, 1000, 8, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, 1000, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        out, lse = bsattn.selected_attention(q, k, v, 64, top_k=4, causal=True, heads="kv", proxy=proxy,
                                             return_lse=True)
        want_out, want_lse, _, _ = separate_calls(q, k, v, (64, 64), dict(top_k=4), causal=True, heads="kv",
                                                  proxy=proxy)
    stream.synchronize()
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)


def test_torch_cuda_graph_replays_with_new_values(rng):
    torch = pytest.importorskip("torch")
    _cuda(torch)
    q = torch.randn(1, 1500, 4, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, 1500, 4, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    out = torch.empty_like(q)
    selected = bsattn.SelectedAttention(q, k, v, 64, top_k=3, sinks=1, validate=False)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        selected(q, k, v, out=out)  # warm-up outside the capture
    side.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        selected(q, k, v, out=out)
    outputs = []
    for step in range(3):
        for t in (q, k, v):
            t.copy_(torch.randn_like(t) + 0.3 * step)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        eager = bsattn.selected_attention(q, k, v, 64, top_k=3, sinks=1, validate=False)
        torch.cuda.synchronize()
        assert torch.equal(out, eager), step
        outputs.append(out.clone())
    assert not torch.equal(outputs[0], outputs[1])
