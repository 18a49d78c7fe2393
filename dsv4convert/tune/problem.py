"""What SGLang's Triton fused-MoE kernel computes for a checkpoint at a tensor-parallel size.

The routed experts' stored format decides the kernel's flavour and SGLang's config ``dtype``
(``fp8_w8a8`` with 128x128 blocks, ``int4_w4a16`` with the compressed-tensors group, or BF16),
and ``config.json`` decides the shapes: ``E`` experts, each TP rank holding ``I / tp`` of the
intermediate size. Formats SGLang does not run through this kernel are refused with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dsv4convert.errors import DSV4Error
from dsv4convert.layout import FP8_BLOCK, ModelConfig, Role
from dsv4convert.storage import Format

# Why each format SGLang 0.5.23 does not serve through its Triton fused-MoE kernel is refused.
NO_TRITON_PATH = {
    Format.NVFP4: (
        "the routed experts are NVFP4: SGLang 0.5.23 runs NVFP4 experts with FlashInfer's CUTLASS or TRT-LLM "
        "kernels or with Marlin (ModelOptNvFp4FusedMoEMethod), never with its Triton fused-MoE kernel, so "
        "there are no Triton MoE configs to tune"),
    Format.MXFP4: (
        "the routed experts are MXFP4 (the native checkpoint): SGLang 0.5.23 runs them with FlashInfer's "
        "MXFP4 kernels or Marlin, not with its Triton fused-MoE kernel; convert them with `dsv4convert "
        "to-fp8` to serve (and tune) the Triton path"),
}


class TuneError(DSV4Error):
    """A checkpoint, device or output folder ``tune`` cannot work with."""


@dataclass(frozen=True)
class MoEProblem:
    """One TP rank's routed-expert MoE, as SGLang's Triton kernel sees it."""

    expert_format: Format
    experts: int              # E: every rank holds all experts (TP splits the intermediate size)
    hidden: int               # H
    intermediate: int         # I / tp, the per-rank intermediate size
    topk: int
    tp: int
    group_size: int = 0       # INT4 only
    swiglu_limit: float | None = None
    source: str = "config.json"

    @property
    def dtype(self) -> str | None:
        """SGLang's config ``dtype`` (``get_config_dtype_str``); None for BF16."""
        return {Format.FP8: "fp8_w8a8", Format.INT4: "int4_w4a16", Format.BF16: None}[self.expert_format]

    @property
    def block_shape(self) -> list[int] | None:
        """The ``block_shape`` SGLang passes to its kernel: FP8's weight blocks, INT4's ``[0, group]``."""
        if self.expert_format is Format.FP8:
            return [FP8_BLOCK, FP8_BLOCK]
        if self.expert_format is Format.INT4:
            return [0, self.group_size]
        return None

    @property
    def lookup_n(self) -> int:
        """``N`` in SGLang's file name: ``w2.shape[2]``, which the Triton W4A16 layout packs two to a byte."""
        return self.intermediate // 2 if self.expert_format is Format.INT4 else self.intermediate

    def describe(self) -> str:
        fmt = {Format.FP8: "FP8 e4m3, 128x128 blocks", Format.INT4: f"INT4 W4A16, group {self.group_size}",
               Format.BF16: "BF16"}[self.expert_format]
        return (f"{self.experts} experts, top-{self.topk}, hidden {self.hidden}, intermediate {self.intermediate} "
                f"per rank (TP {self.tp}), {fmt}")

    @classmethod
    def from_config(cls, config: dict, expert_format: Format, tp: int, *, group_size: int = 0,
                    source: str = "config.json") -> MoEProblem:
        """The problem of a checkpoint whose routed experts are stored in ``expert_format``."""
        if expert_format in NO_TRITON_PATH:
            raise TuneError(NO_TRITON_PATH[expert_format], file=source)
        cfg = ModelConfig.from_dict(config, source=source)
        if tp < 1 or cfg.moe_intermediate_size % tp:
            raise TuneError(f"moe_intermediate_size {cfg.moe_intermediate_size} does not split into {tp} "
                            "tensor-parallel ranks", file=source)
        per_rank = cfg.moe_intermediate_size // tp
        if expert_format is Format.FP8:
            blocks = (config.get("quantization_config") or {}).get("weight_block_size", [FP8_BLOCK, FP8_BLOCK])
            if list(blocks) != [FP8_BLOCK, FP8_BLOCK]:
                raise TuneError(f"quantization_config.weight_block_size is {blocks}; the FP8 variant stores "
                                f"[{FP8_BLOCK}, {FP8_BLOCK}] blocks", file=source)
        granule = {Format.FP8: FP8_BLOCK, Format.INT4: group_size, Format.BF16: 16}[expert_format]
        if not granule or per_rank % granule or cfg.hidden_size % granule:
            raise TuneError(f"at TP {tp} each rank holds {per_rank} of the intermediate size, which SGLang's "
                            f"{expert_format.value} MoE needs to be a multiple of {granule}; choose another --tp",
                            file=source)
        limit = config.get("swiglu_limit")
        return cls(expert_format=expert_format, experts=cfg.n_routed_experts, hidden=cfg.hidden_size,
                   intermediate=per_rank, topk=cfg.num_experts_per_tok, tp=tp, group_size=group_size,
                   swiglu_limit=float(limit) if limit else None, source=source)

    @classmethod
    def from_checkpoint(cls, model: str | Path, tp: int) -> MoEProblem:
        """Read the routed experts' format (``inspect``) and the shapes (``config.json``) of a checkpoint."""
        from dsv4convert.checkpoint import Checkpoint
        from dsv4convert.inspection import inspect_checkpoint

        ckpt = Checkpoint.open(model)
        inspection = inspect_checkpoint(ckpt)
        experts = [m for m in inspection.modules.values() if m.role is Role.ROUTED_EXPERT and not m.is_mtp]
        formats = {m.format for m in experts}
        where = str(ckpt.root)
        if None in formats:
            bad = next(m.module for m in experts if m.format is None)
            raise TuneError("a routed expert is stored in no known format (see `dsv4convert inspect`)",
                            file=where, tensor=f"{bad}.weight")
        if len(formats) != 1:
            raise TuneError(f"the routed experts mix formats ({', '.join(sorted(f.value for f in formats))}); "
                            "SGLang builds one MoE method for all of them", file=where)
        (fmt,) = formats
        if fmt in NO_TRITON_PATH:
            raise TuneError(NO_TRITON_PATH[fmt], file=where)
        groups = {m.params.get("group_size", 0) for m in experts}
        if fmt is Format.INT4 and len(groups) != 1:
            raise TuneError(f"the INT4 experts use several group sizes {sorted(groups)}", file=where)
        return cls.from_config(ckpt.config, fmt, tp, group_size=groups.pop() if fmt is Format.INT4 else 0,
                               source=str(ckpt.root / "config.json"))


def model_card_lines(variant: str, env: dict[str, str] | None = None) -> list[str]:
    """The model card's paragraph on tuning SGLang's Triton MoE configs for a variant; ``env``: the variables
    the card's launch commands set (its example launch sets them too)."""
    lines = ["## Tuned MoE kernel configs", ""]
    if variant == "native" or variant.startswith("nvfp4"):
        kernels = "FlashInfer MXFP4 or Marlin kernels" if variant == "native" else "FlashInfer or Marlin kernels"
        reason = (f"Not applicable: SGLang 0.5.23 runs these routed experts with {kernels}, not with its Triton "
                  "fused-MoE kernel, so `dsv4convert tune` has nothing to tune (it refuses this checkpoint and says why).")
        return [*lines, reason, ""]
    when = {"w4a16": " when started with `--moe-runner-backend triton` (its default for W4A16 is Marlin, which "
                     "these configs do not affect)",
            "mixed": " if they are FP8, INT4 or BF16"}.get(variant, "")
    shipped = " (it ships none for these FP8 128x128 experts on any RTX PRO 6000)" if variant == "fp8" else ""
    text = (f"SGLang runs these routed experts with its Triton fused-MoE kernel{when}. Where SGLang ships no config "
            f"for the GPU and shape{shipped} it logs `Using default MoE kernel config` and runs one fixed tile. On the "
            "serving GPU, with the server's Triton, make a config folder once and point SGLang at it (the folder "
            "also holds every config SGLang ships: the variable replaces SGLang's own folder):")
    assignments = "".join(f"{k}={v} " for k, v in sorted((env or {}).items()) if k != "CUDA_VISIBLE_DEVICES")
    launch = (f"{assignments}SGLANG_MOE_CONFIG_DIR=$PWD/moe-configs python -m sglang.launch_server ...   "
              "# or: dsv4convert serve --model <this folder> --tuned-configs moe-configs")
    return [
        *lines,
        text,
        "",
        "```bash",
        "dsv4convert tune --model <this folder> --tp <TP> --out moe-configs",
        launch,
        "```",
        "",
    ]
