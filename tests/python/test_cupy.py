"""CuPy arrays on the GPU: read in place through DLPack, outputs returned as CuPy arrays, on
CuPy's current stream. Skipped without CuPy, a GPU, or a GPU build of bsattn."""

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

import bsattn  # noqa: E402
from conftest import assert_close, assert_lse_close, random_blocks, random_qkv, reference, reference_batched  # noqa: E402

pytestmark = pytest.mark.skipif(
    not bsattn.built_with_cuda or cupy.cuda.runtime.getDeviceCount() == 0, reason="needs a GPU build and a GPU"
)


def test_cupy_arrays(rng):
    q, k, v = random_qkv(rng, (2, 200, 4, 64), (2, 200, 2, 64), np.float16)
    dense = random_blocks(rng, (1, 2, 4, 4))
    sparsity = bsattn.from_dense_block_mask(cupy.asarray(dense), 64)
    cq, ck, cv = (cupy.asarray(x) for x in (q, k, v))
    out, lse = bsattn.attention(cq, ck, cv, sparsity, mask=bsattn.Mask(causal=True), return_lse=True)
    assert isinstance(out, cupy.ndarray) and out.dtype == cupy.float16 and lse.shape == (2, 4, 200)
    expected, expected_lse = reference_batched(
        *(x.astype(np.float64) for x in (q, k, v)), dense, None, (64, 64), reference.MaskSpec(causal=True)
    )
    assert_close(cupy.asnumpy(out), expected, "float16")
    assert_lse_close(cupy.asnumpy(lse), expected_lse)
