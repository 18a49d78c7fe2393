"""``fit`` for DeepSeek-V4.1-Flash: each server of the launch, the native release, with the Engram tables on the
GPUs or in host memory, sized as SGLang 0.5.23 sizes it (:mod:`dsv4convert.engines.sglang.memory_v41`).

The launch is SGLang's defaults for V4.1 (``serve`` does not start V4.1 yet): no ``--mem-fraction-static``, the
default KV layout and attention backend, the ``flashinfer_mxfp4`` MoE runner SGLang picks for FP4 experts.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from dsv4convert.checkpoint import read_small_json

from dsv4convert.engines import Gpu
from dsv4convert.engines.memory import GIB, gib
from dsv4convert.engines.sglang import memory as v4
from dsv4convert.engines.sglang import memory_v41 as sizing
from dsv4convert.engines.sglang.server import Disaggregation, Server
from dsv4convert.fit.source_v41 import LABEL, PlannedV41, is_v41_config, planned
from dsv4convert.fit.verdict import FitError, roles

PLACEMENT_ENV = {"gpu": {}, "host-shared": {"SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE": "1",
                                            "SGLANG_DSV41_ENGRAM_HOST_TABLE_LAYOUT": "shared"},
                 "host-per-rank": {"SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE": "1",
                                   "SGLANG_DSV41_ENGRAM_HOST_TABLE_LAYOUT": "per_rank"}}


@dataclass(frozen=True)
class ServerFitV41:
    """One V4.1 server with one Engram placement (the JSON keys are these field names)."""

    role: str
    tp: int
    engram: str
    kv_layout: str
    weights_bytes_per_rank: int          # what the GPU holds: backbone (+ the tables' shard where on GPU)
    engram_gpu_bytes_per_rank: int
    engram_host_bytes_per_server: int
    engram_host_bytes_per_process: int
    mem_fraction_static: float
    min_mem_fraction_static: float
    kv_bytes_per_token: float
    kv_terms: dict
    swa_tokens: int
    fixed_bytes: int
    available_kv_bytes: int
    kv_tokens: int
    requests_at_context: int | None
    fits: bool


def plan_of(path: Path) -> PlannedV41 | None:
    """The DeepSeek-V4.1 release ``path`` (a config.json) describes, planned; None for another release's config."""
    config = read_small_json(path)
    return planned(config, str(path)) if is_v41_config(config) else None


def launch(gpu: Gpu, role: str, tp: int, placement: str, max_running: int | None) -> Server:
    """The server SGLang starts for V4.1 with its defaults, the Engram placement's environment."""
    return Server(model="MODEL", variant=LABEL, gpu_family=gpu.family, role=role, tp=tp,
                  max_running_requests=max_running, env=dict(PLACEMENT_ENV[placement]),
                  disaggregation=Disaggregation() if role in ("prefill", "decode") else None)


def size(plan: PlannedV41, gpu: Gpu, role: str, tp: int, placement: str, *, context: int | None = None,
         max_running: int | None = None) -> ServerFitV41:
    server = launch(gpu, role, tp, placement, max_running)
    weights = sizing.weights_per_rank(plan.tensors, server)
    engram = sizing.engram_placement(plan.config, tp, placement)
    on_gpu = weights.target + engram.gpu_bytes_per_rank
    fraction = v4.memory_fraction(server, gpu.mib)
    held = v4.budget(gpu.mib, fraction.used, on_gpu)
    cost = sizing.kv_cost(plan.config, server, fraction.chunked_prefill_size)
    full = sizing.kv_tokens(held.available_bytes, cost)
    needed = max(context or v4.V4_PAGE_SIZE, v4.V4_PAGE_SIZE)
    running = server.max_running_requests or v4.V4_MAX_RUNNING_REQUESTS
    return ServerFitV41(
        role=role, tp=tp, engram=placement, kv_layout=cost.layout, weights_bytes_per_rank=on_gpu,
        engram_gpu_bytes_per_rank=engram.gpu_bytes_per_rank,
        engram_host_bytes_per_server=engram.host_bytes_per_server,
        engram_host_bytes_per_process=engram.host_bytes_per_process, mem_fraction_static=fraction.used,
        min_mem_fraction_static=held.min_mem_fraction_static, kv_bytes_per_token=cost.bytes_per_full_token,
        kv_terms=cost.terms, swa_tokens=cost.swa_tokens, fixed_bytes=cost.fixed_bytes,
        available_kv_bytes=held.available_bytes, kv_tokens=full,
        requests_at_context=min(full // context, running) if context else None,
        fits=held.available_bytes > cost.fixed_bytes and full >= needed)


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


def run(args: argparse.Namespace, gpu: Gpu, plan: PlannedV41) -> int:
    """The table (or JSON) for V4.1: every server of the launch, once per Engram placement."""
    if args.mtp:
        raise FitError("--mtp: fit does not size DeepSeek-V4.1's DSpark drafter yet (its stages' weights and "
                       "caches); size the target without --mtp")
    if args.engine != "sglang":
        raise FitError(f"--engine {args.engine}: fit sizes DeepSeek-V4.1 for SGLang only so far")
    rows = [[size(plan, gpu, role, args.tp, placement, context=args.context, max_running=args.max_running)
             for role in roles(args.pd)] for placement in sizing.ENGRAM_PLACEMENTS]
    if args.json:
        print(json.dumps({"release": "DeepSeek-V4.1-Flash", "engine": "sglang", "gpu": gpu.name, "gpu_mib": gpu.mib,
                          "gpu_family": gpu.family, "count": args.count, "tp": args.tp, "pd": args.pd,
                          "context": args.context, "engram_table_bytes": sizing.engram_placement(
                              plan.config, args.tp, "gpu").table_bytes,
                          "servers": [asdict(f) for fits in rows for f in fits]}))
    else:
        table = sizing.engram_placement(plan.config, args.tp, "gpu").table_bytes
        print(f"SGLang on {gpu.name} ({gpu.mib} MiB, sm_{gpu.family[2:]}), DeepSeek-V4.1-Flash as released, "
              f"TP {args.tp}{' PD' if args.pd else ''}, {args.count} GPUs; Engram tables {gib(table)}")
        print(f"{'engram tables':18s} {'server':8s} {'GPU/rank':>10s}  {'fraction (min)':15s}  {'KV B/token':>10s}  "
              f"{'KV tokens':>11s}  verdict")
        for fits in rows:
            for fit in fits:
                verdict = "fits" if fit.fits else "DOES NOT FIT"
                if fit.fits and fit.requests_at_context is not None:
                    verdict += f"; {fit.requests_at_context} requests of --context"
                print(f"{fit.engram:18s} {fit.role:8s} {fit.weights_bytes_per_rank / GIB:6.1f} GiB  "
                      f"{fit.mem_fraction_static:.3f} ({fit.min_mem_fraction_static:.3f})  "
                      f"{fit.kv_bytes_per_token:10.1f}  {fit.kv_tokens:>11,d}  {verdict}")
            host = _host_line(fits, args.pd)
            if host:
                print(host.lstrip("\n"))
        layouts = sorted({f.kv_layout for fits in rows for f in fits})
        slots = ", ".join(f"{f.role} {f.swa_tokens:,}" for f in rows[0])
        print(f"KV layout {', '.join(layouts)} (SGLang's select_dsv4_kv_layout); the sliding-window pool is sized from "
              f"the request cap, not per token ({slots} slots, counted before the KV tokens); fraction: SGLang's "
              "default --mem-fraction-static, in brackets the smallest that holds the weights")
        print("estimated: free memory before loading = GPU total - 1536 MiB; the launch is SGLang's defaults "
              "(serve does not start V4.1 yet)")
    return 0 if any(all(f.fits for f in fits) for fits in rows) else 1
