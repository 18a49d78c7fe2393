"""Benchmark the dsv4convert Triton kernels against the device's ceilings and torch baselines.

Run on a GPU from the repository root::

    PYTHONPATH=. python bench/kernels.py --out bench/results/kernels-h200

writes ``<out>.json`` (every measurement) and ``<out>.md`` (a summary that says which
targets of issue 5 are met). Timings are medians of CUDA-graph replays
(``triton.testing.do_bench_cudagraph``); each timed graph cycles through enough copies of the
weights to exceed the L2 cache three times, so the 4-bit kernels are measured from HBM, as
they would run on a real layer, and so is cuBLAS.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from collections.abc import Callable

import torch
import triton
import triton.language as tl
import triton.testing

from dsv4convert import formats, kernels
from dsv4convert.kernels import configs, launch, reference
from dsv4convert.kernels.operands import QuantizedWeight, quantized_weight
from dsv4convert.kernels.samples import random_activations, random_weight

SHAPES = {"expert_w1_w3": (2048, 4096), "expert_w2": (4096, 2048), "wq_b": (32768, 1024), "square_8192": (8192, 8192)}
TOKENS = (1, 4, 16, 64, 4096)
WEIGHT_ONLY = (("int4", 128), ("int4", 32), ("nvfp4", 16), ("mxfp4", 32))
GROUPED_EXPERTS = 256  # routed experts per DeepSeek-V4-Flash layer
DEQUANT = (("fp8", "ue8m0"), ("fp8", "float32"), ("mxfp4", "ue8m0"), ("nvfp4", "ue8m0"), ("int4", "ue8m0"))


def median_us(fn: Callable[[], object], rep_ms: int) -> float:
    return triton.testing.do_bench_cudagraph(fn, rep=rep_ms, return_mode="median") * 1e3


def copies_for(bytes_per_copy: int) -> int:
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    return max(1, min(64, math.ceil(3 * l2 / max(bytes_per_copy, 1))))


def weight_bytes(weight: QuantizedWeight) -> int:
    total = weight.codes.numel() * weight.codes.element_size() + weight.scale.numel() * weight.scale.element_size()
    return total + (0 if weight.global_scale is None else weight.global_scale.numel() * 4)


def make_weights(fmt: str, n: int, k: int, count: int, *, group: int = 128, scale_fmt: str = "ue8m0",
                 experts: int | None = None) -> list[QuantizedWeight]:
    gen = torch.Generator().manual_seed(n * 31 + k)
    block = (128, 128) if fmt == "fp8" else None   # DeepSeek-V4's FP8 block
    first = random_weight(fmt, n, k, experts=experts, group_size=group, block=block, scale_fmt=scale_fmt,
                          device="cuda", generator=gen)
    return [quantized_weight(fmt, tuple(t.clone() for t in first), block=block) for _ in range(count)]


def timed_over_copies(run_one: Callable[[int], object], count: int, rep_ms: int) -> float:
    """Median microseconds of one call, timing a graph that makes ``count`` calls on rotating buffers."""
    return median_us(lambda: [run_one(i) for i in range(count)], rep_ms) / count


def copy_bandwidth(rep_ms: int) -> dict:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    # Events around eager launches: a captured graph turns the copy into a DMA memcpy node, slower.
    us = triton.testing.do_bench(lambda: dst.copy_(src), rep=rep_ms, return_mode="median") * 1e3
    return {"bytes_moved": 2 * src.numel(), "us": us, "gbps": 2 * src.numel() / us / 1e3}


def dense_matmul_tflops(rep_ms: int) -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    return 2 * 8192**3 / median_us(lambda: a @ b, rep_ms) / 1e6


@triton.jit
def _copy_words(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst_ptr + offsets, tl.load(src_ptr + offsets, mask=offsets < n), mask=offsets < n)


def same_size_copy_us(moved: int, rep_ms: int) -> float:
    """A Triton copy that reads and writes ``moved`` bytes in total, timed like the dequant kernels.

    The 1 GB copy bandwidth is the target's yardstick; a copy of a single expert's ~20 MB does not
    reach it either (launch, ramp-up and tail), so each dequant row also says how it compares with
    moving its own number of bytes.
    """
    words = moved // 8
    count = copies_for(moved)
    src = [torch.empty(words, dtype=torch.int32, device="cuda") for _ in range(count)]
    dst = [torch.empty(words, dtype=torch.int32, device="cuda") for _ in range(count)]
    grid = (triton.cdiv(words, 4096),)
    return timed_over_copies(lambda i: _copy_words[grid](src[i], dst[i], words, BLOCK=4096, num_warps=8), count, rep_ms)


def bench_dequant(copy_gbps: float, rep_ms: int) -> list[dict]:
    """Every format on single matrices, then all 256 experts of a layer in one launch (what validate runs)."""
    rows = []
    cases = [(fmt, scale_fmt, shape_name, None) for fmt, scale_fmt in DEQUANT for shape_name in SHAPES]
    cases += [(fmt, scale_fmt, "expert_w1_w3", GROUPED_EXPERTS) for fmt, scale_fmt in DEQUANT if scale_fmt == "ue8m0"]
    for fmt, scale_fmt, shape_name, experts in cases:
        n, k = SHAPES[shape_name]
        probe = make_weights(fmt, n, k, 1, scale_fmt=scale_fmt, experts=experts)[0]
        moved = weight_bytes(probe) + probe.experts * n * k * 2
        count = copies_for(moved)
        weights = [probe] + make_weights(fmt, n, k, count - 1, scale_fmt=scale_fmt, experts=experts)
        want = reference.dequantize(weights[0], torch.bfloat16)
        exact = torch.equal(launch.dequantize(weights[0], torch.bfloat16).view(torch.int16), want.view(torch.int16))
        del want
        us = timed_over_copies(lambda i: launch.dequantize(weights[i], torch.bfloat16), count, rep_ms)
        del weights
        copy_us = same_size_copy_us(moved, rep_ms)
        gbps = moved / us / 1e3
        rows.append({"format": fmt, "scale_fmt": scale_fmt, "shape": shape_name, "experts": probe.experts,
                     "n": n, "k": k, "us": us, "gbps": gbps, "fraction_of_copy_bw": gbps / copy_gbps,
                     "same_size_copy_us": copy_us, "fraction_of_same_size_copy": copy_us / us, "bit_exact": exact})
        print(f"dequant {fmt:9s} {scale_fmt:7s} {shape_name:13s} E={probe.experts:<3d} {us:8.1f} us {gbps:7.0f} GB/s "
              f"{gbps / copy_gbps:5.1%} (same-size copy {copy_us:.1f} us) exact={exact}", flush=True)
        del probe
    return rows


def _scaled_mm_baseline(m: int, n: int, k: int, rep_ms: int) -> dict:
    """torch._scaled_mm on FP8 operands in every scaling mode this torch/cuBLAS accepts.

    Block-wise scaling (DeepSeek's 1x128 activation / 128x128 weight scales, the same work as our
    kernel) takes ``scale_a [M, K/128]`` and ``scale_b [K/128, N/128]``; cuBLAS wants them
    M-major / K-major, so each layout is tried. ``mode`` is the row-wise result when there is one
    (the comparison earlier runs used), with the block-wise one beside it.
    """
    a = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn)
    block_a = torch.rand(m, k // 128, device="cuda") + 0.5
    block_b = torch.rand(k // 128, n // 128, device="cuda") + 0.5
    attempts = {
        "blockwise_1x128_128x128": (block_a.t().contiguous().t(), block_b.t().contiguous().t()),
        "blockwise_1x128_128x128_rowmajor": (block_a, block_b),
        "rowwise": (torch.rand(m, 1, device="cuda") + 0.5, torch.rand(1, n, device="cuda") + 0.5),
        "tensorwise": (torch.tensor(1.0, device="cuda"), torch.tensor(1.0, device="cuda")),
    }
    modes, errors = {}, {}
    for mode, (scale_a, scale_b) in attempts.items():
        if mode.startswith("blockwise") and "blockwise" in modes:
            continue
        try:
            def run(scale_a=scale_a, scale_b=scale_b):
                return torch._scaled_mm(a, b.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16)
            run()
            torch.cuda.synchronize()
            us = median_us(run, rep_ms)
            modes["blockwise" if mode.startswith("blockwise") else mode] = {
                "layout": mode, "us": us, "tflops": 2 * m * n * k / us / 1e6}
        except (RuntimeError, ValueError) as error:  # each mode is tried; the refusals are recorded
            errors[mode] = str(error).splitlines()[0][:200]
    main = modes.get("rowwise") or next(iter(modes.values()), None)
    return {"mode": None if main is None else ("rowwise" if "rowwise" in modes else main["layout"]),
            "us": None if main is None else main["us"], "tflops": None if main is None else main["tflops"],
            "modes": modes, "refused": errors}


def _fast_accum_fp8(probe, weights, x, offsets, flops: int, scaled: dict, rep_ms: int) -> dict:
    """The opt-in rescaled-accumulator FP8 config (configs.FAST_ACCUM_FP8), side by side: faster, less exact."""
    cfg = configs.FAST_ACCUM_FP8
    m = x.shape[0]
    if launch.arch_of(x.device) != "sm_90" or not probe.scale_is_e8m0:
        return {}
    error = launch.relative_error(reference.grouped_gemm(probe, x, offsets), launch._launch(probe, x, offsets, m, cfg))
    us = timed_over_copies(lambda i: launch._launch(weights[i], x, offsets, m, cfg), len(weights), rep_ms)
    return {"config": repr(cfg), "us": us, "tflops": flops / us / 1e6, "rel_error_vs_fp32_reference": error,
            "fraction_of_scaled_mm": flops / us / 1e6 / scaled["tflops"]}


def bench_gemms(rep_ms: int, tokens: tuple[int, ...]) -> list[dict]:
    rows = []
    for shape_name, (n, k) in SHAPES.items():
        dense_count = copies_for(n * k * 2)
        dense = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(dense_count)]
        for m in tokens:
            x = random_activations(m, k, device="cuda", generator=torch.Generator().manual_seed(m))
            offsets = torch.tensor([0, m], dtype=torch.int32, device="cuda")
            cublas_us = timed_over_copies(lambda i: x @ dense[i].T, dense_count, rep_ms)
            flops = 2 * m * n * k
            for fmt, group in WEIGHT_ONLY + (("fp8", 128),):
                probe = make_weights(fmt, n, k, 1, group=group)[0]
                count = copies_for(weight_bytes(probe))
                weights = [probe] + make_weights(fmt, n, k, count - 1, group=group)
                cfg = launch.checked_config(probe, m)
                y = launch._launch(probe, x, offsets, m, cfg)
                error = launch.relative_error(reference.grouped_gemm(probe, x, offsets), y)
                us = timed_over_copies(lambda i: launch._launch(weights[i], x, offsets, m, cfg), count, rep_ms)
                row = {"format": fmt, "group": group, "shape": shape_name, "n": n, "k": k, "m": m, "us": us,
                       "tflops": flops / us / 1e6, "weight_gbps": weight_bytes(probe) / us / 1e3,
                       "cublas_bf16_us": cublas_us, "speedup_vs_cublas_bf16": cublas_us / us,
                       "rel_error_vs_fp32_reference": error, "config": repr(cfg)}
                if fmt == "fp8":
                    xq_us = median_us(lambda: launch.quantize_activations_fp8(x, group=128), rep_ms)
                    row["activation_quant_us"] = xq_us
                    if m == 4096:
                        scaled = _scaled_mm_baseline(m, n, k, rep_ms)
                        row["scaled_mm"] = scaled
                        if "blockwise" in scaled["modes"]:
                            row["fraction_of_blockwise_scaled_mm"] = row["tflops"] / scaled["modes"]["blockwise"]["tflops"]
                        if scaled["tflops"]:
                            row["fraction_of_scaled_mm"] = row["tflops"] / scaled["tflops"]
                            row["gemm_only_fraction_of_scaled_mm"] = flops / (us - xq_us) / 1e6 / scaled["tflops"]
                            row["fast_accum"] = _fast_accum_fp8(probe, weights, x, offsets, flops, scaled, rep_ms)
                else:
                    def dequant_then_matmul(weight=probe):
                        return x @ reference.dequantize(weight, torch.bfloat16).T
                    row["torch_dequant_matmul_us"] = triton.testing.do_bench(
                        dequant_then_matmul, rep=rep_ms, return_mode="median") * 1e3
                    row["speedup_vs_torch_dequant_matmul"] = row["torch_dequant_matmul_us"] / us
                rows.append(row)
                extra = f" vs scaled_mm {row.get('fraction_of_scaled_mm', float('nan')):.2f}" if m == 4096 and \
                    fmt == "fp8" else ""
                print(f"gemm {fmt:9s} g{group:<3d} {shape_name:13s} M={m:<5d} {us:8.1f} us  cuBLAS {cublas_us:8.1f} us "
                      f"x{cublas_us / us:5.2f}  err {error:.1e}{extra}", flush=True)
                del weights
        del dense
    return rows


def bench_grouped(rep_ms: int, experts: int, tokens: int) -> list[dict]:
    """One launch over ``experts`` stacked experts against one launch per expert, and against cuBLAS
    BF16 ``bmm`` over the same experts densely (a batched GEMM: one launch too)."""
    rows = []
    n, k = SHAPES["expert_w1_w3"]
    dense = torch.randn(experts, n, k, device="cuda", dtype=torch.bfloat16)
    for fmt, group in WEIGHT_ONLY[::2] + (("mxfp4", 32), ("fp8", 128)):
        stack = make_weights(fmt, n, k, 1, group=group, experts=experts)[0]
        singles = [launch._one_expert(stack, e) for e in range(experts)]
        x = random_activations(experts * tokens, k, device="cuda", generator=torch.Generator().manual_seed(1))
        offsets = torch.arange(experts + 1, dtype=torch.int32, device="cuda") * tokens
        one = torch.tensor([0, tokens], dtype=torch.int32, device="cuda")
        cfg = launch.checked_config(stack, tokens)
        grouped = launch._launch(stack, x, offsets, tokens, cfg)
        error = launch.relative_error(reference.grouped_gemm(stack, x, offsets), grouped)
        grouped_us = median_us(lambda: launch._launch(stack, x, offsets, tokens, cfg), rep_ms)
        per_expert = lambda: [launch._launch(singles[e], x[e * tokens:(e + 1) * tokens], one, tokens, cfg)  # noqa: E731
                              for e in range(experts)]
        graph_us = median_us(per_expert, rep_ms)
        eager_us = triton.testing.do_bench(per_expert, rep=rep_ms, return_mode="median") * 1e3
        x3 = x.view(experts, tokens, k)
        bmm_us = median_us(lambda: torch.bmm(x3, dense.transpose(1, 2)), rep_ms)
        row = {"format": fmt, "group": group, "experts": experts, "tokens_per_expert": tokens, "n": n, "k": k,
               "config": repr(cfg), "grouped_us": grouped_us, "per_expert_graph_us": graph_us,
               "per_expert_eager_us": eager_us, "speedup_vs_per_expert_graph": graph_us / grouped_us,
               "speedup_vs_per_expert_eager": eager_us / grouped_us, "cublas_bmm_us": bmm_us,
               "speedup_vs_cublas_bmm": bmm_us / grouped_us,
               "weight_gbps": weight_bytes(stack) / grouped_us / 1e3, "rel_error_vs_fp32_reference": error}
        rows.append(row)
        print(f"grouped {fmt:9s} E={experts} M={tokens}: {grouped_us:8.1f} us, per-expert graph {graph_us:8.1f} us, "
              f"eager {eager_us:8.1f} us, cuBLAS bmm {bmm_us:8.1f} us, "
              f"err {error:.1e}", flush=True)
    return rows


def _launch_floor(rep_ms: int) -> dict:
    """Microseconds per launch of an empty Triton kernel in a CUDA graph: the floor under every small row."""
    out = torch.empty(1, device="cuda")
    count = 64
    us = timed_over_copies(lambda i: _empty_kernel[(132,)](out), count, rep_ms)
    print(f"sweep launch floor {us:.2f} us", flush=True)
    return {"kind": "launch_floor", "us": us}


@triton.jit
def _empty_kernel(out_ptr):
    pass


def _sweep_fp8(rep_ms: int) -> list[dict]:
    rows = []
    candidates = [configs.GemmConfig(bm, bn, 128, num_warps=w, num_stages=st, group_m=g, variant=v)
                  for bm, bn, w, st, g, v in [(64, 128, 4, 3, 8, "tma"), (64, 128, 4, 3, 16, "tma"),
                                              (64, 128, 4, 3, 32, "tma"), (64, 128, 4, 3, 64, "tma"),
                                              (64, 128, 4, 4, 64, "tma"), (128, 64, 4, 3, 32, "tma"),
                                              (64, 256, 8, 2, 16, "tma"), (128, 128, 8, 3, 16, "tma"),
                                              (128, 128, 8, 3, 16, "tma_rescale"), (128, 128, 8, 3, 64, "tma_rescale")]]
    for shape_name in SHAPES:
        n, k = SHAPES[shape_name]
        weight = make_weights("fp8", n, k, 1)[0]
        x = random_activations(4096, k, device="cuda")
        offsets = torch.tensor([0, 4096], dtype=torch.int32, device="cuda")
        xq_us = median_us(lambda: launch.quantize_activations_fp8(x, group=128), rep_ms)
        for cfg in candidates:
            try:
                ok = launch._config_passes("fp8", 128, (128, 128), cfg, torch.device("cuda"))
                us = median_us(lambda: launch._launch(weight, x, offsets, 4096, cfg), rep_ms)
            except Exception as error:  # record compile failures of a candidate
                ok, us = False, float("nan")
                print(f"sweep fp8 {cfg}: {type(error).__name__}: {str(error)[:200]}", flush=True)
            rows.append({"kind": "fp8", "format": "fp8", "shape": shape_name, "m": 4096, "config": repr(cfg),
                         "us": us, "tflops": 2 * 4096 * n * k / us / 1e6, "activation_quant_us": xq_us, "correct": ok})
            print(f"sweep fp8 {shape_name} {cfg} {us:7.1f} us (act quant {xq_us:.1f}) "
                  f"{2 * 4096 * n * k / us / 1e6:5.0f} TFLOP/s ok={ok}", flush=True)
        scaled = _scaled_mm_baseline(4096, n, k, rep_ms)
        rows.append({"kind": "scaled_mm", "shape": shape_name, **scaled})
        print(f"sweep scaled_mm {shape_name} {scaled}", flush=True)
    return rows


def _sweep_fp8_small(rep_ms: int) -> list[dict]:
    """FP8 block GEMM tiles at M <= 16 on one expert: the table's 64-wide tile gives only 32 programs."""
    rows = []
    candidates = [configs.GemmConfig(16, bn, 128, split_k=split, num_warps=4, num_stages=4)
                  for bn, split in [(64, 1), (32, 1), (16, 1), (64, 2), (64, 4), (32, 2), (32, 4), (128, 4)]]
    for shape_name in ("expert_w1_w3", "expert_w2"):
        n, k = SHAPES[shape_name]
        probe = make_weights("fp8", n, k, 1)[0]
        count = copies_for(weight_bytes(probe))
        weights = [probe] + make_weights("fp8", n, k, count - 1)
        for m in (4, 16):
            x = random_activations(m, k, device="cuda")
            offsets = torch.tensor([0, m], dtype=torch.int32, device="cuda")
            want = reference.grouped_gemm(probe, x, offsets)
            for cfg in candidates:
                try:
                    err = launch.relative_error(want, launch._launch(probe, x, offsets, m, cfg))
                    us = timed_over_copies(lambda i: launch._launch(weights[i], x, offsets, m, cfg), count, rep_ms)
                except Exception as error:  # record compile failures of a candidate
                    err, us = float("nan"), float("nan")
                    print(f"sweep fp8 small {cfg}: {type(error).__name__}: {str(error)[:200]}", flush=True)
                rows.append({"kind": "fp8_block_small", "shape": shape_name, "m": m, "config": repr(cfg), "us": us,
                             "rel_err": err})
                print(f"sweep fp8 {shape_name} M={m} {cfg} {us:7.2f} us err {err:.1e}", flush=True)
        del weights
    return rows


def _sweep_dequant(rep_ms: int, copy_gbps: float) -> list[dict]:
    rows = []
    candidates = [configs.ElementwiseConfig(r, c, num_warps=w)
                  for r, c, w in [(16, 256, 4), (8, 512, 4), (4, 1024, 4), (8, 1024, 8), (4, 512, 2),
                                  (8, 512, 8), (4, 2048, 8), (2, 1024, 2), (8, 256, 2)]]
    for fmt in ("mxfp4", "nvfp4", "int4", "fp8"):
        for shape_name, experts in (("expert_w1_w3", None), ("expert_w2", None), ("wq_b", None),
                                    ("square_8192", None), ("expert_w1_w3", 256)):
            n, k = SHAPES[shape_name]
            probe = make_weights(fmt, n, k, 1, experts=experts)[0]
            moved = weight_bytes(probe) + probe.experts * n * k * 2
            count = copies_for(moved)
            weights = [probe] + make_weights(fmt, n, k, count - 1, experts=experts)
            want = reference.dequantize(probe, torch.bfloat16).view(torch.int16) if experts is None else None
            for cfg in candidates:
                out = launch.dequantize(probe, torch.bfloat16, cfg).view(torch.int16)
                exact = torch.equal(out, want) if want is not None else None
                del out
                us = timed_over_copies(lambda i: launch.dequantize(weights[i], torch.bfloat16, cfg), count, rep_ms)
                rows.append({"kind": "dequant", "format": fmt, "shape": shape_name, "experts": experts or 1,
                             "config": repr(cfg), "us": us, "fraction_of_copy_bw": moved / us / 1e3 / copy_gbps,
                             "correct": exact})
                print(f"sweep dequant {fmt} {shape_name} E={experts or 1} {cfg} {us:8.1f} us "
                      f"{moved / us / 1e3 / copy_gbps:5.1%} exact={exact}", flush=True)
            del weights
    return rows


def sweep(rep_ms: int, copy_gbps: float) -> list[dict]:
    """Candidate configs (FP8 at M=4096 and M <= 16, dequant tiles), for choosing the tables.

    The small-batch weight-only candidates have their own script: bench/gemv_sweep.py --mode sweep.
    """
    return [_launch_floor(rep_ms)] + _sweep_fp8(rep_ms) + _sweep_fp8_small(rep_ms) + _sweep_dequant(rep_ms, copy_gbps)


def bench_quantize(copy_gbps: float, rep_ms: int) -> list[dict]:
    """The converters' GPU kernels on one expert and one 8192^2 matrix, bytes read + written vs copy."""
    rows = []
    gen = torch.Generator().manual_seed(3)
    for shape_name in [name for name in ("expert_w1_w3", "square_8192") if name in SHAPES]:  # --quick drops 8192^2
        n, k = SHAPES[shape_name]
        dense = (torch.randn(n, k, generator=gen) * 0.02).to(device="cuda", dtype=torch.bfloat16)
        packed, scale = random_weight("mxfp4", n, k, device="cuda", generator=gen)
        cases = {
            "bf16->fp8_block": (lambda: kernels.quantize("fp8", dense, block=(128, 128)), n * k * 3,
                                lambda: formats.quantize_fp8_block(dense, block=(128, 128))),
            "bf16->int4_g128": (lambda: kernels.quantize("int4", dense), n * k * 2 + n * k // 2,
                                lambda: formats.quantize_int4_weight(dense)),
            "mxfp4->nvfp4": (lambda: kernels.transcode_mxfp4("nvfp4", packed, scale), n * k // 32 * 3,
                             lambda: formats.mxfp4_to_nvfp4(packed, scale)),
            "mxfp4->fp8_block": (lambda: kernels.transcode_mxfp4("fp8", packed, scale, block=(128, 128)), n * k * 3 // 2,
                                 lambda: formats.mxfp4_to_fp8_block(packed, scale, block=(128, 128))),
        }
        for name, (run, moved, torch_run) in cases.items():
            us = triton.testing.do_bench(run, rep=rep_ms, return_mode="median") * 1e3
            torch_us = triton.testing.do_bench(torch_run, rep=rep_ms, return_mode="median") * 1e3
            rows.append({"case": name, "shape": shape_name, "us": us, "gbps": moved / us / 1e3,
                         "fraction_of_copy_bw": moved / us / 1e3 / copy_gbps, "torch_same_device_us": torch_us,
                         "speedup_vs_torch": torch_us / us})
            print(f"quantize {name:17s} {shape_name:13s} {us:8.1f} us {moved / us / 1e3:6.0f} GB/s "
                  f"torch on GPU {torch_us:8.1f} us", flush=True)
    return rows


def _grouped_line(r: dict) -> str:
    variant = r["config"].split("variant='")[1].split("'")[0]
    return (f"| {r['format']} | {r['experts']} | {r['tokens_per_expert']} | {variant} | {r['grouped_us']:.1f} | "
            f"{r['per_expert_graph_us']:.1f} | {r['per_expert_eager_us']:.1f} | {r['speedup_vs_per_expert_graph']:.2f} | "
            f"{r['speedup_vs_per_expert_eager']:.2f} | {r['cublas_bmm_us']:.1f} | {r['speedup_vs_cublas_bmm']:.2f} |")


def summarize(result: dict) -> str:
    copy = result["copy_bandwidth"]["gbps"]
    lines = [f"# Kernel benchmark: {result['device']}", "",
             f"- commit `{result['commit']}`, torch {result['torch']}, triton {result['triton']}",
             f"- command: `{result['command']}`",
             f"- measured copy bandwidth {copy:.0f} GB/s (read + write); dense BF16 8192^3 "
             f"{result['dense_bf16_tflops']:.0f} TFLOP/s; an empty kernel in a CUDA graph "
             f"{result['launch_floor']['us']:.2f} us per launch", ""]
    verdicts = []
    deq = result["dequant"]
    worst = min(deq, key=lambda r: r["fraction_of_copy_bw"]) if deq else None
    if deq:
        met = all(r["fraction_of_copy_bw"] >= 0.8 for r in deq)
        hits = sum(r["fraction_of_copy_bw"] >= 0.8 for r in deq)
        misses = [r for r in deq if r["fraction_of_copy_bw"] < 0.8 and "fraction_of_same_size_copy" in r]
        miss_note = ""
        if misses:
            shapes = sorted({f"{r['shape']} E={r.get('experts', 1)}" for r in misses})
            low = min(r["fraction_of_same_size_copy"] for r in misses)
            high = max(r["fraction_of_same_size_copy"] for r in misses)
            miss_note = (f"; the rows below 80% ({', '.join(shapes)}) run at x{low:.2f}-x{high:.2f} the speed of a "
                         f"copy of their own number of bytes")
        verdicts.append(f"- Dequant >= 80% of copy bandwidth: **{'MET' if met else 'NOT MET'}** "
                        f"({hits}/{len(deq)} rows; worst {worst['format']}/{worst['scale_fmt']} {worst['shape']} "
                        f"E={worst.get('experts', 1)}: {worst['fraction_of_copy_bw']:.0%}{miss_note}); bit-exact "
                        f"everywhere: {all(r['bit_exact'] for r in deq)}")
    gem = [r for r in result["gemm"] if r["format"] != "fp8"]
    small = [r for r in gem if r["m"] <= 16]
    if small:
        hits = sum(r["speedup_vs_cublas_bf16"] >= 3 for r in small)
        worst_small = min(small, key=lambda r: r["speedup_vs_cublas_bf16"])
        best_small = max(small, key=lambda r: r["speedup_vs_cublas_bf16"])
        verdicts.append(f"- 4-bit GEMM >= 3x cuBLAS BF16 at M <= 16: **{'MET' if hits == len(small) else 'NOT MET'}** "
                        f"({hits}/{len(small)} cases; range x{worst_small['speedup_vs_cublas_bf16']:.2f} "
                        f"({worst_small['format']} {worst_small['shape']} M={worst_small['m']}) to "
                        f"x{best_small['speedup_vs_cublas_bf16']:.2f})")
    fp8 = [r for r in result["gemm"] if r["format"] == "fp8" and r["m"] == 4096 and "fraction_of_scaled_mm" in r]
    if fp8:
        met = all(r["fraction_of_scaled_mm"] >= 0.7 for r in fp8)
        fast = [r for r in fp8 if r.get("fast_accum")]
        fast_note = (f"; the opt-in fast-accumulation config (not the default: error grows with K) reaches "
                     f"{', '.join(r['shape'] + ' ' + format(r['fast_accum']['fraction_of_scaled_mm'], '.0%') for r in fast)}"
                     if fast else "")
        verdicts.append(f"- FP8 block GEMM >= 70% of torch._scaled_mm TFLOP/s at M=4096 (default, exact two-level "
                        f"accumulation): **{'MET' if met else 'NOT MET'}** "
                        f"({', '.join(r['shape'] + ' ' + format(r['fraction_of_scaled_mm'], '.1%') for r in fp8)}; "
                        f"_scaled_mm mode: {fp8[0]['scaled_mm']['mode']}; against block-wise _scaled_mm: "
                        f"{', '.join(r['shape'] + ' ' + format(r.get('fraction_of_blockwise_scaled_mm', float('nan')), '.0%') for r in fp8)}"
                        f"{fast_note})")
    lines += ["## Targets", ""] + verdicts + [""]
    if deq:
        lines += ["## Dequantize to BF16", "",
                  f"E = {GROUPED_EXPERTS}: the whole stack of a layer's experts in one launch, as `validate` runs it.", "",
                  "The last column but one: a Triton copy of the same number of bytes (read + written) "
                  "against the dequant kernel, timed the same way; a single expert's ~20 MB copy does not "
                  "reach the 1 GB copy's bandwidth either.", "",
                  "| format | scale | shape | E | us | GB/s | % of copy | x same-size copy | bit-exact |",
                  "|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['format']} | {r['scale_fmt']} | {r['shape']} | {r.get('experts', 1)} | {r['us']:.1f} | "
                  f"{r['gbps']:.0f} | {r['fraction_of_copy_bw']:.0%} | "
                  f"{r.get('fraction_of_same_size_copy', float('nan')):.2f} | {r['bit_exact']} |" for r in deq]
        lines.append("")
    if result.get("quantize"):
        lines += ["## Quantize / transcode on the GPU (the converters' --device cuda path)", "",
                  "Bit-identical to `dsv4convert.formats` (tests/test_kernels_quantize.py); GB/s counts bytes "
                  "read + written; the last column is the formats function run on the same GPU tensors.", "",
                  "| case | shape | us | GB/s | % of copy | x vs torch on GPU |", "|---|---|---|---|---|---|"]
        lines += [f"| {r['case']} | {r['shape']} | {r['us']:.1f} | {r['gbps']:.0f} | {r['fraction_of_copy_bw']:.0%} | "
                  f"{r['speedup_vs_torch']:.1f} |" for r in result["quantize"]]
        lines.append("")
    if result["gemm"]:
        lines += ["## GEMM Y = X @ W^T", "",
                  "| format | shape | M | us | TFLOP/s | x vs cuBLAS BF16 | x vs torch dequant+matmul | rel err |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in result["gemm"]:
            vs_torch = r.get("speedup_vs_torch_dequant_matmul")
            fmt = f"{r['format']} g{r['group']}" if r["format"] == "int4" else r["format"]
            lines.append(f"| {fmt} | {r['shape']} | {r['m']} | {r['us']:.1f} | {r['tflops']:.1f} | "
                         f"{r['speedup_vs_cublas_bf16']:.2f} | {'' if vs_torch is None else f'{vs_torch:.1f}'} | "
                         f"{r['rel_error_vs_fp32_reference']:.1e} |")
        lines.append("")
    if fp8:
        lines += ["## FP8 block vs torch._scaled_mm at M=4096", "",
                  "Row-wise scaling is less work per K block than ours; block-wise (1x128 activation, 128x128 "
                  "weight scales) is the same computation.", "",
                  "| shape | ours TFLOP/s (incl. act. quant) | act. quant us | _scaled_mm row-wise TFLOP/s | ratio "
                  "| ratio, GEMM only | _scaled_mm block-wise TFLOP/s | ratio | fast-accum TFLOP/s | ratio | "
                  "fast-accum rel err |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in fp8:
            block = r["scaled_mm"].get("modes", {}).get("blockwise")
            lines.append(f"| {r['shape']} | {r['tflops']:.0f} | {r['activation_quant_us']:.1f} | "
                         f"{r['scaled_mm']['tflops']:.0f} | {r['fraction_of_scaled_mm']:.2f} | "
                         f"{r['gemm_only_fraction_of_scaled_mm']:.2f} | "
                         f"{block['tflops'] if block else float('nan'):.0f} | "
                         f"{r.get('fraction_of_blockwise_scaled_mm', float('nan')):.2f} | "
                         f"{r.get('fast_accum', {}).get('tflops', float('nan')):.0f} | "
                         f"{r.get('fast_accum', {}).get('fraction_of_scaled_mm', float('nan')):.2f} | "
                         f"{r.get('fast_accum', {}).get('rel_error_vs_fp32_reference', float('nan')):.1e} |")
        lines.append("")
    if result["grouped"]:
        lines += ["## All experts in one launch vs one launch per expert, and vs cuBLAS BF16 bmm", "",
                  "M = 8 per expert is what `validate` runs.", "",
                  "| format | E | M/expert | variant | grouped us | per-expert (graph) us | per-expert (eager) us | "
                  "x graph | x eager | cuBLAS bmm us | x cuBLAS bmm |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        lines += [_grouped_line(r) for r in result["grouped"]]
        lines.append("")
    lines += ["## Config checks (once per process)", ""]
    lines += [f"- {key}: {'pass' if ok else 'FAIL'}" for key, ok in result["config_verdicts"].items()]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="path prefix for the .json and .md results")
    parser.add_argument("--rep-ms", type=int, default=40)
    parser.add_argument("--quick", action="store_true", help="a smoke run: one shape per section, M in (1, 16)")
    parser.add_argument("--sweep", action="store_true", help="also time candidate configs (see sweep())")
    parser.add_argument("--sweep-only", action="store_true", help="time only the candidate configs")
    parser.add_argument("--experts", type=int, default=64)
    args = parser.parse_args()
    if args.quick and (args.sweep or args.sweep_only):
        parser.error("--quick times one shape per section; the sweeps need every shape")
    if args.quick:
        for name in ("expert_w2", "wq_b", "square_8192"):
            SHAPES.pop(name)
    torch.backends.cuda.matmul.allow_tf32 = False
    start = time.time()
    result = {
        "device": torch.cuda.get_device_name(0), "capability": list(torch.cuda.get_device_capability(0)),
        "arch": launch.arch_of(torch.device("cuda")), "torch": torch.__version__, "triton": triton.__version__,
        "python": platform.python_version(), "commit": os.environ.get("DSV4_COMMIT", "unknown"),
        "command": os.environ.get("DSV4_COMMAND", "python bench/kernels.py " + " ".join(sys.argv[1:])),
    }
    result["copy_bandwidth"] = copy_bandwidth(args.rep_ms)
    result["dense_bf16_tflops"] = dense_matmul_tflops(args.rep_ms)
    print(f"copy {result['copy_bandwidth']['gbps']:.0f} GB/s, bf16 {result['dense_bf16_tflops']:.0f} TFLOP/s", flush=True)
    result["sweep"] = sweep(args.rep_ms, result["copy_bandwidth"]["gbps"]) if args.sweep or args.sweep_only else []
    if args.sweep_only:
        with open(args.out + ".json", "w") as f:
            json.dump(result, f, indent=1, default=str)
        return
    result["launch_floor"] = _launch_floor(args.rep_ms)
    result["quantize"] = bench_quantize(result["copy_bandwidth"]["gbps"], args.rep_ms)
    result["dequant"] = bench_dequant(result["copy_bandwidth"]["gbps"], args.rep_ms)
    result["gemm"] = bench_gemms(args.rep_ms, (1, 16) if args.quick else TOKENS)
    result["grouped"] = [row for tokens in (8, 16) for row in bench_grouped(args.rep_ms, 8 if args.quick else args.experts,
                                                                               tokens)]
    result["config_verdicts"] = {repr(k): v for k, v in configs.verdicts().items()}
    result["wall_seconds"] = time.time() - start
    with open(args.out + ".json", "w") as f:
        json.dump(result, f, indent=1, default=str)
    summary = summarize(result)
    with open(args.out + ".md", "w") as f:
        f.write(summary)
    print(summary)


if __name__ == "__main__":
    main()
