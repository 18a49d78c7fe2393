"""``dsv4convert automix``: the most faithful checkpoint that fits, chosen per layer, written and verified."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from dsv4convert.compare import DEFAULT_GPU_FAMILY
from dsv4convert.engines import CHOICES, GPU_FAMILIES
from dsv4convert.errors import DSV4Error
from dsv4convert.sizes import human_bytes, parse_size

if TYPE_CHECKING:
    from dsv4convert.automix import plan as automix


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "automix",
        help="per-layer formats chosen from measured sensitivity under a memory budget, written and verified",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Choose one format per decision (each MoE layer's routed experts, each layer's attention, indexer and\n"
            "shared expert) among the layouts --engine serves on --gpu-family, so that the KLD is least within the\n"
            "budget; write the recipe, convert it into DST and measure its KLD with compare on held-out text.\n"
            "The sensitivity pass streams the base once: each candidate is made by the converter's own code\n"
            "and run under its served numerics on the base's input, then the rest of the model runs at the base's\n"
            "precision to the output, where its KL divergence is measured (docs/automix.md). The choice is then\n"
            "verified: the --verify-top best predicted mixes and every uniform layout within the budget are\n"
            "measured whole on --select-tokens of other text, in one more pass over the model, and the one that\n"
            "measures least is returned (it says so when that is not the predicted best). The held-out\n"
            "--verify-tokens are read by neither. The budget is a checkpoint size (--size) or bytes per GPU as\n"
            "fit computes them (--gpu, --tp, --kv-tokens). The text must hold --tokens + --select-tokens +\n"
            "--verify-tokens (24K by default)."
        ),
        epilog=(
            "examples:\n"
            "  dsv4convert automix --src base --dst out/mix --gpu rtx-pro-6000 --tp 4 --kv-tokens 1M --text data.txt "
            "--device cuda\n"
            "  dsv4convert automix --src base --dst out/mix --size 120G --engine both --text data.txt --dry-run\n"
            "  dsv4convert automix --src base --dst out/mix --size 120G --text data.txt --report out/report  "
            "(Pareto table)"
        ),
    )
    p.add_argument("--src", required=True, help="the base checkpoint (a local DeepSeek-V4 directory)")
    p.add_argument("--dst", help="where to write the chosen mix (omit to only choose and write the recipe)")
    p.add_argument("--size", type=parse_size, help="budget: the checkpoint's bytes (e.g. 120G)")
    p.add_argument("--gpu", help="budget per GPU: GPU name as fit knows it (rtx-pro-6000, h200, b200, ...), or a "
                                  "size in MiB with --gpu-family")
    p.add_argument("--tp", type=int, help="tensor-parallel GPUs per server (with --gpu)")
    p.add_argument("--kv-tokens", type=_tokens, help="tokens of KV cache the server must still hold (e.g. 1M, 262144)")
    p.add_argument("--mtp", action="store_true", help="count the MTP draft's weights and KV in the budget (fit --mtp)")
    p.add_argument("--engine", choices=CHOICES, default="sglang",
                   help="engines the mix must load in (default sglang, unlike the converters' both: a mix is chosen for "
                        "the engine that serves it, and both leaves only the layouts the two engines share)")
    p.add_argument("--gpu-family", choices=GPU_FAMILIES,
                   help=f"numerics the candidates are served with (default: --gpu's, else {DEFAULT_GPU_FAMILY})")
    p.add_argument("--text", type=Path, help="UTF-8 text or JSONL the pass and the verification read (the user's own)")
    p.add_argument("--tokens", type=_tokens, default=8192, help="tokens of text for the sensitivity pass (default 8K)")
    p.add_argument("--select-tokens", type=_tokens, default=8192,
                   help="tokens (after --tokens) on which the candidates of the choice are measured whole (default 8K)")
    p.add_argument("--verify-top", type=_count, default=4, metavar="N",
                   help="measure the N best predicted mixes (each the best of its layout) and every uniform layout "
                        "within the budget before choosing: N + up to 11 tracks in one more pass over the model, "
                        "about 8 min for the whole V4-Flash on one H200 (docs/automix.md); 0: trust the estimate, "
                        "no selection windows (default 4)")
    p.add_argument("--verify-tokens", type=_tokens, default=8192,
                   help="held-out tokens (after --select-tokens) for compare's verification and the report "
                        "(default 8K)")
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence (default 2048)")
    p.add_argument("--device", default="auto",
                   help="auto, cpu, cuda or cuda:N (default: auto, the first CUDA GPU when there is one, else cpu)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), help="compute dtype (default: bfloat16 on a GPU)")
    p.add_argument("--chunk", type=int, default=2048, help="queries per forward (default 2048)")
    p.add_argument("--calibration", type=Path, help="NVFP4 input scales from calibrate's file (as convert)")
    p.add_argument("--report", type=Path, metavar="DIR",
                   help="write automix.md/json and pareto.png here, measuring every uniform layout, the naive mix and "
                        "automix at each of their sizes (one conversion and compare each); without it, automix.md/json "
                        "of the choice go to DST-automix beside DST, never into the model directory")
    p.add_argument("--dry-run", action="store_true", help="print the plan (menu, candidates, budget) and stop")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=_run)


def _tokens(text: str) -> int:
    """``8192``, ``8K`` (1024), ``1M`` (1024^2)."""
    t = text.strip().upper()
    scale = {"K": 1024, "M": 1024**2}.get(t[-1:], 1)
    try:
        value = int(float(t[:-1] if scale > 1 else t) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a token count: {text!r} (examples: 8192, 8K, 1M)") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be positive, got {text!r}")
    return value


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text!r}")
    return value


def _options(args: argparse.Namespace) -> automix.AutomixOptions:
    from dsv4convert.automix import plan as automix

    return automix.AutomixOptions(
        src=args.src, dst=args.dst, size=args.size, gpu=args.gpu, tp=args.tp, kv_tokens=args.kv_tokens, mtp=args.mtp,
        engine=args.engine, gpu_family=args.gpu_family, text=args.text, tokens=args.tokens,
        select_tokens=args.select_tokens, verify_top=args.verify_top, verify_tokens=args.verify_tokens,
        seq_len=args.seq_len, device=args.device, dtype=args.dtype, chunk=args.chunk, calibration=args.calibration,
        report=args.report, progress=not args.no_progress)


def _run(args: argparse.Namespace) -> int:
    from dsv4convert.automix import choose, v41, verify
    from dsv4convert.automix import plan as automix

    opts = _options(args)
    if opts.dst and Path(opts.dst).exists() and any(Path(opts.dst).iterdir()):
        raise DSV4Error("destination exists and is not empty", file=opts.dst)
    if v41.is_v41_source(opts.src):     # uniform layouts only on V4.1 (engines/mixes_v41.py says why)
        return v41.run(v41.build(opts), args.dry_run)
    plan = automix.build(opts)
    automix.print_plan(plan)
    windows = automix.windows(plan)
    eta, what = automix.expected(plan, windows)
    if args.dry_run:
        print(f"  {eta.line(what)}")
        return 0
    eta.announce(what)       # before any work: on a CPU the real model's pass takes hours, and says so here
    measured = automix.run_sensitivity(plan, windows.sensitivity, eta)
    best = plan.solve(measured)
    if best is None:
        raise DSV4Error("no mix fits the budget")
    print(f"automix: predicted best {best.layout.label}, {human_bytes(best.bytes)} of "
          f"{human_bytes(best.layout.capacity)} ({best.layout.unit.describe()}); predicted mean KLD {best.predicted:.5f}")
    capacities: dict[str, int | None] = {"": None}
    if opts.report:
        capacities.update({mix.name: mix.bytes for _, mix in verify.baselines(plan, measured)})
    if opts.verify_top:
        print(f"automix: verifying the choice: the best predicted mixes and the uniform layouts within the budget "
              f"{'(and within each baseline of the report) ' if opts.report else ''}measured whole on "
              f"{windows.selection.numel()} selection tokens, one more pass over the model")
    choices = choose.choose_at(plan, measured, capacities, windows.selection)
    choice = choices.pop("")
    if choice.selection is not None:
        for mix in choice.candidates:
            mark = "  <- chosen" if mix is choice.chosen else ""
            print(f"  {mix.name:40} {mix.layout.label:28} {human_bytes(mix.bytes):>9}  predicted {mix.predicted:.5f}  "
                  f"measured {choice.kld(mix):.5f} ± {choice.error(mix):.5f}{mark}")
    print(f"automix: {choice.verdict()}")
    chosen = replace(choice.chosen, name="automix")
    for line in automix.check_fit(plan, chosen, measured):
        print(f"automix: {line}")
    if not opts.dst and not opts.report:
        sys.stdout.write(chosen.recipe(plan, measured, "per-layer formats chosen by dsv4convert automix").text)
        return 0
    verify.deliver(plan, measured, windows, choice, choices)
    return 0
