"""DeepSeek-V4 config.json rewritten: fewer layers, a DSpark drafter in place of the MTP block, other target
layers, the compact model ``fit`` plans, the keys a drafter sets. Each reads the release's checked
:class:`~dsv4convert.models.deepseek_v4.layout.ModelConfig`, and the drafter's keys are written only here and in
``layout.py``.
"""

from __future__ import annotations

import copy

from dsv4convert.errors import DSV4Error
from dsv4convert.models.deepseek_v4.layout import (
    DSPARK_EXPERTS_KEY,
    DSPARK_KEY_PREFIX,
    TARGET_LAYERS_KEY,
    ModelConfig,
    without_drafter,
)
from dsv4convert.models.deepseek_v4.names import draft_block

# Keys that wire the drafter to the backbone, not shape it: two checkpoints may differ in them and still be the
# same model (compare reports each side's and what it costs the drafts).
DRAFTER_WIRING = frozenset({TARGET_LAYERS_KEY})
# The keys :func:`compact` changes that the KV geometry reads: a plan of the compact model takes them back from
# the full model's config.
COMPACTED_KEYS = ("num_hidden_layers", "num_hash_layers", "compress_ratios", "n_routed_experts", DSPARK_EXPERTS_KEY,
                  TARGET_LAYERS_KEY)


def _last_layers(num_layers: int, stages: int) -> list[int]:
    """A DSpark drafter's target layers when it drafts from the last ``stages`` of ``num_layers`` (0731's drafts
    from its last three)."""
    return [max(0, num_layers - stages + i) for i in range(stages)]


def with_num_layers(config: dict, num_layers: int, *, mtp: bool = True) -> dict:
    """Keep the first ``num_layers`` backbone layers, and the drafter unless ``mtp`` is False (a DSpark drafter
    then drafts from the last layers kept)."""
    config = copy.deepcopy(config)
    cfg = ModelConfig.from_dict(config, source="config")
    n, drafts = cfg.num_hidden_layers, cfg.num_draft_blocks
    if not 1 <= num_layers <= n:
        raise DSV4Error(f"--num-layers must be between 1 and {n}, got {num_layers}")
    ratios = config["compress_ratios"]
    config["compress_ratios"] = ratios[:num_layers] + ratios[n : n + drafts]
    config["num_hidden_layers"] = num_layers
    config["num_hash_layers"] = min(config.get("num_hash_layers", 0), num_layers)
    if not mtp:
        return without_drafter(config)
    if cfg.dspark is not None:
        config[TARGET_LAYERS_KEY] = _last_layers(num_layers, drafts)
    return config


def with_dspark(config: dict, *, stages: int = 3, block_size: int = 5, markov_rank: int | None = None,
                noise_token_id: int | None = None) -> dict:
    """The config with a DSpark drafter in place of the MTP block, as DeepSeek-V4-Flash-0731 ships it: ``stages``
    sliding-window stages drafting blocks of ``block_size`` from the last ``stages`` layers, a Markov head of rank
    256 (a quarter of the hidden size for smaller models), the noise token the vocabulary's last unless given;
    the ``num_nextn_predict_layers`` key stays (0731 keeps 1)."""
    config = copy.deepcopy(config)
    cfg = ModelConfig.from_dict(config, source="config")
    n = cfg.num_hidden_layers
    if cfg.dspark is not None:
        raise DSV4Error("the config already has a DSpark drafter")
    if not 1 <= stages <= n:
        raise DSV4Error(f"a DSpark drafter needs between 1 and {n} stages (one per target layer), got {stages}")
    config["compress_ratios"] = list(config["compress_ratios"][:n]) + [0] * stages
    config["num_nextn_predict_layers"] = max(config.get("num_nextn_predict_layers") or 0, 1)
    config.update(dspark_block_size=block_size, dspark_markov_rank=markov_rank or min(256, cfg.hidden_size // 4),
                  dspark_noise_token_id=cfg.vocab_size - 1 if noise_token_id is None else noise_token_id,
                  dspark_target_layer_ids=_last_layers(n, stages))
    return config


def with_first_target(config: dict, layer: int, *, source: str = "config.json") -> dict:
    """The config with its DSpark drafter's first target layer replaced by backbone layer ``layer``."""
    d = ModelConfig.from_dict(config, source=source).dspark
    if d is None:
        raise DSV4Error("the config has no DSpark drafter (no dspark_* keys)", file=source)
    return {**config, TARGET_LAYERS_KEY: [layer, *d.target_layer_ids[1:]]}


def drafter_keys(config: dict) -> dict:
    """The config.json keys a DSpark drafter sets on its backbone's config: the ``dspark_*`` keys, the compress
    ratios of the stages, ``num_nextn_predict_layers`` (0731 keeps 1)."""
    return {"num_nextn_predict_layers": config["num_nextn_predict_layers"],
            "compress_ratios": list(config["compress_ratios"]),
            **{key: value for key, value in config.items() if key.startswith(DSPARK_KEY_PREFIX)}}


def compact(config: dict) -> tuple[dict, dict[str, int], dict[bool, int]]:
    """The config of a model with one backbone layer of each kind V4 has (compress ratio, hash or score
    routing) and one routed expert per layer: (its config, how many full-model layers each of its layers
    stands for, how many experts its one stands for in the backbone (False) and in the drafter (True)). Every
    layer of a kind plans alike (the recipes match roles, not layer numbers), and so does every expert; the
    router's gate rows scale with the experts."""
    cfg = ModelConfig.from_dict(config)
    experts = {False: cfg.n_routed_experts, True: cfg.experts_in(draft_block(0)) if cfg.num_draft_blocks else 0}
    kinds: dict[tuple[bool, int], int] = {}
    for i in range(cfg.num_hidden_layers):
        key = (not cfg.is_hash_block(f"layers.{i}"), cfg.ratio(f"layers.{i}"))
        kinds[key] = kinds.get(key, 0) + 1
    order = sorted(kinds, key=lambda kind: kind[0])            # hash layers first, as V4 numbers them
    ratios = [ratio for _, ratio in order] + list(cfg.compress_ratios[cfg.num_hidden_layers:])
    compacted = {**config, "num_hidden_layers": len(order), "num_hash_layers": sum(not score for score, _ in order),
                 "compress_ratios": ratios, "n_routed_experts": 1}
    if config.get(DSPARK_EXPERTS_KEY):
        compacted[DSPARK_EXPERTS_KEY] = 1
    if cfg.dspark is not None:   # the same number of target layers (main_proj's width), among the compact ones
        compacted[TARGET_LAYERS_KEY] = _last_layers(len(order), cfg.dspark.stages)
    return compacted, {f"layers.{i}": kinds[kind] for i, kind in enumerate(order)}, experts
