"""The router kernels (``kernels/sm90_router.py``, ``Sm90RouterTopk`` and ``Sm90RouterHash``): compiled for sm_90a on
the CPU (CI), and on the H200 against ``ReferenceBackend.route`` (torch ops on the same GPU, marked ``gpu``).

Top-k ids are compared as sets per token with the weights matched by id (the MoE result does not depend on a token's
slot order), except where the reference's k-th and (k+1)-th choices are closer than the scores' last bits, where
either pick is right; the kernel's own order (descending, ties to the lower expert) is checked on its own."""

from __future__ import annotations

import os
from dataclasses import replace

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed")

from nvfp4_megamoe.kernels import cute_host, sm90_router  # noqa: E402
from nvfp4_megamoe.kernels.router_reference import router_scores  # noqa: E402
from nvfp4_megamoe.kernels.sm90_router import (RouterConfig, Sm90RouterHash, Sm90RouterTopk,  # noqa: E402
                                               sm90_route)
from nvfp4_megamoe.runtime.backend import ReferenceBackend  # noqa: E402

# (E, k, scaling) of V4-Flash, V4-Pro and the synthetic presets (convert/synth_config.py: tiny, small, flash-layer,
# pro-layer, their pro variants)
SHIPPED = [(256, 6, 1.5), (384, 6, 2.5), (8, 2, 1.0), (12, 2, 2.5), (16, 4, 1.0), (24, 4, 2.5), (64, 6, 1.5),
           (128, 6, 2.5)]
SCALING = 1.5
needs_sm90a = pytest.mark.skipif(os.environ["CUTE_DSL_ARCH"] != "sm_90a", reason="CUTE_DSL_ARCH names another target")


def _compile_on_cpu(config: RouterConfig, **kw) -> None:
    """Compile what ``sm90_router.warmup`` asks for, from CPU stand-ins (no GPU)."""
    with cute_host.collecting() as jobs:
        assert sm90_router.warmup(config, "cpu", **kw) == 1
    (op, tensors), = jobs
    assert cute_host.compile_op(op, tensors) is not None


@needs_sm90a
@pytest.mark.parametrize("e,k,scaling", SHIPPED)
def test_shipped_configurations_compile_sm90a(e, k, scaling, monkeypatch):
    """Every (E, k) the runtime launches for V4 and the synthetic presets: top-k with its bias, hash layers with a
    tid2eid of either stored dtype."""
    monkeypatch.setenv(cute_host.CACHE_ENV, "0")
    _compile_on_cpu(RouterConfig(e, k, "sqrtsoftplus", scaling, bias=True))
    for dtype in (torch.int64, torch.int32):
        _compile_on_cpu(RouterConfig(e, k, "sqrtsoftplus", scaling), hashed=True, tid2eid_dtype=dtype)


@needs_sm90a
@pytest.mark.parametrize("func", sm90_router.SCORING_FUNCS)
@pytest.mark.parametrize("e,k,bias", [(512, 32, False), (384, 6, True), (1, 1, False)])
def test_every_scoring_function_and_the_extremes_compile_sm90a(func, e, k, bias, monkeypatch):
    monkeypatch.setenv(cute_host.CACHE_ENV, "0")
    _compile_on_cpu(RouterConfig(e, k, func, SCALING, bias=bias))
    _compile_on_cpu(RouterConfig(e, k, func, SCALING), hashed=True)


def test_can_implement_says_which_shapes_the_kernels_take():
    assert sm90_router.can_implement(512, 6, "sqrtsoftplus") and sm90_router.can_implement(8, 8, "softmax")
    assert not sm90_router.can_implement(513, 6, "sqrtsoftplus")      # 16 logits a lane
    assert not sm90_router.can_implement(4, 6, "sigmoid")             # k > E
    assert not sm90_router.can_implement(256, 33, "sigmoid")          # a lane a slot
    assert not sm90_router.can_implement(256, 6, "relu")
    with pytest.raises(ValueError, match="router kernels take"):
        Sm90RouterTopk(RouterConfig(600, 6))


def test_the_backend_runs_the_reference_off_the_gpu():
    """CPU logits (and shapes past ``can_implement``) go to the reference: same results, no kernel call."""
    from nvfp4_megamoe.runtime.hopper import HopperBackend

    be = HopperBackend()
    logits = torch.randn(5, 16, generator=torch.Generator().manual_seed(0))
    bias = torch.randn(16, generator=torch.Generator().manual_seed(1))
    args = (logits, "sqrtsoftplus", bias, None, torch.zeros(5, dtype=torch.long), 4, SCALING)
    for got, want in zip(be.route(*args), ReferenceBackend().route(*args)):
        assert torch.equal(got, want)
    assert be.kernel_calls["route"] == 0


def test_the_warm_up_registers_one_router_kernel_per_layer_kind(synth_checkpoints):
    """``HopperBackend._warm_shapes`` asks for the top-k kernel (with the bias) and the hash kernel (the checkpoint's
    tid2eid dtype), once each, whatever the layer count; both compile."""
    from nvfp4_megamoe.runtime import load_model
    from nvfp4_megamoe.runtime.hopper import HopperBackend

    model = load_model(synth_checkpoints.converted("flash", preset="tiny").output)
    cfg = model.config
    with cute_host.collecting() as jobs:
        HopperBackend()._warm_shapes(cfg, model.weights, torch.device("cpu"))
    routers = [(op, tensors) for op, tensors in jobs if isinstance(op, (Sm90RouterTopk, Sm90RouterHash))]
    kinds = {(type(op).__name__, op.config) for op, _ in routers}
    want = RouterConfig(cfg.n_routed_experts, cfg.top_k, cfg.scoring_func, float(cfg.routed_scaling_factor))
    assert kinds == {("Sm90RouterTopk", replace(want, bias=True)), ("Sm90RouterHash", want)}
    assert len(routers) == 2
    tid2eid = next(lw.moe.tid2eid for lw in model.weights.layers.values() if lw.moe.tid2eid is not None)
    hashed = next(tensors for op, tensors in routers if isinstance(op, Sm90RouterHash))
    assert hashed[1].dtype == tid2eid.dtype
    if os.environ["CUTE_DSL_ARCH"] == "sm_90a":
        for op, tensors in routers:
            assert cute_host.compile_op(op, tensors) is not None


# -- on the GPU ----------------------------------------------------------------------------------------------------

def _logits(t: int, e: int, seed: int) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(t, e, device="cuda", generator=gen) * 2


def _check_topk(logits, func, bias, k, got_ids, got_w, rtol):
    """Sets of ids per token (where the reference's choice is clear), weights matched by id, the kernel's order."""
    want_ids, want_w = ReferenceBackend().route(logits, func, bias, None, None, k, SCALING)
    assert got_ids.dtype == torch.int64 and got_w.dtype == torch.float32
    assert got_ids.shape == want_ids.shape and got_w.shape == want_w.shape
    choice = router_scores(logits, func) + (0 if bias is None else bias.float())
    ranked = choice.sort(-1, descending=True).values
    if k < logits.shape[1]:
        # absolute and relative: a score + bias near 0 keeps the score's absolute rounding
        clear = (ranked[:, k - 1] - ranked[:, k]) > 1e-5 * (1 + ranked[:, k - 1].abs())
    else:
        clear = torch.ones(logits.shape[0], dtype=torch.bool, device=logits.device)
    # random logits leave few near-ties: most tokens are compared as sets (at least one even at 1-7 tokens) ...
    assert int(clear.sum()) >= max(1, (3 * clear.numel()) // 4)
    # ... and every token's picks are among its top-k up to the near-tie margin
    picked = choice.gather(-1, got_ids).min(-1).values
    assert (picked >= ranked[:, k - 1] - 1e-5 * (1 + ranked[:, k - 1].abs())).all()
    got_sorted, order = got_ids.sort(-1)
    want_sorted, want_order = want_ids.sort(-1)
    assert torch.equal(got_sorted[clear], want_sorted[clear])
    torch.testing.assert_close(got_w.gather(-1, order)[clear], want_w.gather(-1, want_order)[clear], rtol=rtol,
                               atol=1e-9)
    # every token: distinct valid experts, non-increasing choices (within the last bits), weights summing to scaling
    assert ((got_ids >= 0) & (got_ids < logits.shape[1])).all()
    assert (got_sorted[:, 1:] != got_sorted[:, :-1]).all()
    picked = choice.gather(-1, got_ids)
    assert (picked[:, :-1] >= picked[:, 1:] - 1e-6 * (1 + picked[:, 1:].abs())).all()
    torch.testing.assert_close(got_w.sum(-1), torch.full_like(got_w[:, 0], SCALING), rtol=1e-5, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("k", [2, 6])
@pytest.mark.parametrize("t", [1, 7, 300])
@pytest.mark.parametrize("e", [64, 256, 384])
def test_topk_kernel_matches_reference(e, t, k, bias):
    logits = _logits(t, e, e + t + k)
    b = torch.randn(e, device="cuda", generator=torch.Generator(device="cuda").manual_seed(e)) if bias else None
    ids, w = sm90_route(logits, "sqrtsoftplus", b, None, None, k, SCALING)
    _check_topk(logits, "sqrtsoftplus", b, k, ids, w, rtol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("func", ["sigmoid", "softmax"])
@pytest.mark.parametrize("e,t,k", [(64, 7, 6), (256, 300, 6), (384, 1, 2), (8, 5, 2), (24, 33, 4), (512, 9, 32)])
def test_topk_kernel_other_scoring_functions_match_reference(func, e, t, k):
    logits = _logits(t, e, e * t + k)
    b = torch.randn(e, device="cuda", generator=torch.Generator(device="cuda").manual_seed(k)) * 0.1
    ids, w = sm90_route(logits, func, b, None, None, k, SCALING)
    _check_topk(logits, func, b, k, ids, w, rtol=2e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("func", sm90_router.SCORING_FUNCS)
@pytest.mark.parametrize("e", [64, 300])
def test_topk_ties_go_to_the_lower_expert_in_descending_order(func, e):
    """Integer logits and a bias of two values: many exactly equal choices (the same logit and bias give the same
    float in the kernel and in torch), so the slot order is the stable descending order of the choices."""
    gen = torch.Generator(device="cuda").manual_seed(e)
    logits = torch.randint(-3, 4, (40, e), device="cuda", generator=gen).float()
    bias = torch.randint(0, 2, (e,), device="cuda", generator=gen).float() * 0.5
    ids, w = sm90_route(logits, func, bias, None, None, 6, SCALING)
    choice = router_scores(logits, func) + bias
    want = torch.sort(choice, dim=-1, descending=True, stable=True).indices[:, :6]
    assert torch.equal(ids, want)
    s = router_scores(logits, func).gather(-1, want)
    torch.testing.assert_close(w, s / (s.sum(-1, keepdim=True) + 1e-20) * SCALING, rtol=2e-6, atol=1e-9)


def _tid2eid(e: int, k: int, rows: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Distinct experts a row, but some rows repeat one (slot 0 again last; slots 1 and 2 alike; all one expert)."""
    gen = torch.Generator().manual_seed(seed)
    tid = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(rows)])
    tid[::5, -1] = tid[::5, 0]
    if k >= 3:
        tid[1::5, 2] = tid[1::5, 1]
    tid[2::7] = tid[2::7, :1]
    return tid.to(dtype).cuda()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("k", [2, 6])
@pytest.mark.parametrize("t", [1, 7, 300])
@pytest.mark.parametrize("e", [64, 256, 384])
def test_hash_kernel_matches_reference(e, t, k, dtype):
    """The experts of each token's tid2eid row, in the row's order; repeated experts weigh 0 after their first slot."""
    rows = 1000
    tid = _tid2eid(e, k, rows, dtype, e + k)
    gen = torch.Generator(device="cuda").manual_seed(t)
    tokens = torch.randint(0, rows, (t,), device="cuda", generator=gen)
    tokens[: min(t, 3)] = torch.tensor([0, 1, 2], device="cuda")[: min(t, 3)]   # rows with repeats, at every T
    logits = _logits(t, e, e * k + t)
    ids, w = sm90_route(logits, "sqrtsoftplus", None, tid, tokens, k, SCALING)
    want_ids, want_w = ReferenceBackend().route(logits, "sqrtsoftplus", None, tid, tokens, k, SCALING)
    assert ids.dtype == torch.int64 and w.dtype == torch.float32
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(w, want_w, rtol=1e-6, atol=1e-9)
    assert (w == 0).any()   # token 0 is row 0, which repeats its first expert


@pytest.mark.gpu
@pytest.mark.parametrize("func", ["sigmoid", "softmax"])
def test_hash_kernel_other_scoring_functions_match_reference(func):
    tid = _tid2eid(256, 6, 100, torch.int64, 3)
    tokens = torch.arange(37, device="cuda", dtype=torch.int32) * 2   # int32 ids: read as int64
    logits = _logits(37, 256, 11)
    ids, w = sm90_route(logits, func, None, tid, tokens, 6, SCALING)
    want_ids, want_w = ReferenceBackend().route(logits, func, None, tid, tokens, 6, SCALING)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(w, want_w, rtol=2e-6, atol=1e-9)


@pytest.mark.gpu
@pytest.mark.parametrize("hashed", [False, True], ids=["topk", "hash"])
@pytest.mark.parametrize("t", [1, 7, 300])
def test_every_output_is_written(hashed, t):
    """Outputs poisoned first (NaN weights, -1 ids) come back with the bytes ``sm90_route`` gives."""
    e, k = 256, 6
    logits = _logits(t, e, 7 * t)
    bias = torch.randn(e, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
    tid = _tid2eid(e, k, 50, torch.int64, 5)
    tokens = torch.randint(0, 50, (t,), device="cuda", generator=torch.Generator(device="cuda").manual_seed(2))
    want = sm90_route(logits, "sqrtsoftplus", None if hashed else bias, tid if hashed else None, tokens, k, SCALING)
    ids = torch.full((t, k), -1, dtype=torch.int64, device="cuda")
    w = torch.full((t, k), float("nan"), device="cuda")
    if hashed:
        cute_host.launch(Sm90RouterHash(RouterConfig(e, k, "sqrtsoftplus", SCALING)), [logits, tid, tokens, ids, w])
    else:
        cute_host.launch(Sm90RouterTopk(RouterConfig(e, k, "sqrtsoftplus", SCALING, bias=True)),
                         [logits, bias, ids, w])
    assert torch.equal(ids, want[0]) and torch.equal(w, want[1])


@pytest.mark.gpu
def test_the_router_replays_in_a_cuda_graph():
    """No host sync: captured once, replayed on new logits, it routes them."""
    e, k, t = 256, 6, 4
    logits = _logits(t, e, 1)
    bias = torch.randn(e, device="cuda", generator=torch.Generator(device="cuda").manual_seed(2))
    sm90_route(logits, "sqrtsoftplus", bias, None, None, k, SCALING)   # compiled before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ids, w = sm90_route(logits, "sqrtsoftplus", bias, None, None, k, SCALING)
    logits.copy_(_logits(t, e, 3))
    graph.replay()
    torch.cuda.synchronize()
    _check_topk(logits, "sqrtsoftplus", bias, k, ids, w, rtol=1e-6)


@pytest.mark.gpu
def test_the_backend_routes_with_the_kernel_where_it_can():
    """``HopperBackend.route``: the kernel for CUDA logits it takes (a hash layer's too), the reference past
    ``can_implement`` (E above 512), each matching ``ReferenceBackend.route``."""
    from nvfp4_megamoe.runtime.hopper import HopperBackend

    be, ref = HopperBackend(), ReferenceBackend()
    logits = _logits(9, 256, 4)
    bias = torch.randn(256, device="cuda", generator=torch.Generator(device="cuda").manual_seed(3))
    ids, w = be.route(logits, "sqrtsoftplus", bias, None, torch.zeros(9, dtype=torch.long, device="cuda"), 6, SCALING)
    assert be.kernel_calls["route"] == 1
    _check_topk(logits, "sqrtsoftplus", bias, 6, ids, w, rtol=1e-6)
    tid = _tid2eid(256, 6, 20, torch.int32, 4)
    tokens = torch.arange(9, device="cuda")
    got = be.route(logits, "sqrtsoftplus", None, tid, tokens, 6, SCALING)
    want = ref.route(logits, "sqrtsoftplus", None, tid, tokens, 6, SCALING)
    assert be.kernel_calls["route"] == 2 and torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=1e-9)
    wide = _logits(3, 520, 5)
    got = be.route(wide, "sqrtsoftplus", None, None, tokens[:3], 6, SCALING)
    want = ref.route(wide, "sqrtsoftplus", None, None, tokens[:3], 6, SCALING)
    assert be.kernel_calls["route"] == 2 and torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
