"""The built-in token mask (SPEC §4), evaluated on partial blocks only."""

import numpy as np

from . import _tensors

_ALIGNMENTS = ("bottom_right", "top_left")


class Mask:
    """Terms combine by AND; sink tokens relax the window only::

        visible = causal_ok and (in_window or kv < sink_tokens) and same_document and kv_valid

    * ``causal``: ``kv <= diag(q)``. ``alignment`` places the diagonal: ``"bottom_right"``
      (``diag(q) = q + Skv - Sq``, FlashAttention's convention) or ``"top_left"`` (``q``).
      The window uses the same diagonal.
    * ``window=(left, right)``: ``diag(q) - left <= kv <= diag(q) + right``; ``None`` on a side
      (or for the whole window) means unlimited. Sliding-window causal attention is
      ``Mask(causal=True, window=(w, 0))``.
    * ``sink_tokens``: the first tokens stay visible whatever the window.
    * ``doc_ids=(doc_q, doc_kv)``: int32 per token (batched ``[B, S]``, varlen ``[total]``,
      paged ``doc_kv [B, C * page_size]``); a query sees only keys of its own document.
    * ``kv_valid``: uint32 (or int32) bit words ``[B, ceil(Skv / 32)]``, or booleans
      ``[B, Skv]`` (packed here); a cleared bit hides that key.
    """

    def __init__(self, causal=False, alignment="bottom_right", window=None, sink_tokens=0, doc_ids=None,
                 kv_valid=None):
        if alignment not in _ALIGNMENTS:
            raise _tensors.fail("mask.alignment", f"expected one of {_ALIGNMENTS}, got {alignment!r}")
        self.causal = bool(causal)
        self.alignment = alignment
        left, right = (None, None) if window is None else window
        self.window_left = -1 if left is None else int(left)
        self.window_right = -1 if right is None else int(right)
        self.sink_tokens = int(sink_tokens)
        if doc_ids is not None and len(doc_ids) != 2:
            raise _tensors.fail("mask.doc_ids", "expected (doc_q, doc_kv)")
        self.doc_q, self.doc_kv = (None, None) if doc_ids is None else map(_tensors.to_int32, doc_ids)
        if kv_valid is not None and _is_bool(kv_valid):
            kv_valid = _pack_bits(kv_valid)
        self.kv_valid = _tensors.to_int32(kv_valid)

    def options(self):
        return {"causal": self.causal, "alignment": self.alignment, "window_left": self.window_left,
                "window_right": self.window_right, "sink_tokens": self.sink_tokens}

    def slots(self):
        return {"doc_q": self.doc_q, "doc_kv": self.doc_kv, "kv_valid": self.kv_valid}

    def __repr__(self):
        window = (self.window_left, self.window_right)
        return (f"Mask(causal={self.causal}, alignment={self.alignment!r}, window={window}, "
                f"sink_tokens={self.sink_tokens}, doc_ids={self.doc_q is not None}, "
                f"kv_valid={self.kv_valid is not None})")


def _is_bool(t):
    return str(t.dtype).rsplit(".", 1)[-1] in ("bool", "bool_")


def _pack_bits(valid):
    """bool [B, S] -> 32-bit words [B, ceil(S / 32)], bit r of word w for token 32 w + r
    (int32 words for PyTorch, which has no general uint32)."""
    if _tensors.is_torch(valid):
        import torch

        pad = -valid.shape[-1] % 32
        bits = torch.nn.functional.pad(valid.to(torch.int64), (0, pad)).view(valid.shape[0], -1, 32)
        words = (bits << torch.arange(32, device=valid.device)).sum(-1)
        return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    valid = np.asarray(valid)
    bits = np.pad(valid, ((0, 0), (0, -valid.shape[-1] % 32)))
    return np.packbits(bits, axis=-1, bitorder="little").view("<u4").astype(np.uint32)


NO_MASK = Mask()
