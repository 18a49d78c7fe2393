"""`serve --check mtp` against a stand-in that reports acceptance in SGLang 0.5.23's own format.

The stand-in is started with the very arguments `serve` planned for the server (it reads
``--port`` and ``--speculative-num-draft-tokens`` from them) and fills ``meta_info`` and
``/server_info`` as SGLang does (see tests/standins/standin_sglang_server.py). The expected
accepted lengths are worked out here from SGLang's definition (completion tokens / verify
steps), independently of the stand-in's code.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import pytest
from test_serve_process import STANDIN_SERVER, assert_nothing_left, free_port

from dsv4convert.engines.sglang.server import server as sglang_server
from dsv4convert.errors import FormatError
from dsv4convert.serve import checks as serve_checks
from dsv4convert.serve import cli as serve_cli
from dsv4convert.serve import mtp, report
from dsv4convert.serve.defaults import DEFAULT_MIN_ACCEPT
from dsv4convert.serve.launch import Command, LaunchError
from dsv4convert.serve.process import ProcessGroup
from dsv4convert.synth import TOKENIZER_CONFIG

STARTUP_S = 60.0  # generous: a busy 2-core machine imports numpy slowly


def serve_args(model: Path, out: Path, port: int, *argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve_cli.add_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", "--model", str(model), "--variant", "fp8", "--gpu-family", "sm90",
                              "--gpus", "0", "--port", str(port), "--out", str(out), "--check", "mtp", *argv])
    serve_cli._check_flags(args)
    return args


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "model"
    directory.mkdir()
    (directory / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG))
    return directory


def run_check(tmp_path: Path, model: Path, name: str, accept_rate: float | None, *argv: str) -> tuple[bool, dict]:
    """Plan `serve --check mtp`, start the stand-in with the planned server arguments, run the check."""
    return run_check_expected(tmp_path, model, name, accept_rate, None, *argv)


def run_check_expected(tmp_path: Path, model: Path, name: str, accept_rate: float | None, expected: dict | None,
                       *argv: str) -> tuple[bool, dict]:
    """:func:`run_check` with compare's expected figures (``serve_checks.expected_report``'s)."""
    port = free_port()
    args = serve_args(model, tmp_path / name, port, *argv)
    (server,) = serve_cli.plan(args, None, serve_cli._inspect(args)[1])[0]   # the draft config.json announces
    speculative = ("--spec-accept-rate", str(accept_rate)) if accept_rate is not None else ()
    sglang_args = server.sglang_args if accept_rate is not None else tuple(
        a for a in server.sglang_args if a not in ("EAGLE", "--speculative-algorithm"))  # a server without MTP
    standin = Command("server", (sys.executable, str(STANDIN_SERVER), *sglang_args, *speculative), {}, server.url, (port,))
    with ProcessGroup(tmp_path / name / "logs", stop_grace=2.0, echo=lambda line: None) as group:
        running = group.start(standin)
        group.wait_healthy(running, STARTUP_S, poll=0.1)
        pgid = running.popen.pid
        passed = serve_checks.run_mtp(args, server.url, {"model": name, "variant": "fp8"}, [server], _base(args),
                                      expected)
    assert_nothing_left([pgid], [port])
    return passed, report.read_report(tmp_path / name / "mtp.json")


def _base(args: argparse.Namespace):
    return serve_checks.base_report(args)


def sglang_accept_length(tokens: int, accept_rate: float, draft_tokens: int) -> float:
    """Accepted length per verify step when each step accepts ``accept_rate`` of its drafts, plus the bonus token."""
    steps = math.ceil(tokens / (1 + accept_rate * (draft_tokens - 1)))
    return tokens / steps


def test_working_draft_passes_and_a_broken_one_fails_side_by_side(tmp_path, model_dir, capsys):
    passed, base = run_check(tmp_path, model_dir, "base", 0.9)
    expected = sglang_accept_length(mtp.MAX_NEW_TOKENS, 0.9, 2)  # 256 tokens in 135 steps: 1.896
    assert passed is True and base["draft_tokens"] == 2 and base["min_accept"] == DEFAULT_MIN_ACCEPT
    assert base["summary"]["accept_length"] == pytest.approx(expected) and expected > DEFAULT_MIN_ACCEPT
    assert base["summary"]["server_avg_spec_accept_length"] == [pytest.approx(expected)]
    assert base["summary"]["prompts"] == base["summary"]["prompts_with_spec_stats"] == len(mtp.PROMPTS)
    assert all(s["output"] and s["spec_verify_ct"] for s in base["samples"])
    out = capsys.readouterr().out
    assert f"mtp: mean accepted length {expected:.2f} per verify step (at most 2: 2 tokens verified per step)" \
           in out and "FAIL" not in out

    passed, broken = run_check(tmp_path, model_dir, "broken", 0.0, "--compare", str(tmp_path / "base" / "mtp.json"))
    assert passed is False and broken["summary"]["accept_length"] == 1.0 and broken["summary"]["accept_rate"] == 0.0
    out = capsys.readouterr().out
    proposed = mtp.MAX_NEW_TOKENS * len(mtp.PROMPTS)
    assert (f"FAIL: mean accepted length 1.00 < --min-accept 1.60: 0 of {proposed} draft tokens accepted (0%) -- "
            "the draft is broken") in out
    table = next(line for line in out.splitlines() if line.startswith("accepted length (all prompts)"))
    assert table.split()[-3:] == [f"{expected:.3f}", "1.000", f"{1.0 - expected:+.3f}"]


def test_floor_is_the_users_and_a_server_without_the_draft_fails_clearly(tmp_path, model_dir, capsys):
    passed, summary = run_check(tmp_path, model_dir, "strict", 0.5, "--min-accept", "1.7")
    assert passed is False and summary["summary"]["accept_length"] == pytest.approx(sglang_accept_length(256, 0.5, 2))
    assert "< --min-accept 1.70" in capsys.readouterr().out
    passed, summary = run_check(tmp_path, model_dir, "nodraft", None)
    assert passed is False and summary["summary"]["accept_length"] is None
    assert "FAIL: SGLang reported no speculative decoding for any prompt" in capsys.readouterr().out


def test_response_parsing_and_bad_input(tmp_path, model_dir):
    prompt = mtp.PROMPTS[0]
    payload = mtp.request(prompt, mtp.bos_text(model_dir))
    assert payload["text"].startswith("<｜begin▁of▁sentence｜>Count from 1") and payload["sampling_params"]["temperature"] == 0
    sample = mtp.parse_response(prompt, {"text": " 9, 10, 11, 12, 13", "meta_info": {
        "completion_tokens": 30, "spec_verify_ct": 20, "spec_num_correct_drafts": 10, "spec_num_proposed_drafts": 20}})
    assert sample.accept_length == 1.5 and sample.as_expected
    with pytest.raises(FormatError, match="no completion_tokens"):
        mtp.parse_response(prompt, {"text": "x", "meta_info": {}})
    with pytest.raises(FormatError, match="without text and meta_info"):
        mtp.parse_response(prompt, {"error": "overloaded"})
    assert mtp.server_accept_lengths({"internal_states": [{"avg_spec_accept_length": 1.8}, {}, "x"]}) == [1.8]
    assert mtp.server_accept_lengths({}) == []
    plain = sglang_server("MODEL", "fp8", "sm90", tp=4)
    user = plain.with_arguments(["--speculative-num-draft-tokens", "2", "--speculative-num-draft-tokens=4"])
    assert user.draft_tokens == 4 and user.mtp and plain.draft_tokens is None
    with pytest.raises(LaunchError, match="must be >= 1.0"):
        serve_args(model_dir, tmp_path, 1, "--min-accept", "0.5")
    recall_report = tmp_path / "recall.json"
    report.write_report(recall_report, "recall", {}, {"summary": {"accuracy": 1.0, "cells": []}})
    with pytest.raises(FormatError, match=r"recall\.json: is a recall report; --check mtp compares with a mtp\.json"):
        serve_checks.base_report(serve_args(model_dir, tmp_path, 1, "--compare", str(recall_report)))


def test_dspark_acceptance_per_draft_position(tmp_path, model_dir, capsys):
    """A DSpark checkpoint is checked under DSPARK: gamma + 1 tokens verified per step, and SGLang's per-step
    histogram of accepted drafts read as the acceptance of each draft position (a prefix is accepted)."""
    from dsv4convert.models.deepseek_v4.configs import with_dspark, with_num_layers
    from dsv4convert.synth import preset_config

    tiny = preset_config("tiny")
    config = with_dspark(with_num_layers(tiny, tiny["num_hidden_layers"], mtp=False), block_size=5)
    (model_dir / "config.json").write_text(json.dumps(config))
    passed, found = run_check(tmp_path, model_dir, "dspark", 0.5)
    assert found["draft_tokens"] == 6
    expected = sglang_accept_length(mtp.MAX_NEW_TOKENS, 0.5, 6)
    summary = found["summary"]
    assert passed is True and summary["accept_length"] == pytest.approx(expected)
    histogram = summary["correct_drafts_histogram"]
    steps = sum(s["spec_verify_ct"] for s in found["samples"])
    assert sum(histogram) == steps and sum(k * n for k, n in enumerate(histogram)) == summary["correct_drafts"]
    reached = [row["reached"] for row in summary["per_position"]]
    assert reached == [pytest.approx(sum(histogram[j:]) / steps) for j in range(1, len(histogram))]
    assert reached == sorted(reached, reverse=True) and reached[0] > 0
    assert "mtp: accepted per draft position: 1: " in capsys.readouterr().out


def test_position_acceptance_reads_a_prefix_histogram():
    # 10 steps: 4 accepted nothing, 3 one draft, 2 two, 1 three.
    rows = mtp.position_acceptance([4, 3, 2, 1])
    assert [row["reached"] for row in rows] == [0.6, 0.3, 0.1]
    assert [row["conditional"] for row in rows] == [0.6, 0.5, pytest.approx(1 / 3)]
    assert mtp.position_acceptance([]) == []
    with pytest.raises(FormatError, match="spec_correct_drafts_histogram for 'counting' is not a list of counts"):
        mtp.parse_response(mtp.PROMPTS[0], {"text": "x", "meta_info": {"completion_tokens": 3,
                                                                       "spec_correct_drafts_histogram": [1, -2]}})


def dspark_model(model_dir: Path) -> Path:
    from dsv4convert.models.deepseek_v4.configs import with_dspark, with_num_layers
    from dsv4convert.synth import preset_config

    tiny = preset_config("tiny")
    config = with_dspark(with_num_layers(tiny, tiny["num_hidden_layers"], mtp=False), block_size=5)
    (model_dir / "config.json").write_text(json.dumps(config))
    return model_dir


def write_compare_report(directory: Path, accept_length: float, accepted: list[float]) -> Path:
    """A compare.json as `compare` writes its DSpark section (only the keys the check reads)."""
    directory.mkdir(parents=True, exist_ok=True)
    positions = [{"position": j + 1, "accepted": {"base": 1.0, "variant": value}} for j, value in enumerate(accepted)]
    (directory / "compare.json").write_text(json.dumps({
        "variant": {"path": "model"}, "data": {"source": ["heldout.txt"]},
        "dspark": {"expected_accept_length": {"base": 6.0, "variant": accept_length}, "positions": positions}}))
    return directory


def test_dspark_acceptance_against_compares_expectation(tmp_path, model_dir, capsys):
    """With compare's report of the variant at its default place (MODEL-compare/compare.json), the check sets the
    server's accepted length and per-position acceptance beside compare's and says which is lower, by how much."""
    dspark_model(model_dir)
    expected = [0.95, 0.9, 0.85, 0.8, 0.75]
    write_compare_report(model_dir.parent / "model-compare", 5.25, expected)
    args = serve_args(model_dir, tmp_path / "x", 1)
    assert serve_checks.expected_report(args)["accept_length"] == 5.25
    _, found = run_check_expected(tmp_path, model_dir, "dspark", 0.5, serve_checks.expected_report(args))
    summary, rows = found["summary"], found["expected"]["rows"]
    assert rows[0] == {"what": "accepted length", "server": pytest.approx(summary["accept_length"]),
                       "expected": 5.25, "lower": "server", "by": pytest.approx(5.25 - summary["accept_length"])}
    reached = [row["reached"] for row in summary["per_position"]]
    reached += [0.0] * (len(expected) - len(reached))     # past the histogram's end: never accepted
    assert [r["server"] for r in rows[1:]] == pytest.approx(reached)
    assert [r["lower"] for r in rows[1:]] == ["server" if m < e else "compare" for m, e in zip(reached, expected)]
    out = capsys.readouterr().out
    assert (f"mtp: accepted length: server {summary['accept_length']:.3f}, compare expects 5.250: the server is lower "
            f"by {5.25 - summary['accept_length']:.3f}") in out
    # A measured figure above compare's is said the other way round.
    low = {"report": "r", "text": "t", "accept_length": 1.0, "per_position": [0.0] * 5}
    lines, _ = mtp.against_expected(summary, low)
    assert f"compare's expectation is lower by {summary['accept_length'] - 1.0:.3f}" in lines[0]


def test_expected_from_must_hold_a_dspark_section(tmp_path, model_dir):
    dspark_model(model_dir)
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "compare.json").write_text(json.dumps({"dspark": None, "mtp_draft_agreement": {}}))
    with pytest.raises(FormatError, match="has no DSpark section"):
        serve_checks.expected_report(serve_args(model_dir, tmp_path / "x", 1, "--expected-from", str(plain)))
    assert serve_checks.expected_report(serve_args(model_dir, tmp_path / "x", 1)) is None   # no default report
    with pytest.raises(LaunchError, match="--expected-from belongs to --check mtp"):
        serve_args(model_dir, tmp_path, 1, "--check", "recall", "--expected-from", str(plain))
