"""What SGLang runs for each variant on each GPU family: MoE methods, runner, environment, the MTP draft.

Paths are relative to ``python/sglang/srt/`` of the pinned wheel (``sglang-contract.md`` sections 1, 4,
5 and 9, ``sglang-loading.md`` section 2.4 of the project reference). CI builds SGLang's own model with
these settings on CPU and checks every method name (tests/test_sglang_loading.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from dsv4convert import variants
from dsv4convert.engines import SGLANG_LABEL, EngineError, gpu_family_major
from dsv4convert.formats import Format
from dsv4convert.models.deepseek_v4.layout import Drafter

# SGLang's EAGLE draft from the checkpoint's MTP block, the cookbook's "balanced" preset (sglang-contract.md
# section 4: V4 accepts EAGLE with top-k 1, or DSPARK): one draft step, one candidate, two tokens verified
# per step, so an accepted length of at most 2.
EAGLE_STEPS, EAGLE_TOPK, EAGLE_DRAFT_TOKENS = 1, 1, 2
# The algorithm that serves each drafter: EAGLE builds the one-block NextN draft from the preview's MTP block;
# DSPARK builds DeepseekV4ForCausalLMDSpark from 0731's stages (configs/model_config.py::_config_draft_model).
SPECULATIVE_ALGORITHM = {Drafter.MTP: "EAGLE", Drafter.DSPARK: "DSPARK"}

# The cookbook's only SM120 cell: --mem-fraction-static 0.70, decode CUDA graphs up to batch 32.
SM120_MEM_FRACTION = 0.70
SM120_DECODE_GRAPH_BS = 32

# MoE methods whose kernels exist only on some GPU majors, and why.
SM100_ONLY_METHODS = {
    "Mxfp4FlashinferTrtllmMoEMethod": "FlashInfer's TRT-LLM MXFP4 MoE kernel (trtllm_fp4_block_scale_moe) is an SM100 "
                                      "kernel",
}

# The routed-expert method SGLang's loader gives each stored format, as its loader-level checks name it
# (validate/sglang_load.py reports which tensor a method would drop or cast).
EXPERT_METHOD = {Format.FP8: "Fp8MoEMethod", Format.MXFP4: "MXFP4", Format.NVFP4: "ModelOptNvFp4FusedMoEMethod",
                 Format.INT4: "CompressedTensorsWNA16", Format.BF16: "UnquantizedFusedMoEMethod"}


@dataclass(frozen=True)
class VariantRules:
    """What SGLang runs for one variant on one GPU family, and the settings that make it so.

    ``moe_method``/``draft_moe_method`` name the routed-expert method SGLang builds for the backbone and for
    the MTP draft (the compressed-tensors scheme class for W4A16).
    """

    env: dict[str, str]
    moe_runner_backend: str | None      # None: leave SGLang's automatic choice
    moe_method: str
    draft_moe_method: str
    draft_moe_runner_backend: str | None = None   # --speculative-moe-runner-backend
    mtp_note: str | None = None         # why the MTP draft cannot run here (None: it can)

    @property
    def serves_draft(self) -> bool:
        return self.mtp_note is None


def _rules(env: dict[str, str], runner: str | None, method: str, draft_method: str, major: int,
           draft_runner: str | None = None, drafter: Drafter = Drafter.MTP) -> VariantRules:
    why = SM100_ONLY_METHODS.get(draft_method) if major != 10 else None
    note = None if why is None else (
        f"{SGLANG_LABEL} loads this checkpoint's MXFP4 draft experts into {draft_method}, and {why}; convert with "
        "to-nvfp4 --mtp-experts bf16 (both engines)" + (" or --engine sglang (FP8-block draft experts)"
                                                       if drafter is not Drafter.DSPARK else "")
        + " to serve the draft on this GPU")
    if drafter is Drafter.DSPARK:
        # DSpark's worker runs its stages outside speculative_moe_backend_context (speculative/
        # draft_worker_common.py::build_draft_tp_worker), so --speculative-moe-runner-backend has no effect: the
        # stages' experts run on the backbone's runner, where Fp8MoEMethod has no Marlin path.
        draft_runner = None
        if note is None and runner == "marlin" and draft_method == "Fp8MoEMethod":
            note = (f"{SGLANG_LABEL}'s DSPARK runs the drafter's FP8 experts on the backbone's Marlin MoE runner, "
                    "where Fp8MoEMethod has no path (DSPARK ignores --speculative-moe-runner-backend); convert with "
                    "to-nvfp4 --mtp-experts bf16 to serve the draft on this GPU")
    return VariantRules(env, runner, method, draft_method, draft_runner, note)


def variant_rules(variant: str, gpu_family: str, drafter: Drafter = Drafter.MTP) -> VariantRules:
    """Environment, MoE runner and draft settings a variant needs on a GPU family, for the checkpoint's drafter
    (EAGLE serves the preview's MTP block, DSPARK 0731's drafter).

    SGLang detects the quantization itself; what it cannot know is that non-FP4 experts must not be read as
    FP4 when its shard probe finds nothing (W4A16 keys, BF16) or finds the NVFP4 backbone's U8 while the
    draft's experts are FP8, and that its automatic runner for the NVFP4 hybrid is an SM100-only one. The
    NVFP4 hybrid's FP8 draft experts run on SGLang's Triton FP8 MoE: Fp8MoEMethod has no Marlin path (its
    runner stays unset and its forward fails).
    """
    major = gpu_family_major(gpu_family)
    not_fp4 = {"SGLANG_DSV4_FP4_EXPERTS": "0"}
    nvfp4_runner = None if major == 10 else "marlin"
    if variant == "native":
        mxfp4 = {10: "Mxfp4FlashinferTrtllmMoEMethod", 12: "Mxfp4MarlinMoEMethod"}.get(major,
                                                                                     "Mxfp4FlashinferCutlassMoEMethod")
        return _rules({}, "marlin" if major == 12 else None, mxfp4, mxfp4, major, drafter=drafter)
    if variant == "fp8":
        return _rules(not_fp4, None, "Fp8MoEMethod", "Fp8MoEMethod", major, drafter=drafter)
    if variant == "nvfp4":
        return _rules(not_fp4, nvfp4_runner, "ModelOptNvFp4FusedMoEMethod", "Fp8MoEMethod", major, "triton", drafter)
    if variant == "nvfp4-mtp-mxfp4":
        return _rules({"SGLANG_DSV4_FP4_EXPERTS": "1"}, nvfp4_runner, "ModelOptNvFp4FusedMoEMethod",
                      "Mxfp4FlashinferTrtllmMoEMethod", major, drafter=drafter)
    if variant == "nvfp4-mtp-bf16":  # BF16 draft experts (ignored_layers): SGLang's unquantized Triton MoE
        return _rules(not_fp4, nvfp4_runner, "ModelOptNvFp4FusedMoEMethod", "UnquantizedFusedMoEMethod", major,
                      "triton", drafter)
    if variant == "w4a16":
        wna16 = "CompressedTensorsWNA16TritonMoE" if major == 10 else "CompressedTensorsWNA16MoE"
        return _rules(not_fp4, None, wna16, wna16, major, drafter=drafter)
    if variant == "bf16":
        return _rules(not_fp4, None, "UnquantizedFusedMoEMethod", "UnquantizedFusedMoEMethod", major, drafter=drafter)
    raise EngineError(f"no serving rules for variant {variant!r}; expected one of {', '.join(variants.SERVED)} "
                      "(pass --variant to override what inspect detected)")


# ------------------------------------------------------------------------------ the Triton fused-MoE kernel

@dataclass(frozen=True)
class TritonMoE:
    """How SGLang's Triton fused-MoE kernel (layers/moe/fused_moe_triton) runs routed experts of one format."""

    dtype: str | None          # its config ``dtype`` (get_config_dtype_str): fp8_w8a8, int4_w4a16, None for BF16
    block_k: tuple[int, ...]   # BLOCK_SIZE_K values worth trying, the preferred first
    label: str                 # what the experts are, for a person ("{group}": the INT4 group size)
    weights_per_byte: int = 1  # the W4A16 layout packs two weights to a byte (w2.shape[2] is half of N)
    note: str = ""             # how a launch must ask for it, where its default is another runner

    @property
    def fp8_activations(self) -> bool:
        """W8A8: activations are quantized to FP8 per group of the weight block's columns before each GEMM."""
        return self.dtype == "fp8_w8a8"

    @property
    def activation_bytes(self) -> int:
        return 1 if self.fp8_activations else 2

    def block_shape(self, group_size: int, fp8_block: tuple[int, int]) -> list[int] | None:
        """The ``block_shape`` SGLang passes to its kernel: FP8's weight blocks (the release's ``fp8_block``),
        INT4's ``[0, group]``."""
        if self.fp8_activations:
            return list(fp8_block)
        return [0, group_size] if self.dtype == "int4_w4a16" else None

    def granule(self, group_size: int, fp8_block: tuple[int, int]) -> int:
        """What each rank's share of the intermediate size (and the hidden size) must be a multiple of."""
        shape = self.block_shape(group_size, fp8_block)
        return shape[1] if shape else 16


# The kernel steps FP8 block scales once per BLOCK_SIZE_K, so it must divide the block's columns (tune keeps the
# values here that do, else tries the columns alone).
TRITON_MOE: dict[Format, TritonMoE] = {
    Format.FP8: TritonMoE("fp8_w8a8", (128, 64), "FP8 e4m3, {block} blocks"),
    Format.INT4: TritonMoE("int4_w4a16", (64, 128, 32, 256), "INT4 W4A16, group {group}", weights_per_byte=2,
                           note="W4A16 runs SGLang's Triton MoE only with --moe-runner-backend triton (its default is "
                                "Marlin)"),
    Format.BF16: TritonMoE(None, (64, 128, 32), "BF16"),
}
# Why each format SGLang does not serve through its Triton fused-MoE kernel has nothing to tune there.
NO_TRITON_PATH = {
    Format.NVFP4: (
        f"the routed experts are NVFP4: {SGLANG_LABEL} runs NVFP4 experts with FlashInfer's CUTLASS or TRT-LLM "
        "kernels or with Marlin (ModelOptNvFp4FusedMoEMethod), never with its Triton fused-MoE kernel, so "
        "there are no Triton MoE configs to tune"),
    Format.MXFP4: (
        f"the routed experts are MXFP4 (the native checkpoint): {SGLANG_LABEL} runs them with FlashInfer's "
        "MXFP4 kernels or Marlin, not with its Triton fused-MoE kernel; convert them with `dsv4convert "
        "to-fp8` to serve (and tune) the Triton path"),
}


def triton_moe(fmt: Format) -> TritonMoE:
    """The Triton fused-MoE kernel's flavour for experts stored as ``fmt``; raises with the reason when SGLang
    never runs them through it."""
    if fmt not in TRITON_MOE:
        raise EngineError(NO_TRITON_PATH.get(fmt, f"{SGLANG_LABEL} has no Triton fused-MoE path for {fmt.value} "
                                                  "experts"))
    return TRITON_MOE[fmt]
