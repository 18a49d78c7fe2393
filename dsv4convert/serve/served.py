"""What ``serve`` serves: a checkpoint's release, variant and config, and for DeepSeek-V4.1 where its Engram
tables go.

A DeepSeek-V4 checkpoint is what ``inspect`` detects (or ``--variant`` says). A DeepSeek-V4.1 one is read from its
config alone (:class:`V41Checkpoint`): SGLang detects its expert format itself
(``configs/deepseek_v4.py::try_detect_fp4_experts``, ``configs/model_config.py``'s ``nvfp4_moe_meta``), so the
variant only names what the launch may not run. The Engram placement is ``fit``'s choice
(:func:`dsv4convert.fit.v41.choose_placement`) unless ``--engram`` names one.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

from dsv4convert.checkpoint import Checkpoint, read_small_json
from dsv4convert.engines import SGLANG_LABEL, EngineError, gpu_family_major, gpu_of_family
from dsv4convert.engines.sglang.server import Server
from dsv4convert.engines.vllm.server import VLLM_ENGRAM_DEFAULT, vllm_launch
from dsv4convert.errors import CheckpointError
from dsv4convert.fit import v41 as fit_v41
from dsv4convert.fit.source_v41 import planned
from dsv4convert.inspection import inspect_checkpoint
from dsv4convert.models.deepseek_v4.layout import Drafter, ModelConfig
from dsv4convert.models.deepseek_v41 import release as v41_release
from dsv4convert.models.deepseek_v41.config import DSparkV41Config, V41Config
from dsv4convert.models.registry import release_of
from dsv4convert.serve.launch import SERVED_VARIANTS, LaunchError


@dataclass(frozen=True)
class V41Checkpoint:
    """A DeepSeek-V4.1 checkpoint as ``serve`` launches it: its checked config, raw config and variant."""

    config: V41Config
    raw: dict
    source: str
    variant: str            # native (FP4 experts), fp8 (FP8 experts) or nvfp4 (ModelOpt's hybrid)
    is_v41: bool = True     # what ``serve``'s planning asks of a checkpoint's config (V4's ModelConfig has none)

    @property
    def drafter(self) -> Drafter:
        """V4.1's only drafter is DSpark (``mtp.*``, three stages in the release), announced by its dspark_* keys."""
        return Drafter.DSPARK if self.config.dspark is not None else Drafter.NONE

    @property
    def dspark(self) -> DSparkV41Config | None:
        return self.config.dspark


def v41_variant(quant: dict, source: str) -> str:
    """What a V4.1 ``quantization_config`` describes: the release (MXFP4 experts), FP8 experts (``expert_dtype``
    fp8) or NVIDIA's ModelOpt hybrid (``moe_quant_algo`` NVFP4, ``HybridFp8NvFp4Config``); anything else SGLang
    0.5.23 has no V4.1 path for (compressed-tensors: only its generic DeepSeek mapping, unchecked)."""
    method = quant.get("quant_method")
    if method != "fp8":
        raise CheckpointError(f"quant_method {method!r}: serve launches DeepSeek-V4.1 checkpoints whose "
                              f"quantization_config is fp8 (the release, FP8 experts, ModelOpt's NVFP4 hybrid); "
                              f"{SGLANG_LABEL} has no DeepSeek-V4.1 path checked for this one",
                              file=f"{source} (quantization_config)")
    if quant.get("moe_quant_algo") == "NVFP4":
        return "nvfp4"
    return "fp8" if quant.get("expert_dtype") == "fp8" else "native"


def inspect(model: Path, variant: str | None) -> tuple[str, ModelConfig | V41Checkpoint | None]:
    """The variant to serve and the checkpoint's config (which draft it holds). With ``--variant`` only config.json
    is read, where there is one (a router host may hold nothing but the tokenizer)."""
    path = model / "config.json"
    config = read_small_json(path) if path.is_file() else None
    if config is not None:
        release = release_of(config, str(path))
        why = release.not_yet("serve")
        if why:
            raise CheckpointError(why, file=str(path))
        if release is v41_release:
            found = v41_variant(config.get("quantization_config") or {}, str(path))
            if variant not in (None, found):
                raise LaunchError(f"--variant {variant}: this DeepSeek-V4.1 checkpoint's config says {found}")
            return found, V41Checkpoint(v41_release.read_config(config, str(path)), config, str(path), found)
    if variant:
        return variant, ModelConfig.from_dict(config, source=str(path)) if config is not None else None
    inspection = inspect_checkpoint(Checkpoint.open(model))
    if inspection.variant not in SERVED_VARIANTS:
        raise LaunchError(f"inspect calls this checkpoint {inspection.variant!r}; pass --variant to serve it anyway")
    return inspection.variant, inspection.config


def check_v41_family(checkpoint: V41Checkpoint, family: str) -> None:
    """A V4.1 variant SGLang picks a kernel for that this GPU family does not have, refused before launch."""
    if checkpoint.variant == "nvfp4" and gpu_family_major(family) != 10:
        raise LaunchError(f"{checkpoint.source}: ModelOpt's NVFP4 hybrid runs on {SGLANG_LABEL}'s automatic MoE runner "
                          "for it, flashinfer_trtllm_routed, an SM100 kernel (arg_groups/model_overrides/deepseek_v4.py::"
                          f"_deepseek_v4_overrides); no other runner is checked for DeepSeek-V4.1, so not on {family}")


def engram_placement(checkpoint: V41Checkpoint, servers: list[Server], family: str, requested: str,
                     ) -> tuple[str, str]:
    """The Engram placement to launch with and the plan's line saying why. ``auto``: ``fit``'s choice for these
    servers on ``family``'s card; a named placement is checked the same way. ``fit`` sizes the release as
    released, so a converted V4.1 gets SGLang's default (the GPUs) unless told, unsized."""
    if checkpoint.variant != "native":
        placement = "gpu" if requested == "auto" else requested
        return placement, (f"# engram: {placement} ({'SGLang default; ' if requested == 'auto' else ''}not sized: fit "
                           "sizes DeepSeek-V4.1 as released only)")
    gpu = gpu_of_family(family)
    choice = fit_v41.choose_placement(planned(checkpoint.raw, checkpoint.source), gpu, servers)
    if requested == "auto":
        if choice.placement is None:
            raise LaunchError(f"{checkpoint.source}: on {gpu.name}, {choice.why()} (dsv4convert fit --config "
                              f"{checkpoint.source} shows every term)")
        drafter = "; the DSpark drafter counted" if any(s.mtp for s in servers) else ""
        return choice.placement, f"# engram: {choice.placement}, fit's choice on {gpu.name}: {choice.why()}{drafter}"
    failed = [f for f in choice.fits[requested] if not f.fits]
    if failed:
        raise LaunchError(f"{checkpoint.source}: --engram {requested}: the {failed[0].role} server does not "
                          f"fit on {gpu.name} (dsv4convert fit --config {checkpoint.source} shows every term)")
    kv = ", ".join(f"{f.role} {f.kv_tokens:,} KV tokens" for f in choice.fits[requested])
    return requested, f"# engram: {requested} (--engram; fit on {gpu.name}: {kv})"


def vllm_lines(model: str, variant: str, config: ModelConfig | V41Checkpoint | None, family: str, tp: int,
               requested: str) -> list[str]:
    """``--engine vllm``: vLLM 0.33.0's command for one server of ``tp`` GPUs, its draft form where it has one, and
    what it gives up. A V4.1 checkpoint's Engram tables go where ``requested`` says (``auto``: vLLM's own default,
    each rank's shard in pinned host memory; fit does not size vLLM's V4.1)."""
    v41 = getattr(config, "is_v41", False)
    drafter = config.drafter if config is not None else Drafter.MTP
    block = config.dspark.block_size if config is not None and config.dspark else None
    engram = (VLLM_ENGRAM_DEFAULT if requested == "auto" else requested) if v41 else None
    if v41 and variant == "nvfp4":
        variant = "nvfp4-mtp-mxfp4"   # ModelOpt's hybrid ignores mtp.*: the drafter's experts stay MXFP4
    try:
        plan = vllm_launch(model, variant, family, tp, drafter=drafter, dspark_block_size=block, engram=engram)
    except EngineError as exc:
        raise LaunchError(str(exc)) from None
    lines = [f"# server: {shlex.join(plan.argv)}"]
    if plan.mtp_argv is not None:
        lines.append(f"# with the drafter: {shlex.join(plan.mtp_argv)}")
    else:
        lines.append(f"# draft: {plan.mtp_note}")
    if engram is not None:
        lines.append(f"# engram: {engram}" + (" (vLLM's default, EngramConfig.cpu_offload)" if requested == "auto" else ""))
    return lines + [f"# note: {limit}" for limit in plan.limits]
