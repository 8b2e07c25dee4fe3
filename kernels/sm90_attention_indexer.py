"""Lightning-indexer top-k for CSA decode on the GPU, composed from torch ops (one query per request).

``score[b, n] = sum_h w[b, h] * ReLU(q[b, h] . k[b, n]) * h**-0.5 * d**-0.5`` over the visible entries
``n < n_valid[b]`` (contract of ``indexer_reference.indexer_scores`` / ``select_topk`` with T = 1),
then the ``k`` best entries as int32 indices, **-1 padding** where fewer than ``k`` are visible (the
operand ``decode_attention`` takes).

Composition: one BF16 ``bmm`` with float32 output for the head dots (``[B, h, N]``), ReLU in place,
one float32 ``bmm`` with the head weights, then ``topk`` on an int64 key that packs the score's
order-preserving bits above the reversed entry index, so equal scores pick the **lower index**
(the reference's rule) whatever ``topk``'s own tie order. No host sync; CUDA-graph capturable.
"""

from __future__ import annotations

import torch


def _bmm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """BF16 x BF16 -> float32 batched product (fp32 accumulate, no BF16 rounding of the result)."""
    if a.is_cuda:
        try:
            return torch.bmm(a, b, out_dtype=torch.float32)
        except (RuntimeError, TypeError):
            pass
    return torch.bmm(a.float(), b.float())


def ordered_key(scores: torch.Tensor) -> torch.Tensor:
    """float32 -> int64 key whose order is the scores' order, ties broken towards the lower index."""
    n = scores.shape[-1]
    bits = scores.contiguous().view(torch.int32).long()
    mono = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)      # IEEE order as signed ints
    rev = (n - 1) - torch.arange(n, device=scores.device, dtype=torch.int64)
    return (mono << 32) | rev


def indexer_topk(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor, k: int,
                 n_valid: torch.Tensor | None = None) -> torch.Tensor:
    """q bf16 [B, h, d] (rotated), keys bf16 [B, N, d] (rotated), weights f32 [B, h], n_valid int [B]
    (None: all N visible) -> int32 [B, k] entry indices, -1 where fewer than k are visible."""
    b, h, d = q.shape
    n = keys.shape[1]
    dots = _bmm_f32(q, keys.transpose(1, 2)).relu_()                         # [B, h, N]
    w = (weights.float() * (h ** -0.5 * d ** -0.5)).unsqueeze(1)               # [B, 1, h]
    scores = torch.bmm(w, dots).squeeze(1) + 0.0                               # [B, N]; -0.0 -> +0.0
    if n_valid is not None:
        visible = torch.arange(n, device=q.device)[None] < n_valid.to(q.device).long()[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
    kk = min(k, n)
    top = torch.topk(ordered_key(scores), kk, dim=-1).indices                 # [B, kk]
    picked = torch.gather(scores, 1, top)
    idx = torch.where(torch.isneginf(picked), torch.full_like(top, -1), top).to(torch.int32)
    if kk < k:
        idx = torch.cat((idx, torch.full((b, k - kk), -1, dtype=torch.int32, device=q.device)), dim=1)
    return idx
