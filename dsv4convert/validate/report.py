"""Validation reports: JSON for machines, Markdown for people, PNG plots of SNR per layer.

The Markdown puts the worst modules first and aggregates per role; a module whose error
is over 1.5x the median of its role and format is flagged, as formats.md §7 suggests.
"""

from __future__ import annotations

import json
import math
import statistics
import textwrap
from collections import defaultdict
from pathlib import Path

from dsv4convert.checkpoint import atomic_write_bytes, atomic_write_json
from dsv4convert.engines import LABELS as ENGINE_VERSIONS
from dsv4convert.engines import SGLANG_LABEL
from dsv4convert.models.deepseek_v4.names import in_draft
from dsv4convert.validate.layer_error import ModuleError


def _fmt_db(x: float) -> str:
    return "exact" if math.isinf(x) else f"{x:.2f}"


def role_aggregates(errors: list[ModuleError]) -> list[dict]:
    groups: dict[tuple, list[ModuleError]] = defaultdict(list)
    for e in errors:
        groups[(e.role, e.source_format, e.format)].append(e)
    rows = []
    for (role, src, dst), items in sorted(groups.items()):
        finite = [e.snr_db for e in items if not math.isinf(e.snr_db)]
        out_finite = [e.output_snr_db for e in items if not math.isinf(e.output_snr_db)]
        rows.append({
            "role": role, "conversion": f"{src} -> {dst}", "modules": len(items),
            "exact": sum(e.exact for e in items),
            "min_snr_db": min(finite) if finite else math.inf,
            "median_snr_db": statistics.median(finite) if finite else math.inf,
            "min_output_snr_db": min(out_finite) if out_finite else math.inf,
            "max_rel_fro": max(e.rel_fro for e in items),
        })
    return rows


def outliers(errors: list[ModuleError]) -> list[ModuleError]:
    groups: dict[tuple, list[ModuleError]] = defaultdict(list)
    for e in errors:
        groups[(e.role, e.format)].append(e)
    flagged = []
    for items in groups.values():
        errs = [e.rel_fro for e in items if e.rel_fro > 0]
        if len(errs) >= 4:
            median = statistics.median(errs)
            flagged += [e for e in items if e.rel_fro > 1.5 * median]
    return flagged


def write_reports(out_dir: Path, *, dst: str, src: str | None, variant: str, integrity: list[str],
                  errors: list[ModuleError], threshold: float | None, seconds: float, device: str,
                  sglang_env: dict[str, str] | None = None, sglang_note: str | None = None,
                  engines: list[str] | None = None, engine_checks: dict[str, str | None] | None = None) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    aggregates = role_aggregates(errors)
    below = [e for e in errors if threshold is not None and e.snr_db < threshold]
    summary = {
        "checkpoint": dst, "against": src, "variant": variant, "device": device, "seconds": round(seconds, 3),
        "integrity_ok": not integrity, "integrity_problems": integrity,
        "sglang_env": sglang_env, "sglang_note": sglang_note,
        "engines": engines or [], "engine_checks": engine_checks or {},
        "modules": len(errors), "exact_modules": sum(e.exact for e in errors),
        "worst_snr_db": min((e.snr_db for e in errors), default=math.inf),
        "fail_below_snr_db": threshold, "below_threshold": [e.module for e in below],
        "passed": not integrity and not below,
    }
    doc = {"summary": _json_safe(summary), "roles": _json_safe(aggregates), "modules": [e.as_dict() for e in errors]}
    atomic_write_json(out_dir / "validate.json", doc)
    atomic_write_bytes(out_dir / "validate.md", _markdown(summary, aggregates, errors).encode("utf-8"))
    if errors:
        _plot(out_dir / "snr_per_layer.png", errors)
    return summary


def layer_error_line(summary: dict) -> str:
    """The per-layer error in words; without a source there is none, and "0/0 bit-exact" would read as a pass."""
    if summary["against"] is None:
        return ("per-layer error not measured: no reference given (--against SRC compares every module with the "
                "checkpoint it was made from)")
    worst = summary["worst_snr_db"]
    return (f"{summary['exact_modules']}/{summary['modules']} modules bit-exact against the source, worst weight SNR "
            + ("exact" if math.isinf(worst) else f"{worst:.2f} dB"))


def engine_line(summary: dict) -> str:
    """Which engines the output is for and checked for, and why another engine would not load it."""

    claimed = summary.get("engines") or []
    checks = summary.get("engine_checks") or {}
    parts = [f"for {' and '.join(ENGINE_VERSIONS[e] for e in claimed)}" if claimed else "for no engine"]
    for engine, problem in checks.items():
        state = "loads it" if problem is None else f"cannot load it ({problem})"
        parts.append(f"{ENGINE_VERSIONS[engine]} {state}{'' if engine in claimed else ' [not claimed]'}")
    return "; ".join(parts)


def _json_safe(obj):
    if isinstance(obj, float) and math.isinf(obj):
        return "inf"
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_json_safe(v) for v in obj]
    return obj


def _markdown(summary: dict, aggregates: list[dict], errors: list[ModuleError]) -> str:
    lines = [f"# Validation of `{summary['checkpoint']}`", ""]
    lines.append(f"- variant: **{summary['variant']}**, against `{summary['against']}`, on {summary['device']}, "
                 f"{summary['seconds']:.1f} s")
    verdict = "PASSED" if summary["passed"] else "FAILED"
    lines.append(f"- result: **{verdict}**; integrity {'OK' if summary['integrity_ok'] else 'FAILED'}; "
                 f"{layer_error_line(summary)}")
    for problem in summary["integrity_problems"][:20]:
        lines.append(f"  - integrity: {problem}")
    lines.append(f"- engines: {engine_line(summary)}")
    if summary.get("sglang_note"):
        lines.append(f"- {SGLANG_LABEL}: {summary['sglang_note']}")
    if summary["fail_below_snr_db"] is not None:
        lines.append(f"- threshold {summary['fail_below_snr_db']} dB: {len(summary['below_threshold'])} modules below")
    lines += ["", "## Per role", "", "| role | conversion | modules | bit-exact | min SNR dB | median SNR dB | "
              "min output SNR dB | max rel. error |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in aggregates:
        lines.append(f"| {r['role']} | {r['conversion']} | {r['modules']} | {r['exact']} | {_fmt_db(r['min_snr_db'])} | "
                     f"{_fmt_db(r['median_snr_db'])} | {_fmt_db(r['min_output_snr_db'])} | {r['max_rel_fro']:.3g} |")
    worst = sorted((e for e in errors if not e.exact), key=lambda e: e.snr_db)[:25]
    flagged = {e.module for e in outliers(errors)}
    lines += ["", "## Worst modules", ""]
    if not worst:
        lines.append("Every compared module is bit-exact against the source.")
    else:
        lines += ["| module | conversion | SNR dB | output SNR dB | cosine | max abs | flag |", "|---|---|---:|---:|---:|---:|---|"]
        for e in worst:
            flag = "> 1.5x median error" if e.module in flagged else ""
            lines.append(f"| `{e.module}` | {e.source_format} -> {e.format} | {_fmt_db(e.snr_db)} | "
                         f"{_fmt_db(e.output_snr_db)} | {e.cosine:.6f} | {e.max_abs:.3g} | {flag} |")
    lines += ["", "Output SNR: the converted weight through the serving-style fused kernel on synthetic probe "
              "activations, against an FP32 matmul with the source weight (FP8 weights include FP8 activation "
              "quantization).", ""]
    return "\n".join(lines)


def _plot(path: Path, errors: list[ModuleError]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_role: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for e in errors:
        if e.block is not None:
            by_role[e.role][e.block].append(e.snr_db)
    blocks = sorted({b for layers in by_role.values() for b in layers},
                    key=lambda b: (in_draft(b), int(b.split(".")[1])))
    x_of = {b: i for i, b in enumerate(blocks)}
    cap = 100.0
    # Roles that are bit-exact everywhere would all draw the same flat line at the cap: name them instead.
    exact = sorted(role for role, layers in by_role.items() if all(v == float("inf") for vs in layers.values()
                                                                    for v in vs))
    fig, ax = plt.subplots(figsize=(10, 5))
    for role, layers in sorted(by_role.items()):
        if role in exact:
            continue
        xs = sorted(layers, key=x_of.get)
        ax.plot([x_of[b] for b in xs], [min(min(layers[b]), cap) for b in xs], marker="o", label=role)
    step = max(1, len(blocks) // 24)
    ax.set_xticks(range(0, len(blocks), step), [blocks[i].replace("layers.", "") for i in range(0, len(blocks), step)],
                  rotation=90, fontsize=7)
    ax.set_xlabel("block (backbone layer number, then the draft's mtp.N)")
    ax.set_ylabel("worst weight SNR per block, dB")
    ax.set_title("Per-block weight SNR against the source")
    if exact:
        everything = len(exact) == len(by_role)
        note = "every module bit-exact" if everything else "bit-exact everywhere (not drawn): " + ", ".join(exact)
        ax.text(0.5 if everything else 0.01, 0.5 if everything else 0.02, textwrap.fill(note, 110),
                transform=ax.transAxes, fontsize=12 if everything else 7, ha="center" if everything else "left",
                va="center" if everything else "bottom")
    ax.grid(alpha=0.3)
    if len(exact) < len(by_role):
        ax.legend(fontsize=8)
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.partial.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)


def load_summary(path: Path) -> dict:
    return json.loads(Path(path).read_text())["summary"]
