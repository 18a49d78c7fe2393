"""Time ``automix``'s sensitivity pass on real-size synthetic layers and extrapolate the whole model (GPU).

Run on a GPU machine from the repository root::

    PYTHONPATH=. python bench/automix.py --work /tmp/mix --out bench/results/automix-h200

Stages (``--stages``):

* ``synth``: the real ``config.json`` cut to three backbone layers, CSA (ratio 4), HCA (ratio 128), CSA,
  plus the MTP block: ``dsv4convert synth --config`` (random weights at the real shapes);
* ``sensitivity``: the pass as ``automix`` runs it (its own plan: the menu of ``--engine`` on ``--gpu-family``,
  every candidate, the floor, calibration and uniform-layout tracks) over ``--sequences`` x ``--seq-len`` random
  token ids (8K tokens by default; synthetic weights carry no text), the knapsack at the full model's size,
  and the verified choice's selection pass (its candidates at an unbounded budget: the ``--verify-top`` best
  and every uniform layout) over as many other random tokens.

Extrapolation to DeepSeek-V4-Flash (43 layers in the real config's order: CSA, HCA and 2 sliding-window
layers, counted as HCA): each block pays its kind's measured read, candidate passes (candidates made by the
converter's code and run on the reference's input, with the calibration tracks that need the same weights),
floor/calibration tracks and reference pass; and each fork started before it goes through it at the
measured time per fork pass of its kind (layers.1 measures HCA, layers.2 CSA; layers.0 has no forks yet).
The forks before block k are the candidates of blocks 0..k-1 (the kind's measured count). The output head
scores every fork and track once, at the measured time per stream. The selection pass is extrapolated the
same way: each block pays its kind's read, mix tracks (their candidates made once per block) and reference.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

REAL_CONFIG = Path("dsv4convert/data/deepseek-v4-flash-config.json")
GOAL_SECONDS = 30 * 60


def bench_config(path: Path) -> dict:
    config = json.loads(path.read_text())
    config["num_hidden_layers"] = 3
    config["compress_ratios"] = [4, 128, 4, 0]      # layers.0 CSA, layers.1 HCA, layers.2 CSA, mtp.0
    config["num_hash_layers"] = 1
    return config


def kind_of(ratio: int) -> str:
    return "csa" if ratio == 4 else "hca"


def extrapolate(blocks: list[dict], head_per_stream: float, real: dict) -> dict:
    """Whole-model seconds from the measured blocks (see the module docstring)."""
    kinds = {0: "csa", 1: "hca", 2: "csa"}
    fixed: dict[str, dict[str, float]] = {}
    per_fork: dict[str, float] = {}
    candidates: dict[str, int] = {}
    for i, b in enumerate(blocks):
        kind = kinds[i]
        fixed.setdefault(kind, {k: b[k] for k in ("read", "candidates", "tracks", "mixes", "reference")})
        candidates.setdefault(kind, b["n_candidates"])
        if b["fork_passes"]:
            per_fork[kind] = b["forks"] / b["fork_passes"]
    ratios = real["compress_ratios"][: real["num_hidden_layers"]]
    forks = fork_passes = 0.0
    parts = {"read": 0.0, "candidates": 0.0, "tracks": 0.0, "mixes": 0.0, "reference": 0.0, "forks": 0.0}
    tracks = blocks[0]["n_tracks"]
    for ratio in ratios:
        kind = kind_of(ratio)
        for k in ("read", "candidates", "tracks", "mixes", "reference"):
            parts[k] += fixed[kind][k]
        parts["forks"] += forks * per_fork.get(kind, 0.0)
        fork_passes += forks
        forks += candidates[kind]
    parts["head"] = head_per_stream * (forks + tracks)
    total = sum(parts.values())
    return {"seconds": total, "minutes": total / 60, "parts": parts, "fork_passes": fork_passes, "forks": forks,
            "per_fork_pass": per_fork, "per_block": fixed, "candidates_per_block": candidates,
            "layers": {"csa": sum(r == 4 for r in ratios), "hca": sum(r == 128 for r in ratios),
                       "sliding (as hca)": sum(r == 0 for r in ratios)}}


def knapsack_seconds(real: dict, candidates: dict[str, int]) -> float:
    """The solver at the full model's size (43 layers x the measured decisions' options, made-up costs)."""
    import random

    from dsv4convert.automix.solve import Option, solve
    rng = random.Random(0)
    groups = []
    for _ in range(real["num_hidden_layers"]):
        groups.append([Option(f, b, rng.random()) for f, b in (("nvfp4", 2300), ("fp8", 4200), ("bf16", 8400))])
        for size in (60, 8, 30, 4):
            groups.append([Option("fp8", size, rng.random()), Option("bf16", 2 * size, 0.0)])
    t = time.perf_counter()
    solve(groups, sum(min(o.bytes for o in g) for g in groups) * 2)
    return time.perf_counter() - t


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True, help="results prefix (writes .json and .md)")
    parser.add_argument("--stages", default="synth,sensitivity")
    parser.add_argument("--commit", help="the commit measured (the device's copy may not know it)")
    parser.add_argument("--engine", default="sglang")
    parser.add_argument("--gpu-family", default="sm100")
    parser.add_argument("--sequences", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--banks", default="device,host", help="where the forks' streams live, one run each")
    parser.add_argument("--config", type=Path, default=REAL_CONFIG, help="the model to cut (a smaller one for a smoke run)")
    args = parser.parse_args()
    stages = args.stages.split(",")
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    base = work / "base"
    timings: dict = {}
    if "synth" in stages:
        (work / "config.json").write_text(json.dumps(bench_config(args.config)))
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "dsv4convert", "synth", "--config", str(work / "config.json"),
                        "--dst", str(base), "--overwrite"], check=True)
        timings["synth_seconds"] = time.perf_counter() - t
    from dsv4convert.automix import plan as automix
    from dsv4convert.automix.sensitivity import measure

    opts = automix.AutomixOptions(src=str(base), size=10**15, engine=args.engine, gpu_family=args.gpu_family,
                                  tokens=args.sequences * args.seq_len, seq_len=args.seq_len, device=args.device,
                                  progress=True)
    t = time.perf_counter()
    plan = automix.build(opts)
    timings["plan_seconds"] = time.perf_counter() - t
    automix.print_plan(plan)
    ids = torch.randint(0, plan.inspection.config.vocab_size, (args.sequences, args.seq_len),
                        generator=torch.Generator().manual_seed(0))
    cuda = plan.device.type == "cuda"
    needs = any("nvfp4" in lay.family.name for lay in plan.layouts)
    from dsv4convert.calibration import build_input_scales
    real = json.loads(REAL_CONFIG.read_text())
    runs = {}
    for place in args.banks.split(","):
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        measured = measure(plan.ckpt, plan.inspection, ids, plan.probes, plan.floors, plan.calibrations,
                           device=plan.device, dtype=plan.dtype, chunk=opts.chunk,
                           input_scales=build_input_scales(plan.ckpt) if needs else None, mixes=plan.uniforms,
                           bank_place=place, progress=True)
        streams = len(measured.costs) + len(measured.floors) + len(measured.calibrations) + len(measured.mixes)
        x = extrapolate(measured.blocks, measured.seconds["head"] / max(streams, 1), real)
        runs[place] = {"seconds": time.perf_counter() - t, "bank": measured.bank,
                       "peak_gpu_bytes": torch.cuda.max_memory_allocated() if cuda else 0,
                       "measured": measured.to_json(), "extrapolation": x}
    # Where the full model's forks would live: (forks + tracks + 1) streams of the tokens, beside the reserve.
    first = next(iter(runs.values()))["extrapolation"]
    cfg = plan.inspection.config
    from dsv4convert.automix.sensitivity import bank_reserve, stream_bytes
    full_bank = stream_bytes(int(first["forks"]) + len(plan.floors) + len(plan.calibrations) + 1, ids.numel(),
                             cfg.hc_mult, cfg.hidden_size, plan.dtype)
    reserve = bank_reserve(cfg, plan.dtype)
    free = torch.cuda.mem_get_info()[1] if cuda else 0
    full_place = "device" if full_bank + reserve < free else "host"
    x = runs.get(full_place, first)["extrapolation"] if full_place in runs else first
    x["knapsack_seconds"] = knapsack_seconds(real, x["candidates_per_block"])
    # The verified choice: one more pass measuring its candidates whole on other windows.
    from dsv4convert.automix import choose
    mixes = choose.candidates(plan, measured)
    t = time.perf_counter()
    selection = choose.measure_candidates(plan, mixes, torch.randint(0, plan.inspection.config.vocab_size,
                                                                     (args.sequences, args.seq_len),
                                                                     generator=torch.Generator().manual_seed(1)))
    verification = extrapolate(selection.blocks, selection.seconds["head"] / len(selection.mixes), real)
    verification["candidates"] = [{"name": m.name, "layout": m.layout.label} for m in mixes]
    timings["selection_seconds"] = time.perf_counter() - t
    timings["full_bank_bytes"], timings["full_bank_place"] = full_bank, full_place
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    run_info = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__, "python": platform.python_version(),
                "commit": args.commit or commit or "unknown", "command": " ".join(sys.argv), "engine": args.engine,
                "gpu_family": args.gpu_family, "tokens": args.sequences * args.seq_len,
                "layouts": [lay.label for lay in plan.layouts], "candidates": len(plan.probes),
                "calibrations": len(plan.calibrations)}
    result = {"run": run_info, "timings": timings, "runs": runs, "extrapolation": x,
              "selection": {"measured": selection.to_json(), "extrapolation": verification}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [f"# `dsv4convert automix` sensitivity pass on real-size synthetic layers: {run_info['device']}", "",
             f"Commit {run_info['commit']}, torch {run_info['torch']}, `{run_info['command']}`.", "",
             f"- synth (CPU): {timings.get('synth_seconds', 0):.1f} s (layers.0 CSA, layers.1 HCA, layers.2 CSA, mtp.0)",
             f"- menu: --engine {args.engine} on {args.gpu_family}: {len(plan.layouts)} layouts "
             f"({', '.join(run_info['layouts'])}); {len(plan.probes)} candidates over 3 layers, "
             f"{len(plan.calibrations)} calibration tracks + {len(plan.floors)} floor",
             f"- the full model's bank: {full_bank / 2**30:.0f} GiB of fork streams (+{reserve / 2**30:.0f} GiB "
             f"reserve) on a {free / 2**30:.0f} GiB GPU -> {full_place} memory; extrapolated from the {full_place} run"]
    for place, r in runs.items():
        lines += ["", f"### forks' streams in {r['bank']} memory: pass over 3 layers, {run_info['tokens']} tokens "
                  f"({args.sequences} x {args.seq_len}): {r['seconds']:.1f} s; peak GPU memory "
                  f"{r['peak_gpu_bytes'] / 2**30:.1f} GiB; whole model {r['extrapolation']['minutes']:.1f} min", "",
                  "| block | fork passes | candidates | read | candidates (make + run) | forks | tracks | reference |",
                  "|---|---|---|---|---|---|---|---|"]
        lines += [f"| {b['block']} | {b['fork_passes']} | {b['n_candidates']} | {b['read']:.2f} s | "
                  f"{b['candidates']:.2f} s | {b['forks']:.2f} s | {b['tracks']:.2f} s | {b['reference']:.2f} s |"
                  for b in r["measured"]["blocks"]]
    verdict = "met" if x["seconds"] < GOAL_SECONDS else "MISSED"
    lines += ["", f"Whole model ({x['layers']['csa']} CSA + {x['layers']['hca']} HCA + "
              f"{x['layers']['sliding (as hca)']} sliding as HCA), {run_info['tokens']} tokens: **{x['minutes']:.1f} min** "
              f"({', '.join(f'{k} {v:.0f} s' for k, v in x['parts'].items())}); {x['forks']:.0f} forks, "
              f"{x['fork_passes']:.0f} fork passes at {', '.join(f'{k} {v * 1000:.0f} ms' for k, v in x['per_fork_pass'].items())} "
              f"each; goal under 30 min -> {verdict}.",
              f"- knapsack at the full model's size: {x['knapsack_seconds']:.3f} s; planning (menu, plans, budget) "
              f"here: {timings['plan_seconds']:.1f} s",
              f"- the verified choice's selection pass, {len(mixes)} candidates ({', '.join(m.name for m in mixes)}) "
              f"over {run_info['tokens']} other tokens: {timings['selection_seconds']:.1f} s here, whole model "
              f"**{verification['minutes']:.1f} min** ({', '.join(f'{k} {v:.0f} s' for k, v in verification['parts'].items() if v)}); "
              f"with the sensitivity pass {x['minutes'] + verification['minutes']:.1f} min, goal under 30 min -> "
              f"{'met' if x['seconds'] + verification['seconds'] < GOAL_SECONDS else 'MISSED'}"]
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
