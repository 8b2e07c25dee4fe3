"""Two eager calls of one MoE layer (model, T, optional tuning JSON), for Nsight Compute: the second call's
kernels are the ones to profile
(``ncu -k regex:Gemm --launch-skip 2 --launch-count 2 python bench/moe_ncu.py V4-Flash 4096 [TUNING_JSON]``).
The tuning key ``"_weight_tiles": true`` gives the layer w13 and w2 in Hopper row tiles (``--target sm90``)."""

from __future__ import annotations

import json
import sys

import torch

from moe_bench import LIMIT, MODELS, routed_inputs

from nvfp4_megamoe.kernels.moe_reference import random_moe_weights
from nvfp4_megamoe.kernels.row_tiles import tile_expert_weights
from nvfp4_megamoe.kernels.sm90_moe import Sm90NvFp4MoE


def main() -> None:
    model, t = sys.argv[1], int(sys.argv[2])
    h, i, e, k = MODELS[model]
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = random_moe_weights(e, h, i, generator=gen, device="cuda", distinct_halves=False)
    tuning = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
    tiles = tuning.pop("_weight_tiles", False)
    if tiles:
        w = tile_expert_weights(w)
    layer = Sm90NvFp4MoE(hidden=h, intermediate=i, experts=e, top_k=k, swiglu_limit=LIMIT, max_tokens=t,
                         tuning=tuning, weight_tiles=tiles)
    x, ids, wts = routed_inputs(t, h, e, k, gen)
    for _ in range(2):
        layer(x, ids, wts, **w)
    torch.cuda.synchronize()
    print(layer.config(t))


if __name__ == "__main__":
    main()
