"""W4A16 from MXFP4: weight SNR per expert for each INT4 scheme, and to-w4a16's time against cp.

On one real-size synthetic layer (``dsv4convert synth --config <real config> --num-layers 1``:
``layers.0`` and the MTP block, 512 routed experts of three 2048 x 4096 / 4096 x 2048 matrices),
in one run and in this order:

1. ``cp -r`` of the source (then ``sync``), cold source;
2. today's converter (``--baseline DIR``: a checkout from before the scale search, e.g.
   ``git archive b250710 | tar -x -C DIR``), ``to-w4a16`` with its defaults (group 128, amax / 7.5);
3. this checkout's ``to-w4a16`` for every scheme (``--group-size`` x ``--scale-rule``);
4. ``cp`` again. Each converter's time is divided by the mean of the two cp runs.

Every source is evicted from the page cache before each timed command (posix_fadvise). After
each conversion (untimed) the output's experts are dequantized and compared with the MXFP4
source: SNR per expert (w1, w2, w3 together), worst / median / best per block, and the bytes the
experts take. ``amax`` at group 128 must be byte-identical to today's output (compared tensor by
tensor, and reported).

``--compute-repeats R`` times one core's quantization of single expert matrices, today's
``quantize_int4_weight`` (imported from ``--baseline``) against each scheme, alternating in one
process: the work ratio without the I/O and less disturbed by other processes.

``--timing-rounds R`` times R more rounds of (cp, today, each scheme) without the quality
passes, for ratios less at the mercy of a shared machine's drifting load.

``--gptq-experts N`` adds GPTQ on N real-size experts of layers.0 with synthetic correlated
activations (outlier channels, as real ones have; 2 x 4096 calibration rows, 2048 held out):
held-out output error of round-to-nearest and GPTQ, each with both scale rules, at group 32 and
128. ``--tiny-calibration`` runs ``dsv4convert calibrate --report`` (transformers' layers, every
block) on the tiny synthetic model at both group sizes: GPTQ against round-to-nearest per
calibrated layer.

    python bench/w4a16_quality.py --src SRC --baseline /tmp/base --work /tmp/w4a16-work \\
        --gptq-experts 2 --tiny-calibration
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.convert import GB, PeakRSS, _machine, evict  # noqa: E402
from dsv4convert.checkpoint import Checkpoint  # noqa: E402
from dsv4convert.convert.modules import dequantize_source  # noqa: E402
from dsv4convert.formats import (  # noqa: E402
    Format,  # noqa: E402
    dequantize_int4,
    quantize_int4_weight,
)
from dsv4convert.formats.gptq import gptq_quantize_int4  # noqa: E402
from dsv4convert.models.deepseek_v4.layout import Role, classify  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
SCHEMES = [(128, "amax"), (128, "mse"), (32, "amax"), (32, "mse")]


def _git(*args: str, cwd: Path = REPO) -> str:
    try:
        return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _commit() -> str:
    dirty = _git("status", "--porcelain", "--", "dsv4convert", "recipes", "bench/w4a16_quality.py")
    return _git("rev-parse", "HEAD") + ("-dirty" if dirty else "")


def _size(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def timed(cmd: list[str], src: Path, dst: Path, *, cwd: Path = REPO, then_sync: bool = False) -> dict:
    """Wall and CPU seconds and peak RSS of ``cmd`` on a cold ``src`` into a fresh ``dst`` (kept)."""
    if dst.exists():
        shutil.rmtree(dst)
    evict(src)
    load = os.getloadavg()[0]
    cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONPATH": str(cwd)})
    rss = PeakRSS(proc.pid)
    output, _ = proc.communicate()
    if then_sync and proc.returncode == 0:
        os.sync()
    seconds = time.monotonic() - t0
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    rss.stop()
    if proc.returncode:
        raise SystemExit(f"command failed ({proc.returncode}): {shlex.join(cmd)}\n{output[-3000:]}")
    cpu = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
    return {"command": shlex.join(cmd), "cwd": str(cwd), "seconds": round(seconds, 2), "cpu_seconds": round(cpu, 1),
            "peak_rss_gb": round(rss.peak_total / GB, 3), "output_bytes": _size(dst), "load_avg_1m_before": round(load, 2)}


def _experts(ckpt: Checkpoint) -> dict[str, list[str]]:
    """Routed expert prefix (``layers.0.ffn.experts.7``) -> its three projection modules."""
    out: dict[str, list[str]] = {}
    for name in ckpt.tensors:
        info = classify(name)
        if info.role is Role.ROUTED_EXPERT and name.endswith((".weight", ".weight_packed")):
            out.setdefault(info.module.rsplit(".", 1)[0], []).append(info.module)
    return {e: sorted(set(m)) for e, m in sorted(out.items())}


def _read(ckpt: Checkpoint, module: str, fmt: Format) -> torch.Tensor:
    params = {"weight", "scale"} if fmt is Format.MXFP4 else {"weight_packed", "weight_scale", "weight_shape"}
    return dequantize_source(fmt, {p: ckpt.read(f"{module}.{p}") for p in params}, module, {})


def expert_snr(src: Path, out: Path) -> dict:
    """SNR (dB) of every routed expert of ``out`` (INT4) against ``src`` (MXFP4), and the experts' bytes."""
    source, converted = Checkpoint.open(src), Checkpoint.open(out)
    snr, expert_bytes = {}, 0
    for expert, modules in _experts(source).items():
        signal = noise = 0.0
        for module in modules:
            reference = _read(source, module, Format.MXFP4)
            restored = _read(converted, module, Format.INT4)
            signal += float(reference.square().sum(dtype=torch.float64))
            noise += float((reference - restored).square_().sum(dtype=torch.float64))
            expert_bytes += sum(converted.tensors[f"{module}.{p}"].nbytes
                                for p in ("weight_packed", "weight_scale", "weight_shape"))
        snr[expert] = round(-10 * math.log10(noise / signal), 3)
    return {"snr_db": snr, "expert_bytes": expert_bytes}


def tensor_digest(root: Path) -> str:
    """sha256 over every tensor's name, dtype, shape and bytes (shard layout and metadata aside)."""
    ckpt = Checkpoint.open(root)
    h = hashlib.sha256()
    for name in sorted(ckpt.tensors):
        entry = ckpt.tensors[name]
        h.update(f"{name} {entry.dtype} {list(entry.shape)}\n".encode())
        h.update(ckpt.read(name).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _blocks(snr: dict[str, float]) -> dict[str, dict]:
    per: dict[str, list[float]] = {}
    for expert, value in snr.items():
        per.setdefault(expert.split(".ffn.")[0], []).append(value)
    per["all"] = list(snr.values())
    return {block: {"worst": min(v), "median": round(statistics.median(v), 3), "best": max(v), "experts": len(v)}
            for block, v in per.items()}


def conversions(args: argparse.Namespace, result: dict) -> None:
    src, work = args.src.resolve(), args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    out = work / "out"
    result["source_bytes"] = _size(src)
    cps = [timed(["cp", "-r", str(src), str(work / "cp-out")], src, work / "cp-out", then_sync=True)]
    shutil.rmtree(work / "cp-out")
    runs = []
    base_cmd = [sys.executable, "-m", "dsv4convert", "to-w4a16", "--src", str(src), "--dst", str(out), "--no-progress"]
    if args.baseline:
        row = timed(base_cmd, src, out, cwd=args.baseline.resolve())
        row.update(scheme="today (group 128, amax / 7.5)", commit=_git("rev-parse", "HEAD", cwd=args.baseline)
                   if (args.baseline / ".git").exists() else args.baseline_commit)
        row["tensor_digest"] = tensor_digest(out)
        runs.append(row)
        print(f"today: {row['seconds']} s", flush=True)
        shutil.rmtree(out)
    for group_size, rule in args.schemes:
        row = timed(base_cmd + ["--group-size", str(group_size), "--scale-rule", rule], src, out)
        row.update(scheme=f"group {group_size}, {rule}", group_size=group_size, scale_rule=rule)
        print(f"group {group_size} {rule}: {row['seconds']} s", flush=True)
        quality = expert_snr(src, out)
        row.update(expert_bytes=quality["expert_bytes"], blocks=_blocks(quality["snr_db"]), snr_db=quality["snr_db"])
        if (group_size, rule) == (128, "amax"):
            row["tensor_digest"] = tensor_digest(out)
        runs.append(row)
        shutil.rmtree(out)
        save(args, {**result, "runs": runs, "cp": cps})
    cps.append(timed(["cp", "-r", str(src), str(work / "cp-out")], src, work / "cp-out", then_sync=True))
    shutil.rmtree(work / "cp-out")
    cp_mean = statistics.mean(c["seconds"] for c in cps)
    today = next((r for r in runs if r["scheme"].startswith("today")), None)
    for row in runs:
        row["ratio_to_cp"] = round(row["seconds"] / cp_mean, 2)
        if today is not None:
            row["ratio_to_today"] = round(row["seconds"] / today["seconds"], 2)
    result.update(runs=runs, cp=cps, cp_mean_seconds=round(cp_mean, 2))
    amax = next((r for r in runs if r.get("group_size") == 128 and r.get("scale_rule") == "amax"), None)
    if today is not None and amax is not None:
        result["amax_group128_identical_to_today"] = amax["tensor_digest"] == today["tensor_digest"]


def timing_rounds(args: argparse.Namespace, result: dict) -> None:
    """``--timing-rounds R``: R rounds of (cp, today, every scheme), then cp; no quality passes.

    Each converter run is divided by the mean of the cp runs just before and after its round, and
    by today's run of the same round: the shared machine's load drifts within minutes.
    """
    src, work = args.src.resolve(), args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    out = work / "out"
    base_cmd = [sys.executable, "-m", "dsv4convert", "to-w4a16", "--src", str(src), "--dst", str(out), "--no-progress"]

    def cp() -> dict:
        row = timed(["cp", "-r", str(src), str(work / "cp-out")], src, work / "cp-out", then_sync=True)
        shutil.rmtree(work / "cp-out")
        return row

    cps, rows = [cp()], []
    for round_ in range(args.timing_rounds):
        runs = [("today", base_cmd, args.baseline.resolve())] if args.baseline else []
        runs += [(f"group {g}, {rule}", base_cmd + ["--group-size", str(g), "--scale-rule", rule], REPO)
                 for g, rule in args.schemes]
        for scheme, cmd, cwd in runs:
            row = timed(cmd, src, out, cwd=cwd)
            shutil.rmtree(out)
            row.update(scheme=scheme, round=round_)
            rows.append(row)
            print(f"round {round_} {scheme}: {row['seconds']} s", flush=True)
        cps.append(cp())
    for row in rows:
        around = statistics.mean([cps[row["round"]]["seconds"], cps[row["round"] + 1]["seconds"]])
        row["ratio_to_cp"] = round(row["seconds"] / around, 2)
        today = next((r for r in rows if r["round"] == row["round"] and r["scheme"] == "today"), None)
        if today is not None:
            row["ratio_to_today"] = round(row["seconds"] / today["seconds"], 2)
            row["cpu_ratio_to_today"] = round(row["cpu_seconds"] / today["cpu_seconds"], 2)
    summary = {}
    for scheme in dict.fromkeys(r["scheme"] for r in rows):
        mine = [r for r in rows if r["scheme"] == scheme]
        summary[scheme] = {"median_seconds": round(statistics.median(r["seconds"] for r in mine), 1),
                           "median_ratio_to_cp": round(statistics.median(r["ratio_to_cp"] for r in mine), 2),
                           "median_cpu_seconds": round(statistics.median(r["cpu_seconds"] for r in mine), 1),
                           "ratios_to_today": [r.get("ratio_to_today") for r in mine],
                           "cpu_ratios_to_today": [r.get("cpu_ratio_to_today") for r in mine],
                           "load_before": [r["load_avg_1m_before"] for r in mine]}
    result["timing"] = {"rounds": args.timing_rounds, "cp": cps, "runs": rows, "summary": summary}


def compute_per_matrix(args: argparse.Namespace, result: dict) -> None:
    """``--compute-repeats R``: one core's time to quantize one expert matrix, today's code against this one.

    The conversion's work without its I/O: dequantize the MXFP4 source, then today's
    ``quantize_int4_weight`` (imported from ``--baseline``) or this checkout's per scheme, all
    alternating in one process on the same matrices, medians over R rounds. Less at the mercy of
    other processes than wall times of whole conversions.
    """
    import importlib.util

    torch.set_num_threads(1)
    ckpt = Checkpoint.open(args.src)
    modules = [m for e in list(_experts(ckpt))[:2] for m in _experts(ckpt)[e]]
    sources = [{p: ckpt.read(f"{m}.{p}") for p in ("weight", "scale")} for m in modules]
    spec = importlib.util.spec_from_file_location("today_int4", args.baseline / "dsv4convert" / "formats" / "int4.py")
    today = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(today)
    cases = {"today (group 128, amax / 7.5)": lambda w: today.quantize_int4_weight(w, group_size=128)}
    cases.update({f"group {g}, {rule}": (lambda w, g=g, rule=rule: quantize_int4_weight(w, group_size=g, scale_rule=rule))
                  for g, rule in args.schemes})
    times: dict[str, list[float]] = {name: [] for name in ["dequantize"] + list(cases)}
    for _ in range(args.compute_repeats):
        for name in times:
            t0 = time.perf_counter()
            for module, src in zip(modules, sources):
                w = dequantize_source(Format.MXFP4, src, module, {})
                if name != "dequantize":
                    cases[name](w)
            times[name].append((time.perf_counter() - t0) / len(modules))
    dequant = statistics.median(times["dequantize"])
    rows = {name: {"ms_per_matrix": round(1000 * statistics.median(v), 1),
                   "quantize_ms": round(1000 * (statistics.median(v) - dequant), 1)} for name, v in times.items()}
    base = rows["today (group 128, amax / 7.5)"]["ms_per_matrix"]
    for name, row in rows.items():
        row["x_today"] = round(row["ms_per_matrix"] / base, 2)
    result["compute_per_matrix"] = {"modules": modules, "repeats": args.compute_repeats, "threads": 1, "rows": rows,
                                    "load_avg_1m_after": round(os.getloadavg()[0], 2)}
    torch.set_num_threads(os.cpu_count() or 1)


def _correlated_inputs(k: int, rows: int, gen: torch.Generator) -> torch.Tensor:
    """Activations with correlated channels and a few outlier channels (tests/test_calibrate.py's model)."""
    mix = torch.randn(k, k, generator=gen) / k**0.5 + torch.eye(k)
    x = torch.randn(rows, k, generator=gen) @ mix
    x[:, :8] *= 20.0
    return x


def gptq_experts(args: argparse.Namespace, result: dict) -> None:
    """Held-out relative output error ||XW^T - XQ^T|| / ||XW^T|| for RTN and GPTQ, both rules, both groups."""
    ckpt = Checkpoint.open(args.src)
    experts = [e for e in _experts(ckpt) if e.startswith("layers.0.")][:args.gptq_experts]
    gen = torch.Generator().manual_seed(0)
    rows = []
    for expert in experts:
        for module in _experts(ckpt)[expert]:
            w = _read(ckpt, module, Format.MXFP4)
            x = _correlated_inputs(w.shape[1], 8192 + 2048, gen)
            calib, held = x[:8192], x[8192:]
            hessian = calib.T @ calib
            reference = held @ w.T
            row = {"module": module}
            for group_size in (32, 128):
                for rule in ("amax", "mse"):
                    for method in ("rtn", "gptq"):
                        t0 = time.perf_counter()
                        q = (gptq_quantize_int4(w, hessian, group_size=group_size, scale_rule=rule) if method == "gptq"
                             else quantize_int4_weight(w, group_size=group_size, scale_rule=rule))
                        seconds = time.perf_counter() - t0
                        restored = dequantize_int4(q.weight_packed, q.weight_scale, q.weight_shape, group_size=group_size)
                        error = float((reference - held @ restored.T).norm() / reference.norm())
                        row[f"g{group_size}_{rule}_{method}"] = round(error, 5)
                        row[f"g{group_size}_{rule}_{method}_seconds"] = round(seconds, 2)
            rows.append(row)
            print(json.dumps(row), flush=True)
    result["gptq_real_size"] = {"experts": experts, "calibration_rows": 8192, "heldout_rows": 2048, "rows": rows}


WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing matches "
         "under pale moonlight near ancient rivers").split()


def tiny_calibration(args: argparse.Namespace, result: dict) -> None:
    """``calibrate --report`` on the tiny synthetic model: per block, GPTQ vs round-to-nearest."""
    from dsv4convert.calibrate.stream import CalibrateOptions, Calibrator
    from dsv4convert.synth import preset_config, synthesize

    with tempfile.TemporaryDirectory(prefix="w4a16-tiny-") as tmp:
        root = Path(tmp)
        synthesize(root / "tiny", preset_config("tiny"), seed=0)
        rng = random.Random(1)
        data = root / "calib.jsonl"
        data.write_text("\n".join(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(400))})
                                  for _ in range(40)) + "\n")
        out = {}
        for group_size in (32, 128):
            content = Calibrator(CalibrateOptions(
                source=root / "tiny", output=root / f"calib-{group_size}.json", data=data, num_sequences=8, seq_len=128,
                holdout=2, batch_size=10, dtype="float32", report=True, report_experts=4, progress=False,
                report_group_size=group_size)).run()
            out[group_size] = content["report"]
        result["tiny_calibration"] = out


def markdown(result: dict) -> str:
    m = result["machine"]
    lines = ["# W4A16 from MXFP4: INT4 schemes on one real-size synthetic layer", "",
             f"- machine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB; torch {m['torch']}",
             f"- commit `{result['commit']}`", f"- command: `{result['command']}`",
             f"- source: `{result.get('source_command', '')}` ({result.get('source_bytes', 0) / GB:.2f} GB)", ""]
    runs = result.get("runs", [])
    if runs:
        lines += ["SNR of every routed expert (w1, w2, w3 together) against the MXFP4 source, dB; time against "
                  f"`cp -r` of the same bytes (mean of the cp runs before and after: {result.get('cp_mean_seconds')} s):",
                  "", "| scheme | worst expert | median | best | layers.0 worst | mtp.0 worst | expert GB | seconds | x cp | x today |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in runs:
            b = r.get("blocks", {})
            cells = [f"{b['all']['worst']:.2f}", f"{b['all']['median']:.2f}", f"{b['all']['best']:.2f}",
                     f"{b.get('layers.0', {}).get('worst', float('nan')):.2f}",
                     f"{b.get('mtp.0', {}).get('worst', float('nan')):.2f}",
                     f"{r['expert_bytes'] / GB:.3f}"] if b else ["(same bytes as group 128, amax)"] + [""] * 5
            lines.append(f"| {r['scheme']} | " + " | ".join(cells) +
                         f" | {r['seconds']:.1f} | {r.get('ratio_to_cp', '')} | {r.get('ratio_to_today', '')} |")
        if "amax_group128_identical_to_today" in result:
            lines += ["", f"group 128 + amax is byte-identical to today's output (every tensor): "
                          f"**{result['amax_group128_identical_to_today']}**"]
    g = result.get("gptq_real_size")
    if g:
        lines += ["", f"GPTQ on real-size experts ({', '.join(g['experts'])}), synthetic correlated activations, "
                      f"{g['calibration_rows']} calibration rows, {g['heldout_rows']} held out: relative output error",
                  "", "| module | group | RTN amax | RTN mse | GPTQ amax | GPTQ mse | GPTQ mse seconds |", "|---|---|---|---|---|---|---|"]
        for r in g["rows"]:
            for gs in (32, 128):
                lines.append(f"| {r['module']} | {gs} | {r[f'g{gs}_amax_rtn']} | {r[f'g{gs}_mse_rtn']} | "
                             f"{r[f'g{gs}_amax_gptq']} | {r[f'g{gs}_mse_gptq']} | {r[f'g{gs}_mse_gptq_seconds']} |")
    compute = result.get("compute_per_matrix")
    if compute:
        lines += ["", f"One core, per expert matrix ({len(compute['modules'])} matrices, median of {compute['repeats']} "
                      "alternating rounds): dequantize the MXFP4 source, then quantize (includes the dequantize):", "",
                  "| code | ms per matrix | of which quantize | x today |", "|---|---|---|---|"]
        for name, row in compute["rows"].items():
            lines.append(f"| {name} | {row['ms_per_matrix']} | {row['quantize_ms']} | {row['x_today']} |")
    timing = result.get("timing")
    if timing:
        lines += ["", f"Timing only, {timing['rounds']} rounds of (cp, today, each scheme), cp at the end; each run against "
                      "the cp runs around its round and against today's run of the same round:", "",
                  "| scheme | median seconds | median x cp | wall x today, per round | median CPU s | "
                  "CPU x today, per round | load before, per round |", "|---|---|---|---|---|---|---|"]
        for scheme, row in timing["summary"].items():
            lines.append(f"| {scheme} | {row['median_seconds']} | {row['median_ratio_to_cp']} | "
                         f"{', '.join(str(r) for r in row['ratios_to_today'])} | {row['median_cpu_seconds']} | "
                         f"{', '.join(str(r) for r in row['cpu_ratios_to_today'])} | "
                         f"{', '.join(str(r) for r in row['load_before'])} |")
        lines += ["", "cp runs (s): " + ", ".join(str(c["seconds"]) for c in timing["cp"])]
    t = result.get("tiny_calibration")
    if t:
        lines += ["", "`calibrate --report` on the tiny synthetic model (8 x 128 calibration tokens, 2 x 128 held out, "
                      "4 experts per block): relative held-out output error", "",
                  "| group | block | RTN amax | RTN mse | GPTQ mse |", "|---|---|---|---|---|"]
        for gs, rows in t.items():
            for r in rows:
                lines.append(f"| {gs} | {r['block']} | {r['int4_rtn_amax']:.4f} | {r['int4_rtn']:.4f} | {r['int4_gptq']:.4f} |")
    return "\n".join(lines) + "\n"


def save(args: argparse.Namespace, result: dict) -> None:
    args.out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{args.out}.json").write_text(json.dumps(result, indent=1) + "\n")
    if "machine" in result:
        Path(f"{args.out}.md").write_text(markdown(result))


def _scheme(text: str) -> tuple[int, str]:
    group, rule = text.split(":")
    return int(group), rule


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--src", type=Path, required=True, help="synth --config <real config> --num-layers 1 checkpoint")
    p.add_argument("--source-command", default="", help="the synth command that made --src (recorded)")
    p.add_argument("--baseline", type=Path, help="checkout of today's converter, timed and compared beside")
    p.add_argument("--baseline-commit", default="unknown", help="its commit, when --baseline is no git checkout")
    p.add_argument("--work", type=Path, default=Path("w4a16-quality-work"), help="scratch directory (outputs)")
    p.add_argument("--schemes", type=_scheme, nargs="+", default=SCHEMES, metavar="GROUP:RULE",
                   help="schemes to convert with (default: 128:amax 128:mse 32:amax 32:mse)")
    p.add_argument("--no-convert", action="store_true", help="skip the conversions (GPTQ sections only)")
    p.add_argument("--compute-repeats", type=int, default=0,
                   help="rounds of the one-core per-matrix quantize timing, today's code against this (needs --baseline)")
    p.add_argument("--timing-rounds", type=int, default=0,
                   help="rounds of (cp, today, each scheme) timed without quality passes (default 0)")
    p.add_argument("--gptq-experts", type=int, default=0, help="real-size experts for the GPTQ section (default 0)")
    p.add_argument("--tiny-calibration", action="store_true", help="calibrate --report on the tiny model too")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "w4a16-quality-cpu",
                   help="results path without extension (.json and .md)")
    args = p.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    result: dict = {"machine": _machine("cpu"), "commit": _commit(), "command": shlex.join(["python", *sys.argv]),
                    "source_command": args.source_command, "baseline": str(args.baseline) if args.baseline else None,
                    "baseline_commit": args.baseline_commit}
    if not args.no_convert:
        conversions(args, result)
        save(args, result)
    if args.compute_repeats:
        compute_per_matrix(args, result)
        save(args, result)
    if args.timing_rounds:
        timing_rounds(args, result)
        save(args, result)
    if args.gptq_experts:
        gptq_experts(args, result)
        save(args, result)
    if args.tiny_calibration:
        tiny_calibration(args, result)
    save(args, result)
    print(markdown(result))


if __name__ == "__main__":
    main()
