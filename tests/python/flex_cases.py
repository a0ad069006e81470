"""FlexAttention comparison cases: each builds q, k, v ([B, H, S, D], FlexAttention's layout), a
BlockMask from a mask_mod, and the bsattn.Mask equivalent to that mask_mod. The CPU tests run
them in float32, the GPU tests in bfloat16."""

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import bsattn

CASES = ("causal", "sliding_window", "document", "random_blocks", "gqa")


def make_case(name, device, dtype, batch=2, seqlen=300, heads=4, head_dim=64, block_size=(128, 128)):
    """(q, k, v, block_mask, bsattn_mask)."""
    generator = torch.Generator().manual_seed(CASES.index(name))
    heads_kv = 2 if name == "gqa" else heads
    bq, bk = block_size

    def randn(h):
        return torch.randn(batch, h, seqlen, head_dim, generator=generator).to(device=device, dtype=dtype)

    q, k, v = randn(heads), randn(heads_kv), randn(heads_kv)
    mask_batch, mask_heads = None, None
    if name in ("causal", "gqa"):
        def mask_mod(b, h, qi, kv):
            return qi >= kv
        mask = bsattn.Mask(causal=True)
    elif name == "sliding_window":
        window = 100

        def mask_mod(b, h, qi, kv):
            return (qi >= kv) & (qi - kv <= window)
        mask = bsattn.Mask(causal=True, window=(window, 0))
    elif name == "document":
        lengths = torch.randint(1, seqlen, (batch, 3), generator=generator)
        doc = torch.stack([torch.bucketize(torch.arange(seqlen), row.sort().values, right=True) for row in lengths])
        doc = doc.to(device=device, dtype=torch.int32)
        mask_batch = batch

        def mask_mod(b, h, qi, kv):
            return (doc[b, qi] == doc[b, kv]) & (qi >= kv)
        mask = bsattn.Mask(causal=True, doc_ids=(doc, doc))
    elif name == "random_blocks":
        table = torch.rand(batch, heads, -(-seqlen // bq), -(-seqlen // bk), generator=generator) < 0.5
        table[..., 0] = True  # every row attends something
        table = table.to(device)
        mask_batch, mask_heads = batch, heads

        def mask_mod(b, h, qi, kv):
            return table[b, h, qi // bq, kv // bk]
        mask = None
    else:
        raise ValueError(name)
    block_mask = create_block_mask(mask_mod, mask_batch, mask_heads, seqlen, seqlen, device=device,
                                   BLOCK_SIZE=block_size)
    return q, k, v, block_mask, mask


def flex_reference(q, k, v, block_mask):
    return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=q.shape[1] != k.shape[1])


def bsattn_on_flex_layout(q, k, v, block_mask, mask, **kwargs):
    """bsattn on FlexAttention's [B, H, S, D] tensors (transposed views, no copy)."""
    result = bsattn.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                              bsattn.from_block_mask(block_mask), mask=mask, **kwargs)
    if isinstance(result, tuple):
        return result[0].transpose(1, 2), result[1]
    return result.transpose(1, 2)
