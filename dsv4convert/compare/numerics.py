"""What each side's server computes with, derived from the launch ``serve`` would make.

One source of truth: the SGLang arguments and environment come from
:mod:`dsv4convert.serve.launch` (``server_args``/``variant_defaults``, what ``serve`` starts and the
model card prints), and this module reads the few settings that change numbers out of them: the
MoE runner, the KV-cache dtype, the FP8 GEMM backend, the FP4 indexer flag. The rules that turn
those into numerics (which activations are quantized how, per variant and GPU family) are SGLang
0.5.23's, each traced to its file and function in ``docs/served-numerics.md``; the numerics
themselves are the pure functions of :mod:`dsv4convert.formats.activations` and
:mod:`dsv4convert.formats.kv_cache`.

``Numerics`` switches on three independent parts (the ablation of ``compare --recall --ablate``
turns them on one at a time): activation quantization (dense W8A8 linears and routed experts),
the FP8 KV cache, and the indexer's key/query cache (FP8 or FP4). All off: weights only.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from dsv4convert.errors import DSV4Error
from dsv4convert.inspection import Inspection
from dsv4convert.serve.launch import (
    LaunchOptions,
    flag_value,
    gpu_family_major,
    served_like,
    server_args,
    variant_defaults,
)
from dsv4convert.storage import Format

GPU_FAMILIES = ("sm90", "sm100", "sm120")
ENGINES = ("sglang",)
# Routed-expert activation schemes (``Serving.expert_scheme``): None is W4A16 / BF16 (activations as computed).
EXPERT_SCHEMES = ("fp8", "mxfp8", "nvfp4")


@dataclass(frozen=True)
class Serving:
    """The settings of one SGLang launch that decide its numerics, and the rules that follow from them."""

    engine: str
    gpu_family: str
    variant: str                  # the served variant whose rules apply (a mixed recipe follows its experts)
    moe_runner_backend: str       # as launched; "auto" when SGLang chooses
    fp8_gemm_backend: str
    kv_cache_dtype: str
    fp4_indexer: bool
    ue8m0_checkpoint: bool        # an Fp8Config with scale_fmt ue8m0 (native, fp8, nvfp4), not compressed-tensors
    fp8_wo_a: bool                # SGLANG_OPT_FP8_WO_A_GEMM forced on
    server_args: tuple[str, ...] = field(compare=False)
    env: dict[str, str] = field(compare=False, default_factory=dict)

    @property
    def major(self) -> int:
        return gpu_family_major(self.gpu_family)

    def dense_scale_format(self) -> str:
        """Scale of the W8A8 dense linears' per-1x128 activation quantization (docs/served-numerics.md, L1-L4)."""
        backend, major = self.fp8_gemm_backend, self.major
        if backend == "auto":
            if major == 12:
                return "float32"          # auto resolves to CUTLASS on sm120
            if major == 10:
                return "ue8m0"            # DeepGEMM scales are UE8M0 on sm100 whatever the checkpoint
            return "ue8m0" if self.ue8m0_checkpoint else "float32"
        if backend == "deep_gemm":
            return "ue8m0" if major >= 10 or self.ue8m0_checkpoint else "float32"
        return "float32"                  # triton, cutlass, flashinfer_*: the float32 per-token-group kernel

    def wo_a(self) -> str | None:
        """How ``wo_a`` runs: ``"ue8m0"`` (an FP8 GEMM, sm100's default) or None (dequantized to BF16 at load)."""
        if self.ue8m0_checkpoint and (self.major == 10 or self.fp8_wo_a) and self.major != 12:
            return "ue8m0" if self.major == 10 else "float32"
        return None

    def expert_scheme(self, fmt: Format, *, is_mtp: bool) -> str | None:
        """Activation quantization of routed experts stored as ``fmt`` (docs/served-numerics.md, R1-R9)."""
        runner, major = self.moe_runner_backend, self.major
        if fmt is Format.FP8:
            return "fp8"                                      # Fp8MoEMethod, Triton: float32 token groups
        if fmt is Format.MXFP4:
            if is_mtp and self.variant.startswith("nvfp4"):
                return "mxfp8"                                # Mxfp4FlashinferTrtllmMoEMethod whatever the runner
            if runner == "marlin" or (runner in ("auto", "flashinfer_mxfp4") and major == 9):
                return None                                   # Marlin, or flashinfer cutlass W4A16 on sm90
            return "mxfp8"                                    # sm100 TRT-LLM, sm120 cutlass MXFP8 x MXFP4
        if fmt is Format.NVFP4:
            if runner == "marlin" or (runner == "auto" and major < 10):
                return None                                   # ModelOptNvFp4FusedMoEMethod, Marlin: W4A16
            return "nvfp4"                                    # flashinfer trtllm / cutlass: W4A4
        return None                                           # INT4 (WNA16), BF16 (unquantized)

    def describe(self) -> dict:
        return {"engine": self.engine, "gpu_family": self.gpu_family, "variant_rules": self.variant,
                "moe_runner_backend": self.moe_runner_backend, "fp8_gemm_backend": self.fp8_gemm_backend,
                "kv_cache_dtype": self.kv_cache_dtype, "fp4_indexer": self.fp4_indexer,
                "dense_fp8_activation_scales": self.dense_scale_format(), "wo_a": self.wo_a() or "bf16",
                "server_args": list(self.server_args), "env": dict(self.env)}


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
                extra_args: tuple[str, ...] = (), model: str = "MODEL") -> Serving:
    """The launch ``serve`` would make for this checkpoint on ``gpu_family``, as the settings that matter."""
    formats = {m.module: (m.format, m.params) for m in inspection.modules.values() if m.format is not None}
    return serving_from_formats(inspection.variant, formats, config.get("quantization_config") or {}, engine=engine,
                                gpu_family=gpu_family, extra_args=extra_args, model=model)


def serving_from_formats(variant: str, formats: dict[str, tuple[Format, dict]], quant: dict, *, engine: str,
                         gpu_family: str, extra_args: tuple[str, ...] = (), model: str = "MODEL") -> Serving:
    """The launch for a checkpoint that stores ``formats`` under the ``quantization_config`` ``quant`` (one not
    written yet, as ``automix`` plans it, or one inspected)."""
    if engine not in ENGINES:
        raise DSV4Error(f"--engine {engine!r}: compare emulates {', '.join(ENGINES)} (vLLM is not emulated yet)")
    if gpu_family not in GPU_FAMILIES:
        raise DSV4Error(f"--gpu-family must be one of {', '.join(GPU_FAMILIES)}, got {gpu_family!r}")
    like = served_like(variant, formats)
    options = LaunchOptions(model=model, variant=like, gpu_family=gpu_family, extra_args=tuple(extra_args))
    args = server_args(options, "server", 1, options.server_port, options.prefill_nccl_port)
    env = dict(variant_defaults(like, gpu_family).env)
    return Serving(
        engine=engine, gpu_family=gpu_family, variant=like,
        moe_runner_backend=flag_value(args, "--moe-runner-backend") or "auto",
        fp8_gemm_backend=flag_value(args, "--fp8-gemm-backend") or "auto",
        kv_cache_dtype=flag_value(args, "--kv-cache-dtype") or "auto",
        fp4_indexer="--enable-deepseek-v4-fp4-indexer" in args,
        ue8m0_checkpoint=quant.get("quant_method") == "fp8" and quant.get("scale_fmt") == "ue8m0",
        fp8_wo_a=env.get("SGLANG_OPT_FP8_WO_A_GEMM") == "1",
        server_args=tuple(args), env=env)


def served(serving: Serving) -> Numerics:
    """Every part of what ``serving`` computes with."""
    if serving.fp4_indexer and serving.major == 9:
        raise DSV4Error("--enable-deepseek-v4-fp4-indexer: SGLang 0.5.23 refuses the FP4 indexer on sm90")
    kv = serving.kv_cache_dtype in ("fp8_e4m3", "auto")   # SGLang resolves auto to fp8_e4m3 for V4
    return Numerics(serving, activations=True, kv_cache=kv, indexer="fp4" if serving.fp4_indexer else "fp8")


def weights_only(serving: Serving | None = None) -> Numerics:
    return Numerics(serving)
