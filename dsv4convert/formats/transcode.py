"""Lossless re-encodings of DeepSeek-V4's MXFP4 experts, each with an exactness report.

Both transcodes work from the E8M0 exponents and, where they must, the raw code bytes;
neither decodes the weights through floating point on the common (exact) path.

* :func:`mxfp4_to_fp8_block` follows DeepSeek's ``cast_e2m1fn_to_e4m3fn`` (V4
  ``inference/convert.py``): per 128x128 tile, ``B = max(sub-scale exponents) - 6`` and each
  element becomes ``e4m3(e2m1 * 2**(k - B))``. ``6 * 2**6 = 384 <= 448`` so nothing
  overflows; an element is exact unless ``k - B < -8`` pushes small codes under E4M3's
  2**-9 grid (a tile whose exponents span more than 14 binades).
* :func:`mxfp4_to_nvfp4` keeps the code bytes and rewrites only the scales:
  ``weight_scale_2 = 2**m`` and both 16-element halves of a 32-block get
  ``weight_scale = e4m3(2**(k - m))``, exact while ``k - m`` is in E4M3's power-of-two
  window [-9, 8] (formats.md §4; ModelOpt ``numeric_utils.py``, PR #1372).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from dsv4convert.errors import FormatError
from dsv4convert.formats.mxfp4 import MXFP4_BLOCK, mxfp4_shape
from dsv4convert.formats.numerics import (
    E4M3_MAX,
    E4M3_MAX_EXP,
    E4M3_MIN_EXP,
    E8M0_BIAS,
    decode_e2m1_packed,
    e2m1_table,
    e8m0_bytes,
    e8m0_max_byte,
    e8m0_to_exponent,
    exp2_float32,
    exponent_to_e8m0,
)
from dsv4convert.formats.nvfp4 import NVFP4_BLOCK, NVFP4Weight

FP8_TILE = 128
_BYTES_PER_SUB = MXFP4_BLOCK // 2
# DeepSeek's headroom: the tile's largest sub-scale maps to 2**6, and 6 * 2**6 = 384 <= 448.
_FP8_HEADROOM_EXP = 6
# Below this shift every E2M1 value (at most 6 * 2**-13 < 2**-10) rounds to a signed zero in
# E4M3, so all shifts under it produce the same bytes as it does; that bounds the byte table.
_FP8_SHIFT_MIN = -13
# Shifts at or above this keep every E2M1 value on the E4M3 grid (0.5 * 2**-8 = 2**-9).
_FP8_SHIFT_EXACT_MIN = E4M3_MIN_EXP + 1
_E2M1_NEGATIVE_ZERO = 8
# float32 must hold weight_scale_2 = 2**m as a normal number.
_GLOBAL_EXP_MIN, _GLOBAL_EXP_MAX = -126, 127


@dataclass
class ExactnessReport:
    """How much of a transcode reproduced the source bit for bit.

    ``max_abs_error`` is the largest absolute difference between the decoded source and the
    decoded result, over the elements that changed (0.0 when nothing did).
    """

    blocks_total: int
    blocks_exact: int
    elements_total: int
    elements_exact: int
    max_abs_error: float

    @property
    def exact(self) -> bool:
        return self.blocks_exact == self.blocks_total and self.elements_exact == self.elements_total

    @property
    def exact_fraction(self) -> float:
        """Fraction of blocks preserved exactly (1.0 for an empty report)."""
        return self.blocks_exact / self.blocks_total if self.blocks_total else 1.0

    def merged(self, other: ExactnessReport) -> ExactnessReport:
        return ExactnessReport(
            blocks_total=self.blocks_total + other.blocks_total,
            blocks_exact=self.blocks_exact + other.blocks_exact,
            elements_total=self.elements_total + other.elements_total,
            elements_exact=self.elements_exact + other.elements_exact,
            max_abs_error=max(self.max_abs_error, other.max_abs_error),
        )


@functools.lru_cache(maxsize=None)
def _fp8_byte_pairs(device: torch.device) -> torch.Tensor:
    """int16 ``[20 * 256]``: both E4M3 bytes of ``e2m1(byte) * 2**shift`` at ``(shift + 13) * 256 + byte``.

    Built with torch's own float32 -> float8_e4m3fn cast (round to nearest even). Code 8
    (-0) is written as +0 (byte 0x00) because DeepSeek's FP4_TABLE holds +0.0 there, so the
    bytes match the official ``--expert-dtype fp8`` output. Viewing the ``[..., 2]`` byte
    pairs as int16 lets one gather emit both output bytes in order.
    """
    shifts = torch.arange(_FP8_SHIFT_MIN, _FP8_HEADROOM_EXP + 1, device=device)
    source_values = e2m1_table(device).clone()
    source_values[_E2M1_NEGATIVE_ZERO] = 0.0
    values = source_values[None, :] * exp2_float32(shifts)[:, None]
    fp8_codes = values.to(torch.float8_e4m3fn).view(torch.uint8)
    byte = torch.arange(256, device=device)
    pairs = torch.stack([fp8_codes[:, byte & 0xF], fp8_codes[:, byte >> 4]], dim=-1).contiguous()
    return pairs.view(torch.int16).reshape(-1)


def mxfp4_to_fp8_block(
    packed: torch.Tensor,
    scale: torch.Tensor,
    *,
    tile: int = FP8_TILE,
    name: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, ExactnessReport]:
    """MXFP4 ``(packed [N, K/2], scale [N, K/32])`` -> ``(e4m3 [N, K], E8M0 [N/tile, K/tile], report)``.

    N and K must be multiples of ``tile`` (128, as in DeepSeek's V4 reference; DeepSeek-V4.1's blocks are 32), itself
    a multiple of MXFP4's 32. The tile exponent is clamped at E8M0's floor (-127) for tiles whose scales all sit
    near 2**-127, which keeps every shift at or below 6. Blocks of the report are the tiles.
    """
    n, k = mxfp4_shape(packed, scale, name)
    if tile % MXFP4_BLOCK or n % tile or k % tile:
        raise FormatError(f"MXFP4 -> FP8 block needs N and K multiples of {tile}, got [{n}, {k}]",
                          tensor=name)
    tiles_n, tiles_k = n // tile, k // tile
    sub_exp = e8m0_to_exponent(scale, name=name).reshape(tiles_n, tile, tiles_k, tile // MXFP4_BLOCK)
    tile_exp = (sub_exp.amax(dim=(1, 3)) - _FP8_HEADROOM_EXP).clamp(min=-E8M0_BIAS)
    shift = (sub_exp - tile_exp[:, None, :, None]).reshape(n, k // MXFP4_BLOCK)

    source = packed.view(torch.uint8).reshape(n, k // MXFP4_BLOCK, _BYTES_PER_SUB)
    index = source.to(torch.int32)  # in place from here: the index is the largest temporary
    index += ((shift.clamp(min=_FP8_SHIFT_MIN) - _FP8_SHIFT_MIN) * 256)[..., None]
    out_bytes = _fp8_byte_pairs(packed.device).index_select(0, index.reshape(-1)).view(torch.uint8)
    weight = out_bytes.reshape(n, k).view(torch.float8_e4m3fn)

    report = _fp8_report(source, shift, sub_exp.reshape(n, -1), tile_exp, out_bytes.reshape(n, -1, MXFP4_BLOCK), tile)
    return weight, exponent_to_e8m0(tile_exp, name=name), report


def _fp8_report(
    source: torch.Tensor,
    shift: torch.Tensor,
    sub_exp: torch.Tensor,
    tile_exp: torch.Tensor,
    out_bytes: torch.Tensor,
    tile: int,
) -> ExactnessReport:
    """Exactness of an MXFP4 -> FP8 cast, decoding only the sub-blocks that can be inexact."""
    n, subs = shift.shape
    tiles_total = tile_exp.numel()
    suspect = shift < _FP8_SHIFT_EXACT_MIN
    if not bool(suspect.any()):
        return ExactnessReport(tiles_total, tiles_total, source.numel() * 2, source.numel() * 2, 0.0)
    rows, cols = suspect.nonzero(as_tuple=True)
    original = decode_e2m1_packed(source[rows, cols]).double() * torch.exp2(sub_exp[rows, cols].double())[:, None]
    tile_row, tile_col = rows // tile, cols // (tile // MXFP4_BLOCK)
    converted = out_bytes[rows, cols].view(torch.float8_e4m3fn).double()
    converted *= torch.exp2(tile_exp[tile_row, tile_col].double())[:, None]
    equal = original == converted
    inexact_sub = ~equal.all(dim=1)
    inexact_tiles = torch.unique((tile_row * tile_exp.shape[1] + tile_col)[inexact_sub]).numel()
    return ExactnessReport(
        blocks_total=tiles_total,
        blocks_exact=tiles_total - inexact_tiles,
        elements_total=n * subs * MXFP4_BLOCK,
        elements_exact=n * subs * MXFP4_BLOCK - int((~equal).sum()),
        max_abs_error=float((original - converted).abs().max()),
    )


def nvfp4_global_exponent(*scales: torch.Tensor, name: str | None = None) -> int:
    """The exponent m of ``weight_scale_2 = 2**m`` for MXFP4 scale tensors that will share it.

    Pass every tensor that shares the global scale (an expert's w1 and w3, which SGLang
    fuses). Returns ``m = k_max - 8``, where k_max is the largest block exponent, ignoring
    E8M0 byte 0 (2**-127), ModelOpt's sentinel for an all-zero block. Why this m is best:

    * Block j is exact iff ``m - 9 <= k_j <= m + 8``.
    * Every m >= k_max - 8 leaves no block above the window, and the exact blocks are then
      ``{j : k_j >= m - 9}``, a set that only shrinks as m grows; so m = k_max - 8 maximises
      exact blocks among these choices.
    * Any m < k_max - 8 pushes the largest blocks above 448 * 2**m, where their scale
      saturates at 448 = 1.75 * 2**8 and their (largest) weights shrink by at least 12.5%;
      the blocks it could win back at the bottom are over 2**17 times smaller, so we
      never trade the top for them.

    With no usable block the choice is free and 0 is returned. m is kept within float32's
    normal range [-126, 127].
    """
    top_byte = max((e8m0_max_byte(scale, name=name if len(scales) == 1 else f"{name or 'scale'}[{index}]")
                    for index, scale in enumerate(scales)), default=0)
    return global_exponent_of_top_byte(top_byte)


def global_exponent_of_top_byte(top_byte: int) -> int:
    """:func:`nvfp4_global_exponent` from the largest E8M0 byte of the scales (a caller that has it)."""
    if top_byte == 0:  # only sentinels (or nothing): every block is zero
        return 0
    return max(top_byte - E8M0_BIAS - E4M3_MAX_EXP, _GLOBAL_EXP_MIN)


@functools.lru_cache(maxsize=None)
def _nvfp4_scale_pairs(global_exponent: int, device: torch.device) -> torch.Tensor:
    """int16 ``[256]``: for each E8M0 byte, both E4M3 bytes of its NVFP4 block scale.

    The scale is ``clamp(2**(byte - 127 - m), 2**-9, 448)``: outside E4M3's exact window
    the nearest non-zero scale 2**-9 (ModelOpt clamps block scales to [2**-9, 448]; a zero
    scale would erase the block) or the largest finite value 448. Each 32-element MXFP4
    block becomes two 16-element NVFP4 blocks with the same scale, so one int16 gather per
    source byte writes both output bytes. At most 254 exponents times the devices in use.
    """
    t = torch.arange(256, device=device) - E8M0_BIAS - global_exponent
    scale = exp2_float32(t.clamp(E4M3_MIN_EXP - 1, E4M3_MAX_EXP + 1)).clamp(2.0**E4M3_MIN_EXP, E4M3_MAX)
    byte = scale.to(torch.float8_e4m3fn).view(torch.uint8)
    return torch.stack([byte, byte], dim=-1).view(torch.int16).reshape(256)


@dataclass
class NVFP4Rescale:
    """NVFP4 scales for MXFP4 codes kept as they are, found from the E8M0 scales alone.

    ``outside`` lists the 32-blocks (rows, block columns) whose exponent leaves E4M3's
    power-of-two window; only their codes (:data:`MXFP4_BLOCK` // 2 bytes each) decide how far
    the result is from the source, see :func:`nvfp4_rescale_report`.
    """

    weight_scale: torch.Tensor     # float8_e4m3fn [N, K/16]
    weight_scale_2: torch.Tensor   # float32, 0-dim: 2**global_exponent
    global_exponent: int
    outside: tuple[torch.Tensor, torch.Tensor]


def mxfp4_to_nvfp4_scales(scale: torch.Tensor, *, global_exponent: int | None = None,
                          name: str | None = None) -> NVFP4Rescale:
    """The scale half of :func:`mxfp4_to_nvfp4`: one table gather per E8M0 byte, no codes needed.

    Lets a converter copy the code bytes without reading them.
    """
    raw = e8m0_bytes(scale, name=name)
    n, k = raw.shape[0], raw.shape[1] * MXFP4_BLOCK
    m = nvfp4_global_exponent(scale, name=name) if global_exponent is None else int(global_exponent)
    if not _GLOBAL_EXP_MIN <= m <= _GLOBAL_EXP_MAX:
        raise FormatError(f"global exponent {m} is outside float32's normal range "
                          f"[{_GLOBAL_EXP_MIN}, {_GLOBAL_EXP_MAX}]", tensor=name)
    pairs = _nvfp4_scale_pairs(m, scale.device).index_select(0, raw.reshape(-1).to(torch.int32))
    weight_scale = pairs.view(torch.uint8).reshape(n, k // NVFP4_BLOCK).view(torch.float8_e4m3fn)
    weight_scale_2 = exp2_float32(torch.tensor(m, device=scale.device))
    exact_low, exact_high = E8M0_BIAS + m + E4M3_MIN_EXP, E8M0_BIAS + m + E4M3_MAX_EXP
    # Row minima and maxima find the rows with a block outside (DeepSeek stores an all-zero
    # block's exponent as -126, so most experts have one); only those rows are searched for it.
    # On one core this is ~5x faster than a nonzero over the whole mask, 2x aminmax(dim=1).
    rows = torch.empty(0, dtype=torch.long, device=raw.device)
    if raw.numel():
        rows = ((raw.amin(dim=1) < exact_low) | (raw.amax(dim=1) > exact_high)).nonzero().flatten()
    some = raw.index_select(0, rows)
    in_rows, cols = ((some < exact_low) | (some > exact_high)).nonzero(as_tuple=True)
    return NVFP4Rescale(weight_scale, weight_scale_2, m, (rows[in_rows], cols))


def nvfp4_rescale_report(rescale: NVFP4Rescale, scale: torch.Tensor, outside_codes: torch.Tensor) -> ExactnessReport:
    """Exactness of a rescale, given the code bytes (uint8 ``[len(outside), 16]``) of its outside blocks.

    Blocks of the report are the 32-element MXFP4 blocks; an outside block whose codes are
    all zero is still exact.
    """
    raw = scale.view(torch.uint8)
    n, k = raw.shape[0], raw.shape[1] * MXFP4_BLOCK
    blocks_total = n * (k // MXFP4_BLOCK)
    rows, cols = rescale.outside
    if not rows.numel():
        return ExactnessReport(blocks_total, blocks_total, n * k, n * k, 0.0)
    magnitude = decode_e2m1_packed(outside_codes.view(torch.uint8).reshape(-1, _BYTES_PER_SUB)).abs()
    zero_codes = magnitude == 0
    source_scale = torch.exp2(raw[rows, cols].double() - E8M0_BIAS)
    new_scale = rescale.weight_scale[rows, 2 * cols].double() * 2.0**rescale.global_exponent
    error = magnitude.amax(dim=1).double() * (source_scale - new_scale).abs()
    inexact_blocks = int((~zero_codes.all(dim=1)).sum())
    return ExactnessReport(
        blocks_total=blocks_total,
        blocks_exact=blocks_total - inexact_blocks,
        elements_total=n * k,
        elements_exact=n * k - int((~zero_codes).sum()),
        max_abs_error=float(error.max()),
    )


def mxfp4_to_nvfp4(
    packed: torch.Tensor,
    scale: torch.Tensor,
    *,
    global_exponent: int | None = None,
    name: str | None = None,
) -> tuple[NVFP4Weight, ExactnessReport]:
    """Re-express MXFP4 as ModelOpt NVFP4 without touching the codes.

    ``weight`` is ``packed`` reinterpreted as uint8 (a view sharing its storage; E2M1 codes
    and nibble order are identical in both formats). ``global_exponent`` defaults to
    :func:`nvfp4_global_exponent` of this tensor alone; pass the shared value for w1/w3.
    Blocks outside the window get the nearest non-zero E4M3 scale and are reported; only
    those blocks' bytes are read.
    """
    n, _ = mxfp4_shape(packed, scale, name)
    rescale = mxfp4_to_nvfp4_scales(scale, global_exponent=global_exponent, name=name)
    rows, cols = rescale.outside
    outside_codes = packed.view(torch.uint8).reshape(n, -1, _BYTES_PER_SUB)[rows, cols]
    result = NVFP4Weight(packed.view(torch.uint8), rescale.weight_scale, rescale.weight_scale_2)
    return result, nvfp4_rescale_report(rescale, scale, outside_codes)
