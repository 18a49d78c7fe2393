"""Time ``dsv4convert compare`` on real-size synthetic layers and extrapolate the whole model (GPU).

Run on a GPU machine from the repository root::

    PYTHONPATH=. python bench/compare.py --work /tmp/cmp --out bench/results/compare-h200

Stages (``--stages``, timings accumulate in ``<work>/timings.json``):

* ``synth``: the real ``config.json`` cut to two backbone layers, one CSA (ratio 4) and one HCA (ratio
  128), plus the MTP block (a sliding-window block): ``dsv4convert synth --config``;
* ``convert``: ``dsv4convert to-nvfp4 --device cuda`` of it (the variant);
* ``compare``: ``dsv4convert compare --device cuda`` of the variant against the base, served numerics on
  ``--gpu-family``, for each ``--shapes`` entry (sequences x tokens, 64K tokens by default: 16 x 4096 and
  1 x 65536), each in its own process (peak host memory is its own);
* ``recall``: ``dsv4convert compare --recall`` on the default grid cut at 64K tokens (3 depths), and
  at 128K tokens at one depth (``--recall-runs``);
* ``read``: ``cat`` of both checkpoints' files to /dev/null, the bytes a comparison must read at least;
* ``ranks``: the first ``--shapes`` entry once as a plain process and once per ``--ranks`` entry under
  ``torchrun --nproc-per-node N`` (one GPU each): time per layer, speedup against the plain run, torchrun's
  own cost at N = 1, peak GPU memory per rank, and whether compare.json equals the plain run's.

Extrapolation to DeepSeek-V4-Flash (2 sliding + 21 CSA + 20 HCA layers + 1 MTP block): each block's
time (reading and dequantizing its weights, the three forwards: base, variant on its own streams,
variant on the base's) comes from the measured block of its kind (the MTP block stands for the
sliding layers, whose attention is the same), plus the output heads and scoring once. Reading the
weights scales with their bytes, which real layers of a kind share.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import report  # noqa: E402

REAL_CONFIG = Path("dsv4convert/data/deepseek-v4-flash-config.json")
FULL = {"csa": 21, "hca": 20, "sliding": 2, "mtp": 1}
GOAL_SECONDS = 15 * 60
GOAL_DEVICE_BYTES = 80 * 2**30
EARLY_TRACKS = ["base", "variant (also on the base's input)", "base, chunk 1027"]  # runs that recorded no tracks
RECALL_GOALS = {"grid64K": 30 * 60, "single128K": 20 * 60}
PER_BLOCK = ("read", "forward", "metrics", "other")   # what every block pays; "buffers" only the first
# The default grid of V4-Flash as it was before the threshold was corrected (2176 then, 2052 now: needle.py),
# cut at 64K tokens, kept so that runs stay comparable with bench/results; and the 128K single-depth check.
RECALL_RUNS = {"grid64K": ("1024,2039,2046,2309,4096,8191,16382,32765,65536", "0.1,0.5,0.9"),
               "single128K": ("131071", "0.5")}


def bench_config(path: Path) -> dict:
    config = json.loads(path.read_text())
    config["num_hidden_layers"] = 2
    config["compress_ratios"] = [4, 128, 0]      # layers.0 CSA, layers.1 HCA, mtp.0
    config["num_hash_layers"] = 1
    return config


def _timed(command: list[str]) -> float:
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "dsv4convert", *command], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"dsv4convert {' '.join(command)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return time.monotonic() - start


def _bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--out", default="bench/results/compare-h200")
    parser.add_argument("--stages", default="synth,convert,compare,recall,read")
    parser.add_argument("--ranks", default="1", help="ranks stage: torchrun world sizes, e.g. 1,2,4")
    parser.add_argument("--recall-runs", default="grid64K,single128K",
                        help="grid64K: the default grid to 64K, 3 depths; single128K: 131071 tokens at depth 0.5")
    parser.add_argument("--shapes", default="16x4096,1x65536", help="sequences x tokens per comparison")
    parser.add_argument("--gpu-family", default="sm100",
                        help="whose served numerics (default sm100: both sides quantize their experts' activations)")
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--config", type=Path, default=REAL_CONFIG, help="model config to cut (smoke tests: a preset's)")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    stages = args.stages.split(",")
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    base, variant = work / "base", work / "nvfp4"
    timings_path = work / "timings.json"
    timings = json.loads(timings_path.read_text()) if timings_path.exists() else {}
    if "synth" in stages:
        (work / "config.json").write_text(json.dumps(bench_config(args.config)))
        timings["synth_seconds"] = _timed(["synth", "--config", str(work / "config.json"), "--dst", str(base),
                                           "--overwrite"])
        timings["base_bytes"] = _bytes(base)
    if "convert" in stages:
        timings["convert_seconds"] = _timed(["to-nvfp4", "--src", str(base), "--dst", str(variant), "--overwrite",
                                             "--no-progress", "--device", args.device])
        timings["variant_bytes"] = _bytes(variant)
    if "read" in stages:
        files = sorted([*base.glob("*.safetensors"), *variant.glob("*.safetensors")])
        start = time.monotonic()
        subprocess.run(["cat", *map(str, files)], stdout=subprocess.DEVNULL, check=True)
        timings["read_both_seconds"] = time.monotonic() - start
    if "compare" in stages:
        timings["runs"] = {}
        for shape in args.shapes.split(","):
            sequences, tokens = (int(x) for x in shape.split("x"))
            out = work / f"report-{shape}"
            before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
            wall = _timed(["compare", "--base", str(base), "--variant", str(variant), "--random-tokens",
                           "--tokens", str(sequences * tokens), "--seq-len", str(tokens), "--device", args.device,
                           "--gpu-family", args.gpu_family, "--chunk", str(args.chunk), "--no-progress",
                           "--report", str(out)])
            rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
            result = json.loads((out / "compare.json").read_text())
            timings["runs"][shape] = {"wall_seconds": wall, "peak_host_bytes": rss * 1024 if rss > before else None,
                                      "result": {k: result[k] for k in ("output", "blocks", "seconds",
                                                                         "peak_device_bytes", "estimate", "settings")}}
    if "recall" in stages:
        timings["recall"] = {}
        for name in args.recall_runs.split(","):
            lengths, depths = RECALL_RUNS[name]
            out = work / f"recall-{name}"
            before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
            wall = _timed(["compare", "--base", str(base), "--variant", str(variant), "--recall", "--lengths", lengths,
                           "--depths", depths, "--device", args.device, "--gpu-family", args.gpu_family,
                           "--chunk", str(args.chunk), "--no-progress", "--report", str(out)])
            rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
            result = json.loads((out / "recall.json").read_text())
            timings["recall"][name] = {"wall_seconds": wall, "peak_host_bytes": rss * 1024 if rss > before else None,
                                       "lengths": lengths, "depths": depths,
                                       "result": {**{k: result[k] for k in ("seconds", "blocks", "peak_device_bytes",
                                                                            "estimate", "settings", "data")},
                                                  "tracks": list(result["recall"]["tracks"])},
                                       "verdicts": result["recall"]["verdicts"]}
    if "ranks" in stages:
        timings["ranks"] = rank_runs(base, variant, work, args)
    timings_path.write_text(json.dumps(timings, indent=1))
    write_report(timings, args)
    return 0


def _comparable(report_dir: Path) -> dict:
    result = json.loads((report_dir / "compare.json").read_text())
    for key in ("seconds", "peak_device_bytes", "distributed", "estimate"):
        result.pop(key, None)
    for block in result["blocks"]:
        block.pop("seconds")
    return result


def rank_runs(base: Path, variant: Path, work: Path, args: argparse.Namespace) -> dict:
    """The first shape as a plain process, then under torchrun for each world size."""
    sequences, tokens = (int(x) for x in args.shapes.split(",")[0].split("x"))
    common = ["--base", str(base), "--variant", str(variant), "--random-tokens", "--tokens",
              str(sequences * tokens), "--seq-len", str(tokens), "--device", args.device, "--gpu-family",
              args.gpu_family, "--chunk", str(args.chunk), "--no-progress"]
    runs = {}
    for name, ranks in [("plain", None), *((f"torchrun {n}", int(n)) for n in args.ranks.split(","))]:
        out = work / f"ranks-{name.replace(' ', '-')}"
        launcher = [] if ranks is None else ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                                              str(ranks)]
        start = time.monotonic()
        done = subprocess.run([sys.executable, *launcher, "-m", "dsv4convert", "compare", *common, "--report",
                               str(out)], capture_output=True, text=True)
        wall = time.monotonic() - start
        if done.returncode != 0:
            raise RuntimeError(f"{name}: compare failed ({done.returncode}):\n{done.stderr[-3000:]}")
        result = json.loads((out / "compare.json").read_text())
        runs[name] = {"ranks": ranks or 1, "wall_seconds": wall, "engine_seconds": result["seconds"],
                      "layer_seconds": {b["block"]: sum(b["seconds"].values()) for b in result["blocks"]},
                      "distributed": result["distributed"],
                      "equals_plain": _comparable(out) == _comparable(work / "ranks-plain")}
    return runs


def extrapolate(run: dict, timings: dict) -> dict:
    blocks = {b["block"]: b["seconds"] for b in run["result"]["blocks"]}
    kinds = {"csa": blocks["layers.0"], "hca": blocks["layers.1"], "sliding": blocks["mtp.0"], "mtp": blocks["mtp.0"]}
    seconds = run["result"]["seconds"]
    per_block = PER_BLOCK if "other" in blocks["layers.0"] else ("read", "forward", "metrics")
    in_blocks = {k: sum(b[k] for b in blocks.values()) for k in per_block}
    heads = seconds["metrics"] - in_blocks["metrics"]          # both heads and the scoring, once
    fixed = seconds["total"] - sum(in_blocks.values()) - heads
    if "other" not in blocks["layers.0"]:
        # An engine that did not time the rest of each block: counted per block, an upper bound.
        fixed *= sum(FULL.values()) / len(blocks)
    # else: what is left (embedding, new host buffers, set-up) happens once, and the measured blocks
    # already paid the buffers the whole model needs (every later block reuses them)
    full = {k: sum(FULL[kind] * kinds[kind][k] for kind in FULL) for k in per_block}
    total = sum(full.values()) + heads + fixed
    model_bytes = 2 * 160e9                                     # both checkpoints of the real model
    measured_bytes = timings.get("base_bytes", 0) + timings.get("variant_bytes", 0)
    read_rate = measured_bytes / timings["read_both_seconds"] if timings.get("read_both_seconds") else None
    return {"per_kind_seconds": kinds, "heads_and_scoring_seconds": heads, "other_seconds": fixed,
            "full_model_seconds": {**full, "heads_and_scoring": heads, "once": fixed, "total": total},
            "read_both_full_model_seconds_at_measured_rate": model_bytes / read_rate if read_rate else None}


def _host(run: dict) -> str:
    peak = run["peak_host_bytes"]
    return f"{peak / 2**30:.1f} GiB" if peak else "not told apart (an earlier run of the call peaked higher)"


def write_report(timings: dict, args: argparse.Namespace, run_info: dict | None = None) -> None:
    """The summary; ``run_info`` of the machine that measured ``timings`` (default: this one)."""
    if run_info is None:
        run_info = report.gpu_run() if args.device.startswith("cuda") else {
            "device": "cpu (smoke test)", "commit": "-", "torch": "-", "command": "python " + " ".join(sys.argv)}
    lines = [f"# `dsv4convert compare` on real-size synthetic layers: {run_info['device']}", "",
             f"Commit {run_info['commit']}, torch {run_info['torch']}, `{run_info['command']}`.", "",
             f"- synth (CPU): {timings.get('synth_seconds', 0):.1f} s for {timings.get('base_bytes', 0) / 1e9:.2f} GB "
             "(layers.0 CSA, layers.1 HCA, mtp.0; the real config otherwise)",
             f"- to-nvfp4 --device cuda: {timings.get('convert_seconds', 0):.1f} s, "
             f"{timings.get('variant_bytes', 0) / 1e9:.2f} GB",
             f"- cat of both checkpoints to /dev/null: {timings.get('read_both_seconds', 0):.1f} s", ""]
    results = {"run": run_info, "timings": timings, "extrapolation": {}}
    for shape, run in timings.get("runs", {}).items():
        r = run["result"]
        x = extrapolate(run, timings)
        results["extrapolation"][shape] = x
        total = x["full_model_seconds"]["total"]
        lines += [f"## {shape} tokens (served numerics, {args.gpu_family}), chunk {r['settings']['chunk']}", "",
                  f"Wall {run['wall_seconds']:.1f} s; peak GPU memory {(r['peak_device_bytes'] or 0) / 2**30:.1f} GiB "
                  f"(estimate {r['estimate']['peak_device_bytes'] / 2**30:.1f} GiB); peak host memory "
                  f"{_host(run)}; mean KLD {r['output']['kld']['mean']:.4g}.", "",
                  "| block | read + dequantize | forward (3 passes) | metrics | rest of the block | new host buffers |",
                  "|---|---|---|---|---|---|"]
        for b in r["blocks"]:
            s = b["seconds"]
            lines.append(f"| {b['block']} | {s['read']:.2f} s | {s['forward']:.2f} s | {s['metrics']:.2f} s | "
                         f"{s.get('other', 0):.2f} s | {s.get('buffers', 0):.2f} s |")
        full = x["full_model_seconds"]
        lines += ["", f"Whole model (2 sliding + 21 CSA + 20 HCA + MTP): **{total / 60:.1f} min** "
                      f"(read {full['read']:.0f} s, forward {full['forward']:.0f} s, metrics {full['metrics']:.0f} s, "
                      f"heads and scoring {full['heads_and_scoring']:.0f} s, rest of the blocks {full.get('other', 0):.0f} s, "
                      f"once per run {full['once']:.0f} s); goal under {GOAL_SECONDS // 60} min "
                      f"-> {'met' if total < GOAL_SECONDS else 'MISSED'}. Peak GPU memory goal under 80 GiB -> "
                      f"{'met' if (r['peak_device_bytes'] or 0) < GOAL_DEVICE_BYTES else 'MISSED'}.", ""]
        if x["read_both_full_model_seconds_at_measured_rate"]:
            lines += [f"Reading both full checkpoints (2 x 160 GB) at the rate cat measured here: "
                      f"{x['read_both_full_model_seconds_at_measured_rate']:.0f} s; the whole comparison is "
                      f"{total / x['read_both_full_model_seconds_at_measured_rate']:.2f}x that.", ""]
    for name, run in timings.get("recall", {}).items():
        r = run["result"]
        timed = "other" in r["blocks"][0]["seconds"]
        blocks = {b["block"]: sum(v for k, v in b["seconds"].items() if k in PER_BLOCK or not timed)
                  for b in r["blocks"]}
        # The rest: embedding, heads, new host buffers (paid by the first blocks, reused by every later one);
        # once per run where the engine timed each block's own rest, else counted per block (an upper bound).
        other = r["seconds"]["total"] - sum(blocks.values())
        if not timed:
            other /= len(blocks)
        # No MTP block in a recall run; the two sliding-window layers are counted as HCA layers (an upper bound).
        full = 21 * blocks["layers.0"] + 22 * blocks["layers.1"] + (other if timed else 43 * other)
        lines += [f"## compare --recall, {name}: lengths {run['lengths']}, depths {run['depths']}", "",
                  f"{r['data']['prompts']} prompts; tracks {', '.join(r.get('tracks', EARLY_TRACKS))}; "
                  f"wall {run['wall_seconds']:.1f} s; CSA layer {blocks['layers.0']:.1f} s, HCA layer "
                  f"{blocks['layers.1']:.1f} s, the rest {other:.1f} s {'once' if timed else 'per block'}; peak GPU memory "
                  f"{(r['peak_device_bytes'] or 0) / 2**30:.1f} GiB (estimate {r['estimate']['peak_device_bytes'] / 2**30:.1f}); "
                  f"peak host memory {_host(run)}.", "",
                  f"Whole model (21 CSA + 20 HCA + 2 sliding layers counted as HCA): **{full / 60:.1f} min**; goal "
                  f"under {RECALL_GOALS[name] // 60} min -> {'met' if full < RECALL_GOALS[name] else 'MISSED'}.", "",
                  *[f"- {v}" for v in run["verdicts"]], ""]
        results["extrapolation"][f"recall-{name}"] = {"block_seconds": blocks, "other_seconds": other,
                                                      "full_model_seconds": full}
    if timings.get("ranks"):
        runs = timings["ranks"]
        plain = runs["plain"]["engine_seconds"]["total"]
        lines += ["## Ranks (torch.distributed, one GPU each)", "",
                  "| run | ranks | engine time | speedup vs plain | per layer (CSA / HCA / MTP) | peak GPU per rank | "
                  "compare.json equals the plain run's |", "|---|---|---|---|---|---|---|"]
        for name, run in runs.items():
            layers = run["layer_seconds"]
            peaks = run["distributed"].get("peak_device_bytes_per_rank") or []
            lines.append(f"| {name} | {run['ranks']} | {run['engine_seconds']['total']:.1f} s | "
                         f"{plain / run['engine_seconds']['total']:.2f}x | "
                         f"{layers.get('layers.0', 0):.1f} / {layers.get('layers.1', 0):.1f} / "
                         f"{layers.get('mtp.0', 0):.1f} s | "
                         f"{', '.join(f'{p / 2**30:.1f} GiB' for p in peaks if p) or '-'} | {run['equals_plain']} |")
        if "torchrun 1" in runs:
            overhead = runs["torchrun 1"]["engine_seconds"]["total"] / plain - 1
            lines += ["", f"torchrun at N = 1 costs {100 * overhead:+.1f}% against the plain run (goal: at most +5%)."]
        lines.append("")
        results["ranks"] = runs
    report.write(args.out, results, "\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
