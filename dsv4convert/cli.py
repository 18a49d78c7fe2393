"""The ``dsv4convert`` command line.

Each command lives beside the code it drives and registers itself through an
``add_parser(subparsers)`` function that sets ``func``; this module only dispatches and
turns :class:`DSV4Error` into one ``error:`` line and exit status 2.

The modules below are light: they import what their arguments show (names, defaults, choices) and nothing
that loads torch, numpy or transformers; ``func`` imports the implementation when the command runs. So
``--version``, ``--help`` and every ``COMMAND --help`` start at once (tests/test_cli_startup.py).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from dsv4convert import __version__
from dsv4convert.errors import DSV4Error

# Modules that define ``add_parser(subparsers)``, in the order ``--help`` lists them.
COMMAND_MODULES = [
    "dsv4convert.synth_cli",
    "dsv4convert.inspection_cli",
    "dsv4convert.convert.cli",
    "dsv4convert.validate.cli",
    "dsv4convert.compare.cli",
    "dsv4convert.fit.cli",
    "dsv4convert.automix.cli",
    "dsv4convert.serve.cli",
    "dsv4convert.tune.cli",
    "dsv4convert.demo.cli",
    "dsv4convert.organism.cli",
    "dsv4convert.calibrate.cli",
]


def _quiet_openmp() -> None:
    """OpenMP threads that spin while waiting starve the converter's reader and writer threads
    (docs/performance.md: 2.4x on a busy 2-core machine); it must be set before torch loads."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dsv4convert",
        description=(
            "Convert DeepSeek-V4-Flash (0731 with its DSpark drafter, or the preview; FP8 + MXFP4 experts) into the "
            "quantized variants SGLang and vLLM serve, prove each one's error, size it, and serve it. "
            "Start with `dsv4convert demo` (about a minute on a CPU)."
        ),
    )
    parser.add_argument("--version", action="version", version=f"dsv4convert {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in COMMAND_MODULES:
        importlib.import_module(module).add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    _quiet_openmp()
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)   # as given: --gpus restarts it once per rank
    try:
        return int(args.func(args) or 0)
    except DSV4Error as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
