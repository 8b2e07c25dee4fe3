"""The runtime on an H200 with the Hopper backend (CuTeDSL kernels) against the reference path.

Marked ``gpu``: CI (CPU only) skips it; run through the device machine. The reference path is the
same model with :class:`ReferenceBackend` on the GPU (fp32 activations); the kernels take BF16
activations (W4A16), so agreement is to BF16 rounding, not to float32.
"""

from __future__ import annotations

import functools
import gc

import pytest
import torch

from nvfp4_megamoe.runtime import HopperBackend, ReferenceBackend, load_model
from nvfp4_megamoe.kernels.moe_reference import random_moe_weights
from nvfp4_megamoe.runtime.weights import Nvfp4Linear

from numeric import rel_err
from weight_trees import weight_tensors

pytestmark = pytest.mark.gpu  # tests/conftest.py skips it without an sm_90 GPU


@pytest.fixture(scope="module")
def converted(synth_checkpoints):
    def get(variant: str, dense: str = "keep", target: str = "sm100"):
        return synth_checkpoints.converted(variant, dense=dense, target=target).output

    return get


@pytest.mark.parametrize("variant,target", [("flash", "sm100"), ("modelopt", "sm100"), ("flash", "sm90")])
def test_moe_kernel_matches_reference_on_loaded_layers(converted, variant, target):
    """One routed-MoE call per layer: kernel vs reference on the same packed weights (per-half alpha); sm90: the
    kernels read the row tiles, the reference the same weights un-tiled."""
    model = load_model(converted(variant, target=target), device="cuda")
    assert isinstance(model.backend, HopperBackend) and model.backend.warmup_seconds is not None
    assert set(model.load_seconds) == {"read", "start compiles", "weights", "kernels (warm-up)", "forwards (warm-up)",
                                       "total"}
    ref = ReferenceBackend()
    gen = torch.Generator(device="cuda").manual_seed(0)
    for lw in model.weights.layers.values():
        m = lw.moe
        x = torch.randn(37, model.config.hidden_size, device="cuda", generator=gen)
        ids = torch.stack([torch.randperm(m.n_experts, device="cuda", generator=gen)[:model.config.top_k]
                           for _ in range(37)])
        wts = torch.rand(37, model.config.top_k, device="cuda", generator=gen)
        before = model.backend.kernel_calls["moe"]
        got = model.backend.moe(x, ids, wts, m, model.config.swiglu_limit)
        assert model.backend.kernel_calls["moe"] == before + 1  # the kernel ran, not the fallback
        want = ref.moe(x.to(torch.bfloat16).float(), ids, wts, m, model.config.swiglu_limit)
        assert rel_err(got, want) < 1e-2


def test_weights_uploaded_by_byte_range_are_the_bytes_read(converted, monkeypatch, tmp_path):
    """A GPU load reads its large tensors by byte range into pinned buffers and copies them asynchronously
    (``runtime/gpu_upload.py``): with every tensor taken that way, in 4 KiB chunks (most tensors end inside a chunk),
    each one equals the CPU read, bit for bit; a poisoned tensor is overwritten in full; a shard that shrank is an
    error that names it."""
    from nvfp4_megamoe.runtime import gpu_upload, weights as weights_module
    from nvfp4_megamoe.runtime.checkpoint import Checkpoint
    from nvfp4_megamoe.runtime.config import ModelConfig

    monkeypatch.setattr(weights_module, "UPLOAD_MIN_BYTES", 1)
    monkeypatch.setattr(gpu_upload, "CHUNK_BYTES", 4096)
    path = converted("flash", target="sm90")
    ckpt = Checkpoint(path)
    config = ModelConfig.from_file(path)
    on_gpu = dict(weight_tensors(weights_module.WeightLoader(ckpt, config, "cuda").model(None, (1, 4))))
    on_cpu = dict(weight_tensors(weights_module.WeightLoader(ckpt, config).model(None, (1, 4))))
    assert on_gpu.keys() == on_cpu.keys()
    for name, t in on_gpu.items():
        assert t.is_cuda and t.dtype == on_cpu[name].dtype and torch.equal(t.cpu().view(torch.uint8).reshape(-1),
                                                                          on_cpu[name].view(torch.uint8).reshape(-1)), name
    name = "layers.0.ffn.experts.w13.weight"
    where = ckpt.byte_range(name, (1, 3))
    out = torch.full(where.shape, 0xA5, dtype=where.dtype, device="cuda")
    with gpu_upload.GpuUploader(torch.device("cuda")) as up:
        up.upload_into(out, where.path, where.offset)
    assert torch.equal(out.cpu(), ckpt.read(name, (1, 3)))
    short = tmp_path / "short.safetensors"
    short.write_bytes(where.path.read_bytes()[: where.offset + 5000])
    with pytest.raises(OSError, match="short.safetensors: the file ended"):
        with gpu_upload.GpuUploader(torch.device("cuda")) as up:
            up.upload_into(torch.empty(where.shape, dtype=where.dtype, device="cuda"), short, where.offset)


def _same_experts(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.sort(-1).values, b.sort(-1).values)


def _route_to(route_topk, ids: torch.Tensor, scores, bias, k, scaling):
    """``route_topk`` made to pick the experts ``ids``, their weights from ``scores`` as its own choice would have."""
    forced = torch.zeros_like(scores).scatter_(-1, ids, 1e9) + (0 if bias is None else bias.float())
    got, weights = route_topk(scores, forced, k, scaling)
    assert _same_experts(got, ids)
    return got, weights


def _topk_route_to(backend, ids: torch.Tensor, logits, func, bias, k, scaling):
    """``Backend.route`` of a top-k layer made to pick the experts ``ids``: the weights from this run's scores."""
    return _route_to(backend.route_topk, ids, backend.route_scores(logits, func), bias, k, scaling)


class SharedRouting:
    """The reference model takes the kernel model's routed-expert choices (``route`` of the top-k layers, call by
    call: run the kernel model first), so that a router near-tie which BF16 rounding flips does not become a
    different expert, which on a random synthetic model is a different token's logits. Counts the
    choices where the reference alone would have picked other experts. Hash layers choose by token id: as they are."""

    def __init__(self, fast, slow):
        self.pending, self.flips, self.calls = [], 0, 0
        fast_inner, slow_inner = fast.backend.route, slow.backend.route

        def fast_route(logits, func, bias, tid2eid, token_ids, k, scaling):
            ids, weights = fast_inner(logits, func, bias, tid2eid, token_ids, k, scaling)
            if tid2eid is None:
                self.pending.append(ids)
            return ids, weights

        def slow_route(logits, func, bias, tid2eid, token_ids, k, scaling):
            if tid2eid is not None:
                return slow_inner(logits, func, bias, tid2eid, token_ids, k, scaling)
            ids = self.pending.pop(0)
            own, _ = slow_inner(logits, func, bias, None, token_ids, k, scaling)
            self.calls += 1
            self.flips += int(not _same_experts(own, ids))
            return _topk_route_to(slow.backend, ids, logits, func, bias, k, scaling)

        fast.backend.route, slow.backend.route = fast_route, slow_route


@pytest.mark.parametrize("variant,dense,target", [("flash", "keep", "sm100"), ("modelopt", "keep", "sm100"),
                                                  ("flash", "nvfp4", "sm100"), ("flash", "keep", "sm90")])
def test_logits_with_kernels_match_reference_path(converted, variant, dense, target):
    """Prefill and decode logits with the kernels (BF16 activations and decode state) vs the fp32
    reference path (float32 state), both with the kernel path's routed experts (:class:`SharedRouting`:
    with its own, the reference picks other experts in 2-4 of this test's 72 router calls, and a random
    synthetic model turns one such near-tie into a 0.1-0.6 relative difference of the logits).

    16 tokens: fewer compressed entries than the indexer's top-k, so the indexer picks every entry and
    the difference is BF16 rounding. Over long sequences the indexer's top-k flips too and compounds
    (printed for the record).
    """
    out = converted(variant, dense, target)
    fast = load_model(out, device="cuda")
    fast.decode_graphs = None  # replays run no Python: SharedRouting must see every router call
    slow = load_model(out, device="cuda", backend=ReferenceBackend())
    routing = SharedRouting(fast, slow)
    ids = torch.randint(0, fast.config.vocab_size, (1, 160), generator=torch.Generator().manual_seed(3)).cuda()
    print(f"{variant}: 160-token logits rel err kernels vs reference {rel_err(fast(ids), slow(ids)):.3e}")
    short = ids[:, :16]
    assert rel_err(fast(short), slow(short)) < 1e-2
    sf, ss = fast.new_state(1), slow.new_state(1)
    before = routing.flips
    errs = [rel_err(fast.step(short[:, t], sf), slow.step(short[:, t], ss)) for t in range(16)]
    print(f"{variant}: 16 decode steps worst rel err {max(errs):.3e}; the reference's own routing would "
          f"differ in {routing.flips - before} of these steps' router calls, {routing.flips} of {routing.calls} in all")
    assert routing.calls > 0 and not routing.pending
    assert max(errs) < 1e-2


def _ids(model, seed: int, *shape: int) -> torch.Tensor:
    return torch.randint(0, model.config.vocab_size, shape, generator=torch.Generator().manual_seed(seed)).cuda()


@pytest.mark.parametrize("variant", ["flash", "modelopt"])
def test_decode_steps_from_cuda_graphs_match_eager_steps(converted, variant):
    """load_model on the kernels path replays each decode step, all layers and the head, from one CUDA graph per
    state (captured at its first step). On a ragged state (slots prefilled to 11, 126 and 3 tokens; slot 1 closes
    an HCA window, CSA entries are emitted every 4 tokens, slot 2 is refilled mid-way) the logits equal those of
    the same steps run eagerly (up to the order of the MoE's atomic sums), and no state tensor moves."""
    model = load_model(converted(variant, "nvfp4"), device="cuda")
    graphs = model.decode_graphs
    assert graphs is not None
    b, lengths, steps = 3, (11, 126, 3), 9
    prompts = [_ids(model, 5 + i, n) for i, n in enumerate(lengths)]
    toks, refill = _ids(model, 9, b, steps), _ids(model, 10, 17)
    s_graph, s_eager = model.new_state(b, 256), model.new_state(b, 256)
    for st in (s_graph, s_eager):
        model.prefill(prompts, st, [0, 1, 2])
    addresses = [t.data_ptr() for t in s_graph.tensors()]
    before = graphs.replays
    errs = []
    for i in range(steps):
        if i == 4:
            for st in (s_graph, s_eager):
                model.prefill([refill], st, [2])
        got = model.step(toks[:, i], s_graph)
        model.decode_graphs = None
        want = model.step(toks[:, i], s_eager)
        model.decode_graphs = graphs
        assert torch.isfinite(got).all()
        errs.append(rel_err(got, want))
    assert graphs.replays - before == steps - 1  # the first step captured, the others replayed
    assert [t.data_ptr() for t in s_graph.tensors()] == addresses
    assert s_graph.host_positions == (11 + steps, 126 + steps, 17 + steps - 4)
    assert s_graph.positions.tolist() == list(s_graph.host_positions)
    assert max(errs) < 1e-4, errs
    del s_graph
    gc.collect()
    assert len(graphs) == 0  # a state's graph goes with it


def test_decode_steps_do_not_wait_for_the_gpu(converted):
    """No op of a decode step reads a device value back (each such read stalls the host until the GPU has
    caught up): CUDA's sync check raises on any, over graph-replayed steps and eager steps that emit compressed
    entries, on a ragged state."""
    model = load_model(converted("flash", "nvfp4"), device="cuda")
    graphs = model.decode_graphs
    ids = _ids(model, 6, 2, 20)
    for mode in ("graphs", "eager"):
        model.decode_graphs = graphs if mode == "graphs" else None
        state = model.new_state(2, 64)
        model.prefill([ids[0, :9], ids[1, :2]], state, [0, 1])
        model.step(ids[:, 9], state)  # captures this state's graph (allocations, no reads)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for i in range(10, 20):
                logits = model.step(ids[:, i], state)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert torch.isfinite(logits).all(), mode


class RowDecisions:
    """The discrete choices of a batched run (routed experts, the indexer's picks in prefill and decode) recorded,
    then given row by row to runs of one sequence, so that a near-tie which rounding flips does not become another
    expert or entry (on a random synthetic model, another token's logits). The kernels' tilings and the MoE's
    atomic sums differ between a batch of 8 and one, so without this the comparison measures the model's chaos,
    not the ragged state. Counts the choices a run of one would have made otherwise (``flips``, printed).

    Recording: set ``tag`` (the calls go under it). Forcing: ``force(entries)`` with (tag, row) pairs, the row
    taken from a decode step's [B, ...] choices (None: the whole choice, as in a prompt's own prefill)."""

    NAMES = ("route", "indexer_topk", "chunk_topk")

    def __init__(self, model):
        self.backend, self.log, self.tag, self.queue = model.backend, {}, None, None
        self.inner = {name: getattr(model.backend, name) for name in self.NAMES}
        self.calls = self.flips = 0
        for name in self.NAMES:
            setattr(model.backend, name, functools.partial(self._call, name))

    def force(self, entries) -> None:
        self.queue = [(name, out, row) for tag, row in entries for name, out in self.log[tag]]

    def _call(self, name, *args):
        own = self.inner[name](*args)
        if name == "route" and args[3] is not None:   # a hash layer: chosen by token id, not a decision
            return own
        if self.queue is None:
            if self.tag is not None:
                self.log.setdefault(self.tag, []).append((name, own))
            return own
        want_name, out, row = self.queue.pop(0)
        assert want_name == name, (want_name, name)
        self.calls += 1
        if name == "route":
            ids = (out[0] if row is None else out[0][row:row + 1]).long()
            self.flips += int(not _same_experts(own[0], ids))
            logits, func, bias, _, _, k, scaling = args
            return _topk_route_to(self.backend, ids, logits, func, bias, k, scaling)
        want = out if row is None else out[row:row + 1]
        self.flips += int(not torch.equal(own, want))
        return want


def test_ragged_batch_decodes_each_prompt_as_alone(converted):
    """8 prompts of 17 to 4,000 tokens prefill the slots of one state, then decode 64 tokens together (each slot at
    its own position); every sequence's logits (after its prompt and after each step) equal those of the same
    sequence in a state of its own, within the BF16 tolerance of these tests, given the batch's discrete choices
    (:class:`RowDecisions`). The batch runs twice: from the state's CUDA graph, as a user runs it, and eagerly,
    recording its choices; the two agree (up to the MoE's atomic sums)."""
    model = load_model(converted("flash", "nvfp4"), device="cuda")
    graphs = model.decode_graphs
    lengths, steps, ctx = (17, 100, 255, 512, 1000, 2049, 3001, 4000), 64, 4096
    prompts = [_ids(model, 20 + i, n) for i, n in enumerate(lengths)]
    toks = _ids(model, 30, len(lengths), steps)
    state = model.new_state(len(lengths), ctx)
    addresses = [t.data_ptr() for t in state.tensors()]
    model.prefill(prompts, state, range(len(lengths)), chunk=512)
    replays = graphs.replays
    from_graph = torch.stack([model.step(toks[:, i], state) for i in range(steps)], dim=1)    # [8, steps, V]
    assert graphs.replays - replays == steps - 1
    assert [t.data_ptr() for t in state.tensors()] == addresses
    assert state.host_positions == tuple(n + steps for n in lengths)
    del state
    gc.collect()

    model.decode_graphs = None   # eager: the choices pass through Python, where they are recorded
    decisions = RowDecisions(model)
    state = model.new_state(len(lengths), ctx)
    first = []
    for s, p in enumerate(prompts):   # one prompt a call, as prefill runs them, to record each one's choices
        decisions.tag = ("prefill", s)
        first.append(model.prefill([p], state, [s], chunk=512)[0])
    got = []
    for i in range(steps):
        decisions.tag = ("step", i)
        got.append(model.step(toks[:, i], state))
    got = torch.stack(got, dim=1)
    decisions.tag = None
    graph_errs = [rel_err(from_graph[:, i], got[:, i]) for i in range(steps)]
    print(f"ragged batch from its graph vs eager: worst rel err {max(graph_errs):.1e}")
    assert max(graph_errs[:8]) < 1e-4, graph_errs

    worst = []
    for s, p in enumerate(prompts):
        decisions.force([(("prefill", s), None)] + [(("step", i), s) for i in range(steps)])
        alone = model.new_state(1, ctx)
        want_first = model.prefill([p], alone, [0], chunk=512)[0]
        want = torch.stack([model.step(toks[s, i:i + 1], alone)[0] for i in range(steps)])
        assert not decisions.queue
        errs = [rel_err(first[s], want_first)] + [rel_err(got[s, i], want[i]) for i in range(steps)]
        worst.append(max(errs))
    print("ragged batch vs alone, worst rel err per sequence:", [f"{e:.1e}" for e in worst],
          f"with the batch's choices; alone, {decisions.flips} of {decisions.calls} would differ")
    assert decisions.calls > 0
    assert max(worst) < 1e-2, worst


def test_a_state_that_does_not_fit_the_gpu_is_refused(converted):
    model = load_model(converted("flash", "nvfp4"), device="cuda")
    free, _ = torch.cuda.mem_get_info()
    with pytest.raises(ValueError, match="needs .* GiB and cuda.* GiB free"):
        model.new_state(1 << 14, 1 << 22)
    state = model.new_state(2, 1024)
    assert state.nbytes == model.state_nbytes(2, 1024) and all(t.is_cuda for t in state.tensors())
    assert state.nbytes < free


def test_an_out_of_range_id_on_the_gpu_is_refused_at_the_next_call(converted):
    """Ids already on the GPU are not read back in a step (no sync): an out-of-range one is clamped, flagged on the
    GPU, and the first call after the flag reached the host raises InputError; then the model goes on."""
    from nvfp4_megamoe.errors import InputError
    model = load_model(converted("flash", "nvfp4"), device="cuda")
    state = model.new_state(2)
    model(torch.randint(0, model.config.vocab_size, (2, 5)).cuda(), state)
    bad = torch.tensor([1, model.config.vocab_size + 3], device="cuda")
    logits = model.step(bad, state)  # no device-side assert: the id was clamped
    torch.cuda.synchronize()
    assert torch.isfinite(logits).all()
    with pytest.raises(InputError, match="outside"):
        model.step(torch.tensor([1, 2], device="cuda"), state)
    assert torch.isfinite(model.step(torch.tensor([1, 2], device="cuda"), state)).all()
    with pytest.raises(InputError, match="vocab_size"):  # ids from the CPU: refused before the call
        model.step(torch.tensor([1, -1]), state)


def _nvfp4_linear(n: int, k: int, seed: int) -> Nvfp4Linear:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    w = random_moe_weights(1, k, n // 2, generator=gen, device="cuda")
    return Nvfp4Linear(w["w13"][0], w["w13_scale"][0], w["w13_alpha"][0, 0].reshape(()))


@pytest.mark.parametrize("n,k,kernel", [(512, 256, True), (192, 384, True), (96, 256, False)])
def test_dense_linear_kernel_matches_reference(n, k, kernel):
    """Any leading shape; N % 64 or K % 128 outside the kernel's tiling falls back to the reference."""
    be, w = HopperBackend(), _nvfp4_linear(n, k, n + k)
    for lead in ((1,), (2, 5), (3, 70)):
        x = torch.randn(*lead, k, device="cuda", generator=torch.Generator(device="cuda").manual_seed(len(lead)))
        before = be.kernel_calls["linear"]
        got = be.linear(x, w)
        assert be.kernel_calls["linear"] == before + kernel
        assert got.shape == (*lead, n) and got.dtype == torch.float32
        assert rel_err(got, ReferenceBackend().linear(x.to(torch.bfloat16).float(), w)) < 1e-2


@pytest.mark.parametrize("groups,rows,kernel", [(4, 128, True), (2, 256, True), (4, 64, False)])
def test_grouped_linear_kernel_matches_reference(groups, rows, kernel):
    """``wo_a``: each group's weight rows and the matching slice of the swizzled scales (128-row groups)."""
    be, w, k = HopperBackend(), _nvfp4_linear(groups * rows, 256, groups), 256
    x = torch.randn(2, 9, groups, k, device="cuda", generator=torch.Generator(device="cuda").manual_seed(7))
    got = be.grouped_linear(x, w, groups)
    assert be.kernel_calls["linear"] == int(kernel)
    assert got.shape == (2, 9, groups, rows)
    assert rel_err(got, ReferenceBackend().grouped_linear(x.to(torch.bfloat16).float(), w, groups)) < 1e-2


def test_expert_range_on_gpu_is_a_partial_sum(converted):
    out = converted("flash")
    full = load_model(out, device="cuda")
    n = full.weights.layers[0].moe.n_experts
    halves = [load_model(out, device="cuda", experts=r) for r in ((0, n // 2), (n // 2, n))]
    lw = [h.weights.layers[1].moe for h in halves]
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(9, full.config.hidden_size, device="cuda", generator=gen)
    ids = torch.stack([torch.randperm(n, device="cuda", generator=gen)[:full.config.top_k] for _ in range(9)])
    wts = torch.rand(9, full.config.top_k, device="cuda", generator=gen)
    limit = full.config.swiglu_limit
    parts = sum(h.backend.moe(x, ids, wts, m, limit) for h, m in zip(halves, lw))
    whole = full.backend.moe(x, ids, wts, full.weights.layers[1].moe, limit)
    assert rel_err(parts, whole) < 1e-5


def test_rms_norm_on_the_gpu_matches_the_reference():
    """The kernels path's RMSNorm (``F.rms_norm``, the weight's float32 copy made once) against the reference's
    formula, with and without a weight, on random data."""
    be, ref = HopperBackend(), ReferenceBackend()
    gen = torch.Generator(device="cuda").manual_seed(4)
    x = torch.randn(5, 4, 4096, device="cuda", generator=gen) * 3
    w = torch.randn(4096, device="cuda", generator=gen).bfloat16()
    for weight in (w, None):
        got = be.rms_norm(x, weight, 1e-6)
        assert got.dtype == torch.float32 and torch.isfinite(got).all()
        assert rel_err(got, ref.rms_norm(x, weight, 1e-6)) < 1e-6
    assert be._f32(w) is be._f32(w) and be._f32(w).dtype == torch.float32


def test_bf16_dense_linears_on_the_gpu_match_the_reference():
    """BF16 dense weights: a small one (compressor-sized) against its float32 copy made once, to float32 rounding;
    one past ``F32_COPY_MAX_BYTES`` (head-sized) in BF16 with float32 out, to BF16 rounding of x; random data."""
    from nvfp4_megamoe.runtime.hopper import F32_COPY_MAX_BYTES
    from nvfp4_megamoe.runtime.weights import DenseLinear

    be, ref = HopperBackend(), ReferenceBackend()
    gen = torch.Generator(device="cuda").manual_seed(6)
    x = torch.randn(3, 2, 4096, device="cuda", generator=gen)
    small = DenseLinear(torch.randn(1024, 4096, device="cuda", generator=gen).bfloat16())
    large = DenseLinear(torch.randn(F32_COPY_MAX_BYTES // (4 * 4096) + 64, 4096, device="cuda", generator=gen).bfloat16())
    for w, tol in ((small, 1e-6), (large, 1e-2)):
        got = be.linear(x, w)
        assert got.dtype == torch.float32 and got.shape == (3, 2, w.weight.shape[0]) and torch.isfinite(got).all()
        assert rel_err(got, ref.linear(x, w)) < tol
    assert be._f32(small.weight) is be._f32(small.weight) and id(large.weight) not in be._f32_weights


def test_linears_of_one_input_fused_match_each_alone(converted):
    """The groups ``fuse_same_input`` makes one weight of (FP8 ``wq_a`` + ``wkv`` and shared ``w1`` + ``w3``, the
    compressors' BF16 projections) give each member's output as its own linear does, on random input; each FP8
    member's tensors become views of the fused weight."""
    from nvfp4_megamoe.runtime.weights import Fp8Linear, same_input_linears

    model = load_model(converted("flash"), device="cuda")   # warm-up fused the groups
    be = model.backend
    gen = torch.Generator(device="cuda").manual_seed(8)
    x = torch.randn(5, model.config.hidden_size, device="cuda", generator=gen)
    kinds = set()
    for lw in model.weights.layers.values():
        for group in same_input_linears(lw):
            hit = be._fused.get(tuple(id(w) for w in group))
            if hit is None:
                continue
            kinds.add(type(group[0]).__name__)
            outs = be.linears(x, group)
            for w, got in zip(group, outs):
                want = be.linear(x, w)
                assert got.shape == want.shape and torch.isfinite(got).all()
                assert rel_err(got, want) < 1e-5   # another N: another K split or GEMM algorithm
                if isinstance(w, Fp8Linear):
                    assert w.weight.untyped_storage().data_ptr() == hit[1].weight.untyped_storage().data_ptr()
    assert kinds == {"Fp8Linear", "DenseLinear"}


def test_prefill_linears_on_the_w8a8_gemm_track_the_reference(converted, monkeypatch):
    """The FP8 dense linears of a prefill on the W8A8 GEMM (activations quantised per 128 K, as the official
    inference does; here for every call of 2 tokens or more, where the runtime gives it prefill chunks of 1,024) against
    the float32 reference path, with the kernel path's routed experts: the logits move by the activations' E4M3
    rounding, a few per cent at most, and the GEMM ran."""
    from nvfp4_megamoe.kernels import sm90_fp8_gemm, sm90_fp8_linear

    out = converted("flash", "keep", "sm90")
    fast = load_model(out, device="cuda")
    fast.decode_graphs = None
    slow = load_model(out, device="cuda", backend=ReferenceBackend())
    SharedRouting(fast, slow)
    ids = _ids(fast, 4, 1, 64)
    bf16 = rel_err(fast(ids), slow(ids))
    calls = []
    inner = sm90_fp8_gemm.sm90_fp8_gemm
    monkeypatch.setattr(sm90_fp8_linear, "fp8_w8a8_pays", lambda tokens: tokens >= 2)
    monkeypatch.setattr(sm90_fp8_gemm, "sm90_fp8_gemm", lambda *a, **kw: calls.append(1) or inner(*a, **kw))
    w8a8 = rel_err(fast(ids), slow(ids))
    print(f"64-token prefill logits vs the reference: W8A16 linears {bf16:.2e}, W8A8 linears {w8a8:.2e} "
          f"({len(calls)} W8A8 calls)")
    assert calls and w8a8 < 5e-2
