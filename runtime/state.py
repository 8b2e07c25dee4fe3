"""Decode state (KV cache) of a DeepSeek-V4 model, per layer.

* **SWA ring**: the last ``sliding_window`` K=V vectors, slot ``pos % window``.
* **Compressor state** (CSA/HCA layers, and the indexer's own compressor on CSA layers):
  projected ``kv``/``gate`` of the tokens since the last closed window (``pending_*``), the Ca
  half of the last closed window (CSA overlap, ``prev``), and every compressed entry emitted so
  far (``entries``, normalised and rotated; entry ``w`` covers tokens ``[w*ratio, (w+1)*ratio)``).

The ring and the entries are held in the backend's ``state_dtype`` (float32 for the references,
BF16 for the GPU kernels, which read BF16); pending projections and ``prev`` stay float32.
All sequences of a batch share one position (no padding).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class CompressorState:
    pending_kv: torch.Tensor      # [B, <ratio, C]
    pending_gate: torch.Tensor    # [B, <ratio, C]
    entries: torch.Tensor         # [B, N, d]
    prev: tuple[torch.Tensor, torch.Tensor] | None = None  # CSA: Ca (kv, gate+ape) [B, ratio, d]

    @classmethod
    def empty(cls, batch: int, width: int, dim: int, device, dtype: torch.dtype = torch.float32) -> "CompressorState":
        """No pending tokens (float32: they are pooled) and no entries (``dtype``: the backend's state dtype)."""
        z = torch.zeros((batch, 0, width), dtype=torch.float32, device=device)
        return cls(z, z.clone(), torch.zeros((batch, 0, dim), dtype=dtype, device=device))


@dataclass
class LayerState:
    window: torch.Tensor                  # [B, W, D] ring of K=V vectors
    compressor: CompressorState | None = None
    indexer: CompressorState | None = None


@dataclass
class DecodeState:
    """What :meth:`Model.step` carries between tokens; make one with :meth:`Model.new_state`."""

    batch: int
    position: int = 0
    layers: dict[int, LayerState] = field(default_factory=dict)
