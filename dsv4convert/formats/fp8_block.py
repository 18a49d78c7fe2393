"""FP8 E4M3 weights with one scale per ``rows x cols`` block (DeepSeek-V3/V4 style).

``W[n, k] = e4m3(w[n, k]) * scale[n // rows, k // cols]`` (formats.md §5). The block is the release's
(``models.registry.release_of(config).fp8_block(cfg)``: 128x128 for DeepSeek-V4, 32x32 for V4.1), handed in
by every caller: these numerics hold no block of their own. The scale is a dequant multiplier in both
on-disk forms:

* ``scale_fmt="ue8m0"`` (native DeepSeek-V4, tensor ``.scale`` F8_E8M0): ``2**ceil(log2(amax/448))``.
  Rounding the scale *up* to a power of two keeps ``amax/scale <= 448``, so nothing saturates.
* ``scale_fmt="float32"`` (V3 / HF ``weight_scale_inv``): ``amax/448``.

Blocks that do not fill their rows or columns are zero-padded before their amax is taken,
as the V3 reference does; the scale grid is ``[ceil(N/rows), ceil(K/cols)]``. An all-zero
block gets scale 1 (E8M0 byte 127): any scale reproduces it, and 1 is the neutral choice.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from dsv4convert.errors import FormatError
from dsv4convert.formats.numerics import (
    E4M3_MAX,
    E8M0_BIAS,
    ceil_log2,
    divide,
    e8m0_to_float,
    exp2_float32,
    exponent_to_e8m0,
    require_finite,
)

ScaleFormat = Literal["ue8m0", "float32"]
Block = tuple[int, int]   # (rows, cols) of the weights one scale covers


def _require_2d(w: torch.Tensor, name: str | None) -> None:
    if w.ndim != 2:
        raise FormatError(f"expected a 2-D weight [N, K], got shape {list(w.shape)}", tensor=name)


def scale_grid(n: int, k: int, block: Block) -> tuple[int, int]:
    """The scale tensor's shape for a ``[n, k]`` weight in ``block``s."""
    return (-(-n // block[0]), -(-k // block[1]))


def _blocked(x: torch.Tensor, block: Block) -> torch.Tensor:
    """View ``x[N, K]`` as ``[N/r, r, K/c, c]``, zero-padding a ragged edge first."""
    n, k = x.shape
    rows, cols = block
    pad_n, pad_k = -n % rows, -k % cols
    if pad_n or pad_k:
        x = F.pad(x, (0, pad_k, 0, pad_n))
    return x.reshape((n + pad_n) // rows, rows, (k + pad_k) // cols, cols)


def _block_axis(dim: int, scales: int) -> list[int]:
    """The powers of two ``b`` with ``ceil(dim / b) == scales``: one for two or more scales (the quotient strictly
    falls as ``b`` doubles), every one from ``dim`` up for a single scale (capped at 2**16 here)."""
    return [1 << e for e in range(17) if -(-dim // (1 << e)) == scales]


def fp8_block_of(weight_shape: tuple[int, ...], scale_shape: tuple[int, ...], *, known: Block | None = None,
                 name: str | None = None) -> Block | None:
    """The block a stored FP8 weight's scale grid says it was written in (None: no power-of-two block fits).

    ``known`` (the release's block) is the answer where it fits the grid. Otherwise each axis is the one power of
    two that fits it; a single scale over a whole axis fits every power of two from the axis up, and then the
    block is not written in the shapes: FormatError naming ``name``.
    """
    (n, k), grid = tuple(weight_shape[-2:]), tuple(scale_shape[-2:])
    if known is not None and scale_grid(n, k, known) == grid:
        return known
    axes = [_block_axis(dim, scales) for dim, scales in zip((n, k), grid)]
    if not all(axes):
        return None
    if any(len(candidates) > 1 for candidates in axes):
        unfit = f", and the release's {list(known)} does not fit" if known else ""
        raise FormatError(f"scale shape {list(scale_shape)} of weight {list(weight_shape)} does not say its block "
                          f"(one scale spans a whole axis{unfit})", tensor=name)
    return (axes[0][0], axes[1][0])


def quantize_fp8_block(
    w: torch.Tensor,
    *,
    block: Block,
    scale_fmt: ScaleFormat = "ue8m0",
    name: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``w[N, K]`` to e4m3 with one scale per ``block`` (rows, cols) tile.

    Returns ``(weight float8_e4m3fn [N, K], scale [ceil(N/rows), ceil(K/cols)])``, the scale being
    float8_e8m0fnu for ``"ue8m0"`` and float32 for ``"float32"``.
    """
    _require_2d(w, name)
    if scale_fmt not in ("ue8m0", "float32"):
        raise FormatError(f"unknown scale_fmt {scale_fmt!r} (expected 'ue8m0' or 'float32')", tensor=name)
    n, k = w.shape
    tiles = _blocked(w.float(), block)
    amax = tiles.abs().amax(dim=(1, 3))
    require_finite(amax, name, "weights")
    zero = amax == 0
    if scale_fmt == "ue8m0":
        # ceil_log2 of the float32 quotient equals ceil(log2(amax/448)) exactly: a quotient
        # within half an ulp of 2**k would need amax within 0.57 ulp of 448 * 2**k, which
        # only 448 * 2**k itself is.
        exponent = ceil_log2(divide(amax, E4M3_MAX)).clamp(min=-E8M0_BIAS)
        exponent = torch.where(zero, torch.zeros_like(exponent), exponent)
        scale_value = exp2_float32(exponent)
        stored_scale = exponent_to_e8m0(exponent, name=name)
    else:
        scale_value = torch.where(zero, torch.ones_like(amax), divide(amax, E4M3_MAX))
        stored_scale = scale_value
    scaled = (tiles / scale_value[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX)
    weight = scaled.to(torch.float8_e4m3fn).reshape(tiles.shape[0] * block[0], -1)[:n, :k]
    return weight.contiguous(), stored_scale


def dequantize_fp8_block(
    weight: torch.Tensor,
    scale: torch.Tensor,
    *,
    block: Block,
    out_dtype: torch.dtype = torch.float32,
    name: str | None = None,
) -> torch.Tensor:
    """``W = e4m3(weight) * scale`` per tile; ``scale`` may be E8M0 (or uint8 bytes) or float32.

    Computed in float32. With an E8M0 scale every product is exact, in float32 and in bf16.
    """
    _require_2d(weight, name)
    n, k = weight.shape
    grid = scale_grid(n, k, block)
    if tuple(scale.shape) != grid:
        raise FormatError(
            f"scale shape {list(scale.shape)} does not match weight {list(weight.shape)} "
            f"in {block[0]}x{block[1]} blocks (expected {list(grid)})",
            tensor=name,
        )
    if weight.dtype != torch.float8_e4m3fn:
        raise FormatError(f"FP8 block weight must be float8_e4m3fn, got {weight.dtype}", tensor=name)
    if scale.dtype in (torch.float8_e8m0fnu, torch.uint8):
        scale_value = e8m0_to_float(scale, name=name)
    else:
        scale_value = scale.float()
    tiles = _blocked(weight.float(), block)
    out = (tiles * scale_value[:, None, :, None]).reshape(grid[0] * block[0], -1)[:n, :k]
    return out.to(out_dtype).contiguous()


def e8m0_scale_to_float32(scale: torch.Tensor, *, name: str | None = None) -> torch.Tensor:
    """The same scales as float32 (``weight_scale_inv`` form); exact."""
    return e8m0_to_float(scale, name=name)


def float32_scale_to_e8m0(scale: torch.Tensor, *, name: str | None = None) -> torch.Tensor:
    """float32 scales back to E8M0; every value must be an exact power of two in [2**-127, 2**127].

    Lossless by construction: anything that would need rounding raises instead.
    """
    mantissa, exponent = torch.frexp(scale.float())
    exact = (mantissa == 0.5) & (exponent - 1 >= -E8M0_BIAS) & (exponent - 1 <= E8M0_BIAS)
    if not bool(exact.all()):
        bad = scale.float()[~exact][0].item()
        raise FormatError(
            f"scale {bad!r} is not a power of two in E8M0's range [2**-127, 2**127]; "
            "converting it to E8M0 would change the weights",
            tensor=name,
        )
    return exponent_to_e8m0(exponent - 1, name=name)
