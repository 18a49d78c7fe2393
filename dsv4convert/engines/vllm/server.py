"""The ``vllm serve`` command that serves a converted checkpoint, per GPU family (the model card's source).

Pure planning, like :mod:`dsv4convert.engines.sglang.server` for SGLang: CI parses and resolves every
command with vLLM's own ``vllm serve`` parser and ``create_engine_config`` (tests/vllm_oracle.py).
The flags are vLLM's own recipe for DeepSeek-V4-Flash (vllm-project/recipes,
``models/deepseek-ai/DeepSeek-V4-Flash.yaml``): its base arguments ``--kv-cache-dtype fp8
--block-size 256``, its default strategy ``single_node_tep`` (``--tensor-parallel-size N
--enable-expert-parallel``) and its MTP mode ``--speculative-config {"method":"mtp",...}`` with two
draft tokens, one on Hopper. The recipe lists no RTX PRO 6000 (sm_120) among its hardware, so no
MTP command is offered there: vLLM 0.33.0's code does not refuse MTP on sm_120, but nothing we
checked says it serves it (CI can only resolve sm_120 commands, see tests/vllm_oracle.py).
Left out, and why: the recipe's remote-code flag (V4 is built into vLLM; these checkpoints ship no code,
and dsv4convert never asks for remote code), the recipe's Blackwell extras
``--attention_config.use_fp4_indexer_cache True`` (an FP4 indexer-key cache: a recall trade-off a
user should opt into, see ``dsv4convert compare --recall``) and ``--moe-backend deep_gemm_mega_moe``
(FP4 experts only: vLLM raises for ``expert_dtype`` other than fp4, ``nvidia/model.py``
``DeepseekV4MoE.__init__``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from dsv4convert.engines import NO_DRAFT, VLLM_LABEL, EngineError, gpu_family_major
from dsv4convert.engines.vllm.quant_config import v41_family_problem, v41_problem
from dsv4convert.models.deepseek_v4.layout import Drafter

KV_CACHE_DTYPE = "fp8"
BLOCK_SIZE = 256        # tokens per KV block (--block-size); vLLM's memory sizing counts whole blocks
BASE_ARGS = ("--kv-cache-dtype", KV_CACHE_DTYPE, "--block-size", str(BLOCK_SIZE))
# vLLM's recipe: 2 MTP draft tokens, 1 on Hopper; it lists no RTX PRO 6000 (sm_120), so none there.
_MTP_TOKENS = {9: 1, 10: 2}

# Routed-expert methods vLLM 0.33.0 builds for a variant's backbone and MTP draft
# (models/deepseek_v41/quant_config.py DeepseekV4FP8Config.get_quant_method; compressed-tensors'
# CompressedTensorsMoEMethod for W4A16). CI builds vLLM's model and checks these names.
VLLM_MOE_METHODS: dict[str, tuple[str, str]] = {
    "native": ("Mxfp4MoEMethod", "Mxfp4MoEMethod"),
    "fp8": ("Fp8MoEMethod", "Fp8MoEMethod"),
    "nvfp4-mtp-mxfp4": ("ModelOptNvFp4FusedMoE", "Mxfp4MoEMethod"),
    "nvfp4-mtp-bf16": ("ModelOptNvFp4FusedMoE", "UnquantizedFusedMoEMethod"),
    "w4a16": ("CompressedTensorsWNA16MoEMethod", "CompressedTensorsWNA16MoEMethod"),
    "bf16": ("UnquantizedFusedMoEMethod", "UnquantizedFusedMoEMethod"),
}

# What a user of vLLM 0.33.0 should know, per variant (beyond the common limits below).
_NVFP4_MTP = ("MTP acceptance under vLLM is not measured here: a converted NVFP4 checkpoint whose MTP experts vLLM "
              "ran as NVFP4 reached 1.8 % against 80 % for the native one (vLLM #43455); this checkpoint's "
              "config keeps vLLM off NVFP4 for the draft (ignore lists mtp.*), which CI checks")
_VARIANT_LIMITS = {
    "fp8": ["experts run vLLM's FP8 block MoE (Fp8MoEMethod) because config.json says expert_dtype fp8; "
            "the recipe's `--moe-backend deep_gemm_mega_moe` is for FP4 experts and refuses this checkpoint"],
    "nvfp4-mtp-mxfp4": ["the MTP draft's experts are MXFP4 (Mxfp4MoEMethod), as in NVIDIA's own NVFP4 checkpoint",
                        _NVFP4_MTP],
    "nvfp4-mtp-bf16": ["the MTP draft's experts are BF16 (UnquantizedFusedMoEMethod through ignored_layers)",
                       _NVFP4_MTP],
    "w4a16": ["attention, shared experts and MTP projections are BF16: vLLM's compressed-tensors path reads "
              "linears as INT4 or BF16 only",
              "a W4A16 MoE weight_scale sharding fault at TP > 2 was reported against vLLM (#41511, closed as "
              "stale); whether 0.33.0 fixed it is not checked here"],
}
# What a DSpark drafter meets in vLLM 0.33.0 (models/deepseek_v4/nvidia/dspark.py).
DSPARK_LIMITS = [
    "vLLM 0.33.0's V4 DSpark loader knows the Markov head only as markov_head.markov_w1/markov_w2 (the V4.1 loader "
    "renames the release's embed/head, the V4 one raises KeyError): checkpoints converted for vLLM carry those "
    "names, which SGLang reads too",
    "the DSpark stages run the backbone's expert count (vLLM's V4 ignores dspark_n_routed_experts) and keep a "
    "second copy of each stage's wkv (context_wkv_proj), which fit counts",
    DSPARK_RUNNER := "DSpark runs on Model Runner V2 only; vLLM picks it where Triton is installed",
]
COMMON_LIMITS = [
    "CI builds vLLM 0.33.0's own model and MTP draft on CPU and loads every tensor through its loader; no "
    "kernel ran (the MoE backend vLLM picks depends on the GPU and the kernels installed)",
    "the MTP draft takes the target's embedding and LM head (vLLM shares them; the checkpoint has no copies)",
]


@dataclass(frozen=True)
class VllmLaunch:
    """One ``vllm serve`` command, its MTP form where vLLM's recipe supports it, and the limits to state."""

    argv: tuple[str, ...]
    env: dict[str, str]
    mtp_argv: tuple[str, ...] | None
    mtp_note: str | None
    moe_method: str
    draft_moe_method: str
    limits: tuple[str, ...]
    block_size: int = BLOCK_SIZE


def speculative_config(gpu_family: str, drafter: Drafter = Drafter.MTP, block_size: int | None = None) -> str | None:
    """``--speculative-config`` for the checkpoint's drafter, or None where none is offered.

    The preview's MTP block: vLLM's recipe (``method: mtp``). A DSpark drafter: ``method: dspark`` with
    ``num_speculative_tokens`` set to the drafter's block size: vLLM 0.33.0 refuses the bundled form without
    it (``config/speculative.py::SpeculativeConfig._verify_args``) and runs it only on Model Runner V2, its
    default where Triton is installed (``config/vllm.py::VllmConfig.use_v2_model_runner``)."""
    if drafter is Drafter.DSPARK:
        if not block_size:
            raise EngineError("a DSpark drafter needs its dspark_block_size for vLLM's num_speculative_tokens")
        spec = {"method": "dspark", "num_speculative_tokens": block_size}
    elif drafter is Drafter.MTP and gpu_family_major(gpu_family) in _MTP_TOKENS:
        spec = {"method": "mtp", "num_speculative_tokens": _MTP_TOKENS[gpu_family_major(gpu_family)]}
    else:
        return None
    return json.dumps(spec, separators=(",", ":"))


# DeepSeek-V4.1's Engram tables in vLLM 0.33.0 (config/engram.py::EngramConfig, models/deepseek_v41/common/engram.py
# ParallelEngramEmbedding): each TP rank's shard in pinned host memory read by UVA lookups (cpu_offload, the
# default: what SGLang calls per rank), or in GPU memory with cpu_offload false. vLLM shares host tables only between
# co-located DP replicas (dp_shared_memory), never across one server's TP ranks: SGLang's shared layout has no twin.
VLLM_ENGRAM_ARGS = {"host-per-rank": (), "gpu": ("--engram-config", '{"cpu_offload":false}')}
VLLM_ENGRAM_DEFAULT = "host-per-rank"


def vllm_launch(model: str, variant: str, gpu_family: str, tp: int, *, drafter: Drafter = Drafter.MTP,
                dspark_block_size: int | None = None, engram: str | None = None) -> VllmLaunch:
    """The vLLM command for a checkpoint vLLM 0.33.0 loads (``engines`` includes vllm), on one GPU family, with
    its drafter (``Drafter.NONE``: no ``mtp.*``; an NVFP4 one then has no draft format to tell apart). ``engram``:
    a DeepSeek-V4.1 checkpoint's Engram placement (:data:`VLLM_ENGRAM_ARGS`), None for V4."""
    draft = drafter is not Drafter.NONE
    if not draft and variant == "nvfp4":
        variant = "nvfp4-mtp-bf16"
    if variant not in VLLM_MOE_METHODS:
        raise EngineError(f"no vLLM command for the {variant!r} layout; expected one of "
                          f"{', '.join(VLLM_MOE_METHODS)}")
    moe, draft_method = VLLM_MOE_METHODS[variant]
    if engram is not None and engram not in VLLM_ENGRAM_ARGS:
        raise EngineError(f"Engram placement {engram}: vLLM 0.33.0 shares host tables only between data-parallel "
                          "replicas (config/engram.py::EngramConfig.dp_shared_memory), not across one server's TP "
                          f"ranks; use {' or '.join(VLLM_ENGRAM_ARGS)}")
    argv = ("vllm", "serve", model, "--tensor-parallel-size", str(tp), *(("--enable-expert-parallel",) if tp > 1
                                                                         else ()), *BASE_ARGS,
            *VLLM_ENGRAM_ARGS.get(engram or "", ()))
    spec = speculative_config(gpu_family, drafter, dspark_block_size)
    mtp_argv = None if spec is None else (*argv, "--speculative-config", spec)
    note = None if spec is not None else NO_DRAFT if not draft else (
        "vLLM's DeepSeek-V4-Flash recipe lists no RTX PRO 6000 (sm_120) and no MTP setting for it, so none is "
        "offered; vLLM 0.33.0's code does not refuse --speculative-config there, but it is unchecked")
    limits = list(_VARIANT_LIMITS.get(variant, []))
    if drafter is Drafter.DSPARK:   # V4.1's own draft (DSparkV41DraftModel) has none of V4's loader limits
        limits += DSPARK_LIMITS if engram is None else [DSPARK_RUNNER]
    return VllmLaunch(argv, {}, mtp_argv, note, moe, draft_method, tuple(limits))


# A DeepSeek-V4.1 variant as the layout :data:`VLLM_MOE_METHODS` names: ModelOpt's hybrid ignores ``mtp.*``, so its
# DSpark stages' experts stay MXFP4 (``models/deepseek_v41/quant_config.py::DeepseekV4FP8Config``).
V41_LAYOUTS = {"native": "native", "nvfp4": "nvfp4-mtp-mxfp4", "bf16": "bf16", "fp8": "fp8", "w4a16": "w4a16"}


def vllm_launch_v41(model: str, variant: str, quant_config: dict | None, gpu_family: str, tp: int, *,
                    dspark_block_size: int | None, engram: str) -> VllmLaunch:
    """The vLLM command for a DeepSeek-V4.1 checkpoint of ``variant`` (its ``quantization_config`` as stored), with its
    DSpark drafter where the config announces one (``dspark_block_size``) and the Engram tables at ``engram``; a
    variant vLLM 0.33.0 does not load (``quant_config.py::v41_problem``: FP8 experts in 32x32 blocks,
    compressed-tensors) or not on this family is refused, naming why."""
    problem = v41_problem(quant_config, variant) or v41_family_problem(variant, gpu_family)
    if problem:
        raise EngineError(f"{VLLM_LABEL} does not load this DeepSeek-V4.1 {variant} checkpoint: {problem}")
    drafter = Drafter.DSPARK if dspark_block_size else Drafter.NONE
    return vllm_launch(model, V41_LAYOUTS[variant], gpu_family, tp, drafter=drafter,
                       dspark_block_size=dspark_block_size, engram=engram)
