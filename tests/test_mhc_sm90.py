"""The mHC weights kernel (``kernels/sm90_mhc.py``): compiled for sm_90a on the CPU (CI), and on the H200
against ``mhc_reference.hc_weights`` (marked ``gpu``)."""

from __future__ import annotations

import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed")

from nvfp4_megamoe.kernels.mhc_reference import hc_weights  # noqa: E402
from nvfp4_megamoe.kernels.sm90_mhc import Sm90HcWeights, sm90_hc_weights  # noqa: E402
from numeric import rel_err  # noqa: E402
from sm90_stand_ins import hc_weights_args  # noqa: E402


@pytest.mark.skipif(os.environ["CUTE_DSL_ARCH"] != "sm_90a", reason="CUTE_DSL_ARCH names another target")
@pytest.mark.parametrize("hc,iters", [(4, 20), (2, 1)])
def test_hc_weights_compiles_sm90a(hc, iters):
    from nvfp4_megamoe.kernels.cute_host import compile_op
    assert compile_op(Sm90HcWeights(hc=hc, iters=iters, hc_eps=1e-6), hc_weights_args(hc)) is not None
    with pytest.raises(ValueError, match="hc must be"):
        Sm90HcWeights(hc=9, iters=20, hc_eps=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("lead,hc,iters", [((1,), 4, 20), ((3, 37), 4, 20), ((300,), 4, 1), ((2, 5), 2, 7)])
def test_hc_weights_kernel_matches_reference(lead, hc, iters):
    gen = torch.Generator(device="cuda").manual_seed(hc * iters + len(lead))
    m = (2 + hc) * hc
    mixes = torch.randn(*lead, m, device="cuda", generator=gen) * 4        # saturated sigmoids too
    base = torch.randn(m, device="cuda", generator=gen)
    scale = torch.rand(3, device="cuda", generator=gen) + 0.5
    got = sm90_hc_weights(mixes, base, scale, hc=hc, iters=iters, hc_eps=1e-6)
    want = hc_weights(mixes.double(), base.double(), scale.double(), hc=hc, iters=iters, hc_eps=1e-6)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == torch.float32
        assert rel_err(g, w) < 1e-5
