"""attention(), Plan, build_summaries(), varlen_block_offsets(): the Python face of plan.hpp.

A call is described in two steps. `_flatten` turns the user's objects (sparsity, mask, proxy,
keyword tensors) into fixed tensor slots plus primitive options; `_describe` turns q, k, v, the
slots and the options into the C++ Problem (a dict of field values) and the extension's inputs.
The PyTorch custom op (torch_ops.py) carries exactly the slots and options through the
dispatcher, so eager, torch.compile and NumPy calls share one description.
"""

import threading

from . import _bsattn, _tensors
from .mask import NO_MASK, Mask
from .sparsity import AllBlocks, Sparsity

# Every tensor input besides q, k, v, in the order the torch op receives them.
SLOT_NAMES = (
    "partial.counts", "partial.indices", "partial.indptr", "partial.bits",
    "full.counts", "full.indices", "full.indptr", "full.bits",
    "proxy.counts", "proxy.indices", "proxy.indptr", "proxy.bits",
    "cu_total_m_blocks", "cu_block_idx_offsets",
    "cu_seqlens_q", "cu_seqlens_k", "seqused_k", "block_table", "seq_lens_kv",
    "doc_q", "doc_kv", "kv_valid", "k_summary", "v_summary",
)
# Bit words: int32 tensors are read as uint32 (PyTorch has no general uint32).
_BIT_SLOTS = frozenset({"partial.bits", "full.bits", "proxy.bits", "kv_valid"})

# Primitive options with their schema types, in the order the torch op receives them. 0 and ""
# mean "derive it": scale 1/sqrt(D), max_seqlen_* from the tensors, out_dtype q's dtype,
# num_threads all cores.
OPTIONS = (
    ("sparsity_format", "str"), ("block_q", "int"), ("block_kv", "int"), ("sparsity_batch", "int"),
    ("sparsity_heads", "int"), ("causal", "bool"), ("alignment", "str"), ("window_left", "int"),
    ("window_right", "int"), ("sink_tokens", "int"), ("scale", "float"), ("max_seqlen_q", "int"),
    ("max_seqlen_kv", "int"), ("out_dtype", "str"), ("return_lse", "bool"), ("validate", "bool"),
    ("num_threads", "int"),
)
OPTION_NAMES = tuple(name for name, _ in OPTIONS)


_ALL_BLOCKS = AllBlocks()  # sparsity=None


_TORCH_OPS = []  # bsattn.torch_ops once a PyTorch call imported it (it imports torch)


def _torch_ops():
    if not _TORCH_OPS:
        from . import torch_ops

        _TORCH_OPS.append(torch_ops)
    return _TORCH_OPS[0]


class Summaries(tuple):
    """``(k_summary, v_summary)`` ``[B, nKB, Hkv, D]`` for proxy compensation (SPEC §6); what
    `build_summaries` returns and ``attention(..., proxy=)`` takes."""

    def __new__(cls, k_summary, v_summary):
        return super().__new__(cls, (k_summary, v_summary))

    @property
    def k_summary(self):
        return self[0]

    @property
    def v_summary(self):
        return self[1]


def _flatten(sparsity, mask, proxy, *, scale, out_dtype, return_lse, validate, num_threads, max_seqlen_q,
             max_seqlen_k, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, seq_lens_kv):
    """(slots, options): every tensor by slot name (None where absent) and the primitive options."""
    sparsity = _ALL_BLOCKS if sparsity is None else sparsity
    if not isinstance(sparsity, Sparsity):
        raise _tensors.fail("sparsity", "expected a bsattn sparsity object (see bsattn.adapters), "
                            f"got {type(sparsity).__name__}")
    mask = NO_MASK if mask is None else mask
    if not isinstance(mask, Mask):
        raise _tensors.fail("mask", f"expected a bsattn.Mask, got {type(mask).__name__}")
    slots = dict.fromkeys(SLOT_NAMES)
    slots.update(sparsity.slots())
    slots.update(mask.slots())
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k), ("seqused_k", seqused_k),
                    ("block_table", block_table), ("seq_lens_kv", seq_lens_kv)):
        if t is not None:
            slots[name] = _tensors.to_int32(t)
    if proxy is not None:
        if len(proxy) != 2:
            raise _tensors.fail("proxy", "expected (k_summary, v_summary)")
        slots["k_summary"], slots["v_summary"] = proxy
    elif "proxy" in sparsity.sets:
        raise _tensors.fail("proxy", "the sparsity names proxy blocks but no summaries were given (proxy=)")
    sparsity_batch, sparsity_heads = sparsity.geometry()
    options = dict(
        sparsity_format=sparsity.format, block_q=sparsity.block_size[0], block_kv=sparsity.block_size[1],
        sparsity_batch=int(sparsity_batch), sparsity_heads=int(sparsity_heads), **mask.options(),
        scale=0.0 if scale is None else float(scale), max_seqlen_q=int(max_seqlen_q or 0),
        max_seqlen_kv=int(max_seqlen_k or 0), out_dtype=_tensors.dtype_label(out_dtype), return_lse=bool(return_lse),
        validate=bool(validate), num_threads=int(num_threads))
    return slots, options


def _expect_rank(name, t, rank, layout):
    shape = _tensors.shape_of(t)
    if len(shape) != rank:
        raise _tensors.fail(name, f"expected rank {rank} {layout}, got {list(shape)}")
    return shape


def _max_length(cu_seqlens, used, fallback):
    """The longest sequence, read from host metadata, or `fallback` (an upper bound) when the
    metadata lives on a device and reading it would synchronise."""
    if used is not None:
        values = _tensors.host_ints(used)
        return int(values.max(initial=0)) if values is not None else fallback
    values = _tensors.host_ints(cu_seqlens)
    if values is None:
        return fallback
    return int((values[1:] - values[:-1]).max(initial=0))


def output_shapes(q, varlen, return_lse):
    """(out shape, lse shape or None): O has Q's shape; LSE is [B, Hq, Sq] or [Hq, total_q].
    Sizes stay as the tensor gives them (symbolic under torch.compile's dynamic shapes)."""
    shape = tuple(q.shape)
    if not return_lse:
        return shape, None
    return shape, ((shape[1], shape[0]) if varlen else (shape[0], shape[2], shape[1]))


def _describe(q, k, v, slots, options):
    """(problem, inputs): the C++ Problem fields and the extension's input tensors."""
    varlen = slots["cu_seqlens_q"] is not None
    paged = slots["block_table"] is not None
    if varlen:
        total_q, heads_q, head_dim = _expect_rank("q", q, 3, "[total_q, Hq, D] (varlen)")
        batch = _tensors.shape_of(slots["cu_seqlens_q"])[0] - 1
        seqlen_q = options["max_seqlen_q"] or _max_length(slots["cu_seqlens_q"], None, total_q)
    else:
        batch, seqlen_q, heads_q, head_dim = _expect_rank("q", q, 4, "[B, Sq, Hq, D]")
        total_q = batch * seqlen_q
    problem = dict(batch=batch, heads_q=heads_q, head_dim=head_dim, max_seqlen_q=seqlen_q,
                   q_layout="varlen" if varlen else "batched", total_q=total_q)

    if paged:
        num_pages, page_size, heads_kv, _ = _expect_rank("k", k, 4, "[num_pages, page_size, Hkv, D] (paged)")
        if slots["seq_lens_kv"] is None:
            raise _tensors.fail("seq_lens_kv", "required with block_table")
        pages_per_seq = _expect_rank("block_table", slots["block_table"], 2, "[B, C]")[1]
        seqlen_kv = options["max_seqlen_kv"] or _max_length(None, slots["seq_lens_kv"], pages_per_seq * page_size)
        problem.update(kv_layout="paged", page_size=page_size, num_pages=num_pages, pages_per_seq=pages_per_seq)
    elif varlen:
        if slots["cu_seqlens_k"] is None:
            raise _tensors.fail("cu_seqlens_k", "required with cu_seqlens_q (or pass block_table for paged KV)")
        total_kv, heads_kv, _ = _expect_rank("k", k, 3, "[total_kv, Hkv, D] (varlen)")
        seqlen_kv = options["max_seqlen_kv"] or _max_length(slots["cu_seqlens_k"], slots["seqused_k"], total_kv)
        problem.update(kv_layout="contiguous", total_kv=total_kv)
    else:
        _, seqlen_kv, heads_kv, _ = _expect_rank("k", k, 4, "[B, Skv, Hkv, D]")
        problem.update(kv_layout="contiguous")

    dtype = _tensors.dtype_name(q)
    if dtype not in ("f16", "bf16", "f32"):
        raise _tensors.fail("q", f"dtype {dtype} is not supported; expected float16, bfloat16 or float32")
    device, device_index = _tensors.device_of(q)
    has = {name: slots[name] is not None for name in SLOT_NAMES}
    if has["proxy.counts"] or has["proxy.indptr"] or has["proxy.bits"]:
        proxy = "explicit_set"
    else:
        proxy = "eligible" if has["k_summary"] else "off"
    fmt = options["sparsity_format"]
    problem.update(
        heads_kv=heads_kv, max_seqlen_kv=seqlen_kv, dtype=dtype, out_dtype=options["out_dtype"] or dtype,
        device=device, device_index=device_index, format=fmt, block_q=options["block_q"],
        block_kv=options["block_kv"], sparsity_batch=options["sparsity_batch"],
        sparsity_heads=options["sparsity_heads"],
        has_partial=fmt == "all_blocks" or has["partial.counts"] or has["partial.indptr"] or has["partial.bits"],
        has_full=has["full.counts"] or has["full.indptr"] or has["full.bits"],
        causal=options["causal"], alignment=options["alignment"], window_left=options["window_left"],
        window_right=options["window_right"], sink_tokens=options["sink_tokens"],
        document_ids=has["doc_q"] or has["doc_kv"], kv_valid_bits=has["kv_valid"], proxy=proxy,
        scale=options["scale"], validate=options["validate"], num_threads=options["num_threads"])

    inputs = {"q": _tensors.export(q), "k": _tensors.export(k), "v": _tensors.export(v)}
    for name in SLOT_NAMES:
        t = slots[name]
        if t is not None:
            bits_as_int32 = name in _BIT_SLOTS and _tensors.dtype_name(t) == "i32"
            inputs[name] = _tensors.export(t, "u32" if bits_as_int32 else None)
    return problem, inputs


def _outputs(q, problem, return_lse, out, lse):
    """Outputs given by the caller, or allocated like q."""
    out_shape, lse_shape = output_shapes(q, problem["q_layout"] == "varlen", return_lse or lse is not None)
    if out is None:
        out = _tensors.empty(q, out_shape, problem["out_dtype"])
    if lse is None and lse_shape is not None:
        lse = _tensors.empty(q, lse_shape, "f32")
    return out, lse


def _run(run, q, problem, inputs, return_lse, out, lse, stream):
    out, lse = _outputs(q, problem, return_lse, out, lse)
    stream = _tensors.current_stream(q) if stream is None else stream
    with _tensors.device_guard(q):
        run(inputs, {"out": _tensors.export(out), "lse": None if lse is None else _tensors.export(lse)}, stream)
    out = _tensors.finish(q, out)
    return (out, _tensors.finish(q, lse)) if return_lse else out


def attention(q, k, v, sparsity=None, *, scale=None, mask=None, proxy=None, return_lse=False, out=None, lse=None,
              out_dtype=None, cu_seqlens_q=None, cu_seqlens_k=None, seqused_k=None, max_seqlen_q=None,
              max_seqlen_k=None, block_table=None, seq_lens_kv=None, validate=True, num_threads=0, stream=None):
    """Block-sparse attention, planned and run in one call with full validation (SPEC §1, §8).

    Layouts (SPEC §2): batched ``q [B, Sq, Hq, D]``, ``k``/``v [B, Skv, Hkv, D]``; varlen
    ``q [total_q, Hq, D]`` with ``cu_seqlens_q``/``cu_seqlens_k`` (``k``/``v [total_kv, Hkv, D]``,
    optional ``seqused_k``); paged KV ``k``/``v [num_pages, page_size, Hkv, D]`` with
    ``block_table [B, C]`` and ``seq_lens_kv [B]``. Strides are free except the last dimension.

    ``sparsity``: a `bsattn.sparsity` object (see `bsattn.adapters`); None attends every block.
    ``mask``: a `bsattn.Mask`. ``proxy``: ``(k_summary, v_summary)`` from `build_summaries`
    turns on proxy compensation (SPEC §6). ``scale`` defaults to ``1/sqrt(D)``.
    ``max_seqlen_q``/``max_seqlen_k``: varlen/paged bounds; when omitted they are read from
    CPU metadata, or bounded by the totals for device metadata (no host synchronisation).

    Returns ``out`` (Q's shape, ``out_dtype`` or Q's dtype), or ``(out, lse)`` with
    ``return_lse``: LSE fp32 ``[B, Hq, Sq]`` (varlen ``[Hq, total_q]``), ``-inf`` for an empty
    row. PyTorch tensors go through the ``torch.ops.bsattn.attention`` custom op on the current
    stream (torch.compile and CUDA graphs); errors raise `BsattnError` (a ValueError).
    """
    slots, options = _flatten(
        sparsity, mask, proxy, scale=scale, out_dtype=out_dtype, return_lse=return_lse, validate=validate,
        num_threads=num_threads, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k, seqused_k=seqused_k, block_table=block_table, seq_lens_kv=seq_lens_kv)
    if _tensors.is_torch(q):
        torch_ops = _torch_ops()
        if torch_ops.direct_call_allowed(q, k, v):
            return torch_ops.direct_attention(q, k, v, slots, options, out, lse, stream)
        if stream is None:
            return torch_ops.attention(q, k, v, slots, options, out, lse)
    problem, inputs = _describe(q, k, v, slots, options)
    run = lambda inputs, outputs, stream: _bsattn.attention(problem, inputs, outputs, stream)  # noqa: E731
    return _run(run, q, problem, inputs, return_lse, out, lse, stream)


def backward_run(run, q, k, v, slots, options, out, lse, dout, dlse, dq, dk, dv, stream=None):
    """Writes dq, dk, dv (like q, k, v) from the flattened call of the forward through
    run(problem, inputs, backward, gradients, stream): a one-shot call or a cached plan's."""
    problem, inputs = _describe(q, k, v, slots, options)
    backward = {"out": _tensors.export(out), "lse": _tensors.export(lse), "dout": _tensors.export(dout),
                "dlse": None if dlse is None else _tensors.export(dlse)}
    gradients = {"dq": _tensors.export(dq), "dk": _tensors.export(dk), "dv": _tensors.export(dv)}
    stream = _tensors.current_stream(q) if stream is None else stream
    with _tensors.device_guard(q):
        run(problem, inputs, backward, gradients, stream)


def attention_backward(q, k, v, out, lse, dout, sparsity=None, *, scale=None, mask=None, proxy=None,
                       cu_seqlens_q=None, cu_seqlens_k=None, seqused_k=None, max_seqlen_q=None, max_seqlen_k=None,
                       block_table=None, seq_lens_kv=None, validate=True, num_threads=0, stream=None, dlse=None,
                       dq=None, dk=None, dv=None):
    """Gradients ``(dq, dk, dv)`` of `attention` for the loss gradient ``dout`` (SPEC §9).

    ``q, k, v`` and the keywords describe the forward call exactly as in `attention`; ``out`` and
    ``lse`` are what it returned (``return_lse=True``), ``dout`` has ``out``'s shape and dtype;
    ``dlse`` (float32, ``lse``'s shape) adds the gradient of a loss that uses the LSE too.
    Every attended pair contributes, rows with ``lse = -inf`` nothing; accumulation is fp32.
    ``dq``, ``dk``, ``dv`` may be given (Q's, K's, V's shape, in their dtype or float32), else
    they are allocated like q, k, v. CPU engine and GPU; proxy compensation and paged KV
    have no backward (`BsattnError` names the argument).
    """
    slots, options = _flatten(
        sparsity, mask, proxy, scale=scale, out_dtype=_tensors.dtype_name(out), return_lse=True, validate=validate,
        num_threads=num_threads, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k, seqused_k=seqused_k, block_table=block_table, seq_lens_kv=seq_lens_kv)
    dq, dk, dv = (_tensors.empty(t, _tensors.shape_of(t), _tensors.dtype_name(t)) if g is None else g
                  for t, g in ((q, dq), (k, dk), (v, dv)))
    backward_run(_bsattn.attention_backward, q, k, v, slots, options, out, lse, dout, dlse, dq, dk, dv, stream)
    return _tensors.finish(q, dq), _tensors.finish(k, dk), _tensors.finish(v, dv)


# Keyword arguments of `attention` that describe the problem, with their defaults.
_CALL_DEFAULTS = dict(
    sparsity=None, scale=None, mask=None, proxy=None, return_lse=False, out_dtype=None, cu_seqlens_q=None,
    cu_seqlens_k=None, seqused_k=None, max_seqlen_q=None, max_seqlen_k=None, block_table=None, seq_lens_kv=None,
    validate=True, num_threads=0)


def _flatten_call(arguments):
    unknown = sorted(set(arguments) - set(_CALL_DEFAULTS))
    if unknown:
        raise TypeError(f"unexpected keyword argument {unknown[0]!r}")
    a = dict(_CALL_DEFAULTS, **arguments)
    return _flatten(a.pop("sparsity"), a.pop("mask"), a.pop("proxy"), **a)


class Plan:
    """A planned problem for repeated calls (C++ ``bsattn::Plan``): planning sizes and allocates
    the workspace once; each call prepares routes and runs attention, with no allocation on the
    device when ``validate=False`` (the trusted path, capturable in a CUDA graph).

    ``Plan(q, k, v, sparsity, **kwargs)`` takes the arguments of `attention`; a call
    ``plan(q, k, v, sparsity=None, *, out=None, lse=None, stream=None, **kwargs)`` reuses every
    argument it does not repeat. Tensors may change between calls (values and addresses), shapes
    and options may not: a call that describes another problem raises BsattnError naming the
    first difference. Varlen plans should pass ``max_seqlen_q`` / ``max_seqlen_k``: lengths read
    from the metadata would change the problem from call to call.
    """

    def __init__(self, q, k, v, sparsity=None, **kwargs):
        self._arguments = dict(kwargs, sparsity=sparsity)
        self._problem, _ = _describe(q, k, v, *_flatten_call(self._arguments))
        self._plan = _bsattn.Plan()
        with _tensors.device_guard(q):
            self._plan.plan(self._problem)
        self._lock = threading.Lock()  # the plan's workspace serves one call at a time
        self._calls = {}  # eager PyTorch calls: signature -> tensor layout (torch_ops.direct_attention)

    @property
    def problem(self):
        """The C++ Problem fields this plan was made for."""
        return dict(self._problem)

    @property
    def tiles(self):
        return self._plan.tiles

    @property
    def route_capacity(self):
        return self._plan.route_capacity

    @property
    def workspace_bytes(self):
        return self._plan.workspace_bytes

    def __call__(self, q, k, v, sparsity=None, *, out=None, lse=None, stream=None, **kwargs):
        arguments = dict(self._arguments, **kwargs) if kwargs else self._arguments
        if sparsity is not None:
            arguments = dict(arguments, sparsity=sparsity)
        slots, options = _flatten_call(arguments)
        if _tensors.is_torch(q):
            torch_ops = _torch_ops()
            if torch_ops.direct_call_allowed(q, k, v):
                return torch_ops.direct_attention(q, k, v, slots, options, out, lse, stream, self._calls,
                                                  self._planned)
        problem, inputs = _describe(q, k, v, slots, options)
        self._planned(problem)
        return _run(self._plan.run, q, problem, inputs, arguments.get("return_lse", False), out, lse, stream)

    def _planned(self, problem):
        """(plan, lock) for a call describing `problem`, which must be the planned one."""
        for field, value in problem.items():
            if self._problem.get(field) != value:
                raise _tensors.fail(f"problem.{field}", f"{value!r} differs from the planned "
                                    f"{self._problem.get(field)!r}; make a new Plan for another problem")
        return self._plan, self._lock

    run = __call__


def _kv_problem(k, block_kv, cu_seqlens_k, seqused_k, block_table, seq_lens_kv, max_seqlen_k):
    """(problem, inputs) of a KV-only operation in any KV layout; no query is involved."""
    heads_kv, head_dim = _tensors.shape_of(k)[-2:]
    inputs = {}
    if block_table is not None:
        num_pages, page_size, _, _ = _expect_rank("k", k, 4, "[num_pages, page_size, Hkv, D] (paged)")
        batch, pages_per_seq = _expect_rank("block_table", block_table, 2, "[B, C]")
        seq_lens_kv = _tensors.to_int32(seq_lens_kv)
        seqlen_kv = max_seqlen_k or _max_length(None, seq_lens_kv, pages_per_seq * page_size)
        problem = dict(q_layout="batched", kv_layout="paged", page_size=page_size, num_pages=num_pages,
                       pages_per_seq=pages_per_seq)
        inputs.update(block_table=_tensors.to_int32(block_table), seq_lens_kv=seq_lens_kv)
    elif cu_seqlens_k is not None:
        total_kv = _expect_rank("k", k, 3, "[total_kv, Hkv, D] (varlen)")[0]
        cu_seqlens_k, seqused_k = _tensors.to_int32(cu_seqlens_k), _tensors.to_int32(seqused_k)
        batch = _tensors.shape_of(cu_seqlens_k)[0] - 1
        seqlen_kv = max_seqlen_k or _max_length(cu_seqlens_k, seqused_k, total_kv)
        # A varlen layout addresses Q through cu_seqlens_q too; the KV offsets stand in for it.
        problem = dict(q_layout="varlen", kv_layout="contiguous", total_kv=total_kv, total_q=total_kv)
        inputs.update(cu_seqlens_q=cu_seqlens_k, cu_seqlens_k=cu_seqlens_k, seqused_k=seqused_k)
    else:
        batch, seqlen_kv, _, _ = _expect_rank("k", k, 4, "[B, Skv, Hkv, D]")
        problem = dict(q_layout="batched", kv_layout="contiguous")
    device, device_index = _tensors.device_of(k)
    problem.update(batch=batch, heads_q=heads_kv, heads_kv=heads_kv, head_dim=head_dim, max_seqlen_q=seqlen_kv,
                   max_seqlen_kv=seqlen_kv, dtype=_tensors.dtype_name(k), block_q=64, block_kv=block_kv,
                   format="all_blocks", device=device, device_index=device_index)
    return problem, {name: _tensors.export(t) for name, t in inputs.items() if t is not None}


def build_summaries(k, v, block_kv, *, cu_seqlens_k=None, seqused_k=None, block_table=None, seq_lens_kv=None,
                    max_seqlen_k=None, validate=True, stream=None):
    """Proxy summaries (SPEC §6) of K/V in any KV layout of `attention`: per KV block of
    ``block_kv`` tokens, the mean of K and the sum of V over its in-range tokens, each
    ``[B, ceil(max_seqlen_k / block_kv), Hkv, D]`` in K's dtype. Returns `Summaries`.

    CUDA tensors are summarised by a GPU kernel on ``stream`` (default: the current stream of
    K's framework). ``validate=True`` reads the length metadata on the host first (a device
    sync); ``validate=False`` only enqueues the kernel (graph-capturable)."""
    problem, inputs = _kv_problem(k, block_kv, cu_seqlens_k, seqused_k, block_table, seq_lens_kv, max_seqlen_k)
    problem["validate"] = bool(validate)
    inputs.update(k=_tensors.export(k), v=_tensors.export(v))
    shape = (problem["batch"], -(-problem["max_seqlen_kv"] // block_kv), problem["heads_kv"], problem["head_dim"])
    k_summary, v_summary = _tensors.empty(k, shape, problem["dtype"]), _tensors.empty(k, shape, problem["dtype"])
    stream = _tensors.current_stream(k) if stream is None else stream
    with _tensors.device_guard(k):
        _bsattn.build_summaries(problem, inputs, _tensors.export(k_summary), _tensors.export(v_summary), stream)
    return Summaries(_tensors.finish(k, k_summary), _tensors.finish(k, v_summary))


def varlen_block_offsets(cu_seqlens_q, block_size, *, cu_seqlens_k=None, seqused_k=None, seq_lens_kv=None,
                         stream=None):
    """``(cu_total_m_blocks, cu_block_idx_offsets)``, int32 ``[B + 1]`` (SPEC §3.2), computed
    where the lengths live (on the device without a host sync). KV lengths come from
    ``cu_seqlens_k`` (and ``seqused_k``) or, for paged KV, ``seq_lens_kv``."""
    bq, bk = AllBlocks(block_size).block_size
    cu_seqlens_q = _tensors.to_int32(cu_seqlens_q)
    batch = _tensors.shape_of(cu_seqlens_q)[0] - 1
    device, device_index = _tensors.device_of(cu_seqlens_q)
    problem = dict(batch=batch, max_seqlen_q=1, max_seqlen_kv=1, q_layout="varlen",
                   kv_layout="contiguous" if seq_lens_kv is None else "paged", block_q=bq, block_kv=bk,
                   format="varlen_block_lists", device=device, device_index=device_index)
    lengths = {"cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k, "seqused_k": seqused_k,
               "seq_lens_kv": seq_lens_kv}
    inputs = {n: _tensors.export(_tensors.to_int32(t)) for n, t in lengths.items() if t is not None}
    m_blocks, offsets = (_tensors.empty(cu_seqlens_q, (batch + 1,), "i32") for _ in range(2))
    stream = _tensors.current_stream(cu_seqlens_q) if stream is None else stream
    with _tensors.device_guard(cu_seqlens_q):
        _bsattn.varlen_block_offsets(problem, inputs, _tensors.export(m_blocks), _tensors.export(offsets), stream)
    return _tensors.finish(cu_seqlens_q, m_blocks), _tensors.finish(cu_seqlens_q, offsets)
