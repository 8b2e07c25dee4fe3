"""CI (CPU-only) checks of the SM90 MoE and dense NVFP4 kernels: every configuration the heuristics pick compiles for
sm_90a, the heuristics pick what they say, and a configuration the kernels do not take is refused.

CuTeDSL 4.8 compiles without a GPU when ``CUTE_DSL_ARCH`` names the target: ``cute.compile`` on
CPU tensors (their dtypes and ranks are what the kernels specialise on; shapes stay dynamic) runs
the whole pipeline down to an sm_90a cubin. Nothing is launched.
"""

from __future__ import annotations

import dataclasses
import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import pytest  # noqa: E402
import torch  # noqa: E402

cutlass = pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed")

from nvfp4_megamoe.kernels import sm90_heuristics as heur  # noqa: E402
from nvfp4_megamoe.kernels.cute_host import compile_op  # noqa: E402
from nvfp4_megamoe.kernels.sm90_config import GemmProblem, MmaTiling, MoeShape, WgmmaTiling  # noqa: E402
from nvfp4_megamoe.kernels.sm90_gemm_family import gemm_kernel  # noqa: E402
from nvfp4_megamoe.kernels.sm90_moe import Sm90Nvfp4Moe  # noqa: E402
from nvfp4_megamoe.kernels.sm90_moe_gemm import Sm90Nvfp4MmaGemm  # noqa: E402
from nvfp4_megamoe.kernels.sm90_moe_wgmma import Sm90Nvfp4WgmmaGemm  # noqa: E402
from nvfp4_megamoe.kernels.sm90_config import replace_tilings  # noqa: E402
from sm90_stand_ins import moe_gemm_args  # noqa: E402

if os.environ["CUTE_DSL_ARCH"] != "sm_90a":
    pytest.skip("CUTE_DSL_ARCH is set to another target", allow_module_level=True)

V4 = {"flash": (4096, 2048, 256), "pro": (7168, 3072, 384)}


def _shape(model: str, tiles: bool = False, distinct: bool = True) -> MoeShape:
    h, i, e = V4[model]
    return MoeShape(h, i, e, 6, 10.0, tiles, distinct)


def _compile_plan(plan, h: int, i: int, ids_dtype: torch.dtype = torch.int64) -> None:
    routing_args, l1_args, l2_args = moe_gemm_args(h, i)
    if plan.direct:  # the GEMMs read topk_ids [P, 1] where the tiles go
        ids = torch.zeros(l1_args[5].numel(), 1, dtype=ids_dtype)
        l1_args, l2_args = [*l1_args[:6], ids, *l1_args[7:]], [*l2_args[:6], ids, *l2_args[7:]]
    else:
        from nvfp4_megamoe.kernels.sm90_moe_routing import Sm90MoeRouting
        assert compile_op(Sm90MoeRouting(experts=2, top_k=6, tile_tokens=plan.routing_tile), routing_args)
    assert compile_op(gemm_kernel(plan.l1), l1_args) is not None
    assert compile_op(gemm_kernel(plan.l2), l2_args) is not None


# decode (direct, one and two row tiles), mid T (routed mma.sync), prefill (WGMMA: one warpgroup, two, two m64 groups)
@pytest.mark.parametrize("model,tokens,tiles", [
    ("flash", 1, False), ("flash", 2, True), ("pro", 1, True), ("flash", 64, False), ("pro", 16, True),
    ("flash", 1024, False), ("flash", 4096, True), ("pro", 3000, True), ("pro", 4096, False)])
def test_moe_plans_compile_sm90a(model, tokens, tiles):
    plan = heur.moe_plan(_shape(model, tiles), tokens)
    assert plan.l1.problem.weight_tiles is tiles and plan.l2.problem.weight_tiles is tiles
    _compile_plan(plan, *V4[model][:2])


@pytest.mark.parametrize("variant", [
    dict(l1=dict(stage_x=False)),                          # the direct L1 reading x from global memory
    dict(l1=dict(block_columns=False), l2=dict(block_columns=False)),
    dict(l2=dict(k_warps=2, depth=2)),                     # L2 with two warps per row group too
])
def test_direct_variants_compile_sm90a(variant):
    """Valid configurations the heuristics do not pick at T = 2 (the GPU tests run them against the reference)."""
    plan = replace_tilings(heur.moe_plan(_shape("flash"), 2), **variant)
    _compile_plan(plan, *V4["flash"][:2], ids_dtype=torch.int32)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_dense_linear_compiles_sm90a(out_dtype):
    """Every configuration the dense linear picks, with the operands ``sm90_nvfp4_linear`` launches."""
    from nvfp4_megamoe.kernels import sm90_nvfp4_linear
    from nvfp4_megamoe.kernels.sm90_moe_wgmma import Sm90Nvfp4WgmmaGemm

    bf16 = out_dtype == torch.bfloat16
    # bf16 out: the mma.sync kernel's four token tiles; float32 out on a wide W (2048 rows): its 8- and 16-token
    # tiles (K split), then the WGMMA kernel's 32-, 64- and 128-token tiles (K split), and longer calls' 128-token
    # tiles unsplit in 128-row CTAs
    n = 1024 if bf16 else 2048
    assert sm90_nvfp4_linear.warmup(n, 4096, "cpu", out_dtype) == (4 if bf16 else 6)
    ts = (1, 8, 9, 17, 31, 32, 33, 64, 65, 128, 129, 5000)
    ops = [sm90_nvfp4_linear.linear_op(n, 4096, t, bf16) for t in ts]
    assert [isinstance(op, Sm90Nvfp4WgmmaGemm) for op in ops] == [not bf16 and t > 16 for t in ts]
    if bf16:
        assert [op.bn for op in ops] == [8, 8, 16, 32, 32, 32, 64, 64, 64, 64, 64, 64]
        assert {op.k_splits for op in ops} == {1}
        # 128-row CTAs for the 32-token tile alone
        assert [sm90_nvfp4_linear.linear_op(1024, 4096, t, True).row_tiles for t in (8, 16, 32, 64)] == [1, 1, 2, 1]
    else:
        assert [op.bn for op in ops] == [8, 8, 16, 32, 32, 32, 64, 64, 128, 128, 128, 128]
        # 32 CTAs unsplit: to 1024 with 8-token tiles (all 32 k-tiles), 256 with 16; the WGMMA tiles to 16384 / N
        # tokens' CTAs (512, 256, 128)
        assert [op.k_splits for op in ops] == [32, 32, 8, 16, 16, 16, 8, 8, 4, 4, 1, 1]
        assert [op.bm for op in ops[3:]] == [64] * 7 + [128] * 2
    # a narrow W (1024 rows) runs mma.sync up to 32 tokens, WGMMA from the 64-token tile
    assert [isinstance(sm90_nvfp4_linear.linear_op(1024, 4096, t, bf16), Sm90Nvfp4WgmmaGemm)
            for t in (32, 33)] == [False, not bf16]
    assert sm90_nvfp4_linear.can_implement(1024, 4096) and not sm90_nvfp4_linear.can_implement(96, 256)
    with pytest.raises(ValueError, match="multiple"):  # the backend asks can_implement and keeps the reference
        sm90_nvfp4_linear.warmup(96, 256, "cpu")


def test_grouped_dense_linear_compiles_sm90a():
    """wo_a's groups in one launch: 128-row groups only (whole scale atoms each), every configuration compiled."""
    from nvfp4_megamoe.kernels import sm90_nvfp4_linear

    assert sm90_nvfp4_linear.can_implement(1024, 4096, 8) and not sm90_nvfp4_linear.can_implement(64, 4096, 8)
    assert sm90_nvfp4_linear.warmup(1024, 4096, "cpu", groups=8) >= 4
    with pytest.raises(ValueError, match="groups"):
        sm90_nvfp4_linear.warmup(64, 4096, "cpu", groups=8)


def test_moe_heuristics():
    # two row tiles once L1 has two 128-row CTAs per SM: not V4-Flash at T = 1 (6 x 32 CTAs), V4-Pro at T = 1
    assert heur.pick_row_tiles(1, 6, 256, 4096, 132) == 1 and heur.pick_row_tiles(4, 6, 256, 4096, 132) == 2
    assert heur.pick_row_tiles(1, 6, 384, 6144, 132) == 2
    for hidden in (4096, 7168):
        for n in (32, 48):
            assert heur.wgmma_tiling(n, 0, hidden, hidden, 132) == WgmmaTiling(n, 0, warpgroups=1, min_ctas=3)
        assert heur.wgmma_tiling(128, 64, hidden, hidden, 132) == WgmmaTiling(128, 64, l2_ahead=8, prefetch_next=132)
    # one warpgroup up to N = 96, except for layers as wide as V4-Pro's from N = 64 (two, as above 96) ...
    for n in (64, 96):
        assert heur.wgmma_tiling(n, 0, 4096, 4096, 132) == WgmmaTiling(n, warpgroups=1, min_ctas=2, l2_ahead=8)
    # ... with two m64 groups each (256-row CTAs, 2 k-tiles in flight) up to N = 80
    for n in (64, 80):
        assert heur.wgmma_tiling(n, 0, 7168, 7168, 78) == WgmmaTiling(n, m_tiles=2, depth=2, l2_ahead=8,
                                                                     prefetch_next=78)
    assert heur.wgmma_tiling(96, 0, 7168, 7168, 78) == WgmmaTiling(96, l2_ahead=8, prefetch_next=78)
    assert not heur.use_wgmma(64, 6, 256) and heur.use_wgmma(4096, 6, 256)
    # up to N = 48 one MMA width; from 64 on, N holds mean + 3 sqrt(mean) pairs and widths run from 32
    assert heur.pick_wgmma_tile_tokens(1024, 6, 256) == (32, 0) and heur.pick_wgmma_tile_tokens(2048, 6, 384) == (48, 0)
    assert heur.pick_wgmma_tile_tokens(4096, 6, 256) == (128, 32) and heur.pick_wgmma_tile_tokens(4096, 6, 384) == (96, 32)
    assert heur.pick_wgmma_tile_tokens(8192, 6, 256) == (128, 32)  # experts overflow 128: their last tiles take any
    # one narrowest width: one plan (two WGMMA kernels) per token tile N
    for model, (h, i, e) in V4.items():
        plans = {heur.moe_plan(_shape(model), t) for t in range(1, 8193)}
        wgmma = [p for p in plans if p.wgmma]
        assert len(wgmma) == len({p.l1.tiling.tile_tokens for p in wgmma}), model
    pro = heur.moe_plan(_shape("pro"), 4096)  # N = 96 taken down to 80 for two m64 groups a warpgroup
    assert pro.wgmma and pro.routing_tile == 80 and pro.l1.tiling.min_tokens == pro.l2.tiling.min_tokens == 32
    l1, l2 = gemm_kernel(pro.l1), gemm_kernel(pro.l2)
    assert l1.bm == l2.bm == 256 and l1.wgs == 2 and l1.depth == 2 and not l2.ids_first and l1.width_step == 16
    flash = heur.moe_plan(_shape("flash"), 4096)
    assert flash.routing_tile == 128 and gemm_kernel(flash.l1).bm == 128
    assert gemm_kernel(heur.moe_plan(_shape("flash"), 2048).l1).bm == 64  # N = 80 on a narrow layer: one warpgroup
    # T = 1: one row tile (L1 with two warps per row group, each over half of K), then two; no routing kernel and
    # row tiles interleaved up to T = 4, block scales on the partial sums with two row tiles; L2 launched early (PDL)
    one = heur.moe_plan(_shape("flash"), 1)
    assert one.direct and one.l1.tiling == MmaTiling(8, 1, depth=2, k_warps=2, stage_x=True, pdl=True, max_ctas=3)
    assert one.l2.tiling == MmaTiling(8, 1, depth=4, pdl=True, max_ctas=3)
    for t in (2, 4):
        two = heur.moe_plan(_shape("flash"), t)
        assert two.l1.tiling == MmaTiling(8, 2, depth=2, interleave_rows=True, block_columns=True, stage_x=True,
                                          pdl=True)
        assert two.l2.tiling == MmaTiling(8, 2, depth=2, interleave_rows=True, block_columns=True, pdl=True)
    five = heur.moe_plan(_shape("flash"), 5)
    assert not five.direct and five.l1.tiling == MmaTiling(8, 2, depth=2) == five.l2.tiling
    # a rank holding part of the experts runs the routing kernel even for one token
    assert not heur.moe_plan(_shape("flash", distinct=False), 1).direct
    # a shape whose rows do not fill 128-row CTAs keeps one row tile at any T
    odd = MoeShape(192 * 2, 96, 8, 2)
    assert {heur.moe_plan(odd, t).l1.tiling.row_tiles for t in range(1, 65)} == {1}
    for h, i, wgmma in ((384, 256, False), (256, 384, False), (256, 128, True)):  # (256, 128): the tiny model's
        assert heur.moe_plan(MoeShape(h, i, 8, 2), 4096).wgmma is wgmma, (h, i)  # else the mma.sync kernels
    # forced paths (the GPU tests run both at any T)
    assert heur.moe_plan(_shape("flash"), 5, wgmma=True).wgmma and not heur.moe_plan(_shape("flash"), 4096,
                                                                                     wgmma=False).wgmma


def test_kernels_refuse_what_they_do_not_take():
    """Each violated rule is named, can_implement says no, and the constructor raises (a ValueError)."""
    ok = GemmProblem(m=128, k=128, mode="scatter", b_order="staged")
    cases = [
        (Sm90Nvfp4WgmmaGemm, ok, WgmmaTiling(96, min_tokens=40), "min_tokens"),
        (Sm90Nvfp4WgmmaGemm, GemmProblem(m=128, k=512, mode="store", b_order="staged", out_bf16=True),
         WgmmaTiling(depth=2, k_splits=2), "k_splits"),   # shares add in float32 only
        (Sm90Nvfp4WgmmaGemm, GemmProblem(m=128, k=512, mode="scatter", b_order="staged"),
         WgmmaTiling(depth=2, k_splits=2), "k_splits"),
        (Sm90Nvfp4WgmmaGemm, GemmProblem(m=128, k=768, mode="store", b_order="staged"),
         WgmmaTiling(depth=2, k_splits=2), "depth"),      # 3 k-tiles a share
        (Sm90Nvfp4WgmmaGemm, GemmProblem(m=128, k=512, mode="store", b_order="staged"),
         WgmmaTiling(depth=2, l2_ahead=8, prefetch_next=132), "routed tiles"),
        (Sm90Nvfp4WgmmaGemm, ok, WgmmaTiling(24), "tile_tokens"),
        (Sm90Nvfp4WgmmaGemm, GemmProblem(m=192, k=128, mode="scatter", b_order="staged"), WgmmaTiling(), "multiple of"),
        (Sm90Nvfp4WgmmaGemm, GemmProblem(m=768, k=128, mode="scatter", b_order="staged"), WgmmaTiling(m_tiles=3),
         "m_tiles"),
        (Sm90Nvfp4WgmmaGemm, ok, WgmmaTiling(m_tiles=2, depth=1), "256 rows"),
        (Sm90Nvfp4WgmmaGemm, ok, WgmmaTiling(256, depth=1), "shared memory"),  # 4 x 64 KiB: a launch would fail
        (Sm90Nvfp4WgmmaGemm, ok, WgmmaTiling(depth=1, prefetch_next=132), "prefetch_next"),
        # one k-tile in flight over several gave non-finite outputs on an H200: K / 128 must be even (or 1)
        (Sm90Nvfp4WgmmaGemm, GemmProblem(m=128, k=256, mode="scatter", b_order="staged"), WgmmaTiling(depth=1),
         "depth"),
        (Sm90Nvfp4WgmmaGemm, GemmProblem(m=128, k=128, mode="swiglu", b_order="staged", h_order="lanes"),
         WgmmaTiling(depth=1), "h_order"),
        (Sm90Nvfp4WgmmaGemm, GemmProblem(m=128, k=128, mode="scatter"), WgmmaTiling(depth=1), "staged"),
        (Sm90Nvfp4MmaGemm, GemmProblem(m=128, k=128, mode="scatter", b_order="staged"), MmaTiling(depth=1), "b_order"),
        (Sm90Nvfp4MmaGemm, GemmProblem(m=128, k=128, mode="nope"), MmaTiling(depth=1), "mode"),
        (Sm90Nvfp4MmaGemm, GemmProblem(m=100, k=128, mode="store"), MmaTiling(depth=1), "multiple of"),
        (Sm90Nvfp4MmaGemm, GemmProblem(m=128, k=128, mode="store"), MmaTiling(12, depth=1), "tile_tokens"),
        (Sm90Nvfp4MmaGemm, GemmProblem(m=128, k=384, mode="store"), MmaTiling(depth=2), "depth"),
        (Sm90Nvfp4MmaGemm, GemmProblem(m=4096, k=4096, mode="swiglu"), MmaTiling(block_columns=True),
         "one-token tiles"),
        (Sm90Nvfp4MmaGemm, GemmProblem(m=4096, k=4096, mode="swiglu"), MmaTiling(pdl=True), "pdl"),
        (Sm90Nvfp4MmaGemm, GemmProblem(m=4096, k=4096, mode="store"), MmaTiling(k_warps=2), "k_warps"),
        (Sm90Nvfp4MmaGemm, GemmProblem(m=4096, k=2048, mode="scatter"), MmaTiling(max_ctas=-1), "max_ctas"),
        (Sm90Nvfp4MmaGemm, GemmProblem(m=4096, k=2048, mode="scatter"), MmaTiling(interleave_rows=True), "interleave"),
    ]
    for family, problem, tiling, words in cases:
        assert not family.can_implement(problem, tiling), (problem, tiling)
        with pytest.raises(ValueError, match=words):
            family(problem, tiling)
    assert Sm90Nvfp4WgmmaGemm(GemmProblem(m=128, k=768, mode="scatter", b_order="staged"), WgmmaTiling(depth=2)).depth == 2
    assert Sm90Nvfp4WgmmaGemm(ok, WgmmaTiling(128, depth=1)).smem_bytes == 4 * 32768 + 2048  # one k-tile: no back edge


def test_moe_layer_can_implement():
    assert Sm90Nvfp4Moe.can_implement(_shape("flash"), 8192) and Sm90Nvfp4Moe.can_implement(_shape("pro", True), 4096)
    assert not Sm90Nvfp4Moe.can_implement(MoeShape(192, 96, 8, 2), 64)          # K = 192: not 128-K tiles
    assert not Sm90Nvfp4Moe.can_implement(MoeShape(4096, 2048, 4096, 6), 64)    # more experts than the routing takes


@pytest.mark.parametrize("cap", [1, 2, 3, 6])
def test_max_ctas_pads_shared_memory_so_one_more_cta_does_not_fit(cap):
    from nvfp4_megamoe.kernels.sm90_moe_gemm import CTA_SMEM_RESERVED, SM_SMEM_BYTES
    # the staged V4-Flash L1 of T = 1 (x row and k_warps sums in shared memory) and an L2 without shared memory
    one = heur.moe_plan(_shape("flash"), 1)
    for config in (one.l1, one.l2):
        op = gemm_kernel(dataclasses.replace(config, tiling=dataclasses.replace(config.tiling, max_ctas=cap)))
        per_cta = op.smem_bytes + CTA_SMEM_RESERVED
        assert cap * per_cta <= SM_SMEM_BYTES < (cap + 1) * per_cta
        assert op.smem_bytes >= op.staged_bytes + op.reduce_bytes and op.occupancy["preferred_smem_carveout"] == 100
    assert gemm_kernel(heur.moe_plan(_shape("flash"), 5).l2).smem_bytes == 0


def test_warmup_compiles_every_plan_a_call_can_pick():
    """A V4-Flash layer for T <= 400 on CPU stand-ins: warm-up compiles what ``moe_plan`` picks for every T."""
    from nvfp4_megamoe.kernels import cute_host

    layer = Sm90Nvfp4Moe(_shape("flash"), max_tokens=400, device="cpu")
    picked = {layer.plan(t) for t in range(1, 401)}
    assert any(plan.wgmma for plan in picked) and any(plan.direct for plan in picked)  # from 342 tokens: WGMMA
    assert layer.warmup() == len(picked)
    for plan in picked:
        for op in layer.kernels(plan):
            assert op is None or any(key[1] == op.key() for key in cute_host._COMPILED), (plan, type(op).__name__)
    assert any(key[0] == "Sm90StagedOrder" for key in cute_host._COMPILED)  # the permute of x before a WGMMA L1


def test_staged_order_kernel_compiles_sm90a():
    from nvfp4_megamoe.kernels.sm90_k_order import Sm90StagedOrder

    x = torch.empty(3, 256, dtype=torch.bfloat16)
    assert compile_op(Sm90StagedOrder(), [x, torch.empty_like(x)]) is not None


def test_register_e2m1_decode_is_exact_for_every_code_in_every_slot():
    """The kernels' ``decode_e2m1x8`` (run here on int64 tensors, the same operators the kernels trace): each
    BF16 half of word j, times 2**126, is the value of nibble j (low half) or j + 4 (high half), -0 included."""
    from nvfp4_megamoe.kernels.e2m1 import decode_e2m1
    from nvfp4_megamoe.kernels.e2m1_registers import decode_e2m1x8
    gen = torch.Generator().manual_seed(0)
    words = torch.cat([torch.randint(0, 1 << 32, (1 << 16,), generator=gen, dtype=torch.int64),
                       torch.tensor([0x11111111 * c for c in range(16)])])  # every code in every nibble
    for j, reg in enumerate(decode_e2m1x8(words)):
        reg = reg & 0xFFFFFFFF
        for half, nibble in ((reg & 0xFFFF, j), (reg >> 16, j + 4)):
            got = (half << 16).to(torch.int32).view(torch.float32).double() * 2.0 ** 126
            want = decode_e2m1(((words >> (4 * nibble)) & 0xF).to(torch.uint8)).double()
            assert torch.equal(got, want) and torch.equal(got.signbit(), want.signbit())


def test_every_dense_linear_configuration_is_valid():
    """For every dense NVFP4 linear of V4-Flash and V4-Pro (their ``flash-layer`` / ``pro-layer`` shapes) and every
    token count a decode batch or a prefill chunk has, the heuristics' configuration is one its kernel takes; the
    family, the split and 128-row CTAs are where the rules say."""
    from nvfp4_megamoe.kernels.sm90_config import WgmmaTiling
    from nvfp4_megamoe.kernels.sm90_gemm_family import gemm_can_implement
    from nvfp4_megamoe.kernels.sm90_heuristics import linear_config

    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from linear_bench import dense_shapes

    split = wgmma = 0
    for preset in ("flash-layer", "pro-layer"):
        for name, n, k, groups in dense_shapes(preset):
            rows = n * groups
            warmed = {linear_config(n, k, t, groups=groups) for t in heur.linear_token_counts()}
            for t in (*range(1, 257), 1024, 4096):
                config = linear_config(n, k, t, groups=groups)
                tiling = config.tiling
                assert gemm_can_implement(config), (preset, name, t, tiling)
                assert config in warmed, (preset, name, t)  # the load's warm-up compiled it
                bn, s = tiling.tile_tokens, tiling.k_splits
                start = heur.LINEAR_WGMMA_MIN_TILE * (2 if rows < heur.LINEAR_WGMMA_NARROW_ROWS else 1) // 2 + 1
                if isinstance(tiling, WgmmaTiling):
                    assert t >= start and bn == min(b for b in heur.LINEAR_WGMMA_TILES if b >= min(t, 128))
                    ctas = rows // (64 * tiling.warpgroups)
                    target = heur.LINEAR_WGMMA_WORK // bn
                    if t > bn:  # tensor-core bound: 128-row CTAs from 1024 rows, unsplit
                        assert s == 1 and tiling.warpgroups == (2 if rows >= 1024 else 1), (name, t)
                    else:  # the fewest shares that reach the target, or as many as keep LINEAR_WGMMA_MIN_SHARE each
                        assert tiling.warpgroups == (2 if rows // 128 >= 2 * target else 1), (name, t)
                        assert ctas * s >= target or k // (2 * s * 128) < heur.LINEAR_WGMMA_MIN_SHARE \
                            or not heur.wgmma_fits_k(k // (2 * s)), (name, t, s)
                        assert s == 1 or ctas * (s // 2) < target, (name, t, s)
                    wgmma += 1
                else:
                    assert t < start, (preset, name, t)  # every V4 shape tiles with WGMMA
                    ctas = n * groups // 64 * -(-t // bn)
                    target = heur.LINEAR_SPLIT_CTAS_8 if bn == 8 else heur.LINEAR_SPLIT_CTAS
                    # the fewest shares that reach the target, or all that divide K
                    assert ctas * s >= target or (k // 128) % (2 * s), (name, t, s)
                    assert s == 1 or ctas * (s // 2) < target, (name, t, s)
                    assert tiling.row_tiles == (2 if bn == 32 and n % 128 == 0 else 1)
                split += s > 1
    assert split > 0 and wgmma > 0
