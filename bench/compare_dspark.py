"""The DSpark known-truth table: what ``compare`` says about the organism's drafter, its conversions and each fault.

For an organism that drafts with DSpark (``synth --preset organism --drafter dspark``, or ``--base DIR``): the lossless
``to-fp8`` and ``to-nvfp4`` conversions and each drafter fault of ``dsv4convert/organism/faults.py`` (the ones
tests/test_compare_dspark.py injects), each compared with the base on its held-out text: per draft position the
KLD of the draft distribution and each side's agreement and accepted prefix, the expected accepted length, the
confidence head's Brier score, every drafter component's local error, and the verdict. ``--numerics`` as compare's.

    python bench/compare_dspark.py --work /tmp/compare-dspark [--base DIR] [--numerics weights|served]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.convert import _machine  # noqa: E402
from dsv4convert.cli import main as dsv4convert  # noqa: E402
from dsv4convert.compare.run import CompareOptions, build_plan, run  # noqa: E402
from dsv4convert.organism.faults import inject  # noqa: E402
from tests.test_compare_dspark import FAULTS  # noqa: E402


def measure(base: Path, variant: Path, numerics: str, tokens: int, seq_len: int, anchors: int,
            device: str = "cpu") -> dict:
    t0 = time.perf_counter()
    result = run(build_plan(CompareOptions(base=str(base), variant=str(variant), texts=[base / "heldout.txt"],
                                           tokens=tokens, seq_len=seq_len, numerics=numerics, draft_anchors=anchors,
                                           device=device, progress=False)))
    d = result["dspark"]
    return {"seconds": round(time.perf_counter() - t0, 1), "kld_backbone": result["output"]["kld"]["mean"],
            "dspark": d}


def row(name: str, d: dict) -> str:
    p = d["positions"]
    length = d["expected_accept_length"]
    local = {c["component"]: c["local"]["relative_error"] for c in d["components"]}
    worst = max(local, key=local.get)
    return (f"| {name} | " + " / ".join(f"{x['kld']:.3g}" for x in p) + " | "
            + " / ".join(f"{100 * x['agreement']['variant']:.1f}" for x in p) + " | "
            + " / ".join(f"{100 * x['accepted']['variant']:.1f}" for x in p) + " | "
            + f"{length['variant']:.3f} ({length['delta']:+.3f}, floor {length['noise_floor']:.3f}) | "
            + " / ".join(f"{x['confidence']['variant']['brier']:.3f}" for x in p) + " | "
            + (f"{worst} {local[worst]:.3g}" if local[worst] else "all 0") + " | "
            + f"{d['verdict']['component'] or '-'} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--base", type=Path, help="an organism that drafts (default: synth --preset organism "
                                                  "--drafter dspark into WORK/base)")
    parser.add_argument("--numerics", choices=("weights", "served"), default="weights")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--draft-anchors", type=int, default=2048)
    parser.add_argument("--cases", default="fp8,nvfp4," + ",".join(FAULTS),
                        help="which variants (default: both conversions and every fault)")
    parser.add_argument("--device", default="cpu", help="as compare's --device (default cpu)")
    parser.add_argument("--out", type=Path, default=Path("bench/results/compare-dspark-organism-cpu"))
    args = parser.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    args.work.mkdir(parents=True, exist_ok=True)
    base = args.base
    if base is None:
        base = args.work / "base"
        if not base.exists():
            assert dsv4convert(["synth", "--preset", "organism", "--drafter", "dspark", "--dst", str(base)]) == 0
    wanted = set(args.cases.split(","))
    cases: dict[str, Path] = {}
    for recipe in sorted(wanted & {"fp8", "nvfp4"}):
        dst = args.work / recipe
        if not dst.exists():
            assert dsv4convert([f"to-{recipe}", "--src", str(base), "--dst", str(dst), "--no-progress"]) == 0
        cases[recipe] = dst
    for name, (fault, _) in ((n, f) for n, f in FAULTS.items() if n in wanted):
        cases[f"{name} ({fault.describe()})"] = inject(base, args.work / name, fault, overwrite=True)
    results = {name: measure(base, path, args.numerics, args.tokens, args.seq_len, args.draft_anchors, args.device)
               for name, path in cases.items()}
    first = next(iter(results.values()))["dspark"]
    gamma = first["block_size"]
    command = (f"python bench/compare_dspark.py --work {args.work}" + (f" --base {args.base}" if args.base else "")
               + f" --numerics {args.numerics} --tokens {args.tokens} --seq-len {args.seq_len} "
               f"--draft-anchors {args.draft_anchors} --cases {args.cases} --device {args.device}")
    lines = ["# compare on the organism's DSpark drafter: conversions and injected faults", "",
             f"Command: `{command}`; commit {commit}; machine: {json.dumps(_machine('cuda' if args.device.startswith('cuda') else 'cpu'))}.", "",
             f"Base: {base}; {args.tokens} tokens of its held-out text in sequences of {args.seq_len}, "
             f"{first['anchors']['blocks']} draft blocks of {gamma} (an anchor every {first['anchors']['stride']} "
             f"position(s)), numerics {args.numerics}. Per draft position 1..{gamma}, separated by /. The draft "
             "KLD's noise floor (float rounding: the base re-drafted in other batches) is below "
             f"{max(p['kld_noise_floor'] for r in results.values() for p in r['dspark']['positions']):.1g} nats "
             "in every case.", "",
             "Base: agreement " + " / ".join(f"{100 * x['agreement']['base']:.1f}" for x in first["positions"])
             + " %, accepted " + " / ".join(f"{100 * x['accepted']['base']:.1f}" for x in first["positions"])
             + f" %, expected accepted length {first['expected_accept_length']['base']:.3f} (drafts + bonus), "
             "confidence predicted / measured " + " / ".join(
                 f"{100 * x['confidence']['base']['predicted']:.0f}:{100 * x['confidence']['base']['measured']:.0f}"
                 for x in first["positions"]) + " %, Brier " + " / ".join(
                 f"{x['confidence']['base']['brier']:.3f}" for x in first["positions"]) + ".", "",
             "| variant | draft KLD (nats) | agreement % | accepted % | expected accepted length (vs base, noise "
             "floor) | Brier | largest local error | named |", "|---|---|---|---|---|---|---|---|"]
    lines += [row(name, r["dspark"]) for name, r in results.items()]
    lines += ["", "Verdicts:", ""] + [f"* {name}: {r['dspark']['verdict']['sentence']} ({r['seconds']} s)"
                                      for name, r in results.items()]
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    args.out.with_suffix(".json").write_text(json.dumps({"command": command, "commit": commit,
                                                         "machine": _machine("cpu"), "results": results}, indent=1))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
