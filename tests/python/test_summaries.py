"""bsattn.build_summaries (SPEC §6) in every KV layout against a float64 reference: NumPy on the
CPU engine, and torch CUDA tensors on the GPU kernel (skipped without a CUDA device or a bsattn
built with BSATTN_ENABLE_CUDA=ON), on the current and on an explicit stream."""

import numpy as np
import pytest

import bsattn


def reference_summaries(rows_of, batch, seqlens, block_kv, max_seqlen, heads, head_dim):
    """float64 mean K / sum V per (b, block, head); rows_of(b) = (K rows, V rows) [len, H, D]."""
    nkb = -(-max_seqlen // block_kv)
    mean_k = np.zeros((batch, nkb, heads, head_dim))
    sum_v = np.zeros_like(mean_k)
    for b in range(batch):
        k, v = (np.asarray(x, np.float64) for x in rows_of(b))
        for j in range(-(-seqlens[b] // block_kv)):
            lo, hi = j * block_kv, min((j + 1) * block_kv, seqlens[b])
            mean_k[b, j] = k[lo:hi].mean(axis=0)
            sum_v[b, j] = v[lo:hi].sum(axis=0)
    return mean_k, sum_v


def varlen_case(rng, lengths, used, heads=2, head_dim=32):
    cu = np.cumsum([0] + lengths).astype(np.int32)
    k, v = (rng.standard_normal((int(cu[-1]), heads, head_dim)).astype(np.float32) for _ in range(2))
    seqlens = used if used is not None else lengths
    expected = reference_summaries(lambda b: (k[cu[b]:cu[b] + seqlens[b]], v[cu[b]:cu[b] + seqlens[b]]),
                                   len(lengths), seqlens, 32, max(lengths), heads, head_dim)
    return k, v, cu, expected


def paged_case(rng, seqlens, page_size, heads=2, head_dim=32, block_kv=64):
    pages_per_seq = max(-(-n // page_size) for n in seqlens) + 1
    needed = sum(-(-n // page_size) for n in seqlens)
    num_pages = needed + 2
    order = rng.permutation(num_pages).astype(np.int32)  # scattered pages
    table = np.full((len(seqlens), pages_per_seq + 1), -1, np.int32)  # padded rows
    used = 0
    for b, n in enumerate(seqlens):
        count = -(-n // page_size)
        table[b, :count] = order[used:used + count]
        used += count
    k, v = (rng.standard_normal((num_pages, page_size, heads, head_dim)).astype(np.float32) for _ in range(2))

    def rows(b):
        pages = table[b, :-(-seqlens[b] // page_size)]
        return tuple(x[pages].reshape(-1, heads, head_dim)[:seqlens[b]] for x in (k, v))

    expected = reference_summaries(rows, len(seqlens), seqlens, block_kv, max(seqlens), heads, head_dim)
    return k, v, table, np.array(seqlens, np.int32), expected


def check(summaries, expected, atol=(1e-5, 1e-4), rtol=0.0):
    np.testing.assert_allclose(np.asarray(summaries.k_summary, np.float64), expected[0], atol=atol[0], rtol=rtol)
    np.testing.assert_allclose(np.asarray(summaries.v_summary, np.float64), expected[1], atol=atol[1], rtol=rtol)


@pytest.mark.parametrize("with_used", [False, True])
def test_varlen_on_the_cpu(rng, with_used):
    lengths = [70, 0, 129, 33]
    used = [50, 0, 129, 1] if with_used else None
    k, v, cu, expected = varlen_case(rng, lengths, used)
    out = bsattn.build_summaries(k, v, 32, cu_seqlens_k=cu,
                                 seqused_k=None if used is None else np.array(used, np.int32))
    check(out, expected)


@pytest.mark.parametrize("page_size", [16, 48, 256])
def test_paged_on_the_cpu(rng, page_size):
    k, v, table, lens, expected = paged_case(rng, [300, 0, 65], page_size)
    check(bsattn.build_summaries(k, v, 64, block_table=table, seq_lens_kv=lens), expected)


def _torch():  # imported per test: the NumPy tests run without PyTorch
    return pytest.importorskip("torch")


def _require_gpu():
    torch = _torch()
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if not bsattn.built_with_cuda:
        pytest.skip("bsattn built without CUDA (BSATTN_ENABLE_CUDA=ON)")
    return torch


BF16 = dict(atol=(1e-2, 5e-2), rtol=1.6e-2)  # one bf16 rounding of an fp32 sum


def test_torch_cpu_tensors_give_torch_tensors(rng):
    torch = _torch()
    k, v = (rng.standard_normal((2, 100, 2, 32)).astype(np.float32) for _ in range(2))
    out = bsattn.build_summaries(torch.from_numpy(k).bfloat16(), torch.from_numpy(v).bfloat16(), 32)
    assert isinstance(out.k_summary, torch.Tensor) and out.k_summary.dtype == torch.bfloat16
    expected = reference_summaries(lambda b: (torch.from_numpy(k[b]).bfloat16().double().numpy(),
                                              torch.from_numpy(v[b]).bfloat16().double().numpy()),
                                   2, [100, 100], 32, 100, 2, 32)
    check(type(out)(out.k_summary.double(), out.v_summary.double()), expected, **BF16)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_cuda_contiguous_on_a_stream(rng, head_dim):
    torch = _require_gpu()
    k, v = (torch.randn(2, 1000, 4, head_dim, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())  # k, v were written on the default stream
    with torch.cuda.stream(stream):  # the current stream is picked up
        out = bsattn.build_summaries(k, v, 64, validate=False)
    stream.synchronize()
    assert out.k_summary.device == k.device and out.k_summary.dtype == torch.bfloat16
    assert out.k_summary.shape == (2, 16, 4, head_dim)
    kc, vc = k.double().cpu().numpy(), v.double().cpu().numpy()
    expected = reference_summaries(lambda b: (kc[b], vc[b]), 2, [1000, 1000], 64, 1000, 4, head_dim)
    check(type(out)(out.k_summary.double().cpu(), out.v_summary.double().cpu()), expected, **BF16)
    # An explicit stream argument, and the same bytes (deterministic kernel).
    again = bsattn.build_summaries(k, v, 64, stream=stream.cuda_stream)
    stream.synchronize()
    assert torch.equal(again.k_summary, out.k_summary) and torch.equal(again.v_summary, out.v_summary)


def test_cuda_varlen_and_paged(rng):
    torch = _require_gpu()
    cuda = lambda a: torch.from_numpy(np.ascontiguousarray(a)).cuda()  # noqa: E731
    k, v, cu, _ = varlen_case(rng, [70, 0, 129, 33], None, head_dim=64)
    kb, vb = cuda(k).bfloat16(), cuda(v).bfloat16()
    kr, vr = kb.double().cpu().numpy(), vb.double().cpu().numpy()
    used = [50, 0, 129, 1]
    expected = reference_summaries(lambda b: (kr[cu[b]:cu[b] + used[b]], vr[cu[b]:cu[b] + used[b]]),
                                   4, used, 32, 129, 2, 64)
    out = bsattn.build_summaries(kb, vb, 32, cu_seqlens_k=cuda(cu), seqused_k=cuda(np.array(used, np.int32)),
                                 max_seqlen_k=129)
    check(type(out)(out.k_summary.double().cpu(), out.v_summary.double().cpu()), expected, **BF16)

    k, v, table, lens, _ = paged_case(rng, [300, 0, 65], 48, head_dim=64)
    kb, vb = cuda(k).bfloat16(), cuda(v).bfloat16()
    kr, vr = kb.double().cpu().numpy(), vb.double().cpu().numpy()

    def rows(b):
        pages = table[b, :-(-lens[b] // 48)]
        return tuple(x[pages].reshape(-1, 2, 64)[:lens[b]] for x in (kr, vr))

    expected = reference_summaries(rows, 3, list(lens), 64, 300, 2, 64)
    out = bsattn.build_summaries(kb, vb, 64, block_table=cuda(table), seq_lens_kv=cuda(lens), max_seqlen_k=300)
    check(type(out)(out.k_summary.double().cpu(), out.v_summary.double().cpu()), expected, **BF16)
