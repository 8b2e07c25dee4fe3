"""Dense FP8 linear on Hopper (sm_90a) for few tokens: ``x @ (fp8 * scale).T``, the released layout read as it is.

W8A16 on warp-level MMAs (``mma.sync.m16n8k16``, BF16 in, float32 accumulation), the decode path of the FP8 dense
layers (attention projections, shared experts, the indexer's projections) a conversion with ``--dense keep`` leaves
as the source has them: ``weight`` E4M3 bytes [G * N, K] (row-major), ``scale`` [ceil(G * N / 128), K / 128], one
scale per 128 x 128 block, E8M0 bytes (the official releases) or float32 (-Base).

Operand roles, as in the NVFP4 GEMM (``sm90_moe_gemm``): weight rows are the MMA's A operand (16 a warp per row
tile), tokens the B operand (8 per MMA), so one token fills an MMA. Each thread loads its rows' bytes straight from
global memory into a register pipeline: in a 128-K tile, lane quad ``c = lane % 4`` owns k ``16c .. 16c+15`` and
``64+16c .. 64+16c+15`` of a row (32 bytes, two 16-byte loads; the quad's four lanes read each 64-byte half of the
tile whole, so every 32-byte sector a load touches is used by that load, none fetched twice past L1). MMA step ``s``
(0..7) takes the lane's k ``4s .. 4s + 3`` in that order into the fragment slots (2c, 2c+1, 2c+8, 2c+9): one weight
word per step and row, and the two activation words the lane loads for the same k, in memory order (a sum over k
does not depend on which k a slot holds, so long as weights and activations agree).

Decode. An E4M3 byte placed as BF16 bits ``s << 15 | (e m) << 4`` reads as ``value * 2**-120`` for every code,
subnormals included (a prmt and three logic ops per two values). Instead of scaling the weights back, the activations
are scaled: every weight row of a CTA (64 or 128 rows, inside one 128-row scale block) shares the k-tile's block
scale, so each k-tile's activation words are multiplied by ``2**X_LOG2 * scale`` (one BF16 multiply per word, shared
by all the thread's rows; exact for E8M0 scales, which are powers of two; float32 scales are rounded to BF16 there,
a relative 2**-9, finer than the per-128 FP8 quantisation of activations the official inference applies). The
products are then normal floats and the epilogue multiplies by ``2**(120 - X_LOG2)``. Block scales must be at most
``2**63`` (:func:`scales_fit`; every real FP8 weight's are: its values would otherwise exceed ``448 * 2**63``).

Output: float32 or BF16 [T, G * N]; with ``k_splits`` > 1 (float32 only) each of the CTAs that share a tile's K adds
its partial sums (``red.add``) into an output the caller zeroed. The configuration is an ``Fp8LinearConfig``
(``sm90_config``) picked by ``sm90_heuristics.fp8_linear_config``; :meth:`Sm90Fp8Linear.can_implement` says whether
the kernel takes one.
"""

from __future__ import annotations

import functools

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32, Int64, const_expr

from . import sm90_ptx as ptx
from .cute_host import compile_op as _compile, expect as _expect, launch as _launch
from .sm90_config import K_TILE, Fp8LinearConfig
from .sm90_heuristics import (FP8_W8A8_MIN_TOKENS, fp8_kernel_pays, fp8_linear_config, fp8_linear_token_counts,
                              fp8_reads_f32_x, fp8_w8a8_pays, fp8_wgmma_config, fp8_wgmma_pays)

WARPS = 4                 # row groups (warps) per CTA, each 16 * row_tiles weight rows
SCALE_BLOCK = 128         # rows and columns of one block scale
HALF_K = K_TILE // 2       # a k-tile's two halves: lane quad c owns k [LANE_K c, LANE_K (c + 1)) of each
LANE_K = HALF_K // 4
X_LOG2 = 64               # the activations ride the MMAs times 2**X_LOG2 (and the block scale)
DECODE_LOG2 = 120         # an E4M3 byte moved into BF16 bits reads as value * 2**-DECODE_LOG2
_SIGN = 0x80008000 - (1 << 32)   # the two BF16 sign bits (an Int32 constant)
_MAGNITUDE = 0x07F007F0          # the two BF16 halves' bits that take an E4M3 byte's exponent and mantissa


def fp8_violations(config: Fp8LinearConfig) -> list[str]:
    """What in ``config`` the kernel does not take (empty: it takes it)."""
    c, bad = config, []
    rows = WARPS * 16 * c.row_tiles
    if c.row_tiles not in (1, 2):
        bad.append(f"row_tiles must be 1 or 2, got {c.row_tiles}")
    elif c.n <= 0 or c.n % rows:
        bad.append(f"N={c.n} must be a positive multiple of the CTA's {rows} rows")
    bad += groups_and_k_violations(c.n, c.k, c.groups)
    if c.tile_tokens % 8 or not 8 <= c.tile_tokens <= 64:
        bad.append(f"tile_tokens must be a multiple of 8 in [8, 64], got {c.tile_tokens}")
    if c.k_splits < 1 or (c.k_splits > 1 and c.out_bf16):
        bad.append(f"k_splits must be >= 1, and 1 with BF16 out; got {c.k_splits}")
    elif c.depth not in (1, 2, 4) or c.depth * c.row_tiles > 4 or (c.k // K_TILE) % (c.k_splits * c.depth):
        bad.append(f"depth must be 1, 2 or 4, at most 4 / row_tiles, and divide each of the {c.k_splits} K "
                   f"shares' k-tiles ({c.k // K_TILE} in all); got {c.depth}")
    return bad


def groups_and_k_violations(n: int, k: int, groups: int) -> list[str]:
    """What the FP8 linear kernels (mma.sync and WGMMA) do not take in the groups and K of a configuration: each
    group's weight rows whole 128-row scale blocks when there are several, K whole k-tiles."""
    bad = []
    if groups < 1 or (groups > 1 and n % SCALE_BLOCK):
        bad.append(f"groups must be >= 1, and above 1 only with N a multiple of {SCALE_BLOCK}; got {groups} (N={n})")
    if k <= 0 or k % K_TILE:
        bad.append(f"K={k} must be a positive multiple of {K_TILE}")
    return bad


def decode_e4m3x4(w: Int32) -> tuple[Int32, Int32]:
    """Four E4M3 bytes (b0 lowest) -> BF16x2 words (b0, b1), (b2, b3), each ``value * 2**-DECODE_LOG2``."""
    out = []
    for sel in (0x1404, 0x3424):                  # bytes (0, 1) and (2, 3) into the high byte of each half
        t = ptx.prmt(w, Int32(0), sel)
        out.append((t & Int32(_SIGN)) | ((t >> 4) & Int32(_MAGNITUDE)))
    return tuple(out)


class Fp8LinearParts:
    """What the FP8 linear kernels (this mma.sync one, ``sm90_fp8_wgmma``'s WGMMA one) share: the activation
    multiplier of a k-tile's block scale and the store of the accumulators. A kernel class mixes it in and sets
    ``n``, ``groups``, ``row_tiles``, ``nb`` (8-token blocks of a tile), ``k_splits``, ``out_bf16`` and
    ``scale_f32``."""

    def x_multiplier(self, s) -> Int32:
        """``2**X_LOG2 * scale`` as a BF16 pair: an E8M0 byte e is ``2**(e - 127)``, so its BF16 exponent field is
        ``e - 127 + X_LOG2 + 127``; a float32 scale is rounded."""
        if const_expr(self.scale_f32):
            m = Float32(s) * Float32(2.0 ** X_LOG2)
            return ptx.f32x2_to_bf16x2(m, m)
        bits = (Int32(s) + X_LOG2) << 7
        return bits | (bits << 16)

    @cute.jit
    def epilogue(self, acc: cute.Tensor, mOut: cute.Tensor, row_base: Int32, begin: Int32, cnt: Int32, g: Int32,
                 c: Int32):
        """Accumulator (mt, nb, tt) is row ``row_base + 16 mt + g`` of token ``nb * 8 + 2c + tt``, (mt, nb, 2 + tt)
        row + 8 of the same token (the MMA's D fragment)."""
        out_base = mOut.iterator.toint()
        row_elems = self.n * self.groups
        unscale = Float32(2.0 ** (DECODE_LOG2 - X_LOG2))
        for mt in cutlass.range_constexpr(self.row_tiles):
            r0 = row_base + mt * 16 + g
            for nb in cutlass.range_constexpr(self.nb):
                for tt in cutlass.range_constexpr(2):
                    t = nb * 8 + 2 * c + tt
                    if t < cnt:
                        lo = acc[mt, nb, tt] * unscale
                        hi = acc[mt, nb, 2 + tt] * unscale
                        at = Int64(begin + t) * row_elems + Int64(r0)
                        if const_expr(self.out_bf16):
                            ptx.st_global_b16(out_base + at * 2, ptx.f32x2_to_bf16x2(lo, lo))
                            ptx.st_global_b16(out_base + at * 2 + 16, ptx.f32x2_to_bf16x2(hi, hi))
                        elif const_expr(self.k_splits > 1):     # a share of K: summed with the others'
                            ptx.red_add_f32(out_base + at * 4, lo)
                            ptx.red_add_f32(out_base + at * 4 + 32, hi)
                        else:
                            ptx.st_global_f32(out_base + at * 4, lo)
                            ptx.st_global_f32(out_base + at * 4 + 32, hi)


class Sm90Fp8Linear(Fp8LinearParts):
    """One compiled configuration of the FP8 linear (module docstring).

    Launched as ``fn(w, scale, x, out, stream)``: ``w`` uint8 [G * N, K], ``scale`` uint8 (E8M0) or float32
    [ceil(G * N / 128), K / 128], ``x`` BF16 or float32 (``x_f32``) [T, G * K], ``out`` float32 or BF16 [T, G * N].
    """

    def __init__(self, config: Fp8LinearConfig):
        bad = fp8_violations(config)
        _expect(not bad, f"FP8 linear {config}: " + "; ".join(bad))
        self.config = config
        self.n, self.k, self.groups = config.n, config.k, config.groups
        self.row_tiles, self.depth, self.k_splits = config.row_tiles, config.depth, config.k_splits
        self.out_bf16, self.scale_f32 = config.out_bf16, config.scale_f32
        self.bm = WARPS * 16 * config.row_tiles
        self.bn = config.tile_tokens
        self.nb = config.tile_tokens // 8
        self.threads = WARPS * 32
        self.n_kt = config.k // K_TILE // config.k_splits     # k-tiles per CTA
        # tiles of up to two 8-token blocks load the next k-tile's activation words a k-tile ahead; wider ones load
        # them at the k-tile (registers: 16 a block; their MMAs per weight byte and the other warps cover the wait)
        self.x_ahead = self.nb <= 2
        self.xbytes = 4 if config.x_f32 else 2      # bytes of an activation as the kernel reads it
        self.xwords = 8 * self.xbytes               # 32-bit words of a lane's 32 activations of a k-tile

    @staticmethod
    def can_implement(config: Fp8LinearConfig) -> bool:
        return not fp8_violations(config)

    def key(self) -> tuple:
        return (self.config,)

    @cute.jit
    def __call__(self, mW: cute.Tensor, mS: cute.Tensor, mX: cute.Tensor, mOut: cute.Tensor, stream):
        n_tiles = (mX.shape[0] + self.bn - 1) // self.bn
        self.kernel(mW, mS, mX, mOut).launch(grid=[self.n // self.bm, n_tiles, self.groups * self.k_splits],
                                             block=[self.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mW: cute.Tensor, mS: cute.Tensor, mX: cute.Tensor, mOut: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bx, by, bz = cute.arch.block_idx()
        group = bz // self.k_splits
        kt0 = (bz % self.k_splits) * self.n_kt
        warp = tidx // 32
        lane = tidx % 32
        g = lane // 4
        c = lane % 4
        k, n = self.k, self.n
        begin = by * self.bn
        cnt = mX.shape[0] - begin
        if cnt > self.bn:
            cnt = self.bn
        row_base = group * n + bx * self.bm + warp * (16 * self.row_tiles)   # a row of the stacked [G * N, K]
        scale_row = (group * n + bx * self.bm) // SCALE_BLOCK                 # the CTA's block row of scales

        # per-thread addresses (bytes): its rows' first bytes in the k-tiles, its tokens' activation words
        w_addr = cute.make_rmem_tensor((self.row_tiles, 2), Int64)
        for mt in cutlass.range_constexpr(self.row_tiles):
            for h in cutlass.range_constexpr(2):
                w_addr[mt, h] = mW.iterator.toint() + Int64(row_base + mt * 16 + h * 8 + g) * k + Int64(c * LANE_K)
        x_addr = cute.make_rmem_tensor((self.nb,), Int64)
        for nb in cutlass.range_constexpr(self.nb):
            t = nb * 8 + g
            if t > cnt - 1:
                t = cnt - 1                     # columns past the tile's tokens read its last one (not stored)
            x_addr[nb] = (mX.iterator.toint() + Int64(begin + t) * (self.xbytes * k * self.groups)
                          + Int64((group * k + c * LANE_K) * self.xbytes))

        D = self.depth
        wbuf = cute.make_rmem_tensor((D, self.row_tiles, 2, 8), Int32)
        mbuf = cute.make_rmem_tensor((D,), Int32)
        xnext = cute.make_rmem_tensor((self.nb, self.xwords), Int32)   # as loaded (float32 x: not yet rounded)
        acc = cute.make_rmem_tensor((self.row_tiles, self.nb, 4), Float32)
        acc.fill(0.0)
        kt_last = kt0 + self.n_kt - 1
        for d in cutlass.range_constexpr(D):
            self.load_stage(mS, wbuf, mbuf, w_addr, scale_row, d, kt0 + d)
        if const_expr(self.x_ahead):
            self.load_x(xnext, x_addr, kt0)

        for kto in cutlass.range(0, self.n_kt, D, unroll=1):
            for d in cutlass.range_constexpr(D):
                kt = kt0 + kto + d
                cw = cute.make_rmem_tensor((self.row_tiles, 2, 8), Int32)
                for mt in cutlass.range_constexpr(self.row_tiles):
                    for h in cutlass.range_constexpr(2):
                        for i in cutlass.range_constexpr(8):
                            cw[mt, h, i] = wbuf[d, mt, h, i]
                mult = mbuf[d]
                xw = cute.make_rmem_tensor((self.nb, 16), Int32)
                if const_expr(self.x_ahead):
                    self.to_bf16_words(xnext, xw)
                    nxb = kt + 1
                    if nxb > kt_last:
                        nxb = kt_last
                    self.load_x(xnext, x_addr, nxb)
                else:
                    raw = cute.make_rmem_tensor((self.nb, self.xwords), Int32)
                    self.load_x(raw, x_addr, kt)
                    self.to_bf16_words(raw, xw)
                # refill the slot with k-tile kt + D (clamped: a re-read of the last one hits the cache)
                nxt = kt + D
                if nxt > kt_last:
                    nxt = kt_last
                self.load_stage(mS, wbuf, mbuf, w_addr, scale_row, d, nxt)
                self.mma_ktile(cw, xw, mult, acc)

        self.epilogue(acc, mOut, row_base, begin, cnt, g, c)

    def load_stage(self, mS: cute.Tensor, wbuf: cute.Tensor, mbuf: cute.Tensor, w_addr: cute.Tensor,
                   scale_row: Int32, slot: int, kt: Int32) -> None:
        """Pipeline slot ``slot`` <- k-tile ``kt``: the thread's 32 weight bytes of each of its rows and the
        activation multiplier of the k-tile's block scale."""
        for mt in range(self.row_tiles):
            for h in range(2):
                for q in range(2):
                    v = ptx.ld_global_v4(w_addr[mt, h] + Int64(kt * K_TILE + q * HALF_K))
                    for i in range(4):
                        wbuf[slot, mt, h, q * 4 + i] = v[i]
        mbuf[slot] = self.x_multiplier(mS[scale_row, kt])

    def load_x(self, raw: cute.Tensor, x_addr: cute.Tensor, kt: Int32) -> None:
        """The lane's activation words of k-tile ``kt`` (its 32 k: 16 BF16 pairs, or 32 floats) for each 8-token
        block, as they are in memory."""
        per_half = self.xwords // 8                # 16-byte loads a half of the lane's k takes
        for nb in range(self.nb):
            for q in range(self.xwords // 4):
                at = kt * K_TILE * self.xbytes + (q // per_half) * HALF_K * self.xbytes + (q % per_half) * 16
                v = ptx.ld_global_v4_keep(x_addr[nb] + Int64(at))
                for i in range(4):
                    raw[nb, q * 4 + i] = v[i]

    def to_bf16_words(self, raw: cute.Tensor, xw: cute.Tensor) -> None:
        """Loaded activation words -> the 16 BF16 pairs an 8-token block's MMAs take (float32 x: rounded to nearest
        even here, as torch's cast to BF16 rounds; an early load's latency is not waited for until now)."""
        for nb in range(self.nb):
            for i in range(16):
                if const_expr(self.config.x_f32):
                    lo, hi = ptx.f32_of_bits(raw[nb, 2 * i]), ptx.f32_of_bits(raw[nb, 2 * i + 1])
                    xw[nb, i] = ptx.f32x2_to_bf16x2(lo, hi)
                else:
                    xw[nb, i] = raw[nb, i]

    @cute.jit
    def mma_ktile(self, cw: cute.Tensor, xw: cute.Tensor, mult: Int32, acc: cute.Tensor):
        # the k-tile's A fragments first (row g's and g + 8's k (4s, 4s + 1) and (4s + 2, 4s + 3) of the lane's 32 at
        # step s), then each token block's MMAs: a block's activation words are live only for its own
        a = cute.make_rmem_tensor((self.row_tiles, 8, 4), Int32)
        for mt in cutlass.range_constexpr(self.row_tiles):
            for s in cutlass.range_constexpr(8):
                a[mt, s, 0], a[mt, s, 2] = decode_e4m3x4(cw[mt, 0, s])
                a[mt, s, 1], a[mt, s, 3] = decode_e4m3x4(cw[mt, 1, s])
        for nb in cutlass.range_constexpr(self.nb):
            for i in cutlass.range_constexpr(16):
                xw[nb, i] = ptx.mul_bf16x2(xw[nb, i], mult)
            for mt in cutlass.range_constexpr(self.row_tiles):
                for s in cutlass.range_constexpr(8):
                    d = ptx.mma_bf16_16816(a[mt, s, 0], a[mt, s, 1], a[mt, s, 2], a[mt, s, 3], xw[nb, 2 * s],
                                           xw[nb, 2 * s + 1], acc[mt, nb, 0], acc[mt, nb, 1], acc[mt, nb, 2],
                                           acc[mt, nb, 3])
                    for i in cutlass.range_constexpr(4):
                        acc[mt, nb, i] = d[i]

class Sm90Fp8Dequant:
    """An FP8 weight dequantised to BF16 (``fp8 * scale``, exact with E8M0 scales; float32 scales: the float32
    product rounded once), for the calls of more tokens than the kernel takes: one thread per 16 weight bytes (a
    16-byte load, the hardware's E4M3 -> f16x2 -> f32 conversion, the block scale, two 16-byte stores), so a weight
    costs about its bytes read once and twice written.

    Launched as ``fn(w, scale, out, stream)``: ``w`` uint8 [R, K] (K a multiple of 128), ``scale`` uint8 (E8M0) or
    float32 [ceil(R / 128), K / 128], ``out`` BF16 [R, K].
    """

    THREADS = 256

    def __init__(self, *, scale_f32: bool):
        self.scale_f32 = scale_f32

    def key(self) -> tuple:
        return (self.scale_f32,)

    @cute.jit
    def __call__(self, mW: cute.Tensor, mS: cute.Tensor, mOut: cute.Tensor, stream):
        chunks = mW.shape[0] * (mW.shape[1] // 16)
        self.kernel(mW, mS, mOut).launch(grid=[(chunks + self.THREADS - 1) // self.THREADS, 1, 1],
                                         block=[self.THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mW: cute.Tensor, mS: cute.Tensor, mOut: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bx, _, _ = cute.arch.block_idx()
        per_row = mW.shape[1] // 16
        chunk = bx * self.THREADS + tidx
        if chunk < mW.shape[0] * per_row:
            row = chunk // per_row
            col = (chunk % per_row) * 16
            if const_expr(self.scale_f32):
                s = Float32(mS[row // SCALE_BLOCK, col // SCALE_BLOCK])
            else:
                s = ptx.e8m0_to_f32(Int32(mS[row // SCALE_BLOCK, col // SCALE_BLOCK]))
            v = ptx.ld_global_v4(mW.iterator.toint() + Int64(chunk) * 16)
            words = []
            for i in cutlass.range_constexpr(4):
                for half in cutlass.range_constexpr(2):
                    lo, hi = ptx.e4m3x2_to_f32x2(v[i] >> (16 * half))
                    words.append(ptx.f32x2_to_bf16x2(lo * s, hi * s))
            at = mOut.iterator.toint() + Int64(chunk) * 32
            ptx.st_global_v4_b32(at, *words[:4])
            ptx.st_global_v4_b32(at + 16, *words[4:])


# -- host -----------------------------------------------------------------------------------------------------------
def can_implement(n: int, k: int, groups: int = 1) -> bool:
    """Whether the kernel tiles ``groups`` W [N, K] (N a multiple of 64 rows, 128 with groups; K of 128)."""
    return n > 0 and k > 0 and Sm90Fp8Linear.can_implement(fp8_linear_config(n, k, 1, groups=groups))


@functools.lru_cache(maxsize=None)
def linear_op(config: Fp8LinearConfig) -> Sm90Fp8Linear:
    """One kernel object per configuration: a call (every FP8 linear of a decode step) does not check it again."""
    return Sm90Fp8Linear(config)


MAX_SCALE_LOG2 = 127 - X_LOG2      # the largest block scale, 2**63, whose activation multiplier is a finite BF16 ...
MAX_E8M0 = 127 + MAX_SCALE_LOG2     # ... as an E8M0 byte (190)


def scales_fit(scale: torch.Tensor) -> bool:
    """Whether every block scale is one the kernel takes (at most ``2**MAX_SCALE_LOG2``, finite, and not negative):
    a larger one would make its activation multiplier infinite. No weight of a real checkpoint comes near (its values
    would exceed ``448 * 2**63``); the backend runs such a weight on the reference. Reads the scales (a device sync)."""
    if scale.dtype in (torch.float8_e8m0fnu, torch.uint8):
        return scale.numel() == 0 or int(scale.view(torch.uint8).max()) <= MAX_E8M0
    return bool(torch.isfinite(scale).all() and (scale >= 0).all() and (scale <= 2.0 ** MAX_SCALE_LOG2).all())


def _scale_operand(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 scales as their bytes (the kernels take uint8), float32 ones as they are."""
    return scale.view(torch.uint8) if scale.dtype == torch.float8_e8m0fnu else scale


def warmup(n: int, k: int, device: torch.device | str, scale_dtype: torch.dtype = torch.uint8,
           out_dtype: torch.dtype = torch.float32, groups: int = 1, x_dtype: torch.dtype = torch.float32) -> int:
    """Compile every configuration :func:`sm90_fp8_linear` can pick for ``groups`` W [N, K] with these scales and x
    (float32, as the runtime passes it, or BF16), so no call compiles; returns how many."""
    dev = torch.device(device)
    scale_f32 = scale_dtype == torch.float32
    w = torch.empty(groups * n, k, dtype=torch.uint8, device=dev)
    s = torch.empty(-(-groups * n // SCALE_BLOCK), k // K_TILE, dtype=torch.float32 if scale_f32 else torch.uint8,
                    device=dev)
    x = torch.empty(1, groups * k, dtype=x_dtype, device=dev)
    out = torch.empty(1, groups * n, dtype=out_dtype, device=dev)
    configs = {fp8_linear_config(n, k, t, out_dtype == torch.bfloat16, groups, scale_f32,
                                 x_dtype == torch.float32 and fp8_reads_f32_x(t))
               for t in fp8_linear_token_counts()}
    for config in configs:
        _compile(linear_op(config), [w, s, x if config.x_f32 else x.to(torch.bfloat16), out])
    _compile(Sm90Fp8Dequant(scale_f32=scale_f32), [w, s, torch.empty(w.shape, dtype=torch.bfloat16, device=dev)])
    wgmma = 0
    if out_dtype == torch.float32:
        from . import sm90_fp8_wgmma

        wgmma = sm90_fp8_wgmma.warmup(n, k, dev, scale_dtype, groups)
        from . import sm90_fp8_gemm

        if sm90_fp8_gemm.can_implement(n, k, groups):
            wgmma += sm90_fp8_gemm.warmup(n, k, dev, scale_dtype, groups, x_dtype, min_tokens=FP8_W8A8_MIN_TOKENS)
    return len(configs) + 1 + wgmma


def _dequantized_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, out: torch.Tensor,
                        groups: int) -> torch.Tensor:
    """A long call: W dequantised to BF16 (``Sm90Fp8Dequant``), then cuBLAS BF16 with float32 accumulation."""
    t = x.shape[0]
    x = x.to(torch.bfloat16)
    w = torch.empty(weight.shape, dtype=torch.bfloat16, device=weight.device)
    dequant = Sm90Fp8Dequant(scale_f32=scale.dtype == torch.float32)
    _launch(dequant, [weight.view(torch.uint8), _scale_operand(scale), w])
    if groups == 1:
        return torch.mm(x, w.T, out_dtype=out.dtype, out=out)
    w = w.view(groups, -1, weight.shape[1])
    y = torch.bmm(x.view(t, groups, -1).transpose(0, 1), w.transpose(1, 2), out_dtype=torch.float32)
    out.view(t, groups, -1).copy_(y.transpose(0, 1))
    return out


def fp8_operands(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, groups: int) -> tuple[int, int]:
    """Check the FP8 linears' operands (the contract of :func:`sm90_fp8_linear`, which the WGMMA and W8A8 hosts share)
    and return each group's (N, K); ``KernelArgumentError`` naming the first one that does not fit."""
    _expect(groups >= 1 and weight.dim() == 2 and weight.shape[0] % groups == 0,
            f"weight rows {tuple(weight.shape)} must split into {groups} groups")
    n, k = weight.shape[0] // groups, weight.shape[1]
    _expect(weight.dtype in (torch.float8_e4m3fn, torch.uint8) and weight.is_contiguous(),
            f"weight must be contiguous float8_e4m3fn or uint8, got {weight.dtype}")
    _expect(x.dtype in (torch.bfloat16, torch.float32) and x.dim() == 2 and x.shape[1] == groups * k
            and x.shape[0] >= 1 and x.is_contiguous(), f"x must be contiguous bf16 or f32 [T >= 1, G*K={groups * k}], "
                                                       f"got {x.dtype} {tuple(x.shape)}")
    want = (-(-groups * n // SCALE_BLOCK), -(-k // SCALE_BLOCK))
    _expect(tuple(scale.shape) == want and scale.dtype in (torch.float8_e8m0fnu, torch.uint8, torch.float32)
            and scale.is_contiguous(), f"scale must be contiguous E8M0 or float32 {want}, got {scale.dtype} "
                                       f"{tuple(scale.shape)}")
    return n, k


def sm90_fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, out: torch.Tensor | None = None,
                    out_dtype: torch.dtype = torch.float32, groups: int = 1) -> torch.Tensor:
    """Dense FP8 linear ``x @ (weight * scale).T``, or ``groups`` of them: ``out[t, g] = x[t, g] @ W[g].T``.

    ``x`` BF16 or float32 [T, G * K] (T >= 1; float32: rounded to BF16 as the kernel reads it, or cast first where
    ``sm90_heuristics.fp8_reads_f32_x`` says no); ``weight``
    float8_e4m3fn or its uint8 bytes [G * N, K] (group g: rows g N .. (g + 1) N); ``scale`` [ceil(G * N / 128),
    K / 128], E8M0 (float8_e8m0fnu or uint8 bytes) or float32. Returns ``out_dtype`` (float32 or BF16) [T, G * N].
    Calls of the token counts ``sm90_heuristics.fp8_wgmma_pays`` names run the WGMMA kernel (``sm90_fp8_wgmma``,
    float32 out, where it tiles W); calls of more tokens than the mma.sync kernel pays for
    (``sm90_heuristics.fp8_kernel_pays``) dequantise W to BF16 and run cuBLAS."""
    n, k = fp8_operands(x, weight, scale, groups)
    if out is None:
        out = torch.empty(x.shape[0], groups * n, dtype=out_dtype, device=x.device)
    _expect(tuple(out.shape) == (x.shape[0], groups * n) and out.dtype in (torch.bfloat16, torch.float32)
            and out.is_contiguous(), f"out must be contiguous bf16/f32 [T, G*N={groups * n}], got {out.dtype} "
                                     f"{tuple(out.shape)}")
    # the operands are checked: the other kernels' launches, not their checking hosts
    if fp8_wgmma_pays(x.shape[0]) and out.dtype == torch.float32:
        from . import sm90_fp8_wgmma   # it builds on this module's parts

        config = fp8_wgmma_config(n, k, x.shape[0], groups, scale.dtype == torch.float32)
        if config is not None and sm90_fp8_wgmma.Sm90Fp8WgmmaLinear.can_implement(config):
            return sm90_fp8_wgmma.launch_linear(x, weight, scale, out, config)
    if fp8_w8a8_pays(x.shape[0]) and out.dtype == torch.float32 and weight.data_ptr() % 16 == 0:
        from . import sm90_fp8_gemm

        if sm90_fp8_gemm.can_implement(n, k, groups):
            return sm90_fp8_gemm.launch_gemm(x, weight, scale, out, groups)
    if not fp8_kernel_pays(x.shape[0]):
        return _dequantized_linear(x, weight, scale, out, groups)
    if x.dtype == torch.float32 and not fp8_reads_f32_x(x.shape[0]):
        x = x.to(torch.bfloat16)
    config = fp8_linear_config(n, k, x.shape[0], out.dtype == torch.bfloat16, groups, scale.dtype == torch.float32,
                               x.dtype == torch.float32)
    op = linear_op(config)
    if op.k_splits > 1:
        out.zero_()  # the K shares add into it
    _launch(op, [weight.view(torch.uint8), _scale_operand(scale), x, out])
    return out