"""HopperBackend's choice of MoE layer shape (CPU: the kernel class is replaced by a recorder)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from nvfp4_megamoe.runtime.hopper import HopperBackend

pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed")


class _Recorder:
    """Stands in for Sm90Nvfp4Moe: keeps its shape, compiles nothing."""

    made: list = []
    can_implement = staticmethod(lambda shape, max_tokens: True)

    def __init__(self, shape, max_tokens, device):
        self.shape = shape
        _Recorder.made.append(shape)

    def warmup(self) -> int:
        return 0


def _experts(held: int, total: int, row_tiles: bool = False) -> SimpleNamespace:
    """The MoEWeights fields ``_moe_layer`` reads: packed w13 [held, 2I, H/2], the model's expert count, the layout."""
    return SimpleNamespace(w13=torch.zeros(held, 256, 64, dtype=torch.uint8), n_experts=total, row_tiles=row_tiles)


@pytest.fixture
def recorder(monkeypatch):
    from nvfp4_megamoe.kernels import sm90_moe
    monkeypatch.setattr(sm90_moe, "Sm90Nvfp4Moe", _Recorder)
    _Recorder.made = []
    return _Recorder


def test_all_experts_keep_the_direct_one_token_path(recorder):
    layer = HopperBackend()._moe_layer(_experts(8, 8), top_k=2, swiglu_limit=10.0, device=torch.device("cpu"))
    assert layer.shape.distinct_experts and layer.shape.experts == 8


def test_a_rank_with_part_of_the_experts_keeps_the_routing_kernel(recorder):
    """Pairs held elsewhere all become local expert 0: one tile per pair would read it several times."""
    be = HopperBackend()
    part = be._moe_layer(_experts(4, 8), top_k=2, swiglu_limit=10.0, device=torch.device("cpu"))
    assert not part.shape.distinct_experts and part.shape.experts == 4
    # the same shape held whole is another layer object with the default configuration
    whole = be._moe_layer(_experts(4, 4), top_k=2, swiglu_limit=10.0, device=torch.device("cpu"))
    assert whole is not part and whole.shape.distinct_experts
    assert len(recorder.made) == 2
    # row-tiled weights (--target sm90): a layer of its own that reads them so
    tiled = be._moe_layer(_experts(4, 4, row_tiles=True), top_k=2, swiglu_limit=10.0, device=torch.device("cpu"))
    assert tiled is not whole and tiled.shape.weight_tiles and not whole.shape.weight_tiles


@pytest.mark.parametrize("overlap", [False, True])
def test_slot_softmax_on_the_last_axis_pools_as_the_reference(overlap):
    """The compressor's softmax over a window's slots, taken on the last axis of the transposed gates (the GPU
    backend's form), gives the reference's pooled entries and carried half-window; -inf gates (no previous window)
    included."""
    from nvfp4_megamoe.kernels.compressor_reference import compress_windows

    gen = torch.Generator().manual_seed(3)
    b, n, ratio, c = 2, 3, 4, 16
    kv, gate = torch.randn(b, n, ratio, c, generator=gen), 4 * torch.randn(b, n, ratio, c, generator=gen)
    ape = torch.randn(ratio, c, generator=gen)
    ref, ref_last = compress_windows(kv, gate, ape, overlap=overlap)
    got, got_last = compress_windows(kv, gate, ape, overlap=overlap, slot_softmax_last=True)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
    if overlap:
        assert all(torch.equal(g, r) for g, r in zip(got_last, ref_last))


def _fp8(rows: int, k: int, gen: torch.Generator, scale_dtype=torch.uint8):
    from nvfp4_megamoe.runtime.weights import Fp8Linear

    w = torch.randint(0, 256, (rows, k), dtype=torch.uint8, generator=gen).view(torch.float8_e4m3fn)
    blocks = (rows // 128, k // 128)
    s = (torch.randint(120, 130, blocks, dtype=torch.uint8, generator=gen) if scale_dtype == torch.uint8
         else torch.rand(blocks, generator=gen))
    return Fp8Linear(w, s)


def test_linears_of_one_input_are_fused_only_where_one_weight_can_hold_them():
    """FP8: same K and dtypes, whole 128-row scale blocks; BF16: small weights of one K; NVFP4 never (each has its
    own alpha); mixed kinds never."""
    from nvfp4_megamoe.runtime.hopper import fused_kind
    from nvfp4_megamoe.runtime.weights import DenseLinear

    gen = torch.Generator().manual_seed(1)
    a, b = _fp8(256, 512, gen), _fp8(128, 512, gen)
    assert fused_kind((a, b)) == "fp8"
    assert fused_kind((a,)) is None
    assert fused_kind((a, _fp8(128, 256, gen))) is None                         # another K
    assert fused_kind((a, _fp8(128, 512, gen, torch.float32))) is None          # another scale dtype
    dense = DenseLinear(torch.zeros(64, 512, dtype=torch.bfloat16))
    assert fused_kind((dense, DenseLinear(torch.zeros(32, 512, dtype=torch.bfloat16)))) == "f32"
    assert fused_kind((dense, DenseLinear(torch.zeros(32, 512)))) is None        # float32 and BF16
    assert fused_kind((a, dense)) is None


def test_fp8_linears_concatenated_keep_their_bytes_as_views_of_one_weight():
    """The fused weight is the members' rows and block-scale rows in order, and each member now views it: the same
    values, the bytes held once."""
    from nvfp4_megamoe.runtime.hopper import _concat_fp8

    gen = torch.Generator().manual_seed(2)
    group = (_fp8(256, 512, gen), _fp8(128, 512, gen), _fp8(384, 512, gen))
    before = [(w.weight.view(torch.uint8).clone(), w.scale.clone()) for w in group]
    fused = _concat_fp8(group)
    assert fused.weight.shape == (768, 512) and fused.scale.shape == (6, 4)
    row = 0
    for w, (weight, scale) in zip(group, before):
        assert torch.equal(w.weight.view(torch.uint8), weight) and torch.equal(w.scale, scale)
        assert w.weight.dtype == torch.float8_e4m3fn and w.weight.is_contiguous() and w.scale.is_contiguous()
        assert w.weight.untyped_storage().data_ptr() == fused.weight.untyped_storage().data_ptr()
        assert torch.equal(fused.weight[row:row + weight.shape[0]].view(torch.uint8), weight)
        row += weight.shape[0]
