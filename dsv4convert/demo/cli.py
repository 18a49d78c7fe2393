"""``dsv4convert demo``: the command line (the demo itself is :mod:`dsv4convert.demo`, loaded when it runs)."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from dsv4convert.errors import DSV4Error


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "demo",
        help="the model organism's story: convert, validate, compare, recall to 8x the threshold, a fault named",
        description="On the shipped model organism (a 7.4M-parameter DeepSeek-V4 trained to retrieve needles, "
                    "docs/organism.md): convert it to fp8, nvfp4 and w4a16 and validate each, compare each with it "
                    "(KLD and same top-1 on held-out text, needle recall from half its 260-token selection "
                    "threshold to 8x it, served numerics of sm120 on both sides), inject a known indexer fault in "
                    "a copy and check that compare --recall --local names it; one table, about a minute on a "
                    "laptop CPU. Exit 0 when every check passed and the fault was named, 1 otherwise. Needs "
                    "transformers: pip install -e '.[compare]'.",
    )
    p.add_argument("--workdir", type=Path, help="where to write (default: a new temporary directory, kept)")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    try:
        from dsv4convert.demo import demo_passed, run_demo
    except ImportError as exc:   # compare runs transformers' layers: one line instead of a traceback
        raise DSV4Error(f"the demo runs compare, which needs transformers ({exc}): "
                        "pip install -e '.[compare]'") from None
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="dsv4convert-demo-"))
    passed = demo_passed(run_demo(workdir))
    size = sum(f.stat().st_size for f in workdir.rglob("*") if f.is_file())
    kept = "left there for you to read" if args.workdir else "a temporary directory, kept: `rm -r` it when done"
    print(f"{size / 1e6:.0f} MB in {workdir} ({kept})")
    return 0 if passed else 1
