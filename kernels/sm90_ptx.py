"""Inline-PTX building blocks of the SM90 kernels (what CuTeDSL 4.8 has no plain op for).

MoE (``sm90_moe_gemm``, ``sm90_moe_wgmma``):

* 16-byte / 2-byte global loads on raw addresses (read-only path, weights streamed once);
* ``mma.sync.m16n8k16`` BF16 x BF16 -> FP32 on register fragments, and register-sourced ``wgmma``;
* E2M1 x E4M3 -> BF16: the E4M3 scales, and ``rotr_b32`` for the E2M1 decode of ``e2m1_registers`` (exact);
* ``red.global.add.f32`` for the token scatter-reduce.

Decode attention (``sm90_decode_attention``): ``cp.async.cg`` 16-byte gathers with zero fill,
``wgmma`` with both operands in shared memory and with a transposed (MN-major) B, shared/global scalar
and vector I/O, distributed shared memory reads across a cluster (``mapa``), ``ex2.approx``.

Compressor step (``sm90_compressor``): the cos and sin of a RoPE angle, accurate for large positions; a float stored
into a peer CTA's shared memory (the cluster's sum of squares).

FP8 GEMM (``sm90_fp8_gemm``): E8M0 scale bytes as floats, IEEE division (the activation quantiser divides as torch
does) and four floats to four E4M3 bytes.

Shared memory is addressed by 32-bit ``.shared`` addresses, global memory by 64-bit generic
addresses. Every helper is a pure function of 32-bit registers (``Int32``) or ``Float32`` values
unless it stores or copies.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64
from cutlass._mlir import ir
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from . import sm90_config as _config


def _struct(n: int, ty: str = "i32") -> ir.Type:
    return ir.Type.parse("!llvm.struct<(" + ", ".join([ty] * n) + ")>")


def _unpack(res, n: int, ty, wrap, loc=None, ip=None):
    return tuple(wrap(llvm.extractvalue(ty, res, [i], loc=loc, ip=ip)) for i in range(n))


SMEM_LIMIT = _config.SMEM_LIMIT  # shared memory one CTA may ask for on sm_90


@dsl_user_op
def ld_global_v4(addr: Int64, *, loc=None, ip=None) -> tuple[Int32, Int32, Int32, Int32]:
    """16 bytes from a 16-aligned global address, read-only cache path, not kept in L1 (the weights: read once)."""
    res = llvm.inline_asm(
        _struct(4), [Int64(addr).ir_value(loc=loc, ip=ip)],
        "ld.global.nc.L1::no_allocate.v4.u32 {$0, $1, $2, $3}, [$4];",
        "=r,=r,=r,=r,l", has_side_effects=False, loc=loc, ip=ip)
    return _unpack(res, 4, T.i32(), Int32, loc, ip)


@dsl_user_op
def prefetch_l2(addr: Int64, evict_last: bool = True, *, loc=None, ip=None) -> None:
    """Bring the line holding ``addr`` into L2; ``evict_last`` marks it to stay: weights a later
    kernel phase reads while other traffic streams through."""
    hint = "::evict_last" if evict_last else ""
    llvm.inline_asm(None, [Int64(addr).ir_value(loc=loc, ip=ip)], f"prefetch.global.L2{hint} [$0];", "l",
                    has_side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def ld_global_v4_keep(addr: Int64, *, loc=None, ip=None) -> tuple[Int32, Int32, Int32, Int32]:
    """16 bytes from a 16-aligned global address through L1 (activations: reused by every warp)."""
    res = llvm.inline_asm(
        _struct(4), [Int64(addr).ir_value(loc=loc, ip=ip)],
        "ld.global.nc.v4.u32 {$0, $1, $2, $3}, [$4];",
        "=r,=r,=r,=r,l", has_side_effects=False, loc=loc, ip=ip)
    return _unpack(res, 4, T.i32(), Int32, loc, ip)


@dsl_user_op
def ld_global_u16(addr: Int64, *, loc=None, ip=None) -> Int32:
    """2 bytes (zero-extended) from a 2-aligned global address, read-only path."""
    return Int32(llvm.inline_asm(
        T.i32(), [Int64(addr).ir_value(loc=loc, ip=ip)],
        "{.reg .u16 t; ld.global.nc.u16 t, [$1]; cvt.u32.u16 $0, t;}",
        "=r,l", has_side_effects=False, loc=loc, ip=ip))


@dsl_user_op
def prmt(a: Int32, b: Int32, sel: int, *, loc=None, ip=None) -> Int32:
    """``prmt.b32``: bytes of {b:a} picked by the 4 selector nibbles of ``sel``."""
    return Int32(llvm.inline_asm(
        T.i32(), [Int32(a).ir_value(loc=loc, ip=ip), Int32(b).ir_value(loc=loc, ip=ip)],
        f"prmt.b32 $0, $1, $2, {sel:#x};", "=r,r,r", has_side_effects=False, loc=loc, ip=ip))


@dsl_user_op
def mul_bf16x2(a: Int32, b: Int32, *, loc=None, ip=None) -> Int32:
    """Lane-wise BF16 product (round to nearest; subnormal inputs are honoured)."""
    return Int32(llvm.inline_asm(
        T.i32(), [Int32(a).ir_value(loc=loc, ip=ip), Int32(b).ir_value(loc=loc, ip=ip)],
        "mul.rn.bf16x2 $0, $1, $2;", "=r,r,r", has_side_effects=False, loc=loc, ip=ip))


# PTX text: the two E4M3 bytes in the low half of operand $2 -> floats {0}, {1} (the block declares the
# .b16 lo, hi and .b32 h2 it uses)
_E4M3X2_TO_F32 = ("mov.b32 {{lo, hi}}, $2;\n\t"
                  "cvt.rn.f16x2.e4m3x2 h2, lo;\n\t"
                  "mov.b32 {{lo, hi}}, h2;\n\t"
                  "cvt.f32.f16 {0}, lo;\n\t"
                  "cvt.f32.f16 {1}, hi;")


@dsl_user_op
def e4m3x2_to_bf16x2_pair(sf: Int32, log2_bias: int, *, loc=None, ip=None) -> tuple[Int32, Int32]:
    """Two E4M3 scale bytes (low 16 bits of ``sf``) -> two BF16x2 words, each a scale times
    ``2**log2_bias`` broadcast to both lanes: ``(s0, s0)``, ``(s1, s1)``. Exact (E4M3 fits BF16)."""
    res = llvm.inline_asm(
        _struct(2), [Int32(sf).ir_value(loc=loc, ip=ip)],
        "{.reg .b16 lo, hi, s16; .reg .b32 h2; .reg .f32 f0, f1;\n\t"
        + _E4M3X2_TO_F32.format("f0", "f1") + "\n\t"
        f"mul.f32 f0, f0, 0f{(127 + log2_bias) << 23:08X};\n\t"
        f"mul.f32 f1, f1, 0f{(127 + log2_bias) << 23:08X};\n\t"
        "cvt.rn.bf16x2.f32 $0, f0, f0;\n\t"
        "cvt.rn.bf16x2.f32 $1, f1, f1;}",
        "=r,=r,r", has_side_effects=False, loc=loc, ip=ip)
    return _unpack(res, 2, T.i32(), Int32, loc, ip)


@dsl_user_op
def e4m3x2_to_f32x2(sf: Int32, *, loc=None, ip=None) -> tuple[Float32, Float32]:
    """Two E4M3 bytes (low 16 bits of ``sf``, first in the low byte) -> two floats, exact."""
    res = llvm.inline_asm(
        _struct(2, "f32"), [Int32(sf).ir_value(loc=loc, ip=ip)],
        "{.reg .b16 lo, hi; .reg .b32 h2;\n\t" + _E4M3X2_TO_F32.format("$0", "$1") + "}",
        "=f,=f,r", has_side_effects=False, loc=loc, ip=ip)
    return _unpack(res, 2, T.f32(), Float32, loc, ip)


@dsl_user_op
def rotr_b32(a: Int32, n: int, *, loc=None, ip=None) -> Int32:
    """``a`` rotated right by ``n`` bits (``shf.r.wrap``: one instruction)."""
    v = Int32(a).ir_value(loc=loc, ip=ip)
    return Int32(llvm.inline_asm(T.i32(), [v, v], f"shf.r.wrap.b32 $0, $1, $2, {n};", "=r,r,r",
                                 has_side_effects=False, loc=loc, ip=ip))


@dsl_user_op
def mma_bf16_16816(a0: Int32, a1: Int32, a2: Int32, a3: Int32, b0: Int32, b1: Int32,
                   c0: Float32, c1: Float32, c2: Float32, c3: Float32, *, loc=None, ip=None
                   ) -> tuple[Float32, Float32, Float32, Float32]:
    """``mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32``: D = A B + C on one warp."""
    args = [Int32(v).ir_value(loc=loc, ip=ip) for v in (a0, a1, a2, a3, b0, b1)]
    args += [Float32(v).ir_value(loc=loc, ip=ip) for v in (c0, c1, c2, c3)]
    res = llvm.inline_asm(
        _struct(4, "f32"), args,
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};",
        "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", has_side_effects=False, loc=loc, ip=ip)
    return _unpack(res, 4, T.f32(), Float32, loc, ip)


@dsl_user_op
def red_add_f32(addr: Int64, v: Float32, *, loc=None, ip=None) -> None:
    """``red.global.add.f32``: fire-and-forget atomic add."""
    llvm.inline_asm(
        None, [Int64(addr).ir_value(loc=loc, ip=ip), Float32(v).ir_value(loc=loc, ip=ip)],
        "red.global.add.f32 [$0], $1;", "l,f", has_side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def st_global_b16(addr: Int64, v: Int32, *, loc=None, ip=None) -> None:
    """Store the low 16 bits of ``v``."""
    llvm.inline_asm(
        None, [Int64(addr).ir_value(loc=loc, ip=ip), Int32(v).ir_value(loc=loc, ip=ip)],
        "{.reg .b16 lo, hi; mov.b32 {lo, hi}, $1; st.global.b16 [$0], lo;}", "l,r",
        has_side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def st_global_v4_zero(addr: Int64, *, loc=None, ip=None) -> None:
    """Store 16 zero bytes."""
    llvm.inline_asm(
        None, [Int64(addr).ir_value(loc=loc, ip=ip)],
        "st.global.v4.u32 [$0], {0, 0, 0, 0};", "l", has_side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def st_global_f32(addr: Int64, v: Float32, *, loc=None, ip=None) -> None:
    llvm.inline_asm(
        None, [Int64(addr).ir_value(loc=loc, ip=ip), Float32(v).ir_value(loc=loc, ip=ip)],
        "st.global.f32 [$0], $1;", "l,f", has_side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def f32x2_to_bf16x2(lo: Float32, hi: Float32, *, loc=None, ip=None) -> Int32:
    """Pack two floats as BF16x2 (``lo`` in the low half), round to nearest even."""
    return Int32(llvm.inline_asm(
        T.i32(), [Float32(hi).ir_value(loc=loc, ip=ip), Float32(lo).ir_value(loc=loc, ip=ip)],
        "cvt.rn.bf16x2.f32 $0, $1, $2;", "=r,f,f", has_side_effects=False, loc=loc, ip=ip))


# --- WGMMA (MoE prefill ``sm90_moe_wgmma``, decode attention) ---

def _wgmma_bf16(acc: list, a_args: list, a_cons: list, a_text: str, desc_b: Int64, accumulate: bool,
                imm_tail: str, loc, ip) -> list:
    """``wgmma.mma_async ... m64nNk16.f32.bf16.bf16`` on this thread's N/2 accumulators (N = 2 * len(acc))."""
    n_acc = len(acc)
    args = [Float32(v).ir_value(loc=loc, ip=ip) for v in acc] + a_args
    args.append(Int64(desc_b).ir_value(loc=loc, ip=ip))
    args.append(Int32(1 if accumulate else 0).ir_value(loc=loc, ip=ip))
    d = ", ".join(f"${i}" for i in range(n_acc))
    n_a = len(a_args)
    # operands: outputs 0..n_acc-1, tied inputs n_acc..2n_acc-1, A 2n_acc.., desc_b, scale-d
    a = a_text.format(*[f"${2 * n_acc + i}" for i in range(n_a)])
    cons = ",".join(["=f"] * n_acc + [str(i) for i in range(n_acc)] + a_cons + ["l", "r"])
    res = llvm.inline_asm(
        _struct(n_acc, "f32"), args,
        "{.reg .pred p;\n\t"
        f"setp.ne.b32 p, ${2 * n_acc + n_a + 1}, 0;\n\t"
        f"wgmma.mma_async.sync.aligned.m64n{2 * n_acc}k16.f32.bf16.bf16 {{{d}}}, {a}, ${2 * n_acc + n_a}, p, "
        f"{imm_tail};}}",
        cons, has_side_effects=True, loc=loc, ip=ip)
    return list(_unpack(res, n_acc, T.f32(), Float32, loc, ip))


@dsl_user_op
def wgmma_bf16_rs(acc: list, a0: Int32, a1: Int32, a2: Int32, a3: Int32, desc_b: Int64, tnsp_b: bool = False,
                  *, loc=None, ip=None) -> list:
    """``wgmma.mma_async.sync.aligned.m64nNk16.f32.bf16.bf16`` with A from registers, N = 2 * len(acc).

    ``acc`` are this thread's N/2 float32 accumulators (D = A B + D); A is the mma.sync-style
    fragment of the warp's 16 rows of the m64 tile; ``desc_b`` the shared-memory descriptor of B
    (N x 16, K-major; MN-major with ``tnsp_b``). Asynchronous: pair with ``warpgroup.fence/commit_group/wait_group``.
    """
    a_args = [Int32(v).ir_value(loc=loc, ip=ip) for v in (a0, a1, a2, a3)]
    return _wgmma_bf16(acc, a_args, ["r"] * 4, "{{{0}, {1}, {2}, {3}}}", desc_b, True,
                       f"1, 1, {int(tnsp_b)}", loc, ip)


@dsl_user_op
def wgmma_bf16_ss(acc: list, desc_a: Int64, desc_b: Int64, accumulate: bool = True, *, loc=None, ip=None) -> list:
    """As :func:`wgmma_bf16_rs` with A (64 x 16, K-major) from shared memory too, B K-major; without
    ``accumulate`` D = A B (the incoming ``acc`` values are ignored)."""
    return _wgmma_bf16(acc, [Int64(desc_a).ir_value(loc=loc, ip=ip)], ["l"], "{0}", desc_b, accumulate,
                       "1, 1, 0, 0", loc, ip)


@dsl_user_op
def fence_operands(acc: list, *, loc=None, ip=None) -> list:
    """An empty side-effecting asm that takes and returns ``acc``: uses of the result cannot move above it."""
    n = len(acc)
    res = llvm.inline_asm(
        _struct(n, "f32"), [Float32(v).ir_value(loc=loc, ip=ip) for v in acc], "",
        ",".join(["=f"] * n + [str(i) for i in range(n)]), has_side_effects=True, loc=loc, ip=ip)
    return list(_unpack(res, n, T.f32(), Float32, loc, ip))


SW128_DESC_HI = (1 << 62) | ((1024 >> 4) << 32)  # 128B swizzle, SBO = 1024 B (8-row groups)


def smem_desc_sw128(addr: Int32, lbo: int = 16) -> Int64:
    """WGMMA descriptor of a 128-byte-swizzled tile at shared address ``addr``, 8-row groups 1024 B apart.

    K-major: rows of 64 K-elements, ``lbo`` unused. MN-major (B with ``tnsp_b``): rows of 64 N-elements
    (each K index one 128-byte row), and ``lbo`` the byte stride between such 64-column blocks along N.
    """
    return (Int64(addr) >> 4) & Int64(0x3FFF) | Int64(SW128_DESC_HI | ((lbo >> 4) << 16))


# --- decode attention (``sm90_decode_attention``): cp.async gathers, shared/global I/O ---

def _i32(v, loc, ip):
    return Int32(v).ir_value(loc=loc, ip=ip)


def _f32(v, loc, ip):
    return Float32(v).ir_value(loc=loc, ip=ip)


def cp_async_16(smem: Int32, gaddr: Int64, src_bytes: Int32, *, loc=None, ip=None) -> None:
    """``cp.async.cg.shared.global`` of 16 bytes; bytes past ``src_bytes`` (0 or 16) are zero-filled."""
    llvm.inline_asm(
        None, [_i32(smem, loc, ip), Int64(gaddr).ir_value(loc=loc, ip=ip), _i32(src_bytes, loc, ip)],
        "cp.async.cg.shared.global [$0], [$1], 16, $2;", "r,l,r", has_side_effects=True, loc=loc, ip=ip)


def ld_shared_f32x2(smem: Int32, *, loc=None, ip=None) -> tuple[Float32, Float32]:
    res = llvm.inline_asm(
        _struct(2, "f32"), [_i32(smem, loc, ip)],
        "ld.shared.v2.f32 {$0, $1}, [$2];", "=f,=f,r", has_side_effects=True, loc=loc, ip=ip)
    return _unpack(res, 2, T.f32(), Float32, loc, ip)


def ld_shared_f32(smem: Int32, *, loc=None, ip=None) -> Float32:
    return Float32(llvm.inline_asm(
        T.f32(), [_i32(smem, loc, ip)], "ld.shared.f32 $0, [$1];", "=f,r", has_side_effects=True, loc=loc, ip=ip))


def st_shared_f32(smem: Int32, v: Float32, *, loc=None, ip=None) -> None:
    llvm.inline_asm(None, [_i32(smem, loc, ip), _f32(v, loc, ip)], "st.shared.f32 [$0], $1;", "r,f",
                    has_side_effects=True, loc=loc, ip=ip)


def shared_sum_f32(smem: Int32, count: int) -> Float32:
    """The ``count`` floats from ``smem`` on added in index order (every thread that calls it gets the same float):
    a block's total from its warps' partial sums."""
    total = ld_shared_f32(smem)
    for i in range(1, count):
        total = total + ld_shared_f32(smem + i * 4)
    return total


def lane_sum(v: Float32, first: int = 0, count: int = 5) -> Float32:
    """Sum over the lanes that differ from this one in bits ``first .. first + count - 1`` (the whole warp by
    default; every such lane gets the same float: each butterfly step adds the same two partial sums)."""
    for b in range(first, first + count):
        v = v + cute.arch.shuffle_sync_bfly(v, 1 << b)
    return v


def lane_max(v: Float32, first: int = 0, count: int = 5) -> Float32:
    """:func:`lane_sum`'s lanes' maximum."""
    for b in range(first, first + count):
        v = cute.arch.fmax(v, cute.arch.shuffle_sync_bfly(v, 1 << b))
    return v


# 16-byte shared-memory vectors of 32-bit floats ("f") or words ("r"): (PTX type, LLVM type, converter, MLIR type,
# DSL type)
_V4 = {"f": ("f32", "f32", _f32, T.f32, Float32), "r": ("b32", "i32", _i32, T.i32, Int32)}


def _st_shared_v4(kind: str, smem: Int32, vals, loc, ip) -> None:
    ty, _, conv, _, _ = _V4[kind]
    llvm.inline_asm(None, [_i32(smem, loc, ip)] + [conv(v, loc, ip) for v in vals],
                    f"st.shared.v4.{ty} [$0], {{$1, $2, $3, $4}};", "r" + f",{kind}" * 4,
                    has_side_effects=True, loc=loc, ip=ip)


def _ld_shared_v4(kind: str, smem: Int32, loc, ip) -> tuple:
    ty, llvm_ty, _, mlir_ty, wrap = _V4[kind]
    res = llvm.inline_asm(
        _struct(4, llvm_ty), [_i32(smem, loc, ip)],
        f"ld.shared.v4.{ty} {{$0, $1, $2, $3}}, [$4];", f"={kind}," * 4 + "r", has_side_effects=True, loc=loc, ip=ip)
    return _unpack(res, 4, mlir_ty(), wrap, loc, ip)


def st_shared_v4_f32(smem: Int32, a: Float32, b: Float32, c: Float32, d: Float32, *, loc=None, ip=None) -> None:
    _st_shared_v4("f", smem, (a, b, c, d), loc, ip)


def ld_shared_v4_f32(smem: Int32, *, loc=None, ip=None) -> tuple[Float32, Float32, Float32, Float32]:
    return _ld_shared_v4("f", smem, loc, ip)


def st_shared_v4_b32(smem: Int32, a: Int32, b: Int32, c: Int32, d: Int32, *, loc=None, ip=None) -> None:
    _st_shared_v4("r", smem, (a, b, c, d), loc, ip)


def ld_shared_v4_b32(smem: Int32, *, loc=None, ip=None) -> tuple[Int32, Int32, Int32, Int32]:
    return _ld_shared_v4("r", smem, loc, ip)


def st_shared_v2_f32(smem: Int32, a: Float32, b: Float32, *, loc=None, ip=None) -> None:
    llvm.inline_asm(None, [_i32(smem, loc, ip), _f32(a, loc, ip), _f32(b, loc, ip)],
                    "st.shared.v2.f32 [$0], {$1, $2};", "r,f,f", has_side_effects=True, loc=loc, ip=ip)


def mapa(smem: Int32, rank: Int32, *, loc=None, ip=None) -> Int32:
    """The ``.shared::cluster`` address of the same shared-memory offset in CTA ``rank`` of the cluster."""
    return Int32(llvm.inline_asm(T.i32(), [_i32(smem, loc, ip), _i32(rank, loc, ip)],
                                 "mapa.shared::cluster.u32 $0, $1, $2;", "=r,r,r", has_side_effects=False,
                                 loc=loc, ip=ip))


def ld_cluster_v2_f32(addr: Int32, *, loc=None, ip=None) -> tuple[Float32, Float32]:
    """8 bytes from a ``.shared::cluster`` address (:func:`mapa`), after a cluster barrier published them."""
    res = llvm.inline_asm(
        _struct(2, "f32"), [_i32(addr, loc, ip)],
        "ld.shared::cluster.v2.f32 {$0, $1}, [$2];", "=f,=f,r", has_side_effects=True, loc=loc, ip=ip)
    return _unpack(res, 2, T.f32(), Float32, loc, ip)


def ld_cluster_v4_f32(addr: Int32, *, loc=None, ip=None) -> tuple[Float32, Float32, Float32, Float32]:
    """16 bytes from a ``.shared::cluster`` address (:func:`mapa`), after a cluster barrier published them."""
    res = llvm.inline_asm(
        _struct(4, "f32"), [_i32(addr, loc, ip)],
        "ld.shared::cluster.v4.f32 {$0, $1, $2, $3}, [$4];", "=f,=f,=f,=f,r", has_side_effects=True, loc=loc, ip=ip)
    return _unpack(res, 4, T.f32(), Float32, loc, ip)


def st_cluster_f32(addr: Int32, v: Float32, *, loc=None, ip=None) -> None:
    """4 bytes to a ``.shared::cluster`` address (:func:`mapa`: a peer CTA's shared memory), published to the peer
    by a cluster barrier (``barrier.cluster.arrive``, release, then its ``wait``, acquire)."""
    llvm.inline_asm(None, [_i32(addr, loc, ip), _f32(v, loc, ip)], "st.shared::cluster.f32 [$0], $1;", "r,f",
                    has_side_effects=True, loc=loc, ip=ip)


def f32_bits(x: Float32, *, loc=None, ip=None) -> Int32:
    """The IEEE bits of a float32, as an int32."""
    return Int32(llvm.inline_asm(T.i32(), [_f32(x, loc, ip)], "mov.b32 $0, $1;", "=r,f", has_side_effects=False,
                                 loc=loc, ip=ip))


def f32_of_bits(bits: Int32, *, loc=None, ip=None) -> Float32:
    """The float32 whose IEEE bits are ``bits``."""
    return Float32(llvm.inline_asm(T.f32(), [_i32(bits, loc, ip)], "mov.b32 $0, $1;", "=f,r", has_side_effects=False,
                                   loc=loc, ip=ip))


def st_global_b32(addr: Int64, v: Int32, *, loc=None, ip=None) -> None:
    llvm.inline_asm(None, [Int64(addr).ir_value(loc=loc, ip=ip), _i32(v, loc, ip)], "st.global.b32 [$0], $1;",
                    "l,r", has_side_effects=True, loc=loc, ip=ip)


def st_global_v2_f32(addr: Int64, a: Float32, b: Float32, *, loc=None, ip=None) -> None:
    llvm.inline_asm(None, [Int64(addr).ir_value(loc=loc, ip=ip), _f32(a, loc, ip), _f32(b, loc, ip)],
                    "st.global.v2.f32 [$0], {$1, $2};", "l,f,f", has_side_effects=True, loc=loc, ip=ip)


def st_global_v2_b32(addr: Int64, a: Int32, b: Int32, *, loc=None, ip=None) -> None:
    llvm.inline_asm(None, [Int64(addr).ir_value(loc=loc, ip=ip), _i32(a, loc, ip), _i32(b, loc, ip)],
                    "st.global.v2.b32 [$0], {$1, $2};", "l,r,r", has_side_effects=True, loc=loc, ip=ip)


def st_global_v4_b32(addr: Int64, a: Int32, b: Int32, c: Int32, d: Int32, *, loc=None, ip=None) -> None:
    llvm.inline_asm(None, [Int64(addr).ir_value(loc=loc, ip=ip), *(_i32(v, loc, ip) for v in (a, b, c, d))],
                    "st.global.v4.b32 [$0], {$1, $2, $3, $4};", "l,r,r,r,r", has_side_effects=True, loc=loc, ip=ip)


def ld_global_v4_f32(addr: Int64, *, loc=None, ip=None) -> tuple[Float32, Float32, Float32, Float32]:
    """16 bytes of float32 from a 16-aligned global address (L2-resident partials: ``.cg``). Pure: only
    for data no thread of the same launch writes."""
    res = llvm.inline_asm(
        _struct(4, "f32"), [Int64(addr).ir_value(loc=loc, ip=ip)],
        "ld.global.cg.v4.f32 {$0, $1, $2, $3}, [$4];", "=f,=f,=f,=f,l", has_side_effects=False, loc=loc, ip=ip)
    return _unpack(res, 4, T.f32(), Float32, loc, ip)


def ld_global_v2_f32(addr: Int64, *, loc=None, ip=None) -> tuple[Float32, Float32]:
    res = llvm.inline_asm(
        _struct(2, "f32"), [Int64(addr).ir_value(loc=loc, ip=ip)],
        "ld.global.cg.v2.f32 {$0, $1}, [$2];", "=f,=f,l", has_side_effects=False, loc=loc, ip=ip)
    return _unpack(res, 2, T.f32(), Float32, loc, ip)


def e8m0_to_f32(e: Int32) -> Float32:
    """An E8M0 scale byte ``e`` (0..254) as the float ``2**(e - 127)``; 0 is ``2**-127``, a float32 subnormal."""
    return f32_of_bits(cutlass.max(Int32(e) << 23, Int32(1 << 22)))   # e >= 1: e << 23 is at least 1 << 23


def div_rn_f32(a: Float32, b: Float32, *, loc=None, ip=None) -> Float32:
    """``a / b`` rounded to nearest (IEEE, subnormals kept): what torch's float32 division gives."""
    return Float32(llvm.inline_asm(T.f32(), [_f32(a, loc, ip), _f32(b, loc, ip)], "div.rn.f32 $0, $1, $2;",
                                   "=f,f,f", has_side_effects=False, loc=loc, ip=ip))


def f32x4_to_e4m3x4(a: Float32, b: Float32, c: Float32, d: Float32, *, loc=None, ip=None) -> Int32:
    """Four floats -> four E4M3 bytes (``a`` the lowest), rounded to nearest even, saturated to +-448 (as torch's
    cast for every value that rounds to at most 448; NaN stays NaN)."""
    return Int32(llvm.inline_asm(
        T.i32(), [_f32(v, loc, ip) for v in (a, b, c, d)],
        "{.reg .b16 lo, hi;\n\t"
        "cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1;\n\t"
        "cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3;\n\t"
        "mov.b32 $0, {lo, hi};}",
        "=r,f,f,f,f", has_side_effects=False, loc=loc, ip=ip))


def ld_global_v2_b32(addr: Int64, *, loc=None, ip=None) -> tuple[Int32, Int32]:
    """8 bytes from an 8-aligned global address, read-only path (activations read once)."""
    res = llvm.inline_asm(
        _struct(2), [Int64(addr).ir_value(loc=loc, ip=ip)],
        "ld.global.nc.L1::no_allocate.v2.u32 {$0, $1}, [$2];", "=r,=r,l", has_side_effects=False, loc=loc, ip=ip)
    return _unpack(res, 2, T.i32(), Int32, loc, ip)


LOG2E = 1.4426950408889634   # exp(x) = ex2(x * LOG2E): softmax and sigmoids run in log2 units


def ex2(x: Float32, *, loc=None, ip=None) -> Float32:
    """``ex2.approx.ftz.f32`` (2**-inf = 0)."""
    return Float32(llvm.inline_asm(T.f32(), [_f32(x, loc, ip)], "ex2.approx.ftz.f32 $0, $1;", "=f,f",
                                   has_side_effects=False, loc=loc, ip=ip))


# --- compressor step (``sm90_compressor``): RoPE angles of large positions ---

# sinf / cosf on [-pi/4, pi/4] (Cephes' single-precision minimax polynomials in z = r * r)
_SIN_POLY = ("0fB94CA1F9", "0f3C08839E", "0fBE2AAAA3")   # -1.9515295891e-4, 8.3321608736e-3, -1.6666654611e-1
_COS_POLY = ("0f37CCF5CE", "0fBAB6061A", "0f3D2AAAA5")   # 2.443315711809948e-5, -1.388731625493765e-3, 4.16666457e-2


def rope_cos_sin(position: Int64, inv_freq: Float32, *, loc=None, ip=None) -> tuple[Float32, Float32]:
    """(cos, sin) of the angle ``float32(position) * inv_freq`` rounded as torch rounds it (``rope_tables``: int64 to
    float32, then one float32 product, no fused multiply-add), accurate for large angles.

    ``sin.approx`` loses about 2**-21 absolutely at |x| = pi and more beyond, and libdevice's ``sinf`` reduces an
    argument past 105615 through a local-memory array (a stack frame in every kernel that calls it). Here the angle
    is reduced in float64 (Hopper runs it at full rate for a handful of instructions): ``q = rint(x * 2/pi)``,
    ``r = x - q * pi/2`` with pi/2 as two doubles and fused products (about 1e-16 absolutely for any ``q`` that fits
    an int32), then sin and cos of ``r`` by polynomials in float32, and the quadrant ``q mod 4`` swaps and negates
    them. Within 1.5 ulp of the true values and 6e-8 absolutely of torch's (an emulation of these instructions
    against mpmath, V4's compressed-layer frequencies at random positions up to 2**21)."""
    res = llvm.inline_asm(
        _struct(2, "f32"), [Int64(position).ir_value(loc=loc, ip=ip), _f32(inv_freq, loc, ip)],
        "{\n"
        ".reg .f64 xd, t, kd, rd;\n"
        ".reg .f32 x, r, z, w, ps, pc, s, c, sx, cx, ns;\n"
        ".reg .b32 q, qb;\n"
        ".reg .pred odd, neg;\n"
        "cvt.rn.f32.s64 x, $2;\n"
        "mul.rn.f32 x, x, $3;\n"
        "cvt.f64.f32 xd, x;\n"
        "mul.rn.f64 t, xd, 0d3FE45F306DC9C883;\n"            # 2 / pi
        "cvt.rni.s32.f64 q, t;\n"
        "cvt.rn.f64.s32 kd, q;\n"
        "fma.rn.f64 rd, kd, 0dBFF921FB54442D18, xd;\n"        # - pi/2, the double nearest
        "fma.rn.f64 rd, kd, 0dBC91A62633145C07, rd;\n"        # - (pi/2 - that double)
        "cvt.rn.f32.f64 r, rd;\n"
        "mul.rn.f32 z, r, r;\n"
        f"fma.rn.f32 ps, z, {_SIN_POLY[0]}, {_SIN_POLY[1]};\n"
        f"fma.rn.f32 ps, ps, z, {_SIN_POLY[2]};\n"
        "mul.rn.f32 ps, ps, z;\n"
        "fma.rn.f32 s, ps, r, r;\n"                           # r + r^3 p(z)
        f"fma.rn.f32 pc, z, {_COS_POLY[0]}, {_COS_POLY[1]};\n"
        f"fma.rn.f32 pc, pc, z, {_COS_POLY[2]};\n"
        "mul.rn.f32 w, z, z;\n"
        "mul.rn.f32 pc, pc, w;\n"
        "fma.rn.f32 c, z, 0fBF000000, 0f3F800000;\n"          # 1 - z / 2
        "add.rn.f32 c, c, pc;\n"                              # + z^2 p(z)
        "and.b32 qb, q, 1;\n"
        "setp.ne.b32 odd, qb, 0;\n"
        "and.b32 qb, q, 2;\n"
        "setp.ne.b32 neg, qb, 0;\n"
        "neg.f32 ns, s;\n"
        "selp.f32 sx, c, s, odd;\n"                           # q odd: sin x = cos r, cos x = -sin r
        "selp.f32 cx, ns, c, odd;\n"
        "neg.f32 s, sx;\n"
        "neg.f32 c, cx;\n"
        "selp.f32 $1, s, sx, neg;\n"                          # q = 2, 3 (mod 4): both negated
        "selp.f32 $0, c, cx, neg;\n"
        "}",
        "=f,=f,l,f", has_side_effects=False, loc=loc, ip=ip)
    return _unpack(res, 2, T.f32(), Float32, loc, ip)
