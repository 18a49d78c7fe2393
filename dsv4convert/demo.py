"""``dsv4convert demo``: the whole tool on a tiny model, in about a minute on two cores.

Synthesizes a tiny native checkpoint, converts it to fp8, nvfp4 and w4a16, validates each
against the source (GPU when present), compares each with the source at the model's output
(``compare``, weights only and as served on sm120, when transformers is installed) and prints
one table: variant, size, lossless blocks, worst-layer SNR, KLD and same top-1, and where the
output is.
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from pathlib import Path

from dsv4convert.checkpoint import Checkpoint
from dsv4convert.convert.execute import ConvertOptions, convert
from dsv4convert.convert.plan import human_bytes
from dsv4convert.convert.recipe import load_recipe
from dsv4convert.synth import preset_config, synthesize
from dsv4convert.validate.cli import validate

VARIANTS = ("fp8", "nvfp4", "w4a16")
# One sequence past the tiny model's top-k threshold and HCA window; the GPU family the users serve on.
COMPARE_TOKENS, COMPARE_GPU = 259, "sm120"


def model_fidelity(src: Path, dst: Path) -> dict[str, dict] | None:
    """KLD and same top-1 of ``dst`` against ``src``, weights only and served; None without transformers."""
    try:
        from dsv4convert.compare.run import CompareOptions, build_plan, run
    except ImportError:
        return None
    out = {}
    for numerics in ("weights", "served"):
        result = run(build_plan(CompareOptions(base=str(src), variant=str(dst), random_tokens=True,
                                               tokens=COMPARE_TOKENS, seq_len=COMPARE_TOKENS, chunk=COMPARE_TOKENS,
                                               numerics=numerics, gpu_family=COMPARE_GPU, progress=False)))
        out[numerics] = {"kld": result["output"]["kld"]["mean"], "same_top1": result["output"]["same_top1"]}
    return out


def run_demo(workdir: Path, *, preset: str = "tiny", progress: bool = False) -> list[dict]:
    t0 = time.monotonic()
    src = synthesize(workdir / "source", preset_config(preset), seed=0, overwrite=True)
    print(f"synthesized {src} ({human_bytes(Checkpoint.open(src).total_bytes)}) in {time.monotonic() - t0:.1f} s")
    rows = []
    for variant in VARIANTS:
        dst = workdir / variant
        result = convert(ConvertOptions(src=str(src), dst=dst, recipe=load_recipe(variant), overwrite=True,
                                        max_shard_bytes=2 * 1024**2, progress=progress))
        check = validate(dst, against=src, report_dir=workdir / f"{variant}-validation", progress=progress)
        s = result.stats
        rows.append({
            "variant": variant,
            "bytes": Checkpoint.open(dst).total_bytes,
            "lossless": (s["lossless_blocks"] / s["total_blocks"]) if s["total_blocks"] else None,
            "worst_snr_db": check.summary["worst_snr_db"],
            "passed": check.summary["passed"],
            "fidelity": model_fidelity(src, dst),
            "dst": str(dst),
            "report": str(check.report_dir / "validate.md"),
        })
    print(f"\n{'variant':8s} {'size':>10s} {'lossless':>10s} {'worst SNR':>11s} {'check':>6s} "
          f"{'KLD weights':>12s} {'KLD served':>11s} {'same top-1 served':>18s}  output")
    for r in rows:
        lossless = f"{100 * r['lossless']:.2f}%" if r["lossless"] is not None else "n/a"
        snr = "exact" if math.isinf(r["worst_snr_db"]) else f"{r['worst_snr_db']:.1f} dB"
        f = r["fidelity"]
        fidelity = (f"{f['weights']['kld']:12.4g} {f['served']['kld']:11.4g} {100 * f['served']['same_top1']:17.1f}%"
                    if f else f"{'-':>12s} {'-':>11s} {'-':>18s}")
        print(f"{r['variant']:8s} {human_bytes(r['bytes']):>10s} {lossless:>10s} {snr:>11s} "
              f"{'ok' if r['passed'] else 'FAIL':>6s} {fidelity}  {r['dst']}")
    if rows and rows[0]["fidelity"]:
        print(f"\nKLD: nats per token at the model's output against the source ({COMPARE_TOKENS} random tokens; "
              f"served = the numerics SGLang runs on {COMPARE_GPU}, both sides). A random tiny model magnifies "
              "every rounding: compare real models on real text with `dsv4convert compare`.")
    else:
        print("\nmodel-level fidelity: pip install -e '.[compare]' (transformers) to add `dsv4convert compare`'s KLD")
    print(f"\nreports: {workdir}/<variant>-validation/validate.md; total {time.monotonic() - t0:.1f} s")
    return rows


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "demo",
        help="synthesize a tiny model, convert it to fp8/nvfp4/w4a16, validate each, print a summary",
        description="The whole pipeline on a tiny synthetic DeepSeek-V4 checkpoint (about a minute on 2 cores).",
    )
    p.add_argument("--workdir", type=Path, help="where to write (default: a new temporary directory, kept)")
    p.add_argument("--preset", default="tiny", choices=["tiny", "small"])
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="dsv4convert-demo-"))
    rows = run_demo(workdir, preset=args.preset)
    return 0 if all(r["passed"] for r in rows) else 1
