"""Where the GPU MXFP4 -> NVFP4 transcode's time goes, on one expert_w1_w3 matrix (2048 x 4096).

    PYTHONPATH=. python bench/transcode_overhead.py      # needs a CUDA GPU; prints, writes nothing

Median wall time (CUDA-synchronized, 50 calls) of the whole ``--device cuda`` transcodes and of
the checks they run, then torch.profiler's table over ten calls: how many kernel launches and
host synchronizations one matrix costs, against the GPU time they use. Results:
bench/results/transcode-overhead-h200.md.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Callable

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dsv4convert.formats.numerics import e8m0_bytes  # noqa: E402
from dsv4convert.formats.transcode import nvfp4_global_exponent  # noqa: E402
from dsv4convert.kernels import quantize_launch  # noqa: E402
from dsv4convert.kernels.operands import quantized_weight  # noqa: E402
from dsv4convert.kernels.samples import random_weight  # noqa: E402


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


def main() -> None:
    packed, scale = random_weight("mxfp4", 2048, 4096, group_size=32, device="cuda",
                                  generator=torch.Generator().manual_seed(0))[:2]
    stages = {
        "whole mxfp4_to_nvfp4": lambda: quantize_launch.mxfp4_to_nvfp4(packed, scale),
        "whole mxfp4_to_fp8_block": lambda: quantize_launch.mxfp4_to_fp8_block(packed, scale),
        "quantized_weight": lambda: quantized_weight("mxfp4", (packed, scale)),
        "e8m0_bytes": lambda: e8m0_bytes(scale),
        "nvfp4_global_exponent": lambda: nvfp4_global_exponent(scale),
        "empty sync": lambda: None,
    }
    for name, fn in stages.items():
        print(f"{name:25s} {median_wall_us(fn):.1f} us")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            quantize_launch.mxfp4_to_nvfp4(packed, scale)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=18, max_name_column_width=45))


if __name__ == "__main__":
    main()
