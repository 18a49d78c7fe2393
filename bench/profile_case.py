"""Launch one GEMM case a few times, for a profiler (Nsight Compute) to pick one launch.

    ncu --set full -k regex:weight_only_gemv --launch-skip 3 --launch-count 1 \\
        python bench/profile_case.py --format int4:128 --shape square_8192 --m 1
    ncu --section SourceCounters --page source --print-source sass -k regex:weight_only_mma ... (stalls per SASS line)

Runs the table's config for the case (as ``launch.checked_config`` fits it, without its check, so
the check's small launches do not mix with the profiled ones), or ``--stream``: the read-only
kernel of ``bench/gemv_sweep.py --bound`` over the same code words. Every launch is the same, so
``--launch-skip`` can pass over the ones that compile.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.gemv_sweep import _stream_words_kernel  # noqa: E402
from bench.kernels import SHAPES, make_weights  # noqa: E402
from dsv4convert.kernels import configs, launch  # noqa: E402
from dsv4convert.kernels._runtime import arch_of  # noqa: E402
from dsv4convert.kernels.samples import random_activations  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--format", default="int4:128", help="format:group, e.g. nvfp4:16 or fp8_block:128")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="square_8192")
    parser.add_argument("--m", type=int, default=1, help="tokens")
    parser.add_argument("--launches", type=int, default=5)
    parser.add_argument("--stream", action="store_true", help="the read-only kernel over the same code words instead")
    args = parser.parse_args()
    n, k = SHAPES[args.shape]
    if args.stream:
        words = torch.randint(-1000, 1000, (n, k // 8), dtype=torch.int32, device="cuda")
        out = torch.empty(n, dtype=torch.int32, device="cuda")
        for _ in range(args.launches):
            _stream_words_kernel[(n // 8,)](words, out, k // 8, BLOCK_N=8, WORDS=128, num_warps=4, num_stages=1)
    else:
        fmt, group = args.format.split(":")
        weight = make_weights(fmt, n, k, 1, group=int(group))[0]
        x = random_activations(args.m, k, device="cuda")
        offsets = torch.tensor([0, args.m], dtype=torch.int32, device="cuda")
        kind = launch._gemm_kind(weight)
        cfg = launch._fit_split_k(configs.gemm_config(kind, arch_of(weight.device), args.m), weight, args.m)
        print(cfg, file=sys.stderr)
        for _ in range(args.launches):
            launch._launch(weight, x, offsets, args.m, cfg)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
