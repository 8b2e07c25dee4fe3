"""The activation K orders of the SM90 MoE kernels: to_order / from_order round trips and the per-index map."""

from __future__ import annotations

import pytest
import torch

from nvfp4_megamoe.kernels.k_order import ORDERS, from_order, position, to_order


@pytest.mark.parametrize("order", ORDERS)
def test_round_trip_and_position_agree(order):
    x = torch.randn(3, 5, 384, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    y = to_order(x, order)
    assert torch.equal(from_order(y, order), x)
    pos = torch.tensor([position(j, order) for j in range(384)])
    assert sorted(pos.tolist()) == list(range(384))          # a permutation of each row
    assert torch.equal(y[..., pos], x)                         # logical j is stored at position(j)
    out = torch.empty(3, 5, 384, dtype=torch.bfloat16)
    assert to_order(x, order, out=out) is out and torch.equal(out, y)


def test_orders_hold_the_mma_operand_pairs():
    """"lane": word 4w + 2u + hi of quad c's run is (k, k + 4), k = 32c + 8w + 2u + hi; "staged": 16-byte
    chunk 2s + hi holds that pair for quads c = 0..3 (s = 2w + u)."""
    k = torch.arange(128)
    lane, staged = to_order(k, "lane"), to_order(k, "staged")
    for c in range(4):
        for w in range(4):
            for u in range(2):
                for hi in range(2):
                    k0 = 32 * c + 8 * w + 2 * u + hi
                    word = 32 * c + 2 * (4 * w + 2 * u + hi)
                    assert lane[word:word + 2].tolist() == [k0, k0 + 4]
                    chunk = 8 * (2 * (2 * w + u) + hi) + 2 * c
                    assert staged[chunk:chunk + 2].tolist() == [k0, k0 + 4]


def test_bad_order_or_row_length_is_refused():
    with pytest.raises(ValueError, match="order must be one of"):
        to_order(torch.zeros(128), "swizzled")
    with pytest.raises(ValueError, match="multiple of 128"):
        to_order(torch.zeros(2, 100), "lane")
    with pytest.raises(ValueError, match="order must be one of"):
        position(3, "swizzled")
