"""`serve --check accuracy`: lm-evaluation-harness itself, for real, against the stand-in server.

The task is tests/data/lm_eval_tasks/dsv4_tiny_arith.yaml (five questions in questions.jsonl,
loaded by a local function, no download); the stand-in answers from canned_answers.json through
the OpenAI routes SGLang exposes. lm-eval loads the tokenizer from a directory holding the
synthetic checkpoints' tokenizer files, with the Hub switched off (HF_HUB_OFFLINE=1), so any
download attempt would fail the run. lm-eval starts slowly (it indexes its ~15,000 task YAMLs),
so only three lm-eval processes run in this module.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import pytest

from dsv4convert.cli import main
from dsv4convert.serve import accuracy, report
from dsv4convert.serve import checks as serve_checks
from dsv4convert.serve import cli as serve_cli
from dsv4convert.serve.accuracy import AccuracyError, EvalSettings
from dsv4convert.serve.launch import Command, LaunchError
from dsv4convert.serve.process import ProcessGroup, ServeError
from dsv4convert.synth import TOKENIZER_CONFIG, byte_level_tokenizer
from test_serve_process import STANDIN_SERVER, assert_nothing_left, free_port

pytest.importorskip("lm_eval", reason="lm-eval is part of the test environment (.ci/run installs .[test])")

TASKS = (Path(__file__).parent / "data" / "lm_eval_tasks").resolve()
TASK, SECOND_TASK = "dsv4_tiny_arith", "dsv4_tiny_arith_copy"
METRIC = "exact_match,answer-is"  # the task's first metric under its first filter
STARTUP_S = 60.0  # generous: a busy 2-core machine imports numpy and tokenizers slowly


def implied_score() -> float:
    """What the canned answers score on the questions, by the task's own rule ("The answer is N")."""
    questions = [json.loads(line) for line in (TASKS / "questions.jsonl").read_text().splitlines()]
    canned = json.loads((TASKS / "canned_answers.json").read_text())["answers"]
    right = 0
    for question in questions:
        reply = next(entry["reply"] for entry in canned if entry["match"] in question["question"])
        found = re.search(r"The answer is (-?[0-9]+)", reply)
        right += bool(found) and found.group(1) == question["answer"]
    return right / len(questions)


@pytest.fixture
def model_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A checkpoint directory as far as lm-eval sees it: the tokenizer files `synth` writes."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # nothing written to the user's cache
    directory = tmp_path / "model"
    directory.mkdir()
    (directory / "tokenizer.json").write_text(json.dumps(byte_level_tokenizer(512)))
    (directory / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG))
    return directory


def serve_args(model: Path, out: Path, *argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve_cli.add_parser(parser.add_subparsers())
    return parser.parse_args(["serve", "--model", str(model), "--out", str(out), "--check", "accuracy",
                              "--include-path", str(TASKS), "--eval-concurrency", "1", *argv])


def standin(port: int, *extra: str) -> Command:
    argv = (sys.executable, str(STANDIN_SERVER), "--port", str(port),
            "--canned-answers", str(TASKS / "canned_answers.json"), *extra)
    return Command("server", argv, {}, f"http://127.0.0.1:{port}", (port,))


def started_pids(lines: list[str], name: str) -> list[int]:
    return [int(m.group(1)) for line in lines if (m := re.match(rf"started {name} \(pid (\d+)\)", line))]


def test_server_dying_mid_evaluation_keeps_the_finished_task_and_leaves_nothing(tmp_path, model_dir):
    """Two tasks of five requests each; the stand-in crashes on the sixth request. The first task's
    score is what lm-eval wrote and what the canned answers imply; the report says incomplete."""
    port, child_file = free_port(), tmp_path / "child"
    args = serve_args(model_dir, tmp_path / "run", "--tasks", f"{TASK},{SECOND_TASK}")
    echoed: list[str] = []
    with pytest.raises(ServeError, match=rf"(?s)server exited with status 7 while lm-eval {SECOND_TASK} was running"
                                         r".*simulated crash while serving"):
        with ProcessGroup(tmp_path / "run" / "logs", stop_grace=2.0, echo=echoed.append) as group:
            server = group.start(standin(port, "--die-after-requests", "5", "--child-pid-file", str(child_file)))
            group.wait_healthy(server, STARTUP_S, poll=0.1)
            pgids = [server.popen.pid]
            serve_checks.run_accuracy(args, server.command.url, {"model": str(model_dir), "variant": "fp8"}, group, None)
    lm_eval_pgids = started_pids(echoed, f"lm-eval {TASK}") + started_pids(echoed, f"lm-eval {SECOND_TASK}")
    assert len(lm_eval_pgids) == 2
    assert_nothing_left(pgids + lm_eval_pgids, [port], [int(child_file.read_text())])

    saved = report.read_report(tmp_path / "run" / "accuracy.json")
    assert saved["complete"] is False and list(saved["tasks"]) == [TASK]
    assert saved["failed"]["task"] == SECOND_TASK and "exited with status 7" in saved["failed"]["error"]
    assert Path(saved["failed"]["log"]).is_file() and saved["not_run"] == []
    first = saved["tasks"][TASK]
    lm_eval_wrote = json.loads(Path(first["results_file"]).read_text())["results"][TASK][METRIC]
    assert first["metric"] == METRIC and first["score"] == lm_eval_wrote == implied_score() == 0.6
    assert first["n_samples"] == 5 and first["n_shot"] == 0 and first["stderr"] > 0
    assert saved["settings"]["api"] == "chat" and saved["settings"]["lm_eval_version"] == accuracy.LM_EVAL_VERSION
    samples = list(Path(first["results_file"]).parent.glob(f"samples_{TASK}_*.jsonl"))
    assert len(samples) == 1 and len(samples[0].read_text().splitlines()) == 5  # lm-eval's own per-question log
    assert not list((tmp_path / "run" / "lm-eval" / SECOND_TASK).glob("results_*.json"))


def test_completions_api_tokenizes_with_the_models_tokenizer_and_gates_recovery(tmp_path, model_dir, capsys):
    """/v1/completions with token ids from the checkpoint's own tokenizer (the stand-in decodes them
    with the same tokenizer.json); then recovery against a base that scored better fails the bar."""
    base_path = tmp_path / "base" / "accuracy.json"
    report.write_report(base_path, "accuracy", {"model": "base", "variant": "native"}, {
        "complete": True,
        "settings": {"tasks": [TASK], "api": "completions", "limit": None, "num_fewshot": None,
                     "extra_lm_eval_args": []},
        "tasks": {TASK: {"metric": METRIC, "score": 0.64, "higher_is_better": True, "metrics": {METRIC: 0.64}}},
    })
    port = free_port()
    args = serve_args(model_dir, tmp_path / "run", "--tasks", TASK, "--eval-api", "completions",
                      "--compare", str(base_path))
    serve_cli._check_flags(args)
    base = serve_checks.base_report(args)
    with ProcessGroup(tmp_path / "run" / "logs", stop_grace=2.0, echo=lambda line: None) as group:
        server = group.start(standin(port, "--tokenizer", str(model_dir)))
        group.wait_healthy(server, STARTUP_S, poll=0.1)
        passed = serve_checks.run_accuracy(args, server.command.url, {"model": str(model_dir), "variant": "nvfp4"},
                                        group, base)
        log = server.log_path.read_text()
    assert passed is False  # 0.6 / 0.64 = 93.75% < 95%
    out = capsys.readouterr().out
    assert re.search(rf"{TASK}\s+{METRIC}\s+0\.6400\s+0\.6000\s+93\.8%\s+FAIL", out), out
    assert f"FAIL: {TASK} kept 93.8% of the base's {METRIC} (0.6000 vs 0.6400), below --min-recovery 95.0%" in out
    assert log.count("POST /v1/completions") == 5 and "/v1/chat/completions" not in log

    saved = report.read_report(tmp_path / "run" / "accuracy.json")
    assert saved["complete"] is True and saved["failed"] is None
    lm_eval = json.loads(Path(saved["tasks"][TASK]["results_file"]).read_text())
    assert saved["tasks"][TASK]["score"] == lm_eval["results"][TASK][METRIC] == implied_score()
    assert lm_eval["config"]["model_args"]["tokenized_requests"] is True
    assert lm_eval["config"]["model_args"]["tokenizer"] == str(model_dir)
    assert lm_eval["tokenizer_eos_token"][0] == TOKENIZER_CONFIG["eos_token"]  # the local tokenizer was loaded

    # The same report against a base it keeps 96.8% of: passes the default bar, fails a stricter one.
    close = dict(base, tasks={TASK: dict(base["tasks"][TASK], score=0.62, metrics={METRIC: 0.62})})
    found = accuracy.recoveries(close, saved)
    assert found[0].recovery == pytest.approx(0.6 / 0.62)
    assert accuracy.failures(found, 0.95) == [] and len(accuracy.failures(found, 0.97)) == 1


def test_unknown_task_is_refused_before_anything_starts(tmp_path, model_dir, capsys):
    with pytest.raises(AccuracyError, match=r"unknown lm-eval task\(s\): gsm8kk \(did you mean gsm8k"):
        accuracy.check_tasks(EvalSettings(tasks=(TASK, "gsm8kk"), include_path=TASKS))
    accuracy.check_tasks(EvalSettings(tasks=(TASK, "gsm8k"), include_path=TASKS))  # the local task is found
    with pytest.raises(AccuracyError, match="--include-path is not a directory"):
        accuracy.check_tasks(EvalSettings(tasks=(TASK,), include_path=tmp_path / "missing"))
    code = main(["serve", "--model", str(model_dir), "--variant", "fp8", "--gpu-family", "sm90", "--gpus", "0",
                 "--out", str(tmp_path / "run"), "--check", "accuracy", "--tasks", "no_such_task",
                 "--include-path", str(TASKS)])  # the same task index as above (lm-eval's index is cached)
    assert code == 2 and "unknown lm-eval task(s): no_such_task" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # nothing started, nothing written


def _accuracy_report(path: Path, tasks: dict, **settings) -> Path:
    body = {"complete": True, "settings": {"api": "chat", "limit": None, "num_fewshot": None,
                                           "extra_lm_eval_args": [], **settings}, "tasks": tasks}
    report.write_report(path, "accuracy", {"model": "base"}, body)
    return path


def test_base_report_from_another_task_set_or_setting_is_refused(tmp_path, model_dir, capsys):
    entry = {"metric": "exact_match,strict-match", "score": 0.95, "higher_is_better": True,
             "metrics": {"exact_match,strict-match": 0.95}}
    other_tasks = _accuracy_report(tmp_path / "a.json", {"gsm8k": entry})
    settings = EvalSettings(tasks=("gsm8k", "mmlu_pro"))
    with pytest.raises(AccuracyError, match=r"a\.json: has no results for task\(s\) mmlu_pro \(it holds gsm8k\); "
                                            r"run the base with --tasks gsm8k,mmlu_pro"):
        accuracy.check_base(report.read_report(other_tasks), settings, other_tasks)
    fewshot = _accuracy_report(tmp_path / "b.json", {"gsm8k": entry}, num_fewshot=8)
    with pytest.raises(AccuracyError, match=r"b\.json: was measured differently \(num_fewshot: base 8, this run None\)"):
        accuracy.check_base(report.read_report(fewshot), EvalSettings(tasks=("gsm8k",)), fewshot)
    accuracy.check_base(report.read_report(other_tasks), EvalSettings(tasks=("gsm8k",)), other_tasks)

    recall_report = tmp_path / "recall.json"
    report.write_report(recall_report, "recall", {}, {"summary": {"accuracy": 1.0, "cells": []}})
    for base, message in ((other_tasks, "has no results for task(s) mmlu_pro"),
                          (recall_report, "is a recall report; --check accuracy compares with a accuracy.json")):
        code = main(["serve", "--model", str(model_dir), "--variant", "fp8", "--gpu-family", "sm90", "--gpus", "0",
                     "--out", str(tmp_path / "run"), "--check", "accuracy", "--tasks", "gsm8k,mmlu_pro",
                     "--include-path", str(TASKS), "--compare", str(base)])  # lm-eval's task index: cached
        assert code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


# A group's results as lm-eval 0.4.13 writes them (keys as in its results_*.json), by hand.
GROUP_RESULTS = {
    "results": {
        "mmlu_pro": {"alias": "mmlu_pro", "exact_match,custom-extract": 0.75, "exact_match_stderr,custom-extract": 0.01},
        "mmlu_pro_math": {"alias": " - math", "exact_match,custom-extract": 0.8,
                          "exact_match_stderr,custom-extract": 0.02, "sample_len": 10},
        "mmlu_pro_law": {"alias": " - law", "exact_match,custom-extract": 0.7,
                         "exact_match_stderr,custom-extract": 0.02, "sample_len": 10},
    },
    "groups": {"mmlu_pro": {"exact_match,custom-extract": 0.75}},
    "group_subtasks": {"mmlu_pro": ["mmlu_pro_math", "mmlu_pro_law"]},
    "configs": {t: {"metric_list": [{"metric": "exact_match", "higher_is_better": True}],
                    "filter_list": [{"name": "custom-extract", "filter": []}]} for t in ("mmlu_pro_math", "mmlu_pro_law")},
    "higher_is_better": {"mmlu_pro": {"exact_match": True}},
    "n-shot": {"mmlu_pro_math": 5, "mmlu_pro_law": 5},
    "n-samples": {"mmlu_pro_math": {"original": 100, "effective": 10}, "mmlu_pro_law": {"original": 90, "effective": 10}},
}


def test_group_results_and_lower_is_better_recovery(tmp_path):
    path = tmp_path / "results_2026.json"
    path.write_text(json.dumps(GROUP_RESULTS))
    score = accuracy.parse_results(path, "mmlu_pro")
    assert (score.metric, score.score, score.stderr, score.n_samples, score.n_shot) == (
        "exact_match,custom-extract", 0.75, 0.01, 20, 5)
    assert set(score.subtasks) == {"mmlu_pro_math", "mmlu_pro_law"}
    with pytest.raises(report.FormatError, match="no entry for task 'gsm8k'"):
        accuracy.parse_results(path, "gsm8k")
    perplexity = {"tasks": {"wikitext": {"metric": "word_perplexity,none", "score": 12.0, "higher_is_better": False,
                                         "metrics": {"word_perplexity,none": 12.0}}}}
    base = {"tasks": {"wikitext": {"metrics": {"word_perplexity,none": 10.0}}}}
    assert accuracy.recoveries(base, perplexity)[0].recovery == pytest.approx(10 / 12)
    zero = {"tasks": {"wikitext": {"metrics": {"word_perplexity,none": 0.0}}}}
    found = accuracy.recoveries(zero, {"tasks": {"wikitext": dict(perplexity["tasks"]["wikitext"], higher_is_better=True)}})
    assert found[0].recovery is None and "undefined share" in accuracy.failures(found, 0.95)[0]


def test_lm_eval_commands_and_flag_errors(tmp_path):
    chat = accuracy.lm_eval_argv(EvalSettings(tasks=("gsm8k",), limit=50, num_fewshot=5), "gsm8k",
                                 url="http://127.0.0.1:8000", model="/m", tokenizer="/m",
                                 output=tmp_path / "r.json", max_length=65536)
    assert chat[1:4] == ["-m", "lm_eval", "run"] and "--apply_chat_template" in chat
    model_args = dict(kv.split("=", 1) for kv in chat[chat.index("--model_args") + 1].split(","))
    assert model_args["base_url"] == "http://127.0.0.1:8000/v1/chat/completions"
    assert model_args["tokenized_requests"] == "False" and model_args["max_length"] == "65536"
    assert chat[chat.index("--limit") + 1] == "50" and chat[chat.index("--gen_kwargs") + 1] == accuracy.GREEDY
    raw = accuracy.lm_eval_argv(EvalSettings(api="completions"), "mmlu", url="http://h:1", model="/m",
                                tokenizer="/m", output=tmp_path / "r.json", max_length=None)
    assert "--apply_chat_template" not in raw and "tokenized_requests=True" in raw[raw.index("--model_args") + 1]
    with pytest.raises(AccuracyError, match="contains ',' or '='"):
        accuracy.lm_eval_argv(EvalSettings(), "gsm8k", url="http://h:1", model="/a,b", tokenizer="/a,b",
                              output=tmp_path / "r.json", max_length=None)
    for bad in ({"limit": 0}, {"limit": 1.5}, {"tasks": ()}, {"tasks": ("a", "a")}, {"api": "grpc"},
                {"concurrency": 0}, {"num_fewshot": -1}):
        with pytest.raises(AccuracyError):
            EvalSettings(**bad)
    parser = argparse.ArgumentParser()
    serve_cli.add_parser(parser.add_subparsers())
    for argv, message in ((["--tasks", "gsm8k"], "belong(s) to --check accuracy"),
                          (["--check", "accuracy", "--min-recovery", "0.9"], "needs --compare"),
                          (["--check", "accuracy", "--min-accept", "1.5"], "--min-accept belongs to --check mtp")):
        with pytest.raises(LaunchError, match=re.escape(message)):
            serve_cli._check_flags(parser.parse_args(["serve", "--model", "m", *argv]))


def test_failed_lm_eval_run_is_reported_with_its_log(tmp_path):
    """lm-eval itself failing (here: a fake client exiting 3) marks the task failed, with its log tail."""
    written: list[dict] = []

    def fake_client(name, argv, log_path, progress):
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_path.write_text("Traceback ...\nValueError: dataset not reachable\n")
        return 3

    settings = EvalSettings(tasks=("gsm8k", "mmlu_pro"))
    with pytest.raises(AccuracyError, match=r"(?s)lm-eval failed on gsm8k \(exit status 3\).*dataset not reachable"):
        accuracy.run_tasks(settings, url="http://h:1", model=tmp_path, out=tmp_path, run_client=fake_client,
                           write=lambda body: written.append(body) or tmp_path, echo=lambda line: None)
    assert written[-1]["complete"] is False and written[-1]["failed"]["task"] == "gsm8k"
    assert written[-1]["not_run"] == ["mmlu_pro"] and written[-1]["tasks"] == {}
