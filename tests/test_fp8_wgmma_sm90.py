"""The FP8 x FP8 WGMMA linear (``kernels/sm90_fp8_wgmma.py``): the activations' quantisation on the CPU, the kernel
compiled for sm_90a (CI), and on the H200 against a float32 reference that quantises the activations the same way
(marked ``gpu``)."""

from __future__ import annotations

import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed")

from nvfp4_megamoe.kernels import sm90_fp8_wgmma as wg  # noqa: E402
from nvfp4_megamoe.kernels.fp8 import fp8_block_dequantize  # noqa: E402
from nvfp4_megamoe.kernels.sm90_config import Fp8WgmmaConfig  # noqa: E402
from numeric import rel_err  # noqa: E402


def _dequantized_x(xq: torch.Tensor, sa: torch.Tensor) -> torch.Tensor:
    t, cols = xq.shape
    values = xq.view(torch.float8_e4m3fn).float().view(t, cols // 128, 128)
    return (values * sa[..., None]).view(t, cols)


def test_activations_are_quantised_per_block_with_power_of_two_scales():
    """Each 1 x 128 block: a power-of-two scale at or above amax / 448 (so nothing saturates), values within E4M3's
    rounding (a relative 2**-4, or its subnormal step) of the input; a zero block stays zero."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 384, generator=gen) * torch.logspace(-6, 6, 5)[:, None]
    x[2, 128:256] = 0
    xq, sa = wg.quantize_activations(x)
    assert xq.dtype == torch.uint8 and tuple(sa.shape) == (5, 3)
    mant, _ = torch.frexp(sa)
    assert (mant == 0.5).all()                                   # powers of two
    amax = x.view(5, 3, 128).abs().amax(-1)
    assert (sa >= amax / wg.FP8_MAX).all() and (sa < 2 * amax / wg.FP8_MAX + 1e-30).all()
    back = _dequantized_x(xq, sa)
    step = sa.repeat_interleave(128, 1) * 2.0 ** -9               # E4M3's subnormal step at that scale
    assert ((back - x).abs() <= torch.maximum(x.abs() * 2.0 ** -4, step)).all()
    assert (back[2, 128:256] == 0).all()


@pytest.mark.parametrize("config,match", [
    (Fp8WgmmaConfig(n=192, k=1024), "multiple of 128"),
    (Fp8WgmmaConfig(n=1024, k=1000), "K=1000"),
    (Fp8WgmmaConfig(n=1024, k=1024, stages=8), "stages must be 2..6"),
])
def test_configurations_the_kernel_does_not_take_are_refused(config, match):
    assert not wg.Sm90Fp8Wgmma.can_implement(config)
    with pytest.raises(ValueError, match=match):
        wg.Sm90Fp8Wgmma(config)


@pytest.mark.skipif(os.environ["CUTE_DSL_ARCH"] != "sm_90a", reason="CUTE_DSL_ARCH names another target")
@pytest.mark.parametrize("scale_dtype", [torch.uint8, torch.float32])
def test_fp8_wgmma_compiles_sm90a(scale_dtype):
    from nvfp4_megamoe.kernels.cute_host import compile_op
    args = [torch.zeros(300, 256, dtype=torch.uint8), torch.zeros(300, 2), torch.zeros(256, 256, dtype=torch.uint8),
            torch.zeros(2, 2, dtype=scale_dtype), torch.zeros(300, 256)]
    config = Fp8WgmmaConfig(n=1024, k=4096, scale_f32=scale_dtype == torch.float32)
    assert compile_op(wg.Sm90Fp8Wgmma(config), args) is not None


@pytest.mark.gpu
@pytest.mark.parametrize("n,k,groups,scale_f32", [(1024, 4096, 1, False), (4096, 2048, 1, False),
                                                  (1024, 1024, 8, False), (2048, 1024, 1, True)])
def test_fp8_wgmma_matches_the_quantised_reference(n, k, groups, scale_f32):
    """Token counts inside one 128-token tile, across tiles and not a multiple of it; E4M3 weights of every finite
    code, E8M0 or float32 block scales. Reference: the same quantised activations, float32 products."""
    gen = torch.Generator(device="cuda").manual_seed(n + k + groups)
    rows = groups * n
    mag = torch.randint(0, 0x7F, (rows, k), device="cuda", generator=gen)
    w = (mag | (torch.randint(0, 2, (rows, k), device="cuda", generator=gen) << 7)).to(torch.uint8)
    if scale_f32:
        scale = torch.rand(rows // 128, k // 128, device="cuda", generator=gen) * 2 ** -9 + 2 ** -11
    else:
        scale = torch.randint(110, 125, (rows // 128, k // 128), device="cuda", generator=gen).to(torch.uint8)
        scale = scale.view(torch.float8_e8m0fnu)
    weight = fp8_block_dequantize(w, scale).view(groups, n, k)
    for tokens in (1, 100, 128, 300, 1000):
        x = torch.randn(tokens, groups * k, device="cuda", generator=gen) * 2
        got = wg.sm90_fp8_wgmma_linear(x, w, scale, groups=groups)
        xq, sa = wg.quantize_activations(x)
        want = torch.einsum("tgk,gnk->tgn", _dequantized_x(xq, sa).view(tokens, groups, k), weight)
        assert got.shape == (tokens, groups * n) and got.isfinite().all()
        assert rel_err(got, want.reshape(tokens, -1)) < 1e-5, tokens
