"""The DeepSeek-V4 checkpoint layout: what every tensor is.

From ``config.json`` alone this module knows every tensor the native checkpoint holds
(name, safetensors dtype, shape) and, for any tensor name of any variant, its role,
block, layer, expert and projection. It is the one place the rest of the code asks
"what is this tensor?". The tables follow the reference code's names (``attn``/``ffn``,
``w1/w2/w3``, ``.scale``), which the released checkpoint uses as is.

Roles (``Role``) are what recipes select on; ``LINEAR_ROLES`` are the ones whose weight is
a matrix a quantization format can apply to.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from enum import Enum
from typing import Iterator

from dsv4convert.dtypes import nbytes
from dsv4convert.errors import CheckpointError
from dsv4convert.models.deepseek_v4.names import DSparkNames, draft_block, in_draft

FP8_BLOCK = 128
MXFP4_GROUP = 32
MAX_EXPERTS = 4096
MAX_DRAFT_BLOCKS = 64
# The most tensors a config may describe: the inventory is built in memory, so a config's counts must not size
# it unbounded (DeepSeek-V4-Flash-0731 holds 72,317 tensors).
MAX_INVENTORY = 1 << 20
# Each integer ModelConfig reads: its lowest and highest value. The highs are far beyond any DeepSeek-V4 release
# (43 layers, 256 experts, 4096 hidden, a 129,280-token vocabulary) and keep every shape a config describes sane.
LIMITS = {
    "vocab_size": (1, 1 << 24), "hidden_size": (MXFP4_GROUP, 1 << 17), "moe_intermediate_size": (MXFP4_GROUP, 1 << 17),
    "num_hidden_layers": (1, 1 << 10), "num_nextn_predict_layers": (0, MAX_DRAFT_BLOCKS),
    "num_hash_layers": (0, 1 << 10), "num_attention_heads": (1, 1 << 12), "head_dim": (MXFP4_GROUP, 1 << 14),
    "q_lora_rank": (MXFP4_GROUP, 1 << 17), "o_lora_rank": (1, 1 << 17), "o_groups": (1, 1 << 12),
    "n_routed_experts": (1, MAX_EXPERTS), "n_shared_experts": (0, 64), "num_experts_per_tok": (1, MAX_EXPERTS),
    "index_n_heads": (1, 1 << 12), "index_head_dim": (1, 1 << 14), "hc_mult": (1, 64),
}


class Role(str, Enum):
    EMBED = "embed"
    HEAD = "head"
    NORM = "norm"                        # every RMSNorm weight, final norm and MTP enorm/hnorm/norm included
    HYPER_CONNECTION = "hyper_connection"  # hc_{attn,ffn,head}_{fn,base,scale}
    ATTENTION = "attention"              # wq_a, wq_b, wkv, wo_a, wo_b
    ATTN_SINK = "attn_sink"
    COMPRESSOR = "compressor"            # attn.compressor.{wkv,wgate,ape,norm}
    INDEXER = "indexer"                  # attn.indexer.wq_b (FP8 linear)
    INDEXER_WEIGHTS_PROJ = "indexer_weights_proj"
    INDEXER_COMPRESSOR = "indexer_compressor"  # attn.indexer.compressor.*
    ROUTER = "router"                    # ffn.gate.weight / .bias / .tid2eid
    SHARED_EXPERT = "shared_expert"
    ROUTED_EXPERT = "routed_expert"
    MTP_PROJECTION = "mtp_projection"    # mtp.N.{e_proj,h_proj}; a DSpark drafter's mtp.0.main_proj
    DRAFT_HEAD = "draft_head"            # a DSpark drafter's markov_head.{embed,head} and confidence_head.proj


# Roles whose `.weight` is a 2-D matrix a format can target (when the module is a linear).
LINEAR_ROLES = frozenset(
    {Role.ATTENTION, Role.INDEXER, Role.SHARED_EXPERT, Role.ROUTED_EXPERT, Role.MTP_PROJECTION,
     Role.COMPRESSOR, Role.INDEXER_WEIGHTS_PROJ, Role.INDEXER_COMPRESSOR, Role.ROUTER, Role.EMBED, Role.HEAD,
     Role.DRAFT_HEAD}
)


class Drafter(str, Enum):
    """What drafts tokens for speculative decoding under ``mtp.*``, as config.json announces it."""

    NONE = "none"
    MTP = "mtp"          # the preview's MTP block(s) (num_nextn_predict_layers), served by EAGLE
    DSPARK = "dspark"    # V4-Flash-0731's DSpark drafter: stages mtp.0..S-1, a Markov head, a confidence head


# The keys that announce a DSpark drafter bundled in the checkpoint (SGLang's test:
# speculative/dspark_components/dspark_config.py::checkpoint_bundles_dspark_draft).
DSPARK_KEYS = ("dspark_block_size", "dspark_markov_rank", "dspark_noise_token_id", "dspark_target_layer_ids")
TARGET_LAYERS_KEY = "dspark_target_layer_ids"
DSPARK_EXPERTS_KEY = "dspark_n_routed_experts"   # a stage's own expert count (the backbone's where absent)
DSPARK_KEY_PREFIX = "dspark_"


def without_drafter(config: dict) -> dict:
    """A config.json with its drafter taken out (``--no-mtp``): no MTP block, no ``dspark_*`` key, the compress
    ratios of the backbone only; everything else as it was."""
    n = config["num_hidden_layers"]
    kept = {key: value for key, value in config.items() if not key.startswith(DSPARK_KEY_PREFIX)}
    return {**kept, "num_nextn_predict_layers": 0, "compress_ratios": list(config["compress_ratios"][:n])}


@dataclass(frozen=True)
class DSparkConfig:
    """A DSpark drafter's shape, from config.json: stage s drafts from the target's hidden states at
    ``target_layer_ids`` (stage 0 projects their concatenation with ``main_proj``), the last stage carries a
    rank-``markov_rank`` Markov head over the vocabulary and a confidence head."""

    target_layer_ids: tuple[int, ...]
    markov_rank: int
    block_size: int
    noise_token_id: int
    n_routed_experts: int          # per stage (dspark_n_routed_experts, else the backbone's)
    num_experts_per_tok: int
    confidence_with_markov: bool   # the confidence head reads [hidden, markov] (H + R wide)

    @property
    def stages(self) -> int:
        return len(self.target_layer_ids)

    @property
    def names(self) -> DSparkNames:
        return DSparkNames(self.stages)


def is_v4_config(config: dict) -> bool:
    """The preview's and 0731's config.json: ``model_type`` deepseek_v4, or the architecture."""
    return config.get("model_type") == "deepseek_v4" or "DeepseekV4ForCausalLM" in (config.get("architectures") or [])


@dataclass(frozen=True)
class AttentionReach:
    """How far a release's attention reaches, for a recall grid: the sliding window every layer sees, the
    compressed layers' ratios (one per backbone layer), the indexer's top-k, and the reach of a candidate level
    that picks blocks before the indexer does (DeepSeek-V4.1: ``candidate_topk_blocks`` x ``candidate_block_size``
    tokens; None where there is none). A needle farther from the question than every one of these is found only
    through the sparse selection."""

    sliding_window: int
    compress_ratios: tuple[int, ...]
    index_topk: int | None
    candidate_reach: int | None = None


@dataclass(frozen=True)
class ModelConfig:
    """The config fields the layout depends on, checked to be a DeepSeek-V4 config."""

    vocab_size: int
    hidden_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_nextn_predict_layers: int
    num_hash_layers: int
    num_attention_heads: int
    head_dim: int
    q_lora_rank: int
    o_lora_rank: int
    o_groups: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    index_n_heads: int
    index_head_dim: int
    hc_mult: int
    compress_ratios: tuple[int, ...]
    dspark: DSparkConfig | None = None
    index_topk: int | None = None    # None: the config names none (recall's threshold needs it)
    sliding_window: int = 128        # transformers' DeepseekV4Config default
    bos_token_id: int = 0

    @property
    def drafter(self) -> Drafter:
        if self.dspark is not None:
            return Drafter.DSPARK
        return Drafter.MTP if self.num_nextn_predict_layers else Drafter.NONE

    @property
    def num_draft_blocks(self) -> int:
        """The ``mtp.*`` blocks: the preview's MTP blocks, or a DSpark drafter's stages."""
        return self.dspark.stages if self.dspark is not None else self.num_nextn_predict_layers

    @classmethod
    def from_dict(cls, config: dict, *, source: str = "config.json") -> "ModelConfig":
        """Every value the layout reads, checked for type, range and consistency before anything is sized by it:
        a hostile config is one error naming its key, never a traceback or an inventory that fills memory."""
        if not isinstance(config, dict):
            raise CheckpointError("config is not a JSON object", file=source)
        if not is_v4_config(config):
            raise CheckpointError(f"not a DeepSeek-V4 config (model_type={config.get('model_type')!r}, "
                                  f"architectures={config.get('architectures')!r})", file=source)
        values = {}
        for name, (low, high) in LIMITS.items():
            value = config.get(name)
            if name == "num_nextn_predict_layers" and value is None:
                value = 0
            values[name] = checked_int(name, value, low, high, source)
        _check_consistency(values, source)
        dspark = _dspark(config, values, source)
        draft_blocks = dspark.stages if dspark else values["num_nextn_predict_layers"]
        ratios = config.get("compress_ratios")
        n_blocks = values["num_hidden_layers"] + draft_blocks
        what = "DSpark stages" if dspark else "MTP blocks"
        if not isinstance(ratios, list) or len(ratios) < n_blocks or any(
                type(r) is not int or r not in (0, 4, 128) for r in ratios):
            raise CheckpointError(
                f"'compress_ratios' must list 0/4/128 for each of the {n_blocks} layers and {what}, got {ratios!r}",
                file=source,
            )
        if dspark and any(ratios[values["num_hidden_layers"]:n_blocks]):
            raise CheckpointError("'compress_ratios' of the DSpark stages must be 0: they attend in the sliding "
                                  "window only (no compressor, no indexer)", file=source)
        experts = max(values["n_routed_experts"], dspark.n_routed_experts if dspark else 0)
        if n_blocks * (6 * experts + 64) > MAX_INVENTORY:
            key = "dspark_n_routed_experts" if dspark and dspark.n_routed_experts == experts else "n_routed_experts"
            raise CheckpointError(f"'{key}' = {experts} over {n_blocks} blocks describes more than {MAX_INVENTORY:,} "
                                  "tensors, far beyond any DeepSeek-V4 release", file=source)
        attention = {}   # what the attention and the organism's data read; absent (or null): the field's default
        for key, low, high in (("sliding_window", 1, 1 << 24), ("index_topk", 1, 1 << 24),
                               ("bos_token_id", 0, values["vocab_size"] - 1)):
            if config.get(key) is not None:
                attention[key] = checked_int(key, config[key], low, high, source)
        return cls(**values, compress_ratios=tuple(ratios[:n_blocks]), dspark=dspark, **attention)

    def block_prefixes(self) -> list[str]:
        return [f"layers.{i}" for i in range(self.num_hidden_layers)] + [
            draft_block(i) for i in range(self.num_draft_blocks)
        ]

    def ratio(self, block: str) -> int:
        kind, idx = block.split(".")
        i = int(idx) if kind == "layers" else self.num_hidden_layers + int(idx)
        return self.compress_ratios[i]

    def experts_in(self, block: str) -> int:
        """Routed experts of a block (a DSpark stage may have its own count)."""
        if self.dspark is not None and in_draft(block):
            return self.dspark.n_routed_experts
        return self.n_routed_experts

    def is_hash_block(self, block: str) -> bool:
        kind, idx = block.split(".")
        return kind == "layers" and int(idx) < self.num_hash_layers


def checked_int(key: str, value: object, low: int, high: int, source: str) -> int:
    """``value`` if it is an integer (not a bool, not 8.0) in [low, high]; else one error naming ``key``."""
    if type(value) is not int or not low <= value <= high:
        raise CheckpointError(f"'{key}' must be an integer in [{low}, {high}], got {value!r}", file=source)
    return value


def _check_consistency(values: dict, source: str) -> None:
    """What one key says about another: the layout's shapes are only whole where these hold."""
    for name in ("hidden_size", "moe_intermediate_size", "q_lora_rank", "head_dim"):
        if values[name] % MXFP4_GROUP:
            raise CheckpointError(f"'{name}' must be a multiple of {MXFP4_GROUP}, got {values[name]}", file=source)
    if values["num_attention_heads"] % values["o_groups"]:
        raise CheckpointError(f"'o_groups' ({values['o_groups']}) must divide 'num_attention_heads' "
                              f"({values['num_attention_heads']})", file=source)
    if values["num_hash_layers"] > values["num_hidden_layers"]:
        raise CheckpointError(f"'num_hash_layers' ({values['num_hash_layers']}) must not exceed "
                              f"'num_hidden_layers' ({values['num_hidden_layers']})", file=source)


def check_top_k(cfg: ModelConfig, source: str) -> None:
    """Each token's routed experts are among its block's: checked where a checkpoint is read (inspect, the
    converters, validate), not in ``from_dict``, since ``fit`` sizes a compact copy of the model that keeps the
    full top-k over one expert per layer (configs.py::compact)."""
    if cfg.num_experts_per_tok > cfg.n_routed_experts:
        raise CheckpointError(f"'num_experts_per_tok' ({cfg.num_experts_per_tok}) must not exceed "
                              f"'n_routed_experts' ({cfg.n_routed_experts})", file=source)
    d = cfg.dspark
    if d is not None and d.num_experts_per_tok > d.n_routed_experts:
        raise CheckpointError(f"'dspark_num_experts_per_tok' ({d.num_experts_per_tok}) must not exceed the stages' "
                              f"routed experts ({d.n_routed_experts}, 'dspark_n_routed_experts' else "
                              "'n_routed_experts')", file=source)


def _dspark(config: dict, values: dict, source: str) -> DSparkConfig | None:
    """The DSpark drafter config.json announces, checked (None: no DSpark key set). A per-stage expert count
    falls back to the backbone's only where its key is absent (or null): 0 is a value, and refused."""
    if not any(config.get(key) is not None for key in DSPARK_KEYS):
        return None
    missing = [key for key in DSPARK_KEYS if config.get(key) is None]
    if missing:
        raise CheckpointError(f"a DSpark drafter needs every dspark_* key; {', '.join(missing)} missing", file=source)
    ids = config["dspark_target_layer_ids"]
    layers = values["num_hidden_layers"]
    if not isinstance(ids, list) or not 0 < len(ids) <= MAX_DRAFT_BLOCKS or any(
            type(i) is not int or not 0 <= i < layers for i in ids):
        raise CheckpointError(f"'dspark_target_layer_ids' must list 1 to {MAX_DRAFT_BLOCKS} backbone layers "
                              f"(0..{layers - 1}), got {ids!r}", file=source)
    numbers = {}
    for key, low, high in (("dspark_markov_rank", 1, values["hidden_size"]), ("dspark_block_size", 1, 1 << 12),
                           ("dspark_noise_token_id", 0, values["vocab_size"] - 1)):
        numbers[key] = checked_int(key, config[key], low, high, source)
    experts, topk = (values[base] if config.get(key) is None else checked_int(key, config[key], 1, MAX_EXPERTS, source)
                     for key, base in (("dspark_n_routed_experts", "n_routed_experts"),
                                       ("dspark_num_experts_per_tok", "num_experts_per_tok")))
    with_markov = config.get("confidence_head_with_markov")
    if with_markov is not None and not isinstance(with_markov, bool):
        raise CheckpointError(f"'confidence_head_with_markov' must be true or false, got {with_markov!r}", file=source)
    return DSparkConfig(tuple(ids), numbers["dspark_markov_rank"], numbers["dspark_block_size"],
                        numbers["dspark_noise_token_id"], experts, topk, with_markov is not False)


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of the native checkpoint."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def info(self) -> "TensorInfo":
        return classify(self.name)

    @property
    def nbytes(self) -> int:
        return nbytes(self.dtype, self.shape)


@dataclass(frozen=True)
class TensorInfo:
    """What a tensor name means, for any variant (``weight_packed``, ``weight_scale_2``... included)."""

    name: str
    role: Role
    module: str            # the name without its parameter suffix, e.g. "layers.3.ffn.experts.7.w1"
    param: str             # "weight", "scale", "weight_scale", "bias", "tid2eid", "ape", "" for bare tensors
    block: str | None      # "layers.3", "mtp.0", or None for global tensors
    expert: int | None = None
    proj: str | None = None  # w1/w2/w3 for experts and shared experts

    @property
    def layer(self) -> int | None:
        return int(self.block.split(".")[1]) if self.block and self.block.startswith("layers.") else None

    @property
    def is_mtp(self) -> bool:
        return bool(self.block and in_draft(self.block))


_PARAMS = r"(?P<param>weight|scale|weight_scale|weight_scale_2|weight_scale_inv|input_scale|weight_packed|weight_shape|weight_zero_point|weight_g_idx|weight_global_scale|input_global_scale|bias|tid2eid|ape)"
_RULES: list[tuple[re.Pattern, Role]] = [
    (re.compile(r"^(?P<module>embed)\.(?P<param>weight)$"), Role.EMBED),
    (re.compile(r"^(?P<module>head)\.(?P<param>weight|weight_scale|scale|weight_packed|weight_shape)$"), Role.HEAD),
    (re.compile(r"^(?P<module>norm)\.(?P<param>weight)$"), Role.NORM),
    (re.compile(r"^(?P<module>hc_head)_(?P<param>fn|base|scale)$"), Role.HYPER_CONNECTION),
    (re.compile(r"^(?P<block>(?:layers|mtp)\.\d+)\.(?P<module>hc_(?:attn|ffn|head))_(?P<param>fn|base|scale)$"),
     Role.HYPER_CONNECTION),
    (re.compile(r"^(?P<block>(?:layers|mtp)\.\d+)\.(?P<module>(?:attn_norm|ffn_norm|enorm|hnorm|norm|main_norm|attn\.q_norm|attn\.kv_norm))\.(?P<param>weight)$"),
     Role.NORM),
    (re.compile(r"^(?P<block>(?:layers|mtp)\.\d+)\.(?P<module>attn)\.(?P<param>attn_sink)$"), Role.ATTN_SINK),
    (re.compile(r"^(?P<block>(?:layers|mtp)\.\d+)\.(?P<module>attn\.indexer\.compressor(?:\.(?:wkv|wgate|norm))?)\.?" + _PARAMS + r"$"),
     Role.INDEXER_COMPRESSOR),
    (re.compile(r"^(?P<block>(?:layers|mtp)\.\d+)\.(?P<module>attn\.compressor(?:\.(?:wkv|wgate|norm))?)\.?" + _PARAMS + r"$"),
     Role.COMPRESSOR),
    (re.compile(r"^(?P<block>(?:layers|mtp)\.\d+)\.(?P<module>attn\.indexer\.weights_proj)\." + _PARAMS + r"$"),
     Role.INDEXER_WEIGHTS_PROJ),
    (re.compile(r"^(?P<block>(?:layers|mtp)\.\d+)\.(?P<module>attn\.indexer\.wq_b)\." + _PARAMS + r"$"), Role.INDEXER),
    (re.compile(r"^(?P<block>(?:layers|mtp)\.\d+)\.(?P<module>attn\.(?:wq_a|wq_b|wkv|wo_a|wo_b))\." + _PARAMS + r"$"),
     Role.ATTENTION),
    (re.compile(r"^(?P<block>(?:layers|mtp)\.\d+)\.(?P<module>ffn\.gate)\." + _PARAMS + r"$"), Role.ROUTER),
    (re.compile(r"^(?P<block>(?:layers|mtp)\.\d+)\.(?P<module>ffn\.shared_experts\.(?P<proj>w[123]))\." + _PARAMS + r"$"),
     Role.SHARED_EXPERT),
    (re.compile(r"^(?P<block>(?:layers|mtp)\.\d+)\.(?P<module>ffn\.experts\.(?P<expert>\d+)\.(?P<proj>w[123]))\." + _PARAMS + r"$"),
     Role.ROUTED_EXPERT),
    (re.compile(r"^(?P<block>mtp\.\d+)\.(?P<module>[eh]_proj|main_proj)\." + _PARAMS + r"$"), Role.MTP_PROJECTION),
    (re.compile(r"^(?P<block>mtp\.\d+)\.(?P<module>markov_head\.(?:embed|head|markov_w1|markov_w2)|confidence_head\.proj)"
                r"\.(?P<param>weight)$"), Role.DRAFT_HEAD),
]
# The Markov head's names vLLM 0.33.0 loads (engines/vllm/rules.py), read as the release's: one module each.
MARKOV_ALIASES = {"markov_head.markov_w1": "markov_head.embed", "markov_head.markov_w2": "markov_head.head"}


def classify(name: str) -> TensorInfo:
    """Role and position of a tensor from its name alone; raises CheckpointError if unknown."""
    for pattern, role in _RULES:
        m = pattern.match(name)
        if m:
            groups = m.groupdict()
            block = groups.get("block")
            local = MARKOV_ALIASES.get(groups["module"], groups["module"])
            module = f"{block}.{local}" if block else local
            expert = groups.get("expert")
            return TensorInfo(
                name=name,
                role=role,
                module=module,
                param=groups.get("param") or "",
                block=block,
                expert=int(expert) if expert is not None else None,
                proj=groups.get("proj"),
            )
    raise CheckpointError("tensor name is not part of the DeepSeek-V4 layout", tensor=name)


def try_classify(name: str) -> TensorInfo | None:
    try:
        return classify(name)
    except CheckpointError:
        return None


def fp8_scale_shape(n: int, k: int) -> tuple[int, int]:
    return (math.ceil(n / FP8_BLOCK), math.ceil(k / FP8_BLOCK))


def _fp8_linear(prefix: str, n: int, k: int) -> list[TensorSpec]:
    return [TensorSpec(f"{prefix}.weight", "F8_E4M3", (n, k)),
            TensorSpec(f"{prefix}.scale", "F8_E8M0", fp8_scale_shape(n, k))]


def _mxfp4_linear(prefix: str, n: int, k: int) -> list[TensorSpec]:
    return [TensorSpec(f"{prefix}.weight", "I8", (n, k // 2)),
            TensorSpec(f"{prefix}.scale", "F8_E8M0", (n, k // MXFP4_GROUP))]


def _hyper_connection(prefix: str, cfg: ModelConfig, kind: str) -> list[TensorSpec]:
    hc = cfg.hc_mult
    if kind == "head":
        rows, n_scale = hc, 1
    else:
        rows, n_scale = (2 + hc) * hc, 3
    return [TensorSpec(f"{prefix}hc_{kind}_fn", "F32", (rows, hc * cfg.hidden_size)),
            TensorSpec(f"{prefix}hc_{kind}_base", "F32", (rows,)),
            TensorSpec(f"{prefix}hc_{kind}_scale", "F32", (n_scale,))]


def _compressor(prefix: str, ratio: int, head_dim: int, hidden: int) -> list[TensorSpec]:
    # Ratio-4 compressors overlap windows and carry two head_dim-wide halves.
    width = (2 if ratio == 4 else 1) * head_dim
    return [TensorSpec(f"{prefix}.ape", "F32", (ratio, width)),
            TensorSpec(f"{prefix}.norm.weight", "BF16", (head_dim,)),
            TensorSpec(f"{prefix}.wkv.weight", "BF16", (width, hidden)),
            TensorSpec(f"{prefix}.wgate.weight", "BF16", (width, hidden))]


def block_inventory(cfg: ModelConfig, block: str) -> list[TensorSpec]:
    """Every tensor of one decoder layer or MTP block, in the released index's order."""
    p, h = block, cfg.hidden_size
    ratio = cfg.ratio(block)
    specs = _hyper_connection(f"{p}.", cfg, "attn") + _hyper_connection(f"{p}.", cfg, "ffn")
    specs.append(TensorSpec(f"{p}.attn.attn_sink", "F32", (cfg.num_attention_heads,)))
    specs += _fp8_linear(f"{p}.attn.wq_a", cfg.q_lora_rank, h)
    specs.append(TensorSpec(f"{p}.attn.q_norm.weight", "BF16", (cfg.q_lora_rank,)))
    specs += _fp8_linear(f"{p}.attn.wq_b", cfg.num_attention_heads * cfg.head_dim, cfg.q_lora_rank)
    specs += _fp8_linear(f"{p}.attn.wkv", cfg.head_dim, h)
    specs.append(TensorSpec(f"{p}.attn.kv_norm.weight", "BF16", (cfg.head_dim,)))
    specs += _fp8_linear(f"{p}.attn.wo_a", cfg.o_groups * cfg.o_lora_rank,
                         cfg.num_attention_heads * cfg.head_dim // cfg.o_groups)
    specs += _fp8_linear(f"{p}.attn.wo_b", h, cfg.o_groups * cfg.o_lora_rank)
    if ratio:
        specs += _compressor(f"{p}.attn.compressor", ratio, cfg.head_dim, h)
    if ratio == 4:
        specs += _fp8_linear(f"{p}.attn.indexer.wq_b", cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank)
        specs.append(TensorSpec(f"{p}.attn.indexer.weights_proj.weight", "BF16", (cfg.index_n_heads, h)))
        specs += _compressor(f"{p}.attn.indexer.compressor", ratio, cfg.index_head_dim, h)
    specs.append(TensorSpec(f"{p}.attn_norm.weight", "BF16", (h,)))
    specs.append(TensorSpec(f"{p}.ffn_norm.weight", "BF16", (h,)))
    inter = cfg.moe_intermediate_size
    shared = inter * cfg.n_shared_experts
    specs += _fp8_linear(f"{p}.ffn.shared_experts.w1", shared, h)
    specs += _fp8_linear(f"{p}.ffn.shared_experts.w3", shared, h)
    specs += _fp8_linear(f"{p}.ffn.shared_experts.w2", h, shared)
    experts = cfg.experts_in(block)
    for e in range(experts):
        specs += _mxfp4_linear(f"{p}.ffn.experts.{e}.w1", inter, h)
        specs += _mxfp4_linear(f"{p}.ffn.experts.{e}.w3", inter, h)
    for e in range(experts):
        specs += _mxfp4_linear(f"{p}.ffn.experts.{e}.w2", h, inter)
    specs.append(TensorSpec(f"{p}.ffn.gate.weight", "BF16", (experts, h)))
    if cfg.is_hash_block(block):
        specs.append(TensorSpec(f"{p}.ffn.gate.tid2eid", "I64", (cfg.vocab_size, cfg.num_experts_per_tok)))
    else:
        specs.append(TensorSpec(f"{p}.ffn.gate.bias", "F32", (experts,)))
    if in_draft(block) and cfg.dspark is not None:
        specs += _dspark_extras(cfg, int(block.split(".")[1]))
    elif in_draft(block):
        specs += _fp8_linear(f"{p}.e_proj", h, h)
        specs += _fp8_linear(f"{p}.h_proj", h, h)
        specs += [TensorSpec(f"{p}.{n}.weight", "BF16", (h,)) for n in ("enorm", "hnorm", "norm")]
        specs += _hyper_connection(f"{p}.", cfg, "head")
    return specs


def _dspark_extras(cfg: ModelConfig, stage: int) -> list[TensorSpec]:
    """A DSpark stage beyond the decoder block it is: stage 0 projects the target's hidden states at
    ``dspark_target_layer_ids`` (``main_proj``, ``main_norm``); the last stage holds the final norm and
    hyper-connection head, the Markov head (``embed``, ``head``: [vocab, rank]) and the confidence head. As
    SGLang's ``models/deepseek_v4_dspark.py::_remap_dspark_weight_name`` and vLLM's
    ``models/deepseek_v4/nvidia/dspark.py::_remap_dspark_name`` read them; the counts and bytes reproduce the
    0731 release's (4,705 tensors, 10,862,838,300 bytes under ``mtp.*``: tests/test_layout.py)."""
    d, h, names = cfg.dspark, cfg.hidden_size, cfg.dspark.names
    specs = []
    if stage == 0:
        specs += _fp8_linear(names.entry_proj, h, h * len(d.target_layer_ids))
        specs.append(TensorSpec(f"{names.entry_norm}.weight", "BF16", (h,)))
    if stage == d.stages - 1:
        specs.append(TensorSpec(f"{names.norm}.weight", "BF16", (h,)))
        specs += _hyper_connection(f"{names.last}.", cfg, "head")
        specs += [TensorSpec(f"{names.markov_embed}.weight", "BF16", (cfg.vocab_size, d.markov_rank)),
                  TensorSpec(f"{names.markov_head}.weight", "BF16", (cfg.vocab_size, d.markov_rank)),
                  TensorSpec(f"{names.confidence}.weight", "BF16",
                             (1, h + (d.markov_rank if d.confidence_with_markov else 0)))]
    return specs


def global_inventory(cfg: ModelConfig) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """(tensors before the first layer, tensors after the last layer) outside any block."""
    head = [TensorSpec("embed.weight", "BF16", (cfg.vocab_size, cfg.hidden_size))]
    tail = _hyper_connection("", cfg, "head") + [
        TensorSpec("norm.weight", "BF16", (cfg.hidden_size,)),
        TensorSpec("head.weight", "BF16", (cfg.vocab_size, cfg.hidden_size)),
    ]
    return head, tail


def native_inventory(cfg: ModelConfig) -> list[TensorSpec]:
    """Every tensor of the native checkpoint, in the released checkpoint's shard order."""
    return [spec for group in native_groups(cfg) for spec in group]


def native_groups(cfg: ModelConfig) -> list[list[TensorSpec]]:
    """The native tensors grouped as the released checkpoint shards them:
    embedding, one group per layer, the final norm/hc/head, then each MTP block or DSpark stage."""
    head, tail = global_inventory(cfg)
    groups = [head]
    groups += [block_inventory(cfg, f"layers.{i}") for i in range(cfg.num_hidden_layers)]
    groups.append(tail)
    groups += [block_inventory(cfg, draft_block(i)) for i in range(cfg.num_draft_blocks)]
    return groups


def linear_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """Logical [N, K] of every module whose weight is a matrix (MXFP4's packed K doubled)."""
    out = {}
    for spec in native_inventory(cfg):
        if spec.name.endswith(".weight") and len(spec.shape) == 2:
            n, k = spec.shape
            out[spec.name[: -len(".weight")]] = (n, k * 2 if spec.dtype == "I8" else k)
    return out


def iter_modules(specs: list[TensorSpec]) -> Iterator[tuple[str, list[TensorSpec]]]:
    """Group specs by module (weight + its scales), keeping order."""
    modules: dict[str, list[TensorSpec]] = {}
    for spec in specs:
        modules.setdefault(spec.info.module, []).append(spec)
    yield from modules.items()
