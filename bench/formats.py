"""Throughput of every dsv4convert.formats quantizer, dequantizer and transcode.

Reports elements (weights) per second on one expert-sized matrix, per device, checks that
every non-CPU device returns bit-identical results to the CPU, and writes
``<out-dir>/formats-<device>.json`` plus a short markdown summary next to it, recording the
machine, the commit and the exact command.

    python bench/formats.py                      # CPU, plus CUDA when present
    python bench/formats.py --devices cpu --rows 2048 --cols 4096 --repeat 5
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from dsv4convert.formats import (
    dequantize_fp8_block,
    dequantize_int4,
    dequantize_mxfp4,
    dequantize_nvfp4,
    error_metrics,
    mxfp4_to_fp8_block,
    mxfp4_to_nvfp4,
    quantize_fp8_block,
    quantize_int4_weight,
    quantize_mxfp4,
    quantize_nvfp4,
)

REPO = Path(__file__).resolve().parent.parent


def _commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "dsv4convert/formats", "bench/formats.py"],
                               cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("-dirty" if dirty else "")


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _machine(device: torch.device) -> dict:
    info = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": str(device),
        "load_average_1m": os.getloadavg()[0],
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def _time(fn: Callable[[], object], device: torch.device, repeat: int) -> list[float]:
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fn()  # warm-up: lazy tables, allocator, kernels
    sync()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return times


def _operations(w: torch.Tensor) -> dict[str, Callable[[], object]]:
    fp8, fp8_scale = quantize_fp8_block(w, block=(128, 128))
    packed, mx_scale = quantize_mxfp4(w)
    nv = quantize_nvfp4(w)
    int4 = quantize_int4_weight(w)
    bf16 = w.to(torch.bfloat16)
    return {
        "quantize_fp8_block (ue8m0)": lambda: quantize_fp8_block(w, block=(128, 128)),
        "quantize_fp8_block (float32)": lambda: quantize_fp8_block(w, scale_fmt="float32", block=(128, 128)),
        "dequantize_fp8_block -> bf16": lambda: dequantize_fp8_block(fp8, fp8_scale, out_dtype=torch.bfloat16, block=(128, 128)),
        "quantize_mxfp4": lambda: quantize_mxfp4(w),
        "dequantize_mxfp4 -> bf16": lambda: dequantize_mxfp4(packed, mx_scale, out_dtype=torch.bfloat16),
        "quantize_nvfp4": lambda: quantize_nvfp4(w),
        "dequantize_nvfp4 -> bf16": lambda: dequantize_nvfp4(nv.weight, nv.weight_scale, nv.weight_scale_2,
                                                             out_dtype=torch.bfloat16),
        "quantize_int4_weight g128 amax": lambda: quantize_int4_weight(w, group_size=128, scale_rule="amax"),
        "quantize_int4_weight g128 mse": lambda: quantize_int4_weight(w, group_size=128, scale_rule="mse"),
        "quantize_int4_weight g32 amax": lambda: quantize_int4_weight(w, group_size=32, scale_rule="amax"),
        "quantize_int4_weight g32 mse": lambda: quantize_int4_weight(w, group_size=32, scale_rule="mse"),
        "quantize_int4_weight (bf16 in)": lambda: quantize_int4_weight(bf16),
        "dequantize_int4 -> bf16": lambda: dequantize_int4(int4.weight_packed, int4.weight_scale,
                                                           int4.weight_shape, out_dtype=torch.bfloat16),
        "mxfp4_to_fp8_block": lambda: mxfp4_to_fp8_block(packed, mx_scale, block=(128, 128)),
        "mxfp4_to_nvfp4": lambda: mxfp4_to_nvfp4(packed, mx_scale),
        "error_metrics": lambda: error_metrics(w, bf16),
    }


def _same(a: object, b: object) -> bool:
    """Bit-for-bit equality of op outputs (tensors, tuples, dataclasses, floats) across devices."""
    if isinstance(a, torch.Tensor):
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        if a.dtype.itemsize == 1:
            a, b = a.view(torch.uint8), b.view(torch.uint8)
        return torch.equal(a.cpu(), b.cpu())
    if isinstance(a, tuple):
        return all(_same(x, y) for x, y in zip(a, b, strict=True))
    if dataclasses.is_dataclass(a) and not isinstance(a, type):
        return all(_same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    return a == b


def bench_device(device: torch.device, rows: int, cols: int, repeat: int) -> dict:
    generator = torch.Generator().manual_seed(0)
    w = torch.randn(rows, cols, generator=generator) * 0.02
    reference = _operations(w) if device.type != "cpu" else None
    results = []
    for op, fn in _operations(w.to(device)).items():
        times = _time(fn, device, repeat)
        median = statistics.median(times)
        row = {"op": op, "seconds_median": median, "seconds_min": min(times), "elements_per_s": rows * cols / median}
        if reference is not None:
            # error_metrics sums in a device-dependent order; compare it to a tolerance instead.
            row["matches_cpu"] = (_same(fn(), reference[op]()) if op != "error_metrics"
                                  else abs(fn().rel_fro - reference[op]().rel_fro) < 1e-9)
        results.append(row)
        check = {True: "  matches CPU", False: "  DIFFERS FROM CPU"}.get(row.get("matches_cpu"), "")
        print(f"{device.type:5s} {op:34s} {rows * cols / median / 1e6:10.1f} M elem/s{check}", flush=True)
    return {
        "machine": _machine(device),
        "commit": _commit(),
        "command": " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv]),
        "shape": [rows, cols],
        "repeat": repeat,
        "results": results,
    }


def _markdown(report: dict) -> str:
    machine = report["machine"]
    where = machine.get("gpu", f"{machine['cpu']}, {machine['torch_threads']} torch threads, "
                               f"1-min load average {machine['load_average_1m']:.1f} at start")
    lines = [
        f"# dsv4convert.formats throughput on {machine['device']}",
        "",
        f"- Machine: {where}; torch {machine['torch']}, Python {machine['python']}, {machine['platform']}",
        f"- Commit: `{report['commit']}`",
        f"- Command: `{report['command']}`",
        f"- Matrix: {report['shape'][0]} x {report['shape'][1]} float32 (Gaussian, std 0.02); "
        f"median of {report['repeat']} runs after one warm-up",
        "",
        "| operation | median s | M elements/s | bit-identical to CPU |",
        "|---|---:|---:|---|",
    ]
    for row in report["results"]:
        same = {True: "yes", False: "NO"}.get(row.get("matches_cpu"), "(is CPU)")
        lines.append(f"| {row['op']} | {row['seconds_median']:.4f} | {row['elements_per_s'] / 1e6:.1f} | {same} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", nargs="+", default=None,
                        help="torch devices to measure (default: cpu, plus cuda when available)")
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--cols", type=int, default=4096)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--out-dir", type=Path, default=REPO / "bench" / "results")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: torch's choice); use 1 on a shared, loaded machine")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    devices = args.devices or ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for name in devices:
        device = torch.device(name)
        report = bench_device(device, args.rows, args.cols, args.repeat)
        stem = args.out_dir / f"formats-{device.type}"
        stem.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
        stem.with_suffix(".md").write_text(_markdown(report))
        print(f"wrote {stem}.json and {stem}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
