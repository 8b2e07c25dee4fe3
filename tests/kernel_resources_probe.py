"""Compile, for sm_90a (no GPU), every kernel configuration the runtime can launch for V4-Flash and V4-Pro:
the MoE configurations a layer can pick (weights row-major and in row tiles), decode attention in its three
modes with the clusters ``pick_cluster`` chooses and the combine kernel, the indexer's score and sort kernels,
and the mHC weights;
print, as JSON, each kernel's registers per thread and stack frame bytes (spills) read from its cubin.

Run in a fresh interpreter (``tests/test_kernel_resources.py`` does): CuTeDSL reads ``CUTE_DSL_KEEP`` /
``CUTE_DSL_DUMP_DIR`` when it is imported, and the cubins must come from compiles, not the disk cache.
Usage: ``python tests/kernel_resources_probe.py DUMP_DIR``.
"""

from __future__ import annotations

import json
import os
import struct
import sys

EIATTR_FRAME_SIZE, EIATTR_REGCOUNT = 0x11, 0x2F  # .nv.info attributes: per-symbol stack frame, registers
EIFMT_HVAL, EIFMT_SVAL = 3, 4                    # attribute formats: 2-byte value; sized value


def cubin_resources(cubin: bytes) -> dict[str, int]:
    """``{"registers": .., "frame_bytes": ..}`` of a cubin's kernels (the largest over its symbols), from the
    ELF section ``.nv.info`` (the per-symbol attributes ``ptxas -v`` prints as registers and stack frame)."""
    if cubin[:4] != b"\x7fELF":
        raise ValueError("not an ELF cubin")
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    sections = [struct.unpack_from("<IIQQQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    names_at = sections[shstrndx][4]
    found = {EIATTR_FRAME_SIZE: 0, EIATTR_REGCOUNT: 0}
    for name, _type, _flags, _addr, offset, size in sections:
        start = names_at + name
        if cubin[start:cubin.index(b"\0", start)] != b".nv.info":
            continue
        p = offset
        while p < offset + size:
            fmt, attr = cubin[p], cubin[p + 1]
            p += 2
            if fmt == EIFMT_SVAL:
                n, = struct.unpack_from("<H", cubin, p)
                if attr in found:
                    _symbol, value = struct.unpack_from("<II", cubin, p + 2)
                    found[attr] = max(found[attr], value)
                p += 2 + n
            elif fmt == EIFMT_HVAL:
                p += 2
    return {"registers": found[EIATTR_REGCOUNT], "frame_bytes": found[EIATTR_FRAME_SIZE]}


def main() -> None:
    os.makedirs(sys.argv[1], exist_ok=True)  # CuTeDSL writes no artifact into a missing folder
    os.environ.update(CUTE_DSL_ARCH="sm_90a", CUTE_DSL_KEEP="cubin", CUTE_DSL_DUMP_DIR=sys.argv[1],
                      NVFP4_MEGAMOE_KERNEL_CACHE="0")
    from nvfp4_megamoe.kernels import cute_host, sm90_attention_indexer, sm90_moe
    from nvfp4_megamoe.kernels.sm90_decode_attention import Sm90DecodeAttention, Sm90DecodeAttentionCombine
    from nvfp4_megamoe.kernels.sm90_mhc import Sm90HcWeights
    from nvfp4_megamoe.kernels.sm90_moe_gemm import Sm90Nvfp4GroupedGemm
    from sm90_stand_ins import decode_attention_args, hc_weights_args, moe_gemm_args

    rows = []
    compile_op = cute_host.compile_op

    def compile_and_record(op, tensors):
        fn = compile_op(op, tensors)
        rows.append({"kernel": type(op).__name__, "key": repr(op.key()), "threads": getattr(op, "threads", 0),
                     "min_ctas": getattr(op, "min_ctas", None), **cubin_resources(fn.artifacts.CUBIN)})
        return fn

    sm90_moe._compile = sm90_attention_indexer._compile = compile_and_record  # the modules' own bindings
    for h, i, e in ((4096, 2048, 256), (7168, 3072, 384)):
        for tiles in (False, True):  # canonical and --target sm90 checkpoints
            sm90_moe.Sm90NvFp4MoE(hidden=h, intermediate=i, experts=e, top_k=6, swiglu_limit=10.0, max_tokens=8192,
                                  device="cpu", weight_tiles=tiles).warmup()
    for k in (512, 1024):  # V4-Flash's and V4-Pro's index top-k, 64 index heads of 128
        sm90_attention_indexer.warmup_indexer(64, 128, k, "cpu")
    args = decode_attention_args()
    for mode in ("window", "dense", "indexed"):
        for cluster in (1, 2, 4):  # what pick_cluster returns
            compile_and_record(Sm90DecodeAttention(mode=mode, scale=512 ** -0.5, cluster=cluster), args)
    for groups in (1, 4):
        compile_and_record(Sm90DecodeAttentionCombine(groups), [args[7], args[8], args[5], args[6]])
    compile_and_record(Sm90HcWeights(hc=4, iters=20, hc_eps=1e-6), hc_weights_args(4))
    # a control that spills (64-token tiles, two row tiles: no layer picks it), so the check can be seen to fail
    layer = sm90_moe.Sm90NvFp4MoE(hidden=4096, intermediate=2048, experts=256, top_k=6, swiglu_limit=10.0,
                                  max_tokens=1, device="cpu")
    _, l1, _ = layer.kernels(64, False, 2)
    assert isinstance(l1, Sm90Nvfp4GroupedGemm)
    compile_and_record(l1, moe_gemm_args(4096, 2048)[1])
    control = rows.pop()
    print(json.dumps({"kernels": rows, "control": control}))


if __name__ == "__main__":
    main()
