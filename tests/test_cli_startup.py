"""``dsv4convert --version``, ``--help`` and every ``dsv4convert COMMAND --help`` start without loading torch, numpy,
transformers or any other heavy library: each command imports its implementation when it runs (docs/architecture.md).

Checked on module names in ``python -X importtime`` output, never on time (CI machines are noisy). Two processes:
the real entry point (``python -m dsv4convert --version``), and one that imports each command's module, then runs
``--help`` and each command's ``--help`` through :func:`dsv4convert.cli.main`, writing a marker before each step,
so a heavy import is blamed on the first module or command that made it. The commands are the parser's own: a new
command is checked without being listed here.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from dsv4convert import __version__

ROOT = Path(__file__).resolve().parents[1]
HEAVY = frozenset({"torch", "numpy", "transformers", "triton", "safetensors", "matplotlib", "yaml", "jsonschema",
                   "huggingface_hub", "tqdm", "sglang", "vllm"})
MARK = "=== dsv4convert "

HELP_EVERY_COMMAND = f"""
import argparse, contextlib, importlib, io, sys
from dsv4convert.cli import COMMAND_MODULES, build_parser, main

for module in COMMAND_MODULES:
    print({MARK!r} + "import " + module, file=sys.stderr, flush=True)
    importlib.import_module(module)
sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
for argv in (["--help"], *([name, "--help"] for name in sub.choices)):
    print({MARK!r} + " ".join(argv), file=sys.stderr, flush=True)
    with contextlib.redirect_stdout(io.StringIO()) as out:
        try:
            main(argv)
        except SystemExit as exc:
            assert exc.code == 0, (argv, exc.code)
    assert out.getvalue().startswith("usage: dsv4convert"), argv
"""


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-X", "importtime", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)


def _heavy_by_step(stderr: str, first: str) -> dict[str, list[str]]:
    """The heavy top-level packages each step imported (importtime lines: ``import time: self | cumulative | name``),
    keyed by the marker before them (``first`` until the first marker)."""
    found: dict[str, list[str]] = {}
    step = first
    for line in stderr.splitlines():
        if line.startswith(MARK):
            step = line[len(MARK):]
        elif line.startswith("import time:") and "|" in line:
            name = line.rsplit("|", 1)[1].strip().split(".")[0]
            if name in HEAVY and name not in found.get(step, []):
                found.setdefault(step, []).append(name)
    return found


def test_version_loads_nothing_heavy():
    done = _run("-m", "dsv4convert", "--version")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == f"dsv4convert {__version__}"
    assert "import time:" in done.stderr   # -X importtime reported (else the check below would pass vacuously)
    heavy = _heavy_by_step(done.stderr, "--version")
    assert not heavy, f"loaded at start-up, by step: {heavy}"


def test_help_of_every_command_loads_nothing_heavy():
    done = _run("-c", HELP_EVERY_COMMAND)
    assert done.returncode == 0, done.stderr[-2000:]
    steps = [line[len(MARK):] for line in done.stderr.splitlines() if line.startswith(MARK)]
    assert {"--help", "serve --help", "fit --help", "to-nvfp4 --help", "demo --help"} <= set(steps), steps
    heavy = _heavy_by_step(done.stderr, "import dsv4convert.cli")
    assert not heavy, f"loaded at start-up, by the first step that did: {heavy}"
