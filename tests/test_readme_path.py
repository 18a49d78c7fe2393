"""The README's five commands for our users' case (8x RTX PRO 6000, PD TP4+TP4) run end to end, as written, on the
shipped organism (issue 45): the release's name and the output directory replaced by local paths, ``my.txt`` by the
organism's held-out text, ``compare`` told to read 4K of its tokens (not the 64K the full model wants: CI's time),
and ``serve`` planned with ``--dry-run`` for the GPUs the README's case has (this machine has none). A renamed flag, a changed default or a command that no longer finishes fails here; the parse of every
other documented line is ``tests/test_documented_commands.py``'s.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from dsv4convert.cli import main
from dsv4convert.organism.export import write_organism

README = Path(__file__).resolve().parents[1] / "README.md"
RELEASE, OUTPUT = "deepseek-ai/DeepSeek-V4-Flash-0731", "/models/V4-Flash-0731-W4A16"
ADDED = {"serve": ["--dry-run", "--gpu-family", "sm120", "--prefill-gpus", "0,1,2,3", "--decode-gpus", "4,5,6,7"],
         "compare": ["--tokens", "4096", "--seq-len", "1024", "--no-progress"], "to-w4a16": ["--no-progress"]}


def users_case() -> list[list[str]]:
    """The ``dsv4convert`` lines of the first code block after "Our users' case", comments cut off."""
    text = README.read_text(encoding="utf-8")
    block = text[text.index("Our users' case"):].split("```bash\n", 1)[1].split("```", 1)[0]
    return [shlex.split(line, comments=True)[1:] for line in block.splitlines() if line.startswith("dsv4convert ")]


def test_the_readme_lists_five_commands_that_start_with_fit_and_end_with_serve():
    commands = [argv[0] for argv in users_case()]
    assert commands == ["fit", "to-w4a16", "validate", "compare", "serve"]


@pytest.fixture(scope="module")
def organism(tmp_path_factory) -> Path:
    return write_organism(tmp_path_factory.mktemp("readme") / "organism")


def test_the_users_case_runs_as_written_on_the_organism(organism, tmp_path, capsys):
    output = tmp_path / "w4a16"
    local = {RELEASE: str(organism), OUTPUT: str(output), "my.txt": str(organism / "heldout.txt")}
    for argv in users_case():
        argv = [local.get(arg, arg) for arg in argv] + ADDED.get(argv[0], [])
        assert main(argv) == 0, argv
        out = capsys.readouterr().out
        if argv[0] == "fit":
            assert "rtx-pro-6000" in out.lower() or "RTX PRO 6000" in out
        if argv[0] == "serve":
            assert "--disaggregation-mode prefill" in out and "--disaggregation-mode decode" in out
    assert (output / "config.json").is_file()
    assert (tmp_path / "w4a16-compare" / "compare.json").is_file()
