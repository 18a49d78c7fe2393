"""The organism's DSpark drafter: its provenance as a report, and its acceptance on larger held-out sets.

``dsv4convert train-organism --drafter dspark`` writes the drafter's files (``dspark.safetensors``,
``dspark.json``: command, commit, seed, device, seconds, steps, the training curve and the acceptance per
draft position measured on the checkpoint ``synth --preset organism --drafter dspark`` writes). This script
renders that, and with ``--more N`` measures the same drafter, read back the same way, on N held-out rows, N
needle prompts and N greedy continuations (the provenance's held-out set is kept small so the CPU tests
recompute it). Run from the repository root::

    python bench/organism_dspark.py --drafter DIR --more 32 --device cuda --out bench/results/organism-dspark-h200

Writes ``<out>.md`` and ``<out>.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CURVE = [("step", "step", "{:d}"), ("seconds", "s", "{:.1f}"), ("ce", "distillation CE", "{:.3f}"),
         ("bce", "confidence BCE", "{:.3f}"), ("teacher_agreement", "teacher-forced agreement", "{:.1%}")]


def measure_more(drafter_dir: Path, rows: int, device: str) -> dict:
    """The drafter read back as synth assembles it, measured on ``rows`` rows of each set."""
    from tokenizers import Tokenizer

    from dsv4convert.model.blocks import parse_device
    from dsv4convert.organism.dspark import MeasureSettings, Target, measure
    from dsv4convert.organism.export import load_dspark_release, write_with_drafter
    from dsv4convert.synth import ORGANISM_DIR

    provenance = json.loads((drafter_dir / "dspark.json").read_text())
    settings = MeasureSettings(heldout_sequences=rows, needle_sequences=rows, greedy_prompts=min(rows, 16),
                               greedy_prompt_tokens=96, greedy_new_tokens=192, seed=provenance["seed"] + 1)
    tokenizer = Tokenizer.from_file(str(ORGANISM_DIR / "tokenizer.json"))
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        assembled = write_with_drafter(Path(tmp) / "organism", ORGANISM_DIR, drafter_dir)
        config = json.loads((assembled / "config.json").read_text())
        backbone, drafter = load_dspark_release(assembled, device=parse_device(device))
        text = (assembled / "heldout.txt").read_text(encoding="utf-8")
        measured = measure(drafter, Target(backbone, config), tokenizer, text, settings)
    return {"settings": settings.__dict__, "device": device, "seconds": round(time.perf_counter() - started, 1),
            "acceptance": measured}


def acceptance_table(acceptance: dict) -> list[str]:
    g = len(next(iter(acceptance.values()))["accepted"])
    lines = ["| set | blocks | " + " | ".join(f"draft {j + 1}: agreement / accepted" for j in range(g))
             + " | expected accepted length (of %d) |" % g, "|---|---|" + "---|" * (g + 1)]
    for name, s in acceptance.items():
        cells = " | ".join(f"{100 * a:.1f} % / {100 * c:.1f} %" for a, c in zip(s["agreement"], s["accepted"]))
        lines.append(f"| {name} | {s['blocks']} | {cells} | {s['expected_accept_length']:.2f} |")
    return lines


def render(provenance: dict, more: dict | None, size: int) -> str:
    s = provenance["settings"]
    out = ["# The organism's DSpark drafter", "",
           f"`{provenance['command']}` at commit `{provenance['commit']}` on {provenance['device']} "
           f"({provenance['host']}; torch {provenance['torch']}, transformers {provenance['transformers']}), on "
           f"the frozen shipped organism (commit `{provenance['base']['commit']}`): {provenance['steps']} steps of "
           f"{s['tokens_per_step']} tokens in {provenance['training_seconds']} s of training "
           f"({provenance['total_seconds']} s with loading, writing and measuring), seed {provenance['seed']}; "
           f"{provenance['parameters'] / 1e6:.2f}M parameters, {size / 1e6:.2f} MB of drafter tensors as 0731 "
           f"stores them. Replay: the same command with `--steps {provenance['steps']}`.", "",
           "## Acceptance per draft position (the provenance's; greedy verification against the target's top-1)", "",
           "Measured on the checkpoint `synth --preset organism --drafter dspark` writes, read back (every weight "
           "dequantized from its stored format). `heldout`: the first "
           f"{provenance['measured_on']['heldout_sequences']} rows of 320 tokens of the organism's `heldout.txt`, "
           "teacher-forced (every block drafts from the text's own prefix; `tests/test_organism_dspark.py` "
           "recomputes it on a CPU); `needle`: fresh needle prompts with their answers; `greedy`: the target's own "
           "greedy continuations of held-out prompts, where a draft that equals the target's top-1 is exactly what "
           "greedy verification accepts. Agreement: the draft equals the target's greedy token at that position; "
           "accepted: it and every draft before it do.", "", *acceptance_table(provenance["acceptance"]), ""]
    if more:
        m = more["settings"]
        out += [f"## On larger sets ({more['device']}, {more['seconds']} s)", "",
                f"The same drafter on {m['heldout_sequences']} held-out rows, {m['needle_sequences']} needle prompts "
                f"and {m['greedy_prompts']} greedy continuations of {m['greedy_new_tokens']} tokens (needle seed "
                f"{m['seed']}):", "", *acceptance_table(more["acceptance"]), ""]
    out += ["## Training curve (acceptance on the held-out and needle rows the curve uses)", "",
            "| " + " | ".join(h for _, h, _ in CURVE) + " | held-out accepted per position | needle |",
            "|" + "---|" * (len(CURVE) + 2)]
    for point in provenance["curve"]:
        cells = [fmt.format(point[key]) if key in point else "" for key, _, fmt in CURVE]
        held = ["/".join(f"{100 * v:.0f}" for v in point["heldout"][k]) for k in ("heldout", "needle")]
        out.append("| " + " | ".join(cells + held) + " |")
    return "\n".join(out) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--drafter", type=Path, default=ROOT / "dsv4convert/data/organism-dspark")
    parser.add_argument("--more", type=int, default=0, metavar="N", help="measure again on N rows of each set")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--more-json", type=Path, help="a --more result already measured (its .json) to render")
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/organism-dspark-h200")
    args = parser.parse_args()
    provenance = json.loads((args.drafter / "dspark.json").read_text())
    more = measure_more(args.drafter, args.more, args.device) if args.more else None
    if args.more_json:
        more = json.loads(args.more_json.read_text()).get("more")
    size = (args.drafter / "dspark.safetensors").stat().st_size
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"provenance": provenance, "more": more}, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(render(provenance, more, size))
    print(args.out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
