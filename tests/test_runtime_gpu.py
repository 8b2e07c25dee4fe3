"""The runtime on an H200 with the Hopper backend (CuTeDSL kernels) against the reference path.

Marked ``gpu``: CI (CPU only) skips it; run through the device machine. The reference path is the
same model with :class:`ReferenceBackend` on the GPU (fp32 activations); the kernels take BF16
activations (W4A16), so agreement is to BF16 rounding, not to float32.
"""

from __future__ import annotations

import pytest
import torch

from nvfp4_megamoe.convert.api import convert_checkpoint
from nvfp4_megamoe.convert.synth import write_synthetic
from nvfp4_megamoe.runtime import HopperBackend, ReferenceBackend, load_model
from nvfp4_megamoe.kernels.moe_reference import random_moe_weights
from nvfp4_megamoe.runtime.hopper import hopper_available
from nvfp4_megamoe.runtime.weights import Nvfp4Linear

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not hopper_available("cuda"), reason="needs an sm_90 GPU with CuTeDSL"),
]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    made = {}

    def get(variant: str, dense: str = "keep"):
        if (variant, dense) not in made:
            root = tmp_path_factory.mktemp(f"{variant}-{dense}")
            src = write_synthetic(root / "src", preset="tiny", variant=variant, seed=0)
            convert_checkpoint(src, root / "out", dense=dense, progress=False)
            made[variant, dense] = root / "out"
        return made[variant, dense]

    return get


@pytest.mark.parametrize("variant", ["flash", "modelopt"])
def test_moe_kernel_matches_reference_on_loaded_layers(converted, variant):
    """One routed-MoE call per layer: kernel vs reference on the same packed weights (per-half alpha)."""
    model = load_model(converted(variant), device="cuda")
    assert isinstance(model.backend, HopperBackend) and model.backend.warmup_seconds is not None
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
        assert rel(got, want) < 1e-2


@pytest.mark.parametrize("variant,dense", [("flash", "keep"), ("modelopt", "keep"), ("flash", "nvfp4")])
def test_logits_with_kernels_match_reference_path(converted, variant, dense):
    """Prefill and decode logits with the kernels vs the fp32 reference path.

    16 tokens: fewer compressed entries than the indexer's top-k, so no discrete top-k choice can
    flip and the difference is the kernels' BF16 activations (W4A16). Over long sequences the
    random synthetic models amplify that rounding through router/indexer top-k flips (3-6e-2 at
    160 tokens, printed for the record), as any change of rounding would.
    """
    out = converted(variant, dense)
    fast = load_model(out, device="cuda")
    slow = load_model(out, device="cuda", backend=ReferenceBackend())
    ids = torch.randint(0, fast.config.vocab_size, (1, 160), generator=torch.Generator().manual_seed(3)).cuda()
    print(f"{variant}: 160-token logits rel err kernels vs reference {rel(fast(ids), slow(ids)):.3e}")
    short = ids[:, :16]
    assert rel(fast(short), slow(short)) < 1e-2
    sf, ss = fast.new_state(1), slow.new_state(1)
    steps = [(fast.step(short[:, t], sf), slow.step(short[:, t], ss)) for t in range(16)]
    worst = max(rel(x, y) for x, y in steps)
    print(f"{variant}: 16-token prefill/decode worst step rel err {worst:.3e}")
    assert worst < 1e-2
    assert fast.backend.kernel_calls["moe"] > 0
    if dense == "nvfp4":  # attention projections and shared experts are NVFP4: the dense kernel ran
        assert fast.backend.kernel_calls["linear"] > 0
    assert fast.backend.kernel_calls["indexer"] > 0  # CSA decode steps ran the GPU indexer top-k
    assert fast.backend.kernel_calls["hc_pre"] > 0


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
        assert rel(got, ReferenceBackend().linear(x.to(torch.bfloat16).float(), w)) < 1e-2


@pytest.mark.parametrize("groups,rows,kernel", [(4, 128, True), (2, 256, True), (4, 64, False)])
def test_grouped_linear_kernel_matches_reference(groups, rows, kernel):
    """``wo_a``: each group's weight rows and the matching slice of the swizzled scales (128-row groups)."""
    be, w, k = HopperBackend(), _nvfp4_linear(groups * rows, 256, groups), 256
    x = torch.randn(2, 9, groups, k, device="cuda", generator=torch.Generator(device="cuda").manual_seed(7))
    got = be.grouped_linear(x, w, groups)
    assert be.kernel_calls["linear"] == int(kernel)
    assert got.shape == (2, 9, groups, rows)
    assert rel(got, ReferenceBackend().grouped_linear(x.to(torch.bfloat16).float(), w, groups)) < 1e-2


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
    assert rel(parts, whole) < 1e-5
