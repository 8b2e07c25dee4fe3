"""The FP8 WGMMA linear (``kernels/sm90_fp8_wgmma.py``): its configurations on the CPU, every configuration
``bench/fp8_linear_bench.py`` times for V4-Flash and V4-Pro compiled for sm_90a (CI), and on the H200 against the
float32 reference ``fp8_linear`` (marked ``gpu``)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed")

from nvfp4_megamoe.kernels import cute_host  # noqa: E402
from nvfp4_megamoe.kernels import sm90_fp8_wgmma as wg  # noqa: E402
from nvfp4_megamoe.kernels.fp8_reference import fp8_linear  # noqa: E402
from nvfp4_megamoe.kernels.sm90_config import Fp8WgmmaConfig  # noqa: E402
from nvfp4_megamoe.kernels.sm90_heuristics import fp8_wgmma_config, fp8_wgmma_token_counts  # noqa: E402
from numeric import rel_err  # noqa: E402
from sm90_stand_ins import FP8_LINEAR_SHAPES, fp8_linear_args, random_fp8_weight  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
BENCH_TOKENS = (32, 64, 128, 2048)  # the benchmark's token counts that time ``fp8_wgmma`` (2048: ``--prefill``)


@pytest.mark.parametrize("n,k,groups", FP8_LINEAR_SHAPES)
def test_every_picked_configuration_is_taken(n, k, groups):
    """What ``fp8_wgmma_config`` picks for V4's shapes from 32 to 300 tokens the kernel takes, and the warm-up's token
    counts reach all of it."""
    warmed = {fp8_wgmma_config(n, k, t, groups) for t in fp8_wgmma_token_counts()}
    for tokens in range(32, 301):
        config = fp8_wgmma_config(n, k, tokens, groups)
        assert config in warmed and wg.Sm90Fp8WgmmaLinear.can_implement(config), (tokens, config)
    assert wg.can_implement(n, k, 32, groups)


@pytest.mark.parametrize("config,match", [
    (Fp8WgmmaConfig(n=96, k=4096), "multiple of the CTA's 64 rows"),
    (Fp8WgmmaConfig(n=192, k=4096, warpgroups=2), "multiple of the CTA's 128 rows"),
    (Fp8WgmmaConfig(n=1024, k=4000), "K=4000 must be a positive multiple of 128"),
    (Fp8WgmmaConfig(n=192, k=1024, groups=2), "above 1 only with N a multiple of 128"),
    (Fp8WgmmaConfig(n=1024, k=4096, tile_tokens=72), "tile_tokens must be a multiple of 16"),
    (Fp8WgmmaConfig(n=1024, k=4096, tile_tokens=16, warpgroups=2), "staging units"),
    (Fp8WgmmaConfig(n=1024, k=4096, k_splits=3), "divide the 32 k-tiles"),
    (Fp8WgmmaConfig(n=1024, k=384, depth=2), "depth must divide"),
    (Fp8WgmmaConfig(n=1024, k=512, depth=1), "2 or 4 unless it is one k-tile"),
])
def test_configurations_the_kernel_does_not_take_are_refused(config, match):
    assert not wg.Sm90Fp8WgmmaLinear.can_implement(config)
    with pytest.raises(ValueError, match=match):
        wg.Sm90Fp8WgmmaLinear(config)


def _bench_configs() -> list[Fp8WgmmaConfig]:
    """Every configuration ``fp8_linear_bench.py`` times in its ``fp8_wgmma`` column for V4-Flash and V4-Pro (E8M0
    scales, as it runs them), and the float32-scale form of each register shape."""
    from fp8_linear_bench import fp8_shapes

    found: dict[Fp8WgmmaConfig, None] = {}
    for preset in ("flash-layer", "pro-layer"):
        for _, n, k, groups in fp8_shapes(preset):
            for tokens in BENCH_TOKENS:
                config = fp8_wgmma_config(n, k, tokens, groups)
                if config is not None:
                    found.setdefault(config)
    shapes = {(c.tile_tokens, c.warpgroups, c.depth): c for c in found}
    for config in shapes.values():
        found.setdefault(Fp8WgmmaConfig(**{**config.__dict__, "scale_f32": True}))
    return list(found)


def test_the_bench_shapes_are_all_tiled():
    from fp8_linear_bench import fp8_shapes

    for preset in ("flash-layer", "pro-layer"):
        for name, n, k, groups in fp8_shapes(preset):
            assert all(fp8_wgmma_config(n, k, t, groups) is not None for t in BENCH_TOKENS), (preset, name)


@pytest.mark.skipif(os.environ["CUTE_DSL_ARCH"] != "sm_90a", reason="CUTE_DSL_ARCH names another target")
@pytest.mark.parametrize("config", _bench_configs(), ids=repr)
def test_fp8_wgmma_compiles_sm90a(config):
    """Each configuration the benchmark times, compiled for sm_90a with the operands' dtypes as it passes them."""
    w, scale, x, out = fp8_linear_args(scale_f32=config.scale_f32)
    assert cute_host.compile_op(wg.Sm90Fp8WgmmaLinear(config), [w, scale, x, out]) is not None


@pytest.mark.skipif(os.environ["CUTE_DSL_ARCH"] != "sm_90a", reason="CUTE_DSL_ARCH names another target")
def test_warmup_compiles_every_pick():
    """Every configuration a call the FP8 linear hands the WGMMA kernel (33 to 128 tokens) picks, and no other."""
    from nvfp4_megamoe.kernels.sm90_heuristics import FP8_WGMMA_TOKENS, fp8_wgmma_config

    picks = {fp8_wgmma_config(1024, 1024, t, 8, True) for t in range(FP8_WGMMA_TOKENS[0], FP8_WGMMA_TOKENS[1] + 1)}
    assert wg.warmup(1024, 1024, "cpu", scale_dtype=torch.float32, groups=8) == len(picks) == 2


def _operands(n: int, k: int, groups: int, scale_f32: bool, tokens: int, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    w, scale = random_fp8_weight(n, k, groups, scale_f32, gen)
    return w, scale, torch.randn(tokens, groups * k, device="cuda", generator=gen) * 2


def _want(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, groups: int) -> torch.Tensor:
    """float32 reference (``fp8_linear``) per group, on x rounded to BF16 as the kernel's host function rounds it."""
    t = x.shape[0]
    xb = x.to(torch.bfloat16).view(t, groups, -1)
    ws, n = w.view(groups, -1, w.shape[1]), w.shape[0] // groups
    return torch.cat([fp8_linear(xb[:, g], ws[g], scale[g * n // 128:(g + 1) * n // 128] if groups > 1 else scale)
                      for g in range(groups)], dim=1)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k,groups,scale_f32", [(1024, 4096, 1, False), (512, 4096, 1, False),
                                                  (4096, 8192, 1, False), (32768, 1024, 1, False),
                                                  (1024, 4096, 8, False), (1024, 1024, 8, True),
                                                  (1024, 4096, 1, True), (1536, 7168, 1, False),
                                                  (7168, 3072, 1, False)])
def test_fp8_wgmma_matches_reference(n, k, groups, scale_f32):
    """Token counts filling a tile, one past it, inside a wider one and two 128-token tiles, the output poisoned
    first (with a K split the host zeroes it). E8M0 scales: x * 2**64 * scale is exact in BF16 and each product of
    BF16 x and a decoded E4M3 weight is exact in float32, so only the float32 sums' order (tensor cores, K shares
    added by ``red.add``) differs from the reference: 1e-5, as for the mma.sync kernel. float32 scales are rounded to
    BF16 with the activations (twice 2**-9 relative a product, random in sign): 3e-3, as there."""
    for tokens in (32, 33, 100, 256):
        w, scale, x = _operands(n, k, groups, scale_f32, tokens, seed=n + k + groups + tokens)
        out = torch.full((tokens, groups * n), float("nan"), device="cuda")
        for xin in (x.to(torch.bfloat16), x):  # BF16 x, and float32 x cast by the host function
            out.fill_(float("nan"))
            got = wg.sm90_fp8_linear_wgmma(xin, w, scale, out=out, groups=groups)
            assert got.data_ptr() == out.data_ptr() and got.isfinite().all(), tokens
            assert rel_err(got, _want(x, w, scale, groups)) < (3e-3 if scale_f32 else 1e-5), tokens


@pytest.mark.gpu
def test_fp8_wgmma_matches_the_mma_sync_kernel():
    """At 64 tokens, the tile both kernels take: the same products (E8M0), only the sums' order differs."""
    from nvfp4_megamoe.kernels.sm90_fp8_linear import sm90_fp8_linear

    w, scale, x = _operands(4096, 2048, 1, False, 64, seed=5)
    xb = x.to(torch.bfloat16)
    assert rel_err(wg.sm90_fp8_linear_wgmma(xb, w, scale), sm90_fp8_linear(xb, w, scale)) < 1e-5
