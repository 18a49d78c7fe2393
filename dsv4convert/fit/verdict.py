"""Per server of a launch: weights per rank, memory fraction, KV tokens, and whether it fits.

The arithmetic is each engine's (:mod:`dsv4convert.engines.sglang.memory`,
:mod:`dsv4convert.engines.vllm.memory`); this module picks the GPU, the TP sizes ``fit`` tries, the server
``serve`` would start for a role, and words a refusal. No I/O.
"""

from __future__ import annotations

from dataclasses import replace

from dsv4convert.engines import (GPU_FAMILIES, GPUS, LABELS, SGLANG, VLLM, EngineError, Gpu, family_label,
                                 gpu_of_family)
from dsv4convert.engines.memory import ESTIMATED, RUNTIME_OVERHEAD_MIB, ServerFit, gib
from dsv4convert.engines.served import ServedModel
from dsv4convert.engines.sglang import memory as sglang_memory
from dsv4convert.engines.sglang.server import Server, drafter_of, server
from dsv4convert.engines.vllm import memory as vllm_memory
from dsv4convert.errors import DSV4Error

TP_SIZES = (1, 2, 4, 8)

__all__ = ["GPUS", "Gpu", "gpu_of_family", "ServerFit"]


class FitError(DSV4Error):
    """Input fit cannot size: unknown GPU, more TP than GPUs."""


def gpu_from(text: str, family: str | None = None) -> Gpu:
    """``rtx-pro-6000``/``h200``/``b200``, or a size in MiB (then ``family``, default sm90, picks the launch rules)."""
    if text in GPUS:
        return GPUS[text]
    if text.isdigit() and int(text) >= 1024:
        return Gpu(f"{int(text)} MiB GPU", family or "sm90", int(text))
    raise FitError(f"--gpu {text!r}: expected one of {', '.join(GPUS)} or a memory size in MiB (e.g. 97887)")


def gpu_of(text: str, family: str | None) -> Gpu:
    """``fit``'s GPU: a card by name (``family``, if given, must be its own), or a size in MiB with its family
    (required: the family picks the launch rules, e.g. serve's 0.70 memory fraction on sm_120, and a 96 GB card
    sized by H200 rules gets nearly twice the KV tokens it would get as the RTX PRO 6000 it likely is)."""
    if text in GPUS and family and family != GPUS[text].family:
        raise FitError(f"--gpu-family {family}: --gpu {text} is {family_label(GPUS[text].family)}; "
                       "drop --gpu-family, or give --gpu as a size in MiB")
    if text.isdigit() and not family:
        cards = ", ".join(f"{f} ({family_label(f)})" for f in GPU_FAMILIES)
        raise FitError(f"--gpu {text}: a size needs its family, which picks the launch rules and memory reserve: "
                       f"add --gpu-family, one of {cards}")
    return gpu_from(text, family)


def launched(model: ServedModel, gpu: Gpu, role: str, tp: int, *, mtp: bool,
             max_running: int | None = None) -> Server:
    """The SGLang server ``serve`` starts for ``model`` as ``role`` on ``tp`` GPUs of ``gpu``."""
    try:
        return server("MODEL", model.variant, gpu.family, role=role, tp=tp, mtp=mtp,
                      max_running_requests=max_running, **drafter_of(model.model_config))
    except EngineError as exc:
        raise FitError(str(exc)) from None


def sglang_server(model: ServedModel, gpu: Gpu, role: str, tp: int, *, mtp: bool, context: int | None = None,
                  max_running: int | None = None) -> ServerFit:
    """One SGLang server as ``serve`` would launch it for ``model`` on ``tp`` GPUs of ``gpu``."""
    return sglang_memory.size_server(model, gpu, launched(model, gpu, role, tp, mtp=mtp, max_running=max_running),
                                     context=context)


def vllm_server(model: ServedModel, gpu: Gpu, tp: int, *, mtp: bool, context: int | None = None) -> ServerFit:
    """One vLLM server as its launch starts it (see :func:`dsv4convert.engines.vllm.memory.size_server`)."""
    return vllm_memory.size_server(model, gpu, tp, mtp=mtp, context=context)


class SglangSizing:
    """``fit``'s questions about SGLang's launch (each engine answers the same ones: :data:`SIZINGS`)."""

    name, label, estimated = SGLANG, LABELS[SGLANG], ESTIMATED
    fraction = ("--mem-fraction-static, the share of GPU memory SGLang gives weights and KV cache (the rest: "
                "activations, CUDA graphs)")

    def refuse(self, *, pd: bool, max_running: int | None) -> None:
        """Every launch ``serve`` makes with SGLang can be sized."""

    def size(self, model: ServedModel, gpu: Gpu, role: str, tp: int, *, mtp: bool, context: int | None,
             max_running: int | None) -> ServerFit:
        return sglang_server(model, gpu, role, tp, mtp=mtp, context=context, max_running=max_running)


class VllmSizing(SglangSizing):
    """vLLM: one server (no PD, its own scheduler limits), sized by :func:`vllm_server`."""

    name, label, estimated = VLLM, LABELS[VLLM], vllm_memory.ESTIMATES
    fraction = "--gpu-memory-utilization, the share of GPU memory vLLM may use"

    def refuse(self, *, pd: bool, max_running: int | None) -> None:
        if pd or max_running:
            flag = "--pd" if pd else "--max-running"
            raise FitError(f"{flag}: serve starts vLLM as one server with its own scheduler limits; "
                           "fit sizes that (drop the flag or use --engine sglang)")

    def size(self, model: ServedModel, gpu: Gpu, role: str, tp: int, *, mtp: bool, context: int | None,
             max_running: int | None) -> ServerFit:
        return vllm_server(model, gpu, tp, mtp=mtp, context=context)


SIZINGS: dict[str, SglangSizing] = {SGLANG: SglangSizing(), VLLM: VllmSizing()}


def check_gpu(gpu: Gpu) -> None:
    """A GPU whose memory SGLang's own reserve already fills sizes nothing (its fraction would be negative)."""
    bare = server("MODEL", "fp8", gpu.family)
    fraction = sglang_memory.memory_fraction(bare, gpu.mib)
    if fraction.default <= 0 or gpu.mib <= RUNTIME_OVERHEAD_MIB:
        raise FitError(f"--gpu {gpu.mib}: a {gpu.mib} MiB GPU holds nothing once SGLang reserves "
                       f"{fraction.reserved_mib:,.0f} MiB for activations and graphs and the runtime "
                       f"{RUNTIME_OVERHEAD_MIB} MiB; give a card's memory in MiB (e.g. 97887 for an RTX PRO 6000)")


def roles(pd: bool) -> tuple[str, ...]:
    return ("prefill", "decode") if pd else ("server",)


def check_launch(gpu: Gpu, count: int, tp: int, pd: bool) -> None:
    servers = len(roles(pd))
    if tp not in TP_SIZES:
        raise FitError(f"--tp {tp}: expected one of {', '.join(map(str, TP_SIZES))}")
    if tp * servers > count:
        what = f"{servers} servers of TP {tp}" if servers > 1 else f"TP {tp}"
        raise FitError(f"{what} need {tp * servers} GPUs, but --count is {count}")


def smallest_tp(model: ServedModel, gpu: Gpu, role: str, *, mtp: bool, context: int | None,
                max_running: int | None, sizing: SglangSizing = SIZINGS[SGLANG]) -> int | None:
    """The smallest TP (power of two up to 8) at which this server fits on ``gpu``, or None."""
    for tp in TP_SIZES:
        if sizing.size(model, gpu, role, tp, mtp=mtp, context=context, max_running=max_running).fits:
            return tp
    return None


def refusal(model: ServedModel, gpu: Gpu, settings: Server) -> str | None:
    """Why ``serve`` must not start the server ``settings`` (one line naming it, the GPU and the shortfall), or
    None. The server is sized as it will run: the user's own launch arguments included."""
    fit = sglang_memory.size_server(model, gpu, settings)
    if fit.fits:
        return None
    better = next((tp for tp in TP_SIZES if tp > settings.tp
                   and sglang_memory.size_server(model, gpu, replace(settings, tp=tp)).fits), None)
    hint = f"; TP {better} fits" if better else ""
    return (f"the {settings.role} server does not fit TP {settings.tp} x {gpu.name} ({gpu.mib} MiB): "
            f"{gib(fit.weights_bytes_per_rank)} of weights per GPU, "
            f"{gib(fit.shortfall_bytes)} short at --mem-fraction-static {fit.mem_fraction_static} "
            f"(SGLang needs at least {fit.min_mem_fraction_static} to load){hint}")
