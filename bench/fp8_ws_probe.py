"""Does Triton's automatic warp specialization help the FP8 block GEMM on this GPU? (a probe)

The FP8 GEMM's last gap on the H200 (expert_w1_w3 at M = 4096, docs/kernels.md) is the one
cuBLAS closes with a warp-specialized kernel: a producer warp group issuing TMA loads and two
consumer warp groups on 128x128 tiles. Triton 3.6 compiles ``tl.range(..., warp_specialize=True)``
for sm_90 too (``num_warps=4`` becomes 12 warps: one producer and two consumer groups, with
``setmaxnreg``), though its docs say Blackwell. This probe runs the smallest kernel with the
GEMM's numerics (TMA tiles, each 128-wide K slice's dot scaled into an FP32 accumulator by its
1x128 activation and 128x128 weight scales), with and without warp specialization, against the
per-block FP32 reference and row-wise ``torch._scaled_mm``. Each case runs in its own process
under a timeout, because a warp-specialized kernel that deadlocks never returns::

    python bench/fp8_ws_probe.py --out bench/results/fp8-warp-specialize-h200

Rerun it after a Triton upgrade; if a warp-specialized 128x128 case both finishes and beats the
plain kernel, the table's FP8 kernel is worth porting to it. Writes ``<out>.json`` and ``<out>.md``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import report  # noqa: E402

SHAPE = {"m": 4096, "n": 2048, "k": 4096}  # expert_w1_w3 at M = 4096: the shape below 70% of _scaled_mm
# (warp_specialize, block_m, num_stages): the table's tile without and with it, then cuBLAS's 128x128.
CASES = ((False, 64, 3), (True, 64, 3), (False, 128, 3), (True, 128, 3), (True, 128, 4))


@triton.jit
def block_scaled_fp8_kernel(x_desc, w_desc, xs_ptr, ws_ptr, y_ptr, N, K, stride_ym, stride_xsm,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WARP_SPECIALIZE: tl.constexpr):
    """One [BLOCK_M, BLOCK_N] tile of ``Y = (X * xs) @ (W * ws)^T``, K in 128-wide scaled slices (no masks)."""
    num_m = tl.num_programs(0) // tl.cdiv(N, BLOCK_N)
    row0 = (tl.program_id(0) % num_m) * BLOCK_M
    n0 = (tl.program_id(0) // num_m) * BLOCK_N
    rm = row0 + tl.arange(0, BLOCK_M)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in tl.range(0, K // 128, warp_specialize=WARP_SPECIALIZE):
        x = x_desc.load([row0, kb * 128])
        w = w_desc.load([n0, kb * 128])
        scale = tl.load(xs_ptr + rm * stride_xsm + kb) * tl.load(ws_ptr + (n0 // 128) * (K // 128) + kb)
        acc += tl.dot(x, tl.trans(w)) * scale[:, None]
    rn = n0 + tl.arange(0, BLOCK_N)
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(tl.bfloat16))


def run_case(warp_specialize: bool, block_m: int, stages: int) -> dict:
    """Compile, check and time one case on the GPU (in the child process)."""
    import torch
    from triton.tools.tensor_descriptor import TensorDescriptor

    m, n, k = SHAPE["m"], SHAPE["n"], SHAPE["k"]
    generator = torch.Generator(device="cuda").manual_seed(0)
    xq = torch.randn(m, k, device="cuda", generator=generator).to(torch.float8_e4m3fn)
    wq = torch.randn(n, k, device="cuda", generator=generator).to(torch.float8_e4m3fn)
    xs = torch.rand(m, k // 128, device="cuda", generator=generator) + 0.5
    ws = torch.rand(n // 128, k // 128, device="cuda", generator=generator) + 0.5
    y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    x_desc = TensorDescriptor.from_tensor(xq, [block_m, 128])
    w_desc = TensorDescriptor.from_tensor(wq, [128, 128])
    grid = (m // block_m * (n // 128),)

    def launch():
        return block_scaled_fp8_kernel[grid](x_desc, w_desc, xs, ws, y, n, k, y.stride(0), xs.stride(0),
                                             BLOCK_M=block_m, BLOCK_N=128, WARP_SPECIALIZE=warp_specialize,
                                             num_warps=4, num_stages=stages)

    compiled = launch()
    torch.cuda.synchronize()
    reference = torch.zeros(m, n, device="cuda")
    for kb in range(k // 128):
        cut = slice(128 * kb, 128 * kb + 128)
        reference += (xq[:, cut].float() @ wq[:, cut].float().T) * xs[:, kb:kb + 1] * ws[:, kb].repeat_interleave(128)
    ones_a, ones_b = torch.ones(m, 1, device="cuda"), torch.ones(1, n, device="cuda")
    us = triton.testing.do_bench(launch, rep=200) * 1000
    scaled_mm_us = triton.testing.do_bench(
        lambda: torch._scaled_mm(xq, wq.t(), scale_a=ones_a, scale_b=ones_b, out_dtype=torch.bfloat16), rep=200) * 1000
    return {"warps": compiled.metadata.num_warps, "setmaxnreg": compiled.asm["ptx"].count("setmaxnreg"),
            "relative_error": float((y.float() - reference).norm() / reference.norm()), "us": us,
            "scaled_mm_rowwise_us": scaled_mm_us, "fraction_of_scaled_mm": scaled_mm_us / us}


def summary(result: dict) -> str:
    lines = [f"# Triton warp specialization on the FP8 block GEMM: {result['device']}", "",
             f"- torch {result['torch']}, triton {result['triton']}, commit `{result['commit']}`",
             f"- command: `{result['command']}`",
             f"- M={SHAPE['m']}, N={SHAPE['n']}, K={SHAPE['k']} (expert_w1_w3); each case in its own process, "
             f"{result['timeout_s']} s timeout", "",
             "| warp specialized | tile | stages | warps | outcome | us | % of row-wise _scaled_mm | rel err |",
             "|---|---|---|---|---|---|---|---|"]
    for row in result["cases"]:
        tile = f"{row['block_m']}x128"
        if "us" in row:
            lines.append(f"| {row['warp_specialize']} | {tile} | {row['stages']} | {row['warps']} | ran | "
                         f"{row['us']:.1f} | {row['fraction_of_scaled_mm']:.1%} | {row['relative_error']:.1e} |")
        else:
            lines.append(f"| {row['warp_specialize']} | {tile} | {row['stages']} |  | {row['outcome']} |  |  |  |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="path prefix for the .json and .md results")
    parser.add_argument("--timeout", type=int, default=45, help="seconds per case before it counts as hung")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # the child process: "ws,block_m,stages"
    args = parser.parse_args()
    if args.case:
        ws, block_m, stages = args.case.split(",")
        print(json.dumps(run_case(ws == "1", int(block_m), int(stages))))
        return
    if args.out is None:
        parser.error("--out is required")
    cases = []
    for ws, block_m, stages in CASES:
        row = {"warp_specialize": ws, "block_m": block_m, "stages": stages}
        try:
            done = subprocess.run([sys.executable, __file__, "--case", f"{int(ws)},{block_m},{stages}"],
                                  capture_output=True, text=True, timeout=args.timeout)
            if done.returncode:
                row["outcome"] = "failed: " + (done.stderr.strip().splitlines() or ["?"])[-1][:200]
            else:
                row.update(json.loads(done.stdout.strip().splitlines()[-1]))
        except subprocess.TimeoutExpired:
            row["outcome"] = f"hung (no result in {args.timeout} s)"
        print(json.dumps(row), flush=True)
        cases.append(row)
    result = {**report.gpu_run(), "timeout_s": args.timeout, "shape": SHAPE, "cases": cases}
    report.write(args.out, result, summary(result))


if __name__ == "__main__":
    main()
