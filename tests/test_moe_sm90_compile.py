"""CI (CPU-only) check that every SM90 MoE CuTeDSL kernel compiles for sm_90a.

CuTeDSL 4.8 compiles without a GPU when ``CUTE_DSL_ARCH`` names the target: ``cute.compile`` on
CPU tensors (their dtypes and ranks are what the kernels specialise on; shapes stay dynamic) runs
the whole pipeline down to an sm_90a cubin. Nothing is launched.
"""

from __future__ import annotations

import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import pytest  # noqa: E402
import torch  # noqa: E402

cutlass = pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed")

from nvfp4_megamoe.kernels.cute_host import compile_op  # noqa: E402
from nvfp4_megamoe.kernels.sm90_moe import Sm90NvFp4MoE  # noqa: E402
from nvfp4_megamoe.kernels.sm90_moe_gemm import Sm90Nvfp4GroupedGemm  # noqa: E402
from sm90_stand_ins import moe_gemm_args  # noqa: E402

if os.environ["CUTE_DSL_ARCH"] != "sm_90a":
    pytest.skip("CUTE_DSL_ARCH is set to another target", allow_module_level=True)

V4 = {"flash": (4096, 2048, 256), "pro": (7168, 3072, 384)}


class _Layer:
    """The attributes Sm90NvFp4MoE.kernels reads, without allocating CUDA workspaces."""

    def __init__(self, h, i, e, k, limit, tuning=None, weight_tiles=False):
        self.h, self.i, self.e, self.k, self.limit = h, i, e, k, limit
        self.tuning, self.weight_tiles = tuning or {}, weight_tiles
        self.sms = 132


# the tunings: PDL with and without the L2 prefetch of the L2 weights, the L2 load hints, deeper pipelines
PDL = {"pdl": True, "pdl_prefetch": True, "l2_prefetch": 256}


@pytest.mark.parametrize("model,tile_tokens,wgmma,tuning,tiles", [
    ("flash", 8, False, None, False), ("flash", 64, False, None, False), ("pro", 8, False, None, False),
    ("pro", 64, False, None, False), ("flash", 8, False, PDL, False),
    ("pro", 16, False, {"pdl": True, "l2_prefetch": 128, "l2": {"split_k": 2}}, False),
    ("flash", 8, False, {"depth": 8, "l2_prefetch": 64}, False),
    ("pro", 16, False, {"row_tiles": 2, "depth": 2, "pdl": True, "l2": {"split_k": 2}}, False),
    ("flash", 32, True, None, False), ("flash", 80, True, None, False), ("flash", 128, True, None, False),
    ("pro", 96, True, None, False), ("flash", 128, True, {"wg": {"l2_prefetch": 256}}, False),
    # weights in Hopper row tiles (converter --target sm90); routed tiles with two warps per row group
    ("flash", 8, False, PDL, True), ("pro", 16, False, {"row_tiles": 2, "depth": 2}, True),
    ("flash", 8, False, {"min_ctas": 2, "l1": {"k_warps": 2}, "l2": {"k_warps": 2}}, True),
    ("flash", 128, True, None, True),
    # one k-tile loop per MMA width (``min_tokens``), in steps of 16 and of 8
    ("pro", 96, True, {"wg": {"min_tokens": 48}}, True), ("pro", 80, True, {"wg": {"min_tokens": 48}}, True),
    ("pro", 80, True, {"wg": {"min_tokens": 48}}, False),
    ("flash", 128, True, {"wg": {"min_tokens": 64, "width_step": 8}}, True)])
def test_moe_kernels_compile_sm90a(model, tile_tokens, wgmma, tuning, tiles):
    h, i, experts = V4[model]
    routing, l1, l2 = Sm90NvFp4MoE.kernels(_Layer(h, i, experts, 6, 10.0, tuning, tiles), tile_tokens, wgmma)
    assert l1.weight_tiles is tiles and l2.weight_tiles is tiles
    # a CPU stand-in with 2 experts and 3 tokens: E and T are runtime sizes
    for op, args in zip((routing, l1, l2), moe_gemm_args(h, i)):
        assert compile_op(op, args) is not None


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_dense_linear_compiles_sm90a(out_dtype):
    """Every token tile the dense linear picks, with the operands ``nvfp4_linear_sm90`` launches."""
    from nvfp4_megamoe.kernels.sm90_moe import dense_linear_op, warmup_nvfp4_linear

    assert warmup_nvfp4_linear(1024, 4096, "cpu", out_dtype) == 4
    assert [dense_linear_op(1024, 4096, t).bn for t in (1, 8, 9, 17, 33, 64, 5000)] == [8, 8, 16, 32, 64, 64, 64]
    with pytest.raises(ValueError, match="multiple"):  # the runtime falls back to the reference on this
        warmup_nvfp4_linear(96, 256, "cpu")


def test_wgmma_heuristics_and_bad_config():
    from nvfp4_megamoe.kernels.sm90_moe import pick_row_tiles, pick_wgmma_tile_tokens, use_wgmma, wgmma_shape
    # two row tiles once L1 has two 128-row CTAs per SM: not V4-Flash at T = 1 (6 x 32 CTAs), V4-Pro at T = 1
    assert pick_row_tiles(1, 6, 256, 4096, 132) == 1 and pick_row_tiles(4, 6, 256, 4096, 132) == 2
    assert pick_row_tiles(1, 6, 384, 6144, 132) == 2
    for hidden in (4096, 7168):
        assert wgmma_shape(32, hidden) == {"warpgroups": 1, "min_ctas": 3} == wgmma_shape(48, hidden)
        assert wgmma_shape(128, hidden, 132) == {"l2_ahead": 8, "prefetch_next": 132}
    # one warpgroup up to N = 96, except for layers as wide as V4-Pro's from N = 64 (two, as above 96)
    assert wgmma_shape(64, 4096) == {"warpgroups": 1, "min_ctas": 2, "l2_ahead": 8} == wgmma_shape(96, 4096)
    # ... with two m64 groups each (256-row CTAs) up to N = 80
    two_groups = {"m_tiles": 2, "depth": 2, "l2_ahead": 8, "prefetch_next": 78}
    assert wgmma_shape(64, 7168, 78) == two_groups == wgmma_shape(80, 7168, 78)
    assert wgmma_shape(96, 7168, 78) == {"l2_ahead": 8, "prefetch_next": 78}
    pro = Sm90NvFp4MoE.kernels(_Layer(7168, 3072, 384, 6, 10.0), 80, True)
    flash = Sm90NvFp4MoE.kernels(_Layer(4096, 2048, 256, 6, 10.0), 80, True)
    assert pro[1].wgs == pro[2].wgs == 2 and flash[1].wgs == flash[2].wgs == 1
    assert pro[1].bm == pro[2].bm == 256 and pro[1].depth == 2 and flash[1].bm == 64
    # a shape whose rows do not fill 128-row CTAs keeps one row tile at any T
    odd = Sm90NvFp4MoE(hidden=192, intermediate=96, experts=8, top_k=2, swiglu_limit=None, max_tokens=64, device="cpu")
    assert {odd.config(t)[2] for t in range(1, 65)} == {1}
    from nvfp4_megamoe.kernels.sm90_moe_wgmma import Sm90Nvfp4WgmmaGemm
    assert not use_wgmma(64, 6, 256) and use_wgmma(4096, 6, 256)
    # up to N = 48 one MMA width; from 64 on, N holds mean + 3 sqrt(mean) pairs and widths run from mean - 2 sqrt(mean)
    assert pick_wgmma_tile_tokens(1024, 6, 256) == (32, 0) and pick_wgmma_tile_tokens(2048, 6, 384) == (48, 0)
    assert pick_wgmma_tile_tokens(4096, 6, 256) == (128, 64) and pick_wgmma_tile_tokens(4096, 6, 384) == (96, 48)
    assert pick_wgmma_tile_tokens(8192, 6, 256) == (128, 32)  # experts overflow 128: their last tiles take any count
    layer = Sm90NvFp4MoE(hidden=7168, intermediate=3072, experts=384, top_k=6, swiglu_limit=10.0, max_tokens=4096,
                         device="cpu")
    cfg = layer.config(4096)  # N = 96 taken down to 80 for two m64 groups a warpgroup (the experts above: two tiles)
    assert (cfg.tile_tokens, cfg.wgmma, cfg.min_tokens) == (80, True, 48)
    _, l1, l2 = layer.kernels(*cfg)
    assert l1.bn == l2.bn == 80 and l1.min_tokens == l2.min_tokens == 48 and l1.width_step == 16
    assert l1.bm == l2.bm == 256 and not l2.ids_first
    flash = Sm90NvFp4MoE(hidden=4096, intermediate=2048, experts=256, top_k=6, swiglu_limit=10.0, max_tokens=4096,
                         device="cpu")
    assert flash.config(4096).tile_tokens == 128 and flash.kernels(*flash.config(4096))[1].bm == 128
    forced = Sm90NvFp4MoE(hidden=7168, intermediate=3072, experts=384, top_k=6, swiglu_limit=10.0, max_tokens=4096,
                          device="cpu", tuning={"wgmma_tile_tokens": 80})
    assert forced.config(4096).tile_tokens == 80 and forced.kernels(*forced.config(4096))[1].min_tokens == 80
    with pytest.raises(ValueError, match="min_tokens"):
        Sm90Nvfp4WgmmaGemm(m=128, k=128, mode="scatter", tile_tokens=96, min_tokens=40)
    with pytest.raises(ValueError, match="width_step"):
        Sm90Nvfp4WgmmaGemm(m=128, k=128, mode="scatter", tile_tokens=96, min_tokens=48, width_step=12)
    with pytest.raises(ValueError, match="modes"):
        Sm90Nvfp4WgmmaGemm(m=128, k=128, mode="store")
    with pytest.raises(ValueError, match="tile_tokens"):
        Sm90Nvfp4WgmmaGemm(m=128, k=128, mode="scatter", tile_tokens=24)
    with pytest.raises(ValueError, match="multiple of"):
        Sm90Nvfp4WgmmaGemm(m=192, k=128, mode="scatter")
    with pytest.raises(ValueError, match="stages"):
        Sm90Nvfp4WgmmaGemm(m=128, k=128, mode="scatter", stages=2)
    with pytest.raises(ValueError, match="m_tiles"):
        Sm90Nvfp4WgmmaGemm(m=768, k=128, mode="scatter", m_tiles=3)
    with pytest.raises(ValueError, match="256 rows"):
        Sm90Nvfp4WgmmaGemm(m=128, k=128, mode="scatter", m_tiles=2)
    with pytest.raises(ValueError, match="shared memory"):  # 8 x 32 KiB: the launch failed on an H200
        Sm90Nvfp4WgmmaGemm(m=128, k=128, mode="scatter", tile_tokens=128, stages=8)
    assert Sm90Nvfp4WgmmaGemm(m=128, k=128, mode="scatter", tile_tokens=128, stages=6).smem_bytes == 6 * 32768 + 2048
    with pytest.raises(ValueError, match="prefetch_next"):
        Sm90Nvfp4WgmmaGemm(m=128, k=128, mode="scatter", prefetch_next=132)  # it continues the l2_ahead prefetches
    # one k-tile in flight over several gave non-finite outputs on an H200: K / 128 must be even (or 1)
    with pytest.raises(ValueError, match="depth >= 2"):
        Sm90Nvfp4WgmmaGemm(m=128, k=384, mode="scatter")
    with pytest.raises(ValueError, match="depth >= 2"):
        Sm90Nvfp4WgmmaGemm(m=128, k=256, mode="scatter", depth=1)
    assert Sm90Nvfp4WgmmaGemm(m=128, k=768, mode="scatter").depth == 2
    assert Sm90Nvfp4WgmmaGemm(m=128, k=128, mode="scatter").depth == 1  # one k-tile: no loop back edge
    for h, i, wgmma in ((384, 256, False), (256, 384, False), (256, 128, True)):  # (256, 128): the tiny model's
        moe = Sm90NvFp4MoE(hidden=h, intermediate=i, experts=8, top_k=2, swiglu_limit=None, max_tokens=4096,
                           device="cpu")
        assert moe.config(4096).wgmma is wgmma, (h, i)  # otherwise the mma.sync kernels
    with pytest.raises(ValueError, match="h_order"):
        Sm90Nvfp4WgmmaGemm(m=128, k=128, mode="swiglu", h_order="lanes")
    with pytest.raises(ValueError, match="b_order"):
        Sm90Nvfp4GroupedGemm(m=128, k=128, mode="scatter", b_order="staged")


@pytest.mark.parametrize("cap", [1, 2, 3, 6])
def test_max_ctas_pads_shared_memory_so_one_more_cta_does_not_fit(cap):
    from nvfp4_megamoe.kernels.sm90_moe_gemm import CTA_SMEM_RESERVED, SM_SMEM_BYTES
    # the staged V4-Flash L1 of T = 1 (x row and k_warps sums in shared memory) and an L2 without shared memory
    for op in (Sm90Nvfp4GroupedGemm(m=4096, k=4096, mode="swiglu", direct_top_k=6, stage_x=True, k_warps=2,
                                    max_ctas=cap),
               Sm90Nvfp4GroupedGemm(m=4096, k=2048, mode="scatter", direct_top_k=6, max_ctas=cap)):
        per_cta = op.smem_bytes + CTA_SMEM_RESERVED
        assert cap * per_cta <= SM_SMEM_BYTES < (cap + 1) * per_cta
        assert op.smem_bytes >= op.staged_bytes + op.reduce_bytes and op.occupancy["preferred_smem_carveout"] == 100
    assert Sm90Nvfp4GroupedGemm(m=4096, k=2048, mode="scatter").smem_bytes == 0
    with pytest.raises(ValueError, match="max_ctas"):
        Sm90Nvfp4GroupedGemm(m=4096, k=2048, mode="scatter", max_ctas=-1)


def test_gemm_rejects_bad_config():
    with pytest.raises(ValueError, match="mode"):
        Sm90Nvfp4GroupedGemm(m=128, k=128, mode="nope")
    with pytest.raises(ValueError, match="multiple of"):
        Sm90Nvfp4GroupedGemm(m=100, k=128, mode="store")
    with pytest.raises(ValueError, match="tile_tokens"):
        Sm90Nvfp4GroupedGemm(m=128, k=128, mode="store", tile_tokens=12)
    with pytest.raises(ValueError, match="l2_prefetch"):
        Sm90Nvfp4GroupedGemm(m=128, k=128, mode="store", l2_prefetch=32)


def test_warmup_compiles_every_configuration_a_call_can_pick():
    """A V4-Flash layer for T <= 400 on CPU stand-ins: warm-up compiles what ``config`` picks for every T."""
    from nvfp4_megamoe.kernels import cute_host

    layer = Sm90NvFp4MoE(hidden=4096, intermediate=2048, experts=256, top_k=6, swiglu_limit=10.0,
                         max_tokens=400, device="cpu")
    picked = {layer.config(t) for t in range(1, 401)}
    # T = 1: one row tile (L1 with two warps per row group, each over half of K), then two; no routing kernel and row
    # tiles interleaved up to T = 4, block scales on the partial sums with two row tiles; from 342 tokens (8 pairs
    # per expert) the WGMMA kernels
    assert layer.config(1) == (8, False, 1, True, False, False, 2, 0)
    assert layer.config(2) == (8, False, 2, True, True, True, 1, 0) == layer.config(4)
    assert layer.config(5) == (8, False, 2, False, False, False, 1, 0)
    assert any(cfg.wgmma for cfg in picked)
    assert layer.warmup() == len(picked)
    for cfg in picked:
        routing, l1, l2 = layer.kernels(*cfg)
        assert cfg.wgmma or (l1.interleave_rows is cfg.interleave and l2.block_columns is cfg.block_columns
                             and l1.k_warps == cfg.k_warps and l2.k_warps == 1 and l1.stage_x is cfg.direct
                             and l2.pdl is cfg.direct and l1.early_dependents is cfg.direct
                             and l1.max_ctas == l2.max_ctas == (3 if cfg.direct and cfg.row_tiles == 1 else 0))
        for op in (l1, l2) if cfg.direct else (routing, l1, l2):
            assert any(key[1] == op.key() for key in cute_host._COMPILED), (cfg, type(op).__name__)
    assert any(key[0] == "Sm90StagedOrder" for key in cute_host._COMPILED)  # the permute of x before a WGMMA L1


def test_staged_order_kernel_compiles_sm90a():
    from nvfp4_megamoe.kernels.sm90_k_order import Sm90StagedOrder

    x = torch.empty(3, 256, dtype=torch.bfloat16)
    assert compile_op(Sm90StagedOrder(), [x, torch.empty_like(x)]) is not None


# the default direct L1 stages x in shared memory; x read from global memory instead, and L2 with two warps per row
# group (a tuning; L1 has them by default at T = 1, see test_warmup_compiles_every_configuration_a_call_can_pick)
NO_STAGE, L2_K_WARPS = {"stage_x": False}, {"l2": {"k_warps": 2, "depth": 2}}


@pytest.mark.parametrize("ids_dtype,block_columns,tuning", [
    (torch.int32, True, None), (torch.int64, True, None), (torch.int32, False, None), (torch.int32, True, NO_STAGE),
    (torch.int32, False, NO_STAGE), (torch.int32, False, L2_K_WARPS)])
def test_direct_gemms_compile_sm90a(ids_dtype, block_columns, tuning):
    """A few tokens: the GEMMs read topk_ids [P, 1] and topk_weights [P] themselves (no routing kernel), with or
    without the block scales applied to fp32 partial sums (``block_columns``, which needs those one-token tiles)."""
    h, i, experts = V4["flash"]
    layer = _Layer(h, i, experts, 6, 10.0, tuning)
    _, l1, l2 = Sm90NvFp4MoE.kernels(layer, 8, False, 1, direct=True, block_columns=block_columns)
    assert l1.stage_x is (tuning is not NO_STAGE) and l2.k_warps == (2 if tuning is L2_K_WARPS else 1)
    assert l1.direct_top_k == 6 and l2.direct_top_k == 6 and not l1.pdl
    assert l1.block_columns is block_columns and l2.block_columns is block_columns
    assert not Sm90NvFp4MoE.kernels(_Layer(h, i, experts, 6, 10.0), 8, False, 1)[1].block_columns
    with pytest.raises(ValueError, match="one-token tiles"):
        Sm90Nvfp4GroupedGemm(m=2 * i, k=h, mode="swiglu", block_columns=True)
    # the routed operands, with topk_ids [P, 1] where the tiles go
    _, l1_args, l2_args = moe_gemm_args(h, i)
    ids = torch.zeros(l1_args[5].numel(), 1, dtype=ids_dtype)
    for op, args in ((l1, l1_args), (l2, l2_args)):
        assert compile_op(op, [*args[:6], ids, *args[7:]]) is not None


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
