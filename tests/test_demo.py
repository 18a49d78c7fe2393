"""`dsv4convert demo`, run once for real through the CLI (about a minute on 2 cores): the organism's story, each
number checked against what is known about it."""

from __future__ import annotations

import math

from dsv4convert.demo import story as demo
from dsv4convert.cli import main

LENGTHS = [130, 253, 260, 520, 1040, 2080]   # half the 260-token threshold, fully covered, threshold, 2x-8x
COVERED = 253


def test_demo_tells_the_organisms_story_and_names_the_fault(tmp_path, capsys, monkeypatch):
    rows: list[dict] = []
    run_demo = demo.run_demo
    monkeypatch.setattr(demo, "run_demo", lambda workdir: rows.extend(run_demo(workdir)) or rows)
    assert main(["demo", "--workdir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    by = {r["variant"]: r for r in rows}
    assert list(by) == ["base", "fp8", "nvfp4", "w4a16", "fault"]
    base = by["base"]["recall"]
    assert list(base) == LENGTHS and all(v == 1.0 for v in base.values())
    for variant in demo.VARIANTS:
        r = by[variant]
        assert r["passed"] and all(r["recall"][n] >= base[n] for n in LENGTHS), (variant, r["recall"])
        assert r["same_top1"] > 0.9
    assert by["fp8"]["lossless"] == by["nvfp4"]["lossless"] == 1.0 and by["w4a16"]["lossless"] is None
    assert math.isinf(by["fp8"]["worst_snr_db"]) and 8 < by["w4a16"]["worst_snr_db"] < 40
    # Served on sm120 the base's and nvfp4's experts run W4A16 (Marlin): exactly the same model. fp8's run W8A8.
    assert by["nvfp4"]["kld"] == 0.0 and by["nvfp4"]["same_top1"] == 1.0
    assert by["fp8"]["kld"] > 0.0 and by["w4a16"]["kld"] > 0.0
    fault = by["fault"]
    assert (fault["diagnosis"]["kind"], fault["diagnosis"]["layer"]) == ("indexer", "layers.3")
    assert all(fault["recall"][n] == base[n] for n in LENGTHS if n <= COVERED)
    assert any(fault["recall"][n] < base[n] for n in LENGTHS if n > COVERED)
    assert fault["verdict"].startswith("fault: loses needles") and fault["verdict"].endswith(": the indexer")
    assert "layers.3's indexer" in fault["verdict"] and "fault: loses needles base finds from 520 on" in out
    assert "recall (%) by prompt length" in out and f"workdir {tmp_path}" in out and "docs/organism.md" in out


def test_demo_fails_when_a_check_fails_or_the_fault_is_not_named():
    fault = {"variant": "fault", "diagnosis": {"kind": "indexer", "layer": "layers.3"}}
    good = [{"variant": "fp8", "passed": True}, fault]
    assert demo.demo_passed(good)
    assert not demo.demo_passed([{"variant": "fp8", "passed": False}, fault])
    assert not demo.demo_passed([good[0], {**fault, "diagnosis": {"kind": "after_selection", "layer": None}}])
    assert not demo.demo_passed([good[0], {**fault, "diagnosis": {"kind": "indexer", "layer": "layers.1"}}])
