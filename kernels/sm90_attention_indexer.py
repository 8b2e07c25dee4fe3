"""Lightning-indexer top-k for CSA decode on the GPU (one query per request).

``score[b, n] = sum_h w[b, h] * ReLU(q[b, h] . k[b, n]) * h**-0.5 * d**-0.5`` over the visible entries
``n < n_valid[b]`` (contract of ``indexer_reference.indexer_scores`` / ``select_topk`` with T = 1),
then the ``k`` best entries as int32 indices, **-1 padding** where fewer than ``k`` are visible (the
operand ``decode_attention`` takes).

Order: every score becomes an int64 key, its order-preserving bits above the complemented entry index
(:func:`ordered_key`, inverse :func:`scores_of_key`), so one ``topk`` on the keys picks the best and,
among equal scores, the **lower index** (the reference's rule) whatever ``topk``'s own tie order.

Top-k, on sm_90a: :class:`Sm90SortTopk` sorts up to 4,096 keys per CTA. A longer list is cut into
4,096-key segments whose k best keys (one CTA each) form a list ``4096 / k`` times shorter, until one
CTA sorts the rest: the k best of a list are among the k best of its segments, and keys are distinct,
so the result is ``torch.topk``'s on the same keys.

Scores, on sm_90a: :class:`Sm90IndexerScores`, one pass over the keys. Each CTA (one warpgroup)
computes ``S^T = K Q^T`` for 64 keys at a time with ``wgmma`` (keys are M, the index heads N, the head
dimension K; both operands 128-byte-swizzled in shared memory, keys in a ``cp.async`` ring), then ReLU,
the head weights and the sum over heads in registers (two shuffles), and writes each entry's int64
key: 8 bytes out per ``2 d`` bytes read, where the torch composition (elsewhere: CPU, other GPUs,
other shapes) writes and rereads a float32 ``[B, h, N]`` and then builds the keys in six more ops.
No host sync; CUDA-graph capturable.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.cute.nvgpu.warpgroup as warpgroup
import torch
from cutlass import Float32, Int32, Int64

from . import sm90_ptx as ptx
from .sm90_ptx import SMEM_LIMIT
from .cute_host import compile_op as _compile, expect as _expect, launch as _launch

KEYS_PER_CHUNK = 64                    # M of one wgmma: keys per pipeline step
ATOM = 128                             # bytes of one swizzled row (64 BF16 dims)
THREADS = 128                          # one warpgroup
STAGES = 4
# compiled Sm90SortTopk sizes. Measured on an H200 (docs/benchmarks.md, the earlier shared-memory network):
# 1,024 keys as 2,048 took ~10 us and as 4,096 ~22 us against ~40 us for torch.topk; one CTA on 16,384
# keys took ~150 us against ~95 us, so longer lists go through segment passes of 4,096.
SORT_SIZES = (2048, 4096)
SEGMENT = SORT_SIZES[-1]               # keys per segment of a segment pass
SEGMENT_MAX_K = SEGMENT // 2           # the largest k a segment pass shortens the list for
# keys (all requests) up to which segment passes beat torch.topk on longer lists. Measured on an H200
# (docs/benchmarks.md): 16K keys x 1-32 requests and 262K x 1 1.2-2.0x faster, 2M keys in all even
# (16K x 128) or 5 % slower (262K x 8), 8M-33M 1.3-1.5x slower.
SEGMENT_PASS_MAX_KEYS = 1 << 20
SORT_THREADS = 1024


def _bmm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """BF16 x BF16 -> float32 batched product (fp32 accumulate, no BF16 rounding of the result)."""
    if a.is_cuda:
        try:
            return torch.bmm(a, b, out_dtype=torch.float32)
        except (RuntimeError, TypeError):
            pass
    return torch.bmm(a.float(), b.float())


def _mono(bits: torch.Tensor) -> torch.Tensor:
    """IEEE float32 bits (as signed ints) -> ints in the floats' order (an involution on the negatives)."""
    return torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


MONO_NEG_INF = -0x800000 ^ 0x7FFFFFFF     # _mono of -inf's bits (0xFF800000): the key of a hidden entry


LOW_WORD = 0xFFFFFFFF


def ordered_key(scores: torch.Tensor) -> torch.Tensor:
    """float32 scores [..., N] -> int64 keys in the scores' order, ties broken towards the lower index:
    the score's ordered bits above the complemented entry index ``0xFFFFFFFF - n`` (independent of N, so
    keys of different lists compare as they are; inverse: :func:`scores_of_key`)."""
    n = scores.shape[-1]
    rev = LOW_WORD - torch.arange(n, device=scores.device, dtype=torch.int64)
    return (_mono(scores.contiguous().view(torch.int32).long()) << 32) | rev


def scores_of_key(key: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`ordered_key`: int64 keys [..., N] -> the float32 scores."""
    return _mono(key >> 32).to(torch.int32).view(torch.float32)


def _smem_bytes(heads: int, dim: int) -> int:
    blocks = dim // 64
    return -(-blocks * heads * ATOM // 1024) * 1024 + STAGES * blocks * KEYS_PER_CHUNK * ATOM + 1024


def kernel_fits(heads: int, dim: int) -> bool:
    """Shapes :class:`Sm90IndexerScores` takes: heads a multiple of 8 up to 256 (wgmma N), dim a
    multiple of 64 (whole swizzle atoms), Q and the key ring within shared memory."""
    return (heads % 8 == 0 and 8 <= heads <= 256 and dim % 64 == 0 and dim >= 64
            and _smem_bytes(heads, dim) <= SMEM_LIMIT)


def _use_kernel(q: torch.Tensor, keys: torch.Tensor) -> bool:
    """The score kernel: BF16 operands on an sm_90 GPU, in a tiling it has (else the torch composition)."""
    return (q.is_cuda and q.dtype == keys.dtype == torch.bfloat16 and kernel_fits(q.shape[1], q.shape[2])
            and torch.cuda.get_device_capability(q.device) == (9, 0))


def indexer_scores_torch(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor,
                         n_valid: torch.Tensor | None = None) -> torch.Tensor:
    """The scores by torch ops: float32 [B, N], -inf beyond ``n_valid``."""
    h, d = q.shape[1], q.shape[2]
    n = keys.shape[1]
    dots = _bmm_f32(q, keys.transpose(1, 2)).relu_()                         # [B, h, N]
    w = (weights.float() * (h ** -0.5 * d ** -0.5)).unsqueeze(1)               # [B, 1, h]
    scores = torch.bmm(w, dots).squeeze(1) + 0.0                               # [B, N]; -0.0 -> +0.0
    if n_valid is not None:
        visible = torch.arange(n, device=q.device)[None] < n_valid.to(q.device).long()[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
    return scores


def indexer_keys(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor,
                 n_valid: torch.Tensor | None = None) -> torch.Tensor:
    """q bf16 [B, h, d], keys bf16 [B, N, d], weights f32 [B, h], n_valid int [B] (None: all N) ->
    int64 [B, N] :func:`ordered_key` of the scores (-inf beyond ``n_valid``): the sm_90a kernel, which
    writes the keys itself, where it applies, else the torch composition."""
    b, h, d = q.shape
    _expect(keys.dim() == 3 and keys.shape[0] == b and keys.shape[2] == d,
            f"keys must be [B={b}, N, d={d}], got {tuple(keys.shape)}")
    _expect(tuple(weights.shape) == (b, h), f"weights must be [B={b}, h={h}], got {tuple(weights.shape)}")
    if not _use_kernel(q, keys):
        return ordered_key(indexer_scores_torch(q, keys, weights, n_valid))
    n = keys.shape[1]
    nv = (torch.full((b,), n, dtype=torch.int32, device=q.device) if n_valid is None
          else n_valid.to(device=q.device, dtype=torch.int32).contiguous())
    out = torch.empty(b, n, dtype=torch.int64, device=q.device)
    if n == 0 or b == 0:
        return out
    chunks = -(-n // KEYS_PER_CHUNK)
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    splits = max(1, min(chunks, 2 * sms // b))  # two CTAs per SM in one wave, no empty split
    grid_x = torch.empty(1, splits, dtype=torch.int32, device=q.device)  # carries the split count (shape only)
    _launch(Sm90IndexerScores(heads=h, dim=d),
            [q.contiguous(), keys.contiguous(), weights.float().contiguous(), nv, out, grid_x])
    return out


def sort_size(n: int, k: int) -> int | None:
    """The :class:`Sm90SortTopk` size for ``n`` entries and top-``k`` (the smallest that holds both), or None."""
    return next((p for p in SORT_SIZES if max(n, k) <= p), None)


def sort_levels(n: int, k: int) -> list[int]:
    """List lengths the segment passes of :func:`topk_of_keys` reduce ``n`` keys through before the final
    sort (empty up to 4,096 keys): each pass keeps ``k`` of every 4,096."""
    levels = []
    while n > SEGMENT:
        n = -(-n // SEGMENT) * k
        levels.append(n)
    return levels


def segment_pass(k: int) -> "Sm90SortTopk":
    """The sort kernel that keeps the ``k`` best keys of every ``SEGMENT`` keys."""
    return Sm90SortTopk(k=k, entries=SEGMENT, keys_out=True)


def uses_sort_kernel(key: torch.Tensor, k: int) -> bool:
    """Whether :func:`topk_of_keys` runs :class:`Sm90SortTopk` (sm_90 GPU): up to 4,096 entries, or with
    segment passes up to ``SEGMENT_PASS_MAX_KEYS`` keys in all and k <= 2,048 (each pass must shorten the
    list)."""
    b, n = key.shape
    fits = sort_size(n, k) is not None or (k <= SEGMENT_MAX_K and b * n <= SEGMENT_PASS_MAX_KEYS)
    return key.is_cuda and b > 0 and n > 0 and fits and torch.cuda.get_device_capability(key.device) == (9, 0)


def topk_of_keys(key: torch.Tensor, k: int) -> torch.Tensor:
    """int64 :func:`ordered_key` [B, N] -> int32 [B, k] indices of the k best, best first, -1 where
    fewer than k entries are visible (score -inf). On sm_90a: :class:`Sm90SortTopk`, a segment pass per
    :func:`sort_levels` then one sort; elsewhere ``torch.topk``."""
    _expect(key.dtype == torch.int64 and key.dim() == 2, f"keys must be int64 [B, N], got {key.dtype} {tuple(key.shape)}")
    if not uses_sort_kernel(key, k):
        return topk_of_keys_torch(key, k)
    key = key.contiguous()
    b = key.shape[0]
    for n in sort_levels(key.shape[1], k):
        shorter = torch.empty(b, n, dtype=torch.int64, device=key.device)
        _launch(segment_pass(k), [key, shorter])
        key = shorter
    out = torch.empty(b, k, dtype=torch.int32, device=key.device)
    _launch(Sm90SortTopk(k=k, entries=sort_size(key.shape[1], k)), [key, out])
    return out


def warmup_indexer(heads: int, dim: int, k: int, device: torch.device | str) -> int:
    """Compile the score kernel (where it tiles) and every sort size for top-``k``; returns how many kernels."""
    dev = torch.device(device)
    i32, i64 = dict(dtype=torch.int32, device=dev), dict(dtype=torch.int64, device=dev)
    n = 0
    if kernel_fits(heads, dim):
        bf = dict(dtype=torch.bfloat16, device=dev)
        _compile(Sm90IndexerScores(heads=heads, dim=dim),
                 [torch.empty(1, heads, dim, **bf), torch.empty(1, 1, dim, **bf), torch.empty(1, heads, device=dev),
                  torch.empty(1, **i32), torch.empty(1, 1, **i64), torch.empty(1, 1, **i32)])
        n += 1
    for size in SORT_SIZES:
        if k <= size:
            _compile(Sm90SortTopk(k=k, entries=size), [torch.empty(1, 1, **i64), torch.empty(1, k, **i32)])
            n += 1
    if k <= SEGMENT_MAX_K:
        _compile(segment_pass(k), [torch.empty(1, 1, **i64), torch.empty(1, k, **i64)])
        n += 1
    return n


def topk_of_keys_torch(key: torch.Tensor, k: int) -> torch.Tensor:
    """:func:`topk_of_keys` by ``torch.topk`` (any size, any device)."""
    b, n = key.shape
    kk = min(k, n)
    top = torch.topk(key, kk, dim=-1)
    idx = torch.where((top.values >> 32) <= MONO_NEG_INF, -1, top.indices).to(torch.int32)
    if kk < k:
        idx = torch.cat((idx, torch.full((b, k - kk), -1, dtype=torch.int32, device=key.device)), dim=1)
    return idx


def indexer_topk(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor, k: int,
                 n_valid: torch.Tensor | None = None) -> torch.Tensor:
    """q bf16 [B, h, d] (rotated), keys bf16 [B, N, d] (rotated), weights f32 [B, h], n_valid int [B]
    (None: all N visible) -> int32 [B, k] entry indices, -1 where fewer than k are visible."""
    return topk_of_keys(indexer_keys(q, keys, weights, n_valid), k)


class Sm90IndexerScores:
    """Indexer scores of one decode query per request (module docstring), one compiled (heads, dim),
    written as their :func:`ordered_key` (so ``topk`` reads them directly).

    Operands (contiguous): ``q`` bf16 [B, h, d], ``keys`` bf16 [B, N, d], ``weights`` f32 [B, h],
    ``n_valid`` int32 [B], ``out`` int64 [B, N] (keys >= n_valid get -inf's; loaded as zeros, no read),
    ``splits`` any int32 [1, S] tensor: the grid is (S, B), split ``s`` takes chunks
    ``[s C / S, (s + 1) C / S)`` of the C = ceil(N / 64) chunks.
    """

    def __init__(self, *, heads: int, dim: int):
        if not kernel_fits(heads, dim):
            raise ValueError(f"heads={heads} (multiple of 8, <= 256) / dim={dim} (multiple of 64) outside the "
                             f"kernel's tiling or its {SMEM_LIMIT} B of shared memory")
        self.heads, self.dim = heads, dim
        self.blocks = dim // 64                                 # 128-byte column blocks per row
        self.q_block = heads * ATOM
        self.k_block = KEYS_PER_CHUNK * ATOM
        self.k_bytes = self.blocks * self.k_block              # one ring slot
        self.off_k = -(-self.blocks * self.q_block // 1024) * 1024
        self.smem = _smem_bytes(heads, dim)
        self.scale = float(heads ** -0.5 * dim ** -0.5)

    def key(self) -> tuple:
        return (self.heads, self.dim)

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mW: cute.Tensor, mNv: cute.Tensor,
                 mOut: cute.Tensor, mSplits: cute.Tensor, stream):
        self.kernel(mQ, mK, mW, mNv, mOut).launch(
            grid=[mSplits.shape[1], mQ.shape[0], 1], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mW: cute.Tensor, mNv: cute.Tensor, mOut: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        split, b, _ = cute.arch.block_idx()
        n_splits, _, _ = cute.arch.grid_dim()
        H, D = self.heads, self.dim
        N = mK.shape[1]
        n_chunks = (N + KEYS_PER_CHUNK - 1) // KEYS_PER_CHUNK
        c_begin = split * n_chunks // n_splits
        n_mine = (split + 1) * n_chunks // n_splits - c_begin
        nv = mNv[b]
        warp = tidx // 32
        lane = tidx % 32
        g = lane // 4
        c = lane % 4

        smem = cutlass.memory.SmemAllocator()
        sraw = smem.allocate_array(cutlass.Int8, self.smem, byte_alignment=16).toint()
        sbase = (Int32(sraw) + 1023) & Int32(-1024)   # swizzle atoms need 1024-byte alignment

        # Q [H x D] once (in the first commit group), then chunks 0 .. STAGES - 2
        pieces = D // 8                                # 16-byte pieces per row
        q_src = mQ.iterator.toint() + Int64(b) * (H * D * 2)
        for i in cutlass.range_constexpr((H * pieces + THREADS - 1) // THREADS):
            p = tidx + THREADS * i
            if p < H * pieces:
                row = p // pieces
                seg = p % pieces
                ptx.cp_async_16(sbase + (seg // 8) * self.q_block + row * ATOM + (((seg % 8) ^ (row % 8)) << 4),
                                q_src + Int64(p * 16), Int32(16))
        for st in cutlass.range_constexpr(STAGES - 1):
            if n_mine > st:
                self.load_chunk(mK, sbase, b, N, nv, c_begin + st, st, tidx)
            cute.arch.cp_async_commit_group()

        # this thread's head weights: columns 8 j + 2 c + e of the accumulator (scale folded in)
        w = [mW[b, 8 * j + 2 * c + e] * Float32(self.scale) for j in range(H // 8) for e in range(2)]

        for it in cutlass.range(0, n_mine, unroll=1):
            slot = it % STAGES
            kb = sbase + self.off_k + slot * self.k_bytes
            cute.arch.cp_async_wait_group(STAGES - 2)
            cute.arch.fence_view_async_shared()
            cute.arch.barrier()                        # chunk `it` landed; chunk it - 1's slot is free
            nxt = it + STAGES - 1
            if nxt < n_mine:
                self.load_chunk(mK, sbase, b, N, nv, c_begin + nxt, nxt % STAGES, tidx)
            cute.arch.cp_async_commit_group()
            warpgroup.fence()
            s = self.key_dots(kb, sbase)
            warpgroup.commit_group()
            warpgroup.wait_group(0)
            s = ptx.fence_operands(s)
            for hh in cutlass.range_constexpr(2):
                part = Float32(0.0)                    # +0.0 first: a sum of -0.0 products reads +0.0
                for j in cutlass.range_constexpr(H // 8):
                    part = part + w[2 * j] * cute.arch.fmax(s[4 * j + 2 * hh], Float32(0.0))
                    part = part + w[2 * j + 1] * cute.arch.fmax(s[4 * j + 2 * hh + 1], Float32(0.0))
                for sh in cutlass.range_constexpr(2):
                    part = part + cute.arch.shuffle_sync_bfly(part, 1 << sh)
                key = (c_begin + it) * KEYS_PER_CHUNK + 16 * warp + g + 8 * hh
                if c == 0:
                    if key < N:
                        bits = ptx.f32_bits(part)
                        if bits < 0:
                            bits = bits ^ Int32(0x7FFFFFFF)
                        if key >= nv:
                            bits = Int32(MONO_NEG_INF)
                        ptx.st_global_v2_b32(mOut.iterator.toint() + (Int64(b) * N + Int64(key)) * 8, Int32(-1) - key, bits)
        cute.arch.cp_async_wait_group(0)

    def key_dots(self, kb: Int32, qb: Int32) -> list:
        """Issue S^T = K Q^T for the chunk at ``kb`` (64 keys = M, heads = N, dims = K in k16 steps)."""
        s = [Float32(0.0)] * (self.heads // 2)
        for ks in range(self.dim // 16):
            blk = ks // 4
            da = ptx.smem_desc_sw128(kb + blk * self.k_block + (ks % 4) * 32)
            db = ptx.smem_desc_sw128(qb + blk * self.q_block + (ks % 4) * 32)
            s = ptx.wgmma_bf16_ss(s, da, db, accumulate=ks > 0)
        return s

    @cute.jit
    def load_chunk(self, mK: cute.Tensor, sbase: Int32, b: Int32, N: Int32, nv: Int32, chunk: Int32,
                   slot: Int32, tidx: Int32):
        """Two threads per key row, each half of its 16-byte pieces; keys >= n_valid are zero-filled."""
        r = tidx // 2
        key = chunk * KEYS_PER_CHUNK + r
        nbytes = Int32(0)
        src = mK.iterator.toint()
        if key < nv:
            if key < N:
                nbytes = Int32(16)
                src = src + (Int64(b) * N + Int64(key)) * (self.dim * 2)
        dst = sbase + self.off_k + slot * self.k_bytes + r * ATOM
        for i in cutlass.range_constexpr(self.dim // 16):
            seg = tidx % 2 + 2 * i
            ptx.cp_async_16(dst + (seg // 8) * self.k_block + (((seg % 8) ^ (r % 8)) << 4), src + Int64(seg * 16),
                            nbytes)


class Sm90SortTopk:
    """The ``k`` best of each ``entries``-key segment (``entries`` a power of two, ``SORT_SIZES``) of int64
    order keys: one CTA per (segment, request), ``entries / 1024`` consecutive keys per thread (padded with
    the smallest int64), sorts them descending with a bitonic network (log2(entries) (log2(entries) + 1) / 2
    compare-exchange steps: partners in the same thread in registers, in the same warp by shuffles, farther
    through shared memory with a CTA barrier each, 20 barriers for 4,096 keys instead of 78) and writes its
    first ``k``:

    * ``keys_out=False`` (one segment per request, N <= ``entries``): the entry indices
      (``0xFFFFFFFF -`` the key's low word), -1 for -inf scores and padding;
    * ``keys_out=True``: the keys themselves, segment ``s`` to ``out[b, s k .. s k + k)`` (padding included
      where a segment is short), a shorter list with the same k best (module docstring).

    Keys are distinct (the low word is the entry), so the order, ties included, is ``torch.topk``'s.

    Operands: ``key`` int64 [B, N], ``out`` int32 [B, k] (indices) or int64 [B, ceil(N / entries) k] (keys).
    """

    def __init__(self, *, k: int, entries: int, keys_out: bool = False):
        if entries not in SORT_SIZES or not 1 <= k <= entries:
            raise ValueError(f"entries must be one of {SORT_SIZES} and 1 <= k <= entries, got entries={entries}, k={k}")
        self.k, self.entries, self.keys_out = k, entries, keys_out

    def key(self) -> tuple:
        return (self.k, self.entries, self.keys_out)

    @cute.jit
    def __call__(self, mKey: cute.Tensor, mOut: cute.Tensor, stream):
        segments = (mKey.shape[1] + self.entries - 1) // self.entries
        self.kernel(mKey, mOut).launch(grid=[segments, mKey.shape[0], 1], block=[SORT_THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mKey: cute.Tensor, mOut: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        seg, b, _ = cute.arch.block_idx()
        P, KPT = self.entries, self.entries // SORT_THREADS
        N = mKey.shape[1]
        first = seg * P + tidx * KPT
        smem = cutlass.memory.SmemAllocator()
        sk = smem.allocate_tensor(cutlass.Int64, P, byte_alignment=16)
        reg = cute.make_rmem_tensor((KPT,), Int64)     # positions KPT * tidx + e
        for e in cutlass.range_constexpr(KPT):
            v = Int64(-(1 << 63))
            if first + e < N:
                v = mKey[b, first + e]
            reg[e] = v
        in_smem = False
        log_n = P.bit_length() - 1
        for size_log in cutlass.range_constexpr(1, log_n + 1):
            for st_log in cutlass.range_constexpr(size_log - 1, -1, -1):
                stride = 1 << st_log
                if cutlass.const_expr(stride >= KPT * 32):   # partner in another warp: through shared memory
                    if cutlass.const_expr(not in_smem):
                        for e in cutlass.range_constexpr(KPT):
                            sk[tidx * KPT + e] = reg[e]
                        in_smem = True
                    cute.arch.barrier()
                    self.exchange_smem(sk, tidx, size_log, st_log)
                else:
                    if cutlass.const_expr(in_smem):   # back to registers: each thread reads only its own positions
                        cute.arch.barrier()
                        for e in cutlass.range_constexpr(KPT):
                            reg[e] = sk[tidx * KPT + e]
                        in_smem = False
                    if cutlass.const_expr(stride >= KPT):
                        self.exchange_lanes(reg, tidx, size_log, st_log, stride // KPT)
                    else:
                        self.exchange_thread(reg, tidx, size_log, st_log)
        for e in cutlass.range_constexpr(KPT):   # sorted: position o is the (o + 1)-th best
            o = tidx * KPT + e
            if o < self.k:
                v = reg[e]
                if cutlass.const_expr(self.keys_out):
                    mOut[b, seg * self.k + o] = v
                else:
                    idx = Int32(-1)
                    if (v >> 32) > Int64(MONO_NEG_INF):      # a visible score (not -inf, not padding)
                        idx = Int32(Int64(LOW_WORD) - (v & Int64(LOW_WORD)))
                    mOut[b, o] = idx

    # Bitonic step (size_log, st_log): positions i and i + 2**st_log (i's bit st_log clear) are ordered
    # descending where i's bit size_log is clear, ascending where it is set (P is one descending run).

    @cute.jit
    def exchange_smem(self, sk: cute.Tensor, tidx: Int32, size_log: cutlass.Constexpr, st_log: cutlass.Constexpr):
        for r in cutlass.range_constexpr(self.entries // 2 // SORT_THREADS):
            p = tidx + SORT_THREADS * r
            i = ((p >> st_log) << (st_log + 1)) + (p & ((1 << st_log) - 1))
            self.order_pair(sk, i, i + (1 << st_log), (i & (1 << size_log)) == 0)

    @cute.jit
    def exchange_lanes(self, reg: cute.Tensor, tidx: Int32, size_log: cutlass.Constexpr, st_log: cutlass.Constexpr,
                       lane_xor: cutlass.Constexpr):
        KPT = self.entries // SORT_THREADS
        for e in cutlass.range_constexpr(KPT):
            pos = tidx * KPT + e
            mine = reg[e]
            other = cute.arch.shuffle_sync_bfly(mine, lane_xor)
            lower = (pos & (1 << st_log)) == 0
            descending = (pos & (1 << size_log)) == 0
            if lower == descending:              # keep the larger
                if other > mine:
                    reg[e] = other
            else:
                if other < mine:
                    reg[e] = other

    @cute.jit
    def exchange_thread(self, reg: cute.Tensor, tidx: Int32, size_log: cutlass.Constexpr, st_log: cutlass.Constexpr):
        KPT = self.entries // SORT_THREADS
        for e in cutlass.range_constexpr(KPT):
            if cutlass.const_expr(((e >> st_log) & 1) == 0):
                self.order_pair(reg, e, e + (1 << st_log), ((tidx * KPT + e) & (1 << size_log)) == 0)

    @cute.jit
    def order_pair(self, t: cute.Tensor, i, j, descending):
        """Put ``t[i]``, ``t[j]`` in descending (else ascending) order."""
        a = t[i]
        c = t[j]
        if descending:
            if a < c:
                t[i] = c
                t[j] = a
        else:
            if a > c:
                t[i] = c
                t[j] = a
