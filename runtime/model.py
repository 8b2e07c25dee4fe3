"""The DeepSeek-V4 forward over typed format-1 weights: prefill, chunked prefill and step-by-step decode.

The decode state (``runtime/state.py``) has one slot per sequence, each at its own position. Two paths
share every block but the attention core (``runtime/attention.py``):

* a **chunk**: ``T`` tokens of slots that share one position (``model(ids, state)``, :meth:`Model.prefill`),
  masked attention in blocks of queries, CSA's top-k entries gathered per query (``runtime/attention.py``);
* a **step**: one token of every slot, each at its own position (:meth:`Model.step`), with fixed shapes and
  no host read of a device value, so that one CUDA graph per state replays it (``runtime/decode_graphs.py``).

Every compute op goes through the model's backend (``runtime/backend.py``); activations are float32.
Semantics are the official ``inference/model.py`` (docs/deepseek_v4.md, "The forward pass"); where transformers 5.23
differs, docs/runtime.md says which one this follows.
"""

from __future__ import annotations

import importlib.util
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

from nvfp4_megamoe.errors import InputError

from .attention import ChunkAttention, PositionTables, StepAttention, StepTables
from .backend import ReferenceBackend
from .hopper import HopperBackend, hopper_available
from .checkpoint import Checkpoint
from .distributed import ExpertParallelBackend, resolve_world
from .config import ModelConfig
from .decode_graphs import DecodeGraphs
from .rope import inv_freq
from .state import CompressorState, DecodeState, LayerState, Shapes, check_fits, compressor_shapes, nbytes_of
from .weights import LayerWeights, ModelWeights, WeightLoader

#: max_context of :meth:`Model.new_state` when none is given
DEFAULT_MAX_CONTEXT = 4096
# Tokens of a prompt that Model.prefill feeds at once by default (the GPU MoE kernels' largest call too).
PREFILL_CHUNK = 4096


def check_token_ids(ids: torch.Tensor, vocab: int) -> None:
    """Refuse what the embedding cannot look up, saying so (torch says only ``index out of range in self``,
    and on a GPU an out-of-range id is a device-side assert that ends the process's CUDA context). Ids on the CPU
    are read here; ids already on the GPU are checked by :class:`_DeviceIdCheck` instead (no host sync)."""
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise InputError(f"input_ids must hold integer token ids, got dtype {ids.dtype}")
    if not ids.numel() or ids.is_cuda:
        return
    lo, hi = (int(v) for v in torch.aminmax(ids))
    if lo < 0 or hi >= vocab:
        where = ((ids < 0) | (ids >= vocab)).nonzero()[0].tolist()
        raise InputError(f"token ids must lie in [0, {vocab}) (the model's vocab_size); input_ids{where} is "
                         f"{int(ids[tuple(where)])} (min {lo}, max {hi})")


class _DeviceIdCheck:
    """Token ids that are already on the GPU (sampled there, say), checked without reading them back, which would
    stall the host in every decode step: out-of-range ids are clamped (so nothing reads out of bounds), a flag on the
    GPU records them, is copied to pinned host memory behind the step, and the first call after that copy has
    landed raises :class:`~nvfp4_megamoe.errors.InputError` (the earlier call's logits were not the model's)."""

    def __init__(self, vocab: int, device: torch.device):
        self.vocab = vocab
        self.flag = torch.zeros((), dtype=torch.bool, device=device)
        self.seen = torch.zeros((), dtype=torch.bool).pin_memory()
        self.copied: torch.cuda.Event | None = None

    def raise_if_flagged(self) -> None:
        if self.copied is not None and self.copied.query() and bool(self.seen):
            self.seen.zero_()
            self.flag.zero_()
            self.copied = None
            raise InputError(f"a token id given on the GPU to an earlier call was outside [0, {self.vocab}) (the "
                             "model's vocab_size); that call's logits are not the model's (ids on the CPU are checked "
                             "before the call)")

    def clamp(self, ids: torch.Tensor) -> torch.Tensor:
        bad = (ids < 0) | (ids >= self.vocab)
        self.flag.logical_or_(bad.any())
        self.seen.copy_(self.flag, non_blocking=True)
        self.copied = torch.cuda.Event()
        self.copied.record()
        return ids.clamp(0, self.vocab - 1)


class Model:
    """A loaded DeepSeek-V4 model. ``model(input_ids)`` -> float32 logits [B, T, V]."""

    def __init__(self, config: ModelConfig, weights: ModelWeights, *, backend=None,
                 device: torch.device | str = "cpu", checkpoint: Checkpoint | None = None):
        self.config, self.weights = config, weights
        self.backend = backend if backend is not None else ReferenceBackend()
        self.device = torch.device(device)
        self.checkpoint = checkpoint
        self.world = None  # a distributed.World when load_model(..., world=...) split the experts
        self.load_seconds: dict[str, float] = {}  # where load_model's time went (its phases, and "total")
        # decode steps replay from one CUDA graph per state (load_model sets this on the Hopper kernels
        # path; None: every op eager)
        self.decode_graphs: DecodeGraphs | None = None
        self._id_check: _DeviceIdCheck | None = None  # for token ids handed over on the GPU
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
    def _state_shapes(self, batch: int, max_context: int) -> dict[int, dict[str, Shapes]]:
        """Per layer, per part (``window``, ``compressor``, ``indexer``): the state's tensor shapes."""
        cfg, dt = self.config, self.backend.state_dtype
        plan = {}
        for i in self.layer_indices:
            ratio = cfg.compress_ratios[i]
            parts = {"window": {"window": ((batch, cfg.sliding_window, cfg.head_dim), dt)}}
            if ratio:
                width = 2 * cfg.head_dim if ratio == 4 else cfg.head_dim
                parts["compressor"] = compressor_shapes(batch, ratio, width, cfg.head_dim, max_context, dt,
                                                        overlap=ratio == 4)
            if ratio == 4:
                parts["indexer"] = compressor_shapes(batch, ratio, 2 * cfg.index_head_dim, cfg.index_head_dim,
                                                     max_context, dt, overlap=True)
            plan[i] = parts
        return plan

    def state_nbytes(self, batch: int, max_context: int) -> int:
        """Bytes :meth:`new_state` allocates for ``batch`` slots of ``max_context`` tokens."""
        return 8 * batch + sum(nbytes_of(shapes) for parts in self._state_shapes(batch, max_context).values()
                               for shapes in parts.values())

    def new_state(self, batch: int, max_context: int = DEFAULT_MAX_CONTEXT) -> DecodeState:
        """An empty decode state for ``batch`` sequences of up to ``max_context`` tokens each, every
        tensor a step touches allocated here once (``state.nbytes`` says how much). Raises ValueError
        when it does not fit the device's free memory."""
        for name, v in (("batch", batch), ("max_context", max_context)):
            if not (isinstance(v, int) and v >= 1):
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        check_fits(self.state_nbytes(batch, max_context), self.device, f"a state of batch {batch} and "
                   f"max_context {max_context}")
        state = DecodeState(batch, max_context, torch.zeros(batch, dtype=torch.long, device=self.device))
        for i, parts in self._state_shapes(batch, max_context).items():
            (shape, dtype), = parts["window"].values()
            st = LayerState(torch.zeros(shape, dtype=dtype, device=self.device))
            ratio = self.config.compress_ratios[i]
            if "compressor" in parts:
                st.compressor = CompressorState.allocate(parts["compressor"], ratio, self.device)
            if "indexer" in parts:
                st.indexer = CompressorState.allocate(parts["indexer"], ratio, self.device)
            state.layers[i] = st
        return state

    # -- public forward -------------------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, state: DecodeState | None = None) -> torch.Tensor:
        """Logits float32 [B, T, V] for ``input_ids`` [B, T] (int) continuing ``state`` (fresh if None): row b
        continues slot b from its own position."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, tokens], got shape {tuple(input_ids.shape)}")
        check_token_ids(input_ids, self.config.vocab_size)
        if input_ids.is_cuda:
            if self._id_check is None:
                self._id_check = _DeviceIdCheck(self.config.vocab_size, input_ids.device)
            self._id_check.raise_if_flagged()
            input_ids = self._id_check.clamp(input_ids)
        input_ids = input_ids.to(self.device)
        b, t = input_ids.shape
        if t == 0:
            raise ValueError("input_ids holds no tokens")
        if state is None:
            state = self.new_state(b, max_context=t)
        elif state.batch != b:
            raise ValueError(f"state is for batch {state.batch}, input_ids has batch {b}")
        if t == 1:
            return self._decode(input_ids[:, 0], state)[:, None]
        state.room(range(b), t)
        groups: dict[int, list[int]] = {}   # rows at one position run as one chunk
        for row, pos in enumerate(state.host_positions):
            groups.setdefault(pos, []).append(row)
        if len(groups) == 1:
            return self._chunk(input_ids, state, list(range(b)))
        out = torch.empty(b, t, self.config.vocab_size, device=self.device)
        for rows in groups.values():
            out[rows] = self._chunk(input_ids[rows], state, rows)
        return out

    __call__ = forward

    @torch.no_grad()
    def step(self, token_ids: torch.Tensor, state: DecodeState) -> torch.Tensor:
        """Decode one token per slot: ``token_ids`` [B] (or [B, 1]) -> logits [B, V]; every slot advances by
        one from its own position."""
        return self.forward(token_ids.reshape(-1, 1), state)[:, 0]

    @torch.no_grad()
    def prefill(self, prompts, state: DecodeState, slots, *, chunk: int | None = None,
                fresh: bool = True) -> torch.Tensor:
        """Feed prompts of any lengths into chosen slots of ``state``; the other slots are untouched.

        ``prompts``: a sequence of 1-D int tensors (or a [n, T] tensor); ``slots``: n distinct slot numbers.
        ``fresh``: each slot starts a new sequence (``state.reset(slot)`` first); False continues it.
        ``chunk``: feed each prompt ``chunk`` tokens at a time (same logits; default ``PREFILL_CHUNK``): what a
        call holds at once grows with the chunk, not with the prompt (docs/runtime.md). Returns float32 [n, V]:
        the logits after each prompt's last token (what picks its first generated token).
        """
        slots = [int(s) for s in slots]
        if len(prompts) != len(slots) or len(set(slots)) != len(slots):
            raise ValueError(f"need one distinct slot per prompt, got {len(prompts)} prompts and slots {slots}")
        for s in slots:
            state.check_slot(s)
        prompts = [torch.as_tensor(p).reshape(-1).to(self.device) for p in prompts]
        for s, p in zip(slots, prompts):
            if p.numel() == 0:
                raise ValueError(f"the prompt for slot {s} holds no tokens")
            state.room([] if fresh else [s], p.numel())
            if fresh and p.numel() > state.max_context:
                raise ValueError(f"a prompt of {p.numel()} tokens does not fit max_context={state.max_context}")
        size = chunk if chunk is not None else PREFILL_CHUNK
        if not (isinstance(size, int) and size >= 1):
            raise ValueError(f"chunk must be a positive int, got {chunk!r}")
        last = []
        for s, p in zip(slots, prompts):
            if fresh:
                state.reset(s)
            for a in range(0, p.numel(), size):
                logits = self._chunk(p[None, a:a + size], state, [s], last_only=True)
            last.append(logits[0, -1])
        return torch.stack(last)

    # -- the two paths: a chunk of rows at one position, a step of every slot at its own ----------------
    def _chunk(self, input_ids: torch.Tensor, state: DecodeState, rows: list[int], last_only: bool = False):
        """``input_ids`` [n, T] continuing slots ``rows`` of ``state``, which share one position (host-known):
        masked attention over (ring + chunk + entries, CSA's gathered per query). Logits [n, T, V] ([n, 1, V]:
        ``last_only``)."""
        cfg, w = self.config, self.weights
        n, t = input_ids.shape
        pos0 = state.host_positions[rows[0]]
        if any(state.host_positions[r] != pos0 for r in rows):
            raise ValueError(f"a chunk's slots must share one position, slots {rows} are at "
                             f"{[state.host_positions[r] for r in rows]}")
        state.room(rows, t)
        idx = torch.tensor(rows, device=self.device)
        positions = torch.arange(pos0, pos0 + t, device=self.device)
        streams = F.embedding(input_ids, w.embed).float().unsqueeze(2).expand(n, t, cfg.hc_mult, cfg.hidden_size)
        tables = PositionTables(self.backend, positions[None])
        for i in self.layer_indices:
            attend = ChunkAttention(self.backend, cfg, state.layers[i], idx, positions, pos0)
            streams = self._layer(w.layers[i], streams, input_ids, tables, attend)
        state.positions.index_fill_(0, idx, pos0 + t)
        state.advance(rows, t)
        return self._head(streams[:, -1:] if last_only else streams)

    def _decode(self, token_ids: torch.Tensor, state: DecodeState) -> torch.Tensor:
        """One token per slot, each at its own position: the host checks the bounds, then the step runs
        (replayed from the state's CUDA graph where :attr:`decode_graphs` is set)."""
        if token_ids.shape != (state.batch,):
            raise ValueError(f"token_ids must be [batch={state.batch}], got shape {tuple(token_ids.shape)}")
        state.room(range(state.batch), 1)
        graphs = self.decode_graphs
        if graphs is None:
            logits = self._decode_step(token_ids, state)
        else:  # a replay writes the graph's own output buffer: copy it out before the next step can
            logits = graphs.run(("step", state.serial), lambda ids: self._decode_step(ids, state), token_ids,
                                owner=state).clone()
        state.advance(range(state.batch), 1)
        return logits

    def _decode_step(self, token_ids: torch.Tensor, state: DecodeState) -> torch.Tensor:
        """The decode step on the device: every layer, the head and ``positions += 1``. Fixed shapes, no host
        read of a device value, state written in place: one CUDA graph captures it whole."""
        cfg, w = self.config, self.weights
        b = token_ids.shape[0]
        ids = token_ids[:, None]
        streams = F.embedding(ids, w.embed).float().unsqueeze(2).expand(b, 1, cfg.hc_mult, cfg.hidden_size)
        tables = StepTables(self.backend, state.positions)   # what every layer derives from the positions, made once
        for i in self.layer_indices:
            attend = StepAttention(self.backend, cfg, state.layers[i], tables)
            streams = self._layer(w.layers[i], streams, ids, tables, attend)
        logits = self._head(streams)[:, 0]
        state.positions.add_(1)
        return logits

    # -- blocks -----------------------------------------------------------------------------------
    def _hc_kw(self) -> dict:
        cfg = self.config
        return dict(iters=cfg.hc_sinkhorn_iters, hc_eps=cfg.hc_eps, norm_eps=cfg.rms_norm_eps)

    def _layer(self, lw: LayerWeights, streams, input_ids, tables: PositionTables, attend):
        """One decoder layer: mHC, norm, attention (``attend``: the chunk's or the step's core), mHC; then the FFN half."""
        be = self.backend
        # the sublayer's norm within hc_pre (its norm eps is the model's rms_norm_eps): one launch on the GPU
        x, post, comb = be.hc_pre(streams, lw.hc_attn.fn, lw.hc_attn.base, lw.hc_attn.scale,
                                  norm_weight=lw.attn_norm, **self._hc_kw())
        out = self._attention(lw, x, tables, attend)
        streams = be.hc_post(out, streams, post, comb)
        return self._ffn_half(lw, streams, input_ids)

    def _ffn_half(self, lw: LayerWeights, streams, input_ids):
        """mHC, norm, MoE, mHC (no decode state)."""
        be = self.backend
        x, post, comb = be.hc_pre(streams, lw.hc_ffn.fn, lw.hc_ffn.base, lw.hc_ffn.scale,
                                  norm_weight=lw.ffn_norm, **self._hc_kw())
        out = self._moe(lw, x, input_ids)
        return be.hc_post(out, streams, post, comb)

    def _head(self, streams):
        be, cfg, w = self.backend, self.config, self.weights
        h = be.hc_head(streams, w.hc_head.fn, w.hc_head.base, w.hc_head.scale,
                       hc_eps=cfg.hc_eps, norm_eps=cfg.rms_norm_eps)
        return be.linear(be.rms_norm(h, w.norm, cfg.rms_norm_eps), w.head)

    def _attention(self, lw: LayerWeights, h, tables: PositionTables, attend):
        """Projections, RoPE and output of the attention sublayer; ``tables`` the call's positions' RoPE tables;
        ``attend`` the core over the decode state (``runtime/attention.py``): ``attend.query_key`` norms and rotates
        the query and key (a step: in one backend op that writes the key to the ring), ``attend(...)`` attends."""
        be, cfg, a = self.backend, self.config, lw.attn
        b, t, _ = h.shape
        eps = cfg.rms_norm_eps
        freq = self._freq_compress if a.compress_ratio else self._freq_main
        turn = tables.turn(freq)                                # [B or 1, T, rd/2]
        q_low, kv = be.linears(h, (a.wq_a, a.wkv))              # one input: a backend may run them as one weight
        qr = be.rms_norm(q_low, a.q_norm, eps)                  # [B, T, q_lora]
        q = be.linear(qr, a.wq_b).view(b, t, cfg.num_heads, cfg.head_dim)
        q, kv = attend.query_key(a, q, kv, freq, turn)          # [B, T, H, D], [B, T, D] (a step: None, in the ring)
        out = attend(a, h, qr, q, kv, freq, turn).float()       # float32 already: the core's own output
        out = be.rotate_(out, tables.turn(freq, inverse=True)[:, :, None])
        out = be.grouped_linear(out.reshape(b, t, cfg.o_groups, -1), a.wo_a, cfg.o_groups)
        return be.linear(out.flatten(2), a.wo_b)

    def _moe(self, lw: LayerWeights, h, input_ids):
        be, cfg, m = self.backend, self.config, lw.moe
        b, t, d = h.shape
        x = h.reshape(-1, d)
        ids, weights = be.route(be.linear(x, m.gate), cfg.scoring_func, m.bias, m.tid2eid, input_ids.reshape(-1),
                                cfg.top_k, cfg.routed_scaling_factor)
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
    an sm_90 GPU, compiled here before returning, in worker processes while the weights are read; the PyTorch
    references elsewhere). ``Model.load_seconds`` says where the time went.
    ``world``: expert parallelism over torch.distributed (``"auto"``: the default process group when
    initialised; or a :class:`~nvfp4_megamoe.runtime.distributed.World`): this rank loads its
    contiguous expert range, the MoE combines across ranks (docs/distributed.md).

    Raises :class:`~nvfp4_megamoe.runtime.format.FormatError` for a folder that is not a
    converted checkpoint, or one written by a newer/unknown format version.
    """
    t0 = time.perf_counter()
    ckpt = Checkpoint(path, verify_hashes=verify_hashes)
    config = ModelConfig.from_file(ckpt.path)
    world = resolve_world(world)
    if world is not None:
        if experts is not None:
            raise ValueError("pass experts= or world=, not both (world= picks this rank's expert range)")
        experts = world.expert_range(config.n_routed_experts)
    warm = backend is None and hopper_available(device)
    if backend is None and not warm:
        _warn_without_kernels(device)
    seconds: dict[str, float] = {}
    if warm:
        backend = HopperBackend()
        backend.start_workers()   # compiling processes, importing while the checkpoint is read (unused if all cached)

    def start_compiles(weights: ModelWeights) -> None:
        # the kernels compile (worker processes) from the weights' shapes while their bytes are still being copied
        seconds["read"] = time.perf_counter() - t0
        backend.start_warmup(config, weights, device)
        seconds["start compiles"] = time.perf_counter() - t0 - seconds["read"]

    try:
        weights = WeightLoader(ckpt, config, device).model(layers, experts, start_compiles if warm else None)
    except BaseException:
        if warm:
            backend.cancel_warmup()   # no kernels for a model that did not load
        raise
    seconds["weights"] = time.perf_counter() - t0 - sum(seconds.values())
    inner = backend
    if world is not None:
        backend = ExpertParallelBackend(backend if backend is not None else ReferenceBackend(), world)
    model = Model(config, weights, backend=backend, device=device, checkpoint=ckpt)
    model.world = world
    if warm:
        if world is None:  # collectives inside a captured block are not set up for graphs here
            model.decode_graphs = DecodeGraphs()
        inner.warmup(model)
        seconds.update({f"{k} (warm-up)": v for k, v in inner.warmup_phases.items()})
    seconds["total"] = time.perf_counter() - t0
    model.load_seconds = seconds
    return model
