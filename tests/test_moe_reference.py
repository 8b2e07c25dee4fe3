"""CPU checks of kernels/moe_reference.py against a float64 dense computation."""

from __future__ import annotations

import pytest
import torch

from nvfp4_megamoe.kernels.interleave import interleave_gate_up
from nvfp4_megamoe.kernels.moe_reference import moe_reference, moe_reference_dense, random_moe_weights
from nvfp4_megamoe.kernels.nvfp4 import dequantize_nvfp4, quantize_nvfp4
from nvfp4_megamoe.kernels.nvfp4_reference import decode_weight
from nvfp4_megamoe.kernels.row_tiles import tile_expert_weights
from nvfp4_megamoe.kernels.swizzle import swizzle_block_scales

from numeric import rel_err


def _quantized_experts(e: int, h: int, i: int, gen: torch.Generator):
    """Random float weights quantised to format 1, and their exact dequantised float64 values."""
    w13, s13, a13, w2, s2, a2 = [], [], [], [], [], []
    w1d, w3d, w2d = [], [], []
    for _ in range(e):
        w1 = torch.randn(i, h, generator=gen, dtype=torch.float64) / h ** 0.5 * 3
        w3 = torch.randn(i, h, generator=gen, dtype=torch.float64) / h ** 0.5 * 3
        wd = torch.randn(h, i, generator=gen, dtype=torch.float64) / i ** 0.5
        q1, q3 = quantize_nvfp4(w1.float()), quantize_nvfp4(w3.float() * 0.37)  # halves on different alphas
        q2 = quantize_nvfp4(wd.float())
        w13.append(interleave_gate_up(q1.packed, q3.packed))
        s13.append(swizzle_block_scales(interleave_gate_up(q1.scales, q3.scales)))
        a13.append((q1.alpha, q3.alpha))
        w2.append(q2.packed), s2.append(swizzle_block_scales(q2.scales)), a2.append(q2.alpha)
        w1d.append(dequantize_nvfp4(q1.packed, q1.scales, q1.alpha).double())
        w3d.append(dequantize_nvfp4(q3.packed, q3.scales, q3.alpha).double())
        w2d.append(dequantize_nvfp4(q2.packed, q2.scales, q2.alpha).double())
    fmt = dict(w13=torch.stack(w13), w13_scale=torch.stack(s13), w13_alpha=torch.tensor(a13, dtype=torch.float32),
               w2=torch.stack(w2), w2_scale=torch.stack(s2), w2_alpha=torch.tensor(a2, dtype=torch.float32))
    return fmt, torch.stack(w1d), torch.stack(w3d), torch.stack(w2d)


@pytest.mark.parametrize("limit", [None, 10.0, 0.5])
def test_reference_matches_float64_dense(limit):
    gen = torch.Generator().manual_seed(1234)
    e, h, i, t, k = 6, 64, 32, 7, 3
    fmt, w1, w3, w2 = _quantized_experts(e, h, i, gen)
    x = torch.randn(t, h, generator=gen).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(e - 1, generator=gen)[:k] for _ in range(t)])  # expert e-1 never hit
    wts = torch.rand(t, k, generator=gen) + 0.1
    out = moe_reference(x, ids, wts, **fmt, swiglu_limit=limit)
    ref = moe_reference_dense(x.double(), ids, wts.double(), w1, w3, w2, limit)
    assert out.dtype == torch.float32 and out.shape == (t, h)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < 1e-5
    if limit == 0.5:  # the clamp is active and matters
        assert rel_err(moe_reference_dense(x.double(), ids, wts.double(), w1, w3, w2, None), ref) > 1e-2


def test_reference_decodes_random_format1_weights():
    gen = torch.Generator().manual_seed(7)
    e, h, i, t, k = 4, 128, 64, 5, 2
    fmt = random_moe_weights(e, h, i, generator=gen)
    x = torch.randn(t, h, generator=gen).to(torch.bfloat16)
    ids = torch.tensor([[0, 1], [1, 2], [2, 0], [0, 2], [1, 0]])
    wts = torch.rand(t, k, generator=gen)
    assert fmt["w13_alpha"].shape == (e, 2) and bool((fmt["w13_alpha"][:, 0] != fmt["w13_alpha"][:, 1]).all())
    w2 = torch.stack([decode_weight(fmt["w2"][j], fmt["w2_scale"][j], fmt["w2_alpha"][j]) for j in range(e)])
    # gate/up from the spec (interleave by 8, gate first), each half on its own alpha
    codes_scales = torch.stack([decode_weight(fmt["w13"][j], fmt["w13_scale"][j], 1.0) for j in range(e)])
    gate = (codes_scales.view(e, i // 8, 2, 8, h)[:, :, 0].reshape(e, i, h) * fmt["w13_alpha"][:, 0, None, None]).double()
    up = (codes_scales.view(e, i // 8, 2, 8, h)[:, :, 1].reshape(e, i, h) * fmt["w13_alpha"][:, 1, None, None]).double()
    ref = moe_reference_dense(x.double(), ids, wts.double(), gate, up, w2.double(), 10.0)
    out = moe_reference(x, ids, wts, **fmt, swiglu_limit=10.0)
    assert rel_err(out, ref) < 1e-5
    assert float(out.abs().mean()) > 0.01  # random data, not a degenerate all-zero layer


def test_reference_reads_row_tiled_weights():
    """``weight_tiles``: the same layer from w13 and w2 in Hopper row tiles (each expert un-tiled as it is used)."""
    gen = torch.Generator().manual_seed(3)
    e, h, i, t, k = 4, 256, 128, 6, 2
    fmt = random_moe_weights(e, h, i, generator=gen)
    x = torch.randn(t, h, generator=gen).to(torch.bfloat16)
    ids = torch.rand(t, e, generator=gen).topk(k, dim=1).indices
    wts = torch.rand(t, k, generator=gen)
    tiled = tile_expert_weights(fmt)
    assert not tiled["w13"].equal(fmt["w13"])
    out = moe_reference(x, ids, wts, **tiled, swiglu_limit=10.0, weight_tiles=True)
    assert torch.equal(out, moe_reference(x, ids, wts, **fmt, swiglu_limit=10.0))
    assert float(out.abs().mean()) > 0.01
    assert rel_err(moe_reference(x, ids, wts, **tiled, swiglu_limit=10.0), out) > 0.1  # tiles read as rows: wrong


def test_reference_rejects_bad_shapes():
    gen = torch.Generator().manual_seed(0)
    fmt = random_moe_weights(2, 64, 32, generator=gen)
    x = torch.randn(3, 64).to(torch.bfloat16)
    with pytest.raises(ValueError, match="topk_ids"):
        moe_reference(x, torch.zeros(3, 2, dtype=torch.long), torch.zeros(3, 1), **fmt, swiglu_limit=None)
    with pytest.raises(ValueError, match="x must be"):
        moe_reference(x[0], torch.zeros(3, 2, dtype=torch.long), torch.zeros(3, 2), **fmt, swiglu_limit=None)
