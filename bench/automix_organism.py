"""``automix --report`` on the trained organism: the Pareto table against every baseline, measured (CPU).

Run from the repository root::

    PYTHONPATH=. python bench/automix_organism.py --out bench/results/automix-organism-cpu
    PYTHONPATH=. python bench/automix_organism.py --text-seed 4646 --out bench/results/automix-organism-seed4646-cpu

Writes the organism (``synth --preset organism``), runs ``dsv4convert automix`` with a size budget and
``--report`` (every uniform layout of the menu, the naive mix of each, and automix's verified choice at each of
their sizes, each converted and compared with the base on held-out windows), and keeps the report's JSON,
markdown and PNG under ``--out`` with the machine, commit and exact command. The text is
``dsv4convert/data/organism/heldout.txt`` (what the tests read), or with ``--text-seed`` text in the organism's
language from that seed (``organism.language.documents``), which no test reads.

The summary counts the baselines met: automix's choice at a baseline's bytes measures at most the baseline's
KLD on the held-out windows ("met"), or more by less than one standard error of the difference (the two
rows' errors combined: "indistinguishable", listed), else "missed" (listed); and gives measured over
predicted KLD per family, for the held-out rows, for automix's choices (also with the prediction corrected by
the family's measured/predicted on the selection windows), and for the candidates measured there.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dsv4convert.organism.language import documents

TEXT = Path("dsv4convert/data/organism/heldout.txt")


def ratio_range(pairs: list[tuple[float, float]]) -> str:
    """Measured over predicted, least-most, of (predicted, measured) pairs."""
    ratios = [m / p for p, m in pairs if p > 0]
    return f"{min(ratios):.2f}-{max(ratios):.2f} ({len(ratios)})" if ratios else "-"


def summary(report: dict) -> tuple[list[str], dict]:
    """The baselines met, and measured/predicted per family (see the module docstring)."""
    rows = [r for r in report["rows"] if r["measured"] is not None]
    by_name = {r["name"]: r for r in rows}
    met, close, missed = [], [], []
    for base in (r for r in rows if r["kind"] != "automix"):
        auto = by_name[f"automix-at-{base['name']}"]
        assert auto["bytes"] <= base["bytes"], (auto, base)
        gap = auto["measured"] - base["measured"]
        error = math.hypot(auto["standard_error"], base["standard_error"])
        verdict = (f"{base['name']}: automix {auto['measured']:.5f} ± {auto['standard_error']:.5f} at "
                   f"{auto['bytes'] / 1e6:.1f} MB against {base['measured']:.5f} ± {base['standard_error']:.5f} at "
                   f"{base['bytes'] / 1e6:.1f} MB")
        (met if gap <= 0 else close if gap < error else missed).append(verdict)
    columns = ("held-out rows", "automix's choices", "automix's choices, corrected", "selection candidates")
    families: dict[str, dict[str, list]] = {}
    for r in rows:
        kinds = families.setdefault(r["layout"], {column: [] for column in columns})
        kinds["held-out rows"].append((r["predicted"], r["measured"]))
        if r["kind"] == "automix":
            kinds["automix's choices"].append((r["predicted"], r["measured"]))
            if r["corrected"]:
                kinds["automix's choices, corrected"].append((r["corrected"], r["measured"]))
    for c in report["candidates"]:
        families.setdefault(c["layout"], {column: [] for column in columns})["selection candidates"].append(
            (c["predicted"], c["selection"]))
    chosen = [(r["predicted"], r["measured"]) for r in rows if r["kind"] == "automix"]
    corrected = [(r["corrected"], r["measured"]) for r in rows if r["kind"] == "automix" and r["corrected"]]
    lines = [f"- baselines met by automix's choice at their bytes: {len(met)} of {len(met) + len(close) + len(missed)} "
             f"at most their measured KLD, {len(close)} more within one standard error of the difference "
             f"(indistinguishable), {len(missed)} missed",
             *(f"  - indistinguishable: {v}" for v in close), *(f"  - missed: {v}" for v in missed),
             "- measured / predicted KLD, every held-out row: "
             + ratio_range([(r["predicted"], r["measured"]) for r in rows]),
             f"- measured / predicted KLD, automix's choices: {ratio_range(chosen)}; with the prediction corrected by "
             f"its family's measured/predicted on the selection windows: {ratio_range(corrected)}",
             "- choices that overruled the estimate: " + str(sum(1 for r in rows if r["kind"] == "automix" and r["note"])),
             "", "| family | " + " | ".join(columns) + " |", "|---|---|---|---|---|"]
    for family, kinds in sorted(families.items()):
        lines.append(f"| {family} | " + " | ".join(ratio_range(pairs) for pairs in kinds.values()) + " |")
    return lines, {"met": met, "indistinguishable": close, "missed": missed}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="results prefix (.json, .md, -pareto.png)")
    parser.add_argument("--gpu-family", default="sm100")
    parser.add_argument("--engine", default="sglang")
    parser.add_argument("--size", default="9M", help="automix's own budget (the report adds every baseline's)")
    parser.add_argument("--text-seed", type=int, help="text in the organism's language from this seed (else the tests' text)")
    parser.add_argument("--documents", type=int, default=250, help="documents of --text-seed text (default 250)")
    parser.add_argument("--tokens", default="4096")
    parser.add_argument("--select-tokens", default="4096")
    parser.add_argument("--verify-tokens", default="8192")
    parser.add_argument("--verify-top", default="4")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="automix-organism-") as tmp:
        work = Path(tmp)
        subprocess.run([sys.executable, "-m", "dsv4convert", "synth", "--preset", "organism", "--dst",
                        str(work / "base")], check=True)
        text = TEXT
        if args.text_seed is not None:
            text = work / f"organism-seed{args.text_seed}.txt"
            text.write_text("\n\n\n".join(documents(args.text_seed, args.documents)) + "\n", encoding="utf-8")
        command = ["automix", "--src", str(work / "base"), "--dst", str(work / "mix"), "--size", args.size,
                   "--text", str(text), "--tokens", args.tokens, "--select-tokens", args.select_tokens,
                   "--verify-tokens", args.verify_tokens, "--verify-top", args.verify_top, "--seq-len", "512",
                   "--engine", args.engine, "--gpu-family", args.gpu_family, "--report", str(work / "report"),
                   "--no-progress"]
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "dsv4convert", *command], check=True, stdout=subprocess.DEVNULL)
        seconds = time.perf_counter() - t
        report = json.loads((work / "report" / "automix.json").read_text())
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True).stdout.strip()
        source = (f"organism.language.documents(seed {args.text_seed}, {args.documents} documents), a seed no test "
                  "reads" if args.text_seed is not None else str(TEXT))
        run = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores (CPU)",
               "commit": commit + ("-dirty" if dirty else ""), "text": source,
               "command": "dsv4convert " + " ".join(command).replace(str(work), "<tmp>"), "seconds": round(seconds, 1)}
        lines, verdicts = summary(report)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps({"run": run, "baselines": verdicts, "report": report},
                                                            indent=2) + "\n")
        body = (work / "report" / "automix.md").read_text().split("\n", 2)[2]
        header = [f"# `dsv4convert automix --report` on the organism ({args.gpu_family}, --engine {args.engine})", "",
                  f"{run['machine']}, commit {run['commit']}, {seconds:.0f} s; text: {source}", "",
                  f"`{run['command']}`", "", *lines, ""]
        args.out.with_suffix(".md").write_text("\n".join(header) + body)
        shutil.copy(work / "report" / "pareto.png", args.out.parent / f"{args.out.name}-pareto.png")
    print(args.out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
