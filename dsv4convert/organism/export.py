"""The trained organism in the release format, as the real checkpoint is stored.

Every tensor of the native layout (:func:`dsv4convert.layout.native_groups`: real names, dtypes and
shapes) from the trained float32 weights, rounded with no quantization-aware training: FP8 e4m3 with
power-of-two (UE8M0) 128x128-block scales for the attention, shared-expert, indexer and MTP-projection
linears, MXFP4 (E2M1, UE8M0 per 32) for the routed experts, BF16 for the embedding, head, norms,
compressors and the indexer's ``weights_proj``, F32 for the hyper-connections, sinks, ``ape`` and router
bias, I64 for the hash tables. The same quantizers the converters use (``dsv4convert.formats``).

Written into a temporary directory beside ``dst`` and renamed when complete, so a crash never leaves
a checkpoint that looks whole.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch

from dsv4convert.checkpoint import Checkpoint, PlannedTensor, ShardWriter, atomic_write_json, write_index
from dsv4convert.checkpoint.writer import shard_name
from dsv4convert.errors import DSV4Error
from dsv4convert.formats.fp8_block import quantize_fp8_block
from dsv4convert.formats.mxfp4 import quantize_mxfp4
from dsv4convert.inspection import inspect_checkpoint
from dsv4convert.layout import ModelConfig, TensorSpec, native_inventory
from dsv4convert.model.blocks import WeightSource
from dsv4convert.model.trainable import TrainableModel, load_native_state
from dsv4convert.organism.tokenizer import TOKENIZER_CONFIG
from dsv4convert.synth import GENERATION_CONFIG_PATH

PROVENANCE_NAME = "organism.json"
_FLOAT_DTYPES = {"BF16": torch.bfloat16, "F32": torch.float32}


def release_tensors(state: dict[str, torch.Tensor], specs: list[TensorSpec]) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, stored tensor)`` for every spec, in order; a quantized weight's scale follows its weight."""
    scales: dict[str, torch.Tensor] = {}
    for spec in specs:
        if spec.name in scales:
            yield spec.name, scales.pop(spec.name)
            continue
        module = spec.info.module
        if spec.dtype == "F8_E4M3":
            weight, scales[f"{module}.scale"] = quantize_fp8_block(state[spec.name], name=spec.name)
        elif spec.dtype == "I8":
            weight, scales[f"{module}.scale"] = quantize_mxfp4(state[spec.name], name=spec.name)
        elif spec.dtype == "I64":
            weight = state[spec.name].to(torch.int64)
        else:
            weight = state[spec.name].to(_FLOAT_DTYPES[spec.dtype])
        if tuple(weight.shape) != tuple(spec.shape):
            raise DSV4Error(f"trained shape {list(weight.shape)} is not the layout's {list(spec.shape)}",
                            tensor=spec.name)
        yield spec.name, weight.contiguous()
    if scales:
        raise DSV4Error(f"scales without a place in the layout: {sorted(scales)}")


def write_release(dst: Path, model: TrainableModel, config: dict, tokenizer, provenance: dict,
                  *, overwrite: bool = False) -> Path:
    """Write the release-format checkpoint of ``model`` (one shard) with its tokenizer and provenance."""
    dst = Path(dst)
    if dst.exists() and any(dst.iterdir()) and not overwrite:
        raise DSV4Error("destination is not empty (pass --overwrite to replace it)", file=dst)
    specs = native_inventory(ModelConfig.from_dict(config))
    state = model.native_state()
    work = dst.parent / f".{dst.name}.partial"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    name = shard_name(1, 1)
    with ShardWriter(work / name, [PlannedTensor(s.name, s.dtype, s.shape) for s in specs],
                     metadata={"format": "pt"}) as writer:
        for tensor_name, tensor in release_tensors(state, specs):
            writer.write(tensor_name, tensor)
    atomic_write_json(work / "config.json", config)
    atomic_write_json(work / "generation_config.json", json.loads(GENERATION_CONFIG_PATH.read_text()))
    atomic_write_json(work / "tokenizer_config.json", TOKENIZER_CONFIG)
    (work / "tokenizer.json").write_text(tokenizer.to_str(pretty=False), encoding="utf-8")
    atomic_write_json(work / PROVENANCE_NAME, provenance)
    write_index(work, {s.name: name for s in specs}, sum(s.nbytes for s in specs))
    if dst.exists():
        shutil.rmtree(dst)
    os.replace(work, dst)
    return dst


def load_release(path: Path, *, device: torch.device = torch.device("cpu")) -> TrainableModel:
    """A release-format checkpoint back as a :class:`TrainableModel`, every weight dequantized to float32
    (the model the checkpoint's numbers describe, with no serving numerics)."""
    ckpt = Checkpoint.open(path)
    inspection = inspect_checkpoint(ckpt)
    if not inspection.ok:
        raise DSV4Error("not a complete DeepSeek-V4 checkpoint", file=ckpt.root)
    source = WeightSource(ckpt, inspection, device, torch.float32)
    model = TrainableModel(ckpt.config)
    load_native_state(model, lambda name: (source.linear(name.removesuffix(".weight"))
                                           if name.removesuffix(".weight") in inspection.modules
                                           and name.endswith(".weight") else source.tensor(name)))
    return model.to(device).eval()
