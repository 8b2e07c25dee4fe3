"""SM clock and board power while one MoE layer configuration replays for seconds, on the GPU.

At prefill sizes the H200 runs the MoE layer at its power cap (700 W), so a configuration's time is its cycles over
the clock the cap leaves it. For each variant (a ``moe_bench.variant_layer`` spec) in turn this replays the layer's CUDA graph
with a cold L2 for ``SECONDS`` while ``nvidia-smi`` samples the SM clock and the power every 20 ms, and prints the
medians over the last two thirds (after the clock has settled) with the layer's median time. Weights are random
format 1 in Hopper row tiles, routing uniform random top-k, as in ``moe_bench.py``.

    python bench/moe_power.py '{"two_wg": {}, "one_wg": {"wg": {"warpgroups": 1, "min_ctas": 2}}}' V4-Pro 4096 2
    # VARIANTS (JSON: name -> variant spec), MODEL, T, ROUNDS
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time

import torch

from gpu_timing import ColdTimer
from moe_ab import capture_variants
from moe_bench import MODELS, routed_inputs

from nvfp4_megamoe.kernels.moe_reference import random_moe_weights
from nvfp4_megamoe.kernels.row_tiles import tile_expert_weights

SECONDS = 2.5
SAMPLE_MS = 20


def main() -> None:
    variants = json.loads(sys.argv[1])
    model, t, rounds = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    h, i, e, k = MODELS[model]
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = tile_expert_weights(random_moe_weights(e, h, i, generator=gen, device="cuda", distinct_halves=False))
    x, ids, wts = routed_inputs(t, h, e, k, gen)
    timer = ColdTimer()
    layers, graphs, _ = capture_variants(variants, model, w, x, ids, wts, t)  # noqa: F841 (kept while graphs replay)
    for r in range(rounds):
        for name, graph in graphs.items():
            time.sleep(1.0)  # the same pause before every variant
            smi = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                                    "-lms", str(SAMPLE_MS)], stdout=subprocess.PIPE, text=True)
            start, times = time.time(), []
            while time.time() - start < SECONDS:
                times.append(timer.time(graph, 10))
            smi.terminate()
            samples = [[float(v) for v in line.split(",")] for line in smi.communicate()[0].splitlines() if line.strip()]
            settled = samples[len(samples) // 3:]
            print(f"round {r} {name}: layer {statistics.median(times[len(times) // 3:]):.0f} us over "
                  f"{10 * len(times)} replays, SM clock median {statistics.median(s[0] for s in settled):.0f} MHz, "
                  f"power median {statistics.median(s[1] for s in settled):.0f} W ({len(settled)} samples)", flush=True)


if __name__ == "__main__":
    main()
