"""Problem builders shared by the Python tests: random inputs and the float64 reference of a
batched or varlen problem given dense block patterns."""

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))

import reference  # noqa: E402

TOLERANCE = {"float32": 2e-5, "float16": 2e-3, "bfloat16": 3e-2}


def tolerance(dtype):
    return TOLERANCE[dtype if isinstance(dtype, str) else np.dtype(dtype).name]


def assert_close(actual, expected, dtype):
    actual = np.asarray(actual).astype(np.float64)
    atol = tolerance(dtype)
    np.testing.assert_allclose(actual, expected, atol=atol, rtol=10 * atol)


def assert_lse_close(actual, expected):
    actual = np.asarray(actual, np.float64)
    assert np.array_equal(np.isinf(actual), np.isinf(expected))
    finite = np.isfinite(expected)
    np.testing.assert_allclose(actual[finite], expected[finite], atol=1e-4, rtol=1e-4)


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def random_qkv(rng, q_shape, kv_shape, dtype=np.float32):
    q = rng.standard_normal(q_shape).astype(dtype)
    k = rng.standard_normal(kv_shape).astype(dtype)
    v = rng.standard_normal(kv_shape).astype(dtype)
    return q, k, v


def random_blocks(rng, shape, density=0.5):
    return rng.random(shape) < density


def per_head(dense, b, heads_q):
    """bool [Hq, nQB, nKB] of batch b from [Bs, Hs, nQB, nKB]."""
    bs, hs = dense.shape[:2]
    return np.repeat(dense[0 if bs == 1 else b], heads_q // hs, axis=0)


def reference_batched(q, k, v, partial, full=None, block_size=(64, 64), spec=None, scale=None, doc_ids=None,
                      kv_valid=None, proxy=None, summaries=None):
    """(out [B, Sq, Hq, D], lse [B, Hq, Sq]) from dense patterns [Bs, Hs, nQB, nKB]."""
    spec = spec or reference.MaskSpec()
    b_count, sq, hq, d = q.shape
    full = np.zeros_like(partial) if full is None else full
    outs, lses = [], []
    for b in range(b_count):
        seq = reference.Sequence(q[b].astype(np.float64), k[b].astype(np.float64), v[b].astype(np.float64))
        if doc_ids is not None:
            seq.doc_q, seq.doc_kv = doc_ids[0][b], doc_ids[1][b]
        if kv_valid is not None:
            seq.kv_valid = kv_valid[b]
        proxy_b = proxy if proxy is None or isinstance(proxy, str) else per_head(proxy, b, hq)
        sums = None if summaries is None else tuple(np.asarray(s[b], np.float64) for s in summaries)
        o, l = reference.attend_sequence(seq, per_head(partial, b, hq), per_head(full, b, hq), block_size, spec,
                                         scale, proxy_b, sums)
        outs.append(o)
        lses.append(l)
    return np.stack(outs), np.stack(lses)


def reference_varlen(q, k, v, cu_q, cu_k, partial_per_seq, block_size, spec=None, full_per_seq=None):
    """(out [total_q, Hq, D], lse [Hq, total_q]) from per-sequence patterns [Hs, nQB, nKB]."""
    spec = spec or reference.MaskSpec()
    hq = q.shape[1]
    out = np.zeros(q.shape)
    lse = np.full((hq, q.shape[0]), -np.inf)
    for b in range(len(cu_q) - 1):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        seq = reference.Sequence(q[qs].astype(np.float64), k[ks].astype(np.float64), v[ks].astype(np.float64))
        partial = per_head(partial_per_seq[b][None], 0, hq)
        full = np.zeros_like(partial) if full_per_seq is None else per_head(full_per_seq[b][None], 0, hq)
        o, l = reference.attend_sequence(seq, partial, full, block_size, spec)
        out[qs], lse[:, qs] = o, l
    return out, lse
