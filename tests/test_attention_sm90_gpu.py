"""GPU checks of the SM90 decode attention (and its prefill form) against the float32 PyTorch references.

Random data drawn fresh per case, outputs poisoned with NaN before each run, windows partly filled,
top-k lists shorter than k (-1 padding scattered, not only at the tail), repeated indices, heads 64 and
128, window-only / CSA (indexed) / HCA (dense) forms, one split and several: merged by the combine kernel,
or by a cluster of CTAs through distributed shared memory. Prefill: a chunk's query tokens as requests sharing
their sequence's rows and entries (S = 1 and 2, windows short at a sequence's start, past rows, T of no particular
multiple), bit for bit the decode kernel on each request's gathered ring where both lists are chunked alike; the
indexer's shared-keys score kernel, and the sort at 8,192 lists of 16,384 keys.
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


# -- prefill: a chunk's query tokens as requests sharing their sequence's keys -------------------------------------
WINDOW = 128


def make_prefill_case(s: int, t: int, h: int, past: int, mode: str, n: int, k: int | None, seed: int):
    """A chunk's operands on the GPU: S sequences of ``past`` rows then T chunk rows, the runtime's windows
    (``chunk_windows``: shorter than W near a sequence's start), CSA indices with scattered -1 padding and a repeat,
    HCA counts from 0 to past N (clamped by the kernel)."""
    from nvfp4_megamoe.kernels.prefill_attention_reference import chunk_windows
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dev, r = "cuda", s * t
    q = torch.randn(r, h, 512, device=dev, generator=gen).bfloat16()
    rows = torch.randn(s, past + t, 512, device=dev, generator=gen).bfloat16()
    start, length = chunk_windows(past, t, WINDOW, s, device=dev)
    kvc = idx = count = None
    if mode != "window":
        kvc = torch.randn(s, n, 512, device=dev, generator=gen).bfloat16()
    if mode == "indexed":
        idx = torch.argsort(torch.rand(r, n, device=dev, generator=gen), dim=1)[:, :k].int()
        if n < k:                                                      # fewer entries than k: -1 at the tail too
            idx = torch.cat((idx, idx.new_full((r, k - n), -1)), dim=1)
        idx = idx.masked_fill(torch.rand(r, k, device=dev, generator=gen) < 0.2, -1).contiguous()
        idx[-1, 1] = idx[-1, 0]                                        # a repeated entry counts twice
    if mode == "dense":
        count = torch.randint(0, n + 1, (r,), device=dev, generator=gen, dtype=torch.int32)
        count[0], count[-1] = 0, n + 7                                 # none, and more than there are
    sink = torch.randn(h, device=dev, generator=gen) * 2
    return q, rows, start, length, kvc, idx, count, sink


def run_prefill(case, out=None, **options):
    from nvfp4_megamoe.kernels.sm90_decode_attention import sm90_prefill_attention
    q, rows, start, length, kvc, idx, count, sink = case
    if out is None:
        out = torch.full(q.shape, float("nan"), dtype=torch.bfloat16, device="cuda")
    sm90_prefill_attention(q, rows, start, length, kvc, idx, sink, SCALE, count=count, out=out,
                           max_window=WINDOW, **options)
    torch.cuda.synchronize()
    return out


PREFILL_CASES = [  # s, t, h, past, mode, n, k, options
    (1, 200, 64, 0, "window", 0, None, {}),                        # a sequence's start: windows of 1 .. 128
    (2, 77, 128, 127, "window", 0, None, {}),
    (1, 333, 64, 127, "indexed", 2000, 512, {}),
    (2, 45, 128, 60, "indexed", 700, 512, {}),
    (1, 1000, 64, 127, "indexed", 16384, 512, {}),
    (2, 150, 64, 0, "dense", 300, None, {}),
    (1, 129, 128, 127, "dense", 1000, None, {}),
    (2, 61, 128, 127, "dense", 4096, None, {}),
    (1, 3, 64, 127, "indexed", 500, 512, {}),                       # few requests (splits), fewer entries than k
    (2, 5, 128, 10, "dense", 2000, None, {"splits": 5}),              # partials through the combine kernel
    (2, 7, 64, 127, "indexed", 300, 100, {"cluster": 4}),              # merged in a cluster
    (1, 2, 64, 3, "window", 0, None, {"cluster": 2}),                 # more splits than chunks
]


@pytest.mark.parametrize("s,t,h,past,mode,n,k,options", PREFILL_CASES)
def test_prefill_attention_matches_reference(s, t, h, past, mode, n, k, options):
    """Every output written (NaN-poisoned before), relative error to the float32 reference below 1e-2."""
    from nvfp4_megamoe.kernels.prefill_attention_reference import prefill_attention_reference
    case = make_prefill_case(s, t, h, past, mode, n, k, seed=s * 7919 + t + h + n)
    out = run_prefill(case, **options)
    assert not out.isnan().any(), "unwritten (NaN-poisoned) outputs remain"
    q, rows, start, length, kvc, idx, count, sink = case
    ref = prefill_attention_reference(q, rows, start, length, kvc, idx, sink, SCALE, count=count)
    err = rel_err(out, ref)
    assert err < 1e-2, f"relative error {err:.3e}"


def test_prefill_windows_outside_the_rows_are_masked():
    """Window starts before row 0 and spans past row L read nothing there (the reference masks them too)."""
    from nvfp4_megamoe.kernels.prefill_attention_reference import prefill_attention_reference
    q, rows, start, length, kvc, idx, count, sink = case = make_prefill_case(2, 40, 64, 20, "indexed", 300, 64, 3)
    start[0], start[1], start[-1] = -5, -200, rows.shape[1] - 3     # partly before, wholly before, partly after
    out = run_prefill(case)
    ref = prefill_attention_reference(q, rows, start, length, kvc, idx, sink, SCALE)
    assert not out.isnan().any() and rel_err(out, ref) < 1e-2


def test_prefill_all_masked_gives_zero():
    """No window row and no entry: the sink takes all the mass, the output is 0 (not NaN), split or not."""
    q, rows, start, length, kvc, idx, count, sink = case = make_prefill_case(1, 6, 128, 0, "indexed", 64, 32, 5)
    length.zero_()
    idx.fill_(-1)
    for options in ({"splits": 1}, {"splits": 3}, {"cluster": 2}):
        assert bool((run_prefill(case, **options) == 0).all()), options


@pytest.mark.parametrize("mode", ["window", "indexed", "dense"])
def test_prefill_request_equals_decode_of_its_ring(mode):
    """A prefill request is the decode kernel run for that token alone, its window's rows gathered into a ring (slots
    0 .. len-1) and its entries given as indices (HCA: 0 .. count-1): bit for bit where the window is full (the two
    lists are then chunked alike), within BF16 rounding where it is shorter (the decode list keeps W slots)."""
    from nvfp4_megamoe.kernels.sm90_decode_attention import sm90_decode_attention as decode_attention
    s, t, past = 2, 150, 40
    q, rows, start, length, kvc, idx, count, sink = case = make_prefill_case(s, t, 64, past, mode, 900, 512, 9)
    out = run_prefill(case, splits=1, cluster=1)
    for r in (0, 50, t - 1, t, 2 * t - 1):                          # windows of 41, 91 and 128 rows
        seq, w = r // t, int(length[r])
        ring = torch.zeros(1, WINDOW, 512, dtype=torch.bfloat16, device="cuda")
        ring[0, :w] = rows[seq, int(start[r]):int(start[r]) + w]
        entries = None if kvc is None else kvc[seq:seq + 1].contiguous()
        picked = idx[r:r + 1] if mode == "indexed" else None
        if mode == "dense":
            picked = torch.arange(min(int(count[r]), kvc.shape[1]), dtype=torch.int32, device="cuda")[None]
            if picked.shape[1] == 0:
                picked = torch.full((1, 1), -1, dtype=torch.int32, device="cuda")
        one = decode_attention(q[r:r + 1], ring, length[r:r + 1].contiguous(), entries, picked, sink, SCALE,
                               splits=1, cluster=1)
        torch.cuda.synchronize()
        if w == WINDOW and (mode != "dense" or int(count[r]) > 0):
            assert torch.equal(one, out[r:r + 1]), r
        else:
            assert rel_err(one, out[r:r + 1].float()) < 1e-2, r


def test_prefill_graph_capture_replays():
    from nvfp4_megamoe.kernels.prefill_attention_reference import prefill_attention_reference
    from nvfp4_megamoe.kernels.sm90_decode_attention import sm90_prefill_attention
    q, rows, start, length, kvc, idx, count, sink = case = make_prefill_case(1, 64, 64, 127, "dense", 512, None, 13)
    out = run_prefill(case)                                          # warm-up: compile
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):                                    # no host sync inside a capture
        sm90_prefill_attention(q, rows, start, length, kvc, idx, sink, SCALE, count=count, out=out,
                               max_window=WINDOW)
    q.copy_(torch.randn_like(q, dtype=torch.float32).bfloat16())
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(out, prefill_attention_reference(q, rows, start, length, kvc, idx, sink, SCALE, count=count)) < 1e-2


def shared_indexer_case(s: int, t: int, n: int, seed: int, heads: int = 64, dim: int = 128):
    """q [S T, h, d], keys [S, N, d], weights [S T, h] and causal n_valid [S T]: a chunk's queries at the end of a
    prompt of 4 N tokens (ratio 4) see from about N - T / 4 entries to N, and the first ones of a prompt none."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    r = s * t
    q = torch.randn(r, heads, dim, device="cuda", generator=gen).bfloat16()
    keys = torch.randn(s, n, dim, device="cuda", generator=gen).bfloat16()
    wts = torch.randn(r, heads, device="cuda", generator=gen)
    pos = 4 * n - t + torch.arange(t, device="cuda")
    nv = ((pos + 1) // 4).clamp(0, n).repeat(s).int()
    nv[:min(t, 5)] = torch.tensor([0, 1, 63, 64, 65][:min(t, 5)], device="cuda", dtype=torch.int32)
    return q, keys, wts, nv


@pytest.mark.parametrize("s,t,n", [(1, 1024, 1024), (2, 77, 5000), (2, 300, 16384), (3, 5, 130)])
def test_shared_keys_indexer_matches_float32_reference(s, t, n):
    """The score kernel with a chunk's queries sharing their sequence's keys: the float32 reference's scores,
    -inf at and past n_valid (also over chunks it skips), every key written (poisoned before); and bit for bit the
    decode kernel's on the keys copied per request."""
    from nvfp4_megamoe.kernels.indexer_keys import scores_of_key
    from nvfp4_megamoe.kernels.sm90_indexer import sm90_indexer_keys as indexer_keys
    q, keys, wts, nv = shared_indexer_case(s, t, n, seed=s * n + t)
    r = s * t
    out = torch.full((r, n), 0x7FF0DEADBEEF, dtype=torch.int64, device="cuda")
    key = indexer_keys(q, keys, wts, nv, out=out)
    assert key is out
    rev = 0xFFFFFFFF - torch.arange(n, device="cuda")
    assert torch.equal(key & 0xFFFFFFFF, rev.expand(r, n))            # every key written, its entry below
    got = scores_of_key(key)
    want = indexer_scores(q.view(s, t, *q.shape[1:]).float(), keys.float(), wts.view(s, t, -1)).view(r, n)
    visible = torch.arange(n, device="cuda")[None] < nv[:, None].long()
    assert bool(torch.isneginf(got[~visible]).all()) and bool(torch.isfinite(got[visible]).all())
    assert rel_err(got[visible], want[visible]) < 1e-5
    copied = keys.repeat_interleave(t, dim=0)                          # the decode form: every request its keys
    assert torch.equal(indexer_keys(q, copied, wts, nv), key)


@pytest.mark.parametrize("s,t,n,k", [(1, 1024, 1024, 512), (1, 1024, 16384, 512), (2, 100, 16384, 1024)])
def test_shared_keys_indexer_topk_matches_reference(s, t, n, k):
    """Scores then the sort kernel for a chunk's queries: the reference's top-k (``topk_in_blocks``, as the chunk
    path runs it) up to near-ties at the cut, -1 padding where fewer than k are visible."""
    from nvfp4_megamoe.kernels.indexer_reference import topk_in_blocks
    from nvfp4_megamoe.kernels.sm90_indexer import sm90_indexer_keys as indexer_keys
    from nvfp4_megamoe.kernels.sm90_indexer import sm90_topk_of_keys as topk_of_keys
    q, keys, wts, nv = shared_indexer_case(s, t, n, seed=n + k)
    r = s * t
    got = topk_of_keys(indexer_keys(q, keys, wts, nv), k)
    want = topk_in_blocks(q.view(s, t, *q.shape[1:]), keys, wts.view(s, t, -1), nv.view(s, t), k, 4096).view(r, k)
    scores = indexer_scores(q.view(s, t, *q.shape[1:]).float(), keys.float(), wts.view(s, t, -1)).view(r, n)
    for i in range(r):
        sel, ref = got[i][got[i] >= 0].long(), want[i][want[i] >= 0]
        assert len(sel) == len(ref) == min(k, int(nv[i])) and len(set(sel.tolist())) == len(sel)
        assert bool((sel < nv[i]).all())
        if len(ref):
            kth = scores[i, ref].min()
            assert float(scores[i, sel].min()) >= float(kth) - 1e-4 * float(scores[i].abs().max())


@pytest.mark.parametrize("k", [512, 1024])
def test_sort_topk_takes_a_long_prompts_chunk(k):
    """8,192 lists of 16,384 keys (a 64K-token prompt's CSA entries at ratio 4): torch.topk's indices exactly."""
    from nvfp4_megamoe.kernels.indexer_keys import ordered_key, topk_of_keys_torch
    from nvfp4_megamoe.kernels.sm90_indexer import sm90_topk_of_keys as topk_of_keys
    gen = torch.Generator(device="cuda").manual_seed(k)
    scores = torch.randn(8192, 16384, device="cuda", generator=gen).round()
    scores[torch.arange(16384, device="cuda")[None] >= torch.randint(0, 16385, (8192, 1), device="cuda",
                                                                     generator=gen)] = float("-inf")
    key = ordered_key(scores)
    del scores
    assert torch.equal(topk_of_keys(key, k), topk_of_keys_torch(key, k))


@pytest.mark.parametrize("kind,n,t,pos0", [("window", 1, 300, 0), ("window", 2, 77, 500), ("csa", 1, 1024, 127),
                                          ("csa", 2, 300, 2000), ("hca", 1, 1000, 127), ("hca", 2, 129, 0)])
def test_hopper_chunk_attention_equals_the_reference_blocks(kind, n, t, pos0):
    """``HopperBackend.chunk_attention`` (every query a request of the prefill kernel) against the reference
    backend's blocks of float32 ops on the same operands, CSA given the same picks (the Hopper backend's own,
    handed to the reference block by block), so that only the attention is compared; windows short at a slot's
    start and past ring rows, entries fewer than some queries may see."""
    from nvfp4_megamoe.runtime.backend import ReferenceBackend
    from nvfp4_megamoe.runtime.hopper import HopperBackend

    gen = torch.Generator(device="cuda").manual_seed(n * 1000 + t)
    dev, heads, window, topk = "cuda", 64, 128, 512
    past, ratio = min(pos0, window - 1), 4 if kind == "csa" else 128
    entries = 0 if kind == "window" else (pos0 + t) // ratio   # what the slot's compressor has stored by then
    q = torch.randn(n, t, heads, 512, device=dev, generator=gen)
    rows = torch.randn(n, past + t, 512, device=dev, generator=gen)
    sink = torch.randn(heads, device=dev, generator=gen)
    n_visible = (pos0 + torch.arange(t, device=dev) + 1) // ratio
    kvc = torch.randn(n, entries, 512, device=dev, generator=gen) if entries else None
    index = None
    if kind == "csa":
        index = (torch.randn(n, t, 64, 128, device=dev, generator=gen),
                 torch.randn(n, entries, 128, device=dev, generator=gen), torch.rand(n, t, 64, device=dev,
                                                                                     generator=gen))
    hopper, ref = HopperBackend(), ReferenceBackend()
    got = hopper.chunk_attention(q, rows, past, window, kvc, n_visible, index, sink, SCALE, topk)
    assert hopper.kernel_calls["prefill_attention"] == 1
    if index is not None:
        picks = hopper.chunk_topk(*index, n_visible, topk, 0)
        assert picks.shape == (n, t, topk) and bool((picks < n_visible[None, :, None]).all())
        done = []

        def given(q_block, *_):
            r0 = sum(done)
            done.append(q_block.shape[1])
            return picks[:, r0:r0 + q_block.shape[1]]
        ref.chunk_topk = given
    want = ref.chunk_attention(q.bfloat16().float(), rows.bfloat16().float(),
                               past, window, None if kvc is None else kvc.bfloat16().float(), n_visible, index, sink,
                               SCALE, topk)
    assert torch.isfinite(got).all()
    assert rel_err(got, want) < 1e-2
