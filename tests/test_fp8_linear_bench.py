"""``bench/fp8_linear_bench.py`` parts that need no GPU: which path a call of T tokens runs, and a layer's summary
against its floors (the figures the FP8 goals are read from)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from nvfp4_megamoe.kernels.sm90_heuristics import FP8_F32_X_MAX_TOKENS, FP8_KERNEL_MAX_TOKENS

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import fp8_linear_bench  # noqa: E402


def test_the_path_follows_the_runtime_picks():
    paths = {t: fp8_linear_bench.runtime_path(t) for t in range(1, 2 * FP8_KERNEL_MAX_TOKENS)}
    assert {t for t, p in paths.items() if p == "fp8_x32"} == set(range(1, FP8_F32_X_MAX_TOKENS + 1))
    assert {t for t, p in paths.items() if p == "fp8"} == set(range(FP8_F32_X_MAX_TOKENS + 1,
                                                                     FP8_KERNEL_MAX_TOKENS + 1))
    assert paths[FP8_KERNEL_MAX_TOKENS + 1] == "dequant_bf16"


def test_a_layer_summary_sums_the_path_run_against_both_floors():
    rows = [dict(tokens=2048, n=4096, k=1024, groups=1, floor_us=30.0, fp8_us=900.0, dequant_bf16_us=60.0,
                 nvfp4_us=70.0),
            dict(tokens=2048, n=1024, k=512, groups=4, floor_us=10.0, fp8_us=500.0, dequant_bf16_us=20.0,
                 nvfp4_us=25.0),
            dict(tokens=1, n=4096, k=1024, groups=1, floor_us=2.0, fp8_us=4.0, fp8_x32_us=5.0, dequant_bf16_us=9.0,
                 nvfp4_us=3.0)]
    rate = 1e15
    got = fp8_linear_bench.layer_summary(rows, 2048, rate)
    flops = 2 * 2048 * (4096 * 1024 + 4 * 1024 * 512)
    assert got["path"] == "dequant_bf16" and got["us"] == pytest.approx(80.0)
    assert got["floor_us"] == pytest.approx(40.0) and got["of_floor"] == pytest.approx(0.5)
    assert got["fp8_rate_us"] == pytest.approx(flops / rate * 1e6)
    assert got["of_fp8_rate"] == pytest.approx(flops / rate * 1e6 / 80.0) and got["nvfp4_us"] == pytest.approx(95.0)
    one = fp8_linear_bench.layer_summary(rows, 1, rate)
    assert (one["path"], one["us"], one["of_floor"]) == ("fp8_x32", 5.0, pytest.approx(0.4))


def test_a_layer_summary_adds_the_w8a8_gemm_where_every_row_timed_it():
    rows = [dict(tokens=2048, n=4096, k=1024, groups=1, floor_us=30.0, dequant_bf16_us=60.0, w8a8_us=40.0),
            dict(tokens=2048, n=1024, k=512, groups=4, floor_us=10.0, dequant_bf16_us=20.0, w8a8_us=10.0)]
    rate = 1e15
    got = fp8_linear_bench.layer_summary(rows, 2048, rate)
    flops = 2 * 2048 * (4096 * 1024 + 4 * 1024 * 512)
    assert got["w8a8_us"] == pytest.approx(50.0)
    assert got["w8a8_of_fp8_rate"] == pytest.approx(flops / rate * 1e6 / 50.0)
    del rows[1]["w8a8_us"]
    assert "w8a8_us" not in fp8_linear_bench.layer_summary(rows, 2048, rate)
