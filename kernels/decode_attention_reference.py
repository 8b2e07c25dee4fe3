"""PyTorch references for DeepSeek-V4 decode attention over (SWA ring + gathered compressed entries + sink).

Contract (shared with ``sm90_decode_attention.decode_attention``), one decoding token per request:

* ``q`` [B, H, D]: the query heads, already RMS-normalised and RoPE-rotated (D = 512);
* ``kv_window`` [B, W, D]: the sliding-window ring (W = 128 slots, the current token included);
  slots ``[0, window_len[b])`` are valid (a ring fills slots 0, 1, ... before it wraps, so a partly
  filled ring is a prefix; a full one has ``window_len = W``). Slot order does not matter to a softmax;
* ``window_len`` int [B];
* ``kv_compressed`` [B, N, D] or None: the compressed entries (CSA or HCA), already rotated;
* ``indices`` int [B, K] or None: entries of ``kv_compressed[b]`` attended to (CSA: the indexer's
  top-k; -1 = padding, anywhere). None with ``kv_compressed`` given means every one of the N entries
  (HCA); None with ``kv_compressed`` None means a window-only layer;
* ``sink`` float [H]: a per-head logit that joins the softmax denominator only;
* ``scale``: the logit scale (512**-0.5 in V4).

``out[b, h] = sum_s p[b, h, s] kv_s`` with ``p = exp(l_s) / (exp(sink_h) + sum_s' exp(l_s'))`` and
``l_s = scale * q[b, h] . kv_s`` over the valid entries; K = V (MQA, one vector per entry). The
inverse RoPE of the output is the caller's (``attention_reference.apply_rope(..., inverse=True)``).
An entry picked twice by ``indices`` counts twice (the kernel does the same).
"""

from __future__ import annotations

import torch

from .attention_reference import sink_attention


def gather_keys(kv_window: torch.Tensor, window_len: torch.Tensor, kv_compressed: torch.Tensor | None,
                indices: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The entries each request attends to, in kernel order: keys [B, W + K, D] and valid [B, W + K]."""
    b, w, d = kv_window.shape
    valid_w = torch.arange(w, device=kv_window.device)[None] < window_len.to(kv_window.device).long()[:, None]
    if kv_compressed is None:
        return kv_window, valid_w
    n = kv_compressed.shape[1]
    if indices is None:
        idx = torch.arange(n, device=kv_window.device).expand(b, n)
    else:
        idx = indices.long()
    valid_c = (idx >= 0) & (idx < n)
    safe = idx.clamp(0, max(n - 1, 0))
    gathered = torch.gather(kv_compressed, 1, safe.unsqueeze(-1).expand(-1, -1, d))
    return torch.cat((kv_window, gathered), dim=1), torch.cat((valid_w, valid_c), dim=1)


def decode_attention_reference(q: torch.Tensor, kv_window: torch.Tensor, window_len: torch.Tensor,
                               kv_compressed: torch.Tensor | None, indices: torch.Tensor | None,
                               sink: torch.Tensor, scale: float) -> torch.Tensor:
    """float32 [B, H, D] (all arithmetic in float32), through ``attention_reference.sink_attention``."""
    keys, valid = gather_keys(kv_window, window_len, kv_compressed, indices)
    return attend_gathered(q, keys, valid, sink, scale)


def attend_gathered(q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, sink: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """q [B, H, D] against its own keys [B, S, D] (``valid`` [B, S]) and the sink -> float32 [B, H, D], through
    ``attention_reference.sink_attention``."""
    bias = torch.zeros(valid.shape, dtype=torch.float32, device=q.device).masked_fill(~valid, float("-inf"))
    # invalid rows hold arbitrary bytes: zero them so that 0 * NaN cannot reach the output
    keys = keys.float().masked_fill(~valid.unsqueeze(-1), 0.0)
    return sink_attention(q.unsqueeze(1), keys, bias.unsqueeze(1), sink, scale)[:, 0]


def decode_attention_torch(q: torch.Tensor, kv_window: torch.Tensor, window_len: torch.Tensor,
                           kv_compressed: torch.Tensor | None, indices: torch.Tensor | None,
                           sink: torch.Tensor, scale: float) -> torch.Tensor:
    """The well-composed PyTorch baseline on the GPU: gather, BF16 ``bmm`` for the logits and for P V,
    float32 softmax with the sink column; returns BF16 [B, H, D] (the benchmark's torch anchor)."""
    keys, valid = gather_keys(kv_window, window_len, kv_compressed, indices)
    logits = torch.bmm(q, keys.transpose(1, 2)).float() * scale              # [B, H, S]
    logits = logits.masked_fill(~valid.unsqueeze(1), float("-inf"))
    sinks = sink.float().view(1, -1, 1).expand(q.shape[0], -1, 1)
    probs = torch.softmax(torch.cat((logits, sinks), dim=-1), dim=-1)[..., :-1]
    return torch.bmm(probs.to(keys.dtype), keys.masked_fill(~valid.unsqueeze(-1), 0))
