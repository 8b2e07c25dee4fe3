"""CI (CPU-only) guard on what ptxas gives the Hopper kernels: the configurations the runtime can launch for V4-Flash
and V4-Pro (the MoE plans ``Sm90Nvfp4Moe.warmup`` compiles up to 8192 tokens, decode attention with its clusters and
combine and its prefill form, the indexer, the mHC weights, the compressor step, the step's query and key, the
router, the W8A8 GEMM) are compiled for sm_90a and their cubins read (``kernel_resources_probe.py``, in fresh
interpreters, several at once).

The CPU suite compiles one GEMM per configuration that differs only in its token tile (the widest tile, whose
accumulators take the most registers) and every other kernel; ``-m slow`` compiles every configuration.

Spills (a stack frame) and registers past the CTAs per SM a kernel is designed for cost time silently: with
the row tiles interleaved at every T, the V4-Flash decode L2 took 138 registers instead of 128 (3 CTAs per SM
instead of 4) and T = 16 / 64 ran 5-7 % slower (docs/design/moe_kernels.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed")

PROBE = Path(__file__).with_name("kernel_resources_probe.py")
DECODE_CTAS_PER_SM = 3  # the mma.sync decode GEMMs are measured at 3-4 CTAs of 128 threads per SM


def max_registers(ctas: int, threads: int) -> int:
    """Registers per thread that let ``ctas`` CTAs of ``threads`` share one SM's 64 K (allocated by 8)."""
    return min(255, 65536 // (ctas * threads) // 8 * 8)


@pytest.fixture(scope="module", params=[pytest.param(False, id="widest-tiles"),
                                        pytest.param(True, id="every-config", marks=pytest.mark.slow)])
def resources(request, tmp_path_factory) -> dict:
    dump = tmp_path_factory.mktemp("cubins")
    cmd = [sys.executable, str(PROBE), str(dump), "--jobs", str(min(8, os.cpu_count() or 1))]
    run = subprocess.run(cmd + (["--all"] if request.param else []), capture_output=True, text=True, timeout=3000)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_the_probe_sees_a_spill(resources):
    """The control (64-token tiles with two row tiles, which no layer picks) spills: the check can fail."""
    assert resources["control"]["frame_bytes"] > 0 and resources["control"]["registers"] == 255


def test_no_kernel_the_runtime_launches_spills(resources):
    kernels = resources["kernels"]
    assert len(kernels) >= 60 and {k["kernel"] for k in kernels} >= {
        "Sm90Nvfp4MmaGemm", "Sm90Nvfp4WgmmaGemm", "Sm90MoeRouting", "Sm90StagedOrder", "Sm90DecodeAttention",
        "Sm90PrefillAttention", "Sm90DecodeAttentionCombine", "Sm90IndexerScores", "Sm90SortTopk", "Sm90HcPre",
        "Sm90HcPreFused", "Sm90HcPost", "Sm90Fp8Linear", "Sm90Fp8WgmmaLinear", "Sm90Fp8Dequant", "Sm90CompressStep",
        "Sm90RouterTopk", "Sm90RouterHash", "Sm90QkvStep", "Sm90Fp8Gemm", "Sm90Fp8ActQuant"}
    assert len({(k["kernel"], k["key"]) for k in kernels}) == len(kernels)  # the workers split one list
    spilled = [f'{k["kernel"]} {k["key"]}: {k["frame_bytes"]} bytes' for k in kernels if k["frame_bytes"]]
    assert not spilled, "kernels with a stack frame (register spills):\n" + "\n".join(spilled)


def test_kernels_fit_the_ctas_per_sm_they_are_built_for(resources):
    too_big = []
    for k in resources["kernels"]:
        if not k["threads"]:
            continue
        ctas = k["min_ctas"] or (DECODE_CTAS_PER_SM if k["kernel"] == "Sm90Nvfp4MmaGemm" else 1)
        if k["registers"] > max_registers(ctas, k["threads"]):
            too_big.append(f'{k["kernel"]} {k["key"]}: {k["registers"]} registers, {ctas} CTAs of {k["threads"]}')
    assert not too_big, "kernels that no longer fit their CTAs per SM:\n" + "\n".join(too_big)
