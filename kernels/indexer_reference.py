"""PyTorch reference for the lightning indexer of CSA layers: scores and top-k selection.

``score[t, s] = sum_h w[t, h] * ReLU(q[t, h] . k[s]) * d**-0.5 * h_count**-0.5`` with ``q``
[B, T, h, d] (rotated), ``k`` [B, N, d] the indexer's compressed keys (rotated) and ``w`` [B, T, h]
the ``weights_proj`` output, all float32.

Top-k tie-breaking (:func:`select_topk`) is deterministic: entries are ranked by score, and among
exactly equal scores the **lower entry index (the older window) wins**. Entries a query may not see
(``visible`` False) are never selected, even when fewer than ``k`` are visible.
"""

from __future__ import annotations

import torch


def indexer_scores(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """q [B, T, h, d], keys [B, N, d], weights [B, T, h] -> scores [B, T, N]."""
    h, d = q.shape[-2], q.shape[-1]
    dots = torch.relu(torch.einsum("bthd,bnd->bthn", q.float(), keys.float()))
    return (dots * (weights.float() * (h ** -0.5 * d ** -0.5)).unsqueeze(-1)).sum(2)


def select_topk(scores: torch.Tensor, visible: torch.Tensor, k: int) -> torch.Tensor:
    """scores, visible [B, T, N] -> bool mask [B, T, N] of the (at most k) selected visible entries."""
    masked = scores.float().masked_fill(~visible, float("-inf"))
    order = torch.sort(masked, dim=-1, descending=True, stable=True).indices
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, torch.arange(order.shape[-1], device=order.device).expand_as(order))
    return (rank < k) & visible
