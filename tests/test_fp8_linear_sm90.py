"""The FP8 dense linear (``kernels/sm90_fp8_linear.py``): its decode rules and configurations on the CPU, its kernels
compiled for sm_90a (CI), and on the H200 against the float32 reference ``fp8_linear`` (marked ``gpu``)."""

from __future__ import annotations

import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed")

from nvfp4_megamoe.kernels import sm90_fp8_linear as fp8  # noqa: E402
from nvfp4_megamoe.kernels.fp8 import fp8_block_dequantize  # noqa: E402
from nvfp4_megamoe.kernels.sm90_config import Fp8LinearConfig  # noqa: E402
from nvfp4_megamoe.kernels.sm90_heuristics import (  # noqa: E402
    FP8_KERNEL_MAX_TOKENS, fp8_kernel_pays, fp8_linear_config, fp8_linear_token_counts)
from numeric import rel_err  # noqa: E402
from sm90_stand_ins import FP8_LINEAR_SHAPES, random_fp8_weight  # noqa: E402



def _bf16_of_bits(bits: torch.Tensor) -> torch.Tensor:
    """16-bit patterns (int64) -> the BF16 values they encode, as float32."""
    return torch.where(bits >= 1 << 15, bits - (1 << 16), bits).to(torch.int16).view(torch.bfloat16).float()


def test_an_e4m3_byte_in_bf16_bits_reads_as_its_value_times_a_power_of_two():
    """The kernel's decode: byte b in the high byte of a half, then sign kept and exponent-mantissa moved down 4 bits,
    is b's value times 2**-DECODE_LOG2 for every finite code, subnormals and both zeros included."""
    codes = torch.arange(256)
    codes = codes[(codes & 0x7F) != 0x7F]                     # 0x7F and 0xFF are NaN
    t = codes << 8
    bits = (t & (fp8._SIGN & 0xFFFF)) | ((t >> 4) & (fp8._MAGNITUDE & 0xFFFF))
    want = codes.to(torch.uint8).view(torch.float8_e4m3fn).float() * 2.0 ** -fp8.DECODE_LOG2
    assert torch.equal(_bf16_of_bits(bits), want)
    assert torch.equal(_bf16_of_bits(bits).signbit(), want.signbit())


def test_the_activation_multiplier_of_an_e8m0_scale_is_exact():
    """BF16 bits ``(e + X_LOG2) << 7`` are ``2**X_LOG2`` times the E8M0 scale ``2**(e - 127)`` for every scale the
    kernel takes (up to 2**63)."""
    e = torch.arange(0, 127 + 63 + 1)
    got = _bf16_of_bits((e + fp8.X_LOG2) << 7)
    assert torch.equal(got, torch.exp2((e - 127 + fp8.X_LOG2).double()).float())


def test_scales_past_what_the_multiplier_holds_are_not_taken():
    """Block scales up to 2**63 (E8M0 byte 190) are taken; larger, negative or not finite ones are not (the backend
    runs those weights on the reference)."""
    e8m0 = torch.full((2, 3), 120, dtype=torch.uint8)
    assert fp8.scales_fit(e8m0) and fp8.scales_fit(e8m0.view(torch.float8_e8m0fnu))
    e8m0[1, 2] = fp8.MAX_E8M0
    assert fp8.scales_fit(e8m0)
    e8m0[1, 2] = fp8.MAX_E8M0 + 1
    assert not fp8.scales_fit(e8m0) and not fp8.scales_fit(e8m0.view(torch.float8_e8m0fnu))
    f32 = torch.full((2, 3), 2.0 ** -9)
    assert fp8.scales_fit(f32)
    for bad in (2.0 ** 64, float("inf"), float("nan"), -1.0):
        f32[0, 0] = bad
        assert not fp8.scales_fit(f32), bad


@pytest.mark.parametrize("n,k,groups", FP8_LINEAR_SHAPES)
def test_every_picked_configuration_is_taken(n, k, groups):
    """What the heuristics pick for V4's shapes, at every token count the kernel runs, the kernel takes, and the
    warm-up's token counts reach all of it (no call compiles)."""
    warmed = {fp8_linear_config(n, k, t, False, groups) for t in fp8_linear_token_counts()}
    for tokens in range(1, FP8_KERNEL_MAX_TOKENS + 1):
        config = fp8_linear_config(n, k, tokens, False, groups)
        assert config in warmed and fp8.Sm90Fp8Linear.can_implement(config), config
        assert fp8.Sm90Fp8Linear.can_implement(fp8_linear_config(n, k, tokens, True, groups))
    assert fp8.can_implement(n, k, groups) and not fp8_kernel_pays(FP8_KERNEL_MAX_TOKENS + 1)


@pytest.mark.parametrize("config,match", [
    (Fp8LinearConfig(n=96, k=4096), "multiple of the CTA's 64 rows"),
    (Fp8LinearConfig(n=1024, k=4000), "K=4000 must be a positive multiple of 128"),
    (Fp8LinearConfig(n=192, k=1024, groups=2), "above 1 only with N a multiple of 128"),
    (Fp8LinearConfig(n=1024, k=4096, tile_tokens=72), "tile_tokens must be a multiple of 8"),
    (Fp8LinearConfig(n=1024, k=4096, k_splits=2, out_bf16=True), "1 with BF16 out"),
    (Fp8LinearConfig(n=1024, k=4096, row_tiles=2, depth=4), "at most 4 / row_tiles"),
    (Fp8LinearConfig(n=1024, k=384, depth=2), "divide each of the 1 K shares' k-tiles"),
])
def test_configurations_the_kernel_does_not_take_are_refused(config, match):
    assert not fp8.Sm90Fp8Linear.can_implement(config)
    with pytest.raises(ValueError, match=match):
        fp8.Sm90Fp8Linear(config)


@pytest.mark.skipif(os.environ["CUTE_DSL_ARCH"] != "sm_90a", reason="CUTE_DSL_ARCH names another target")
@pytest.mark.parametrize("n,k,groups,scale_dtype,x_dtype", [(1024, 4096, 1, torch.uint8, torch.float32),
                                                         (1024, 1024, 8, torch.float32, torch.bfloat16)])
def test_fp8_linear_compiles_sm90a(n, k, groups, scale_dtype, x_dtype):
    """Every configuration a weight's calls pick (E8M0 and float32 scales, one group and several, x as the runtime
    passes it and in BF16), and the long calls' dequantisation."""
    assert fp8.warmup(n, k, "cpu", scale_dtype=scale_dtype, groups=groups, x_dtype=x_dtype) >= 5


def _operands(n: int, k: int, groups: int, scale_f32: bool, tokens: int, seed: int, subnormal: bool = False):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    w, scale = random_fp8_weight(n, k, groups, scale_f32, gen, subnormal)
    x = (torch.randn(tokens, groups * k, device="cuda", generator=gen) * 2).to(torch.bfloat16)
    return w, scale, x


def _want(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, groups: int) -> torch.Tensor:
    """float32 reference: ``x[t, g] @ W[g].T`` with W dequantised whole."""
    weight = fp8_block_dequantize(w, scale)
    t = x.shape[0]
    return torch.einsum("tgk,gnk->tgn", x.float().view(t, groups, -1),
                        weight.view(groups, -1, weight.shape[1])).reshape(t, -1)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k,groups,scale_f32", [(512, 4096, 1, False), (1024, 4096, 1, False),
                                                  (1024, 4096, 8, False), (4096, 2048, 1, False),
                                                  (32768, 1024, 1, False), (1024, 4096, 1, True),
                                                  (1024, 1024, 8, True), (1536, 7168, 1, False)])
def test_fp8_linear_kernel_matches_reference(n, k, groups, scale_f32):
    """Token counts inside one tile, across tiles, past the widest and past the kernel's range (W dequantised to BF16,
    cuBLAS), the output poisoned first. E8M0 scales: the same products as the reference, only the float32 sums' order
    differs; float32 scales are rounded to BF16 with the activations, or with the weights (module docstring)."""
    for tokens in (1, 3, 8, 13, 32, 40, 64, 128, 200, 300):
        w, scale, x = _operands(n, k, groups, scale_f32, tokens, seed=n + k + groups + tokens)
        out = torch.full((tokens, groups * n), float("nan"), device="cuda")
        got = fp8.sm90_fp8_linear(x, w, scale, out=out, groups=groups)
        assert got.data_ptr() == out.data_ptr() and got.isfinite().all()
        assert rel_err(got, _want(x, w, scale, groups)) < (3e-3 if scale_f32 else 1e-5), tokens
        # float32 x (the runtime's), rounded to BF16 by the kernel as torch rounds it
        x32 = x.float() + torch.randn(x.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(
            tokens)) * 2 ** -9
        got = fp8.sm90_fp8_linear(x32, w, scale, groups=groups)
        assert rel_err(got, _want(x32.to(torch.bfloat16), w, scale, groups)) < (3e-3 if scale_f32 else 1e-5), tokens


@pytest.mark.gpu
@pytest.mark.parametrize("scale_f32", [False, True])
def test_the_dequantisation_kernel_matches_torch(scale_f32):
    """``Sm90Fp8Dequant`` (the long calls' W in BF16) against ``fp8_block_dequantize``: bit for bit with E8M0 scales
    (the products are exact; the scales include 2**-127 and 2**63), within one BF16 rounding with float32 ones; 200
    rows (a partial block row), the output poisoned first."""
    w, scale, _ = _operands(100, 384, 2, scale_f32, 1, seed=21)
    if not scale_f32:
        scale.view(torch.uint8)[0, 0], scale.view(torch.uint8)[1, 2] = 0, fp8.MAX_E8M0
    out = torch.full(w.shape, float("nan"), dtype=torch.bfloat16, device="cuda")
    fp8._launch(fp8.Sm90Fp8Dequant(scale_f32=scale_f32), [w, fp8._scale_operand(scale), out])
    want = fp8_block_dequantize(w, scale)
    if scale_f32:
        assert ((out.float() - want).abs() <= want.abs() * 2 ** -8).all()
    else:
        assert torch.equal(out, want.to(torch.bfloat16))


@pytest.mark.gpu
def test_fp8_linear_keeps_subnormal_weights_and_writes_bf16():
    """Weights of subnormal codes alone (a flush to zero would show), and BF16 out (one rounding of the sums)."""
    w, scale, x = _operands(1024, 4096, 1, False, 5, seed=3, subnormal=True)
    want = _want(x, w, scale, 1)
    assert rel_err(fp8.sm90_fp8_linear(x, w, scale), want) < 1e-5
    out = torch.full((5, 1024), float("nan"), dtype=torch.bfloat16, device="cuda")
    assert rel_err(fp8.sm90_fp8_linear(x, w, scale, out=out), want) < 4e-3


@pytest.mark.gpu
def test_hopper_backend_runs_fp8_linears_on_the_kernel():
    """``--dense keep`` weights: ``linear`` and ``grouped_linear`` (``wo_a``) launch the FP8 kernel and match the
    reference backend; a weight the kernel does not tile (N = 96) stays on the reference."""
    from nvfp4_megamoe.runtime.backend import ReferenceBackend
    from nvfp4_megamoe.runtime.hopper import HopperBackend
    from nvfp4_megamoe.runtime.weights import Fp8Linear

    be, ref = HopperBackend(), ReferenceBackend()
    w, scale, x = _operands(1024, 4096, 1, False, 6, seed=11)
    lin = Fp8Linear(w.view(torch.float8_e4m3fn), scale)
    xs = x.float().view(2, 3, 4096)
    got = be.linear(xs, lin)
    assert be.kernel_calls["linear"] == 1 and got.shape == (2, 3, 1024)
    assert rel_err(got, ref.linear(xs, lin)) < 1e-5
    w, scale, x = _operands(256, 512, 4, False, 6, seed=12)
    grouped = Fp8Linear(w.view(torch.float8_e4m3fn), scale)
    xg = x.float().view(2, 3, 4, 512)
    got = be.grouped_linear(xg, grouped, 4)
    assert be.kernel_calls["linear"] == 2 and got.shape == (2, 3, 4, 256)
    assert rel_err(got, ref.grouped_linear(xg, grouped, 4)) < 1e-5
    w, scale, x = _operands(96, 512, 1, False, 2, seed=13)
    odd = Fp8Linear(w.view(torch.float8_e4m3fn), scale)
    assert rel_err(be.linear(x.float(), odd), ref.linear(x.float(), odd)) < 1e-6
    assert be.kernel_calls["linear"] == 2
    w, scale, x = _operands(1024, 4096, 1, False, 2, seed=14)   # a block scale of 2**73: the reference's
    scale.view(torch.uint8)[3, 5] = fp8.MAX_E8M0 + 10
    huge = Fp8Linear(w.view(torch.float8_e4m3fn), scale)
    assert rel_err(be.linear(x.float(), huge), ref.linear(x.float(), huge)) < 1e-6
    assert be.kernel_calls["linear"] == 2
