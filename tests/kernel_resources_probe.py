"""Compile, for sm_90a (no GPU), the kernel configurations the runtime can launch for V4-Flash and V4-Pro: the MoE
plans a layer can pick (weights row-major and in row tiles), decode attention in its three modes with the clusters
``pick_cluster`` chooses and the combine kernel, and its prefill form, the indexer's score (decode and shared-keys)
and sort kernels, the mHC weights (also with the product by ``fn``), the compressor step, the step's query and key,
the router and the W8A8 GEMM; print, as JSON, each kernel's registers per thread and stack frame bytes (spills) read
from its cubin.

``--all`` compiles every configuration; without it, one GEMM (and one routing kernel) per configuration that differs
only in its token tile (the widest tile, whose accumulators take the most registers) and every other kernel. ``--jobs N`` compiles in N
processes. Run in a fresh interpreter (``tests/test_kernel_resources.py`` does): CuTeDSL reads ``CUTE_DSL_KEEP`` /
``CUTE_DSL_DUMP_DIR`` when it is imported, and the cubins must come from compiles, not the disk cache.
Usage: ``python tests/kernel_resources_probe.py DUMP_DIR [--all] [--jobs N]``.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import replace
import json
import multiprocessing
import os
import struct
import sys
from concurrent.futures import ProcessPoolExecutor

EIATTR_FRAME_SIZE, EIATTR_REGCOUNT = 0x11, 0x2F  # .nv.info attributes: per-symbol stack frame, registers
EIFMT_HVAL, EIFMT_SVAL = 3, 4                    # attribute formats: 2-byte value; sized value
MODELS = ((4096, 2048, 256), (7168, 3072, 384))   # V4-Flash, V4-Pro: H, I, E (top-6)
MAX_TOKENS = 8192


def elf_sections(elf: bytes) -> dict[str, bytes]:
    """The named sections of a 64-bit little-endian ELF file (a cubin, an object file): name -> bytes."""
    if elf[:4] != b"\x7fELF":
        raise ValueError("not an ELF file")
    shoff, = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)
    sections = [struct.unpack_from("<IIQQQQ", elf, shoff + i * shentsize) for i in range(shnum)]
    names_at = sections[shstrndx][4]
    found = {}
    for name, kind, _flags, _addr, offset, size in sections:
        start = names_at + name
        found[elf[start:elf.index(b"\0", start)].decode()] = b"" if kind == 8 else elf[offset:offset + size]  # NOBITS
    return found


def cubin_resources(cubin: bytes) -> dict[str, int]:
    """``{"registers": .., "frame_bytes": ..}`` of a cubin's kernels (the largest over its symbols), from the
    ELF section ``.nv.info`` (the per-symbol attributes ``ptxas -v`` prints as registers and stack frame)."""
    info = elf_sections(cubin)[".nv.info"]
    found = {EIATTR_FRAME_SIZE: 0, EIATTR_REGCOUNT: 0}
    p = 0
    while p < len(info):
        fmt, attr = info[p], info[p + 1]
        p += 2
        if fmt == EIFMT_SVAL:
            n, = struct.unpack_from("<H", info, p)
            if attr in found:
                _symbol, value = struct.unpack_from("<II", info, p + 2)
                found[attr] = max(found[attr], value)
            p += 2 + n
        elif fmt == EIFMT_HVAL:
            p += 2
    return {"registers": found[EIATTR_REGCOUNT], "frame_bytes": found[EIATTR_FRAME_SIZE]}


def _token_tile_free(op) -> tuple | None:
    """A GEMM's (or the routing kernel's) configuration with its token tile taken out (None for other kernels)."""
    if type(op).__name__ == "Sm90MoeRouting":  # the tile only bounds the tiles it cuts
        return "Sm90MoeRouting", op.experts, op.top_k
    tiling = getattr(op, "tiling", None)
    if tiling is None:
        return None
    wide = dict(tile_tokens=0, **({"min_tokens": 0} if hasattr(tiling, "min_tokens") else {}))
    return type(op).__name__, op.problem, dataclasses.replace(tiling, **wide)


def _tile_rank(op) -> tuple[int, int]:
    """Wider token tiles first (more accumulators), then fewer MMA widths (a shorter compile)."""
    tiling = getattr(op, "tiling", None)
    if tiling is None:
        return op.bn, 0
    return tiling.tile_tokens, -getattr(tiling, "min_tokens", 0)


def jobs(every: bool) -> list[tuple]:
    """(op, operands) of every kernel to compile, in a fixed order (each worker rebuilds the same list)."""
    from nvfp4_megamoe.kernels import cute_host, sm90_indexer, sm90_moe, sm90_router
    from nvfp4_megamoe.kernels.sm90_config import MoeShape
    from nvfp4_megamoe.kernels.sm90_decode_attention import (CLUSTERS, Sm90DecodeAttention,
                                                             Sm90DecodeAttentionCombine, Sm90PrefillAttention)
    from nvfp4_megamoe.kernels.sm90_mhc import Sm90HcPost, Sm90HcPre, Sm90HcPreFused, fused_operands
    from nvfp4_megamoe.kernels.sm90_compressor import Sm90CompressStep, stand_in_operands as compressor_operands
    from nvfp4_megamoe.kernels.sm90_qkv_step import QkvStepConfig, Sm90QkvStep, stand_in_operands as qkv_operands
    from nvfp4_megamoe.kernels.sm90_router import RouterConfig
    from nvfp4_megamoe.kernels.sm90_fp8_gemm import Sm90Fp8ActQuant, Sm90Fp8Gemm
    from nvfp4_megamoe.kernels.sm90_fp8_linear import Sm90Fp8Dequant, Sm90Fp8Linear
    from nvfp4_megamoe.kernels.sm90_fp8_wgmma import Sm90Fp8WgmmaLinear
    from nvfp4_megamoe.kernels.sm90_heuristics import (compress_step_config, fp8_gemm_configs, fp8_linear_config,
                                                       fp8_linear_token_counts, fp8_reads_f32_x, fp8_wgmma_config,
                                                       fp8_wgmma_token_counts, hc_pre_fused_config)
    from sm90_stand_ins import (FP8_LINEAR_SHAPES, decode_attention_args, fp8_gemm_args, fp8_linear_args,
                                hc_post_args, hc_pre_args, prefill_attention_args)

    found: dict[tuple, tuple] = {}
    record = lambda op, tensors: found.setdefault((type(op).__name__, op.key()), (op, tensors))  # noqa: E731
    saved = sm90_moe._compile, sm90_indexer._compile
    sm90_moe._compile = sm90_indexer._compile = record  # the modules' own bindings: collect, do not compile
    try:
        for h, i, e in MODELS:
            for tiles in (False, True):  # canonical and --target sm90 checkpoints
                sm90_moe.Sm90Nvfp4Moe(MoeShape(h, i, e, 6, 10.0, tiles), MAX_TOKENS, device="cpu").warmup()
        for k in (512, 1024):  # V4-Flash's and V4-Pro's index top-k, 64 index heads of 128 (decode and prefill)
            sm90_indexer.warmup(64, 128, k, "cpu", prefill=True)
    finally:
        sm90_moe._compile, sm90_indexer._compile = saved
    args = decode_attention_args()
    prefill = prefill_attention_args()
    for mode in ("window", "dense", "indexed"):
        # the prefill form: window starts beside the lengths, HCA's counts [R, 1] where CSA's indices are
        picked = prefill[5][:, :1].contiguous() if mode == "dense" else prefill[5]
        for cluster in CLUSTERS:
            record(Sm90DecodeAttention(mode=mode, scale=512 ** -0.5, cluster=cluster), args)
            record(Sm90PrefillAttention(mode=mode, scale=512 ** -0.5, cluster=cluster), [*prefill[:5], picked,
                                                                                          *prefill[6:]])
    for groups in (1, 4):
        record(Sm90DecodeAttentionCombine(groups), [args[7], args[8], args[5], args[6]])
    for norm in (False, True):
        record(Sm90HcPre(hc=4, iters=20, hc_eps=1e-6, norm_eps=1e-6, norm=norm), hc_pre_args(4))
    record(Sm90HcPost(hc=4), hc_post_args(4))
    # hc_pre with its product by fn: V4-Flash's and V4-Pro's widths, the clusters of a decode step and of a long call
    for (h, _, _), tokens, norm in ((m, t, nm) for m in MODELS for t in (1, 64) for nm in (False, True)):
        fused = hc_pre_fused_config(4, h, tokens, iters=20, hc_eps=1e-6, norm_eps=1e-6, norm=norm)
        record(Sm90HcPreFused(fused), fused_operands(fused, "cpu"))
    # the decode step's compressor update: V4's CSA compressor, its indexer's, and HCA's
    for ratio, dim, overlap in ((4, 512, True), (4, 128, True), (128, 512, False)):
        config = compress_step_config(ratio, dim, overlap, 64, 1e-6)   # the cluster and groups the runtime picks
        record(Sm90CompressStep(config), compressor_operands(config, "cpu"))
    # the decode step's query and key: V4's head_dim and RoPE width (Flash and Pro alike)
    qkv = QkvStepConfig(dim=512, rope_dim=64, eps=1e-6)
    record(Sm90QkvStep(qkv), qkv_operands(qkv, "cpu"))
    # the router: V4's top-k (with its bias) and hash kernels, and the widest softmax one (16 logits a lane, 32 slots)
    with cute_host.collecting() as routers:
        for (_, _, e), scaling in zip(MODELS, (1.5, 2.5)):
            sm90_router.warmup(RouterConfig(e, 6, "sqrtsoftplus", scaling, bias=True), "cpu")
            sm90_router.warmup(RouterConfig(e, 6, "sqrtsoftplus", scaling), "cpu", hashed=True)
        sm90_router.warmup(RouterConfig(512, 32, "softmax", 1.0, bias=True), "cpu")
    for op, tensors in routers:
        record(op, tensors)
    # the FP8 linears: one configuration per register shape (token tile, row tiles, depth, x's dtype) V4's weights
    # pick with x as the runtime hands it (float32 where the kernel reads it so, else cast to BF16), and the
    # float32-scale and BF16-out forms of the decode one
    fp8_shapes: dict[tuple, object] = {}
    for n, k, groups in FP8_LINEAR_SHAPES:
        for tokens in fp8_linear_token_counts():
            config = fp8_linear_config(n, k, tokens, groups=groups, x_f32=fp8_reads_f32_x(tokens))
            fp8_shapes.setdefault((config.tile_tokens, config.row_tiles, config.depth, config.x_f32), config)
    for config in fp8_shapes.values():
        record(Sm90Fp8Linear(config), fp8_linear_args(x_f32=config.x_f32))
    decode = fp8_linear_config(1024, 4096, 1)
    record(Sm90Fp8Linear(decode), fp8_linear_args())
    record(Sm90Fp8Linear(replace(decode, scale_f32=True)), fp8_linear_args(scale_f32=True))
    record(Sm90Fp8Linear(fp8_linear_config(1024, 4096, 1, out_bf16=True)), fp8_linear_args(out_bf16=True))
    # the FP8 WGMMA linear (not launched by the runtime yet; the benchmark's ``fp8_wgmma``): one configuration per
    # register shape (token tile, warpgroups, depth) V4's weights pick, and the float32-scale form of the widest
    wgmma_shapes: dict[tuple, object] = {}
    for n, k, groups in FP8_LINEAR_SHAPES:
        for tokens in fp8_wgmma_token_counts():
            config = fp8_wgmma_config(n, k, tokens, groups)
            if config is not None:
                wgmma_shapes.setdefault((config.tile_tokens, config.warpgroups, config.depth), config)
    for config in wgmma_shapes.values():
        record(Sm90Fp8WgmmaLinear(config), fp8_linear_args())
    widest = max(wgmma_shapes.values(), key=lambda config: (config.tile_tokens, config.warpgroups, config.depth))
    record(Sm90Fp8WgmmaLinear(replace(widest, scale_f32=True)), fp8_linear_args(scale_f32=True))
    for scale_f32 in (False, True):
        w, scale, x, _ = fp8_linear_args(scale_f32=scale_f32)
        record(Sm90Fp8Dequant(scale_f32=scale_f32), [w, scale, x.new_zeros(w.shape)])
    # the W8A8 GEMM: one configuration per register shape (tile width, warpgroups) V4's FP8 linears can pick, with
    # E8M0 scales and the widest with float32 ones, and the quantiser for float32 and BF16 x
    w8a8: dict[tuple, object] = {}
    for n, k, groups in FP8_LINEAR_SHAPES:
        for config in sorted(fp8_gemm_configs(n, k, groups), key=repr):
            w8a8.setdefault((config.block_n, config.warpgroups), config)
    widest = max(w8a8.values(), key=lambda c: (c.block_n, c.warpgroups))
    for config in list(w8a8.values()) + [replace(widest, scale_f32=True)]:
        record(Sm90Fp8Gemm(config), fp8_gemm_args(scale_f32=config.scale_f32)[1])
    for x_f32 in (False, True):
        record(Sm90Fp8ActQuant(x_f32=x_f32), fp8_gemm_args(x_f32=x_f32)[0])
    chosen = list(found.values())
    if not every:  # per GEMM configuration up to its token tile: the widest tile (then the fewest MMA widths)
        widest: dict[tuple, tuple] = {}
        for op, tensors in chosen:
            group = _token_tile_free(op)
            if group is None:
                widest[(type(op).__name__, op.key())] = (op, tensors)
                continue
            best = widest.get(group)
            if best is None or _tile_rank(op) > _tile_rank(best[0]):
                widest[group] = (op, tensors)
        chosen = list(widest.values())
    del cute_host
    # every worker slices this list: one order in every process (the warm-ups' own order follows set iteration,
    # which string hashing makes differ from process to process)
    return sorted(chosen, key=lambda job: (type(job[0]).__name__, repr(job[0].key())))


def control() -> tuple:
    """A configuration that spills (64-token tiles with two row tiles, which no plan picks), so the check can fail."""
    from nvfp4_megamoe.kernels.sm90_config import GemmProblem, MmaTiling
    from nvfp4_megamoe.kernels.sm90_moe_gemm import Sm90Nvfp4MmaGemm
    from sm90_stand_ins import moe_gemm_args

    problem = GemmProblem(m=4096, k=4096, mode="swiglu", swiglu_limit=10.0, h_order="lane")
    return Sm90Nvfp4MmaGemm(problem, MmaTiling(64, 2, depth=2)), moe_gemm_args(4096, 2048)[1]


def _row(op, tensors) -> dict:
    """Compile ``op`` for CUDA operands (the stand-ins a compiling worker of the runtime uses: operands in global
    memory, as on the GPU; CPU tensors would be generic-address operands, other code) and read its cubin."""
    from nvfp4_megamoe.kernels import cute_host

    specs = [(shape, dtype, "cuda", aligned) for shape, dtype, _, aligned in map(cute_host._operand_spec, tensors)]
    fn = cute_host.compile_described(op, [cute_host._operand(spec) for spec in specs])
    return {"kernel": type(op).__name__, "key": repr(op.key()), "threads": getattr(op, "threads", 0),
            "min_ctas": getattr(op, "min_ctas", None), **cubin_resources(fn.artifacts.CUBIN)}


def _work(share: tuple[int, int, bool, str]) -> list[dict]:
    """Compile every ``step``-th kernel of :func:`jobs` from ``first`` (a worker process); ``first`` -1: the control.
    Cubins go under the dump folder ``share[3]``."""
    first, step, every, dump = share
    # CuTeDSL names a kernel's dump file after the op's class and reads the cubin back from that file: a folder of
    # this process's own, set before CuTeDSL is imported here, so that no other worker overwrites it in between
    os.environ["CUTE_DSL_DUMP_DIR"] = own = os.path.join(dump, f"worker-{os.getpid()}")
    os.makedirs(own, exist_ok=True)
    if first < 0:
        return [_row(*control())]
    return [_row(op, tensors) for op, tensors in jobs(every)[first::step]]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dump")
    ap.add_argument("--all", action="store_true", help="every configuration, not one per token-tile family")
    ap.add_argument("--jobs", type=int, default=1, help="compiling processes")
    args = ap.parse_args()
    os.makedirs(args.dump, exist_ok=True)  # CuTeDSL writes no artifact into a missing folder
    os.environ.update(CUTE_DSL_ARCH="sm_90a", CUTE_DSL_KEEP="cubin", NVFP4_MEGAMOE_KERNEL_CACHE="0")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # sm90_stand_ins, in the workers too
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.dirname(os.path.abspath(__file__)),
                                                            os.environ.get("PYTHONPATH")]))
    n = max(1, args.jobs)
    with ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("spawn")) as pool:
        shares = [(w, n, args.all, args.dump) for w in range(n)] + [(-1, n, args.all, args.dump)]
        *parts, control_rows = pool.map(_work, shares)
    print(json.dumps({"kernels": [row for part in parts for row in part], "control": control_rows[0]}))


if __name__ == "__main__":
    main()
