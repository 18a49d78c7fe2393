"""The README.md model card of a converted checkpoint.

A card is for the person who downloads the checkpoint: what it was made from and how, what
each part is stored as, how much of it is bit-exact, which engines it is made and checked for,
the exact SGLang and vLLM commands (the pinned versions, :data:`dsv4convert.engines.VERSIONS`) (and environment) that serve it on each GPU
family with each engine's known limits, and how to upload it. Its YAML front matter is what the
Hugging Face Hub reads for a quantized derivative (``base_model``, ``base_model_relation``,
``library_name``, ``license`` taken from the source's own card, ``tags``).
"""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

from dsv4convert import engines as eng
from dsv4convert import variants
from dsv4convert.checkpoint import Checkpoint
from dsv4convert.convert.plan import human_bytes
from dsv4convert.engines.memory import MIB, ServerFit, gib
from dsv4convert.engines.served import ServedModel
from dsv4convert.engines.sglang import memory as sglang_memory
from dsv4convert.engines.sglang.quant_config import serving_env
from dsv4convert.engines.sglang.server import drafter_of, server
from dsv4convert.engines.vllm import memory as vllm_memory
from dsv4convert.engines.vllm.server import COMMON_LIMITS, vllm_launch
from dsv4convert.inspection import Inspection, inspect_checkpoint
from dsv4convert.models.deepseek_v4.layout import Drafter, ModelConfig
from dsv4convert.tune.problem import model_card_lines

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


def _per_family(model_dir: str | Path, variant: str, opened: tuple[Checkpoint, Inspection] | None, spec_for,
                size_for) -> dict[str, dict]:
    """``spec_for(family, tp, like, formats, config, drafter)`` for every GPU family whose 8 GPUs hold the weights
    (the TP size from their bytes), a note for the others: what both engines' launch tables share. Each
    spec's ``fit`` is ``size_for(model, gpu, tp)``: what ``dsv4convert fit`` computes for that launch
    from the stored bytes (weights per GPU, KV tokens)."""
    if opened is None:
        ckpt = Checkpoint.open(model_dir)
        opened = ckpt, inspect_checkpoint(ckpt)
    ckpt, inspection = opened
    formats = {m.module: (m.format, m.params) for m in inspection.modules.values() if m.format is not None}
    like = variants.served_like(variant, formats)
    drafter = inspection.config.drafter if any(m.is_mtp for m in inspection.modules.values()) else Drafter.NONE
    weight_bytes = sum(entry.nbytes for entry in ckpt.tensors.values())
    model = ServedModel.of(str(model_dir), ckpt, inspection)
    launch: dict[str, dict] = {}
    for family in eng.GPU_FAMILIES:
        gpu = eng.gpu_of_family(family)
        tp = tensor_parallel_size(weight_bytes, gpu.mib * MIB)
        if tp is None:
            launch[gpu.label] = {"argv": [], "env": {}, "note": f"{human_bytes(weight_bytes)} of weights need more "
                                                                 f"than {MAX_TP} of these GPUs (multi-node TP)"}
        else:
            launch[gpu.label] = {**spec_for(family, tp, like, formats, ckpt.config, drafter),
                                 "fit": _fit_line(size_for(model, gpu, tp))}
    return launch


def _fit_line(server: ServerFit) -> dict:
    """What a card prints of one server's sizing."""
    return {"gpu": server.gpu, "weights_bytes_per_rank": server.weights_bytes_per_rank, "kv_tokens": server.kv_tokens,
            "fits": server.fits, "upper_bound": server.engine.startswith("vllm")}


def _gpus(tp: int) -> dict[str, str]:
    return {"CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in range(tp))}


def default_launch(model_dir: str | Path, variant: str, *, opened: tuple[Checkpoint, Inspection] | None = None
                   ) -> dict[str, dict]:
    """Single-server SGLang commands for a converted checkpoint, per GPU family.

    The settings are the engine's (:func:`dsv4convert.engines.sglang.server.server`, what ``serve`` starts),
    the environment also what the checkpoint stores needs (``serving_env``), and the TP size follows the
    weights' size. A family whose 8 GPUs cannot hold the weights gets a note instead of a command. Each
    family also gets ``mtp``, the command with the MTP draft, where SGLang's MoE method for the draft's
    experts runs there, else ``mtp_note`` saying why not; ``draft_moe_method`` names that method.
    ``opened``: the checkpoint and its inspection where the caller has them already (the converter).
    The commands name the checkpoint by its absolute path: they run from any directory.
    """
    path = os.path.abspath(model_dir)

    def spec_for(family: str, tp: int, like: str, formats: dict, config: dict, drafter: Drafter) -> dict:
        env = serving_env(config, formats)
        draft = drafter_of(ModelConfig.from_dict(config)) if drafter is not Drafter.NONE else {}
        settings = server(path, like, family, tp=tp, **draft)
        rules = settings.rules
        spec: dict = {"argv": settings.command("python"), "env": {**settings.env, **_gpus(tp), **env},
                      "draft_moe_method": rules.draft_moe_method}
        if not draft or not rules.serves_draft:
            spec["mtp_note"] = rules.mtp_note if draft else eng.NO_DRAFT
        else:
            drafting = server(path, like, family, tp=tp, mtp=True, **draft)
            spec["mtp"] = {"argv": drafting.command("python"), "env": {**drafting.env, **_gpus(tp), **env},
                           "what": _draft_what(drafter, drafting.speculative_algorithm, drafting.draft_tokens)}
        return spec

    def size_for(model: ServedModel, gpu: eng.Gpu, tp: int) -> ServerFit:
        return sglang_memory.size_server(model, gpu, server("MODEL", model.variant, gpu.family, tp=tp,
                                                            **drafter_of(model.model_config)))

    return _per_family(model_dir, variant, opened, spec_for, size_for)


def vllm_default_launch(model_dir: str | Path, variant: str, *, opened: tuple[Checkpoint, Inspection] | None = None
                        ) -> dict[str, dict]:
    """``vllm serve`` commands for a checkpoint vLLM loads, per GPU family (same TP as SGLang's).

    Each family's spec has ``argv``, ``env``, ``moe_method``/``draft_moe_method``, ``limits``, and
    ``mtp`` (the command with the MTP draft) or ``mtp_note``; from :mod:`dsv4convert.engines.vllm.server`.
    The commands name the checkpoint by its absolute path.
    """
    path = os.path.abspath(model_dir)

    def spec_for(family: str, tp: int, like: str, formats: dict, config: dict, drafter: Drafter) -> dict:
        dspark = ModelConfig.from_dict(config).dspark
        plan = vllm_launch(path, like, family, tp, drafter=drafter,
                           dspark_block_size=dspark.block_size if dspark else None)
        spec: dict = {"argv": list(plan.argv), "env": dict(plan.env), "moe_method": plan.moe_method,
                      "draft_moe_method": plan.draft_moe_method, "limits": list(plan.limits)}
        if plan.mtp_argv is None:
            spec["mtp_note"] = plan.mtp_note
        else:
            method = json.loads(plan.mtp_argv[-1])
            spec["mtp"] = {"argv": list(plan.mtp_argv), "env": dict(plan.env),
                           "what": _draft_what(drafter, f"`--speculative-config` method {method['method']}",
                                               method["num_speculative_tokens"] + 1)}
        return spec

    def size_for(model: ServedModel, gpu: eng.Gpu, tp: int) -> ServerFit:
        return vllm_memory.size_server(model, gpu, tp, mtp=False)

    return _per_family(model_dir, variant, opened, spec_for, size_for)


# What the Hub's metadata says about the base model, where the source carries no card to read it from.
DEFAULT_BASE_MODEL = "deepseek-ai/DeepSeek-V4-Flash"
MAX_CARD_BYTES = 1 << 20


def source_card_metadata(root: Path) -> dict:
    """The YAML front matter of the source's README.md (license fields), or {} without one."""
    import yaml

    path = Path(root) / "README.md"
    try:
        if not path.is_file() or path.stat().st_size > MAX_CARD_BYTES:
            return {}
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return {}
    if not text.startswith("---\n"):
        return {}
    head, sep, _ = text[4:].partition("\n---")
    try:
        data = yaml.safe_load(head) if sep else None
    except yaml.YAMLError:
        return {}
    return data if isinstance(data, dict) else {}


def base_model_id(src: str, root: Path, default: str = DEFAULT_BASE_MODEL) -> str:
    """The Hub id of the model converted: ``src`` when it is one, the id of a Hub cache snapshot, else ``default``."""
    if not Path(src).exists() and src.count("/") == 1:
        return src
    for part in Path(root).resolve().parts:
        if part.startswith("models--"):
            return part.removeprefix("models--").replace("--", "/", 1)
    return default


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


def fit_sentence(fit: dict) -> str:
    """One line of what ``dsv4convert fit`` computes for the command above it."""
    verdict = "" if fit["fits"] else " It does not fit: `dsv4convert fit` gives the shortfall."
    if fit["upper_bound"]:
        verdict += " KV tokens before vLLM's profiled activation peak (an upper bound)."
    return (f"Sized by `dsv4convert fit` for this command on {fit['gpu']}: {gib(fit['weights_bytes_per_rank'])} "
            f"of weights per GPU, {fit['kv_tokens']:,} KV tokens.{verdict}")


def _draft_what(drafter: Drafter, algorithm: str | None, tokens: int | None) -> str:
    """How a card names the draft a command serves."""
    what = "the DSpark drafter" if drafter is Drafter.DSPARK else "the MTP draft"
    return f"{what} ({algorithm}, {tokens} tokens verified per step)"


def draft_lines(config: ModelConfig, kept: bool) -> list[str]:
    """What the card says of the source's drafter (``config``): kept (which one, how it is served) or dropped."""
    if config.drafter is Drafter.NONE:
        return ["## Draft model", "", "None: the source has no `mtp.*` draft. Serve it without speculative decoding.",
                ""]
    if not kept:
        what = "DSpark drafter" if config.drafter is Drafter.DSPARK else "MTP draft"
        return ["## Draft model", "", f"None: the source's {what} was left out (`--no-mtp`), so this checkpoint "
                "serves without speculative decoding.", ""]
    if config.drafter is Drafter.DSPARK:
        d = config.dspark
        return ["## Draft model", "",
                f"The DSpark drafter is kept: {d.stages} stages under `mtp.0`..`mtp.{d.stages - 1}`, drafting blocks "
                f"of {d.block_size} tokens from the backbone's layers {list(d.target_layer_ids)}, with its Markov "
                "and confidence heads. SGLang serves it with `--speculative-algorithm DSPARK` (never EAGLE: EAGLE "
                "would load the stages into a one-layer NextN draft and leave its projections uninitialized); vLLM "
                "with `--speculative-config` method `dspark`.", ""]
    return ["## Draft model", "",
            f"The MTP draft is kept ({config.num_nextn_predict_layers} block under `mtp.0`); SGLang serves it with "
            "EAGLE, vLLM with `--speculative-config` method `mtp`.", ""]


def _launch_lines(launch: dict[str, dict]) -> list[str]:
    lines: list[str] = []
    for family, spec in launch.items():
        lines += [f"### {family}", ""]
        if spec.get("note"):
            lines += [spec["note"], ""]
        if spec.get("argv"):
            lines += ["```bash", shell_line(spec), "```", ""]
        if spec.get("fit"):
            lines += [fit_sentence(spec["fit"]), ""]
        method = spec.get("draft_moe_method")
        if spec.get("mtp"):
            lines += [f"With {spec['mtp']['what']}; its routed experts run through `{method}`:", "",
                      "```bash", shell_line(spec["mtp"]), "```", ""]
        elif spec.get("mtp_note"):
            lines += [f"No draft on this GPU: {spec['mtp_note']}.", ""]
    return lines


def _front_matter(variant: str, base_model: str, engines: tuple[str, ...], source_meta: dict) -> list[str]:
    """What the Hub reads for a quantized derivative; the license comes from the source's own card."""
    lines = ["---", f"base_model: {json.dumps(base_model)}", "base_model_relation: quantized",
             "library_name: transformers", "pipeline_tag: text-generation"]
    if source_meta.get("license"):
        for key in ("license", "license_name", "license_link"):
            if source_meta.get(key):
                lines.append(f"{key}: {json.dumps(str(source_meta[key]))}")
    else:
        lines += ["license: other", 'license_name: "base-model-license"',
                  f"license_link: {json.dumps(f'https://huggingface.co/{base_model}')}"]
    tags = ["deepseek_v4", variant, *variants.TAGS.get(variant, ()), "quantized", *engines, "dsv4convert"]
    lines += ["tags:", *[f"- {json.dumps(t)}" for t in dict.fromkeys(tags)], "---"]
    return lines


def _engine_lines(engines: tuple[str, ...], not_for: dict[str, str]) -> list[str]:
    made = " and ".join(eng.LABELS[e] for e in engines)
    lines = [f"Made for {made} (`--engine {eng.choice_of(engines)}`): `config.json` carries what each of them "
             "reads, and CI builds each engine's own model from a tiny checkpoint of this layout and loads every "
             "tensor through the engine's own loader."]
    for engine, reason in not_for.items():
        lines += ["", f"Not for {eng.LABELS[engine]}: {reason}"]
    return lines


def _limit_lines(limits: list[str]) -> list[str]:
    return ["Known limits:", "", *[f"- {limit}" for limit in limits], ""] if limits else []


def upload_command(model_dir: str | Path) -> list[str]:
    """huggingface_hub's CLI for this directory (resumable: re-running it continues an interrupted upload)."""
    return ["hf", "upload", "<your-namespace>/<repo-name>", str(model_dir), ".", "--repo-type", "model"]


def upload_lines(model_dir: str | Path | None) -> list[str]:
    target = model_dir if model_dir is not None else "<this directory>"
    return [
        "## Upload", "",
        "With huggingface_hub's own CLI. Since `upload_large_folder` was folded into it, `hf upload` sends a large "
        "folder in several commits and the same command resumes an interrupted upload:", "",
        "```bash", shlex.join(upload_command(target)), "```", "",
        "With an older huggingface_hub (0.x or 1.x), the resumable command is `hf upload-large-folder "
        f"<your-namespace>/<repo-name> {shlex.quote(str(target))} --repo-type=model`.", "",
    ]


def render_model_card(*, variant: str, base_model: str, recipe_name: str, recipe_text: str,
                      formats_by_role: dict[str, dict[str, int]], stats: dict, launch: dict[str, dict],
                      engines: tuple[str, ...] = (eng.SGLANG,), vllm_launch: dict[str, dict] | None = None,
                      not_for: dict[str, str] | None = None, source_meta: dict | None = None,
                      model_dir: str | Path | None = None, source: str | None = None,
                      draft: list[str] | None = None) -> str:
    """The README.md of an output checkpoint (Hugging Face front matter, then Markdown).

    ``launch``/``vllm_launch``: per GPU family, SGLang's and vLLM's commands (:func:`default_launch`,
    :func:`vllm_default_launch`), shown for the engines in ``engines``; ``not_for``: per engine the
    output is not made for, why (one line); ``source``: what was converted, as given (default ``base_model``,
    the Hub id the front matter names); ``draft``: what the card says of the drafter (:func:`draft_lines`).
    """
    serves = []
    if eng.SGLANG in engines:
        serves += [
            f"## Serving with {eng.SGLANG_LABEL}", "",
            "One server per GPU family. The environment variables are part of the command: SGLang cannot "
            "tell every expert layout from the files alone.", "",
            *_launch_lines(launch),
        ]
    if eng.VLLM in engines and vllm_launch:
        limits = next((spec.get("limits", []) for spec in vllm_launch.values() if spec.get("argv")), [])
        serves += [
            f"## Serving with {eng.VLLM_LABEL}", "",
            "The flags are vLLM's own DeepSeek-V4-Flash recipe (FP8 KV cache, 256-token blocks, tensor plus expert "
            "parallel); vLLM reads the expert format from `config.json` (`expert_dtype`, `quantization_config`), so "
            "no environment is needed.", "",
            *_launch_lines(vllm_launch),
            *_limit_lines([*limits, *COMMON_LIMITS]),
        ]
    lines = [
        *_front_matter(variant, base_model, engines, source_meta or {}),
        "",
        f"# DeepSeek-V4-Flash, {variant} variant",
        "",
        f"Converted from `{source or base_model}` by dsv4convert with the recipe `{recipe_name}`. Tensors the recipe "
        "does not convert are copied byte for byte.",
        "",
        *_engine_lines(engines, not_for or {}),
        "",
        "## Formats per role",
        "",
        *_formats_table(formats_by_role),
        "",
        "## Conversion statistics",
        "",
        *_stats_lines(stats),
        "",
        *(draft or []),
        *serves,
        *(model_card_lines(variant, next((spec["env"] for spec in launch.values() if spec.get("argv")), {}))
          if eng.SGLANG in engines else []),
        *upload_lines(model_dir),
        "## Recipe",
        "",
        "```yaml",
        recipe_text.rstrip("\n"),
        "```",
        "",
    ]
    if not (source_meta or {}).get("license"):
        lines.insert(lines.index(f"# DeepSeek-V4-Flash, {variant} variant") + 2,
                     "License: the base model's; the source had no model card to read it from, so check "
                     f"https://huggingface.co/{base_model} before publishing.\n")
    return "\n".join(lines)
