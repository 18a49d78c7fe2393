"""The known-truth table: what ``compare`` says about each fault injected into the organism, measured.

For the shipped organism (dsv4convert/data/organism) and each fault of ``dsv4convert/organism/faults.py``
(the ones tests/test_organism.py injects, same seeds), plus the lossless FP8 and NVFP4 conversions:
``compare --recall --local --numerics weights`` over the grid from half the selection threshold to 8x it
(three depths), and ``compare --numerics weights`` on the organism's held-out text. Reported per case:
recall by length, the diagnosis (kind, layer, the sentence), each CSA layer's local top-k overlap and
value-selection rate past the threshold, the text KLD and same top-1, and the block with the largest
local error. Then the ablation rows (``--ablate``, served sm120) for the NVFP4 variant.

    python bench/organism_faults.py --work /tmp/organism-faults
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.convert import _machine  # noqa: E402
from dsv4convert.cli import main as dsv4convert  # noqa: E402
from dsv4convert.compare.recall import RecallOptions  # noqa: E402
from dsv4convert.compare.run import CompareOptions, build_plan, run  # noqa: E402
from dsv4convert.organism.export import write_organism  # noqa: E402
from dsv4convert.organism.faults import Fault, inject  # noqa: E402
from dsv4convert.organism.language import heldout_text  # noqa: E402

GRID = [130, 253, 260, 520, 1040, 2080]
DEPTHS = (0.1, 0.5, 0.9)
FAULTS = {"indexer-crushed": Fault("indexer-crushed", 3), "indexer-randomized": Fault("indexer-randomized", 1),
          "attention": Fault("attention", 3), "experts": Fault("experts", 2)}
ABLATION_LENGTHS = [253, 520, 1040, 2080]


def by_length(track: dict) -> dict[int, float]:
    cells = defaultdict(list)
    for cell in track["cells"]:
        cells[cell["length"]].append(cell["accuracy"])
    return {length: sum(v) / len(v) for length, v in sorted(cells.items())}


def measure(base: Path, variant: Path, text: Path) -> dict:
    rec = run(build_plan(CompareOptions(base=str(base), variant=str(variant), numerics="weights", progress=False,
                                        recall=RecallOptions(lengths=GRID, depths=DEPTHS, local=True))))["recall"]
    txt = run(build_plan(CompareOptions(base=str(base), variant=str(variant), texts=[text], tokens=8192,
                                        seq_len=1024, numerics="weights", progress=False)))
    local = {b["block"]: b["local"]["relative_error"] for b in txt["blocks"]}
    d = rec["diagnosis"]
    return {"recall": {str(k): v for k, v in by_length(rec["tracks"]["variant"]).items()},
            "base_recall": {str(k): v for k, v in by_length(rec["tracks"]["base"]).items()},
            "diagnosis": {k: d[k] for k in ("kind", "reason", "layer", "sentence")},
            "layers": [{k: e[k] for k in ("layer", "overlap_local", "selected_rate_past")} for e in d["layers"]],
            "kld": txt["output"]["kld"]["mean"], "same_top1": txt["output"]["same_top1"],
            "worst_local_block": max(local, key=local.get) if any(local.values()) else None,
            "local_error": local}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--out", default="bench/results/organism-faults-cpu")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    base = write_organism(args.work / "base", overwrite=True)
    text = args.work / "heldout.txt"
    text.write_text(heldout_text())
    cases = {}
    for name in ("fp8", "nvfp4"):
        dsv4convert([f"to-{name}", "--src", str(base), "--dst", str(args.work / name), "--overwrite", "--no-progress"])
        cases[name] = measure(base, args.work / name, text)
        print(name, cases[name]["recall"], cases[name]["diagnosis"]["kind"], flush=True)
    for name, fault in FAULTS.items():
        variant = inject(base, args.work / name, fault, overwrite=True)
        cases[name] = {"fault": fault.describe(), **measure(base, variant, text)}
        print(name, cases[name]["recall"], cases[name]["diagnosis"]["kind"], flush=True)
    ablation = run(build_plan(CompareOptions(
        base=str(base), variant=str(args.work / "nvfp4"), numerics="served", gpu_family="sm120", progress=False,
        recall=RecallOptions(lengths=ABLATION_LENGTHS, depths=DEPTHS, ablate=True))))["recall"]
    rows = {label: {"recall": {str(k): v for k, v in by_length(t).items()},
                    "answer_kld": (t.get("answer_positions") or {}).get("kld", {}).get("mean")}
            for label, t in ablation["tracks"].items()}
    write(cases, rows, ablation["verdicts"], time.monotonic() - started, args)
    return 0


def write(cases: dict, ablation: dict, verdicts: list[str], seconds: float, args: argparse.Namespace) -> None:
    machine = _machine("cpu")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    command = "python " + " ".join(sys.argv)
    head = "/".join(str(n) for n in GRID)
    lines = ["# The organism's known truths: what compare says about each injected fault", "",
             f"- machine: {machine['cpu']}, {machine['cores']} cores; torch {machine['torch']}; {seconds:.0f} s",
             f"- commit `{commit}`", f"- command: `{command}`",
             "- model: the shipped organism (selection threshold 260 tokens; 7-token answers, so prompts up to 253 "
             "tokens are fully covered); recall teacher-forced, 3 depths per length, `--numerics weights --local`; "
             "KLD on 8K tokens of held-out text in its language", "",
             f"| case | recall % at {head} | diagnosis | local top-k overlap (value selected past threshold) | "
             "text KLD | same top-1 | largest local error |",
             "|---|---|---|---|---|---|---|"]
    for name, c in cases.items():
        recall = " / ".join(f"{100 * v:.0f}" for v in c["recall"].values())
        diagnosis = c["diagnosis"]["kind"] + (f" ({c['diagnosis']['layer']})" if c["diagnosis"]["layer"] else "")
        layers = ", ".join(f"{e['layer']} {e['overlap_local']:.2f} ({100 * (e['selected_rate_past'] or 0):.0f}%)"
                           for e in c["layers"] if e["overlap_local"] is not None)
        label = f"{name}: {c['fault']}" if "fault" in c else f"to-{name}"
        lines.append(f"| {label} | {recall} | {diagnosis} | {layers} | {c['kld']:.4g} | "
                     f"{100 * c['same_top1']:.2f}% | {c['worst_local_block'] or '-'} |")
    lines += ["", "Verdicts, as compare prints them:", ""]
    lines += [f"- **{name}**: {c['diagnosis']['sentence']}" for name, c in cases.items()]
    head = "/".join(str(n) for n in ABLATION_LENGTHS)
    lines += ["", "## Ablation (`--ablate`, NVFP4 variant, served sm120, against the base with its weights only)", "",
              f"| row | recall % at {head} | KLD at the answer positions |", "|---|---|---|"]
    for label, r in ablation.items():
        kld = "-" if r["answer_kld"] is None else f"{r['answer_kld']:.4g}"
        lines.append(f"| {label} | {' / '.join(f'{100 * v:.0f}' for v in r['recall'].values())} | {kld} |")
    lines += ["", *[f"- {v}" for v in verdicts], ""]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(f"{args.out}.json").write_text(json.dumps({"machine": machine, "commit": commit, "command": command,
                                                    "seconds": seconds, "cases": cases, "ablation": ablation,
                                                    "ablation_verdicts": verdicts}, indent=1))
    Path(f"{args.out}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
