"""``fit`` for DeepSeek-V4.1-Flash: each server of the launch, the native release, with the Engram tables on the
GPUs or in host memory, sized as SGLang 0.5.23 sizes it (:mod:`dsv4convert.engines.sglang.memory_v41`).

The launch is the one ``serve`` starts (:func:`dsv4convert.engines.sglang.server.server_v41`): SGLang's defaults
for V4.1, no ``--mem-fraction-static``, the default KV layout and attention backend, the ``flashinfer_mxfp4`` MoE
runner SGLang picks for FP4 experts. :func:`choose_placement` is the Engram placement ``serve`` uses by default.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from dsv4convert.checkpoint import read_small_json

from dsv4convert.engines import Gpu
from dsv4convert.engines.memory import GIB, gib
from dsv4convert.engines.sglang import memory as v4
from dsv4convert.engines.sglang import memory_v41 as sizing
from dsv4convert.engines.sglang.server import Server, server_v41
from dsv4convert.fit.source_v41 import PlannedV41, is_v41_config, planned
from dsv4convert.fit.verdict import FitError, roles


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
    """The server ``serve`` starts for V4.1 on ``gpu``'s family, with the Engram tables at ``placement``."""
    return server_v41("MODEL", gpu.family, role=role, tp=tp, engram=placement, max_running_requests=max_running)


def size(plan: PlannedV41, gpu: Gpu, role: str, tp: int, placement: str, *, context: int | None = None,
         max_running: int | None = None) -> ServerFitV41:
    return size_server(plan, gpu, launch(gpu, role, tp, placement, max_running), context=context)


def size_server(plan: PlannedV41, gpu: Gpu, server: Server, *, context: int | None = None) -> ServerFitV41:
    """One V4.1 server as it will run (its role, TP, request cap, Engram placement) on ``gpu``."""
    role, tp, placement = server.role, server.tp, server.engram or "gpu"
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


@dataclass(frozen=True)
class PlacementChoice:
    """The Engram placement a launch gets by default, and every placement's servers as sized."""

    placement: str | None                # None: no placement fits every server
    fits: dict[str, list[ServerFitV41]]  # placement -> its servers, in the launch's order

    def why(self) -> str:
        """The choice in a sentence, with the numbers that made it."""
        def tokens(placement: str) -> str:
            return ", ".join(f"{f.role} {f.kv_tokens:,} KV tokens" if f.fits else f"{f.role} does not fit"
                             for f in self.fits[placement])
        if self.placement is None:
            return "no Engram placement fits every server: " + "; ".join(
                f"{p}: {tokens(p)}" for p in self.fits)
        if self.placement == "gpu":
            return f"the tables fit on the GPUs, SGLang's default ({tokens('gpu')})"
        return (f"the tables do not fit on the GPUs ({tokens('gpu')}); in host memory, one buffer per TP group "
                f"(SGLang's default host layout): {tokens(self.placement)}")


def choose_placement(plan: PlannedV41, gpu: Gpu, servers: Sequence[Server], *,
                     context: int | None = None) -> PlacementChoice:
    """Where ``serve`` puts the Engram tables unless told: on the GPUs (SGLang's default: no host memory, no
    lookups over PCIe) when every server of the launch fits there, else in host memory shared per TP group
    (the host table's default layout; per rank holds the same GPU memory, so it never fits where shared does not),
    else nowhere (the launch is refused with every placement's numbers)."""
    fits = {p: [size_server(plan, gpu, replace(s, engram=p), context=context) for s in servers]
            for p in sizing.ENGRAM_PLACEMENTS}
    chosen = next((p for p in ("gpu", "host-shared") if all(f.fits for f in fits[p])), None)
    return PlacementChoice(chosen, fits)


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
    return choose_placement(plan, gpu, [launch(gpu, role, args.tp, "gpu", args.max_running) for role in roles(args.pd)],
                            context=args.context)


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
        print("estimated: free memory before loading = GPU total - 1536 MiB; the launch is SGLang's defaults, as "
              f"serve starts it (its default Engram placement: {_choice(plan, gpu, args).placement or 'none fits'})")
    return 0 if any(all(f.fits for f in fits) for fits in rows) else 1
