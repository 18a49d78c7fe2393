"""``dsv4convert validate``: integrity, per-layer error against the source, and reports."""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from dsv4convert.engines import SGLANG_LABEL, VLLM_LABEL
from dsv4convert.errors import DSV4Error


@dataclass
class ValidationResult:
    summary: dict
    report_dir: Path


def validate(dst: str | Path, *, against: str | Path | None = None, device: str | None = None,
             report_dir: Path | None = None, fail_below_snr: float | None = None, progress: bool = True,
             chunk_bytes: int | None = None) -> ValidationResult:
    import torch
    from tqdm import tqdm

    from dsv4convert.checkpoint import Checkpoint
    from dsv4convert.inspection import check_routing, inspect_checkpoint
    from dsv4convert.validate.integrity import check_all_finite, check_integrity
    from dsv4convert.validate.layer_error import layer_errors
    from dsv4convert.validate import v41
    from dsv4convert.validate.report import write_reports

    t0 = time.monotonic()
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise DSV4Error("--device cuda asked for, but torch sees no CUDA GPU")
    ckpt = Checkpoint.open(dst)
    if v41.handles(ckpt.config, str(ckpt.root / "config.json")):
        out = Path(report_dir) if report_dir else ckpt.root.parent / f"{ckpt.root.name}-validation"
        return ValidationResult(v41.validate_v41(ckpt, against=against, report_dir=out, progress=progress), out)
    check_routing(ckpt)
    info = inspect_checkpoint(ckpt)
    src = Checkpoint.open(against) if against is not None else None
    if src is not None:
        check_routing(src)
    src_info = inspect_checkpoint(src) if src is not None else None
    if src_info is not None and src_info.config != info.config:
        raise DSV4Error("the two checkpoints have different model configs", file=Path(against) / "config.json")
    for which, checked in (("the validated checkpoint", ckpt), ("the --against source", src)):
        if checked is not None:
            scan = tqdm(total=checked.total_bytes, unit="B", unit_scale=True, desc="finite", disable=not progress,
                        file=sys.stderr)
            check_all_finite(checked, which, scan.update)
            scan.close()
    integrity = check_integrity(ckpt, info)
    problems = integrity.problems
    setting = integrity.fp4_experts
    errors = []
    if src is not None:
        total = sum(1 for m in info.modules if m in src_info.modules)
        bar = tqdm(total=total, unit="module", desc="validate", disable=not progress, file=sys.stderr)
        budget = chunk_bytes or ((8 << 30) if device == "cuda" else (1 << 30))
        errors = layer_errors(ckpt, src, info, src_info, device=device, chunk_bytes=budget,
                              progress=bar.update)
        bar.close()
    out = Path(report_dir) if report_dir else ckpt.root.parent / f"{ckpt.root.name}-validation"
    summary = write_reports(out, dst=str(dst), src=str(against) if against else None, variant=info.variant,
                            integrity=problems, errors=errors, threshold=fail_below_snr,
                            seconds=time.monotonic() - t0, device=device,
                            sglang_env={"SGLANG_DSV4_FP4_EXPERTS": setting.needed} if setting else None,
                            sglang_note=setting.describe() if setting else None,
                            engines=list(integrity.engines), engine_checks=integrity.engine_checks)
    return ValidationResult(summary, out)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "validate",
        help="check a converted checkpoint's integrity and per-layer error against its source",
        description=(
            "Every tensor is read and must be finite (a NaN or Inf stops it, naming the file and tensor). "
            "Integrity: every tensor the layout and variant require, index and shards agreeing, what "
            f"{SGLANG_LABEL}'s loader would do silently (expert tensors dropped, cast or missing, scales without weights, "
            "mixed wq_a/wkv pairs, w1/w3 scales that differ), the quantization_config the stored formats need, "
            "and the SGLANG_DSV4_FP4_EXPERTS value to serve with (the model card's commands must set it). "
            f"Engines: which engines the output says it is for ({SGLANG_LABEL}, {VLLM_LABEL} or both), and each "
            "engine's rules on the stored formats; an engine it is for but cannot load fails integrity. "
            "With --against SRC: every linear module is dequantized on both sides (Triton kernels on the GPU, "
            "torch on the CPU) and compared (relative error, SNR, cosine, max abs, bit-exactness), and run "
            "through the fused dequant-GEMM kernel on probe activations. Writes validate.json, validate.md and snr_per_layer.png; exits 1 when "
            "integrity fails or a module is below --fail-below-snr."
        ),
    )
    p.add_argument("dst", help="the checkpoint to validate")
    p.add_argument("--against", metavar="SRC", help="the source checkpoint to measure error against")
    p.add_argument("--device", choices=["cuda", "cpu"], help="where to dequantize (default: cuda if present)")
    p.add_argument("--report", type=Path, metavar="DIR", help="report directory (default: DST-validation beside DST)")
    p.add_argument("--fail-below-snr", type=float, metavar="DB", help="fail if any module's weight SNR is below DB")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from dsv4convert.validate.report import engine_line, layer_error_line

    result = validate(args.dst, against=args.against, device=args.device, report_dir=args.report,
                      fail_below_snr=args.fail_below_snr, progress=not args.no_progress)
    s = result.summary
    print(f"{args.dst}: variant {s['variant']}, integrity {'OK' if s['integrity_ok'] else 'FAILED'}, "
          f"{layer_error_line(s)}")
    for problem in s["integrity_problems"][:10]:
        print(f"  integrity: {problem}")
    if len(s["integrity_problems"]) > 10:
        print(f"  ... and {len(s['integrity_problems']) - 10} more integrity problems (see the report)")
    print(f"  engines: {engine_line(s)}")
    for engine, families in s.get("families", {}).items():   # DeepSeek-V4.1: what each engine runs per GPU family
        print(f"  {engine} per GPU family: " + "; ".join(f"{f} {why}" for f, why in families.items()))
    if s["sglang_note"]:
        print(f"  {SGLANG_LABEL}: {s['sglang_note']}")
    if s["below_threshold"]:
        print(f"  {len(s['below_threshold'])} modules below {s['fail_below_snr_db']} dB, e.g. {s['below_threshold'][0]}")
    print(f"report: {result.report_dir / 'validate.md'}")
    if s["passed"]:
        print(f"next: dsv4convert compare --base {args.against} --variant {args.dst}" if args.against
              else f"next: dsv4convert fit --model {args.dst}")
    return 0 if s["passed"] else 1
