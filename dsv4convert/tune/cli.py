"""``dsv4convert tune``: SGLang's Triton fused-MoE configs for this GPU and a checkpoint's expert shapes."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

from dsv4convert.engines import SGLANG_LABEL
from dsv4convert.tune import DEFAULT_BATCH_SIZES


def _batch_sizes(text: str) -> list[int]:
    try:
        sizes = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        sizes = []
    if not sizes or sizes[0] < 1:
        raise argparse.ArgumentTypeError(f"expected positive batch sizes like 1,2,4,64, got {text!r}")
    return sizes


def _positive(kind):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = 0
        if value <= 0:
            raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
        return value
    return parse


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "tune",
        help="tune SGLang's Triton fused-MoE kernel configs for this GPU and a checkpoint's expert shapes",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            f"Search the tile configs of {SGLANG_LABEL}'s own Triton fused-MoE kernel for the checkpoint's routed\n"
            "experts (FP8 block, INT4 W4A16 or BF16; E experts, intermediate size / TP per rank) on this GPU,\n"
            "per batch size, within a time budget. Each candidate is checked against SGLang's default config\n"
            "before it is timed; tiles that cannot fit the GPU's shared memory (99 KB per block on sm_120) are\n"
            "left out. Writes the up and _down JSON files exactly where and as SGLang looks them up, into a\n"
            "copy of the configs SGLang ships (SGLANG_MOE_CONFIG_DIR replaces the shipped folder), then times\n"
            "the whole MoE with the default, shipped and tuned configs side by side.\n\n"
            "Serve with SGLANG_MOE_CONFIG_DIR=OUT, or `dsv4convert serve --tuned-configs OUT`."
        ),
        epilog=(
            "examples:\n"
            "  dsv4convert tune --model out/fp8 --tp 4 --dry-run\n"
            "  dsv4convert tune --model out/fp8 --tp 4 --out moe-configs --time-budget 30\n"
            "  dsv4convert tune --model out/fp8 --tp 4 --batch-sizes 1,2,4,8,16,32,64 --out moe-configs\n"
            "  dsv4convert serve --model out/fp8 --pd --tuned-configs moe-configs\n"
            "Run it on the GPU model that will serve (GPU 0; CUDA_VISIBLE_DEVICES picks it), with the\n"
            "Triton version the server uses: SGLang keys the files by both."
        ),
    )
    p.add_argument("--model", required=True, help="checkpoint directory or Hugging Face repo id (config and headers only)")
    p.add_argument("--tp", required=True, type=_positive(int), help="tensor-parallel size the server runs")
    p.add_argument("--batch-sizes", type=_batch_sizes, default=list(DEFAULT_BATCH_SIZES),
                   help="tokens per MoE call to tune for (default: SGLang's tuner's 1..4096)")
    p.add_argument("--out", type=Path, default=Path("sglang-moe-configs"),
                   help="folder to write (new, empty, or an earlier tune's; default: sglang-moe-configs)")
    p.add_argument("--time-budget", type=_positive(float), default=20.0, metavar="MIN",
                   help="minutes of search; the best configs found by then are written (default 20)")
    p.add_argument("--max-candidates", type=_positive(int), metavar="N",
                   help="try at most N tile shapes and N refinements (a quick look)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights and routings")
    p.add_argument("--dry-run", action="store_true", help="print what would be tuned and written, run nothing")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from dsv4convert.tune import compare, device, output, run, space
    from dsv4convert.tune.problem import MoEProblem

    problem = MoEProblem.from_checkpoint(args.model, args.tp)
    gpu = device.detect()
    plan = run.plan(problem)
    output.check_destination(args.out, plan.sglang_version)
    shapes, left_out = space.shape_grid(problem, gpu)
    print(f"tune {args.model}: {problem.describe()}")
    print(f"on {gpu.describe()}, SGLang {plan.sglang_version}, Triton folder {plan.triton_folder}")
    for name in plan.files:
        print(f"writes {args.out / 'configs' / name}")
    for name in plan.replaces_shipped():
        print(f"  (replaces SGLang's shipped {name} in the copy)")
    print(f"merged with the {len(output.shipped_files(plan.shipped_configs))} files SGLang ships; "
          f"{len(args.batch_sizes)} batch sizes, {len(shapes)} tile shapes fit this GPU "
          f"({left_out} need more shared memory than a block has), budget {args.time_budget:g} min")
    if args.dry_run:
        return 0
    outcome = run.tune(problem, gpu, args.out, batch_sizes=args.batch_sizes, budget_s=args.time_budget * 60,
                       source=str(args.model), max_candidates=args.max_candidates, seed=args.seed)
    summary = outcome.result.summary()
    print(f"searched {summary['shapes_tried']} of {summary['shapes_planned']} tile shapes in {summary['elapsed_s']:.0f} s"
          + (" (time budget reached: a larger --time-budget searches further)" if summary["stopped_by_budget"] else ""))
    for line in compare.table(outcome.rows):
        print(line)
    stats = compare.summary(outcome.rows)
    if not gpu.timed:
        print("(times from Triton's interpreter mean nothing)")
    elif stats["decode_mean_speedup_vs_default"]:
        print(f"decode batch sizes 1-64: {stats['decode_mean_speedup_vs_default']:.2f}x SGLang's default config")
    for path in outcome.written:
        print(f"wrote {path}")
    print(f"every candidate, its time and its difference from the default config: {outcome.log}")
    backend = " -- --moe-runner-backend triton" if problem.kernel.note else ""
    print(f"serve with: dsv4convert serve --model {shlex.quote(str(args.model))} --tuned-configs "
          f"{shlex.quote(str(args.out))}{backend}   (or SGLANG_MOE_CONFIG_DIR={shlex.quote(str(args.out.resolve()))})")
    if backend:
        print(f"  {problem.kernel.note}")
    return 0
