"""What a checkpoint stores, grouped the way the engines build their layers.

:class:`StoredFormats` is the one description every engine rule reads (SGLang's and vLLM's quant
configs, refusals and serving environment); :func:`analyse` builds it from the formats of every linear
module, refusing what neither engine builds. Paths are relative to ``python/sglang/srt/`` of the SGLang
wheel this tool pins.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from dsv4convert.engines import SGLANG_LABEL
from dsv4convert.errors import RecipeError
from dsv4convert.formats import Format
from dsv4convert.models.deepseek_v4.layout import ModelConfig, Role, classify, linear_shapes
from dsv4convert.models.registry import release_of

# Modules SGLang builds with quant_config=None (models/deepseek_v4.py, layers/attention/dsv4/compressor.py,
# indexer.py) or never quantizes for V4; a quantized tensor there would not load.
NEVER_QUANTIZED = {
    Role.COMPRESSOR: "SGLang builds the compressor wkv/wgate with quant_config=None",
    Role.INDEXER_COMPRESSOR: "SGLang builds the indexer's compressor with quant_config=None",
    Role.INDEXER_WEIGHTS_PROJ: "SGLang builds indexer weights_proj with quant_config=None",
    Role.ROUTER: "the router gate runs in BF16/FP32 in every engine",
    Role.EMBED: "an embedding is a lookup table, not a GEMM",
    Role.DRAFT_HEAD: ("a DSpark drafter's Markov and confidence heads are built unquantized by both engines "
                      "(SGLang models/deepseek_v4_dspark.py::DSparkV4MarkovHead, vLLM quant_config=None)"),
}
# Linears SGLang builds with quant_config=None or never quantizes (the LM head is a
# ParallelLMHead, which Fp8Config.get_quant_method leaves unquantized): only BF16 loads.
ALWAYS_BF16 = frozenset(NEVER_QUANTIZED) | {Role.HEAD}
# Linears whose quant method comes from the config (Fp8LinearMethod unless ignored).
CONFIG_LINEARS = frozenset({Role.ATTENTION, Role.INDEXER, Role.SHARED_EXPERT, Role.MTP_PROJECTION})
# Pairs both engines load into one fused linear, so both halves must share one format:
# wq_a + wkv -> wqkv_a (SGLANG_OPT_FUSE_WQA_WKV, models/deepseek_v4.py), shared w1 + w3 ->
# gate_up_proj (DEEPSEEK_V4_STACKED_PARAMS_MAPPING); vLLM's packed_modules_mapping the same.
FUSED_PAIRS = {"attn.wq_a": ("attn.wkv", "wqkv_a"), "ffn.shared_experts.w1": ("ffn.shared_experts.w3", "gate_up_proj")}

# DeepSeek-V4.1 (models/deepseek_v41/inventory.py::role_of's roles): what every variant stores exactly as the release
# does, because both engines build it in one dtype whatever the quant config.
V41_NEVER_QUANTIZED = {
    "engram_table": ("both engines hard-code the Engram table as FP8 E4M3 rows with 1x32 E8M0 scales and copy_ it in "
                     "(SGLang layers/engram.py::EngramEmbedding._load_rows, vLLM models/deepseek_v41/common/engram.py::"
                     "ParallelEngramEmbedding): any other dtype is cast without its scales"),
    "compressor": ("SGLang builds DeepseekV41Compressor as plain BF16 nn.Linear (layers/attention/dsv4/"
                   "dsv41_sparse.py), vLLM with quant_config=None (models/deepseek_v41/compressor.py)"),
    "indexer_bf16": ("SGLang builds DeepseekV41Indexer.wk, k_norm and weights_proj in BF16 "
                     "(layers/attention/dsv4/dsv41_sparse.py), vLLM with quant_config=None "
                     "(models/deepseek_v41/attention.py)"),
    "vision": "both engines build the vision tower and aligner unquantized (BF16)",
    "router": "the router gate runs in BF16/FP32 in every engine",
    "embed": "an embedding is a lookup table, not a GEMM",
    "head": "the LM head is a ParallelLMHead, which neither engine's fp8 config quantizes",
    "draft_head": ("a DSpark drafter's Markov and confidence heads are built unquantized by both engines "
                   "(SGLang models/deepseek_v4_dspark.py, vLLM models/deepseek_v41/nvidia/dspark.py)"),
}
# V4.1's pairs both engines load into one fused parameter, so both halves keep one format: wq_a + wkv -> wqkv_a
# (SGLang SGLANG_OPT_FUSE_WQA_WKV, vLLM fused_wqa_wkv), shared w1 + w3 -> gate_up_proj, and on SGLang sm_100+ /
# always in vLLM the compressor's wkv + wgate (SGLang dsv41_sparse.py::fused_low_ratio_compress_supported, vLLM
# nvidia/model.py::DeepseekV41LLMForCausalLM.load_weights: fused_wkv_wgate).
V41_FUSED_PAIRS = {**FUSED_PAIRS, "attn.compressor.wkv": ("attn.compressor.wgate", "wkv_gate")}


@dataclass
class StoredFormats:
    """The output's linear formats, grouped the way SGLang builds its layers.

    ``formats`` maps every linear module (native name) to its stored format and parameters
    (``group_size`` for INT4, ``fp8_scale_dtype`` for FP8); the rest is derived from it by
    :func:`analyse`: one format per block's FusedMoE (every routed expert of a block),
    the INT4 group sizes, the formats of the linears whose quant method comes from the config
    (attention, indexer ``wq_b``, shared experts, MTP projections) and the FP8 scale dtypes.
    """

    formats: dict[str, tuple[Format, dict]]
    config: ModelConfig                                          # the model's (its drafter among the rest)
    fp8_block: tuple[int, int]                                   # the release's (rows, cols) FP8 block
    experts: dict[str, Format] = field(default_factory=dict)    # block -> the one format of its FusedMoE
    int4_groups: set[int] = field(default_factory=set)
    config_linears: dict[str, Format] = field(default_factory=dict)  # native module -> format
    fp8_scale_dtypes: set[str] = field(default_factory=set)

    @property
    def dspark(self) -> bool:
        """The drafter under ``mtp.*`` is DSpark's stages (else the preview's MTP block, or none)."""
        return self.config.dspark is not None

    @property
    def everything_bf16(self) -> bool:
        return all(fmt is Format.BF16 for fmt, _ in self.formats.values())

    def expert_formats(self, *, mtp: bool | None = None) -> set[Format]:
        """Formats of the blocks' FusedMoEs: all blocks, only the MTP draft's (True) or only the backbone's."""
        return {f for block, f in self.experts.items() if mtp is None or block.startswith("mtp.") == mtp}

    @property
    def wo_a_bf16(self) -> bool:
        return any(f is Format.BF16 for m, f in self.config_linears.items() if m.endswith(".attn.wo_a"))


def analyse(source_config: dict, module_formats: dict[str, tuple[Format, dict]]) -> StoredFormats:
    """Group what is stored the way the engines build layers, refusing what no engine builds (naming the module).

    ``module_formats`` maps every linear module (native name) to its stored format and parameters."""
    cfg = ModelConfig.from_dict(source_config)
    expected = set(linear_shapes(cfg))
    missing = sorted(expected - set(module_formats))
    unknown = sorted(set(module_formats) - expected)
    if unknown:
        raise RecipeError("not a linear module of this model's layout", tensor=unknown[0])
    if missing:
        raise RecipeError(f"no stored format given for {len(missing)} linear module(s)", tensor=missing[0])
    stored = StoredFormats(dict(module_formats), cfg, release_of(source_config).fp8_block(cfg))
    by_block: dict[str, dict[Format, str]] = defaultdict(dict)
    for module, (fmt, params) in module_formats.items():
        info = classify(module + ".weight")
        if fmt is Format.FP8:
            stored.fp8_scale_dtypes.add(params.get("fp8_scale_dtype", "F8_E8M0"))
        if info.role is Role.ROUTED_EXPERT:
            by_block[info.block].setdefault(fmt, module)
            if fmt is Format.INT4:
                stored.int4_groups.add(int(params.get("group_size", 128)))
        elif info.role in ALWAYS_BF16:
            if fmt is not Format.BF16:
                raise RecipeError(f"{SGLANG_LABEL} loads this {info.role.value} module only in BF16, not {fmt.value}",
                                  tensor=module)
        elif info.role in CONFIG_LINEARS:
            if fmt not in (Format.FP8, Format.BF16):
                raise RecipeError(f"{SGLANG_LABEL} reads {fmt.value} only for routed experts; keep this "
                                  f"{info.role.value} module FP8 or BF16", tensor=module)
            stored.config_linears[module] = fmt
        else:
            raise RecipeError(f"no SGLang rule for a {info.role.value} linear", tensor=module)
    for block, found in by_block.items():
        if len(found) > 1:
            a, b = sorted(found.items(), key=lambda kv: kv[1])[:2]
            # Every expert of a layer is one FusedMoE with one quant method (FusedMoE.__init__).
            raise RecipeError(f"all routed experts of {block} must share one format, SGLang loads them as one "
                              f"FusedMoE; found {a[0].value} ({a[1]}) and {b[0].value} ({b[1]})", tensor=a[1])
        stored.experts[block] = next(iter(found))
    for module, fmt in stored.config_linears.items():
        for first, (second, fused) in FUSED_PAIRS.items():
            if module.endswith("." + first):
                partner = module[: -len(first)] + second
                if stored.config_linears.get(partner) is not fmt:
                    raise RecipeError(f"SGLang fuses this module with {partner} into {fused}; both must share one "
                                      f"format", tensor=module)
    return stored
