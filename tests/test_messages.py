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


@pytest.mark.parametrize("recipe, message", [
    ("name: x\nrules:\n  - match: {role: norm}\n    format: keep\n    reasn: tiny\n",
     "at rules[0]: unknown key 'reasn' (did you mean 'reason'?)"),
    ("name: x\nrules:\n  - match: {rol: norm, modul: x}\n    format: keep\n    reason: tiny\n",
     "at rules[0].match: unknown keys 'modul' (did you mean 'module'?), 'rol' (did you mean 'role'?)"),
    ("name: x\ncolour: red\nrules:\n  - match: {role: norm}\n    format: keep\n    reason: tiny\n",
     "unknown key 'colour' (known: description, engine, name, rules)"),
])
def test_a_misspelt_recipe_key_is_named_with_the_closest_known_one(tiny_ckpt, tmp_path, capsys, recipe, message):
    path = tmp_path / "recipe.yaml"
    path.write_text(recipe)
    code = main(["convert", "--recipe", str(path), "--src", str(tiny_ckpt), "--dst", str(tmp_path / "o"), "--dry-run"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and str(path) in err and message in err, err
    assert "required property" not in err


def test_a_mistyped_command_gets_one_error_line_with_the_closest_command(capsys):
    assert main(["vaildate", "some/dir"]) == 2
    captured = capsys.readouterr()
    assert captured.err.strip() == ("error: unknown command 'vaildate': did you mean 'validate'? "
                                    "(dsv4convert --help says what each does)") and captured.out == ""
    assert main(["frobnicate"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "'frobnicate'" in err and "did you mean" not in err and "validate, compare" in err


def test_help_explains_each_term_once_and_the_glossary_page_explains_it_too(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    glossary = (ROOT / "docs" / "glossary.md").read_text(encoding="utf-8")
    for term, text in GLOSSARY:
        assert out.count(f"{term}: ") == 1 and " ".join(text.split()) in out, term
        assert f"**{term}**" in glossary, term
    assert "(docs/glossary.md)" in (ROOT / "README.md").read_text(encoding="utf-8")


def test_the_shard_size_default_is_stated_as_the_code_has_it(capsys):
    with pytest.raises(SystemExit):
        main(["to-fp8", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    stated = f"default {DEFAULT_MAX_SHARD_BYTES / 1024**3:g} GiB = {human_bytes(DEFAULT_MAX_SHARD_BYTES)}"
    assert stated in help_text, help_text
    assert f"`--max-shard-size SIZE` ({stated}" in (ROOT / "README.md").read_text(encoding="utf-8")


def test_validate_without_a_reference_says_no_error_was_measured(finished, tmp_path, capsys):
    assert main(["validate", str(finished), "--report", str(tmp_path / "r"), "--no-progress"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert "per-layer error not measured: no reference given" in first and "--against SRC" in first, first
    assert "0/0" not in first and "bit-exact" not in first
    assert "per-layer error not measured" in (tmp_path / "r" / "validate.md").read_text()


def test_the_dspark_verdict_lists_each_measure_once_with_its_positions():
    from dsv4convert.compare.dspark import moved_in_words, name_component

    moved = [*(f"draft distribution at position {j}" for j in (1, 2, 3, 5)), "agreement at position 2",
             "expected accepted length"]
    assert moved_in_words(moved) == ("the draft's token distribution (KLD) at positions 1-3, 5, agreement with the "
                                     "target's greedy token at position 2 and the expected accepted length")
    verdict = name_component(moved, [{"component": "mtp.0", "local": {"relative_error": 0.5}}])
    assert verdict["component"] == "mtp.0" and "more moved" not in verdict["sentence"], verdict
    assert verdict["sentence"].startswith(moved_in_words(moved) + " moved beyond the noise floor")
