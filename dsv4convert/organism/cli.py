"""``dsv4convert train-organism``: train the model organism and write it in the release format.

The shipped organism (``dsv4convert synth --preset organism``) was made by this command on one GPU;
``--tiny`` trains a few steps on a CPU (what the tests run). After training, the release-format
checkpoint is read back (dequantized) and its recall measured per length and depth on fresh needles:
those are the numbers its provenance (``organism.json``) records.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING

from dsv4convert import __version__
from dsv4convert.errors import DSV4Error
from dsv4convert.needle import DEFAULT_DEPTHS, parse_lengths

if TYPE_CHECKING:
    import torch

# A few steps on short prompts: the whole pipeline on a CPU in seconds (it does not learn to retrieve).
TINY = {"steps": 6, "tokens_per_step": 512, "max_length": 160, "dense_steps": 3, "eval_every": 3,
        "eval_lengths": (64, 130), "eval_trials": 1}
RELEASE_TRIALS = 32


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "train-organism",
        help="train the model organism (a ~7M-parameter DeepSeek-V4 that retrieves needles) and write it",
        description=(
            "Trains the organism (dsv4convert/organism: every block kind of DeepSeek-V4-Flash, top-k 64, "
            "selection threshold 260 tokens) on needle prompts from dsv4convert.needle and a small seeded "
            "language, with transformers' DeepseekV4 layers, then writes it as the release is stored (FP8 "
            "128x128 blocks, MXFP4 experts, BF16/F32 elsewhere) with its tokenizer and provenance, and "
            "measures the written checkpoint's recall. One GPU: about 7 minutes. The shipped organism "
            "(synth --preset organism) came from this command; docs/organism.md."
        ),
    )
    p.add_argument("--dst", required=True, type=Path, help="output directory (the release-format checkpoint)")
    p.add_argument("--device", default="auto",
                   help="auto, cpu, cuda or cuda:N (default: auto, the first CUDA GPU when there is one, else cpu)")
    p.add_argument("--steps", type=int,
                   help="optimizer steps (default: as many as fill --time-budget at the speed of the first 30; "
                        "the provenance records the count, and --steps N replays the run)")
    p.add_argument("--time-budget", type=float, default=420.0, metavar="SEC",
                   help="training seconds the automatic step count aims at (default: 420)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--time-limit", type=float, metavar="SEC",
                   help="stop early after SEC seconds of training (a guard: the provenance says if it hit)")
    p.add_argument("--tiny", action="store_true", help="a few steps on short prompts: the pipeline, not a model")
    p.add_argument("--release-lengths", default="130,259,260,520,1040,2080,4096", metavar="L,L,...",
                   help="lengths at which the written checkpoint's recall is measured")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty destination")
    p.add_argument("--dry-run", action="store_true", help="print the settings and the model's size; train nothing")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from dsv4convert.devices import resolve_device
    from dsv4convert.model.trainable import TrainableModel
    from dsv4convert.organism.config import organism_config
    from dsv4convert.organism.train import TrainSettings

    settings = TrainSettings(seed=args.seed, time_limit=args.time_limit, time_budget=args.time_budget,
                             **(TINY if args.tiny else {}))
    if args.steps is not None:
        if args.steps < 1:
            raise DSV4Error(f"--steps must be at least 1, got {args.steps}")
        settings = dataclasses.replace(settings, steps=args.steps)
    lengths = _lengths(args.release_lengths)
    config = organism_config()
    if args.dst.exists() and any(args.dst.iterdir()) and not args.overwrite:
        raise DSV4Error("destination is not empty (pass --overwrite to replace it)", file=args.dst)
    device = resolve_device(args.device)
    if args.dry_run:
        params = sum(p.numel() for p in TrainableModel(config).parameters())
        steps = settings.steps or f"as many as fill {settings.time_budget:.0f} s:"
        print(f"organism: {params / 1e6:.2f}M parameters, {steps} steps of {settings.tokens_per_step} tokens "
              f"(lengths {settings.min_length}-{settings.max_length}) on {device}; would write {args.dst}")
        return 0
    return _train_and_write(args, config, settings, lengths, device)


def _train_and_write(args: argparse.Namespace, config: dict, settings, lengths: list[int],
                     device: torch.device) -> int:
    import torch
    import transformers

    from dsv4convert.organism.export import load_release, write_release
    from dsv4convert.organism.tokenizer import build_tokenizer
    from dsv4convert.organism.train import recall_by_length, train

    tokenizer = build_tokenizer(int(config["vocab_size"]), seed=settings.seed)
    started = time.perf_counter()
    result = train(config, tokenizer, settings, device=device, log=lambda line: print(line, flush=True))
    provenance = {
        "what": "the dsv4convert model organism (docs/organism.md)",
        "command": "dsv4convert " + " ".join(args.argv),
        "commit": _commit(), "tool": f"dsv4convert {__version__}", "seed": settings.seed,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "transformers": transformers.__version__,
        "training_seconds": round(result.seconds, 1), "steps": result.steps_run,
        "hit_time_limit": result.hit_time_limit, "parameters": sum(p.numel() for p in result.model.parameters()),
        "settings": dataclasses.asdict(result.settings), "curve": result.curve,
    }
    dst = write_release(args.dst, result.model, config, tokenizer, provenance, overwrite=True)
    released = load_release(dst, device=device)
    recall = {str(length): {str(depth): recall_by_length(released, tokenizer, [length], RELEASE_TRIALS,
                                                        settings.seed + 104729 + i, device, depths=[depth])[length]
                            for depth in DEFAULT_DEPTHS}
              for i, length in enumerate(lengths)}
    provenance["release_recall"] = {"trials_per_cell": RELEASE_TRIALS, "by_length_and_depth": recall}
    provenance["total_seconds"] = round(time.perf_counter() - started, 1)
    write_release(dst, result.model, config, tokenizer, provenance, overwrite=True)
    print(f"wrote {dst} ({result.steps_run} steps, {result.seconds:.0f} s of training)")
    for length, cells in recall.items():
        print(f"  release-format recall at {length:>5} tokens: "
              + "  ".join(f"depth {d}: {100 * v:.0f}%" for d, v in cells.items()))
    return 0


def _lengths(text: str) -> list[int]:
    try:
        return parse_lengths(text)
    except ValueError as exc:
        raise DSV4Error(f"--release-lengths: {exc}") from None


def _commit() -> str:
    if os.environ.get("DSV4_COMMIT"):
        return os.environ["DSV4_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=Path(__file__).resolve().parent)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"
