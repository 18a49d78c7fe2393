"""compare on a DSpark drafter: known truths, each checked against what was done to the checkpoint.

On the organism that drafts (``synth --preset organism --drafter dspark``: the shipped organism with its trained
DSpark drafter): lossless conversions (fp8, nvfp4) keep every draft and the draft distributions exactly (KLD 0),
and each fault injected into one drafter component (dsv4convert/organism/faults.py) moves agreement, acceptance or
the confidence calibration beyond the noise floor and is named by that component. On a random drafter (``synth
--preset tiny --drafter dspark``, which drafts nothing worth accepting) the machinery: a conversion changes no
draft (tests/test_drafters.py), and a fault shows in its component's local error alone.

Weights-only numerics: the known truths are about the weights; the served numerics are compare's default and
run in tests/test_compare.py. Few tokens, one compare run per case (the CI machine has two cores).
"""

from __future__ import annotations

import json
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


def dspark_compare(base: Path, variant: Path, **kw) -> dict:
    """compare's DSpark section, weights only, on the base's held-out text (or random ids for synth's tiny)."""
    data = {"texts": [base / "heldout.txt"]} if (base / "heldout.txt").is_file() else {"random_tokens": True}
    opts = CompareOptions(base=str(base), variant=str(variant), tokens=kw.pop("tokens", 512),
                          seq_len=kw.pop("seq_len", 256), draft_anchors=kw.pop("draft_anchors", 256),
                          numerics="weights", progress=False, **data, **kw)
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


# -- the organism that drafts ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def organism(tmp_path_factory) -> Path:
    dst = tmp_path_factory.mktemp("dspark-organism") / "base"
    if main(["synth", "--preset", "organism", "--drafter", "dspark", "--dst", str(dst)]) != 0:
        pytest.skip("the organism that drafts (synth --preset organism --drafter dspark, branch issue-47-dspark) "
                    "is not shipped in this tree yet")
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


@pytest.mark.parametrize("name", FAULTS)
def test_each_drafter_fault_is_caught_and_named_by_its_component(organism, name, tmp_path):
    fault, component = FAULTS[name]
    section = dspark_compare(organism, inject(organism, tmp_path / name, fault))
    verdict, moved = section["verdict"], section["moved"]
    assert verdict["component"] == component, verdict["sentence"]
    calibration_only = all(m.startswith("confidence calibration") for m in moved)
    assert moved and calibration_only == (name == "confidence-flipped"), moved
    errors = local_errors(section)
    assert errors[component] > 0 and all(e == 0.0 for c, e in errors.items() if c != component), errors
    # every fault but the confidence head's moves the draft distribution beyond float rounding at every position
    drafts = [p["kld"] > p["kld_noise_floor"] for p in section["positions"]]
    assert drafts == [name != "confidence-flipped"] * len(drafts), section["positions"]


# -- a random drafter: the machinery --------------------------------------------------------------------------


def test_on_a_random_drafter_a_fault_shows_in_its_component_alone(tmp_path, capsys):
    """(A lossless conversion of a random drafter: tests/test_drafters.py.)"""
    base = tmp_path / "tiny"
    assert main(["synth", "--preset", "tiny", "--drafter", "dspark", "--dst", str(base)]) == 0
    wired = inject(base, tmp_path / "wired", Fault("target-layer", 0))
    report = tmp_path / "report"
    argv = ["compare", "--base", str(base), "--variant", str(wired), "--random-tokens", "--tokens", "64",
            "--seq-len", "64", "--numerics", "weights", "--report", str(report), "--no-progress"]
    assert main([*argv, "--dry-run"]) == 0
    plan = capsys.readouterr().out
    assert "DSpark drafter: 59 blocks of 5 drafts (anchored at every position)" in plan and "DSpark target layers differ" in plan
    assert main([*argv, "--no-mtp", "--dry-run"]) == 0 and "not compared (--no-mtp)" in capsys.readouterr().out
    assert main(argv) == 0
    section = json.loads((report / "compare.json").read_text())["dspark"]
    errors = local_errors(section)
    assert errors[TARGET_FEATURES] > 0 and all(e == 0.0 for c, e in errors.items() if c != TARGET_FEATURES)
    assert section["target_layer_ids"]["variant"][0] == 0 != section["target_layer_ids"]["base"][0]
    assert all(p["kld"] > 0 for p in section["positions"])
    assert "## DSpark draft" in (report / "compare.md").read_text()
