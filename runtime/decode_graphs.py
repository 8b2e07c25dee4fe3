"""CUDA graphs of whole decode steps: one per decode state, captured at its first step and replayed after.

A decode step is bound by the host when it is launched op by op: every torch op and kernel launch costs CPU
time while the GPU waits (``docs/runtime.md``). :meth:`Model.step` has fixed shapes, reads no device value on
the host and writes the state in place (``runtime/state.py``), so for one state it is the same launches on the
same memory every step: all layers (both halves) and the head are captured once as one graph and each later step
is one replay. The only input that changes is the token ids, copied into the graph's buffer.
"""

from __future__ import annotations

import warnings
import weakref
from dataclasses import dataclass
from typing import Callable, Hashable

import torch


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    inputs: list[torch.Tensor]   # the graph reads these: each replay copies the call's inputs in first
    output: torch.Tensor         # the graph writes this: valid until the next replay of the same graph


class DecodeGraphs:
    """Capture-once, replay-after cache of CUDA graphs keyed by the caller (the model: one per decode state).

    :meth:`run` computes ``fn(*inputs)`` (CUDA tensors in, one tensor out). The first call for a key runs
    ``fn`` eagerly, which also compiles and allocates whatever it needs (so no lazily made workspace lands in
    a graph's private memory), then captures it (a capture records, it does not run: the eager call was the
    step); later calls copy the inputs into the graph's buffers and replay it. A graph writes the memory it
    was captured on: ``owner`` (the decode state) is what owns that memory, and its graph is dropped when the
    owner is freed, so a replay never writes memory that has been given to something else. A block that cannot
    be captured (a host sync in a fallback path, say) stays eager; the first such block warns. The output of a
    replay is the graph's own buffer: the next replay of that key overwrites it, so copy it out first.
    """

    def __init__(self) -> None:
        self._graphs: dict[Hashable, _Captured | None] = {}
        self._warned = False
        self.replays = 0

    def __len__(self) -> int:
        """Graphs held (captured or refused), one per live key."""
        return len(self._graphs)

    def graph(self, key: Hashable) -> torch.cuda.CUDAGraph | None:
        """The graph captured for ``key`` (None: not captured, or refused); for timing it alone."""
        cap = self._graphs.get(key)
        return None if cap is None else cap.graph

    def run(self, key: Hashable, fn: Callable[..., torch.Tensor], *inputs: torch.Tensor,
            owner: object | None = None) -> torch.Tensor:
        if key not in self._graphs:
            out = fn(*inputs)
            self._graphs[key] = self._capture(key, fn, inputs)
            if owner is not None:
                weakref.finalize(owner, self._graphs.pop, key, None)
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
