"""The ``dsv4convert`` command line.

Each command lives beside the code it drives and registers itself through an
``add_parser(subparsers)`` function that sets ``func``; this module only dispatches, turns
:class:`DSV4Error` and a mistyped command into one ``error:`` line and exit status 2, and holds the glossary
``--help`` ends with.

The modules below are light: they import what their arguments show (names, defaults, choices) and nothing
that loads torch, numpy or transformers; ``func`` imports the implementation when the command runs. So
``--version``, ``--help`` and every ``COMMAND --help`` start at once (tests/test_cli_startup.py).
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import os
import sys
import textwrap

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


# The terms the commands' help uses, explained once (`dsv4convert --help`; docs/glossary.md says more).
GLOSSARY = (
    ("model organism", "a 7.4M-parameter DeepSeek-V4 shipped with the package, trained to retrieve needles and "
                       "stored in the release format: every command runs on it in seconds on a CPU "
                       "(synth --preset organism)"),
    ("DSpark", "DeepSeek-V4-Flash-0731's speculative-decoding drafter under mtp.*: three stages that draft a block "
               "of tokens from the target's hidden states, with a Markov head and a confidence head; the preview "
               "had a single MTP block instead"),
    ("MTP", "multi-token prediction: the drafter a checkpoint ships (DSpark or the preview's MTP block); --mtp "
            "serves with it, --no-mtp leaves it out"),
    ("CSA / HCA", "V4's two compressed attentions: CSA compresses every 4 tokens into one entry and its lightning "
                  "indexer picks the top-k entries each query reads; HCA compresses 128 into one and reads them "
                  "all"),
    ("selection threshold", "the shortest prompt at which CSA's indexer must leave entries out (4 x index_topk + "
                            "4 tokens: 2,052 for V4-Flash, 260 for the organism); below it every entry is read, so "
                            "a faulty indexer shows only past it"),
    ("E8M0", "an 8-bit scale that is a power of two (exponent only): MXFP4's block scale, and to-fp8's expert "
             "block scales for SGLang alone (float32 where vLLM reads the output)"),
    ("ModelOpt layout", "NVIDIA ModelOpt's NVFP4 checkpoint layout (4-bit E2M1 weights, an FP8 scale per 16, "
                        "weight_scale_2 and input_scale), which SGLang and vLLM load with their ModelOpt methods"),
    ("sm90 / sm100 / sm120", "GPU families by CUDA compute capability: sm90 Hopper (H100, H200), sm100 "
                             "Blackwell data-center (B200, GB200), sm120 Blackwell workstation (RTX PRO 6000)"),
)


def _glossary() -> str:
    """The epilog of ``dsv4convert --help``: one wrapped paragraph per term."""
    return "terms (docs/glossary.md says more):\n" + "\n".join(
        textwrap.fill(f"{term}: {text}", width=100, initial_indent="  ", subsequent_indent="    ")
        for term, text in GLOSSARY)


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
        epilog=_glossary(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"dsv4convert {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in COMMAND_MODULES:
        importlib.import_module(module).add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    _quiet_openmp()
    parser = build_parser()
    given = list(sys.argv[1:] if argv is None else argv)
    unknown = _unknown_command(parser, given)
    if unknown:
        print(f"error: {unknown}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    args.argv = given   # as given: --gpus restarts it once per rank
    try:
        return int(args.func(args) or 0)
    except DSV4Error as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # the reader went away (``dsv4convert inspect ... | head``): stop quietly, as a shell tool does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


def _unknown_command(parser: argparse.ArgumentParser, argv: list[str]) -> str | None:
    """The one line for a first word that is no command, with the closest command (argparse lists them all)."""
    if not argv or argv[0].startswith("-"):
        return None
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    if argv[0] in commands:
        return None
    close = difflib.get_close_matches(argv[0], list(commands), n=1)
    hint = f"did you mean '{close[0]}'?" if close else f"the commands are {', '.join(commands)}"
    return f"unknown command '{argv[0]}': {hint} (dsv4convert --help says what each does)"
