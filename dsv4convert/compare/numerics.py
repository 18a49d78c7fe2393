"""What each side of a comparison computes with: the server ``serve`` would launch, and the parts emulated.

One source of truth: each side's settings are the SGLang server ``serve`` starts and the model card prints
(:func:`dsv4convert.engines.sglang.server.server`), and its rules are the engine's
(:class:`dsv4convert.engines.sglang.numerics.Serving`). ``Numerics`` switches on three independent parts
(the ablation of ``compare --recall --ablate`` turns them on one at a time): activation quantization (dense
W8A8 linears and routed experts), the FP8 KV cache, and the indexer's key/query cache (FP8 or FP4). All off:
weights only.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from dsv4convert import variants
from dsv4convert.engines import GPU_FAMILIES, SGLANG, SGLANG_LABEL
from dsv4convert.engines.sglang.numerics import Serving
from dsv4convert.engines.sglang.server import server
from dsv4convert.errors import DSV4Error
from dsv4convert.formats import Format
from dsv4convert.inspection import Inspection

ENGINES = (SGLANG,)


@dataclass(frozen=True)
class Numerics:
    """Which parts of a side's served numerics are emulated (see the module docstring)."""

    serving: Serving | None
    activations: bool = False
    kv_cache: bool = False
    indexer: str | None = None    # "fp8" | "fp4" | None (transformers' own BF16/float indexer)

    @property
    def label(self) -> str:
        parts = [name for name, on in (("activations", self.activations), ("fp8 kv cache", self.kv_cache)) if on]
        if self.indexer:
            parts.append(f"{self.indexer} indexer")
        return "weights only" if not parts else "weights + " + " + ".join(parts)

    def with_parts(self, **parts) -> "Numerics":
        return replace(self, **parts)

    def describe(self) -> dict:
        return {"label": self.label, "activations": self.activations, "kv_cache": self.kv_cache,
                "indexer": self.indexer, "serving": self.serving.describe() if self.serving else None}


def serving_for(inspection: Inspection, config: dict, *, engine: str, gpu_family: str,
                moe_runner_backend: str | None = None, fp4_indexer: bool = False, model: str = "MODEL") -> Serving:
    """The launch ``serve`` would make for this checkpoint on ``gpu_family``, as the settings that matter."""
    formats = {m.module: (m.format, m.params) for m in inspection.modules.values() if m.format is not None}
    return serving_from_formats(inspection.variant, formats, config.get("quantization_config") or {}, engine=engine,
                                gpu_family=gpu_family, moe_runner_backend=moe_runner_backend,
                                fp4_indexer=fp4_indexer, model=model)


def serving_from_formats(variant: str, formats: dict[str, tuple[Format, dict]], quant: dict, *, engine: str,
                         gpu_family: str, moe_runner_backend: str | None = None, fp4_indexer: bool = False,
                         model: str = "MODEL") -> Serving:
    """The launch for a checkpoint that stores ``formats`` under the ``quantization_config`` ``quant`` (one not
    written yet, as ``automix`` plans it, or one inspected); ``moe_runner_backend``/``fp4_indexer`` override
    the launch's (compare's --moe-runner-backend, --fp4-indexer)."""
    if engine not in ENGINES:
        raise DSV4Error(f"--engine {engine!r}: compare emulates {', '.join(ENGINES)} (vLLM is not emulated yet)")
    if gpu_family not in GPU_FAMILIES:
        raise DSV4Error(f"--gpu-family must be one of {', '.join(GPU_FAMILIES)}, got {gpu_family!r}")
    like = variants.served_like(variant, formats)
    settings = server(model, like, gpu_family)
    overrides = {"moe_runner_backend": moe_runner_backend} if moe_runner_backend else {}
    return Serving.of(replace(settings, fp4_indexer=fp4_indexer or settings.fp4_indexer, **overrides), quant)


def served(serving: Serving) -> Numerics:
    """Every part of what ``serving`` computes with."""
    if serving.fp4_indexer and serving.major == 9:
        raise DSV4Error(f"--enable-deepseek-v4-fp4-indexer: {SGLANG_LABEL} refuses the FP4 indexer on sm90")
    kv = serving.kv_cache_dtype in ("fp8_e4m3", "auto")   # SGLang resolves auto to fp8_e4m3 for V4
    return Numerics(serving, activations=True, kv_cache=kv, indexer="fp4" if serving.fp4_indexer else "fp8")


def weights_only(serving: Serving | None = None) -> Numerics:
    return Numerics(serving)
