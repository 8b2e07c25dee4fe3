"""Two eager calls of one MoE layer (model, T, optional variant JSON), for Nsight Compute: the second call's
kernels are the ones to profile
(``ncu -k regex:Gemm --launch-skip 2 --launch-count 2 python bench/moe_ncu.py V4-Flash 4096 [SPEC_JSON]``).
The spec is ``moe_bench.variant_layer``'s (``{"weight_tiles": true}``: w13 and w2 in Hopper row tiles)."""

from __future__ import annotations

import json
import sys

import torch

from moe_bench import MODELS, routed_inputs, variant_layer

from nvfp4_megamoe.kernels.moe_reference import random_moe_weights
from nvfp4_megamoe.kernels.row_tiles import tile_expert_weights


def main() -> None:
    model, t = sys.argv[1], int(sys.argv[2])
    h, i, e, k = MODELS[model]
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = random_moe_weights(e, h, i, generator=gen, device="cuda", distinct_halves=False)
    layer = variant_layer(model, json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}, t)
    if layer.shape.weight_tiles:
        w = tile_expert_weights(w)
    x, ids, wts = routed_inputs(t, h, e, k, gen)
    for _ in range(2):
        layer(x, ids, wts, **w)
    torch.cuda.synchronize()
    print(layer.plan(t))


if __name__ == "__main__":
    main()
