"""JAX arrays on the CPU: read in place through DLPack, outputs returned as JAX arrays.
Skipped when JAX is not installed. Arrays are placed on JAX's CPU device explicitly: on a GPU
machine JAX's default device is the GPU."""

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

import bsattn  # noqa: E402
from conftest import assert_close, random_blocks, random_qkv, reference, reference_batched  # noqa: E402


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_jax_arrays(rng, dtype):
    q, k, v = random_qkv(rng, (2, 130, 4, 64), (2, 130, 2, 64))
    dense = random_blocks(rng, (1, 2, 3, 3))
    with jax.default_device(jax.devices("cpu")[0]):
        sparsity = bsattn.from_dense_block_mask(jnp.asarray(dense), 64)
        jq, jk, jv = (jnp.asarray(x, dtype=dtype) for x in (q, k, v))
    out, lse = bsattn.attention(jq, jk, jv, sparsity, mask=bsattn.Mask(causal=True), return_lse=True)
    assert isinstance(out, type(jq)) and out.dtype == jq.dtype and lse.shape == (2, 4, 130)
    inputs = (np.asarray(x.astype(jnp.float32)) for x in (jq, jk, jv))
    expected, _ = reference_batched(*inputs, dense, None, (64, 64), reference.MaskSpec(causal=True))
    assert_close(np.asarray(out.astype(jnp.float32)), expected, dtype)
