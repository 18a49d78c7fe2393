"""The budget in the user's unit, and what each choice costs of it, from ``fit``'s own sizing.

Two units: ``--size`` counts the checkpoint's stored bytes (every tensor of the output, as the converter
plans it); ``--gpu/--tp/--kv-tokens`` counts bytes per GPU as SGLang 0.5.23 (or vLLM 0.33.0) loads them
(:func:`dsv4convert.engines.memory.weights_per_rank`, with the launch ``serve`` makes for the family), and the
allowance is what one rank may hold in weights so that the KV pool still has ``--kv-tokens`` tokens
(:func:`dsv4convert.fit.verdict.sglang_server`'s budget, solved for the weights). Both are sums over
tensors, so a mix's bytes are its fixed part plus its choices' bytes, exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dsv4convert import dtypes
from dsv4convert.engines import SGLANG_LABEL, VLLM_LABEL, Gpu
from dsv4convert.engines import memory as sizing
from dsv4convert.engines.served import ServedModel
from dsv4convert.engines.sglang.memory import V4_PAGE_SIZE, load_rules
from dsv4convert.engines.vllm.server import BLOCK_SIZE as VLLM_BLOCK
from dsv4convert.fit.verdict import launched, sglang_server, vllm_server
from dsv4convert.formats import Format, linear_storage
from dsv4convert.models.deepseek_v4.layout import classify


@dataclass(frozen=True)
class Unit:
    """How bytes are counted: the file (``rules`` None) or one of ``tp`` ranks under ``rules``."""

    tp: int = 1
    rules: sizing.LoadRules | None = None
    mtp: bool = False

    @property
    def per_rank(self) -> bool:
        return self.rules is not None

    def describe(self) -> str:
        return f"bytes per GPU at TP {self.tp}" if self.per_rank else "checkpoint bytes"

    def count(self, tensors: list[tuple[str, str, tuple[int, ...]]]) -> int:
        """Bytes of ``(name, dtype, shape)`` tensors in this unit."""
        if not self.per_rank:
            return sum(dtypes.nbytes(dtype, shape) for _, dtype, shape in tensors)
        rows = [(sizing.Tensor(name, dtype, tuple(shape), dtypes.nbytes(dtype, shape)), classify(name))
                for name, dtype, shape in tensors]
        held = sizing.weights_per_rank(rows, self.tp, self.rules)
        return held.target + (held.draft if self.mtp else 0)


def stored(module: str, fmt: Format, shape: tuple[int, int], fp8_block: tuple[int, int],
           fp8_scale_dtype: str = "F8_E8M0") -> list[tuple]:
    """The tensors a linear module is stored as in ``fmt`` (INT4 in groups of 128, as the recipes write it; FP8 in
    the release's ``fp8_block``)."""
    n, k = shape
    return [(f"{module}.{p.suffix}", p.dtype, p.shape)
            for p in linear_storage(fmt, n, k, group_size=128, fp8_scale_dtype=fp8_scale_dtype, fp8_block=fp8_block)]


def sglang_rules(model: ServedModel, gpu: Gpu, tp: int, mtp: bool) -> sizing.LoadRules:
    return load_rules(model, launched(model, gpu, "server", tp, mtp=mtp))


def allowance(source: ServedModel, gpu: Gpu, tp: int, kv_tokens: int, *, engine: str, mtp: bool) -> tuple[int, list[str]]:
    """Weight bytes one rank may hold so that ``kv_tokens`` tokens of KV still fit, and how it was reached.

    Each server's KV budget falls byte for byte with the weights (``sizing.budget``, ``vllm.kv_budget``), so
    ``allowance = weights + available - (fixed state + kv_tokens x bytes per token)`` for any one layout.
    """
    notes, limits = [], []
    if engine in ("sglang", "both"):
        fit = sglang_server(source, gpu, "server", tp, mtp=mtp, context=kv_tokens)
        pages = -(-kv_tokens // V4_PAGE_SIZE) * V4_PAGE_SIZE   # the pool holds whole pages
        need = fit.fixed_state_bytes + math.ceil(pages * fit.kv_bytes_per_token)
        limits.append(fit.weights_bytes_per_rank + fit.available_kv_bytes - int(need))
        notes.append(f"{SGLANG_LABEL}: mem_fraction_static {fit.mem_fraction_static}, "
                     f"{fit.kv_bytes_per_token:.0f} B of KV per token, {sizing.gib(need)} for {kv_tokens} tokens")
    if engine in ("vllm", "both"):
        fit = vllm_server(source, gpu, tp, mtp=mtp, context=kv_tokens)
        blocks = -(-kv_tokens // VLLM_BLOCK) * VLLM_BLOCK                    # vllm_server counts whole blocks
        need = math.ceil(blocks * fit.kv_bytes_per_token)
        limits.append(fit.weights_bytes_per_rank + fit.available_kv_bytes - int(need))
        notes.append(f"{VLLM_LABEL}: gpu_memory_utilization {fit.mem_fraction_static}, "
                     f"{fit.kv_bytes_per_token:.0f} B of KV per token")
    return min(limits), notes
