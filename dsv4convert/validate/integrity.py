"""Integrity of a checkpoint: layout, index and shards, what SGLang would make of it, its config.

The layout check is ``inspect``'s (every tensor the layout and the variant require, with
the right dtype and shape; index and shard headers agree). ``sglang_load`` then names what
SGLang 0.5.23's loader would do silently with what is there (dropped, cast or missing expert
tensors, partial modules, mixed fused pairs, w1/w3 scalars that differ); its specific message
replaces inspect's generic one for the same module. The config check recomputes the
``quantization_config`` (and ``hf_quant_config.json``) that the stored formats call for and
compares it with what the checkpoint carries, so a stale or hand-edited config that SGLang would
misread is caught; last, the model card's launch commands must set the ``SGLANG_DSV4_FP4_EXPERTS``
value the checkpoint needs.

Engines: the output says which engines it is for (``quantization_config.producer.engines``, else
``provenance.json``'s ``engines``; an output that says neither was made for SGLang, as every output
before vLLM support was). Each engine's rules are run on the stored formats; an engine the output is
for that could not load it is an integrity failure naming the engine and module, and the config is
recomputed for exactly those engines.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from dsv4convert import engines as eng
from dsv4convert.checkpoint import Checkpoint
from dsv4convert.convert.modules import check_source_finite
from dsv4convert.engines.config import build_quant_config, servable_engines
from dsv4convert.errors import CheckpointError, DSV4Error, FormatError
from dsv4convert.inspection import Inspection
from dsv4convert.models.deepseek_v4.layout import try_classify
from dsv4convert.validate.sglang_load import (
    Fp4ExpertsSetting,
    fp4_experts_setting,
    model_card_problems,
    sglang_load_problems,
)


@dataclass
class Integrity:
    problems: list[str]
    fp4_experts: Fp4ExpertsSetting | None  # the SGLANG_DSV4_FP4_EXPERTS value to serve with (None: unservable)
    engines: tuple[str, ...] = (eng.SGLANG,)  # the engines the output says it is for
    engine_checks: dict[str, str | None] | None = None  # per engine: None if it loads the output, else why not


def claimed_engines(ckpt: Checkpoint) -> tuple[str, ...]:
    """The engines an output says it is for (see the module docstring)."""
    producer = (ckpt.config.get("quantization_config") or {}).get("producer") or {}
    named = producer.get("engines")
    if named is None:
        try:
            named = json.loads((ckpt.root / "provenance.json").read_text()).get("engines")
        except (OSError, ValueError, AttributeError):
            named = None
    if not isinstance(named, list) or not named or not set(named) <= set(eng.ENGINES):
        return (eng.SGLANG,)
    return tuple(e for e in eng.ENGINES if e in named)


def check_integrity(ckpt: Checkpoint, inspection: Inspection) -> Integrity:
    specific, covered = sglang_load_problems(ckpt, inspection)
    problems = specific + [p for p in _layout_problems(inspection) if _module_of(p) not in covered]
    formats = {m: (f.format, dict(f.params)) for m, f in inspection.modules.items() if f.format is not None}
    engines = claimed_engines(ckpt)
    if problems or inspection.variant == "native":
        return Integrity(problems, None if problems else fp4_experts_setting(ckpt, formats), engines)
    for module, (fmt, params) in formats.items():
        if fmt.value == "fp8":
            params["fp8_scale_dtype"] = ckpt.entry(f"{module}.scale").dtype
    checks = servable_engines(ckpt.config, formats)
    failing = [e for e in engines if checks[e] is not None]
    if failing:
        return Integrity([f"config: says it is for {eng.LABELS[e]}, which cannot load it: {checks[e]}"
                          for e in failing], None, engines, checks)
    try:
        expected, extras = build_quant_config(ckpt.config, formats, engines=engines)
    except DSV4Error as exc:
        return Integrity([f"config: the stored formats cannot be served: {exc}"], None, engines, checks)
    if expected.get("quantization_config") != ckpt.config.get("quantization_config"):
        problems.append(
            "config.json: quantization_config differs from what the stored formats need: expected "
            f"{json.dumps(expected.get('quantization_config'), sort_keys=True)[:400]}")
    if expected.get("expert_dtype") != ckpt.config.get("expert_dtype"):
        problems.append(
            f"config.json: expert_dtype is {json.dumps(ckpt.config.get('expert_dtype'))}, the stored formats need "
            f"{json.dumps(expected.get('expert_dtype'))} ({eng.VLLM_LABEL} reads the routed experts' format from it, a "
            "missing key meaning MXFP4; DeepSeek's inference code reads it too)")
    for name, obj in extras.items():
        path = ckpt.root / name
        if not path.exists():
            problems.append(f"{name}: missing")
        elif json.loads(path.read_text()) != obj:
            problems.append(f"{name}: differs from what the stored formats need")
    setting = fp4_experts_setting(ckpt, formats) if eng.SGLANG in engines else None
    if setting is not None:
        problems += model_card_problems(ckpt, setting)
    return Integrity(problems, setting, engines, checks)


def check_all_finite(ckpt: Checkpoint, which: str, progress=None) -> None:
    """Every tensor of ``ckpt`` is finite, read one at a time in bounded pieces (the layout check reads headers
    only): a NaN or Inf stops validation naming ``which`` checkpoint, its file and the tensor."""
    for shard in ckpt.shards:
        for entry in ckpt.tensors_in(shard):
            try:
                check_source_finite(entry)
            except FormatError:
                raise CheckpointError(f"holds NaN or Inf, in {which} {ckpt.root}", file=entry.path,
                                      tensor=entry.name) from None
            if progress is not None:
                progress(entry.nbytes)


def integrity_problems(ckpt: Checkpoint, inspection: Inspection) -> list[str]:
    return check_integrity(ckpt, inspection).problems


def _layout_problems(inspection: Inspection) -> list[str]:
    problems = [f"missing: {n}" for n in inspection.missing]
    problems += [f"unexpected: {n}: {why}" if (why := inspection.why_unexpected(n)) else f"unexpected: {n}"
                 for n in inspection.unexpected]
    problems += [f"mismatched: {n}" for n in inspection.mismatched]
    return problems + inspection.problems


def _module_of(problem: str) -> str | None:
    """The module an inspect problem is about ("missing: X.weight", "mismatched: X: ...")."""
    kind, _, rest = problem.partition(": ")
    if kind == "mismatched":
        return rest.split(":", 1)[0]
    if kind in ("missing", "unexpected"):
        name = rest.split(": ", 1)[0]      # an unexpected drafter tensor carries the reason after it
        info = try_classify(name)
        return info.module if info else name.rsplit(".", 1)[0]
    return None
