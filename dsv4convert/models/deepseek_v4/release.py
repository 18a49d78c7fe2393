"""DeepSeek-V4 as a release (the preview and V4-Flash-0731): what :mod:`dsv4convert.models.registry` asks of it.

The layout itself (every tensor from config.json, roles, the drafter's names) is :mod:`.layout`; this module
answers the registry's questions from it: is a config this release's, its checked config, the native inventory
``inspect --expected`` plans, the FP8 block, and what drafts.
"""

from __future__ import annotations

from dsv4convert import models
from dsv4convert.models.deepseek_v4.layout import (
    FP8_BLOCK,
    AttentionReach,
    ModelConfig,
    Role,
    is_v4_config,
    native_groups,
    try_classify,
)

NAME = "DeepSeek-V4-Flash"


def not_yet(command: str) -> str | None:
    """Every command handles V4."""
    return None


def matches(config: dict) -> bool:
    return is_v4_config(config)


def read_config(config: dict, source: str) -> ModelConfig:
    return ModelConfig.from_dict(config, source=source)


def attention_reach(cfg: ModelConfig) -> AttentionReach:
    """The window, the backbone's CSA/HCA ratios and the indexer's top-k; V4 has no candidate level."""
    return AttentionReach(cfg.sliding_window, cfg.compress_ratios[:cfg.num_hidden_layers], cfg.index_topk)


def fp8_block(cfg: ModelConfig) -> tuple[int, int]:
    """V4's FP8 linears are stored in 128 x 128 blocks with one scale each."""
    return (FP8_BLOCK, FP8_BLOCK)


def describe_drafter(cfg: ModelConfig) -> str:
    """What drafts for speculative decoding, in a few words."""
    blocks = cfg.num_draft_blocks
    if cfg.dspark is not None:
        d = cfg.dspark
        return (f"a DSpark drafter: {d.stages} stages (mtp.0-mtp.{d.stages - 1}) drafting blocks of {d.block_size} from "
                f"layers {', '.join(map(str, d.target_layer_ids))}, a rank-{d.markov_rank} Markov head")
    if blocks:
        return f"the MTP draft block{'s' if blocks > 1 else ''} mtp.0{f'-mtp.{blocks - 1}' if blocks > 1 else ''}"
    return "no drafter"


def role_of(name: str) -> str:
    """A tensor's role as inspect tallies it ("unknown" for a name V4 does not have); a drafter's routed experts
    apart."""
    info = try_classify(name)
    if info is None:
        return "unknown"
    return f"{info.role.value} (mtp)" if info.is_mtp and info.role is Role.ROUTED_EXPERT else info.role.value


def role_table(entries: list[tuple[str, str, tuple[int, ...], int]]) -> list[dict]:
    """Tensors, bytes and dtypes per role, the heaviest first."""
    return models.role_table(entries, role_of)


def expected_report(config: dict, source: str) -> dict:
    """``inspect --expected``'s plan of the native checkpoint."""
    cfg = read_config(config, source)
    groups = native_groups(cfg)
    specs = [s for g in groups for s in g]
    return {
        "release": NAME,
        "variant": "native",
        "drafter": cfg.drafter.value,
        "drafter_description": describe_drafter(cfg),
        "tensor_count": len(specs),
        "total_bytes": sum(s.nbytes for s in specs),
        "shard_bytes": [sum(s.nbytes for s in g) for g in groups],
        "roles": role_table([(s.name, s.dtype, s.shape, s.nbytes) for s in specs]),
        "tensors": [{"name": s.name, "dtype": s.dtype, "shape": list(s.shape)} for s in specs],
    }
