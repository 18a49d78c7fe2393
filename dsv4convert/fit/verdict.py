"""Per server of a launch: weights per rank, memory fraction, KV tokens, and whether it fits.

Joins :mod:`dsv4convert.fit.source` (what is loaded, how ``serve`` launches it) with the arithmetic of
:mod:`dsv4convert.fit.sizing`; no I/O. The vLLM estimate is in :func:`vllm_server`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from dsv4convert.errors import DSV4Error
from dsv4convert.fit import sizing
from dsv4convert.fit.source import Source


@dataclass(frozen=True)
class Gpu:
    name: str
    family: str      # SGLang's architecture family (serve's launch rules depend on it)
    mib: int         # total memory as nvidia-smi reports it (what SGLang reads)


# nvidia-smi's memory.total for each card we serve on.
GPUS: dict[str, Gpu] = {
    "rtx-pro-6000": Gpu("RTX PRO 6000", "sm120", 97887),
    "h200": Gpu("H200", "sm90", 143771),
    "b200": Gpu("B200", "sm100", 183359),
}
TP_SIZES = (1, 2, 4, 8)


class FitError(DSV4Error):
    """Input fit cannot size: unknown GPU, more TP than GPUs."""


def gpu_of_family(family: str) -> Gpu | None:
    """The card ``serve`` assumes for a GPU family (the one we serve on), or None for another family."""
    return next((gpu for gpu in GPUS.values() if gpu.family == family), None)


def gpu_from(text: str, family: str | None = None) -> Gpu:
    """``rtx-pro-6000``/``h200``/``b200``, or a size in MiB (then ``family``, default sm90, picks the launch rules)."""
    if text in GPUS:
        return GPUS[text]
    if text.isdigit() and int(text) >= 1024:
        return Gpu(f"{int(text)} MiB GPU", family or "sm90", int(text))
    raise FitError(f"--gpu {text!r}: expected one of {', '.join(GPUS)} or a memory size in MiB (e.g. 97887)")


@dataclass(frozen=True)
class ServerFit:
    """Everything ``fit`` reports for one server (the JSON keys are these field names)."""

    role: str
    gpu: str
    tp: int
    mtp: bool
    weights_bytes_per_rank: int
    draft_weights_bytes_per_rank: int
    mem_fraction_static: float
    default_mem_fraction_static: float
    reserved_mib: float
    reserve_terms_mib: dict
    kv_bytes_per_token: float
    kv_terms: dict
    fixed_state_bytes: int
    available_kv_bytes: int
    kv_tokens: int
    swa_tokens: int
    max_running_requests: int
    requests_at_context: int | None
    min_mem_fraction_static: float
    fits: bool
    shortfall_bytes: int
    estimated: tuple[str, ...]
    engine: str = "sglang 0.5.23"

    def as_dict(self) -> dict:
        return asdict(self)


ESTIMATED = (f"free memory before loading = GPU total - {sizing.RUNTIME_OVERHEAD_MIB} MiB (CUDA context, NCCL, "
             "communicators); SGLang measures it at startup",)


def sglang_server(source: Source, gpu: Gpu, role: str, tp: int, *, mtp: bool, context: int | None = None,
                  max_running: int | None = None) -> ServerFit:
    """One SGLang 0.5.23 server as ``serve`` would launch it for ``source`` on ``tp`` GPUs of ``gpu``."""
    extra = ("--max-running-requests", str(max_running)) if max_running else ()
    settings = source.settings(gpu.family, role, tp, mtp=mtp, extra_args=extra)
    weights = sizing.weights_per_rank(source.tensors, tp, source.load_rules(gpu.family, settings))
    fraction = sizing.memory_fraction(settings, gpu.mib)
    loaded = weights.target + (weights.draft if mtp else 0)
    budget = sizing.budget(gpu.mib, fraction.used, loaded)
    cost = sizing.kv_cost(source.geometry, settings)
    full, swa = sizing.kv_tokens(budget.available_bytes, cost)
    running = min(max_running or sizing.V4_MAX_RUNNING_REQUESTS, full // 2)
    needed = max(context or sizing.V4_PAGE_SIZE, sizing.V4_PAGE_SIZE)
    fits = budget.available_bytes > 0 and full >= needed
    short = 0
    if not fits:
        wanted = cost.fixed_bytes + needed * cost.bytes_per_full_token
        short = int(wanted - budget.available_bytes)
    return ServerFit(
        role=role, gpu=gpu.name, tp=tp, mtp=mtp, weights_bytes_per_rank=loaded,
        draft_weights_bytes_per_rank=weights.draft if mtp else 0, mem_fraction_static=fraction.used,
        default_mem_fraction_static=fraction.default, reserved_mib=fraction.reserved_mib,
        reserve_terms_mib=fraction.terms_mib, kv_bytes_per_token=cost.bytes_per_full_token, kv_terms=cost.terms,
        fixed_state_bytes=cost.fixed_bytes, available_kv_bytes=budget.available_bytes, kv_tokens=full,
        swa_tokens=swa, max_running_requests=max(running, 0),
        requests_at_context=min(full // context, running) if context else None,
        min_mem_fraction_static=budget.min_mem_fraction_static, fits=fits, shortfall_bytes=max(short, 0),
        estimated=ESTIMATED)


VLLM_ESTIMATED = (
    ESTIMATED[0].replace("SGLang", "vLLM"),
    "not subtracted: the activation peak of vLLM's profiled dummy forward and its CUDA graph memory estimate "
    "(v1/worker/gpu_worker.py determine_available_memory measures both on the GPU): KV tokens are an upper bound",
    "KV tokens = budget / the growing caches' bytes per token; vLLM packs V4's mixed-page caches into one block "
    "pool (v1/core/kv_cache_planning.py), whose padding and per-request sliding-window and state blocks are not "
    "restated",
    "weights per rank: fit's split rules (attention and vocabulary by TP, whole experts by EP) over the file's "
    "bytes (FP8 block scales as F32, wo_a kept FP8); vLLM's model is not built per rank to check them",
)


def vllm_server(source: Source, gpu: Gpu, tp: int, *, mtp: bool, context: int | None = None) -> ServerFit:
    """One vLLM 0.33.0 server as ``serve``'s vLLM launch starts it (TP with expert parallelism, FP8 KV cache,
    256-token blocks, the default ``gpu_memory_utilization``), as far as vLLM's code sizes it without a GPU."""
    from dsv4convert.fit import vllm
    from dsv4convert.serve.launch import LaunchError
    from dsv4convert.serve.vllm_launch import vllm_launch

    plan = vllm_launch("MODEL", source.variant, gpu.family, tp, draft=source.has_draft)   # raises if vLLM cannot load it
    if mtp and plan.mtp_argv is None:
        raise LaunchError(f"no MTP draft with vLLM here: {plan.mtp_note}")
    rules = sizing.LoadRules(wo_a_bf16=False, nvfp4_scale_copies=1)    # vLLM keeps wo_a FP8; one copy of scales
    weights = sizing.weights_per_rank(source.tensors, tp, rules)
    loaded = weights.target + (weights.draft if mtp else 0)
    block = int(plan.argv[plan.argv.index("--block-size") + 1])
    specs = vllm.cache_specs(source.geometry, window=int(source.config.get("sliding_window", 128)), block_size=block,
                             packed=vllm.packed_layout(gpu.family), draft_layers=1 if mtp else 0)
    per_token = sum(spec.bytes_per_token for spec in specs)
    available = vllm.kv_budget(gpu.mib, vllm.GPU_MEMORY_UTILIZATION, loaded, sizing.RUNTIME_OVERHEAD_MIB)
    if per_token:
        tokens = max(int(available / per_token) // block * block, 0)
    else:   # only window and state caches (no compressed layer): the context does not grow them
        tokens = int(source.config.get("max_position_embeddings", 0)) if available > 0 else 0
    needed = max(context or block, block)
    fits = tokens >= needed
    minimum = (loaded + (sizing.RUNTIME_OVERHEAD_MIB << 20)) / (gpu.mib << 20)
    return ServerFit(
        role="server", gpu=gpu.name, tp=tp, mtp=mtp, weights_bytes_per_rank=loaded,
        draft_weights_bytes_per_rank=weights.draft if mtp else 0, mem_fraction_static=vllm.GPU_MEMORY_UTILIZATION,
        default_mem_fraction_static=vllm.GPU_MEMORY_UTILIZATION, reserved_mib=0.0, reserve_terms_mib={},
        kv_bytes_per_token=per_token, kv_terms={spec.name: spec.bytes_per_token for spec in specs if spec.bytes_per_token},
        fixed_state_bytes=0, available_kv_bytes=available, kv_tokens=tokens, swa_tokens=0, max_running_requests=0,
        requests_at_context=tokens // context if context else None,
        min_mem_fraction_static=math.ceil(minimum * 1000) / 1000, fits=fits,
        shortfall_bytes=0 if fits else int(needed * per_token - available), estimated=VLLM_ESTIMATED,
        engine="vllm 0.33.0")


def roles(pd: bool) -> tuple[str, ...]:
    return ("prefill", "decode") if pd else ("server",)


def check_launch(gpu: Gpu, count: int, tp: int, pd: bool) -> None:
    servers = len(roles(pd))
    if tp not in TP_SIZES:
        raise FitError(f"--tp {tp}: expected one of {', '.join(map(str, TP_SIZES))}")
    if tp * servers > count:
        what = f"{servers} servers of TP {tp}" if servers > 1 else f"TP {tp}"
        raise FitError(f"{what} need {tp * servers} GPUs, but --count is {count}")


def smallest_tp(source: Source, gpu: Gpu, role: str, *, mtp: bool, context: int | None,
                max_running: int | None) -> int | None:
    """The smallest TP (power of two up to 8) at which this server fits on ``gpu``, or None."""
    for tp in TP_SIZES:
        if sglang_server(source, gpu, role, tp, mtp=mtp, context=context, max_running=max_running).fits:
            return tp
    return None


def refusal(source: Source, gpu: Gpu, role: str, tp: int, *, mtp: bool) -> str | None:
    """Why ``serve`` must not start this server (one line naming it, the GPU and the shortfall), or None."""
    fit = sglang_server(source, gpu, role, tp, mtp=mtp)
    if fit.fits:
        return None
    better = smallest_tp(source, gpu, role, mtp=mtp, context=None, max_running=None)
    hint = f"; TP {better} fits" if better and better > tp else ""
    return (f"the {role} server does not fit TP {tp} x {gpu.name} ({gpu.mib} MiB): "
            f"{sizing.gib(fit.weights_bytes_per_rank)} of weights per GPU, "
            f"{sizing.gib(fit.shortfall_bytes)} short at --mem-fraction-static {fit.mem_fraction_static} "
            f"(SGLang needs at least {fit.min_mem_fraction_static} to load){hint}")
