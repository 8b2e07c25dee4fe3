"""PyTorch reference for DeepSeek-V4 MoE routing: score-based top-k and hash routing.

Scores are ``sqrt(softplus(x @ gate.T))`` (``sqrtsoftplus``; ``sigmoid`` and ``softmax`` are
accepted too) in float32. Score routing picks the top-k of ``scores + bias`` (the bias only
selects); hash routing takes the experts from ``tid2eid[token_id]``. Either way the weights are the
selected *scores* renormalised to sum 1 (``+1e-20``) times ``routed_scaling_factor``.

Repeated experts in a ``tid2eid`` row (never in released checkpoints) count **once**, as in the
official reference: the later duplicates get weight 0 (transformers would count them twice).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def router_scores(logits: torch.Tensor, func: str = "sqrtsoftplus") -> torch.Tensor:
    logits = logits.float()
    if func == "sqrtsoftplus":
        return torch.sqrt(F.softplus(logits))
    if func == "sigmoid":
        return torch.sigmoid(logits)
    if func == "softmax":
        return torch.softmax(logits, dim=-1)
    raise ValueError(f"unknown scoring_func {func!r}")


def _weights(scores: torch.Tensor, ids: torch.Tensor, scaling: float) -> torch.Tensor:
    w = scores.gather(-1, ids)
    return w / (w.sum(-1, keepdim=True) + 1e-20) * scaling


def route_topk(scores: torch.Tensor, bias: torch.Tensor | None, k: int, scaling: float
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """scores [T, E] -> (ids [T, k] int64, weights [T, k] float32)."""
    choice = scores if bias is None else scores + bias.float()
    ids = torch.topk(choice, k, dim=-1).indices
    return ids, _weights(scores, ids, scaling)


def route_hash(scores: torch.Tensor, tid2eid: torch.Tensor, token_ids: torch.Tensor, scaling: float
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """scores [T, E], tid2eid [V, k], token_ids [T] -> (ids [T, k], weights [T, k]); duplicates count once."""
    ids = tid2eid[token_ids.long()].long()
    weights = _weights(scores, ids, scaling)
    earlier = (ids.unsqueeze(-1) == ids.unsqueeze(-2)).tril(-1).any(-1)  # [T, k]: same id at a lower slot
    return ids, weights.masked_fill(earlier, 0.0)
