"""Where the GPU MXFP4 transcodes' time goes, on one expert_w1_w3 matrix (2048 x 4096).

    PYTHONPATH=. python bench/transcode_overhead.py --out bench/results/transcode-overhead-h200.json \
        [--baseline path/to/an/older/quantize_launch.py]

Median wall time (CUDA-synchronized, 50 calls) of the whole ``--device cuda`` transcodes
(``quantize_launch.mxfp4_to_nvfp4`` / ``mxfp4_to_fp8_block``) and of their checks, then
torch.profiler over ten calls of each: kernel launches and host synchronizations per matrix,
and host time against GPU time. ``--baseline`` times another version of ``quantize_launch``
(a copy of the file from an earlier commit) side by side in the same run and checks that it
returns the same results.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import os
import statistics
import sys
import time
from typing import Callable

import torch
import triton
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dsv4convert.formats.numerics import e8m0_max_byte  # noqa: E402
from dsv4convert.kernels import quantize_launch  # noqa: E402
from dsv4convert.kernels.operands import quantized_weight  # noqa: E402
from dsv4convert.kernels.samples import random_weight  # noqa: E402

LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx")
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpyAsync")


def median_wall_us(fn: Callable[[], object], reps: int = 50) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)


def profiled(fn: Callable[[], object], calls: int = 10) -> dict:
    """Per call: kernel launches, synchronizing host calls, host and GPU microseconds (torch.profiler)."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    events = prof.key_averages()
    count = lambda names: sum(e.count for e in events if e.key in names) / calls  # noqa: E731
    gpu_us = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    return {"launches": count(LAUNCHES), "synchronizing_calls": count(SYNCS),
            "gpu_us": gpu_us / calls, "table": events.table(sort_by="cpu_time_total", row_limit=15)}


def _v4_block(module) -> dict:
    """DeepSeek-V4's 128x128 FP8 block, for a quantize_launch that takes the block (those before #52 did not)."""
    return {"block": (128, 128)} if "block" in inspect.signature(module.mxfp4_to_fp8_block).parameters else {}


def load_module(path: str):
    spec = importlib.util.spec_from_file_location("quantize_launch_baseline", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON results")
    parser.add_argument("--baseline", help="another quantize_launch.py to time side by side")
    args = parser.parse_args()
    packed, scale = random_weight("mxfp4", 2048, 4096, group_size=32, device="cuda",
                                  generator=torch.Generator().manual_seed(0))[:2]
    versions = {"this commit": quantize_launch}
    if args.baseline:
        versions["baseline"] = load_module(args.baseline)
    result = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "triton": triton.__version__,
              "commit": os.environ.get("DSV4_COMMIT", "unknown"), "baseline": args.baseline,
              "command": "python bench/transcode_overhead.py " + " ".join(sys.argv[1:]), "stages": {}, "versions": {}}
    for label, module in versions.items():
        nvfp4 = lambda module=module: module.mxfp4_to_nvfp4(packed, scale)  # noqa: E731
        fp8 = lambda module=module: module.mxfp4_to_fp8_block(packed, scale, **_v4_block(module))  # noqa: E731
        result["versions"][label] = {
            "mxfp4_to_nvfp4": {"wall_us": median_wall_us(nvfp4), **profiled(nvfp4)},
            "mxfp4_to_fp8_block": {"wall_us": median_wall_us(fp8), **profiled(fp8)},
        }
    if args.baseline:  # the same bytes and reports from both
        new, old = quantize_launch.mxfp4_to_nvfp4(packed, scale), versions["baseline"].mxfp4_to_nvfp4(packed, scale)
        same = torch.equal(new[0].weight_scale.view(torch.uint8), old[0].weight_scale.view(torch.uint8)) and \
            torch.equal(new[0].weight_scale_2, old[0].weight_scale_2) and new[1] == old[1]
        baseline = versions["baseline"]
        new = quantize_launch.mxfp4_to_fp8_block(packed, scale, **_v4_block(quantize_launch))
        old = baseline.mxfp4_to_fp8_block(packed, scale, **_v4_block(baseline))
        same = same and torch.equal(new[0].view(torch.uint8), old[0].view(torch.uint8)) and \
            torch.equal(new[1].view(torch.uint8), old[1].view(torch.uint8)) and new[2] == old[2]
        result["baseline_results_identical"] = same
    result["stages"] = {
        "quantized_weight": median_wall_us(lambda: quantized_weight("mxfp4", (packed, scale))),
        "e8m0_max_byte": median_wall_us(lambda: e8m0_max_byte(scale)),
        "empty call between two synchronizations": median_wall_us(lambda: None),
    }
    for label, version in result["versions"].items():
        for name, row in version.items():
            print(f"{label:12s} {name:20s} {row['wall_us']:8.1f} us wall, {row['launches']:4.1f} launches, "
                  f"{row['synchronizing_calls']:4.1f} synchronizing calls, GPU {row['gpu_us']:6.1f} us")
    for name, us in result["stages"].items():
        print(f"{name:40s} {us:8.1f} us")
    print("baseline results identical:", result.get("baseline_results_identical"))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
