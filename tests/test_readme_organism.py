"""The README's "No weights yet" block runs verbatim on a CPU (issue 54): each line through the tool's own entry
point, in an empty directory, exactly as a newcomer pastes it; nothing is added, as
``tests/test_readme_path.py`` must add to the five commands that need the release."""

from __future__ import annotations

import shlex

from dsv4convert.cli import main
from test_readme_path import README


def no_weights_yet() -> list[list[str]]:
    """The ``dsv4convert`` lines of the first code block after "No weights yet", comments cut off."""
    text = README.read_text(encoding="utf-8")
    block = text[text.index("No weights yet"):].split("```bash\n", 1)[1].split("```", 1)[0]
    lines = [line for line in block.splitlines() if line.strip() and not line.startswith("#")]
    assert all(line.startswith("dsv4convert ") for line in lines), lines
    return [shlex.split(line, comments=True)[1:] for line in lines]


def test_the_block_goes_from_synth_to_serve_on_the_organism_alone():
    commands = [argv[0] for argv in no_weights_yet()]
    assert commands == ["synth", "to-nvfp4", "validate", "compare", "fit", "serve"]
    assert all("organism" in " ".join(argv) for argv in no_weights_yet())


def test_the_no_weights_block_runs_as_written(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    said = {}
    for argv in no_weights_yet():
        assert main(argv) == 0, argv
        captured = capsys.readouterr()
        said[argv[0]] = captured.out + captured.err
    assert (tmp_path / "organism" / "heldout.txt").is_file() and (tmp_path / "organism-nvfp4" / "config.json").is_file()
    assert "bit-exact against the source" in said["validate"]
    assert "organism/heldout.txt" in said["compare"], said["compare"]     # the organism's own text, by default
    assert (tmp_path / "organism-nvfp4-compare" / "compare.json").is_file()
    assert "organism-nvfp4" in said["fit"] and "fits" in said["fit"], said["fit"]
    assert "sglang.launch_server" in said["serve"] and "organism-nvfp4" in said["serve"], said["serve"]
