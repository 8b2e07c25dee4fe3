"""Order keys of the lightning indexer's scores, and the torch ops that make and read them.

Every score becomes an int64 key, its order-preserving bits above the complemented entry index
(:func:`ordered_key`, inverse :func:`scores_of_key`), so one ``topk`` on the keys picks the best and,
among equal scores, the **lower index** (the reference's rule, ``indexer_reference.select_topk``) whatever
``topk``'s own tie order. The Hopper kernels (``sm90_indexer``) write and read the same keys; the torch
compositions here serve every other shape and device.
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


def _mono(bits: torch.Tensor) -> torch.Tensor:
    """IEEE float32 bits (as signed ints) -> ints in the floats' order (an involution on the negatives)."""
    return torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


MONO_NEG_INF = -0x800000 ^ 0x7FFFFFFF     # _mono of -inf's bits (0xFF800000): the key of a hidden entry


LOW_WORD = 0xFFFFFFFF


def ordered_key(scores: torch.Tensor) -> torch.Tensor:
    """float32 scores [..., N] -> int64 keys in the scores' order, ties broken towards the lower index:
    the score's ordered bits above the complemented entry index ``0xFFFFFFFF - n`` (independent of N, so
    keys of different lists compare as they are; inverse: :func:`scores_of_key`)."""
    n = scores.shape[-1]
    rev = LOW_WORD - torch.arange(n, device=scores.device, dtype=torch.int64)
    return (_mono(scores.contiguous().view(torch.int32).long()) << 32) | rev


def scores_of_key(key: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`ordered_key`: int64 keys [..., N] -> the float32 scores."""
    return _mono(key >> 32).to(torch.int32).view(torch.float32)


def indexer_scores_torch(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor,
                         n_valid: torch.Tensor | None = None) -> torch.Tensor:
    """The scores by torch ops: float32 [B, N], -inf beyond ``n_valid``."""
    h, d = q.shape[1], q.shape[2]
    n = keys.shape[1]
    dots = _bmm_f32(q, keys.transpose(1, 2)).relu_()                         # [B, h, N]
    w = (weights.float() * (h ** -0.5 * d ** -0.5)).unsqueeze(1)               # [B, 1, h]
    scores = torch.bmm(w, dots).squeeze(1) + 0.0                               # [B, N]; -0.0 -> +0.0
    if n_valid is not None:
        visible = torch.arange(n, device=q.device)[None] < n_valid.to(q.device).long()[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
    return scores


def indexer_keys_torch(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor,
                       n_valid: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, h, d], keys [B, N, d], weights f32 [B, h], n_valid int [B] (None: all N) -> int64 [B, N]
    :func:`ordered_key` of the scores (-inf beyond ``n_valid``), by torch ops."""
    return ordered_key(indexer_scores_torch(q, keys, weights, n_valid))


def topk_of_keys_torch(key: torch.Tensor, k: int) -> torch.Tensor:
    """:func:`topk_of_keys` by ``torch.topk`` (any size, any device)."""
    b, n = key.shape
    kk = min(k, n)
    top = torch.topk(key, kk, dim=-1)
    idx = torch.where((top.values >> 32) <= MONO_NEG_INF, -1, top.indices).to(torch.int32)
    if kk < k:
        idx = torch.cat((idx, torch.full((b, k - kk), -1, dtype=torch.int32, device=key.device)), dim=1)
    return idx
