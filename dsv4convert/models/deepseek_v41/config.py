"""DeepSeek-V4.1-Flash's ``config.json``: nested, read whole and checked before anything is sized from it.

The release's file (``../shared/reference/deepseek-v4.1-flash/config.json``, sha256 8be45ce0...) nests the text
model under ``text_config`` and the vision tower under ``vision_config``; SGLang 0.5.23 flattens it
(``srt/configs/deepseek_v41.py::normalize_deepseek_v41_config``: text keys to the top level, vision keys renamed
``vision_*``) and so does vLLM 0.33.0 (``transformers_utils/configs/deepseek_v41.py::DeepseekV41Config``). Here
the nesting is kept: an output's config keeps ``text_config`` and ``vision_config`` as they are.

Every key of the three levels is known (the release's own, nothing else): a config with a key this reader does
not know, such as a later snapshot's (-1017) if it adds one, is refused naming the keys, and one without
``text_config`` is refused. Every value the inventory and the engines' sizing read is checked for type, range
and consistency with the others before anything is allocated from it (the bounds below are far above the
release's and far below what would exhaust a machine).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dsv4convert.errors import CheckpointError
from dsv4convert.models.deepseek_v4.names import in_draft

MODEL_TYPE = "deepseek_v41"
ARCHITECTURE = "DeepseekV41ForCausalLM"

TOP_KEYS = frozenset({"architectures", "model_type", "dtype", "transformers_version", "bos_token_id", "eos_token_id",
                      "pad_token_id", "image_token_id", "quantization_config", "text_config", "vision_config"})
TEXT_KEYS = frozenset({
    "model_type", "vocab_size", "hidden_size", "moe_intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "qk_rope_head_dim", "q_lora_rank", "o_lora_rank", "o_groups", "hidden_act",
    "swiglu_limit", "rms_norm_eps", "attention_bias", "attention_dropout", "initializer_range", "use_cache",
    "tie_word_embeddings", "max_position_embeddings", "rope_theta", "rope_scaling", "n_routed_experts",
    "n_shared_experts", "num_experts_per_tok", "scoring_func", "topk_method", "norm_topk_prob",
    "routed_scaling_factor", "sliding_window", "compress_ratios", "compress_rope_theta", "kv_source_layer_ids",
    "index_source_layer_ids", "index_n_heads", "index_head_dim", "index_topk", "candidate_source_layer_id",
    "candidate_topk_blocks", "candidate_block_size", "hc_mult", "hc_sinkhorn_iters", "hc_eps", "engram_layer_ids",
    "engram_num_embeddings", "engram_max_ngram_size", "engram_vocab_size", "engram_n_heads", "engram_head_dim",
    "engram_pad_token_id", "engram_compressed_vocab_size", "num_nextn_predict_layers", "dspark_block_size",
    "dspark_noise_token_id", "dspark_target_layer_ids", "dspark_markov_rank", "dspark_n_routed_experts",
    "dspark_num_experts_per_tok"})
VISION_KEYS = frozenset({"model_type", "num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size",
                         "patch_size", "rope_theta", "downsample_ratio", "max_image_tokens", "min_pixels",
                         "max_wh_ratio"})

# Upper bounds that keep every size computed from a config finite and small enough to plan (the release's value).
_LIMITS = {"vocab_size": 1 << 22, "hidden_size": 1 << 16, "moe_intermediate_size": 1 << 16,
           "num_hidden_layers": 1024, "num_attention_heads": 1024, "head_dim": 4096, "q_lora_rank": 1 << 16,
           "o_lora_rank": 1 << 16, "o_groups": 1024, "n_routed_experts": 4096, "n_shared_experts": 64,
           "num_experts_per_tok": 4096, "index_n_heads": 1024, "index_head_dim": 4096, "index_topk": 1 << 20,
           "hc_mult": 64, "candidate_topk_blocks": 1 << 24, "candidate_block_size": 1 << 16,
           "engram_max_ngram_size": 16, "engram_vocab_size": 1 << 32, "engram_n_heads": 256,
           "engram_head_dim": 4096, "engram_compressed_vocab_size": 1 << 22, "dspark_block_size": 64,
           "dspark_markov_rank": 1 << 16, "dspark_n_routed_experts": 4096, "dspark_num_experts_per_tok": 4096,
           "num_nextn_predict_layers": 64, "sliding_window": 1 << 20}
_VISION_LIMITS = {"num_hidden_layers": 1024, "hidden_size": 1 << 16, "num_attention_heads": 1024,
                  "intermediate_size": 1 << 18, "patch_size": 1024, "downsample_ratio": 64}
# SGLang's MXFP4 MoE needs hidden and intermediate sizes in multiples of 128
# (Mxfp4FlashinferCutlassMoEMethod.create_weights); vLLM's MXFP8 linears need multiples of 32
# (quantization/modelopt.py::KMxfp8Static.get_scale_weight_loader).
MOE_MULTIPLE = 128
RELEASE_FP8_BLOCK = (32, 32)   # the release's quantization_config.weight_block_size


@dataclass(frozen=True)
class VisionConfig:
    num_hidden_layers: int
    hidden_size: int
    num_attention_heads: int
    intermediate_size: int
    patch_size: int
    downsample_ratio: int


@dataclass(frozen=True)
class DSparkV41Config:
    target_layer_ids: tuple[int, ...]
    markov_rank: int
    block_size: int
    noise_token_id: int
    n_routed_experts: int
    num_experts_per_tok: int

    @property
    def stages(self) -> int:
        return len(self.target_layer_ids)


@dataclass(frozen=True)
class YarnScaling:
    """The main attention's YaRN RoPE scaling (``rope_scaling`` with ``rope_type`` "yarn")."""

    factor: float
    beta_fast: float
    beta_slow: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class V41Math:
    """The scalars V4.1's forward reads (``dsv4convert/model/v41/``), checked: the routing SGLang runs for V4.1 is
    ``sqrtsoftplus`` scores with ``noaux_tc`` selection and a SiLU SwiGLU (the only one, so other values are refused),
    the RoPE of the main attention (YaRN) and of compressed keys, the hyper-connections' Sinkhorn, and the token ids
    the Engram hash and the vision routing read."""

    rms_norm_eps: float
    swiglu_limit: float | None          # None: no clamp (absent or 0, as SGLang's swiglu_limit_func reads it)
    routed_scaling_factor: float
    norm_topk_prob: bool
    hc_sinkhorn_iters: int
    hc_eps: float
    qk_rope_head_dim: int
    rope_theta: float
    compress_rope_theta: float
    rope_scaling: YarnScaling | None
    max_position_embeddings: int
    engram_pad_token_id: int
    image_token_id: int | None
    bos_token_id: int | None
    eos_token_id: int | None


@dataclass(frozen=True)
class V41Config:
    """What V4.1's inventory, sizing and serving read, checked. ``fp8_block`` is the release's
    ``quantization_config.weight_block_size`` (32 x 32)."""

    vocab_size: int
    hidden_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
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
    index_topk: int
    hc_mult: int
    sliding_window: int
    compress_ratios: tuple[int, ...]           # one per backbone layer, then one (0) per DSpark stage
    kv_source_layer_ids: tuple[int, ...]
    index_source_layer_ids: tuple[int, ...]
    candidate_source_layer_id: int
    candidate_topk_blocks: int
    candidate_block_size: int
    engram_layer_ids: tuple[int, ...]
    engram_num_embeddings: tuple[int, ...]
    engram_max_ngram_size: int
    engram_vocab_size: int
    engram_n_heads: int
    engram_head_dim: int
    engram_compressed_vocab_size: int
    dspark: DSparkV41Config | None
    vision: VisionConfig | None
    fp8_block: tuple[int, int]
    expert_dtype: str
    math: V41Math

    def experts_in(self, block: str) -> tuple[int, int]:
        """(routed experts, experts per token) of ``block`` (``layers.N`` or ``mtp.S``): a DSpark stage's own
        (``dspark_n_routed_experts``, SGLang ``models/deepseek_v4_dspark.py::_dspark_stage_config``) or the
        backbone's."""
        if self.dspark is not None and in_draft(block):
            return self.dspark.n_routed_experts, self.dspark.num_experts_per_tok
        return self.n_routed_experts, self.num_experts_per_tok

    def ratio(self, layer: int) -> int:
        return self.compress_ratios[layer]

    def kv_source_of(self, layer: int) -> int | None:
        """The KV-source layer whose compressed KV ``layer`` reads (the last source at or before it with the same
        ratio: SGLang ``model_executor/pool_configurator.py::collect_sources_by_ratio``), None without one."""
        ratio = self.ratio(layer)
        if not ratio:
            return None
        sources = [s for s in self.kv_source_layer_ids if s <= layer and self.ratio(s) == ratio]
        return sources[-1] if sources else None


def _where(source: str, level: str) -> str:
    return f"{source} ({level})" if level else source


def _int(values: dict, key: str, source: str, level: str, *, low: int = 1, high: int | None = None) -> int:
    value = values.get(key)
    high = _LIMITS.get(key) if high is None else high
    if not isinstance(value, int) or isinstance(value, bool) or value < low or (high is not None and value > high):
        bound = f"between {low} and {high:,}" if high is not None else f">= {low}"
        raise CheckpointError(f"'{key}' must be an integer {bound}, got {value!r}", file=_where(source, level))
    return value


def _ints(values: dict, key: str, source: str, level: str, *, low: int, high: int, unique: bool = True,
          allow_empty: bool = False) -> tuple[int, ...]:
    value = values.get(key)
    if (not isinstance(value, list) or (not value and not allow_empty) or len(value) > 4096
            or any(not isinstance(v, int) or isinstance(v, bool) or not low <= v <= high for v in value)):
        raise CheckpointError(f"'{key}' must list integers in {low}..{high:,}, got {value!r}",
                              file=_where(source, level))
    if unique and (len(set(value)) != len(value) or list(value) != sorted(value)):
        raise CheckpointError(f"'{key}' must be ascending without repeats, got {value!r}", file=_where(source, level))
    return tuple(value)


def _unknown(values: dict, known: frozenset, source: str, level: str) -> None:
    unknown = sorted(set(values) - known)
    if unknown:
        raise CheckpointError(f"keys DeepSeek-V4.1-Flash's config does not have: {', '.join(unknown)} (a later "
                              f"snapshot is read when its keys are V4.1's)", file=_where(source, level))


def is_v41(config: Any) -> bool:
    """What SGLang's ``is_dsv41`` keys on (``config.model_type == "deepseek_v41"``), or the release's architecture."""
    return isinstance(config, dict) and (config.get("model_type") == MODEL_TYPE
                                         or ARCHITECTURE in (config.get("architectures") or []))


def engram_primes(layer_count: int, max_ngram_size: int, n_heads: int, vocab_size: int) -> list[list[int]]:
    """Per Engram layer, its column segments' sizes: one prime per (n-gram size 2..max, head), drawn in (layer,
    n-gram size, head) order, each the next prime above the previous one of its n-gram size (starting above
    ``vocab_size - 1``) never used before (SGLang ``layers/engram.py::EngramLayout.from_config``)."""
    seen: set[int] = set()
    out = []
    for _ in range(layer_count):
        sizes = []
        for _ in range(max_ngram_size - 1):
            current = vocab_size - 1
            for _ in range(n_heads):
                current += 1
                while current in seen or not _is_prime(current):
                    current += 1
                seen.add(current)
                sizes.append(current)
        out.append(sizes)
    return out


def _is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin for n < 3.3e24 (the witnesses SGLang's ``_is_prime`` uses)."""
    if n < 2:
        return False
    witnesses = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41)
    for p in witnesses:
        if n % p == 0:
            return n == p
    d, r = n - 1, 0
    while d % 2 == 0:
        d, r = d // 2, r + 1
    for a in witnesses:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def read_config(config: Any, source: str = "config.json") -> V41Config:
    """The release's config, checked whole (see the module's docstring); one ``CheckpointError`` naming the key."""
    if not isinstance(config, dict):
        raise CheckpointError("config is not a JSON object", file=source)
    if not is_v41(config):
        raise CheckpointError(f"not a DeepSeek-V4.1 config (model_type={config.get('model_type')!r})", file=source)
    _unknown(config, TOP_KEYS, source, "")
    text = config.get("text_config")
    if not isinstance(text, dict):
        raise CheckpointError("DeepSeek-V4.1's config nests the text model under 'text_config', which is missing or "
                              "not an object", file=source)
    _unknown(text, TEXT_KEYS, source, "text_config")
    t = "text_config"
    v = {key: _int(text, key, source, t) for key in (
        "vocab_size", "hidden_size", "moe_intermediate_size", "num_hidden_layers", "num_attention_heads", "head_dim",
        "q_lora_rank", "o_lora_rank", "o_groups", "n_routed_experts", "n_shared_experts", "num_experts_per_tok",
        "index_n_heads", "index_head_dim", "index_topk", "hc_mult", "sliding_window", "candidate_topk_blocks",
        "candidate_block_size", "engram_n_heads", "engram_head_dim", "engram_compressed_vocab_size")}
    layers = v["num_hidden_layers"]
    if v["num_experts_per_tok"] > v["n_routed_experts"]:
        raise CheckpointError(f"'num_experts_per_tok' {v['num_experts_per_tok']} exceeds 'n_routed_experts' "
                              f"{v['n_routed_experts']}", file=_where(source, t))
    if (v["num_attention_heads"] * v["head_dim"]) % v["o_groups"]:
        raise CheckpointError("num_attention_heads * head_dim must divide by 'o_groups'", file=_where(source, t))
    for key in ("hidden_size", "moe_intermediate_size"):
        if v[key] % MOE_MULTIPLE:
            raise CheckpointError(f"'{key}' {v[key]} must be a multiple of {MOE_MULTIPLE} (SGLang's MXFP4 MoE)",
                                  file=_where(source, t))

    dspark = _dspark(text, v, source)
    stages = dspark.stages if dspark else 0
    ratios = text.get("compress_ratios")
    if (not isinstance(ratios, list) or len(ratios) != layers + stages
            or any(r not in (0, 1, 2) or isinstance(r, bool) for r in ratios) or any(ratios[layers:])):
        # 4 and 128 are V4's own compressed layers, which SGLang also builds in a V4.1 model
        # (mem_cache/deepseek_v4_memory_pool.py::collect_sources_by_ratio); the release has none, nor does this reader
        raise CheckpointError(f"'compress_ratios' must give 0, 1 or 2 for each of the {layers} layers and 0 for each "
                              f"of the {stages} DSpark stages, got {ratios!r}", file=_where(source, t))
    kv_sources = _ints(text, "kv_source_layer_ids", source, t, low=0, high=layers - 1)
    index_sources = _ints(text, "index_source_layer_ids", source, t, low=0, high=layers - 1)
    for layer in kv_sources:
        if not ratios[layer]:
            raise CheckpointError(f"KV-source layer {layer} has compress ratio 0 (no compressed KV to share)",
                                  file=_where(source, t))
    for layer in range(layers):
        if ratios[layer] and not any(s <= layer and ratios[s] == ratios[layer] for s in kv_sources):
            raise CheckpointError(f"layer {layer} (compress ratio {ratios[layer]}) has no KV-source layer at or "
                                  f"before it with that ratio ('kv_source_layer_ids' {list(kv_sources)})",
                                  file=_where(source, t))
    for layer in index_sources:
        if not ratios[layer]:
            raise CheckpointError(f"index-source layer {layer} has compress ratio 0", file=_where(source, t))
    candidate = _int(text, "candidate_source_layer_id", source, t, low=0, high=layers - 1)
    if candidate not in index_sources:
        raise CheckpointError(f"'candidate_source_layer_id' {candidate} is not an index-source layer "
                              f"({list(index_sources)})", file=_where(source, t))

    engram_layers = _ints(text, "engram_layer_ids", source, t, low=0, high=layers - 1, allow_empty=True)
    ngram = _int(text, "engram_max_ngram_size", source, t, low=2 if engram_layers else 1)
    engram_vocab = _int(text, "engram_vocab_size", source, t, low=2 if engram_layers else 0)
    rows = _ints(text, "engram_num_embeddings", source, t, low=1, high=1 << 40, unique=False,
                 allow_empty=not engram_layers)
    if len(rows) != len(engram_layers):
        raise CheckpointError(f"'engram_num_embeddings' lists {len(rows)} tables for {len(engram_layers)} Engram "
                              f"layers", file=_where(source, t))
    if engram_layers and engram_vocab * (ngram - 1) * v["engram_n_heads"] * len(engram_layers) > 1 << 40:
        raise CheckpointError("the Engram tables this config implies exceed 2^40 rows", file=_where(source, t))
    want = [sum(p) for p in engram_primes(len(engram_layers), ngram, v["engram_n_heads"], engram_vocab)]
    for layer, got, derived in zip(engram_layers, rows, want):
        if got != derived:
            raise CheckpointError(f"'engram_num_embeddings' gives layer {layer} {got:,} rows; its hash needs "
                                  f"{derived:,} (one prime-sized segment per n-gram size and head above "
                                  f"engram_vocab_size, SGLang layers/engram.py::EngramLayout)", file=_where(source, t))
    if v["engram_head_dim"] % 32:
        raise CheckpointError("'engram_head_dim' must be a multiple of 32 (1x32 E8M0 row scales)",
                              file=_where(source, t))

    vision = _vision(config.get("vision_config"), source)
    block, expert_dtype = _quantization(config.get("quantization_config"), source)
    return V41Config(
        **{key: v[key] for key in ("vocab_size", "hidden_size", "moe_intermediate_size", "num_hidden_layers",
                                   "num_attention_heads", "head_dim", "q_lora_rank", "o_lora_rank", "o_groups",
                                   "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "index_n_heads",
                                   "index_head_dim", "index_topk", "hc_mult", "sliding_window",
                                   "candidate_topk_blocks", "candidate_block_size", "engram_n_heads",
                                   "engram_head_dim", "engram_compressed_vocab_size")},
        compress_ratios=tuple(ratios), kv_source_layer_ids=kv_sources, index_source_layer_ids=index_sources,
        candidate_source_layer_id=candidate, engram_layer_ids=engram_layers, engram_num_embeddings=rows,
        engram_max_ngram_size=ngram, engram_vocab_size=engram_vocab, dspark=dspark, vision=vision,
        fp8_block=block, expert_dtype=expert_dtype, math=_math(config, text, v, source))


def _number(values: dict, key: str, source: str, level: str, *, low: float = 0.0, allow_zero: bool = False) -> float:
    value = values.get(key)
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not value < float("inf")
            or not (value >= low if allow_zero else value > low)):
        raise CheckpointError(f"'{key}' must be a {'non-negative' if allow_zero else 'positive'} finite number, got "
                              f"{value!r}", file=_where(source, level))
    return float(value)


def _token(values: dict, key: str, vocab: int, source: str, level: str, *, required: bool) -> int | None:
    if values.get(key) is None and not required:
        return None
    return _int(values, key, source, level, low=0, high=vocab - 1)


def _math(config: dict, text: dict, v: dict, source: str) -> V41Math:
    t = "text_config"
    for key, want in (("scoring_func", "sqrtsoftplus"), ("topk_method", "noaux_tc"), ("hidden_act", "silu")):
        if text.get(key) != want:
            raise CheckpointError(f"'{key}' must be {want!r} (the routing SGLang runs for DeepSeek-V4.1), got "
                                  f"{text.get(key)!r}", file=_where(source, t))
    if not isinstance(text.get("norm_topk_prob"), bool):
        raise CheckpointError(f"'norm_topk_prob' must be true or false, got {text.get('norm_topk_prob')!r}",
                              file=_where(source, t))
    rope = text.get("qk_rope_head_dim")
    if isinstance(rope, bool) or not isinstance(rope, int) or not 0 < rope <= v["head_dim"] or rope % 2:
        raise CheckpointError(f"'qk_rope_head_dim' must be an even integer in 2..head_dim ({v['head_dim']}), got "
                              f"{rope!r}", file=_where(source, t))
    scaling = text.get("rope_scaling")
    if scaling is not None:
        if not isinstance(scaling, dict) or scaling.get("rope_type") != "yarn":
            raise CheckpointError(f"'rope_scaling' must be YaRN's (rope_type 'yarn') or absent, got {scaling!r}",
                                  file=_where(source, t))
        unknown = sorted(set(scaling) - {"rope_type", "factor", "beta_fast", "beta_slow",
                                          "original_max_position_embeddings"})
        if unknown:
            raise CheckpointError(f"'rope_scaling' keys DeepSeek-V4.1's config does not have: {', '.join(unknown)}",
                                  file=_where(source, t))
        scaling = YarnScaling(*(_number(scaling, key, source, f"{t}.rope_scaling")
                                for key in ("factor", "beta_fast", "beta_slow")),
                              _int(scaling, "original_max_position_embeddings", source, f"{t}.rope_scaling",
                                   high=1 << 24))
    limit = text.get("swiglu_limit")
    vocab = v["vocab_size"]
    return V41Math(
        rms_norm_eps=_number(text, "rms_norm_eps", source, t),
        swiglu_limit=None if limit in (None, 0) else _number(text, "swiglu_limit", source, t),
        routed_scaling_factor=_number(text, "routed_scaling_factor", source, t),
        norm_topk_prob=text["norm_topk_prob"],
        hc_sinkhorn_iters=_int(text, "hc_sinkhorn_iters", source, t, high=1000),
        hc_eps=_number(text, "hc_eps", source, t),
        qk_rope_head_dim=rope,
        rope_theta=_number(text, "rope_theta", source, t),
        compress_rope_theta=_number(text, "compress_rope_theta", source, t),
        rope_scaling=scaling,
        max_position_embeddings=_int(text, "max_position_embeddings", source, t, high=1 << 24),
        engram_pad_token_id=_int(text, "engram_pad_token_id", source, t, low=0, high=vocab - 1),
        image_token_id=_token(config, "image_token_id", vocab, source, "", required=False),
        bos_token_id=_token(config, "bos_token_id", vocab, source, "", required=False),
        eos_token_id=_token(config, "eos_token_id", vocab, source, "", required=False))


def _dspark(text: dict, v: dict, source: str) -> DSparkV41Config | None:
    t = "text_config"
    keys = ("dspark_block_size", "dspark_noise_token_id", "dspark_target_layer_ids", "dspark_markov_rank")
    if not any(text.get(key) is not None for key in keys):
        return None
    missing = [key for key in keys if text.get(key) is None]
    if missing:
        raise CheckpointError(f"a DSpark drafter needs every dspark_* key; {', '.join(missing)} missing",
                              file=_where(source, t))
    ids = _ints(text, "dspark_target_layer_ids", source, t, low=0, high=v["num_hidden_layers"] - 1)
    experts = _int(text, "dspark_n_routed_experts", source, t) if "dspark_n_routed_experts" in text \
        else v["n_routed_experts"]
    topk = _int(text, "dspark_num_experts_per_tok", source, t) if "dspark_num_experts_per_tok" in text \
        else v["num_experts_per_tok"]
    if topk > experts:
        raise CheckpointError(f"'dspark_num_experts_per_tok' {topk} exceeds the drafter's {experts} experts",
                              file=_where(source, t))
    noise = _int(text, "dspark_noise_token_id", source, t, low=0, high=v["vocab_size"] - 1)
    stages = text.get("num_nextn_predict_layers")
    if stages is not None and stages != len(ids):
        raise CheckpointError(f"'num_nextn_predict_layers' {stages!r} disagrees with the {len(ids)} DSpark stages "
                              f"'dspark_target_layer_ids' gives", file=_where(source, t))
    return DSparkV41Config(ids, _int(text, "dspark_markov_rank", source, t),
                           _int(text, "dspark_block_size", source, t), noise, experts, topk)


def _vision(vision: Any, source: str) -> VisionConfig | None:
    if vision is None:
        return None
    if not isinstance(vision, dict):
        raise CheckpointError("'vision_config' is not an object", file=source)
    _unknown(vision, VISION_KEYS, source, "vision_config")
    values = {key: _int(vision, key, source, "vision_config", high=high) for key, high in _VISION_LIMITS.items()}
    if values["hidden_size"] % values["num_attention_heads"]:
        raise CheckpointError("vision hidden_size must divide by num_attention_heads", file=f"{source} (vision_config)")
    return VisionConfig(**values)


def _quantization(quant: Any, source: str) -> tuple[tuple[int, int], str]:
    """The release's FP8 block (``weight_block_size``: 32 x 32 with E8M0 ``ue8m0`` scales) and expert dtype (fp4, fp8;
    int4 for a compressed-tensors config, its FP8 block in ``linear_fp8_config``; bf16 for a config without
    ``quantization_config``, which both engines load unquantized)."""
    where = f"{source} (quantization_config)"
    if quant is None:   # an unquantized (BF16) output: its blocks are the release's, only for planning what it was
        return RELEASE_FP8_BLOCK, "bf16"
    if not isinstance(quant, dict):
        raise CheckpointError("DeepSeek-V4.1's 'quantization_config' is not an object", file=source)
    if quant.get("quant_method") == "compressed-tensors":   # a W4A16 output: INT4 experts, FP8 linears beside them
        quant = {**(quant.get("linear_fp8_config") or {}), "expert_dtype": "int4"}
    block = quant.get("weight_block_size")
    if (not isinstance(block, list) or len(block) != 2
            or any(not isinstance(b, int) or isinstance(b, bool) or not 1 <= b <= 1024 for b in block)):
        raise CheckpointError(f"'weight_block_size' must be two integers, got {block!r}", file=where)
    expert_dtype = quant.get("expert_dtype", "fp4")
    if expert_dtype not in ("fp4", "fp8", "int4"):
        raise CheckpointError(f"'expert_dtype' must be fp4 or fp8, got {expert_dtype!r}", file=where)
    return (block[0], block[1]), expert_dtype
