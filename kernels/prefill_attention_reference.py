"""PyTorch reference for DeepSeek-V4 attention of prefill chunks, every query token a request of its own.

Contract (shared with ``sm90_decode_attention.sm90_prefill_attention``). A chunk of T tokens of each of S sequences
makes R = S * T requests; request r belongs to sequence ``s = r // T`` and reads that sequence's keys in place:

* ``q`` [R, H, D]: the query heads, RMS-normalised and RoPE-rotated (D = 512);
* ``rows`` [S, L, D]: each sequence's window keys, its past window rows then the chunk's rows (rotated);
* ``window_start``, ``window_len`` int [R]: request r's window is ``rows[s, window_start[r] : window_start[r] +
  window_len[r]]`` (its own row included); rows outside ``[0, L)`` are masked;
* ``kv_compressed`` [S, N, D] or None: the sequence's compressed entries (CSA or HCA), rotated;
* ``indices`` int [R, K] or None: CSA, the entries of ``kv_compressed[s]`` request r attends to (its top-k; -1 =
  padding, anywhere; an entry picked twice counts twice);
* ``count`` int [R] or None: HCA (``indices`` None), request r attends to entries ``[0, count[r])`` of
  ``kv_compressed[s]``; None as well: all N;
* ``sink`` float [H], ``scale``: as in decode.

Request r's output is :func:`decode_attention_reference`'s for its own list (its window's keys, then its entries):
``out[r, h] = sum_s p[r, h, s] kv_s``, ``p = exp(l_s) / (exp(sink_h) + sum_s' exp(l_s'))``, ``l_s = scale * q[r, h] .
kv_s``. :func:`chunk_windows` gives the windows of the layout the runtime's chunks have (past rows, then the chunk).
"""

from __future__ import annotations

import torch

from .decode_attention_reference import attend_gathered

ROWS_PER_BLOCK = 1 << 18   # gathered key rows per block of requests in the reference: bounds its temporaries


def chunk_windows(past: int, tokens: int, window: int, sequences: int = 1,
                  device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(window_start, window_len) int32 [S * T] of ``sequences`` chunks of ``tokens`` tokens whose rows are ``past``
    past rows then the chunk's: token t (row ``past + t``) sees the last ``window`` rows up to its own, those there
    are (``past`` < ``window`` rows: the start of a sequence, or a ring that holds ``window - 1`` past keys)."""
    row = past + torch.arange(tokens, dtype=torch.int64, device=device)
    start = (row + 1 - window).clamp(min=0)
    return (start.to(torch.int32).repeat(sequences), (row + 1 - start).to(torch.int32).repeat(sequences))


def gather_requests(rows: torch.Tensor, window_start: torch.Tensor, window_len: torch.Tensor,
                    kv_compressed: torch.Tensor | None, indices: torch.Tensor | None,
                    count: torch.Tensor | None, requests: slice, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys [b, Wmax + K, D] and valid [b, Wmax + K] of ``requests`` (b of them; T = ``tokens`` per sequence):
    each one's window (Wmax: the longest window of all requests), then its entries (K: the indices', or N)."""
    dev = rows.device
    r = torch.arange(window_start.shape[0], device=dev)[requests]
    seq = r // tokens
    s, length, _ = rows.shape
    w = max(int(window_len.max()), 0) if window_len.numel() else 0
    slot = torch.arange(w, device=dev)[None]
    start, wlen = window_start.to(dev).long()[requests, None], window_len.to(dev).long()[requests, None]
    row = start + slot
    valid = (slot < wlen) & (row >= 0) & (row < length)
    keys = rows[seq[:, None], row.clamp(0, max(length - 1, 0))]
    if kv_compressed is None:
        return keys, valid
    n = kv_compressed.shape[1]
    if indices is not None:
        idx = indices.to(dev).long()[requests]
    else:
        idx = torch.arange(n, device=dev).expand(len(r), n)
        if count is not None:
            idx = torch.where(idx < count.to(dev).long()[requests, None], idx, -1)
    picked = kv_compressed[seq[:, None], idx.clamp(0, max(n - 1, 0))]
    return torch.cat((keys, picked), dim=1), torch.cat((valid, (idx >= 0) & (idx < n)), dim=1)


def prefill_attention_reference(q: torch.Tensor, rows: torch.Tensor, window_start: torch.Tensor,
                                window_len: torch.Tensor, kv_compressed: torch.Tensor | None,
                                indices: torch.Tensor | None, sink: torch.Tensor, scale: float,
                                count: torch.Tensor | None = None) -> torch.Tensor:
    """float32 [R, H, D] (all arithmetic in float32): each request's keys gathered (:func:`gather_requests`) and
    attended through ``decode_attention_reference.attend_gathered``, in blocks of requests."""
    r = q.shape[0]
    tokens = r // rows.shape[0]
    width = (int(window_len.max()) if r else 0) + (0 if kv_compressed is None else
                                                  indices.shape[1] if indices is not None else kv_compressed.shape[1])
    block = max(1, ROWS_PER_BLOCK // max(width, 1))
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for r0 in range(0, r, block):
        part = slice(r0, min(r0 + block, r))
        keys, valid = gather_requests(rows, window_start, window_len, kv_compressed, indices, count, part, tokens)
        out[part] = attend_gathered(q[part], keys, valid, sink, scale)
    return out
