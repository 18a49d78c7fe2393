"""Time ``dsv4convert calibrate`` on real-size DeepSeek-V4-Flash layers and extrapolate the whole model.

Run on a GPU machine from the repository root::

    PYTHONPATH=. python bench/calibrate.py --work /tmp/cal --out bench/results/calibrate-h200

The checkpoint holds three real-size layers, one of each attention kind (CSA ratio 4 with the
indexer, HCA ratio 128, sliding window), with the real dimensions (hidden 4096, 256 experts
of 2048, 64 heads of 512). ``dsv4convert synth`` draws realistic values on the CPU, which
takes minutes per layer; timing does not depend on the weight values, so here the large
quantized weights are drawn as Gaussian matrices on the GPU and quantized by
:mod:`dsv4convert.formats` (FP8 128x128 and MXFP4, the native formats), and every other tensor
comes from ``synth_tensors``. The tokenizer is synth's byte-level one.

Measured per block: load (read + dequantize on the GPU), forward (all sequences, statistics,
state files), the whole block (saving included) and peak GPU memory; once without and once
with Hessians. Extrapolation to ``--target-sequences`` x ``--seq-len`` on the full model:
``block seconds + forward * (target/measured - 1)`` per layer, times the number of layers of
each kind (2 sliding, 21 CSA, 20 HCA, plus the sliding MTP block).

``--ranks 1,2,4`` instead runs the calibration with Hessians under ``torchrun --nproc-per-node N`` (one GPU
per rank) for each N, beside a plain process: seconds per layer, speedup against the plain run, peak GPU
memory, and whether the calibration equals the plain run's (maxima and token counts exactly, Hessians to
float rounding: the backend sums them across ranks in another order).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from dsv4convert.calibrate.stream import CalibrateOptions, Calibrator, work_dir
from dsv4convert.checkpoint import PlannedTensor, ShardWriter, atomic_write_json, write_index
from dsv4convert.checkpoint.writer import shard_name
from dsv4convert.formats import quantize_fp8_block, quantize_mxfp4
from dsv4convert.models.deepseek_v4.layout import ModelConfig, native_groups
from dsv4convert.synth import TOKENIZER_CONFIG, byte_level_tokenizer, reference_config, synth_tensors

RATIOS = (4, 128, 0)    # the measured layers: CSA, HCA, sliding window
_FAST = ("F8_E4M3", "I8")


def layer_counts() -> dict[int, int]:
    """How many backbone layers of each attention kind the real model has."""
    config = reference_config()
    ratios = config["compress_ratios"][: config["num_hidden_layers"]]
    return {r: ratios.count(r) for r in RATIOS}


def bench_config() -> dict:
    config = reference_config()
    config.update(num_hidden_layers=len(RATIOS), num_nextn_predict_layers=0, compress_ratios=list(RATIOS),
                  num_hash_layers=1)
    return config


def _fast_tensors(group, device: torch.device, seed: int):
    """Large quantized weights (FP8 blocks, MXFP4 experts), the BF16 embedding and head, drawn on the GPU."""
    gen = torch.Generator(device=device).manual_seed(seed)
    for spec in group:
        if spec.dtype == "F8_E4M3":
            n, k = spec.shape
            w, s = quantize_fp8_block(torch.randn(n, k, device=device, generator=gen) / math.sqrt(k), block=(128, 128))
            yield spec.name, w.cpu()
            yield spec.name.replace(".weight", ".scale"), s.cpu()
        elif spec.dtype == "I8":
            n, k = spec.shape[0], spec.shape[1] * 2
            w, s = quantize_mxfp4(torch.randn(n, k, device=device, generator=gen) * (2.5 / math.sqrt(k)))
            yield spec.name, w.cpu()
            yield spec.name.replace(".weight", ".scale"), s.cpu()
        elif spec.name in ("head.weight", "embed.weight"):
            yield spec.name, (torch.randn(spec.shape, device=device, generator=gen) * 0.02).to(torch.bfloat16).cpu()


def write_checkpoint(dst: Path, config: dict, device: torch.device, seed: int = 0) -> Path:
    cfg = ModelConfig.from_dict(config)
    dst.mkdir(parents=True, exist_ok=True)
    groups = native_groups(cfg)
    weight_map, total = {}, 0
    for i, group in enumerate(groups):
        name = shard_name(i + 1, len(groups))
        fast = {s.name for s in group if s.dtype in _FAST or s.name in ("head.weight", "embed.weight")}
        fast |= {f"{s.info.module}.scale" for s in group if s.dtype in _FAST}
        tensors = dict(_fast_tensors(group, device, seed + i))
        tensors.update(synth_tensors([s for s in group if s.name not in fast], cfg, seed))
        planned = [PlannedTensor(s.name, s.dtype, s.shape) for s in group]
        with ShardWriter(dst / name, planned) as writer:
            for spec in group:
                writer.write(spec.name, tensors.pop(spec.name))
        weight_map.update({s.name: name for s in group})
        total += sum(p.nbytes for p in planned)
    atomic_write_json(dst / "config.json", config)
    atomic_write_json(dst / "tokenizer_config.json", TOKENIZER_CONFIG)
    atomic_write_json(dst / "tokenizer.json", byte_level_tokenizer(cfg.vocab_size))
    write_index(dst, weight_map, total)
    return dst


def write_text(path: Path, n_tokens: int) -> Path:
    """Words of printable Latin-1 characters: the byte-level tokenizer gives one token per UTF-8 byte,
    and the ~190 distinct token ids spread hash-routed tokens over most experts."""
    rng = random.Random(0)
    alphabet = [chr(c) for c in (*range(33, 127), *range(161, 256))]
    words = ["".join(rng.choice(alphabet) for _ in range(rng.randint(2, 9))) for _ in range(5000)]
    text = []
    size = 0
    while size < n_tokens * 1.1:
        w = rng.choice(words)
        text.append(w)
        size += len(w) + 1
    path.write_text(" ".join(text))
    return path


def _run(src: Path, output: Path, data: Path, args, *, hessians: bool, max_blocks: int | None) -> list[dict]:
    opts = CalibrateOptions(source=src, output=output, data=data, num_sequences=args.sequences,
                            seq_len=args.seq_len, batch_size=args.batch_size, device=args.device,
                            hessians=hessians, overwrite=True, max_blocks=max_blocks)
    Calibrator(opts).run()
    return [json.loads(p.read_text()) for p in sorted(work_dir(output).glob("layers.*.json"))]


def _scaled(block: dict, scale: float) -> float:
    """A block's seconds with its forward scaled to the target token count (load and save fixed)."""
    return block["seconds"] + block["forward_seconds"] * (scale - 1)


def extrapolate(blocks: list[dict], counts: dict[int, int], scale: float) -> dict:
    by_ratio = dict(zip(RATIOS, blocks))
    per_kind = {str(r): {"layers": n, "seconds_per_layer": _scaled(by_ratio[r], scale)} for r, n in counts.items()}
    mtp = _scaled(by_ratio[0], scale)          # the MTP block is a sliding-window layer
    total = sum(n * _scaled(by_ratio[r], scale) for r, n in counts.items()) + mtp
    return {"per_kind": per_kind, "mtp_seconds": mtp, "total_hours": total / 3600,
            "peak_gpu_gib": max(b["peak_device_bytes"] or 0 for b in blocks) / 2**30}


def rank_runs(src: Path, data: Path, args) -> dict:
    """Calibration with Hessians as a plain process and under torchrun for each ``--ranks`` world size."""
    from dsv4convert.calibration import calibration_hessians

    common = ["calibrate", "--src", str(src), "--calibration-data", str(data), "--num-sequences", str(args.sequences),
              "--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size), "--device", args.device,
              "--hessians", "--no-progress", "--no-mtp", "--overwrite"]
    runs, reference = {}, None
    for name, ranks in [("plain", None), *((f"torchrun {n}", int(n)) for n in args.ranks.split(","))]:
        out = args.work / f"ranks-{name.replace(' ', '-')}" / "calib.json"
        launcher = [] if ranks is None else ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                                              str(ranks)]
        start = time.perf_counter()
        done = subprocess.run([sys.executable, *launcher, "-m", "dsv4convert", *common, "--output", str(out)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{name}: calibrate failed ({done.returncode}):\n{done.stderr[-3000:]}")
        content = json.loads(out.read_text())
        blocks = content["blocks"]
        if reference is None:
            reference = (content, calibration_hessians(out))
        worst = 0.0
        hessians = calibration_hessians(out)
        for module in list(content["experts"])[:64]:          # a sample of experts, both inputs
            for proj in ("w1", "w2"):
                a, b = reference[1](f"{module}.{proj}"), hessians(f"{module}.{proj}")
                worst = max(worst, float((a - b).abs().max() / a.abs().max()))
        runs[name] = {"ranks": ranks or 1, "wall_seconds": time.perf_counter() - start,
                      "layer_seconds": [b["seconds"] for b in blocks],
                      "peak_device_bytes": [b["peak_device_bytes"] for b in blocks],
                      "distributed": content["distributed"],
                      "maxima_and_counts_equal": content["experts"] == reference[0]["experts"],
                      "hessian_max_relative_difference": worst}
    return runs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True, help="results prefix (.json and .md are written)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--sequences", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--target-sequences", type=int, default=512)
    p.add_argument("--config", choices=("real", "tiny"), default="real", help="tiny: a CPU smoke run of this script")
    p.add_argument("--ranks", help="torchrun world sizes to run (e.g. 1,2,4; one GPU per rank) beside a plain run")
    args = p.parse_args()
    device = torch.device(args.device)
    config = bench_config()
    if args.config == "tiny":
        from dsv4convert.synth import preset_config
        tiny = preset_config("tiny")
        config.update({k: tiny[k] for k in ("vocab_size", "hidden_size", "moe_intermediate_size", "num_attention_heads",
                                             "head_dim", "qk_rope_head_dim", "q_lora_rank", "o_lora_rank", "o_groups",
                                             "n_routed_experts", "num_experts_per_tok", "index_n_heads",
                                             "index_head_dim", "index_topk", "sliding_window")})
    args.work.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    src = write_checkpoint(args.work / "ckpt", config, device)
    synth_seconds = time.perf_counter() - start
    data = write_text(args.work / "data.txt", (args.sequences + 1) * args.seq_len)
    if args.ranks:
        runs = rank_runs(src, data, args)
        plain = sum(runs["plain"]["layer_seconds"])
        lines = [f"# dsv4convert calibrate with Hessians under torchrun: "
                 f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}", "",
                 f"{args.sequences} sequences x {args.seq_len} tokens (batch {args.batch_size}) through one CSA, one "
                 "HCA and one sliding-window real-size layer.", "",
                 "| run | ranks | seconds per layer (CSA / HCA / sliding) | speedup vs plain | peak GPU (rank 0) | "
                 "maxima, counts equal | Hessians, max rel. difference |", "|---|---|---|---|---|---|---|"]
        for name, run in runs.items():
            peak = max(p or 0 for p in run["peak_device_bytes"]) / 2**30
            lines.append(f"| {name} | {run['ranks']} | {' / '.join(f'{x:.1f}' for x in run['layer_seconds'])} | "
                         f"{plain / sum(run['layer_seconds']):.2f}x | {peak:.1f} GiB | "
                         f"{run['maxima_and_counts_equal']} | {run['hessian_max_relative_difference']:.1e} |")
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps({"runs": runs, "args": vars(args)}, indent=2,
                                                            default=str) + "\n")
        args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
        print("\n".join(lines))
        return
    # Warm-up (CUDA context, cuBLAS handles, first-call overheads), so the first measured block is not charged.
    warm = argparse.Namespace(**{**vars(args), "sequences": 1})
    _run(src, args.work / "warmup" / "calib.json", data, warm, hessians=False, max_blocks=1)
    shutil.rmtree(args.work / "warmup")
    plain = _run(src, args.work / "amax" / "calib.json", data, args, hessians=False, max_blocks=None)
    with_h = _run(src, args.work / "hessians" / "calib.json", data, args, hessians=True, max_blocks=1)
    hessian_file = work_dir(args.work / "hessians" / "calib.json") / "layers.0.safetensors"
    hessian_bytes = hessian_file.stat().st_size
    # Files hold the experts that received tokens; with every expert calibrated a block holds this much:
    full_hessian_bytes = config["n_routed_experts"] * (config["hidden_size"] ** 2
                                                       + config["moe_intermediate_size"] ** 2) * 4
    shutil.rmtree(args.work / "hessians")
    counts = layer_counts()
    scale = args.target_sequences / args.sequences
    amax_only = extrapolate(plain, counts, scale)
    # Hessians, measured on the CSA layer: their extra seconds (accumulation, writing 20 GiB) on every block.
    extra = _scaled(with_h[0], scale) - _scaled(plain[0], scale)
    layers_total = sum(counts.values()) + 1
    hessian_hours = amax_only["total_hours"] + layers_total * extra / 3600
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
        "torch": torch.__version__, "measured_sequences": args.sequences, "seq_len": args.seq_len,
        "batch_size": args.batch_size, "target_sequences": args.target_sequences,
        "checkpoint_seconds": synth_seconds, "blocks": plain, "hessian_block": with_h[0],
        "hessian_file_bytes_measured": hessian_bytes, "hessian_bytes_per_block_all_experts": full_hessian_bytes,
        "extrapolated": {"amax_only": amax_only,
                         "with_hessians": {"total_hours": hessian_hours,
                                           "peak_gpu_gib": (with_h[0]["peak_device_bytes"] or 0) / 2**30,
                                           "hessian_disk_gib": full_hessian_bytes * layers_total / 2**30}},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [f"# dsv4convert calibrate on {result['device']}", "",
             f"{args.sequences} sequences x {args.seq_len} tokens measured (batch {args.batch_size}); "
             f"extrapolated to {args.target_sequences} sequences on 43 layers + MTP.", "",
             "| block | attention | load s | forward s | peak GPU GiB |", "|---|---|---|---|---|"]
    for b, ratio in zip(plain, RATIOS):
        lines.append(f"| {b['block']} | ratio {ratio} | {b['load_seconds']:.1f} | {b['forward_seconds']:.1f} | "
                     f"{(b['peak_device_bytes'] or 0) / 2**30:.1f} |")
    h = with_h[0]
    lines.append(f"| {h['block']} + Hessians | ratio 4 | {h['load_seconds']:.1f} | {h['forward_seconds']:.1f} | "
                 f"{(h['peak_device_bytes'] or 0) / 2**30:.1f} |")
    lines += ["", f"- amax only (NVFP4): **{amax_only['total_hours']:.2f} h**, "
                  f"peak {amax_only['peak_gpu_gib']:.1f} GiB",
              f"- with Hessians (GPTQ): **{hessian_hours:.2f} h**, peak "
              f"{result['extrapolated']['with_hessians']['peak_gpu_gib']:.1f} GiB, Hessian files "
              f"{result['extrapolated']['with_hessians']['hessian_disk_gib']:.0f} GiB", ""]
    args.out.with_suffix(".md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
