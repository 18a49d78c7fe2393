"""What ``fit`` sizes: a checkpoint's real tensors, or a shipped variant planned from config.json alone.

A checkpoint is read header by header (``Checkpoint.open``, no weights); a planned variant runs the
shipped recipe's conversion plan over the native inventory the config implies (what
``inspect --expected`` lists), so its bytes are exactly what ``convert`` would write. Either way the
result is an :class:`~dsv4convert.engines.served.ServedModel`, which the engines' memory sizing reads.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from dsv4convert import variants
from dsv4convert.checkpoint import Checkpoint
from dsv4convert.checkpoint.reader import TensorEntry
from dsv4convert.convert.plan import build_plan
from dsv4convert.convert.recipe import load_recipe
from dsv4convert.dtypes import nbytes
from dsv4convert.engines.config import build_quant_config
from dsv4convert.engines.served import ServedModel
from dsv4convert.inspection import inspect_checkpoint
from dsv4convert.models.deepseek_v4 import configs
from dsv4convert.models.deepseek_v4.layout import ModelConfig, Role, TensorInfo, native_inventory

# Shipped variants and the recipe that makes each (None: the native checkpoint as released), as
# ``convert`` makes them by default (for both engines).
SHIPPED = variants.PLANNED
# What each keeps of the release's weights, for ranking what fits (``fit``'s ``next:``); native is the release.
QUALITY = {"native": "the release itself, no conversion", "fp8": "lossless (experts cast exactly to FP8)",
           "bf16": "lossless (dequantized)", "nvfp4": "near-lossless (exact where NVFP4's scales fit)",
           "nvfp4-mtp-mxfp4": "near-lossless (exact where NVFP4's scales fit)",
           "w4a16": "4-bit (experts requantized to INT4: lossy)"}
PLANNED_ROOT = Path("<planned>")


def _virtual(config: dict, specs: list[tuple[str, str, tuple[int, ...]]]) -> Checkpoint:
    """A checkpoint of headers only (no file is ever read): what the planner and ``inspect`` need."""
    entries = {name: TensorEntry(name, dtype, tuple(shape), PLANNED_ROOT, 0, nbytes(dtype, shape))
               for name, dtype, shape in specs}
    return Checkpoint(PLANNED_ROOT, entries, [PLANNED_ROOT], {}, config, None, None)


def _source(label: str, ckpt: Checkpoint) -> ServedModel:
    return ServedModel.of(label, ckpt, inspect_checkpoint(ckpt))


def from_checkpoint(model: str | Path) -> ServedModel:
    """A local checkpoint directory or Hub repo id: shard headers only (raises CheckpointError if not V4)."""
    ckpt = Checkpoint.open(model)
    ModelConfig.from_dict(ckpt.config, source=str(ckpt.root / "config.json"))
    return _source(str(model), ckpt)


def from_plan(label: str, plan, source_config: dict, engines: tuple[str, ...] = ("sglang", "vllm")) -> ServedModel:
    """What a conversion plan (``convert.plan.Plan`` of the checkpoint ``source_config`` describes) would
    write, sized before anything is written."""
    config, _ = build_quant_config(source_config, plan.module_formats(), engines=engines)
    return _source(label, _virtual(config, [(p.name, p.dtype, tuple(p.shape)) for job in plan.modules.values()
                                            for p in job.outputs]))


def _copies(info: TensorInfo, layers: dict[str, int], experts: dict[bool, int]) -> int:
    block = ".".join(info.module.split(".")[:2])
    per_expert = info.role is Role.ROUTED_EXPERT or (info.role is Role.ROUTER and info.param != "tid2eid")
    return layers.get(block, 1) * (experts[info.is_mtp] if per_expert else 1)


def shipped(config: dict, path: str) -> list[ServedModel]:
    """Every shipped variant planned from the V4 ``config`` (one error line for a config that is not V4)."""
    ModelConfig.from_dict(config, source=path)
    return [planned(variant, config) for variant in SHIPPED]


def planned(variant: str, config: dict, *, compact: bool = True) -> ServedModel:
    """A shipped variant as ``convert`` would write it from the native checkpoint ``config`` describes.

    ``compact``: plan one layer of each kind with one expert and count each planned tensor for the
    full-model tensors it stands for (``Tensor.copies``; tests/test_fit.py checks it against the full
    plan): the full V4-Flash plan classifies ~200,000 tensors (10-20 s per variant), this one ~200.
    """
    plan_config, layers, experts = configs.compact(config) if compact else (config, {}, {False: 1, True: 1})
    native = _virtual(plan_config, [(s.name, s.dtype, s.shape) for s in native_inventory(ModelConfig.from_dict(plan_config))])
    recipe = SHIPPED[variant]
    src = _source(variant, native) if recipe is None else from_plan(
        variant, build_plan(native, load_recipe(recipe), engine="both"), plan_config)
    # The full model's layer counts (the KV geometry reads them) over what the plan wrote.
    full = {key: config[key] for key in configs.COMPACTED_KEYS if key in config}
    tensors = [(replace(t, copies=_copies(info, layers, experts)), info) for t, info in src.tensors]
    return replace(src, config={**src.config, **full}, tensors=tensors)
