"""select_blocks(): block selection (SPEC §7) into a `Bitmask` that `attention` takes as is."""

from . import _bsattn, _tensors
from ._api import _expect_rank, _max_length
from .sparsity import Bitmask, _block_size


def _policy(top_k, tau, mass):
    given = {name: value for name, value in (("top_k", top_k), ("tau", tau), ("mass", mass)) if value is not None}
    if len(given) != 1:
        raise _tensors.fail("policy", "give exactly one of top_k, tau or mass"
                            + (f" (got {', '.join(given)})" if given else ""))
    (name, value), = given.items()
    return {"policy": name, name: int(value) if name == "top_k" else float(value)}


def _host_values(t, read_device):
    """A small integer tensor's values as NumPy; device tensors only when `read_device` (a sync)."""
    values = _tensors.host_ints(t)
    if values is not None or not read_device:
        return values
    kind = _tensors.framework(t)
    if kind == "torch":
        return t.cpu().numpy()
    if kind == "cupy":
        return t.get()
    import numpy as np

    return np.asarray(t)


def _choice(name, value, choices):
    if value not in choices:
        raise _tensors.fail(name, f"{value!r}, expected one of {', '.join(map(repr, choices))}")
    return value


def select_blocks(q, k_summary, block_size, *, top_k=None, tau=None, mass=None, sinks=0, local=0, diagonal=True,
                  causal=False, alignment="bottom_right", heads="q", scale=None, cu_seqlens_q=None,
                  cu_seqlens_k=None, seqused_k=None, max_seqlen_q=None, max_seqlen_k=None, validate=True,
                  num_threads=0, stream=None):
    """Picks the KV blocks each query block attends exactly (SPEC §7) and returns them as a
    `bsattn.Bitmask` for `attention` (same ``block_size``; pass the same ``cu_seqlens_*``).

    Scores: ``scale * <mean of the Q block's in-range tokens, k_summary[b, j, g(h)]>`` for every
    visible KV block j, per query head (``heads="q"``) or per KV head (``heads="kv"``, the
    group's scores summed). ``k_summary [B, nKB, Hkv, D]`` is `build_summaries`'s first tensor.
    Exactly one policy: ``top_k`` (blocks in all, forced ones included), ``tau`` (scores
    ``>= mean + tau * std`` of the row's visible scores) or ``mass`` (the smallest best-first set
    whose softmax mass reaches the fraction). Forced (when visible): the diagonal block
    (``diagonal``), the first ``sinks`` blocks, ``local`` blocks on each side of the diagonal.
    ``causal`` hides blocks entirely above the diagonal (``alignment`` as `bsattn.Mask`).

    Batched ``q [B, Sq, Hq, D]``: the KV length is ``max_seqlen_k`` (default ``Sq`` when it fits
    ``nKB``). Varlen ``q [total_q, Hq, D]`` with ``cu_seqlens_q`` and ``cu_seqlens_k`` (default:
    ``cu_seqlens_q``) and optional ``seqused_k``. CUDA tensors run the GPU kernel on ``stream``
    (default: the framework's current one); the CPU engine gives the same bits. Bits words are
    uint32 (int32 for PyTorch); varlen rows past the last sequence's blocks are zero.
    """
    options = _policy(top_k, tau, mass)
    options.update(sinks=int(sinks), local=int(local), diagonal=bool(diagonal), causal=bool(causal),
                   alignment=_choice("alignment", alignment, ("bottom_right", "top_left")),
                   heads=_choice("heads", heads, ("q", "kv")))
    bq, bk = _block_size(block_size)
    batch, kv_blocks, heads_kv, _ = _expect_rank("k_summary", k_summary, 4, "[B, nKB, Hkv, D]")
    inputs = {"q": _tensors.export(q), "k_summary": _tensors.export(k_summary)}
    if cu_seqlens_q is not None:
        total_q, heads_q, head_dim = _expect_rank("q", q, 3, "[total_q, Hq, D] (varlen)")
        cu_seqlens_q = _tensors.to_int32(cu_seqlens_q)
        cu_seqlens_k = cu_seqlens_q if cu_seqlens_k is None else _tensors.to_int32(cu_seqlens_k)
        seqused_k = _tensors.to_int32(seqused_k)
        batch = _tensors.shape_of(cu_seqlens_q)[0] - 1
        seqlen_q = max_seqlen_q or _max_length(cu_seqlens_q, None, total_q)
        # The summaries were built for KV sequences up to nKB blocks: that bounds every length.
        seqlen_kv = max_seqlen_k or kv_blocks * bk
        # Lengths on the host: read where they are, or (device metadata) copied when validating,
        # which synchronises as attention(validate=True) does; else bounds stand in for them.
        cu_q, cu_k = (_host_values(t, validate) for t in (cu_seqlens_q, cu_seqlens_k))
        # total_kv is only compared with cu_seqlens_k[B], by the value checks.
        total_kv = int(cu_k[-1]) if cu_k is not None else max(1, kv_blocks * bk * batch)
        problem = dict(q_layout="varlen", total_q=total_q, total_kv=total_kv, validate=bool(validate))
        # Rows: total_m_blocks from the lengths, else its bound (rows past it are zero).
        rows = (int(sum(-(-int(n) // bq) for n in cu_q[1:] - cu_q[:-1])) if cu_q is not None
                else total_q // bq + batch)
        inputs.update({"cu_seqlens_q": _tensors.export(cu_seqlens_q), "cu_seqlens_k": _tensors.export(cu_seqlens_k)})
        if seqused_k is not None:
            inputs["seqused_k"] = _tensors.export(seqused_k)
    else:
        batch, seqlen_q, heads_q, head_dim = _expect_rank("q", q, 4, "[B, Sq, Hq, D]")
        seqlen_kv = max_seqlen_k or seqlen_q
        if not max_seqlen_k and -(-seqlen_kv // bk) != kv_blocks:
            raise _tensors.fail("max_seqlen_k", f"not given, and Sq = {seqlen_q} does not fill the {kv_blocks} KV "
                                f"blocks of k_summary: pass the KV length")
        problem = dict(q_layout="batched", validate=bool(validate))
        rows = -(-seqlen_q // bq)
    device, device_index = _tensors.device_of(q)
    problem.update(batch=batch, heads_q=heads_q, heads_kv=heads_kv, head_dim=head_dim, max_seqlen_q=max(1, seqlen_q),
                   max_seqlen_kv=seqlen_kv, dtype=_tensors.dtype_name(q), block_q=bq, block_kv=bk,
                   scale=0.0 if scale is None else float(scale), num_threads=int(num_threads), device=device,
                   device_index=device_index)
    sparsity_heads = heads_q if heads == "q" else heads_kv
    words = -(-kv_blocks // 32)
    shape = (sparsity_heads, rows, words) if cu_seqlens_q is not None else (batch, sparsity_heads, rows, words)
    word_type = "i32" if _tensors.is_torch(q) else "u32"
    bits = _tensors.empty(q, shape, word_type)
    stream = _tensors.current_stream(q) if stream is None else stream
    with _tensors.device_guard(q):
        _bsattn.select_blocks(problem, inputs, options, _tensors.export(bits, "u32" if word_type == "i32" else None),
                              stream)
    return Bitmask(_tensors.finish(q, bits), block_size=(bq, bk))
