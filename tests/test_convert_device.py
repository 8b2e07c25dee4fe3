"""The FP8 -> NVFP4 requantisation and the MXFP4 -> NVFP4 cast on a device (``convert --device``): one set of torch
ops whatever the device, and the CPU's bytes from a GPU.

The tests marked ``gpu`` need a CUDA GPU (CI, CPU only, skips them):

    python3 -m pytest -q -m gpu tests/test_convert_device.py

The others run here: the same functions with ``device="cpu"``, and the refusal of ``--device cuda`` where there is
no GPU.
"""

from __future__ import annotations

import math

import pytest
import torch
from click.testing import CliRunner

from nvfp4_megamoe.convert.api import convert_checkpoint
from nvfp4_megamoe.convert.cli import main
from nvfp4_megamoe.convert.synth import write_synthetic
from nvfp4_megamoe.convert.transforms import fp8_forward, mxfp4_forward
from nvfp4_megamoe.kernels.fp8_nvfp4 import fp8_to_nvfp4_reference, fp8_to_nvfp4_tables
from nvfp4_megamoe.kernels.mxfp4 import dequantize_mxfp4, mxfp4_to_nvfp4
from nvfp4_megamoe.kernels.nvfp4 import dequantize_nvfp4

pytestmark = pytest.mark.usefixtures("one_thread")

needs_cuda = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
DEVICES = ["cpu", pytest.param("cuda", marks=needs_cuda)]


def _fp8(rows: int, cols: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 bytes (no NaN byte; some narrow and some zero 16-blocks) and E8M0 block scales over 2**-8..2**8."""
    w = torch.randint(0, 256, (rows, cols), dtype=torch.uint8, generator=g)
    w[(w & 0x7F) == 0x7F] = 0x80
    blocks = w.view(rows, -1, 16)
    blocks = torch.where(torch.rand(rows, cols // 16, 1, generator=g) < 0.3, blocks & 0x8F, blocks)
    blocks = torch.where(torch.rand(rows, cols // 16, 1, generator=g) < 0.05, blocks & 0x80, blocks)
    scales = torch.randint(119, 136, (-(-rows // 128), -(-cols // 128)), dtype=torch.uint8, generator=g)
    return blocks.reshape(rows, cols).view(torch.float8_e4m3fn), scales


def _mxfp4(rows: int, cols: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 codes and E8M0 scales spread over 2**-30..2**6, so some 32-blocks fall out of E4M3's range."""
    packed = torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8, generator=g)
    packed.view(rows, -1, 16)[torch.rand(rows, cols // 32, generator=g) < 0.05] = 0  # zero blocks
    scales = torch.randint(97, 134, (rows, cols // 32), dtype=torch.uint8, generator=g)
    return packed.view(torch.int8), scales


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_tables_on_the_device_give_the_recipes_bytes(device):
    """The tables path computed on ``device`` against the float recipe on the CPU (the oracle), bit for bit, with
    the exact value histogram the error figures come from."""
    g = torch.Generator().manual_seed(3)
    parts = [_fp8(384, 640, g), _fp8(384, 640, g)]
    oracle = fp8_to_nvfp4_reference([w for w, _ in parts], [s for _, s in parts], shared_alpha=False)
    cast = fp8_to_nvfp4_tables([w.to(device) for w, _ in parts], [s.to(device) for _, s in parts],
                               shared_alpha=False)
    assert cast is not None and cast.alphas == oracle.alphas
    for packed, scales, hist, ref_packed, ref_scales, source in zip(cast.packed, cast.scales, cast.histograms,
                                                                     oracle.packed, oracle.scales, oracle.sources):
        assert packed.device.type == device
        assert torch.equal(packed.cpu(), ref_packed) and torch.equal(scales.cpu(), ref_scales)
        assert int(hist.counts.sum()) == source.numel()
    fused, _ = fp8_forward([w for w, _ in parts], [s for _, s in parts], shared_alpha=False, device=torch.device(device))
    on_cpu, _ = fp8_forward([w for w, _ in parts], [s for _, s in parts], shared_alpha=False)
    assert fused.packed.device.type == "cpu"  # results come back for the writer
    assert torch.equal(fused.packed, on_cpu.packed) and torch.equal(fused.scales, on_cpu.scales)


@pytest.mark.parametrize("device", DEVICES)
def test_mxfp4_cast_on_the_device(device):
    """The cast on ``device``: codes kept and exact where E4M3 holds the scale, out-of-range blocks re-rounded and
    counted, and (from a GPU) the CPU's bytes."""
    g = torch.Generator().manual_seed(5)
    w1, s1 = _mxfp4(256, 1024, g)
    w3, s3 = _mxfp4(256, 1024, g)
    cast = mxfp4_to_nvfp4([w1.to(device), w3.to(device)], [s1.to(device), s3.to(device)])
    assert cast.fallback_blocks > 0
    for w, s, packed, scales in zip((w1, w3), (s1, s3), cast.packed, cast.scales):
        exact = s.to(torch.int32) - 127 - int(math.log2(cast.alpha)) >= -9  # the block's scale is an E4M3 power
        values = dequantize_nvfp4(packed.cpu(), scales.cpu(), cast.alpha).view(w.shape[0], -1, 32)
        assert torch.equal(values[exact], dequantize_mxfp4(w, s).view(w.shape[0], -1, 32)[exact])
    on_cpu = mxfp4_to_nvfp4([w1, w3], [s1, s3])
    assert (cast.alpha, cast.fallback_blocks) == (on_cpu.alpha, on_cpu.fallback_blocks)
    for a, b in zip(cast.packed + cast.scales, on_cpu.packed + on_cpu.scales):
        assert torch.equal(a.cpu(), b)
    fused = mxfp4_forward([w1, w3], [s1, s3], torch.device(device))
    assert fused.packed.device.type == "cpu" and fused.inexact_blocks == cast.fallback_blocks


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("variant,extra", [("flash", {"out_of_range_blocks": 5}), ("pro", {}), ("base", {})])
def test_conversion_on_the_gpu_writes_the_cpus_bytes(tmp_path, variant, extra):
    """A whole conversion with ``device="cuda"``: every shard and the manifest (error figures included) byte for
    byte the CPU's (flash: MXFP4 experts with out-of-range blocks and FP8 dense layers on the tables path; base:
    FP8 experts with float32 scales, on the CPU's reference path whatever the device)."""
    src = write_synthetic(tmp_path / "src", preset="tiny", variant=variant, seed=11, **extra)
    cpu = convert_checkpoint(src, tmp_path / "cpu", progress=False, workers=3)
    gpu = convert_checkpoint(src, tmp_path / "gpu", progress=False, workers=3, device="cuda")
    files = sorted(cpu.manifest["shards"]) + ["nvfp4_manifest.json", "model.safetensors.index.json"]
    assert sorted(gpu.manifest["shards"]) == sorted(cpu.manifest["shards"])
    for name in files:
        assert (tmp_path / "gpu" / name).read_bytes() == (tmp_path / "cpu" / name).read_bytes(), name


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is there")
def test_device_cuda_without_a_gpu_is_refused(tmp_path):
    src = write_synthetic(tmp_path / "src", preset="tiny", variant="flash")
    r = CliRunner().invoke(main, ["convert", str(src), str(tmp_path / "out"), "--device", "cuda", "--no-progress"])
    assert r.exit_code == 1
    assert "--device cuda: no CUDA GPU is available" in r.output and "leave --device out" in r.output
    assert not (tmp_path / "out").exists()
    r = CliRunner().invoke(main, ["convert", str(src), str(tmp_path / "out"), "--device", "tpu"])
    assert r.exit_code == 1 and "use cpu or cuda" in r.output and not (tmp_path / "out").exists()
