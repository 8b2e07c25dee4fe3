"""PyTorch reference for the KV compressor of CSA/HCA layers (and the indexer's own compressor).

Each token projects to ``kv`` and ``gate`` of width ``C``; tokens are grouped into windows of
``ratio``; ``ape`` [ratio, C] is added to the gates by slot. One compressed entry per window is the
softmax(gate)-weighted sum of its slots' kv, taken per channel over the slot axis, in float32.

* HCA (``overlap=False``, C = d): the window's ``ratio`` slots.
* CSA (``overlap=True``, C = 2d): entry ``w`` pools ``2*ratio`` slots: the first half ``[:d]``
  ("Ca") of window ``w-1`` and the second half ``[d:]`` ("Cb") of window ``w``. For window 0 the
  previous Ca comes from ``prev`` (the last closed window of an earlier chunk) or, at the very
  start of a sequence, is absent (weight 0).

The caller RMS-normalises and rotates the pooled entries; this op only pools.
"""

from __future__ import annotations

import torch


def _slot_softmax(gate: torch.Tensor, last: bool) -> torch.Tensor:
    """Softmax over the slot axis (2) of [B, n, slots, C]; ``last``: computed over the last axis of the transposed
    tensor (the same values; on CUDA a copy and a fast last-axis softmax instead of a slow middle-axis one)."""
    if last:
        return torch.softmax(gate.transpose(2, 3), dim=-1).transpose(2, 3)
    return torch.softmax(gate, dim=2)


def compress_windows(kv: torch.Tensor, gate: torch.Tensor, ape: torch.Tensor, *, overlap: bool,
                     prev: tuple[torch.Tensor, torch.Tensor] | None = None, slot_softmax_last: bool = False,
                     ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """kv, gate [B, n, ratio, C] -> (pooled [B, n, d], the last window's (Ca kv, Ca gate+ape) or None).

    ``prev`` is the (kv, gate+ape) pair [B, ratio, d] of the window before the first one; ``slot_softmax_last``:
    see :func:`_slot_softmax`.
    """
    kv, gate = kv.float(), gate.float() + ape.float()
    if not overlap:
        return (kv * _slot_softmax(gate, slot_softmax_last)).sum(2), None
    d = kv.shape[-1] // 2
    b, n, r, _ = kv.shape
    prev_kv = kv.new_zeros((b, n, r, d))
    prev_gate = gate.new_full((b, n, r, d), float("-inf"))
    prev_kv[:, 1:], prev_gate[:, 1:] = kv[:, :-1, :, :d], gate[:, :-1, :, :d]
    if prev is not None:
        prev_kv[:, 0], prev_gate[:, 0] = prev[0].float(), prev[1].float()
    slots_kv = torch.cat((prev_kv, kv[..., d:]), dim=2)
    slots_gate = torch.cat((prev_gate, gate[..., d:]), dim=2)
    pooled = (slots_kv * _slot_softmax(slots_gate, slot_softmax_last)).sum(2)
    return pooled, (kv[:, -1, :, :d], gate[:, -1, :, :d])
