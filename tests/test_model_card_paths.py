"""The model card's launch commands name the checkpoint by its absolute path (issue 54): a relative one only
runs from the directory the converter ran in."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsv4convert.convert.model_card import default_launch, vllm_default_launch
from dsv4convert.organism.export import write_organism


def test_card_commands_name_the_checkpoint_by_its_absolute_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    write_organism(tmp_path / "organism", drafter="none")
    monkeypatch.chdir(tmp_path)
    for launch, flag in ((default_launch("organism", "native"), "--model-path"),
                         (vllm_default_launch("organism", "native"), "serve")):
        argvs = [spec["argv"] for spec in launch.values() if spec["argv"]]
        assert argvs
        for argv in argvs:
            assert argv[argv.index(flag) + 1] == str(tmp_path / "organism")
