"""Expert parallelism over ``torch.distributed``: each rank holds a contiguous range of routed experts.

``load_model(path, device=..., world="auto")`` under ``torchrun`` (the default process group
initialised) gives every rank the experts ``expert_ranges(E, size)[rank]`` of every layer (only those
bytes are read) and every other weight whole (replicated). The model's backend is wrapped in an
:class:`ExpertParallelBackend`, whose ``moe`` combines the ranks' routed-expert outputs; every other op
runs on the rank's own copy. Two combine schemes (docs/distributed.md says when to use which):

``"all_reduce"`` (default, :meth:`World.from_group`)
    Every rank runs the *same* tokens (same ``input_ids``, replicated dense parts, identical routing);
    each computes the partial sum of the experts it holds (pairs routed elsewhere contribute 0, the
    backends' existing ``experts=(start, stop)`` contract) and one ``all_reduce(SUM)`` of the
    [tokens, H] float32 output per layer combines them.

``"all_to_all"``
    Every rank runs *its own* tokens (data-parallel dense parts: different sequences per rank, any
    count, possibly different positions). Per layer each rank routes its tokens, sends every token
    once to each rank that holds one of its experts (with the token's full top-k ids and weights),
    the receiver computes its partial sum for them, and a second all-to-all brings the partial
    outputs back, where they are added per token. All ranks must call the forward the same number of
    times (the collectives run once per layer).

Only the routed MoE crosses ranks; the shared expert, attention, mHC, router and head are replicated.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

COMBINES = ("all_reduce", "all_to_all")


def expert_ranges(n_experts: int, size: int) -> list[tuple[int, int]]:
    """Contiguous ``[start, stop)`` per rank, as even as possible: the first ``n_experts % size``
    ranks hold one expert more. Every rank holds at least one (``size <= n_experts``)."""
    if size < 1:
        raise ValueError(f"world size must be >= 1, got {size}")
    if size > n_experts:
        raise ValueError(f"{size} ranks for {n_experts} routed experts: every rank must hold at least one")
    base, extra = divmod(n_experts, size)
    ranges, start = [], 0
    for r in range(size):
        stop = start + base + (r < extra)
        ranges.append((start, stop))
        start = stop
    return ranges


@dataclass(frozen=True)
class World:
    """This process's place in an expert-parallel group.

    ``rank``/``size`` are within ``group`` (``None`` = the default process group); ``combine`` is
    ``"all_reduce"`` (ranks run the same tokens) or ``"all_to_all"`` (ranks run their own tokens).
    """

    rank: int
    size: int
    group: Any = None
    combine: str = "all_reduce"

    def __post_init__(self):
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} outside a world of size {self.size}")
        if self.combine not in COMBINES:
            raise ValueError(f"combine={self.combine!r}: expected one of {COMBINES}")

    @classmethod
    def from_group(cls, group=None, combine: str = "all_reduce") -> "World":
        """The world of an initialised process group (default: the default group)."""
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("torch.distributed is not initialised: call torch.distributed.init_process_group "
                               "first (torchrun sets the environment for it), or use "
                               "nvfp4_megamoe.runtime.distributed.init_distributed()")
        return cls(dist.get_rank(group), dist.get_world_size(group), group, combine)

    def expert_range(self, n_experts: int) -> tuple[int, int]:
        return expert_ranges(n_experts, self.size)[self.rank]


def resolve_world(world) -> World | None:
    """``None`` -> single process; ``"auto"`` -> the default group's world (all-reduce combine) when
    ``torch.distributed`` is initialised, else single process; ``"all_reduce"``/``"all_to_all"`` -> the
    default group with that combine (initialised group required); a :class:`World` as is."""
    if world is None or isinstance(world, World):
        return world
    if world == "auto":
        return World.from_group() if dist.is_available() and dist.is_initialized() else None
    if world in COMBINES:
        return World.from_group(combine=world)
    raise TypeError(f"world={world!r}: expected None, 'auto', 'all_reduce', 'all_to_all' or a World")


def init_distributed(backend: str | None = None, combine: str = "all_reduce", **kwargs) -> tuple[World, torch.device]:
    """For scripts run by ``torchrun``: initialise the default group (NCCL when CUDA is available,
    else gloo; ``kwargs`` go to ``init_process_group``, e.g. ``timeout``) if it is not yet, bind this
    process to GPU ``LOCAL_RANK``; returns (world, device)."""
    cuda = torch.cuda.is_available() and backend != "gloo"
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend or ("nccl" if cuda else "gloo"), **kwargs)
    return World.from_group(combine=combine), device


class ExpertParallelBackend:
    """Wraps a backend (reference or Hopper): ``moe`` combines across the world's ranks, every other
    op (and attribute) is the wrapped backend's."""

    def __init__(self, inner, world: World):
        self.inner, self.world = inner, world
        self.name = f"{inner.name}+ep{world.size}:{world.combine}"
        self.comm_calls = 0

    def __getattr__(self, name):  # only reached for attributes not set here
        if name == "inner":  # not set yet (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    def moe(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts, swiglu_limit: float):
        """Routed experts of the whole world for this rank's tokens: x [N, H], ids/weights [N, k] (global
        expert ids) -> float32 [N, H]; ``experts`` holds this rank's range."""
        self.comm_calls += 1
        if self.world.combine == "all_reduce":
            out = self.inner.moe(x, ids, weights, experts, swiglu_limit)
            dist.all_reduce(out, op=dist.ReduceOp.SUM, group=self.world.group)
            return out
        return self._moe_all_to_all(x, ids, weights, experts, swiglu_limit)

    def _moe_all_to_all(self, x, ids, weights, experts, swiglu_limit):
        world, group = self.world, self.world.group
        n, d = x.shape
        k = ids.shape[1]
        dev = x.device
        stops = [stop for _, stop in expert_ranges(experts.n_experts, world.size)[:-1]]
        owner = torch.bucketize(ids, torch.tensor(stops, dtype=ids.dtype, device=dev), right=True)  # [N, k]
        needs = torch.zeros(world.size, n, dtype=torch.bool, device=dev)
        needs.scatter_(0, owner.T, True)                          # needs[r, t]: token t has an expert on r
        _, token = needs.nonzero(as_tuple=True)                  # grouped by destination rank, then token
        send_counts = needs.sum(1)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=group)
        sc, rc = send_counts.tolist(), recv_counts.tolist()
        # One message per (token, rank): the activation row, its k weights and k global ids
        # (ids < 2^24 are exact in float32), so a single all-to-all dispatches everything.
        send = torch.cat((x[token].float(), weights[token].float(), ids[token].float()), dim=1)
        recv = send.new_empty(sum(rc), d + 2 * k)
        dist.all_to_all_single(recv, send, rc, sc, group=group)
        if recv.shape[0]:
            xr, wr, ir = recv.split((d, k, k), dim=1)
            part = self.inner.moe(xr.contiguous(), ir.long(), wr.contiguous(), experts, swiglu_limit)
        else:
            part = recv.new_zeros(0, d)
        back = part.new_empty(token.numel(), d)
        dist.all_to_all_single(back, part.float().contiguous(), sc, rc, group=group)
        out = torch.zeros(n, d, dtype=torch.float32, device=dev)
        out.index_add_(0, token, back)
        return out
