"""``bench/e2e_bench.py`` parts that need no GPU: its arguments, the expected number of experts a batch touches,
and the bytes floor read from a converted checkpoint's headers (against the weights the runtime loads)."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch

from nvfp4_megamoe.runtime import ModelConfig, load_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import e2e_bench  # noqa: E402
from weight_trees import tensor_bytes  # noqa: E402

EXPERT_FIELDS = ("w13", "w13_scale", "w13_alpha", "w2", "w2_scale", "w2_alpha")


def test_arguments_and_their_defaults():
    args = e2e_bench.parse_args(["--checkpoint", "/tmp/x"])
    assert (args.batches, args.contexts) == ([1, 8, 32, 128], [4096, 65536])
    assert args.out == e2e_bench.DEFAULT_OUT and args.preset is None
    args = e2e_bench.parse_args(["--checkpoint", "/tmp/x", "--batches", "2", "--contexts", "512", "--steps", "3"])
    assert (args.batches, args.contexts, args.steps) == ([2], [512], 3)
    for bad in (["--batches", "0"], ["--steps", "0"], []):
        with pytest.raises(SystemExit):
            e2e_bench.parse_args((["--checkpoint", "/tmp/x"] if bad else []) + bad)


def test_expected_experts_is_the_mean_of_distinct_experts_a_batch_picks():
    assert e2e_bench.expected_experts(64, 6, 1) == pytest.approx(6)
    gen = torch.Generator().manual_seed(0)
    for b in (2, 8, 32):
        trials = [len(torch.cat([torch.randperm(64, generator=gen)[:6] for _ in range(b)]).unique())
                  for _ in range(400)]
        assert sum(trials) / len(trials) == pytest.approx(e2e_bench.expected_experts(64, 6, b), rel=0.02)
    assert e2e_bench.expected_experts(64, 6, 4096) == pytest.approx(64)


def test_floor_bytes_from_the_headers_match_the_loaded_weights(synth_checkpoints):
    out = synth_checkpoints.converted("flash", target="sm90").output
    config = ModelConfig.from_file(out)
    sizes = e2e_bench.checkpoint_bytes(out, config)
    w = load_model(out).weights
    for i, lw in w.layers.items():
        experts = sum(getattr(lw.moe, f).nbytes for f in EXPERT_FIELDS)
        assert sizes["layers"][i]["experts"] == experts
        assert sizes["layers"][i]["non_expert"] == tensor_bytes(lw) - experts - tensor_bytes(lw.moe.tid2eid)
    assert sizes["head"] == tensor_bytes(w.head) + w.norm.nbytes + tensor_bytes(w.hc_head)
    e, k = config.n_routed_experts, config.top_k
    non_expert = sum(v["non_expert"] for v in sizes["layers"].values()) + sizes["head"]
    experts = sum(v["experts"] for v in sizes["layers"].values())
    assert e2e_bench.floor_bytes(sizes, 1) == round(non_expert + experts * k / e)
    assert e2e_bench.floor_bytes(sizes, 10_000) == non_expert + experts
    one = e2e_bench.state_read_bytes(config, 1, 4096)
    assert e2e_bench.state_read_bytes(config, 8, 4096) == 8 * one > e2e_bench.state_read_bytes(config, 8, 1024)


def test_decode_profile_ops_table_sums_each_op_by_its_shapes():
    """``decode_profile.py --by-op``'s table, from a CPU profile (its own time per op and shapes, per step)."""
    import decode_profile

    a, b = torch.randn(64, 64), torch.randn(8, 8)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(2):
            a @ a
            b @ b
            b @ b
    kernel_row = types.SimpleNamespace(key="gemm_kernel", input_shapes=[], self_cpu_time_total=1e6, count=2,
                                       device_type=torch.autograd.DeviceType.CUDA)   # a kernel's own row: left out
    rows = decode_profile.ops_table([*prof.key_averages(group_by_input_shape=True), kernel_row], 2,
                                    "self_cpu_time_total")
    assert "gemm_kernel" not in {r[0] for r in rows}
    mm = {shapes: calls for op, shapes, us, calls in rows if op == "aten::mm"}
    assert mm == {str([[64, 64], [64, 64]]): 1.0, str([[8, 8], [8, 8]]): 2.0}
    assert all(us > 0 for _, _, us, _ in rows) and [r[2] for r in rows] == sorted((r[2] for r in rows), reverse=True)


def test_prefill_flops_counts_weights_once_a_token_and_each_key_a_query_reads():
    """A CSA layer (window 2, top-1) and an HCA one (ratio 128) over 9 tokens, counted by hand: query p reads
    min(2, p + 1) window keys, CSA's one best of its (p + 1) // 4 visible entries (0 before position 3), HCA's none
    yet; the indexer scores every visible entry."""
    c = types.SimpleNamespace(hidden_size=8, num_heads=2, head_dim=4, q_lora_rank=3, o_lora_rank=5, o_groups=1,
                              n_shared_experts=1, top_k=2, moe_intermediate_size=6, n_routed_experts=4, hc_mult=1,
                              index_n_heads=2, index_head_dim=2, index_topk=1, sliding_window=2, vocab_size=10,
                              compress_ratios=(4, 128))
    attention = 8 * 3 + 3 * 2 * 4 + 8 * 4 + 2 * 4 * 5 + 5 * 8
    ffn = 3 * 3 * 8 * 6 + 8 * 4
    mhc = 2 * 3 * 1 * 1 * 8
    csa = attention + ffn + mhc + 4 * 8 * 4 + 4 * 8 * 2 + 8 * 2 + 3 * 2 * 2
    hca = attention + ffn + mhc + 2 * 8 * 4
    window = [1, 2, 2, 2, 2, 2, 2, 2, 2]
    visible = [0, 0, 0, 1, 1, 1, 1, 2, 2]
    keys_csa = [w + min(1, v) for w, v in zip(window, visible)]
    want = (2 * 9 * (csa + hca) + 4 * 2 * 4 * (sum(keys_csa) + sum(window)) + 2 * 2 * 2 * sum(visible)
            + 2 * 8 * 10)
    assert e2e_bench.prefill_flops(c, 9) == want
