"""The decode step's compressor kernel (``kernels/sm90_compressor.py``): every configuration V4-Flash and V4-Pro use
compiled for sm_90a on the CPU (CI), with the clusters and slot groups ``sm90_heuristics`` picks and others (one CTA a
slot, several chunks a thread), the backend's fallback on the CPU, and on the H200 (marked ``gpu``) against
``ReferenceBackend.compress_step`` over consecutive steps: the three compressor shapes, 1 to 64 slots, windows that
close and do not, the first window (an empty overlap half), positions near a million, strided projections and
poisoned store rows, and the other configurations' code paths.
"""

from __future__ import annotations

import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed")

from nvfp4_megamoe.kernels.sm90_compressor import Sm90CompressStep, sm90_compress_step, stand_in_operands  # noqa: E402
from nvfp4_megamoe.kernels.sm90_config import CompressStepConfig  # noqa: E402
from nvfp4_megamoe.kernels.sm90_heuristics import compress_step_config  # noqa: E402
from nvfp4_megamoe.runtime.backend import ReferenceBackend  # noqa: E402
from nvfp4_megamoe.runtime.hopper import HopperBackend  # noqa: E402
from nvfp4_megamoe.runtime.state import CompressorState, compressor_shapes  # noqa: E402
from numeric import bf16_ulps  # noqa: E402

EPS = 1e-6
ROPE_DIM = 64
# (ratio, d, overlap): V4's CSA compressor, the CSA indexer's compressor, the HCA compressor (Flash and Pro alike)
SHAPES = {"csa": (4, 512, True), "indexer": (4, 128, True), "hca": (128, 512, False)}
SHIPPED = [compress_step_config(ratio, d, overlap, ROPE_DIM, EPS) for ratio, d, overlap in SHAPES.values()]
# configurations no V4 compressor picks, for their code paths: one CTA a slot and one group (no cluster, no partials
# through shared memory), several chunks a thread (HCA's 128 slots in 4 groups of 32; CSA-like 16 slots in 2 groups)
OTHERS = {"one-cta": CompressStepConfig(4, 128, True, ROPE_DIM, EPS, cluster=1, groups=1),
          "hca-chunks": CompressStepConfig(128, 512, False, ROPE_DIM, EPS, cluster=2, groups=4),
          "overlap-chunks": CompressStepConfig(16, 128, True, ROPE_DIM, EPS, cluster=2, groups=2)}


@pytest.mark.skipif(os.environ["CUTE_DSL_ARCH"] != "sm_90a", reason="CUTE_DSL_ARCH names another target")
@pytest.mark.parametrize("config", SHIPPED + list(OTHERS.values()), ids=list(SHAPES) + list(OTHERS))
def test_compress_step_compiles_sm90a(config):
    from nvfp4_megamoe.kernels.cute_host import compile_op
    assert Sm90CompressStep.can_implement(config)
    assert compile_op(Sm90CompressStep(config), stand_in_operands(config, "cpu")) is not None


def test_heuristics_spread_a_slot_over_a_cluster():
    """d = 512: 8 CTAs of 64 channels; the indexer's d = 128: 4 of 32; HCA's 128 slots in 16 groups of 8 (1024
    threads), CSA's 4 in 4 groups of one (and its prev twin)."""
    picked = {name: (c.cluster, c.channels, c.groups, c.slots) for name, c in zip(SHAPES, SHIPPED)}
    assert picked == {"csa": (8, 64, 4, 1), "indexer": (4, 32, 4, 1), "hca": (8, 64, 16, 8)}
    assert all(c.channels * c.groups <= 1024 for c in SHIPPED)
    wide = compress_step_config(4, 2048, True, 64, EPS)
    assert (wide.cluster, wide.channels, wide.groups) == (8, 256, 4) and Sm90CompressStep.can_implement(wide)
    assert compress_step_config(3, 96, True, 64, EPS).cluster == 1   # 48 channels are not whole warps


def test_can_implement_says_which_shapes_fit():
    assert not Sm90CompressStep.can_implement(CompressStepConfig(4, 2048, True, 64, EPS))   # past a CTA's threads
    assert not Sm90CompressStep.can_implement(CompressStepConfig(4, 100, True, 64, EPS))    # not whole warps
    assert not Sm90CompressStep.can_implement(CompressStepConfig(4, 128, True, 63, EPS))    # half a RoPE pair
    assert not Sm90CompressStep.can_implement(CompressStepConfig(4, 128, True, 256, EPS))   # more rotated than d
    assert not Sm90CompressStep.can_implement(CompressStepConfig(4, 128, True, 64, EPS, cluster=8))  # 16 a CTA
    assert not Sm90CompressStep.can_implement(CompressStepConfig(4, 384, True, 64, EPS, cluster=3))  # not a size
    assert not Sm90CompressStep.can_implement(CompressStepConfig(4, 256, True, 64, EPS, groups=3))   # 4 slots in 3
    assert not Sm90CompressStep.can_implement(CompressStepConfig(128, 512, False, 64, EPS, groups=4))  # 2048 threads
    assert Sm90CompressStep.can_implement(CompressStepConfig(1, 32, False, 0, 0.0))
    with pytest.raises(ValueError, match="compressor step"):
        Sm90CompressStep(CompressStepConfig(4, 2048, True, 64, EPS))


def _freq(device) -> torch.Tensor:
    return 1.0 / (160000.0 ** (torch.arange(0, ROPE_DIM, 2, dtype=torch.float32, device=device) / ROPE_DIM))


def _states(ratio: int, d: int, overlap: bool, starts: torch.Tensor, dtype: torch.dtype, device, gen, extra=4
            ) -> tuple[CompressorState, CompressorState]:
    """Two equal compressor states (the kernel's and the reference's) of slots at ``starts``: random pending
    windows, a random overlap half where a window has closed (-inf gates, the empty half, where none has), every
    store row NaN (a row the step does not write stays NaN)."""
    b, width = starts.numel(), 2 * d if overlap else d
    shapes = compressor_shapes(b, ratio, width, d, int(starts.max()) + extra * ratio, dtype, overlap)
    got, want = CompressorState.allocate(shapes, ratio, device), CompressorState.allocate(shapes, ratio, device)
    want.pending_kv.copy_(torch.randn(want.pending_kv.shape, device=device, generator=gen))
    want.pending_gate.copy_(2 * torch.randn(want.pending_gate.shape, device=device, generator=gen))
    if overlap:
        want.prev_kv.copy_(torch.randn(want.prev_kv.shape, device=device, generator=gen))
        gate = 2 * torch.randn(want.prev_gate.shape, device=device, generator=gen)
        want.prev_gate.copy_(gate.masked_fill((starts < ratio).view(-1, 1, 1).to(device), float("-inf")))
    want.store.fill_(float("nan"))
    for g, w in zip(got.tensors(), want.tensors()):
        g.copy_(w)
    return got, want


def _weights(ratio: int, d: int, overlap: bool, device, gen) -> tuple[torch.Tensor, torch.Tensor]:
    width = 2 * d if overlap else d
    ape = torch.randn(ratio, width, device=device, generator=gen)
    norm = (torch.rand(d, device=device, generator=gen) + 0.5).to(torch.bfloat16)   # as stored: the backend's copy
    return ape, norm


def _projections(b: int, width: int, device, gen) -> tuple[torch.Tensor, torch.Tensor]:
    """kv and gate as column slices of one wider product (row stride 3C, not contiguous)."""
    wide = torch.randn(b, 3 * width, device=device, generator=gen)
    wide[:, :width] *= 2
    return wide[:, width:2 * width], wide[:, :width]


def _assert_entries_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """BF16 entries: NaN in the same places (rows not written), elsewhere within one BF16 ulp, or, for values near
    zero (a pooled sum that cancels), within 1e-5 of the row's largest magnitude (float32 sums in another order)."""
    assert torch.equal(got.isnan(), want.isnan()), f"{what}: written rows differ"
    rows = ~want.isnan().all(-1)
    g, w = got[rows].float(), want[rows].float()
    assert g.isfinite().all() and w.isfinite().all(), f"{what}: a written row holds a non-finite value"
    scale = w.abs().amax(-1, keepdim=True)
    ok = (bf16_ulps(got[rows], want[rows]) <= 1) | ((g - w).abs() <= 1e-5 * scale)
    assert ok.all(), f"{what}: {int((~ok).sum())} entries off, worst {float(((g - w).abs() / scale)[~ok].max())}"


def _assert_state_equal(got: CompressorState, want: CompressorState, what: str) -> None:
    """Pending windows and the overlap half bit for bit (copies and one float add), the stores as entries."""
    assert torch.equal(got.pending_kv, want.pending_kv) and torch.equal(got.pending_gate, want.pending_gate), what
    if want.overlap:
        assert torch.equal(got.prev_kv, want.prev_kv), f"{what}: prev_kv"
        assert torch.equal(got.prev_gate, want.prev_gate), f"{what}: prev_gate"
    _assert_entries_close(got.store, want.store, what)


def _kernel_step(kv, gate, cs: CompressorState, ape, norm, positions, freq,
                 config: CompressStepConfig | None = None) -> None:
    """The kernel's step as the runtime launches it, or, with ``config``, that configuration's kernel."""
    if config is None:
        sm90_compress_step(kv, gate, cs.pending_kv, cs.pending_gate, cs.prev_kv, cs.prev_gate, cs.store, ape,
                           norm.float(), positions, freq, cs.ratio, EPS)
        return
    from nvfp4_megamoe.kernels.cute_host import launch
    prev = [cs.prev_kv, cs.prev_gate] if cs.overlap else [cs.pending_kv, cs.pending_gate]
    launch(Sm90CompressStep(config), [kv, gate, cs.pending_kv, cs.pending_gate, *prev, cs.store, ape, norm.float(),
                                      positions, freq])


def test_hopper_backend_runs_the_reference_on_the_cpu():
    """CPU operands: the backend's update is the reference's, bit for bit."""
    gen = torch.Generator().manual_seed(0)
    ratio, d, overlap = 4, 64, True
    starts = torch.tensor([0, 3, 6])
    got, want = _states(ratio, d, overlap, starts, torch.float32, "cpu", gen)
    ape, norm = _weights(ratio, d, overlap, "cpu", gen)
    freq = 1.0 / (160000.0 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    kv, gate = _projections(3, 2 * d, "cpu", gen)
    be = HopperBackend()
    be.compress_step(kv, gate, got, ape, norm, starts, freq, EPS)
    ReferenceBackend().compress_step(kv, gate, want, ape, norm, starts, freq, EPS)
    assert be.kernel_calls["compress_step"] == 0
    for g, w in zip(got.tensors(), want.tensors()):
        assert torch.equal(g.nan_to_num(), w.nan_to_num())


def _starts(ratio: int, b: int, large: bool, gen) -> torch.Tensor:
    """Slot positions: with ``large`` first positions near a million (angles of about 1e6 radians at the fastest
    frequency; 2**20 - 1 closes an HCA window), then the first window (0, and its last token), a window's last
    token but one, and random ones."""
    fixed = ([10 ** 6 - 2, 0, 2 ** 20 - 1] if large else []) + [0, ratio - 1, 2 * ratio - 2, ratio + 1]
    random = torch.randint(0, 64 * ratio, (max(0, b - len(fixed)),), generator=gen).tolist()
    return torch.tensor((fixed + random)[:b], dtype=torch.int64)


def _steps_match_reference(ratio: int, d: int, overlap: bool, starts: torch.Tensor, gen, steps: int, what: str,
                           config: CompressStepConfig | None = None) -> None:
    """``steps`` consecutive steps from one random state, slots at ``starts``, through the kernel (``_kernel_step``)
    and the reference; after every step the whole state agrees (``_assert_state_equal``)."""
    got, want = _states(ratio, d, overlap, starts, torch.bfloat16, "cuda", gen, extra=4)
    ape, norm = _weights(ratio, d, overlap, "cuda", gen)
    freq, ref = _freq("cuda"), ReferenceBackend()
    positions = starts.cuda()
    for step in range(steps):
        kv, gate = _projections(starts.numel(), 2 * d if overlap else d, "cuda", gen)
        _kernel_step(kv, gate, got, ape, norm, positions, freq, config)
        ref.compress_step(kv, gate, want, ape, norm, positions, freq, EPS)
        torch.cuda.synchronize()
        _assert_state_equal(got, want, f"{what} step {step}")
        positions += 1


@pytest.mark.gpu
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("b,large", [(1, False), (2, True), (3, True), (64, False)])
def test_kernel_matches_reference_over_steps(shape, b, large):
    """Consecutive steps from the same state through the kernel and the reference: after every step the whole
    state agrees (pending and prev bit for bit, every store row, NaN where neither wrote)."""
    ratio, d, overlap = SHAPES[shape]
    gen = torch.Generator(device="cuda").manual_seed(ratio + d + b)
    starts = _starts(ratio, b, large, torch.Generator().manual_seed(b))
    if b == 1 and large is False:
        starts = torch.tensor([ratio - 2])   # one slot: a window that closes on the second step
    _steps_match_reference(ratio, d, overlap, starts, gen, 2 * ratio + 1 if ratio <= 8 else 6, f"{shape} B={b}")


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(OTHERS))
@pytest.mark.parametrize("b", [1, 5])
def test_other_configurations_match_reference(name, b):
    """The code paths no shipped shape takes (no cluster, one group; several chunks a thread), over steps that
    close windows, from positions near a million too."""
    config = OTHERS[name]
    ratio, d, overlap = config.ratio, config.dim, config.overlap
    gen = torch.Generator(device="cuda").manual_seed(ratio + d + b + 1)
    starts = _starts(ratio, b, True, torch.Generator().manual_seed(b)) if b > 1 else torch.tensor([ratio - 2])
    _steps_match_reference(ratio, d, overlap, starts, gen, 2 * ratio + 1 if ratio <= 16 else 4, f"{name} B={b}",
                           config)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", list(SHAPES))
def test_kernel_writes_one_row_and_moves_the_overlap_half_where_the_window_closes(shape):
    """One step of slots at a window's last token and at others: the row ``pos // ratio`` is written (finite) and
    no other; prev changes only where the window closes, to the window's first half (the new token's too) and
    gate + ape."""
    ratio, d, overlap = SHAPES[shape]
    gen = torch.Generator(device="cuda").manual_seed(7)
    starts = torch.tensor([ratio - 1, 0, 2 * ratio - 1, ratio + 1, 5 * ratio - 1])
    got, want = _states(ratio, d, overlap, starts, torch.bfloat16, "cuda", gen)
    before = CompressorState(ratio, *(t.clone() for t in (got.pending_kv, got.pending_gate, got.store)),
                             *((got.prev_kv.clone(), got.prev_gate.clone()) if overlap else ()))
    ape, norm = _weights(ratio, d, overlap, "cuda", gen)
    kv, gate = _projections(len(starts), 2 * d if overlap else d, "cuda", gen)
    positions = starts.cuda()
    _kernel_step(kv, gate, got, ape, norm, positions, _freq("cuda"))
    ReferenceBackend().compress_step(kv, gate, want, ape, norm, positions, _freq("cuda"), EPS)
    _assert_state_equal(got, want, shape)
    for s, p in enumerate(starts.tolist()):
        row = p // ratio
        assert got.store[s, row].float().isfinite().all()
        others = torch.ones(got.store.shape[1], dtype=torch.bool)
        others[row] = False
        assert got.store[s, others].isnan().all()
        assert torch.equal(got.pending_kv[s, p % ratio], kv[s]) and torch.equal(got.pending_gate[s, p % ratio], gate[s])
        if overlap:
            closes = (p + 1) % ratio == 0
            if closes:
                assert torch.equal(got.prev_kv[s], got.pending_kv[s, :, :d])
                assert torch.equal(got.prev_gate[s], got.pending_gate[s, :, :d] + ape[:, :d])
            else:
                assert torch.equal(got.prev_kv[s], before.prev_kv[s])
                assert torch.equal(got.prev_gate[s], before.prev_gate[s])   # -inf where no window has closed


@pytest.mark.gpu
def test_backend_step_runs_the_kernel_and_replays_in_a_cuda_graph():
    """``HopperBackend.compress_step`` takes the kernel for a BF16 store (and the reference for a float32 one), and a
    step captured in a CUDA graph replays with the positions it finds on the device (no host read)."""
    ratio, d, overlap = SHAPES["csa"]
    gen = torch.Generator(device="cuda").manual_seed(11)
    starts = torch.tensor([0, 2, 7, 13])
    got, want = _states(ratio, d, overlap, starts, torch.bfloat16, "cuda", gen, extra=8)
    ape, norm = _weights(ratio, d, overlap, "cuda", gen)
    freq, be, ref = _freq("cuda"), HopperBackend(), ReferenceBackend()
    positions = starts.cuda()
    kv, gate = _projections(4, 2 * d, "cuda", gen)
    be.compress_step(kv, gate, got, ape, norm, positions, freq, EPS)   # compiles, caches the weight's float32 copy
    ref.compress_step(kv, gate, want, ape, norm, positions, freq, EPS)
    assert be.kernel_calls["compress_step"] == 1
    _assert_state_equal(got, want, "eager")
    kv_in, gate_in = kv.clone(), gate.clone()
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        be.compress_step(kv_in, gate_in, got, ape, norm, positions, freq, EPS)
    for step in range(2 * ratio):
        positions += 1
        kv, gate = _projections(4, 2 * d, "cuda", gen)
        kv_in.copy_(kv)
        gate_in.copy_(gate)
        graph.replay()
        ref.compress_step(kv, gate, want, ape, norm, positions, freq, EPS)
        torch.cuda.synchronize()
        _assert_state_equal(got, want, f"graph step {step}")
    f32_got, f32_want = _states(ratio, d, overlap, starts, torch.float32, "cuda", gen)
    calls = be.kernel_calls["compress_step"]
    be.compress_step(kv, gate, f32_got, ape, norm, starts.cuda(), freq, EPS)
    ref.compress_step(kv, gate, f32_want, ape, norm, starts.cuda(), freq, EPS)
    assert be.kernel_calls["compress_step"] == calls
    # the backend's reference: its fused RMSNorm and last-axis softmax, float32 roundings apart from the plain one's
    torch.testing.assert_close(f32_got.store, f32_want.store, rtol=1e-5, atol=1e-5, equal_nan=True)
