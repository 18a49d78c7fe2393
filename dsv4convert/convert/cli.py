"""``to-fp8``, ``to-nvfp4``, ``to-w4a16``, ``to-bf16`` and ``convert --recipe``.

The ``to-*`` commands are the shipped recipes; ``convert`` runs any recipe file. All share
one set of options and one engine (:func:`dsv4convert.convert.execute.convert`).
"""

from __future__ import annotations

import argparse
import signal
from pathlib import Path

from dsv4convert.convert import DEFAULT_MAX_SHARD_BYTES
from dsv4convert.engines import CHOICES, SGLANG_LABEL, VLLM_LABEL
from dsv4convert.format_names import SCALE_RULES
from dsv4convert.sizes import human_bytes, parse_size
from dsv4convert.variants import SUMMARIES

# The shipped recipes a `to-*` command of its own makes (`convert --recipe` makes any).
COMMANDS = {f"to-{recipe}": recipe for recipe in ("fp8", "nvfp4", "w4a16", "bf16")}

ENGINE_HELP = (
    f"the engines the checkpoint must load in: sglang ({SGLANG_LABEL}), vllm ({VLLM_LABEL}) or both. Default: the "
    "recipe's `engine:` key, else both where one layout serves both (the shipped recipes always do, storing "
    "what each engine needs: F32 expert scales and expert_dtype for FP8, BF16 MTP experts for NVFP4, BF16 "
    "linears for W4A16); a layout an engine asked for cannot load is refused, naming the engine and module")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--src", required=True, help="source checkpoint directory or Hugging Face repo id")
    p.add_argument("--dst", required=True, type=Path, help="output directory (must not be inside the source)")
    p.add_argument("--workers", type=int, default=1, help="worker processes (default 1)")
    p.add_argument("--max-memory", type=parse_size, metavar="SIZE",
                   help="memory budget for all workers together, e.g. 16G (default: 80%% of available)")
    p.add_argument("--max-shard-size", type=parse_size, default=DEFAULT_MAX_SHARD_BYTES, metavar="SIZE",
                   help=f"largest output shard (default {DEFAULT_MAX_SHARD_BYTES / 1024**3:g} GiB = "
                        f"{human_bytes(DEFAULT_MAX_SHARD_BYTES)}; a source layer shard is kept whole when it fits)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--resume", action="store_true", help="continue an interrupted run into DST")
    mode.add_argument("--overwrite", action="store_true", help="delete DST's contents and start over")
    p.add_argument("--dry-run", action="store_true", help="plan and check everything, print the plan, write nothing")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--device", default="cpu", metavar="DEVICE",
                   help="where the numerics run: cpu (default), cuda or cuda:N; the output bytes are the same")
    p.add_argument("--revision", help="branch, tag or commit of a Hugging Face repo id --src")
    p.add_argument("--delete-source-shards", action="store_true",
                   help="Hub sources: delete each downloaded shard from the cache once converted, so peak disk "
                        "is the output plus the source shards one output shard reads and the next one (per worker)")
    p.add_argument("--engine", choices=CHOICES, help=ENGINE_HELP)
    p.add_argument("--no-mtp", action="store_true",
                   help="leave the mtp.* drafter out (the preview's MTP block or 0731's DSpark drafter): smaller, "
                        "served without speculative decoding; the model card records it. Without this flag the "
                        "drafter is always converted")


# to-nvfp4 --mtp-experts: how the MTP draft's experts are stored (auto: the nvfp4 recipe's per-engine rules).
NVFP4_MTP_EXPERTS = {"auto": None, "fp8": "fp8", "mxfp4": "keep", "bf16": "bf16"}


def _nvfp4_inputs(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input-scales-from", metavar="PATH_OR_REPO",
                   help="take NVFP4 activation input_scales from another NVFP4 checkpoint of this model")
    p.add_argument("--calibration", type=Path, metavar="FILE",
                   help="take NVFP4 activation input_scales from a calibration file (dsv4convert.calibration/1)")


def _int4_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--group-size", type=int, choices=[32, 128], default=None,
                   help="INT4 weights per BF16 scale (default: the recipe's, 32). 32 matches the source's MXFP4 "
                        "blocks (about +5.5 dB weight SNR); 128 stores 8%% fewer expert bytes")
    p.add_argument("--scale-rule", choices=SCALE_RULES, default=None,
                   help="how each group's scale is chosen (default: the recipe's, mse): 'mse' searches the clip "
                        "ratio with the least squared error (never worse than amax); 'amax' is "
                        "compressed-tensors' amax/7.5, bit-identical to llm-compressor round-to-nearest")


def _gptq_inputs(p: argparse.ArgumentParser) -> None:
    p.add_argument("--calibration", type=Path, metavar="FILE",
                   help="calibration file written by 'dsv4convert calibrate --hessians' (with --gptq)")
    p.add_argument("--gptq", action="store_true",
                   help="quantize routed experts with GPTQ from the calibration Hessians (round-to-nearest "
                        "without; experts that saw no calibration tokens stay round-to-nearest)")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    for command, recipe in COMMANDS.items():
        summary = SUMMARIES[recipe]
        p = subparsers.add_parser(command, help=summary, description=(
            f"{summary}. Streams shard by shard with bounded memory, resumable (--resume), and writes a "
            f"config.json {SGLANG_LABEL} loads as is, a model card and a provenance file. "
            f"Same as: dsv4convert convert --recipe {recipe}"))
        _common(p)
        if recipe == "nvfp4":
            _nvfp4_inputs(p)
            p.add_argument("--mtp-experts", choices=list(NVFP4_MTP_EXPERTS), default="auto",
                           help="the draft's experts (the preview's MTP block, 0731's DSpark stages), all lossless "
                                "from MXFP4: auto (default) picks per --engine: fp8 for sglang (FP8-block; SGLang runs "
                                "the preview's draft on sm_90, sm_100 and sm_120, a DSpark one on sm_100 only: DSPARK "
                                "runs it on the backbone's Marlin runner elsewhere; vLLM cannot load it), mxfp4 for "
                                "vllm (kept as released: recipe nvfp4-mtp-mxfp4; both engines load it, SGLang runs that "
                                "draft on sm_100 only), bf16 for both (2 bytes a weight: 12.9 GB per MTP block or "
                                "DSpark stage at full size against 6.4 GB FP8 and 3.4 GB MXFP4; both engines run the "
                                "draft on every family)")
        if recipe == "w4a16":
            _int4_options(p)
            _gptq_inputs(p)
        if recipe == "fp8":
            p.add_argument("--scale-dtype", choices=["auto", "e8m0", "float32"], default="auto",
                           help="expert block scales: auto (default) is float32 wherever vLLM reads the output ("
                                f"{VLLM_LABEL} copies E8M0 expert scales as raw bytes) and E8M0 powers of two (native) for "
                                "--engine sglang; e8m0 or float32 force one (vLLM refuses e8m0)")
        p.set_defaults(func=_run, recipe=recipe)
    p = subparsers.add_parser("convert", help="run any recipe (YAML) on a checkpoint", description=(
        "Convert with a recipe file: ordered rules that map tensor roles (and optional module regexes) to "
        "keep/bf16/fp8/nvfp4/int4. See recipes/ for the shipped ones and a mixed example."))
    p.add_argument("--recipe", required=True,
                   help="a shipped name (fp8, nvfp4, nvfp4-mtp-mxfp4, w4a16, bf16), or a recipe file (./fp8 for a "
                        "file named like a shipped recipe)")
    _common(p)
    _nvfp4_inputs(p)
    p.add_argument("--gptq", action="store_true",
                   help="INT4 routed experts by GPTQ with the Hessians of --calibration (calibrate --hessians)")
    p.set_defaults(func=_run)


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _recipe(args: argparse.Namespace):
    """The recipe with the command line's overrides: the NVFP4 MTP experts, the FP8 scale dtype, the INT4
    group and scale rule."""
    from dsv4convert.convert.recipe import load_recipe, with_fp8_scale_dtype, with_int4_params, with_mtp_experts

    mtp_experts = NVFP4_MTP_EXPERTS[getattr(args, "mtp_experts", None) or "auto"]
    if mtp_experts == "keep":
        recipe = load_recipe("nvfp4-mtp-mxfp4")
    elif mtp_experts:
        recipe = with_mtp_experts(load_recipe(args.recipe), mtp_experts)
    else:
        recipe = load_recipe(args.recipe)
    recipe = with_fp8_scale_dtype(recipe, getattr(args, "scale_dtype", "auto"))
    return with_int4_params(recipe, group_size=getattr(args, "group_size", None),
                            scale_rule=getattr(args, "scale_rule", None))


def _run(args: argparse.Namespace) -> int:
    from dsv4convert.convert.execute import ConvertOptions, convert

    signal.signal(signal.SIGTERM, _raise_interrupt)
    convert(ConvertOptions(
        src=args.src,
        dst=args.dst,
        recipe=_recipe(args),
        workers=max(1, args.workers),
        max_memory=args.max_memory,
        max_shard_bytes=args.max_shard_size,
        resume=args.resume,
        overwrite=args.overwrite,
        dry_run=args.dry_run,
        input_scales_from=getattr(args, "input_scales_from", None),
        calibration=getattr(args, "calibration", None),
        gptq=getattr(args, "gptq", False),
        progress=not args.no_progress,
        device=args.device,
        revision=args.revision,
        delete_source_shards=args.delete_source_shards,
        engine=args.engine,
        no_mtp=args.no_mtp,
    ))
    if not args.dry_run:
        print(f"next: dsv4convert validate {args.dst} --against {args.src}")
    return 0
