"""PyTorch reference for manifold-constrained hyper-connections (mHC) and the hc head.

The residual is ``hc`` streams ``x`` [..., hc, H]. Before a sublayer, an unweighted RMS norm over
the flattened ``hc*H`` vector, times ``fn`` [(2+hc)*hc, hc*H], gives the mixes; with ``scale`` [3]
and ``base`` [(2+hc)*hc]:

* ``pre  = sigmoid(m[:hc] * scale[0] + base[:hc]) + eps``  (collapse weights, sublayer input = sum pre_i x_i)
* ``post = 2 * sigmoid(m[hc:2hc] * scale[1] + base[hc:2hc])``
* ``comb = softmax_rows(m[2hc:] * scale[2] + base[2hc:]) + eps``, then Sinkhorn: one column
  normalisation, then ``iters - 1`` rounds of (row, column) normalisation, each dividing by
  ``sum + eps``.

After the sublayer: ``x'_j = post_j * out + sum_i comb[i, j] * x_i``. All of it runs in float32.
"""

from __future__ import annotations

import torch


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)


def hc_mixes(x: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> torch.Tensor:
    """Streams [..., hc, H] -> the raw mixes [..., (2+hc)*hc]: unweighted RMS norm of ``hc*H``, times ``fn``."""
    return _rms(x.float().flatten(-2), norm_eps) @ fn.float().T


def hc_weights(mixes: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, *, hc: int, iters: int,
               hc_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mixes [..., (2+hc)*hc] -> (pre [..., hc], post [..., hc], comb [..., hc, hc]) (module docstring)."""
    base, scale = base.float(), scale.float()
    pre = torch.sigmoid(mixes[..., :hc] * scale[0] + base[:hc]) + hc_eps
    post = 2 * torch.sigmoid(mixes[..., hc:2 * hc] * scale[1] + base[hc:2 * hc])
    logits = mixes[..., 2 * hc:] * scale[2] + base[2 * hc:]
    comb = torch.softmax(logits.unflatten(-1, (hc, hc)), dim=-1) + hc_eps
    comb = comb / (comb.sum(-2, keepdim=True) + hc_eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(-2, keepdim=True) + hc_eps)
    return pre, post, comb


def hc_pre(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, *,
           iters: int, hc_eps: float, norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Streams [..., hc, H] -> (sublayer input [..., H], post [..., hc], comb [..., hc, hc])."""
    pre, post, comb = hc_weights(hc_mixes(x, fn, norm_eps), base, scale, hc=x.shape[-2], iters=iters, hc_eps=hc_eps)
    return hc_collapse(x, pre), post, comb


def hc_collapse(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """Streams [..., hc, H] and weights [..., hc] -> ``sum_i pre_i x_i`` [..., H]."""
    return (pre.unsqueeze(-1) * x.float()).sum(-2)


def hc_post(out: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """Sublayer output [..., H], streams [..., hc, H] -> new streams ``post_j out + sum_i comb[i,j] x_i``."""
    return post.unsqueeze(-1) * out.float().unsqueeze(-2) + comb.transpose(-1, -2) @ x.float()


def hc_head(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, *,
            hc_eps: float, norm_eps: float) -> torch.Tensor:
    """Final collapse of the streams [..., hc, H] -> [..., H] with ``pre = sigmoid(m*scale + base) + eps``."""
    pre = torch.sigmoid(hc_mixes(x, fn, norm_eps) * scale.float() + base.float()) + hc_eps
    return hc_collapse(x, pre)
