"""The per-layer mixes SGLang serves, per config family and GPU family (see :mod:`dsv4convert.engines.mixes`).

Paths are relative to the ``sglang`` package of the pinned wheel (``serve/...``, ``convert/...``: this
project's). A family is admitted only where it loads *and* its methods run under the MoE runner its launch
uses (:func:`dsv4convert.engines.sglang.rules.variant_rules`: Marlin for the NVFP4 hybrid on sm_90/sm_120,
SGLang's automatic ``flashinfer_trtllm_routed`` on sm_100, ...). tests/test_mixed_layouts.py loads every
admitted layout with SGLang's real loader on CPU.
"""

from __future__ import annotations

from dataclasses import replace

from dsv4convert.engines.mixes import BF16, FP8, FP8_OR_BF16, INT4, MXFP4, NVFP4, MixRule

# Cited reasons, shared across GPU families.
_SG_FP8_NO_MARLIN = (
    "the launch serves the NVFP4 hybrid with --moe-runner-backend marlin here (ModelOptNvFp4FusedMoEMethod's "
    "path below sm_100; engines/sglang/rules.py::variant_rules), and srt/layers/quantization/fp8.py::"
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
    "trtllm_fp4_block_scale_(routed_)moe, an SM100 kernel (engines/sglang/rules.py SM100_ONLY_METHODS)")
_SG_MXFP4_NO_BF16 = (
    "with is_fp4_experts srt/layers/quantization/modelopt_quant.py::HybridFp8NvFp4Config.get_quant_method returns "
    "Mxfp4FlashinferTrtllmMoEMethod for every FusedMoE outside NVFP4 before ignored_layers is consulted: no layer "
    "can be BF16")
HYBRID_MTP = (
    "srt/model_loader/loader.py::_get_quantization_config always excludes model.decoder.* from NVFP4")


def rule(key: str, gpu: str) -> MixRule | str:
    """SGLang 0.5.23 on ``gpu``: the choices of config family ``key`` that load and run, or why none do."""
    rule = _sglang_rule(key, gpu)
    # models/deepseek_v4.py::DeepseekV4ForCausalLM.load_weights streams every wo_a through
    # _dequant_fp8_wo_a_streaming (unless the FP8 wo_a GEMM is on, which needs them all FP8), which asserts
    # "<wo_a>.scale is missing" for a BF16 wo_a once any wo_a had a scale (engines/sglang/quant_config.py::_check_wo_a).
    return rule if isinstance(rule, str) else replace(rule, model_wide=("attn.wo_a",))


def _sglang_rule(key: str, gpu: str) -> MixRule | str:
    sm100 = gpu == "sm100"
    if key == "nvfp4-hybrid":
        # HybridFp8NvFp4Config.get_quant_method: not excluded -> ModelOptNvFp4FusedMoEMethod; excluded with
        # is_fp4_experts False -> the Fp8Config dispatch (fp8.py::Fp8Config.get_quant_method): Fp8MoEMethod, or
        # UnquantizedFusedMoEMethod where ignored_layers lists the layer.
        if sm100:
            return MixRule((NVFP4, FP8), {BF16: _SG_BF16_TRTLLM}, FP8_OR_BF16, True, (FP8, BF16),
                         "SGLang: SGLANG_DSV4_FP4_EXPERTS=0, MoE runner auto = flashinfer_trtllm_routed (NVFP4 W4A4 and "
                         "FP8 layers on TRT-LLM), draft on Triton (--speculative-moe-runner-backend triton)")
        # Under marlin the unquantized method gets a Triton runner (unquant.py::create_moe_runner: neither
        # flashinfer_cutlass nor trtllm), which applies swiglu_limit (moe_runner/triton.py).
        return MixRule((NVFP4, BF16), {FP8: _SG_FP8_NO_MARLIN}, FP8_OR_BF16, True, (FP8, BF16),
                     "SGLang: SGLANG_DSV4_FP4_EXPERTS=0, --moe-runner-backend marlin (NVFP4 W4A16 Marlin, BF16 layers on "
                     "Triton), draft on Triton (--speculative-moe-runner-backend triton)")
    if key == "nvfp4-hybrid-mxfp4":
        if not sm100:
            return f"{_SG_MXFP4_SM100}; without it this family is the FP8-alternate hybrid"
        # Mxfp4FlashinferTrtllmMoEMethod.create_moe_runner keeps no runner and applies the kernel itself
        # (srt/layers/quantization/mxfp4_flashinfer_trtllm_moe.py), with the swiglu_limit clamp.
        return MixRule((NVFP4, MXFP4), {BF16: _SG_MXFP4_NO_BF16}, FP8_OR_BF16, True, (None,),
                     "SGLang: SGLANG_DSV4_FP4_EXPERTS=1, MoE runner auto = flashinfer_trtllm_routed for NVFP4, MXFP4 "
                     "layers and the draft on FlashInfer's TRT-LLM MXFP4 kernel (sm_100 only)")
    if key == "fp8":
        # fp8.py::Fp8MoEMethod.create_moe_runner: auto -> DeepGEMM or Triton; skipped layers ->
        # UnquantizedFusedMoEMethod on Triton (the runner flag stays auto).
        return MixRule((FP8, BF16), {}, FP8_OR_BF16, True, (FP8, BF16),
                     "SGLang: SGLANG_DSV4_FP4_EXPERTS=0, MoE runner auto (FP8 on Triton or DeepGEMM, BF16 on Triton)")
    if key == "mxfp4":
        # fp8.py::Fp8Config.get_quant_method with is_fp4_experts: Mxfp4FlashinferCutlassMoEMethod (sm_90/sm_120
        # under flashinfer_mxfp4), Mxfp4FlashinferTrtllmMoEMethod (sm_100), Mxfp4MarlinMoEMethod (marlin, the
        # sm_120 launch); skipped layers: UnquantizedFusedMoEMethod, a Triton runner under either.
        runner = {"sm90": "auto = flashinfer_mxfp4 (CUTLASS)", "sm100": "auto = flashinfer_mxfp4 (TRT-LLM)",
                  "sm120": "--moe-runner-backend marlin"}[gpu]
        return MixRule((MXFP4, BF16), {}, FP8_OR_BF16, True, (None, BF16),
                     f"SGLang: SGLANG_DSV4_FP4_EXPERTS=1, MoE runner {runner}, BF16 layers on Triton")
    if key == "int4":
        # compressed_tensors.py::CompressedTensorsConfig.get_quant_method: get_moe_scheme per layer (expert 0),
        # None where `ignore` matches -> UnquantizedFusedMoEMethod (Triton); linear_fp8_config gives every
        # LinearBase Fp8LinearMethod without an ignore check, so the linears are all FP8 or all BF16.
        wna16 = "Triton WNA16" if sm100 else "Marlin WNA16"
        return MixRule((INT4, BF16), {}, FP8_OR_BF16, False, (INT4, BF16),
                     f"SGLang: SGLANG_DSV4_FP4_EXPERTS=0, MoE runner auto ({wna16}, BF16 layers on Triton); "
                     "linears all FP8 (linear_fp8_config) or all BF16")
    raise KeyError(key)


