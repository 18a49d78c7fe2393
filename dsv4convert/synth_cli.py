"""``dsv4convert synth``: the command line (the checkpoints themselves are :mod:`dsv4convert.synth`, loaded when the
command runs)."""

from __future__ import annotations

import argparse
from pathlib import Path

from dsv4convert.errors import DSV4Error
from dsv4convert.models.deepseek_v4.presets import PRESETS
from dsv4convert.models.deepseek_v41.config import is_v41
from dsv4convert.models.deepseek_v41.presets import DEFAULT_ENGRAM_ROWS
from dsv4convert.models.deepseek_v41.presets import PRESETS as V41_PRESETS

ORGANISM = "organism"
ORGANISM_V41 = "organism-v41"
DRAFTERS = ("mtp", "dspark", "none")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "synth",
        help="write a synthetic checkpoint in the exact native DeepSeek-V4-Flash format",
        description=(
            "Write a checkpoint with the native names, dtypes and layouts (FP8 + E8M0 128x128 scales, "
            "MXFP4 experts, BF16/F32/I64 elsewhere) and realistic values, deterministic by seed. "
            "Presets are small enough for CI; --config with the real config.json and --num-layers "
            "makes real-size layers for benchmarks (~3.6 GB per layer; DeepSeek-V4.1-Flash's: 7.3 GB per layer, "
            "the Engram tables scaled by --engram-rows). --preset organism writes the "
            "shipped model organism instead: a small DeepSeek-V4 trained to retrieve needles, stored as "
            "the release is (docs/organism.md); with --drafter dspark in V4-Flash-0731's layout, its backbone "
            "unchanged and its trained DSpark drafter under mtp.* (10.1 MB on disk, 3.4 MB of it the drafter), with "
            "--drafter none without a drafter."
        ),
    )
    p.add_argument("--dst", required=True, type=Path, help="output directory")
    p.add_argument("--preset", choices=sorted([*PRESETS, *V41_PRESETS, ORGANISM, ORGANISM_V41]), default="tiny",
                   help="model size (default: tiny); tiny-v41: a tiny DeepSeek-V4.1-Flash (every tensor kind, its "
                        "tokenizer); organism: the shipped trained organism (7.6 MB on disk; "
                        "10.1 MB with --drafter dspark); organism-v41: the shipped trained V4.1 organism (15 MB; "
                        "with --drafter dspark its trained DSpark drafter in V4.1's layout; docs/organism.md)")
    p.add_argument("--config", type=Path, help="a DeepSeek-V4 or V4.1 config.json to use instead of a preset")
    p.add_argument("--num-layers", type=int, help="keep only the first N backbone layers (a V4.1 config: the first "
                   "N-1 and its first layer that holds every tensor kind, an Engram layer that is a KV and index "
                   "source: the release's layer 14; renumbered)")
    p.add_argument("--engram-rows", type=int, metavar="ROWS",
                   help=f"with a DeepSeek-V4.1 --config: about ROWS rows per Engram table, 264 bytes each (default "
                        f"{DEFAULT_ENGRAM_ROWS:,}: {DEFAULT_ENGRAM_ROWS * 264 / 1e9:.1f} GB per table; the release's "
                        f"are 384M rows, 101 GB). engram_vocab_size and engram_num_embeddings are rederived so the "
                        f"engines' hash layout still holds")
    p.add_argument("--drafter", choices=DRAFTERS, help="the draft model under mtp.*: mtp (the preview's MTP block), "
                   "dspark (V4-Flash-0731's DSpark drafter: three sliding-window stages, a Markov and a confidence "
                   "head) or none; default: what the preset or --config has. With --preset organism: mtp (default) "
                   "its own MTP block, dspark its trained DSpark drafter (0731's layout), none neither; with --preset "
                   "organism-v41: none (default) the backbone alone, dspark its trained DSpark drafter (V4.1's layout)")
    p.add_argument("--no-mtp", action="store_true", help="leave out the drafter (same as --drafter none)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=1, metavar="N",
                   help="DeepSeek-V4.1 (--config or --preset tiny-v41): write N shards at once in spawned processes, "
                        "the same bytes (its real-size layers are drawn on one core each: about 30 s per layer)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty destination")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from dsv4convert.checkpoint import read_small_json
    from dsv4convert.organism.export import write_organism, write_organism_v41
    from dsv4convert.models.deepseek_v41 import synth as v41_synth
    from dsv4convert.models.deepseek_v4.configs import ModelConfig, with_dspark, with_num_layers
    from dsv4convert.synth import preset_config, synthesize

    if args.no_mtp and args.drafter not in (None, "none"):
        raise DSV4Error(f"--no-mtp and --drafter {args.drafter} contradict each other")
    drafter = "none" if args.no_mtp else args.drafter
    if args.workers < 1:
        raise DSV4Error(f"--workers must be at least 1, got {args.workers}")
    if args.preset == ORGANISM:
        if (args.config or args.num_layers is not None or args.seed or args.engram_rows is not None
                or args.workers != 1):
            raise DSV4Error("--preset organism is a trained checkpoint: --config, --num-layers, --engram-rows, "
                            "--seed and --workers do not apply")
        dst = write_organism(args.dst, drafter=drafter or "mtp", overwrite=args.overwrite)
        size = sum(p.stat().st_size for p in dst.iterdir())
        what = {"mtp": "its MTP block", "dspark": "its DSpark drafter, 0731's layout", "none": "no drafter"}
        print(f"wrote {dst} (the trained organism with {what[drafter or 'mtp']}, {size / 1e6:.1f} MB; "
              "docs/organism.md)")
        return 0
    if args.preset == ORGANISM_V41:
        if (args.config or args.num_layers is not None or args.seed or args.engram_rows is not None
                or args.workers != 1 or drafter == "mtp"):
            raise DSV4Error("--preset organism-v41 is a trained checkpoint: --config, --num-layers, --engram-rows, "
                            "--seed, --workers and --drafter mtp (V4.1's drafter is DSpark) do not apply")
        dst = write_organism_v41(args.dst, drafter=drafter or "none", overwrite=args.overwrite)
        size = sum(p.stat().st_size for p in dst.iterdir())
        what = "with its DSpark drafter, V4.1's layout" if drafter == "dspark" else "no drafter"
        print(f"wrote {dst} (the trained DeepSeek-V4.1 organism, {what}, {size / 1e6:.1f} MB; docs/organism.md)")
        return 0
    if args.preset in V41_PRESETS:
        if (args.config or args.num_layers is not None or args.engram_rows is not None
                or drafter not in (None, "dspark")):
            raise DSV4Error(f"--preset {args.preset} is V4.1's release layout with its DSpark drafter: --config, "
                            "--num-layers, --engram-rows and other drafters do not apply")
        dst = v41_synth.synthesize(args.dst, V41_PRESETS[args.preset], seed=args.seed, overwrite=args.overwrite,
                                   workers=args.workers)
        print(f"wrote {dst}")
        return 0
    config = read_small_json(args.config) if args.config else preset_config(args.preset)
    if is_v41(config):
        if drafter == "mtp":
            raise DSV4Error("--drafter mtp: DeepSeek-V4.1's drafter is DSpark (--drafter dspark or none)",
                            file=args.config)
        rows = DEFAULT_ENGRAM_ROWS if args.engram_rows is None else args.engram_rows
        config = v41_synth.scaled_config(config, args.num_layers, rows, drafter=drafter != "none")
        text = config["text_config"]
        dst = v41_synth.synthesize(args.dst, config, seed=args.seed, overwrite=args.overwrite, progress=True,
                                   workers=args.workers)
        tables = ", ".join(f"layer {i}: {r:,} rows" for i, r in zip(text["engram_layer_ids"],
                                                                    text["engram_num_embeddings"]))
        print(f"wrote {dst}: {text['num_hidden_layers']} real-size DeepSeek-V4.1 layers, Engram tables scaled to "
              f"--engram-rows {rows:,} ({tables or 'none kept'}; the release's are 384M rows each)")
        return 0
    if args.engram_rows is not None:
        raise DSV4Error("--engram-rows applies to a DeepSeek-V4.1 --config (V4 has no Engram tables)")
    if args.workers != 1:
        raise DSV4Error("--workers applies to DeepSeek-V4.1 (--config or --preset tiny-v41); V4 is written in one "
                        "process")
    cfg = ModelConfig.from_dict(config, source=str(args.config or f"preset {args.preset}"))
    if drafter == "dspark" and cfg.dspark is None:
        config = with_dspark(with_num_layers(config, cfg.num_hidden_layers, mtp=False))
    elif drafter == "mtp" and cfg.drafter.value != "mtp":
        raise DSV4Error("--drafter mtp: this config has no MTP block to keep (the preview's configs and presets have "
                        "one)")
    if args.num_layers is not None or drafter == "none":
        config = with_num_layers(config, args.num_layers or config["num_hidden_layers"], mtp=drafter != "none")
    dst = synthesize(args.dst, config, seed=args.seed, overwrite=args.overwrite, progress=True)
    print(f"wrote {dst}")
    return 0
