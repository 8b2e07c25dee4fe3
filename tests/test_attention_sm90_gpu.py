"""GPU checks of the SM90 decode attention against the float32 PyTorch reference.

Random data drawn fresh per case, outputs poisoned with NaN before each run, windows partly filled,
top-k lists shorter than k (-1 padding scattered, not only at the tail), repeated indices, heads 64 and
128, window-only / CSA (indexed) / HCA (dense) forms, one split and several: merged by the combine kernel,
or by a cluster of CTAs through distributed shared memory.
"""

from __future__ import annotations

import pytest
import torch

from nvfp4_megamoe.kernels.decode_attention_reference import decode_attention_reference
from nvfp4_megamoe.kernels.indexer_reference import indexer_scores, select_topk

from numeric import rel_err

pytestmark = pytest.mark.gpu  # tests/conftest.py skips it without an sm_90 GPU

SCALE = 512 ** -0.5


def make_case(b: int, h: int, n: int, k: int | None, mode: str, seed: int, w: int = 128):
    """Inputs on the GPU. ``k``: indices per request (CSA); some requests get fewer (-1 padding)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dev = "cuda"
    q = torch.randn(b, h, 512, device=dev, generator=gen).bfloat16()
    kvw = torch.randn(b, w, 512, device=dev, generator=gen).bfloat16()
    wlen = torch.randint(1, w + 1, (b,), device=dev, generator=gen, dtype=torch.int32)
    wlen[0] = w                                                     # one full ring, the rest partly filled
    kvc = idx = None
    if mode != "window":
        kvc = torch.randn(b, n, 512, device=dev, generator=gen).bfloat16()
    if mode == "indexed":
        idx = torch.argsort(torch.rand(b, n, device=dev, generator=gen), dim=1)[:, :k].int()
        lengths = torch.randint(0, k + 1, (b,), device=dev, generator=gen)
        lengths[0] = k
        pad = torch.arange(k, device=dev)[None] >= lengths[:, None]
        # scatter the padding: permute each row so -1 entries are not only at the tail
        perm = torch.argsort(torch.rand(b, k, device=dev, generator=gen), dim=1)
        idx = torch.gather(idx.masked_fill(pad, -1), 1, perm).contiguous()
        if b > 1 and k > 4:
            idx[1, 1] = idx[1, 0] if idx[1, 0] >= 0 else idx[1, 1]  # a repeated entry counts twice
    sink = torch.randn(h, device=dev, generator=gen) * 2
    return q, kvw, wlen, kvc, idx, sink


CASES = [  # b, h, n (compressed entries), k (indices), mode, splits (None: heuristic)
    (1, 64, 1024, 512, "indexed", None),
    (3, 64, 700, 512, "indexed", 1),
    (5, 128, 2000, 1024, "indexed", None),
    (2, 128, 300, 100, "indexed", 4),
    (8, 64, 0, None, "window", None),
    (2, 128, 0, None, "window", 1),
    (4, 64, 512, None, "dense", None),
    (2, 128, 8192, None, "dense", None),
    (33, 64, 32, None, "dense", 1),
    (16, 128, 777, 512, "indexed", None),
]


def indexer_topk(q, keys, weights, k, n_valid=None):
    """The GPU backend's indexer top-k (the kernels where they apply, as the runtime runs it)."""
    from nvfp4_megamoe.runtime.hopper import HopperBackend
    nv = torch.full((q.shape[0],), keys.shape[1], device=q.device) if n_valid is None else n_valid
    return HopperBackend().indexer_topk(q, keys, weights, k, nv)


def check_against_reference(b: int, h: int, n: int, k: int | None, mode: str, seed: int, **options) -> None:
    """``sm90_decode_attention(**options)`` into a NaN-poisoned output: every element written, relative error
    to the float32 reference below 1e-2."""
    from nvfp4_megamoe.kernels.sm90_decode_attention import sm90_decode_attention as decode_attention
    q, kvw, wlen, kvc, idx, sink = make_case(b, h, n, k, mode, seed=seed)
    ref = decode_attention_reference(q, kvw, wlen, kvc, idx, sink, SCALE)
    out = torch.full((b, h, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    decode_attention(q, kvw, wlen, kvc, idx, sink, SCALE, out=out, **options)
    torch.cuda.synchronize()
    assert not out.isnan().any(), "unwritten (NaN-poisoned) outputs remain"
    err = rel_err(out, ref)
    assert err < 1e-2, f"relative error {err:.3e}"


@pytest.mark.parametrize("b,h,n,k,mode,splits", CASES)
def test_decode_attention_matches_reference(b, h, n, k, mode, splits):
    check_against_reference(b, h, n, k, mode, b * 1000 + h + n, splits=splits)


CLUSTER_CASES = [  # b, h, n, k, mode, cluster (= the splits of a head block)
    (1, 64, 1024, 512, "indexed", 4),
    (3, 64, 300, 100, "indexed", 2),
    (2, 128, 8192, None, "dense", 4),
    (2, 64, 40, None, "dense", 4),            # more splits than chunks: empty CTAs still merge
    (8, 64, 0, None, "window", 4),
    (5, 128, 2000, 1024, "indexed", 4),
]


@pytest.mark.parametrize("b,h,n,k,mode,cluster", CLUSTER_CASES)
def test_cluster_merge_matches_reference(b, h, n, k, mode, cluster):
    check_against_reference(b, h, n, k, mode, b * 100 + cluster, cluster=cluster)


def test_all_masked_gives_zero_and_sink_only():
    """No valid entry at all: the sink takes all the mass, the output is 0 (not NaN)."""
    from nvfp4_megamoe.kernels.sm90_decode_attention import sm90_decode_attention as decode_attention
    q, kvw, wlen, kvc, idx, sink = make_case(2, 64, 256, 64, "indexed", seed=7)
    wlen.zero_()
    idx.fill_(-1)
    for splits, cluster in ((1, 1), (3, 1), (4, 4), (2, 2)):
        out = torch.full((2, 64, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
        decode_attention(q, kvw, wlen, kvc, idx, sink, SCALE, out=out, splits=splits, cluster=cluster)
        torch.cuda.synchronize()
        assert bool((out == 0).all()), (splits, cluster)


def test_graph_capture_replays():
    from nvfp4_megamoe.kernels.sm90_decode_attention import sm90_decode_attention as decode_attention
    q, kvw, wlen, kvc, idx, sink = make_case(4, 64, 1024, 512, "indexed", seed=11)
    out = torch.empty(4, 64, 512, dtype=torch.bfloat16, device="cuda")
    decode_attention(q, kvw, wlen, kvc, idx, sink, SCALE, out=out)             # warm-up: compile + workspaces
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode_attention(q, kvw, wlen, kvc, idx, sink, SCALE, out=out)
    q.copy_(torch.randn_like(q, dtype=torch.float32).bfloat16())
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(out, decode_attention_reference(q, kvw, wlen, kvc, idx, sink, SCALE)) < 1e-2


@pytest.mark.parametrize("b,n,k", [(4, 1024, 512), (2, 5000, 1024), (3, 300, 512)])
def test_indexer_topk_gpu(b, n, k):
    gen = torch.Generator(device="cuda").manual_seed(n)
    q = torch.randn(b, 64, 128, device="cuda", generator=gen).bfloat16()
    keys = torch.randn(b, n, 128, device="cuda", generator=gen).bfloat16()
    wts = torch.randn(b, 64, device="cuda", generator=gen)
    nv = torch.randint(1, n + 1, (b,), device="cuda", generator=gen)
    got = indexer_topk(q, keys, wts, k, nv)
    scores = indexer_scores(q[:, None], keys, wts[:, None])[:, 0]             # float32 reference
    visible = torch.arange(n, device="cuda")[None] < nv[:, None]
    want = select_topk(scores[:, None], visible[:, None], k)[:, 0]
    for i in range(b):
        sel = got[i][got[i] >= 0].long()
        assert len(sel) == int(want[i].sum()) == min(k, int(nv[i]))
        assert len(set(sel.tolist())) == len(sel) and bool(visible[i, sel].all())
        # same set up to near-ties at the cut: every pick scores at least the reference's k-th best
        kth = scores[i][want[i]].min()
        assert float(scores[i, sel].min()) >= float(kth) - 1e-4 * float(scores[i].abs().max())


@pytest.mark.parametrize("b,h,d,n,short", [(1, 64, 128, 1024, False), (3, 64, 128, 5000, True),
                                           (2, 8, 64, 77, True), (130, 64, 128, 300, False)])
def test_indexer_scores_kernel_matches_float32_reference(b, h, d, n, short):
    """The fused score kernel (keys streamed once, int64 order keys out) against the float32 reference,
    -inf past n_valid."""
    from nvfp4_megamoe.kernels.indexer_keys import scores_of_key
    from nvfp4_megamoe.kernels.sm90_indexer import Sm90IndexerScores
    from nvfp4_megamoe.kernels.sm90_indexer import sm90_indexer_keys as indexer_keys
    assert Sm90IndexerScores.can_implement(h, d)
    gen = torch.Generator(device="cuda").manual_seed(b * n + h)
    q = torch.randn(b, h, d, device="cuda", generator=gen).bfloat16()
    keys = torch.randn(b, n, d, device="cuda", generator=gen).bfloat16()
    wts = torch.randn(b, h, device="cuda", generator=gen)
    nv = torch.randint(1, n + 1, (b,), device="cuda", generator=gen) if short else None
    key = indexer_keys(q, keys, wts, nv)
    rev = 0xFFFFFFFF - torch.arange(n, device="cuda")
    assert torch.equal(key & 0xFFFFFFFF, rev.expand(b, n))                    # the complemented entry index
    got = scores_of_key(key)
    want = indexer_scores(q[:, None].float(), keys.float(), wts[:, None])[:, 0]             # float32 reference
    visible = torch.ones(b, n, dtype=torch.bool, device="cuda") if nv is None else \
        torch.arange(n, device="cuda")[None] < nv[:, None]
    assert bool(torch.isneginf(got[~visible]).all()) and bool(torch.isfinite(got[visible]).all())
    assert rel_err(got[visible], want[visible]) < 1e-5


def test_indexer_kernel_ties_pick_lower_index():
    """All-zero queries: every score is +0.0 (no -0.0 from negative weights), so the top-k is the first k."""
    from nvfp4_megamoe.kernels.indexer_keys import scores_of_key
    from nvfp4_megamoe.kernels.sm90_indexer import sm90_indexer_keys as indexer_keys
    q = torch.zeros(2, 64, 128, dtype=torch.bfloat16, device="cuda")
    keys = torch.randn(2, 300, 128, device="cuda").bfloat16()
    wts = -torch.rand(2, 64, device="cuda")
    scores = scores_of_key(indexer_keys(q, keys, wts))
    assert bool((scores.view(torch.int32) == 0).all())                       # +0.0 bit pattern
    assert indexer_topk(q, keys, wts, 10).tolist() == [list(range(10))] * 2   # best first: ties by index


@pytest.mark.parametrize("b,n,k", [(1, 1024, 512), (3, 4096, 1024), (2, 77, 512), (130, 640, 512), (1, 1, 8),
                                   (2, 2049, 512), (1, 4097, 512), (2, 16384, 512), (3, 70001, 1024),
                                   (1, 262144, 512), (2, 5000, 2048), (5, 262144, 512)])
def test_sort_topk_kernel_equals_torch_topk(b, n, k):
    """Bitonic top-k (every sort size, and 1 to 3 segment passes for longer lists) against torch.topk on
    the same keys: the same indices, in the same order, -1 for -inf scores and past N; with many equal
    scores (ties by index)."""
    from nvfp4_megamoe.kernels.indexer_keys import ordered_key, topk_of_keys_torch
    from nvfp4_megamoe.kernels.sm90_indexer import sm90_topk_of_keys as topk_of_keys
    from nvfp4_megamoe.kernels.sm90_indexer import topk_can_implement
    gen = torch.Generator(device="cuda").manual_seed(b * n + k)
    scores = torch.randn(b, n, device="cuda", generator=gen).round()         # few distinct values: ties
    scores[torch.rand(b, n, device="cuda", generator=gen) < 0.3] = float("-inf")
    if n == 4097:
        scores[:, 100:] = float("-inf")                                      # fewer visible than k, in two segments
    key = ordered_key(scores)
    assert topk_can_implement(n, k)
    out = topk_of_keys(key, k)
    want = topk_of_keys_torch(key, k)
    assert torch.equal(out, want)
    if n == 4097:
        assert bool((out[:, 100:] == -1).all())
