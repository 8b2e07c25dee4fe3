"""Dense FP8 linear on Hopper (sm_90a) on warpgroup MMAs (``wgmma``): ``x @ (fp8 * scale).T`` for calls of 32 tokens
and more (decode batches, prefill chunks), the released layout read as it is.

Operands and results as ``sm90_fp8_linear`` (whose docstring holds the FP8 contract): ``weight`` E4M3 bytes
[G * N, K], ``scale`` [ceil(G * N / 128), K / 128] (E8M0 bytes or float32), ``x`` BF16 [T, G * K] (the host casts
float32 x first, as ``sm90_fp8_linear`` already does past ``sm90_heuristics.fp8_reads_f32_x``: staging float32
would double the activation bytes and the staging registers), ``out`` float32 [T, G * N]. What changes is the MMA,
as between the NVFP4 mma.sync and WGMMA GEMMs (``sm90_moe_wgmma``):

* A = the weights, 64 rows a warpgroup (16 a warp: rows g and g + 8 of lane ``4 g + c``), loaded and decoded in
  registers exactly as the mma.sync FP8 kernel does (lane quad ``c`` owns k ``16c .. 16c+15`` and
  ``64+16c .. 64+16c+15`` of a 128-K tile, two 16-byte loads a row; :func:`~.sm90_fp8_linear.decode_e4m3x4`, a
  ``prmt`` and three logic ops per two weights, exact, where the hardware's E4M3 conversion reaches BF16 only
  through f16 and f32, four ``cvt`` per two), ``depth`` k-tiles ahead in a register pipeline. The register
  fragment of ``wgmma ... m64nNk16`` with A in registers is, per warp, the m16n8k16 A fragment, so MMA step ``s``
  (0..7) takes the lane's k ``4s .. 4s+3`` into the fragment's slots (2c, 2c+1, 2c+8, 2c+9).
* B = ``tile_tokens`` (N) activation rows in shared memory, K-major, 128-byte swizzle (two 64-K halves a tile), in
  a ring of ``STAGES`` tiles, read by the tensor cores through a matrix descriptor. The weight fragment above fixes
  which logical k each staged column must hold: in BF16 pairs, staged pair ``32 H + 4 j + c`` of a tile holds
  logical pair ``32 H + 8 c + j`` (H the 64-K half, j 0..7, c 0..3), a transpose of 4-byte words that no 16-byte
  copy makes. So x is staged through registers: a staging unit (a token row, a half H, j0 = 0 or 4) loads the four
  16-byte runs ``32 H + 8 c + j0 ..``, c = 0..3 (adjacent units read adjacent runs: every sector a load instruction
  touches is used by it), transposes them in registers (renaming only) and stores four 16-byte chunks ``j0 .. j0+3``
  of its row. Rows past the tile's tokens repeat its last token (their outputs are not stored).
* Block scale on the activations, as in the mma.sync kernel: a CTA's 64 or 128 rows lie in one 128-row scale block,
  so k-tile ``kt``'s words are multiplied by ``2**X_LOG2 * scale[kt]`` as they are staged: one BF16 multiply per
  word of x per CTA, where scaling the decoded A fragment would cost one per two weights of every thread's rows;
  exact with E8M0 scales, a relative 2**-9 with float32 ones (rounded to BF16 there), the same products as
  ``sm90_fp8_linear``'s. The epilogue multiplies by ``2**(DECODE_LOG2 - X_LOG2)`` (``Fp8LinearParts``).

Per k-tile kt: proxy fence and barrier (everyone's stores of x(kt) are visible to the tensor cores, and everyone is
past ``wait_group 1`` of kt - 1, so the MMAs of kt - 2 are done and their stage is free), store x(kt + 1) from
registers into stage (kt + 1) % 3, load x(kt + 2) into them, refill the weight pipeline with k-tile kt + depth,
decode A(kt), ``wgmma.fence``, 8 ``wgmma`` (k16 steps) on stage kt % 3, commit, ``wait_group 1``: the MMAs of kt
run while A(kt + 1) is decoded, x arrives a k-tile ahead of its store and two ahead of its MMAs.

With ``k_splits`` > 1 each of the CTAs that share a tile's K adds its partial sums (``red.add``) into an output the
caller zeroed. The configuration is an ``Fp8WgmmaConfig`` (``sm90_config``), picked by
``sm90_heuristics.fp8_wgmma_config``; ``sm90_fp8_linear`` runs it for the calls ``sm90_heuristics.fp8_wgmma_pays``
names (33 to 128 tokens); ``bench/fp8_linear_bench.py`` times it beside the other paths (column ``fp8_wgmma``).
"""

from __future__ import annotations

import functools

import cutlass
import cutlass.cute as cute
import cutlass.cute.nvgpu.warpgroup as warpgroup
import torch
from cutlass import Float32, Int32, Int64

from . import sm90_ptx as ptx
from .cute_host import compile_op as _compile, expect as _expect, launch as _launch
from .sm90_config import K_TILE, Fp8WgmmaConfig
from .sm90_fp8_linear import (LANE_K, SCALE_BLOCK, Fp8LinearParts, _scale_operand, decode_e4m3x4, fp8_operands,
                              groups_and_k_violations)
from .sm90_heuristics import fp8_wgmma_config, fp8_wgmma_pays, fp8_wgmma_token_counts

STAGES = 3           # staged x tiles: the MMAs' (kt), the one in flight before them (kt - 1), the one being stored
UNIT_WORDS = 16      # 32-bit words (BF16 pairs) a staging unit moves a k-tile: four runs of four
TILE_BYTES = K_TILE * 2  # bytes of one token's BF16 k-tile


def _smem_bytes(tile_tokens: int) -> int:
    """Shared memory a CTA asks for: the stage ring (N rows of 256 bytes a stage) and room to align it to 1024."""
    return STAGES * tile_tokens * TILE_BYTES + 1024


def fp8_wgmma_violations(config: Fp8WgmmaConfig) -> list[str]:
    """What in ``config`` the kernel does not take (empty: it takes it)."""
    c, bad = config, []
    if c.warpgroups not in (1, 2):
        bad.append(f"warpgroups must be 1 or 2, got {c.warpgroups}")
    elif c.n <= 0 or c.n % (64 * c.warpgroups):
        bad.append(f"N={c.n} must be a positive multiple of the CTA's {64 * c.warpgroups} rows")
    elif (4 * c.tile_tokens) % (128 * c.warpgroups):
        bad.append(f"the {4 * c.tile_tokens} staging units of N = {c.tile_tokens} must be a multiple of the CTA's "
                   f"{128 * c.warpgroups} threads")
    bad += groups_and_k_violations(c.n, c.k, c.groups)
    if c.tile_tokens % 16 or not 16 <= c.tile_tokens <= 256:
        bad.append(f"tile_tokens must be a multiple of 16 in [16, 256], got {c.tile_tokens}")
    elif _smem_bytes(c.tile_tokens) > ptx.SMEM_LIMIT:
        bad.append(f"{STAGES} stages of N = {c.tile_tokens} take {_smem_bytes(c.tile_tokens)} bytes of shared memory, "
                   f"more than the {ptx.SMEM_LIMIT} a CTA may have")
    k_tiles = c.k // K_TILE if c.k > 0 and c.k % K_TILE == 0 else 0
    if c.k_splits < 1 or (k_tiles and k_tiles % c.k_splits):
        bad.append(f"k_splits must be >= 1 and divide the {k_tiles} k-tiles, got {c.k_splits}")
    elif k_tiles:
        share = k_tiles // c.k_splits
        # as in the NVFP4 WGMMA GEMM: one k-tile in flight over several computed non-finite outputs there (the next
        # k-tile's decode reusing the A registers of a wgmma still in flight across the loop's back edge)
        if c.depth not in (1, 2, 4) or share % c.depth or (c.depth == 1 and share > 1):
            bad.append(f"depth must divide each share's {share} k-tiles, and be 2 or 4 unless it is one k-tile; "
                       f"got {c.depth}")
    if c.min_ctas < 1:
        bad.append(f"min_ctas must be >= 1, got {c.min_ctas}")
    return bad


class Sm90Fp8WgmmaLinear(Fp8LinearParts):
    """One compiled configuration of the FP8 WGMMA linear (module docstring).

    Launched as ``fn(w, scale, x, out, stream)``: ``w`` uint8 [G * N, K], ``scale`` uint8 (E8M0) or float32
    [ceil(G * N / 128), K / 128], ``x`` BF16 [T, G * K], ``out`` float32 [T, G * N] (zeroed first with
    ``k_splits`` > 1).
    """

    def __init__(self, config: Fp8WgmmaConfig):
        bad = fp8_wgmma_violations(config)
        _expect(not bad, f"FP8 WGMMA linear {config}: " + "; ".join(bad))
        self.config = config
        self.n, self.k, self.groups = config.n, config.k, config.groups
        self.depth, self.k_splits, self.min_ctas = config.depth, config.k_splits, config.min_ctas
        self.out_bf16, self.scale_f32 = False, config.scale_f32
        self.row_tiles = 1                      # one m64 MMA a warpgroup: a warp's 16 rows
        self.wgs = config.warpgroups
        self.threads = 128 * config.warpgroups
        self.bm = 64 * config.warpgroups
        self.bn = config.tile_tokens
        self.nb = config.tile_tokens // 8
        self.n_kt = config.k // K_TILE // config.k_splits     # k-tiles per CTA
        self.units = 4 * self.bn // self.threads                # staging units per thread
        self.stages = STAGES
        self.region = self.bn * 128                             # bytes of one 64-K half of a staged tile
        self.stage_bytes = 2 * self.region

    @staticmethod
    def can_implement(config: Fp8WgmmaConfig) -> bool:
        return not fp8_wgmma_violations(config)

    def key(self) -> tuple:
        return (self.config,)

    @property
    def smem_bytes(self) -> int:
        return _smem_bytes(self.bn)

    @cute.jit
    def __call__(self, mW: cute.Tensor, mS: cute.Tensor, mX: cute.Tensor, mOut: cute.Tensor, stream):
        n_tiles = (mX.shape[0] + self.bn - 1) // self.bn
        self.kernel(mW, mS, mX, mOut).launch(
            grid=[self.n // self.bm, n_tiles, self.groups * self.k_splits], block=[self.threads, 1, 1],
            smem=self.smem_bytes, stream=stream, min_blocks_per_mp=self.min_ctas,
            preferred_smem_carveout=-1 if self.min_ctas > 1 else None)

    @cute.kernel
    def kernel(self, mW: cute.Tensor, mS: cute.Tensor, mX: cute.Tensor, mOut: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bx, by, bz = cute.arch.block_idx()
        group = bz // self.k_splits
        kt0 = (bz % self.k_splits) * self.n_kt
        wg = tidx // 128
        warp = (tidx % 128) // 32
        lane = tidx % 32
        g = lane // 4
        c = lane % 4
        k, n = self.k, self.n
        begin = by * self.bn
        cnt = mX.shape[0] - begin
        if cnt > self.bn:
            cnt = Int32(self.bn)
        row_base = group * n + bx * self.bm + (wg * 4 + warp) * 16   # the warp's 16 rows of the stacked [G * N, K]
        scale_row = (group * n + bx * self.bm) // SCALE_BLOCK        # the CTA's block row of scales
        smem = cutlass.memory.SmemAllocator()
        sbuf = smem.allocate_tensor(cutlass.Uint8, cute.make_layout(self.stages * self.stage_bytes + 1024), 1024)
        s_smem = (Int32(sbuf.iterator.toint()) + 1023) & Int32(-1024)  # swizzle atoms need 1024-byte alignment

        # weights: row g's first byte of the share's first k-tile (row g + 8 is 8 K bytes on)
        w_addr = mW.iterator.toint() + Int64(row_base + g) * k + Int64(c * LANE_K + kt0 * K_TILE)

        # staging units u = tidx + i * threads: j0 = 4 (u % 2), token row (u // 2) % N, half (u // 2) // N. The unit
        # parity and the row's swizzle phase are the thread's own (threads / 2 is a multiple of 8)
        j0 = (tidx % 2) * 4
        n8 = (tidx // 2) % 8
        x_addr = cute.make_rmem_tensor((self.units,), Int64)
        st_off = cute.make_rmem_tensor((self.units,), Int32)
        for i in cutlass.range_constexpr(self.units):
            r = tidx // 2 + i * (self.threads // 2)
            row = r % self.bn
            half = r // self.bn
            t = row
            if t > cnt - 1:
                t = cnt - 1                     # rows past the tile's tokens read its last one (not stored)
            x_addr[i] = (mX.iterator.toint() + Int64(begin + t) * (2 * k * self.groups)
                         + Int64((group * k + kt0 * K_TILE) * 2 + half * 128 + j0 * 4))
            st_off[i] = half * self.region + (row // 8) * 1024 + n8 * 128
        # byte offset of chunk j0 + q of a row (128-byte swizzle: 16-byte chunk index XOR the row's phase)
        chunk = cute.make_rmem_tensor((4,), Int32)
        for q in cutlass.range_constexpr(4):
            chunk[q] = ((j0 + q) ^ n8) * 16

        D = self.depth
        n_kt = self.n_kt
        S = self.stages
        wbuf = cute.make_rmem_tensor((D, 2, 8), Int32)
        for d in cutlass.range_constexpr(D):
            self.load_w(wbuf, w_addr, d, d)
        xr = cute.make_rmem_tensor((self.units, UNIT_WORDS), Int32)
        xm = cute.make_rmem_tensor((1,), Int32)
        self.load_x(mS, xr, xm, x_addr, scale_row, kt0, 0)
        self.store_x(xr, xm, s_smem, st_off, chunk)
        if n_kt > 1:
            self.load_x(mS, xr, xm, x_addr, scale_row, kt0, 1)
        acc = cute.make_rmem_tensor((self.bn // 2,), Float32)
        acc.fill(0.0)
        for kto in cutlass.range(0, n_kt, D, unroll=1):
            for d in cutlass.range_constexpr(D):
                kt = kto + d
                cw = cute.make_rmem_tensor((2, 8), Int32)
                for h in cutlass.range_constexpr(2):
                    for i in cutlass.range_constexpr(8):
                        cw[h, i] = wbuf[d, h, i]
                # refill the slot with k-tile kt + D (clamped: a re-read of the last one hits the cache)
                nxt = kt + D
                if nxt > n_kt - 1:
                    nxt = n_kt - 1
                self.load_w(wbuf, w_addr, d, nxt)
                cute.arch.fence_view_async_shared()     # this thread's stores of x(kt), to the tensor cores ...
                cute.arch.barrier()                      # ... everyone's; and the MMAs of kt - 2 are done
                if kt + 1 < n_kt:
                    self.store_x(xr, xm, s_smem + ((kt + 1) % S) * self.stage_bytes, st_off, chunk)
                if kt + 2 < n_kt:
                    self.load_x(mS, xr, xm, x_addr, scale_row, kt0, kt + 2)
                desc0 = ptx.smem_desc_sw128(s_smem + (kt % S) * self.stage_bytes)
                # A of step s: row g's k (4s, 4s + 1) and (4s + 2, 4s + 3) of the lane's 32 in slots 0 and 2, row
                # g + 8's in slots 1 and 3 (the m16n8k16 A fragment)
                a = cute.make_rmem_tensor((8, 4), Int32)
                for s in cutlass.range_constexpr(8):
                    a[s, 0], a[s, 2] = decode_e4m3x4(cw[0, s])
                    a[s, 1], a[s, 3] = decode_e4m3x4(cw[1, s])
                warpgroup.fence()
                for s in cutlass.range_constexpr(8):
                    desc = desc0 + Int64(((s // 4) * self.region + (s % 4) * 32) >> 4)
                    vals = [acc[i] for i in range(self.bn // 2)]
                    vals = ptx.wgmma_bf16_rs(vals, a[s, 0], a[s, 1], a[s, 2], a[s, 3], desc)
                    for i in cutlass.range_constexpr(self.bn // 2):
                        acc[i] = vals[i]
                warpgroup.commit_group()
                warpgroup.wait_group(1)

        warpgroup.wait_group(0)
        acc4 = cute.make_rmem_tensor((1, self.nb, 4), Float32)
        vals = ptx.fence_operands([acc[i] for i in range(self.bn // 2)])
        for nb in cutlass.range_constexpr(self.nb):
            for i in cutlass.range_constexpr(4):
                acc4[0, nb, i] = vals[4 * nb + i]
        self.epilogue(acc4, mOut, row_base, begin, cnt, g, c)

    def load_w(self, wbuf: cute.Tensor, w_addr: Int64, slot: int, kt: Int32) -> None:
        """Pipeline slot ``slot`` <- k-tile ``kt`` (of the CTA's share): the thread's 32 bytes of rows g and g + 8
        (immediate offsets on row g's address)."""
        for h in range(2):
            for q in range(2):
                v = ptx.ld_global_v4(w_addr + Int64(kt * K_TILE + h * 8 * self.k + q * (K_TILE // 2)))
                for i in range(4):
                    wbuf[slot, h, q * 4 + i] = v[i]

    def load_x(self, mS: cute.Tensor, xr: cute.Tensor, xm: cute.Tensor, x_addr: cute.Tensor, scale_row: Int32,
               kt0: Int32, kt: Int32) -> None:
        """The thread's units' words of k-tile ``kt`` of the share (run c's four words at ``xr[i, 4c ..]``), and the
        k-tile's activation multiplier (``Fp8LinearParts.x_multiplier``)."""
        for i in range(self.units):
            for c in range(4):
                v = ptx.ld_global_v4_keep(x_addr[i] + Int64(kt * TILE_BYTES + c * 32))
                for w in range(4):
                    xr[i, 4 * c + w] = v[w]
        xm[0] = self.x_multiplier(mS[scale_row, kt0 + kt])

    def store_x(self, xr: cute.Tensor, xm: cute.Tensor, stage: Int32, st_off: cute.Tensor,
                chunk: cute.Tensor) -> None:
        """The loaded words, times the multiplier, into the stage at shared address ``stage``: chunk j0 + q of a
        unit's row holds word q of each run c (staged pair 32 H + 4 j + c = logical pair 32 H + 8 c + j)."""
        mult = xm[0]
        for i in range(self.units):
            for q in range(4):
                ptx.st_shared_v4_b32(stage + st_off[i] + chunk[q], *[ptx.mul_bf16x2(xr[i, 4 * c + q], mult)
                                                                      for c in range(4)])


# -- host -----------------------------------------------------------------------------------------------------------
def can_implement(n: int, k: int, tokens: int, groups: int = 1) -> bool:
    """Whether the kernel tiles a call of ``tokens`` rows against ``groups`` W [N, K] (N a multiple of the CTA's 64
    or 128 rows, 128 with groups; K of 128, an even number of k-tiles or one)."""
    config = fp8_wgmma_config(n, k, tokens, groups) if n > 0 and k > 0 and tokens > 0 else None
    return config is not None and Sm90Fp8WgmmaLinear.can_implement(config)


@functools.lru_cache(maxsize=None)
def linear_op(config: Fp8WgmmaConfig) -> Sm90Fp8WgmmaLinear:
    """One kernel object per configuration (a call does not check it again)."""
    return Sm90Fp8WgmmaLinear(config)


def warmup(n: int, k: int, device: torch.device | str, scale_dtype: torch.dtype = torch.uint8,
           groups: int = 1) -> int:
    """Compile every configuration :func:`sm90_fp8_linear_wgmma` picks for ``groups`` W [N, K] with these scales at the
    token counts ``sm90_fp8_linear`` gives it (``sm90_heuristics.fp8_wgmma_pays``), so no call compiles; returns how
    many (0 where it does not tile W)."""
    dev = torch.device(device)
    scale_f32 = scale_dtype == torch.float32
    w = torch.empty(groups * n, k, dtype=torch.uint8, device=dev)
    s = torch.empty(-(-groups * n // SCALE_BLOCK), k // K_TILE, dtype=torch.float32 if scale_f32 else torch.uint8,
                    device=dev)
    x = torch.empty(1, groups * k, dtype=torch.bfloat16, device=dev)
    out = torch.empty(1, groups * n, dtype=torch.float32, device=dev)
    configs = {fp8_wgmma_config(n, k, t, groups, scale_f32) for t in fp8_wgmma_token_counts() if fp8_wgmma_pays(t)}
    configs = {c for c in configs if c is not None and Sm90Fp8WgmmaLinear.can_implement(c)}
    for config in configs:
        _compile(linear_op(config), [w, s, x, out])
    return len(configs)


def sm90_fp8_linear_wgmma(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                          out: torch.Tensor | None = None, groups: int = 1) -> torch.Tensor:
    """Dense FP8 linear ``x @ (weight * scale).T`` on the WGMMA kernel, or ``groups`` of them:
    ``out[t, g] = x[t, g] @ W[g].T``.

    ``x`` BF16 or float32 [T, G * K] (T >= 1; float32 is cast to BF16 first); ``weight`` float8_e4m3fn or its uint8
    bytes [G * N, K] (group g: rows g N .. (g + 1) N); ``scale`` [ceil(G * N / 128), K / 128], E8M0
    (float8_e8m0fnu or uint8 bytes) or float32, each at most ``2**63`` (``sm90_fp8_linear.scales_fit``; not checked
    here, it reads the scales). Returns float32 [T, G * N] (``out`` if given). Raises ``KernelArgumentError`` for
    operands it does not take and W it does not tile (:func:`can_implement`)."""
    n, k = fp8_operands(x, weight, scale, groups)
    if out is None:
        out = torch.empty(x.shape[0], groups * n, dtype=torch.float32, device=x.device)
    _expect(tuple(out.shape) == (x.shape[0], groups * n) and out.dtype == torch.float32 and out.is_contiguous(),
            f"out must be contiguous f32 [T, G*N={groups * n}], got {out.dtype} {tuple(out.shape)}")
    config = fp8_wgmma_config(n, k, x.shape[0], groups, scale.dtype == torch.float32)
    _expect(config is not None, f"the FP8 WGMMA linear does not tile {groups} W [{n}, {k}]")
    return launch_linear(x, weight, scale, out, config)


def launch_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, out: torch.Tensor,
                  config: Fp8WgmmaConfig) -> torch.Tensor:
    """Run ``config`` on operands already checked (:func:`sm90_fp8_linear_wgmma`, or ``sm90_fp8_linear``, which
    dispatches here): x cast to BF16 where it is float32, ``out`` zeroed where K is split; returns ``out``."""
    op = linear_op(config)
    if x.dtype == torch.float32:
        x = x.to(torch.bfloat16)
    if op.k_splits > 1:
        out.zero_()  # the K shares add into it
    _launch(op, [weight.view(torch.uint8), _scale_operand(scale), x, out])
    return out
