"""What ``serve`` serves: a checkpoint's release, variant and config, and for DeepSeek-V4.1 where its Engram
tables go.

A DeepSeek-V4 checkpoint is what ``inspect`` detects (or ``--variant`` says). A DeepSeek-V4.1 one is what
``fit --model`` reads (:func:`dsv4convert.fit.source_v41.of_directory`: its variant from its ``quantization_config``,
checked against its experts' stored dtype, and every tensor from its headers): the release or any variant ``convert``
writes. The Engram placement is ``fit``'s choice for that checkpoint's own tensors
(``engines/sglang/memory_v41.py::choose_placement``) unless ``--engram`` names one.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

from dsv4convert.checkpoint import Checkpoint, read_small_json
from dsv4convert.engines import EngineError, gpu_of_family
from dsv4convert.engines.sglang.memory_v41 import choose_placement
from dsv4convert.engines.sglang.server import Server
from dsv4convert.engines.vllm.server import VLLM_ENGRAM_DEFAULT, VllmLaunch, vllm_launch, vllm_launch_v41
from dsv4convert.errors import CheckpointError
from dsv4convert.fit.source_v41 import PlannedV41, of_directory
from dsv4convert.inspection import inspect_checkpoint
from dsv4convert.models.deepseek_v4.layout import Drafter, ModelConfig
from dsv4convert.models.deepseek_v41 import release as v41_release
from dsv4convert.models.deepseek_v41.config import DSparkV41Config
from dsv4convert.models.registry import release_of
from dsv4convert.serve.launch import SERVED_VARIANTS, LaunchError


@dataclass(frozen=True)
class V41Checkpoint:
    """A DeepSeek-V4.1 checkpoint as ``serve`` launches it: ``fit``'s reading of it (config, variant, tensors)."""

    plan: PlannedV41
    source: str             # its config.json, as errors name it
    is_v41: bool = True     # what ``serve``'s planning asks of a checkpoint's config (V4's ModelConfig has none)

    @property
    def variant(self) -> str:
        return self.plan.variant

    @property
    def drafter(self) -> Drafter:
        """V4.1's only drafter is DSpark (``mtp.*``, three stages in the release), announced by its dspark_* keys."""
        return Drafter.DSPARK if self.plan.config.dspark is not None else Drafter.NONE

    @property
    def dspark(self) -> DSparkV41Config | None:
        return self.plan.config.dspark


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
            plan = of_directory(model)
            if variant not in (None, plan.variant):
                raise LaunchError(f"--variant {variant}: this DeepSeek-V4.1 checkpoint's config says {plan.variant}")
            return plan.variant, V41Checkpoint(plan, str(path))
    if variant:
        return variant, ModelConfig.from_dict(config, source=str(path)) if config is not None else None
    inspection = inspect_checkpoint(Checkpoint.open(model))
    if inspection.variant not in SERVED_VARIANTS:
        raise LaunchError(f"inspect calls this checkpoint {inspection.variant!r}; pass --variant to serve it anyway")
    return inspection.variant, inspection.config


def engram_placement(checkpoint: V41Checkpoint, servers: list[Server], family: str, requested: str,
                     ) -> tuple[str, str]:
    """The Engram placement to launch with and the plan's line saying why. ``auto``: ``fit``'s choice for these
    servers on ``family``'s card, sized with this checkpoint's own tensors (the release or a converted variant); a
    named placement is checked the same way."""
    gpu = gpu_of_family(family)
    plan = checkpoint.plan
    choice = choose_placement(plan.config, plan.tensors, gpu, servers)
    model = Path(checkpoint.source).parent
    if requested == "auto":
        if choice.placement is None:
            raise LaunchError(f"{checkpoint.source}: on {gpu.name}, {choice.why()} ({_fit_command(model, plan)} "
                              "shows every term)")
        drafter = "; the DSpark drafter counted" if any(s.mtp for s in servers) else ""
        return choice.placement, f"# engram: {choice.placement}, fit's choice on {gpu.name}: {choice.why()}{drafter}"
    failed = [f for f in choice.fits[requested] if not f.fits]
    if failed:
        raise LaunchError(f"{checkpoint.source}: --engram {requested}: the {failed[0].role} server does not "
                          f"fit on {gpu.name} ({_fit_command(model, plan)} shows every term)")
    kv = ", ".join(f"{f.role} {f.kv_tokens:,} KV tokens" for f in choice.fits[requested])
    return requested, f"# engram: {requested} (--engram; fit on {gpu.name}: {kv})"


def _fit_command(model: Path, plan: PlannedV41) -> str:
    """The ``fit`` command that shows the same numbers: ``--model`` where the shards are, else ``--config``."""
    return (f"dsv4convert fit --model {model}" if any(model.glob("*.safetensors"))
            else f"dsv4convert fit --config {model / 'config.json'}")


def v41_vllm_launch(model: str, checkpoint: V41Checkpoint, family: str, tp: int, engram: str) -> VllmLaunch:
    """vLLM 0.33.0's command for a V4.1 checkpoint of any variant (``engines/vllm/server.py::vllm_launch_v41``): its
    drafter where the config announces one; a variant vLLM does not load is refused, naming why."""
    plan = checkpoint.plan
    quant = (plan.raw or {}).get("quantization_config")
    block = checkpoint.dspark.block_size if checkpoint.dspark else None
    try:
        return vllm_launch_v41(model, plan.variant, quant, family, tp, dspark_block_size=block, engram=engram)
    except EngineError as exc:
        raise LaunchError(str(exc)) from None


def vllm_lines(model: str, variant: str, config: ModelConfig | V41Checkpoint | None, family: str, tp: int,
               requested: str) -> list[str]:
    """``--engine vllm``: vLLM 0.33.0's command for one server of ``tp`` GPUs, its draft form where it has one, and
    what it gives up. A V4.1 checkpoint's Engram tables go where ``requested`` says (``auto``: vLLM's own default,
    each rank's shard in pinned host memory)."""
    if getattr(config, "is_v41", False):
        engram = VLLM_ENGRAM_DEFAULT if requested == "auto" else requested
        plan = v41_vllm_launch(model, config, family, tp, engram)
    else:
        engram = None
        drafter = config.drafter if config is not None else Drafter.MTP
        block = config.dspark.block_size if config is not None and config.dspark else None
        try:
            plan = vllm_launch(model, variant, family, tp, drafter=drafter, dspark_block_size=block)
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
