"""Inline-PTX building blocks of the SM90 decode attention (what CuTeDSL 4.8 has no plain op for).

Shared memory is addressed by 32-bit ``.shared`` addresses (``smem_ptr.toint()``), global memory by
64-bit generic addresses (``gmem_ptr.toint()``). Every helper is a pure function of 32-bit registers
(``Int32`` / ``Float32``) unless it stores or copies:

* ``cp.async.cg`` 16-byte global -> shared copies with zero fill (gathered KV rows);
* ``ldmatrix`` (plain and ``.trans``) for ``mma.sync`` operand fragments;
* ``mma.sync.m16n8k16`` BF16 x BF16 -> FP32;
* shared / global scalar and vector stores, ``ex2.approx``, BF16x2 packing.
"""

from __future__ import annotations

from cutlass import Float32, Int32, Int64
from cutlass._mlir import ir
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op


def _struct(n: int, ty: str = "i32") -> ir.Type:
    return ir.Type.parse("!llvm.struct<(" + ", ".join([ty] * n) + ")>")


def _unpack(res, n: int, ty, wrap, loc=None, ip=None):
    return tuple(wrap(llvm.extractvalue(ty, res, [i], loc=loc, ip=ip)) for i in range(n))


def _i32(v, loc, ip):
    return Int32(v).ir_value(loc=loc, ip=ip)


def _f32(v, loc, ip):
    return Float32(v).ir_value(loc=loc, ip=ip)


@dsl_user_op
def cp_async_16(smem: Int32, gaddr: Int64, src_bytes: Int32, *, loc=None, ip=None) -> None:
    """``cp.async.cg.shared.global`` of 16 bytes; bytes past ``src_bytes`` (0 or 16) are zero-filled."""
    llvm.inline_asm(
        None, [_i32(smem, loc, ip), Int64(gaddr).ir_value(loc=loc, ip=ip), _i32(src_bytes, loc, ip)],
        "cp.async.cg.shared.global [$0], [$1], 16, $2;", "r,l,r", has_side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def ldmatrix_x4(smem: Int32, *, loc=None, ip=None) -> tuple[Int32, Int32, Int32, Int32]:
    """``ldmatrix.sync.aligned.m8n8.x4.shared.b16``: lanes 8i..8i+7 give the row addresses of matrix i."""
    res = llvm.inline_asm(
        _struct(4), [_i32(smem, loc, ip)],
        "ldmatrix.sync.aligned.m8n8.x4.shared.b16 {$0, $1, $2, $3}, [$4];",
        "=r,=r,=r,=r,r", has_side_effects=True, loc=loc, ip=ip)
    return _unpack(res, 4, T.i32(), Int32, loc, ip)


@dsl_user_op
def ldmatrix_x4_trans(smem: Int32, *, loc=None, ip=None) -> tuple[Int32, Int32, Int32, Int32]:
    """``ldmatrix ... .x4.trans``: as :func:`ldmatrix_x4`, each 8x8 matrix transposed."""
    res = llvm.inline_asm(
        _struct(4), [_i32(smem, loc, ip)],
        "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {$0, $1, $2, $3}, [$4];",
        "=r,=r,=r,=r,r", has_side_effects=True, loc=loc, ip=ip)
    return _unpack(res, 4, T.i32(), Int32, loc, ip)


@dsl_user_op
def mma_bf16_16816(a0: Int32, a1: Int32, a2: Int32, a3: Int32, b0: Int32, b1: Int32,
                   c0: Float32, c1: Float32, c2: Float32, c3: Float32, *, loc=None, ip=None
                   ) -> tuple[Float32, Float32, Float32, Float32]:
    """``mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32``: D = A B + C on one warp."""
    args = [_i32(v, loc, ip) for v in (a0, a1, a2, a3, b0, b1)] + [_f32(v, loc, ip) for v in (c0, c1, c2, c3)]
    res = llvm.inline_asm(
        _struct(4, "f32"), args,
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};",
        "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", has_side_effects=False, loc=loc, ip=ip)
    return _unpack(res, 4, T.f32(), Float32, loc, ip)


@dsl_user_op
def ld_shared_f32x2(smem: Int32, *, loc=None, ip=None) -> tuple[Float32, Float32]:
    res = llvm.inline_asm(
        _struct(2, "f32"), [_i32(smem, loc, ip)],
        "ld.shared.v2.f32 {$0, $1}, [$2];", "=f,=f,r", has_side_effects=True, loc=loc, ip=ip)
    return _unpack(res, 2, T.f32(), Float32, loc, ip)


@dsl_user_op
def ld_shared_f32(smem: Int32, *, loc=None, ip=None) -> Float32:
    return Float32(llvm.inline_asm(
        T.f32(), [_i32(smem, loc, ip)], "ld.shared.f32 $0, [$1];", "=f,r", has_side_effects=True, loc=loc, ip=ip))


@dsl_user_op
def st_shared_f32(smem: Int32, v: Float32, *, loc=None, ip=None) -> None:
    llvm.inline_asm(None, [_i32(smem, loc, ip), _f32(v, loc, ip)], "st.shared.f32 [$0], $1;", "r,f",
                    has_side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def st_shared_b32(smem: Int32, v: Int32, *, loc=None, ip=None) -> None:
    llvm.inline_asm(None, [_i32(smem, loc, ip), _i32(v, loc, ip)], "st.shared.b32 [$0], $1;", "r,r",
                    has_side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def st_global_b32(addr: Int64, v: Int32, *, loc=None, ip=None) -> None:
    llvm.inline_asm(None, [Int64(addr).ir_value(loc=loc, ip=ip), _i32(v, loc, ip)], "st.global.b32 [$0], $1;",
                    "l,r", has_side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def st_global_v2_f32(addr: Int64, a: Float32, b: Float32, *, loc=None, ip=None) -> None:
    llvm.inline_asm(None, [Int64(addr).ir_value(loc=loc, ip=ip), _f32(a, loc, ip), _f32(b, loc, ip)],
                    "st.global.v2.f32 [$0], {$1, $2};", "l,f,f", has_side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def st_global_v2_b32(addr: Int64, a: Int32, b: Int32, *, loc=None, ip=None) -> None:
    llvm.inline_asm(None, [Int64(addr).ir_value(loc=loc, ip=ip), _i32(a, loc, ip), _i32(b, loc, ip)],
                    "st.global.v2.b32 [$0], {$1, $2};", "l,r,r", has_side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def ld_global_v4_f32(addr: Int64, *, loc=None, ip=None) -> tuple[Float32, Float32, Float32, Float32]:
    """16 bytes of float32 from a 16-aligned global address (L2-resident partials: ``.cg``). Pure: only
    for data no thread of the same launch writes."""
    res = llvm.inline_asm(
        _struct(4, "f32"), [Int64(addr).ir_value(loc=loc, ip=ip)],
        "ld.global.cg.v4.f32 {$0, $1, $2, $3}, [$4];", "=f,=f,=f,=f,l", has_side_effects=False, loc=loc, ip=ip)
    return _unpack(res, 4, T.f32(), Float32, loc, ip)


@dsl_user_op
def ld_global_v2_f32(addr: Int64, *, loc=None, ip=None) -> tuple[Float32, Float32]:
    res = llvm.inline_asm(
        _struct(2, "f32"), [Int64(addr).ir_value(loc=loc, ip=ip)],
        "ld.global.cg.v2.f32 {$0, $1}, [$2];", "=f,=f,l", has_side_effects=False, loc=loc, ip=ip)
    return _unpack(res, 2, T.f32(), Float32, loc, ip)


@dsl_user_op
def ex2(x: Float32, *, loc=None, ip=None) -> Float32:
    """``ex2.approx.ftz.f32`` (2**-inf = 0)."""
    return Float32(llvm.inline_asm(T.f32(), [_f32(x, loc, ip)], "ex2.approx.ftz.f32 $0, $1;", "=f,f",
                                   has_side_effects=False, loc=loc, ip=ip))


@dsl_user_op
def f32x2_to_bf16x2(lo: Float32, hi: Float32, *, loc=None, ip=None) -> Int32:
    """Pack two floats as BF16x2 (``lo`` in the low half), round to nearest even."""
    return Int32(llvm.inline_asm(
        T.i32(), [_f32(hi, loc, ip), _f32(lo, loc, ip)],
        "cvt.rn.bf16x2.f32 $0, $1, $2;", "=r,f,f", has_side_effects=False, loc=loc, ip=ip))
