"""The DSpark drafter streams like any block: its stages' conversion rate against the backbone's, and peak memory.

Synthesizes the official release's config (``dsv4convert/data/deepseek-v4-flash-0731-config.json``) at
``1 + --more`` real-size backbone layers with its drafter (three real-size DSpark stages, about 10.9 GB), then
derives three checkpoints from it by hard links (``synth`` derives every tensor from (seed, name) alone, so
these are the bytes ``synth`` would write for them):

* ``A1``: one backbone layer, no drafter;
* ``A2``: ``1 + --more`` backbone layers, no drafter (``--more 3``, the default: as many bytes more as the drafter);
* ``D1``: one backbone layer and the drafter.

Each converter (``to-<variant>``, one worker) runs on A1, A2 and D1 in turn, from a cold page cache
(``bench/convert.py``'s ``timed``: wall seconds, CPU, peak RSS). The backbone's rate is what the extra layers
cost, ``(bytes(A2) - bytes(A1)) / (t(A2) - t(A1))``; the drafter's is what it adds,
``(bytes(D1) - bytes(A1)) / (t(D1) - t(A1))``: the same embedding and head are in both differences'
baselines, so they cancel. Compare increments of about the same size: a single extra layer (``--more 1``)
overlaps with the fixed work around it (reading ahead, writing the head) and looks faster than it is. The ratio
of the two rates is the finding (machines are noisy: the runs are side by side in one process, in the order A1,
A2, D1 per variant, with ``--repeat`` rounds). Peak RSS of D1 against A1 and A2 says whether memory grows with
the drafter.

    python bench/drafter.py --variants nvfp4 fp8 --engine sglang --work /root/bd --out-dir /root/out
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from convert import GB, _commit, _machine, _size, link_checkpoint, timed  # noqa: E402  (bench/convert.py: one way to time a run)

from dsv4convert.checkpoint import Checkpoint  # noqa: E402
from dsv4convert.models.deepseek_v4.configs import with_num_layers  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "dsv4convert" / "data" / "deepseek-v4-flash-0731-config.json"
VARIANTS = ("nvfp4", "fp8", "w4a16", "bf16")


def derive(full: Path, dst: Path, layers: int, *, drafter: bool) -> Path:
    """A checkpoint of ``layers`` backbone layers (with or without the drafter) made of hard links into ``full``."""
    return link_checkpoint(full, dst, with_num_layers(Checkpoint.open(full).config, layers, mtp=drafter))


def rates(rows: list[dict]) -> dict:
    """Per variant: median seconds of A1/A2/D1 over the rounds, the backbone layer's and the drafter's rates."""
    out = {}
    for variant in sorted({r["variant"] for r in rows}):
        t = {name: statistics.median(r["seconds"] for r in rows if r["variant"] == variant and r["source"] == name)
             for name in ("A1", "A2", "D1")}
        size = {r["source"]: r["source_bytes"] for r in rows}
        layer = (size["A2"] - size["A1"]) / max(t["A2"] - t["A1"], 1e-9)
        drafter = (size["D1"] - size["A1"]) / max(t["D1"] - t["A1"], 1e-9)
        peak = {name: max(r["peak_rss_total"] for r in rows if r["variant"] == variant and r["source"] == name)
                for name in ("A1", "A2", "D1")}
        written = {name: statistics.median(r["output_bytes"] for r in rows if r["variant"] == variant
                                           and r["source"] == name) for name in ("A1", "A2", "D1")}
        out[variant] = {"seconds": {k: round(v, 2) for k, v in t.items()},
                        "backbone_layer_gb_per_s": round(layer / GB, 3), "drafter_gb_per_s": round(drafter / GB, 3),
                        "drafter_over_backbone": round(drafter / layer, 2),
                        "backbone_written_gb_per_s": round((written["A2"] - written["A1"]) / GB
                                                           / max(t["A2"] - t["A1"], 1e-9), 3),
                        "drafter_written_gb_per_s": round((written["D1"] - written["A1"]) / GB
                                                          / max(t["D1"] - t["A1"], 1e-9), 3),
                        "peak_rss_gb": {k: round(v / GB, 3) for k, v in peak.items()}}
    return out


def markdown(result: dict) -> str:
    m = result["machine"]
    lines = ["# The DSpark drafter's conversion rate against the backbone's (0731 config, real-size blocks)", "",
             f"- machine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB; torch {m['torch']}",
             f"- commit `{result['commit']}`; command: `{result['command']}`",
             f"- sources: A1 {result['bytes']['A1'] / GB:.2f} GB (1 layer), A2 {result['bytes']['A2'] / GB:.2f} GB "
             f"(more layers), D1 {result['bytes']['D1'] / GB:.2f} GB (1 layer + drafter); synth "
             f"{result['synth_seconds']} s", "",
             "| variant | A1 s | A2 s | D1 s | backbone read GB/s | drafter read GB/s | drafter / backbone | "
             "backbone / drafter written GB/s | peak RSS A1 / A2 / D1 GB |", "|---|---|---|---|---|---|---|---|---|"]
    for variant, r in result["rates"].items():
        s, p = r["seconds"], r["peak_rss_gb"]
        lines.append(f"| {variant} | {s['A1']} | {s['A2']} | {s['D1']} | {r['backbone_layer_gb_per_s']} | "
                     f"{r['drafter_gb_per_s']} | {r['drafter_over_backbone']} | {r['backbone_written_gb_per_s']} / "
                     f"{r['drafter_written_gb_per_s']} | {p['A1']} / {p['A2']} / {p['D1']} |")
    lines += ["", "Every run:", "", "| round | variant | source | seconds | CPU s | peak RSS GB | output GB |",
              "|---|---|---|---|---|---|---|"]
    for r in result["runs"]:
        lines.append(f"| {r['round']} | {r['variant']} | {r['source']} | {r['seconds']:.1f} | "
                     f"{r['cpu_user_seconds'] + r['cpu_system_seconds']:.1f} | {r['peak_rss_total'] / GB:.3f} | "
                     f"{r['output_bytes'] / GB:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=["nvfp4", "fp8"])
    p.add_argument("--repeat", type=int, default=1, help="rounds of A1, A2, D1 per variant (default 1)")
    p.add_argument("--more", type=int, default=3,
                   help="backbone layers A2 has beyond A1 (default 3: about the drafter's size)")
    p.add_argument("--engine", choices=("sglang", "vllm", "both"), default="both",
                   help="the converters' --engine (sglang keeps NVFP4's draft experts FP8, half both's BF16 bytes)")
    p.add_argument("--work", type=Path, default=Path("bench-drafter-work"), help="scratch directory")
    p.add_argument("--source", type=Path, help="reuse a synth of the 0731 config at 1 + --more layers with its drafter")
    p.add_argument("--config", type=Path, default=CONFIG, help="the config to synthesize (default: 0731's)")
    p.add_argument("--out-dir", type=Path, default=REPO / "bench" / "results")
    p.add_argument("--name", default="drafter-cpu", help="results file stem")
    args = p.parse_args()
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    full = args.source or work / f"src-0731-{1 + args.more}"
    result: dict = {"machine": _machine("cpu"), "commit": _commit(), "command": shlex.join(sys.argv), "runs": []}
    synth_seconds = 0.0
    if args.source is None:
        import time

        t0 = time.monotonic()
        subprocess.run([sys.executable, "-m", "dsv4convert", "synth", "--config", str(args.config), "--num-layers",
                        str(1 + args.more), "--dst", str(full), "--overwrite"], check=True)
        synth_seconds = round(time.monotonic() - t0, 1)
    result["synth_seconds"] = synth_seconds
    sources = {"A1": derive(full, work / "A1", 1, drafter=False),
               "A2": derive(full, work / "A2", 1 + args.more, drafter=False),
               "D1": derive(full, work / "D1", 1, drafter=True)}
    result["bytes"] = {name: _size(path) for name, path in sources.items()}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for round_ in range(args.repeat):
        for variant in args.variants:
            for name, src in sources.items():
                cmd = [sys.executable, "-m", "dsv4convert", f"to-{variant}", "--src", str(src), "--dst",
                       str(work / "out"), "--no-progress", "--engine", args.engine]
                row = timed(cmd, src, work / "out")
                row.update(round=round_, variant=variant, source=name, source_bytes=result["bytes"][name])
                result["runs"].append(row)
                print(f"{variant} {name}: {row['seconds']} s, peak RSS {row['peak_rss_total'] / GB:.2f} GB", flush=True)
                (args.out_dir / f"{args.name}.json").write_text(json.dumps(result, indent=2) + "\n")
    result["rates"] = rates(result["runs"])
    (args.out_dir / f"{args.name}.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out_dir / f"{args.name}.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
