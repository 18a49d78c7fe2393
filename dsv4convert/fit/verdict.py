"""Per server of a launch: weights per rank, memory fraction, KV tokens, and whether it fits.

Joins :mod:`dsv4convert.fit.source` (what is loaded, how ``serve`` launches it) with the arithmetic of
:mod:`dsv4convert.fit.sizing`; no I/O. The vLLM estimate is in :func:`vllm_server`.
"""

from __future__ import annotations

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
