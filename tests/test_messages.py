"""What the tool says in the user's terms (issue 54): a finished destination under --resume, a conversion interrupted
under its progress bar, misspelt recipe keys and commands, validate without a reference, DSpark's moved measures,
the glossary of --help and the shard size the help and the README state."""

from __future__ import annotations

import gc
import shutil
from pathlib import Path

import pytest

from dsv4convert.cli import GLOSSARY, main
from dsv4convert.convert import DEFAULT_MAX_SHARD_BYTES, execute
from dsv4convert.sizes import human_bytes

from conftest import SHARD

ROOT = Path(__file__).resolve().parents[1]


def _convert(src: Path, dst: Path, command: str, *extra: str) -> int:
    return main([command, "--src", str(src), "--dst", str(dst), "--max-shard-size", str(SHARD), *extra])


@pytest.fixture(scope="module")
def finished(tiny_ckpt, tmp_path_factory) -> Path:
    """A finished to-fp8 output of the tiny checkpoint; tests copy it before changing it."""
    dst = tmp_path_factory.mktemp("finished") / "fp8"
    assert _convert(tiny_ckpt, dst, "to-fp8", "--no-progress") == 0
    return dst


def test_resume_of_a_finished_output_says_it_is_complete_and_touches_nothing(finished, tiny_ckpt, tmp_path, capsys):
    dst = tmp_path / "fp8"
    shutil.copytree(finished, dst)
    before = {p.name: p.stat().st_mtime_ns for p in dst.iterdir() if p.is_file()}
    capsys.readouterr()
    assert _convert(tiny_ckpt, dst, "to-fp8", "--resume", "--no-progress") == 0
    out = capsys.readouterr().out
    assert f"{dst}: already complete (recipe 'fp8'" in out and "nothing to do" in out, out
    assert "/s of source" not in out
    assert {p.name: p.stat().st_mtime_ns for p in dst.iterdir() if p.is_file()} == before


def test_resume_into_a_finished_output_of_another_recipe_names_it(finished, tiny_ckpt, tmp_path, capsys):
    dst = tmp_path / "fp8"
    shutil.copytree(finished, dst)
    capsys.readouterr()
    assert _convert(tiny_ckpt, dst, "to-nvfp4", "--resume", "--no-progress") == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    assert "holds a finished conversion (recipe 'fp8')" in err and "(recipe 'nvfp4')" in err, err
    assert "interrupted" not in err and "--overwrite" in err and "another --dst" in err, err


def test_ctrl_c_closes_the_progress_bar_before_the_error_line(tiny_ckpt, tmp_path, capsys, monkeypatch):
    original, calls = execute.run_shard_job, []

    def interrupted_on_the_second_shard(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return original(*args, **kwargs)

    monkeypatch.setattr(execute, "run_shard_job", interrupted_on_the_second_shard)
    assert _convert(tiny_ckpt, tmp_path / "out", "to-fp8") == 2
    gc.collect()      # an unclosed bar is drawn again when it is collected: after the error line
    err = capsys.readouterr().err
    assert "convert:" in err, err                                   # the bar was drawn
    last = [line for line in err.replace("\r", "\n").splitlines() if line.strip()][-1]
    assert last.startswith("error: ") and "interrupted" in last and "--resume" in last, err
