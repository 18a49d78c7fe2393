"""``dsv4convert serve``: run a converted checkpoint with SGLang (PD-disaggregated or not) and check it.

The command plans (``launch``), starts and watches (``process``), then optionally measures
(``checks``: recall, speed, accuracy through lm-eval, MTP draft acceptance) and reports
(``report``). ``--dry-run`` stops after planning. A check that measures below its bar
(``--min-recovery``, ``--min-accept``) exits with status 1; errors exit with 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dsv4convert import variants
from dsv4convert.engines import GPU_FAMILIES, SGLANG_LABEL, family_label
from dsv4convert.engines.sglang import ENGRAM_PLACEMENTS, TRANSFER_BACKENDS
from dsv4convert.errors import CheckpointError
from dsv4convert.serve import defaults

if TYPE_CHECKING:
    from dsv4convert.models.deepseek_v4.layout import ModelConfig
    from dsv4convert.serve import launch
    from dsv4convert.serve.process import ProcessGroup
    from dsv4convert.serve.served import V41Checkpoint
    from dsv4convert.serve.topology import Topology

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


def _str_list(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _limit(text: str) -> int | float:
    try:
        value = float(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected a count or a fraction below 1, got {text!r}") from exc
    return int(value) if value.is_integer() else value


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve",
        usage="dsv4convert serve --model DIR [--pd] [--mtp|--no-mtp] [--check CHECK] [--dry-run] [options] "
              "[-- SGLANG_ARGS]",
        help=f"serve a checkpoint with {SGLANG_LABEL} (PD-disaggregated or single), optionally check recall, speed, "
             "task accuracy (lm-eval) or MTP draft acceptance",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Start SGLang on a (converted) DeepSeek-V4-Flash or V4.1-Flash checkpoint with the right per-variant\n"
            "settings, wait until every server is healthy, send one real request, then check or keep serving.\n\n"
            "With --pd: a prefill server on one NUMA node's GPUs, a decode server on another's (each bound\n"
            "to its node with numactl when present), and sglang_router in front. Ctrl-C stops everything.\n"
            "Arguments after `--` go to every sglang.launch_server command unchanged. The checkpoint's\n"
            "drafter is served when it carries one and SGLang runs it there (--no-mtp: without it). For V4.1,\n"
            "what SGLang refuses (--pp-size, two-batch overlap, HiSparse, EAGLE) is refused first (docs/v41.md)."
        ),
        epilog=(
            "examples:\n"
            "  dsv4convert serve --model out/nvfp4 --pd --dry-run   (on the GPU host; elsewhere add --gpu-family sm120 \\\n      --prefill-gpus 0,1,2,3 --decode-gpus 4,5,6,7)\n"
            "  dsv4convert serve --model out/nvfp4 --gpus 0,1,2,3 --check recall --indexer-topk\n"
            "  dsv4convert serve --model out/nvfp4 --pd --check accuracy --tasks gsm8k --out runs/nvfp4 \\\n"
            "      --compare runs/base/accuracy.json --min-recovery 0.97\n"
            "  dsv4convert serve --model out/fp8 --pd --check mtp --compare runs/base/mtp.json\n"
            "  dsv4convert serve --model out/fp8 --gpus 0,1,2,3 --no-mtp   (without the checkpoint's drafter)\n"

            "  dsv4convert serve --model M --pd --role prefill --host 0.0.0.0 -- --dist-init-addr h1:5000 \\\n"
            "      --nnodes 2 --node-rank 0   (multi-node: one role per host; see docs/serve.md)"
        ),
    )
    what = p.add_argument_group("what to launch")
    what.add_argument("--model", metavar="DIR", required=True, type=Path, help="checkpoint directory (also the tokenizer)")
    what.add_argument("--variant", metavar="VARIANT", choices=variants.SERVED, help=f"override the variant `inspect` detects: {', '.join(variants.SERVED)}")
    what.add_argument("--mtp", action=argparse.BooleanOptionalAction, default=None,
                      help="the checkpoint's draft (EAGLE: MTP block; DSPARK: DSpark drafter); default: where it "
                           "runs")
    what.add_argument("--tuned-configs", type=Path, metavar="DIR",
                      help="`dsv4convert tune --out DIR` (SGLANG_MOE_CONFIG_DIR)")
    what.add_argument("--metrics", action="store_true",
                      help="SGLang's --enable-metrics: Prometheus metrics at /metrics on every server (docs/serve.md)")
    what.add_argument("--dry-run", action="store_true", help="print the plan (commands, environment), start nothing")
    what.add_argument("--engine", metavar="E", choices=("sglang", "vllm"), default="sglang",
                      help="sglang (default); vllm: print `vllm serve`")
    what.add_argument("--engram", dest="engram_placement", metavar="WHERE", choices=("auto", *ENGRAM_PLACEMENTS), default="auto",
                      help="V4.1's Engram tables: gpu, host-shared, host-per-rank, auto (fit's choice)")
    where = p.add_argument_group("topology (GPUs, PD, hosts, ports)")
    where.add_argument("--gpu-family", metavar="FAMILY", choices=GPU_FAMILIES,
                       help="read from nvidia-smi when omitted: "
                            + ", ".join(f"{f} {family_label(f)}" for f in GPU_FAMILIES))
    where.add_argument("--pd", action="store_true", help="prefill/decode disaggregation behind sglang_router")
    where.add_argument("--gpus", metavar="LIST", type=_gpu_list, help="GPUs of the single server (default: all)")
    where.add_argument("--prefill-gpus", metavar="LIST", type=_gpu_list, help="--pd: prefill GPUs (default: first NUMA node's)")
    where.add_argument("--decode-gpus", metavar="LIST", type=_gpu_list, help="--pd: decode GPUs (default: second NUMA node's)")
    where.add_argument("--transfer-backend", metavar="BACKEND", choices=TRANSFER_BACKENDS,
                       help=f"--pd KV transfer: {', '.join(TRANSFER_BACKENDS)} (default mooncake with RDMA NICs, "
                            "else mooncake_tcp)")
    where.add_argument("--role", metavar="ROLE", choices=("prefill", "decode", "router"),
                       help="multi-node --pd: start only this host's part: prefill, decode or router")
    where.add_argument("--prefill-url", metavar="URL", help="--role router: e.g. http://host1:30000")
    where.add_argument("--decode-url", metavar="URL", help="--role router: e.g. http://host2:30001")
    where.add_argument("--host", metavar="ADDR", default="127.0.0.1", help="address servers listen on (0.0.0.0 across hosts)")
    where.add_argument("--port", metavar="N", type=int, default=8000, help="client port: the router's with --pd, else the server's")
    where.add_argument("--prefill-port", metavar="N", type=int, default=30000, help="(default 30000)")
    where.add_argument("--decode-port", metavar="N", type=int, default=30001, help="(default 30001)")
    where.add_argument("--bootstrap-port", metavar="N", type=int, default=8998, help="prefill bootstrap port (default 8998)")
    where.add_argument("--startup-timeout", metavar="S", type=float, default=1800.0, help="seconds to wait for each /health")
    check = p.add_argument_group("checks (once serving; then stop, unless --hold)")
    check.add_argument("--check", metavar="CHECK", choices=("recall", "speed", "accuracy", "mtp"), help="recall, speed, accuracy or mtp")
    check.add_argument("--hold", action="store_true", help="keep serving after --check until Ctrl-C")
    check.add_argument("--out", metavar="DIR", type=Path, default=Path("serve-runs"), help="logs and reports (default serve-runs)")
    check.add_argument("--compare", type=Path, metavar="REPORT", help="deltas of this run's report against REPORT")
    check.add_argument("--indexer-topk", action="store_true",
                       help="recall: capture the indexer's top-k (sets --enable-return-indexer-topk, attention DP)")
    check.add_argument("--lengths", metavar="LIST", type=_int_list, default=list(defaults.DEFAULT_LENGTHS),
                       help="recall context lengths")
    check.add_argument("--depths", metavar="LIST", type=_float_list, default=list(defaults.DEFAULT_DEPTHS),
                       help="recall needle depths 0..1")
    check.add_argument("--trials", metavar="N", type=int, default=3, help="recall needles per (length, depth) cell")
    check.add_argument("--concurrency", metavar="LIST", type=_int_list, default=list(defaults.DEFAULT_CONCURRENCIES),
                       help="speed concurrencies")
    acc = p.add_argument_group("--check accuracy (lm-evaluation-harness; pip install 'dsv4convert[eval]')")
    acc.add_argument("--tasks", metavar="LIST", type=_str_list,
                     help=f"lm-eval tasks or groups, comma-separated (default {','.join(defaults.DEFAULT_TASKS)})")
    acc.add_argument("--limit", metavar="N", type=_limit, help="examples per task: a count, or a fraction below 1 (default: all)")
    acc.add_argument("--num-fewshot", metavar="N", type=int, help="few-shot examples (default: each task's own)")
    acc.add_argument("--eval-api", metavar="API", choices=tuple(defaults.EVAL_APIS),
                     help="chat (default): /v1/chat/completions; completions: /v1/completions with token ids "
                          "(log-likelihood tasks)")
    acc.add_argument("--eval-concurrency", metavar="N", type=int, help=f"requests in flight (default {defaults.DEFAULT_CONCURRENCY})")
    acc.add_argument("--include-path", metavar="DIR", type=Path, help="a directory of your own lm-eval task YAMLs")
    acc.add_argument("--lm-eval-args", metavar="STR", help="more lm-eval arguments, one shell-quoted string")
    acc.add_argument("--min-recovery", metavar="F", type=float,
                     help=f"with --compare: fail when a task keeps less than this of the base's score "
                          f"(default {defaults.DEFAULT_MIN_RECOVERY})")
    draft = p.add_argument_group("--check mtp (the draft's acceptance)")
    draft.add_argument("--min-accept", metavar="F", type=float,
                       help=f"fail when the mean accepted length per verify step is below this "
                            f"(default {defaults.DEFAULT_MIN_ACCEPT}; 1.0: no draft token accepted)")
    draft.add_argument("--expected-from", type=Path, metavar="REPORT",
                       help="compare's report of this variant (directory or compare.json): measured DSpark acceptance "
                            "against it, per draft position (default: MODEL-compare/compare.json when there)")
    passthrough = p.add_argument_group("engine passthrough")
    passthrough.add_argument("sglang_args", nargs=argparse.REMAINDER, metavar="-- ARGS",
                             help="after --: extra sglang.launch_server arguments, for every server")
    p.set_defaults(func=run)


def _topology(args: argparse.Namespace) -> Topology | None:
    """This host's GPUs; None where none are needed (router role) or a dry run names them itself."""
    from dsv4convert.serve.topology import TopologyError, discover

    if args.role == "router":
        return None
    try:
        return discover()
    except TopologyError as exc:
        if args.dry_run and args.gpu_family:
            return None
        lists = "--prefill-gpus 0,1,2,3 --decode-gpus 4,5,6,7" if args.pd else "--gpus 0,1,2,3"
        raise TopologyError(f"{exc} (to plan without GPUs here: --dry-run --gpu-family sm90|sm100|sm120 "
                            f"{lists})") from exc


def _gpu_family(args: argparse.Namespace, topology: Topology | None) -> str:
    from dsv4convert.serve.topology import TopologyError

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


def _inspect(args: argparse.Namespace) -> tuple[str, ModelConfig | V41Checkpoint | None]:
    """The variant to serve and the checkpoint's config (which draft it holds): :func:`served.inspect`."""
    from dsv4convert.serve import served

    return served.inspect(args.model, args.variant)


@dataclass(frozen=True)
class DraftChoice:
    """Whether the plan serves the checkpoint's drafter, and why, in the plan's words."""

    used: bool
    why: str
    carried: bool = True   # the checkpoint carries a drafter (what compare measured it to bring is worth saying)


def draft_choice(args: argparse.Namespace, config: ModelConfig | V41Checkpoint | None, family: str,
                 extra: tuple[str, ...]) -> DraftChoice:
    """Serve the drafter an official release ships by default, where SGLang runs it on ``family`` (DeepSeek-V4.1's
    DSpark drafter: on every family); ``--mtp`` insists (refused where it cannot run), ``--no-mtp`` declines,
    ``--check mtp`` needs it, and the user's own ``--speculative-*`` arguments decide for themselves."""
    from dsv4convert.engines import NO_DRAFT
    from dsv4convert.engines.sglang.rules import SPECULATIVE_ALGORITHM, variant_rules
    from dsv4convert.engines.sglang.server import DRAFT_LABELS
    from dsv4convert.models.deepseek_v4.layout import Drafter

    drafter = config.drafter if config is not None else None
    if any(a.startswith("--speculative-") for a in extra):
        return DraftChoice(False, "as your --speculative-* arguments after -- set it")
    label = f"the checkpoint's {DRAFT_LABELS[drafter or Drafter.MTP]} drafter"
    if args.mtp or args.check == "mtp":   # asked for: refused by the engine's rules where it cannot run
        return DraftChoice(True, f"{label} is served ({'--check mtp' if args.check == 'mtp' else '--mtp'})")
    if drafter is None:
        return DraftChoice(False, "none served: no config.json here to say whether the checkpoint carries a drafter "
                                  "(--mtp serves the one it has)", carried=False)
    if drafter is Drafter.NONE:
        return DraftChoice(False, f"none served: {NO_DRAFT}", carried=False)
    if args.mtp is False:
        return DraftChoice(False, f"{label} is not served (--no-mtp; drop it to serve the drafter)")
    note = None if getattr(config, "is_v41", False) else variant_rules(args.variant, family, drafter).mtp_note
    if note:
        return DraftChoice(False, f"{label} is not served: {note}")
    return DraftChoice(True, f"{label} is served by --speculative-algorithm {SPECULATIVE_ALGORITHM[drafter]}: "
                             "the default where the checkpoint carries one and SGLang runs it on "
                             f"{family}; --no-mtp serves without it")


def draft_statement(args: argparse.Namespace, choice: DraftChoice) -> str:
    """The plan's draft line, with what ``compare`` measured the drafter to bring when its report is there."""
    from dsv4convert.errors import FormatError
    from dsv4convert.serve import mtp

    report = args.expected_from or mtp.default_compare_report(args.model)
    line = f"# draft: {choice.why}"
    if choice.carried and report.exists():
        try:
            found = mtp.read_expected(report)
        except FormatError:   # a report without a DSpark section: nothing measured to say
            return line
        line += f"; compare expects {found['accept_length']:.2f} tokens accepted per verify step ({found['report']})"
    return line


def plan(args: argparse.Namespace, topology: Topology | None,
         config: ModelConfig | V41Checkpoint | None = None) -> tuple[list[launch.Command], list[str]]:
    """The commands to run, in start order, and warnings for the user (``args.variant`` must be set;
    ``config`` says which draft the checkpoint holds, the preview's MTP block when not given; a DeepSeek-V4.1
    checkpoint's Engram tables go where ``args.engram_placement`` says, the GPUs for ``auto`` until
    :func:`run` has fit's choice)."""
    from dsv4convert.engines.sglang.server import drafter_of
    from dsv4convert.serve import launch

    warnings: list[str] = []
    extra = tuple(args.sglang_args[1:] if args.sglang_args[:1] == ["--"] else args.sglang_args)
    backend, warning = launch.choose_transfer_backend(args.transfer_backend, topology.ib_devices if topology else ())
    if args.pd and warning:
        warnings.append(warning)
    family = _gpu_family(args, topology)
    options = launch.LaunchOptions(
        model=os.path.abspath(args.model), variant=args.variant, gpu_family=family, host=args.host,
        router_port=args.port, server_port=args.port, prefill_port=args.prefill_port, decode_port=args.decode_port,
        bootstrap_port=args.bootstrap_port, transfer_backend=backend,
        ib_devices=topology.ib_devices if topology else (), indexer_topk=args.indexer_topk,
        mtp=family != "" and draft_choice(args, config, family, extra).used,
        enable_metrics=args.metrics, extra_args=extra, **drafter_of(config),
        engram=({"auto": "gpu"}.get(args.engram_placement, args.engram_placement)
                if getattr(config, "is_v41", False) else None),
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
    from dsv4convert.serve.process import ServeError, http_post_json

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


ACCURACY_FLAGS = ("tasks", "limit", "num_fewshot", "eval_api", "eval_concurrency", "include_path", "lm_eval_args",
                  "min_recovery")


def _check_flags(args: argparse.Namespace) -> None:
    """Refuse flags that belong to another check than the one asked for."""
    from dsv4convert.serve import launch

    if args.indexer_topk and args.check != "recall":
        raise launch.LaunchError("--indexer-topk belongs to --check recall")
    if args.indexer_topk and args.pd:
        raise launch.LaunchError(
            "--indexer-topk needs the single-server form (no --pd): with PD the prompt's indexer runs on the "
            "prefill server, while the response (and its indexer_topk) comes from the decode server")
    if args.compare and not args.check:
        raise launch.LaunchError("--compare needs --check (it compares the new report with REPORT)")
    given = [f"--{name.replace('_', '-')}" for name in ACCURACY_FLAGS if getattr(args, name) is not None]
    if given and args.check != "accuracy":
        raise launch.LaunchError(f"{', '.join(given)} belong(s) to --check accuracy")
    if args.min_recovery is not None and not args.compare:
        raise launch.LaunchError("--min-recovery needs --compare BASE/accuracy.json (recovery is against a base)")
    if args.mtp is False and args.check == "mtp":
        raise launch.LaunchError("--no-mtp: --check mtp measures the drafter, which --no-mtp leaves out")
    if args.expected_from is not None and args.check != "mtp":
        raise launch.LaunchError("--expected-from belongs to --check mtp")
    if args.min_accept is not None and args.check != "mtp":
        raise launch.LaunchError("--min-accept belongs to --check mtp")
    if args.min_accept is not None and args.min_accept < 1.0:
        raise launch.LaunchError(f"--min-accept must be >= 1.0 (one token per verify step), got {args.min_accept}")


def run(args: argparse.Namespace) -> int:
    from dsv4convert.serve import accuracy, checks, served
    from dsv4convert.serve.process import ProcessGroup, ServeError

    _check_flags(args)
    if args.engine == "vllm":
        return _vllm(args)
    checks_here = args.role in (None, "router")  # a prefill or decode host only serves
    if args.check == "accuracy" and checks_here:
        accuracy.check_tasks(checks.eval_settings(args))
    base = checks.base_report(args) if checks_here else None
    expected = checks.expected_report(args) if checks_here else None
    args.variant, config = _inspect(args)
    topology = _topology(args)
    commands, warnings = plan(args, topology, config)
    engram_line = ""
    if getattr(config, "is_v41", False) and args.role != "router":
        family = _gpu_family(args, topology)
        args.engram_placement, engram_line = served.engram_placement(
            config, [c.server for c in commands if c.server is not None], family, args.engram_placement)
        commands, warnings = plan(args, topology, config)
    if args.tuned_configs:
        from dataclasses import replace

        from dsv4convert.tune.output import tuned_config_env

        env, tuned_warnings = tuned_config_env(args.tuned_configs)
        commands = [replace(c, env={**c.env, **env}) if c.role != "router" else c for c in commands]
        warnings += tuned_warnings
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    family = "" if args.role == "router" else _gpu_family(args, topology)
    if not getattr(config, "is_v41", False):   # V4.1: sized with its Engram placement above
        _refuse_what_cannot_fit(args, commands, family)
    extra = tuple(args.sglang_args[1:] if args.sglang_args[:1] == ["--"] else args.sglang_args)
    statement = draft_statement(args, draft_choice(args, config, family, extra)) if family else ""
    if args.dry_run:
        _print_plan(commands)
        for line in (statement, engram_line):
            if line:
                print(line)
        if args.check == "accuracy" and checks_here:
            for line in accuracy.dry_run_lines(checks.eval_settings(args), url=commands[-1].url, model=args.model,
                                               out=args.out, max_length=checks.model_max_length(args.model)):
                print(line)
        return 0
    for line in (statement, engram_line):
        if line:
            print(line)
    client_url = commands[-1].url
    failed = False
    with ProcessGroup(args.out / "logs") as group:
        start_and_wait(group, commands, args.startup_timeout)
        if args.metrics:
            _print_metrics_endpoints(commands)
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
            checks.print_compare(args, checks.run_recall(args, client_url, meta))
        elif args.check == "speed":
            checks.print_compare(args, checks.run_speed(args, client_url, meta))
        elif args.check == "accuracy":
            failed = not checks.run_accuracy(args, client_url, meta, group, base)
        elif args.check == "mtp":
            failed = not checks.run_mtp(args, client_url, meta, commands, base, expected)
        if not args.check or args.hold:
            print(f"serving at {client_url}; Ctrl-C stops every process")
            _hold(group)
    return 1 if failed else 0


def _vllm(args: argparse.Namespace) -> int:
    """``--engine vllm``: print vLLM's command for the single server (nothing is started)."""
    from dsv4convert.serve import launch, served

    if not args.dry_run or args.pd or args.role or args.check:
        raise launch.LaunchError("--engine vllm prints vLLM's command for one server: use it with --dry-run, without "
                                 "--pd, --role or --check (serve starts and checks SGLang)")
    args.variant, config = _inspect(args)
    topology = _topology(args)
    family = _gpu_family(args, topology)
    gpus = args.gpus or ([g.index for g in topology.gpus] if topology else None)
    if not gpus:
        raise launch.LaunchError("pass --gpus when nvidia-smi cannot list them")
    for line in served.vllm_lines(os.path.abspath(args.model), args.variant, config, family, len(gpus),
                                  args.engram_placement):
        print(line)
    return 0


def _refuse_what_cannot_fit(args: argparse.Namespace, commands: list[launch.Command], family: str) -> None:
    """``fit``'s verdict before any process starts: a server SGLang could not load is refused in one line
    (the card of ``family`` we serve on: H200, B200 or RTX PRO 6000), sized as each command will run."""
    from dsv4convert.fit import source, verdict
    from dsv4convert.serve import launch

    servers = [c for c in commands if c.server is not None]
    if not servers:
        return
    try:
        model = source.from_checkpoint(args.model)
    except CheckpointError as exc:
        if not args.dry_run:
            raise
        print(f"warning: not sized (fit needs the checkpoint's headers): {exc}", file=sys.stderr)
        return
    gpu = verdict.gpu_of_family(family)
    for command in servers:
        why = verdict.refusal(model, gpu, command.server)
        if why:
            raise launch.LaunchError(f"{args.model}: {why} (dsv4convert fit --model {args.model} shows every term)")


def _print_metrics_endpoints(commands: list[launch.Command]) -> None:
    for command in commands:
        if command.role == "router":
            print("Prometheus metrics: router on port 29000 (sglang_router's --prometheus-port default), /metrics")
        else:
            print(f"Prometheus metrics: {command.role} at {command.url}/metrics")


def _exited_tails(group: ProcessGroup) -> str:
    """Log tails of every started process that has already exited (why a request failed)."""
    from dsv4convert.serve.process import log_tail

    return "".join(f"\n{p.name} exited with status {p.popen.poll()}; last lines of {p.log_path}:\n"
                   f"{log_tail(p.log_path)}" for p in group.processes if p.popen.poll() is not None)


def _hold(group: ProcessGroup) -> None:
    """Serve until Ctrl-C, or until a server dies (then say why, and stop the rest)."""
    from dsv4convert.serve.process import ServeError, log_tail

    while True:
        for p in group.processes:
            code = p.popen.poll()
            if code is not None:
                raise ServeError(f"{p.name} exited with status {code} while serving; last lines of "
                                 f"{p.log_path}:\n{log_tail(p.log_path)}")
        time.sleep(1.0)

