"""The per-layer mixes vLLM serves, per config family (see :mod:`dsv4convert.engines.mixes`).

Paths are relative to the ``vllm`` package of the pinned wheel. vLLM reads one ``expert_dtype`` per model and
``ignored_layers`` per layer; an NVFP4 hybrid's excluded layers are MXFP4, so FP8 cannot be its alternate;
its MoE kernel backend is chosen per layer (``model_executor/layers/fused_moe/oracle/*.py``), so mixing adds
no runner constraint. vLLM on sm_120 is resolved, not built, in CI (its attention needs FlashInfer's SM120
DSV4 kernels).
"""

from __future__ import annotations

from dsv4convert.engines.mixes import BF16, FP8, FP8_OR_BF16, INT4, MXFP4, NVFP4, MixRule

_VL_FP8_ALT = (
    "models/deepseek_v41/quant_config.py::DeepseekV4FP8Config.get_quant_method reads a RoutedExperts outside NVFP4 "
    "(ignore, fnmatch in _is_nvfp4_expert_layer) as Mxfp4MoEMethod, or UnquantizedFusedMoEMethod where "
    "ignored_layers lists it: the NVFP4 path needs expert_dtype fp4, so FP8-block layers would load into MXFP4 "
    "parameters")
CT_LINEARS = (
    "vLLM's compressed-tensors config has no linear_fp8_config, and its FP8 block scheme registers weight_scale "
    "while models/deepseek_v4/nvidia/model.py::_make_deepseek_v4_weights_mapper renames .scale to weight_scale_inv "
    "(engines/vllm/quant_config.py::vllm_problem): the linears must be BF16")
_VL_NOTE = ("vLLM: vllm serve with the card's flags ({what}); the MoE kernel is chosen per layer "
            "(model_executor/layers/fused_moe/oracle/), sm_120 resolved only in CI")


def rule(key: str, gpu: str) -> MixRule | str:
    """vLLM 0.33.0 (the same on every GPU family: its quant methods do not depend on it)."""
    del gpu
    if key == "nvfp4-hybrid":
        # DeepseekV4FP8Config.get_quant_method: ignored_layers -> UnquantizedFusedMoEMethod, else (expert_dtype
        # fp4) ModelOptNvFp4FusedMoE unless `ignore` covers the layer, then Mxfp4MoEMethod.
        return MixRule((NVFP4, BF16), {FP8: _VL_FP8_ALT}, FP8_OR_BF16, True, (BF16,),
                     _VL_NOTE.format(what="DeepseekV4FP8Config, expert_dtype fp4; BF16 layers and draft in "
                                          "ignored_layers"))
    if key == "nvfp4-hybrid-mxfp4":
        return MixRule((NVFP4, MXFP4, BF16), {}, FP8_OR_BF16, True, (None, BF16),
                     _VL_NOTE.format(what="DeepseekV4FP8Config, expert_dtype fp4; MXFP4 layers in ignore, BF16 ones "
                                          "also in ignored_layers"))
    if key == "fp8":
        # expert_dtype fp8 -> Fp8Config.get_quant_method -> Fp8MoEMethod (float32 block scales: E8M0 ones are
        # copied as raw bytes, models/deepseek_v4/nvidia/model.py::DeepseekV4Model.load_weights).
        return MixRule((FP8, BF16), {}, FP8_OR_BF16, True, (FP8, BF16),
                     _VL_NOTE.format(what="DeepseekV4FP8Config, expert_dtype fp8, F32 expert scales"))
    if key == "mxfp4":
        return MixRule((MXFP4, BF16), {}, FP8_OR_BF16, True, (None, BF16),
                     _VL_NOTE.format(what="DeepseekV4FP8Config, expert_dtype fp4 (Mxfp4MoEMethod)"))
    if key == "int4":
        # compressed_tensors_moe.py::get_moe_method per layer; `ignore` (re.match on vLLM names,
        # compressed_tensors/utils.py::should_ignore_layer) -> UnquantizedFusedMoEMethod.
        return MixRule((INT4, BF16), {}, (BF16,), False, (INT4, BF16),
                     _VL_NOTE.format(what="CompressedTensorsConfig, BF16 linears"))
    raise KeyError(key)


