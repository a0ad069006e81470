"""merge_state() / merge_states(): partial attention results combined by their LSE (merge.hpp)."""

from . import _bsattn, _tensors


def _like(name, t, shape):
    """An uninitialised tensor of `shape` in `t`'s float dtype, framework and device."""
    dtype = _tensors.dtype_name(t)
    if dtype not in ("f32", "f16", "bf16"):
        raise _tensors.fail(name, f"dtype {dtype} is not supported; expected float32, float16 or bfloat16")
    return _tensors.empty(t, shape, dtype)


def _run(call, like, out, lse, stream):
    stream = _tensors.current_stream(like) if stream is None else stream
    with _tensors.device_guard(like):
        call(_tensors.export(out), _tensors.export(lse), stream)
    return _tensors.finish(like, out), _tensors.finish(like, lse)


def merge_state(out_a, lse_a, out_b, lse_b, *, out=None, lse=None, stream=None):
    """Merges two partial attention results into ``(out, lse)``: attention over two disjoint KV
    subsets, each as `attention` returned it with ``return_lse=True`` (O batched ``[B, S, H, D]``
    or varlen ``[total, H, D]``, float32 / float16 / bfloat16, any strides with a contiguous last
    dimension; LSE float32 ``[B, H, S]`` or ``[H, total]``), gives attention over their union.

    In fp32 per (row, head): ``m = max(lse_i)``, ``w_i = exp(lse_i - m)``,
    ``out = sum(w_i * o_i) / sum(w_i)``, ``lse = m + log(sum(w_i))``. A part with ``lse = -inf``
    (an empty row) is ignored; a row empty in every part gives ``out = 0``, ``lse = -inf``; a NaN
    LSE gives NaN. ``out`` / ``lse`` (allocated like ``out_a`` / ``lse_a`` when not given) may be
    ``out_a`` / ``lse_a`` themselves to merge in place. CUDA tensors run one kernel on ``stream``
    (default: the framework's current stream) with no host synchronisation.
    """
    out = _like("out_a", out_a, _tensors.shape_of(out_a)) if out is None else out
    lse = _tensors.empty(lse_a, _tensors.shape_of(lse_a), "f32") if lse is None else lse
    parts = [_tensors.export(t) for t in (out_a, lse_a, out_b, lse_b)]
    return _run(lambda o, l, s: _bsattn.merge_state(*parts, o, l, s), out_a, out, lse, stream)


def merge_states(outs, lses, *, out=None, lse=None, stream=None):
    """Merges N >= 1 partial results stacked on a leading dimension, ``outs [N, ...]`` and
    ``lses [N, ...]`` (each part laid out as in `merge_state`), into ``(out, lse)`` of one part's
    shape. Same arithmetic, rules and devices as `merge_state`; ``out`` may be one of the parts
    (``outs[i]``, with ``lse`` = ``lses[i]``) to merge in place."""
    out_shape, lse_shape = _tensors.shape_of(outs)[1:], _tensors.shape_of(lses)[1:]
    out = _like("outs", outs, out_shape) if out is None else out
    lse = _tensors.empty(lses, lse_shape, "f32") if lse is None else lse
    parts = [_tensors.export(t) for t in (outs, lses)]
    return _run(lambda o, l, s: _bsattn.merge_states(*parts, o, l, s), outs, out, lse, stream)
