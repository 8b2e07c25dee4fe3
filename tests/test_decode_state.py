"""The fixed-size decode state and ragged batches on the CPU reference path (``runtime/state.py``,
``Model.prefill`` / ``Model.step``): every sequence of a batch at its own position gives the logits it
gives alone; the state is allocated once and never moves; bounds are refused clearly; a step reads no
device value on the host (what a CUDA graph of the step needs; the GPU side is ``tests/test_runtime_gpu.py``).
"""

from __future__ import annotations


import pytest
import torch

from nvfp4_megamoe.runtime import load_model
from nvfp4_megamoe.runtime import model as model_module

from numeric import rel_err

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

# tiny flash: window 32, layers SWA (hash-routed), SWA, CSA (ratio 4, top-k 8), HCA (ratio 128), CSA
PROMPTS = (150, 37, 131)      # past the ring's wrap, many CSA windows, an HCA entry closed in the prompt
STEPS = 12                    # slot 1 crosses position 40 (a CSA window), slot 0 HCA-free, slot 2 past 128 + 4
REFILL, MORE = 61, 9          # slot 1 takes a new prompt while 0 and 2 go on


@pytest.fixture(scope="module")
def model(synth_checkpoints):
    return load_model(synth_checkpoints.converted("flash", dense="keep").output)


def tokens(model, seed: int, n: int) -> torch.Tensor:
    return torch.randint(0, model.config.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


def alone(model, prompt: torch.Tensor, steps: torch.Tensor, max_context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence in a state of its own: the logits after its prompt, then after each step's token."""
    state = model.new_state(1, max_context)
    first = model(prompt[None], state)[0, -1]
    return first, torch.stack([model.step(t.view(1), state)[0] for t in steps])


def test_ragged_batch_decodes_each_sequence_as_alone_and_refills_a_slot(model):
    """Three prompts of different lengths prefill chosen slots (one in chunks), decode together, each at its
    own position; then slot 1 takes a new prompt while slots 0 and 2 go on. Every logit equals the same
    sequence run alone (a batch-of-one state, prefilled by the plain forward) to float32 rounding."""
    ctx = 200
    prompts = [tokens(model, 10 + i, n) for i, n in enumerate(PROMPTS)]
    steps = torch.stack([tokens(model, 20 + i, STEPS + MORE) for i in range(3)])   # [3, STEPS + MORE]
    refill = tokens(model, 30, REFILL)

    state = model.new_state(3, ctx)
    firsts = model.prefill([prompts[2], prompts[0]], state, [2, 0], chunk=50)
    firsts = torch.stack([firsts[1], model.prefill([prompts[1]], state, [1])[0], firsts[0]])
    assert state.host_positions == PROMPTS
    got = [model.step(steps[:, i], state) for i in range(STEPS)]
    refill_first = model.prefill([refill], state, [1])[0]
    assert state.host_positions == (PROMPTS[0] + STEPS, REFILL, PROMPTS[2] + STEPS)
    got += [model.step(steps[:, i], state) for i in range(STEPS, STEPS + MORE)]
    got = torch.stack(got, dim=1)                                                  # [3, STEPS + MORE, V]
    assert state.positions.tolist() == list(state.host_positions)

    errs = []
    for s in range(3):
        first, want = alone(model, prompts[s], steps[s, :STEPS] if s == 1 else steps[s], ctx)
        errs += [rel_err(firsts[s], first), rel_err(got[s, :want.shape[0]], want)]
    first, want = alone(model, refill, steps[1, STEPS:], ctx)
    errs += [rel_err(refill_first, first), rel_err(got[1, STEPS:], want)]
    print("ragged vs alone, rel err per (prefill, steps):", [f"{e:.1e}" for e in errs])
    assert max(errs) < 2e-6, errs


def test_a_chunk_over_slots_at_different_positions_runs_each_from_its_own(model):
    """``model(ids, state)`` with T > 1 on a ragged state continues every row from its own position."""
    a, b = tokens(model, 40, 45), tokens(model, 41, 9)
    more = torch.stack([tokens(model, 42, 7), tokens(model, 43, 7)])
    state = model.new_state(2, 64)
    model.prefill([a, b], state, [0, 1])
    got = model(more, state)
    for s, p in enumerate((a, b)):
        want = model(torch.cat((p, more[s]))[None])[0, -7:]
        assert rel_err(got[s], want) < 2e-6


def test_the_state_is_allocated_once_and_never_moves(model):
    """Every tensor a step touches exists from new_state on, with the size stated up front; prefill, steps,
    a reset and a refill write in place (a CUDA graph of the step keeps reading the same addresses)."""
    cfg = model.config
    state = model.new_state(2, 300)
    assert state.nbytes == model.state_nbytes(2, 300) > 0
    for i, st in state.layers.items():
        ratio = cfg.compress_ratios[i]
        assert st.window.shape == (2, cfg.sliding_window, cfg.head_dim)
        if ratio:
            assert st.compressor.store.shape == (2, 300 // ratio + 1, cfg.head_dim)
            assert st.compressor.pending_kv.shape[1] == ratio
        assert (st.indexer is not None) == (ratio == 4)
    before = [(t.data_ptr(), t.shape, t.dtype) for t in state.tensors()]
    model.prefill([tokens(model, 1, 140), tokens(model, 2, 9)], state, [0, 1], chunk=64)
    for i in range(6):
        model.step(tokens(model, 3 + i, 2), state)
    state.reset(1)
    model.prefill([tokens(model, 9, 5)], state, [1])
    model.step(tokens(model, 10, 2), state)
    assert [(t.data_ptr(), t.shape, t.dtype) for t in state.tensors()] == before
    assert state.host_positions == (147, 6)


def test_positions_past_max_context_are_refused_before_anything_runs(model):
    state = model.new_state(2, 40)
    model.prefill([tokens(model, 1, 39), tokens(model, 2, 12)], state, [0, 1])
    model.step(tokens(model, 3, 2), state)                      # slot 0 now holds 40 = max_context
    snapshot = [t.clone() for t in state.tensors()]
    with pytest.raises(ValueError, match=r"slots \[0\] hold \[40\] tokens.*max_context=40"):
        model.step(tokens(model, 4, 2), state)
    with pytest.raises(ValueError, match="max_context=40"):
        model.prefill([tokens(model, 5, 29)], state, [1], fresh=False)   # 13 + 29 > 40
    with pytest.raises(ValueError, match="does not fit max_context=40"):
        model.prefill([tokens(model, 5, 41)], state, [1])
    with pytest.raises(ValueError, match="max_context=40"):
        model(tokens(model, 6, 30).view(1, -1).expand(2, -1), state)
    assert all(torch.equal(a, b) for a, b in zip(snapshot, state.tensors()))   # nothing written
    assert state.host_positions == (40, 13)
    state.reset(0)                                              # a finished slot makes room
    model.step(tokens(model, 7, 2), state)
    assert state.host_positions == (1, 14)


def test_bad_state_requests_are_clear_errors(model):
    with pytest.raises(ValueError, match="needs .* GiB .*smaller batch or max_context"):
        model.new_state(1 << 20, 1 << 24)
    with pytest.raises(ValueError, match="max_context must be a positive int"):
        model.new_state(1, 0)
    state = model.new_state(2, 16)
    with pytest.raises(ValueError, match=r"slot must be an int in \[0, 2\)"):
        state.reset(2)
    with pytest.raises(ValueError, match="one distinct slot per prompt"):
        model.prefill([tokens(model, 1, 3), tokens(model, 2, 3)], state, [1, 1])
    with pytest.raises(ValueError, match="state is for batch 2, input_ids has batch 3"):
        model.step(tokens(model, 1, 3), state)
    model.prefill([tokens(model, 1, 3)], state, [0])
    with pytest.raises(ValueError, match="different positions"):
        state.position  # noqa: B018 - the property raises


class HostReadGuard:
    """While ``on``, every Python-level way of reading a tensor's value on the host raises: what CUDA's sync
    check catches on the GPU, and what a graph replay would silently freeze (a branch or a shape taken from one
    step's values)."""

    NAMES = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "numpy")

    def __init__(self, monkeypatch):
        self.on = False
        for name in self.NAMES:
            monkeypatch.setattr(torch.Tensor, name, self._guarded(getattr(torch.Tensor, name)))
        monkeypatch.setattr(torch, "nonzero", self._guarded(torch.nonzero))

    def _guarded(self, fn):
        def call(*args, **kwargs):
            if self.on:
                raise AssertionError(f"a decode step read a tensor value on the host ({fn.__name__})")
            return fn(*args, **kwargs)
        return call

    def exempt(self, fn):
        """``fn`` with the guard off while it runs."""
        def call(*args, **kwargs):
            on, self.on = self.on, False
            try:
                return fn(*args, **kwargs)
            finally:
                self.on = on
        return call


def test_a_step_reads_no_device_value_and_takes_no_shape_from_one(model, monkeypatch):
    """The step's code path (all layers and the head) under a guard that refuses every host read of a tensor
    value, over steps that emit CSA entries and close an HCA window for one slot but not the other. Exempt: the
    reference routed-MoE op, which groups tokens by expert on the host (the GPU backend's MoE kernel reads its
    routing on the device and is captured by the GPU tests), and the range check of token ids given on the CPU
    (ids on the GPU are checked there, without a read)."""
    state = model.new_state(2, 160)
    model.prefill([tokens(model, 1, 125), tokens(model, 2, 3)], state, [0, 1])
    guard = HostReadGuard(monkeypatch)
    monkeypatch.setattr(model.backend, "moe", guard.exempt(model.backend.moe))
    monkeypatch.setattr(model_module, "check_token_ids", guard.exempt(model_module.check_token_ids))
    guard.on = True
    try:
        out = [model.step(tokens(model, 3 + i, 2), state) for i in range(6)]
    finally:
        guard.on = False
    assert all(o.shape == out[0].shape for o in out) and torch.isfinite(torch.stack(out)).all()
    assert state.host_positions == (131, 9)
