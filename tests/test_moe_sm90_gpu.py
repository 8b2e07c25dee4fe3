"""GPU checks of the SM90 NVFP4 MoE kernels against the fp32 PyTorch reference (random data, poisoned outputs)."""

from __future__ import annotations

import pytest
import torch

from nvfp4_megamoe.kernels.moe_reference import moe_reference, random_moe_weights
from nvfp4_megamoe.kernels.nvfp4_reference import nvfp4_linear

from numeric import rel_err

pytestmark = pytest.mark.gpu  # tests/conftest.py skips it without an sm_90 GPU

SHAPES = {  # H, I, E, top-k
    "small": (512, 256, 16, 4),
    "flash": (4096, 2048, 256, 6),
    "pro": (7168, 3072, 384, 6),
}
CASES = [
    ("small", 1, "uniform"), ("small", 2, "skewed"), ("small", 3, "skewed"), ("small", 17, "uniform"), ("small", 130, "skewed"),
    ("small", 1001, "uniform"),
    ("flash", 1, "uniform"), ("flash", 5, "uniform"), ("flash", 64, "skewed"), ("flash", 333, "uniform"),
    ("flash", 8192, "skewed"),
    ("pro", 1, "uniform"), ("pro", 2, "skewed"), ("pro", 7, "skewed"), ("pro", 256, "uniform"), ("pro", 3000, "skewed"),
    ("pro", 4095, "uniform"),
]
_WEIGHTS: dict[str, dict] = {}
_LAYERS: dict[str, object] = {}


def _weights(shape: str) -> dict:
    if shape not in _WEIGHTS:
        _WEIGHTS.clear()  # keep one model's weights resident at a time
        h, i, e, _ = SHAPES[shape]
        gen = torch.Generator(device="cuda").manual_seed(hash(shape) % 1000)
        _WEIGHTS[shape] = random_moe_weights(e, h, i, generator=gen, device="cuda")
    return _WEIGHTS[shape]


def _layer(shape: str, planner=None, tiles: bool = False):
    """The layer of a shape, with the default heuristics or a test planner (``planner``: a name in ``PLANNERS``)."""
    from nvfp4_megamoe.kernels.sm90_config import MoeShape
    from nvfp4_megamoe.kernels.sm90_moe import Sm90Nvfp4Moe
    key = (shape, planner, tiles)
    if key not in _LAYERS:
        h, i, e, k = SHAPES[shape]
        kwargs = {} if planner is None else {"planner": PLANNERS[planner]}
        _LAYERS[key] = Sm90Nvfp4Moe(MoeShape(h, i, e, k, 10.0, tiles), max_tokens=8192, **kwargs)
    return _LAYERS[key]


def _tweaked(**changes):
    """A planner: the heuristics' plan with fields of its tilings replaced (``sm90_config.replace_tilings``)."""
    from nvfp4_megamoe.kernels.sm90_config import replace_tilings
    from nvfp4_megamoe.kernels.sm90_heuristics import moe_plan
    wgmma = changes.pop("wgmma", None)
    return lambda shape, t, sms: replace_tilings(moe_plan(shape, t, sms, wgmma=wgmma), **changes)


def _routed(shape, t, sms):
    """One token through the routing kernel too (as a rank holding part of the experts runs it)."""
    import dataclasses
    from nvfp4_megamoe.kernels.sm90_heuristics import moe_plan
    return moe_plan(dataclasses.replace(shape, distinct_experts=False), t, sms)


def _direct_up_to_8(shape, t, sms):
    """The direct plan of T = 4 (no routing kernel, one tile per pair) for up to 8 tokens: experts repeat."""
    from nvfp4_megamoe.kernels.sm90_heuristics import moe_plan
    return moe_plan(shape, min(t, 4) if t <= 8 else t, sms)


def _wgmma_n64_from_16(shape, t, sms):
    """The WGMMA path with N = 64 and MMA widths from 16."""
    import dataclasses
    from nvfp4_megamoe.kernels import sm90_heuristics as heur
    plan = heur.moe_plan(shape, t, sms, wgmma=True)
    return dataclasses.replace(
        plan, routing_tile=64,
        l1=dataclasses.replace(plan.l1, tiling=heur.wgmma_tiling(64, 16, shape.hidden, shape.hidden, sms)),
        l2=dataclasses.replace(plan.l2, tiling=heur.wgmma_tiling(64, 16, shape.hidden, shape.intermediate, sms)))


PLANNERS = {
    "wgmma": _tweaked(wgmma=True), "mma": _tweaked(wgmma=False),
    "wgmma-depth2": _tweaked(wgmma=True, both=dict(depth=2)),
    "rows2": _tweaked(both=dict(row_tiles=2, depth=2, max_ctas=0), l1=dict(k_warps=1)),
    "rows1": _tweaked(both=dict(row_tiles=1, depth=4, interleave_rows=False)),
    "small-rows2": _tweaked(wgmma=False, both=dict(row_tiles=2, depth=2)),
    "interleaved": _tweaked(both=dict(interleave_rows=True)), "not-interleaved": _tweaked(both=dict(interleave_rows=False)),
    "routed": _routed, "direct-to-8": _direct_up_to_8,
    "block-columns": _tweaked(both=dict(block_columns=True)),
    "scaled-weights-rows1": _tweaked(both=dict(block_columns=False, row_tiles=1, depth=4, interleave_rows=False)),
    "x-global": _tweaked(l1=dict(stage_x=False)),
    "l2-k-warps": _tweaked(l2=dict(k_warps=2, depth=2)), "small-l2-k-warps": _tweaked(l2=dict(k_warps=2, depth=1)),
    "routed-k-warps": _tweaked(both=dict(k_warps=2, depth=2, row_tiles=1, interleave_rows=False)),
    "no-pdl": _tweaked(both=dict(pdl=False, max_ctas=0)),
    "one-width": _tweaked(both=dict(min_tokens=0)), "wgmma-widths-from-32": _tweaked(wgmma=True, both=dict(min_tokens=32)),
    "wgmma-n64": _wgmma_n64_from_16,
}


def routing(t: int, e: int, k: int, kind: str, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct experts per token. "skewed": experts 0-1 take most tokens, the upper half gets none."""
    logits = torch.rand(t, e, device="cuda", generator=gen)
    if kind == "skewed":
        logits[:, :2] += 0.9
        logits[:, e // 2:] -= 2.0
    ids = logits.topk(k, dim=1).indices
    return ids, torch.rand(t, k, device="cuda", generator=gen) + 0.05


# the WGMMA (prefill) kernels forced at any T, and the mma.sync kernels forced at prefill sizes
FORCED = [
    ("small", 1, "uniform", "wgmma"), ("small", 130, "skewed", "wgmma"), ("small", 1001, "uniform", "wgmma"),
    ("small", 1001, "uniform", "mma"), ("flash", 5, "uniform", "wgmma"), ("flash", 64, "skewed", "wgmma"),
    ("flash", 333, "uniform", "wgmma"), ("flash", 1500, "uniform", "wgmma"), ("flash", 2800, "uniform", "wgmma"),
    ("flash", 3400, "skewed", "wgmma"), ("flash", 8192, "skewed", "wgmma"),
    ("pro", 256, "uniform", "wgmma"), ("pro", 4095, "uniform", "wgmma"), ("pro", 4095, "uniform", "mma"),
]


@pytest.mark.parametrize("shape,tokens,kind,planner", FORCED)
def test_moe_kernel_paths_match_reference(shape, tokens, kind, planner):
    test_moe_matches_reference(shape, tokens, kind, planner=planner)


# valid configurations the heuristics do not pick at these T: each configuration field away from its default
VARIANTS = [
    ("flash", 333, "uniform", "wgmma-depth2"),
    ("flash", 1, "uniform", "rows2"), ("flash", 64, "skewed", "rows1"), ("small", 130, "skewed", "small-rows2"),
    # the decode GEMMs' row tiles interleaved past the default T, and not interleaved below it
    ("flash", 64, "skewed", "interleaved"), ("pro", 4, "uniform", "not-interleaved"),
    ("flash", 1, "uniform", "routed"), ("pro", 1, "skewed", "routed"),  # one token through the routing kernel
    ("pro", 7, "uniform", "direct-to-8"),  # several tokens as one tile per routed pair, experts repeated
    # the block scales on the fp32 partial sums with one row tile (default: with two), and on the decoded weights
    # with two
    ("flash", 1, "uniform", "block-columns"), ("pro", 2, "skewed", "scaled-weights-rows1"),
    # the direct L1 reading x from global memory (default: staged in shared memory, ``stage_x``)
    ("flash", 1, "uniform", "x-global"), ("pro", 4, "skewed", "x-global"),
    # two warps per row group, each summing half of K (L1 by default at T = 1; L2 too; direct with a repeated
    # expert; routed)
    ("flash", 1, "uniform", "l2-k-warps"), ("small", 3, "skewed", "small-l2-k-warps"),
    ("flash", 16, "skewed", "routed-k-warps"),
    # direct calls with L2 launched after L1 (default: early, PDL, waiting for L1 after its first weight loads)
    ("flash", 1, "uniform", "no-pdl"),
    # the WGMMA kernels with one MMA width (default from N = 64: one k-tile loop per width), widths from 32, N = 64
    ("pro", 4095, "uniform", "one-width"), ("flash", 3400, "skewed", "wgmma-widths-from-32"),
    ("small", 1001, "uniform", "wgmma-n64"),
]


@pytest.mark.parametrize("shape,tokens,kind,planner", VARIANTS)
def test_moe_variants_match_reference(shape, tokens, kind, planner):
    test_moe_matches_reference(shape, tokens, kind, planner=planner)


# weights in Hopper row tiles (converter --target sm90): both kernel families, direct and routed
TILED = [
    ("flash", 1, "uniform"), ("flash", 4, "skewed"), ("pro", 1, "uniform"), ("pro", 7, "skewed"),
    ("flash", 64, "uniform"), ("small", 130, "skewed"), ("flash", 3400, "skewed"), ("pro", 4095, "uniform"),
]


@pytest.mark.parametrize("shape,tokens,kind", TILED)
def test_moe_with_row_tiles_matches_reference(shape, tokens, kind):
    test_moe_matches_reference(shape, tokens, kind, tiles=True)


@pytest.mark.parametrize("shape,tokens,kind", CASES)
def test_moe_matches_reference(shape, tokens, kind, planner=None, tiles=False):
    from nvfp4_megamoe.kernels.row_tiles import tile_expert_weights
    h, i, e, k = SHAPES[shape]
    w = _weights(shape)
    layer = _layer(shape, planner, tiles)
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, h, device="cuda", generator=gen).to(torch.bfloat16)
    ids, wts = routing(tokens, e, k, kind, gen)
    if kind == "skewed":
        assert int(torch.bincount(ids.flatten(), minlength=e)[e // 2:].sum()) == 0
    out = torch.full((tokens, h), float("nan"), device="cuda")
    layer.hbuf.fill_(float("nan"))
    layer(x, ids, wts, **(tile_expert_weights(w) if tiles else w), out=out)
    torch.cuda.synchronize()
    ref = moe_reference(x, ids, wts, **w, swiglu_limit=10.0)
    assert torch.isfinite(out).all(), "unwritten or non-finite outputs"
    err = rel_err(out, ref)
    assert err <= 1e-2, f"relative error {err:.3e}"
    assert float(ref.abs().mean()) > 1e-2


@pytest.mark.parametrize("scale", [2.0 ** -40, 2.0 ** 40])
@pytest.mark.parametrize("shape,tokens", [("flash", 4), ("pro", 2)])
def test_direct_moe_holds_for_small_and_large_activations(shape, tokens, scale):
    """The direct path carries x and h as 2**64 times their values (``block_columns``): inputs 2**-40 or 2**40
    times the usual size still match the reference to the same relative error."""
    h, i, e, k = SHAPES[shape]
    w = _weights(shape)
    layer = _layer(shape)
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    x = (torch.randn(tokens, h, device="cuda", generator=gen) * scale).to(torch.bfloat16)
    ids, wts = routing(tokens, e, k, "uniform", gen)
    out = torch.full((tokens, h), float("nan"), device="cuda")
    layer(x, ids, wts, **w, out=out)
    torch.cuda.synchronize()
    ref = moe_reference(x, ids, wts, **w, swiglu_limit=10.0)
    assert torch.isfinite(out).all() and float(ref.abs().max()) > 0
    err = rel_err(out, ref)
    assert err <= 1e-2, f"relative error {err:.3e}"


@pytest.mark.parametrize("t", [37, 1])
# "wgmma": the routing captured on the side stream, beside the permute of x
@pytest.mark.parametrize("planner", [None, "wgmma"])
def test_moe_int32_ids_and_cuda_graph(planner, t):
    h, i, e, k = SHAPES["small"]
    w = _weights("small")
    layer = _layer("small", planner)
    gen = torch.Generator(device="cuda").manual_seed(99)
    x = torch.randn(t, h, device="cuda", generator=gen).to(torch.bfloat16)
    ids, wts = routing(t, e, k, "uniform", gen)
    ids = ids.to(torch.int32)
    out = torch.full((t, h), float("nan"), device="cuda")
    layer(x, ids, wts, **w, out=out)  # warm-up compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        layer(x, ids, wts, **w, out=out)
    for seed in (1, 2):
        g2 = torch.Generator(device="cuda").manual_seed(seed)
        x.copy_(torch.randn(t, h, device="cuda", generator=g2).to(torch.bfloat16))
        new_ids, new_wts = routing(t, e, k, "skewed" if seed == 2 else "uniform", g2)
        ids.copy_(new_ids), wts.copy_(new_wts)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = moe_reference(x, ids, wts, **w, swiglu_limit=10.0)
        assert rel_err(out, ref) <= 1e-2


@pytest.mark.parametrize("t,kdim", [(1, 128), (37, 4096), (4095, 7168), (8192, 2048)])
def test_staged_order_kernel_equals_to_order(t, kdim):
    """The GPU permute of x into the "staged" K order gives to_order's bytes (random bits, poisoned output)."""
    from nvfp4_megamoe.kernels.cute_host import launch
    from nvfp4_megamoe.kernels.k_order import to_order
    from nvfp4_megamoe.kernels.sm90_k_order import Sm90StagedOrder

    gen = torch.Generator(device="cuda").manual_seed(t)
    x = torch.randint(-2 ** 15, 2 ** 15, (t, kdim), device="cuda", generator=gen, dtype=torch.int32)
    x = x.to(torch.int16).view(torch.bfloat16)
    out = torch.full((t + 1, kdim), float("nan"), device="cuda", dtype=torch.bfloat16)  # one row past the end
    launch(Sm90StagedOrder(), [x, out[:t]])
    torch.cuda.synchronize()
    assert torch.equal(out[:t].view(torch.int16), to_order(x, "staged").view(torch.int16))
    assert out[t].isnan().all()


# (N, K, T): float32 out splits K (32, 4, 8, 8, 1 and 4 shares: 2 token tiles at T = 128, 4 at T = 200), bf16 does not
@pytest.mark.parametrize("n,kdim,t,subnormal", [(1024, 4096, 1, 0.02), (4096, 2048, 33, 0.02), (512, 1024, 9, 1.0),
                                                 (1024, 4096, 128, 0.02), (1024, 2048, 200, 0.02),
                                                 (4096, 1024, 27, 0.02)])   # 27: 128-row CTAs
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_dense_linear(n, kdim, t, subnormal, out_dtype):
    from nvfp4_megamoe.kernels.sm90_nvfp4_linear import linear_op, sm90_nvfp4_linear
    gen = torch.Generator(device="cuda").manual_seed(n + t)
    w = random_moe_weights(1, kdim, n // 2, generator=gen, device="cuda", subnormal_fraction=subnormal)
    weight, scale, alpha = w["w13"][0], w["w13_scale"][0], w["w13_alpha"][0, 0].reshape(())
    x = torch.randn(t, kdim, device="cuda", generator=gen).to(torch.bfloat16)
    out = torch.full((t, n), float("nan"), device="cuda", dtype=out_dtype)  # poisoned: a split call zeroes it first
    sm90_nvfp4_linear(x, weight, scale, alpha, out=out)
    torch.cuda.synchronize()
    ref = nvfp4_linear(x, weight, scale, alpha)
    assert torch.isfinite(out.float()).all()
    assert rel_err(out.float(), ref) <= 1e-2
    assert (linear_op(n, kdim, t, out_dtype == torch.bfloat16).k_splits > 1) == (out_dtype == torch.float32 and t < 200)


@pytest.mark.parametrize("groups,n,kdim,t", [(8, 1024, 4096, 1), (4, 128, 1024, 37), (16, 128, 512, 130)])
def test_grouped_dense_linear(groups, n, kdim, t):
    """G linears in one launch: group g's output is x[:, g] @ W[g].T, each group against the float32 reference."""
    from nvfp4_megamoe.kernels.sm90_nvfp4_linear import sm90_nvfp4_linear
    from nvfp4_megamoe.kernels.swizzle import swizzled_row_slice

    gen = torch.Generator(device="cuda").manual_seed(groups + t)
    w = random_moe_weights(1, kdim, groups * n // 2, generator=gen, device="cuda", subnormal_fraction=0.02)
    weight, scale, alpha = w["w13"][0], w["w13_scale"][0], w["w13_alpha"][0, 0].reshape(())
    x = torch.randn(t, groups * kdim, device="cuda", generator=gen).to(torch.bfloat16)
    out = torch.full((t, groups * n), float("nan"), device="cuda")
    sm90_nvfp4_linear(x, weight, scale, alpha, out=out, out_dtype=torch.float32, groups=groups)
    torch.cuda.synchronize()
    for g in range(groups):
        rows = slice(g * n, (g + 1) * n)
        ref = nvfp4_linear(x[:, g * kdim:(g + 1) * kdim], weight[rows],
                           swizzled_row_slice(scale, groups * n, kdim // 16, g * n, (g + 1) * n), alpha)
        assert torch.isfinite(out[:, rows]).all()
        assert rel_err(out[:, rows], ref) <= 1e-2, g


@pytest.mark.parametrize("n,kdim,t,groups,bn,wgs,splits", [
    (512, 4096, 45, 1, 64, 1, 8),      # K split, one partial token tile
    (1024, 1024, 300, 1, 128, 2, 1),   # three token tiles, the last partial
    (256, 2048, 32, 2, 32, 1, 4),      # two groups, K split
    (384, 1536, 130, 3, 128, 1, 1),    # three groups, one warpgroup at N = 128, 12 k-tiles
])
def test_dense_linear_wgmma(n, kdim, t, groups, bn, wgs, splits):
    """The WGMMA kernel in mode "store" (token tiles, groups, K shares) against the float32 reference, each group on
    its own; the output row past the call's stays poisoned."""
    from nvfp4_megamoe.kernels.cute_host import launch
    from nvfp4_megamoe.kernels.k_order import to_order
    from nvfp4_megamoe.kernels.sm90_config import GemmConfig, GemmProblem
    from nvfp4_megamoe.kernels.sm90_gemm_family import gemm_kernel
    from nvfp4_megamoe.kernels.sm90_heuristics import linear_wgmma_tiling
    from nvfp4_megamoe.kernels.sm90_nvfp4_linear import _operands
    from nvfp4_megamoe.kernels.swizzle import swizzled_row_slice

    tiling = linear_wgmma_tiling(n, kdim, t, groups, tile_tokens=bn, warpgroups=wgs, k_splits=splits)
    op = gemm_kernel(GemmConfig(GemmProblem(m=n, k=kdim, mode="store", b_order="staged", groups=groups), tiling))
    gen = torch.Generator(device="cuda").manual_seed(n + t)
    w = random_moe_weights(1, kdim, groups * n // 2, generator=gen, device="cuda", subnormal_fraction=0.02)
    weight, scale, alpha = w["w13"][0], w["w13_scale"][0], w["w13_alpha"][0, 0].reshape(())
    x = torch.randn(t, groups * kdim, device="cuda", generator=gen).to(torch.bfloat16)
    out = torch.full((t + 1, groups * n), float("nan"), device="cuda")
    if splits > 1:
        out[:t].zero_()  # the shares add into it
    launch(op, _operands(to_order(x, "staged"), weight, scale, alpha, out[:t]))
    torch.cuda.synchronize()
    assert out[t].isnan().all()
    for g in range(groups):
        rows = slice(g * n, (g + 1) * n)
        ref = nvfp4_linear(x[:, g * kdim:(g + 1) * kdim], weight[rows],
                           swizzled_row_slice(scale, groups * n, kdim // 16, g * n, (g + 1) * n), alpha)
        assert torch.isfinite(out[:t, rows]).all(), g
        assert rel_err(out[:t, rows], ref) <= 1e-2, g


def test_no_call_compiles_after_warmup():
    """After ``warmup`` no token count up to ``max_tokens`` compiles (so a graph capture never does)."""
    from nvfp4_megamoe.kernels import cute_host
    from nvfp4_megamoe.kernels.sm90_config import MoeShape
    from nvfp4_megamoe.kernels.sm90_moe import Sm90Nvfp4Moe

    h, i, e, k = SHAPES["small"]
    w = _weights("small")
    layer = Sm90Nvfp4Moe(MoeShape(h, i, e, k, 10.0), max_tokens=300)
    assert layer.warmup() >= 2
    compiled = len(cute_host._COMPILED)
    gen = torch.Generator(device="cuda").manual_seed(5)
    for t in (1, 2, 7, 33, 150, 300):
        x = torch.randn(t, h, device="cuda", generator=gen).to(torch.bfloat16)
        ids, wts = routing(t, e, k, "uniform", gen)
        out = layer(x, ids.to(torch.int32), wts, **w)
        torch.cuda.synchronize()
        assert rel_err(out, moe_reference(x, ids, wts, **w, swiglu_limit=10.0)) <= 1e-2
    assert len(cute_host._COMPILED) == compiled


def test_kernels_loaded_from_the_disk_cache_compute_the_same(tmp_path, monkeypatch):
    """Kernels written to ``NVFP4_MEGAMOE_KERNEL_CACHE`` and loaded back (no compile) give the same bytes."""
    import cutlass.cute as cute

    from nvfp4_megamoe.kernels import cute_host
    from nvfp4_megamoe.kernels.sm90_config import MoeShape
    from nvfp4_megamoe.kernels.sm90_moe import Sm90Nvfp4Moe

    monkeypatch.setenv(cute_host.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(cute_host, "_COMPILED", {})
    h, i, e, k = SHAPES["small"]
    w = _weights("small")
    layer = Sm90Nvfp4Moe(MoeShape(h, i, e, k, 10.0), max_tokens=64)
    gen = torch.Generator(device="cuda").manual_seed(11)
    x = torch.randn(29, h, device="cuda", generator=gen).to(torch.bfloat16)
    ids, wts = routing(29, e, k, "skewed", gen)
    compiled = layer(x, ids, wts, **w).clone()
    assert any(tmp_path.glob("*.o"))
    monkeypatch.setattr(cute_host, "_COMPILED", {})
    monkeypatch.setattr(cute, "compile", lambda *a, **kw: (_ for _ in ()).throw(AssertionError("compiled")))
    loaded = layer(x, ids, wts, **w)
    torch.cuda.synchronize()
    assert torch.equal(loaded, compiled) or rel_err(loaded, compiled) < 1e-6  # atomics may reorder the sums
