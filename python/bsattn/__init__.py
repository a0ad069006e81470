"""bsattn: block-sparse attention (C++/CUDA) for NumPy, PyTorch, CuPy and JAX tensors.

    import bsattn
    out = bsattn.attention(q, k, v, bsattn.adapters.from_block_mask(block_mask),
                           mask=bsattn.Mask(causal=True))

See docs/PYTHON.md. Errors raise `BsattnError` (a ValueError) with the library's message;
its ``argument`` attribute names the offending argument.
"""

from . import adapters, distributed, sparsity
from ._api import Plan, Summaries, attention, attention_backward, build_summaries, varlen_block_offsets
from ._bsattn import BsattnError, built_with_cuda
from ._merge import merge_state, merge_states
from ._select import select_blocks
from ._selected import SelectedAttention, selected_attention
from .adapters import from_block_mask, from_dense_block_mask, from_flash_attention, from_flashinfer_bsr
from .mask import Mask
from .sparsity import BSR, AllBlocks, Bitmask, BlockLists, Sparsity, VarlenBlockLists

__version__ = "0.1.0"

__all__ = [
    "AllBlocks", "BSR", "Bitmask", "BlockLists", "BsattnError", "Mask", "Plan", "Sparsity", "Summaries",
    "VarlenBlockLists", "adapters", "attention", "distributed",
    "attention_backward", "build_summaries", "built_with_cuda", "from_block_mask",
    "from_dense_block_mask", "from_flash_attention", "from_flashinfer_bsr", "merge_state", "merge_states",
    "SelectedAttention", "select_blocks", "selected_attention", "sparsity",
    "varlen_block_offsets",
]
