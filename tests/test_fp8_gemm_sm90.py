"""The W8A8 FP8 GEMM (``kernels/sm90_fp8_gemm.py``): its picks and references on the CPU, its kernels compiled for
sm_90a at V4-Flash's and V4-Pro's FP8 linears (CI), and on the H200 (marked ``gpu``) against float32 references:
tightly against the same quantised operands (only the order of the float32 sums differs), loosely against the
unquantised product (the activations' FP8 rounding, a few per cent), and the quantiser bit for bit against
torch."""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed")

from nvfp4_megamoe.kernels import sm90_fp8_gemm as w8a8  # noqa: E402
from nvfp4_megamoe.kernels.fp8 import fp8_block_dequantize  # noqa: E402
from nvfp4_megamoe.kernels.fp8_reference import fp8_act_quantize, fp8_w8a8_linear  # noqa: E402
from nvfp4_megamoe.kernels.sm90_config import Fp8GemmConfig  # noqa: E402
from nvfp4_megamoe.kernels.sm90_heuristics import fp8_gemm_config, fp8_gemm_configs  # noqa: E402
from numeric import rel_err  # noqa: E402
from sm90_stand_ins import random_fp8_weight  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from fp8_linear_bench import fp8_shapes  # noqa: E402

PRESET_SHAPES = sorted({(n, k, groups) for preset in ("flash-layer", "pro-layer")
                        for _, n, k, groups in fp8_shapes(preset)})
TOKENS = (1, 64, 65, 100, 2048, 3000, 8192)
# The tensor cores add an FP8 wgmma's products with fewer mantissa bits than float32 keep (the reason the kernel
# promotes every 128 K into float32): on the H200 a 128-K block of random E4M3 operands differs from the exact sum by
# about 1e-3 of its size at most (structured operands, exactly representable sums, come out exact). Against the
# float32 reference of the same quantised operands the kernel is held to 2e-3 of the output's norm: a wrong tile,
# row, block or scale moves it by far more.
ACCUMULATION_TOL = 2e-3


@pytest.mark.parametrize("n,k,groups", PRESET_SHAPES)
def test_every_picked_configuration_is_taken_and_warmed(n, k, groups):
    """What the pick returns for V4's FP8 linears at any token count, the kernel takes and the warm-up compiles."""
    warmed = fp8_gemm_configs(n, k, groups)
    for tokens in TOKENS + tuple(range(1, 300, 7)):
        config = fp8_gemm_config(n, k, tokens, groups)
        assert config in warmed and w8a8.Sm90Fp8Gemm.can_implement(config), config
    assert w8a8.can_implement(n, k, groups)


def test_a_192_wide_tile_is_picked_where_it_saves_a_wave():
    """V4-Flash's ``wq_a + wkv`` at 2048 tokens: 128 tiles of 192 rows fill 132 SMs once, 192 tiles of 128 twice."""
    assert fp8_gemm_config(1536, 4096, 2048).block_n == 192
    assert fp8_gemm_config(32768, 1024, 2048).block_n == 128      # 192 does not divide N
    assert fp8_gemm_config(1536, 4096, 50).warpgroups == 1


@pytest.mark.parametrize("config,match", [
    (Fp8GemmConfig(n=1024, k=4096, block_n=96), "block_n must be one of"),
    (Fp8GemmConfig(n=1280, k=4096, block_n=192, stages=4), "multiple of 128 and of block_n=192"),
    (Fp8GemmConfig(n=1024, k=4000), "K=4000 must be a positive multiple of 128"),
    (Fp8GemmConfig(n=1024, k=4096, warpgroups=3), "warpgroups must be 1 or 2"),
    (Fp8GemmConfig(n=1024, k=4096, stages=8), "fit 232448 bytes"),
    (Fp8GemmConfig(n=1024, k=4096, stages=1), "stages must be >= 2"),
])
def test_configurations_the_kernel_does_not_take_are_refused(config, match):
    assert not w8a8.Sm90Fp8Gemm.can_implement(config)
    with pytest.raises(ValueError, match=match):
        w8a8.Sm90Fp8Gemm(config)


def test_calls_the_kernel_does_not_take_are_refused_before_any_launch():
    """W not tiled (N = 96), x of the wrong width, scales of the wrong shape, a weight off the TMA's alignment."""
    w, s = torch.zeros(256, 512, dtype=torch.uint8), torch.zeros(2, 4, dtype=torch.uint8)
    assert not w8a8.can_implement(96, 512) and w8a8.can_implement(256, 512)
    with pytest.raises(ValueError, match="does not tile"):
        w8a8.sm90_fp8_gemm(torch.zeros(2, 512), w[:96], s[:1])
    with pytest.raises(ValueError, match="x must be"):
        w8a8.sm90_fp8_gemm(torch.zeros(2, 256), w, s)
    with pytest.raises(ValueError, match="scale must be"):
        w8a8.sm90_fp8_gemm(torch.zeros(2, 512), w, s[:, :2])
    with pytest.raises(ValueError, match="16-byte aligned"):
        w8a8.sm90_fp8_gemm(torch.zeros(2, 512), torch.zeros(256 * 512 + 1, dtype=torch.uint8)[1:].view(256, 512), s)


def test_the_reference_sums_each_block_times_both_scales():
    """``fp8_w8a8_linear`` against the formula spelt out block by block (two groups, E8M0 weight scales), and the
    quantiser's blocks: scale amax / 448, a zero block scale 0 and values 0, values within one E4M3 rounding."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 2 * 256, generator=gen)
    x[1, 128:256] = 0
    xq, sx = fp8_act_quantize(x)
    assert sx[1, 1] == 0 and (xq[1, 128:256].float() == 0).all()
    amax = x.view(3, 4, 128).abs().amax(-1)
    assert torch.equal(sx, amax / torch.full_like(amax, 448.0))
    back = xq.float().view(3, 4, 128) * sx[..., None]
    assert ((back.view(3, -1) - x).abs() <= x.abs() * 2 ** -4 + 1e-30).all()
    w = torch.randint(0, 0x7F, (2 * 128, 256), generator=gen).to(torch.uint8)
    sw = torch.randint(118, 124, (2, 2), generator=gen).to(torch.uint8)
    want = torch.zeros(3, 256, dtype=torch.float64)
    wf = fp8_block_dequantize(w, sw).double()
    for g in range(2):
        for kb in range(2):
            xs = xq[:, g * 256 + kb * 128:][:, :128].double() * sx[:, g * 2 + kb, None].double()
            want[:, g * 128:(g + 1) * 128] += xs @ wf[g * 128:(g + 1) * 128, kb * 128:(kb + 1) * 128].T
    assert torch.allclose(fp8_w8a8_linear(xq, sx, w, sw, groups=2).double(), want, rtol=1e-6, atol=0)


@pytest.mark.skipif(os.environ["CUTE_DSL_ARCH"] != "sm_90a", reason="CUTE_DSL_ARCH names another target")
@pytest.mark.parametrize("n,k,groups", PRESET_SHAPES)
def test_fp8_gemm_compiles_sm90a(n, k, groups):
    """Every configuration the pick can return for V4-Flash's and V4-Pro's FP8 linears (E8M0 scales, float32 x as
    the runtime holds it) and the quantiser."""
    assert w8a8.warmup(n, k, "cpu", groups=groups) == len(fp8_gemm_configs(n, k, groups)) + 1


@pytest.mark.skipif(os.environ["CUTE_DSL_ARCH"] != "sm_90a", reason="CUTE_DSL_ARCH names another target")
def test_fp8_gemm_compiles_sm90a_other_operands():
    """Float32 weight scales (-Base), BF16 x, and the 64-wide tile the pick does not return."""
    assert w8a8.warmup(1024, 4096, "cpu", scale_dtype=torch.float32, groups=8, x_dtype=torch.bfloat16) >= 3
    tensors = [torch.empty(4, 512, dtype=torch.uint8), torch.empty(4, 4), torch.empty(1024, 512, dtype=torch.uint8),
               torch.empty(8, 4, dtype=torch.uint8), torch.empty(4, 1024)]
    w8a8._compile(w8a8.gemm_op(Fp8GemmConfig(n=1024, k=512, block_n=64, stages=4)), tensors)


# -- on the H200 -----------------------------------------------------------------------------------------------------
def _operands(n: int, k: int, groups: int, scale_f32: bool, tokens: int, seed: int, x_dtype=torch.bfloat16):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    w, scale = random_fp8_weight(n, k, groups, scale_f32, gen)
    # a spread of magnitudes between blocks, as real activations have (each block's own scale matters)
    x = torch.randn(tokens, groups * k, device="cuda", generator=gen)
    x *= torch.exp2(torch.randint(-6, 7, (tokens, groups * k // 128, 1), device="cuda", generator=gen).float()
                    ).repeat_interleave(128, 1).view(tokens, -1)
    return w, scale, x.to(x_dtype)


def _unquantised(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, groups: int) -> torch.Tensor:
    weight = fp8_block_dequantize(w, scale)
    t = x.shape[0]
    return torch.einsum("tgk,gnk->tgn", x.float().view(t, groups, -1),
                        weight.view(groups, -1, weight.shape[1])).reshape(t, -1)


@pytest.mark.gpu
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
def test_the_quantiser_matches_torch_bit_for_bit(x_dtype):
    """Bytes and scales equal to ``fp8_act_quantize``'s, with a zero block, a block of subnormal-sized values and one
    whose amax is negative; 3000 tokens, the outputs poisoned first."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    x = (torch.randn(3000, 4096, device="cuda", generator=gen) * 3).to(x_dtype)
    x[7, 128:256] = 0
    x[8, :128] *= 1e-38
    x[9, 256:384] = -x[9, 256:384].abs()
    q = torch.full(x.shape, 0x7F, dtype=torch.uint8, device="cuda")
    s = torch.full((3000, 32), float("nan"), device="cuda")
    w8a8._launch(w8a8.Sm90Fp8ActQuant(x_f32=x_dtype == torch.float32), [x, q, s])
    want_q, want_s = fp8_act_quantize(x)
    assert torch.equal(s, want_s)
    assert torch.equal(q, want_q.view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("n,k,groups,scale_f32", [(1024, 4096, 1, False), (1536, 4096, 1, False),
                                                  (4096, 2048, 1, True), (1024, 1024, 8, False),
                                                  (6144, 1024, 1, False), (32768, 1024, 1, False),
                                                  (1024, 512, 4, True)])
def test_fp8_gemm_matches_references(n, k, groups, scale_f32):
    """T = 1, 100, 2048, 3000 (a partial token tile at the edge), E8M0 and float32 weight scales, one group and
    several, the output poisoned first: within ``ACCUMULATION_TOL`` (relative, of the output's norm) of the float32
    product of the same quantised operands, and within 4e-2 of the unquantised product: E4M3 keeps 3 mantissa bits, so each
    activation moves by up to 2**-4 of itself (on such operands the float32 reference of the quantised product is
    2.6 % off, measured on the CPU); the kernel's own distance from the unquantised product must be the reference's."""
    for tokens in (1, 100, 2048, 3000):
        w, scale, x = _operands(n, k, groups, scale_f32, tokens, seed=n + k + groups + tokens)
        out = torch.full((tokens, groups * n), float("nan"), device="cuda")
        got = w8a8.sm90_fp8_gemm(x, w, scale, groups=groups, out=out)
        assert got.data_ptr() == out.data_ptr() and got.isfinite().all()
        xq, sx = fp8_act_quantize(x)
        want = fp8_w8a8_linear(xq, sx, w, scale, groups)
        assert rel_err(got, want) < ACCUMULATION_TOL, tokens
        exact = _unquantised(x, w, scale, groups)
        assert rel_err(got, exact) < 4e-2, tokens
        assert abs(rel_err(got, exact) - rel_err(want, exact)) < ACCUMULATION_TOL, tokens


@pytest.mark.gpu
@pytest.mark.parametrize("block_n,warpgroups", [(64, 2), (128, 1), (192, 1), (192, 2)])
def test_every_tile_shape_matches_the_reference(block_n, warpgroups):
    """Each tile width and warpgroup count the kernel takes, whether or not the pick returns it at these sizes
    (a 192-wide tile starting mid scale block included: N = 768 has tiles at 0, 192, 384, 576)."""
    n, k, tokens = 768, 1024, 300
    w, scale, x = _operands(n, k, 1, False, tokens, seed=block_n + warpgroups)
    config = Fp8GemmConfig(n=n, k=k, block_n=block_n, warpgroups=warpgroups, stages=4)
    xq, sx = w8a8.quantize_activations(x)
    out = torch.full((tokens, n), float("nan"), device="cuda")
    w8a8._launch(w8a8.gemm_op(config), [xq, sx, w, scale.view(torch.uint8), out])
    want = fp8_w8a8_linear(xq.view(torch.float8_e4m3fn), sx, w, scale)
    assert rel_err(out, want) < ACCUMULATION_TOL


@pytest.mark.gpu
def test_fp8_gemm_is_captured_by_a_cuda_graph():
    """A graph of the call replays on new activations written into the captured input (nothing cached outside)."""
    w, scale, x = _operands(1024, 1024, 1, False, 256, seed=9)
    w8a8.sm90_fp8_gemm(x, w, scale)      # compiled outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = w8a8.sm90_fp8_gemm(x, w, scale)
    x.copy_(_operands(1024, 1024, 1, False, 256, seed=10)[2])
    graph.replay()
    xq, sx = fp8_act_quantize(x)
    assert rel_err(out, fp8_w8a8_linear(xq, sx, w, scale)) < ACCUMULATION_TOL
