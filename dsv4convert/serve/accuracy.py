"""Task accuracy through lm-evaluation-harness against the served model, and recovery against a base.

lm-eval does the evaluation (``python -m lm_eval run``, its own tasks, prompts, filters and
metrics); this module only decides how it talks to the server and reads what it wrote:

* ``chat`` (default): ``local-chat-completions`` on ``/v1/chat/completions`` with
  ``--apply_chat_template``: lm-eval sends messages and SGLang renders them with the model's own
  chat format (for DeepSeek-V4, SGLang's DeepSeek-V4 encoder, thinking off by default), the way
  users prompt the model.
* ``completions``: ``local-completions`` on ``/v1/completions``: lm-eval tokenizes the raw prompt
  with the model's own tokenizer (the checkpoint directory, never a download) and sends token
  ids; needed for log-likelihood tasks (``mmlu``, ``hellaswag``), which chat endpoints cannot score.

Both load the tokenizer from the checkpoint directory, decode greedily (``temperature=0``), and
run one lm-eval process per task, so a server that dies mid-way loses only the task in flight:
``accuracy.json`` is rewritten after every task and says ``"complete": false`` until the last.
"""

from __future__ import annotations

import difflib
import functools
import json
import math
import re
import shlex
import shutil
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsv4convert.errors import DSV4Error, FormatError
from dsv4convert.serve.defaults import DEFAULT_CONCURRENCY, DEFAULT_TASKS, EVAL_APIS
from dsv4convert.serve.process import log_tail

LM_EVAL_VERSION = "0.4.13"  # the version pinned by the [eval] extra
GREEDY = "temperature=0,do_sample=False"
REQUEST_TIMEOUT_S = 1800
_PROGRESS = re.compile(rb"Requesting API:\s+(\d+)%\|[^|\r\n]*\|\s*(\d+)/(\d+)")


class AccuracyError(DSV4Error):
    """The accuracy check cannot run as asked: lm-eval missing, unknown task, incomparable base report."""


@dataclass(frozen=True)
class EvalSettings:
    """What lm-eval runs; two reports are comparable only when these agree (version aside)."""

    tasks: tuple[str, ...] = DEFAULT_TASKS
    api: str = "chat"
    limit: float | None = None  # per task: a count, or a fraction below 1
    num_fewshot: int | None = None  # None: each task's own default
    concurrency: int = DEFAULT_CONCURRENCY
    include_path: Path | None = None
    extra_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.api not in EVAL_APIS:
            raise AccuracyError(f"unknown evaluation API {self.api!r}; expected one of {', '.join(EVAL_APIS)}")
        if not self.tasks or len(set(self.tasks)) != len(self.tasks):
            raise AccuracyError(f"expected distinct task names, got {','.join(self.tasks) or 'none'}")
        if self.limit is not None and not (self.limit > 0 and (self.limit < 1 or float(self.limit).is_integer())):
            raise AccuracyError(f"--limit must be a positive count or a fraction below 1, got {self.limit}")
        if self.num_fewshot is not None and self.num_fewshot < 0:
            raise AccuracyError(f"--num-fewshot must be >= 0, got {self.num_fewshot}")
        if self.concurrency < 1:
            raise AccuracyError(f"--eval-concurrency must be >= 1, got {self.concurrency}")

    @property
    def lm_eval_model(self) -> str:
        return EVAL_APIS[self.api][0]

    def comparable(self) -> dict[str, Any]:
        """The settings that change what a score means."""
        return {"api": self.api, "limit": self.limit, "num_fewshot": self.num_fewshot,
                "extra_lm_eval_args": list(self.extra_args)}

    def to_json(self) -> dict[str, Any]:
        return {"tasks": list(self.tasks), **self.comparable(), "lm_eval_model": self.lm_eval_model,
                "gen_kwargs": GREEDY, "concurrency": self.concurrency,
                "include_path": str(self.include_path) if self.include_path else None}


def lm_eval_version() -> str:
    """The installed lm-eval's version, or a clear error saying how to install it."""
    try:
        from importlib.metadata import PackageNotFoundError, version

        return version("lm_eval")
    except PackageNotFoundError:
        raise AccuracyError(
            "--check accuracy runs lm-evaluation-harness, which is not installed: "
            "pip install 'dsv4convert[eval]' (lm-eval[api]==" + LM_EVAL_VERSION + ")") from None


@functools.lru_cache(maxsize=4)
def _known_tasks(include_path: str | None) -> frozenset[str]:
    from lm_eval.tasks import TaskManager  # indexes every task YAML: seconds

    return frozenset(TaskManager(include_path=include_path).all_tasks)


def check_tasks(settings: EvalSettings) -> None:
    """Refuse task names lm-eval does not know, before any server starts (loading takes minutes)."""
    lm_eval_version()
    if settings.include_path is not None and not settings.include_path.is_dir():
        raise AccuracyError("--include-path is not a directory", file=settings.include_path)
    known = _known_tasks(str(settings.include_path) if settings.include_path else None)
    unknown = [task for task in settings.tasks if task not in known]
    if unknown:
        hints = []
        for task in unknown:
            close = difflib.get_close_matches(task, known, n=3)
            hints.append(f"{task} (did you mean {', '.join(close)}?)" if close else task)
        raise AccuracyError(
            f"unknown lm-eval task(s): {'; '.join(hints)}. `python -m lm_eval ls tasks` lists them; "
            "--include-path DIR adds your own task YAMLs")


def lm_eval_argv(settings: EvalSettings, task: str, *, url: str, model: str, tokenizer: str, output: Path,
                 max_length: int | None) -> list[str]:
    """The ``python -m lm_eval run`` command for one task against the server at ``url``."""
    for name, value in (("model", model), ("tokenizer", tokenizer), ("server URL", url)):
        if "," in value or "=" in value:
            raise AccuracyError(f"the {name} {value!r} contains ',' or '=', which lm-eval's --model_args cannot carry")
    model_args = {
        "base_url": url + EVAL_APIS[settings.api][1],
        "model": model,  # SGLang's default served model name is its --model-path
        "tokenizer": tokenizer,
        "tokenizer_backend": "huggingface",
        "tokenized_requests": settings.api == "completions",
        "num_concurrent": settings.concurrency,
        "max_retries": 3,
        "timeout": REQUEST_TIMEOUT_S,
    }
    if max_length:
        model_args["max_length"] = max_length  # lm-eval's default (2048) would truncate long few-shot prompts
    argv = [sys.executable, "-m", "lm_eval", "run",
            "--model", settings.lm_eval_model,
            "--model_args", ",".join(f"{k}={v}" for k, v in model_args.items()),
            "--tasks", task,
            "--gen_kwargs", GREEDY,
            "--output_path", str(output),
            "--log_samples"]
    if settings.api == "chat":
        argv.append("--apply_chat_template")
    if settings.limit is not None:
        argv += ["--limit", f"{settings.limit:g}"]
    if settings.num_fewshot is not None:
        argv += ["--num_fewshot", str(settings.num_fewshot)]
    if settings.include_path is not None:
        argv += ["--include_path", str(settings.include_path)]
    return argv + list(settings.extra_args)


@dataclass
class TaskScore:
    """One task's result as lm-eval wrote it, with the metric that stands for the task."""

    task: str
    metric: str  # lm-eval's "metric,filter" key, e.g. "exact_match,strict-match"
    score: float
    stderr: float | None
    higher_is_better: bool
    metrics: dict[str, float]
    n_samples: int | None
    n_shot: int | None
    results_file: str
    subtasks: dict[str, dict[str, float]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"metric": self.metric, "score": self.score, "stderr": self.stderr,
                "higher_is_better": self.higher_is_better, "metrics": self.metrics, "n_samples": self.n_samples,
                "n_shot": self.n_shot, "results_file": self.results_file, "subtasks": self.subtasks}


def _metrics(entry: dict[str, Any]) -> dict[str, float]:
    """The numeric ``metric,filter`` values of one results entry (stderr kept apart)."""
    return {k: float(v) for k, v in entry.items()
            if "," in k and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


def _headline(metric_names: Sequence[str], config: dict[str, Any] | None) -> str | None:
    """The task's first metric under its first filter: what lm-eval lists first and papers quote."""
    if config:
        metric_list = config.get("metric_list") or []
        filters = config.get("filter_list") or [{"name": "none"}]
        if metric_list and isinstance(metric_list[0], dict) and isinstance(filters[0], dict):
            key = f"{metric_list[0].get('metric')},{filters[0].get('name', 'none')}"
            if key in metric_names:
                return key
    return None


def parse_results(path: Path, task: str) -> TaskScore:
    """The score of ``task`` (a task or a group) from an lm-eval ``results_*.json``."""
    try:
        results = json.loads(path.read_text())
        entry = results["results"][task]
    except (OSError, ValueError) as exc:
        raise FormatError(f"cannot read lm-eval results: {exc}", file=path) from exc
    except (KeyError, TypeError):
        raise FormatError(f"lm-eval results hold no entry for task {task!r}", file=path) from None
    values = _metrics(entry)
    scores = {k: v for k, v in values.items() if "_stderr," not in k}
    if not scores:
        raise FormatError(f"lm-eval results for {task!r} hold no numeric metric: {sorted(entry)}", file=path)
    configs = results.get("configs") or {}
    subtasks = list((results.get("group_subtasks") or {}).get(task) or [])
    metric = _headline(list(scores), configs.get(task))
    for subtask in subtasks:
        metric = metric or _headline(list(scores), configs.get(subtask))
    metric = metric or next(iter(scores))
    name, _, filter_name = metric.partition(",")
    higher = (results.get("higher_is_better") or {}).get(task, {}).get(name)
    if higher is None and subtasks:
        higher = (results.get("higher_is_better") or {}).get(subtasks[0], {}).get(name)
    samples = results.get("n-samples") or {}
    counted = [samples[t].get("effective") for t in (subtasks or [task]) if isinstance(samples.get(t), dict)]
    n_shot = (results.get("n-shot") or {}).get(task)
    if n_shot is None and subtasks:
        n_shot = (results.get("n-shot") or {}).get(subtasks[0])
    return TaskScore(
        task=task, metric=metric, score=scores[metric], stderr=values.get(f"{name}_stderr,{filter_name}"),
        higher_is_better=True if higher is None else bool(higher), metrics=scores,
        n_samples=sum(counted) if counted and all(isinstance(c, int) for c in counted) else None,
        n_shot=n_shot if isinstance(n_shot, int) else None, results_file=str(path),
        subtasks={s: _metrics(results["results"][s]) for s in subtasks if s in results.get("results", {})},
    )


def results_file(output_dir: Path) -> Path:
    """The one ``results_*.json`` lm-eval wrote into ``output_dir`` (it appends a timestamp)."""
    found = sorted(output_dir.glob("results_*.json"))
    if len(found) != 1:
        raise FormatError(f"expected one lm-eval results_*.json, found {len(found)}", file=output_dir)
    return found[0]


def report_body(settings: EvalSettings, version: str, scores: Sequence[TaskScore],
                failure: dict[str, str] | None = None) -> dict[str, Any]:
    """The body of ``accuracy.json``; ``complete`` only when every task finished."""
    done = {s.task for s in scores}
    return {
        "complete": failure is None and done == set(settings.tasks),
        "settings": {**settings.to_json(), "lm_eval_version": version},
        "tasks": {s.task: s.to_json() for s in scores},
        "failed": failure,
        "not_run": [t for t in settings.tasks if t not in done and (failure is None or t != failure["task"])],
    }


def check_base(base: dict[str, Any], settings: EvalSettings, path: Path) -> None:
    """Refuse a base report that cannot be compared with this run, before anything starts."""
    if base.get("kind") != "accuracy":
        raise AccuracyError(f"is a {base.get('kind')} report; --check accuracy compares with an accuracy.json",
                            file=path)
    missing = [t for t in settings.tasks if t not in (base.get("tasks") or {})]
    if missing:
        ran = ", ".join(base.get("tasks") or {}) or "no task"
        raise AccuracyError(f"has no results for task(s) {', '.join(missing)} (it holds {ran}); run the base "
                            f"with --tasks {','.join(settings.tasks)}", file=path)
    theirs = {k: (base.get("settings") or {}).get(k) for k in settings.comparable()}
    if theirs.get("extra_lm_eval_args") is None:
        theirs["extra_lm_eval_args"] = []
    differ = {k: (theirs[k], v) for k, v in settings.comparable().items() if theirs[k] != v}
    if differ:
        said = "; ".join(f"{k}: base {a!r}, this run {b!r}" for k, (a, b) in differ.items())
        raise AccuracyError(f"was measured differently ({said}); recovery would compare different things", file=path)


@dataclass(frozen=True)
class Recovery:
    task: str
    metric: str
    base: float
    other: float
    recovery: float | None  # other / base (base / other for lower-is-better metrics); None: undefined

    def passes(self, minimum: float) -> bool:
        return self.recovery is not None and self.recovery >= minimum


def recoveries(base: dict[str, Any], other: dict[str, Any]) -> list[Recovery]:
    """Per task of ``other``: its headline score against the base's on the same metric."""
    found = []
    for task, entry in other["tasks"].items():
        base_entry = base["tasks"].get(task)
        if base_entry is None:
            continue
        metric = entry["metric"]
        if metric not in base_entry["metrics"]:
            raise FormatError(f"the base has no {metric!r} for {task}; its metrics: {sorted(base_entry['metrics'])}")
        b, o = base_entry["metrics"][metric], entry["score"]
        num, den = (o, b) if entry["higher_is_better"] else (b, o)
        found.append(Recovery(task, metric, b, o, num / den if den > 0 else None))
    return found


def recovery_lines(found: Sequence[Recovery], minimum: float) -> list[str]:
    lines = [f"{'task':24} {'metric':30} {'base':>8} {'other':>8} {'recovery':>9}"]
    for r in found:
        verdict = "ok" if r.passes(minimum) else f"FAIL (< {minimum:.1%})"
        shown = "n/a" if r.recovery is None else f"{r.recovery:.1%}"
        lines.append(f"{r.task:24} {r.metric:30} {r.base:8.4f} {r.other:8.4f} {shown:>9}  {verdict}")
    return lines


def failures(found: Sequence[Recovery], minimum: float) -> list[str]:
    """Why the variant fails the recovery bar (empty: it passes)."""
    problems = []
    for r in found:
        if not r.passes(minimum):
            kept = "an undefined share (the base scored 0)" if r.recovery is None else f"{r.recovery:.1%}"
            problems.append(f"{r.task} kept {kept} of the base's {r.metric} ({r.other:.4f} vs {r.base:.4f}), "
                            f"below --min-recovery {minimum:.1%}")
    return problems


def _progress_reporter(log_path: Path, task: str, echo: Callable[[str], None]) -> Callable[[], None]:
    """Echo lm-eval's request progress (its tqdm bar in the log) every 10%."""
    shown = {"decile": -1}

    def report() -> None:
        try:
            with open(log_path, "rb") as handle:
                handle.seek(max(0, log_path.stat().st_size - 4096))
                matches = _PROGRESS.findall(handle.read())
        except OSError:
            return
        if matches:
            percent, done, total = (int(x) for x in matches[-1])
            if percent // 10 > shown["decile"]:
                shown["decile"] = percent // 10
                echo(f"  {task}: {percent}% ({done}/{total} requests)")

    return report


def run_tasks(
    settings: EvalSettings,
    *,
    url: str,
    model: Path,
    out: Path,
    run_client: Callable[..., int],
    write: Callable[[dict[str, Any]], Path],
    max_length: int | None = None,
    echo: Callable[[str], None] = print,
) -> tuple[Path, list[TaskScore]]:
    """Run every task, one lm-eval process each; ``write`` gets the report body after each task.

    ``run_client(name, argv, log_path, progress=...)`` runs one process and returns its exit
    status (``ProcessGroup.run_client``: it raises when a server dies). A failure is recorded in
    the report, which stays incomplete, and raised again.
    """
    version = lm_eval_version()
    scores: list[TaskScore] = []
    path = write(report_body(settings, version, scores))
    for number, task in enumerate(settings.tasks, start=1):
        output_dir = out / "lm-eval" / task
        shutil.rmtree(output_dir, ignore_errors=True)  # a stale results_*.json must not pass for this run's
        log = out / "logs" / f"lm-eval-{task}.log"
        argv = lm_eval_argv(settings, task, url=url, model=str(model), tokenizer=str(model),
                            output=output_dir / "results.json", max_length=max_length)
        echo(f"accuracy: {task} ({number}/{len(settings.tasks)}) through {settings.lm_eval_model}")
        try:
            code = run_client(f"lm-eval {task}", argv, log, progress=_progress_reporter(log, task, echo))
            if code:
                raise AccuracyError(f"lm-eval failed on {task} (exit status {code}); last lines of {log}:\n"
                                    f"{log_tail(log)}")
            score = parse_results(results_file(output_dir), task)
        except BaseException as exc:
            reason = "interrupted" if isinstance(exc, KeyboardInterrupt) else str(exc).splitlines()[0]
            write(report_body(settings, version, scores, {"task": task, "error": reason, "log": str(log)}))
            raise
        scores.append(score)
        stderr = f" ± {score.stderr:.4f}" if score.stderr is not None else ""
        echo(f"  {task} {score.metric} = {score.score:.4f}{stderr} ({score.n_samples} samples, "
             f"{score.n_shot}-shot); lm-eval wrote {score.results_file}")
        path = write(report_body(settings, version, scores))
    return path, scores


def dry_run_lines(settings: EvalSettings, *, url: str, model: Path, out: Path, max_length: int | None) -> list[str]:
    """The lm-eval commands ``run_tasks`` would start, for ``--dry-run``."""
    lines = []
    for task in settings.tasks:
        argv = lm_eval_argv(settings, task, url=url, model=str(model), tokenizer=str(model),
                            output=out / "lm-eval" / task / "results.json", max_length=max_length)
        lines += [f"# accuracy: {task}", shlex.join(argv)]
    return lines
