"""The core of the attention sublayer over the fixed-size decode state (``runtime/state.py``): which keys a query
sees, and the state writes that go with it. Two forms, one semantics (docs/deepseek_v4.md, "The forward pass"):

* :class:`ChunkAttention`: ``T`` tokens of chosen slots that share one position, known on the host (prefill,
  chunked prefill, refilling a slot): masked logits over (ring + chunk, and HCA's entries) through
  ``sink_attention``, CSA's per-query top-k entries gathered beside them (``sink_attention_picked``), in blocks
  of queries.
* :class:`StepAttention`: one token of every slot, each at its own position (``positions`` on the device): the
  query and key normed, rotated and the key written to the ring in one op (``Backend.step_qkv``), the compressors'
  masked emission of the entry a slot's window closes, the indexer's top-k with per-slot ``n_valid``, and
  ``decode_attention`` over the operands the GPU kernel takes. Fixed shapes, no host read of a device value, writes
  in place: capturable in a CUDA graph.

:meth:`Model._attention` hands each the projections first, ``core.query_key(a, q, kv, freq, turn)`` (the query
[B, T, H, D] and key [B, T, D] as the linears made them; ``turn``: their RoPE rotation, ``PositionTables.turn``), which
returns them RMS-normalised and rotated (a step: the key already in the ring, so None for it), then calls
``core(a, h, qr, q, kv, freq, turn)`` with the layer's attention weights, its normed input ``h`` [B, T, hidden] and
the query's low-rank ``qr``; that returns the attention output [B, T, H, D] (before the inverse RoPE).
"""

from __future__ import annotations

import torch

from .config import ModelConfig
from .state import CompressorState, LayerState
from .weights import AttentionWeights, CompressorWeights, compressor_linears

_NEG_INF = float("-inf")
# A chunk's attention runs QUERY_BLOCK queries at a time, and the CSA indexer scores INDEX_KEY_BLOCK keys at a time:
# the largest temporaries are [QUERY_BLOCK, heads, window + chunk + (top-k or HCA entries)] logits and
# [QUERY_BLOCK, index heads, INDEX_KEY_BLOCK] indexer scores, whatever the context (docs/runtime.md).
QUERY_BLOCK = 256
INDEX_KEY_BLOCK = 4096


class PositionTables:
    """What a call's layers derive from its positions alone, made at the first layer that asks and shared by the
    rest: each is a few launches on the GPU, which a decode step of an L-layer model then makes once, not L times.
    ``positions`` int64 [B or 1, T] on the device."""

    def __init__(self, backend, positions: torch.Tensor):
        self.be, self.positions = backend, positions
        self._made: dict[tuple, object] = {}

    def _once(self, key: tuple, make):
        if key not in self._made:
            self._made[key] = make()
        return self._made[key]

    def turn(self, freq: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """RoPE's rotation (``Backend.rope_turn``, complex [B or 1, T, rd/2]) of the positions for the frequencies
        ``freq`` (the model's own tensor), or its inverse."""
        def make():
            cos, sin = self._once(("rope", id(freq)), lambda: self.be.rope_tables(self.positions, freq))
            return self.be.rope_turn(cos, sin, inverse=inverse)
        return self._once(("turn", id(freq), inverse), make)


class StepTables(PositionTables):
    """:class:`PositionTables` of a decode step: slot b at ``pos[b]`` (int64 [B], the tokens it held before this
    one), plus the step's ring slots, window lengths and entry counts."""

    def __init__(self, backend, pos: torch.Tensor):
        super().__init__(backend, pos[:, None])
        self.pos = pos

    def window_len(self, window: int) -> torch.Tensor:
        """int32 [B]: the ring's valid slots, this token's included (a partly filled ring is a prefix)."""
        return self._once(("window_len", window), lambda: torch.clamp(self.pos + 1, max=window).to(torch.int32))

    def count(self, ratio: int) -> torch.Tensor:
        """int32 [B]: the closed windows of ``ratio`` tokens, the one this token closes included."""
        return self._once(("count", ratio),
                          lambda: torch.div(self.pos + 1, ratio, rounding_mode="floor").to(torch.int32))

    def every_entry(self, ratio: int, rows: int) -> torch.Tensor:
        """int32 [B, rows]: each of a store's ``rows`` entry indices where valid, -1 past the slot's count (HCA
        attends every valid entry; the store's rows are fixed)."""
        def make():
            index = torch.arange(rows, dtype=torch.int32, device=self.pos.device)[None]
            return torch.where(index < self.count(ratio)[:, None], index, -1)
        return self._once(("every", ratio, rows), make)


def _entries_rope(be, ratio: int, windows: torch.Tensor, freq: torch.Tensor):
    """RoPE tables of entries ``windows`` (entry w sits at position w * ratio)."""
    return be.rope_tables(windows * ratio, freq)


def attend_chunk(be, q: torch.Tensor, rows: torch.Tensor, past: int, window: int, entries: torch.Tensor | None,
                 n_visible: torch.Tensor | None, index: tuple | None, sink: torch.Tensor, scale: float,
                 topk: int) -> torch.Tensor:
    """A chunk's attention (``Backend.chunk_attention``'s contract) through the backend's reference ops, QUERY_BLOCK
    queries at a time: masked logits over the window rows (and HCA's entries) by ``sink_attention``; CSA's per-query
    top-k entries (``chunk_topk``, INDEX_KEY_BLOCK keys a pass) gathered beside them by ``sink_attention_picked``.
    A chunk's temporaries grow with the block, not with the chunk times the context (CSA reads each query's top-k
    entries, gathered, never a [T, entries] mask)."""
    n, t = q.shape[:2]
    dev = q.device
    # query t is row past + t and sees rows (past + t - window, past + t]
    dist = (past + torch.arange(t, device=dev))[:, None] - torch.arange(rows.shape[1], device=dev)[None, :]
    bias = torch.zeros(dist.shape, device=dev).masked_fill((dist < 0) | (dist >= window), _NEG_INF)
    keys = rows
    if entries is not None and index is None:   # HCA: every visible entry, as more masked keys
        visible = torch.arange(entries.shape[1], device=dev)[None, :] < n_visible[:, None]
        keys = torch.cat((keys, entries), dim=1)
        bias = torch.cat((bias, torch.zeros(visible.shape, device=dev).masked_fill(~visible, _NEG_INF)), dim=-1)
    out = torch.empty(n, t, q.shape[2], q.shape[3], device=dev)
    for q0 in range(0, t, QUERY_BLOCK):
        r = slice(q0, q0 + QUERY_BLOCK)
        block_bias = bias[r].expand(n, -1, -1)
        if index is None:
            out[:, r] = be.sink_attention(q[:, r], keys, block_bias, sink, scale)
            continue
        iq, index_keys, index_weights = index
        picked = be.chunk_topk(iq[:, r], index_keys, index_weights[:, r], n_visible[r], topk,
                               INDEX_KEY_BLOCK)                                     # [n, b, k], -1 padding
        gathered = entries[torch.arange(n, device=dev)[:, None, None], picked.clamp(min=0)]
        out[:, r] = be.sink_attention_picked(q[:, r], keys, block_bias, gathered, picked >= 0, sink, scale)
    return out


class ChunkAttention:
    """``T`` tokens continuing slots ``rows`` [n] (a device index) of one layer's state, all at ``pos0``;
    ``positions`` [T] = ``pos0 + arange(T)`` on the device."""

    def __init__(self, backend, config: ModelConfig, st: LayerState, rows: torch.Tensor, positions: torch.Tensor,
                 pos0: int):
        self.be, self.cfg, self.st, self.rows, self.positions, self.pos0 = backend, config, st, rows, positions, pos0

    def query_key(self, a: AttentionWeights, q, kv, freq, turn):
        """The query [n, T, H, D] RMS-normalised per head (no weight) and the key [n, T, D] by ``a.kv_norm``, both
        rotated by ``turn`` [n or 1, T, rd/2] (``Backend.query_key``); the ring is written in :meth:`__call__`, after
        it is read."""
        return self.be.query_key(q, kv, a.kv_norm, turn, self.cfg.rms_norm_eps)

    def __call__(self, a: AttentionWeights, h, qr, q, kv, freq, turn):
        be, cfg, st, rows_idx, positions, pos0 = self.be, self.cfg, self.st, self.rows, self.positions, self.pos0
        n, t = q.shape[:2]
        # Sliding window: the ring holds positions [pos0 - W, pos0); query p sees keys (p - W, p]. ``rows``: the ring's
        # past keys in position order, then the chunk's; query t is row past + t of them.
        window = cfg.sliding_window
        past_pos = torch.arange(max(0, pos0 - window + 1), pos0, device=h.device)
        rows = torch.cat((st.window[rows_idx[:, None], (past_pos % window)[None]].to(kv.dtype), kv), dim=1)
        keep = min(t, window)
        st.window[rows_idx[:, None], (positions[-keep:] % window)[None]] = kv[:, -keep:].to(st.window.dtype)

        ratio, entries, n_visible, index = a.compress_ratio, None, None, None
        if ratio:
            proj = be.linears(h, compressor_linears(a))   # [n, T, C] each: kv, gate (, the indexer's kv, gate, weights)
            entries = self._compress(a.compressor, proj[0], proj[1], st.compressor, freq).to(rows.dtype)
            n_visible = (positions + 1) // ratio    # entries query t may see
            if a.indexer is not None:  # CSA: the lightning indexer picks each query's top-k visible entries
                ix = a.indexer
                index_keys = self._compress(ix.compressor, proj[2], proj[3], st.indexer, freq)
                iq = be.linear(qr, ix.wq_b).view(n, t, cfg.index_n_heads, cfg.index_head_dim)
                iq = be.rotate_(iq, turn[:, :, None])   # in place: the linear's own output
                if not entries.shape[1]:  # no entry is stored yet: the window alone
                    entries = None
                else:
                    index = iq, index_keys.to(iq.dtype), proj[4]
        return be.chunk_attention(q, rows, past_pos.shape[0], window, entries, n_visible, index, a.sink,
                                  cfg.head_dim ** -0.5, cfg.index_topk)   # [n, T, H, D]

    def _compress(self, cw: CompressorWeights, kv, gate, cs: CompressorState, freq) -> torch.Tensor:
        """Feed the chunk's projections ``kv``, ``gate`` [n, T, C] to a compressor: store the entries of the windows
        it closes, keep the open window's projections pending; return every entry of these slots so far
        [n, count, d]."""
        be, rows, ratio = self.be, self.rows, cs.ratio
        n = kv.shape[0]
        held = self.pos0 % ratio                  # the open window's tokens already pending
        kv = torch.cat((cs.pending_kv[rows, :held], kv), dim=1)
        gate = torch.cat((cs.pending_gate[rows, :held], gate), dim=1)
        closed = kv.shape[1] // ratio
        rest = kv.shape[1] - closed * ratio
        cs.pending_kv[rows, :rest] = kv[:, closed * ratio:]
        cs.pending_gate[rows, :rest] = gate[:, closed * ratio:]
        first = self.pos0 // ratio
        if closed:
            prev = (cs.prev_kv[rows], cs.prev_gate[rows]) if cs.overlap else None
            pooled, last = be.compress_windows(kv[:, :closed * ratio].reshape(n, closed, ratio, -1),
                                               gate[:, :closed * ratio].reshape(n, closed, ratio, -1), cw.ape,
                                               overlap=cs.overlap, prev=prev)
            if cs.overlap:
                cs.prev_kv[rows], cs.prev_gate[rows] = last
            cos, sin = _entries_rope(be, ratio, torch.arange(first, first + closed, device=kv.device), freq)
            entries = be.apply_rope_(be.rms_norm(pooled, cw.norm, self.cfg.rms_norm_eps), cos, sin)
            cs.store[rows, first:first + closed] = entries.to(cs.store.dtype)
        return cs.store[rows, :first + closed]


class StepAttention:
    """One token of every slot of one layer's state, slot b at ``tables.pos[b]`` (the step's
    :class:`StepTables`, shared by its layers)."""

    def __init__(self, backend, config: ModelConfig, st: LayerState, tables: StepTables):
        self.be, self.cfg, self.st, self.tables = backend, config, st, tables

    def query_key(self, a: AttentionWeights, q, kv, freq, turn):
        """``Backend.step_qkv``: the query [B, 1, H, D] normed and rotated (in the dtype the backend's
        ``decode_attention`` reads), the key normed, rotated and written to each slot's ring row ``pos % W``; no key
        is handed on (None): the ring holds it."""
        q = self.be.step_qkv(q, kv, a.kv_norm, self.st.window, self.tables.pos, freq, turn, self.cfg.rms_norm_eps)
        return q, None

    def __call__(self, a: AttentionWeights, h, qr, q, kv, freq, turn):
        be, cfg, st, tables = self.be, self.cfg, self.st, self.tables
        b, window = q.shape[0], cfg.sliding_window
        window_len = tables.window_len(window)   # the ring holds this token's key already (query_key)
        entries = indices = None
        ratio = a.compress_ratio
        if ratio:
            cs = st.compressor
            proj = be.linears(h[:, 0], compressor_linears(a))   # [B, C]: kv, gate (, the indexer's kv, gate, weights)
            self._compress(a.compressor, proj[0], proj[1], cs, freq)
            count = tables.count(ratio)
            entries = cs.store
            if a.indexer is not None:  # CSA: the indexer's top-k of the valid keys (-1 padding)
                ix = a.indexer
                self._compress(ix.compressor, proj[2], proj[3], st.indexer, freq)
                iq = be.linear(qr[:, 0], ix.wq_b).view(b, cfg.index_n_heads, cfg.index_head_dim)
                iq = be.rotate_(iq, turn)                    # turn [B, 1, rd/2] over the index heads
                indices = be.indexer_topk(iq, st.indexer.store, proj[4], cfg.index_topk, count)
            else:  # HCA: every valid entry
                indices = tables.every_entry(ratio, cs.store.shape[1])
        out = be.decode_attention(q[:, 0], st.window, window_len, entries, indices, a.sink, cfg.head_dim ** -0.5)
        return out[:, None]

    def _compress(self, cw: CompressorWeights, kv, gate, cs: CompressorState, freq) -> None:
        """The slots' projections ``kv``, ``gate`` [B, C] into one compressor's state
        (:meth:`ReferenceBackend.compress_step`)."""
        self.be.compress_step(kv, gate, cs, cw.ape, cw.norm, self.tables.pos, freq, self.cfg.rms_norm_eps)
