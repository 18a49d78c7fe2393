"""``dsv4convert fit``: will a variant serve on these GPUs, and with how many tokens of KV cache.

Computed as SGLang 0.5.23 computes it (docs/fit.md lists every term with its SGLang function): the
servers ``serve`` would start (PD prefill and decode, or one), the weights each TP rank holds, the
default ``--mem-fraction-static`` and its reserve terms, the V4 KV pool's bytes per token and the
tokens it holds, the smallest fraction SGLang would load with, and a verdict.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dsv4convert.checkpoint import read_small_json
from dsv4convert.engines import LABELS, SGLANG, SGLANG_LABEL, VLLM, EngineError
from dsv4convert.engines import memory as sizing
from dsv4convert.engines.served import ServedModel
from dsv4convert.engines.vllm.memory import ESTIMATES as VLLM_ESTIMATED
from dsv4convert.fit import source, verdict
from dsv4convert.layout import ModelConfig

# The official release (V4-Flash-0731, DSpark drafter); the preview's config is data/deepseek-v4-flash-config.json.
DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "data" / "deepseek-v4-flash-0731-config.json"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "fit",
        help=f"will a variant serve on these GPUs, and with how many tokens of KV cache (as {SGLANG_LABEL} sizes it)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Size each server `serve` would start (with --pd: prefill and decode, each on --tp GPUs) the way\n"
            f"{SGLANG_LABEL} does: weights per TP rank from the checkpoint's tensor bytes and SGLang's split and\n"
            "load rules, SGLang's default --mem-fraction-static and its reserve terms (or the one the launch\n"
            "sets), the V4 KV pool's bytes per token (page-padded entries, sliding-window pool, compressed\n"
            "caches, indexer, compressor state), the KV tokens it leaves, the smallest fraction that loads,\n"
            "and a verdict. Without --model: every shipped variant planned from the released config.json\n"
            "(no weights needed; one layer of each kind planned and counted: about 2 s for the table).\n"
            "KV tokens are the full pool: concurrent requests x context <= KV tokens."
        ),
        epilog=(
            "examples:\n"
            "  dsv4convert fit --gpu rtx-pro-6000 --count 8 --tp 4 --pd          (every shipped variant)\n"
            "  dsv4convert fit --model out/nvfp4 --gpu rtx-pro-6000 --tp 4 --pd --mtp --context 65536\n"
            "  dsv4convert fit --model out/fp8 --gpu 81559 --gpu-family sm90 --tp 8 --json\n"
            "details: docs/fit.md"
        ),
    )
    p.add_argument("--model", help="checkpoint directory or Hub repo id (headers only); default: every shipped variant")
    p.add_argument("--config", type=Path, default=DEFAULT_CONFIG,
                   help="without --model: the native config.json to plan the variants from (default: the official "
                        "V4-Flash-0731's, with its DSpark drafter; the preview's is data/deepseek-v4-flash-config.json)")
    p.add_argument("--gpu", default="h200", help=f"{', '.join(verdict.GPUS)} or a memory size in MiB (default h200)")
    p.add_argument("--gpu-family", choices=("sm90", "sm100", "sm120"), help="with --gpu MiB: the launch rules to use")
    p.add_argument("--count", type=int, default=8, help="GPUs on the host (default 8)")
    p.add_argument("--tp", type=int, default=4, help="tensor-parallel size of each server (default 4)")
    p.add_argument("--ep", action="store_true",
                   help="refused: fit sizes serve's launch (SGLang: TP only; vLLM: expert parallel already)")
    p.add_argument("--pd", action="store_true", help="prefill and decode servers, each on --tp GPUs")
    p.add_argument("--mtp", action="store_true",
                   help="with the checkpoint's draft (its weights and caches): the preview's MTP block under EAGLE, "
                        "0731's DSpark drafter under DSPARK")
    p.add_argument("--max-running", type=int, help="--max-running-requests (SGLang's V4 default: 256)")
    p.add_argument("--context", type=int, help="tokens per request: report how many such requests fit")
    p.add_argument("--engine", choices=("sglang", "vllm"), default="sglang",
                   help="sglang (computed), or vllm (one server; the profiled activation peak is not known without "
                        "a GPU: its KV tokens are an upper bound, see 'estimated')")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)


def _sources(args: argparse.Namespace) -> list[ServedModel]:
    if args.model:
        return [source.from_checkpoint(args.model)]
    config = read_small_json(args.config)
    ModelConfig.from_dict(config, source=str(args.config))   # one error line for a config that is not V4
    return [source.planned(variant, config) for variant in source.SHIPPED]


_COLUMNS = f"{'variant':18s} {'server':8s} {'weights/GPU':>11s}  {'fraction (default, min)':25s}  " \
           f"{'KV B/token':>10s}  {'KV tokens':>11s}  verdict"


def _header(engine: str) -> list[str]:
    """The table's column names, and what its fraction is (the one word a reader cannot guess)."""
    fraction = ("fraction: vLLM's --gpu-memory-utilization, the share of GPU memory it may use" if engine == "vllm"
                else "fraction: SGLang's --mem-fraction-static, the share of GPU memory it gives weights and KV cache "
                     "(the rest: activations, CUDA graphs); min: the smallest it loads with")
    return [fraction, _COLUMNS]


def _line(label: str, fit: verdict.ServerFit, best: int | None, servers: int, count: int) -> str:
    gib = sizing.GIB
    fraction = (f"{fit.mem_fraction_static:.3f} ({fit.default_mem_fraction_static:.3f}, "
                f"{fit.min_mem_fraction_static:.3f})")
    head = (f"{label:18s} {fit.role:8s} {fit.weights_bytes_per_rank / gib:7.1f} GiB  {fraction:25s}  "
            f"{fit.kv_bytes_per_token:10.0f}  {fit.kv_tokens:>11,d}  ")
    if fit.fits:
        head += "fits"
    elif best is None:
        head += f"DOES NOT FIT ({sizing.gib(fit.shortfall_bytes)} short; no TP up to 8 fits)"
    elif best * servers > count:
        head += (f"DOES NOT FIT ({sizing.gib(fit.shortfall_bytes)} short; TP {best} would, but {servers} servers of "
                 f"TP {best} need {best * servers} GPUs and --count is {count})")
    else:
        head += f"DOES NOT FIT ({sizing.gib(fit.shortfall_bytes)} short; --tp {best} fits)"
    if fit.requests_at_context is not None:
        head += f"; {fit.requests_at_context} requests of --context"
    return head + _draft_line(fit)


def _draft_line(fit: verdict.ServerFit) -> str:
    """The draft's share of a server, on its own line (nothing without a draft)."""
    if not fit.drafter:
        return ""
    line = (f"\n{'':18s} {'':8s} of which draft ({fit.drafter}, {fit.draft_tokens} tokens verified per step): "
            f"{sizing.gib(fit.draft_weights_bytes_per_rank)} of weights")
    if fit.draft_kv_bytes:
        line += f", its own cache {sizing.gib(fit.draft_kv_bytes)}"
        if fit.draft_kv_unbudgeted_bytes:
            line += (f" ({sizing.gib(fit.draft_kv_unbudgeted_bytes)} beyond the one draft layer SGLang's KV sizing "
                     "sets aside: taken from the activation reserve)")
    return line


def _refuse(args: argparse.Namespace) -> None:
    """Flags fit would otherwise accept and not act on (one error line each)."""
    if args.ep:
        raise verdict.FitError("--ep: fit sizes the launch serve makes, and serve starts SGLang with tensor parallelism "
                               "only and vLLM with --enable-expert-parallel already (whole experts per rank: the same "
                               "routed-expert bytes per GPU, 256 experts / TP)")
    if args.engine == "vllm" and (args.pd or args.max_running):
        flag = "--pd" if args.pd else "--max-running"
        raise verdict.FitError(f"{flag}: serve starts vLLM as one server with its own scheduler limits; "
                               "fit sizes that (drop the flag or use --engine sglang)")


def _size(src: ServedModel, gpu: verdict.Gpu, role: str, args: argparse.Namespace) -> verdict.ServerFit:
    if args.engine == "vllm":
        return verdict.vllm_server(src, gpu, args.tp, mtp=args.mtp, context=args.context)
    return verdict.sglang_server(src, gpu, role, args.tp, mtp=args.mtp, context=args.context,
                                 max_running=args.max_running)


def _smallest_tp(src: ServedModel, gpu: verdict.Gpu, role: str, args: argparse.Namespace) -> int | None:
    if args.engine == "vllm":
        return next((tp for tp in verdict.TP_SIZES
                     if verdict.vllm_server(src, gpu, tp, mtp=args.mtp, context=args.context).fits), None)
    return verdict.smallest_tp(src, gpu, role, mtp=args.mtp, context=args.context, max_running=args.max_running)


def run(args: argparse.Namespace) -> int:
    gpu = verdict.gpu_from(args.gpu, args.gpu_family)
    verdict.check_gpu(gpu)
    verdict.check_launch(gpu, args.count, args.tp, args.pd)
    _refuse(args)
    rows, skipped = [], []
    for src in _sources(args):
        for role in verdict.roles(args.pd):
            try:
                fit = _size(src, gpu, role, args)
            except (verdict.FitError, EngineError) as exc:
                if args.model:
                    raise
                skipped.append((src.label, exc.detail))   # a variant serve refuses here (its MTP draft, its layout)
                break
            rows.append((src, fit, None if fit.fits else _smallest_tp(src, gpu, role, args)))
    engine = LABELS[VLLM if args.engine == "vllm" else SGLANG]
    estimated = VLLM_ESTIMATED if args.engine == "vllm" else sizing.ESTIMATED
    if args.json:
        print(json.dumps({"engine": engine.lower(), "gpu": gpu.name, "gpu_mib": gpu.mib, "count": args.count,
                          "tp": args.tp, "pd": args.pd, "mtp": args.mtp, "context": args.context,
                          "estimated": list(estimated),
                          "variants": [{"variant": src.label, "serves_as": src.variant, **fit.as_dict(),
                                        "smallest_tp": best if not fit.fits else args.tp}
                                       for src, fit, best in rows],
                          "not_served": [{"variant": label, "why": why} for label, why in skipped]}))
    else:
        print(f"{engine} on {gpu.name} ({gpu.mib} MiB, {gpu.family}), TP {args.tp}"
              f"{' PD' if args.pd else ''}{' + draft' if args.mtp else ''}, {args.count} GPUs")
        for line in _header(args.engine):
            print(line)
        for src, fit, best in rows:
            print(_line(src.label, fit, best, len(verdict.roles(args.pd)), args.count))
        for label, why in skipped:
            print(f"{label:18s} not served: {why}")
        for line in estimated:
            print(f"estimated: {line}")
    return 0 if all(fit.fits for _, fit, _ in rows) else 1
