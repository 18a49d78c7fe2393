"""A whole tune: plan the files, search, write the merged folder, compare what a server would run.

Shared by ``dsv4convert tune`` (from a checkpoint) and ``bench/tune.py`` (from the real config).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from dsv4convert import __version__
from dsv4convert.tune import compare, output, sglang_moe
from dsv4convert.tune.device import Device
from dsv4convert.tune.problem import MoEProblem
from dsv4convert.tune.search import SearchResult, run_search


@dataclass(frozen=True)
class Plan:
    """Where the tuned files go, as SGLang 0.5.23 looks them up on this host."""

    sglang_version: str
    triton_folder: str
    up_file: str       # "triton_X_Y_Z/E=..,N=..,device_name=..[,dtype=..][,block_shape=[..]].json"
    down_file: str     # the same with "_down"
    shipped_configs: Path

    @property
    def files(self) -> tuple[str, str]:
        return self.up_file, self.down_file

    def replaces_shipped(self) -> list[str]:
        return [name for name in self.files if (self.shipped_configs / name).is_file()]


@dataclass
class Outcome:
    plan: Plan
    result: SearchResult
    written: list[Path]
    rows: list[dict]
    log: Path


def plan(problem: MoEProblem) -> Plan:
    folder = sglang_moe.triton_folder()
    return Plan(sglang_moe.version(), folder, f"{folder}/{sglang_moe.file_name(problem)}",
                f"{folder}/{sglang_moe.file_name(problem, down=True)}", sglang_moe.shipped_root() / "configs")


def tune(problem: MoEProblem, device: Device, out: Path, *, batch_sizes: list[int], budget_s: float, source: str,
         max_candidates: int | None = None, seed: int = 0, progress: bool = True, compare_rounds: int = 2,
         rep_ms: int = 3, compare_rep_ms: int = 20) -> Outcome:
    import triton

    the_plan = plan(problem)
    output.check_destination(out, the_plan.sglang_version)
    result = run_search(problem, device, batch_sizes, budget_s=budget_s, max_candidates=max_candidates, seed=seed,
                        rep_ms=rep_ms, progress=progress)
    made = {"model": source, "tp": problem.tp, "problem": problem.describe(), "device": device.name,
            "dsv4convert": __version__, "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "search": result.summary()}
    files = {the_plan.up_file: {m: c.up.to_sglang() for m, c in result.choices.items()},
             the_plan.down_file: {m: c.down.to_sglang() for m, c in result.choices.items()}}
    written = output.write_tuned(out, shipped_configs=the_plan.shipped_configs, files=files,
                                 entries={name: made for name in files}, sglang_version=the_plan.sglang_version,
                                 triton_version=triton.__version__)
    rows = (compare.compare(problem, device, result.batches, out, rounds=compare_rounds, rep_ms=compare_rep_ms)
            if compare_rounds else [])
    log = output.write_log(out, the_plan.up_file, {
        **made, "device_capability": list(device.capability), "shared_memory_per_block": device.shared_memory,
        "timed": device.timed, "choices": [c.to_json() for c in result.choices.values()],
        "trials": [t.to_json() for t in result.trials], "compare": rows, "compare_summary": compare.summary(rows)})
    return Outcome(the_plan, result, written, rows, log)
