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
(``engines/sglang/rules.py::variant_rules`` of ``variants.served_like``: Marlin for the NVFP4 hybrid on sm_90/sm_120,
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
(``engines/sglang/quant_config.py::_state_expert_layout``).

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
so each pair takes one format (``engines/stored.py::analyse``). SGLang loads ``wo_a`` all FP8
or all BF16, the MTP block's included (``Family.model_wide_linears``): unless its FP8 ``wo_a`` GEMM is
on, ``models/deepseek_v4.py::DeepseekV4ForCausalLM.load_weights`` streams the checkpoint through
``_dequant_fp8_wo_a_streaming``, which asserts ``"<wo_a>.scale is missing"`` for a BF16 ``wo_a`` once
it has seen any ``wo_a`` scale (``engines/sglang/quant_config.py::_check_wo_a``); BF16 ``wo_a`` everywhere turns the FP8
``wo_a`` GEMM off (``SGLANG_OPT_FP8_WO_A_GEMM=0``, ``engines/sglang/quant_config.py::serving_env``). vLLM builds ``wo_a``
as an ordinary quantized linear and takes it per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

from dsv4convert.engines import GPU_FAMILIES, SGLANG, VLLM, engines_for
from dsv4convert.engines import LABELS as ENGINE_VERSIONS
from dsv4convert.engines.mixes import CANDIDATES, FP8_OR_BF16
from dsv4convert.engines.sglang import mixes as sglang_mixes
from dsv4convert.engines.vllm import mixes as vllm_mixes
from dsv4convert.errors import DSV4Error
from dsv4convert.formats import Format

FP8 = Format.FP8
_RULES = {SGLANG: sglang_mixes.rule, VLLM: vllm_mixes.rule}


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


def _full_name(key: str) -> str:
    return "+".join(f.value for f in CANDIDATES[key])




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
        linears = tuple(f for f in FP8_OR_BF16 if all(f in r.linears for r in rules.values()))
        if FP8 not in linears and any(FP8 in r.linears for r in rules.values()):
            excluded.append(Excluded(f"{full}: fp8 linears", f"{ENGINE_VERSIONS[VLLM]}: {vllm_mixes.CT_LINEARS}"))
        per_layer = all(r.linears_per_layer for r in rules.values()) and len(linears) > 1
        first = next(iter(rules.values()))
        mtp = tuple(m for m in first.mtp if all(m in r.mtp for r in rules.values()))
        if not mtp:
            excluded.append(Excluded(full, "no MTP draft storage every engine asked for loads"))
            continue
        if Format.NVFP4 in candidate:
            excluded.append(Excluded(f"{full}: nvfp4 MTP experts", f"{ENGINE_VERSIONS[SGLANG]}: {sglang_mixes.HYBRID_MTP}; "
                                     f"{ENGINE_VERSIONS[VLLM]}: ignore lists mtp.* (engines/vllm/quant_config.py)"))
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
