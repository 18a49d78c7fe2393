"""What ``serve --check`` measures through a running server: recall, speed, accuracy, MTP acceptance.

Each check takes the parsed arguments, the client URL and the report's metadata, writes its report
under ``--out`` and prints a summary; the accuracy and MTP checks return False when a figure fell
below its bar. Starting and stopping the servers is ``cli``'s (and ``process``'s) business.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

from dsv4convert.checkpoint import read_small_json
from dsv4convert.errors import FormatError
from dsv4convert.models.registry import attention_reach_of_config
from dsv4convert.serve import accuracy, defaults, launch, mtp, recall, report, speed
from dsv4convert.serve.process import ProcessGroup, ServeError, http_get_json, http_post_json, log_tail


def run_recall(args: argparse.Namespace, url: str, meta: dict[str, Any]) -> Path:
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:
        raise ServeError("--check recall needs the model's tokenizer through transformers (installed with SGLang)") from exc
    path = args.model / "config.json"
    reach = attention_reach_of_config(read_small_json(path), str(path))
    layer_ids = recall.indexer_layer_ids(reach.compress_ratios, len(reach.compress_ratios))
    if args.indexer_topk and not layer_ids:
        raise ServeError(f"{path}: --indexer-topk: SGLang returns the top-k of ratio-4 (CSA) layers only "
                         "(configs/model_config.py::get_num_indexer_layers) and this model has none; run "
                         "--check recall without it")
    tokenizer = AutoTokenizer.from_pretrained(str(args.model))
    sweep = recall.RecallSweep(lengths=args.lengths, depths=args.depths, trials=args.trials,
                               indexer_topk=args.indexer_topk, indexer_layers=len(layer_ids),
                               index_topk=reach.index_topk or 0)
    prompts = sweep.prompts(tokenizer)
    farthest = recall.farthest_needle(prompts)
    for line in recall.reach_lines(reach, farthest):
        print(line, file=sys.stderr)

    def show(trial: recall.RecallTrial) -> None:
        print(f"recall {trial.length:>7} tokens depth {trial.depth:4.0%}: {'ok ' if trial.correct else 'MISS'} "
              f"{trial.output.strip()[:40]!r}", flush=True)

    trials = sweep.run(tokenizer, lambda payload: http_post_json(url + "/generate", payload, 1800.0), show, prompts)
    summary = recall.summarize(trials, layer_ids)
    reached = {"sliding_window": reach.sliding_window, "index_topk": reach.index_topk,
               "candidate_reach": reach.candidate_reach, "farthest_needle": farthest}
    path = args.out / "recall.json"
    report.write_report(path, "recall", meta, {"summary": summary, "reach": reached,
                                               "trials": [t.to_json() for t in trials]})
    report.write_heatmap(summary, args.out / "recall.png", f"{args.model.name} ({meta['variant']})")
    print(f"recall accuracy {summary['accuracy']:.3f}; wrote {path} and {args.out / 'recall.png'}")
    return path


def run_speed(args: argparse.Namespace, url: str, meta: dict[str, Any]) -> Path:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    jsonl = args.out / "speed.jsonl"
    jsonl.unlink(missing_ok=True)
    for case in speed.bench_cases(speed.DEFAULT_SHAPES, args.concurrency):
        argv = [sys.executable, "-m", "sglang.benchmark.serving",
                *speed.bench_args(case, host=host, port=int(port), model=str(args.model),
                                  output_file=str(jsonl), pd_separated=args.pd)]
        log = args.out / "logs" / f"bench-{case.input_len}-{case.output_len}-c{case.concurrency}.log"
        print(f"speed: input {case.input_len}, output {case.output_len}, concurrency {case.concurrency}", flush=True)
        with open(log, "wb") as handle:
            if subprocess.run(argv, stdout=handle, stderr=subprocess.STDOUT, check=False).returncode:
                raise ServeError(f"bench_serving failed; last lines of {log}:\n{log_tail(log)}")
    results = speed.parse_bench_jsonl(jsonl.read_text(), str(jsonl))
    for r in results:
        print(f"  in {r.case.input_len:>6} out {r.case.output_len:>4} c{r.case.concurrency:<3} "
              f"{r.output_throughput:9.1f} tok/s  TTFT {r.latencies_ms['median_ttft_ms']:8.1f} ms  "
              f"TPOT {r.latencies_ms['median_tpot_ms']:6.1f} ms  ITL {r.latencies_ms['median_itl_ms']:6.1f} ms")
    path = args.out / "speed.json"
    report.write_report(path, "speed", meta, {"results": [r.to_json() for r in results]})
    print(f"wrote {path}")
    return path


def eval_settings(args: argparse.Namespace) -> accuracy.EvalSettings:
    return accuracy.EvalSettings(
        tasks=tuple(args.tasks or defaults.DEFAULT_TASKS), api=args.eval_api or "chat", limit=args.limit,
        num_fewshot=args.num_fewshot, concurrency=args.eval_concurrency or defaults.DEFAULT_CONCURRENCY,
        include_path=args.include_path.resolve() if args.include_path else None,
        extra_args=tuple(shlex.split(args.lm_eval_args or "")),
    )


def base_report(args: argparse.Namespace) -> dict[str, Any] | None:
    """The --compare report, read and checked before anything starts (loading takes minutes)."""
    if not args.compare:
        return None
    base = report.read_report(args.compare)
    if base["kind"] != args.check:
        raise FormatError(f"is a {base['kind']} report; --check {args.check} compares with a {args.check}.json",
                          file=args.compare)
    if args.check == "accuracy":
        accuracy.check_base(base, eval_settings(args), args.compare)
    return base


def model_max_length(model: Path) -> int | None:
    path = model / "config.json"
    if not path.is_file():
        return None

    value = read_small_json(path).get("max_position_embeddings")
    return value if isinstance(value, int) and value > 0 else None


def run_accuracy(args: argparse.Namespace, url: str, meta: dict[str, Any], group: ProcessGroup,
                 base: dict[str, Any] | None) -> bool:
    """lm-eval on every task; with a base, recovery per task. True when nothing fell below the bar."""
    settings = eval_settings(args)
    path = args.out / "accuracy.json"
    installed = accuracy.lm_eval_version()
    if installed != accuracy.LM_EVAL_VERSION:
        print(f"warning: lm-eval {installed} is installed; dsv4convert pins {accuracy.LM_EVAL_VERSION} "
              "(scores can move between lm-eval versions)", file=sys.stderr)
    if base is not None and (base.get("settings") or {}).get("lm_eval_version") not in (None, installed):
        print(f"warning: the base was measured with lm-eval {base['settings']['lm_eval_version']}, this run uses "
              f"{installed}", file=sys.stderr)

    def write(body: dict[str, Any]) -> Path:
        report.write_report(path, "accuracy", meta, body)
        return path

    accuracy.run_tasks(settings, url=url, model=args.model, out=args.out, run_client=group.run_client, write=write,
                       max_length=model_max_length(args.model), echo=group.echo)
    print(f"wrote {path}")
    if base is None:
        return True
    minimum = defaults.DEFAULT_MIN_RECOVERY if args.min_recovery is None else args.min_recovery
    new = report.read_report(path)
    for line in report.compare(base, new, min_recovery=minimum):
        print(line)
    problems = accuracy.failures(accuracy.recoveries(base, new), minimum)
    for problem in problems:
        print(f"FAIL: {problem}")
    return not problems


def expected_report(args: argparse.Namespace) -> dict[str, Any] | None:
    """``compare``'s expected DSpark acceptance for the served variant, read before anything starts:
    ``--expected-from``, else the default report (``VARIANT-compare/compare.json``) when it is there and has a
    DSpark section; None without one."""
    if args.check != "mtp":
        return None
    if args.expected_from is not None:
        return mtp.read_expected(args.expected_from)
    default = mtp.default_compare_report(args.model)
    if not default.is_file():
        return None
    try:
        return mtp.read_expected(default)
    except FormatError as exc:
        print(f"note: {exc}; the server's acceptance is not compared with an expected figure", file=sys.stderr)
        return None


def run_mtp(args: argparse.Namespace, url: str, meta: dict[str, Any], commands: list[launch.Command],
            base: dict[str, Any] | None, expected: dict[str, Any] | None = None) -> bool:
    """The fixed prompts through ``url``; SGLang's acceptance against --min-accept (and the base, and
    ``compare``'s expected figures for this variant)."""
    minimum = defaults.DEFAULT_MIN_ACCEPT if args.min_accept is None else args.min_accept
    samples = mtp.run_prompts(lambda payload: http_post_json(url + "/generate", payload, 1800.0),
                              mtp.bos_text(args.model))
    drafting = next((c for c in commands if c.role in ("decode", "server")), None)
    info_url = drafting.url if drafting else args.decode_url  # the router role: the remote decode server
    server_lengths: list[float] = []
    if info_url:
        try:
            server_lengths = mtp.server_accept_lengths(http_get_json(info_url + "/server_info", 60.0))
        except ServeError as exc:  # only the cross-check is lost; the per-request figures stand
            print(f"warning: no server-wide acceptance: {exc}", file=sys.stderr)
    summary = mtp.summarize(samples, server_lengths)
    tokens = drafting.server.draft_tokens if drafting and drafting.server else None
    path = args.out / "mtp.json"
    against, expectation = ([], None) if expected is None else mtp.against_expected(summary, expected)
    report.write_report(path, "mtp", meta, {"summary": summary, "min_accept": minimum, "draft_tokens": tokens,
                                            "expected": expectation, "samples": [s.to_json() for s in samples]})
    length = summary["accept_length"]
    ceiling = f" (at most {tokens}: {tokens} tokens verified per step)" if tokens else ""
    if length is not None:
        rate = "n/a" if summary["accept_rate"] is None else f"{summary['accept_rate']:.0%}"
        print(f"mtp: mean accepted length {length:.2f} per verify step{ceiling}; draft acceptance {rate}; "
              f"SGLang's avg_spec_accept_length {', '.join(f'{v:.2f}' for v in server_lengths) or 'n/a'}")
        if summary["per_position"]:
            print("mtp: accepted per draft position: " + ", ".join(
                f"{row['position']}: {row['reached']:.0%}" for row in summary["per_position"]))
    if expected is not None:
        print(f"mtp: against compare's expectation ({expected['report']}; measured offline on {expected['text']}, "
              "teacher-forced, not on these prompts):")
        for line in against:
            print(line)
    print(f"wrote {path}")
    if base is not None:
        for line in report.compare(base, report.read_report(path)):
            print(line)
    problems = mtp.failures(summary, minimum)
    for problem in problems:
        print(f"FAIL: {problem}")
    return not problems


def print_compare(args: argparse.Namespace, new_report: Path) -> None:
    if args.compare:
        for line in report.compare(report.read_report(args.compare), report.read_report(new_report)):
            print(line)
