"""Which per-layer formats a mixed checkpoint may hold, per ``--engine`` and GPU family, from the engines' code.

A *family* is one quantization config the engines read (one ``quantization_config``, one SGLang
environment and MoE runner): within it each backbone MoE layer's routed experts take one of
``Family.experts`` and each config-quantized linear (attention, indexer ``wq_b``, shared experts,
MTP projections) one of ``Family.linears``. Nothing finer can be served: every routed expert of a
layer is one FusedMoE with one quant method (SGLang ``srt/layers/moe/fused_moe_triton/layer.py::
FusedMoE.__init__``; both engines' compressed-tensors MoE paths take a layer's scheme from expert 0,
SGLang ``srt/layers/quantization/compressed_tensors/compressed_tensors.py::get_moe_scheme``, vLLM
``model_executor/layers/quantization/compressed_tensors/compressed_tensors_moe.py::get_moe_method``).

Paths are relative to the ``sglang`` package of the ``sglang==0.5.23`` wheel and to the ``vllm``
package of ``vllm==0.33.0`` (``convert/...``, ``serve/...``: this project's). A family is admitted
only where it loads *and* its methods run under the MoE runner its launch uses
(``serve/launch.py::variant_defaults`` of ``served_like``: Marlin for the NVFP4 hybrid on sm_90/sm_120,
SGLang's automatic ``flashinfer_trtllm_routed`` on sm_100, ...). What loading does is checked on CPU
by ``tests/test_mixed_layouts.py`` with both engines' real loaders, for every family below; which
kernel runs is read from code (the runner each method builds is checked there too), not run on a GPU.

Result (the experts' choices per backbone layer, main first, as ``Family.name`` joins them; L: the
linears' choices, per layer unless "model"; MTP: the draft's experts)::

    config family          engine     sm_90             sm_100            sm_120            L           MTP
    nvfp4 hybrid, FP8 alt  sglang     nvfp4+bf16        nvfp4+fp8         nvfp4+bf16        fp8|bf16 *  fp8
                           vllm       nvfp4+bf16        nvfp4+bf16        nvfp4+bf16        fp8|bf16    bf16
                           both       nvfp4+bf16        nvfp4             nvfp4+bf16        fp8|bf16 *  bf16
    nvfp4 hybrid, MXFP4    sglang     -                 nvfp4+mxfp4       -                 fp8|bf16 *  mxfp4
                           vllm       nvfp4+mxfp4+bf16  nvfp4+mxfp4+bf16  nvfp4+mxfp4+bf16  fp8|bf16    mxfp4
                           both       -                 nvfp4+mxfp4       -                 fp8|bf16 *  mxfp4
    fp8 (Fp8Config)        any        fp8+bf16          fp8+bf16          fp8+bf16          fp8|bf16 *  fp8
    mxfp4 (as released)    any        mxfp4+bf16        mxfp4+bf16        mxfp4+bf16        fp8|bf16 *  mxfp4
    int4 (compr.-tensors)  sglang     int4+bf16         int4+bf16         int4+bf16         fp8|bf16 model  int4
                           vllm, both int4+bf16         int4+bf16         int4+bf16         bf16        int4

    * SGLang: wo_a takes one format for the whole model (``Family.model_wide_linears``), see below.

A checkpoint whose backbone experts mix formats states ``routed_experts_quant_method`` in its config,
so SGLang does not guess ``is_fp4_experts`` from the first routed expert
(``convert/quant_config.py::_state_expert_layout``).

Why the gaps (SGLang; each :class:`Excluded` cites the code):

* FP8 layers beside NVFP4 on sm_90/sm_120: the launch pins ``--moe-runner-backend marlin`` for
  NVFP4, and ``Fp8MoEMethod.create_moe_runner`` builds no runner for Marlin (its ``apply`` then
  dereferences ``self.runner``). Under ``flashinfer_cutlass`` (sm_120's W4A4 NVFP4 runner) FP8 layers
  fall back to Triton and BF16 ones get FlashInfer's CUTLASS BF16 MoE with the SwiGLU limit, so a
  launch with that runner might serve NVFP4 + FP8 + BF16 on sm_120 (unchecked; not the launch today).
* BF16 layers beside NVFP4 on sm_100: under ``flashinfer_trtllm_routed`` the unquantized MoE runs
  ``trtllm_bf16_routed_moe``, which is passed no SwiGLU clamp, while V4 clamps at ``swiglu_limit``
  10 (the FP8 and NVFP4 TRT-LLM paths pass it): it would run, unclamped.
* The MXFP4 alternate: an excluded FusedMoE of a hybrid with ``is_fp4_experts`` is always
  ``Mxfp4FlashinferTrtllmMoEMethod`` (``ignored_layers`` cannot make it BF16), an SM100-only kernel.

vLLM reads one ``expert_dtype`` per model and ``ignored_layers`` per layer; an NVFP4 hybrid's
excluded layers are MXFP4 (``models/deepseek_v41/quant_config.py::DeepseekV4FP8Config.get_quant_method``),
so FP8 cannot be its alternate; its MoE kernel backend is chosen per layer
(``model_executor/layers/fused_moe/oracle/*.py``), so mixing adds no runner constraint. vLLM on
sm_120 is resolved, not built, in CI (its attention needs FlashInfer's SM120 DSV4 kernels).

Per-layer linears: SGLang and vLLM fuse ``wq_a`` + ``wkv`` and the shared experts' ``w1`` + ``w3``,
so each pair takes one format (``convert/quant_config.py::_analyse``). SGLang loads ``wo_a`` all FP8
or all BF16, the MTP block's included (``Family.model_wide_linears``): unless its FP8 ``wo_a`` GEMM is
on, ``models/deepseek_v4.py::DeepseekV4ForCausalLM.load_weights`` streams the checkpoint through
``_dequant_fp8_wo_a_streaming``, which asserts ``"<wo_a>.scale is missing"`` for a BF16 ``wo_a`` once
it has seen any ``wo_a`` scale (``quant_config._check_wo_a``); BF16 ``wo_a`` everywhere turns the FP8
``wo_a`` GEMM off (``SGLANG_OPT_FP8_WO_A_GEMM=0``, ``quant_config.serving_env``). vLLM builds ``wo_a``
as an ordinary quantized linear and takes it per layer.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from dsv4convert.convert.engines import ENGINE_VERSIONS, SGLANG, VLLM, engines_for
from dsv4convert.errors import DSV4Error
from dsv4convert.storage import Format

GPU_FAMILIES = ("sm90", "sm100", "sm120")
BF16, FP8, MXFP4, NVFP4, INT4 = Format.BF16, Format.FP8, Format.MXFP4, Format.NVFP4, Format.INT4


@dataclass(frozen=True)
class Family:
    """One quantization config and the per-layer choices it can describe on one engine and GPU family."""

    name: str                          # the admitted expert formats, e.g. "nvfp4+fp8"
    experts: tuple[Format, ...]        # choices for one backbone MoE layer's routed experts; experts[0]: the main
    linears: tuple[Format, ...]        # choices for the config-quantized linears: (FP8, BF16) or (BF16,)
    linears_per_layer: bool            # False: one choice for every linear of the model
    mtp_experts: Format | None         # how the MTP draft's routed experts are stored (None: kept, MXFP4)
    env_note: str                      # how it is served (runner, env), one line
    config: str = ""                   # the config family (CANDIDATES key), the same on every engine and GPU
    # Linears (local names in a block, e.g. "attn.wo_a") that take one format in every block, the MTP
    # block's included, even where the others may differ per layer (SGLang's wo_a).
    model_wide_linears: tuple[str, ...] = ()


@dataclass(frozen=True)
class Excluded:
    name: str
    reason: str                        # why this engine/GPU family cannot serve it, citing code


# Config families dsv4convert can write, each with every expert format it could describe at most.
CANDIDATES: dict[str, tuple[Format, ...]] = {
    "nvfp4-hybrid": (NVFP4, FP8, BF16),         # Fp8Config + ModelOpt hybrid fields, is_fp4_experts False
    "nvfp4-hybrid-mxfp4": (NVFP4, MXFP4, BF16),  # the same, is_fp4_experts True (SGLANG_DSV4_FP4_EXPERTS=1)
    "fp8": (FP8, BF16),                          # Fp8Config, FP8-block experts
    "mxfp4": (MXFP4, BF16),                      # Fp8Config, the release's MXFP4 experts
    "int4": (INT4, BF16),                        # compressed-tensors pack-quantized W4A16
}
_FP8_OR_BF16 = (FP8, BF16)


@dataclass(frozen=True)
class _Rule:
    """One engine's verdict on one config family on one GPU family."""

    experts: tuple[Format, ...]
    refused: dict[Format, str]
    linears: tuple[Format, ...]
    linears_per_layer: bool
    mtp: tuple[Format | None, ...]     # draft storages this engine loads and runs, preferred first
    env_note: str
    model_wide: tuple[str, ...] = ()   # linears one format for the whole model even when the others are per layer


def _full_name(key: str) -> str:
    return "+".join(f.value for f in CANDIDATES[key])


# ------------------------------------------------------------------------------------------- SGLang

# Cited reasons, shared across GPU families.
_SG_FP8_NO_MARLIN = (
    "the launch serves the NVFP4 hybrid with --moe-runner-backend marlin here (ModelOptNvFp4FusedMoEMethod's "
    "path below sm_100; serve/launch.py::variant_defaults), and srt/layers/quantization/fp8.py::"
    "Fp8MoEMethod.create_moe_runner builds no runner for marlin (only triton, deep_gemm, aiter, flashinfer_trtllm"
    "[_routed], hpc_ops, megamoe; flashinfer_cutlass/cutedsl fall back to triton), so Fp8MoEMethod.apply "
    "dereferences self.runner=None: FP8 layers would load and fail in the forward (the MTP draft's FP8 experts run "
    "only because --speculative-moe-runner-backend triton gives the draft its own runner)")
_SG_BF16_TRTLLM = (
    "the hybrid's automatic runner on sm_100 is flashinfer_trtllm_routed (srt/arg_groups/model_overrides/"
    "deepseek_v4.py), under which srt/layers/quantization/unquant.py::UnquantizedFusedMoEMethod.forward_cuda runs "
    "srt/layers/moe/moe_runner/flashinfer_trtllm.py::fused_experts_none_to_flashinfer_trtllm_bf16, whose "
    "trtllm_bf16_routed_moe call gets no SwiGLU clamp while V4 clamps at swiglu_limit 10 (the FP8 and NVFP4 TRT-LLM "
    "paths pass it): BF16 layers would run unclamped (wrong, silently)")
_SG_MXFP4_SM100 = (
    "srt/layers/quantization/modelopt_quant.py::HybridFp8NvFp4Config.get_quant_method gives every FusedMoE outside "
    "NVFP4 Mxfp4FlashinferTrtllmMoEMethod when is_fp4_experts, whose apply calls FlashInfer's "
    "trtllm_fp4_block_scale_(routed_)moe, an SM100 kernel (serve/launch.py _SM100_ONLY_METHODS)")
_SG_MXFP4_NO_BF16 = (
    "with is_fp4_experts srt/layers/quantization/modelopt_quant.py::HybridFp8NvFp4Config.get_quant_method returns "
    "Mxfp4FlashinferTrtllmMoEMethod for every FusedMoE outside NVFP4 before ignored_layers is consulted: no layer "
    "can be BF16")
_SG_HYBRID_MTP = (
    "srt/model_loader/loader.py::_get_quantization_config always excludes model.decoder.* from NVFP4")


def _sglang(key: str, gpu: str) -> _Rule | str:
    """SGLang 0.5.23 on ``gpu``: the choices of config family ``key`` that load and run, or why none do."""
    rule = _sglang_rule(key, gpu)
    # models/deepseek_v4.py::DeepseekV4ForCausalLM.load_weights streams every wo_a through
    # _dequant_fp8_wo_a_streaming (unless the FP8 wo_a GEMM is on, which needs them all FP8), which asserts
    # "<wo_a>.scale is missing" for a BF16 wo_a once any wo_a had a scale (convert/quant_config.py::_check_wo_a).
    return rule if isinstance(rule, str) else replace(rule, model_wide=("attn.wo_a",))


def _sglang_rule(key: str, gpu: str) -> _Rule | str:
    sm100 = gpu == "sm100"
    if key == "nvfp4-hybrid":
        # HybridFp8NvFp4Config.get_quant_method: not excluded -> ModelOptNvFp4FusedMoEMethod; excluded with
        # is_fp4_experts False -> the Fp8Config dispatch (fp8.py::Fp8Config.get_quant_method): Fp8MoEMethod, or
        # UnquantizedFusedMoEMethod where ignored_layers lists the layer.
        if sm100:
            return _Rule((NVFP4, FP8), {BF16: _SG_BF16_TRTLLM}, _FP8_OR_BF16, True, (FP8, BF16),
                         "SGLang: SGLANG_DSV4_FP4_EXPERTS=0, MoE runner auto = flashinfer_trtllm_routed (NVFP4 W4A4 and "
                         "FP8 layers on TRT-LLM), draft on Triton (--speculative-moe-runner-backend triton)")
        # Under marlin the unquantized method gets a Triton runner (unquant.py::create_moe_runner: neither
        # flashinfer_cutlass nor trtllm), which applies swiglu_limit (moe_runner/triton.py).
        return _Rule((NVFP4, BF16), {FP8: _SG_FP8_NO_MARLIN}, _FP8_OR_BF16, True, (FP8, BF16),
                     "SGLang: SGLANG_DSV4_FP4_EXPERTS=0, --moe-runner-backend marlin (NVFP4 W4A16 Marlin, BF16 layers on "
                     "Triton), draft on Triton (--speculative-moe-runner-backend triton)")
    if key == "nvfp4-hybrid-mxfp4":
        if not sm100:
            return f"{_SG_MXFP4_SM100}; without it this family is the FP8-alternate hybrid"
        # Mxfp4FlashinferTrtllmMoEMethod.create_moe_runner keeps no runner and applies the kernel itself
        # (srt/layers/quantization/mxfp4_flashinfer_trtllm_moe.py), with the swiglu_limit clamp.
        return _Rule((NVFP4, MXFP4), {BF16: _SG_MXFP4_NO_BF16}, _FP8_OR_BF16, True, (None,),
                     "SGLang: SGLANG_DSV4_FP4_EXPERTS=1, MoE runner auto = flashinfer_trtllm_routed for NVFP4, MXFP4 "
                     "layers and the draft on FlashInfer's TRT-LLM MXFP4 kernel (sm_100 only)")
    if key == "fp8":
        # fp8.py::Fp8MoEMethod.create_moe_runner: auto -> DeepGEMM or Triton; skipped layers ->
        # UnquantizedFusedMoEMethod on Triton (the runner flag stays auto).
        return _Rule((FP8, BF16), {}, _FP8_OR_BF16, True, (FP8, BF16),
                     "SGLang: SGLANG_DSV4_FP4_EXPERTS=0, MoE runner auto (FP8 on Triton or DeepGEMM, BF16 on Triton)")
    if key == "mxfp4":
        # fp8.py::Fp8Config.get_quant_method with is_fp4_experts: Mxfp4FlashinferCutlassMoEMethod (sm_90/sm_120
        # under flashinfer_mxfp4), Mxfp4FlashinferTrtllmMoEMethod (sm_100), Mxfp4MarlinMoEMethod (marlin, the
        # sm_120 launch); skipped layers: UnquantizedFusedMoEMethod, a Triton runner under either.
        runner = {"sm90": "auto = flashinfer_mxfp4 (CUTLASS)", "sm100": "auto = flashinfer_mxfp4 (TRT-LLM)",
                  "sm120": "--moe-runner-backend marlin"}[gpu]
        return _Rule((MXFP4, BF16), {}, _FP8_OR_BF16, True, (None, BF16),
                     f"SGLang: SGLANG_DSV4_FP4_EXPERTS=1, MoE runner {runner}, BF16 layers on Triton")
    if key == "int4":
        # compressed_tensors.py::CompressedTensorsConfig.get_quant_method: get_moe_scheme per layer (expert 0),
        # None where `ignore` matches -> UnquantizedFusedMoEMethod (Triton); linear_fp8_config gives every
        # LinearBase Fp8LinearMethod without an ignore check, so the linears are all FP8 or all BF16.
        wna16 = "Triton WNA16" if sm100 else "Marlin WNA16"
        return _Rule((INT4, BF16), {}, _FP8_OR_BF16, False, (INT4, BF16),
                     f"SGLang: SGLANG_DSV4_FP4_EXPERTS=0, MoE runner auto ({wna16}, BF16 layers on Triton); "
                     "linears all FP8 (linear_fp8_config) or all BF16")
    raise KeyError(key)


# -------------------------------------------------------------------------------------------- vLLM

_VL_FP8_ALT = (
    "models/deepseek_v41/quant_config.py::DeepseekV4FP8Config.get_quant_method reads a RoutedExperts outside NVFP4 "
    "(ignore, fnmatch in _is_nvfp4_expert_layer) as Mxfp4MoEMethod, or UnquantizedFusedMoEMethod where "
    "ignored_layers lists it: the NVFP4 path needs expert_dtype fp4, so FP8-block layers would load into MXFP4 "
    "parameters")
_VL_CT_LINEARS = (
    "vLLM's compressed-tensors config has no linear_fp8_config, and its FP8 block scheme registers weight_scale "
    "while models/deepseek_v4/nvidia/model.py::_make_deepseek_v4_weights_mapper renames .scale to weight_scale_inv "
    "(convert/engines.py::vllm_problem): the linears must be BF16")
_VL_NOTE = ("vLLM: vllm serve with the card's flags ({what}); the MoE kernel is chosen per layer "
            "(model_executor/layers/fused_moe/oracle/), sm_120 resolved only in CI")


def _vllm(key: str, gpu: str) -> _Rule | str:
    """vLLM 0.33.0 (the same on every GPU family: its quant methods do not depend on it)."""
    del gpu
    if key == "nvfp4-hybrid":
        # DeepseekV4FP8Config.get_quant_method: ignored_layers -> UnquantizedFusedMoEMethod, else (expert_dtype
        # fp4) ModelOptNvFp4FusedMoE unless `ignore` covers the layer, then Mxfp4MoEMethod.
        return _Rule((NVFP4, BF16), {FP8: _VL_FP8_ALT}, _FP8_OR_BF16, True, (BF16,),
                     _VL_NOTE.format(what="DeepseekV4FP8Config, expert_dtype fp4; BF16 layers and draft in "
                                          "ignored_layers"))
    if key == "nvfp4-hybrid-mxfp4":
        return _Rule((NVFP4, MXFP4, BF16), {}, _FP8_OR_BF16, True, (None, BF16),
                     _VL_NOTE.format(what="DeepseekV4FP8Config, expert_dtype fp4; MXFP4 layers in ignore, BF16 ones "
                                          "also in ignored_layers"))
    if key == "fp8":
        # expert_dtype fp8 -> Fp8Config.get_quant_method -> Fp8MoEMethod (float32 block scales: E8M0 ones are
        # copied as raw bytes, models/deepseek_v4/nvidia/model.py::DeepseekV4Model.load_weights).
        return _Rule((FP8, BF16), {}, _FP8_OR_BF16, True, (FP8, BF16),
                     _VL_NOTE.format(what="DeepseekV4FP8Config, expert_dtype fp8, F32 expert scales"))
    if key == "mxfp4":
        return _Rule((MXFP4, BF16), {}, _FP8_OR_BF16, True, (None, BF16),
                     _VL_NOTE.format(what="DeepseekV4FP8Config, expert_dtype fp4 (Mxfp4MoEMethod)"))
    if key == "int4":
        # compressed_tensors_moe.py::get_moe_method per layer; `ignore` (re.match on vLLM names,
        # compressed_tensors/utils.py::should_ignore_layer) -> UnquantizedFusedMoEMethod.
        return _Rule((INT4, BF16), {}, (BF16,), False, (INT4, BF16),
                     _VL_NOTE.format(what="CompressedTensorsConfig, BF16 linears"))
    raise KeyError(key)


_RULES = {SGLANG: _sglang, VLLM: _vllm}


# -------------------------------------------------------------------------------------------- menu

def menu(engine: str, gpu_family: str) -> tuple[list[Family], list[Excluded]]:
    """The families (and per-layer choices) a checkpoint for ``engine`` (sglang|vllm|both) may hold on
    ``gpu_family`` (sm90|sm100|sm120), and what is left out with the reason. ``both``: the intersection."""
    if gpu_family not in GPU_FAMILIES:
        raise DSV4Error(f"unknown GPU family {gpu_family!r}; expected one of {', '.join(GPU_FAMILIES)}")
    engines = engines_for(engine)
    families: list[Family] = []
    excluded: list[Excluded] = [Excluded(
        "per-expert formats", "every routed expert of a layer is one FusedMoE with one quant method (SGLang "
        "srt/layers/moe/fused_moe_triton/layer.py::FusedMoE.__init__); compressed-tensors takes a layer's scheme "
        "from expert 0 in both engines (SGLang compressed_tensors.py::get_moe_scheme, vLLM "
        "compressed_tensors_moe.py::get_moe_method)")]
    for key, candidate in CANDIDATES.items():
        full = _full_name(key)
        rules = {e: _RULES[e](key, gpu_family) for e in engines}
        refusals = [f"{ENGINE_VERSIONS[e]}: {r}" for e, r in rules.items() if isinstance(r, str)]
        if refusals:
            excluded.append(Excluded(full, "; ".join(refusals)))
            continue
        experts = tuple(f for f in candidate if all(f in r.experts for r in rules.values()))
        for fmt in candidate:
            if fmt in experts:
                continue
            reasons = [f"{ENGINE_VERSIONS[e]}: {r.refused[fmt]}" for e, r in rules.items() if fmt in r.refused]
            excluded.append(Excluded(f"{full}: {fmt.value} experts", "; ".join(reasons)))
        if not experts or experts[0] is not candidate[0]:
            continue
        linears = tuple(f for f in _FP8_OR_BF16 if all(f in r.linears for r in rules.values()))
        if FP8 not in linears and any(FP8 in r.linears for r in rules.values()):
            excluded.append(Excluded(f"{full}: fp8 linears", f"{ENGINE_VERSIONS[VLLM]}: {_VL_CT_LINEARS}"))
        per_layer = all(r.linears_per_layer for r in rules.values()) and len(linears) > 1
        first = next(iter(rules.values()))
        mtp = tuple(m for m in first.mtp if all(m in r.mtp for r in rules.values()))
        if not mtp:
            excluded.append(Excluded(full, "no MTP draft storage every engine asked for loads"))
            continue
        if Format.NVFP4 in candidate:
            excluded.append(Excluded(f"{full}: nvfp4 MTP experts", f"{ENGINE_VERSIONS[SGLANG]}: {_SG_HYBRID_MTP}; "
                                     f"{ENGINE_VERSIONS[VLLM]}: ignore lists mtp.* (convert/engines.py)"))
        families.append(Family(
            name="+".join(f.value for f in experts), experts=experts, linears=linears, linears_per_layer=per_layer,
            mtp_experts=mtp[0], env_note=" | ".join(r.env_note for r in rules.values()), config=key,
            model_wide_linears=tuple(sorted({m for r in rules.values() for m in r.model_wide})) if per_layer else (),
            ))
    return families, _dedupe(excluded)


def _dedupe(excluded: list[Excluded]) -> list[Excluded]:
    seen: set[tuple[str, str]] = set()
    out = []
    for e in excluded:
        if (e.name, e.reason) not in seen:
            seen.add((e.name, e.reason))
            out.append(e)
    return out
