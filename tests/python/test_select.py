"""bsattn.select_blocks (SPEC §7): the policies against a float64 NumPy reference of the scores,
the Bitmask it returns fed to bsattn.attention (batched and varlen, heads="q" and "kv"), argument
errors, PyTorch CPU tensors, and torch CUDA tensors equal to the CPU bits (skipped without a CUDA
device or a bsattn built with BSATTN_ENABLE_CUDA=ON)."""

import numpy as np
import pytest

import bsattn


def pooled_scores(q, k_summary, block_size, heads_kv_rows=False):
    """float64 scores [B, Hs, nQB, nKB] of a batched problem (Skv = Sq)."""
    bq, _ = block_size
    batch, sq, hq, d = q.shape
    hkv = k_summary.shape[2]
    nqb = -(-sq // bq)
    q = np.asarray(q, np.float64)
    ks = np.asarray(k_summary, np.float64)
    pooled = np.stack([q[:, i * bq:(i + 1) * bq].mean(axis=1) for i in range(nqb)], axis=1)  # [B, nQB, Hq, D]
    group = hq // hkv
    scores = np.einsum("bqhd,bjhd->bhqj", pooled, np.repeat(ks, group, axis=2)) / np.sqrt(d)
    if heads_kv_rows:
        scores = scores.reshape(batch, hkv, group, nqb, -1).sum(axis=2)
    return scores


def words_to_dense(bits, kv_blocks):
    words = np.asarray(bits).view(np.uint32)
    dense = (words[..., None] >> np.arange(32, dtype=np.uint32)) & 1
    return dense.reshape(*words.shape[:-1], -1)[..., :kv_blocks].astype(bool)


def case(rng, batch=2, sq=200, hq=4, hkv=2, d=32, block=(32, 32), dtype=np.float32):
    q, k, v = (rng.standard_normal((batch, sq, h, d)).astype(dtype) for h in (hq, hkv, hkv))
    return q, k, v, bsattn.build_summaries(k, v, block[1])


@pytest.mark.parametrize("heads", ["q", "kv"])
def test_top_k_picks_the_best_blocks(rng, heads):
    q, k, v, summaries = case(rng)
    mask = bsattn.select_blocks(q, summaries.k_summary, 32, top_k=3, diagonal=False, heads=heads)
    assert isinstance(mask, bsattn.Bitmask)
    scores = pooled_scores(q, summaries.k_summary, (32, 32), heads == "kv")
    dense = words_to_dense(mask.sets["partial"]["bits"], scores.shape[-1])
    assert dense.shape == scores.shape
    assert (dense.sum(axis=-1) == 3).all()
    best = np.argsort(-scores, axis=-1, kind="stable")[..., :3]
    assert (np.take_along_axis(dense, best, axis=-1)).all()


def test_tau_and_mass_semantics(rng):
    q, k, v, summaries = case(rng, sq=256)
    scores = pooled_scores(q, summaries.k_summary, (32, 32))
    bits = bsattn.select_blocks(q, summaries.k_summary, 32, tau=0.5, diagonal=False).sets["partial"]["bits"]
    threshold = scores.mean(axis=-1, keepdims=True) + 0.5 * scores.std(axis=-1, keepdims=True)
    dense = words_to_dense(bits, scores.shape[-1])
    margin = 1e-4
    assert not (dense & (scores < threshold - margin)).any()
    assert (dense | (scores < threshold + margin)).all()

    bits = bsattn.select_blocks(q, summaries.k_summary, 32, mass=0.6, diagonal=False).sets["partial"]["bits"]
    dense = words_to_dense(bits, scores.shape[-1])
    p = np.exp(scores - scores.max(axis=-1, keepdims=True))
    kept = (p * dense).sum(axis=-1) / p.sum(axis=-1)
    assert (kept >= 0.6 - 1e-5).all()
    without_lowest = kept - np.where(dense, p, np.inf).min(axis=-1) / p.sum(axis=-1)
    assert (without_lowest < 0.6 + 1e-5).all()


def test_causal_forced_blocks(rng):
    q, k, v, summaries = case(rng, batch=1, sq=256)
    bits = bsattn.select_blocks(q, summaries.k_summary, 32, top_k=1, sinks=1, local=1, causal=True)
    dense = words_to_dense(bits.sets["partial"]["bits"], 8)[0, 0]
    for qb in range(8):
        assert not dense[qb, qb + 1:].any()  # nothing above the diagonal
        assert dense[qb, 0] and dense[qb, qb] and dense[qb, max(qb - 1, 0)]


@pytest.mark.parametrize("heads", ["q", "kv"])
def test_bitmask_drives_attention(rng, heads):
    q, k, v, summaries = case(rng, sq=190)
    mask = bsattn.select_blocks(q, summaries.k_summary, 32, mass=0.8, heads=heads)
    out = bsattn.attention(q, k, v, mask)
    dense = words_to_dense(mask.sets["partial"]["bits"], 6)
    counts = dense.sum(axis=-1).astype(np.int32)
    indices = np.zeros(dense.shape, np.int32)
    for index in np.ndindex(*dense.shape[:-1]):
        chosen = np.flatnonzero(dense[index])
        indices[index][:len(chosen)] = chosen
    expected = bsattn.attention(q, k, v, bsattn.BlockLists(counts, indices, block_size=32))
    np.testing.assert_array_equal(out, expected)


def test_varlen(rng):
    lengths = [70, 0, 131]
    cu = np.cumsum([0] + lengths).astype(np.int32)
    q, k, v = (rng.standard_normal((int(cu[-1]), h, 16)).astype(np.float32) for h in (4, 2, 2))
    summaries = bsattn.build_summaries(k, v, 32, cu_seqlens_k=cu)
    mask = bsattn.select_blocks(q, summaries.k_summary, 32, top_k=2, causal=True, heads="kv", cu_seqlens_q=cu)
    bits = mask.sets["partial"]["bits"]
    assert bits.shape == (2, 3 + 5, 1)
    out = bsattn.attention(q, k, v, mask, mask=bsattn.Mask(causal=True), cu_seqlens_q=cu, cu_seqlens_k=cu)
    assert np.isfinite(out).all()
    dense = words_to_dense(bits, 5)
    assert not dense[:, :3, 3:].any()  # sequence 0 has 3 KV blocks


def test_errors(rng):
    q, _, _, summaries = case(rng)
    ks = summaries.k_summary
    for kwargs, argument in [({}, "policy"), (dict(top_k=2, mass=0.5), "policy"), (dict(top_k=0), "options.top_k"),
                             (dict(mass=0.0), "options.mass"), (dict(mass=1.5), "options.mass"),
                             (dict(tau=float("nan")), "options.tau"), (dict(top_k=1, heads="x"), "heads"),
                             (dict(top_k=1, sinks=-1), "options.sinks")]:
        with pytest.raises(bsattn.BsattnError) as error:
            bsattn.select_blocks(q, ks, 32, **kwargs)
        assert error.value.argument == argument
    with pytest.raises(bsattn.BsattnError) as error:
        bsattn.select_blocks(q, ks[:, :-1], 32, top_k=1, max_seqlen_k=q.shape[1])
    assert error.value.argument == "k_summary"
    with pytest.raises(bsattn.BsattnError) as error:
        bsattn.select_blocks(q, ks.astype(np.float16), 32, top_k=1)
    assert error.value.argument == "k_summary"


def test_torch_cpu_matches_numpy(rng):
    torch = pytest.importorskip("torch")
    q, _, _, summaries = case(rng)
    expected = np.asarray(bsattn.select_blocks(q, summaries.k_summary, 32, tau=0.0).sets["partial"]["bits"])
    bits = bsattn.select_blocks(torch.from_numpy(q), torch.from_numpy(summaries.k_summary), 32,
                                tau=0.0).sets["partial"]["bits"]
    assert bits.dtype == torch.int32
    np.testing.assert_array_equal(bits.numpy().view(np.uint32), expected)


@pytest.mark.parametrize("policy", [dict(top_k=3), dict(tau=0.3), dict(mass=0.9)])
def test_torch_cuda_matches_cpu(rng, policy):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available() or not bsattn.built_with_cuda:
        pytest.skip("needs a CUDA device and bsattn built with BSATTN_ENABLE_CUDA=ON")
    q, _, _, summaries = case(rng, sq=1000, d=64, block=(64, 64), dtype=np.float32)
    q16, ks16 = (torch.from_numpy(x).to(torch.bfloat16) for x in (q, summaries.k_summary))
    cpu = bsattn.select_blocks(q16, ks16, 64, sinks=1, local=1, causal=True, **policy).sets["partial"]["bits"]
    gpu = bsattn.select_blocks(q16.cuda(), ks16.cuda(), 64, sinks=1, local=1, causal=True,
                               **policy).sets["partial"]["bits"]
    assert torch.equal(gpu.cpu(), cpu)
