"""``automix --report`` on the trained organism: the Pareto table against every baseline, measured (CPU).

Run from the repository root::

    PYTHONPATH=. python bench/automix_organism.py --out bench/results/automix-organism-cpu

Writes the organism (``synth --preset organism``), runs ``dsv4convert automix`` with a size budget and
``--report`` (every uniform layout of the menu, the naive mix of each, automix at each of their sizes, each
converted and compared with the base on held-out windows of ``dsv4convert/data/organism/heldout.txt``), and keeps
the report's JSON, markdown and PNG under ``--out`` with the machine, commit and exact command.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TEXT = Path("dsv4convert/data/organism/heldout.txt")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="results prefix (.json, .md, -pareto.png)")
    parser.add_argument("--gpu-family", default="sm100")
    parser.add_argument("--engine", default="sglang")
    parser.add_argument("--tokens", default="4096")
    parser.add_argument("--verify-tokens", default="8192")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="automix-organism-") as tmp:
        work = Path(tmp)
        subprocess.run([sys.executable, "-m", "dsv4convert", "synth", "--preset", "organism", "--dst",
                        str(work / "base")], check=True)
        command = ["automix", "--src", str(work / "base"), "--dst", str(work / "mix"), "--size", "9M",
                   "--text", str(TEXT), "--tokens", args.tokens, "--verify-tokens", args.verify_tokens, "--seq-len",
                   "512", "--engine", args.engine, "--gpu-family", args.gpu_family, "--report", str(work / "report"),
                   "--no-progress"]
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "dsv4convert", *command], check=True, stdout=subprocess.DEVNULL)
        seconds = time.perf_counter() - t
        report = json.loads((work / "report" / "automix.json").read_text())
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        run = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores (CPU)",
               "commit": commit, "command": "dsv4convert " + " ".join(command).replace(str(work), "<tmp>"),
               "seconds": round(seconds, 1)}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps({"run": run, "report": report}, indent=2) + "\n")
        body = (work / "report" / "automix.md").read_text().split("\n", 2)[2]
        rows = [r for r in report["rows"] if r["measured"] is not None]
        ratios = [r["measured"] / r["predicted"] for r in rows]
        wins = []
        for base in (r for r in rows if r["kind"] != "automix"):
            at = [r for r in rows if r["kind"] == "automix" and r["bytes"] <= base["bytes"]]
            best = min(at, key=lambda r: r["measured"]) if at else None
            wins.append(best is not None and best["measured"] <= base["measured"])
        header = [f"# `dsv4convert automix --report` on the organism ({args.gpu_family}, --engine {args.engine})", "",
                  f"{run['machine']}, commit {commit}, {seconds:.0f} s: `{run['command']}`", "",
                  f"- predicted / measured KLD over {len(rows)} mixes: {min(ratios):.2f}-{max(ratios):.2f}",
                  f"- baselines with an automix mix at equal or fewer bytes and at most their KLD: "
                  f"{sum(wins)} of {len(wins)}", ""]
        args.out.with_suffix(".md").write_text("\n".join(header) + body)
        shutil.copy(work / "report" / "pareto.png", args.out.parent / f"{args.out.name}-pareto.png")
    print(args.out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
