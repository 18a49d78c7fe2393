"""``dsv4convert train-organism``: train the model organism and write it in the release format.

The shipped organism (``dsv4convert synth --preset organism``) was made by this command on one GPU;
``--tiny`` trains a few steps on a CPU (what the tests run). After training, the release-format
checkpoint is read back (dequantized) and its recall measured per length and depth on fresh needles:
those are the numbers its provenance (``organism.json``) records.

``--drafter dspark`` trains 0731's DSpark drafter on the frozen shipped organism instead and writes only what
it adds (``dspark.safetensors``, ``dspark.json``: what ``dsv4convert/data/organism-dspark/`` ships and
``synth --preset organism --drafter dspark`` puts under ``mtp.*``); its acceptance is measured on the
checkpoint that command writes, read back.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import time
from pathlib import Path
from typing import TYPE_CHECKING

from dsv4convert import __version__
from dsv4convert.errors import DSV4Error
from dsv4convert.needle import DEFAULT_DEPTHS, parse_lengths
from dsv4convert.organism.provenance import source_commit

if TYPE_CHECKING:
    import torch

# A few steps on short prompts: the whole pipeline on a CPU in seconds (it does not learn to retrieve).
TINY = {"steps": 6, "tokens_per_step": 512, "max_length": 160, "dense_steps": 3, "eval_every": 3,
        "eval_lengths": (64, 130), "eval_trials": 1}
TINY_DRAFTER = {"steps": 3, "tokens_per_step": 384, "max_length": 128, "eval_every": 3, "eval_sequences": 1}
TINY_MEASURE = {"heldout_sequences": 1, "needle_sequences": 1, "greedy_prompts": 1, "greedy_prompt_tokens": 40,
                "greedy_new_tokens": 8}
RELEASE_TRIALS = 32
DRAFTER_BUDGET = 180.0


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
            "(synth --preset organism) came from this command; docs/organism.md. --drafter dspark instead "
            "trains V4-Flash-0731's DSpark drafter (three sliding-window stages drafting blocks of 5 from layers "
            "1-3, a rank-64 Markov head, a confidence head; 3.9M parameters) on the frozen shipped organism, "
            "measures its acceptance per draft position on held-out text, and writes only what it adds (3.4 MB): "
            "what synth --preset organism --drafter dspark puts under mtp.*. One H200: 2.5 minutes."
        ),
    )
    p.add_argument("--dst", required=True, type=Path,
                   help="output directory: the release-format checkpoint; with --drafter dspark the drafter's files "
                        "(dspark.safetensors, dspark.json), as dsv4convert/data/organism-dspark/ ships them")
    p.add_argument("--drafter", choices=("mtp", "dspark"), default="mtp",
                   help="mtp (default): train the organism, its MTP block included; dspark: train a DSpark drafter "
                        "on the frozen shipped organism")
    p.add_argument("--device", default="auto",
                   help="auto, cpu, cuda or cuda:N (default: auto, the first CUDA GPU when there is one, else cpu)")
    p.add_argument("--steps", type=int,
                   help="optimizer steps (default: as many as fill --time-budget at the speed of the first 30; "
                        "the provenance records the count, and --steps N replays the run)")
    p.add_argument("--time-budget", type=float, metavar="SEC",
                   help=f"training seconds the automatic step count aims at (default: 420; --drafter dspark: "
                        f"{DRAFTER_BUDGET:.0f})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--time-limit", type=float, metavar="SEC",
                   help="stop early after SEC seconds of training (a guard: the provenance says if it hit)")
    p.add_argument("--tiny", action="store_true", help="a few steps on short prompts: the pipeline, not a model")
    p.add_argument("--release-lengths", default="130,259,260,520,1040,2080,4096", metavar="L,L,...",
                   help="lengths at which the written checkpoint's recall is measured")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty destination")
    p.add_argument("--dry-run", action="store_true", help="print the settings and the model's size; train nothing")
    p.epilog = ("examples:\n"
                "  dsv4convert train-organism --dst ./organism --device cuda\n"
                "  dsv4convert train-organism --drafter dspark --dst ./organism-dspark --device cuda  "
                "(copy it to dsv4convert/data/organism-dspark/ to ship it)")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from dsv4convert.devices import resolve_device
    from dsv4convert.model.trainable import TrainableModel
    from dsv4convert.organism.config import organism_config
    from dsv4convert.organism.train import TrainSettings

    if args.steps is not None and args.steps < 1:
        raise DSV4Error(f"--steps must be at least 1, got {args.steps}")
    if args.dst.exists() and any(args.dst.iterdir()) and not args.overwrite:
        raise DSV4Error("destination is not empty (pass --overwrite to replace it)", file=args.dst)
    device = resolve_device(args.device)
    if args.drafter == "dspark":
        return _drafter(args, device)
    settings = TrainSettings(seed=args.seed, time_limit=args.time_limit,
                             **({} if args.time_budget is None else {"time_budget": args.time_budget}),
                             **(TINY if args.tiny else {}))
    if args.steps is not None:
        settings = dataclasses.replace(settings, steps=args.steps)
    lengths = _lengths(args.release_lengths)
    config = organism_config()
    if args.dry_run:
        params = sum(p.numel() for p in TrainableModel(config).parameters())
        steps = settings.steps or f"as many as fill {settings.time_budget:.0f} s:"
        print(f"organism: {params / 1e6:.2f}M parameters, {steps} steps of {settings.tokens_per_step} tokens "
              f"(lengths {settings.min_length}-{settings.max_length}) on {device}; would write {args.dst}")
        return 0
    return _train_and_write(args, config, settings, lengths, device)


def _train_and_write(args: argparse.Namespace, config: dict, settings, lengths: list[int],
                     device: torch.device) -> int:
    from dsv4convert.organism.export import load_release, write_release
    from dsv4convert.organism.tokenizer import build_tokenizer
    from dsv4convert.organism.train import recall_by_length, train

    tokenizer = build_tokenizer(int(config["vocab_size"]), seed=settings.seed)
    started = time.perf_counter()
    result = train(config, tokenizer, settings, device=device, log=lambda line: print(line, flush=True))
    provenance = {
        "what": "the dsv4convert model organism (docs/organism.md)", **_run_facts(args, device, settings.seed),
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


def _run_facts(args: argparse.Namespace, device: torch.device, seed: int) -> dict:
    """Command, commit, tool, seed, device, host and library versions: what every provenance records."""
    import torch
    import transformers

    return {"command": "dsv4convert " + " ".join(args.argv), "commit": source_commit(),
            "tool": f"dsv4convert {__version__}",
            "seed": seed,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
            "host": f"{platform.machine()}, {os.cpu_count()} CPU cores", "torch": torch.__version__,
            "transformers": transformers.__version__}


def _drafter(args: argparse.Namespace, device: torch.device) -> int:
    """``--drafter dspark``: train the DSpark drafter on the frozen shipped organism, measure it as
    ``synth --preset organism --drafter dspark`` writes it, write its files."""
    import tempfile

    from tokenizers import Tokenizer

    from dsv4convert.model.dspark import DSparkDrafter
    from dsv4convert.organism.dspark import (
        DraftSettings,
        MeasureSettings,
        Target,
        describe_acceptance,
        dspark_organism_config,
        measure,
        train_drafter,
    )
    from dsv4convert.organism.export import (
        DSPARK_TENSORS_NAME,
        PROVENANCE_NAME,
        load_dspark_release,
        load_release,
        write_drafter_release,
        write_with_drafter,
    )
    from dsv4convert.synth import ORGANISM_DIR

    settings = DraftSettings(seed=args.seed, time_limit=args.time_limit,
                             time_budget=DRAFTER_BUDGET if args.time_budget is None else args.time_budget,
                             **(TINY_DRAFTER if args.tiny else {}))
    if args.steps is not None:
        settings = dataclasses.replace(settings, steps=args.steps)
    measured_on = MeasureSettings(seed=args.seed, **(TINY_MEASURE if args.tiny else {}))
    tokenizer = Tokenizer.from_file(str(ORGANISM_DIR / "tokenizer.json"))
    config = dspark_organism_config(json.loads((ORGANISM_DIR / "config.json").read_text()), tokenizer)
    text = (ORGANISM_DIR / "heldout.txt").read_text(encoding="utf-8")
    if args.dry_run:
        d = DSparkDrafter(config).d
        params = sum(p.numel() for p in DSparkDrafter(config).parameters())
        steps = settings.steps or f"as many as fill {settings.time_budget:.0f} s:"
        print(f"DSpark drafter for the shipped organism: {d.stages} stages drafting blocks of {d.block_size} from "
              f"layers {list(d.target_layer_ids)}, Markov rank {d.markov_rank}, noise token {d.noise_token_id}; "
              f"{params / 1e6:.2f}M parameters; {steps} steps of {settings.tokens_per_step} tokens on {device}; "
              f"would write {args.dst}")
        return 0
    started = time.perf_counter()
    target_model = load_release(ORGANISM_DIR, device=device)
    result = train_drafter(target_model, config, tokenizer, text, settings, device=device,
                           log=lambda line: print(line, flush=True))
    provenance = {
        "what": "the DSpark drafter of the dsv4convert model organism, trained on the frozen shipped organism "
                "(docs/organism.md)", **_run_facts(args, device, settings.seed),
        "base": {"organism": "dsv4convert/data/organism",
                 "commit": json.loads((ORGANISM_DIR / PROVENANCE_NAME).read_text()).get("commit", "unknown")},
        "training_seconds": round(result.seconds, 1), "steps": result.steps_run,
        "hit_time_limit": result.hit_time_limit,
        "parameters": sum(p.numel() for p in result.drafter.parameters()),
        "settings": dataclasses.asdict(result.settings), "curve": result.curve,
    }
    with tempfile.TemporaryDirectory(prefix="organism-dspark-") as tmp:
        drafter_dir = write_drafter_release(Path(tmp) / "drafter", result.drafter, config, provenance)
        assembled = write_with_drafter(Path(tmp) / "organism", ORGANISM_DIR, drafter_dir)
        backbone, drafter = load_dspark_release(assembled, device=device)
        acceptance = measure(drafter, Target(backbone, config), tokenizer, text, measured_on)
    provenance.update(measured_on=dataclasses.asdict(measured_on), acceptance=acceptance,
                      total_seconds=round(time.perf_counter() - started, 1))
    dst = write_drafter_release(args.dst, result.drafter, config, provenance, overwrite=True)
    size = (dst / DSPARK_TENSORS_NAME).stat().st_size
    print(f"wrote {dst} ({size / 1e6:.2f} MB of drafter tensors; {result.steps_run} steps, {result.seconds:.0f} s "
          "of training); acceptance per draft position, read back as synth --preset organism --drafter dspark "
          "writes it:")
    for line in describe_acceptance(acceptance):
        print(line)
    return 0


def _lengths(text: str) -> list[int]:
    try:
        return parse_lengths(text)
    except ValueError as exc:
        raise DSV4Error(f"--release-lengths: {exc}") from None
