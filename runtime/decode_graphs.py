"""CUDA graphs of the decode step's blocks whose shapes depend on the batch alone.

A decode step is bound by the host: every torch op and kernel launch of a layer costs CPU time while
the GPU waits (``docs/runtime.md``). The FFN half of a layer (mHC weights, norm, router, routed and
shared experts, mHC update) reads no decode state, so at a fixed batch size it is the same launches
on the same shapes every step: it is captured once per (layer, batch) and replayed as one graph.
The attention half stays eager: its shapes follow the position (compressed entries appear every 4
and 128 tokens).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable, Hashable

import torch


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    inputs: list[torch.Tensor]   # the graph reads these: each replay copies the call's inputs in first
    output: torch.Tensor         # the graph writes this: valid until the next replay of the same graph


class DecodeGraphs:
    """Capture-once, replay-after cache of CUDA graphs keyed by the caller (``(layer, batch)``).

    :meth:`run` computes ``fn(*inputs)`` (CUDA tensors in, one tensor out). The first call for a key
    runs ``fn`` eagerly, which also compiles and allocates whatever it needs (so no lazily made
    workspace lands in a graph's private memory), then captures it; later calls copy the inputs into
    the graph's buffers and replay it. A block that cannot be captured (a host sync in a fallback
    path, say) stays eager; the first such block warns. The output of a replay is the graph's own
    buffer: the next replay of that key overwrites it, so consume it first (the decode step does: the
    next layer reads it before the next step).
    """

    def __init__(self) -> None:
        self._graphs: dict[Hashable, _Captured | None] = {}
        self._warned = False
        self.replays = 0

    def run(self, key: Hashable, fn: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> torch.Tensor:
        if key not in self._graphs:
            out = fn(*inputs)
            self._graphs[key] = self._capture(key, fn, inputs)
            return out
        cap = self._graphs[key]
        if cap is None:
            return fn(*inputs)
        for buf, x in zip(cap.inputs, inputs):
            buf.copy_(x)
        cap.graph.replay()
        self.replays += 1
        return cap.output

    def _capture(self, key: Hashable, fn: Callable[..., torch.Tensor], inputs: tuple) -> _Captured | None:
        static = [torch.empty_like(x, memory_format=torch.contiguous_format).copy_(x) for x in inputs]
        try:
            graph = torch.cuda.CUDAGraph()  # raises where torch has no CUDA
            with torch.cuda.graph(graph):
                out = fn(*static)
        except RuntimeError as exc:
            if not self._warned:
                self._warned = True
                warnings.warn(f"decode block {key} could not be captured in a CUDA graph and runs eagerly, "
                              f"as will any other that cannot ({exc})", stacklevel=3)
            return None
        return _Captured(graph, static, out)
