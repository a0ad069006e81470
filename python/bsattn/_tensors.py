"""Framework-neutral tensor helpers: device, dtype, allocation, DLPack export.

bsattn reads every tensor through DLPack. This module is the only place that knows which array
library a tensor comes from (NumPy, PyTorch, CuPy, JAX); everything else duck-types through it.
"""

import contextlib

import numpy as np

from ._bsattn import BsattnError

# DLPack device types (dlpack.h).
_DL_CPU, _DL_CUDA = 1, 2

_DTYPE_NAMES = {"float32": "f32", "float16": "f16", "bfloat16": "bf16", "int32": "i32", "uint32": "u32"}
_NUMPY_DTYPES = {"f32": np.float32, "f16": np.float16, "i32": np.int32, "u32": np.uint32}


def fail(argument, message):
    """A BsattnError formatted like the library's own: 'bsattn: <argument>: <message>'."""
    error = BsattnError(f"bsattn: {argument}: {message}")
    error.argument = argument
    return error


def framework(t):
    module = type(t).__module__
    for name in ("numpy", "torch", "cupy"):
        if module == name or module.startswith(name + "."):
            return name
    if module.startswith(("jax", "jaxlib")):
        return "jax"
    return "other"


def is_torch(t):
    module = type(t).__module__  # framework(), checked first for the common case
    return module == "torch" or module.startswith("torch.")


def device_of(t):
    """('cpu' | 'cuda', index) of a tensor."""
    if is_torch(t):
        if t.device.type == "cuda":
            return "cuda", t.device.index if t.device.index is not None else 0
        return t.device.type, 0
    kind, index = t.__dlpack_device__() if hasattr(t, "__dlpack_device__") else (_DL_CPU, 0)
    return {_DL_CPU: "cpu", _DL_CUDA: "cuda"}.get(int(kind), f"dlpack-device-{int(kind)}"), int(index)


def dtype_name(t):
    """'f32', 'f16', 'bf16', 'i32', 'u32', or the library's own name of an unsupported dtype."""
    name = str(t.dtype).rsplit(".", 1)[-1]
    return _DTYPE_NAMES.get(name, name)


def dtype_label(dtype):
    """An output dtype given as 'f32' / 'f16' / 'bf16', or as a NumPy, ml_dtypes or PyTorch
    dtype, as the library's name; None gives '' (the input dtype)."""
    if dtype is None:
        return ""
    if dtype in ("f32", "f16", "bf16"):
        return dtype
    name = _DTYPE_NAMES.get(str(np.dtype(dtype) if isinstance(dtype, type) else dtype).rsplit(".", 1)[-1])
    if name not in ("f32", "f16", "bf16"):
        raise fail("out_dtype", f"expected float32, float16 or bfloat16, got {dtype}")
    return name


def shape_of(t):
    return tuple(int(s) for s in t.shape)


def export(t, reinterpret=None):
    """The object handed to the extension for tensor `t`.

    PyTorch tensors go as DLPack capsules taken with stream=-1 (no synchronisation, so the call
    is capturable in a CUDA graph) from a detached view (so tensors requiring grad are accepted).
    NumPy bfloat16 (ml_dtypes) has no DLPack type: it travels as uint16 marked 'bf16'.
    `reinterpret` marks other same-size reinterpretations (int32 bit words as 'u32').
    """
    if is_torch(t):
        exported = t.detach().__dlpack__(stream=-1)
    elif framework(t) == "numpy" and dtype_name(t) == "bf16":
        exported, reinterpret = t.view(np.uint16), "bf16"
    else:
        exported = t
    return exported if reinterpret is None else (exported, reinterpret)


def _numpy_dtype(name):
    if name == "bf16":
        try:
            import ml_dtypes
        except ImportError as e:
            raise fail("dtype", "bfloat16 NumPy arrays need the ml_dtypes package") from e
        return ml_dtypes.bfloat16
    return _NUMPY_DTYPES[name]


def empty(like, shape, dtype):
    """An uninitialised tensor of `shape` and bsattn dtype name on `like`'s framework and device.

    JAX arrays are immutable: JAX callers get NumPy storage here and `finish` converts it back.
    """
    kind = framework(like)
    if kind == "torch":
        import torch

        torch_dtype = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16, "i32": torch.int32}[dtype]
        return torch.empty(shape, dtype=torch_dtype, device=like.device)
    if kind == "cupy":
        import cupy

        with cupy.cuda.Device(device_of(like)[1]):
            return cupy.empty(shape, dtype=_numpy_dtype(dtype))
    if device_of(like)[0] != "cpu":
        raise fail("q", f"cannot allocate outputs for a {kind} tensor on {device_of(like)[0]}; pass out= and lse=")
    return np.empty(shape, dtype=_numpy_dtype(dtype))


def finish(like, result):
    """Outputs in the caller's framework (JAX gets its arrays back)."""
    if framework(like) == "jax" and result is not None:
        import jax.numpy as jnp

        return jnp.asarray(result)
    return result


def to_int32(t):
    """An integer tensor as int32 (NumPy's default integers are int64); other tensors unchanged."""
    if t is None or dtype_name(t) in ("i32", "u32"):
        return t
    if is_torch(t):
        import torch

        if t.dtype.is_floating_point or t.dtype == torch.bool:
            return t
        return t.to(torch.int32)
    kind = getattr(t.dtype, "kind", None)
    return t.astype(np.int32) if kind in ("i", "u") else t


def host_ints(t):
    """The values of a small integer tensor as a NumPy array, or None for a device tensor whose
    read would synchronise (callers then fall back to an upper bound)."""
    if device_of(t)[0] != "cpu":
        return None
    if is_torch(t):
        return t.detach().numpy()
    return np.asarray(t)


def device_guard(t):
    """A context that makes `t`'s GPU the current one (plans allocate and launch there)."""
    if device_of(t)[0] != "cuda":
        return contextlib.nullcontext()
    kind = framework(t)
    if kind == "torch":
        import torch

        return torch.cuda.device(t.device)
    if kind == "cupy":
        import cupy

        return cupy.cuda.Device(device_of(t)[1])
    return contextlib.nullcontext()


def current_stream(t):
    """The stream a call on `t`'s device runs on: the framework's current stream, 0 on the CPU."""
    if device_of(t)[0] != "cuda":
        return 0
    kind = framework(t)
    if kind == "torch":
        import torch

        return torch.cuda.current_stream(t.device).cuda_stream
    if kind == "cupy":
        import cupy

        return cupy.cuda.get_current_stream().ptr
    return 0
