"""``dsv4convert serve``: run a converted checkpoint with SGLang (PD-disaggregated or not) and check it.

The command plans (``launch``), starts and watches (``process``), then optionally measures
(``recall``, ``speed``) and reports (``report``). ``--dry-run`` stops after planning.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from dsv4convert.serve import launch, recall, report, speed
from dsv4convert.serve.process import ProcessGroup, ServeError, http_post_json, log_tail
from dsv4convert.serve.topology import Topology, TopologyError, discover

SMOKE_PROMPT = "The three primary colours are"
# SGLang only logs this when a parameter got no checkpoint tensor; the server still starts.
UNINITIALIZED_WEIGHTS = "Some weights are not initialized from checkpoints"


def _gpu_list(text: str) -> list[int]:
    try:
        gpus = [int(part) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected GPU indices like 0,1,2,3, got {text!r}") from exc
    if not gpus or len(set(gpus)) != len(gpus):
        raise argparse.ArgumentTypeError(f"expected distinct GPU indices like 0,1,2,3, got {text!r}")
    return gpus


def _int_list(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def _float_list(text: str) -> list[float]:
    return [float(part) for part in text.split(",") if part.strip()]


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve",
        help="serve a checkpoint with SGLang 0.5.23 (PD-disaggregated or single), optionally check recall or speed",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Start SGLang on a (converted) DeepSeek-V4-Flash checkpoint with the right per-variant settings,\n"
            "wait until every server is healthy, send one real request, then check or keep serving.\n\n"
            "With --pd: a prefill server on one NUMA node's GPUs, a decode server on another's (each bound\n"
            "to its node with numactl when present), and sglang_router in front. Ctrl-C stops everything.\n"
            "Arguments after `--` go to every sglang.launch_server command unchanged."
        ),
        epilog=(
            "examples:\n"
            "  dsv4convert serve --model out/nvfp4 --pd --dry-run\n"
            "  dsv4convert serve --model out/nvfp4 --pd --check recall --indexer-topk\n"
            "  dsv4convert serve --model out/nvfp4 --pd --check speed --compare runs/base/speed.json\n"
            "  dsv4convert serve --model out/fp8 --gpus 0,1,2,3 -- --speculative-algorithm EAGLE \\\n"
            "      --speculative-num-steps 1 --speculative-eagle-topk 1 --speculative-num-draft-tokens 2\n"
            "  dsv4convert serve --model M --pd --role prefill --host 0.0.0.0 -- --dist-init-addr h1:5000 \\\n"
            "      --nnodes 2 --node-rank 0   (multi-node: one role per host; see docs/serve.md)"
        ),
    )
    p.add_argument("--model", required=True, type=Path, help="checkpoint directory (also the tokenizer)")
    p.add_argument("--variant", choices=launch.SERVED_VARIANTS, help="override the variant `inspect` detects")
    p.add_argument("--tuned-configs", type=Path, metavar="DIR",
                   help="`dsv4convert tune --out DIR`: sets SGLANG_MOE_CONFIG_DIR=DIR for every server")
    p.add_argument("--gpu-family", help="sm90, sm100 or sm120; read from nvidia-smi when omitted")
    p.add_argument("--pd", action="store_true", help="prefill/decode disaggregation behind sglang_router")
    p.add_argument("--prefill-gpus", type=_gpu_list, help="GPUs of the prefill server (default: first NUMA node's)")
    p.add_argument("--decode-gpus", type=_gpu_list, help="GPUs of the decode server (default: second NUMA node's)")
    p.add_argument("--gpus", type=_gpu_list, help="GPUs of the single server (default: all)")
    p.add_argument("--transfer-backend", choices=launch.TRANSFER_BACKENDS,
                   help="KV transfer for --pd (default mooncake with RDMA NICs, else mooncake_tcp)")
    p.add_argument("--role", choices=("prefill", "decode", "router"),
                   help="multi-node --pd: start only this host's part")
    p.add_argument("--prefill-url", help="--role router: the prefill server, e.g. http://host1:30000")
    p.add_argument("--decode-url", help="--role router: the decode server, e.g. http://host2:30001")
    p.add_argument("--host", default="127.0.0.1", help="address servers listen on (0.0.0.0 across hosts)")
    p.add_argument("--port", type=int, default=8000, help="client port: the router's with --pd, else the server's")
    p.add_argument("--prefill-port", type=int, default=30000)
    p.add_argument("--decode-port", type=int, default=30001)
    p.add_argument("--bootstrap-port", type=int, default=8998, help="prefill bootstrap port both sides use")
    p.add_argument("--startup-timeout", type=float, default=1800.0, help="seconds to wait for each /health")
    p.add_argument("--out", type=Path, default=Path("serve-runs"), help="logs and reports go here")
    p.add_argument("--dry-run", action="store_true", help="print commands and environment, start nothing")
    p.add_argument("--check", choices=("recall", "speed"), help="run a check once serving, then stop")
    p.add_argument("--hold", action="store_true", help="keep serving after --check until Ctrl-C")
    p.add_argument("--indexer-topk", action="store_true",
                   help="recall: capture the indexer's top-k (sets --enable-return-indexer-topk and attention DP)")
    p.add_argument("--lengths", type=_int_list, default=list(recall.DEFAULT_LENGTHS), help="recall context lengths")
    p.add_argument("--depths", type=_float_list, default=list(recall.DEFAULT_DEPTHS), help="recall needle depths 0..1")
    p.add_argument("--trials", type=int, default=3, help="recall needles per (length, depth) cell")
    p.add_argument("--concurrency", type=_int_list, default=list(speed.DEFAULT_CONCURRENCIES), help="speed concurrencies")
    p.add_argument("--compare", type=Path, metavar="REPORT", help="print deltas of this run's report against REPORT")
    p.add_argument("sglang_args", nargs=argparse.REMAINDER, help="after --: extra sglang.launch_server arguments")
    p.set_defaults(func=run)


def _topology(args: argparse.Namespace) -> Topology | None:
    """This host's GPUs; None where none are needed (router role) or a dry run names them itself."""
    if args.role == "router":
        return None
    try:
        return discover()
    except TopologyError as exc:
        if args.dry_run and args.gpu_family:
            return None
        raise TopologyError(f"{exc} (for --dry-run on a machine without GPUs pass --gpu-family and the GPU lists)") from exc


def _gpu_family(args: argparse.Namespace, topology: Topology | None) -> str:
    if args.gpu_family:
        return args.gpu_family
    if topology is None:
        if args.role == "router":
            return ""  # the router host starts no SGLang server; nothing depends on its GPUs
        raise TopologyError("cannot tell the GPU architecture; pass --gpu-family")
    families = {gpu.family for gpu in topology.gpus}
    if len(families) != 1:
        raise TopologyError(f"GPUs of different architectures ({sorted(families)}); pass --gpu-family")
    return families.pop()


def _variant(args: argparse.Namespace) -> str:
    if args.variant:
        return args.variant
    from dsv4convert.inspection import detect_variant

    variant = detect_variant(args.model)
    if variant not in launch.SERVED_VARIANTS:
        raise launch.LaunchError(f"inspect calls this checkpoint {variant!r}; pass --variant to serve it anyway")
    return variant


def plan(args: argparse.Namespace, topology: Topology | None) -> tuple[list[launch.Command], list[str]]:
    """The commands to run, in start order, and warnings for the user (``args.variant`` must be set)."""
    warnings: list[str] = []
    extra = tuple(args.sglang_args[1:] if args.sglang_args[:1] == ["--"] else args.sglang_args)
    backend, warning = launch.choose_transfer_backend(args.transfer_backend, topology.ib_devices if topology else ())
    if args.pd and warning:
        warnings.append(warning)
    options = launch.LaunchOptions(
        model=str(args.model), variant=args.variant, gpu_family=_gpu_family(args, topology), host=args.host,
        router_port=args.port, server_port=args.port, prefill_port=args.prefill_port, decode_port=args.decode_port,
        bootstrap_port=args.bootstrap_port, transfer_backend=backend,
        ib_devices=topology.ib_devices if topology else (), indexer_topk=args.indexer_topk, extra_args=extra,
    )
    if not args.pd:
        if args.role or args.prefill_gpus or args.decode_gpus:
            raise launch.LaunchError("--role, --prefill-gpus and --decode-gpus belong to the --pd form")
        gpus = args.gpus or ([g.index for g in topology.gpus] if topology else None)
        if not gpus:
            raise launch.LaunchError("pass --gpus when nvidia-smi cannot list them")
        return launch.plan_single(options, topology, gpus), warnings
    if args.gpus:
        raise launch.LaunchError("--gpus is for the single-server form; with --pd use --prefill-gpus/--decode-gpus")
    prefill, decode = args.prefill_gpus, args.decode_gpus
    if (prefill is None or decode is None) and args.role != "router":
        if topology is None:
            raise launch.LaunchError("pass --prefill-gpus and --decode-gpus when nvidia-smi cannot list GPUs")
        default_prefill, default_decode, split_warning = launch.default_pd_split(topology)
        prefill, decode = prefill or default_prefill, decode or default_decode
        if split_warning:
            warnings.append(split_warning)
    if args.role:
        gpus = {"prefill": prefill, "decode": decode, "router": []}[args.role]
        return launch.plan_role(options, topology, args.role, gpus, args.prefill_url, args.decode_url), warnings
    return launch.plan_pd(options, topology, prefill, decode), warnings


def _print_plan(commands: list[launch.Command]) -> None:
    for command in commands:
        print(f"# {command.role}: serves {command.url}")
        print(command.shell())


def smoke_request(url: str, timeout: float = 600.0) -> str:
    """One real generation; through the PD router it is the only thing that moves a KV cache."""
    response = http_post_json(
        url + "/generate",
        {"text": SMOKE_PROMPT, "sampling_params": {"temperature": 0.0, "max_new_tokens": 16}},
        timeout,
    )
    text = response.get("text")
    if not isinstance(text, str) or not text.strip():
        raise ServeError(f"/generate through {url} returned no text: {json.dumps(response)[:300]}")
    return text


def start_and_wait(group: ProcessGroup, commands: list[launch.Command], timeout: float) -> None:
    """Start servers together (they load weights in parallel), wait for each, then the router."""
    servers = [group.start(c) for c in commands if c.role != "router"]
    for running in servers:
        group.wait_healthy(running, timeout)
    for running in servers:
        for line in running.log_path.read_text(errors="replace").splitlines():
            if UNINITIALIZED_WEIGHTS in line:
                group.echo(f"warning: {running.name}: {line.strip()}")
    for command in commands:
        if command.role == "router":
            group.wait_healthy(group.start(command), min(timeout, 120.0))


def _meta(args: argparse.Namespace, commands: list[launch.Command]) -> dict[str, Any]:
    return {"model": str(args.model), "variant": args.variant, "pd": args.pd, "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "commands": [c.shell() for c in commands]}


def run_recall(args: argparse.Namespace, url: str, meta: dict[str, Any]) -> Path:
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:
        raise ServeError("--check recall needs the model's tokenizer through transformers (installed with SGLang)") from exc
    from dsv4convert.checkpoint import read_small_json  # imports torch: only when a check runs
    config = read_small_json(args.model / "config.json")
    tokenizer = AutoTokenizer.from_pretrained(str(args.model))
    layer_ids = recall.indexer_layer_ids(config["compress_ratios"], config["num_hidden_layers"])
    sweep = recall.RecallSweep(lengths=args.lengths, depths=args.depths, trials=args.trials,
                               indexer_topk=args.indexer_topk, indexer_layers=len(layer_ids),
                               index_topk=config["index_topk"])

    def show(trial: recall.RecallTrial) -> None:
        print(f"recall {trial.length:>7} tokens depth {trial.depth:4.0%}: {'ok ' if trial.correct else 'MISS'} "
              f"{trial.output.strip()[:40]!r}", flush=True)

    trials = sweep.run(tokenizer, lambda payload: http_post_json(url + "/generate", payload, 1800.0), show)
    summary = recall.summarize(trials, layer_ids)
    path = args.out / "recall.json"
    report.write_report(path, "recall", meta, {"summary": summary, "trials": [t.to_json() for t in trials]})
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


def run(args: argparse.Namespace) -> int:
    if args.indexer_topk and args.check != "recall":
        raise launch.LaunchError("--indexer-topk belongs to --check recall")
    if args.indexer_topk and args.pd:
        raise launch.LaunchError(
            "--indexer-topk needs the single-server form (no --pd): with PD the prompt's indexer runs on the "
            "prefill server, while the response (and its indexer_topk) comes from the decode server")
    if args.compare and not args.check:
        raise launch.LaunchError("--compare needs --check (it compares the new report with REPORT)")
    args.variant = _variant(args)
    topology = _topology(args)
    commands, warnings = plan(args, topology)
    if args.tuned_configs:
        from dataclasses import replace

        from dsv4convert.tune.output import tuned_config_env

        env, tuned_warnings = tuned_config_env(args.tuned_configs)
        commands = [replace(c, env={**c.env, **env}) if c.role != "router" else c for c in commands]
        warnings += tuned_warnings
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    if args.dry_run:
        _print_plan(commands)
        return 0
    client_url = commands[-1].url
    with ProcessGroup(args.out / "logs") as group:
        start_and_wait(group, commands, args.startup_timeout)
        if args.role in ("prefill", "decode"):
            print(f"{args.role} server ready at {client_url}; Ctrl-C stops it")
            _hold(group)
            return 0
        try:
            answer = smoke_request(client_url)
        except ServeError as exc:
            raise ServeError(f"{exc}{_exited_tails(group)}") from None
        print(f"smoke request through {client_url}: {answer!r}")
        meta = _meta(args, commands)
        if args.check == "recall":
            _print_compare(args, run_recall(args, client_url, meta))
        elif args.check == "speed":
            _print_compare(args, run_speed(args, client_url, meta))
        if not args.check or args.hold:
            print(f"serving at {client_url}; Ctrl-C stops every process")
            _hold(group)
    return 0


def _print_compare(args: argparse.Namespace, new_report: Path) -> None:
    if args.compare:
        for line in report.compare(report.read_report(args.compare), report.read_report(new_report)):
            print(line)


def _exited_tails(group: ProcessGroup) -> str:
    """Log tails of every started process that has already exited (why a request failed)."""
    return "".join(f"\n{p.name} exited with status {p.popen.poll()}; last lines of {p.log_path}:\n"
                   f"{log_tail(p.log_path)}" for p in group.processes if p.popen.poll() is not None)


def _hold(group: ProcessGroup) -> None:
    """Serve until Ctrl-C, or until a server dies (then say why, and stop the rest)."""
    while True:
        for p in group.processes:
            code = p.popen.poll()
            if code is not None:
                raise ServeError(f"{p.name} exited with status {code} while serving; last lines of "
                                 f"{p.log_path}:\n{log_tail(p.log_path)}")
        time.sleep(1.0)

