"""CI (CPU-only) checks of the SM90 decode attention: the kernels compile for sm_90a, and the host-side
pieces (reference, torch baseline, the indexer's order keys and torch top-k, split choice) agree with the model
references.

CuTeDSL 4.8 compiles without a GPU when ``CUTE_DSL_ARCH=sm_90a``: ``cute.compile`` on CPU tensors
(dtypes and ranks are what the kernels specialise on) builds the cubin; nothing is launched.
"""

from __future__ import annotations

import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import pytest  # noqa: E402
import torch  # noqa: E402

from nvfp4_megamoe.kernels.attention_reference import sink_attention  # noqa: E402
from nvfp4_megamoe.kernels.decode_attention_reference import (  # noqa: E402
    decode_attention_reference, decode_attention_torch)
from nvfp4_megamoe.kernels.indexer_reference import indexer_scores, select_topk  # noqa: E402
from nvfp4_megamoe.kernels.indexer_keys import indexer_keys_torch, topk_of_keys_torch  # noqa: E402
from sm90_stand_ins import decode_attention_args, prefill_attention_args  # noqa: E402


def indexer_topk(q, keys, weights, k, n_valid=None):
    """The torch composition the GPU backend runs where the indexer kernels do not apply."""
    return topk_of_keys_torch(indexer_keys_torch(q, keys, weights, n_valid), k)


def _case(b, h, w, n, k, gen):
    q = torch.randn(b, h, 512, generator=gen).bfloat16()
    kvw = torch.randn(b, w, 512, generator=gen).bfloat16()
    kvc = torch.randn(b, n, 512, generator=gen).bfloat16()
    wlen = torch.randint(1, w + 1, (b,), generator=gen, dtype=torch.int32)
    idx = torch.stack([torch.randperm(n, generator=gen)[:k] for _ in range(b)]).int()
    idx[0, k // 2:] = -1
    sink = torch.randn(h, generator=gen)
    return q, kvw, wlen, kvc, idx, sink


def test_reference_matches_explicit_softmax():
    gen = torch.Generator().manual_seed(0)
    q, kvw, wlen, kvc, idx, sink = _case(3, 4, 16, 40, 12, gen)
    scale = 512 ** -0.5
    out = decode_attention_reference(q, kvw, wlen, kvc, idx, sink, scale)
    for b in range(3):
        keys = torch.cat((kvw[b, :int(wlen[b])], kvc[b, idx[b][idx[b] >= 0].long()])).float()
        logits = q[b].float() @ keys.T * scale
        full = torch.cat((logits, sink[:, None]), dim=1).softmax(-1)[:, :-1]
        torch.testing.assert_close(out[b], full @ keys, rtol=1e-5, atol=1e-5)
    # HCA (all entries) and window-only forms are the same function with every / no entry selected
    every = torch.arange(40, dtype=torch.int32).expand(3, 40).contiguous()
    torch.testing.assert_close(decode_attention_reference(q, kvw, wlen, kvc, None, sink, scale),
                               decode_attention_reference(q, kvw, wlen, kvc, every, sink, scale))
    none = torch.full((3, 5), -1, dtype=torch.int32)
    torch.testing.assert_close(decode_attention_reference(q, kvw, wlen, None, None, sink, scale),
                               decode_attention_reference(q, kvw, wlen, kvc, none, sink, scale))
    # and the runtime's sink_attention with an explicit bias gives the same thing
    bias = torch.where(torch.arange(16)[None] < wlen[:, None].long(), 0.0, float("-inf"))
    ref = sink_attention(q[:, None], kvw, bias[:, None], sink, scale)[:, 0]
    torch.testing.assert_close(decode_attention_reference(q, kvw, wlen, None, None, sink, scale), ref)


def test_torch_baseline_close_to_reference():
    gen = torch.Generator().manual_seed(1)
    q, kvw, wlen, kvc, idx, sink = _case(2, 8, 16, 64, 20, gen)
    ref = decode_attention_reference(q, kvw, wlen, kvc, idx, sink, 512 ** -0.5)
    got = decode_attention_torch(q, kvw, wlen, kvc, idx, sink, 512 ** -0.5).float()
    assert float((got - ref).norm() / ref.norm()) < 2e-2


@pytest.mark.parametrize("n_valid", [None, "short"])
def test_indexer_topk_matches_reference(n_valid):
    gen = torch.Generator().manual_seed(2)
    b, h, d, n, k = 3, 16, 128, 300, 64
    q = torch.randn(b, h, d, generator=gen).bfloat16()
    keys = torch.randn(b, n, d, generator=gen).bfloat16()
    wts = torch.randn(b, h, generator=gen)
    nv = torch.tensor([300, 40, 199]) if n_valid else None
    got = indexer_topk(q, keys, wts, k, nv)
    scores = indexer_scores(q[:, None], keys, wts[:, None])                # [B, 1, N]
    visible = torch.ones(b, 1, n, dtype=torch.bool) if nv is None else (torch.arange(n)[None] < nv[:, None])[:, None]
    want = select_topk(scores, visible, k)[:, 0]
    for i in range(b):
        sel = got[i][got[i] >= 0].long()
        assert len(set(sel.tolist())) == len(sel) == int(want[i].sum())
        assert bool(want[i, sel].all())
        assert (got[i] < 0).sum() == k - len(sel)


def test_ordered_key_round_trips_and_orders():
    from nvfp4_megamoe.kernels.indexer_keys import MONO_NEG_INF, ordered_key, scores_of_key
    gen = torch.Generator().manual_seed(3)
    s = torch.randn(3, 500, generator=gen) * torch.logspace(-30, 30, 500)
    s[:, :4] = torch.tensor([0.0, float("-inf"), float("inf"), -1e-40])       # zero, infinities, a subnormal
    key = ordered_key(s)
    assert torch.equal(scores_of_key(key).view(torch.int32), s.view(torch.int32))       # exact inverse
    assert int((key[0, 1] >> 32)) == MONO_NEG_INF
    order = torch.argsort(key, dim=-1, descending=True)
    want = torch.sort(s, dim=-1, descending=True, stable=True).indices                  # ties: lower index
    assert torch.equal(order, want)
    s[1, 100:] = float("-inf")                                               # with s[1, 1]: 99 visible
    idx = topk_of_keys_torch(ordered_key(s), 120)
    assert bool((idx[1, 99:] == -1).all()) and bool((idx[1, :99] >= 0).all()) and 1 not in idx[1].tolist()


def test_indexer_ties_pick_lower_index():
    q = torch.zeros(1, 8, 128, dtype=torch.bfloat16)
    keys = torch.randn(1, 50, 128).bfloat16()
    got = indexer_topk(q, keys, torch.randn(1, 8), 10)                       # every score is 0
    assert sorted(got[0].tolist()) == list(range(10))


def test_pick_splits():
    from nvfp4_megamoe.kernels.sm90_config import ATTENTION_CHUNK as chunk
    from nvfp4_megamoe.kernels.sm90_heuristics import pick_splits
    for b in (1, 8, 32, 128):
        for h in (64, 128):
            for entries in (1, 64, 640, 1152, 8320):
                s = pick_splits(b, h, entries, 132)
                chunks = -(-entries // chunk)
                cps = -(-chunks // s)
                assert 1 <= s <= chunks and (s - 1) * cps < chunks   # no empty split
                assert s == 1 or s * b * (h // 64) <= 132             # at most one wave when split


def test_pick_cluster():
    from nvfp4_megamoe.kernels.sm90_heuristics import CLUSTER_GRID, pick_cluster, pick_splits
    for max_cluster in (1, 2, 4):
        for b in (1, 2, 8, 20, 32, 128):
            for h in (64, 128):
                for entries in (1, 64, 160, 640, 1152, 8320):
                    cl = pick_cluster(b, h, entries, 132, max_cluster)
                    splits, ctas = pick_splits(b, h, entries, 132), b * (h // 64)
                    assert cl in (1, 2, 4) and cl <= max_cluster
                    if cl > 1:  # every split in the cluster, one wave, and big clusters only in small grids
                        assert cl // 2 < splits <= cl and cl * ctas <= 132 and (cl <= 2 or cl * ctas <= CLUSTER_GRID)
    # the measured cases: 3 splits at B = 1 / 8 (4-CTA clusters), 2 splits of V4-Pro at B = 32, no cluster
    # for 10 splits or for 4-CTA clusters filling the grid
    assert pick_cluster(1, 64, 160) == 4 and pick_cluster(8, 128, 160) == 4
    assert pick_cluster(32, 128, 1152) == 2
    assert pick_cluster(1, 64, 640) == 1 and pick_cluster(32, 64, 160) == 1 and pick_cluster(128, 64, 8320) == 1


def _chunk_case(s, t, past, h, n, k, gen, window=8):
    """A prefill chunk's operands (CPU): S sequences of ``past`` rows then T chunk rows each, windows of ``window``."""
    from nvfp4_megamoe.kernels.prefill_attention_reference import chunk_windows
    q = torch.randn(s * t, h, 512, generator=gen).bfloat16()
    rows = torch.randn(s, past + t, 512, generator=gen).bfloat16()
    kvc = torch.randn(s, n, 512, generator=gen).bfloat16()
    idx = torch.randint(-1, n, (s * t, k), generator=gen, dtype=torch.int32)
    count = torch.randint(0, n + 1, (s * t,), generator=gen, dtype=torch.int32)
    start, length = chunk_windows(past, t, window, s)
    return q, rows, start, length, kvc, idx, count, torch.randn(h, generator=gen)


@pytest.mark.parametrize("past", [0, 3, 7])
def test_chunk_windows_are_the_chunk_attention_mask(past):
    """``chunk_windows`` spans exactly the keys ChunkAttention's bias leaves visible: query p sees (p - W, p]."""
    from nvfp4_megamoe.kernels.prefill_attention_reference import chunk_windows
    window, t, pos0 = 8, 13, 100
    positions = pos0 + torch.arange(t)
    keys_pos = torch.cat((torch.arange(pos0 - past, pos0), positions))
    dist = positions[:, None] - keys_pos[None]
    visible = (dist >= 0) & (dist < window)
    start, length = chunk_windows(past, t, window, sequences=2)
    assert start.dtype == length.dtype == torch.int32 and start.shape == (2 * t,)
    span = torch.arange(past + t)[None]
    assert torch.equal((span >= start[:t, None]) & (span < (start + length)[:t, None]), visible)
    assert torch.equal(start[t:], start[:t]) and torch.equal(length[t:], length[:t])


@pytest.mark.parametrize("kind", ["window", "csa", "hca"])
def test_prefill_reference_matches_chunk_attention(kind):
    """The prefill contract is what ChunkAttention computes: ``sink_attention(_picked)`` with its window bias and
    (CSA) each query's gathered picks or (HCA) every entry it may see."""
    from nvfp4_megamoe.kernels.attention_reference import sink_attention_picked
    from nvfp4_megamoe.kernels.prefill_attention_reference import prefill_attention_reference
    gen = torch.Generator().manual_seed(4)
    s, t, past, h, n, k, window = 2, 11, 5, 4, 9, 3, 8
    q, rows, start, length, kvc, idx, count, sink = _chunk_case(s, t, past, h, n, k, gen, window)
    span = torch.arange(past + t)[None]
    bias = torch.where((span >= start[:, None]) & (span < (start + length)[:, None]), 0.0, float("-inf"))
    qs, bias = q.view(s, t, h, 512), bias.view(s, t, past + t)
    scale = 512 ** -0.5
    if kind == "window":
        want = sink_attention_picked(qs, rows, bias, None, None, sink, scale)
        got = prefill_attention_reference(q, rows, start, length, None, None, sink, scale)
    elif kind == "csa":
        picked = kvc[torch.arange(s)[:, None, None], idx.view(s, t, k).long().clamp(min=0)]
        want = sink_attention_picked(qs, rows, bias, picked, idx.view(s, t, k) >= 0, sink, scale)
        got = prefill_attention_reference(q, rows, start, length, kvc, idx, sink, scale)
    else:
        seen = torch.where(torch.arange(n)[None] < count[:, None].long(), 0.0, float("-inf")).view(s, t, n)
        want = sink_attention_picked(qs, torch.cat((rows, kvc), 1), torch.cat((bias, seen), -1), None, None, sink,
                                     scale)
        got = prefill_attention_reference(q, rows, start, length, kvc, None, sink, scale, count=count)
    torch.testing.assert_close(got, want.view(s * t, h, 512), rtol=1e-5, atol=1e-5)


def test_prefill_reference_is_decode_per_request():
    """Each request is the decode reference of its own ring (its window's rows at slots 0..len-1) and its entries."""
    from nvfp4_megamoe.kernels.prefill_attention_reference import prefill_attention_reference
    gen = torch.Generator().manual_seed(5)
    s, t, past, h, n, k = 2, 6, 2, 4, 10, 4
    q, rows, start, length, kvc, idx, count, sink = _chunk_case(s, t, past, h, n, k, gen, window=5)
    scale = 512 ** -0.5
    csa = prefill_attention_reference(q, rows, start, length, kvc, idx, sink, scale)
    hca = prefill_attention_reference(q, rows, start, length, kvc, None, sink, scale, count=count)
    for r in range(s * t):
        ring = torch.zeros(1, 5, 512, dtype=torch.bfloat16)
        ring[0, :int(length[r])] = rows[r // t, int(start[r]):int(start[r] + length[r])]
        one = (q[r:r + 1], ring, length[r:r + 1], kvc[r // t:r // t + 1])
        torch.testing.assert_close(csa[r:r + 1], decode_attention_reference(*one, idx[r:r + 1], sink, scale))
        every = torch.where(torch.arange(n) < count[r], torch.arange(n), -1).int()[None]
        torch.testing.assert_close(hca[r:r + 1], decode_attention_reference(*one, every, sink, scale))


def test_prefill_host_rejects_bad_operands():
    """Shapes are checked before anything touches a GPU (a KernelArgumentError, a ValueError)."""
    from nvfp4_megamoe.kernels.sm90_decode_attention import sm90_prefill_attention
    gen = torch.Generator().manual_seed(6)
    q, rows, start, length, kvc, idx, count, sink = _chunk_case(2, 3, 1, 64, 5, 2, gen)
    with pytest.raises(ValueError, match="S dividing"):
        sm90_prefill_attention(q[:5], rows, start[:5], length[:5], None, None, sink, 1.0)
    with pytest.raises(ValueError, match="not both"):
        sm90_prefill_attention(q, rows, start, length, kvc, idx, sink, 1.0, count=count)
    with pytest.raises(ValueError, match="window_start"):
        sm90_prefill_attention(q, rows, start.long(), length, None, None, sink, 1.0)
    with pytest.raises(ValueError, match="need kv_compressed"):
        sm90_prefill_attention(q, rows, start, length, None, idx, sink, 1.0)
    many = 65536                                  # past the grid's z: the caller cuts the chunk
    with pytest.raises(ValueError, match="65535 requests"):
        sm90_prefill_attention(q[:1].expand(many, -1, -1), rows[:1], start[:1].expand(many),
                               length[:1].expand(many), None, None, sink, 1.0)
    from nvfp4_megamoe.kernels.sm90_indexer import sm90_indexer_keys
    with pytest.raises(ValueError, match="65535 requests"):
        sm90_indexer_keys(torch.zeros(1, 64, 128, dtype=torch.bfloat16).expand(many, -1, -1),
                          torch.zeros(1, 10, 128, dtype=torch.bfloat16), torch.zeros(many, 64))
    with pytest.raises(ValueError, match="S dividing"):
        sm90_indexer_keys(torch.zeros(6, 64, 128, dtype=torch.bfloat16), torch.zeros(4, 10, 128, dtype=torch.bfloat16),
                          torch.zeros(6, 64))


cutlass = pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed")


@pytest.mark.skipif(os.environ["CUTE_DSL_ARCH"] != "sm_90a", reason="CUTE_DSL_ARCH names another target")
@pytest.mark.parametrize("mode", ["indexed", "dense", "window"])
def test_decode_attention_compiles_sm90a(mode):
    from nvfp4_megamoe.kernels.cute_host import compile_op
    from nvfp4_megamoe.kernels.sm90_decode_attention import CLUSTERS, Sm90DecodeAttention, Sm90DecodeAttentionCombine
    args = decode_attention_args()
    for cluster in CLUSTERS if mode == "indexed" else (1,):  # the cluster merge (distributed shared memory)
        assert compile_op(Sm90DecodeAttention(mode=mode, scale=512 ** -0.5, cluster=cluster), args) is not None
    if mode == "indexed":
        for groups in (1, 4):
            assert compile_op(Sm90DecodeAttentionCombine(groups), [args[7], args[8], args[5], args[6]]) is not None


@pytest.mark.skipif(os.environ["CUTE_DSL_ARCH"] != "sm_90a", reason="CUTE_DSL_ARCH names another target")
@pytest.mark.parametrize("mode", ["indexed", "dense", "window"])
def test_prefill_attention_compiles_sm90a(mode):
    """The shared-rows form of the split kernel (window starts beside the lengths, HCA's counts [R, 1]), every
    cluster for CSA; the warm-up's count with the prefill forms."""
    from nvfp4_megamoe.kernels.cute_host import compile_op
    from nvfp4_megamoe.kernels.sm90_decode_attention import CLUSTERS, Sm90PrefillAttention, warmup
    args = prefill_attention_args()
    if mode == "dense":
        args[5] = args[5][:, :1].contiguous()
    for cluster in CLUSTERS if mode == "indexed" else (1,):
        kernel = Sm90PrefillAttention(mode=mode, scale=512 ** -0.5, cluster=cluster)
        assert kernel.key()[-1] == "prefill" and compile_op(kernel, args) is not None
    if mode == "window":
        assert warmup(("window",), 64, 512 ** -0.5, "cpu", prefill=("window",)) == len(CLUSTERS) + 1 + 2


@pytest.mark.skipif(os.environ["CUTE_DSL_ARCH"] != "sm_90a", reason="CUTE_DSL_ARCH names another target")
def test_shared_keys_indexer_compiles_sm90a():
    """The score kernel whose requests share their sequence's keys; decode's key is unchanged."""
    from nvfp4_megamoe.kernels.cute_host import compile_op
    from nvfp4_megamoe.kernels.sm90_indexer import SORT_SIZES, Sm90IndexerScores, warmup
    r, s, n, heads, dim = 6, 2, 300, 64, 128
    args = [torch.zeros(r, heads, dim, dtype=torch.bfloat16), torch.zeros(s, n, dim, dtype=torch.bfloat16),
            torch.zeros(r, heads), torch.zeros(r, dtype=torch.int32), torch.zeros(r, n, dtype=torch.int64),
            torch.zeros(1, 4, dtype=torch.int32)]
    assert compile_op(Sm90IndexerScores(heads=heads, dim=dim, shared=True), args) is not None
    assert Sm90IndexerScores(heads=heads, dim=dim).key() == (heads, dim)
    assert warmup(heads, dim, 512, "cpu", prefill=True) == 3 + len(SORT_SIZES)


@pytest.mark.skipif(os.environ["CUTE_DSL_ARCH"] != "sm_90a", reason="CUTE_DSL_ARCH names another target")
@pytest.mark.parametrize("heads,dim", [(64, 128), (8, 64)])
def test_indexer_scores_compiles_sm90a(heads, dim):
    from nvfp4_megamoe.kernels.cute_host import compile_op
    from nvfp4_megamoe.kernels.sm90_indexer import Sm90IndexerScores
    b, n = 2, 300
    args = [torch.zeros(b, heads, dim, dtype=torch.bfloat16), torch.zeros(b, n, dim, dtype=torch.bfloat16),
            torch.zeros(b, heads), torch.zeros(b, dtype=torch.int32), torch.zeros(b, n, dtype=torch.int64),
            torch.zeros(1, 4, dtype=torch.int32)]
    assert compile_op(Sm90IndexerScores(heads=heads, dim=dim), args) is not None
    fits = Sm90IndexerScores.can_implement
    assert not fits(12, 128) and not fits(64, 96) and not fits(256, 512)
    from nvfp4_megamoe.kernels.sm90_indexer import (SORT_SIZES, Sm90SortTopk, sort_levels, sort_size,
                                                    topk_can_implement, warmup)
    if (heads, dim) == (64, 128):  # V4's index heads: the score kernel, every sort size and the segment pass
        assert warmup(heads, dim, 512, "cpu") == 2 + len(SORT_SIZES)
        assert warmup(heads, dim, 4096, "cpu") == 2                     # no segment pass for k > 2048
    assert topk_can_implement(4096, 4096) and not topk_can_implement(4097, 4096) and topk_can_implement(10 ** 6, 2048)
    assert [sort_size(n, 512) for n in (1, 2048, 2049, 4096, 4097)] == [2048, 2048, 4096, 4096, None]
    # each segment pass keeps k of every 4,096 keys until one sort holds the rest
    assert sort_levels(4096, 512) == [] and sort_levels(4097, 512) == [1024]
    assert sort_levels(16384, 512) == [2048] and sort_levels(262144, 1024) == [65536, 16384, 4096]
    assert sort_levels(5000, 2048) == [4096]
    with pytest.raises(ValueError, match="entries"):
        Sm90SortTopk(k=4096, entries=2048)
    with pytest.raises(ValueError, match="tiling"):
        Sm90IndexerScores(heads=64, dim=96)


def test_bad_configuration_rejected():
    from nvfp4_megamoe.kernels.sm90_decode_attention import Sm90DecodeAttention
    with pytest.raises(ValueError, match="mode"):
        Sm90DecodeAttention(mode="nope", scale=1.0)
    with pytest.raises(ValueError, match="cluster must be"):
        Sm90DecodeAttention(mode="dense", scale=1.0, cluster=3)
    assert Sm90DecodeAttention.can_implement(64, 512) and Sm90DecodeAttention.can_implement(128, 512)
    assert not Sm90DecodeAttention.can_implement(32, 512) and not Sm90DecodeAttention.can_implement(64, 256)


def test_sort_topk_pays_where_measured():
    """One CTA up to 4,096 keys; segment passes up to 2**20 keys in all; torch.topk beyond."""
    from nvfp4_megamoe.kernels.sm90_heuristics import sort_topk_pays
    assert sort_topk_pays(1024, 4096, 512) and sort_topk_pays(8, 131072, 1024) and sort_topk_pays(1, 1 << 20, 512)
    assert not sort_topk_pays(16, 131072, 512)
