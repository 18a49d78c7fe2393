"""GPU kernels for checking and producing quantized weights, with torch fallbacks.

Every function takes ``backend``: ``"auto"`` runs the Triton kernel when Triton can run on the
tensors' device (a CUDA GPU, or CPU tensors under ``TRITON_INTERPRET=1``) and the torch
reference otherwise; ``"triton"`` insists on the kernel; ``"torch"`` forces the reference. The
two agree bit for bit on dequantization and quantization, and to BF16 rounding on GEMMs, so
callers such as the validator run anywhere and get the same answers.

Weight tensors are passed as a checkpoint stores them; see :mod:`dsv4convert.kernels.operands`
for each format's tuple. FP8 takes the ``block`` (rows, cols) it is written in, the release's (128x128 for
DeepSeek-V4, 32x32 for V4.1): nothing here assumes one. Formats: ``fp8``, ``mxfp4``, ``nvfp4``, ``int4`` (the format registry's names, :class:`dsv4convert.formats.Format`).

:func:`quantize` and :func:`transcode_mxfp4` are the converters' GPU path: they return exactly
what the ``dsv4convert.formats`` functions return (same types, same bytes, same exactness
reports), so a converter can run on either device and write identical files.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Literal

import torch

from dsv4convert.errors import DSV4Error, FormatError
from dsv4convert.formats.fp8_block import Block, ScaleFormat, quantize_fp8_block
from dsv4convert.formats.int4 import DEFAULT_SCALE_RULE, Int4Weight, ScaleRule, quantize_int4_weight
from dsv4convert.formats.nvfp4 import NVFP4Weight
from dsv4convert.formats.transcode import ExactnessReport, mxfp4_to_fp8_block, mxfp4_to_nvfp4
from dsv4convert.kernels import reference
from dsv4convert.kernels._runtime import triton_can_run_on, triton_installed
from dsv4convert.kernels.operands import FORMATS, QuantizedWeight, quantized_weight

Backend = Literal["auto", "triton", "torch"]

__all__ = [
    "FORMATS",
    "dequantize",
    "gemm",
    "grouped_gemm",
    "kernels_available",
    "quantize",
    "quantize_activations_fp8",
    "transcode_mxfp4",
]


def kernels_available(device: torch.device | str | None = None) -> bool:
    """Whether the Triton kernels can run on ``device`` (default: the GPU if there is one)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return triton_can_run_on(torch.device(device))


def _use_triton(device: torch.device, backend: Backend) -> bool:
    if backend == "torch":
        return False
    if backend not in ("auto", "triton"):
        raise ValueError(f"backend must be 'auto', 'triton' or 'torch', got {backend!r}")
    runnable = triton_can_run_on(device)
    if backend == "triton" and not runnable:
        reason = "Triton is not installed" if not triton_installed() else (
            f"tensors on {device} need a CUDA GPU, or TRITON_INTERPRET=1 for CPU tensors")
        raise DSV4Error(f"the Triton kernels cannot run: {reason}")
    return runnable


def _triton() -> SimpleNamespace:
    """The Triton launchers, imported when a kernel first runs: Triton is an optional dependency (``[gpu]``)."""
    from dsv4convert.kernels import launch, quantize_launch

    return SimpleNamespace(launch=launch, quantize=quantize_launch)


def dequantize(fmt: str, *tensors: torch.Tensor, block: Block | None = None, out_dtype: torch.dtype = torch.bfloat16,
               backend: Backend = "auto", name: str | None = None) -> torch.Tensor:
    """Dense weights ``[N, K]`` (or ``[E, N, K]`` for a stack of experts) from a quantized weight."""
    weight = quantized_weight(fmt, tensors, block=block, name=name)
    if _use_triton(weight.device, backend):
        return _triton().launch.dequantize(weight, out_dtype)
    return reference.dequantize(weight, out_dtype)


def quantize_activations_fp8(x: torch.Tensor, *, group: int, pow2_scale: bool = True,
                             backend: Backend = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token, per-``group``-channel FP8 activations ``(float8_e4m3fn [M, K], float32 [M, ceil(K/group)])``;
    ``group`` is the FP8 weight block's columns.

    ``pow2_scale`` rounds each scale up to a power of two, as DeepSeek's ``ue8m0`` kernels do.
    """
    if x.ndim != 2:
        raise FormatError(f"activations must be [M, K], got shape {list(x.shape)}")
    if _use_triton(x.device, backend):
        return _triton().launch.quantize_activations_fp8(x.contiguous(), group=group, pow2_scale=pow2_scale)
    return reference.quantize_activations_fp8(x, group=group, pow2_scale=pow2_scale)


def _run_grouped(weight: QuantizedWeight, x: torch.Tensor, offsets: torch.Tensor, backend: Backend) -> torch.Tensor:
    if x.shape[-1] != weight.k:
        raise FormatError(f"activations have {x.shape[-1]} channels but the {weight.fmt} weight has K={weight.k}")
    if x.device != weight.device:
        raise FormatError(f"activations are on {x.device} but the weight is on {weight.device}")
    x = x.to(torch.bfloat16)
    if _use_triton(weight.device, backend):
        return _triton().launch.grouped_gemm(weight, x, offsets)
    return reference.grouped_gemm(weight, x, offsets).to(torch.bfloat16)


def gemm(fmt: str, x: torch.Tensor, *tensors: torch.Tensor, block: Block | None = None, backend: Backend = "auto",
         name: str | None = None) -> torch.Tensor:
    """BF16 ``Y = X @ W^T`` for BF16 ``X [M, K]`` and one quantized ``W [N, K]``, dequantized in the kernel.

    For ``fp8`` the activations are quantized per token and ``block``'s columns first
    (:func:`quantize_activations_fp8`) and the product runs on FP8 tensor cores.
    """
    weight = quantized_weight(fmt, tensors, block=block, name=name)
    if weight.stacked:
        raise FormatError(f"gemm takes one matrix; use grouped_gemm for a stack of {weight.experts}", tensor=name)
    if x.ndim != 2:
        raise FormatError(f"activations must be [M, K], got shape {list(x.shape)}", tensor=name)
    offsets = torch.tensor([0, x.shape[0]], dtype=torch.int32, device=x.device)
    return _run_grouped(weight, x, offsets, backend)


def grouped_gemm(fmt: str, x: torch.Tensor, *tensors: torch.Tensor, expert_offsets: torch.Tensor | None = None,
                 block: Block | None = None, backend: Backend = "auto", name: str | None = None) -> torch.Tensor:
    """All experts of a layer in one launch, with stacked weights ``[E, N, K]``.

    Either ``x`` is a dense probe batch ``[E, M, K]`` (returns ``[E, M, N]``), or ``x`` is
    ``[T, K]`` with tokens sorted by expert and ``expert_offsets`` int ``[E + 1]`` giving each
    expert's rows ``offsets[e]:offsets[e+1]`` (returns ``[T, N]``), as serving MoE kernels take them.
    """
    weight = quantized_weight(fmt, tensors, block=block, name=name)
    if not weight.stacked:
        raise FormatError("grouped_gemm takes stacked weights [E, N, K']; use gemm for one matrix", tensor=name)
    experts = weight.experts
    if expert_offsets is None:
        if x.ndim != 3 or x.shape[0] != experts:
            raise FormatError(f"a dense probe batch must be [{experts}, M, K], got shape {list(x.shape)}", tensor=name)
        tokens = x.shape[1]
        offsets = torch.arange(experts + 1, dtype=torch.int32, device=x.device) * tokens
        y = _run_grouped(weight, x.reshape(experts * tokens, x.shape[2]), offsets, backend)
        return y.reshape(experts, tokens, weight.n)
    if x.ndim != 2:
        raise FormatError(f"with expert_offsets the activations must be [T, K], got {list(x.shape)}", tensor=name)
    bounds = expert_offsets.tolist()
    if (len(bounds) != experts + 1 or bounds[0] != 0 or bounds[-1] != x.shape[0]
            or any(b > a for a, b in zip(bounds[1:], bounds[:-1]))):
        raise FormatError(f"expert_offsets must rise from 0 to {x.shape[0]} in {experts + 1} steps, got {bounds}",
                          tensor=name)
    return _run_grouped(weight, x, expert_offsets.to(device=x.device, dtype=torch.int32), backend)


def quantize(fmt: Literal["fp8", "int4"], w: torch.Tensor, *, block: Block | None = None,
             scale_fmt: ScaleFormat = "ue8m0", group_size: int = 128, scale_rule: ScaleRule = DEFAULT_SCALE_RULE,
             backend: Backend = "auto", name: str | None = None) -> tuple[torch.Tensor, torch.Tensor] | Int4Weight:
    """Quantize a dense weight ``[N, K]`` where it lives, bit-identical to the CPU path.

    ``fp8`` returns :func:`dsv4convert.formats.quantize_fp8_block`'s ``(weight, scale)``
    (``block``, required, and ``scale_fmt`` apply); ``int4`` returns
    :func:`dsv4convert.formats.quantize_int4_weight`'s :class:`Int4Weight` (``group_size`` and
    ``scale_rule`` apply).
    """
    if fmt not in ("fp8", "int4"):
        raise FormatError(f"quantize writes 'fp8' or 'int4', not {fmt!r}", tensor=name)
    if fmt == "fp8" and block is None:
        raise FormatError("fp8 quantization needs the block (rows, cols) to write", tensor=name)
    if not _use_triton(w.device, backend):
        if fmt == "fp8":
            return quantize_fp8_block(w, block=block, scale_fmt=scale_fmt, name=name)
        return quantize_int4_weight(w, group_size=group_size, scale_rule=scale_rule, name=name)
    if fmt == "fp8":
        return _triton().quantize.quantize_fp8_block(w, block=block, scale_fmt=scale_fmt, name=name)
    return _triton().quantize.quantize_int4_weight(w, group_size=group_size, scale_rule=scale_rule, name=name)


def transcode_mxfp4(target: Literal["nvfp4", "fp8"], packed: torch.Tensor, scale: torch.Tensor, *,
                    global_exponent: int | None = None, block: Block | None = None, backend: Backend = "auto",
                    name: str | None = None,
                    ) -> tuple[NVFP4Weight, ExactnessReport] | tuple[torch.Tensor, torch.Tensor, ExactnessReport]:
    """Re-encode MXFP4 ``(packed [N, K/2], scale [N, K/32])`` where it lives, bit-identical to the CPU path.

    ``nvfp4`` returns :func:`dsv4convert.formats.mxfp4_to_nvfp4`'s ``(NVFP4Weight, report)``
    (``global_exponent`` applies; pass the one w1 and w3 share); ``fp8`` returns
    :func:`dsv4convert.formats.mxfp4_to_fp8_block`'s ``(weight, scale, report)`` in ``block`` (required).
    """
    if target not in ("nvfp4", "fp8"):
        raise FormatError(f"MXFP4 transcodes to 'nvfp4' or 'fp8', not {target!r}", tensor=name)
    if target == "fp8" and global_exponent is not None:
        raise FormatError("global_exponent applies to the NVFP4 transcode only", tensor=name)
    if (target == "fp8") != (block is not None):
        raise FormatError("the FP8 transcode needs its block (rows, cols), and only it takes one", tensor=name)
    if not _use_triton(packed.device, backend):
        if target == "nvfp4":
            return mxfp4_to_nvfp4(packed, scale, global_exponent=global_exponent, name=name)
        return mxfp4_to_fp8_block(packed, scale, block=block, name=name)
    if target == "nvfp4":
        return _triton().quantize.mxfp4_to_nvfp4(packed, scale, global_exponent=global_exponent, name=name)
    return _triton().quantize.mxfp4_to_fp8_block(packed, scale, block=block, name=name)
