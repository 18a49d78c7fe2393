"""FP8 block GEMM, this checkout against an older one, side by side in one run (M=4096 by default).

The GPU's speed drifts between sessions by more than most kernel changes gain, so an FP8 change
is judged here: each round times the table's FP8 config (activation quantization included, as in
``bench/kernels.py``) and row-wise ``torch._scaled_mm`` on the four benchmark shapes, once per
checkout, each in its own process, alternating. Run from the repository root on a GPU::

    git archive <old-commit> dsv4convert bench | tar -x -C /tmp/base
    PYTHONPATH=. python bench/fp8_ab.py --base /tmp/base --rounds 2 --out bench/results/fp8-ab-h200 [--m 1,16,4096]

writes ``<out>.json`` (every timing) and ``<out>.md`` (per shape and M: each checkout's time and share
of ``_scaled_mm``, and the old / new time ratio of every round).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def measure(tokens: list[int], rep_ms: int) -> list[dict]:
    """Time the FP8 table config at each M in the checkout on ``sys.path`` (one process, one checkout)."""
    import torch

    from bench.kernels import (
        SHAPES,
        _scaled_mm_baseline,
        copies_for,
        make_weights,
        median_us,
        timed_over_copies,
        weight_bytes,
    )
    from dsv4convert.kernels import launch
    from dsv4convert.kernels.samples import random_activations

    rows = []
    for shape, (n, k) in SHAPES.items():
        probe = make_weights("fp8", n, k, 1)[0]
        count = copies_for(weight_bytes(probe))
        weights = [probe] + make_weights("fp8", n, k, count - 1)
        for m in tokens:
            x = random_activations(m, k, device="cuda", generator=torch.Generator().manual_seed(m))
            offsets = torch.tensor([0, m], dtype=torch.int32, device="cuda")
            cfg = launch.checked_config(probe, m)
            us = timed_over_copies(lambda i: launch._launch(weights[i], x, offsets, m, cfg), count, rep_ms)
            scaled = _scaled_mm_baseline(m, n, k, rep_ms)
            rows.append({"shape": shape, "n": n, "k": k, "m": m, "config": repr(cfg), "us": us,
                         "activation_quant_us": median_us(lambda: launch.quantize_activations_fp8(x, group=128), rep_ms),
                         "scaled_mm_rowwise_us": scaled["us"], "fraction_of_scaled_mm": scaled["us"] / us})
    return rows


def run_checkout(code: Path, tokens: str, rep_ms: int) -> list[dict]:
    """``measure`` in a fresh process that imports ``dsv4convert`` and ``bench`` from ``code``."""
    env = {**os.environ, "PYTHONPATH": str(code)}
    done = subprocess.run([sys.executable, __file__, "--measure", "--m", tokens, "--rep-ms", str(rep_ms)], env=env, cwd=code,
                          capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"measuring {code} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def summary(result: dict) -> str:
    lines = [f"# FP8 block GEMM: this checkout vs `{result['base']}`", "",
             f"- device {result['device']}, torch {result['torch']}, triton {result['triton']}",
             f"- commit `{result['commit']}`; command: `{result['command']}`",
             "- times include the activation quantization; each checkout runs in its own process, alternating", "",
             "| shape | M | base us | new us | base / new, each round | base % of _scaled_mm | new % of _scaled_mm |",
             "|---|---|---|---|---|---|---|"]
    for shape, m in [(row["shape"], row["m"]) for row in result["rounds"][0]["new"]]:
        def pick(side):
            return [next(r for r in rnd[side] if (r["shape"], r["m"]) == (shape, m)) for rnd in result["rounds"]]
        base, new = pick("base"), pick("new")
        ratios = ", ".join(f"{b['us'] / n['us']:.3f}" for b, n in zip(base, new))
        lines.append(f"| {shape} | {m} | {statistics.median(r['us'] for r in base):.1f} | "
                     f"{statistics.median(r['us'] for r in new):.1f} | {ratios} | "
                     f"{', '.join(format(r['fraction_of_scaled_mm'], '.1%') for r in base)} | "
                     f"{', '.join(format(r['fraction_of_scaled_mm'], '.1%') for r in new)} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", type=Path, help="an older checkout (dsv4convert/ and bench/) to compare against")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--m", default="4096", help="comma-separated token counts (default 4096)")
    parser.add_argument("--rep-ms", type=int, default=10)
    parser.add_argument("--out", help="path prefix for the .json and .md results")
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)  # the child process
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure([int(m) for m in args.m.split(",")], args.rep_ms)))
        return
    if args.base is None or args.out is None:
        parser.error("--base and --out are required")
    from bench import report  # here, not at the top: the child measures the checkout on its PYTHONPATH

    rounds = []
    for index in range(args.rounds):
        rounds.append({"base": run_checkout(args.base.resolve(), args.m, args.rep_ms),
                       "new": run_checkout(ROOT, args.m, args.rep_ms)})
        print(f"round {index + 1}: " + ", ".join(
            f"{b['shape']} M={b['m']} {b['us']:.1f} -> {n['us']:.1f} us" for b, n in zip(rounds[-1]["base"], rounds[-1]["new"])),
            flush=True)
    result = {**report.gpu_run(), "base": os.environ.get("DSV4_BASE_COMMIT", str(args.base)), "rounds": rounds}
    report.write(args.out, result, summary(result))


if __name__ == "__main__":
    main()
