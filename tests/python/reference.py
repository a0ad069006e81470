"""An independent float64 NumPy reference for bsattn (SPEC §1, §3, §4, §6), and helpers that
write a dense block pattern in each sparsity format by plain loops (not through bsattn)."""

from dataclasses import dataclass, field

import numpy as np


@dataclass
class MaskSpec:
    causal: bool = False
    top_left: bool = False
    window_left: int = -1
    window_right: int = -1
    sink_tokens: int = 0


@dataclass
class Sequence:
    """One sequence of a problem: its Q/K/V rows (float64 [S, H, D]) and per-token metadata."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    doc_q: np.ndarray = None
    doc_kv: np.ndarray = None
    kv_valid: np.ndarray = None  # bool [Skv]
    extra: dict = field(default_factory=dict)


def token_mask(seqlen_q, seqlen_kv, spec, doc_q=None, doc_kv=None, kv_valid=None):
    """bool [Sq, Skv]: the built-in token mask (SPEC §4, docs/ARCHITECTURE.md: sinks relax the
    window only)."""
    q = np.arange(seqlen_q)[:, None]
    kv = np.arange(seqlen_kv)[None, :]
    diag = q + (0 if spec.top_left else seqlen_kv - seqlen_q)
    visible = np.ones((seqlen_q, seqlen_kv), bool)
    if spec.causal:
        visible &= kv <= diag
    in_window = np.ones_like(visible)
    if spec.window_left >= 0:
        in_window &= kv >= diag - spec.window_left
    if spec.window_right >= 0:
        in_window &= kv <= diag + spec.window_right
    visible &= in_window | (kv < spec.sink_tokens)
    if doc_q is not None:
        visible &= doc_q[:, None] == doc_kv[None, :]
    if kv_valid is not None:
        visible &= kv_valid[None, :]
    return visible


def expand_blocks(blocks, seqlen_q, seqlen_kv, block_q, block_kv):
    """bool [nQB, nKB] -> bool [Sq, Skv]."""
    return np.repeat(np.repeat(blocks, block_q, 0), block_kv, 1)[:seqlen_q, :seqlen_kv]


def attend_sequence(seq, partial, full, block_size, spec, scale=None, proxy=None, summaries=None):
    """(out [Sq, Hq, D], lse [Hq, Sq]) for one sequence.

    partial, full: bool [Hq, nQB, nKB] per query head (already broadcast from sparsity heads).
    proxy: None, "eligible" or bool [Hq, nQB, nKB] (explicit set); summaries: (k_sum, v_sum)
    float64 [nKB, Hkv, D] of this sequence.
    """
    sq, hq, d = seq.q.shape
    skv, hkv, _ = seq.k.shape
    bq, bk = block_size
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    group = hq // hkv
    tm = token_mask(sq, skv, spec, seq.doc_q, seq.doc_kv, seq.kv_valid)
    out = np.zeros((sq, hq, d))
    lse = np.full((hq, sq), -np.inf)
    nkb = -(-skv // bk)
    counts = np.minimum(bk, skv - bk * np.arange(nkb))  # in-range tokens per KV block
    for h in range(hq):
        hk = h // group
        attended = expand_blocks(full[h], sq, skv, bq, bk) | (expand_blocks(partial[h], sq, skv, bq, bk) & tm)
        s = scale * seq.q[:, h] @ seq.k[:, hk].T
        s = np.where(attended, s, -np.inf)
        terms = [s]
        values = [seq.v[:, hk]]
        if proxy is not None:
            k_sum, v_sum = summaries
            selected = partial[h] | full[h]
            if isinstance(proxy, str):  # eligible: unselected blocks the mask keeps whole
                nqb = -(-sq // bq)
                whole = np.array([[tm[i * bq:(i + 1) * bq, j * bk:(j + 1) * bk].all() for j in range(nkb)]
                                  for i in range(nqb)])
                contributes = whole & ~selected[:, :nkb]
            else:
                contributes = proxy[h][:, :nkb] & ~selected[:, :nkb]
            ps = scale * seq.q[:, h] @ k_sum[:, hk].T + np.log(counts)[None, :]
            ps = np.where(np.repeat(contributes, bq, axis=0)[:sq], ps, -np.inf)
            terms.append(ps)
            values.append(v_sum[:, hk] / counts[:, None])
        scores = np.concatenate(terms, axis=1)
        value = np.concatenate(values, axis=0)
        m = scores.max(axis=1, initial=-np.inf)
        live = np.isfinite(m)
        p = np.exp(scores - np.where(live, m, 0)[:, None])
        denom = p.sum(axis=1)
        out[live, h] = (p @ value)[live] / denom[live, None]
        lse[h, live] = m[live] + np.log(denom[live])
    return out, lse


# ---- Formats from dense block patterns (bool [Bs, Hs, nQB, nKB]) ---------------------------

def block_lists(dense, pad_value=0):
    """(counts [Bs, Hs, nQB], indices [Bs, Hs, nQB, nKB]) by loops; unused entries get pad_value."""
    bs, hs, nqb, nkb = dense.shape
    counts = np.zeros((bs, hs, nqb), np.int32)
    indices = np.full((bs, hs, nqb, nkb), pad_value, np.int32)
    for b in range(bs):
        for h in range(hs):
            for i in range(nqb):
                selected = [j for j in range(nkb) if dense[b, h, i, j]]
                counts[b, h, i] = len(selected)
                indices[b, h, i, :len(selected)] = selected
    return counts, indices


def bsr(dense):
    """(indptr, indices): rows in block-list order (b, h, qb)."""
    rows = dense.reshape(-1, dense.shape[-1])
    indptr = [0]
    indices = []
    for row in rows:
        indices += [j for j in range(len(row)) if row[j]]
        indptr.append(len(indices))
    return np.array(indptr, np.int32), np.array(indices, np.int32)


def bitmask(dense):
    """uint32 words [..., W] with bit r of word w selecting block 32 w + r."""
    nkb = dense.shape[-1]
    words = np.zeros(dense.shape[:-1] + (-(-nkb // 32),), np.uint32)
    for j in range(nkb):
        words[..., j // 32] |= dense[..., j].astype(np.uint32) << np.uint32(j % 32)
    return words


def varlen_block_lists(dense_per_seq):
    """Packed varlen lists (SPEC §3.2) from per-sequence bool [Hs, nQB(b), nKB(b)].

    Returns counts [Hs, total_m], indices [Hs, total_n], cu_total_m_blocks, cu_block_idx_offsets.
    """
    hs = dense_per_seq[0].shape[0]
    cu_m, cu_n = [0], [0]
    for dense in dense_per_seq:
        cu_m.append(cu_m[-1] + dense.shape[1])
        cu_n.append(cu_n[-1] + dense.shape[1] * dense.shape[2])
    counts = np.zeros((hs, cu_m[-1]), np.int32)
    indices = np.zeros((hs, max(cu_n[-1], 1)), np.int32)
    for b, dense in enumerate(dense_per_seq):
        nkb = dense.shape[2]
        for h in range(hs):
            for i in range(dense.shape[1]):
                selected = [j for j in range(nkb) if dense[h, i, j]]
                counts[h, cu_m[b] + i] = len(selected)
                start = cu_n[b] + i * nkb
                indices[h, start:start + len(selected)] = selected
    return counts, indices, np.array(cu_m, np.int32), np.array(cu_n, np.int32)
