"""Activation quantization as SGLang 0.5.23 serves DeepSeek-V4: pure fake-quant numerics.

Each function quantizes a tensor the way a serving kernel does and returns the dequantized
values (what the GEMM effectively multiplies), so a model run in plain torch sees the served
numerics. Groups run along the last dim; any leading dims; float32 or bfloat16 in, the input
dtype out unless ``out_dtype`` says otherwise. Pass float32 (or ``out_dtype=torch.float32``)
to get the dequantized values exactly: with a float32 scale ``code * scale`` is rarely a
bfloat16 number. Scales are computed with the kernels' own arithmetic (``amax * fl(1/448)``,
exponents read from the float bits) so results are bit-identical on CPU and CUDA; where a
kernel uses an approximate instruction the docstring says so.

Which function applies to which linear on which GPU and MoE runner, with the SGLang file and
function each follows: ``docs/served-numerics.md``.
"""

from __future__ import annotations

import functools
from typing import Literal

import torch
import torch.nn.functional as F

from dsv4convert.errors import FormatError
from dsv4convert.formats.numerics import E2M1_MAX, E4M3_MAX, ceil_log2, decode_e2m1, encode_e2m1, exp2_float32
from dsv4convert.formats.nvfp4 import NVFP4_BLOCK

Fp8ScaleFormat = Literal["float32", "ue8m0"]

MXFP8_GROUP = 32
# SGLang's floor on a token group's amax (per_token_group_quant.cuh, per_token_group_quant_8bit_v2.cuh).
FP8_AMAX_FLOOR = 1e-10
# UE8M0 holds 2**e for e in [-127, 127]; the conversions saturate there.
_UE8M0_MIN_EXP, _UE8M0_MAX_EXP = -127, 127
_INPUT_DTYPES = (torch.float32, torch.bfloat16)


class ActivationFormatError(FormatError, ValueError):
    """A tensor the served numerics cannot quantize (dtype, shape, NaN/Inf).

    A FormatError, so the CLI prints one ``error:`` line naming the tensor and exits 2, and a
    ValueError, since these are bad numeric arguments to a pure function.
    """


def require_input(x: torch.Tensor, name: str | None) -> None:
    """Refuse anything but a float32/bfloat16 tensor with a last dim."""
    if not isinstance(x, torch.Tensor) or x.dtype not in _INPUT_DTYPES:
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise ActivationFormatError(f"activations must be float32 or bfloat16, got {got}", tensor=name)
    if x.ndim == 0:
        raise ActivationFormatError("activations need at least one dim (the quantized one is the last)",
                                    tensor=name)


def require_finite(amax: torch.Tensor, name: str | None) -> None:
    """Refuse NaN/Inf; callers pass a group amax, through which both propagate."""
    if not bool(torch.isfinite(amax).all()):
        raise ActivationFormatError("activations contain NaN or Inf; refusing to quantize", tensor=name)


def grouped(x: torch.Tensor, group: int, name: str | None, *, pad: bool = False) -> torch.Tensor:
    """float32 view ``[..., K/group, group]`` of ``x``; a ragged last dim is refused, or zero-padded
    when ``pad`` (the kernel pads; zeros leave a group's amax unchanged)."""
    k = x.shape[-1]
    if isinstance(group, bool) or not isinstance(group, int) or group < 1:
        raise ActivationFormatError(f"group size must be a positive int, got {group!r}", tensor=name)
    tail = -k % group
    if tail and not pad:
        raise ActivationFormatError(
            f"last dim of shape {list(x.shape)} is not a multiple of the group size {group}; "
            "the serving kernel refuses it too",
            tensor=name,
        )
    values = x.float()
    if tail:
        values = F.pad(values, (0, tail))
    return values.reshape(*x.shape[:-1], (k + tail) // group, group)


def ungrouped(blocks: torch.Tensor, like: torch.Tensor, out_dtype: torch.dtype | None) -> torch.Tensor:
    """``blocks`` back to ``like``'s shape (dropping padding), in ``out_dtype`` or ``like``'s dtype."""
    flat = blocks.reshape(*like.shape[:-1], -1)[..., : like.shape[-1]]
    return flat.to(out_dtype or like.dtype)


@functools.lru_cache(maxsize=None)
def constant(value: float, device: torch.device) -> torch.Tensor:
    """A 0-dim float32 tensor on ``device`` (cached: no host-to-device copy per call). Dividing by
    it is IEEE division on every device; torch turns division by a Python scalar into
    multiplication by its reciprocal."""
    return torch.tensor(value, dtype=torch.float32, device=device)


def round_e4m3(v: torch.Tensor) -> torch.Tensor:
    """float32 values rounded to E4M3 (nearest, ties to even), saturating at +-448 like the
    kernels' ``cvt.rn.satfinite`` (a bare cast would turn an overflow into NaN)."""
    return v.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()


def fp8_token_groups(
    x: torch.Tensor,
    group: int,
    *,
    scale_format: Fp8ScaleFormat,
    out_dtype: torch.dtype | None = None,
    name: str | None = None,
) -> torch.Tensor:
    """Dynamic E4M3 quantization per 1 x ``group`` slice of the last dim (W8A8 FP8-block linears: ``group`` is the
    weight block's columns, the release's, e.g. 128 for DeepSeek-V4).

    SGLang's ``kernels/ops/quantization/fp8_kernel.py::sglang_per_token_group_quant_fp8`` and the
    JIT kernels behind it (``per_token_group_quant.cuh``, ``per_token_group_quant_8bit_v2.cuh``):
    ``amax = max(max|x|, 1e-10)`` and the dequant scale ``s = amax * fl(1/448)`` (float32). Then

    * ``scale_format="ue8m0"``: ``s`` rounded up to ``2**e`` (``e`` from the float bits, so exact),
      ``x_hat = e4m3(x * 2**-e) * 2**e``. DeepGEMM dense linears of a ``scale_fmt: ue8m0``
      checkpoint on sm90, every DeepGEMM dense linear on sm100, FP8 ``wo_a`` on sm100.
      Bit-exact against ``formats.fp8_block`` on a ``[1, K]`` view (same rule, same rounding).
    * ``scale_format="float32"``: ``x_hat = e4m3(x * fl(448/amax)) * s``. CUTLASS (sm120 default),
      Triton and FlashInfer dense linears, DeepGEMM on sm90 without ``scale_fmt``, and the Triton
      FP8 MoE runner. The kernel is built with ``--use_fast_math``, so on the GPU ``448/amax`` is
      an approximate division (at most 2 ulp off): a code can differ by one E4M3 step where
      ``x * 448/amax`` lies within a few float32 ulps of a rounding midpoint.

    A last dim that is not a multiple of ``group`` is refused, as the kernel asserts.
    """
    require_input(x, name)
    if scale_format not in ("float32", "ue8m0"):
        raise ActivationFormatError(f"unknown scale_format {scale_format!r} (expected 'float32' or 'ue8m0')",
                                    tensor=name)
    blocks = grouped(x, group, name)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    require_finite(amax, name)
    amax = amax.clamp(min=FP8_AMAX_FLOOR)
    scale = amax * constant(1.0 / E4M3_MAX, x.device)
    if scale_format == "ue8m0":
        exponent = ceil_log2(scale)
        out = round_e4m3(blocks * exp2_float32(-exponent)) * exp2_float32(exponent)
    else:
        out = round_e4m3(blocks * (constant(E4M3_MAX, x.device) / amax)) * scale
    return ungrouped(out, x, out_dtype)


def _input_scale(input_scale: float | torch.Tensor, device: torch.device, name: str | None) -> torch.Tensor:
    scale = torch.as_tensor(input_scale, dtype=torch.float32)
    if scale.numel() != 1:
        raise ActivationFormatError(
            f"input_scale must be one number (SGLang uses the layer's max over experts), got shape "
            f"{list(scale.shape)}",
            tensor=name,
        )
    scale = scale.reshape(()).to(device)
    if not bool(torch.isfinite(scale)) or not bool(scale > 0):
        raise ActivationFormatError(f"input_scale must be finite and positive, got {float(scale)!r}", tensor=name)
    return scale


def nvfp4_activations(
    x: torch.Tensor,
    input_scale: float | torch.Tensor,
    *,
    out_dtype: torch.dtype | None = None,
    name: str | None = None,
) -> torch.Tensor:
    """W4A4 activation quantization of NVFP4 MoE experts: E2M1 per 16, E4M3 block scales.

    ``input_scale`` is ModelOpt's ``amax/(6*448)`` dequant scale. SGLang passes the kernels its
    reciprocal as the global scale, from the *max over the layer's experts*
    (``srt/layers/quantization/modelopt_quant.py::ModelOptNvFp4FusedMoEMethod.process_weights_after_loading``:
    ``w13_input_scale.max()`` for the expert input, ``w2_input_scale.max()`` for the down
    projection's); pass that max. Per 16-element block (FlashInfer
    ``csrc/nv_internal/tensorrt_llm/kernels/quantization_utils.cuh::cvt_warp_fp16_to_fp4``, the
    quantizer of ``fp4_quantize`` and of the CUTLASS MoE's FC2 input)::

        sb  = e4m3(min(amax16 / (6 * input_scale), 448))     # no lower clamp: tiny blocks -> 0
        x_hat = e2m1(x / (sb * input_scale)) * sb * input_scale

    With ModelOpt's arithmetic, so it is bit-exact with ``formats.nvfp4.quantize_nvfp4`` /
    ``dequantize_nvfp4`` given the same global scale, except that ModelOpt clamps block scales
    up to 2**-9 where the kernel's cast rounds a scale at or below 2**-10 to 0 (that block
    becomes 0), and that activations above the calibrated range clip at ``6*448*input_scale``
    instead of being refused. The kernel forms ``sb`` as ``(1/input_scale) * (amax16 * rcp(6))``
    and divides by ``rcp.approx``: a few ulps apart from the above, which moves a scale or a code
    only at an exact rounding tie of one form and not the other.
    """
    require_input(x, name)
    scale_2 = _input_scale(input_scale, x.device, name)
    blocks = grouped(x, NVFP4_BLOCK, name)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    require_finite(amax, name)
    block_scale = (amax / (E2M1_MAX * scale_2)).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn).float()
    divisor = block_scale * scale_2
    live = block_scale > 0
    codes = encode_e2m1(torch.where(live, blocks / torch.where(live, divisor, 1.0), 0.0))
    out = decode_e2m1(codes) * block_scale
    out *= scale_2
    return ungrouped(out, x, out_dtype)


def mxfp8_activations(
    x: torch.Tensor,
    *,
    out_dtype: torch.dtype | None = None,
    name: str | None = None,
) -> torch.Tensor:
    """MXFP8: E4M3 elements, one UE8M0 scale per 32 along the last dim (W4A8 MXFP4 MoE runners).

    FlashInfer ``quantization_utils.cuh::cvt_warp_fp16_to_mxfp8`` (``mxfp8_quantize``, called by
    SGLang's ``srt/layers/moe/moe_runner/flashinfer_cutlass.py::_fused_experts_flashinfer_mxfp4_cutlass``
    on sm120, and by the CUTLASS MoE for its FC2 input): the scale is ``amax * rcp(448)`` rounded
    *up* to a power of two (``__nv_cvt_float_to_e8m0(.., cudaRoundPosInf)``, saturating to
    2**-127..2**127), ``x_hat = e4m3(x * 2**-e) * 2**e``; an all-zero block stays zero. No amax
    floor. Equal to ``fp8_token_groups(x, 32, scale_format="ue8m0")`` wherever a block's amax is
    at least 1e-10. ``rcp.approx(448)`` is taken as the correctly rounded ``fl(1/448)``
    (unconfirmed on hardware); sm100's CuTe-DSL quantizer takes the ceiling of ``lg2.approx``
    instead of reading the bits, which could pick a scale one binade lower for a block amax just
    above ``448 * 2**k`` (its last element then saturates at 448).

    A ragged last dim is zero-padded to a multiple of 32, as ``mxfp8_quantize(alignment=32)`` pads.
    """
    require_input(x, name)
    blocks = grouped(x, MXFP8_GROUP, name, pad=True)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    require_finite(amax, name)
    exponent = ceil_log2(amax * constant(1.0 / E4M3_MAX, x.device)).clamp(_UE8M0_MIN_EXP, _UE8M0_MAX_EXP)
    out = round_e4m3(blocks * exp2_float32(-exponent)) * exp2_float32(exponent)
    return ungrouped(out, x, out_dtype)
