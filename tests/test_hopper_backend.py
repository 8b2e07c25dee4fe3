"""HopperBackend's choice of MoE layer configuration (CPU: the kernel class is replaced by a recorder)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from nvfp4_megamoe.runtime.hopper import HopperBackend

pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed")


class _Recorder:
    """Stands in for Sm90NvFp4MoE: keeps its keyword arguments, compiles nothing."""

    made: list[dict] = []

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        _Recorder.made.append(kwargs)

    def kernels(self, tile_tokens: int):
        return None

    def warmup(self) -> int:
        return 0


def _experts(held: int, total: int, row_tiles: bool = False) -> SimpleNamespace:
    """The MoEWeights fields ``_moe_layer`` reads: packed w13 [held, 2I, H/2], the model's expert count, the layout."""
    return SimpleNamespace(w13=torch.zeros(held, 256, 64, dtype=torch.uint8), n_experts=total, row_tiles=row_tiles)


@pytest.fixture
def recorder(monkeypatch):
    from nvfp4_megamoe.kernels import sm90_moe
    monkeypatch.setattr(sm90_moe, "Sm90NvFp4MoE", _Recorder)
    _Recorder.made = []
    return _Recorder


def test_all_experts_keep_the_direct_one_token_path(recorder):
    layer = HopperBackend()._moe_layer(_experts(8, 8), top_k=2, swiglu_limit=10.0, device=torch.device("cpu"))
    assert layer.kwargs["tuning"] is None and layer.kwargs["experts"] == 8


def test_a_rank_with_part_of_the_experts_keeps_the_routing_kernel(recorder):
    """Pairs held elsewhere all become local expert 0: one tile per pair would read it several times."""
    be = HopperBackend()
    part = be._moe_layer(_experts(4, 8), top_k=2, swiglu_limit=10.0, device=torch.device("cpu"))
    assert part.kwargs["tuning"] == {"direct": False} and part.kwargs["experts"] == 4
    # the same shape held whole is another layer object with the default configuration
    whole = be._moe_layer(_experts(4, 4), top_k=2, swiglu_limit=10.0, device=torch.device("cpu"))
    assert whole is not part and whole.kwargs["tuning"] is None
    assert len(recorder.made) == 2
    # row-tiled weights (--target sm90): a layer of its own that reads them so
    tiled = be._moe_layer(_experts(4, 4, row_tiles=True), top_k=2, swiglu_limit=10.0, device=torch.device("cpu"))
    assert tiled is not whole and tiled.kwargs["weight_tiles"] and not whole.kwargs["weight_tiles"]
