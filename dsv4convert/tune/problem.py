"""What SGLang's Triton fused-MoE kernel computes for a checkpoint at a tensor-parallel size.

The routed experts' stored format decides the kernel's flavour and SGLang's config ``dtype``
(``fp8_w8a8`` with the release's FP8 blocks, ``int4_w4a16`` with the compressed-tensors group, or BF16),
and ``config.json`` decides the shapes: ``E`` experts, each TP rank holding ``I / tp`` of the
intermediate size. Formats SGLang does not run through this kernel are refused with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dsv4convert.checkpoint import Checkpoint
from dsv4convert.engines import SGLANG_LABEL, EngineError
from dsv4convert.engines.sglang.rules import NO_TRITON_PATH, TritonMoE, triton_moe
from dsv4convert.errors import DSV4Error
from dsv4convert.formats import Format, spec
from dsv4convert.inspection import inspect_checkpoint
from dsv4convert.models.deepseek_v4.layout import ModelConfig, Role
from dsv4convert.models.registry import release_of


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
    fp8_block: tuple[int, int]  # the release's (rows, cols) FP8 weight block (FP8's block_shape)
    group_size: int = 0       # INT4 only
    swiglu_limit: float | None = None
    source: str = "config.json"

    @property
    def kernel(self) -> TritonMoE:
        """The Triton fused-MoE kernel's flavour for these experts (SGLang's rule)."""
        return triton_moe(self.expert_format)

    @property
    def dtype(self) -> str | None:
        """SGLang's config ``dtype`` (``get_config_dtype_str``); None for BF16."""
        return self.kernel.dtype

    @property
    def block_shape(self) -> list[int] | None:
        """The ``block_shape`` SGLang passes to its kernel: FP8's weight blocks, INT4's ``[0, group]``."""
        return self.kernel.block_shape(self.group_size, self.fp8_block)

    @property
    def weight_bytes(self) -> float:
        """Bytes of one stored weight element (the B operand the kernel reads)."""
        return spec(self.expert_format).bits_per_weight / 8

    @property
    def lookup_n(self) -> int:
        """``N`` in SGLang's file name: ``w2.shape[2]``, which the Triton W4A16 layout packs two to a byte."""
        return self.intermediate // self.kernel.weights_per_byte

    def describe(self) -> str:
        fmt = self.kernel.label.format(group=self.group_size, block="x".join(map(str, self.fp8_block)))
        return (f"{self.experts} experts, top-{self.topk}, hidden {self.hidden}, intermediate {self.intermediate} "
                f"per rank (TP {self.tp}), {fmt}")

    @classmethod
    def from_config(cls, config: dict, expert_format: Format, tp: int, *, group_size: int = 0,
                    source: str = "config.json") -> MoEProblem:
        """The problem of a checkpoint whose routed experts are stored in ``expert_format``."""
        try:
            kernel = triton_moe(expert_format)
        except EngineError as exc:
            raise TuneError(exc.detail, file=source) from None
        cfg = ModelConfig.from_dict(config, source=source)
        fp8_block = release_of(config, source).fp8_block(cfg)
        if tp < 1 or cfg.moe_intermediate_size % tp:
            raise TuneError(f"moe_intermediate_size {cfg.moe_intermediate_size} does not split into {tp} "
                            "tensor-parallel ranks", file=source)
        per_rank = cfg.moe_intermediate_size // tp
        if kernel.fp8_activations:
            blocks = (config.get("quantization_config") or {}).get("weight_block_size", list(fp8_block))
            if list(blocks) != list(fp8_block):
                raise TuneError(f"quantization_config.weight_block_size is {blocks}; the FP8 variant stores "
                                f"{list(fp8_block)} blocks", file=source)
        granule = kernel.granule(group_size, fp8_block)
        if not granule or per_rank % granule or cfg.hidden_size % granule:
            raise TuneError(f"at TP {tp} each rank holds {per_rank} of the intermediate size, which SGLang's "
                            f"{expert_format.value} MoE needs to be a multiple of {granule}; choose another --tp",
                            file=source)
        limit = config.get("swiglu_limit")
        return cls(expert_format=expert_format, experts=cfg.n_routed_experts, hidden=cfg.hidden_size,
                   intermediate=per_rank, topk=cfg.num_experts_per_tok, tp=tp, fp8_block=fp8_block,
                   group_size=group_size,
                   swiglu_limit=float(limit) if limit else None, source=source)

    @classmethod
    def from_checkpoint(cls, model: str | Path, tp: int) -> MoEProblem:
        """Read the routed experts' format (``inspect``) and the shapes (``config.json``) of a checkpoint."""
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
        if len(groups) != 1:
            raise TuneError(f"the {fmt.value} experts use several group sizes {sorted(groups)}", file=where)
        return cls.from_config(ckpt.config, fmt, tp, group_size=groups.pop(), source=str(ckpt.root / "config.json"))


def model_card_lines(variant: str, env: dict[str, str] | None = None) -> list[str]:
    """The model card's paragraph on tuning SGLang's Triton MoE configs for a variant; ``env``: the variables
    the card's launch commands set (its example launch sets them too)."""
    lines = ["## Tuned MoE kernel configs", ""]
    if variant == "native" or variant.startswith("nvfp4"):
        kernels = "FlashInfer MXFP4 or Marlin kernels" if variant == "native" else "FlashInfer or Marlin kernels"
        reason = (f"Not applicable: {SGLANG_LABEL} runs these routed experts with {kernels}, not with its Triton "
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
