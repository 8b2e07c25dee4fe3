"""The per-op backend seam: every compute op of the forward goes through one :class:`Backend`.

:class:`ReferenceBackend` runs the PyTorch references in ``kernels/`` on whatever device the
weights live on (CPU, or CUDA tensors when no kernel is plugged in). A GPU backend subclasses it
and overrides only the ops it has kernels for, e.g.::

    class HopperBackend(ReferenceBackend):
        def moe(self, x, ids, weights, experts, swiglu_limit): return my_grouped_w4a16(...)

and is passed to :func:`nvfp4_megamoe.runtime.load_model` as ``backend=HopperBackend()``.
Op contracts (shapes, float32 results) are those of the reference functions named below.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nvfp4_megamoe.kernels import attention_reference, compressor_reference, indexer_reference
from nvfp4_megamoe.kernels import mhc_reference, router_reference
from nvfp4_megamoe.kernels.decode_attention_reference import decode_attention_reference
from nvfp4_megamoe.kernels.fp8 import fp8_block_dequantize
from nvfp4_megamoe.kernels.fp8_reference import fp8_linear
from nvfp4_megamoe.kernels.interleave import deinterleave_gate_up
from nvfp4_megamoe.kernels.moe_reference import moe_reference
from nvfp4_megamoe.kernels.nvfp4_reference import decode_weight, nvfp4_linear

from .state import CompressorState
from .weights import DenseLinear, Fp8Linear, Linear, MoEWeights, Nvfp4Linear



def decode_linear(w: Linear) -> torch.Tensor:
    """Whole float32 weight [out, in] of one linear (used for grouped projections)."""
    if isinstance(w, Nvfp4Linear):
        return decode_weight(w.weight, w.weight_scale, w.alpha)
    if isinstance(w, Fp8Linear):
        return fp8_block_dequantize(w.weight, w.scale)
    return w.weight.float()


class ReferenceBackend:
    """PyTorch references from ``kernels/`` for every op (the default backend)."""

    name = "reference"
    #: dtype the decode state keeps its K=V vectors in (SWA ring, compressed entries, indexer keys)
    state_dtype = torch.float32

    # -- linears --------------------------------------------------------------------------------
    def linear(self, x: torch.Tensor, w: Linear) -> torch.Tensor:
        """x [..., in] -> float32 [..., out]."""
        if isinstance(w, Nvfp4Linear):
            return nvfp4_linear(x, w.weight, w.weight_scale, w.alpha)
        if isinstance(w, Fp8Linear):
            return fp8_linear(x, w.weight, w.scale)
        if isinstance(w, DenseLinear):
            return x.float() @ w.weight.float().T
        raise TypeError(f"unknown linear weight {type(w).__name__}")

    def linears(self, x: torch.Tensor, ws: tuple[Linear, ...]) -> list[torch.Tensor]:
        """Several linears of one input (a group of ``weights.same_input_linears``): ``[linear(x, w) for w in ws]``,
        which a backend may compute as one weight and hand back as views of its output's columns."""
        return [self.linear(x, w) for w in ws]

    def grouped_linear(self, x: torch.Tensor, w: Linear, groups: int) -> torch.Tensor:
        """x [..., G, in_g], weight [G*out_g, in_g] -> [..., G, out_g] (group g uses rows g*out_g...)."""
        weight = decode_linear(w)
        return torch.einsum("...gi,goi->...go", x.float(), weight.view(groups, -1, weight.shape[-1]))

    # -- MoE ------------------------------------------------------------------------------------
    def moe(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: MoEWeights,
            swiglu_limit: float) -> torch.Tensor:
        """Routed experts held by this rank. ``ids`` are global; those outside the held range are skipped."""
        start, stop = experts.expert_range
        args = (experts.w13, experts.w13_scale, experts.w13_alpha, experts.w2, experts.w2_scale, experts.w2_alpha,
                swiglu_limit, experts.row_tiles)
        if (start, stop) == (0, experts.n_experts):
            return moe_reference(x, ids, weights, *args)
        # Expert parallel: keep the (token, slot) pairs routed here, one pair per row.
        held = ((ids >= start) & (ids < stop)).reshape(-1)
        token = torch.arange(x.shape[0], device=x.device).repeat_interleave(ids.shape[1])[held]
        out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
        if token.numel():
            part = moe_reference(x[token], (ids.reshape(-1)[held] - start)[:, None],
                                 weights.reshape(-1)[held][:, None], *args)
            out.index_add_(0, token, part)
        return out

    def shared_expert(self, x: torch.Tensor, w) -> torch.Tensor:
        """The shared expert, SwiGLU with **no** clamp (official semantics)."""
        if w.w13 is not None:
            gate, up = deinterleave_gate_up(self.linear(x, w.w13).movedim(-1, 0))
            gate, up = gate.movedim(0, -1), up.movedim(0, -1)
        else:
            gate, up = self.linears(x, (w.w1, w.w3))
        return self.linear(F.silu(gate) * up, w.w2)

    route_scores = staticmethod(router_reference.router_scores)
    route_topk = staticmethod(router_reference.route_topk)
    route_hash = staticmethod(router_reference.route_hash)

    def route(self, logits: torch.Tensor, func: str, bias: torch.Tensor | None, tid2eid: torch.Tensor | None,
              token_ids: torch.Tensor, k: int, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The router after its linear, in one op (so that a backend may run it as one kernel): ``logits`` [T, E]
        -> scores (``func``), then the experts of ``tid2eid[token_ids]`` (hash layers: ``tid2eid`` given) or the
        top ``k`` of scores + ``bias``; -> (ids [T, k] int64, weights [T, k] float32, ``route_topk`` /
        ``route_hash``)."""
        scores = self.route_scores(logits, func)
        if tid2eid is not None:
            return self.route_hash(scores, tid2eid, token_ids, scaling)
        return self.route_topk(scores, bias, k, scaling)

    # -- attention ------------------------------------------------------------------------------
    rope_tables = staticmethod(attention_reference.rope_tables)
    apply_rope = staticmethod(attention_reference.apply_rope)
    apply_rope_ = staticmethod(attention_reference.apply_rope_)   # in place: for tensors the caller made
    rope_turn = staticmethod(attention_reference.rope_turn)
    rotate_ = staticmethod(attention_reference.rotate_)           # by a rope_turn, in place
    sink_attention = staticmethod(attention_reference.sink_attention)
    sink_attention_picked = staticmethod(attention_reference.sink_attention_picked)
    compress_windows = staticmethod(compressor_reference.compress_windows)
    chunk_topk = staticmethod(indexer_reference.topk_in_blocks)

    def chunk_attention(self, q: torch.Tensor, rows: torch.Tensor, past: int, window: int,
                        entries: torch.Tensor | None, n_visible: torch.Tensor | None, index: tuple | None,
                        sink: torch.Tensor, scale: float, topk: int) -> torch.Tensor:
        """The attention of a chunk of T tokens of n slots -> float32 [n, T, H, D] (before the inverse RoPE).

        ``q`` [n, T, H, D] normed and rotated; ``rows`` [n, past + T, D]: each slot's window keys, its ``past`` ring
        keys in position order then the chunk's (query t is row ``past + t`` and sees rows ``(past + t - window,
        past + t]``); ``entries`` [n, N, D] or None: the compressed entries so far (None: a window-only layer, or a
        CSA layer with none stored yet); ``n_visible`` int [T]: entries query t may see; ``index``: CSA's
        ``(iq [n, T, h, d], index_keys [n, N, d], weights [n, T, h])``, whose top-``topk`` visible entries
        (``chunk_topk``) each query attends to besides its window; None with ``entries``: HCA, every visible entry.
        The reference runs ``sink_attention`` / ``sink_attention_picked`` in blocks of queries
        (``attention.attend_chunk``)."""
        from .attention import attend_chunk

        return attend_chunk(self, q, rows, past, window, entries, n_visible, index, sink, scale, topk)

    def query_key(self, q_raw: torch.Tensor, kv_raw: torch.Tensor, kv_norm: torch.Tensor, turn: torch.Tensor,
                  eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The attention's query ``q_raw`` [B, T, H, D] RMS-normalised per head without a weight and its key ``kv_raw``
        [B, T, D] by ``kv_norm`` (both ``eps``), both rotated by ``turn`` [B or 1, T, rd/2] (:meth:`rope_turn`)."""
        q = self.rotate_(self.rms_norm(q_raw, None, eps), turn[:, :, None])   # in place: the norm's own output
        return q, self.rotate_(self.rms_norm(kv_raw, kv_norm, eps), turn)

    # -- decode (one token per sequence): the operands the GPU decode kernels take ----------------
    def step_qkv(self, q_raw: torch.Tensor, kv_raw: torch.Tensor, kv_norm: torch.Tensor, ring: torch.Tensor,
                 positions: torch.Tensor, inv_freq: torch.Tensor, turn: torch.Tensor, eps: float) -> torch.Tensor:
        """A decode step's query and key in one op (so that a backend may run it as one kernel): the query ``q_raw``
        [B, 1, H, D] RMS-normalised per head without a weight, the key ``kv_raw`` [B, 1, D] (any row stride) by
        ``kv_norm`` [D] (both ``eps``), both rotated at each slot's position by ``turn`` [B, 1, rd/2]
        (:meth:`rope_turn` of ``positions`` int64 [B], the tokens each slot held before this one, and ``inv_freq``
        [rd/2], which a kernel computes from instead); the key is written, in the ring's dtype, to row
        ``positions % W`` of ``ring`` [B, W, D], in place. Returns the rotated query [B, 1, H, D]: float32 here, in
        the dtype its ``decode_attention`` reads on a backend whose kernel rounds it anyway (the Hopper one: BF16)."""
        q, kv = self.query_key(q_raw, kv_raw, kv_norm, turn, eps)
        b, window, d = ring.shape
        ring.scatter_(1, (positions % window).view(b, 1, 1).expand(b, 1, d), kv.to(ring.dtype))
        return q

    def compress_step(self, kv: torch.Tensor, gate: torch.Tensor, cs: CompressorState, ape: torch.Tensor,
                      norm: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, eps: float) -> None:
        """One token per slot into a compressor's state (``runtime/state.py``), in place: ``kv``, ``gate`` [B, C]
        (the token's projections) go to slot ``positions % ratio`` of the open window; the window is pooled
        (:meth:`compress_windows`, the overlap half ``prev`` too), RMS-normalised by ``norm`` (``eps``), rotated at
        position ``(positions // ratio) * ratio`` and written to store row ``positions // ratio`` whether or not the
        window closes now (only a closed window's row is ever read; an open one's is overwritten when it closes); the
        overlap half moves on only where the window closes. ``positions`` int64 [B]: the tokens each slot held
        before this one."""
        pos, ratio, b = positions, cs.ratio, kv.shape[0]
        slot = (pos % ratio).view(b, 1, 1).expand(b, 1, kv.shape[-1])
        cs.pending_kv.scatter_(1, slot, kv[:, None].to(cs.pending_kv.dtype))
        cs.pending_gate.scatter_(1, slot, gate[:, None].to(cs.pending_gate.dtype))
        prev = (cs.prev_kv, cs.prev_gate) if cs.overlap else None
        pooled, last = self.compress_windows(cs.pending_kv[:, None], cs.pending_gate[:, None], ape,
                                             overlap=cs.overlap, prev=prev)   # [B, 1, d]
        if cs.overlap:
            closes = (torch.remainder(pos + 1, ratio) == 0).view(b, 1, 1)
            cs.prev_kv.copy_(torch.where(closes, last[0], cs.prev_kv))
            cs.prev_gate.copy_(torch.where(closes, last[1], cs.prev_gate))
        w = torch.div(pos, ratio, rounding_mode="floor")
        cos, sin = self.rope_tables(w[:, None] * ratio, inv_freq)
        entry = self.apply_rope_(self.rms_norm(pooled, norm, eps), cos, sin)
        cs.store.scatter_(1, w.view(b, 1, 1).expand(b, 1, entry.shape[-1]), entry.to(cs.store.dtype))

    def indexer_topk(self, q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor, k: int,
                     n_valid: torch.Tensor) -> torch.Tensor:
        """q [B, h, d], keys [B, N, d], weights [B, h], n_valid int [B] -> int32 [B, k] entry indices
        (ties: lower index first), -1 where fewer than k entries are visible."""
        # one block of every key: a step scores all of a row's entries at once, as the GPU kernels do
        picked = indexer_reference.topk_in_blocks(q[:, None], keys, weights[:, None], n_valid[:, None], k,
                                                  block=max(1, keys.shape[1]))
        return picked[:, 0].to(torch.int32)

    def decode_attention(self, q: torch.Tensor, kv_window: torch.Tensor, window_len: torch.Tensor,
                         kv_compressed: torch.Tensor | None, indices: torch.Tensor | None,
                         sink: torch.Tensor, scale: float) -> torch.Tensor:
        """q [B, H, D] against the SWA ring [B, W, D] (``window_len`` valid slots, current token
        included) and compressed entries (``indices`` [B, K], -1 padding; None = all) -> [B, H, D]."""
        return decode_attention_reference(q, kv_window, window_len, kv_compressed, indices, sink, scale)

    # -- mHC --------------------------------------------------------------------------------------
    def hc_pre(self, x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, *, iters: int,
               hc_eps: float, norm_eps: float, norm_weight: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``mhc_reference.hc_pre``; with ``norm_weight`` the sublayer input comes through the sublayer's RMSNorm
        (:meth:`rms_norm`, eps ``norm_eps``), so that a backend may do both in one launch."""
        h, post, comb = mhc_reference.hc_pre(x, fn, base, scale, iters=iters, hc_eps=hc_eps, norm_eps=norm_eps)
        return (h if norm_weight is None else self.rms_norm(h, norm_weight, norm_eps)), post, comb

    hc_post = staticmethod(mhc_reference.hc_post)
    hc_head = staticmethod(mhc_reference.hc_head)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        x = x.float()
        y = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
        return y if weight is None else y * weight.float()
