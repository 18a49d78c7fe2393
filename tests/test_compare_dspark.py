"""compare on a DSpark drafter: known truths on the organism that drafts, each checked against what was done to it.

The organism that drafts (``synth --preset organism --drafter dspark``: the shipped organism with its trained DSpark
drafter, 0731's layout): lossless conversions (fp8, nvfp4) keep every draft and every draft distribution (KLD 0,
every component's local error 0); each fault injected into one drafter component (dsv4convert/organism/faults.py)
moves the draft distribution beyond float rounding at every draft position (the confidence head's fault: the
confidence calibration beyond its noise floor instead), is named by that component, and shows in that component's
local error alone. The Markov head's loss and stage 1's experts x4 also cost acceptance beyond its noise floor (1.3
and 0.18 of 3.5 accepted tokens per step: the second on 2,048 tokens, the rest on 128); the wrong target layer
costs none measurable (bench/results/compare-dspark-organism-cpu.md).

Weights-only numerics: the known truths are about the weights; the served numerics are compare's default and
run in tests/test_compare.py. One compare run per case (the CI machine has two cores).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from dsv4convert.cli import main
from dsv4convert.compare.dspark import CONFIDENCE_HEAD, MARKOV_HEAD, TARGET_FEATURES
from dsv4convert.compare.run import CompareOptions, build_plan, run
from dsv4convert.organism.faults import Fault, inject

FAULTS = {"draft-experts": (Fault("draft-experts", 1), "mtp.1"),
          "markov-zeroed": (Fault("markov-zeroed"), MARKOV_HEAD),
          "confidence-flipped": (Fault("confidence-flipped"), CONFIDENCE_HEAD),
          "target-layer": (Fault("target-layer", 0), TARGET_FEATURES)}


def dspark_compare(base: Path, variant: Path, tokens: int = 128) -> dict:
    """compare's DSpark section, weights only, on ``tokens`` of the base's held-out text in sequences of 128 (123
    draft blocks each)."""
    opts = CompareOptions(base=str(base), variant=str(variant), texts=[base / "heldout.txt"], tokens=tokens,
                          seq_len=128, numerics="weights", progress=False)
    return run(build_plan(opts))["dspark"]


def local_errors(section: dict) -> dict[str, float]:
    return {c["component"]: c["local"]["relative_error"] for c in section["components"]}


def assert_drafts_identical(section: dict) -> None:
    for p in section["positions"]:
        assert p["kld"] == 0.0 and p["agreement"]["base"] == p["agreement"]["variant"], p
        assert p["accepted"]["delta"] == 0.0 and p["confidence"]["brier_delta"] == 0.0, p
    length = section["expected_accept_length"]
    assert length["base"] == length["variant"] and section["verdict"]["component"] is None
    assert set(local_errors(section).values()) == {0.0}


@pytest.fixture(scope="module")
def organism(tmp_path_factory) -> Path:
    dst = tmp_path_factory.mktemp("dspark-organism") / "base"
    assert main(["synth", "--preset", "organism", "--drafter", "dspark", "--dst", str(dst)]) == 0
    return dst


@pytest.mark.parametrize("recipe", ["fp8", "nvfp4"])
def test_lossless_conversions_keep_every_draft(organism, recipe, tmp_path):
    dst = tmp_path / recipe
    assert main([f"to-{recipe}", "--src", str(organism), "--dst", str(dst), "--no-progress"]) == 0
    section = dspark_compare(organism, dst)
    assert_drafts_identical(section)
    # the organism drafts: its first draft agrees with the target most of the time, and a block earns more than
    # the bonus token alone
    assert section["positions"][0]["agreement"]["base"] > 0.5
    assert section["expected_accept_length"]["base"] > 1.5


@pytest.mark.parametrize("name", [name for name in FAULTS if name != "target-layer"])   # that one: below
def test_each_drafter_fault_is_caught_and_named_by_its_component(organism, name, tmp_path):
    fault, component = FAULTS[name]
    # the experts' cost in acceptance (0.18 of 3.5 tokens a step) needs ~2,000 blocks to stand above the noise floor
    tokens = 2048 if name == "draft-experts" else 128
    section = dspark_compare(organism, inject(organism, tmp_path / name, fault), tokens)
    verdict, moved = section["verdict"], section["moved"]
    assert verdict["component"] == component, verdict["sentence"]
    calibration_only = all(m.startswith("confidence calibration") for m in moved)
    assert moved and calibration_only == (name == "confidence-flipped"), moved
    errors = local_errors(section)
    assert errors[component] > 0 and all(e == 0.0 for c, e in errors.items() if c != component), errors
    # every fault but the confidence head's moves the draft distribution beyond float rounding at every position
    drafts = [p["kld"] > p["kld_noise_floor"] for p in section["positions"]]
    assert drafts == [name != "confidence-flipped"] * len(drafts), section["positions"]
    length = section["expected_accept_length"]
    if name in ("markov-zeroed", "draft-experts"):
        assert length["variant"] < length["base"] - length["noise_floor"], length
        assert "expected accepted length" in moved


def test_a_rewired_drafter_in_the_plan_and_the_report(organism, tmp_path, capsys):
    """The target-layer fault through the command line: the plan states the DSpark pass and that the sides read
    different layers, --no-mtp leaves it out, the report names the target features."""
    wired = inject(organism, tmp_path / "wired", FAULTS["target-layer"][0])
    report = tmp_path / "report"
    argv = ["compare", "--base", str(organism), "--variant", str(wired), "--tokens", "128", "--seq-len", "128",
            "--numerics", "weights", "--report", str(report), "--no-progress"]
    assert main([*argv, "--dry-run"]) == 0
    plan = capsys.readouterr().out
    assert "DSpark drafter: 123 blocks of 5 drafts (anchored at every position)" in plan
    assert "DSpark target layers differ" in plan
    assert main([*argv, "--no-mtp", "--dry-run"]) == 0 and "not compared (--no-mtp)" in capsys.readouterr().out
    assert main([a for a in argv if a != "--no-progress"]) == 0
    captured = capsys.readouterr()
    assert "DSpark: the draft's token distribution (KLD) at position" in captured.out
    # the expected time comes first (#54); every phase after the last block has a bar of its own
    err = captured.err.replace("\r", "\n").splitlines()
    first_bar = next(i for i, line in enumerate(err) if re.match(r"compare: +\d+%\|", line))
    assert expected_seconds(err[:first_bar], "compare") > 0
    last_block = max(i for i, line in enumerate(err) if re.match(r"compare: +100%\|.* 4/4 \[", line))
    for phase in ("compare: output heads", "compare: DSpark drafter"):
        moved = [line for line in err[last_block:] if line.startswith(phase)]
        assert moved and "100%" in moved[-1], phase
    hint = captured.out.strip().splitlines()[-1]
    assert hint.startswith("next: ") and "--recall (long-context recall: expected ~" in hint
    section = json.loads((report / "compare.json").read_text())["dspark"]
    assert section["verdict"]["component"] == TARGET_FEATURES
    assert section["target_layer_ids"]["variant"][0] == 0 != section["target_layer_ids"]["base"][0]
    errors = local_errors(section)
    assert errors[TARGET_FEATURES] > 0 and all(e == 0.0 for c, e in errors.items() if c != TARGET_FEATURES)
    markdown = (report / "compare.md").read_text()
    assert "## DSpark draft" in markdown and section["verdict"]["sentence"] in markdown


def expected_seconds(lines: list[str], command: str) -> float:
    """The seconds an expected-time line says (it must be there, and once); finite."""
    said = [m for line in lines if (m := re.match(rf"{command}: expected ~([0-9.]+) (s|min|h) on this device "
                                                  r"\((cpu, \d+ threads|cuda[^)]*)\) for .+: ([0-9.e+]+) GFLOP", line))]
    assert len(said) == 1, lines
    seconds = float(said[0][1]) * {"s": 1, "min": 60, "h": 3600}[said[0][2]]
    assert math.isfinite(seconds) and float(said[0][4]) > 0
    return seconds
