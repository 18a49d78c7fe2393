"""What ``automix`` may offer on DeepSeek-V4.1, per engine and GPU family, from the engines' code.

Two questions, answered separately:

1. **Which uniform layouts each engine runs** (the menu): the release as shipped (``native``) and every variant
   ``convert`` writes (``engines/outputs_v41.py::VARIANTS``), each admitted where the engine reads its
   ``quantization_config`` as that variant (``engines/{sglang,vllm}/quant_config.py::v41_problem``, proven with
   both engines' real loaders on CPU by tests/test_v41_convert.py) and runs it on the GPU family
   (``engines/config.py::v41_families``). Nothing new is decided here: this module only intersects those verdicts.

2. **Whether a per-layer mix could be offered.** The engines' V4.1 quant configs do take per-layer formats:

   * SGLang 0.5.23 builds V4.1 with ``layers/quantization/fp8.py::Fp8Config.get_quant_method`` (a FusedMoE or
     linear in ``ignored_layers`` is ``UnquantizedFusedMoEMethod`` / ``UnquantizedLinearMethod``: BF16 per layer
     beside the model-wide expert format) and, for ModelOpt's hybrid,
     ``layers/quantization/modelopt_quant.py::HybridFp8NvFp4Config.get_quant_method`` (a FusedMoE its ``ignore``
     excludes is ``Mxfp4FlashinferTrtllmMoEMethod`` while ``is_fp4_experts``: NVFP4 or MXFP4 per layer).
   * vLLM 0.33.0 builds V4.1 with ``models/deepseek_v41/quant_config.py::DeepseekV4FP8Config.get_quant_method``
     (``ignored_layers``: BF16 per layer; ``_is_nvfp4_expert_layer``: NVFP4 unless ``ignore`` names
     ``layers.N.ffn.experts``, then ``Mxfp4MoEMethod``).

   automix still offers no mix on V4.1, for two reasons it prints (:data:`NO_MIX`):

   * ``convert/v41.py::_shipped_variant`` converts V4.1 by the shipped recipes as shipped and refuses any other
     recipe, so no mixed V4.1 checkpoint can be written, and none has been loaded by an engine's real loader
     (tests/test_v41_convert.py loads the uniform variants only). A mixed layout is refused by name
     (:func:`refuse_mixed`).
   * There is nothing to trade from the release. Every per-layer alternative those configs take for a layer's
     routed experts (BF16, FP8 in 32x32 blocks, NVFP4 with the codes kept) is at least the release's MXFP4 bytes
     and equal to it in weights; INT4 (W4A16) is lossy *and* larger (BF16 group scales, the DSpark experts BF16).
     The linears are the release's FP8 32x32 or BF16 (larger, equal in weights). What a BF16 or FP8 layer changes
     at serving, its activations quantized otherwise or not at all, ``compare/v41.py`` measures for the uniform
     layouts (``compare/emulate_v41.py``), so automix ranks those by it; a per-layer mix of them falls under the
     first reason (unwritten, unloaded). Under a budget below the release, nothing the engines load is smaller.
"""

from __future__ import annotations

from dataclasses import dataclass

from dsv4convert.engines import GPU_FAMILIES, LABELS, SGLANG, VLLM, engines_for
from dsv4convert.engines.config import v41_families
from dsv4convert.engines.outputs_v41 import NATIVE, VARIANTS
from dsv4convert.engines.sglang.quant_config import v41_problem as sglang_v41_problem
from dsv4convert.engines.sglang.quant_config import v41_quant_config
from dsv4convert.engines.vllm.quant_config import v41_problem as vllm_v41_problem
from dsv4convert.errors import DSV4Error

UNIFORM = (NATIVE, *VARIANTS)          # the uniform V4.1 layouts automix measures: the release, then convert's

# Per engine: what its V4.1 quant config takes per layer (file::function, relative to the pinned wheels).
PER_LAYER = {
    SGLANG: ("layers/quantization/fp8.py::Fp8Config.get_quant_method (ignored_layers: BF16 experts or linears per "
             "layer) and layers/quantization/modelopt_quant.py::HybridFp8NvFp4Config.get_quant_method (ignore: "
             "MXFP4 experts per layer beside NVFP4, is_fp4_experts)"),
    VLLM: ("models/deepseek_v41/quant_config.py::DeepseekV4FP8Config.get_quant_method (ignored_layers: BF16 per "
           "layer; _is_nvfp4_expert_layer: NVFP4 unless ignore names layers.N.ffn.experts, then Mxfp4MoEMethod)"),
}

NO_MIX = ("no per-layer mix is offered on DeepSeek-V4.1: {per_layer} take per-layer formats, but convert/v41.py::"
          "_shipped_variant writes the shipped uniform variants only (no mixed V4.1 checkpoint is written, none has "
          "been loaded by an engine's real loader), and every per-layer alternative to the release's MXFP4 experts "
          "those configs take is no smaller and, in weights, no closer to the release (BF16, FP8, NVFP4 exact; INT4 "
          "lossy and larger); what each layout's activation quantization changes at serving compare/v41.py "
          "measures for the uniform layouts: automix measures them and returns the least-KLD one within the budget")


# The release's quantization_config (FP8 32x32 linears with E8M0 scales, MXFP4 experts) where no source is given.
RELEASE_QUANT = {"quant_method": "fp8", "weight_block_size": [32, 32], "scale_fmt": "ue8m0", "fmt": "e4m3",
                 "activation_scheme": "dynamic", "expert_dtype": "fp4"}


@dataclass(frozen=True)
class V41Option:
    """One uniform V4.1 layout on the menu (``problem`` None) or left out (``problem``: why, naming the engine)."""

    variant: str
    problem: str | None = None


def engine_problem(engine: str, variant: str, gpu_family: str, source: dict | None = None) -> str | None:
    """Why ``engine`` would not load or run a V4.1 ``variant`` on ``gpu_family`` (None: it does): its reading of the
    ``quantization_config`` SGLang's rules write for it (``engines/sglang/quant_config.py::v41_quant_config``), then
    the family (``engines/config.py::v41_families``)."""
    if gpu_family not in GPU_FAMILIES:
        raise DSV4Error(f"unknown GPU family {gpu_family!r}; expected one of {', '.join(GPU_FAMILIES)}")
    qc = v41_quant_config(source or RELEASE_QUANT, variant)
    read = (sglang_v41_problem if engine == SGLANG else vllm_v41_problem)(qc, variant) if variant != NATIVE else None
    if read is not None:
        return read
    if variant == NATIVE:
        return None          # the release: both engines' own format on every family (flashinfer_mxfp4; Mxfp4MoEMethod)
    return v41_families(variant)[engine][gpu_family]


def v41_menu(engine: str, gpu_family: str, source: dict | None = None) -> list[V41Option]:
    """Every uniform V4.1 layout, in :data:`UNIFORM`'s order, on the menu for ``engine`` (sglang|vllm|both: every
    engine asked must load and run it) on ``gpu_family``, or left out with each refusing engine's reason."""
    out = []
    for variant in UNIFORM:
        problems = [p if LABELS[e] in p else f"{LABELS[e]}: {p}" for e in engines_for(engine) 
                    if (p := engine_problem(e, variant, gpu_family, source))]
        out.append(V41Option(variant, "; ".join(problems) or None))
    return out


def no_mix_reason(engine: str) -> str:
    return NO_MIX.format(per_layer=" and ".join(f"{LABELS[e]}'s {PER_LAYER[e]}" for e in engines_for(engine)))


def refuse_mixed(what: str, engine: str) -> DSV4Error:
    """The refusal of a mixed V4.1 layout named ``what`` (raised by the caller)."""
    return DSV4Error(f"{what}: a mixed DeepSeek-V4.1 layout: {no_mix_reason(engine)}")
