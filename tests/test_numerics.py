"""Codecs and layout transforms in kernels/: each forward against its inverse and against the spec."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nvfp4_megamoe.kernels.e2m1 import (E2M1_MAGNITUDES, decode_e2m1, decode_e2m1_packed, encode_e2m1, pack_nibbles,
                                        unpack_nibbles)
from nvfp4_megamoe.kernels.fp8 import fp8_block_dequantize, fp8_block_quantize
from nvfp4_megamoe.kernels.interleave import deinterleave_gate_up, interleave_gate_up
from nvfp4_megamoe.kernels.mxfp4 import dequantize_mxfp4, mxfp4_to_nvfp4, shared_exponent
from nvfp4_megamoe.kernels.nvfp4 import dequantize_nvfp4, encode_nvfp4, quantize_nvfp4, reconcile_global_scales
from nvfp4_megamoe.kernels.scales import decode_e4m3, decode_e8m0, encode_e4m3, encode_e8m0, e8m0_exponent
from nvfp4_megamoe.kernels.swizzle import (swizzle_block_scales, swizzle_padding, swizzled_row_slice,
                                          unswizzle_block_scales)

from numeric import rel_err

SETTINGS = settings(max_examples=40, deadline=None)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@SETTINGS
@given(rows=st.integers(1, 9), pairs=st.integers(1, 40), seed=st.integers(0, 2**31))
def test_nibble_pack_roundtrip_keeps_every_code(rows, pairs, seed):
    codes = torch.randint(0, 16, (rows, 2 * pairs), dtype=torch.uint8, generator=_gen(seed))
    packed = pack_nibbles(codes)
    assert torch.equal(unpack_nibbles(packed), codes)
    assert torch.equal(packed & 0xF, codes[:, 0::2])  # low nibble = even element
    assert torch.equal(unpack_nibbles(packed.view(torch.int8)), codes)


@SETTINGS
@given(rows=st.integers(1, 5), n=st.integers(1, 33), seed=st.integers(0, 2**31))
def test_packed_decode_equals_unpack_then_decode(rows, n, seed):
    packed = torch.randint(0, 256, (rows, n), dtype=torch.uint8, generator=_gen(seed))
    want = decode_e2m1(unpack_nibbles(packed))
    got = decode_e2m1_packed(packed)
    assert torch.equal(got, want) and torch.equal(torch.signbit(got), torch.signbit(want))
    assert torch.equal(decode_e2m1_packed(packed.view(torch.int8)), want)


def test_negative_zero_survives_pack_and_decode():
    codes = torch.tensor([[0x8, 0x0, 0x8, 0x9]], dtype=torch.uint8)
    assert torch.equal(unpack_nibbles(pack_nibbles(codes)), codes)
    v = decode_e2m1(codes)
    assert torch.signbit(v[0, 0]) and not torch.signbit(v[0, 1]) and v[0, 3] == -0.5


def test_e2m1_encode_ties_to_even_and_saturates():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.2501, 7.0, -5.0, -0.1, 1e9])
    want = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 0.5, 6.0, -4.0, -0.0, 6.0]
    assert decode_e2m1(encode_e2m1(x)).tolist() == want
    assert encode_e2m1(torch.tensor([-0.1]))[0] == 0x8


@SETTINGS
@given(seed=st.integers(0, 2**31))
def test_e2m1_encode_matches_threshold_definition(seed):
    """Counting thresholds passed (strict where the upper code is odd, inclusive where even)."""
    g = _gen(seed)
    quarters = torch.randint(-40, 41, (512,), generator=g).float() / 4  # every tie, exactly
    x = torch.cat((quarters, (torch.rand(4096, generator=g) - 0.5) * 20, torch.tensor([1e30, -1e30, -0.0])))
    mag = x.abs()
    want = sum((mag >= th if even else mag > th).to(torch.uint8)
               for th, even in ((0.25, 0), (0.75, 1), (1.25, 0), (1.75, 1), (2.5, 0), (3.5, 1), (5.0, 0)))
    want = want | (torch.signbit(x).to(torch.uint8) << 3)
    assert torch.equal(encode_e2m1(x), want)


def test_e2m1_decode_encode_is_identity_on_all_codes():
    codes = torch.arange(16, dtype=torch.uint8)
    assert torch.equal(encode_e2m1(decode_e2m1(codes)), codes)
    assert [abs(float(v)) for v in decode_e2m1(codes[:8])] == list(E2M1_MAGNITUDES)


@SETTINGS
@given(seed=st.integers(0, 2**31))
def test_e2m1_encode_is_nearest(seed):
    x = (torch.rand(4096, generator=_gen(seed)) - 0.5) * 14
    got = decode_e2m1(encode_e2m1(x))
    grid = torch.tensor(sorted({s * m for m in E2M1_MAGNITUDES for s in (1, -1)}))
    best = (x.clamp(-6, 6).unsqueeze(1) - grid).abs().min(dim=1).values
    assert torch.all((got - x.clamp(-6, 6)).abs() <= best + 1e-7)


def test_e4m3_all_bytes_roundtrip_and_no_nan_from_large_values():
    b = torch.arange(256, dtype=torch.uint8)
    finite = ~((b & 0x7F) == 0x7F)
    assert torch.equal(encode_e4m3(decode_e4m3(b[finite])), b[finite])
    big = encode_e4m3(torch.tensor([480.0, 1e6, -1e30]))
    assert decode_e4m3(big).tolist() == [448.0, 448.0, -448.0]


def test_e8m0_decodes_exact_powers_of_two():
    b = torch.arange(255, dtype=torch.uint8)
    got = decode_e8m0(b).double()
    want = torch.tensor([math.ldexp(1.0, int(i) - 127) for i in range(255)], dtype=torch.float64)
    assert torch.equal(got, want)
    assert math.isnan(float(decode_e8m0(torch.tensor([255], dtype=torch.uint8))))
    k = torch.arange(-127, 128)
    assert torch.equal(e8m0_exponent(encode_e8m0(k)), k.int())


def _swizzle_offset(m: int, kb: int, n_kb: int) -> int:
    return ((m // 128) * math.ceil(n_kb / 4) + kb // 4) * 512 + (m % 32) * 16 + ((m // 32) % 4) * 4 + kb % 4


@SETTINGS
@given(rows=st.integers(1, 300), cols=st.integers(1, 19), seed=st.integers(0, 2**31))
def test_swizzle_matches_formula_and_inverts(rows, cols, seed):
    s = torch.randint(1, 256, (rows, cols), dtype=torch.uint8, generator=_gen(seed))
    flat = swizzle_block_scales(s)
    assert flat.numel() == math.ceil(rows / 128) * 128 * math.ceil(cols / 4) * 4
    g = _gen(seed + 1)
    for _ in range(50):
        m, kb = int(torch.randint(rows, (1,), generator=g)), int(torch.randint(cols, (1,), generator=g))
        assert flat[_swizzle_offset(m, kb, cols)] == s[m, kb]
    assert torch.equal(unswizzle_block_scales(flat, rows, cols), s)
    assert int(swizzle_padding(flat, rows, cols).count_nonzero()) == 0
    assert int(flat.count_nonzero()) == rows * cols


@SETTINGS
@given(blocks=st.integers(1, 4), tail=st.integers(0, 127), cols=st.integers(1, 19), seed=st.integers(0, 2**31))
def test_swizzled_row_slice_is_the_swizzle_of_the_rows(blocks, tail, cols, seed):
    rows = 128 * blocks + tail
    s = torch.randint(1, 256, (rows, cols), dtype=torch.uint8, generator=_gen(seed))
    flat = swizzle_block_scales(s)
    for start in range(0, rows, 128):
        for stop in {min(start + 128, rows), rows}:
            got = swizzled_row_slice(flat, rows, cols, start, stop)
            assert got.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()  # a view, no copy
            assert torch.equal(got, swizzle_block_scales(s[start:stop]))
    with pytest.raises(ValueError, match="128-row"):
        swizzled_row_slice(flat, rows, cols, 64, rows)


@SETTINGS
@given(groups=st.integers(1, 12), cols=st.integers(1, 6), seed=st.integers(0, 2**31))
def test_interleave_gate_first_by_eight_and_inverts(groups, cols, seed):
    rows = 8 * groups
    gate = torch.randn(rows, cols, generator=_gen(seed))
    up = torch.randn(rows, cols, generator=_gen(seed + 1))
    fused = interleave_gate_up(gate, up)
    for r in range(2 * rows):
        src = gate if (r // 8) % 2 == 0 else up
        assert torch.equal(fused[r], src[8 * (r // 16) + r % 8])
    g2, u2 = deinterleave_gate_up(fused)
    assert torch.equal(g2, gate) and torch.equal(u2, up)


def test_interleave_rejects_rows_not_multiple_of_eight():
    with pytest.raises(ValueError, match="divisible by 8"):
        interleave_gate_up(torch.zeros(12, 2), torch.zeros(12, 2))


def _nvfp4_reference(x: torch.Tensor) -> torch.Tensor:
    """The NVFP4 recipe in float64, independently of kernels/nvfp4.py."""
    x = x.double()
    alpha = x.abs().max() / (6 * 448)
    blocks = x.reshape(x.shape[0], -1, 16)
    sb = (blocks.abs().amax(-1) / (6 * alpha)).clamp(2**-9, 448).float().to(torch.float8_e4m3fn).double()
    step = (sb * alpha.float().double()).unsqueeze(-1)
    grid = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=torch.float64)
    mag = (blocks / step).abs().clamp(max=6)
    idx = (mag.unsqueeze(-1) - grid).abs().argmin(-1)
    return (torch.sign(blocks) * grid[idx] * step).reshape(x.shape)


@SETTINGS
@given(rows=st.integers(1, 40), kblocks=st.integers(1, 8), seed=st.integers(0, 2**31))
def test_nvfp4_quantize_matches_recipe_and_encode_inverts_dequant(rows, kblocks, seed):
    x = torch.randn(rows, 16 * kblocks, generator=_gen(seed)) * 3
    q = quantize_nvfp4(x)
    deq = dequantize_nvfp4(q.packed, q.scales, q.alpha)
    ref = _nvfp4_reference(x)
    # Same grid point except at exact ties (measure zero on random data), so compare values.
    assert (deq.double() - ref).abs().max() <= 1e-6 * ref.abs().max()
    assert torch.equal(encode_nvfp4(deq, q.scales, q.alpha), q.packed)
    assert rel_err(deq, x) < 0.15


def test_nvfp4_zero_block_policy():
    x = torch.randn(2, 48)
    x[1, 16:32] = 0
    q = quantize_nvfp4(x)
    assert q.scales[1, 1] == 0x01  # smallest E4M3 scale, 2**-9
    assert int(unpack_nibbles(q.packed)[1, 16:32].count_nonzero()) == 0
    z = quantize_nvfp4(torch.zeros(4, 32))
    assert z.alpha == 1.0 and float(dequantize_nvfp4(z.packed, z.scales, z.alpha).abs().max()) == 0


def _random_mxfp4(rows, k, lo, hi, seed):
    g = _gen(seed)
    packed = torch.randint(-128, 128, (rows, k // 2), dtype=torch.int8, generator=g)
    scales = torch.randint(lo, hi, (rows, k // 32), dtype=torch.uint8, generator=g)
    return packed, scales


@SETTINGS
@given(seed=st.integers(0, 2**31), lo=st.integers(100, 126), spread=st.integers(1, 18))
def test_mxfp4_cast_is_exact_in_range(seed, lo, spread):
    w1, s1 = _random_mxfp4(24, 128, lo, lo + spread, seed)
    w3, s3 = _random_mxfp4(24, 128, lo, lo + spread, seed + 1)
    r = mxfp4_to_nvfp4([w1, w3], [s1, s3])
    assert r.fallback_blocks == 0
    assert math.log2(r.alpha).is_integer()
    for p, s, rp, rs in zip((w1, w3), (s1, s3), r.packed, r.scales):
        assert torch.equal(rp, p.view(torch.uint8))
        assert torch.equal(dequantize_nvfp4(rp, rs, r.alpha), dequantize_mxfp4(p, s))
        eff = decode_e4m3(rs).double() * r.alpha
        assert torch.equal(eff, decode_e8m0(s).double().repeat_interleave(2, dim=1))


def test_mxfp4_cast_counts_and_bounds_out_of_range_blocks():
    w1, s1 = _random_mxfp4(16, 64, 120, 124, 0)
    w3, s3 = _random_mxfp4(16, 64, 120, 124, 1)
    w3[0] = 0x77  # every code 6: non-zero block
    s3[0, :] = 80  # 40+ exponents below the others: outside E4M3's 2**[-9, 8] range
    r = mxfp4_to_nvfp4([w1, w3], [s1, s3])
    assert r.fallback_blocks == 2
    assert torch.equal(r.packed[0], w1.view(torch.uint8))
    got = dequantize_nvfp4(r.packed[1], r.scales[1], r.alpha)
    want = dequantize_mxfp4(w3, s3)
    assert torch.equal(got[1:], want[1:])
    assert float((got[0] - want[0]).abs().max()) <= r.alpha * 2**-9 * 0.25 * 2  # within half a step of the new grid


@SETTINGS
@given(seed=st.integers(0, 2**31), zero_top=st.booleans(), zero_rows=st.integers(0, 12))
def test_mxfp4_shared_exponent_ignores_zero_blocks(seed, zero_top, zero_rows):
    """The shortcut (blocks with the largest scale byte first) gives the definition's k_max - 8: the
    largest E8M0 exponent over the non-zero blocks, with zero blocks (here some carrying the largest
    byte) left out and all-zero matrices contributing nothing."""
    w1, s1 = _random_mxfp4(12, 128, 100, 125, seed)
    w3, s3 = _random_mxfp4(12, 128, 100, 125, seed + 1)
    w1[:zero_rows] = 0
    if zero_top:  # the largest scale byte sits on zero blocks only
        s1[:max(zero_rows, 1)] = 140
        w1[:max(zero_rows, 1)] = 0
    nonzero = [(unpack_nibbles(w.view(torch.uint8)).reshape(12, -1, 32) & 7).any(-1) for w in (w1, w3)]
    tops = [int(s[nz].max()) - 127 for s, nz in zip((s1, s3), nonzero) if nz.any()]
    want = max(tops) - 8 if tops else 0
    assert shared_exponent([s1, s3], [w1, w3]) == want
    assert mxfp4_to_nvfp4([w1, w3], [s1, s3]).alpha == 2.0 ** want
    assert shared_exponent([s1[:0]], [w1[:0]]) == 0 and shared_exponent([s1], [torch.zeros_like(w1)]) == 0


def test_mxfp4_cast_rejects_nan_scale():
    w, s = _random_mxfp4(4, 32, 120, 121, 0)
    s[0, 0] = 0xFF
    with pytest.raises(ValueError, match="NaN"):
        mxfp4_to_nvfp4([w], [s])


@pytest.mark.parametrize("rows,cols", [(300, 200), (384, 256)])  # partial blocks, whole blocks
@pytest.mark.parametrize("scale_kind", ["e8m0", "f32"])
def test_fp8_block_dequant_roundtrip(scale_kind, rows, cols):
    g = _gen(3)
    w = (torch.randn(rows, cols, generator=g) * 50).clamp(-448, 448).to(torch.float8_e4m3fn)
    if scale_kind == "e8m0":
        scale = torch.randint(110, 130, (3, 2), dtype=torch.uint8, generator=g)
        values = [2.0 ** (int(b) - 127) for b in scale.reshape(-1)]
    else:
        scale = torch.rand(3, 2, generator=g) * 0.01 + 1e-4
        values = scale.reshape(-1).tolist()
    deq = fp8_block_dequantize(w, scale)
    assert deq[130, 150] == w[130, 150].float() * values[1 * 2 + 1]
    expanded = torch.tensor(values).reshape(3, 2).repeat_interleave(128, 0).repeat_interleave(128, 1)
    assert torch.equal(deq, w.float() * expanded[:rows, :cols])
    assert torch.equal(fp8_block_quantize(deq, scale).view(torch.uint8), w.view(torch.uint8))


def test_reconcile_exact_for_power_of_two_ratio_and_measured_otherwise():
    x = torch.randn(32, 64)
    q1, q3 = quantize_nvfp4(x), quantize_nvfp4(x * 0.3)
    exact = reconcile_global_scales([q1.scales, q1.scales], [q1.alpha, q1.alpha / 4])
    assert exact.changed_blocks == 0 and exact.alpha == q1.alpha
    want = decode_e4m3(q1.scales).double() * (q1.alpha / 4)
    assert torch.equal(decode_e4m3(exact.scales[1]).double() * exact.alpha, want)
    rec = reconcile_global_scales([q1.scales, q3.scales], [q1.alpha, q3.alpha])
    assert rec.alpha == max(q1.alpha, q3.alpha)
    src = decode_e4m3(q3.scales).double() * q3.alpha
    got = decode_e4m3(rec.scales[1]).double() * rec.alpha
    assert float(((got - src).abs() / src).max()) <= 2**-4 + 1e-9
    assert rec.changed_blocks > 0
    tiny = reconcile_global_scales([q1.scales, torch.full_like(q1.scales, 0x01)], [1.0, 2.0**-12])
    assert int((tiny.scales[1] == 0).sum()) == 0  # a non-zero scale never becomes zero
