"""Small-batch (M <= 16) weight-only GEMMs against cuBLAS BF16 in one call, for choosing configs.

    PYTHONPATH=. python bench/gemv_sweep.py --out /tmp/sweep.json [--mode final|sweep] [--bound] [--m 1,4,16]
        [--formats int4:128,nvfp4:16] [--shapes square_8192,wq_b]

``final`` times the table's checked config against the tensor-core "planes" entry; ``sweep``
times every candidate of :func:`candidates` as well (CUDA-core and tensor-core GEMVs).
``--bound`` first times a Triton kernel that only streams the same code words (a sum of every
word, no decode, no activations): what a kernel of this shape can reach on the device.

Compiles every variant first in parallel worker processes (one per format and shape, sharing
Triton's cache), then times each in this process with CUDA-graph replays over enough weight
copies to leave the L2 cache, as bench/kernels.py does, and checks it against the reference.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.kernels import SHAPES, copies_for, make_weights, timed_over_copies, weight_bytes  # noqa: E402
from dsv4convert.kernels import configs, launch, reference  # noqa: E402
from dsv4convert.kernels.samples import random_activations  # noqa: E402

G = configs.GemmConfig


# (BLOCK_N, BLOCK_K, warps) of the GEMV, swept on the H200 (bench/results/gemv-h200-cudacore.md).
GEMV_TILES = ((8, 1024, 4), (16, 512, 4), (32, 256, 4), (16, 1024, 4), (32, 512, 4), (64, 256, 4), (8, 1024, 8))
# (rows, warps, chunks ahead) of the tensor-core GEMV (16 rows per warp), the tiles of its prototype
# sweep on the H200 (bench/results/mma-rows-h200.md); launch._fit_mma picks among such tiles by size.
MMA_TILES = ((16, 4, 2), (16, 8, 2), (16, 8, 1), (16, 16, 2), (32, 8, 2), (32, 4, 2), (64, 8, 2), (64, 4, 2))


def candidates(m: int) -> list[configs.GemmConfig]:
    """CUDA-core GEMV tiles at M = 1 (one token per program), and tensor-core GEMV tiles at every M
    (8 or 16 tokens per program); configs whose K shares do not divide a shape's K fail and are skipped."""
    gemv = [G(1, bn, bk, num_warps=w, num_stages=1, variant="gemv") for bn, bk, w in GEMV_TILES] if m == 1 else []
    return gemv + [G(8 if m <= 8 else 16, bn, 128, num_warps=w, num_stages=ahead, variant="mma")
                   for bn, w, ahead in MMA_TILES]


PLANES = G(16, 128, 256, split_k=8, num_warps=8, num_stages=3, variant="planes")  # the table's M <= 16 entry before gemv


def configs_for(weight, m: int, mode: str) -> list[configs.GemmConfig]:
    """``final``: the table's checked config and the previous planes entry; ``sweep``: every candidate too."""
    before = launch._fit_split_k(PLANES, weight, m)
    if mode == "final":
        return [launch.checked_config(weight, m), before]
    return [launch.checked_config(weight, m), before] + candidates(m)


@triton.jit
def _stream_words_kernel(w_ptr, out_ptr, K_WORDS, BLOCK_N: tl.constexpr, WORDS: tl.constexpr):
    """out[row] = the sum of a row's int32 words, in [BLOCK_N, WORDS] tiles: a read with nothing else."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_N, WORDS), dtype=tl.int32)
    for k in range(0, K_WORDS, WORDS):
        acc += tl.load(w_ptr + rows[:, None] * K_WORDS + k + tl.arange(0, WORDS)[None, :])
    tl.store(out_ptr + rows, tl.sum(acc, axis=1))


STREAM_TILES = ((4, 128, 4, 1), (8, 128, 4, 1), (8, 64, 4, 3), (16, 128, 4, 1), (16, 128, 8, 3),
                (16, 256, 8, 1), (32, 128, 8, 1), (32, 64, 4, 3))  # (BLOCK_N, words, warps, stages)


def stream_bound(shapes, rep_ms: int) -> list[dict]:
    """Microseconds to stream each shape's 4-bit codes (N x K/8 int32 words) with every tile of STREAM_TILES."""
    rows = []
    for shape in shapes:
        n, k = SHAPES[shape]
        count = copies_for(n * k // 2)
        words = [torch.randint(-1000, 1000, (n, k // 8), dtype=torch.int32, device="cuda") for _ in range(count)]
        out = torch.empty(n, dtype=torch.int32, device="cuda")
        for bn, w, warps, stages in STREAM_TILES:
            def run(i, bn=bn, w=w, warps=warps, stages=stages):
                _stream_words_kernel[(n // bn,)](words[i], out, k // 8, BLOCK_N=bn, WORDS=min(w, k // 8),
                                                 num_warps=warps, num_stages=stages)
            us = timed_over_copies(run, count, rep_ms)
            rows.append(dict(kind="stream_bound", shape=shape, tile=(bn, w, warps, stages), us=us,
                             gbps=n * k / 2 / us / 1e3))
            print(f"bound {shape:13s} tile {bn}x{w} w{warps} st{stages}: {us:7.2f} us {n * k / 2 / us / 1e3:6.0f} GB/s",
                  flush=True)
        del words
    return rows


def shape_of(n: int, k: int) -> str:
    return next(name for name, nk in SHAPES.items() if nk == (n, k))


def cases(formats, shapes):
    return [(fmt, group, shape) for fmt, group in formats for shape in shapes]


def _compile_worker(args):
    fmt, group, shape, ms, chunk, chunks, mode = args
    n, k = SHAPES[shape]
    weight = make_weights(fmt, n, k, 1, group=group)[0]
    failures = []
    for m in ms:
        x = random_activations(m, k, device="cuda")
        offsets = torch.tensor([0, m], dtype=torch.int32, device="cuda")
        for cfg in configs_for(weight, m, mode)[chunk::chunks]:
            try:
                launch._launch(weight, x, offsets, m, cfg)
            except Exception as error:  # noqa: BLE001 - recorded
                failures.append((repr(cfg), f"{type(error).__name__}: {str(error)[:200]}"))
    torch.cuda.synchronize()
    return fmt, shape, failures


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--formats", default="int4:128,int4:32,nvfp4:16,mxfp4:32")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--m", default="1,4,16")
    parser.add_argument("--rep-ms", type=int, default=5)
    parser.add_argument("--workers", type=int, default=12)
    parser.add_argument("--mode", choices=("final", "sweep"), default="final")
    parser.add_argument("--bound", action="store_true", help="time a read-only kernel over the same code words first")
    args = parser.parse_args()
    formats = [(f.split(":")[0], int(f.split(":")[1])) for f in args.formats.split(",")]
    shapes = args.shapes.split(",")
    ms = [int(m) for m in args.m.split(",")]
    start = time.time()
    rows = stream_bound(shapes, args.rep_ms) if args.bound else []
    chunks = 1 if args.mode == "final" else 4
    work = [(fmt, group, shape, ms, c, chunks, args.mode) for fmt, group, shape in cases(formats, shapes)
            for c in range(chunks)]
    with mp.get_context("spawn").Pool(min(args.workers, len(work))) as pool:
        for fmt, shape, failures in pool.imap_unordered(_compile_worker, work):
            for cfg, err in failures:
                print(f"compile-fail {fmt} {shape} {cfg} {err}", flush=True)
    print(f"compiled in {time.time() - start:.0f} s", flush=True)
    for shape in shapes:
        n, k = SHAPES[shape]
        dense_count = copies_for(n * k * 2)
        dense = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(dense_count)]
        for m in ms:
            x = random_activations(m, k, device="cuda", generator=torch.Generator().manual_seed(m))
            offsets = torch.tensor([0, m], dtype=torch.int32, device="cuda")
            cublas = timed_over_copies(lambda i: x @ dense[i].T, dense_count, args.rep_ms)
            for fmt, group in formats:
                probe = make_weights(fmt, n, k, 1, group=group)[0]
                count = copies_for(weight_bytes(probe))
                weights = [probe] + make_weights(fmt, n, k, count - 1, group=group)
                want = reference.grouped_gemm(probe, x, offsets)
                variants = configs_for(probe, m, args.mode)
                current = variants[0]
                for cfg in variants:
                    try:
                        err = launch.relative_error(want, launch._launch(probe, x, offsets, m, cfg))
                        us = timed_over_copies(lambda i: launch._launch(weights[i], x, offsets, m, cfg), count,
                                               args.rep_ms)
                    except Exception as error:  # noqa: BLE001
                        print(f"fail {fmt} {shape} {cfg}: {type(error).__name__}: {str(error)[:200]}", flush=True)
                        continue
                    gbps = weight_bytes(probe) / us / 1e3
                    row = dict(format=fmt, group=group, shape=shape, m=m, cfg=repr(cfg), us=us, cublas_us=cublas,
                               x=cublas / us, gbps=gbps, err=err, current=cfg is current)
                    rows.append(row)
                    print(f"{fmt}{group:<4d} {shape:13s} M={m:<3d} {us:7.2f} us x{cublas / us:5.2f} {gbps:6.0f} GB/s "
                          f"err {err:.1e} {'CUR ' if cfg is current else ''}{cfg.variant} bn{cfg.block_n} bk{cfg.block_k} "
                          f"s{cfg.split_k} w{cfg.num_warps} st{cfg.num_stages}", flush=True)
                del weights
        del dense
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)
    print(f"total {time.time() - start:.0f} s", flush=True)
    best = {}
    for r in (r for r in rows if "format" in r):
        key = (r["format"], r["group"], r["shape"], r["m"])
        if r["err"] < 5e-3 and (key not in best or r["us"] < best[key]["us"]):
            best[key] = r
    for key, r in sorted(best.items()):
        print("BEST", key, f"{r['us']:.2f} us x{r['x']:.2f}", r["cfg"])


if __name__ == "__main__":
    main()
