"""The DeepSeek-V4 forward over typed format-1 weights, prefill and step-by-step decode.

One code path serves both: a forward processes a chunk of ``T`` tokens at positions
``[state.position, state.position + T)`` against a :class:`DecodeState` and advances it. A
prefill is a chunk on a fresh state; :meth:`Model.step` is a chunk of one token. Every compute
op goes through the model's backend (``runtime/backend.py``); activations are float32.

Semantics are the official ``inference/model.py`` (docs/deepseek_v4.md, "The forward pass"); where transformers 5.23
differs, docs/runtime.md says which one this follows.
"""

from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

from nvfp4_megamoe.errors import InputError

from .backend import ReferenceBackend
from .hopper import HopperBackend, hopper_available
from .checkpoint import Checkpoint
from .distributed import ExpertParallelBackend, resolve_world
from .config import ModelConfig
from .decode_graphs import DecodeGraphs
from .rope import inv_freq
from .state import CompressorState, DecodeState, LayerState
from .weights import CompressorWeights, LayerWeights, ModelWeights, WeightLoader

_NEG_INF = float("-inf")


def check_token_ids(ids: torch.Tensor, vocab: int) -> None:
    """Refuse what the embedding cannot look up, saying so (torch says only ``index out of range in self``,
    and on a GPU an out-of-range id is a device-side assert that ends the process's CUDA context)."""
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise InputError(f"input_ids must hold integer token ids, got dtype {ids.dtype}")
    if not ids.numel():
        return
    lo, hi = (int(v) for v in torch.aminmax(ids))  # one small reduction (one device sync on a GPU)
    if lo < 0 or hi >= vocab:
        where = ((ids < 0) | (ids >= vocab)).nonzero()[0].tolist()
        raise InputError(f"token ids must lie in [0, {vocab}) (the model's vocab_size); input_ids{where} is "
                         f"{int(ids[tuple(where)])} (min {lo}, max {hi})")


class Model:
    """A loaded DeepSeek-V4 model. ``model(input_ids)`` -> float32 logits [B, T, V]."""

    def __init__(self, config: ModelConfig, weights: ModelWeights, *, backend=None,
                 device: torch.device | str = "cpu", checkpoint: Checkpoint | None = None):
        self.config, self.weights = config, weights
        self.backend = backend if backend is not None else ReferenceBackend()
        self.device = torch.device(device)
        self.checkpoint = checkpoint
        self.world = None  # a distributed.World when load_model(..., world=...) split the experts
        # one-token forwards replay each layer's FFN half from a CUDA graph (load_model sets this on the
        # Hopper kernels path; None: every op eager)
        self.decode_graphs: DecodeGraphs | None = None
        self._freq_main = inv_freq(config.main_rope).to(self.device)
        self._freq_compress = inv_freq(config.compress_rope).to(self.device)

    @property
    def layer_indices(self) -> list[int]:
        return sorted(self.weights.layers)

    @property
    def complete(self) -> bool:
        """True when every layer and every expert is held (logits are the model's own)."""
        n = self.config.n_routed_experts
        return len(self.weights.layers) == self.config.num_layers and all(
            lw.moe.expert_range == (0, n) for lw in self.weights.layers.values())

    # -- state --------------------------------------------------------------------------------------
    def new_state(self, batch: int) -> DecodeState:
        """An empty KV cache for ``batch`` sequences (all at position 0)."""
        cfg, dev, dt = self.config, self.device, self.backend.state_dtype
        state = DecodeState(batch=batch)
        for i in self.layer_indices:
            ratio = cfg.compress_ratios[i]
            st = LayerState(torch.zeros((batch, cfg.sliding_window, cfg.head_dim), dtype=dt, device=dev))
            if ratio:
                width = 2 * cfg.head_dim if ratio == 4 else cfg.head_dim
                st.compressor = CompressorState.empty(batch, width, cfg.head_dim, dev, dt, spare=ratio == 4)
            if ratio == 4:
                st.indexer = CompressorState.empty(batch, 2 * cfg.index_head_dim, cfg.index_head_dim, dev, dt,
                                                   spare=True)
            state.layers[i] = st
        return state

    # -- public forward -------------------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, state: DecodeState | None = None) -> torch.Tensor:
        """Logits float32 [B, T, V] for ``input_ids`` [B, T] (int) continuing ``state`` (fresh if None)."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, tokens], got shape {tuple(input_ids.shape)}")
        check_token_ids(input_ids, self.config.vocab_size)
        input_ids = input_ids.to(self.device)
        b, t = input_ids.shape
        if state is None:
            state = self.new_state(b)
        elif state.batch != b:
            raise ValueError(f"state is for batch {state.batch}, input_ids has batch {b}")
        if t == 0:
            raise ValueError("input_ids holds no tokens")
        be, cfg, w = self.backend, self.config, self.weights
        positions = torch.arange(state.position, state.position + t, device=self.device)
        x = F.embedding(input_ids, w.embed).float()
        streams = x.unsqueeze(2).expand(b, t, cfg.hc_mult, cfg.hidden_size)
        graphs = self.decode_graphs if t == 1 else None
        for i in self.layer_indices:
            lw = w.layers[i]
            streams = self._attention_half(lw, streams, positions, state.position, state.layers[i])
            if graphs is None:
                streams = self._ffn_half(lw, streams, input_ids)
            else:
                streams = graphs.run((i, b), lambda s, ids, lw=lw: self._ffn_half(lw, s, ids), streams, input_ids)
        state.position += t
        h = be.hc_head(streams, w.hc_head.fn, w.hc_head.base, w.hc_head.scale,
                       hc_eps=cfg.hc_eps, norm_eps=cfg.rms_norm_eps)
        return be.linear(be.rms_norm(h, w.norm, cfg.rms_norm_eps), w.head)

    __call__ = forward

    @torch.no_grad()
    def step(self, token_ids: torch.Tensor, state: DecodeState) -> torch.Tensor:
        """Decode one token per sequence: ``token_ids`` [B] (or [B, 1]) -> logits [B, V]; advances ``state``."""
        return self.forward(token_ids.reshape(-1, 1), state)[:, 0]

    # -- blocks -----------------------------------------------------------------------------------
    def _hc_kw(self) -> dict:
        cfg = self.config
        return dict(iters=cfg.hc_sinkhorn_iters, hc_eps=cfg.hc_eps, norm_eps=cfg.rms_norm_eps)

    def _attention_half(self, lw: LayerWeights, streams, positions, start: int, st: LayerState):
        be, cfg = self.backend, self.config
        x, post, comb = be.hc_pre(streams, lw.hc_attn.fn, lw.hc_attn.base, lw.hc_attn.scale, **self._hc_kw())
        out = self._attention(lw, be.rms_norm(x, lw.attn_norm, cfg.rms_norm_eps), positions, start, st)
        return be.hc_post(out, streams, post, comb)

    def _ffn_half(self, lw: LayerWeights, streams, input_ids):
        """mHC, norm, MoE, mHC: no decode state, shapes set by the batch alone (capturable for decode)."""
        be, cfg = self.backend, self.config
        x, post, comb = be.hc_pre(streams, lw.hc_ffn.fn, lw.hc_ffn.base, lw.hc_ffn.scale, **self._hc_kw())
        out = self._moe(lw, be.rms_norm(x, lw.ffn_norm, cfg.rms_norm_eps), input_ids)
        return be.hc_post(out, streams, post, comb)

    def _attention(self, lw: LayerWeights, h, positions, start: int, st: LayerState):
        """``positions`` [T] on the device; ``start`` = positions[0] on the host (reading it back would
        wait for the GPU in every layer)."""
        be, cfg, a = self.backend, self.config, lw.attn
        b, t, _ = h.shape
        eps, ratio = cfg.rms_norm_eps, a.compress_ratio
        freq = self._freq_compress if ratio else self._freq_main
        cos, sin = be.rope_tables(positions, freq)              # [T, rd/2]
        qr = be.rms_norm(be.linear(h, a.wq_a), a.q_norm, eps)   # [B, T, q_lora]
        q = be.rms_norm(be.linear(qr, a.wq_b).view(b, t, cfg.num_heads, cfg.head_dim), None, eps)
        q = be.apply_rope(q, cos[:, None], sin[:, None])
        kv = be.apply_rope(be.rms_norm(be.linear(h, a.wkv), a.kv_norm, eps), cos, sin)  # [B, T, D]

        if t == 1:
            out = self._decode_attention(a, h, qr, q, kv, start, st, freq, cos, sin)
        else:
            out = self._prefill_attention(a, h, qr, q, kv, positions, start, st, freq, cos, sin)
        out = be.apply_rope(out, cos[:, None], sin[:, None], inverse=True)
        out = be.grouped_linear(out.reshape(b, t, cfg.o_groups, -1), a.wo_a, cfg.o_groups)
        return be.linear(out.flatten(2), a.wo_b)

    def _prefill_attention(self, a, h, qr, q, kv, positions, pos0: int, st: LayerState, freq, cos, sin):
        """A chunk of T tokens: dense logits over (ring + chunk) keys and compressed entries, masked."""
        be, cfg = self.backend, self.config
        b, t = q.shape[:2]
        # Sliding window: the ring holds positions [pos0 - W, pos0); query p sees keys (p - W, p].
        window = cfg.sliding_window
        past_pos = torch.arange(max(0, pos0 - window + 1), pos0, device=h.device)
        keys = torch.cat((st.window[:, past_pos % window].to(kv.dtype), kv), dim=1)
        dist = positions[:, None] - torch.cat((past_pos, positions))[None, :]
        bias = torch.zeros(dist.shape, device=h.device).masked_fill((dist < 0) | (dist >= window), _NEG_INF)
        bias = bias.expand(b, -1, -1)
        keep = min(t, window)
        st.window[:, positions[-keep:] % window] = kv[:, -keep:].to(st.window.dtype)

        ratio = a.compress_ratio
        if ratio:
            entries = self._compress(a.compressor, h, st.compressor, ratio, freq)
            n = entries.shape[1]
            visible = torch.arange(n, device=h.device)[None, :] < ((positions + 1) // ratio)[:, None]
            visible = visible.expand(b, -1, -1)
            if a.indexer is not None:  # CSA: the lightning indexer picks top-k visible entries
                ix = a.indexer
                index_keys = self._compress(ix.compressor, h, st.indexer, ratio, freq)
                iq = be.linear(qr, ix.wq_b).view(b, t, cfg.index_n_heads, cfg.index_head_dim)
                iq = be.apply_rope(iq, cos[:, None], sin[:, None])
                scores = be.indexer_scores(iq, index_keys.to(iq.dtype), be.linear(h, ix.weights_proj))
                visible = be.select_topk(scores, visible, cfg.index_topk)
            keys = torch.cat((keys, entries.to(keys.dtype)), dim=1)
            entry_bias = torch.zeros(visible.shape, device=h.device).masked_fill(~visible, _NEG_INF)
            bias = torch.cat((bias, entry_bias), dim=-1)
        return be.sink_attention(q, keys, bias, a.sink, cfg.head_dim ** -0.5)   # [B, T, H, D]

    def _decode_attention(self, a, h, qr, q, kv, pos: int, st: LayerState, freq, cos, sin):
        """One token: write it into the ring, then attend over the ring and the entries (decode-kernel operands)."""
        be, cfg = self.backend, self.config
        b, window = q.shape[0], cfg.sliding_window
        st.window[:, pos % window] = kv[:, 0]
        window_len = torch.full((b,), min(pos + 1, window), dtype=torch.int32, device=h.device)
        entries = indices = None
        ratio = a.compress_ratio
        if ratio:  # every entry present is complete, hence visible to this token
            cs = st.compressor
            self._compress(a.compressor, h, cs, ratio, freq)
            entries = cs.entries
            if a.indexer is not None:  # whole stores (no copy): the picks and n_valid bound what is read
                ix = a.indexer
                self._compress(ix.compressor, h, st.indexer, ratio, freq)
                iq = be.linear(qr[:, 0], ix.wq_b).view(b, cfg.index_n_heads, cfg.index_head_dim)
                iq = be.apply_rope(iq, cos, sin)
                n_valid = torch.full((b,), st.indexer.count, dtype=torch.int32, device=h.device)
                indices = be.indexer_topk(iq, st.indexer.store, be.linear(h[:, 0], ix.weights_proj),
                                          cfg.index_topk, n_valid)
                entries = cs.store
            if cs.count == 0:  # no window closed yet: a window-only step
                entries = indices = None
        out = be.decode_attention(q[:, 0], st.window, window_len, entries, indices, a.sink, cfg.head_dim ** -0.5)
        return out[:, None]

    def _compress(self, cw: CompressorWeights, h, cs: CompressorState, ratio: int, freq):
        """Feed a chunk to a compressor; emit entries for the windows it closes; return all entries."""
        be, b = self.backend, h.shape[0]
        kv = torch.cat((cs.pending_kv, be.linear(h, cw.wkv)), dim=1)
        gate = torch.cat((cs.pending_gate, be.linear(h, cw.wgate)), dim=1)
        n = kv.shape[1] // ratio
        cs.pending_kv, cs.pending_gate = kv[:, n * ratio:], gate[:, n * ratio:]
        if n:
            pooled, last = be.compress_windows(kv[:, :n * ratio].reshape(b, n, ratio, -1),
                                               gate[:, :n * ratio].reshape(b, n, ratio, -1), cw.ape,
                                               overlap=ratio == 4, prev=cs.prev)
            cs.prev = last
            first = cs.count
            cos, sin = be.rope_tables(torch.arange(first, first + n, device=h.device) * ratio, freq)
            cs.append(be.apply_rope(be.rms_norm(pooled, cw.norm, self.config.rms_norm_eps), cos, sin))
        return cs.entries

    def _moe(self, lw: LayerWeights, h, input_ids):
        be, cfg, m = self.backend, self.config, lw.moe
        b, t, d = h.shape
        x = h.reshape(-1, d)
        scores = be.route_scores(be.linear(x, m.gate), cfg.scoring_func)
        if m.is_hash:
            ids, weights = be.route_hash(scores, m.tid2eid, input_ids.reshape(-1), cfg.routed_scaling_factor)
        else:
            ids, weights = be.route_topk(scores, m.bias, cfg.top_k, cfg.routed_scaling_factor)
        out = be.moe(x, ids, weights, m, cfg.swiglu_limit) + be.shared_expert(x, m.shared)
        return out.view(b, t, d)


def _warn_without_kernels(device: str | torch.device) -> None:
    """On an sm_90 GPU without CuTeDSL the PyTorch references run, far slower: say so, and what to install."""
    dev = torch.device(device)
    if (dev.type == "cuda" and torch.cuda.is_available() and torch.cuda.get_device_capability(dev) == (9, 0)
            and importlib.util.find_spec("cutlass") is None):
        warnings.warn("load_model: CuTeDSL (nvidia-cutlass-dsl) is not installed, so this H100/H200 runs the PyTorch "
                      "reference ops instead of the Hopper kernels; install them with "
                      "`pip install 'nvfp4-megamoe[gpu]'`.", stacklevel=3)


def load_model(path: str | Path, device: str | torch.device = "cpu", layers: list[int] | None = None,
               experts: tuple[int, int] | None = None, verify_hashes: bool = False, backend=None,
               world=None) -> Model:
    """Load a converted (format 1) checkpoint for inference.

    ``layers``: load only these decoder layers (the forward then runs just those, in order).
    ``experts``: load only routed experts ``[start, stop)`` of every layer (expert parallelism;
    the routed-MoE output is then this rank's partial sum). ``verify_hashes``: check every shard's
    sha256 against the manifest first. ``backend``: per-op backend (default: the Hopper kernels on
    an sm_90 GPU, compiled here before returning; the PyTorch references elsewhere).
    ``world``: expert parallelism over torch.distributed (``"auto"``: the default process group when
    initialised; or a :class:`~nvfp4_megamoe.runtime.distributed.World`): this rank loads its
    contiguous expert range, the MoE combines across ranks (docs/distributed.md).

    Raises :class:`~nvfp4_megamoe.runtime.format.FormatError` for a folder that is not a
    converted checkpoint, or one written by a newer/unknown format version.
    """
    ckpt = Checkpoint(path, verify_hashes=verify_hashes)
    config = ModelConfig.from_file(ckpt.path)
    world = resolve_world(world)
    if world is not None:
        if experts is not None:
            raise ValueError("pass experts= or world=, not both (world= picks this rank's expert range)")
        experts = world.expert_range(config.n_routed_experts)
    weights = WeightLoader(ckpt, config, device).model(layers, experts)
    warm = backend is None and hopper_available(device)
    if backend is None and not warm:
        _warn_without_kernels(device)
    if warm:
        backend = HopperBackend()
    inner = backend
    if world is not None:
        backend = ExpertParallelBackend(backend if backend is not None else ReferenceBackend(), world)
    model = Model(config, weights, backend=backend, device=device, checkpoint=ckpt)
    model.world = world
    if warm:
        if world is None:  # collectives inside a captured block are not set up for graphs here
            model.decode_graphs = DecodeGraphs()
        inner.warmup(model)
    return model
