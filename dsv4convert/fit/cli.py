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
from typing import TYPE_CHECKING

from dsv4convert.engines import ENGINES, GPU_FAMILIES, GPUS, SGLANG, SGLANG_LABEL, EngineError, family_label

if TYPE_CHECKING:
    from dsv4convert.engines.served import ServedModel
    from dsv4convert.fit import verdict

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
            "KV tokens are the full pool: concurrent requests x context <= KV tokens.\n"
            "Exit status: 0 when the --model fits (without --model: when at least one variant does), else 1."
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
                        "V4-Flash-0731's, with its DSpark drafter; the preview's is data/deepseek-v4-flash-config.json; "
                        "a DeepSeek-V4.1-Flash config sizes that release with its Engram tables on GPU or host)")
    p.add_argument("--gpu", default="h200",
                   help=f"{', '.join(GPUS)}, or a memory size in MiB with --gpu-family (default h200)")
    p.add_argument("--gpu-family", choices=GPU_FAMILIES,
                   help="required with --gpu MiB: the launch rules and reserve to size by: "
                        + ", ".join(f"{f} ({family_label(f)})" for f in GPU_FAMILIES))
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
    p.add_argument("--engine", choices=ENGINES, default=SGLANG,
                   help="sglang (computed), or vllm (one server; the profiled activation peak is not known without "
                        "a GPU: its KV tokens are an upper bound, see 'estimated')")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)


def _sources(args: argparse.Namespace) -> list[ServedModel]:
    from dsv4convert.checkpoint import read_small_json
    from dsv4convert.fit import source

    if args.model:
        return [source.from_checkpoint(args.model)]
    return source.shipped(read_small_json(args.config), str(args.config))


_COLUMNS = f"{'variant':18s} {'server':8s} {'weights/GPU':>11s}  {'fraction (default, min)':25s}  " \
           f"{'KV B/token':>10s}  {'KV tokens':>11s}  verdict"


def _title(label: str, gpu: verdict.Gpu, args: argparse.Namespace) -> str:
    """The first line: the engine, the GPU and its family in a user's terms, the launch."""
    from dsv4convert.engines import GPUS, family_label

    card = (f"{gpu.name} ({gpu.mib} MiB, sm_{gpu.family[2:]})" if args.gpu in GPUS
            else f"a {gpu.mib} MiB sm_{gpu.family[2:]} GPU ({family_label(gpu.family)} rules)")
    return (f"{label} on {card}, TP {args.tp}{' PD' if args.pd else ''}{' + draft' if args.mtp else ''}, "
            f"{args.count} GPUs")


def _legend(sizing: verdict.SglangSizing, fits: list[verdict.ServerFit]) -> str:
    """What the fraction column shows, under the table: which fraction the launch uses and why, and what the two
    bracketed figures are (the one column a reader cannot guess)."""
    set_by_serve = sorted({fit.mem_fraction_static for fit in fits if fit.mem_fraction_static
                           != fit.default_mem_fraction_static})
    source = (f"serve sets {', '.join(f'{f:.3f}' for f in set_by_serve)} on this family (the engine's cookbook), "
              "not the default" if set_by_serve else "serve keeps the engine's default")
    return (f"fraction: {sizing.fraction}; {source}; in brackets the engine's default and the smallest that holds "
            "the weights: a server whose fraction is below that DOES NOT FIT")


def _line(label: str, fit: verdict.ServerFit, best: int | None, servers: int, count: int) -> str:
    from dsv4convert.engines import memory as sizing

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
    from dsv4convert.engines import memory as sizing

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


def _refuse(args: argparse.Namespace, sizing: verdict.SglangSizing) -> None:
    """Flags fit would otherwise accept and not act on (one error line each)."""
    from dsv4convert.fit import verdict

    if args.ep:
        raise verdict.FitError("--ep: fit sizes the launch serve makes, and serve starts SGLang with tensor parallelism "
                               "only and vLLM with --enable-expert-parallel already (whole experts per rank: the same "
                               "routed-expert bytes per GPU, 256 experts / TP)")
    sizing.refuse(pd=args.pd, max_running=args.max_running)


def _next(rows: list[tuple[ServedModel, verdict.ServerFit, int | None]], context: int | None) -> list[str]:
    """What fits, ranked by what the user gets: KV tokens per server (and requests of --context), with what each
    keeps of the release; the release itself is named as such, never as a conversion."""
    from dsv4convert.fit import source

    fitting: dict[str, list[verdict.ServerFit]] = {}
    for src, fit, _ in rows:
        fitting.setdefault(src.label, []).append(fit)
    ranked = sorted(((min(f.kv_tokens for f in fits), label, fits) for label, fits in fitting.items()
                     if all(f.fits for f in fits)), key=lambda item: (-item[0], item[1]))
    if not ranked:
        return ["nothing fits: more GPUs per server (--tp), another --gpu, or a shorter --context"]
    lines = ["next: what fits, most KV tokens per server first (concurrent requests x context <= KV tokens):"]
    for place, (kv, label, fits) in enumerate(ranked, start=1):
        requests = (f", {min(f.requests_at_context or 0 for f in fits):,} requests of {context:,} tokens"
                    if context else "")
        how = "serve it as released" if source.SHIPPED.get(label) is None else f"dsv4convert to-{label}"
        lines.append(f"  {place}. {label:16s} {kv:>11,} KV tokens{requests}; "
                     f"{source.QUALITY.get(label, 'as planned')}: {how}")
    lines.append("then: dsv4convert fit --model DIR (the checkpoint itself, headers only)")
    return lines


def run(args: argparse.Namespace) -> int:
    from dsv4convert.fit import v41, verdict

    gpu = verdict.gpu_of(args.gpu, args.gpu_family)
    verdict.check_gpu(gpu)
    verdict.check_launch(gpu, args.count, args.tp, args.pd)
    sizing = verdict.SIZINGS[args.engine]
    _refuse(args, sizing)
    plan = v41.plan_of(args.config, args.model)
    if plan is not None:
        return v41.run(args, gpu, plan, sizing.name)
    options = {"mtp": args.mtp, "context": args.context, "max_running": args.max_running}
    rows, skipped = [], []
    for src in _sources(args):
        for role in verdict.roles(args.pd):
            try:
                fit = sizing.size(src, gpu, role, args.tp, **options)
            except (verdict.FitError, EngineError) as exc:
                if args.model:
                    raise
                skipped.append((src.label, exc.detail))   # a variant serve refuses here (its MTP draft, its layout)
                break
            rows.append((src, fit, None if fit.fits else verdict.smallest_tp(src, gpu, role, sizing=sizing,
                                                                             **options)))
    if args.json:
        print(json.dumps({"engine": sizing.label.lower(), "gpu": gpu.name, "gpu_mib": gpu.mib,
                          "gpu_family": gpu.family, "count": args.count,
                          "tp": args.tp, "pd": args.pd, "mtp": args.mtp, "context": args.context,
                          "estimated": list(sizing.estimated),
                          "variants": [{"variant": src.label, "serves_as": src.variant, **fit.as_dict(),
                                        "smallest_tp": best if not fit.fits else args.tp}
                                       for src, fit, best in rows],
                          "not_served": [{"variant": label, "why": why} for label, why in skipped]}))
    else:
        print(_title(sizing.label, gpu, args))
        print(_COLUMNS)
        for src, fit, best in rows:
            print(_line(src.label, fit, best, len(verdict.roles(args.pd)), args.count))
        for label, why in skipped:
            print(f"{label:18s} not served: {why}")
        if rows:
            print(_legend(sizing, [fit for _, fit, _ in rows]))
        for line in sizing.estimated:
            print(f"estimated: {line}")
        if not args.model:
            print("\n".join(_next(rows, args.context)))
    fitting = {src.label for src, _, _ in rows} - {src.label for src, fit, _ in rows if not fit.fits}
    # With --model, whether it fits; without, whether any variant does (the question the table answers).
    return 0 if (all(fit.fits for _, fit, _ in rows) if args.model else fitting) else 1
