"""What ``fit`` sizes for DeepSeek-V4.1-Flash: the release planned from its ``config.json`` (no weights), a variant
``convert`` would write from it, or a checkpoint read header by header.

The native release's tensors are the inventory ``inspect --expected`` plans
(:mod:`dsv4convert.models.deepseek_v41.inventory`, 96,085 tensors for the release); a converted variant's are what
:func:`dsv4convert.engines.outputs_v41.expected_outputs` says the converter writes; a checkpoint's are its shard headers
(``Checkpoint.open`` reads no tensor data), its variant the one its ``quantization_config`` names, checked against
the dtype its routed experts are stored in.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dsv4convert.checkpoint import Checkpoint, read_small_json
from dsv4convert.engines.outputs_v41 import VARIANTS, expected_outputs
from dsv4convert.engines.config import v41_config, v41_variant_of
from dsv4convert.errors import CheckpointError
from dsv4convert.models.deepseek_v4.layout import TensorSpec
from dsv4convert.models.deepseek_v41.config import V41Config, is_v41, read_config
from dsv4convert.models.deepseek_v41.inventory import native_inventory, role_of

LABEL = "native"
# The variants fit plans from a V4.1 config: the release, then what each shipped recipe writes.
PLANNED = (LABEL, *VARIANTS)
# How a backbone routed expert's weight is stored, per variant (``convert/v41.py``'s module docstring).
_EXPERT_WEIGHTS = {"native": ("I8", "U8"), "nvfp4": ("U8",), "fp8": ("F8_E4M3",), "bf16": ("BF16",),
                   "w4a16": ("I32",)}


@dataclass(frozen=True)
class PlannedV41:
    """A V4.1 checkpoint as planned or opened: its checked config, every tensor, its variant and how to call it."""

    config: V41Config
    tensors: list[TensorSpec]
    variant: str = LABEL
    label: str = LABEL
    raw: dict | None = None        # its config.json (its quantization_config is what an engine reads)


def is_v41_config(config: object) -> bool:
    return is_v41(config)


def planned(config: dict, source: str, variant: str = LABEL) -> PlannedV41:
    """The checkpoint ``config`` describes, or the ``variant`` ``convert`` writes from it (one ``CheckpointError``
    naming the key otherwise)."""
    cfg = read_config(config, source)
    if variant == LABEL:
        return PlannedV41(cfg, native_inventory(cfg), raw=config)
    outputs = expected_outputs(cfg, variant)
    return PlannedV41(cfg, [TensorSpec(n, d, s) for n, (d, s) in outputs.items()], variant, variant,
                      v41_config(config, variant, None)[0])


def from_checkpoint(model: str | Path) -> PlannedV41 | None:
    """A V4.1 checkpoint directory or Hub repo id, headers only; None when it is not V4.1. Its variant is what its
    ``quantization_config`` says, and its routed experts must be stored that way (one error naming the shard and
    tensor otherwise). A local directory's config.json is read first: another release's shards are left unopened."""
    local = Path(model) / "config.json"
    if local.is_file() and not is_v41(read_small_json(local)):
        return None
    ckpt = Checkpoint.open(model)
    if not is_v41(ckpt.config):
        return None
    source = str(ckpt.root / "config.json")
    cfg = read_config(ckpt.config, source)
    variant = v41_variant_of(ckpt.config)
    expert = next((e for e in ckpt.tensors.values() if role_of(e.name) == "routed_expert"
                   and e.name.endswith((".weight", ".weight_packed"))), None)
    if expert is None:
        raise CheckpointError(f"{ckpt.root}: no routed expert weight in the shard headers: not a whole "
                              "DeepSeek-V4.1 checkpoint")
    if expert.dtype not in _EXPERT_WEIGHTS[variant]:
        raise CheckpointError(f"{expert.path}: {expert.name} is {expert.dtype}, but {source}'s quantization_config "
                              f"describes the {variant} variant ({' or '.join(_EXPERT_WEIGHTS[variant])} experts)")
    tensors = [TensorSpec(e.name, e.dtype, tuple(e.shape)) for e in ckpt.tensors.values()]
    return PlannedV41(cfg, tensors, variant, str(model), ckpt.config)


def of_directory(model: Path) -> PlannedV41 | None:
    """A V4.1 checkpoint as ``serve`` plans its launch: from its shard headers where they are here, exactly as
    ``fit --model`` reads it (:func:`from_checkpoint`), else from its config.json alone (a host given only the config,
    or the release's config to plan with): the variant its ``quantization_config`` names
    (``engines/config.py::v41_variant_of``), its tensors those ``convert`` writes for that variant. None when the
    config is another release's."""
    path = Path(model) / "config.json"
    config = read_small_json(path)
    if not is_v41(config):
        return None
    if any(Path(model).glob("*.safetensors")):
        return from_checkpoint(model)
    cfg = read_config(config, str(path))
    variant = v41_variant_of(config)
    if variant == LABEL:
        return PlannedV41(cfg, native_inventory(cfg), raw=config)
    groups = (config["quantization_config"].get("config_groups") or {}) if variant == "w4a16" else {}
    group = ((groups.get("group_0") or {}).get("weights") or {}).get("group_size", 32)
    outputs = expected_outputs(cfg, variant, group)
    return PlannedV41(cfg, [TensorSpec(n, d, s) for n, (d, s) in outputs.items()], variant, str(model), config)
