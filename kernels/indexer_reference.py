"""PyTorch reference for the lightning indexer of CSA layers: scores and top-k selection.

``score[t, s] = sum_h w[t, h] * ReLU(q[t, h] . k[s]) * d**-0.5 * h_count**-0.5`` with ``q``
[B, T, h, d] (rotated), ``k`` [B, N, d] the indexer's compressed keys (rotated) and ``w`` [B, T, h]
the ``weights_proj`` output, all float32.

Top-k tie-breaking (:func:`select_topk`) is deterministic: entries are ranked by score, and among
exactly equal scores the **lower entry index (the older window) wins**. Entries a query may not see
(``visible`` False) are never selected, even when fewer than ``k`` are visible.

:func:`topk_in_blocks` picks the same entries block by block of keys, keeping a running top-k, so that a long
context never holds a [T, h, N] score tensor (N up to max_context / 4 entries).
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


def topk_in_blocks(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor, n_visible: torch.Tensor, k: int,
                   block: int) -> torch.Tensor:
    """q [B, T, h, d], keys [B, N, d], weights [B, T, h], n_visible int [T] or [B, T] (query t of row b sees
    entries < n_visible[b, t]) -> int64 [B, T, k] entry indices, best first (ties: lower index), -1 past the
    visible entries. The entries :func:`select_topk` picks, scored ``block`` keys at a time: the largest temporary
    is [B, T, h, block]."""
    b, t = q.shape[:2]
    n_visible = n_visible.to(q.device).expand(b, t)[..., None]
    best = q.new_full((b, t, 0), float("-inf"), dtype=torch.float32)
    best_idx = torch.empty(b, t, 0, dtype=torch.long, device=q.device)
    for start in range(0, keys.shape[1], block):
        idx = torch.arange(start, min(start + block, keys.shape[1]), device=q.device)
        scores = indexer_scores(q, keys[:, start:start + block], weights)
        scores = scores.masked_fill(idx[None, None] >= n_visible, float("-inf"))
        # the kept ones come first and hold lower indices; a stable sort keeps lower indices first among ties
        merged = torch.cat((best, scores), dim=-1)
        order = torch.sort(merged, dim=-1, descending=True, stable=True).indices[..., :k]
        best = merged.gather(-1, order)
        best_idx = torch.cat((best_idx, idx.expand(b, t, -1)), dim=-1).gather(-1, order)
    picked = torch.where(best > float("-inf"), best_idx, -1)
    if picked.shape[-1] < k:
        picked = torch.cat((picked, picked.new_full((b, t, k - picked.shape[-1]), -1)), dim=-1)
    return picked
