"""Decode state (KV cache) of a DeepSeek-V4 model: fixed-size, allocated once, one slot per sequence.

A :class:`DecodeState` is made for ``batch`` slots and ``max_context`` tokens per slot and never changes
shape or address afterwards, so a decode step is the same launches on the same memory every time (one
CUDA graph per state, ``runtime/decode_graphs.py``). Per layer:

* **SWA ring** ``window`` [B, W, D]: the K=V vector of position ``p`` in slot ``p % W``.
* **Compressor** (CSA/HCA layers) and, on CSA layers, the **indexer's compressor**:

  - ``pending_kv`` / ``pending_gate`` [B, ratio, C] float32: the projections of the open window's
    tokens, position ``p`` in slot ``p % ratio`` (they are pooled);
  - CSA only, ``prev_kv`` / ``prev_gate`` [B, ratio, d] float32: the first half ("Ca", gate with ``ape``)
    of the last closed window, which the next entry overlaps; the gate is -inf before the first window
    closes (weight 0);
  - ``store`` [B, max_context // ratio + 1, d]: entry ``w`` (tokens ``[w*ratio, (w+1)*ratio)``,
    normalised and rotated) in row ``w``; rows ``[0, positions // ratio)`` are valid. The last row is
    scratch: a decode step writes the open window's entry whether or not it closes (a masked write
    without a branch on the device), and only a closed one is ever read.

``positions`` [B] int64 on the device: the tokens each slot holds. Entry counts follow from it
(:meth:`DecodeState.counts`: ``positions // ratio``), so there is one device count per slot to keep
right. ``host_positions`` holds the same numbers on the host, which drives every change (a prefill's
length, one per step, a reset): bounds are checked there without reading the device.

The ring and the stores are in the backend's ``state_dtype`` (float32 for the references, BF16 for the
GPU kernels, which read BF16); pending projections and the overlap half stay float32.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field

import torch

_serials = itertools.count()

Shapes = dict[str, tuple[tuple[int, ...], torch.dtype]]


def compressor_shapes(batch: int, ratio: int, width: int, dim: int, max_context: int, dtype: torch.dtype,
                      overlap: bool) -> Shapes:
    """Name -> (shape, dtype) of one compressor's state tensors (one table for sizing and allocating)."""
    f32 = torch.float32
    shapes: Shapes = {"pending_kv": ((batch, ratio, width), f32), "pending_gate": ((batch, ratio, width), f32),
                      "store": ((batch, max_context // ratio + 1, dim), dtype)}
    if overlap:
        shapes.update(prev_kv=((batch, ratio, dim), f32), prev_gate=((batch, ratio, dim), f32))
    return shapes


def nbytes_of(shapes: Shapes) -> int:
    """Bytes of tensors of these shapes and dtypes."""
    n = 0
    for shape, dtype in shapes.values():
        count = 1
        for d in shape:
            count *= d
        n += count * torch.empty((), dtype=dtype).element_size()
    return n


@dataclass
class CompressorState:
    """One compressor's fixed-size state (see the module docstring)."""

    ratio: int
    pending_kv: torch.Tensor      # [B, ratio, C] float32
    pending_gate: torch.Tensor    # [B, ratio, C] float32
    store: torch.Tensor           # [B, max_context // ratio + 1, d]
    prev_kv: torch.Tensor | None = None    # CSA: [B, ratio, d] float32
    prev_gate: torch.Tensor | None = None  # CSA: [B, ratio, d] float32, -inf = no previous window

    @classmethod
    def allocate(cls, shapes: Shapes, ratio: int, device) -> "CompressorState":
        made = {name: torch.zeros(shape, dtype=dtype, device=device) for name, (shape, dtype) in shapes.items()}
        cs = cls(ratio, **made)
        if cs.prev_gate is not None:
            cs.prev_gate.fill_(float("-inf"))
        return cs

    @property
    def overlap(self) -> bool:
        return self.prev_kv is not None

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.pending_kv, self.pending_gate, self.store, self.prev_kv, self.prev_gate)
                if t is not None]

    def reset(self, slot: int) -> None:
        """Forget slot ``slot``'s overlap half (the rest is past its position, never read)."""
        if self.overlap:
            self.prev_kv[slot].zero_()
            self.prev_gate[slot].fill_(float("-inf"))


@dataclass
class LayerState:
    window: torch.Tensor                  # [B, W, D] ring of K=V vectors
    compressor: CompressorState | None = None
    indexer: CompressorState | None = None

    def tensors(self) -> list[torch.Tensor]:
        return [self.window] + [t for cs in (self.compressor, self.indexer) if cs is not None for t in cs.tensors()]


@dataclass(eq=False)
class DecodeState:
    """What :meth:`Model.step` carries between tokens; make one with :meth:`Model.new_state`."""

    batch: int
    max_context: int
    positions: torch.Tensor                       # int64 [B] on the model's device
    layers: dict[int, LayerState] = field(default_factory=dict)
    _host: list[int] = field(default_factory=list, repr=False)
    serial: int = field(default_factory=lambda: next(_serials), repr=False)   # names this state's graph

    def __post_init__(self) -> None:
        if not self._host:
            self._host = [0] * self.batch

    @property
    def host_positions(self) -> tuple[int, ...]:
        """Tokens each slot holds, as the host knows them (no device read)."""
        return tuple(self._host)

    @property
    def position(self) -> int:
        """The position every slot is at; a ragged state (slots at different positions) has none."""
        if len(set(self._host)) != 1:
            raise ValueError(f"the slots are at different positions {self._host}: read state.host_positions "
                             "(or state.positions on the device)")
        return self._host[0]

    @property
    def nbytes(self) -> int:
        """Bytes of every state tensor (what :meth:`Model.new_state` checked against free memory)."""
        return sum(t.nbytes for t in self.tensors())

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor of the state (their addresses never change)."""
        return [self.positions] + [t for st in self.layers.values() for t in st.tensors()]

    def counts(self, ratio: int) -> torch.Tensor:
        """Closed windows (valid store rows) per slot of a compressor of ``ratio``: int64 [B] on the device."""
        return torch.div(self.positions, ratio, rounding_mode="floor")

    def reset(self, slot: int) -> None:
        """Empty slot ``slot`` (position 0) so that it can take a new sequence; the other slots are untouched."""
        self.check_slot(slot)
        self.positions[slot].zero_()
        self._host[slot] = 0
        for st in self.layers.values():
            for cs in (st.compressor, st.indexer):
                if cs is not None:
                    cs.reset(slot)

    def room(self, slots, tokens: int) -> None:
        """Raise unless each slot of ``slots`` can take ``tokens`` more tokens."""
        full = [s for s in slots if self._host[s] + tokens > self.max_context]
        if full:
            held = [self._host[s] for s in full]
            raise ValueError(f"slots {full} hold {held} tokens; {tokens} more would pass "
                             f"max_context={self.max_context}: reset finished slots (state.reset(slot)) or make "
                             "the state with a larger max_context")

    def assume_positions(self, positions) -> None:
        """Declare that slot ``s`` holds ``positions[s]`` tokens without feeding them: the ring, stores and
        pending windows keep whatever they hold. For benchmarks that fill a state with random entries instead
        of a long prefill; a model's logits on such a state are not any sequence's."""
        positions = [int(p) for p in positions]
        if len(positions) != self.batch or not all(0 <= p <= self.max_context for p in positions):
            raise ValueError(f"need {self.batch} positions in [0, {self.max_context}], got {positions}")
        self.positions.copy_(torch.tensor(positions, dtype=torch.long))
        self._host = positions

    def advance(self, slots, tokens: int) -> None:
        """The host's record of ``tokens`` more in each of ``slots`` (the device's is the caller's)."""
        for s in slots:
            self._host[s] += tokens

    def check_slot(self, slot: int) -> None:
        """Raise unless ``slot`` names a slot of this state."""
        if not (isinstance(slot, int) and 0 <= slot < self.batch):
            raise ValueError(f"slot must be an int in [0, {self.batch}), got {slot!r}")


def check_fits(nbytes: int, device: torch.device, what: str) -> None:
    """Raise ValueError when ``nbytes`` more would not fit ``device``: the GPU's free memory (with what torch's
    allocator holds unused), or the host's physical memory."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        where = f"{device} has {free / 2**30:.2f} GiB free"
    else:
        try:
            free = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            return
        where = f"the host has {free / 2**30:.2f} GiB of memory"
    if nbytes > free:
        raise ValueError(f"{what} needs {nbytes / 2**30:.2f} GiB and {where}: use a smaller batch or max_context")
