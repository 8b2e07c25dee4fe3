"""``runtime/decode_graphs.py`` where a block cannot be captured (a capture that raises, as it does
where torch has no CUDA or when a block reads a device value back), and the lifetime of a state's graph.

The capture-and-replay path needs a GPU: ``tests/test_runtime_gpu.py`` checks replayed decode steps
against eager ones on an H200.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from nvfp4_megamoe.runtime.decode_graphs import DecodeGraphs


def _block(x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return x * 2 + ids.float()


class _NoCapture:
    def __init__(self):
        raise RuntimeError("capture refused (test)")


def test_a_block_that_cannot_be_captured_runs_eagerly_and_warns_once(monkeypatch):
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _NoCapture)
    graphs = DecodeGraphs()
    gen = torch.Generator().manual_seed(0)
    x, ids = torch.randn(3, 1, 4, 8, generator=gen), torch.randint(0, 9, (3, 1, 1, 1), generator=gen)
    with pytest.warns(UserWarning, match="could not be captured"):
        first = graphs.run((0, 3), _block, x, ids)
    torch.testing.assert_close(first, _block(x, ids), rtol=0, atol=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second block and the later calls stay quiet
        other = graphs.run((1, 3), _block, x + 1, ids)
        again = [graphs.run((0, 3), _block, x - i, ids) for i in range(3)]
    torch.testing.assert_close(other, _block(x + 1, ids), rtol=0, atol=0)
    for i, got in enumerate(again):  # each call computes on its own inputs, nothing is replayed
        torch.testing.assert_close(got, _block(x - i, ids), rtol=0, atol=0)
    assert graphs.replays == 0


def test_a_graph_goes_with_the_state_that_owns_its_memory(monkeypatch):
    """A graph writes the memory it was captured on: when its owner (the decode state) is freed, the cache drops
    it, so that no later replay writes memory handed to something else."""
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _NoCapture)

    class Owner:
        pass

    graphs, owners = DecodeGraphs(), [Owner(), Owner()]
    x, ids = torch.ones(2, 1, 4, 8), torch.zeros(2, 1, 1, 1)
    with pytest.warns(UserWarning, match="could not be captured"):
        for o in owners:
            graphs.run(("step", id(o)), _block, x, ids, owner=o)
    assert len(graphs) == 2
    del o, owners[0]
    assert len(graphs) == 1
    owners.clear()
    assert len(graphs) == 0
