"""``fit`` for DeepSeek-V4.1-Flash: each server of the launch, with the Engram tables on the GPUs or in host memory,
sized as SGLang 0.5.23 sizes it (:mod:`dsv4convert.engines.sglang.memory_v41`) or as vLLM 0.33.0 does
(:mod:`dsv4convert.engines.vllm.memory_v41`).

SGLang: the launch is the one ``serve`` starts (:func:`dsv4convert.engines.sglang.server.server_v41`): SGLang's
defaults for V4.1 and the checkpoint's variant, no ``--mem-fraction-static``, the default KV layout and attention
backend, the MoE runner SGLang picks for the variant's experts. ``engines/sglang/memory_v41.py::choose_placement`` is
the Engram placement ``serve`` uses by default and the model card prints.
vLLM: one server, ``serve``'s ``vllm serve`` command (``--kv-cache-dtype fp8 --block-size 256``, expert parallel at
TP > 1), each variant vLLM loads sized and each it refuses named with the reason (:func:`run_vllm`).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

from dsv4convert.checkpoint import read_small_json

from dsv4convert.engines import SGLANG, VLLM, VLLM_LABEL, Gpu
from dsv4convert.engines.config import v41_families
from dsv4convert.engines.memory import GIB, gib
from dsv4convert.engines.sglang import memory as v4
from dsv4convert.engines.sglang import memory_v41 as sizing
from dsv4convert.engines.sglang.memory_v41 import PlacementChoice, ServerFitV41, choose_placement, size_server
from dsv4convert.engines.sglang.server import Server, server_v41
from dsv4convert.engines.vllm import memory_v41 as vllm_sizing
from dsv4convert.engines.vllm import quant_config as vllm_quant
from dsv4convert.engines.vllm.server import VLLM_ENGRAM_DEFAULT
from dsv4convert.fit.source_v41 import PLANNED, PlannedV41, from_checkpoint, is_v41_config, planned
from dsv4convert.fit.verdict import FitError, SglangSizing, roles
from dsv4convert.models.deepseek_v4.layout import Drafter


def plan_of(path: Path, model: str | None = None) -> PlannedV41 | None:
    """The DeepSeek-V4.1 checkpoint ``model`` (headers only), or without one the release ``path`` (a config.json)
    describes, planned; None for another release's."""
    if model:
        return from_checkpoint(model)
    config = read_small_json(path)
    return planned(config, str(path)) if is_v41_config(config) else None


def launch(gpu: Gpu, role: str, tp: int, placement: str, max_running: int | None, *,
           plan: PlannedV41 | None = None, mtp: bool = False) -> Server:
    """The server ``serve`` starts for V4.1 on ``gpu``'s family, with the Engram tables at ``placement`` (and, with
    ``mtp``, the DSpark drafter ``plan``'s config announces: DSPARK, its block size)."""
    draft = {}
    if mtp:
        dspark = plan.config.dspark if plan is not None else None
        if dspark is None:
            raise FitError("--mtp: this DeepSeek-V4.1 config announces no DSpark drafter (no dspark_* keys)")
        draft = {"mtp": True, "drafter": Drafter.DSPARK, "dspark_block_size": dspark.block_size}
    return server_v41("MODEL", gpu.family, variant=plan.variant if plan is not None else "native", role=role, tp=tp,
                      engram=placement, max_running_requests=max_running, **draft)


def size(plan: PlannedV41, gpu: Gpu, role: str, tp: int, placement: str, *, context: int | None = None,
         max_running: int | None = None, mtp: bool = False) -> ServerFitV41:
    return size_server(plan.config, plan.tensors, gpu, launch(gpu, role, tp, placement, max_running, plan=plan, mtp=mtp),
                       context=context)


def _host_line(fits: list[ServerFitV41], pd: bool) -> str:
    """Host memory the tables take, per server and per process, and per NUMA node where that is determined."""
    fit = fits[0]
    if not fit.engram_host_bytes_per_server:
        return ""
    line = (f"{'':28s} host: {gib(fit.engram_host_bytes_per_server)} per server (TP group), "
            f"{gib(fit.engram_host_bytes_per_process)} mapped by each rank's process")
    if pd:
        line += f"; per NUMA node, one server each: {gib(fit.engram_host_bytes_per_server)}"
    elif fit.engram == "host-per-rank":
        line += "; per NUMA node: the shards of the ranks it runs"
    else:
        line += "; one buffer for the host (its pages sit where first written: not computed)"
    return "\n" + line


def _choice(plan: PlannedV41, gpu: Gpu, args: argparse.Namespace) -> PlacementChoice:
    servers = [launch(gpu, role, args.tp, "gpu", args.max_running, plan=plan, mtp=args.mtp) for role in roles(args.pd)]
    return choose_placement(plan.config, plan.tensors, gpu, servers, context=args.context)


def _draft_line(fit: ServerFitV41) -> str:
    """The DSpark drafter's share of a server (nothing without it)."""
    if not fit.drafter:
        return ""
    line = (f"{'':18s} {'':8s} of which draft (DSpark, {fit.draft_tokens} tokens verified per step): "
            f"{gib(fit.draft_weights_bytes_per_rank)} of weights, its own cache {gib(fit.draft_kv_bytes)}")
    if fit.draft_kv_unbudgeted_bytes:
        line += (f" ({gib(fit.draft_kv_unbudgeted_bytes)} beyond the one draft layer SGLang's KV sizing sets aside: "
                 "taken from the activation reserve)")
    return "\n" + line


def assumptions(plan: PlannedV41, gpu: Gpu, args: argparse.Namespace, rows: list[list[ServerFitV41]]) -> list[str]:
    """What the table takes for given, one line each: the context and concurrency, the KV cache (dtype and layout
    on this family), where the Engram tables go, the drafter."""
    first = rows[0]
    running = args.max_running or v4.V4_MAX_RUNNING_REQUESTS
    context = (f"{args.context:,} tokens per request (--context)" if args.context
               else "not given (--context): KV tokens are the whole pool, concurrent requests x context <= KV tokens")
    layouts = ", ".join(f"{f.role} {f.kv_layout}" for f in first)
    dspark = plan.config.dspark
    if args.mtp:
        drafter = (f"the DSpark drafter ({dspark.stages} stages, block {dspark.block_size}: "
                   f"{first[0].draft_tokens} tokens verified per step), its weights and caches counted (--mtp)")
    else:
        drafter = ("none (without --mtp; the config's DSpark drafter, served by serve --mtp, is not counted)"
                   if dspark else "none (the config announces no drafter)")
    return [f"assumes: context {context}",
            f"assumes: concurrency up to {running} running requests per server "
            f"({'--max-running' if args.max_running else 'SGLang V4 default'}); the sliding-window pool is sized "
            "for all of them",
            f"assumes: KV cache fp8_e4m3 (SGLang's default for V4.1), layout on {gpu.family}: {layouts} "
            "(SGLang's select_dsv4_kv_layout; V4.1's packed layouts on sm_100 only)",
            f"assumes: Engram tables sized in every placement; serve's default: "
            f"{_choice(plan, gpu, args).placement or 'none fits'}",
            f"assumes: drafter {drafter}"]


def run_sglang(args: argparse.Namespace, gpu: Gpu, plan: PlannedV41) -> int:
    """The table (or JSON) for V4.1 with SGLang: every server of the launch, once per Engram placement."""
    problem = v41_families(plan.variant)[SGLANG][gpu.family]
    if problem:
        raise FitError(f"{plan.label}: {SglangSizing.label} does not run this {plan.variant} checkpoint on "
                       f"{gpu.family}: {problem}")
    rows = [[size(plan, gpu, role, args.tp, placement, context=args.context, max_running=args.max_running,
                  mtp=args.mtp) for role in roles(args.pd)] for placement in sizing.ENGRAM_PLACEMENTS]
    notes = assumptions(plan, gpu, args, rows)
    if args.json:
        print(json.dumps({"release": "DeepSeek-V4.1-Flash", "engine": "sglang", "variant": plan.variant,
                          "model": plan.label, "gpu": gpu.name, "gpu_mib": gpu.mib,
                          "gpu_family": gpu.family, "count": args.count, "tp": args.tp, "pd": args.pd,
                          "mtp": args.mtp, "context": args.context, "engram_table_bytes": sizing.engram_placement(
                              plan.config, args.tp, "gpu").table_bytes,
                          "assumes": [n.removeprefix("assumes: ") for n in notes],
                          "servers": [asdict(f) for fits in rows for f in fits]}))
    else:
        table = sizing.engram_placement(plan.config, args.tp, "gpu").table_bytes
        print(f"{SglangSizing.label} on {gpu.name} ({gpu.mib} MiB, sm_{gpu.family[2:]}), DeepSeek-V4.1-Flash "
              f"{'as released' if plan.label == plan.variant == 'native' else f'{plan.label} ({plan.variant})'}, "
              f"TP {args.tp}{' PD' if args.pd else ''}{' + draft' if args.mtp else ''}, {args.count} GPUs; "
              f"Engram tables {gib(table)}")
        print(f"{'engram tables':18s} {'server':8s} {'GPU/rank':>10s}  {'fraction (min)':15s}  {'KV B/token':>10s}  "
              f"{'KV tokens':>11s}  verdict")
        for fits in rows:
            for fit in fits:
                verdict = "fits" if fit.fits else "DOES NOT FIT"
                if fit.fits and fit.requests_at_context is not None:
                    verdict += f"; {fit.requests_at_context} requests of --context"
                print(f"{fit.engram:18s} {fit.role:8s} {fit.weights_bytes_per_rank / GIB:6.1f} GiB  "
                      f"{fit.mem_fraction_static:.3f} ({fit.min_mem_fraction_static:.3f})  "
                      f"{fit.kv_bytes_per_token:10.1f}  {fit.kv_tokens:>11,d}  {verdict}{_draft_line(fit)}")
            host = _host_line(fits, args.pd)
            if host:
                print(host.lstrip("\n"))
        slots = ", ".join(f"{f.role} {f.swa_tokens:,}" for f in rows[0])
        print(f"the sliding-window pool is sized from the request cap, not per token ({slots} slots, counted before "
              "the KV tokens); fraction: SGLang's default --mem-fraction-static, in brackets the smallest that holds "
              "the weights")
        print("\n".join(notes))
        print("estimated: free memory before loading = GPU total - 1536 MiB; the launch is SGLang's defaults, as "
              "serve starts it")
    return 0 if any(all(f.fits for f in fits) for fits in rows) else 1


# ---------------------------------------------------------------------------------------------------- vLLM 0.33.0

def vllm_refusal(plan: PlannedV41, gpu: Gpu) -> str | None:
    """Why vLLM 0.33.0 does not load ``plan`` on ``gpu``'s family (None: it does): its quantization_config as vLLM
    reads it (``engines/vllm/quant_config.py::v41_problem``: FP8 experts in 32x32 blocks, compressed-tensors W4A16),
    then the family."""
    quant = (plan.raw or {}).get("quantization_config")
    return vllm_quant.v41_problem(quant, plan.variant) or v41_families(plan.variant)[VLLM][gpu.family]


def _vllm_assumptions(plan: PlannedV41, gpu: Gpu, args: argparse.Namespace) -> list[str]:
    """What the vLLM table takes for given, one line each."""
    attention = vllm_sizing.attention_class(gpu.family, args.tp, plan.config)
    records = vllm_sizing.kv_records(gpu.family, attention)
    context = (f"{args.context:,} tokens per request (--context)" if args.context
               else "not given (--context): KV tokens are the whole pool, concurrent requests x context <= KV tokens")
    dspark = plan.config.dspark
    drafter = (f"the DSpark drafter ({dspark.stages} stages, num_speculative_tokens {dspark.block_size}), its weights "
               "counted (--mtp)" if args.mtp else "none (without --mtp)")
    return [f"assumes: context {context}",
            "assumes: concurrency vLLM's scheduler limits; each request's sliding-window and compressor-ring blocks "
            "come out of the same pool (not restated: KV tokens are an upper bound)",
            f"assumes: KV cache --kv-cache-dtype fp8 -> {records.cache_dtype} on {gpu.family} ({attention} attention, "
            f"vLLM's _select_dsv4_attn_cls): sliding-window record {records.swa_bytes} B, compressed "
            f"{records.compressed_bytes} B, indexer K {vllm_sizing.indexer_entry_bytes(plan.config.index_head_dim)} B "
            f"(FP8), pages aligned to {records.alignment} B; only the KV-source layers' caches grow with the context",
            f"assumes: Engram tables sized in both placements; serve's default: {VLLM_ENGRAM_DEFAULT} (vLLM's "
            "EngramConfig.cpu_offload=True: each rank pins its hash-head shard in host memory)",
            f"assumes: drafter {drafter}"]


def run_vllm(args: argparse.Namespace, gpu: Gpu, plan: PlannedV41) -> int:
    """The table (or JSON) for V4.1 with vLLM: one server of ``--tp`` GPUs per variant and Engram placement; without
    ``--model`` the release and every variant ``convert`` writes, those vLLM refuses named with the reason."""
    plans = [plan] if args.model else [plan, *(planned(read_small_json(args.config), str(args.config), v)
                                               for v in PLANNED[1:])]
    rows, refused = [], []
    for item in plans:
        why = vllm_refusal(item, gpu)
        if why is None:
            rows += [(item, vllm_sizing.size_server(item.config, item.tensors, gpu, args.tp, p, context=args.context,
                                                     mtp=args.mtp))
                     for p in vllm_sizing.ENGRAM_PLACEMENTS]
        elif args.model:
            raise FitError(f"{item.label}: {VLLM_LABEL} does not load this {item.variant} checkpoint: "
                           f"{why}")
        else:
            refused.append((item.label, why))
    notes = _vllm_assumptions(plan, gpu, args)
    table = vllm_sizing.engram_placement(plan.config, args.tp, "gpu").table_bytes
    if args.json:
        print(json.dumps({"release": "DeepSeek-V4.1-Flash", "engine": "vllm", "gpu": gpu.name, "gpu_mib": gpu.mib,
                          "gpu_family": gpu.family, "count": args.count, "tp": args.tp, "pd": args.pd,
                          "mtp": args.mtp, "context": args.context, "engram_table_bytes": table,
                          "assumes": [n.removeprefix("assumes: ") for n in notes],
                          "estimated": list(vllm_sizing.ESTIMATES),
                          "servers": [{"variant": item.label, **asdict(f)} for item, f in rows],
                          "not_served": [{"variant": label, "why": why} for label, why in refused]}))
    else:
        print(f"{VLLM_LABEL} on {gpu.name} ({gpu.mib} MiB, sm_{gpu.family[2:]}), DeepSeek-V4.1-Flash, "
              f"TP {args.tp} (expert parallel){' + draft' if args.mtp else ''}, {args.count} GPUs; Engram tables "
              f"{gib(table)}")
        print(f"{'variant':18s} {'engram tables':14s} {'GPU/rank':>10s}  {'utilization (min)':18s}  "
              f"{'KV B/token':>10s}  {'KV tokens':>11s}  verdict")
        for item, fit in rows:
            verdict = "fits" if fit.fits else "DOES NOT FIT"
            if fit.fits and fit.requests_at_context is not None:
                verdict += f"; {fit.requests_at_context:,} requests of --context"
            print(f"{item.label:18s} {fit.engram:14s} {fit.weights_bytes_per_rank / GIB:6.1f} GiB  "
                  f"{fit.mem_fraction_static:.3f} ({fit.min_mem_fraction_static:.3f})     "
                  f"{fit.kv_bytes_per_token:10.1f}  {fit.kv_tokens:>11,d}  {verdict}")
            if fit.engram_host_bytes_per_server:
                print(f"{'':33s} host: {gib(fit.engram_host_bytes_per_process)} pinned by each rank, "
                      f"{gib(fit.engram_host_bytes_per_server)} per server")
            if fit.drafter:
                print(f"{'':33s} of which draft (DSpark, {fit.draft_tokens} tokens verified per step): "
                      f"{gib(fit.draft_weights_bytes_per_rank)} of weights")
        for label, why in refused:
            print(f"{label:18s} not served: {why}")
        print("utilization: vLLM's default --gpu-memory-utilization, in brackets the smallest that holds the weights")
        print("\n".join(notes))
        for line in vllm_sizing.ESTIMATES:
            print(f"estimated: {line}")
    return 0 if any(f.fits for _, f in rows) else 1


RUNS = {SGLANG: run_sglang, VLLM: run_vllm}


def run(args: argparse.Namespace, gpu: Gpu, plan: PlannedV41, engine: str) -> int:
    """``fit`` for a V4.1 release or checkpoint, as ``engine`` (a :data:`dsv4convert.fit.verdict.SIZINGS` name)
    sizes it."""
    return RUNS[engine](args, gpu, plan)
