"""NVFP4 in NVIDIA ModelOpt's export layout (formats.md §2.1).

Tensors per linear: ``weight`` uint8 ``[N, K/2]`` (E2M1 codes, even k in the low nibble),
``weight_scale`` float8_e4m3fn ``[N, K/16]`` (row-major, not swizzled), ``weight_scale_2``
float32 scalar, ``input_scale`` float32 scalar. All scales are dequant multipliers::

    W ~= e2m1(code) * weight_scale[n, k // 16] * weight_scale_2

ModelOpt's quantizer, reproduced operation by operation::

    s2  = global_amax / (6 * 448)
    sb  = amax16 / (6 * s2), with sb == 0 replaced by 1
    sb8 = e4m3(clamp(sb, 2**-9, 448))
    q   = RNE_E2M1(W / (sb8 * s2))
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv4convert.errors import FormatError
from dsv4convert.formats.numerics import (
    E2M1_MAX,
    E4M3_MAX,
    E4M3_MIN_EXP,
    decode_e2m1_packed,
    divide,
    encode_e2m1,
    pack_nibbles,
    require_finite,
)

NVFP4_BLOCK = 16
_SCALE_2_DIVISOR = E2M1_MAX * E4M3_MAX  # 2688: maps the global amax onto 6 * 448


@dataclass
class NVFP4Weight:
    """The three weight tensors of one NVFP4 linear, in their on-disk dtypes."""

    weight: torch.Tensor          # uint8 [N, K/2]
    weight_scale: torch.Tensor    # float8_e4m3fn [N, K/16]
    weight_scale_2: torch.Tensor  # float32, 0-dim


def _scale_2_from_amax(amax: float | torch.Tensor) -> torch.Tensor:
    amax = torch.as_tensor(amax)
    return divide(amax.to(torch.float32).reshape(()), _SCALE_2_DIVISOR)


def input_scale_from_amax(amax: float | torch.Tensor) -> torch.Tensor:
    """ModelOpt's ``input_scale = amax / (6 * 448)`` as a float32 0-dim tensor."""
    return _scale_2_from_amax(amax)


def quantize_nvfp4(
    w: torch.Tensor,
    *,
    global_amax: float | torch.Tensor | None = None,
    name: str | None = None,
) -> NVFP4Weight:
    """Quantize ``w[N, K]`` with ModelOpt's rules.

    ``global_amax`` overrides ``max|w|`` when several shards must share ``weight_scale_2``
    (an expert's w1 and w3: pass the max of both amaxes). It may not be below ``max|w|``,
    since the block scales would then saturate at 448 and clip weights. A tensor that is
    entirely zero (global amax 0) gets ``weight_scale_2 = 1`` and block scales 1.
    """
    if w.ndim != 2 or w.shape[1] % NVFP4_BLOCK:
        raise FormatError(
            f"NVFP4 needs a 2-D weight [N, K] with K a multiple of {NVFP4_BLOCK}, got shape {list(w.shape)}",
            tensor=name,
        )
    n, k = w.shape
    blocks = w.float().reshape(n, k // NVFP4_BLOCK, NVFP4_BLOCK)
    block_amax = blocks.abs().amax(dim=-1)
    require_finite(block_amax, name, "weights")
    tensor_amax = block_amax.max() if block_amax.numel() else torch.zeros((), device=w.device)
    if global_amax is None:
        amax = tensor_amax
    else:
        amax = torch.as_tensor(global_amax, dtype=torch.float32, device=w.device).reshape(())
        require_finite(amax, name, "global_amax")
        if bool(amax < tensor_amax):
            raise FormatError(
                f"global_amax {float(amax):g} is below the tensor's own amax {float(tensor_amax):g}; "
                "its largest weights would clip",
                tensor=name,
            )
    scale_2 = _scale_2_from_amax(amax)
    if bool(scale_2 == 0):
        scale_2 = torch.ones((), dtype=torch.float32, device=w.device)
    block_scale = block_amax / (E2M1_MAX * scale_2)
    block_scale = torch.where(block_scale == 0, torch.ones_like(block_scale), block_scale)
    block_scale_e4m3 = block_scale.clamp(2.0**E4M3_MIN_EXP, E4M3_MAX).to(torch.float8_e4m3fn)
    divisor = block_scale_e4m3.float() * scale_2
    codes = encode_e2m1(blocks / divisor[..., None]).reshape(n, k)
    return NVFP4Weight(pack_nibbles(codes, name=name), block_scale_e4m3, scale_2)


def dequantize_nvfp4(
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_scale_2: torch.Tensor | float,
    *,
    out_dtype: torch.dtype = torch.float32,
    name: str | None = None,
) -> torch.Tensor:
    """``W = e2m1(weight) * weight_scale * weight_scale_2``.

    The first product (E2M1 times E4M3, at most 2 x 4 significant bits) is exact in float32,
    so the result is the correctly rounded float32 of the exact triple product.
    """
    if weight.ndim != 2 or weight.dtype not in (torch.uint8, torch.int8):
        raise FormatError(f"NVFP4 weight must be uint8 [N, K/2], got {weight.dtype} {list(weight.shape)}",
                          tensor=name)
    n, k = weight.shape[0], weight.shape[1] * 2
    if tuple(weight_scale.shape) != (n, k // NVFP4_BLOCK) or k % NVFP4_BLOCK:
        raise FormatError(
            f"NVFP4 weight_scale shape {list(weight_scale.shape)} does not match weight {list(weight.shape)} "
            f"(expected [{n}, {k // NVFP4_BLOCK}])",
            tensor=name,
        )
    if weight_scale.dtype != torch.float8_e4m3fn:
        raise FormatError(f"NVFP4 weight_scale must be float8_e4m3fn, got {weight_scale.dtype}", tensor=name)
    values = decode_e2m1_packed(weight).reshape(n, k // NVFP4_BLOCK, NVFP4_BLOCK)
    values *= weight_scale.float()[..., None]
    values *= torch.as_tensor(weight_scale_2, dtype=torch.float32, device=weight.device)
    return values.reshape(n, k).to(out_dtype)
