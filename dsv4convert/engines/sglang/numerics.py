"""The numerics an SGLang server computes with, from its settings: which activations, caches and weights
are quantized how, per variant and GPU family.

The rules are SGLang's (paths relative to ``python/sglang/srt/`` of the pinned wheel), each traced to its file
and function in ``docs/served-numerics.md``; the numerics themselves are the pure functions of
:mod:`dsv4convert.formats.activations` and :mod:`dsv4convert.formats.kv_cache`. ``compare`` emulates them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dsv4convert.engines import SGLANG, EngineError, gpu_family_major
from dsv4convert.engines.sglang.server import Server
from dsv4convert.formats import Format

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

    @classmethod
    def of(cls, server: Server, quant: dict) -> "Serving":
        """The numerics of an SGLang server that loads a checkpoint whose ``quantization_config`` is ``quant``."""
        return cls(engine=SGLANG, gpu_family=server.gpu_family, variant=server.variant,
                   moe_runner_backend=server.moe_runner_backend or "auto",
                   fp8_gemm_backend=server.fp8_gemm_backend or "auto", kv_cache_dtype=server.kv_cache_dtype,
                   fp4_indexer=server.fp4_indexer,
                   ue8m0_checkpoint=quant.get("quant_method") == "fp8" and quant.get("scale_fmt") == "ue8m0",
                   fp8_wo_a=server.env.get("SGLANG_OPT_FP8_WO_A_GEMM") == "1",
                   server_args=tuple(server.argv()), env=dict(server.env))

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


# DeepSeek-V4.1's dense linears SGLang 0.5.23 builds without its quant config, whatever the checkpoint stores
# (``layers/attention/dsv4/dsv41_sparse.py``: ``DeepseekV41Compressor`` plain ``nn.Linear``, ``DeepseekV41Indexer``
# ``weights_proj`` with ``quant_config=None`` and ``wk`` a BF16 ``nn.Linear``; the router ``MoEGate``), and ``wo_a``,
# which ``models/deepseek_v4.py::wo_a_fp8_gemm_enabled`` runs as an FP8 GEMM only for 128 x 128 blocks: V4.1's
# 32 x 32 ``wo_a`` is dequantized to BF16 at load on every family.
V41_UNQUANTIZED = frozenset({"attn.compressor.wkv", "attn.compressor.wgate", "attn.indexer.weights_proj",
                             "attn.indexer.wk", "ffn.gate", "attn.wo_a"})


@dataclass(frozen=True)
class V41Serving(Serving):
    """An SGLang launch of DeepSeek-V4.1 (``server.py::server_v41``): V4's routed-expert rules
    (:meth:`Serving.expert_scheme`: the same MoE methods and runners, ``flashinfer_mxfp4`` /
    ``flashinfer_trtllm_routed`` / ``Fp8MoEMethod`` Triton in ``weight_block_size[1]`` = 32 groups), and V4.1's own
    dense rules for its 32 x 32 FP8 linears (:meth:`dense_scheme`)."""

    def dense_scale_format(self) -> str:
        """The W8A8 dense linears' activation quantization, per 1 x 32 token group (the weight block's columns):

        * ``"mxfp8"`` on sm100 for an Fp8Config ``scale_fmt: ue8m0`` checkpoint (native, fp8, nvfp4):
          ``arg_groups/model_overrides/deepseek_v4.py::_deepseek_v4_overrides`` sets ``fp8_gemm_runner_backend``
          ``flashinfer_cutedsl`` for V4.1, ``layers/quantization/fp8_utils.py::can_serve_block_fp8_as_mxfp8``
          serves the 32-wide UE8M0 blocks as MXFP8 and ``flashinfer_mxfp8_blockscaled_linear`` quantizes the input
          with ``flashinfer_mxfp8_quantize(.., alignment=32)`` (``formats.activations.mxfp8_activations``);
        * ``"ue8m0"`` on sm90 and sm120 for such a checkpoint: ``Fp8LinearMethod.__init__`` binds
          ``act_scale_ue8m0`` (``scale_fmt == "ue8m0"``); sm90 ``dispatch_w8a8_block_fp8_linear`` takes
          ``deepgemm_w8a8_block_fp8_linear_with_fallback`` (native block-32 DeepGEMM:
          ``sglang_per_token_group_quant_fp8(x, 32, scale_ue8m0=True)``), sm120 (``initialize_fp8_gemm_config``:
          auto -> cutlass) falls to ``triton_w8a8_block_fp8_linear`` for a non-128 block, which quantizes the same
          way with ``act_scale_ue8m0``;
        * ``"float32"`` for W4A16's ``linear_fp8_config`` (``compressed_tensors.py::CompressedTensorsConfig.from_config``
          does not forward ``scale_fmt``, so ``act_scale_ue8m0`` is false): DeepGEMM on sm90 with
          ``scale_ue8m0=DEEPGEMM_SCALE_UE8M0`` (false there), ``triton_w8a8_block_fp8_linear``'s
          ``per_token_group_quant_fp8`` on sm100 and sm120.
        """
        if self.fp8_gemm_backend != "auto":
            raise EngineError(f"--fp8-gemm-backend {self.fp8_gemm_backend}: compare emulates the DeepSeek-V4.1 launch "
                              "serve makes (SGLang's own choice) only")
        if not self.ue8m0_checkpoint:
            return "float32"
        return "mxfp8" if self.major == 10 else "ue8m0"

    def wo_a(self) -> str | None:
        return None

    def dense_scheme(self, suffix: str, fmt: Format | None) -> str | None:
        """How a dense linear ``<block>.<suffix>`` stored as ``fmt`` quantizes its input: None (a BF16 GEMM: stored
        BF16, built unquantized, or ``wo_a``) or :meth:`dense_scale_format`'s scheme for an FP8 one."""
        if fmt is not Format.FP8 or suffix in V41_UNQUANTIZED:
            return None
        return self.dense_scale_format()
