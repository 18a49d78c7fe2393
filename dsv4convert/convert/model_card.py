"""The README.md model card of a converted checkpoint.

A card is for the person who downloads the checkpoint: what it was made from and how, what
each part is stored as, how much of it is bit-exact, and the exact SGLang 0.5.23 command
and environment that serve it on each GPU family.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from dsv4convert.convert.plan import human_bytes
from dsv4convert.convert.quant_config import serving_env
from dsv4convert.tune.problem import model_card_lines

if TYPE_CHECKING:
    from dsv4convert.checkpoint import Checkpoint
    from dsv4convert.inspection import Inspection

# GPU families a card covers: SGLang's family name and the memory of one GPU in bytes.
GPU_FAMILIES: dict[str, tuple[str, int]] = {
    "H200 (sm_90)": ("sm90", 141 * 10**9),
    "B200 (sm_100)": ("sm100", 180 * 10**9),
    "RTX PRO 6000 (sm_120)": ("sm120", 96 * 10**9),
}
# Weights may take this share of the GPUs' memory; the rest is KV cache, activations and
# CUDA graphs (the SM120 cookbook cell serves the ~160 GB native model at TP 4 on 96 GB cards).
WEIGHT_MEMORY_SHARE = 0.6
MAX_TP = 8

_STATS_SHOWN = ("lossless_blocks", "total_blocks", "input_scale_source", "tensors_quantized", "tensors_kept",
                "bytes_in", "bytes_out")
_INPUT_SCALE_SOURCES = {
    "checkpoint": "read from another NVFP4 checkpoint of this model",
    "calibration": "from a calibration file",
    "data-free bound": "a data-free bound that cannot overflow (not calibrated; only SM100 W4A4 runners use it)",
}


def tensor_parallel_size(weight_bytes: int, gpu_memory: int) -> int | None:
    """The smallest power-of-two TP whose GPUs hold the weights in their share; None past 8 GPUs."""
    tp = 1
    while weight_bytes > WEIGHT_MEMORY_SHARE * gpu_memory * tp:
        tp *= 2
        if tp > MAX_TP:
            return None
    return tp


def default_launch(model_dir: str | Path, variant: str, *, opened: tuple[Checkpoint, Inspection] | None = None
                   ) -> dict[str, dict]:
    """Single-server SGLang commands for a converted checkpoint, per GPU family.

    The argv comes from ``dsv4convert.serve.launch`` (the same rules ``serve`` uses), the
    environment from what the checkpoint stores (``quant_config.serving_env``), and the TP
    size from the weights' size. A family whose 8 GPUs cannot hold the weights gets a note
    instead of a command. Each family also gets ``mtp``, the command with the MTP draft, where
    SGLang's MoE method for the draft's experts runs there, else ``mtp_note`` saying why not;
    ``draft_moe_method`` names that method. ``opened``: the checkpoint and its inspection where
    the caller has them already (the converter, which has just inspected its output).
    """
    from dsv4convert.checkpoint import Checkpoint
    from dsv4convert.inspection import inspect_checkpoint
    from dsv4convert.serve.launch import LaunchOptions, plan_single, served_like, variant_defaults

    if opened is None:
        ckpt = Checkpoint.open(model_dir)
        opened = ckpt, inspect_checkpoint(ckpt)
    ckpt, inspection = opened
    formats = {m.module: (m.format, m.params) for m in inspection.modules.values() if m.format is not None}
    env = serving_env(ckpt.config, formats)
    like = served_like(variant, formats)
    weight_bytes = sum(entry.nbytes for entry in ckpt.tensors.values())
    launch: dict[str, dict] = {}
    for name, (family, memory) in GPU_FAMILIES.items():
        tp = tensor_parallel_size(weight_bytes, memory)
        if tp is None:
            launch[name] = {"argv": [], "env": {}, "note": f"{human_bytes(weight_bytes)} of weights need more than "
                                                            f"{MAX_TP} of these GPUs (multi-node TP)"}
            continue
        options = LaunchOptions(model=str(model_dir), variant=like, gpu_family=family, python="python")
        (command,) = plan_single(options, None, list(range(tp)))
        spec: dict = {"argv": list(command.argv), "env": {**command.env, **env}}
        defaults = variant_defaults(like, family)
        spec["draft_moe_method"] = defaults.draft_moe_method
        if defaults.mtp_args is None:
            spec["mtp_note"] = defaults.mtp_note
        else:
            (draft,) = plan_single(replace(options, mtp=True), None, list(range(tp)))
            spec["mtp"] = {"argv": list(draft.argv), "env": {**draft.env, **env}}
        launch[name] = spec
    return launch


def _percent(part: int, whole: int) -> str:
    return f"{100.0 * part / whole:.2f} %" if whole else "n/a"


def _formats_table(formats_by_role: dict[str, dict[str, int]]) -> list[str]:
    lines = ["| Role | Stored format (modules) |", "|---|---|"]
    for role, counts in sorted(formats_by_role.items()):
        cells = ", ".join(f"{fmt} x{n}" for fmt, n in sorted(counts.items()))
        lines.append(f"| {role} | {cells} |")
    return lines


def _stats_lines(stats: dict) -> list[str]:
    total, exact = int(stats.get("total_blocks", 0)), int(stats.get("lossless_blocks", 0))
    lines = [
        f"- Lossless blocks: {exact:,} of {total:,} ({_percent(exact, total)}) decode to exactly the source's values.",
        f"- Tensors quantized: {int(stats.get('tensors_quantized', 0)):,}; kept byte for byte: "
        f"{int(stats.get('tensors_kept', 0)):,}.",
        f"- Size: {human_bytes(int(stats.get('bytes_in', 0)))} in, {human_bytes(int(stats.get('bytes_out', 0)))} out.",
    ]
    sources = stats.get("input_scale_source") or {}
    if sources:
        lines.append("- NVFP4 activation `input_scale`s:")
        for source, count in sorted(sources.items()):
            lines.append(f"  - {count:,} expert projections: {_INPUT_SCALE_SOURCES.get(source, source)}")
    for key, value in stats.items():
        if key in _STATS_SHOWN:
            continue
        if isinstance(value, dict) and value and all(isinstance(v, dict) for v in value.values()):
            lines += ["", f"{key.replace('_', ' ').capitalize()}:", "", *_nested_table(value)]
        else:
            lines.append(f"- {key.replace('_', ' ').capitalize()}: {json.dumps(value, default=str)}")
    return lines


def _nested_table(rows: dict[str, dict]) -> list[str]:
    """A {row: {column: value}} statistic (e.g. per role) as a Markdown table."""
    columns = sorted({column for row in rows.values() for column in row})
    lines = ["| | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for name, row in sorted(rows.items()):
        lines.append(f"| {name} | " + " | ".join(str(row.get(c, "")) for c in columns) + " |")
    return lines


def shell_line(spec: dict) -> str:
    """``VAR=value ... argv`` as one copy-pasteable shell line."""
    assignments = [f"{k}={shlex.quote(str(v))}" for k, v in sorted(spec.get("env", {}).items())]
    return " ".join([*assignments, shlex.join(spec["argv"])])


def _launch_lines(launch: dict[str, dict]) -> list[str]:
    lines: list[str] = []
    for family, spec in launch.items():
        lines += [f"### {family}", ""]
        if spec.get("note"):
            lines += [spec["note"], ""]
        if spec.get("argv"):
            lines += ["```bash", shell_line(spec), "```", ""]
        method = spec.get("draft_moe_method")
        if spec.get("mtp"):
            lines += [f"With the MTP draft (EAGLE; its routed experts run through SGLang's `{method}`):", "",
                      "```bash", shell_line(spec["mtp"]), "```", ""]
        elif spec.get("mtp_note"):
            lines += [f"No MTP draft on this GPU: {spec['mtp_note']}.", ""]
    return lines


def render_model_card(*, variant: str, base_model: str, recipe_name: str, recipe_text: str,
                      formats_by_role: dict[str, dict[str, int]], stats: dict, launch: dict[str, dict]) -> str:
    """The README.md of an output checkpoint (Hugging Face front matter, then Markdown)."""
    lines = [
        "---",
        f"base_model: {json.dumps(base_model)}",
        "tags:",
        "- deepseek_v4",
        f"- {json.dumps(variant)}",
        "- dsv4convert",
        "---",
        "",
        f"# DeepSeek-V4-Flash, {variant} variant",
        "",
        f"Converted from `{base_model}` by dsv4convert with the recipe `{recipe_name}`. Tensors the recipe "
        "does not convert are copied byte for byte; `config.json` carries the `quantization_config` "
        "SGLang 0.5.23 reads for exactly these stored formats.",
        "",
        "## Formats per role",
        "",
        *_formats_table(formats_by_role),
        "",
        "## Conversion statistics",
        "",
        *_stats_lines(stats),
        "",
        "## Serving with SGLang 0.5.23",
        "",
        "One server per GPU family. The environment variables are part of the command: SGLang cannot "
        "tell every expert layout from the files alone.",
        "",
        *_launch_lines(launch),
        *model_card_lines(variant, next((spec["env"] for spec in launch.values() if spec.get("argv")), {})),
        "## Recipe",
        "",
        "```yaml",
        recipe_text.rstrip("\n"),
        "```",
        "",
    ]
    return "\n".join(lines)
