"""The trained organism in the release format, as the real checkpoint is stored.

Every tensor of the native layout (:func:`dsv4convert.models.deepseek_v4.layout.native_groups`: real names, dtypes and
shapes) from the trained float32 weights, rounded with no quantization-aware training: FP8 e4m3 with
power-of-two (UE8M0) 128x128-block scales for the attention, shared-expert, indexer and MTP-projection
linears, MXFP4 (E2M1, UE8M0 per 32) for the routed experts, BF16 for the embedding, head, norms,
compressors and the indexer's ``weights_proj``, F32 for the hyper-connections, sinks, ``ape`` and router
bias, I64 for the hash tables. The same quantizers the converters use (``dsv4convert.formats``).

Written into a temporary directory beside ``dst`` and renamed when complete, so a crash never leaves
a checkpoint that looks whole.

:func:`write_drafter_release` writes only what the organism's DSpark drafter adds (its ``mtp.*`` tensors
rounded like every block: FP8 linears, MXFP4 experts, the Markov and confidence heads BF16 as 0731 releases
them; and ``dspark.json``); :func:`write_with_drafter` puts it in place of the organism's MTP block, 0731's
layout, the backbone's stored bytes unchanged. :func:`write_v41_with_drafter` does the same for the V4.1 organism
in V4.1's layout; both are :func:`assemble_with_drafter` with their release's config keys and plan.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from dsv4convert.checkpoint import Checkpoint, PlannedTensor, ShardWriter, atomic_write_json, write_index
from dsv4convert.checkpoint.reader import INDEX_NAME, read_small_json
from dsv4convert.checkpoint.reader import TensorEntry, read_header, read_tensor
from dsv4convert.checkpoint.writer import copy_small_files, empty_destination, shard_name
from dsv4convert.errors import DSV4Error
from dsv4convert.formats.fp8_block import quantize_fp8_block
from dsv4convert.formats.mxfp4 import quantize_mxfp4
from dsv4convert.inspection import inspect_checkpoint
from dsv4convert.models.deepseek_v4.configs import drafter_keys
from dsv4convert.models.deepseek_v4.layout import ModelConfig, TensorSpec, native_inventory, without_drafter
from dsv4convert.models.deepseek_v41.config import read_config as read_v41_config
from dsv4convert.models.deepseek_v41.inventory import native_groups as v41_groups
from dsv4convert.models.registry import fp8_block_of_config
from dsv4convert.models.deepseek_v4.names import in_draft
from dsv4convert.model.blocks import WeightSource
from dsv4convert.model.dspark import DSparkDrafter
from dsv4convert.model.trainable import TrainableModel, load_native_state
from dsv4convert.organism.tokenizer import TOKENIZER_CONFIG
from dsv4convert.synth import (
    GENERATION_CONFIG_PATH,
    ORGANISM_DIR,
    ORGANISM_DSPARK_DIR,
    ORGANISM_V41_DIR,
    ORGANISM_V41_DSPARK_DIR,
)

PROVENANCE_NAME = "organism.json"
DSPARK_PROVENANCE_NAME = "dspark.json"
DSPARK_TENSORS_NAME = "dspark.safetensors"
_FLOAT_DTYPES = {"BF16": torch.bfloat16, "F32": torch.float32}


def release_tensors(state: dict[str, torch.Tensor], specs: list[TensorSpec],
                    fp8_block: tuple[int, int]) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, stored tensor)`` for every spec, in order (FP8 in the release's ``fp8_block``); a quantized
    weight's scale follows its weight."""
    scales: dict[str, torch.Tensor] = {}
    for spec in specs:
        if spec.name in scales:
            yield spec.name, scales.pop(spec.name)
            continue
        module = spec.info.module
        if spec.dtype == "F8_E4M3":
            weight, scales[f"{module}.scale"] = quantize_fp8_block(state[spec.name], block=fp8_block, name=spec.name)
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


@contextmanager
def staged(dst: Path, *, overwrite: bool) -> Iterator[Path]:
    """A temporary directory beside ``dst`` to write into, renamed to ``dst`` when the block ends without an
    error (a crash never leaves a directory that looks complete)."""
    dst = Path(dst)
    if dst.exists() and any(dst.iterdir()) and not overwrite:
        raise DSV4Error("destination is not empty (pass --overwrite to replace it)", file=dst)
    work = dst.parent / f".{dst.name}.partial"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        yield work
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    if dst.exists():
        shutil.rmtree(dst)
    os.replace(work, dst)


def write_shard(path: Path, tensors: Iterable[tuple[str, torch.Tensor]], specs: list[TensorSpec]) -> None:
    """One safetensors file of ``specs``, in their order, filled from ``tensors``."""
    with ShardWriter(path, [PlannedTensor(s.name, s.dtype, s.shape) for s in specs],
                     metadata={"format": "pt"}) as writer:
        for tensor_name, tensor in tensors:
            writer.write(tensor_name, tensor)


def write_release(dst: Path, model: TrainableModel, config: dict, tokenizer, provenance: dict,
                  *, overwrite: bool = False) -> Path:
    """Write the release-format checkpoint of ``model`` (one shard) with its tokenizer and provenance."""
    specs = native_inventory(ModelConfig.from_dict(config))
    with staged(dst, overwrite=overwrite) as work:
        name = shard_name(1, 1)
        write_shard(work / name, release_tensors(model.native_state(), specs, fp8_block_of_config(config)), specs)
        atomic_write_json(work / "config.json", config)
        atomic_write_json(work / "generation_config.json", json.loads(GENERATION_CONFIG_PATH.read_text()))
        atomic_write_json(work / "tokenizer_config.json", TOKENIZER_CONFIG)
        (work / "tokenizer.json").write_text(tokenizer.to_str(pretty=False), encoding="utf-8")
        atomic_write_json(work / PROVENANCE_NAME, provenance)
        write_index(work, {s.name: name for s in specs}, sum(s.nbytes for s in specs))
    return Path(dst)


# -- the DSpark drafter, shipped apart ------------------------------------------------------------


def drafter_specs(config: dict) -> list[TensorSpec]:
    return [s for s in native_inventory(ModelConfig.from_dict(config)) if in_draft(s.name)]


def write_drafter_release(dst: Path, drafter: DSparkDrafter, config: dict, provenance: dict, *,
                          overwrite: bool = False) -> Path:
    """What a DSpark drafter adds to its organism, and nothing else: ``dspark.safetensors`` (every ``mtp.*``
    tensor as 0731 stores it: FP8 linears, MXFP4 experts, BF16 Markov and confidence heads) and ``dspark.json``
    (``config``: the keys it sets, :func:`drafter_keys`; the rest is ``provenance``)."""
    specs = drafter_specs(config)
    return write_drafter_files(dst, release_tensors(drafter.native_state(), specs, fp8_block_of_config(config)), specs,
                               drafter_keys(config), provenance, overwrite=overwrite)


def write_drafter_files(dst: Path, tensors: Iterable[tuple[str, torch.Tensor]], specs: list[TensorSpec],
                        keys: dict, provenance: dict, *, overwrite: bool = False) -> Path:
    """A drafter's two files, any release: ``dspark.safetensors`` (``specs`` filled from ``tensors``, stored) and
    ``dspark.json`` (``config``: the config keys the drafter sets, ``keys``; then ``provenance``)."""
    with staged(dst, overwrite=overwrite) as work:
        write_shard(work / DSPARK_TENSORS_NAME, tensors, specs)
        atomic_write_json(work / DSPARK_PROVENANCE_NAME, {"config": keys, **provenance})
    return Path(dst)


def write_with_drafter(dst: Path, base: Path, drafter_dir: Path | None, *, overwrite: bool = False) -> Path:
    """The release-format organism ``base`` with its MTP block replaced: by the DSpark drafter that
    :func:`write_drafter_release` wrote to ``drafter_dir`` (0731's layout: the backbone's stored bytes, the
    drafter under ``mtp.*``, the config with its keys, ``dspark.json`` beside the base's other files), or by
    nothing (``drafter_dir`` None: the config says ``num_nextn_predict_layers: 0``). One shard, index last."""
    def merged(config: dict, keys: dict | None) -> dict:
        return without_drafter(config) | (keys or {})

    return assemble_with_drafter(dst, base, drafter_dir, merged,
                                 lambda config: [native_inventory(ModelConfig.from_dict(config))], overwrite=overwrite)


def write_v41_with_drafter(dst: Path, base: Path, drafter_dir: Path, *, overwrite: bool = False) -> Path:
    """The release-format V4.1 organism ``base`` (no drafter) with the DSpark drafter ``drafter_dir`` holds
    (``organism/dspark_v41.py`` wrote it) in V4.1's layout: the backbone's stored bytes, the stages under ``mtp.*``
    as the release plans them (``models/deepseek_v41/inventory.py``: one shard per group, the stages' between the
    head and the Engram tables), the ``text_config`` with the drafter's keys (``dspark.json``'s ``config``)."""
    def merged(config: dict, keys: dict | None) -> dict:
        return {**config, "text_config": without_drafter(config["text_config"]) | keys["text_config"]}

    return assemble_with_drafter(dst, base, drafter_dir, merged,
                                 lambda config: v41_groups(read_v41_config(config, "config.json")),
                                 overwrite=overwrite)


def assemble_with_drafter(dst: Path, base: Path, drafter_dir: Path | None,
                          merged: Callable[[dict, dict | None], dict], groups: Callable[[dict], list[list[TensorSpec]]],
                          *, overwrite: bool = False) -> Path:
    """Any release's organism ``base`` with the drafter in ``drafter_dir`` (or none) under ``mtp.*``: the config
    ``merged(base config, dspark.json's config keys or None)``, one shard per group of ``groups(config)`` (the
    release's plan), each backbone tensor copied as stored and each drafter tensor from ``dspark.safetensors``,
    both checked against the plan; the base's other files and ``dspark.json`` beside them; the index last."""
    base = Path(base)
    source = Checkpoint.open(base)
    keys: dict | None = None
    drafter: dict[str, TensorEntry] = {}
    if drafter_dir is not None:
        keys = read_small_json(Path(drafter_dir) / DSPARK_PROVENANCE_NAME)["config"]
        drafter = dict(read_header(Path(drafter_dir) / DSPARK_TENSORS_NAME).entries)
    config = merged(source.config, keys)
    plan = groups(config)
    specs = [s for group in plan for s in group]
    drafter_file = Path(drafter_dir or base) / DSPARK_TENSORS_NAME
    for spec in specs:
        if not in_draft(spec.name):
            _check_stored(source.entry(spec.name).dtype, source.entry(spec.name).shape, spec, base)
        elif spec.name not in drafter:
            raise DSV4Error("the drafter's file lacks a tensor the layout needs", file=drafter_file, tensor=spec.name)
        else:
            _check_stored(drafter[spec.name].dtype, drafter[spec.name].shape, spec, drafter_file)
    extra = sorted(set(drafter) - {s.name for s in specs})
    if extra:
        raise DSV4Error(f"the drafter's file holds {len(extra)} tensors the layout has no place for", file=drafter_file,
                        tensor=extra[0])
    names = [shard_name(i + 1, len(plan)) for i in range(len(plan))]
    with staged(dst, overwrite=overwrite) as work:
        for name, group in zip(names, plan):
            write_shard(work / name, ((s.name, read_tensor(drafter[s.name]) if s.name in drafter
                                       else source.read(s.name)) for s in group), group)
        atomic_write_json(work / "config.json", config)
        copy_small_files([p for p in source.small_files() if p.name != "config.json"], work)
        if drafter_dir is not None:
            copy_small_files([Path(drafter_dir) / DSPARK_PROVENANCE_NAME], work)
        write_index(work, {s.name: name for name, group in zip(names, plan) for s in group},
                    sum(s.nbytes for s in specs))
    return Path(dst)


def _check_stored(dtype: str | None, shape, spec: TensorSpec, file: Path) -> None:
    if (dtype, tuple(shape)) != (spec.dtype, tuple(spec.shape)):
        raise DSV4Error(f"stored as {dtype} {list(shape)}, the layout wants {spec.dtype} {list(spec.shape)}",
                        file=file, tensor=spec.name)


def load_dspark_release(path: Path, *, device: torch.device = torch.device("cpu")
                        ) -> tuple[TrainableModel, DSparkDrafter]:
    """A DSpark-layout checkpoint back as (backbone, drafter), every weight dequantized to float32 by the path
    ``compare`` loads blocks with."""
    ckpt = Checkpoint.open(path)
    inspection = inspect_checkpoint(ckpt)
    if not inspection.ok or inspection.config.dspark is None:
        raise DSV4Error("not a complete DeepSeek-V4 checkpoint with a DSpark drafter", file=ckpt.root)
    source = WeightSource(ckpt, inspection, device, torch.float32)
    return load_release(path, device=device), DSparkDrafter.from_source(source, ckpt.config).to(device)


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


def write_organism(dst: Path, *, drafter: str = "mtp", overwrite: bool = False) -> Path:
    """The shipped organism (trained weights, not synthetic ones) at ``dst`` with ``drafter``: ``mtp`` its own
    files copied (the index last, so an interrupted copy never looks complete); ``dspark`` 0731's layout, its
    backbone's bytes with the shipped DSpark drafter under ``mtp.*``; ``none`` the backbone alone."""
    dst = Path(dst)
    files = shipped_files(ORGANISM_DIR, "organism")
    if drafter == "dspark" and not any(ORGANISM_DSPARK_DIR.glob("*.safetensors")):
        raise DSV4Error("the package has no DSpark drafter for the organism (reinstall dsv4convert)",
                        file=ORGANISM_DSPARK_DIR)
    if drafter != "mtp":
        return write_with_drafter(dst, ORGANISM_DIR, ORGANISM_DSPARK_DIR if drafter == "dspark" else None,
                                  overwrite=overwrite)
    return copy_shipped(files, dst, overwrite=overwrite)


def shipped_files(directory: Path, what: str) -> list[Path]:
    """The files of a checkpoint the package ships in ``directory``; one error line where it is not whole."""
    files = sorted(p for p in directory.iterdir() if p.is_file()) if directory.is_dir() else []
    if not any(p.name == INDEX_NAME for p in files):
        raise DSV4Error(f"the package has no {what} checkpoint (reinstall dsv4convert)", file=directory)
    return files


def copy_shipped(files: list[Path], dst: Path, *, overwrite: bool = False) -> Path:
    """A shipped checkpoint's ``files`` copied to ``dst``, the index last, so that an interrupted copy never looks
    complete (written read-write: the package's own files may be read-only)."""
    empty_destination(dst, overwrite=overwrite)
    for path in sorted(files, key=lambda p: p.name == INDEX_NAME):
        shutil.copyfile(path, dst / path.name)
        (dst / path.name).chmod(0o644)
    return dst


def write_organism_v41(dst: Path, *, drafter: str = "none", overwrite: bool = False) -> Path:
    """The shipped V4.1 organism (``python -m dsv4convert.organism.v41``'s output, trained weights) at ``dst`` with
    ``drafter``: ``none`` its own files copied; ``dspark`` V4.1's layout, its backbone's bytes with the shipped
    DSpark drafter (``python -m dsv4convert.organism.dspark_v41``'s output) under ``mtp.*``."""
    dst = Path(dst)
    files = shipped_files(ORGANISM_V41_DIR, "V4.1 organism")
    if drafter == "dspark":
        if not (ORGANISM_V41_DSPARK_DIR / DSPARK_TENSORS_NAME).is_file():
            raise DSV4Error(f"the package has no DSpark drafter for the V4.1 organism ({DSPARK_TENSORS_NAME} missing: "
                            "train it with python -m dsv4convert.organism.dspark_v41 and copy its organism-v41-dspark/ "
                            "here)", file=ORGANISM_V41_DSPARK_DIR)
        return write_v41_with_drafter(dst, ORGANISM_V41_DIR, ORGANISM_V41_DSPARK_DIR, overwrite=overwrite)
    return copy_shipped(files, dst, overwrite=overwrite)
