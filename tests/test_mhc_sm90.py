"""The mHC kernels (``kernels/sm90_mhc.py``, ``hc_pre`` and ``hc_post``): compiled for sm_90a on the CPU (CI), and on
the H200 against ``mhc_reference`` (float32 torch ops, marked ``gpu``)."""

from __future__ import annotations

import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed")

from nvfp4_megamoe.kernels.mhc_reference import hc_post, hc_pre  # noqa: E402
from nvfp4_megamoe.kernels.sm90_config import HcPreFusedConfig  # noqa: E402
from nvfp4_megamoe.kernels.sm90_heuristics import hc_pre_fused_config  # noqa: E402
from nvfp4_megamoe.kernels.sm90_mhc import (Sm90HcPost, Sm90HcPre, Sm90HcPreFused, fused_operands,  # noqa: E402
                                            sm90_hc_post, sm90_hc_pre, sm90_hc_pre_fused)
from numeric import rel_err  # noqa: E402
from sm90_stand_ins import hc_post_args, hc_pre_args  # noqa: E402


@pytest.mark.skipif(os.environ["CUTE_DSL_ARCH"] != "sm_90a", reason="CUTE_DSL_ARCH names another target")
@pytest.mark.parametrize("hc,iters,norm", [(4, 20, False), (4, 20, True), (2, 1, False)])
def test_hc_pre_compiles_sm90a(hc, iters, norm):
    from nvfp4_megamoe.kernels.cute_host import compile_op
    op = Sm90HcPre(hc=hc, iters=iters, hc_eps=1e-6, norm_eps=1e-6, norm=norm)
    assert compile_op(op, hc_pre_args(hc)) is not None
    assert Sm90HcPre.can_implement(4, 8192, norm=True) and not Sm90HcPre.can_implement(4, 8196, norm=True)
    with pytest.raises(ValueError, match="hc must be"):
        Sm90HcPre(hc=3, iters=20, hc_eps=1e-6, norm_eps=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("lead,hc,h,iters,broadcast", [((1,), 4, 4096, 20, False), ((1,), 4, 4096, 20, True),
                                                       ((3, 37), 4, 1024, 20, False), ((300,), 4, 256, 1, False),
                                                       ((2, 5), 2, 7168, 7, False)])
def test_hc_pre_kernel_matches_reference(lead, hc, h, iters, broadcast):
    """Sublayer input, post and comb against the reference; mixes of a few units (saturated sigmoids too);
    ``broadcast``: the embedding's streams, one row expanded over the hc streams (not contiguous)."""
    gen = torch.Generator(device="cuda").manual_seed(hc * iters + len(lead) + h)
    m = (2 + hc) * hc
    if broadcast:
        x = torch.randn(*lead, 1, h, device="cuda", generator=gen).expand(*lead, hc, h)
    else:
        x = torch.randn(*lead, hc, h, device="cuda", generator=gen) * 3
    fn = torch.randn(m, hc * h, device="cuda", generator=gen) * (4 / (hc * h) ** 0.5)
    base = torch.randn(m, device="cuda", generator=gen)
    scale = torch.rand(3, device="cuda", generator=gen) + 0.5
    got = sm90_hc_pre(x, fn, base, scale, iters=iters, hc_eps=1e-6, norm_eps=1e-6)
    want = hc_pre(x, fn, base, scale, iters=iters, hc_eps=1e-6, norm_eps=1e-6)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == torch.float32 and g.isfinite().all()
        assert rel_err(g, w) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("lead,hc,h", [((1,), 4, 4096), ((3, 37), 4, 7168), ((300,), 4, 256), ((2,), 2, 8192)])
def test_hc_pre_with_the_sublayer_norm_matches_reference(lead, hc, h):
    """The sublayer input RMS-normalised and scaled by its weight in the same launch (the collapse kept in
    registers: 1 or 2 pieces a thread, most threads idle at H = 256), against the reference's collapse then
    RMSNorm; post and comb as without the norm."""
    from nvfp4_megamoe.runtime.backend import ReferenceBackend

    gen = torch.Generator(device="cuda").manual_seed(hc + h + len(lead))
    m = (2 + hc) * hc
    x = torch.randn(*lead, hc, h, device="cuda", generator=gen) * 3
    fn = torch.randn(m, hc * h, device="cuda", generator=gen) * (4 / (hc * h) ** 0.5)
    base = torch.randn(m, device="cuda", generator=gen)
    scale = torch.rand(3, device="cuda", generator=gen) + 0.5
    weight = (torch.rand(h, device="cuda", generator=gen) + 0.5).to(torch.bfloat16)
    kw = dict(iters=20, hc_eps=1e-6, norm_eps=1e-6)
    got = sm90_hc_pre(x, fn, base, scale, norm_weight=weight.float(), **kw)
    want = ReferenceBackend().hc_pre(x, fn, base, scale, norm_weight=weight, **kw)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == torch.float32 and g.isfinite().all()
        assert rel_err(g, w) < 1e-5


@pytest.mark.skipif(os.environ["CUTE_DSL_ARCH"] != "sm_90a", reason="CUTE_DSL_ARCH names another target")
@pytest.mark.parametrize("hidden", [4096, 7168])
@pytest.mark.parametrize("tokens,norm", [(1, True), (1, False), (64, True)])
def test_hc_pre_fused_compiles_sm90a(hidden, tokens, norm):
    """V4-Flash's and V4-Pro's widths with the cluster the heuristic picks (16 CTAs at one token, 8 at 64)."""
    from nvfp4_megamoe.kernels.cute_host import compile_op
    config = hc_pre_fused_config(4, hidden, tokens, iters=20, hc_eps=1e-6, norm_eps=1e-6, norm=norm)
    assert config.cluster == (16 if tokens == 1 else 8) and config.threads == 4 * hidden // (4 * config.cluster)
    assert compile_op(Sm90HcPreFused(config), fused_operands(config, "cpu")) is not None


def test_hc_pre_fused_config_bounds():
    """A cluster cuts H into 16-byte pieces and a CTA holds one piece a thread; anything else is refused."""
    kw = dict(hc=4, iters=20, hc_eps=1e-6, norm_eps=1e-6)
    assert Sm90HcPreFused.can_implement(HcPreFusedConfig(hidden=7168, cluster=16, **kw))
    assert not Sm90HcPreFused.can_implement(HcPreFusedConfig(hidden=7168, cluster=4, **kw))   # 1792 threads
    assert not Sm90HcPreFused.can_implement(HcPreFusedConfig(hidden=4100, cluster=16, **kw))  # 4100 / 16 / 4
    assert not Sm90HcPreFused.can_implement(HcPreFusedConfig(hidden=4096, cluster=3, **kw))
    picks = {t: hc_pre_fused_config(4, 4096, t, **{k: v for k, v in kw.items() if k != "hc"}).cluster for t in (1, 4, 8, 200)}
    assert picks == {1: 16, 4: 16, 8: 8, 200: 8}   # 16 CTAs while the grid fills at most half of 132 SMs
    with pytest.raises(ValueError, match="hc_pre with its product"):
        Sm90HcPreFused(HcPreFusedConfig(hidden=4096, cluster=16, **{**kw, "hc": 3}))


@pytest.mark.skipif(os.environ["CUTE_DSL_ARCH"] != "sm_90a", reason="CUTE_DSL_ARCH names another target")
@pytest.mark.parametrize("hc,dtype", [(4, torch.bfloat16), (4, torch.float32), (1, torch.bfloat16)])
def test_hc_post_compiles_sm90a(hc, dtype):
    from nvfp4_megamoe.kernels.cute_host import compile_op
    assert compile_op(Sm90HcPost(hc=hc), hc_post_args(hc, dtype=dtype)) is not None
    with pytest.raises(ValueError, match="hc must be"):
        Sm90HcPost(hc=8)


@pytest.mark.gpu
@pytest.mark.parametrize("lead,hc,h,dtype,broadcast", [((1,), 4, 4096, torch.bfloat16, False),
                                                       ((1,), 4, 4096, torch.float32, True),
                                                       ((3, 37), 4, 1024, torch.bfloat16, False),
                                                       ((300,), 2, 256, torch.float32, False)])
def test_hc_post_kernel_matches_reference(lead, hc, h, dtype, broadcast):
    """New streams against the reference, the output poisoned first; ``broadcast``: the embedding's streams."""
    gen = torch.Generator(device="cuda").manual_seed(hc + len(lead) + h)
    if broadcast:
        x = torch.randn(*lead, 1, h, device="cuda", generator=gen).expand(*lead, hc, h)
    else:
        x = torch.randn(*lead, hc, h, device="cuda", generator=gen) * 3
    out = torch.randn(*lead, h, device="cuda", generator=gen).to(dtype)
    post = torch.rand(*lead, hc, device="cuda", generator=gen) * 2
    comb = torch.rand(*lead, hc, hc, device="cuda", generator=gen)
    comb = comb / comb.sum(-2, keepdim=True)
    want = hc_post(out, x, post, comb)
    got = sm90_hc_post(out, x, post, comb)
    assert got.shape == want.shape and got.dtype == torch.float32 and got.isfinite().all()
    assert rel_err(got, want) < 1e-6
    from nvfp4_megamoe.kernels.cute_host import launch
    n = want.numel() // (hc * h)
    poisoned = torch.full((n, hc * h), float("nan"), device="cuda")
    launch(Sm90HcPost(hc=hc), [out.reshape(n, h), x.float().reshape(n, hc * h).contiguous(),
                               post.reshape(n, hc), comb.reshape(n, hc * hc), poisoned])
    assert torch.equal(poisoned.view_as(got), got)  # every element written, the same bytes


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 3, 64])
@pytest.mark.parametrize("h,norm,cluster", [(4096, True, None), (7168, True, None), (4096, False, None),
                                             (4096, True, 8), (7168, True, 8), (1024, True, 1)])
def test_hc_pre_fused_matches_reference_and_sm90_hc_pre(n, h, norm, cluster):
    """The fused kernel (the product by fn in the cluster) against the reference (and the sublayer's RMSNorm after it)
    and against ``sm90_hc_pre`` (cuBLAS's product, then one CTA a token): every output poisoned first, so that an
    element no CTA writes shows as NaN; then two launches give the same bytes (the partials are added in a fixed
    order)."""
    from nvfp4_megamoe.kernels.cute_host import launch
    from nvfp4_megamoe.runtime.backend import ReferenceBackend

    hc, m = 4, 24
    gen = torch.Generator(device="cuda").manual_seed(n * 7 + h + int(norm))
    x = torch.randn(n, hc, h, device="cuda", generator=gen) * 3
    fn = torch.randn(m, hc * h, device="cuda", generator=gen) * (4 / (hc * h) ** 0.5)
    base = torch.randn(m, device="cuda", generator=gen)
    scale = torch.rand(3, device="cuda", generator=gen) + 0.5
    weight = (torch.rand(h, device="cuda", generator=gen) + 0.5).to(torch.bfloat16).float() if norm else None
    kw = dict(iters=20, hc_eps=1e-6, norm_eps=1e-6, norm_weight=weight)
    want = ReferenceBackend().hc_pre(x, fn, base, scale, **kw)
    today = sm90_hc_pre(x, fn, base, scale, **kw)
    config = hc_pre_fused_config(hc, h, n, iters=20, hc_eps=1e-6, norm_eps=1e-6, norm=norm)
    if cluster is not None:
        from dataclasses import replace
        config = replace(config, cluster=cluster)
    outs = [torch.full(shape, float("nan"), device="cuda") for shape in ((n, h), (n, hc), (n, hc), (n, hc * hc))]
    launch(Sm90HcPreFused(config), [x.reshape(n, hc * h).contiguous(), fn, base, scale, *outs,
                                    weight if norm else scale])
    out, pre, post, comb = outs
    got = (out, post, comb.view(n, hc, hc))
    for g, w, o in zip(got, want, today):
        assert g.isfinite().all(), "an element no CTA wrote (NaN poison) or a non-finite result"
        assert rel_err(g, w.reshape(g.shape)) < 1e-5
        assert rel_err(g, o.reshape(g.shape)) < 1e-5
    want_pre = torch.sigmoid((x.flatten(1) * torch.rsqrt(x.flatten(1).square().mean(-1, keepdim=True) + 1e-6))
                             @ fn[:hc].T * scale[0] + base[:hc]) + 1e-6
    assert rel_err(pre, want_pre) < 1e-5
    again = sm90_hc_pre_fused(x, fn, base, scale, cluster=config.cluster, **kw)
    assert all(torch.equal(a.reshape(g.shape), g) for a, g in zip(again, got))
