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

Two scale rules (``scale_rule``), both stored the same way:

* ``"amax"``: compressed-tensors' own ``amax / 7.5`` (so +amax lands on 7.5, rounds to 8 and
  clamps to 7; -amax lands on -8). Bit-identical to compressed-tensors, llm-compressor's
  round-to-nearest and dsv4convert before the search existed.
* ``"mse"`` (the default): per group, the BF16 scale among ``amax / d`` for ``d`` in
  :data:`MSE_DIVISORS` whose codes have the least squared error ``sum (w - q * scale)^2``
  (a clip-ratio search, as AWQ and auto-round do). ``d = 7.5`` is tried first and replaced only
  by a candidate that is provably better, so no group is ever worse than under ``"amax"``.
  See :func:`mse_group_scales` for why the result is the same on every device.

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
from dsv4convert.format_names import DEFAULT_SCALE_RULE, SCALE_RULES, ScaleRule
from dsv4convert.formats.numerics import divide, pack_nibbles, require_finite, unpack_nibbles

INT4_MIN = -8
INT4_MAX = 7
INT4_OFFSET = 8
# compressed-tensors' symmetric divisor: (q_max - q_min) / 2 = 7.5.
INT4_SCALE_DIVISOR = (INT4_MAX - INT4_MIN) / 2
_CODES_PER_WORD = 8

# The "mse" rule's candidate scales are amax / d. compressed-tensors' 7.5 comes first (ties keep
# it). 8 puts -amax exactly on -8; 7 puts +amax exactly on 7; 6 suits groups of MXFP4-decoded
# weights, whose values 0, 1, 2, 3, 4, 6 (x 2^k) it represents exactly; 8.25-11 clip a lone
# outlier. On MXFP4-sourced, Gaussian, Laplace and Student-t(3) weights these 12 come within
# 0.06 dB of the best of 193 divisors (4 to 16 in steps of 1/16), at group 32 and 128.
MSE_DIVISORS: tuple[float, ...] = (7.5, 6.0, 6.5, 7.0, 7.25, 7.75, 8.0, 8.25, 8.5, 9.0, 10.0, 11.0)
# Elements per chunk of the search on the CPU: its passes stay in the core's cache.
_SEARCH_CHUNK_CPU = 1 << 17
_SEARCH_CHUNK_OTHER = 1 << 26


def check_scale_rule(scale_rule: str, name: str | None = None) -> None:
    if scale_rule not in SCALE_RULES:
        raise FormatError(f"INT4 scale rule must be one of {', '.join(SCALE_RULES)}, got {scale_rule!r}", tensor=name)


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


def int4_group_scales(w: torch.Tensor, *, group_size: int = 128, scale_rule: ScaleRule = DEFAULT_SCALE_RULE,
                      name: str | None = None) -> torch.Tensor:
    """float32 ``[N, K/g]`` symmetric group scales under ``scale_rule`` (see the module docstring).

    ``"amax"``: ``amax / 7.5`` (zero groups: ``finfo(w.dtype).eps``); rounding it to BF16 gives
    compressed-tensors' BF16 scale bit for bit, whether ``w`` is float32 or BF16 (a BF16 division
    is the float32 division rounded once). ``"mse"``: the chosen BF16 scales, already BF16 values.
    """
    check_scale_rule(scale_rule, name)
    groups = _grouped(w, group_size, name)
    amax = groups.abs().amax(dim=-1).float()
    require_finite(amax, name, "weights")
    if scale_rule == "amax":
        return _scale_from_amax(amax, INT4_SCALE_DIVISOR, w.dtype)
    return mse_group_scales(groups, amax)


def _scale_from_amax(amax: torch.Tensor, divisor: float, dtype: torch.dtype) -> torch.Tensor:
    scale = divide(amax, divisor)
    return torch.where(scale == 0, torch.full_like(scale, torch.finfo(dtype).eps), scale)


def mse_norm_exponent(group_size: int) -> int:
    """N such that the search's squared errors of a group, in units of ``4^(E - N)`` for an amax in
    ``[2^E, 2^(E+1))``, sum below 2^31: each is below ``4^(N+1)`` (no element's error exceeds the
    amax), so ``group_size * 4^(N+1) <= 2^31``. 12 for groups of 32, 11 for 128."""
    return (29 - (group_size - 1).bit_length()) // 2


def mse_norm_factor(amax: torch.Tensor, norm_exponent: int) -> torch.Tensor:
    """float32 ``2^clamp(N - E, -126, 127)`` for float32 ``amax >= 0`` whose exponent field is E + 127.

    Multiplying a group by it is exact (a power of two, no overflow) and brings its amax to
    ``[2^N, 2^(N+1))`` (groups far below float32's normal range stay smaller: their errors measure
    coarser, not wrong).
    """
    field = amax.view(torch.int32) >> 23
    exponent = (norm_exponent + 127 - field).clamp(-126, 127)
    return ((exponent + 127) << 23).view(torch.float32)


def mse_candidate_scales(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 ``[len(MSE_DIVISORS), *amax.shape]``: the BF16 scales ``amax / d`` the search tries.

    Each is computed as the ``"amax"`` rule computes ``amax / 7.5`` (zero: ``finfo(dtype).eps``,
    then BF16), so candidate 0 is exactly that rule's stored scale.
    """
    divisors = torch.tensor(MSE_DIVISORS, dtype=torch.float32, device=amax.device)
    scale = amax.unsqueeze(0) / divisors.reshape(-1, *([1] * amax.ndim))  # tensor / tensor: correctly rounded
    scale = torch.where(scale == 0, torch.finfo(dtype).eps, scale)
    return scale.to(torch.bfloat16).float()


def mse_group_scales(groups: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """The ``"mse"`` rule's BF16 scales (as float32 ``[N, K/g]``) for ``groups`` ``[N, K/g, g]``.

    Each candidate's codes are those :func:`quantize_int4` would store (the same division, in
    the same dtype), and its error is ``sum trunc(((w - q * scale) * f)^2)`` over the group, ``f``
    from :func:`mse_norm_factor`: every step is one correctly rounded operation and the sum is of
    integers, exact in int32, so CPU, CUDA and the Triton kernel measure the same error whatever
    their reduction order. The least error wins (the first such candidate on ties), and replaces
    ``amax / 7.5`` only when it is lower by more than the rounding of both errors can explain
    (``2^-20`` relative plus one unit per element): the chosen scale's exact squared error is
    never above ``amax / 7.5``'s.
    """
    n, ngroups, size = groups.shape
    bf16_quotient = torch.promote_types(groups.dtype, torch.bfloat16) == torch.bfloat16
    candidates = mse_candidate_scales(amax, groups.dtype)
    norm_exponent = mse_norm_exponent(size)
    chunk = _SEARCH_CHUNK_CPU if groups.device.type == "cpu" else _SEARCH_CHUNK_OTHER
    rows = max(1, chunk // (ngroups * size))
    out = torch.empty_like(amax)
    work = squares = errors = None
    for start in range(0, n, rows):
        block = slice(start, start + rows)
        factor = mse_norm_factor(amax[block], norm_exponent)
        normalized = groups[block].float() * factor.unsqueeze(-1)
        if work is None or work.shape != normalized.shape:
            work = torch.empty_like(normalized)
            squares = torch.empty(normalized.shape, dtype=torch.int32, device=groups.device)
            errors = torch.empty((len(MSE_DIVISORS), *normalized.shape[:2]), dtype=torch.int32, device=groups.device)
        scales = candidates[:, block] * factor
        for i, divisor in enumerate(MSE_DIVISORS):
            _search_error(normalized, scales[i], bf16_quotient, work, squares, clamp=divisor > _UNCLAMPED_DIVISOR,
                          out=errors[i])
        out[block] = select_mse_scale(candidates[:, block], errors, size)
    return out


# Below this divisor no quotient exceeds 7.25 * (1 + 2^-8) < 7.5 (the BF16 scale rounds down by at
# most 2^-9), so rounding never leaves [-8, 7] and the clamp is skipped.
_UNCLAMPED_DIVISOR = 7.25


def _search_error(normalized: torch.Tensor, scale: torch.Tensor, bf16_quotient: bool, work: torch.Tensor,
                  squares: torch.Tensor, *, clamp: bool, out: torch.Tensor) -> None:
    """``out`` (int32 ``[rows, K/g]``) = ``sum trunc((w - q * scale)^2)`` of normalized groups, exactly."""
    scale = scale.unsqueeze(-1)
    torch.div(normalized, scale, out=work)
    if bf16_quotient:  # compressed-tensors divides a BF16 weight by a BF16 scale in BF16
        work.copy_(work.to(torch.bfloat16))
    if clamp:
        work.clamp_(INT4_MIN, INT4_MAX)
    work.round_()
    # q * scale is exact (4 x 8 bits), so fused or not, the only rounding is the subtraction's.
    torch.addcmul(normalized, work, scale, value=-1, out=work)
    squares.copy_(work.mul_(work))  # float -> int32 truncates: the floor of a square
    torch.sum(squares, dim=-1, dtype=torch.int32, out=out)


_INVALID_ERROR = torch.iinfo(torch.int32).max


def select_mse_scale(candidates: torch.Tensor, errors: torch.Tensor, group_size: int) -> torch.Tensor:
    """The chosen scale ``[...]`` from candidates ``[C, ...]`` (candidate 0: ``amax / 7.5``) and their errors.

    A candidate scale that rounded to BF16 zero cannot be stored and never wins (its error is
    not a number); when ``amax / 7.5`` itself rounds to zero it is kept, and refused by
    :func:`quantize_int4`.
    """
    others = torch.where(candidates[1:] > 0, errors[1:], _INVALID_ERROR)
    least, index = others.min(dim=0)
    baseline = errors[0]
    threshold = baseline - (baseline >> 20) - (group_size + 1)
    chosen = candidates[1:].gather(0, index.unsqueeze(0)).squeeze(0)
    return torch.where((least < threshold) & (candidates[0] > 0), chosen, candidates[0])


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


def quantize_int4_weight(w: torch.Tensor, *, group_size: int = 128, scale_rule: ScaleRule = DEFAULT_SCALE_RULE,
                         name: str | None = None) -> Int4Weight:
    """Round-to-nearest W4A16 with BF16 scales chosen by ``scale_rule``, in compressed-tensors' stored form.

    Codes are made and packed a few rows at a time on the CPU, so the temporaries stay in cache.
    """
    scale = int4_group_scales(w, group_size=group_size, scale_rule=scale_rule, name=name).to(torch.bfloat16)
    n, k = w.shape
    packed = torch.empty((n, -(-k // _CODES_PER_WORD)), dtype=torch.int32, device=w.device)
    chunk = _SEARCH_CHUNK_CPU if w.device.type == "cpu" else _SEARCH_CHUNK_OTHER
    rows = max(1, chunk // max(1, k))
    for start in range(0, n, rows):
        block = slice(start, start + rows)
        packed[block] = pack_int4(quantize_int4(w[block], scale[block], group_size=group_size, name=name), name=name)
    return Int4Weight(weight_packed=packed, weight_scale=scale,
                      weight_shape=torch.tensor([n, k], dtype=torch.int64))
