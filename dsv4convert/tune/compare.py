"""The MoE's two GEMMs with the configs a server would pick, side by side.

For each batch size: SGLang's default config (no file), SGLang's shipped file where one exists
for the shape, and the tuned folder, each resolved by SGLang's own lookup; timed in alternating
rounds in one process (the GPU's clock drifts more between runs than tiles differ), after
checking that the tuned configs' whole sequence gives the default's output. Timed are the two
GEMMs as SGLang launches them for that pair (the gate/up GEMM writing expert-sorted rows when
the down config uses TMA): the activation, the FP8 requantization between them, the routing
alignment and the top-k sum do not depend on the configs, and on a server they are SGLang's
CUDA kernels, not the stand-ins run here. Where the tuned folder serves the shipped entries
themselves (the search keeps them unless a candidate beats them by its margin), the kernels are the
same launches: they are timed once and the ratio is 1 by identity, not by two noisy timings.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from dsv4convert.tune import sglang_moe
from dsv4convert.tune.device import Device
from dsv4convert.tune.problem import MoEProblem, TuneError
from dsv4convert.tune.space import Tile
from dsv4convert.tune.workload import SEQUENCE_TOLERANCE, Batch, relative_error, time_us

DECODE_BATCH_SIZES = range(1, 65)


def compare(problem: MoEProblem, device: Device, batches: dict[int, Batch], tuned_root: Path, *,
            rounds: int = 3, rep_ms: int = 20) -> list[dict]:
    """One row per batch size: each variant's configs, median microseconds, and the ratios."""
    has_shipped = sglang_moe.lookup(problem, None) is not None
    rows = []
    for m, batch in sorted(batches.items()):
        default = Tile.from_sglang(sglang_moe.default_config(problem, m))
        variants = {"default": (default, default)}
        if has_shipped:
            variants["shipped"] = tuple(Tile.from_sglang(c) for c in sglang_moe.served_configs(problem, None, m))
        variants["tuned"] = tuple(Tile.from_sglang(c) for c in sglang_moe.served_configs(problem, tuned_root, m))
        reference = batch.sequence(*variants["default"], 0).clone()
        error = relative_error(batch.sequence(*variants["tuned"], 0), reference)
        if error > SEQUENCE_TOLERANCE:
            raise TuneError(f"at batch size {m} the tuned configs' output differs from the default config's by "
                            f"{error:.3g} (tolerance {SEQUENCE_TOLERANCE})", file=tuned_root)
        same = {name: next(other for other in variants if variants[other] == pair) for name, pair in variants.items()}
        times: dict[str, list[float]] = {name: [] for name in variants if same[name] == name}
        calls = len(batch.routings)
        for _ in range(rounds):
            for name in times:
                up, down = variants[name]

                def run(batch=batch, up=up, down=down, calls=calls, reference=default):
                    return [batch.gemms(up, down, r, reference) for r in range(calls)]
                times[name].append(time_us(run, device, rep_ms, calls))
        times = {name: times[same[name]] for name in variants}
        row = {"batch_size": m, "error_vs_default": error,
               "same_as": {name: same[name] for name in variants if same[name] != name}}
        for name, (up, down) in variants.items():
            row[name] = {"up": up.to_sglang(), "down": down.to_sglang(), "us": statistics.median(times[name]),
                         "rounds_us": times[name]}
        row["speedup_vs_default"] = row["default"]["us"] / row["tuned"]["us"]
        if has_shipped:
            row["speedup_vs_shipped"] = row["shipped"]["us"] / row["tuned"]["us"]
        rows.append(row)
    return rows


def summary(rows: list[dict]) -> dict:
    """Mean speed-up over the default config at decode batch sizes (1-64), and the worst ratio to the shipped file."""
    decode = [r["speedup_vs_default"] for r in rows if r["batch_size"] in DECODE_BATCH_SIZES]
    shipped = [r["speedup_vs_shipped"] for r in rows if "speedup_vs_shipped" in r]
    return {"decode_mean_speedup_vs_default": statistics.mean(decode) if decode else None,
            "min_speedup_vs_shipped": min(shipped) if shipped else None,
            "slowest_vs_shipped_batch_size": (min(rows, key=lambda r: r["speedup_vs_shipped"])["batch_size"]
                                              if shipped else None)}


def table(rows: list[dict]) -> list[str]:
    """Markdown rows: per batch size each variant's microseconds and configs, and the ratios."""
    shipped = any("shipped" in r for r in rows)
    head = ["batch", "default us", *(["shipped us"] if shipped else []), "tuned us", "tuned vs default",
            *(["tuned vs shipped"] if shipped else []), "tuned up / down config"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [str(r["batch_size"]), f"{r['default']['us']:.1f}"]
        if shipped:
            cells.append(f"{r['shipped']['us']:.1f}")
        cells += [f"{r['tuned']['us']:.1f}", f"{r['speedup_vs_default']:.2f}x"]
        if shipped:
            cells.append(f"{r['speedup_vs_shipped']:.2f}x")
        up, down = (Tile.from_sglang(r["tuned"][k]).label() for k in ("up", "down"))
        same = r.get("same_as", {}).get("tuned")
        cells.append(f"{up} / {down}" + (f" (the {same} entries)" if same else ""))
        lines.append("| " + " | ".join(cells) + " |")
    return lines
