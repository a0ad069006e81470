"""SelectedAttention / selected_attention(): summaries -> select -> attend in one call (issue 11.4).

The C++ ``bsattn::SelectedAttention`` owns the summaries, the selection bitmask and the attention
plan; one run enqueues `build_summaries`, `select_blocks` and the attention on one stream. The
problem is described exactly as `attention` describes it (dense block geometry, the token mask,
the layouts), the selection options exactly as `select_blocks` takes them.
"""

import collections
import threading

from . import _api, _bsattn, _select, _tensors
from .mask import Mask
from .sparsity import AllBlocks

_MAX_CACHED = 32  # selected_attention's objects, least recently used dropped first
_cached = collections.OrderedDict()  # (problem, options) -> (native object, lock)
_cached_lock = threading.Lock()


def _describe(q, k, v, block_size, *, top_k=None, tau=None, mass=None, sinks=0, local=0, diagonal=True,
              causal=False, alignment="bottom_right", heads="q", proxy=False, mask=None, scale=None, out_dtype=None,
              cu_seqlens_q=None, cu_seqlens_k=None, seqused_k=None, max_seqlen_q=None, max_seqlen_k=None,
              block_table=None, seq_lens_kv=None, validate=True, num_threads=0):
    """(problem, inputs, options): the C++ Problem fields, the extension's inputs, the selection."""
    options = _select._policy(top_k, tau, mass)
    options.update(sinks=int(sinks), local=int(local), diagonal=bool(diagonal), causal=bool(causal),
                   alignment=_select._choice("alignment", alignment, ("bottom_right", "top_left")),
                   heads=_select._choice("heads", heads, ("q", "kv")))
    mask = Mask(causal=causal, alignment=alignment) if mask is None else mask
    slots, flat = _api._flatten(
        AllBlocks(block_size), mask, None, scale=scale, out_dtype=out_dtype, return_lse=False, validate=validate,
        num_threads=num_threads, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k, seqused_k=seqused_k, block_table=block_table, seq_lens_kv=seq_lens_kv)
    problem, inputs = _api._describe(q, k, v, slots, flat)
    problem["proxy"] = "eligible" if proxy else "off"
    return problem, inputs, options


def _first_difference(planned, problem):
    for field, value in problem.items():
        if planned.get(field) != value:
            return field, value, planned.get(field)
    return None


class SelectedAttention:
    """Attention that picks its own blocks, planned once (C++ ``bsattn::SelectedAttention``).

    ``SelectedAttention(q, k, v, block_size, *, top_k=None, tau=None, mass=None, sinks=0, local=0,
    diagonal=True, causal=False, alignment="bottom_right", heads="q", proxy=False, mask=None,
    **keywords of attention)`` allocates the K/V summaries ``[B, nKB, Hkv, D]``, the bitmask and
    the attention plan once. A call ``sa(q, k, v, *, return_lse=False, out=None, lse=None,
    stream=None, **kwargs)`` enqueues on one stream: `build_summaries` of k, v; `select_blocks`
    from q and the K summaries (exactly one of ``top_k``, ``tau``, ``mass``; forced ``diagonal``,
    ``sinks``, ``local`` blocks; per query or KV head); attention over the selected blocks, plus
    with ``proxy=True`` one summary term per unselected block the mask keeps whole (SPEC §6).

    ``causal`` / ``alignment`` apply to the selection and, unless ``mask`` is given, to the token
    mask (``Mask(causal=causal, alignment=alignment)``). A call reuses every argument it does not
    repeat; tensors (values and addresses) may change, shapes and options may not (BsattnError
    names the field). ``validate=False`` makes no host synchronisation on a GPU: the call can be
    captured in a CUDA graph, and a replay selects again from the values then in q, k, v. Calls
    share the object's buffers: do not run one object on two streams at once.
    """

    def __init__(self, q, k, v, block_size, **kwargs):
        self._block_size = block_size
        self._arguments = kwargs
        self._problem, _, self._options = _describe(q, k, v, block_size, **kwargs)
        with _tensors.device_guard(q):
            self._native = _bsattn.SelectedAttention(self._problem, self._options)
        self._lock = threading.Lock()

    @property
    def problem(self):
        """The C++ Problem fields (before the object sets the bitmask format and sparsity heads)."""
        return dict(self._problem)

    @property
    def options(self):
        return dict(self._options)

    @property
    def workspace_bytes(self):
        """Summaries and bitmask plus the attention plan's workspace."""
        return self._native.workspace_bytes

    def __call__(self, q, k, v, *, return_lse=False, out=None, lse=None, stream=None, **kwargs):
        arguments = dict(self._arguments, **kwargs) if kwargs else self._arguments
        problem, inputs, options = _describe(q, k, v, self._block_size, **arguments)
        different = _first_difference(self._problem, problem) or _first_difference(
            {f"options.{n}": x for n, x in self._options.items()}, {f"options.{n}": x for n, x in options.items()})
        if different:
            field, value, planned = different
            name = field if field.startswith("options.") else f"problem.{field}"
            raise _tensors.fail(name, f"{value!r} differs from the planned {planned!r}; make a new SelectedAttention "
                                "for another problem")
        with self._lock:
            return _api._run(self._native.run, q, problem, inputs, return_lse, out, lse, stream)

    run = __call__


def _cached_native(q, problem, options):
    key = (tuple(sorted(problem.items())), tuple(sorted(options.items())))
    with _cached_lock:
        entry = _cached.pop(key, None)
        if entry is None:
            with _tensors.device_guard(q):
                entry = (_bsattn.SelectedAttention(problem, options), threading.Lock())
        _cached[key] = entry
        while len(_cached) > _MAX_CACHED:
            _cached.popitem(last=False)
    return entry


def selected_attention(q, k, v, block_size, *, return_lse=False, out=None, lse=None, stream=None, **kwargs):
    """Summaries, block selection and attention in one call (see `SelectedAttention` for the
    arguments), on the framework's current stream or ``stream``. The object behind a call is
    cached per problem and options (at most 32), as `attention` caches its plans, so repeated
    calls allocate nothing on the device; calls of one problem share its buffers and must not run
    concurrently on different streams. Returns ``out`` or ``(out, lse)`` like `attention`."""
    problem, inputs, options = _describe(q, k, v, block_size, **kwargs)
    native, lock = _cached_native(q, problem, options)
    with lock:
        return _api._run(native.run, q, problem, inputs, return_lse, out, lse, stream)
