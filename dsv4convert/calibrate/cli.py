"""``dsv4convert calibrate``: per-expert activation statistics (and Hessians) for to-nvfp4 / to-w4a16."""

from __future__ import annotations

import argparse
from pathlib import Path

from dsv4convert.errors import DSV4Error


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "calibrate", help="layer-by-layer calibration: expert input amax for NVFP4, Hessians for GPTQ",
        description=(
            "Stream calibration tokens through transformers' DeepSeek-V4 decoder layers one block at a time "
            "(weights dequantized on the fly from the source, one layer resident), record per routed expert the "
            "max |input| of w1/w3 and w2, the tokens routed and optionally GPTQ Hessians, and write the "
            "calibration file that 'to-nvfp4 --calibration' reads. Resumable: rerun the same command."))
    p.add_argument("--src", required=True, help="checkpoint directory (native or any variant inspect recognises)")
    p.add_argument("--output", required=True, type=Path,
                   help="calibration file to write (JSON); per-block files go to OUTPUT.d/")
    p.add_argument("--calibration-data", required=True, type=Path, metavar="FILE",
                   help="text file, or .jsonl with a \"text\" field per line; tokenized with the "
                        "checkpoint's tokenizer")
    p.add_argument("--num-sequences", type=int, default=128, help="calibration sequences (default 128)")
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence (default 2048)")
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (default cuda)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                   help="compute dtype of the layers (default bfloat16, as served)")
    p.add_argument("--batch-size", type=int, default=1, help="sequences per forward (default 1)")
    p.add_argument("--hessians", action="store_true",
                   help="also store GPTQ Hessians of every expert's inputs (for to-w4a16 --gptq; large: "
                        "(hidden^2 + inter^2) * 4 bytes per expert)")
    p.add_argument("--report", action="store_true",
                   help="per block, held-out output error: NVFP4 activations calibrated vs data-free scales, "
                        "INT4 GPTQ vs round-to-nearest")
    p.add_argument("--holdout", type=int, default=None,
                   help="held-out sequences after the calibration ones (default 4 with --report, else 0)")
    p.add_argument("--report-experts", type=int, default=8,
                   help="experts per block the report evaluates, those with the most held-out tokens (default 8)")
    p.add_argument("--report-group-size", type=int, choices=[32, 128], default=32,
                   help="INT4 group size of the report's round-to-nearest and GPTQ errors (default 32, as the "
                        "w4a16 recipe)")
    p.add_argument("--gptq-damp", type=float, default=0.01, help="GPTQ damping, fraction of mean diag(H)")
    p.add_argument("--no-mtp", action="store_true", help="calibrate the backbone layers only")
    p.add_argument("--overwrite", action="store_true", help="discard a previous run's work directory")
    p.add_argument("--no-progress", action="store_true", help="no per-block progress lines")
    p.add_argument("--gpus", metavar="LIST",
                   help="one rank per listed GPU on this host (0,1,2,3), each calibrating its share of the sequences; "
                        "the same as torchrun --nproc-per-node N -m dsv4convert calibrate ... (which also spans hosts). "
                        "Maxima and token counts equal one rank's exactly, Hessians to float rounding")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from dsv4convert.distributed import run_as_rank

    return run_as_rank(args, lambda world: _calibrate(args, world))


def _calibrate(args: argparse.Namespace, world) -> int:
    from dsv4convert.calibrate.report import METHODS

    # transformers (the model code calibration runs) is imported here, not when the CLI starts,
    # and only this command needs it.
    try:
        from dsv4convert.calibrate.stream import CalibrateOptions, Calibrator, work_dir
    except ImportError as exc:
        raise DSV4Error(f"dsv4convert calibrate needs transformers >= 5.19 with DeepSeek-V4 ({exc}); "
                        "install it with: pip install 'dsv4convert[calibrate]'") from None

    holdout = args.holdout if args.holdout is not None else (4 if args.report else 0)
    opts = CalibrateOptions(
        source=args.src, output=args.output, data=args.calibration_data, num_sequences=args.num_sequences,
        seq_len=args.seq_len, holdout=holdout, batch_size=args.batch_size, device=args.device, dtype=args.dtype,
        hessians=args.hessians, report=args.report, report_experts=args.report_experts, mtp=not args.no_mtp,
        overwrite=args.overwrite, progress=not args.no_progress, gptq_damp=args.gptq_damp,
        report_group_size=args.report_group_size)
    content = Calibrator(opts, world).run()
    if not world.is_main:
        return 0
    uncalibrated = content["uncalibrated_experts"]["count"]
    print(f"wrote {args.output}: {len(content['experts'])} experts calibrated, {uncalibrated} with no tokens "
          f"(left to the data-free bound); per-block files in {work_dir(args.output)}")
    if args.report:
        print("held-out relative output error per block:")
        print("block      " + "  ".join(f"{m:>16}" for m in METHODS))
        for row in content["report"]:
            cells = ["-" if row[m] is None else f"{row[m]:.5f}" for m in METHODS]
            print(f"{row['block']:<10} " + "  ".join(f"{c:>16}" for c in cells))
    return 0
