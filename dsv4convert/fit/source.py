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


def _compact(config: dict) -> tuple[dict, dict[str, int], dict[str, int]]:
    """The config of a model with one backbone layer of each kind V4 has (compress ratio, hash or score
    routing) and one routed expert per layer: (its config, how many full-model layers each of its layers
    stands for, how many experts its one stands for in the backbone and in the drafter). Every layer of a kind
    plans alike (the recipes match roles, not layer numbers), and so does every expert; the router's gate rows
    scale with the experts."""
    cfg = ModelConfig.from_dict(config)
    experts = {"layers": cfg.n_routed_experts, "mtp": cfg.experts_in("mtp.0") if cfg.num_draft_blocks else 0}
    kinds: dict[tuple[bool, int], int] = {}
    for i in range(cfg.num_hidden_layers):
        key = (not cfg.is_hash_block(f"layers.{i}"), cfg.ratio(f"layers.{i}"))
        kinds[key] = kinds.get(key, 0) + 1
    order = sorted(kinds, key=lambda kind: kind[0])            # hash layers first, as V4 numbers them
    ratios = [ratio for _, ratio in order] + list(cfg.compress_ratios[cfg.num_hidden_layers:])
    compact = {**config, "num_hidden_layers": len(order), "num_hash_layers": sum(not score for score, _ in order),
               "compress_ratios": ratios, "n_routed_experts": 1}
    if config.get("dspark_n_routed_experts"):
        compact["dspark_n_routed_experts"] = 1
    if cfg.dspark is not None:   # the same number of target layers (main_proj's width), among the compact ones
        stages = cfg.dspark.stages
        compact["dspark_target_layer_ids"] = [max(0, len(order) - stages + i) for i in range(stages)]
    return compact, {f"layers.{i}": kinds[kind] for i, kind in enumerate(order)}, experts


def _copies(info: TensorInfo, layers: dict[str, int], experts: dict[str, int]) -> int:
    block = ".".join(info.module.split(".")[:2])
    per_expert = info.role is Role.ROUTED_EXPERT or (info.role is Role.ROUTER and info.param != "tid2eid")
    return layers.get(block, 1) * (experts[block.split(".")[0]] if per_expert else 1)



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
    plan_config, layers, experts = _compact(config) if compact else (config, {}, {"layers": 1, "mtp": 1})
    native = _virtual(plan_config, [(s.name, s.dtype, s.shape) for s in native_inventory(ModelConfig.from_dict(plan_config))])
    recipe = SHIPPED[variant]
    src = _source(variant, native) if recipe is None else from_plan(
        variant, build_plan(native, load_recipe(recipe), engine="both"), plan_config)
    # The full model's layer counts (the KV geometry reads them) over what the plan wrote.
    full = {key: config[key] for key in ("num_hidden_layers", "num_hash_layers", "compress_ratios", "n_routed_experts",
                                        "dspark_n_routed_experts", "dspark_target_layer_ids")
            if key in config}
    tensors = [(replace(t, copies=_copies(info, layers, experts)), info) for t, info in src.tensors]
    return replace(src, config={**src.config, **full}, tensors=tensors)
