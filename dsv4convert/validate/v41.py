"""``validate`` for DeepSeek-V4.1 outputs: what both engines' loaders would do with it, proved from its files.

Neither engine refuses a V4.1 checkpoint with a tensor missing (SGLang warns, vLLM tracks weights only for
unquantized models) and both ``copy_`` a wrong-dtype Engram table into their FP8 parameter
(../shared/reference/v41-flash.md section 9.3), so completeness and bytes are proved here, as
``validate/sglang_load.py`` does for V4; ``tests/test_v41_convert.py`` runs SGLang 0.5.23's and vLLM 0.33.0's real
V4.1 models and DSpark drafts on every output and finds what this says:

* every tensor the variant's layout has, of its dtype and shape, and no other (``engines/outputs_v41.py::expected_outputs``):
  each reaches a parameter, and every parameter is written; the halves both engines fuse (``wq_a`` + ``wkv``, shared
  ``w1`` + ``w3``, the compressor's ``wkv`` + ``wgate``: ``engines/stored.py::V41_FUSED_PAIRS``) of one dtype;
* the tokenizer beside the weights, whose compressed vocabulary both engines' Engram hashers check
  (``release.check_tokenizer``);
* the ``quantization_config`` SGLang needs for the variant (``engines/sglang/quant_config.py::v41_quant_config``),
  and for each engine the output is made for, that it reads it as that variant (``v41_problem``), and per GPU family
  whether the engine runs it there;
* with ``--against SRC``: ``text_config`` and ``vision_config`` unchanged, every tensor the variant keeps byte for
  byte (hashed in chunks: the Engram tables with flat memory), every converted module decoded on both sides and
  compared (all of V4.1's transcodes are exact).
"""

from __future__ import annotations

import hashlib
import math
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from dsv4convert.checkpoint import Checkpoint, TensorEntry, atomic_write_bytes, atomic_write_json, read_tensor
from dsv4convert.convert.v41 import check_source, handles
from dsv4convert.engines import ENGINES, LABELS
from dsv4convert.engines.config import v41_families, v41_variant_of
from dsv4convert.engines.outputs_v41 import action_of, layout_problems
from dsv4convert.engines.sglang.quant_config import v41_problem as sglang_problem
from dsv4convert.engines.sglang.quant_config import v41_quant_config
from dsv4convert.engines.vllm.quant_config import v41_problem as vllm_problem
from dsv4convert.errors import DSV4Error
from dsv4convert.formats import Format, dequantize_fp8_block, error_metrics, spec
from dsv4convert.models.deepseek_v41 import inventory
from dsv4convert.models.deepseek_v41 import release as v41
from dsv4convert.models.deepseek_v41.config import V41Config

__all__ = ["handles", "validate_v41"]


def _decoded(ckpt: Checkpoint, module: str, cfg: V41Config) -> torch.Tensor:
    """A linear module of a V4.1 checkpoint as float32, whatever it is stored in."""
    names = {n.rpartition(".")[2]: ckpt.tensors[n] for n in ckpt.tensors if n.rpartition(".")[0] == module}
    tensors = {p: read_tensor(e) for p, e in names.items()}
    weight = names.get("weight")
    if weight is not None and weight.dtype == "BF16":
        return tensors["weight"].float()
    if "weight_packed" in names:
        return spec(Format.INT4).decode(tensors, f"{module}.weight", {})
    if "weight_scale" in names:
        return spec(Format.NVFP4).decode(tensors, f"{module}.weight", {})
    if weight.dtype == "F8_E4M3":
        return dequantize_fp8_block(tensors["weight"], tensors["scale"], block=cfg.fp8_block,
                                    name=f"{module}.weight")
    return spec(Format.MXFP4).decode(tensors, f"{module}.weight", {})


def validate_v41(ckpt: Checkpoint, *, against: str | Path | None, report_dir: Path, progress: bool = True) -> dict:
    """Validate a V4.1 output (module docstring); the summary ``validate``'s command line prints, and reports."""
    t0 = time.monotonic()
    source = str(ckpt.root / "config.json")
    cfg = v41.read_config(ckpt.config, source)
    variant = v41_variant_of(ckpt.config)
    problems: list[str] = []
    qc = ckpt.config.get("quantization_config")
    group = (((qc or {}).get("config_groups") or {}).get("group_0") or {}).get("weights", {}).get("group_size", 32)
    problems += layout_problems(ckpt.tensors.values(), cfg, variant, group)
    try:
        v41.check_tokenizer(ckpt.root, cfg)
    except DSV4Error as exc:
        problems.append(str(exc))
    claimed = list((qc or {}).get("producer", {}).get("engines") or ENGINES)
    stated = {k: v for k, v in (qc or {}).items() if k != "producer"} if qc is not None else None
    src = Checkpoint.open(against) if against is not None else None
    if src is not None:
        check_source(src)
        wanted = v41_quant_config(src.config.get("quantization_config") or {}, variant, group)
        if stated != wanted:
            problems.append(f"config.json: quantization_config is {stated}; SGLang reads a {variant} DeepSeek-V4.1 "
                            f"by {wanted}")
        for key in ("text_config", "vision_config"):
            if ckpt.config.get(key) != src.config.get(key):
                problems.append(f"config.json: {key} differs from the source's")
    engine_checks = {"sglang": sglang_problem(stated, variant), "vllm": vllm_problem(stated, variant)}
    families = v41_families(variant)
    for engine in claimed:
        if engine_checks.get(engine):
            problems.append(f"config.json: made for {LABELS[engine]}, which cannot load it: {engine_checks[engine]}")
        if all(families[engine].values()):
            problems.append(f"made for {LABELS[engine]}, which runs it on no GPU family")
    compared = _compare(ckpt, src, cfg, variant, progress, problems) if src is not None else None
    summary = {
        "release": v41.NAME, "variant": variant, "against": str(against) if against is not None else None,
        "integrity_ok": not problems, "integrity_problems": problems, "engines": claimed,
        "engine_checks": engine_checks,
        "families": {e: {f: "cannot load it" if engine_checks[e] else (why or "runs") for f, why in fams.items()}
                     for e, fams in families.items()},
        "tensors": len(ckpt.tensors), "sglang_note": None, "below_threshold": [], "fail_below_snr_db": None,
        "modules": compared["modules"] if compared else 0, "exact_modules": compared["exact"] if compared else 0,
        "worst_snr_db": compared["worst_snr_db"] if compared else math.inf,
        "kept_identical": compared["kept"] if compared else None,
        "engram_sha256": compared["engram"] if compared else None, "seconds": time.monotonic() - t0,
    }
    summary["passed"] = summary["integrity_ok"]
    _write(report_dir, summary)
    return summary


def _compare(ckpt: Checkpoint, src: Checkpoint, cfg: V41Config, variant: str, progress: bool,
             problems: list[str]) -> dict:
    """Kept tensors byte for byte (hashed in chunks), converted modules decoded and compared exactly."""
    kept, converted, engram, lossy, worst = 0, {}, {}, {}, math.inf
    bar = tqdm(total=src.total_bytes, unit="B", unit_scale=True, desc="validate", disable=not progress,
               file=sys.stderr)
    for name, entry in src.tensors.items():
        module, _, param = name.rpartition(".")
        linear = param in ("weight", "scale") and f"{module}.scale" in src.tensors
        action = action_of(inventory.role_of(name), linear, variant)
        bar.update(entry.nbytes)
        if action != "keep":
            converted[module] = None
            if action == "int4":
                lossy[module] = True
            continue
        out = ckpt.tensors.get(name)
        if out is None:
            continue   # named as missing by the integrity check
        digest = digest_of(entry)
        if (out.dtype, out.shape) != (entry.dtype, entry.shape) or digest_of(out) != digest:
            problems.append(f"{out.path.name}: {name}: kept by a {variant} output but its bytes differ from the "
                            "source's")
        else:
            kept += 1
        if inventory.role_of(name) == "engram_table":
            engram[name] = digest
    bar.close()
    exact = 0
    for module in converted:
        if f"{module}.weight" not in ckpt.tensors and f"{module}.weight_packed" not in ckpt.tensors:
            continue   # named as missing by the integrity check
        got, want = _decoded(ckpt, module, cfg), _decoded(src, module, cfg)
        if torch.equal(got, want):
            exact += 1
        elif module not in lossy:
            problems.append(f"{module}: its {variant} weight decodes to other values than the source's")
        else:
            worst = min(worst, error_metrics(want, got, name=f"{module}.weight").snr_db)
    return {"kept": kept, "modules": len(converted), "exact": exact, "engram": engram, "worst_snr_db": worst}


def digest_of(entry: TensorEntry, chunk: int = 64 << 20) -> str:
    """sha256 of a tensor's bytes, read in chunks (flat memory, whatever its size)."""
    h = hashlib.sha256()
    with open(entry.path, "rb") as f:
        f.seek(entry.start)
        left = entry.nbytes
        while left:
            piece = f.read(min(chunk, left))
            if not piece:
                raise DSV4Error("truncated", file=entry.path, tensor=entry.name)
            h.update(piece)
            left -= len(piece)
    return h.hexdigest()



def _write(out: Path, summary: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "validate.json", {k: (None if isinstance(v, float) and math.isinf(v) else v)
                                              for k, v in summary.items()})
    lines = [f"# validate: DeepSeek-V4.1 {summary['variant']}", "",
             f"integrity: {'OK' if summary['integrity_ok'] else 'FAILED'} ({summary['tensors']} tensors)"]
    lines += [f"- {p}" for p in summary["integrity_problems"]]
    if summary["against"]:
        lines += ["", f"against {summary['against']}: {summary['kept_identical']} tensors kept byte for byte, "
                      f"{summary['exact_modules']}/{summary['modules']} converted modules exact"]
        lines += [f"- {name}: sha256 {digest}" for name, digest in (summary["engram_sha256"] or {}).items()]
    lines += ["", "| engine | " + " | ".join(next(iter(summary["families"].values()))) + " |",
              "|---|" + "---|" * len(next(iter(summary["families"].values())))]
    lines += [f"| {LABELS[e]} | " + " | ".join(fams.values()) + " |" for e, fams in summary["families"].items()]
    atomic_write_bytes(out / "validate.md", ("\n".join(lines) + "\n").encode("utf-8"))
