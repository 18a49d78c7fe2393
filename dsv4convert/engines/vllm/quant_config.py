"""What vLLM reads from a checkpoint's config, and what it could not load.

Each rule cites the vLLM file it follows (paths relative to ``vllm/`` of the pinned wheel,
:data:`dsv4convert.engines.VERSIONS`); SGLang's are in :mod:`dsv4convert.engines.sglang.quant_config`. On CUDA and ROCm, vLLM reads a DeepSeek-V4 ``quant_method: fp8`` config
through ``models/deepseek_v41/quant_config.py::DeepseekV4FP8Config`` (chosen in
``model_executor/layers/quantization/__init__.py::get_quantization_config``); compressed-tensors
configs through its own ``CompressedTensorsConfig``.

What differs from SGLang, as far as a converter is concerned (docs/engines.md has the full list):

* Module names: vLLM keeps the checkpoint's ``attn``/``ffn`` and builds MTP block ``i`` as
  ``model.layers.{num_hidden_layers + i}`` (``models/deepseek_v4/nvidia/mtp.py``); SGLang says
  ``self_attn``/``mlp``/``model.decoder``. Ignore lists name modules, so both spellings are written.
* The routed experts' format comes from the top-level ``expert_dtype`` (missing means ``"fp4"``,
  i.e. MXFP4), not from the shards (``DeepseekV4FP8Config.expert_dtype``).
* FP8 expert scales stored as E8M0 are reinterpreted as raw bytes before they are copied into
  ``Fp8MoEMethod``'s float32 scales (``nvidia/model.py::DeepseekV4Model.load_weights``), so FP8
  experts for vLLM carry F32 block scales.
* Experts outside NVFP4 in a ModelOpt hybrid (``ignore`` patterns, matched with ``fnmatch`` on
  native names ``layers.N.ffn.experts``/``mtp.K.ffn.experts``) are read as MXFP4, or BF16 when
  ``ignored_layers`` lists them (``DeepseekV4FP8Config.get_quant_method``).
* vLLM's compressed-tensors config has no ``linear_fp8_config`` (SGLang's key), and its FP8 block
  scheme registers ``weight_scale`` while V4's name mapper renames the native ``.scale`` to
  ``weight_scale_inv``: a compressed-tensors checkpoint's linears must be BF16 for vLLM.
"""

from __future__ import annotations

from dsv4convert.engines import VLLM_LABEL
from dsv4convert.engines.sglang.quant_config import HF_QUANT_CONFIG
from dsv4convert.engines.stored import StoredFormats
from dsv4convert.formats import Format
from dsv4convert.models.deepseek_v4.layout import Role, classify

_V = VLLM_LABEL
# models/deepseek_v4/nvidia/dspark.py::DSparkDeepseekV4Model.__init__ builds ``n_mtp_layers or 3`` stages, whatever
# dspark_target_layer_ids says (SGLang counts those): a drafter of another size must state it.
DSPARK_DEFAULT_STAGES = 3


# ---------------------------------------------------------------------------------- vLLM names

def vllm_block(block: str, num_hidden_layers: int) -> str:
    """vLLM's module prefix of a decoder block: MTP block ``mtp.K`` is ``model.layers.{L+K}``."""
    kind, index = block.split(".")
    if kind == "layers":
        return f"model.layers.{index}"
    return f"model.layers.{num_hidden_layers + int(index)}"


# Native linear (inside its block) -> the module prefix vLLM's quant config is asked about. Fused
# linears are asked per shard (quantization/utils/quant_utils.py::is_layer_skipped splits
# fused_wqa_wkv into wq_a/wkv and gate_up_proj into w1/w3 by packed_modules_mapping); the
# checkpoint's shared w2 is renamed down_proj by the weight mapper (nvidia/model.py).
_VLLM_LOCAL = {"ffn.shared_experts.w2": "ffn.shared_experts.down_proj"}


def vllm_linear_names(module: str, stored: StoredFormats) -> list[str]:
    """The prefixes vLLM's quant config is asked about for one linear. A DSpark drafter's head-stack modules drop
    the stage (``main_proj`` is ``model.main_proj``), and every stage's ``wkv`` has a second copy in the fused
    ``model.context_wkv_proj`` (models/deepseek_v4/nvidia/dspark.py::DSparkDeepseekV4Model.__init__,
    ``_remap_dspark_name``, ``_duplicate_context_wkv_weights``)."""
    info = classify(module + ".weight")
    local = module[len(info.block) + 1:]
    if stored.dspark and info.role is Role.MTP_PROJECTION:
        return [f"model.{local}"]
    names = [f"{vllm_block(info.block, stored.config.num_hidden_layers)}.{_VLLM_LOCAL.get(local, local)}"]
    if stored.dspark and info.is_mtp and local == "attn.wkv":
        names.append("model.context_wkv_proj")
    return names


# The DSpark Markov head under the names vLLM's V4 loader finds parameters for: its _remap_dspark_name keeps the
# release's markov_head.embed/head, which its model calls markov_w1/markov_w2 (a KeyError at load; V4.1's remap
# renames them, V4's does not). SGLang's _remap_dspark_weight_name accepts both names.
MARKOV_NAMES = {"markov_head.embed": "markov_head.markov_w1", "markov_head.head": "markov_head.markov_w2"}


def vllm_module_name(module: str) -> str:
    """The name a module's tensors must have in a checkpoint vLLM loads (the release's, but for the Markov head)."""
    block, _, local = module.partition(".markov_head.")
    return f"{block}.{MARKOV_NAMES['markov_head.' + local]}" if local else module


def vllm_experts_name(block: str, num_hidden_layers: int) -> str:
    """The RoutedExperts prefix ``DeepseekV4FP8Config.get_quant_method`` sees for a block."""
    return f"{vllm_block(block, num_hidden_layers)}.ffn.experts"


# compressed-tensors `ignore` entries in vLLM's names for every linear that is never INT4 here;
# vLLM matches `re:` entries with re.match on its module prefixes
# (quantization/compressed_tensors/utils.py::should_ignore_layer) and keeps them through its name
# mapper (CompressedTensorsConfig.apply_vllm_mapper leaves `re:` targets alone).
CT_VLLM_IGNORE = [
    r"re:.*\.attn\..*",
    r"re:.*\.ffn\.shared_experts\..*",
    r"re:.*\.ffn\.gate$",
    r"re:^model\.layers\.\d+\.(e_proj|h_proj)$",
]
# A DSpark drafter's head-stack linears (never INT4): main_proj, and the fused copy of the stages' wkv.
CT_VLLM_DSPARK_IGNORE = [r"re:^model\.(main_proj|context_wkv_proj)$"]


# ---------------------------------------------------------------------------------- vLLM rules

def _first(stored: StoredFormats, pred) -> str | None:
    return next((m for m, (f, p) in stored.formats.items() if pred(m, f, p)), None)


def _expert(module: str) -> bool:
    return ".ffn.experts." in module


def _dspark_problem(stored: StoredFormats) -> tuple[str, str] | None:
    """What of a DSpark drafter vLLM's DSpark model could not load (models/deepseek_v4/nvidia/dspark.py)."""
    d = stored.config.dspark
    if d.n_routed_experts != stored.config.n_routed_experts:
        return "mtp.0.ffn.gate", (f"{_V}'s V4 DSpark stages are built with the backbone's n_routed_experts "
                                  f"({stored.config.n_routed_experts}; dspark_n_routed_experts is read by its V4.1 "
                                  f"model only), not {d.n_routed_experts}")
    if not d.confidence_with_markov:
        return f"mtp.{d.stages - 1}.confidence_head.proj", (
            f"{_V}'s DSpark confidence head always reads hidden + Markov features (confidence_head_with_markov is "
            "not read): a hidden-only head does not load")
    wkv = {f for m, (f, _) in stored.formats.items() if m.startswith("mtp.") and m.endswith(".attn.wkv")}
    if len(wkv) > 1:
        first = _first(stored, lambda m, f, p: m.startswith("mtp.") and m.endswith(".attn.wkv"))
        return first, (f"{_V} fuses every DSpark stage's wkv into one context_wkv_proj: the stages' wkv must share "
                       "one format")
    return None


def vllm_problem(stored: StoredFormats) -> tuple[str, str] | None:
    """The first module vLLM 0.33.0 could not load as stored, and why; None if it loads all."""
    if stored.dspark and (problem := _dspark_problem(stored)):
        return problem
    experts = stored.expert_formats()
    if Format.INT4 in experts:
        fp8 = _first(stored, lambda m, f, p: f is Format.FP8 and not _expert(m))
        if fp8:
            return fp8, (f"{_V}'s compressed-tensors config has no linear_fp8_config (an SGLang key), and its "
                         "FP8 block scheme registers weight_scale while the V4 name mapper turns .scale into "
                         "weight_scale_inv; with INT4 experts store every linear BF16 for vLLM")
        return None
    if Format.NVFP4 in experts:
        mtp = _first(stored, lambda m, f, p: f is Format.NVFP4 and m.startswith("mtp."))
        if mtp:
            return mtp, (f"{_V} reads the MTP experts of an NVFP4 hybrid (ignore lists mtp.*) as MXFP4 "
                         "(Mxfp4MoEMethod) or, listed in ignored_layers, BF16; store them MXFP4 or BF16")
        other = _first(stored, lambda m, f, p: _expert(m) and f not in (Format.NVFP4, Format.MXFP4, Format.BF16))
        if other:
            return other, (f"{_V} reads experts outside NVFP4 as MXFP4 (expert_dtype fp4 is the only one its "
                           "NVFP4 path allows) or BF16; FP8-block experts here would load into MXFP4 "
                           "parameters; store them MXFP4 or BF16")
        return None
    quantized = experts - {Format.BF16}
    if len(quantized) > 1:
        other = _first(stored, lambda m, f, p: _expert(m) and f is Format.MXFP4)
        return other, (f"{_V} reads one expert_dtype for the whole model (DeepseekV4FP8Config.expert_dtype: fp8 or "
                       "fp4, i.e. MXFP4); routed experts may mix it only with BF16 (ignored_layers)")
    e8m0 = _first(stored, lambda m, f, p: f is Format.FP8 and _expert(m)
                  and p.get("fp8_scale_dtype", "F8_E8M0") == "F8_E8M0")
    if e8m0:
        return e8m0, (f"{_V} views E8M0 expert scales as raw bytes before copying them into Fp8MoEMethod's "
                      "float32 scales (2^0 would load as 127.0; nvidia/model.py DeepseekV4Model.load_weights); "
                      "store FP8 expert scales float32 (to-fp8 --scale-dtype float32)")
    return None


# ---------------------------------------------------------------------------- vLLM config keys

def vllm_ignored_layers(stored: StoredFormats, num_hidden_layers: int) -> list[str]:
    """vLLM names ``ignored_layers`` must list: BF16 config linears and BF16 FusedMoEs.

    ``Fp8Config.from_config`` reads ``ignored_layers`` (else ``modules_to_not_convert``), never
    ``ignore``, and ``is_layer_skipped`` matches them exactly (``quantization/fp8.py``).
    """
    names = [n for m, f in stored.config_linears.items() if f is Format.BF16 for n in vllm_linear_names(m, stored)]
    names += [vllm_experts_name(b, num_hidden_layers) for b, f in stored.experts.items() if f is Format.BF16]
    return names


def vllm_nvfp4_excludes(stored: StoredFormats) -> list[str]:
    """Native ``layers.N.ffn.experts`` names of backbone FusedMoEs outside NVFP4.

    ``DeepseekV4FP8Config._is_nvfp4_expert_layer`` fnmatches exactly this form against ``ignore``
    (``layers.N.ffn.experts.*`` does not match it); ``mtp.*`` already covers the MTP block.
    """
    return [f"{b}.ffn.experts" for b, f in stored.experts.items()
            if f is not Format.NVFP4 and b.startswith("layers.")]


def vllm_expert_dtype(stored: StoredFormats) -> str | None:
    """The top-level ``expert_dtype`` vLLM needs: "fp8" for FP8-block experts, else None (its "fp4")."""
    quantized = stored.expert_formats() - {Format.BF16}
    return "fp8" if quantized == {Format.FP8} else None


def ct_vllm_expert_ignore(stored: StoredFormats, num_hidden_layers: int) -> list[str]:
    """compressed-tensors ``ignore`` regexes, in vLLM's names, for BF16 expert blocks of an INT4 output.

    ``compressed_tensors_moe/compressed_tensors_moe.py::CompressedTensorsMoEMethod.get_moe_method`` asks
    about the unfused names ``<RoutedExperts prefix>.0.<w1|w3|w2>``, all under ``model.layers.N.ffn.experts.``,
    and ``should_ignore_layer`` applies ``re:`` entries with ``re.match``: a regex ending in ``experts$``
    matched none of them (the layer was built INT4 and failed to load), one ending in ``experts\\.`` matches.
    """
    return [f"re:^{vllm_experts_name(b, num_hidden_layers).replace('.', chr(92) + '.')}\\."
            for b, f in stored.experts.items() if f is Format.BF16]


def add_keys(config: dict, extra: dict[str, dict], stored: StoredFormats, num_layers: int) -> None:
    """What vLLM reads on top of SGLang's config: ``expert_dtype``, a DSpark drafter's stage count, and its
    module names in the ignore lists."""
    expert_dtype = vllm_expert_dtype(stored)
    if expert_dtype:
        config["expert_dtype"] = expert_dtype
    stages = stored.config.num_draft_blocks if stored.dspark else DSPARK_DEFAULT_STAGES
    if stages != DSPARK_DEFAULT_STAGES:
        config["n_mtp_layers"] = stages
    quant = config.get("quantization_config")
    if quant is None:
        return
    if quant["quant_method"] == "compressed-tensors":
        quant["ignore"] += (CT_VLLM_IGNORE + (CT_VLLM_DSPARK_IGNORE if stored.dspark else [])
                            + ct_vllm_expert_ignore(stored, num_layers))
        return
    ignored = vllm_ignored_layers(stored, num_layers)
    if ignored:
        quant["ignored_layers"] = quant.get("ignored_layers", []) + ignored
    if Format.NVFP4 in stored.expert_formats():
        excludes = vllm_nvfp4_excludes(stored)
        for key in ("ignore", "exclude_modules"):
            quant[key] = quant[key] + excludes
        extra[HF_QUANT_CONFIG]["quantization"]["exclude_modules"] += excludes


# ------------------------------------------------------------------------------------------ DeepSeek-V4.1

def v41_problem(quant_config: dict | None, variant: str) -> str | None:
    """Why vLLM would not read a V4.1 output's ``quantization_config`` as the ``variant`` it stores (None: it does).

    ``models/deepseek_v41/quant_config.py::DeepseekV4FP8Config.override_quantization_method`` claims ``quant_method``
    fp8 for ``model_type`` deepseek_v41; its ``get_quant_method`` serves 32x32 linears as MXFP8 while ``expert_dtype``
    is fp4 (``is_scale_e8m0``), and the routed experts as
    ``ModelOptNvFp4FusedMoE`` when ``moe_quant_algo`` is NVFP4, those its ``ignore`` matches (``mtp.*``: the DSpark
    stages) as MXFP4. Without a config every linear is unquantized. vLLM claims no compressed-tensors config for
    V4.1."""
    if variant == "bf16":
        return None if quant_config is None else "a BF16 output must carry no quantization_config"
    if variant == "w4a16":
        return (f"{_V} reads DeepSeek-V4.1 only through DeepseekV4FP8Config (models/deepseek_v41/quant_config.py); "
                "it claims no compressed-tensors config for V4.1")
    if variant == "fp8":
        # Observed, not derived: the real model built on CPU for each family raises in Fp8MoEMethod.__init__
        # (tests/test_v41_convert.py::test_vllm_refuses_fp8_experts_in_32x32_blocks).
        return (f"{_V} finds no FP8 MoE kernel for V4.1's experts in 32x32 blocks (quantization/fp8.py::"
                "Fp8MoEMethod.__init__ -> fused_moe/oracle/fp8.py::select_fp8_moe_backend: 'No FP8 MoE backend "
                "supports the deployment configuration', on sm_90, sm_100 and sm_120)")
    if quant_config is None or quant_config.get("quant_method") not in ("fp8", "deepseek_v4_fp8"):
        return (f"{_V} reads DeepSeek-V4.1 only through DeepseekV4FP8Config (quant_method fp8; "
                "models/deepseek_v41/quant_config.py::override_quantization_method)")
    if quant_config.get("weight_block_size") != [32, 32]:
        return f"{_V}'s V4.1 linears are 32x32 blocks (DeepseekV4FP8Config.get_quant_method)"
    wanted = {"native": "fp4", "nvfp4": "fp4"}[variant]
    if quant_config.get("expert_dtype", "fp4") != wanted:
        return f"expert_dtype must be {wanted!r} for {_V} (DeepseekV4FP8Config.expert_dtype)"
    if (variant == "nvfp4") != ((quant_config.get("moe_quant_algo") or "").upper() == "NVFP4"):
        return (f"moe_quant_algo NVFP4 is what makes {_V} read NVFP4 experts "
                "(DeepseekV4FP8Config._is_nvfp4_expert_layer)")
    return None


def v41_family_problem(variant: str, family: str) -> None:
    """vLLM runs every V4.1 variant on sm_90, sm_100 and sm_120: NVFP4 experts on the backend
    ``model_executor/layers/fused_moe/oracle/nvfp4.py::select_nvfp4_moe_backend`` picks (Marlin among them, for
    a GPU without FP4 tensor cores); nothing is refused by family."""
    return None
