"""K orders of the activations (the B operand) the SM90 MoE kernels read.

The kernels decode a lane quad's 16 weight bytes (a contiguous run of 32 k) into MMA fragments whose
k slots are not in memory order: in a 128-k tile, lane quad ``c`` feeds MMA step ``s = 2 w + u`` the
logical k ``32 c + 8 w + 2 u + hi + 4 e`` in fragment slot (hi, e) (``sm90_moe_gemm``). An activation
row stored in that order is read with no ``prmt`` (``"lane"``: the mma.sync kernels' register words)
or copied into shared memory as is, 16 bytes at a time (``"staged"``: the WGMMA kernels' staged tile).
``"logical"`` is plain memory order.

Split logical k inside each 128-k block as ``32 c + 8 w + 4 e + 2 u + hi``; a row in order ...

* ``"lane"`` stores axes (c, w, u, hi, e): word ``4 w + 2 u + hi`` of quad ``c``'s run is the B register
  (k, k + 4) of step s;
* ``"staged"`` stores axes (w, u, hi, c, e): 16-byte chunk ``2 s + hi`` holds every quad's pair of step s,
  the column order of the WGMMA kernels' shared tile.

Rows must hold a multiple of 128 elements. :func:`to_order` / :func:`from_order` are the pair on tensors,
:func:`position` the same map for one index (ints or DSL ``Int32``), as the kernels' epilogues use it.
"""

from __future__ import annotations

import torch

ORDERS = ("logical", "lane", "staged")
_SPLIT = (4, 4, 2, 2, 2)                                   # (c, w, e, u, hi) of k inside a 128-k block
_AXES = {"lane": (0, 1, 3, 4, 2), "staged": (1, 3, 4, 0, 2)}  # stored axes, as indices into _SPLIT


def _check(x: torch.Tensor, order: str) -> None:
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    if x.shape[-1] % 128:
        raise ValueError(f"rows must hold a multiple of 128 elements, got {x.shape[-1]}")


def to_order(x: torch.Tensor, order: str, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` [..., K] in logical order -> the same values in ``order`` (into ``out`` when given)."""
    _check(x, order)
    lead, k = tuple(x.shape[:-1]), x.shape[-1]
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if order == "logical":
        return out.copy_(x)
    src = x.reshape(*lead, k // 128, *_SPLIT).permute(*range(len(lead) + 1), *(len(lead) + 1 + a for a in _AXES[order]))
    out.view(*lead, k // 128, *(_SPLIT[a] for a in _AXES[order])).copy_(src)
    return out


def from_order(x: torch.Tensor, order: str) -> torch.Tensor:
    """Inverse of :func:`to_order`: ``x`` [..., K] in ``order`` -> logical order (a new tensor)."""
    _check(x, order)
    lead, k = tuple(x.shape[:-1]), x.shape[-1]
    if order == "logical":
        return x.clone()
    inv = sorted(range(5), key=lambda i: _AXES[order][i])
    stored = x.reshape(*lead, k // 128, *(_SPLIT[a] for a in _AXES[order]))
    return stored.permute(*range(len(lead) + 1), *(len(lead) + 1 + i for i in inv)).reshape(x.shape).contiguous()


def position(j, order: str):
    """Stored position of logical index ``j`` of a row (``order`` a compile-time constant)."""
    if order == "lane":
        return (j & -8) | (((j >> 1) & 1) << 2) | ((j & 1) << 1) | ((j >> 2) & 1)
    if order == "staged":
        return ((j & -128) | (((j >> 3) & 3) << 5) | (((j >> 1) & 1) << 4) | ((j & 1) << 3)
                | (((j >> 5) & 3) << 1) | ((j >> 2) & 1))
    if order == "logical":
        return j
    raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
