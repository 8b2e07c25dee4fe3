"""Lightning-indexer top-k for CSA decode on Hopper (sm_90a), one query per request: the score kernel and the
sort kernel, and their host wrappers.

``score[b, n] = sum_h w[b, h] * ReLU(q[b, h] . k[b, n]) * h**-0.5 * d**-0.5`` over the visible entries
``n < n_valid[b]`` (contract of ``indexer_reference.indexer_scores`` / ``select_topk`` with T = 1),
then the ``k`` best entries as int32 indices, **-1 padding** where fewer than ``k`` are visible (the
operand ``decode_attention`` takes).

Order: the int64 keys of ``indexer_keys`` (:func:`~nvfp4_megamoe.kernels.indexer_keys.ordered_key`): one ``topk``
on them picks the best, ties to the lower index.

Top-k, on sm_90a: :class:`Sm90SortTopk` sorts up to 4,096 keys per CTA. A longer list is cut into
4,096-key segments whose k best keys (one CTA each) form a list ``4096 / k`` times shorter, until one
CTA sorts the rest: the k best of a list are among the k best of its segments, and keys are distinct,
so the result is ``torch.topk``'s on the same keys.

Scores, on sm_90a: :class:`Sm90IndexerScores`, one pass over the keys. Each CTA (one warpgroup)
computes ``S^T = K Q^T`` for 64 keys at a time with ``wgmma`` (keys are M, the index heads N, the head
dimension K; both operands 128-byte-swizzled in shared memory, keys in a ``cp.async`` ring), then ReLU,
the head weights and the sum over heads in registers (two shuffles), and writes each entry's int64
key: 8 bytes out per ``2 d`` bytes read, where the torch composition (``indexer_keys``) writes and rereads a
float32 ``[B, h, N]`` and then builds the keys in six more ops. No host sync; CUDA-graph capturable.

Prefill: a chunk's T query tokens are T requests whose keys are their sequence's, read in place
(``sm90_indexer_keys`` with keys [S, N, d], ``Sm90IndexerScores(shared=True)``). Limits: at most ``MAX_ROWS``
(65,535) requests a call in both kernels (the grid's y); any N in the score kernel (its output is R x N int64:
8 GiB at R = 65,535 and N = 16,384, so a long prompt's chunk is cut by the caller); the sort takes any N for
k <= 2,048 (segment passes) and N <= 4,096 beyond.

The runtime's backend decides which shapes run here (:meth:`Sm90IndexerScores.can_implement`,
:func:`topk_can_implement`, and ``sm90_heuristics.sort_topk_pays``).
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
from .indexer_keys import LOW_WORD, MONO_NEG_INF

KEYS_PER_CHUNK = 64                    # M of one wgmma: keys per pipeline step
ATOM = 128                             # bytes of one swizzled row (64 BF16 dims)
THREADS = 128                          # one warpgroup
STAGES = 4
# compiled Sm90SortTopk sizes; longer lists go through segment passes of 4,096 (``docs/design/decode_attention.md``)
SORT_SIZES = (2048, 4096)
SEGMENT = SORT_SIZES[-1]               # keys per segment of a segment pass
SEGMENT_MAX_K = SEGMENT // 2           # the largest k a segment pass shortens the list for
SORT_THREADS = 1024
MAX_ROWS = 65535                       # requests (lists) of one call: the grid's y, CUDA's limit


def _smem_bytes(heads: int, dim: int) -> int:
    blocks = dim // 64
    return -(-blocks * heads * ATOM // 1024) * 1024 + STAGES * blocks * KEYS_PER_CHUNK * ATOM + 1024


def scores_can_implement(heads: int, dim: int) -> bool:
    """Shapes :class:`Sm90IndexerScores` takes: heads a multiple of 8 up to 256 (wgmma N), dim a
    multiple of 64 (whole swizzle atoms), Q and the key ring within shared memory."""
    return (heads % 8 == 0 and 8 <= heads <= 256 and dim % 64 == 0 and dim >= 64
            and _smem_bytes(heads, dim) <= SMEM_LIMIT)


def sm90_indexer_keys(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor,
                      n_valid: torch.Tensor | None = None, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """q bf16 [B, h, d], keys bf16 [S, N, d], weights f32 [B, h], n_valid int [B] (None: all N) ->
    int64 [B, N] ``ordered_key`` of the scores (-inf beyond ``n_valid``), written by the score kernel
    (h, d: :meth:`Sm90IndexerScores.can_implement`) into ``out`` (allocated when None).

    S = B: every request its own keys (decode). S < B (S dividing B): the B / S consecutive requests of each
    sequence share its keys, read in place (prefill: a chunk's query tokens; ``Sm90IndexerScores(shared=True)``,
    which skips the product of chunks wholly past a request's ``n_valid``). B is at most ``MAX_ROWS``."""
    b, h, d = q.shape
    _expect(keys.dim() == 3 and keys.shape[0] > 0 and b % keys.shape[0] == 0 and keys.shape[2] == d,
            f"keys must be [S, N, d={d}] with S dividing B={b}, got {tuple(keys.shape)}")
    _expect(b <= MAX_ROWS, f"the score kernel takes at most {MAX_ROWS} requests, got {b}")
    _expect(tuple(weights.shape) == (b, h), f"weights must be [B={b}, h={h}], got {tuple(weights.shape)}")
    _expect(q.is_cuda and q.dtype == keys.dtype == torch.bfloat16 and Sm90IndexerScores.can_implement(h, d),
            f"the score kernel takes CUDA bf16 q [B, h, d] with h a multiple of 8 up to 256 and d of 64, got "
            f"{q.dtype} {tuple(q.shape)}")
    n = keys.shape[1]
    nv = (torch.full((b,), n, dtype=torch.int32, device=q.device) if n_valid is None
          else n_valid.to(device=q.device, dtype=torch.int32).contiguous())
    if out is None:
        out = torch.empty(b, n, dtype=torch.int64, device=q.device)
    _expect(out.dtype == torch.int64 and tuple(out.shape) == (b, n) and out.is_contiguous(),
            f"out must be contiguous int64 [B={b}, N={n}]")
    if n == 0 or b == 0:
        return out
    chunks = -(-n // KEYS_PER_CHUNK)
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    splits = max(1, min(chunks, 2 * sms // b))  # two CTAs per SM in one wave, no empty split
    grid_x = torch.empty(1, splits, dtype=torch.int32, device=q.device)  # carries the split count (shape only)
    _launch(Sm90IndexerScores(heads=h, dim=d, shared=keys.shape[0] != b),
            [q.contiguous(), keys.contiguous(), weights.float().contiguous(), nv, out, grid_x])
    return out


def sort_size(n: int, k: int) -> int | None:
    """The :class:`Sm90SortTopk` size for ``n`` entries and top-``k`` (the smallest that holds both), or None."""
    return next((p for p in SORT_SIZES if max(n, k) <= p), None)


def sort_levels(n: int, k: int) -> list[int]:
    """List lengths the segment passes of :func:`sm90_topk_of_keys` reduce ``n`` keys through before the final
    sort (empty up to 4,096 keys): each pass keeps ``k`` of every 4,096."""
    levels = []
    while n > SEGMENT:
        n = -(-n // SEGMENT) * k
        levels.append(n)
    return levels


def segment_pass(k: int) -> "Sm90SortTopk":
    """The sort kernel that keeps the ``k`` best keys of every ``SEGMENT`` keys."""
    return Sm90SortTopk(k=k, entries=SEGMENT, keys_out=True)


def topk_can_implement(n: int, k: int) -> bool:
    """Whether :func:`sm90_topk_of_keys` takes lists of ``n`` keys and top-``k``: one CTA up to 4,096 keys, segment
    passes beyond with k <= 2,048 (each pass must shorten the list)."""
    return n > 0 and k > 0 and (sort_size(n, k) is not None or k <= SEGMENT_MAX_K)


def sm90_topk_of_keys(key: torch.Tensor, k: int) -> torch.Tensor:
    """int64 ``ordered_key`` [B, N] (CUDA) -> int32 [B, k] indices of the k best, best first, -1 where fewer than k
    entries are visible (score -inf): :class:`Sm90SortTopk`, a segment pass per :func:`sort_levels` then one sort
    (N, k: :func:`topk_can_implement`). The same indices as ``indexer_keys.topk_of_keys_torch``."""
    _expect(key.dtype == torch.int64 and key.dim() == 2 and key.is_cuda,
            f"keys must be int64 CUDA [B, N], got {key.dtype} {tuple(key.shape)}")
    _expect(topk_can_implement(key.shape[1], k), f"the sort kernel does not take N={key.shape[1]} keys, k={k}")
    _expect(key.shape[0] <= MAX_ROWS, f"the sort kernel takes at most {MAX_ROWS} lists, got {key.shape[0]}")
    key = key.contiguous()
    b = key.shape[0]
    for n in sort_levels(key.shape[1], k):
        shorter = torch.empty(b, n, dtype=torch.int64, device=key.device)
        _launch(segment_pass(k), [key, shorter])
        key = shorter
    out = torch.empty(b, k, dtype=torch.int32, device=key.device)
    _launch(Sm90SortTopk(k=k, entries=sort_size(key.shape[1], k)), [key, out])
    return out


def warmup(heads: int, dim: int, k: int, device: torch.device | str, *, prefill: bool = False) -> int:
    """Compile the score kernel (where it tiles; with ``prefill`` its shared-keys form too) and every sort size for
    top-``k``; returns how many kernels."""
    dev = torch.device(device)
    i32, i64 = dict(dtype=torch.int32, device=dev), dict(dtype=torch.int64, device=dev)
    n = 0
    if Sm90IndexerScores.can_implement(heads, dim):
        bf = dict(dtype=torch.bfloat16, device=dev)
        for shared in (False, True) if prefill else (False,):
            _compile(Sm90IndexerScores(heads=heads, dim=dim, shared=shared),
                     [torch.empty(1, heads, dim, **bf), torch.empty(1, 1, dim, **bf),
                      torch.empty(1, heads, device=dev), torch.empty(1, **i32), torch.empty(1, 1, **i64),
                      torch.empty(1, 1, **i32)])
            n += 1
    for size in SORT_SIZES:
        if k <= size:
            _compile(Sm90SortTopk(k=k, entries=size), [torch.empty(1, 1, **i64), torch.empty(1, k, **i32)])
            n += 1
    if k <= SEGMENT_MAX_K:
        _compile(segment_pass(k), [torch.empty(1, 1, **i64), torch.empty(1, k, **i64)])
        n += 1
    return n


class Sm90IndexerScores:
    """Indexer scores of one query per request (module docstring), one compiled (heads, dim, shared),
    written as their ``indexer_keys.ordered_key`` (so ``topk`` reads them directly).

    ``shared``: ``keys`` is [S, N, d] and request b reads row ``b // (B / S)`` (a prefill chunk's query tokens share
    their sequence's keys); chunks wholly at or past ``n_valid[b]`` take no product. Without it (decode) S = B.

    Operands (contiguous): ``q`` bf16 [B, h, d], ``keys`` bf16 [B or S, N, d], ``weights`` f32 [B, h],
    ``n_valid`` int32 [B], ``out`` int64 [B, N] (keys >= n_valid get -inf's; loaded as zeros, no read),
    ``splits`` any int32 [1, S] tensor: the grid is (S, B), split ``s`` takes chunks
    ``[s C / S, (s + 1) C / S)`` of the C = ceil(N / 64) chunks.
    """

    @staticmethod
    def can_implement(heads: int, dim: int) -> bool:
        return scores_can_implement(heads, dim)

    def __init__(self, *, heads: int, dim: int, shared: bool = False):
        if not scores_can_implement(heads, dim):
            raise ValueError(f"heads={heads} (multiple of 8, <= 256) / dim={dim} (multiple of 64) outside the "
                             f"kernel's tiling or its {SMEM_LIMIT} B of shared memory")
        self.heads, self.dim, self.shared = heads, dim, shared
        self.blocks = dim // 64                                 # 128-byte column blocks per row
        self.q_block = heads * ATOM
        self.k_block = KEYS_PER_CHUNK * ATOM
        self.k_bytes = self.blocks * self.k_block              # one ring slot
        self.off_k = -(-self.blocks * self.q_block // 1024) * 1024
        self.smem = _smem_bytes(heads, dim)
        self.scale = float(heads ** -0.5 * dim ** -0.5)

    def key(self) -> tuple:
        return (self.heads, self.dim, "shared") if self.shared else (self.heads, self.dim)

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
        kb = b                                         # whose keys: the request's own (decode)
        n_full = n_mine                                # chunks multiplied; the rest are past n_valid
        if cutlass.const_expr(self.shared):
            # prefill: the requests of a sequence share its keys, and a chunk wholly past n_valid (a prompt's early
            # queries see few entries) takes no product, only its -inf keys
            kb = b // (mQ.shape[0] // mK.shape[0])
            n_full = cutlass.min(cutlass.max((nv + KEYS_PER_CHUNK - 1) // KEYS_PER_CHUNK - c_begin, Int32(0)), n_mine)
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
            if n_full > st:
                self.load_chunk(mK, sbase, kb, N, nv, c_begin + st, st, tidx)
            cute.arch.cp_async_commit_group()

        # this thread's head weights: columns 8 j + 2 c + e of the accumulator (scale folded in)
        w = [mW[b, 8 * j + 2 * c + e] * Float32(self.scale) for j in range(H // 8) for e in range(2)]

        for it in cutlass.range(0, n_full, unroll=1):
            slot = it % STAGES
            ks = sbase + self.off_k + slot * self.k_bytes
            cute.arch.cp_async_wait_group(STAGES - 2)
            cute.arch.fence_view_async_shared()
            cute.arch.barrier()                        # chunk `it` landed; chunk it - 1's slot is free
            nxt = it + STAGES - 1
            if nxt < n_full:
                self.load_chunk(mK, sbase, kb, N, nv, c_begin + nxt, nxt % STAGES, tidx)
            cute.arch.cp_async_commit_group()
            warpgroup.fence()
            s = self.key_dots(ks, sbase)
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
        if cutlass.const_expr(self.shared):
            end = cutlass.min((c_begin + n_mine) * KEYS_PER_CHUNK, N)
            for key in cutlass.range((c_begin + n_full) * KEYS_PER_CHUNK + tidx, end, THREADS, unroll=1):
                ptx.st_global_v2_b32(mOut.iterator.toint() + (Int64(b) * N + Int64(key)) * 8, Int32(-1) - key,
                                     Int32(MONO_NEG_INF))

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
