"""Torch references for every kernel: the ground truth the Triton kernels are checked against.

Weights are dequantized by ``dsv4convert.formats`` (the CPU conversion path), so a kernel that
matches these references matches what the converters write and read. These functions are also
the CPU fallback of :mod:`dsv4convert.kernels` when Triton or a GPU is missing.
"""

from __future__ import annotations

import torch

from dsv4convert.formats.fp8_block import dequantize_fp8_block
from dsv4convert.formats.int4 import dequantize_int4
from dsv4convert.formats.mxfp4 import dequantize_mxfp4
from dsv4convert.formats.numerics import E4M3_MAX, ceil_log2, exp2_float32
from dsv4convert.formats.nvfp4 import dequantize_nvfp4
from dsv4convert.kernels.operands import QuantizedWeight

# Floor on a token group's amax before it becomes a scale, so an all-zero group divides by a
# positive number (the value vLLM's per_token_group_quant_fp8 uses).
ACTIVATION_EPS = 1e-10


def dequantize_expert(weight: QuantizedWeight, expert: int, out_dtype: torch.dtype) -> torch.Tensor:
    """W[expert] as ``out_dtype`` [N, K], computed by the formats module of its format."""
    tensors = weight.expert_tensors(expert)
    if weight.fmt == "fp8":
        return dequantize_fp8_block(tensors[0], tensors[1], block=weight.block, out_dtype=out_dtype)
    if weight.fmt == "mxfp4":
        return dequantize_mxfp4(tensors[0], tensors[1], out_dtype=out_dtype)
    if weight.fmt == "nvfp4":
        return dequantize_nvfp4(tensors[0], tensors[1], tensors[2], out_dtype=out_dtype)
    return dequantize_int4(tensors[0], tensors[1], (weight.n, weight.k), group_size=weight.group,
                           out_dtype=out_dtype)


def dequantize(weight: QuantizedWeight, out_dtype: torch.dtype) -> torch.Tensor:
    """All experts dequantized: [N, K] for a single matrix, [E, N, K] for a stack."""
    experts = [dequantize_expert(weight, e, out_dtype) for e in range(weight.experts)]
    return torch.stack(experts) if weight.stacked else experts[0]


def quantize_activations_fp8(x: torch.Tensor, *, group: int, pow2_scale: bool = True,
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token and ``group`` channels (an FP8 weight block's columns): ``s = max(amax, eps)/448``, rounded up
    to 2^k when ``pow2_scale``.

    Returns ``(float8_e4m3fn [M, K], float32 scales [M, ceil(K/group)])`` (formats.md §5,
    DeepSeek's ``act_quant`` with ``scale_fmt="ue8m0"``). A ragged last group is zero-padded.
    """
    m, k = x.shape
    pad = -k % group
    groups = torch.nn.functional.pad(x.float(), (0, pad)).reshape(m, (k + pad) // group, group)
    # Divide in float64 and round once to float32: the correctly rounded float32 quotient on any
    # device (torch on CUDA divides by a Python scalar through its reciprocal).
    amax = groups.abs().amax(dim=-1).clamp(min=ACTIVATION_EPS)
    scale = (amax.double() / E4M3_MAX).float()
    if pow2_scale:
        scale = exp2_float32(ceil_log2(scale))
    q = (groups.double() / scale.double()[..., None]).float()
    q = q.to(torch.float8_e4m3fn).reshape(m, k + pad)[:, :k]
    return q.contiguous(), scale


def dequantize_activations_fp8(q: torch.Tensor, scale: torch.Tensor, *, group: int) -> torch.Tensor:
    """FP32 activations back from :func:`quantize_activations_fp8`'s output."""
    m, k = q.shape
    return (q.float() * scale.repeat_interleave(group, dim=1)[:, :k])


def expert_rows(offsets: torch.Tensor) -> list[tuple[int, int]]:
    """(begin, end) token rows of each expert from an ``[E + 1]`` offsets tensor."""
    bounds = offsets.tolist()
    return list(zip(bounds[:-1], bounds[1:]))


def grouped_gemm(weight: QuantizedWeight, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """FP32 ``Y[rows of e] = X[rows of e] @ W[e]^T`` with W dequantized exactly.

    For ``fp8`` the activations go through :func:`quantize_activations_fp8` first, as the
    kernel's do; the other formats multiply the BF16 activations as given.
    """
    if weight.fmt == "fp8":
        q, scale = quantize_activations_fp8(x, group=weight.group)
        activations = dequantize_activations_fp8(q, scale, group=weight.group)
    else:
        activations = x.float()
    y = torch.zeros(x.shape[0], weight.n, dtype=torch.float32, device=x.device)
    for expert, (begin, end) in enumerate(expert_rows(offsets)):
        if end > begin:
            y[begin:end] = activations[begin:end] @ dequantize_expert(weight, expert, torch.float32).T
    return y
