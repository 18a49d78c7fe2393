"""The ``quantization_config`` SGLang 0.5.23 needs for what a conversion actually stored.

The config is derived from the stored format of every linear module, not from the recipe's
name, so a custom or mixed recipe gets a config SGLang reads correctly, or a ``RecipeError``
naming the module when no SGLang config can describe it. Each rule below cites the SGLang
code it follows (paths relative to ``python/sglang/srt/`` of the 0.5.23 wheel).

Config families, chosen from the routed experts:

* nothing quantized: no ``quantization_config`` at all.
* INT4 experts: ``CompressedTensorsConfig`` (``quant_method: compressed-tensors``,
  ``pack-quantized``, one group targeting ``Linear``). The NextN draft is built with the same
  quant config (``models/deepseek_v4_nextn.py``, ``DeepseekV4ModelNextN.__init__``), so its
  FusedMoE ``model.decoder.mlp.experts`` is INT4 unless ``ignore`` lists it, and then it is
  unquantized BF16 (``CompressedTensorsConfig.get_quant_method``): the MTP experts must be
  INT4 or BF16. FP8 linears go through ``linear_fp8_config``, which gives *every* LinearBase
  ``Fp8LinearMethod`` without consulting any ignore list, so the linears are all FP8 or all BF16.
* NVFP4 experts: ``Fp8Config`` plus the fields ``ModelConfig.__init__`` (``configs/model_config.py``)
  reads to wrap it as ``HybridFp8NvFp4Config`` (``model_loader/loader.py::_get_quantization_config``).
  The loader always excludes ``model.decoder.*`` from NVFP4, so MTP experts can never be NVFP4:
  the excluded draft FusedMoE is ``Mxfp4FlashinferTrtllmMoEMethod`` (an SM100 kernel) when
  ``is_fp4_experts``, else the ``Fp8Config`` dispatch (``Fp8MoEMethod``, Triton on every GPU).
  ``mtp_experts_format`` (``fp8_block`` or ``mxfp4``) states which the checkpoint holds; SGLang
  does not read it (its choice follows ``SGLANG_DSV4_FP4_EXPERTS``, see :func:`serving_env`).
* otherwise: ``Fp8Config`` (FP8 or MXFP4 experts; ``is_fp4_experts`` is one switch per model).

``expert_dtype: fp4`` is kept only when every routed expert is still MXFP4: SGLang never reads
it (it probes the first expert's shard dtype, ``configs/deepseek_v4.py::try_detect_fp4_experts``),
but DeepSeek's reference inference code takes it to mean "experts are MXFP4", which is false
for every other layout.

``is_fp4_experts`` comes from ``SGLANG_DSV4_FP4_EXPERTS``, which :func:`serving_env` always states.
A checkpoint whose backbone experts mix formats also says it in the config
(``routed_experts_quant_method``, :func:`_state_expert_layout`): unset, SGLang would probe the first
routed expert's dtype, i.e. whatever layer 0 holds. That key also skips V4's ``topk_group = n_group``
fix in ``ModelConfig.__init__``, so ``topk_group`` is written with the value the fix would set.

SGLang also loads ``wo_a`` all FP8 or all BF16 (:func:`_check_wo_a`); the other config-quantized
linears (``ignored_layers``) may differ per layer, fused pairs (``wq_a``/``wkv``, shared ``w1``/``w3``)
sharing one format.

Engines: the config above is SGLang's; :mod:`dsv4convert.engines.config` writes it for every output and,
where vLLM is asked for too, adds what vLLM reads on top (:mod:`dsv4convert.engines.vllm.quant_config`).
"""

from __future__ import annotations

import copy
import re

from dsv4convert import __version__
from dsv4convert.engines import SGLANG_LABEL
from dsv4convert.engines.stored import FUSED_PAIRS, StoredFormats, analyse
from dsv4convert.errors import RecipeError
from dsv4convert.formats import NVFP4_BLOCK, Format
from dsv4convert.models.deepseek_v4.layout import Role, classify

HF_QUANT_CONFIG = "hf_quant_config.json"

# Native -> SGLang module names (DeepseekV4ForCausalLM.remap_weight_name_to_dpsk_hf_format).
_SGLANG_SUFFIX = {
    "attn.wq_a": "self_attn.wq_a", "attn.wkv": "self_attn.wkv", "attn.wq_b": "self_attn.wq_b",
    "attn.wo_a": "self_attn.wo_a", "attn.wo_b": "self_attn.wo_b", "attn.indexer.wq_b": "self_attn.indexer.wq_b",
    "ffn.shared_experts.w1": "mlp.shared_experts.gate_proj", "ffn.shared_experts.w3": "mlp.shared_experts.up_proj",
    "ffn.shared_experts.w2": "mlp.shared_experts.down_proj",
}

# Coarse compressed-tensors `ignore` entries for every Linear that is never INT4 here (only
# routed experts are). SGLang matches them with `re.match` on its own module names
# (compressed_tensors/utils.py::check_equal_or_regex_match); none matches `...mlp.experts.0.*`,
# which is what get_moe_scheme asks about.
_CT_NON_EXPERT_IGNORE = [
    r"re:.*\.self_attn\..*",
    r"re:.*\.mlp\.shared_experts\..*",
    r"re:.*\.mlp\.gate$",
    r"re:^model\.(e_proj|h_proj)$",
    "lm_head",
]
# A DSpark drafter's main_proj (stage 0), which compressed-tensors would otherwise read as INT4.
_CT_DSPARK_IGNORE = [r"re:^stages\.0\.main_proj$"]

# What ModelOpt lists for engines that read hf_quant_config.json (native names): attention,
# shared experts, head and the MTP block are never NVFP4 here (enforced below).
_NVFP4_NATIVE_EXCLUDES = ["*.attn.*", "*.ffn.shared_experts.*", "head", "mtp.*"]
# `mtp_experts_format` of an NVFP4 hybrid config: how the draft's experts (outside NVFP4) are stored.
_MTP_FORMAT_NAMES = {Format.FP8: "fp8_block", Format.MXFP4: "mxfp4", Format.BF16: "bf16"}


def _sglang_block(block: str, stored: StoredFormats) -> str:
    """SGLang's module prefix of a decoder block: the NextN draft builds mtp.0 as ``model.decoder``; the DSpark
    draft builds stage K as ``stages.K`` (models/deepseek_v4_dspark.py::DeepseekV4ForCausalLMDSpark.__init__)."""
    kind, index = block.split(".")
    if kind == "layers":
        return f"model.layers.{index}"
    if stored.dspark:
        return f"stages.{index}"
    if index != "0":
        # models/deepseek_v4.py::load_weights asserts a single nextn layer.
        raise RecipeError(f"{SGLANG_LABEL} serves one MTP block (mtp.0), not {block}", tensor=block)
    return "model.decoder"


def _sglang_linear_names(module: str, stored: StoredFormats) -> list[str]:
    """The SGLang prefixes of one config-quantized linear (both halves' fused name included)."""
    info = classify(module + ".weight")
    local = module[len(info.block) + 1:]
    if info.role is Role.MTP_PROJECTION:
        # The NextN draft builds e_proj/h_proj beside its decoder (DeepseekV4ModelNextN.__init__); DSpark's stage 0
        # holds main_proj (DSparkV4StageMixin.__init__).
        return [f"{_sglang_block(info.block, stored)}.{local}" if stored.dspark else f"model.{local}"]
    base = _sglang_block(info.block, stored)
    names = [f"{base}.{_SGLANG_SUFFIX[local]}"]
    for first, (second, fused) in FUSED_PAIRS.items():
        if local in (first, second):
            names.append(f"{base}.{_SGLANG_SUFFIX[first].rsplit('.', 1)[0]}.{fused}")
    return names


def _fp8_base(stored: StoredFormats) -> dict:
    """The native checkpoint's FP8 block config (Fp8Config.from_config), in the release's blocks."""
    base = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
            "weight_block_size": list(stored.fp8_block)}
    # scale_fmt "ue8m0" tells Fp8LinearMethod the block scales are powers of two (UE8M0 activation
    # scales, the MXFP8 view in fp8_utils.can_serve_block_fp8_as_mxfp8); F32 scales need not be.
    if stored.fp8_scale_dtypes <= {"F8_E8M0"}:
        base["scale_fmt"] = "ue8m0"
    return base


def _fp8_ignored_layers(stored: StoredFormats) -> list[str]:
    """SGLang names Fp8Config must skip: BF16 config linears and BF16 FusedMoEs.

    Fp8Config reads ``ignored_layers`` (not ``ignore``) and matches them on dotted paths in
    ``quantization/utils.py::is_layer_skipped``. ``wo_a`` is left out: it is built unquantized
    unless the FP8 wo_a GEMM is on, and then it must be FP8 whatever the list says (see
    :func:`serving_env`).
    """
    names: list[str] = []
    for module, fmt in stored.config_linears.items():
        if fmt is Format.BF16 and not module.endswith(".attn.wo_a"):
            names += [n for n in _sglang_linear_names(module, stored) if n not in names]
    names += [f"{_sglang_block(b, stored)}.mlp.experts" for b, f in stored.experts.items() if f is Format.BF16]
    return names


def _check_fp8_family(stored: StoredFormats) -> None:
    quantized = stored.expert_formats() - {Format.BF16}
    if len(quantized) > 1:
        # Fp8Config.get_quant_method picks MXFP4 or FP8 MoE methods from one model-wide is_fp4_experts.
        raise RecipeError(f"routed experts mix FP8 and MXFP4; {SGLANG_LABEL} reads all quantized experts of a model "
                          "as one or the other (is_fp4_experts)", tensor=_first_expert(stored, Format.MXFP4))


def _first_expert(stored: StoredFormats, fmt: Format, *, mtp: bool | None = None) -> str:
    return next(m for m, (f, _) in stored.formats.items()
                if f is fmt and ".ffn.experts." in m and (mtp is None or m.startswith("mtp.") == mtp))


def _nvfp4_fallback(stored: StoredFormats) -> set[Format]:
    """Formats of the FusedMoEs the NVFP4 hybrid excludes (MTP, and backbone layers not NVFP4)."""
    mtp_nvfp4 = Format.NVFP4 in stored.expert_formats(mtp=True)
    if mtp_nvfp4:
        raise RecipeError(f"{SGLANG_LABEL}'s NVFP4 hybrid always excludes the MTP draft (model.decoder.*) from NVFP4 "
                          "and loads its experts as FP8-block or MXFP4; store the MTP experts FP8 (every GPU) or keep "
                          "them MXFP4 (sm_100 only)", tensor=_first_expert(stored, Format.NVFP4, mtp=True))
    fallback = {f for f in stored.experts.values() if f is not Format.NVFP4}
    # HybridFp8NvFp4Config.get_quant_method: an excluded FusedMoE is MXFP4 when is_fp4_experts,
    # else the Fp8Config dispatch (FP8, or unquantized when ignored_layers lists it).
    if Format.MXFP4 in fallback and len(fallback) > 1:
        other = next(f for f in fallback if f is not Format.MXFP4)
        raise RecipeError(f"NVFP4 hybrid: experts outside NVFP4 must be all MXFP4 or FP8/BF16, found MXFP4 and "
                          f"{other.value}", tensor=_first_expert(stored, other))
    return fallback


def _nvfp4_config(stored: StoredFormats) -> tuple[dict, dict]:
    nvfp4_blocks = [b for b, f in stored.experts.items() if f is Format.NVFP4]
    excluded = [b for b, f in stored.experts.items() if f is not Format.NVFP4 and b.startswith("layers.")]
    # ModelOptFp4Config.is_layer_excluded fullmatches the FusedMoE prefix (SGLang name); the
    # native `layers.N.ffn.experts.*` form is for engines that read native names.
    ignore = list(_NVFP4_NATIVE_EXCLUDES)
    for block in excluded:
        ignore += [f"{block}.ffn.experts.*", f"{_sglang_block(block, stored)}.mlp.experts"]
    layers = {f"{b}.ffn.experts": {"quant_algo": "NVFP4", "group_size": NVFP4_BLOCK} for b in nvfp4_blocks}
    producer = {"name": "dsv4convert", "version": __version__}
    fp4_args = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": NVFP4_BLOCK}
    config = _fp8_base(stored)
    ignored_layers = _fp8_ignored_layers(stored)
    if ignored_layers:
        config["ignored_layers"] = ignored_layers
    mtp_formats = stored.expert_formats(mtp=True)
    if mtp_formats:
        config["mtp_experts_format"] = _MTP_FORMAT_NAMES[next(iter(mtp_formats))]
    # configs/model_config.py: nvfp4_moe_meta needs quant_algo MIXED_PRECISION, moe_quant_algo
    # NVFP4 and a group_size in config.json itself; exclude_modules = `ignore`.
    config.update({
        "quant_algo": "MIXED_PRECISION",
        "moe_quant_algo": "NVFP4",
        "group_size": NVFP4_BLOCK,
        "kv_cache_quant_algo": None,
        "producer": producer,
        "quantized_layers": layers,
        "ignore": ignore,
        "exclude_modules": list(ignore),
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": dict(fp4_args),
                                      "input_activations": dict(fp4_args)}},
    })
    # The nested form other engines read (and SGLang's own hf_quant_config.json fallback).
    hf_quant = {"producer": producer, "quantization": {
        "quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": None, "group_size": NVFP4_BLOCK,
        "quantized_layers": layers, "exclude_modules": list(ignore)}}
    return config, {HF_QUANT_CONFIG: hf_quant}


def _int4_config(stored: StoredFormats) -> dict:
    others = stored.expert_formats() - {Format.INT4, Format.BF16}
    if others:
        fmt = next(iter(others))
        raise RecipeError(f"INT4 experts are described by a compressed-tensors config, which cannot also hold "
                          f"{fmt.value} experts in {SGLANG_LABEL}", tensor=_first_expert(stored, fmt))
    if len(stored.int4_groups) > 1:
        raise RecipeError(f"INT4 experts use group sizes {sorted(stored.int4_groups)}; one compressed-tensors "
                          f"config group holds one", tensor=_first_expert(stored, Format.INT4))
    # wo_a is dequantized to BF16 at load under a non-Fp8Config (models/deepseek_v4.py::
    # wo_a_fp8_gemm_enabled is False), so either stored form works for it.
    strict = {f for m, f in stored.config_linears.items() if not m.endswith(".attn.wo_a")}
    if len(strict) > 1:
        module = next(m for m, f in stored.config_linears.items() if f is Format.BF16 and not m.endswith(".attn.wo_a"))
        raise RecipeError("with INT4 experts SGLang makes every linear FP8 (linear_fp8_config) or none; this one "
                          "is BF16 while others are FP8", tensor=module)
    group = next(iter(stored.int4_groups))
    ignore = list(_CT_NON_EXPERT_IGNORE) + (_CT_DSPARK_IGNORE if stored.dspark else [])
    ignore += [f"re:^{re.escape(_sglang_block(b, stored))}\\.mlp\\.experts\\."
               for b, f in stored.experts.items() if f is Format.BF16]
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": group,
               "dynamic": False, "actorder": None, "block_structure": None, "observer": "minmax"}
    config = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                      "output_activations": None, "format": "pack-quantized"}},
        "ignore": ignore,
        "kv_cache_scheme": None,
    }
    if Format.FP8 in strict:
        # CompressedTensorsConfig.from_config reads quant_method, activation_scheme,
        # ignored_layers and weight_block_size of this block; the rest documents the data.
        config["linear_fp8_config"] = _fp8_base(stored)
    return config


def _routed_experts_all(stored: StoredFormats, fmt: Format) -> bool:
    return bool(stored.experts) and stored.expert_formats() == {fmt}


def _check_wo_a(stored: StoredFormats) -> None:
    """Every ``wo_a`` (the MTP block's included) in one format.

    Unless the FP8 wo_a GEMM is on, ``models/deepseek_v4.py::DeepseekV4ForCausalLM.load_weights`` streams the
    whole checkpoint (target and draft alike) through ``_dequant_fp8_wo_a_streaming``, which asserts
    ``"<wo_a>.scale is missing"`` for a BF16 wo_a once it has seen any wo_a scale; with the GEMM on, an FP8
    parameter cannot take a BF16 wo_a. So SGLang loads wo_a all FP8 or all BF16.
    """
    formats = {m: f for m, f in stored.config_linears.items() if m.endswith(".attn.wo_a")}
    if len(set(formats.values())) > 1:
        module = next(m for m, f in formats.items() if f is Format.BF16)
        raise RecipeError(f"{SGLANG_LABEL} loads wo_a all FP8 or all BF16 (MTP block included): its "
                          "_dequant_fp8_wo_a_streaming asserts every wo_a has a scale once one has; this one is BF16 "
                          "while others are FP8", tensor=module)


def check(stored: StoredFormats) -> None:
    """SGLang 0.5.23's rules for the expert config family (each raises naming a module)."""
    _check_wo_a(stored)
    experts = stored.expert_formats()
    if Format.INT4 in experts:
        _int4_config(stored)
    elif Format.NVFP4 in experts:
        _nvfp4_fallback(stored)
    elif not stored.everything_bf16:
        _check_fp8_family(stored)


def quant_config(source_config: dict, stored: StoredFormats, *, sglang: bool = True
                         ) -> tuple[dict, dict[str, dict]]:
    """SGLang's config for what is stored; ``sglang`` False (an output for vLLM alone): SGLang's refusals
    (already run by ``check_engines`` where SGLang is asked for) are not applied."""
    config = copy.deepcopy(source_config)
    config.pop("quantization_config", None)
    config.pop("compression_config", None)
    if _routed_experts_all(stored, Format.MXFP4):
        config["expert_dtype"] = "fp4"
    else:
        config.pop("expert_dtype", None)
    extra: dict[str, dict] = {}
    experts = stored.expert_formats()
    if stored.everything_bf16:
        return config, extra
    if Format.INT4 in experts:
        config["quantization_config"] = _int4_config(stored)
        return config, extra
    if Format.NVFP4 in experts:
        if sglang:
            _nvfp4_fallback(stored)
        config["quantization_config"], extra = _nvfp4_config(stored)
        fp4 = Format.MXFP4 in experts
    else:
        if sglang:
            _check_fp8_family(stored)
        quant = _fp8_base(stored)
        ignored_layers = _fp8_ignored_layers(stored)
        if ignored_layers:
            quant["ignored_layers"] = ignored_layers
        config["quantization_config"] = quant
        fp4 = Format.MXFP4 in experts
    if len(stored.expert_formats(mtp=False)) > 1:
        _state_expert_layout(config, fp4)
    return config, extra


# transformers' DeepseekV3Config default, which SGLang's V4 config class inherits
# (srt/utils/hf_transformers/common.py::_DeepseekV4ConfigAlias) when config.json has no n_group.
_V3_DEFAULT_N_GROUP = 8


def _state_expert_layout(config: dict, fp4: bool) -> None:
    """A mixed checkpoint says what its quantized routed experts are instead of leaving it to a probe.

    ``configs/model_config.py::ModelConfig.__init__`` takes ``is_fp4_experts`` from
    ``quantization_config.routed_experts_quant_method`` (True only for "mxfp4"); without the key it takes
    ``SGLANG_DSV4_FP4_EXPERTS`` and, when that is unset, ``configs/deepseek_v4.py::try_detect_fp4_experts``,
    which reads the dtype of the first routed expert in the index only: in a mixed checkpoint that is
    whatever layer 0 holds (BF16: undecided, so True; NVFP4: True), and the other layers would be built
    for the wrong format. Any value of the key also skips the rest of that V4 block, which forces
    ``hf_config.topk_group = n_group``: the config class (``utils/hf_transformers/common.py::
    _DeepseekV4ConfigAlias``, transformers' DeepseekV3Config) defaults to topk_group 4 and n_group 8.
    V4's TopK is built ungrouped (``models/deepseek_v2.py``), but its TopKConfig keeps both and the
    DeepEP and TRT-LLM routing paths are handed them; so ``topk_group`` is written here with the value
    that line would set, and SGLang ends with the same config either way (checked with its
    ModelConfig: tests/test_mixed_layouts.py). The block's handling of the ``SGLANG_DSV4_FP4_DEQUANT``
    opt-in (not used by any launch here) is skipped too. vLLM 0.33.0's V4 code reads neither key;
    transformers' DeepseekV4Config keeps ``topk_group`` as an extra attribute.
    """
    config["quantization_config"]["routed_experts_quant_method"] = "mxfp4" if fp4 else "fp8"
    config["topk_group"] = sglang_topk_group(config)


def sglang_topk_group(config: dict) -> int:
    """The ``topk_group`` SGLang 0.5.23's V4 fix sets (``n_group``, the V3 template's 8 when the config has none)."""
    return config.get("n_group", _V3_DEFAULT_N_GROUP)


def serving_env(source_config: dict, module_formats: dict[str, tuple[Format, dict]]) -> dict[str, str]:
    """Environment SGLang 0.5.23 needs to serve these stored formats.

    ``SGLANG_DSV4_FP4_EXPERTS`` decides ``is_fp4_experts`` (``ModelConfig.__init__``) whenever it
    is set; unset, a header probe of the first expert tensor decides, which fails for a Hub id
    not yet downloaded and for INT4/BF16 experts. It is always stated: "1" only when the
    quantized experts outside NVFP4 are MXFP4. ``SGLANG_OPT_FP8_WO_A_GEMM=0`` when ``wo_a`` is
    BF16 under an Fp8Config, because that GEMM (on by default on SM100) requires an FP8 wo_a
    (``DeepseekV4ForCausalLM.load_weights``).
    """
    stored = analyse(source_config, module_formats)
    experts = stored.expert_formats()
    if Format.INT4 in experts or stored.everything_bf16:
        return {"SGLANG_DSV4_FP4_EXPERTS": "0"}
    if Format.NVFP4 in experts:
        fp4 = Format.MXFP4 in _nvfp4_fallback(stored)
    else:
        _check_fp8_family(stored)
        fp4 = Format.MXFP4 in experts
    env = {"SGLANG_DSV4_FP4_EXPERTS": "1" if fp4 else "0"}
    if stored.wo_a_bf16:
        env["SGLANG_OPT_FP8_WO_A_GEMM"] = "0"
    return env


# ------------------------------------------------------------------------------------------ DeepSeek-V4.1

# What each DeepSeek-V4.1 variant's quantization_config is, as SGLang reads it (the release keeps its own: FP8 32x32
# linears with E8M0 scales, MXFP4 experts, expert_dtype fp4).
V41_NVFP4_IGNORE = ["*.attn.*", "*.ffn.shared_experts.*", "head", "mtp.*"]   # NVIDIA's DeepSeek-V4.1-Flash-NVFP4


# SGLang's names (remap_weight_name_to_dpsk_hf_format; DSpark: _remap_dspark_weight_name) of what a W4A16 V4.1 keeps.
V41_CT_IGNORE = [r"re:.*\.self_attn\..*", r"re:.*\.mlp\.shared_experts\..*", r"re:.*\.mlp\.gate$",
                 r"re:.*\.engram\..*", r"re:^stages\..*", r"re:^vision\..*", r"re:^aligner\..*", "lm_head"]


def v41_quant_config(source: dict, variant: str, group_size: int = 32) -> dict | None:
    """The ``quantization_config`` of a V4.1 output (None: none at all), from the release's own ``source``.

    * ``nvfp4``: ModelOpt's hybrid as NVIDIA published it for V4.1: the release's Fp8Config (``weight_block_size``
      [32, 32], ``scale_fmt`` ue8m0) plus ``quant_algo`` MIXED_PRECISION, ``moe_quant_algo`` NVFP4 and
      ``group_size`` 16, which ``configs/model_config.py::ModelConfig.__init__`` turns into ``nvfp4_moe_meta`` and
      ``model_loader/loader.py::_get_quantization_config`` into ``HybridFp8NvFp4Config``, its ``ignore`` plus
      ``model.decoder.*`` and ``stages.*`` excluded from NVFP4: the DSpark stages' experts stay MXFP4
      (``HybridFp8NvFp4Config.get_quant_method``: ``Mxfp4FlashinferTrtllmMoEMethod`` while ``is_fp4_experts``,
      which ``configs/deepseek_v4.py::try_detect_fp4_experts`` reads off the NVFP4 experts' U8 header).
    * ``fp8``: the release's Fp8Config with ``expert_dtype`` fp8 (SGLang reads the experts' F8_E4M3 header:
      ``try_detect_fp4_experts`` False, ``Fp8MoEMethod``); vLLM reads ``expert_dtype``.
    * ``bf16``: none (every linear BF16; the Engram tables stay FP8, which both engines build whatever the config).
    * ``w4a16``: ``CompressedTensorsConfig`` (pack-quantized INT4 experts, one group targeting ``Linear``) with the
      release's FP8 block config as ``linear_fp8_config`` (every other LinearBase ``Fp8LinearMethod``, 32x32), and
      ``ignore`` naming what stays unquantized in SGLang's names: attention (the indexer's ``wq_b`` included), shared
      experts, the router, the Engram ``wkv``, the vision tower and aligner, the LM head, and the DSpark stages
      (``stages.*``: the draft is built with this config, its ignored FusedMoE BF16:
      ``CompressedTensorsConfig.get_quant_method``).
    """
    base = {k: v for k, v in source.items() if k != "expert_dtype"}
    if variant == "native":
        return copy.deepcopy(source)
    if variant == "bf16":
        return None
    if variant == "fp8":
        return {**copy.deepcopy(base), "expert_dtype": "fp8"}
    if variant == "nvfp4":
        return {**copy.deepcopy(base), "expert_dtype": source.get("expert_dtype", "fp4"),
                "quant_algo": "MIXED_PRECISION", "moe_quant_algo": "NVFP4", "group_size": NVFP4_BLOCK,
                "kv_cache_quant_algo": None, "ignore": list(V41_NVFP4_IGNORE)}
    if variant == "w4a16":
        linear = {k: source[k] for k in ("activation_scheme", "weight_block_size", "scale_fmt") if k in source}
        weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": group_size,
                   "dynamic": False, "actorder": None, "block_structure": None, "observer": "minmax"}
        return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                              "output_activations": None, "format": "pack-quantized"}},
                "ignore": list(V41_CT_IGNORE), "kv_cache_scheme": None,
                "linear_fp8_config": {**linear, "fmt": "e4m3", "quant_method": "fp8"}}
    raise RecipeError(f"no {SGLANG_LABEL} quantization_config for a DeepSeek-V4.1 {variant!r} output")


def v41_serving_env(variant: str) -> dict[str, str]:
    """Environment SGLang 0.5.23 needs to serve a V4.1 ``variant``: ``SGLANG_DSV4_FP4_EXPERTS`` stated, as for V4
    (:func:`serving_env`). Unset, ``configs/model_config.py::ModelConfig.__init__`` asks
    ``configs/deepseek_v4.py::try_detect_fp4_experts``, which reads the first ``experts.N.wK.weight`` header: a W4A16
    output's is a DSpark stage's BF16 expert (the backbone's are ``weight_packed``), a BF16 output's BF16, neither
    U8/I8/F4 nor F8_E4M3, so it answers None and ``is_fp4_experts`` falls back to the variable's default, True; then
    ``arg_groups/model_overrides/deepseek_v4.py::_deepseek_v4_overrides`` gives those BF16 and INT4 experts the
    ``flashinfer_mxfp4`` MoE runner. "0" for FP8, BF16 and W4A16 experts (the runner stays ``auto``: Triton or
    DeepGEMM for FP8 and BF16, ``CompressedTensorsWNA16MoE``'s Marlin kernels for INT4); "1" for the release's MXFP4
    experts and ModelOpt's hybrid, whose MXFP4 DSpark experts need it (``HybridFp8NvFp4Config.get_quant_method``); its
    NVFP4 experts get ``flashinfer_trtllm_routed`` from ``nvfp4_moe_meta`` whatever the variable says."""
    return {"SGLANG_DSV4_FP4_EXPERTS": "1" if variant in ("native", "nvfp4") else "0"}


def v41_family_problem(variant: str, family: str) -> str | None:
    """Why SGLang would not run a V4.1 ``variant`` on ``family`` (None: it picks kernels for it there).

    ModelOpt's NVFP4 hybrid takes the ``flashinfer_trtllm_routed`` MoE runner, an SM100 kernel
    (``arg_groups/model_overrides/deepseek_v4.py::_deepseek_v4_overrides``), and its MXFP4 draft experts
    ``Mxfp4FlashinferTrtllmMoEMethod``, SM100 too; the release, FP8, W4A16 and BF16 run on sm_90, sm_100 and sm_120
    (fp4 experts on ``flashinfer_mxfp4``, INT4 ones on ``CompressedTensorsWNA16MoE``'s Marlin kernels, FP8 32x32
    linears on DeepGEMM, FlashInfer's CuTe DSL or Triton: ``layers/quantization/fp8_utils.py::
    dispatch_w8a8_block_fp8_linear``)."""
    if variant == "nvfp4" and family != "sm100":
        return (f"ModelOpt's NVFP4 hybrid runs on {SGLANG_LABEL}'s flashinfer_trtllm_routed MoE runner, an SM100 "
                "kernel (arg_groups/model_overrides/deepseek_v4.py::_deepseek_v4_overrides)")
    return None


def v41_problem(quant_config: dict | None, variant: str) -> str | None:
    """Why SGLang would not read a V4.1 output's ``quantization_config`` as the ``variant`` it stores (None: it does):
    BF16 without one; otherwise ``Fp8Config`` (``quant_method`` fp8) in 32x32 blocks, made ``HybridFp8NvFp4Config``
    exactly when ``quant_algo`` is MIXED_PRECISION, ``moe_quant_algo`` NVFP4 and ``group_size`` is given
    (``configs/model_config.py::ModelConfig.__init__``'s ``nvfp4_moe_meta``), with ``group_size`` 16
    (``ModelOptFp4Config``: NVFP4's blocks)."""
    if variant == "bf16":
        return None if quant_config is None else "a BF16 output must carry no quantization_config"
    if variant == "w4a16":
        given = quant_config or {}
        linear = given.get("linear_fp8_config") or {}
        if given.get("quant_method") != "compressed-tensors" or linear.get("weight_block_size") != [32, 32]:
            return (f"{SGLANG_LABEL} reads INT4 experts through CompressedTensorsConfig, V4.1's FP8 linears through "
                    "its linear_fp8_config in 32x32 blocks")
        return None
    if quant_config is None or quant_config.get("quant_method") != "fp8":
        return f"{SGLANG_LABEL} reads DeepSeek-V4.1's FP8 linears through Fp8Config (quant_method fp8)"
    if quant_config.get("weight_block_size") != [32, 32]:
        return "DeepSeek-V4.1's FP8 linears are 32x32 blocks (quantization_config.weight_block_size)"
    hybrid = (str(quant_config.get("quant_algo", "")).upper() == "MIXED_PRECISION"
              and str(quant_config.get("moe_quant_algo", "")).upper() == "NVFP4"
              and quant_config.get("group_size") is not None)
    if hybrid != (variant == "nvfp4"):
        return ("NVFP4 experts are read only through HybridFp8NvFp4Config (quant_algo MIXED_PRECISION, moe_quant_algo "
                "NVFP4, group_size: configs/model_config.py nvfp4_moe_meta)")
    if hybrid and quant_config.get("group_size") != NVFP4_BLOCK:
        return f"NVFP4 experts are groups of {NVFP4_BLOCK} (quantization_config.group_size)"
    return None
