"""Synthetic checkpoints in the exact native DeepSeek-V4-Flash format.

Tests and benchmarks never download weights: they run on checkpoints made here, with
the real names, dtypes and layouts (FP8 e4m3 + E8M0 128x128 scales, MXFP4 experts as I8
low-nibble-first + E8M0 per 32, BF16/F32/I64 elsewhere, valid ``tid2eid``) and value
distributions that exercise the numerics: heavy tails, per-channel outliers, row scales
spread over several binades, and a few all-zero blocks. Every tensor is derived from
(seed, name) alone, so any subset is reproducible and the output is byte-identical
across runs.

FP8 and BF16 weights are float matrices quantized with DeepSeek's rules. MXFP4 experts,
98% of a real layer's bytes, are drawn directly in their stored form (:func:`realistic_mxfp4`):
quantizing a float matrix costs seconds per expert on a small CPU, which made real-size
layers take most of an hour to synthesize.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from tqdm import tqdm

from dsv4convert.checkpoint import PlannedTensor, ShardWriter, atomic_write_json, write_index
from dsv4convert.checkpoint.writer import empty_destination, shard_name
from dsv4convert.errors import DSV4Error
from dsv4convert.formats.fp8_block import quantize_fp8_block
from dsv4convert.models.deepseek_v4 import release as v4_release
from dsv4convert.models.deepseek_v4.layout import ModelConfig, Role, TensorSpec, native_groups
from dsv4convert.models.deepseek_v4.presets import PRESETS
from dsv4convert.models.synth_values import generator_for, realistic_matrix, realistic_mxfp4

DATA_DIR = Path(__file__).parent / "data"
# Exact copies of the released config.json and generation_config.json (HF revision 60d8d70).
REFERENCE_CONFIG_PATH = DATA_DIR / "deepseek-v4-flash-config.json"
# The official V4-Flash-0731's config.json as public material gives it (docs/drafters.md says where each key
# comes from): the preview's with the DSpark keys and 46 compress ratios. Its layout reproduces the release's
# 72,317 tensors and 166,878,536,440 bytes exactly (tests/test_layout.py).
RELEASE_0731_CONFIG_PATH = DATA_DIR / "deepseek-v4-flash-0731-config.json"
GENERATION_CONFIG_PATH = DATA_DIR / "deepseek-v4-flash-generation_config.json"
# The trained model organism in the release format (docs/organism.md), written by `train-organism`.
ORGANISM_DIR = DATA_DIR / "organism"
# What its DSpark drafter adds (`train-organism --drafter dspark`): the mtp.* tensors and dspark.json.
ORGANISM_DSPARK_DIR = DATA_DIR / "organism-dspark"
# The trained V4.1 organism in V4.1's release layout (docs/organism.md), written by `python -m dsv4convert.organism.v41`.
ORGANISM_V41_DIR = DATA_DIR / "organism-v41"
# What the V4.1 organism's DSpark drafter adds (`python -m dsv4convert.organism.dspark_v41`): mtp.*, dspark.json.
ORGANISM_V41_DSPARK_DIR = DATA_DIR / "organism-v41-dspark"


def reference_config() -> dict:
    return json.loads(REFERENCE_CONFIG_PATH.read_text())


def preset_config(preset: str) -> dict:
    if preset not in PRESETS:
        raise DSV4Error(f"unknown preset {preset!r} (choose from {', '.join(PRESETS)})")
    config = reference_config()
    config.update(copy.deepcopy(PRESETS[preset]))
    return config


def synth_tensors(spec_group: list[TensorSpec], cfg: ModelConfig, seed: int):
    """Yield (name, tensor) for a group of specs; quantized weights and their scales come as pairs."""
    produced: dict[str, torch.Tensor] = {}
    block = v4_release.fp8_block(cfg)
    for spec in spec_group:
        if spec.name in produced:
            yield spec.name, produced.pop(spec.name)
            continue
        info = spec.info
        gen = generator_for(seed, spec.name)
        if spec.dtype == "F8_E4M3":
            n, k = spec.shape
            weight, scale = quantize_fp8_block(realistic_matrix(n, k, gen, zero_block=block[0]), block=block,
                                               name=spec.name)
            produced[f"{info.module}.scale"] = scale
            yield spec.name, weight
        elif spec.dtype == "I8":
            n, k = spec.shape[0], spec.shape[1] * 2
            weight, scale = realistic_mxfp4(n, k, gen)
            produced[f"{info.module}.scale"] = scale
            yield spec.name, weight
        elif spec.dtype == "I64":   # tid2eid: each token gets top-k distinct experts
            vocab, topk = spec.shape
            keys = torch.rand(vocab, cfg.n_routed_experts, generator=gen)
            yield spec.name, keys.argsort(dim=1)[:, :topk].to(torch.int64).contiguous()
        else:
            yield spec.name, _plain_tensor(spec, info.role, gen)
    if produced:
        raise RuntimeError(f"scales without weights in layout group: {sorted(produced)}")


def _plain_tensor(spec: TensorSpec, role: Role, gen: torch.Generator) -> torch.Tensor:
    dtype = torch.float32 if spec.dtype == "F32" else torch.bfloat16
    shape = spec.shape
    name = spec.name
    if role is Role.NORM:
        t = 1.0 + 0.1 * torch.randn(shape, generator=gen)
    elif role is Role.HYPER_CONNECTION:
        if name.endswith("_fn"):
            t = 0.02 * torch.randn(shape, generator=gen)
        elif name.endswith("_base"):
            t = 0.1 * torch.randn(shape, generator=gen)
        else:
            t = 1.0 + 0.05 * torch.randn(shape, generator=gen)
    elif role is Role.ATTN_SINK:
        t = 0.5 * torch.randn(shape, generator=gen)
    elif name.endswith(".ape") or name.endswith(".bias"):
        t = 0.02 * torch.randn(shape, generator=gen)
    elif role is Role.EMBED:
        t = torch.randn(shape, generator=gen)
    elif len(shape) == 2:
        t = realistic_matrix(shape[0], shape[1], gen)
    else:
        t = torch.randn(shape, generator=gen)
    return t.to(dtype)


def byte_level_tokenizer(vocab_size: int) -> dict:
    """A byte-level BPE ``tokenizer.json`` (no merges): 256 byte tokens plus BOS/EOS, loadable by
    transformers' fast tokenizers, so prompts can be built to exact token lengths."""
    if vocab_size < 258:
        raise DSV4Error(f"vocab_size {vocab_size} is too small for a byte-level tokenizer (needs 258)")
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    vocab = {"<｜begin▁of▁sentence｜>": 0, "<｜end▁of▁sentence｜>": 1}
    for b in range(256):
        vocab[chars[b]] = b + 2
    special = [{"id": i, "content": c, "single_word": False, "lstrip": False, "rstrip": False,
                "normalized": False, "special": True} for c, i in list(vocab.items())[:2]]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": special,
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": []},
    }


TOKENIZER_CONFIG = {
    "add_bos_token": False,
    "add_eos_token": False,
    "bos_token": "<｜begin▁of▁sentence｜>",
    "eos_token": "<｜end▁of▁sentence｜>",
    "pad_token": "<｜end▁of▁sentence｜>",
    "clean_up_tokenization_spaces": False,
    "model_max_length": 1048576,
    "tokenizer_class": "PreTrainedTokenizerFast",
}


def synthesize(dst: Path, config: dict, *, seed: int = 0, overwrite: bool = False, progress: bool = False) -> Path:
    """Write a native-format checkpoint for ``config`` into ``dst``, one shard per layout group."""
    dst = Path(dst)
    cfg = ModelConfig.from_dict(config, source="synth config")
    empty_destination(dst, overwrite=overwrite)
    groups = native_groups(cfg)
    total = sum(spec.nbytes for g in groups for spec in g)
    weight_map: dict[str, str] = {}
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="synth", disable=not progress)
    for i, group in enumerate(groups):
        name = shard_name(i + 1, len(groups))
        planned = [PlannedTensor(s.name, s.dtype, s.shape) for s in group]
        with ShardWriter(dst / name, planned, metadata={"format": "pt"}) as writer:
            for tensor_name, tensor in synth_tensors(group, cfg, seed):
                writer.write(tensor_name, tensor)
                bar.update(tensor.numel() * tensor.element_size())
        weight_map.update({s.name: name for s in group})
    bar.close()
    atomic_write_json(dst / "config.json", config)
    atomic_write_json(dst / "generation_config.json", json.loads(GENERATION_CONFIG_PATH.read_text()))
    atomic_write_json(dst / "tokenizer_config.json", TOKENIZER_CONFIG)
    atomic_write_json(dst / "tokenizer.json", byte_level_tokenizer(cfg.vocab_size))
    write_index(dst, weight_map, total)
    return dst
