"""Tiny synthetic DeepSeek-V4 checkpoints in the official on-disk format, made in code.

This is the project's embedded default source: a seeded, random, well-conditioned
checkpoint laid out exactly like the released ``deepseek-ai/DeepSeek-V4-*`` repositories
(native tensor names without a ``model.`` prefix, real dtypes, one layer per shard, a
standard ``model.safetensors.index.json``), only scaled down.  No network is used.

Public API
----------
``PRESETS``                 preset name -> config.json overrides (dims).
``PRO_OVERRIDES``           preset name -> extra overrides applied for ``variant="pro"``.
``VARIANTS``                ``("flash", "pro", "base", "modelopt", "ct")``.
``synthetic_config(preset, variant, **overrides)`` -> the config.json dict.
``write_synthetic(out, preset, variant, seed, *, out_of_range_blocks=0, **overrides)`` -> Path.

Variants
--------
``flash``     official V4-Flash layout: FP8 (E4M3 + E8M0 block scales) linears, routed
              experts MXFP4 (``.weight`` I8 [out, in/2], low nibble = even element,
              ``.scale`` F8_E8M0 [out, in/32]); compress_ratios ``[0, 0, 4, 128, 4, ..., 0]``.
``pro``       the same formats; compress_ratios ``[128, 128, 4, 128, 4, ..., 0]`` and the
              preset's ``PRO_OVERRIDES`` (more experts, wider I, more o_groups, scaling 2.5).
``base``      ``-Base``: routed experts F8_E4M3 [out, in] with F32 ``.scale``
              [ceil(out/128), ceil(in/128)]; every FP8 ``.scale`` is F32 (amax/448, not a
              power of two); ``expert_dtype: "fp8"``.
``modelopt``  ``nvidia/DeepSeek-V4-Flash-NVFP4``-like: backbone routed experts become
              ``weight`` U8 [out, in/2] + ``weight_scale`` F8_E4M3 [out, in/16] +
              ``weight_scale_2`` F32 [] + ``input_scale`` F32 []; w1 and w3 of every expert get
              *different* ``weight_scale_2`` (non power-of-two ratio); MTP experts stay MXFP4;
              everything else as flash.  Config gains ``quant_algo: MIXED_PRECISION``,
              ``moe_quant_algo: NVFP4``, ``group_size: 16``, ``ignore``, ``quantized_layers``,
              ``config_groups``, ``producer``; an ``hf_quant_config.json`` is written too.
``ct``        compressed-tensors NVFP4 (llm-compressor ``nvfp4-pack-quantized`` export):
              backbone routed experts become ``weight_packed`` U8 [out, in/2] (low nibble =
              even element) + ``weight_scale`` F8_E4M3 [out, in/16] + ``weight_global_scale``
              F32 [1] (a divisor: ``gs = 448*6/amax``, x = e2m1 * e4m3 / gs) +
              ``input_global_scale`` F32 [1]; w1 and w3 get different global scales, none
              a power of two; MTP experts stay MXFP4; everything else as flash. Config's
              ``quantization_config`` becomes compressed-tensors style (``quant_method:
              compressed-tensors``, ``format: nvfp4-pack-quantized``, ``config_groups``,
              ``ignore``).

Values
------
Every tensor is drawn from its own generator seeded by ``(seed, tensor name)``, so adding a
tensor never changes the others.  Effective (dequantised) weights are ~N(0, 1/fan_in) with a
per-block magnitude spread of 2^U(-1, 1); FP8 weights are quantised as DeepSeek does
(E8M0 scale = 2^ceil(log2(amax/448)), clamp, cast); MXFP4 blocks get
2^ceil(log2(amax/6)) scales (so k_max - k stays small, a few exponents) and E2M1 codes
by round-to-nearest-even that keeps the sign (so -0 = 0x8 nibbles occur).
``out_of_range_blocks=n`` lowers the scale of n non-zero 32-blocks of expert 0's w3 to
20..23 exponents below k_max (over that expert's w1 and w3 blocks) to exercise the
MXFP4 -> NVFP4 fallback: in ``layers.0`` for flash/pro, in ``mtp.0`` for modelopt/ct (the only
MXFP4 experts it has); ``base`` has no MXFP4 experts and refuses.
Norm weights ~1, hc parameters small, ``attn_sink`` ~0, compressor ``ape`` small, gate bias
small, ``tid2eid`` rows are distinct experts.

Names and shapes vs the released checkpoints / transformers 5.23
---------------------------------------------------------------
Names follow the official checkpoint (docs/deepseek_v4.md); transformers' ``conversion_mapping``
for ``deepseek_v4`` renames exactly these native names (``attn``->``self_attn``,
``ffn``->``mlp``, ``indexer.compressor``->``compressor.indexer``, ``ape``->``position_bias``,
``gate.bias``->``e_score_correction_bias``, experts w1/w3 fused into ``gate_up_proj``, ...)
and ignores ``mtp.*``.  Points worth knowing:

* transformers has no FP8/MXFP4 block-scale loader for this naming (it expects
  ``scale_inv``); loading with transformers needs a dequantised checkpoint.
* ``mtp.0.hc_head_scale`` is [1] like the global ``hc_head_scale`` (official
  ``inference/model.py``); some ports use [3].
* transformers reads ``compress_ratios`` / ``num_hash_layers`` / ``qk_rope_head_dim`` /
  ``rope_scaling`` as legacy keys and folds them into ``layer_types`` / ``mlp_layer_types`` /
  ``partial_rotary_factor`` / ``rope_parameters``; the extra MTP entry of
  ``compress_ratios`` is dropped by its ``[:num_hidden_layers]`` slice.
* ``expert_dtype`` is written both top-level and inside ``quantization_config``
  (transformers folds the top-level one in; newer official configs carry it there).
* No shape differences from the released checkpoints (docs/deepseek_v4.md) were found: the compressor projects to
  ``2*head_dim`` (overlapping windows) at ratio 4 and ``head_dim`` at ratio 128, the indexer
  compressor to ``2*index_head_dim``; norms are ``head_dim`` / ``index_head_dim``.

This module is deliberately independent of the converter and of ``nvfp4_megamoe.kernels``:
it carries its own small E2M1 / E4M3 / E8M0 encoders.
"""

from __future__ import annotations

import json
import math
import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from .synth_config import _MODELOPT_IGNORE, PRESETS, PRO_OVERRIDES, VARIANTS, compress_pattern, synthetic_config

__all__ = [
    "PRESETS",
    "PRO_OVERRIDES",
    "VARIANTS",
    "synthetic_config",
    "write_synthetic",
    "compress_pattern",
]

_SPECIAL_TOKENS = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"]


# --------------------------------------------------------------------------- encoders

_E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest-even E2M1 codes (uint8, 0..15); saturates at 6; keeps the sign of
    values that round to zero (-0 -> 0x8)."""
    a = x.abs().float()
    code = (
        (a > 0.25).to(torch.uint8)
        + (a >= 0.75).to(torch.uint8)
        + (a > 1.25).to(torch.uint8)
        + (a >= 1.75).to(torch.uint8)
        + (a > 2.5).to(torch.uint8)
        + (a >= 3.5).to(torch.uint8)
        + (a > 5.0).to(torch.uint8)
    )
    return code | (torch.signbit(x).to(torch.uint8) << 3)


def _e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    grid = torch.tensor(_E2M1_GRID, dtype=torch.float32)
    mag = grid[(codes & 7).long()]
    return torch.where((codes & 8) != 0, -mag, mag)


def _pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[..., K] codes -> [..., K/2] uint8, low nibble = even element."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous()


def _e8m0(exponents: torch.Tensor) -> torch.Tensor:
    """Integer exponents k -> float8_e8m0fnu holding 2^k."""
    b = exponents.to(torch.int32) + 127
    if int(b.min()) < 0 or int(b.max()) > 254:
        raise ValueError("E8M0 exponent out of range")
    return b.to(torch.uint8).view(torch.float8_e8m0fnu)


def _to_e4m3(x: torch.Tensor) -> torch.Tensor:
    return x.float().clamp(-448.0, 448.0).to(torch.float8_e4m3fn)


# --------------------------------------------------------------------------- generators


class _Rng:
    """One generator per tensor name, derived from the checkpoint seed."""

    def __init__(self, seed: int) -> None:
        self.seed = seed

    def __call__(self, name: str) -> torch.Generator:
        g = torch.Generator()
        g.manual_seed((self.seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
        return g


def _randn(g: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=g, dtype=torch.float32)


def _spread(g: torch.Generator, out: int, inp: int, br: int, bc: int) -> torch.Tensor:
    """Per-(br x bc)-block magnitude factor 2^U(-1,1), normalised to unit mean square."""
    nr, nc = -(-out // br), -(-inp // bc)
    f = torch.exp2(torch.rand(nr, nc, generator=g) * 2.0 - 1.0)
    f = f / f.pow(2).mean().sqrt()
    return f.repeat_interleave(br, 0)[:out].repeat_interleave(bc, 1)[:, :inp]


def _dense(g: torch.Generator, out: int, inp: int, gain: float = 1.0) -> torch.Tensor:
    """Effective weight ~ N(0, gain^2/inp) with 128-block magnitude spread."""
    return _randn(g, out, inp) * _spread(g, out, inp, 128, 128) * (gain / math.sqrt(inp))


def _fp8_linear(
    g: torch.Generator, out: int, inp: int, f32_scale: bool, gain: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(F8_E4M3 [out, in], scale [ceil(out/128), ceil(in/128)]) as DeepSeek quantises."""
    w = _dense(g, out, inp, gain)
    nr, nc = -(-out // 128), -(-inp // 128)
    pad = torch.zeros(nr * 128, nc * 128)
    pad[:out, :inp] = w
    amax = pad.view(nr, 128, nc, 128).abs().amax(dim=(1, 3)).clamp_min(1e-12)
    if f32_scale:
        scale = (amax / 448.0).float()
        scale_t = scale
    else:
        k = torch.ceil(torch.log2(amax / 448.0))
        scale = torch.exp2(k)
        scale_t = _e8m0(k)
    full = scale.repeat_interleave(128, 0)[:out].repeat_interleave(128, 1)[:, :inp]
    return _to_e4m3(w / full), scale_t


def _mxfp4(g: torch.Generator, out: int, inp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(I8 [out, in/2] packed E2M1, F8_E8M0 [out, in/32]); effective ~N(0, 1/in)."""
    w = _randn(g, out, inp) * _spread(g, out, inp, 1, 32) / math.sqrt(inp)
    blocks = w.view(out, inp // 32, 32)
    amax = blocks.abs().amax(-1).clamp_min(1e-30)
    k = torch.ceil(torch.log2(amax / 6.0))
    codes = _e2m1_encode(blocks / torch.exp2(k)[..., None]).view(out, inp)
    return _pack_nibbles(codes).view(torch.int8), _e8m0(k)


def _nvfp4(g: torch.Generator, out: int, inp: int, gain: float) -> dict[str, torch.Tensor]:
    """ModelOpt NVFP4: weight U8 [out, in/2], weight_scale E4M3 [out, in/16],
    weight_scale_2 F32 [], input_scale F32 []."""
    w = _randn(g, out, inp) * _spread(g, out, inp, 1, 16) * (gain / math.sqrt(inp))
    s2 = (w.abs().amax() / (6.0 * 448.0)).float()
    blocks = w.view(out, inp // 16, 16)
    bamax = blocks.abs().amax(-1)
    sb = (bamax / (6.0 * s2)).clamp(2.0**-9, 448.0).to(torch.float8_e4m3fn)
    codes = _e2m1_encode(blocks / (sb.float() * s2)[..., None]).view(out, inp)
    input_scale = (3.0 + 5.0 * torch.rand((), generator=g)) / (6.0 * 448.0)
    return {
        "weight": _pack_nibbles(codes),
        "weight_scale": sb,
        "weight_scale_2": s2.reshape(()).clone(),
        "input_scale": input_scale.float().reshape(()),
    }


def _ct_nvfp4(g: torch.Generator, out: int, inp: int, gain: float) -> dict[str, torch.Tensor]:
    """compressed-tensors NVFP4 (llm-compressor): weight_packed U8 [out, in/2], weight_scale E4M3
    [out, in/16], weight_global_scale F32 [1] = 448*6/amax (a divisor), input_global_scale F32 [1].
    Block scale e4m3(block_amax/6 * gs), codes rne(x / (e4m3/gs)), as compressed-tensors does."""
    w = _randn(g, out, inp) * _spread(g, out, inp, 1, 16) * (gain / math.sqrt(inp))
    gs = (torch.tensor(448.0 * 6.0) / w.abs().amax()).float()
    blocks = w.view(out, inp // 16, 16)
    sb = (blocks.abs().amax(-1) / 6.0 * gs).clamp(2.0**-9, 448.0).to(torch.float8_e4m3fn)
    codes = _e2m1_encode(blocks / (sb.float() / gs)[..., None]).view(out, inp)
    act_amax = 3.0 + 5.0 * torch.rand((), generator=g)
    return {
        "weight_packed": _pack_nibbles(codes),
        "weight_scale": sb,
        "weight_global_scale": gs.reshape(1).clone(),
        "input_global_scale": (448.0 * 6.0 / act_amax).float().reshape(1),
    }


def _norm(g: torch.Generator, n: int) -> torch.Tensor:
    return (1.0 + 0.1 * _randn(g, n)).to(torch.bfloat16)


def _bf16(g: torch.Generator, out: int, inp: int) -> torch.Tensor:
    return _dense(g, out, inp).to(torch.bfloat16)


# --------------------------------------------------------------------------- tensors


class _Builder:
    def __init__(self, cfg: dict[str, Any], variant: str, seed: int) -> None:
        self.cfg = cfg
        self.variant = variant
        self.rng = _Rng(seed)
        self.base = variant == "base"

    def fp8(self, t: dict[str, torch.Tensor], name: str, out: int, inp: int, gain: float = 1.0) -> None:
        w, s = _fp8_linear(self.rng(name), out, inp, self.base, gain)
        t[f"{name}.weight"] = w
        t[f"{name}.scale"] = s

    def hc(self, t: dict[str, torch.Tensor], prefix: str, kind: str) -> None:
        c = self.cfg
        hc, H = c["hc_mult"], c["hidden_size"]
        g = self.rng(f"{prefix}hc_{kind}")
        if kind == "head":
            mix = hc
            n_scale = 1
        else:
            mix = (2 + hc) * hc
            n_scale = 3
        t[f"{prefix}hc_{kind}_fn"] = (_randn(g, mix, hc * H) * (0.5 / math.sqrt(hc * H))).contiguous()
        t[f"{prefix}hc_{kind}_base"] = 0.1 * _randn(g, mix)
        t[f"{prefix}hc_{kind}_scale"] = 0.5 + 0.5 * torch.rand(n_scale, generator=g)

    def compressor(self, t: dict[str, torch.Tensor], prefix: str, ratio: int, dim: int) -> None:
        H = self.cfg["hidden_size"]
        width = 2 * dim if ratio == 4 else dim  # ratio 4 = overlapping windows (Ca | Cb)
        g = self.rng(prefix + "ape")
        t[prefix + "ape"] = 0.1 * _randn(g, ratio, width)
        t[prefix + "wkv.weight"] = _bf16(self.rng(prefix + "wkv"), width, H)
        t[prefix + "wgate.weight"] = _bf16(self.rng(prefix + "wgate"), width, H)
        t[prefix + "norm.weight"] = _norm(self.rng(prefix + "norm"), dim)

    def block(self, prefix: str, ratio: int, is_hash: bool, expert_format: str) -> dict[str, torch.Tensor]:
        c = self.cfg
        H, hd, nh = c["hidden_size"], c["head_dim"], c["num_attention_heads"]
        ql, og, ol = c["q_lora_rank"], c["o_groups"], c["o_lora_rank"]
        E, I, K = c["n_routed_experts"], c["moe_intermediate_size"], c["num_experts_per_tok"]
        t: dict[str, torch.Tensor] = {}
        self.hc(t, prefix, "attn")
        self.hc(t, prefix, "ffn")
        t[prefix + "attn_norm.weight"] = _norm(self.rng(prefix + "attn_norm"), H)
        t[prefix + "ffn_norm.weight"] = _norm(self.rng(prefix + "ffn_norm"), H)
        a = prefix + "attn."
        t[a + "attn_sink"] = 0.1 * _randn(self.rng(a + "attn_sink"), nh)
        t[a + "q_norm.weight"] = _norm(self.rng(a + "q_norm"), ql)
        t[a + "kv_norm.weight"] = _norm(self.rng(a + "kv_norm"), hd)
        self.fp8(t, a + "wq_a", ql, H)
        self.fp8(t, a + "wq_b", nh * hd, ql)
        self.fp8(t, a + "wkv", hd, H)
        self.fp8(t, a + "wo_a", og * ol, nh * hd // og)
        self.fp8(t, a + "wo_b", H, og * ol)
        if ratio:
            self.compressor(t, a + "compressor.", ratio, hd)
        if ratio == 4:
            ih, ihd = c["index_n_heads"], c["index_head_dim"]
            self.fp8(t, a + "indexer.wq_b", ih * ihd, ql)
            t[a + "indexer.weights_proj.weight"] = _bf16(self.rng(a + "indexer.weights_proj"), ih, H)
            self.compressor(t, a + "indexer.compressor.", ratio, ihd)
        f = prefix + "ffn."
        t[f + "gate.weight"] = _bf16(self.rng(f + "gate"), E, H)
        if is_hash:
            g = self.rng(f + "gate.tid2eid")
            perm = torch.rand(c["vocab_size"], E, generator=g).argsort(dim=1)
            t[f + "gate.tid2eid"] = perm[:, :K].to(torch.int64).contiguous()
        else:
            t[f + "gate.bias"] = 0.1 * _randn(self.rng(f + "gate.bias"), E)
        # Shared expert: half gain on w1/w3 keeps its pre-activations (|x| ~< 3 for RMS-normed
        # inputs) far below swiglu_limit -- the official code clamps routed experts only.
        for w, (o, i), gain in (("w1", (I, H), 0.5), ("w2", (H, I), 1.0), ("w3", (I, H), 0.5)):
            self.fp8(t, f"{f}shared_experts.{w}", o, i, gain)
        # the routed experts are most of the bytes: made side by side (torch's ops release the GIL; each matrix has
        # a generator of its own name, so the bytes do not depend on the order), put in the shard in expert order
        jobs = [(f"{f}experts.{e}.{w}", w, o, i) for e in range(E)
                for w, (o, i) in (("w1", (I, H)), ("w2", (H, I)), ("w3", (I, H)))]
        with ThreadPoolExecutor(min(len(jobs), os.cpu_count() or 1) or 1) as pool:
            for part in pool.map(lambda job: self.expert(*job, expert_format), jobs):
                t.update(part)
        return t

    def expert(self, name: str, w: str, o: int, i: int, expert_format: str) -> dict[str, torch.Tensor]:
        """One routed expert's matrix ``name`` (``w1``, ``w2`` or ``w3``: [o, i]) with its scales."""
        g, t = self.rng(name), {}
        if expert_format == "mxfp4":
            t[name + ".weight"], t[name + ".scale"] = _mxfp4(g, o, i)
        elif expert_format == "fp8":
            self.fp8(t, name, o, i)
        elif expert_format in ("nvfp4", "ct_nvfp4"):
            # w1 and w3 on deliberately different magnitudes -> different weight_scale_2
            gain = {"w1": 0.85, "w3": 1.2, "w2": 1.0}[w]
            make = _nvfp4 if expert_format == "nvfp4" else _ct_nvfp4
            for k, v in make(g, o, i, gain).items():
                t[f"{name}.{k}"] = v
        else:  # pragma: no cover
            raise AssertionError(expert_format)
        return t

    def out_of_range(self, t: dict[str, torch.Tensor], prefix: str, n: int) -> None:
        """Lower n non-zero 32-blocks of expert 0's w3 to >= 20 exponents below k_max."""
        w1s = t[prefix + "ffn.experts.0.w1.scale"]
        w3s = t[prefix + "ffn.experts.0.w3.scale"]
        k3 = w3s.view(torch.uint8).to(torch.int32) - 127
        k1 = w1s.view(torch.uint8).to(torch.int32) - 127
        codes = t[prefix + "ffn.experts.0.w3.weight"].view(torch.uint8)
        rows, nb = k3.shape
        nonzero = (((codes & 0x77) != 0).view(rows, nb, 16)).any(-1)
        cand = nonzero.flatten().nonzero().flatten()
        if n > cand.numel() - 1:
            raise ValueError(f"out_of_range_blocks={n} exceeds the {cand.numel() - 1} blocks available")
        g = self.rng(prefix + "out_of_range")
        chosen = cand[torch.randperm(cand.numel(), generator=g)[:n]]
        flat = k3.flatten().clone()
        keep = torch.ones_like(flat, dtype=torch.bool)
        keep[chosen] = False
        k_max = max(int(k1.max()), int(flat[keep].max()))
        drop = 20 + torch.randint(0, 4, (n,), generator=g)
        flat[chosen] = k_max - drop.to(torch.int32)
        t[prefix + "ffn.experts.0.w3.scale"] = _e8m0(flat.view(rows, nb))

    def globals_first(self) -> dict[str, torch.Tensor]:
        c = self.cfg
        return {"embed.weight": _randn(self.rng("embed"), c["vocab_size"], c["hidden_size"]).to(torch.bfloat16)}

    def globals_last(self) -> dict[str, torch.Tensor]:
        c = self.cfg
        t = {
            "head.weight": _bf16(self.rng("head"), c["vocab_size"], c["hidden_size"]),
            "norm.weight": _norm(self.rng("norm"), c["hidden_size"]),
        }
        self.hc(t, "", "head")
        return t

    def mtp(self) -> dict[str, torch.Tensor]:
        c = self.cfg
        H = c["hidden_size"]
        p = "mtp.0."
        t = self.block(p, c["compress_ratios"][c["num_hidden_layers"]], False, "mxfp4" if not self.base else "fp8")
        self.fp8(t, p + "e_proj", H, H)
        self.fp8(t, p + "h_proj", H, H)
        for n in ("enorm", "hnorm", "norm"):
            t[f"{p}{n}.weight"] = _norm(self.rng(p + n), H)
        self.hc(t, p, "head")
        return t


# --------------------------------------------------------------------------- files


def _tokenizer_files(cfg: dict[str, Any]) -> dict[str, Any]:
    V = cfg["vocab_size"]
    vocab = {tok: i for i, tok in enumerate(_SPECIAL_TOKENS)}
    for i in range(len(vocab), V):
        vocab[f"t{i}"] = i
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": i,
                "content": tok,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
            for i, tok in enumerate(_SPECIAL_TOKENS)
        ],
        "normalizer": None,
        "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [
                {"SpecialToken": {"id": _SPECIAL_TOKENS[0], "type_id": 0}},
                {"Sequence": {"id": "A", "type_id": 0}},
            ],
            "pair": [
                {"SpecialToken": {"id": _SPECIAL_TOKENS[0], "type_id": 0}},
                {"Sequence": {"id": "A", "type_id": 0}},
                {"Sequence": {"id": "B", "type_id": 1}},
            ],
            "special_tokens": {
                _SPECIAL_TOKENS[0]: {"id": _SPECIAL_TOKENS[0], "ids": [0], "tokens": [_SPECIAL_TOKENS[0]]}
            },
        },
        "decoder": None,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": _SPECIAL_TOKENS[2]},
    }
    tokenizer_config = {
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": _SPECIAL_TOKENS[0],
        "eos_token": _SPECIAL_TOKENS[1],
        "pad_token": _SPECIAL_TOKENS[2],
        "unk_token": _SPECIAL_TOKENS[2],
        "clean_up_tokenization_spaces": False,
        "legacy": True,
        "model_max_length": cfg["max_position_embeddings"],
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}",
    }
    generation_config = {
        "_from_model_config": True,
        "bos_token_id": cfg["bos_token_id"],
        "eos_token_id": cfg["eos_token_id"],
        "do_sample": True,
        "temperature": 1.0,
        "top_p": 1.0,
    }
    return {
        "tokenizer.json": tokenizer,
        "tokenizer_config.json": tokenizer_config,
        "generation_config.json": generation_config,
    }


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _write_tensors(out: Path, cfg: dict[str, Any], variant: str, seed: int, out_of_range_blocks: int) -> None:
    """The shards (one layer each) and ``model.safetensors.index.json``."""
    b = _Builder(cfg, variant, seed)
    L = cfg["num_hidden_layers"]
    n_shards = L + 3
    expert_format = {"flash": "mxfp4", "pro": "mxfp4", "base": "fp8", "modelopt": "nvfp4", "ct": "ct_nvfp4"}[variant]

    def shard_name(i: int) -> str:
        width = max(5, len(str(n_shards)))
        return f"model-{i:0{width}d}-of-{n_shards:0{width}d}.safetensors"

    def producers():
        yield b.globals_first
        for i in range(L):
            def layer(i: int = i) -> dict[str, torch.Tensor]:
                t = b.block(f"layers.{i}.", cfg["compress_ratios"][i], i < cfg["num_hash_layers"], expert_format)
                if i == 0 and out_of_range_blocks and variant not in ("modelopt", "ct"):
                    b.out_of_range(t, "layers.0.", out_of_range_blocks)
                return t
            yield layer
        yield b.globals_last

        def mtp() -> dict[str, torch.Tensor]:
            t = b.mtp()
            if out_of_range_blocks and variant in ("modelopt", "ct"):
                b.out_of_range(t, "mtp.0.", out_of_range_blocks)
            return t
        yield mtp

    weight_map: dict[str, str] = {}
    total = 0
    for idx, make in enumerate(producers(), start=1):
        tensors = {k: v.contiguous() for k, v in make().items()}
        fname = shard_name(idx)
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        for k, v in tensors.items():
            weight_map[k] = fname
            total += v.numel() * v.element_size()
        del tensors
    _write_json(
        out / "model.safetensors.index.json",
        {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))},
    )


def write_synthetic(
    out: str | Path,
    preset: str = "tiny",
    variant: str = "flash",
    seed: int = 0,
    *,
    out_of_range_blocks: int = 0,
    **overrides: Any,
) -> Path:
    """Write a synthetic DeepSeek-V4 checkpoint into ``out`` and return its path.

    ``out`` is created; an existing non-empty directory is refused (``FileExistsError``).
    Files: ``config.json``, ``generation_config.json``, ``tokenizer.json``,
    ``tokenizer_config.json``, (modelopt) ``hf_quant_config.json``,
    ``model-0000i-of-0000N.safetensors`` (shard 1: ``embed.weight``; shards 2..L+1:
    ``layers.{0..L-1}``; shard L+2: ``head``/``norm``/``hc_head_*``; shard L+3: ``mtp.0``)
    and ``model.safetensors.index.json``.  ``overrides`` are config.json overrides.
    """
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; known: {VARIANTS}")
    if out_of_range_blocks < 0:
        raise ValueError("out_of_range_blocks must be >= 0")
    if out_of_range_blocks and variant == "base":
        raise ValueError("the base variant has no MXFP4 experts; out_of_range_blocks needs flash/pro/modelopt/ct")
    cfg = synthetic_config(preset, variant, **overrides)
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} exists and is not an empty directory")
    out.mkdir(parents=True, exist_ok=True)

    # Tiny tensors: intra-op threading only adds contention (10x slower on a loaded box).
    prev_threads = torch.get_num_threads()
    if cfg["hidden_size"] <= 1024:
        torch.set_num_threads(1)
    try:
        _write_tensors(out, cfg, variant, seed, out_of_range_blocks)
    finally:
        torch.set_num_threads(prev_threads)
    _write_json(out / "config.json", cfg)
    for name, obj in _tokenizer_files(cfg).items():
        _write_json(out / name, obj)
    if variant == "modelopt":
        qc = cfg["quantization_config"]
        _write_json(
            out / "hf_quant_config.json",
            {
                "producer": qc["producer"],
                "quantization": {
                    "quant_algo": "MIXED_PRECISION",
                    "kv_cache_quant_algo": None,
                    "group_size": 16,
                    "exclude_modules": list(_MODELOPT_IGNORE),
                    "quantized_layers": qc["quantized_layers"],
                },
            },
        )
    return out
