"""Check reports: JSON on disk, a recall heatmap, and side-by-side deltas between two runs."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from dsv4convert.errors import FormatError
from dsv4convert.serve.accuracy import recoveries, recovery_lines
from dsv4convert.serve.defaults import DEFAULT_MIN_RECOVERY
from dsv4convert.serve.mtp import compare_lines

REPORT_VERSION = 1
REPORT_KINDS = ("recall", "speed", "accuracy", "mtp")


def write_report(path: Path, kind: str, meta: dict[str, Any], body: dict[str, Any]) -> dict[str, Any]:
    """Write atomically (a temporary name, then a rename): a crash never leaves half a report."""
    report = {"version": REPORT_VERSION, "kind": kind, "meta": meta, **body}
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(report, indent=2))
    os.replace(partial, path)
    return report


def read_report(path: Path) -> dict[str, Any]:
    try:
        report = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise FormatError(f"cannot read report: {exc}", file=path) from exc
    if not isinstance(report, dict) or report.get("kind") not in REPORT_KINDS:
        raise FormatError(f"not a dsv4convert serve report (kind must be one of {', '.join(REPORT_KINDS)})", file=path)
    return report


def write_heatmap(summary: dict[str, Any], path: Path, title: str) -> None:
    """Accuracy per (context length, needle depth), green = retrieved every time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = summary["cells"]
    lengths = sorted({c["length"] for c in cells})
    depths = sorted({c["depth"] for c in cells})
    grid = [[float("nan")] * len(lengths) for _ in depths]
    for cell in cells:
        grid[depths.index(cell["depth"])][lengths.index(cell["length"])] = cell["accuracy"]
    figure, axes = plt.subplots(figsize=(1.0 + 0.9 * len(lengths), 1.2 + 0.45 * len(depths)))
    image = axes.imshow(grid, cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto", origin="upper")
    axes.set_xticks(range(len(lengths)), [_tokens(n) for n in lengths])
    axes.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths])
    axes.set_xlabel("context length (tokens)")
    axes.set_ylabel("needle depth")
    axes.set_title(title)
    for row, depth_values in enumerate(grid):
        for column, value in enumerate(depth_values):
            if value == value:  # not NaN
                axes.text(column, row, f"{value:.2f}", ha="center", va="center", fontsize=7)
    figure.colorbar(image, ax=axes, label="exact retrieval rate")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)


def _tokens(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def _delta(new: float | None, old: float | None, fmt: str) -> str:
    if new is None or old is None:
        return f"{_fmt(old, fmt):>10} {_fmt(new, fmt):>10} {'n/a':>10}"
    return f"{old:>10{fmt}} {new:>10{fmt}} {new - old:>+10{fmt}}"


def _fmt(value: float | None, fmt: str) -> str:
    return "n/a" if value is None else format(value, fmt)


def compare(base: dict[str, Any], other: dict[str, Any], *, min_recovery: float | None = None) -> list[str]:
    """Lines of a side-by-side table: base, other and other - base, for every figure both have
    (accuracy reports: recovery per task, judged against ``min_recovery``)."""
    if base["kind"] != other["kind"]:
        raise FormatError(f"cannot compare a {base['kind']} report with a {other['kind']} report")
    header = [f"base:  {base['meta'].get('model')} ({base['meta'].get('variant')})",
              f"other: {other['meta'].get('model')} ({other['meta'].get('variant')})",
              f"{'':34} {'base':>10} {'other':>10} {'delta':>10}"]
    if base["kind"] == "recall":
        return header + _compare_recall(base["summary"], other["summary"])
    if base["kind"] == "mtp":
        return header + compare_lines(base["summary"], other["summary"])
    if base["kind"] == "accuracy":
        minimum = DEFAULT_MIN_RECOVERY if min_recovery is None else min_recovery
        return header[:2] + recovery_lines(recoveries(base, other), minimum)
    return header + _compare_speed(base["results"], other["results"])


def _compare_recall(base: dict[str, Any], other: dict[str, Any]) -> list[str]:
    lines = [f"{'accuracy (all cells)':34} {_delta(other['accuracy'], base['accuracy'], '.3f')}"]
    base_cells = {(c["length"], c["depth"]): c["accuracy"] for c in base["cells"]}
    for cell in other["cells"]:
        key = (cell["length"], cell["depth"])
        if key in base_cells and cell["accuracy"] != base_cells[key]:
            label = f"accuracy {_tokens(key[0])} @ {key[1]:.0%}"
            lines.append(f"{label:34} {_delta(cell['accuracy'], base_cells[key], '.3f')}")
    base_layers = {entry["layer"]: entry for entry in base.get("indexer_layers", [])}
    for entry in other.get("indexer_layers", []):
        if entry["layer"] in base_layers:
            label = f"layer {entry['layer']} needle selected"
            lines.append(f"{label:34} {_delta(entry['selected_rate'], base_layers[entry['layer']]['selected_rate'], '.3f')}")
    return lines


def _compare_speed(base: list[dict[str, Any]], other: list[dict[str, Any]]) -> list[str]:
    def key(result: dict[str, Any]) -> tuple[int, int, int]:
        return result["input_len"], result["output_len"], result["concurrency"]

    base_by_case = {key(r): r for r in base}
    lines = []
    for result in other:
        if key(result) not in base_by_case:
            continue
        old = base_by_case[key(result)]
        case = f"in {result['input_len']} out {result['output_len']} c{result['concurrency']}"
        for field, label in (("output_throughput", "tok/s"), ("median_ttft_ms", "TTFT ms"),
                             ("median_tpot_ms", "TPOT ms"), ("median_itl_ms", "ITL ms")):
            lines.append(f"{case + ' ' + label:34} {_delta(result[field], old[field], '.1f')}")
    return lines
