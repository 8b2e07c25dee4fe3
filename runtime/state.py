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


SPARE_MIN = 64  # entries a growing store makes room for at least


@dataclass
class CompressorState:
    """One compressor's state. The entries live in ``store`` [B, capacity, d], the first ``count`` of
    them valid (:attr:`entries`). With ``spare`` the store grows by a quarter when full, so emitting an
    entry copies O(1) of the old ones on average instead of all of them (a CSA compressor emits one every
    4 tokens; its decode consumers take the whole store: indexed attention and the indexer's
    ``n_valid``); without, the store is exactly ``count`` entries, contiguous (HCA: its attention reads
    every entry, and one emitted every 128 tokens costs little to append)."""

    pending_kv: torch.Tensor      # [B, <ratio, C]
    pending_gate: torch.Tensor    # [B, <ratio, C]
    store: torch.Tensor           # [B, capacity, d]
    count: int = 0
    spare: bool = False
    prev: tuple[torch.Tensor, torch.Tensor] | None = None  # CSA: Ca (kv, gate+ape) [B, ratio, d]

    @classmethod
    def empty(cls, batch: int, width: int, dim: int, device, dtype: torch.dtype = torch.float32,
              spare: bool = False) -> "CompressorState":
        """No pending tokens (float32: they are pooled) and no entries (``dtype``: the backend's state dtype)."""
        z = torch.zeros((batch, 0, width), dtype=torch.float32, device=device)
        return cls(z, z.clone(), torch.zeros((batch, 0, dim), dtype=dtype, device=device), spare=spare)

    @property
    def entries(self) -> torch.Tensor:
        """The emitted entries [B, count, d] (a view of ``store``)."""
        return self.store[:, :self.count]

    def append(self, new: torch.Tensor) -> None:
        """Add entries [B, n, d] (cast to the store's dtype)."""
        n = new.shape[1]
        need = self.count + n
        if need > self.store.shape[1]:
            cap = max(need, self.store.shape[1] * 5 // 4, SPARE_MIN) if self.spare else need
            grown = self.store.new_zeros((self.store.shape[0], cap, self.store.shape[2]))
            grown[:, :self.count] = self.entries
            self.store = grown
        self.store[:, self.count:need] = new
        self.count = need


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
