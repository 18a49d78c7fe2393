"""Integrity of a checkpoint: layout, index and shards, and the quantization config.

The layout check is ``inspect``'s (every tensor the layout and the variant require, with
the right dtype and shape; index and shard headers agree). The config check recomputes
the ``quantization_config`` (and ``hf_quant_config.json``) that the stored formats call for
and compares it with what the checkpoint carries, so a stale or hand-edited config that
SGLang would misread is caught.
"""

from __future__ import annotations

import json

from dsv4convert.checkpoint import Checkpoint
from dsv4convert.convert.quant_config import build_quant_config
from dsv4convert.errors import DSV4Error
from dsv4convert.inspection import Inspection


def integrity_problems(ckpt: Checkpoint, inspection: Inspection) -> list[str]:
    problems = [f"missing: {n}" for n in inspection.missing]
    problems += [f"unexpected: {n}" for n in inspection.unexpected]
    problems += [f"mismatched: {n}" for n in inspection.mismatched]
    problems += inspection.problems
    if problems or inspection.variant == "native":
        return problems
    formats = {m: (f.format, dict(f.params)) for m, f in inspection.modules.items() if f.format is not None}
    for module, (fmt, params) in formats.items():
        if fmt.value == "fp8":
            params["fp8_scale_dtype"] = ckpt.entry(f"{module}.scale").dtype
    try:
        expected, extras = build_quant_config(ckpt.config, formats)
    except DSV4Error as exc:
        return [f"config: the stored formats cannot be served by SGLang 0.5.23: {exc}"]
    if expected.get("quantization_config") != ckpt.config.get("quantization_config"):
        problems.append(
            "config.json: quantization_config differs from what the stored formats need: expected "
            f"{json.dumps(expected.get('quantization_config'), sort_keys=True)[:400]}")
    for name, obj in extras.items():
        path = ckpt.root / name
        if not path.exists():
            problems.append(f"{name}: missing")
        elif json.loads(path.read_text()) != obj:
            problems.append(f"{name}: differs from what the stored formats need")
    return problems
