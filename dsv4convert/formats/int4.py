"""INT4 W4A16 in compressed-tensors' ``pack-quantized`` layout (formats.md §6.1).

Tensors per linear: ``weight_packed`` int32 ``[N, ceil(K/8)]`` (code + 8, element i of each
word at bits 4i), ``weight_scale`` BF16 ``[N, K/g]`` (dequant multiplier), ``weight_shape``
int64 ``[2]`` = (N, K). Symmetric, no zero point: ``W ~= q * scale`` with q in [-8, 7].

Rules, checked against compressed-tensors 0.18.0 (the version SGLang 0.5.23 pins):

* Scale: ``calculate_qparams`` in ``compressed_tensors/quantization/utils/helpers.py`` takes
  ``max(|min|, |max|) / ((q_max - q_min) / 2)`` = amax / 7.5 and replaces a zero scale by
  ``torch.finfo(dtype).eps``.
* Codes: ``_quantize`` in ``quantization/lifecycle/forward_helpers.py`` computes
  ``round(clamp(x / scale, -8, 7))`` (torch.round: half to even) in torch's promoted dtype of
  ``(x, scale)``. The compressor divides by the *stored* (model-dtype, BF16) scale, so the
  codes must come from the BF16-rounded scale, and a BF16 weight divided by a BF16 scale
  rounds the quotient to BF16 before the integer rounding. We divide the same tensors the
  same way, which makes the codes bit-identical.
* Packing: ``pack_to_int32`` in ``compressors/pack_quantized/helpers.py`` adds 8, pads K
  with zero nibbles and places element i of each 8-group at bits 4i. On a little-endian
  machine that is exactly the uint8 ``[N, K/2]`` nibble layout of :func:`pack_nibbles`
  viewed as int32, which is how we build it.

Quantization is split into :func:`int4_group_scales` and :func:`quantize_int4` so a
calibrated algorithm (GPTQ) can choose the codes column by column with :func:`round_to_int4`
against the same scales.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dsv4convert.errors import FormatError
from dsv4convert.formats.numerics import divide, pack_nibbles, require_finite, unpack_nibbles

INT4_MIN = -8
INT4_MAX = 7
INT4_OFFSET = 8
# compressed-tensors' symmetric divisor: (q_max - q_min) / 2 = 7.5.
INT4_SCALE_DIVISOR = (INT4_MAX - INT4_MIN) / 2
_CODES_PER_WORD = 8


@dataclass
class Int4Weight:
    """The three tensors compressed-tensors stores for a symmetric pack-quantized linear."""

    weight_packed: torch.Tensor  # int32 [N, ceil(K/8)]
    weight_scale: torch.Tensor   # bfloat16 [N, K/g]
    weight_shape: torch.Tensor   # int64 [2]


def _grouped(w: torch.Tensor, group_size: int, name: str | None) -> torch.Tensor:
    if w.ndim != 2 or group_size <= 0 or w.shape[1] % group_size:
        raise FormatError(
            f"INT4 group quantization needs a 2-D weight [N, K] with K a multiple of the group size "
            f"{group_size}, got shape {list(w.shape)}",
            tensor=name,
        )
    return w.unflatten(-1, (w.shape[1] // group_size, group_size))


def int4_group_scales(w: torch.Tensor, *, group_size: int = 128, name: str | None = None) -> torch.Tensor:
    """float32 ``[N, K/g]`` symmetric scales ``amax / 7.5`` (zero groups: ``finfo(w.dtype).eps``).

    Rounding the result to BF16 gives compressed-tensors' BF16 scale bit for bit, whether
    ``w`` is float32 or BF16 (a BF16 division is the float32 division rounded once).
    """
    amax = _grouped(w, group_size, name).abs().amax(dim=-1).float()
    require_finite(amax, name, "weights")
    scale = divide(amax, INT4_SCALE_DIVISOR)
    eps = torch.finfo(w.dtype).eps
    return torch.where(scale == 0, torch.full_like(scale, eps), scale)


def round_to_int4(scaled: torch.Tensor) -> torch.Tensor:
    """int8 codes ``clamp(round_half_even(scaled), -8, 7)`` of already divided weights."""
    return scaled.clamp(INT4_MIN, INT4_MAX).round().to(torch.int8)


def quantize_int4(
    w: torch.Tensor,
    scale: torch.Tensor,
    *,
    group_size: int = 128,
    name: str | None = None,
) -> torch.Tensor:
    """int8 codes ``[N, K]`` in [-8, 7] for ``w`` under the given group scales ``[N, K/g]``.

    Pass the scale in the dtype it will be stored in (BF16): the codes then match what
    compressed-tensors writes for the same weight and scale.
    """
    groups = _grouped(w, group_size, name)
    if tuple(scale.shape) != tuple(groups.shape[:2]):
        raise FormatError(
            f"INT4 scale shape {list(scale.shape)} does not match weight {list(w.shape)} "
            f"with group size {group_size}",
            tensor=name,
        )
    require_finite(w, name, "weights")
    if not bool((scale > 0).all()) or not bool(torch.isfinite(scale).all()):
        raise FormatError("INT4 scales must be positive and finite", tensor=name)
    return round_to_int4(groups / scale.unsqueeze(-1)).reshape(w.shape)


def _require_little_endian() -> None:
    if sys.byteorder != "little":
        raise FormatError("INT4 packing reinterprets bytes as int32 and needs a little-endian machine")


def pack_int4(q: torch.Tensor, *, name: str | None = None) -> torch.Tensor:
    """Pack int8 codes ``[N, K]`` in [-8, 7] into int32 ``[N, ceil(K/8)]`` (compressed-tensors layout)."""
    _require_little_endian()
    if q.ndim != 2 or q.dtype != torch.int8:
        raise FormatError(f"INT4 codes must be int8 [N, K], got {q.dtype} {list(q.shape)}", tensor=name)
    if q.numel() and (int(q.min()) < INT4_MIN or int(q.max()) > INT4_MAX):
        raise FormatError(f"INT4 codes must lie in [{INT4_MIN}, {INT4_MAX}]", tensor=name)
    stored = (q + INT4_OFFSET).to(torch.uint8)
    pad = -q.shape[1] % _CODES_PER_WORD
    if pad:
        stored = F.pad(stored, (0, pad))
    return pack_nibbles(stored, name=name).view(torch.int32)


def unpack_int4(packed: torch.Tensor, shape: tuple[int, int] | torch.Size | torch.Tensor, *,
                name: str | None = None) -> torch.Tensor:
    """int8 codes ``[N, K]`` from int32 ``weight_packed`` and ``weight_shape`` (N, K)."""
    _require_little_endian()
    n, k = (int(v) for v in shape)
    words = -(-k // _CODES_PER_WORD)
    if packed.dtype != torch.int32 or tuple(packed.shape) != (n, words):
        raise FormatError(
            f"weight_packed must be int32 [{n}, {words}] for weight_shape ({n}, {k}), "
            f"got {packed.dtype} {list(packed.shape)}",
            tensor=name,
        )
    codes = unpack_nibbles(packed.contiguous().view(torch.uint8))[:, :k]
    return codes.to(torch.int8) - INT4_OFFSET


def dequantize_int4(
    packed: torch.Tensor,
    scale: torch.Tensor,
    shape: tuple[int, int] | torch.Size | torch.Tensor,
    *,
    group_size: int = 128,
    out_dtype: torch.dtype = torch.float32,
    name: str | None = None,
) -> torch.Tensor:
    """``W = q * scale``; the float32 product is exact, so ``out_dtype`` rounds it once."""
    codes = unpack_int4(packed, shape, name=name)
    groups = _grouped(codes, group_size, name)
    if tuple(scale.shape) != tuple(groups.shape[:2]):
        raise FormatError(
            f"INT4 scale shape {list(scale.shape)} does not match weight_shape {list(codes.shape)} "
            f"with group size {group_size}",
            tensor=name,
        )
    values = groups.float() * scale.float().unsqueeze(-1)
    return values.reshape(codes.shape).to(out_dtype)


def quantize_int4_weight(w: torch.Tensor, *, group_size: int = 128, name: str | None = None) -> Int4Weight:
    """Round-to-nearest W4A16 with BF16 scales, in compressed-tensors' stored form."""
    scale = int4_group_scales(w, group_size=group_size, name=name).to(torch.bfloat16)
    codes = quantize_int4(w, scale, group_size=group_size, name=name)
    return Int4Weight(
        weight_packed=pack_int4(codes, name=name),
        weight_scale=scale,
        weight_shape=torch.tensor(list(w.shape), dtype=torch.int64),
    )
