"""PyTorch reference for DeepSeek-V4 attention pieces: interleaved RoPE and sink attention.

RoPE is interleaved (GPT-J): channel pairs ``(2i, 2i+1)`` of the *last* ``rd`` channels rotate by
``pos * inv_freq[i]``; the leading channels are untouched. ``inverse=True`` rotates by the negative
angle (used on the attention output, since K = V carries the key's rotation).

Sink attention is MQA with one shared K = V vector per position: ``q`` [B, T, H, D] against
``kv`` [B, S, D], logits scaled by ``scale``, plus an additive ``bias`` [B, T, S] (0 or -inf) that
encodes which keys each query sees (window, causality, indexer selection). A per-head sink logit
joins the softmax denominator only; all in float32. ``picked`` [B, T, K, D] adds keys of each query's own (the
CSA entries its indexer chose; ``picked_valid`` [B, T, K] False for padding): they join the same softmax, so a
query reads K of them instead of a mask row over every entry.
"""

from __future__ import annotations

import torch


def rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [...] (int) -> (cos, sin) [..., rd/2] in float32."""
    angles = positions.float().unsqueeze(-1) * inv_freq.float().to(positions.device)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, inverse: bool = False) -> torch.Tensor:
    """Rotate the last ``2*cos.shape[-1]`` channels of ``x`` [..., D] pairwise; ``cos``/``sin`` broadcast over x[..., 0].
    Returns a new float32 tensor (:func:`apply_rope_` rotates a float32 tensor in place)."""
    return apply_rope_(x.clone() if x.dtype == torch.float32 else x.float(), cos, sin, inverse=inverse)


def apply_rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, inverse: bool = False) -> torch.Tensor:
    """:func:`apply_rope` in place on a float32 ``x`` (returned), for callers that own it: :func:`rotate_` by
    :func:`rope_turn`."""
    return rotate_(x, rope_turn(cos, sin, inverse=inverse))


def rope_turn(cos: torch.Tensor, sin: torch.Tensor, *, inverse: bool = False) -> torch.Tensor:
    """The rotation of each pair as one complex number, ``cos + i sin`` (``cos - i sin``: ``inverse``), complex64."""
    return torch.complex(cos.float(), -sin.float() if inverse else sin.float())


def rotate_(x: torch.Tensor, turn: torch.Tensor) -> torch.Tensor:
    """Rotate the last ``2 * turn.shape[-1]`` channels of a float32 ``x`` in place (returned) by :func:`rope_turn`'s
    ``turn`` (broadcast over x's pairs).

    Each pair ``(a, b)`` is the complex number ``a + ib`` times the turn (``a cos - b sin, a sin + b cos``): one
    complex multiply of the rotated channels alone, where the float form is six multiplies and adds, a stack and a
    concatenation of the whole row, each a launch on the GPU."""
    if x.dtype != torch.float32:
        raise TypeError(f"RoPE rotates float32 in place, got {x.dtype}")
    rd = 2 * turn.shape[-1]
    pairs = x[..., -rd:].unflatten(-1, (-1, 2))
    if pairs.stride(-1) == 1 and pairs.storage_offset() % 2 == 0 and all(st % 2 == 0 for st in pairs.stride()[:-1]):
        torch.view_as_complex(pairs).mul_(turn)      # a complex view of x's own pairs
    else:                                            # pairs no complex view can take: rotate a copy, write it back
        pairs.copy_(torch.view_as_real(torch.view_as_complex(pairs.contiguous()) * turn))
    return x


def sink_attention(q: torch.Tensor, kv: torch.Tensor, bias: torch.Tensor, sink: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """q [B, T, H, D], kv [B, S, D], bias [B, T, S], sink [H] -> out [B, T, H, D] (float32)."""
    return sink_attention_picked(q, kv, bias, None, None, sink, scale)


def sink_attention_picked(q: torch.Tensor, kv: torch.Tensor, bias: torch.Tensor, picked: torch.Tensor | None,
                          picked_valid: torch.Tensor | None, sink: torch.Tensor, scale: float) -> torch.Tensor:
    """:func:`sink_attention` plus each query's own keys ``picked`` [B, T, K, D] (``picked_valid`` [B, T, K]);
    None: none. -> out [B, T, H, D] (float32)."""
    logits = torch.einsum("bthd,bsd->bths", q.float(), kv.float()) * scale + bias.float().unsqueeze(2)
    parts = [logits]
    if picked is not None:
        own = torch.einsum("bthd,btkd->bthk", q.float(), picked.float()) * scale
        parts.append(own.masked_fill(~picked_valid.unsqueeze(2), float("-inf")))
    parts.append(sink.float().view(1, 1, -1, 1).expand(*logits.shape[:3], 1))
    full = torch.cat(parts, dim=-1)
    probs = torch.softmax(full - full.amax(-1, keepdim=True), dim=-1)
    s = kv.shape[1]
    out = torch.einsum("bths,bsd->bthd", probs[..., :s], kv.float())
    if picked is not None:
        out = out + torch.einsum("bthk,btkd->bthd", probs[..., s:-1], picked.float())
    return out
