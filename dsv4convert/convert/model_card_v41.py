"""The README.md model card of a DeepSeek-V4.1 conversion.

What a downloader needs before 500 GB move: what was converted and how (per role: the experts' format, what is the
release's bytes, the Engram tables and the tokenizer above all), which engines run it on which GPU family, the exact
commands per engine (absolute model path) on the usual machines, 8x RTX PRO 6000, 8x H200 and 8x B200, each sized
as ``fit`` sizes it with the Engram placement ``serve --engram auto`` chooses, and the ``validate`` line that proves
it. The commands are the ones ``serve`` renders: the same server objects
(``engines/sglang/server.py::server_v41``, ``engines/vllm/server.py::vllm_launch_v41``), the same placement choice
(``engines/sglang/memory_v41.py::choose_placement``); an engine that refuses the variant on a family is named with
its reason, never offered.
"""

from __future__ import annotations

import hashlib
import json
import shlex
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from dsv4convert import __version__
from dsv4convert import engines as eng
from dsv4convert.convert.model_card import base_model_id, shell_line, source_card_metadata, upload_lines
from dsv4convert.convert.plan import human_bytes
from dsv4convert.engines.config import v41_families
from dsv4convert.engines.memory import gib
from dsv4convert.engines.sglang import memory_v41 as sglang_sizing
from dsv4convert.engines.sglang.server import server_v41
from dsv4convert.engines.vllm import memory_v41 as vllm_sizing
from dsv4convert.engines.vllm.server import VLLM_ENGRAM_DEFAULT, vllm_launch_v41
from dsv4convert.errors import DSV4Error
from dsv4convert.models.deepseek_v4.layout import Drafter, TensorSpec
from dsv4convert.models.deepseek_v41.config import V41Config

GPUS_PER_MACHINE = 8
BASE_MODEL = "deepseek-ai/DeepSeek-V4.1-Flash"   # what the front matter names where the source is no Hub id
# What each of the converter's actions (engines/outputs_v41.py::action_of) does to a module, in a reader's words.
ACTIONS = {
    "keep": "the release's bytes",
    "nvfp4": "MXFP4 -> NVFP4 group 16 (E2M1 codes kept, scales rewritten), ModelOpt's layout",
    "fp8": "MXFP4 -> FP8 E4M3 in 32x32 blocks, E8M0 scales",
    "int4": "MXFP4 -> INT4 W4A16 (compressed-tensors pack-quantized)",
    "bf16": "MXFP4 -> BF16 (exact)",
    "dequant": "FP8 32x32 -> BF16 (exact)",
}


@dataclass(frozen=True)
class V41Card:
    """What a V4.1 card says, gathered by the converter."""

    dst: Path
    src: str
    variant: str
    recipe: str
    engines: tuple[str, ...]
    config: dict                              # the output's config.json
    cfg: V41Config
    tensors: list[TensorSpec]                 # the output's, from its headers
    actions: Counter                          # (role, action) -> modules
    stored: dict[str, Counter]                # role -> dtype -> tensors (the output's)
    stats: dict
    not_for: dict[str, str]                   # engine -> why the output is not made for it


def _machine(family: str) -> eng.Gpu:
    return eng.gpu_of_family(family)


def sglang_section(card: V41Card, family: str) -> list[str]:
    """One machine's SGLang lines: the single-server command at TP 8 with the drafter where the config announces it,
    the Engram placement fit chooses and its sizing, and PD 4+4's verdict; or why SGLang does not run it there."""
    gpu = _machine(family)
    problem = v41_families(card.variant)[eng.SGLANG][family]
    if problem:
        return [f"{eng.SGLANG_LABEL} does not run this checkpoint on {gpu.name}: {problem}.", ""]
    dspark = card.cfg.dspark
    draft = {"mtp": True, "drafter": Drafter.DSPARK, "dspark_block_size": dspark.block_size} if dspark else {}
    model = str(card.dst.resolve())

    def settings(role: str, tp: int, placement: str = "gpu"):
        return server_v41(model, family, variant=card.variant, role=role, tp=tp, engram=placement, **draft)

    single = sglang_sizing.choose_placement(card.cfg, card.tensors, gpu, [settings("server", GPUS_PER_MACHINE)])
    half = GPUS_PER_MACHINE // 2
    pd = sglang_sizing.choose_placement(card.cfg, card.tensors, gpu,
                                        [settings("prefill", half), settings("decode", half)])
    lines = []
    if single.placement is None:
        lines += [f"One server of {GPUS_PER_MACHINE} does not fit: {single.why()}.", ""]
    else:
        server = settings("server", GPUS_PER_MACHINE, single.placement)
        env = {**server.environment(), "CUDA_VISIBLE_DEVICES": ",".join(map(str, range(GPUS_PER_MACHINE)))}
        (fit,) = single.fits[single.placement]
        lines += ["```bash", shell_line({"argv": server.command("python"), "env": env}), "```", "",
                  f"Sized by `dsv4convert fit` for this command: {gib(fit.weights_bytes_per_rank)} per GPU "
                  f"(Engram tables: {single.placement}), {fit.kv_tokens:,} KV tokens. Engram placement, fit's choice "
                  f"(`serve --engram auto`): {single.why()}.", ""]
    pd_verdict = (f"fits with the Engram tables {pd.placement}: {pd.why()}" if pd.placement
                  else f"does not fit: {pd.why()}")
    lines += [f"PD {half}+{half} (`dsv4convert serve --model {shlex.quote(model)} --pd`): {pd_verdict}.", ""]
    return lines


def vllm_section(card: V41Card, family: str) -> list[str]:
    """One machine's vLLM lines: ``vllm serve`` with the drafter at the largest TP up to 8 that vLLM shards this
    checkpoint's Engram tables over (whole hash heads per rank: 8 for the release), sized with vLLM's default Engram
    placement; or why vLLM does not load it there."""
    gpu = _machine(family)
    model = str(card.dst.resolve())
    dspark = card.cfg.dspark
    refused = None
    for tp in (GPUS_PER_MACHINE, 4, 2, 1):
        try:
            plan = vllm_launch_v41(model, card.variant, card.config.get("quantization_config"), family, tp,
                                   dspark_block_size=dspark.block_size if dspark else None, engram=VLLM_ENGRAM_DEFAULT)
            fit = vllm_sizing.size_server(card.cfg, card.tensors, gpu, tp, VLLM_ENGRAM_DEFAULT, mtp=dspark is not None)
            break
        except DSV4Error as exc:   # what vLLM refuses for this checkpoint at this TP on this family
            refused = refused or exc.detail
    else:
        return [f"Not offered: {refused}.", ""]
    lines = [f"TP {tp}: {refused}.", ""] if tp != GPUS_PER_MACHINE else []
    lines += ["```bash", shlex.join(plan.mtp_argv or plan.argv), "```", "",
              f"Sized by `dsv4convert fit --engine vllm --tp {tp}`: {gib(fit.weights_bytes_per_rank)} per GPU, at most "
              f"{fit.kv_tokens:,} KV tokens (before vLLM's profiled activation peak); Engram tables in pinned host "
              f"memory, {gib(fit.engram_host_bytes_per_process)} per rank (vLLM's default, `EngramConfig.cpu_offload`)."
              + ("" if fit.fits else " It does not fit: `dsv4convert fit --engine vllm` gives every term."), ""]
    return lines


def _roles_table(card: V41Card) -> list[str]:
    lines = ["| role | modules: what the conversion did | stored as (tensors) |", "|---|---|---|"]
    for role in sorted({role for role, _ in card.actions}):
        did = ", ".join(f"{n:,} {ACTIONS[action]}" for (r, action), n in sorted(card.actions.items()) if r == role)
        stored = ", ".join(f"{dtype} x{n:,}" for dtype, n in sorted(card.stored.get(role, Counter()).items()))
        lines.append(f"| {role} | {did} | {stored} |")
    return lines


def _kept_lines(card: V41Card) -> list[str]:
    """The release's bytes a reader most needs to know were not touched: the Engram tables and the tokenizer."""
    engram = [t for t in card.tensors if ".engram.embed." in t.name]
    lines = [f"- Engram tables, byte for byte ({human_bytes(sum(t.nbytes for t in engram))}; both engines build "
             "them as FP8 rows with 1x32 E8M0 scales whatever the quantization_config): "
             + ", ".join(f"`{t.name}` {t.dtype} {list(t.shape)}" for t in engram) + "."]
    tokenizer = card.dst / "tokenizer.json"
    if tokenizer.is_file():
        digest = hashlib.sha256(tokenizer.read_bytes()).hexdigest()
        lines.append(f"- `tokenizer.json`, byte for byte (sha256 `{digest}`): both engines rebuild the Engram hasher's "
                     f"compressed map from it ({card.cfg.engram_compressed_vocab_size:,} ids).")
    lines.append("- `config.json`: `text_config` and `vision_config` as released; only `quantization_config` "
                 "rewritten" + (" (none: every linear BF16)." if card.variant == "bf16" else "."))
    return lines


def _front_matter(card: V41Card, base_model: str, meta: dict) -> list[str]:
    lines = ["---", f"base_model: {json.dumps(base_model)}", "base_model_relation: quantized",
             "library_name: transformers", "pipeline_tag: image-text-to-text"]
    if meta.get("license"):
        lines += [f"{k}: {json.dumps(str(meta[k]))}" for k in ("license", "license_name", "license_link")
                  if meta.get(k)]
    else:
        lines += ["license: other", 'license_name: "base-model-license"',
                  f"license_link: {json.dumps(f'https://huggingface.co/{base_model}')}"]
    tags = ["deepseek_v41", card.variant, "quantized", *card.engines, "dsv4convert"]
    return [*lines, "tags:", *[f"- {json.dumps(t)}" for t in dict.fromkeys(tags)], "---"]


def render(card: V41Card) -> str:
    """The card's text (front matter, then Markdown)."""
    root = Path(card.src)
    base_model = base_model_id(card.src, root, BASE_MODEL)
    meta = source_card_metadata(root) if root.is_dir() else {}
    made = " and ".join(eng.LABELS[e] for e in card.engines)
    exact = (f"; {card.stats['blocks_exact']:,} of {card.stats['blocks_total']:,} expert blocks decode to exactly "
             "the release's values" if card.stats.get("blocks_total") else "")
    lines = [*_front_matter(card, base_model, meta), "",
             f"# DeepSeek-V4.1-Flash, {card.variant} variant", "",
             f"Converted from `{card.src}` by dsv4convert {__version__} with the shipped recipe `{card.recipe}`: "
             f"{card.stats.get('converted', 0):,} modules converted, {card.stats.get('kept', 0):,} kept byte for "
             f"byte{exact}. Made for {made} (`--engine {eng.choice_of(card.engines)}`)."]
    for engine, why in card.not_for.items():
        lines += ["", f"Not for {eng.LABELS[engine]}: {why}"]
    lines += ["", "## What was converted, per role", "", *_roles_table(card), "", "Kept as released:", "",
              *_kept_lines(card), ""]
    if not meta.get("license"):
        lines += [f"License: the base model's; check https://huggingface.co/{base_model} before publishing.", ""]
    for engine, section in ((eng.SGLANG, sglang_section), (eng.VLLM, vllm_section)):
        if engine not in card.engines:
            continue
        lines += [f"## Serving with {eng.LABELS[engine]}", "",
                  f"One server per machine, as `dsv4convert serve --model {shlex.quote(str(card.dst.resolve()))}"
                  + ("` starts it; the environment is part of the command." if engine == eng.SGLANG
                     else " --engine vllm --dry-run` prints it; the drafter by `--speculative-config`."), ""]
        for family in eng.GPU_FAMILIES:
            lines += [f"### {GPUS_PER_MACHINE}x {_machine(family).label}", "", *section(card, family)]
    lines += ["## Validate", "",
              "Every tensor, the tokenizer and the quantization_config each engine reads, and against the release "
              "every kept tensor byte for byte (the Engram tables' hashes in the report) and every converted module "
              "decoded:", "",
              "```bash", validate_line(card), "```", "", *upload_lines(card.dst.resolve())]
    return "\n".join(lines)


def validate_line(card: V41Card) -> str:
    src = Path(card.src)
    against = str(src.resolve()) if src.exists() else card.src
    return shlex.join(["dsv4convert", "validate", str(card.dst.resolve()), "--against", against])

