"""PyTorch integration: bsattn as torch.library custom ops, usable under torch.compile and inside
CUDA graphs, on the current torch stream.

* ``torch.ops.bsattn.attention(q, k, v, slots, *options) -> (out, lse)`` is functional; its fake
  implementation returns empty outputs of the right shapes, so torch.compile traces it without
  running it. ``lse`` is an empty tensor unless ``return_lse``.
* ``torch.ops.bsattn.attention_out(q, k, v, slots, *options, out, lse)`` writes into given
  outputs (``attention(..., out=)``).
* ``torch.ops.bsattn.attention_backward(q, k, v, slots, *options, out, lse, dout, dlse) -> (dq, dk, dv)``
  is the backward (CPU engine), registered as the autograd formula of ``attention``: when q, k
  or v requires grad, `bsattn.attention` asks the op for the LSE the backward needs. It runs on
  the forward's cached plan (the LSE request is not part of the problem, so the plan is shared).

``slots`` are the optional tensors of `bsattn._api.SLOT_NAMES` and ``options`` the primitives of
`bsattn._api.OPTIONS`, in that order; `bsattn.attention` builds them from its arguments.

An eager call that needs neither autograd nor tracing skips the dispatcher
(`direct_attention`): it is keyed by its tensors' shapes, strides, dtypes and devices and its
options, and a repeated key passes only data pointers to its cached plan.

Each distinct problem is planned once and cached (plan() allocates; a CUDA graph must capture
calls whose plan exists, so warm up first). Calls of the same problem share that plan's
workspace: they must not run concurrently on different streams. Capture needs
``validate=False``: value validation reads a flag on the host (and, when it is raised, the metadata).
"""

import atexit
import collections
import threading

import torch

from . import _api, _bsattn, _tensors

_OPTION_SCHEMA = ", ".join(f"{kind} {name}" for name, kind in _api.OPTIONS)
_INPUT_SCHEMA = f"Tensor q, Tensor k, Tensor v, Tensor?[] slots, {_OPTION_SCHEMA}"
_CU_SEQLENS_Q = _api.SLOT_NAMES.index("cu_seqlens_q")
_OUT_DTYPE = _api.OPTION_NAMES.index("out_dtype")
_RETURN_LSE = _api.OPTION_NAMES.index("return_lse")
_TORCH_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}

torch.library.define("bsattn::attention", f"({_INPUT_SCHEMA}) -> (Tensor, Tensor)")
torch.library.define("bsattn::attention_out", f"({_INPUT_SCHEMA}, Tensor(a!) out, Tensor(b!)? lse) -> ()")
torch.library.define("bsattn::attention_backward",
                     f"({_INPUT_SCHEMA}, Tensor out, Tensor lse, Tensor dout, Tensor? dlse) "
                     "-> (Tensor, Tensor, Tensor)")

_MAX_PLANS = 32
_plans = collections.OrderedDict()  # problem -> (plan, lock), least recently used first
_plans_lock = threading.Lock()
# Plans hold C++ resources: release them before the interpreter tears the extension down.
atexit.register(_plans.clear)


def _cached_plan(problem):
    key = tuple(sorted(problem.items()))
    with _plans_lock:
        entry = _plans.pop(key, None)
        if entry is None:
            plan = _bsattn.Plan()
            plan.plan(problem)
            entry = (plan, threading.Lock())
        _plans[key] = entry
        while len(_plans) > _MAX_PLANS:
            _plans.popitem(last=False)
    return entry


def _out_dtype(q, name):
    return _TORCH_DTYPES[name] if name else q.dtype


def _new_outputs(q, slots, options):
    """(out, lse) as both the real and the fake implementation allocate them."""
    out_shape, lse_shape = _api.output_shapes(q, slots[_CU_SEQLENS_Q] is not None, options[_RETURN_LSE])
    out = q.new_empty(out_shape, dtype=_out_dtype(q, options[_OUT_DTYPE]))
    lse = q.new_empty(lse_shape if lse_shape is not None else (0,), dtype=torch.float32)
    return out, lse


def _run(q, k, v, slots, options, out, lse):
    problem, inputs = _api._describe(q, k, v, dict(zip(_api.SLOT_NAMES, slots)), dict(zip(_api.OPTION_NAMES, options)))
    outputs = {"out": _tensors.export(out), "lse": None if lse is None else _tensors.export(lse)}
    with _tensors.device_guard(q):
        plan, lock = _cached_plan(problem)
        with lock:
            plan.run(inputs, outputs, _tensors.current_stream(q))


@torch.library.impl("bsattn::attention", ("cpu", "cuda"))
def _attention(q, k, v, slots, *options):
    out, lse = _new_outputs(q, slots, options)
    _run(q, k, v, slots, options, out, lse if options[_RETURN_LSE] else None)
    return out, lse


@torch.library.register_fake("bsattn::attention")
def _attention_fake(q, k, v, slots, *options):
    return _new_outputs(q, slots, options)


@torch.library.impl("bsattn::attention_backward", ("cpu", "cuda"))
def _attention_backward(q, k, v, slots, *arguments):
    *options, out, lse, dout, dlse = arguments
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    def run(problem, inputs, backward, gradients, stream):  # on a cached plan made for the backward
        plan, lock = _cached_plan({**problem, "backward": True})
        with lock:
            plan.run_backward(inputs, backward, gradients, stream)

    _api.backward_run(run, q, k, v, dict(zip(_api.SLOT_NAMES, slots)), dict(zip(_api.OPTION_NAMES, options)), out,
                      lse, dout, dlse, dq, dk, dv, _tensors.current_stream(q))
    return dq, dk, dv


@torch.library.register_fake("bsattn::attention_backward")
def _attention_backward_fake(q, k, v, slots, *arguments):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, slots, *options = inputs
    ctx.options = options
    ctx.slot_count = len(slots)
    ctx.save_for_backward(q, k, v, *output, *slots)


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, *slots = ctx.saved_tensors
    if not ctx.options[_RETURN_LSE]:
        raise RuntimeError("bsattn: no LSE was kept for the backward; call bsattn.attention with q, k or v requiring "
                           "grad (or return_lse=True)")
    # dO with a contiguous last dimension (the gradient of a sum arrives as an expanded view); the
    # LSE's gradient (zeros when the loss does not use it) enters dS too.
    dq, dk, dv = torch.ops.bsattn.attention_backward(q, k, v, slots, *ctx.options, out, lse, grad_out.contiguous(),
                                                     None if grad_lse is None else grad_lse.contiguous())
    return (dq, dk, dv, None, *(None for _ in ctx.options))


torch.library.register_autograd("bsattn::attention", _backward, setup_context=_setup_context)


@torch.library.impl("bsattn::attention_out", ("cpu", "cuda"))
def _attention_out(q, k, v, slots, *arguments):
    *options, out, lse = arguments
    _run(q, k, v, slots, options, out, lse)


@torch.library.register_fake("bsattn::attention_out")
def _attention_out_fake(q, k, v, slots, *arguments):
    return None


def direct_call_allowed(q, k, v):
    """Whether an eager call may skip the dispatcher: plain tensors, no autograd, no tracing
    (torch.compile, make_fx, export) and no torch function / dispatch mode that would expect to
    see the op."""
    return (type(q) is torch.Tensor and type(k) is torch.Tensor and type(v) is torch.Tensor
            and not torch.compiler.is_compiling()
            and not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad))
            and not torch._C._is_torch_function_mode_enabled() and torch._C._len_torch_dispatch_stack() == 0)


class _Call:
    """What a repeated eager call of one signature needs: the plan (shared with the op path), its
    lock, the C++ tensor layout (data pointers are all that change) and the outputs to allocate."""

    __slots__ = ("plan", "lock", "layout", "slot_names", "out_shape", "out_dtype", "lse_shape", "stream_device")


_MAX_CALLS = _MAX_PLANS  # entries keep their plans alive: at most twice _MAX_PLANS plans in all
_calls = {}  # call signature -> _Call
atexit.register(_calls.clear)


def _signature(t):
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device)


def _call_key(q, k, v, slots, options, out, lse):
    """Everything a call's problem and tensor layout follow from: the shapes, strides, dtypes and
    devices of its tensors (by slot name), and its options. Data pointers are not part of it."""
    return (_signature(q), _signature(k), _signature(v), _signature(out), _signature(lse),
            *[(name, t.shape, t.stride(), t.dtype, t.device) for name, t in slots.items() if t is not None],
            *options.values())


def _new_call(q, k, v, slots, options, out, lse, plan_of):
    """A _Call for this signature, its plan from plan_of(problem); raises BsattnError for a call the
    library rejects, before anything is written."""
    for name, t in (("k", k), ("v", v), *slots.items()):
        if t is not None and not isinstance(t, torch.Tensor):
            raise _tensors.fail(name, f"is a {type(t).__name__}; with a PyTorch q, pass PyTorch tensors")
    problem, inputs = _api._describe(q, k, v, slots, options)
    call = _Call()
    call.slot_names = tuple(name for name in _api.SLOT_NAMES if slots[name] is not None)
    out_shape, lse_shape = _api.output_shapes(q, problem["q_layout"] == "varlen",
                                              options["return_lse"] or lse is not None)
    call.out_shape, call.out_dtype, call.lse_shape = out_shape, _TORCH_DTYPES[problem["out_dtype"]], lse_shape
    call.stream_device = q.device.index if q.device.type == "cuda" else None
    # The layout is bound from tensors of exactly the signature's shapes, strides and dtypes.
    out = q.new_empty(out_shape, dtype=call.out_dtype) if out is None else out
    lse = q.new_empty(lse_shape, dtype=torch.float32) if lse is None and lse_shape is not None else lse
    call.layout = _bsattn.CallLayout(inputs, {"out": _tensors.export(out),
                                              "lse": None if lse is None else _tensors.export(lse)})
    with _tensors.device_guard(q):
        call.plan, call.lock = plan_of(problem)
    return call


def direct_attention(q, k, v, slots, options, out, lse, stream, calls=_calls, plan_of=_cached_plan):
    """`bsattn.attention` for an eager call that direct_call_allowed: the call's signature (shapes,
    strides, dtypes and devices of every tensor, and the options) finds its plan and C++ tensor
    layout in `calls`, and the extension receives only data pointers (no DLPack capsules, no
    problem dict). The first call of a signature takes the full path (every check of `_describe`,
    the plan from plan_of(problem) -> (plan, lock)); every call is still checked in C++
    (structure, alignment, overlap; values with validate=True)."""
    try:
        key = _call_key(q, k, v, slots, options, out, lse)
        call = calls.get(key)
    except (AttributeError, TypeError):  # not a PyTorch tensor somewhere: _new_call names it
        key, call = None, None
    if call is None:
        call = _new_call(q, k, v, slots, options, out, lse, plan_of)
        if len(calls) >= _MAX_CALLS:
            calls.clear()
        if key is not None:
            calls[key] = call
    given = [t for t in (out, lse) if t is not None]
    if out is None:
        out = torch.empty(call.out_shape, dtype=call.out_dtype, device=q.device)
    if lse is None and call.lse_shape is not None:
        lse = torch.empty(call.lse_shape, dtype=torch.float32, device=q.device)
    pointers = [q.data_ptr(), k.data_ptr(), v.data_ptr()]
    for name in call.slot_names:
        pointers.append(slots[name].data_ptr())
    pointers.append(out.data_ptr())
    if lse is not None:
        pointers.append(lse.data_ptr())
    if stream is None:
        stream = 0 if call.stream_device is None else torch._C._cuda_getCurrentRawStream(call.stream_device)
    with call.lock:
        call.layout.run(call.plan, pointers, stream)
    for t in given:  # written in place outside the dispatcher: tell autograd, as the op's (a!) would
        torch.autograd.graph.increment_version(t)
    return (out, lse) if options["return_lse"] else out


def attention(q, k, v, slots, options, out, lse):
    """`bsattn.attention` for PyTorch tensors: the flattened call through the custom ops."""
    for name, t in (("k", k), ("v", v), *slots.items()):
        if t is not None and not isinstance(t, torch.Tensor):
            raise _tensors.fail(name, f"is a {type(t).__name__}; with a PyTorch q, pass PyTorch tensors")
    arguments = (q, k, v, [slots[name] for name in _api.SLOT_NAMES], *(options[name] for name in _api.OPTION_NAMES))
    return_lse = options["return_lse"]
    if out is None and lse is None:
        if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):  # keep the LSE for the backward
            arguments = (*arguments[:4 + _RETURN_LSE], True, *arguments[5 + _RETURN_LSE:])
        out, lse = torch.ops.bsattn.attention(*arguments)
    else:
        out_shape, lse_shape = _api.output_shapes(q, slots["cu_seqlens_q"] is not None, return_lse)
        if out is None:
            out = q.new_empty(out_shape, dtype=_out_dtype(q, options["out_dtype"]))
        if lse is None and return_lse:
            lse = q.new_empty(lse_shape, dtype=torch.float32)
        torch.ops.bsattn.attention_out(*arguments, out, lse)
    return (out, lse) if return_lse else out
