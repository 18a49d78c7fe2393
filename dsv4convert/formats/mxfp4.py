"""MXFP4 as stored by DeepSeek-V4 for its routed experts.

``W[n, k] = e2m1(code[n, k]) * 2**(scale[n, k // 32] - 127)`` with the codes packed two per
byte (even k in the low nibble) in an I8 tensor ``[N, K/2]`` and the scale F8_E8M0
``[N, K/32]`` (dsv4-checkpoint.md §5).

Scale rule (DeepSeek's ``fp4_quant_kernel`` in the V4 ``inference/kernel.py``): clamp the
block amax up to ``6 * 2**-126``, then ``X = ceil(log2(amax / 6))``. The kernel multiplies by
float32 ``1/6`` and takes the ceiling from the IEEE bits; dividing by 6 gives the same
exponent, because a float32 quotient can only land on 2**X when amax is exactly 6 * 2**X
(a neighbouring amax is 0.67 ulp away from it after the division, more than the half ulp
rounding can absorb), and the 1/6 product rounds to the same power of two there. The
ceiling means ``amax / 2**X`` lies in (3, 6], so no element clips, and an all-zero block
gets ``X = -126`` (byte 1), as in the reference.
"""

from __future__ import annotations

import torch

from dsv4convert.errors import FormatError
from dsv4convert.formats.numerics import (
    E2M1_MAX,
    ceil_log2,
    decode_e2m1_packed,
    divide,
    e8m0_to_float,
    encode_e2m1,
    exp2_float32,
    exponent_to_e8m0,
    pack_nibbles,
    require_finite,
)

MXFP4_BLOCK = 32
# The kernel's amax floor: the smallest amax whose scale is a normal float32 (2**-126).
_AMAX_FLOOR = E2M1_MAX * 2.0**-126


def _require_weight(w: torch.Tensor, name: str | None) -> None:
    if w.ndim != 2 or w.shape[1] % MXFP4_BLOCK:
        raise FormatError(
            f"MXFP4 needs a 2-D weight [N, K] with K a multiple of {MXFP4_BLOCK}, got shape {list(w.shape)}",
            tensor=name,
        )


def mxfp4_exponents(amax: torch.Tensor) -> torch.Tensor:
    """int32 block exponents ``X = ceil(log2(max(amax, 6 * 2**-126) / 6))`` (DeepSeek's rule)."""
    return ceil_log2(divide(amax.float().clamp(min=_AMAX_FLOOR), E2M1_MAX))


def quantize_mxfp4(w: torch.Tensor, *, name: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``w[N, K]`` to ``(packed int8 [N, K/2], scale float8_e8m0fnu [N, K/32])``."""
    _require_weight(w, name)
    n, k = w.shape
    blocks = w.float().reshape(n, k // MXFP4_BLOCK, MXFP4_BLOCK)
    amax = blocks.abs().amax(dim=-1)
    require_finite(amax, name, "weights")
    exponent = mxfp4_exponents(amax)
    # Multiplying by 2**-X is exact (X is in [-126, 126], so 2**-X is a normal float32).
    codes = encode_e2m1(blocks * exp2_float32(-exponent)[..., None]).reshape(n, k)
    packed = pack_nibbles(codes, name=name).view(torch.int8)
    return packed, exponent_to_e8m0(exponent, name=name)


def mxfp4_shape(packed: torch.Tensor, scale: torch.Tensor, name: str | None) -> tuple[int, int]:
    """Logical [N, K] of MXFP4 ``(codes [N, K/2], scale [N, K/32])``; FormatError if they disagree."""
    if packed.ndim != 2 or packed.dtype not in (torch.int8, torch.uint8):
        raise FormatError(f"MXFP4 codes must be int8/uint8 [N, K/2], got {packed.dtype} {list(packed.shape)}",
                          tensor=name)
    n, k = packed.shape[0], packed.shape[1] * 2
    if k % MXFP4_BLOCK or tuple(scale.shape) != (n, k // MXFP4_BLOCK):
        raise FormatError(
            f"MXFP4 scale shape {list(scale.shape)} does not match codes {list(packed.shape)} "
            f"(expected [{n}, {k // MXFP4_BLOCK}])",
            tensor=name,
        )
    return n, k


def dequantize_mxfp4(
    packed: torch.Tensor,
    scale: torch.Tensor,
    *,
    out_dtype: torch.dtype = torch.float32,
    name: str | None = None,
) -> torch.Tensor:
    """``W[N, K]`` from packed codes ``[N, K/2]`` (int8 or uint8) and E8M0 scales ``[N, K/32]``.

    The products are computed in float32; a scale above 2**125 can overflow it (not seen
    in real weights, whose scales sit far below 1).
    """
    n, k = mxfp4_shape(packed, scale, name)
    values = decode_e2m1_packed(packed).reshape(n, k // MXFP4_BLOCK, MXFP4_BLOCK)
    values *= e8m0_to_float(scale, name=name)[..., None]
    return values.reshape(n, k).to(out_dtype)
