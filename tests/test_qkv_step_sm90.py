"""The decode step's query-and-key kernel (``kernels/sm90_qkv_step.py``): V4's configuration and the extremes compiled
for sm_90a on the CPU (CI), the warm-up's job, the backend's fallback on the CPU, and on the H200 (marked ``gpu``)
against ``ReferenceBackend.step_qkv`` (computed on the CPU): 1 to 64 slots, 64 and 8 heads, positions at the ring's
edges and near a million, a key that is a column slice of a wider product, poisoned outputs (no ring row but
``pos % W`` changes), and the backend's op replayed in a CUDA graph."""

from __future__ import annotations

import os
from dataclasses import replace

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed")

from nvfp4_megamoe.kernels import cute_host, sm90_qkv_step  # noqa: E402
from nvfp4_megamoe.kernels.attention_reference import rope_tables, rope_turn  # noqa: E402
from nvfp4_megamoe.kernels.sm90_qkv_step import QkvStepConfig, Sm90QkvStep, stand_in_operands  # noqa: E402
from nvfp4_megamoe.runtime.backend import ReferenceBackend  # noqa: E402
from nvfp4_megamoe.runtime.hopper import HopperBackend  # noqa: E402
from numeric import bf16_ulps  # noqa: E402

EPS = 1e-6
D, ROPE_DIM, WINDOW = 512, 64, 128   # V4's head_dim, RoPE width and sliding window
needs_sm90a = pytest.mark.skipif(os.environ["CUTE_DSL_ARCH"] != "sm_90a", reason="CUTE_DSL_ARCH names another target")


@needs_sm90a
@pytest.mark.parametrize("config", [QkvStepConfig(D, ROPE_DIM, EPS), QkvStepConfig(64, 0, 0.0),
                                    QkvStepConfig(2048, 2048, 1e-5)], ids=["v4", "narrowest", "widest"])
def test_qkv_step_compiles_sm90a(config, monkeypatch):
    monkeypatch.setenv(cute_host.CACHE_ENV, "0")
    assert Sm90QkvStep.can_implement(config)
    assert cute_host.compile_op(Sm90QkvStep(config), stand_in_operands(config, "cpu")) is not None


def test_can_implement_says_which_shapes_fit():
    assert not sm90_qkv_step.can_implement(4096, 64, EPS)   # past a CTA's threads (a thread a pair)
    assert not sm90_qkv_step.can_implement(96, 64, EPS)     # not whole warps of pairs
    assert not sm90_qkv_step.can_implement(512, 63, EPS)    # half a RoPE pair
    assert not sm90_qkv_step.can_implement(128, 256, EPS)   # more rotated than D
    assert not sm90_qkv_step.can_implement(512, 64, -1.0)
    assert sm90_qkv_step.can_implement(128, 32, EPS) and sm90_qkv_step.can_implement(D, ROPE_DIM, EPS)
    with pytest.raises(ValueError, match="query-and-key step"):
        Sm90QkvStep(QkvStepConfig(4096, 64, EPS))


def test_the_kernel_refuses_operands_off_the_gpu():
    q, kv, norm, ring, pos, freq, _ = stand_in_operands(QkvStepConfig(D, ROPE_DIM, EPS), "cpu")
    with pytest.raises(ValueError, match="q_raw must be CUDA float32"):
        sm90_qkv_step.sm90_qkv_step(q, kv, norm, ring, pos, freq[:ROPE_DIM // 2], EPS)


def test_the_warm_up_registers_one_kernel_where_the_attention_kernel_takes_the_query(synth_checkpoints):
    """``HopperBackend._warm_shapes`` asks for one query-and-key kernel (V4: both RoPE kinds are 64 wide) where the
    decode attention kernel takes the heads (64 x 512), none for the tiny preset's 4 x 128 (the reference runs)."""
    from nvfp4_megamoe.runtime import load_model

    model = load_model(synth_checkpoints.converted("flash", preset="tiny").output)
    wide = replace(model.config, num_heads=64, head_dim=D)
    found = {}
    for name, cfg in (("tiny", model.config), ("64 x 512", wide)):
        with cute_host.collecting() as jobs:
            HopperBackend()._warm_shapes(cfg, model.weights, torch.device("cpu"))
        found[name] = [(op, tensors) for op, tensors in jobs if isinstance(op, Sm90QkvStep)]
    assert found["tiny"] == []
    (op, tensors), = found["64 x 512"]
    assert op.config == QkvStepConfig(D, wide.main_rope.dim, float(wide.rms_norm_eps))
    if os.environ["CUTE_DSL_ARCH"] == "sm_90a":
        assert cute_host.compile_op(op, tensors) is not None


# -- operands ------------------------------------------------------------------------------------------------------

def _freq(device) -> torch.Tensor:
    """V4's RoPE frequencies, computed once on the CPU and copied (as the model does): a GPU ``pow`` may round an entry
    one ulp away, which at positions near a million turns the angle by a tenth of a radian."""
    freq = 1.0 / (10000.0 ** (torch.arange(0, ROPE_DIM, 2, dtype=torch.float32) / ROPE_DIM))
    return freq.to(device)


def _positions(b: int, gen: torch.Generator) -> torch.Tensor:
    """The ring's edges (0, W - 1, W), positions near a million (angles of about 1e6 radians), then random ones."""
    fixed = [0, WINDOW - 1, WINDOW, 10 ** 6, 2 ** 20 - 1, 3 * WINDOW + 5]
    random = torch.randint(0, 1 << 21, (max(0, b - len(fixed)),), generator=gen).tolist()
    return torch.tensor((fixed + random)[:b], dtype=torch.int64)


def _operands(b: int, heads: int, device, gen: torch.Generator) -> dict:
    """The step's projections as the model makes them (the key a column slice of a wider product, row stride 3D),
    the key's BF16 weight as stored, and a random BF16 ring."""
    wide = 3 * torch.randn(b, 1, 3 * D, device=device, generator=gen)
    return dict(q_raw=2 * torch.randn(b, 1, heads, D, device=device, generator=gen), kv_raw=wide[:, :, D:2 * D],
                kv_norm=(torch.rand(D, device=device, generator=gen) + 0.5).to(torch.bfloat16),
                ring=torch.randn(b, WINDOW, D, device=device, generator=gen).to(torch.bfloat16))


def _reference(ops: dict, positions: torch.Tensor, ring_dtype=torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    """``ReferenceBackend.step_qkv`` on the CPU: (query float32 [B, 1, H, D], the ring after the write)."""
    cpu = {k: v.cpu() for k, v in ops.items()}
    ring = cpu["ring"].to(ring_dtype)
    pos, freq = positions.cpu(), _freq("cpu")
    turn = rope_turn(*rope_tables(pos[:, None], freq))
    q = ReferenceBackend().step_qkv(cpu["q_raw"], cpu["kv_raw"], cpu["kv_norm"], ring, pos, freq, turn, EPS)
    return q, ring


def _assert_bf16_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Within one BF16 ulp of the float32 reference rounded to BF16, or, for values near zero, within 1e-5 of the
    row's largest magnitude (float32 roundings in another order)."""
    g, w = got.float().cpu(), want.to(torch.bfloat16).float().cpu()
    assert g.isfinite().all(), f"{what}: a non-finite value"
    scale = w.abs().amax(-1, keepdim=True)
    ok = (bf16_ulps(got.cpu(), want.cpu()) <= 1) | ((g - w).abs() <= 1e-5 * scale)
    assert ok.all(), f"{what}: {int((~ok).sum())} values off, worst {float(((g - w).abs() / scale)[~ok].max())}"


def test_hopper_backend_runs_the_reference_on_the_cpu():
    """CPU operands: the backend's op is the reference's, bit for bit (query and ring), with no kernel call."""
    gen = torch.Generator().manual_seed(0)
    ops = _operands(3, 8, "cpu", gen)
    positions = _positions(3, gen)
    for ring_dtype in (torch.float32, torch.bfloat16):
        want_q, want_ring = _reference(ops, positions, ring_dtype)
        ring = ops["ring"].to(ring_dtype)
        turn = rope_turn(*rope_tables(positions[:, None], _freq("cpu")))
        be = HopperBackend()
        q = be.step_qkv(ops["q_raw"], ops["kv_raw"], ops["kv_norm"], ring, positions, _freq("cpu"), turn, EPS)
        assert be.kernel_calls["step_qkv"] == 0
        assert torch.equal(q, want_q) and torch.equal(ring, want_ring)


# -- on the GPU ----------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("heads", [64, 8])
@pytest.mark.parametrize("b", [1, 3, 64])
def test_kernel_matches_reference(b, heads):
    """The query (into a NaN-poisoned output) and the ring row ``pos % W`` within a BF16 ulp of the reference; every
    other ring row bit for bit as it was."""
    gen = torch.Generator(device="cuda").manual_seed(b * heads)
    ops = _operands(b, heads, "cuda", gen)
    positions = _positions(b, torch.Generator().manual_seed(b)).cuda()
    want_q, want_ring = _reference(ops, positions)
    ring_before = ops["ring"].clone()
    out = torch.full((b, heads, D), float("nan"), dtype=torch.bfloat16, device="cuda")
    q = sm90_qkv_step.sm90_qkv_step(ops["q_raw"][:, 0], ops["kv_raw"][:, 0], ops["kv_norm"].float(), ops["ring"],
                                    positions, _freq("cuda"), EPS, out=out)
    torch.cuda.synchronize()
    assert q is out and q.dtype == torch.bfloat16
    _assert_bf16_close(q, want_q[:, 0], f"query B={b} H={heads}")
    rows = (positions % WINDOW).cpu()
    ring = ops["ring"].cpu()
    for s in range(b):
        _assert_bf16_close(ring[s, rows[s]], want_ring[s, rows[s]].float(), f"ring slot {s} pos {int(positions[s])}")
        others = torch.ones(WINDOW, dtype=torch.bool)
        others[rows[s]] = False
        assert torch.equal(ring[s, others], ring_before.cpu()[s, others]), f"slot {s}: another ring row changed"


@pytest.mark.gpu
def test_backend_runs_the_kernel_hands_decode_attention_its_query_and_replays_in_a_cuda_graph():
    """``HopperBackend.step_qkv`` takes the kernel for 64 heads of 512 and a BF16 ring: the query comes back BF16
    [B, 1, H, D], contiguous, so ``decode_attention``'s conversion is the tensor itself; a captured step replays
    with the positions and projections it finds on the device. 8 heads (no attention kernel) and a float32 ring
    run the reference."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    b, heads = 4, 64
    ops = _operands(b, heads, "cuda", gen)
    positions = _positions(b, torch.Generator().manual_seed(5)).cuda()
    freq, be = _freq("cuda"), HopperBackend()
    turn = rope_turn(*rope_tables(positions[:, None], freq))   # not read by the kernel
    want_q, want_ring = _reference(ops, positions)
    q = be.step_qkv(ops["q_raw"], ops["kv_raw"], ops["kv_norm"], ops["ring"], positions, freq, turn, EPS)
    assert be.kernel_calls["step_qkv"] == 1
    assert q.dtype == torch.bfloat16 and q.shape == (b, 1, heads, D) and q.is_contiguous()
    first = q[:, 0]
    assert first.to(torch.bfloat16) is first and first.contiguous() is first   # decode_attention's ``bf``
    _assert_bf16_close(q, want_q, "eager")
    _assert_bf16_close(ops["ring"], want_ring.float(), "eager ring")

    q_in, kv_in = ops["q_raw"].clone(), ops["kv_raw"].clone()
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        q_graph = be.step_qkv(q_in, kv_in, ops["kv_norm"], ops["ring"], positions, freq, turn, EPS)
    for step in range(3):
        positions += 1
        fresh = _operands(b, heads, "cuda", gen)
        q_in.copy_(fresh["q_raw"])
        kv_in.copy_(fresh["kv_raw"])
        want_q, want_ring = _reference(dict(fresh, kv_norm=ops["kv_norm"], ring=ops["ring"]), positions)
        graph.replay()
        torch.cuda.synchronize()
        _assert_bf16_close(q_graph, want_q, f"graph step {step}")
        _assert_bf16_close(ops["ring"], want_ring.float(), f"graph step {step} ring")

    calls = be.kernel_calls["step_qkv"]
    few = _operands(b, 8, "cuda", gen)
    q8 = be.step_qkv(few["q_raw"], few["kv_raw"], few["kv_norm"], few["ring"], positions, freq, turn, EPS)
    f32_ring = ops["ring"].float()
    q32 = be.step_qkv(ops["q_raw"], ops["kv_raw"], ops["kv_norm"], f32_ring, positions, freq, turn, EPS)
    assert be.kernel_calls["step_qkv"] == calls and q8.dtype == torch.float32 and q32.dtype == torch.float32
