"""Time ``dsv4convert validate`` on one real-size DeepSeek-V4-Flash layer and extrapolate the whole model.

Run on a GPU machine from the repository root::

    PYTHONPATH=. python bench/validate.py --work /tmp/l1 --out bench/results/validate-h200

Stages (each can be run alone, e.g. synthesizing in the background while the GPU does other
work; their timings accumulate in ``<work>/timings.json``):

* ``synth``: ``dsv4convert synth --config <real config> --num-layers 1 --no-mtp`` (CPU);
* ``convert``: ``dsv4convert to-<variant>`` for every ``--variants`` entry;
* ``validate``: ``dsv4convert validate DST --against SRC --device cuda --no-progress`` timed as a
  command, then once more in this process with every stage wrapped (read from disk to the GPU,
  dequantize, probe GEMM, metrics; each bracketed by CUDA synchronization) for the time split.

The one-layer checkpoint also holds the embedding, the output head and the other non-layer
weights that the full model has once; the extrapolation ``43 x (one-layer time)`` therefore
counts them 43 times and is an upper bound for the same disk and page-cache state.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch

from dsv4convert import kernels
from dsv4convert.validate import cli as validate_cli
from dsv4convert.validate import layer_error

REAL_CONFIG = "dsv4convert/data/deepseek-v4-flash-config.json"
FULL_MODEL_LAYERS = 43
GOAL_SECONDS = 600
STAGES = ("synth", "convert", "validate")


def _run(command: list[str]) -> tuple[float, str]:
    """Wall seconds of a dsv4convert command (raises with its output if it fails)."""
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "dsv4convert", *command], capture_output=True, text=True)
    seconds = time.monotonic() - start
    if done.returncode not in (0, 1):  # validate exits 1 when a module is below a threshold
        raise RuntimeError(f"dsv4convert {' '.join(command)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return seconds, (done.stdout + done.stderr)[-2000:]


def _du_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


class StageClock:
    """Wall time per stage of the validator, each call bracketed by CUDA synchronization."""

    def __init__(self, device: str) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.device = device

    def _sync(self) -> None:
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()

    def wrap(self, stage: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            self._sync()
            start = time.monotonic()
            result = fn(*args, **kwargs)
            self._sync()
            self.seconds[stage] += time.monotonic() - start
            self.calls[stage] += 1
            return result
        return timed


@contextlib.contextmanager
def instrumented(clock: StageClock):
    """Wrap the validator's read, dequantize, GEMM and metric calls; restore them afterwards."""
    patches = [
        (layer_error, "_stack", "read (disk -> GPU, stacked)"),
        (kernels, "dequantize", "dequantize (kernels)"),
        (kernels, "grouped_gemm", "probe GEMM (kernels)"),
        (layer_error, "error_metrics", "metrics (float64)"),
    ]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    try:
        for owner, name, stage in patches:
            setattr(owner, name, clock.wrap(stage, getattr(owner, name)))
        yield clock
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


def stage_synth(work: Path, timings: dict, layers: int) -> None:
    src = work / "src"
    seconds, _ = _run(["synth", "--config", REAL_CONFIG, "--num-layers", str(layers), "--no-mtp", "--dst", str(src),
                       "--overwrite"])
    timings["layers"] = layers
    timings["synth"] = {"seconds": seconds, "bytes": _du_bytes(src), "cpu_count": os.cpu_count(),
                        "command": f"dsv4convert synth --config {REAL_CONFIG} --num-layers {layers} --no-mtp "
                                   f"--dst {src}"}
    print(f"synth: {seconds:.1f} s, {timings['synth']['bytes'] / 1e9:.2f} GB", flush=True)


def stage_convert(work: Path, timings: dict, variants: list[str], convert_device: str) -> None:
    for variant in variants:
        dst = work / variant
        command = [f"to-{variant}", "--src", str(work / "src"), "--dst", str(dst), "--overwrite", "--no-progress",
                   "--device", convert_device]
        seconds, _ = _run(command)
        timings.setdefault("convert", {})[variant] = {"seconds": seconds, "bytes": _du_bytes(dst),
                                                      "command": "dsv4convert " + " ".join(command)}
        print(f"convert {variant}: {seconds:.1f} s", flush=True)


def stage_validate(work: Path, timings: dict, variants: list[str], device: str) -> None:
    for variant in variants:
        dst, src = work / variant, work / "src"
        report = work / f"{variant}-validation"
        command = ["validate", str(dst), "--against", str(src), "--device", device, "--no-progress",
                   "--report", str(report)]
        seconds, tail = _run(command)
        clock = StageClock(device)
        with instrumented(clock):
            start = time.monotonic()
            result = validate_cli.validate(dst, against=src, device=device, report_dir=work / f"{variant}-split",
                                           progress=False)
            total = time.monotonic() - start
        split = dict(clock.seconds)
        split["other (inspect, integrity, probe inputs, reference matmul, reports)"] = total - sum(clock.seconds.values())
        summary = result.summary
        timings.setdefault("validate", {})[variant] = {
            "command": "dsv4convert " + " ".join(command), "seconds": seconds, "output_tail": tail,
            "instrumented_seconds": total, "split_seconds": split, "calls": dict(clock.calls),
            "modules": summary.get("modules"), "exact_modules": summary.get("exact_modules"),
            "worst_snr_db": summary.get("worst_snr_db"), "integrity_ok": summary.get("integrity_ok"),
            "extrapolated_full_model_seconds": seconds * FULL_MODEL_LAYERS / timings.get("layers", 1),
        }
        print(f"validate {variant}: {seconds:.1f} s (command), {total:.1f} s instrumented: "
              + ", ".join(f"{k} {v:.1f} s" for k, v in split.items()), flush=True)


def markdown(result: dict) -> str:
    t = result["timings"]
    lines = [f"# `dsv4convert validate` on {t.get('layers', 1)} real-size layer(s): {result['device']}", "",
             f"- commit `{result['commit']}`, torch {result['torch']}, {result['cpu_count']} CPU cores",
             f"- command: `{result['command']}`", ""]
    if "synth" in t:
        s = t["synth"]
        lines += [f"- synth (CPU): {s['seconds']:.1f} s for {s['bytes'] / 1e9:.2f} GB: `{s['command']}`"]
    for variant, c in t.get("convert", {}).items():
        lines += [f"- convert {variant}: {c['seconds']:.1f} s, {c['bytes'] / 1e9:.2f} GB: `{c['command']}`"]
    lines.append("")
    layers = t.get("layers", 1)
    for variant, v in t.get("validate", {}).items():
        full = v["extrapolated_full_model_seconds"]
        verdict = "MET" if full <= GOAL_SECONDS else "NOT MET"
        startup = v["seconds"] - v["instrumented_seconds"]
        once = startup + FULL_MODEL_LAYERS * v["instrumented_seconds"] / layers
        lines += [f"## {variant}", "",
                  f"- `{v['command']}`: **{v['seconds']:.1f} s** for {layers} layer(s); {v['modules']} modules, "
                  f"{v['exact_modules']} bit-exact, worst SNR {v['worst_snr_db']}, integrity {v['integrity_ok']}",
                  f"- 43 layers x {v['seconds'] / layers:.1f} s = **{full / 60:.1f} min** (goal < 10 min on one GPU: "
                  f"**{verdict}**; an upper bound: the process start, imports, kernel compiles and config "
                  f"checks, and the embedding and head, are all counted 43/{layers} times)",
                  f"- with the process start counted once ({startup:.1f} s = command minus the in-process run "
                  f"that followed it) and 43 x the in-process {v['instrumented_seconds'] / layers:.1f} s: "
                  f"**{once / 60:.1f} min** ({'within' if once <= GOAL_SECONDS else 'over'} the goal; still "
                  f"counts the embedding and head 43/{layers} times)", "",
                  f"Split of an instrumented in-process run ({v['instrumented_seconds']:.1f} s; each stage "
                  "bracketed by CUDA synchronization):", "", "| stage | seconds | calls |", "|---|---|---|"]
        lines += [f"| {stage} | {sec:.2f} | {v['calls'].get(stage, '')} |" for stage, sec in v["split_seconds"].items()]
        lines.append("")
    lines += ["Reads come from the page cache here (the checkpoint was just written on a machine with "
              "128 GiB of RAM); a cold full-size model is also bounded by the disk's read rate.", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True, help="scratch directory (a few GB per variant)")
    parser.add_argument("--out", help="path prefix for the .json and .md results (written after 'validate')")
    parser.add_argument("--stages", nargs="+", choices=STAGES, default=list(STAGES))
    parser.add_argument("--variants", nargs="+", default=["nvfp4", "w4a16"])
    parser.add_argument("--device", default="cuda", help="validate's --device")
    parser.add_argument("--convert-device", default="cuda", help="the converters' --device")
    parser.add_argument("--layers", type=int, default=1,
                        help="real-size layers to synthesize; run 1 and 2 in separate --work directories to get "
                             "the per-layer time without the fixed costs (embedding, head, process start)")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    timings_path = args.work / "timings.json"
    timings = json.loads(timings_path.read_text()) if timings_path.exists() else {}
    for stage in args.stages:
        if stage == "synth":
            stage_synth(args.work, timings, args.layers)
        elif stage == "convert":
            stage_convert(args.work, timings, args.variants, args.convert_device)
        else:
            stage_validate(args.work, timings, args.variants, args.device)
        timings_path.write_text(json.dumps(timings, indent=1, default=str))
    if args.out and "validate" in args.stages:
        result = {
            "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
            "torch": torch.__version__, "python": platform.python_version(), "cpu_count": os.cpu_count(),
            "commit": os.environ.get("DSV4_COMMIT", "unknown"),
            "command": os.environ.get("DSV4_COMMAND", "python bench/validate.py " + " ".join(sys.argv[1:])),
            "timings": timings,
        }
        Path(args.out + ".json").write_text(json.dumps(result, indent=1, default=str))
        Path(args.out + ".md").write_text(markdown(result))
        print(markdown(result))


if __name__ == "__main__":
    main()
