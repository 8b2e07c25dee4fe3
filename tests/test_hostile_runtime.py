"""Hostile and broken input to the runtime: a converted checkpoint edited on disk, and bad token ids.

``load_model`` must refuse, with a :class:`FormatError` naming the file or tensor, every checkpoint whose
tensors contradict the format or config.json, whose alphas are not finite and positive, or whose index
leads outside the folder or to a file that is not a regular file; ``Model`` must refuse token ids outside
``[0, vocab)`` saying so. Also the error hierarchy: one base, the old names and ``ValueError`` kept.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import pytest
import torch

from hostile_inputs import INDEX, converted, copy_tree, edit_json, poke, rewrite_shard, shard_of, within
from nvfp4_megamoe.errors import (ConvertError, FormatError, InputError, KernelArgumentError, Nvfp4MegamoeError,
                                  OutputError, PlanError, SourceError)
from nvfp4_megamoe.runtime import load_model
from nvfp4_megamoe.runtime.format import SHARD_METADATA

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def out(tmp_path_factory, tmp_path) -> Path:
    """A conversion with NVFP4 dense layers (``--dense nvfp4``: scales and alphas to damage), a copy of its own."""
    return copy_tree(converted(tmp_path_factory, "flash", dense="nvfp4"), tmp_path / "out")


@pytest.fixture
def kept(tmp_path_factory, tmp_path) -> Path:
    """A default conversion (dense FP8 linears kept as released), a copy of its own."""
    return copy_tree(converted(tmp_path_factory, "flash"), tmp_path / "kept")


def _refused(path: Path, *must_name: str) -> str:
    with pytest.raises(FormatError) as err:
        load_model(path)
    msg = str(err.value)
    for name in must_name:
        assert name in msg, (name, msg)
    return msg


def _replace(out: Path, tensor: str, value: torch.Tensor) -> None:
    rewrite_shard(out, shard_of(out, tensor), lambda t: t.__setitem__(tensor, value), metadata=SHARD_METADATA)


@pytest.mark.parametrize("tensor, value, expect", [
    ("layers.1.attn_norm.weight", torch.ones(256, dtype=torch.int32), "is I32 [256]; the format and config.json imply "
                                                                      "BF16/F16/F32 [256]"),
    ("layers.2.attn.q_norm.weight", torch.ones(127, dtype=torch.bfloat16), "is BF16 [127]"),
    ("embed.weight", torch.zeros(511, 256, dtype=torch.bfloat16), "is BF16 [511, 256]"),
    ("layers.1.ffn.experts.w13.alpha", torch.ones(8, dtype=torch.float16), "is F16 [8]; the format and config.json "
                                                                           "imply F32 [8, 2]"),
    ("layers.1.attn.wq_a.weight_scale", torch.zeros(100, dtype=torch.uint8), "is U8 [100]"),
    ("layers.3.ffn.experts.w2.weight", torch.zeros(8, 256, 32, dtype=torch.uint8), "is U8 [8, 256, 32]"),
    ("layers.0.ffn.gate.tid2eid", torch.zeros(512, 2, dtype=torch.float32), "is F32 [512, 2]"),
])
def test_tensors_contradicting_the_format_or_config(out, tensor, value, expect):
    _replace(out, tensor, value)
    _refused(out, tensor, expect, "convert the source again")


@pytest.mark.parametrize("tensor, value, expect", [
    ("layers.1.attn.wq_a.scale", torch.zeros(3, dtype=torch.uint8), "is U8 [3]"),
    ("layers.2.attn.wkv.weight", torch.zeros(4, 4, dtype=torch.bfloat16), "is BF16 [4, 4]"),
])
def test_kept_fp8_tensors_contradicting_the_format(kept, tensor, value, expect):
    _replace(kept, tensor, value)
    _refused(kept, tensor, expect, "convert the source again")


def test_a_config_contradicting_the_tensors(out):
    edit_json(out / "config.json", lambda c: c.__setitem__("vocab_size", 1024))
    _refused(out, "embed.weight", "BF16 [512, 256]", "BF16/F16/F32 [1024, 256]")


@pytest.mark.parametrize("value", ["256", 256.5, None, -1])
def test_a_config_field_of_the_wrong_type(out, value):
    edit_json(out / "config.json", lambda c: c.pop("hidden_size") if value is None else c.__setitem__("hidden_size", value))
    _refused(out, "config.json", "'hidden_size'")


@pytest.mark.parametrize("field, value", [("scoring_func", "x"), ("compress_rope_theta", 1), ("rms_norm_eps", -1),
                                          ("routed_scaling_factor", 1e308), ("num_hash_layers", 9)])
def test_config_values_the_model_cannot_compute_with(out, field, value):
    edit_json(out / "config.json", lambda c: c.__setitem__(field, value))
    _refused(out, "config.json", field)


def test_a_corrupt_shard_header_or_an_index_the_shard_contradicts(out):
    shard = next(out.glob("model-*.safetensors"))
    edit_json(out / INDEX, lambda i: i["weight_map"].__setitem__("norm.weight.extra", shard.name))
    _refused(out, "holds no tensor 'norm.weight.extra'")
    edit_json(out / INDEX, lambda i: i["weight_map"].pop("norm.weight.extra"))
    with open(shard, "r+b") as f:
        f.seek(9)
        f.write(b"\xff")  # not UTF-8
    _refused(out, shard.name, "cannot be read as safetensors")


@pytest.mark.parametrize("tensor, value", [
    ("layers.1.ffn.experts.w13.alpha", float("nan")), ("layers.1.ffn.experts.w2.alpha", 0.0),
    ("layers.2.attn.wq_b.alpha", float("inf")), ("layers.0.ffn.shared_experts.w13.alpha", -1.0),
])
def test_alphas_must_be_finite_and_positive(out, tensor, value):
    poke(out, tensor, struct.pack("<f", value), at=4 if ".experts." in tensor else 0)
    _refused(out, tensor, "not finite and positive")


@pytest.mark.parametrize("value", [8, -1])
def test_tid2eid_must_name_experts(out, value):
    poke(out, "layers.0.ffn.gate.tid2eid", struct.pack("<q", value), at=8)
    _refused(out, "layers.0.ffn.gate.tid2eid", "outside [0, 8)")


@pytest.mark.parametrize("target", ["../src/model-00001-of-00001.safetensors", "/etc/passwd",
                                    "model-00001-of-00001.safetensors/../model-00001-of-00001.safetensors",
                                    "model-1-of-1.safetensors", "model-00002-of-00001.safetensors", 7])
def test_index_paths_stay_inside_the_checkpoint(out, target):
    edit_json(out / INDEX, lambda i: i["weight_map"].__setitem__("layers.1.attn_norm.weight", target))
    _refused(out, "not a format-1 shard name", "layers.1.attn_norm.weight")


@pytest.mark.parametrize("what", ["shard", "nvfp4_manifest.json", INDEX, "config.json"])
def test_a_fifo_in_the_checkpoint_does_not_block_loading(out, what):
    path = next(out.glob("model-*.safetensors")) if what == "shard" else out / what
    path.unlink()
    os.mkfifo(path)
    with pytest.raises(FormatError, match="FIFO"):
        within(60, lambda: load_model(out))


def test_token_ids_outside_the_vocabulary(tmp_path_factory):
    model = load_model(converted(tmp_path_factory, "flash"))
    vocab = model.config.vocab_size
    for ids, expect in ((torch.tensor([[1, 2, -1]]), "input_ids[0, 2] is -1"),
                        (torch.tensor([[vocab, 3]]), f"input_ids[0, 0] is {vocab}"),
                        (torch.tensor([[1.0, 2.0]]), "integer token ids, got dtype torch.float32")):
        with pytest.raises(InputError) as err:
            model(ids)
        assert f"[0, {vocab})" in str(err.value) or "integer" in str(err.value)
        assert expect in str(err.value)
        assert isinstance(err.value, ValueError)  # callers catching ValueError keep working
    state = model.new_state(1)
    with pytest.raises(InputError, match=f"lie in \\[0, {vocab}\\)"):
        model.step(torch.tensor([vocab + 7]), state)
    assert state.position == 0  # refused before anything ran
    assert model(torch.tensor([[0, vocab - 1]])).shape == (1, 2, vocab)  # the edges are fine


def test_one_error_hierarchy():
    for cls in (ConvertError, SourceError, PlanError, OutputError, FormatError, KernelArgumentError, InputError):
        assert issubclass(cls, Nvfp4MegamoeError)
    for cls in (FormatError, KernelArgumentError, InputError):
        assert issubclass(cls, ValueError)
    assert not issubclass(ConvertError, ValueError)  # the converter wraps a transform's ValueError, never its own
    from nvfp4_megamoe.convert import errors as convert_errors
    from nvfp4_megamoe.kernels.cute_host import expect
    from nvfp4_megamoe.runtime import FormatError as runtime_format_error
    from nvfp4_megamoe.runtime import format as runtime_format

    assert convert_errors.SourceError is SourceError and runtime_format.FormatError is FormatError
    assert runtime_format_error is FormatError
    with pytest.raises(KernelArgumentError, match="rows must be a multiple"):
        expect(False, "rows must be a multiple of 128")
    err = SourceError("x: bad", path="x", tensor="t")
    err.add_hint("Do this.")
    assert (err.path, err.tensor, str(err)) == ("x", "t", "x: bad Do this.")
