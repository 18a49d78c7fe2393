"""Realistic synthetic weight values, shared by every release's ``synth`` (V4's :mod:`dsv4convert.synth`, V4.1's
:mod:`dsv4convert.models.deepseek_v41.synth`): each tensor derived from (seed, name) alone, drawn with the value
statistics that exercise the numerics (heavy tails, outlier channels, row scales over several binades, dead
blocks), MXFP4 experts drawn directly in stored form (see :func:`realistic_mxfp4`).
"""

from __future__ import annotations

import hashlib
import math

import torch

from dsv4convert.formats.mxfp4 import MXFP4_BLOCK
from dsv4convert.formats.numerics import E8M0_BIAS, exponent_to_e8m0


def generator_for(seed: int, name: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


def realistic_matrix(n: int, k: int, gen: torch.Generator, *, zero_block: int | None = None) -> torch.Tensor:
    """A float32 [n, k] weight with heavy tails, outlier input channels and binade-spread rows.

    ``zero_block`` zeroes one aligned block of that size (if the matrix holds two), the
    way real checkpoints contain dead blocks.
    """
    w = torch.randn(n, k, generator=gen)
    w *= torch.exp(0.5 * torch.randn(n, k, generator=gen))           # log-normal scale mixture: heavy tails
    outliers = torch.rand(k, generator=gen) < 0.01
    w[:, outliers] *= 4.0 + 12.0 * torch.rand(int(outliers.sum()), generator=gen)
    w *= torch.exp2(torch.randint(-3, 3, (n, 1), generator=gen).float())  # rows over six binades
    w *= 1.0 / (k ** 0.5)
    if zero_block and n >= 2 * zero_block and k >= 2 * zero_block:
        bi = int(torch.randint(0, n // zero_block, (1,), generator=gen))
        bj = int(torch.randint(0, k // zero_block, (1,), generator=gen))
        w[bi * zero_block:(bi + 1) * zero_block, bj * zero_block:(bj + 1) * zero_block] = 0
    return w


# E2M1 magnitude codes (values 0, 0.5, 0.5, 1, 1, 1.5, 2, 3) for the eight equally likely
# 3-bit draws: roughly a Gaussian's histogram inside a block below its largest element.
_BODY_MAGNITUDES = (0, 1, 1, 2, 2, 3, 4, 5)
# Largest element of a block: 3, 4 or 6 (codes 5..7), as DeepSeek's ceil(log2(amax / 6))
# leaves amax / 2**X in (3, 6].
_PEAK_MAGNITUDES = (5, 6, 6, 7)


def _byte_table(nibble_codes: list[int]) -> torch.Tensor:
    """uint8 [256]: each random byte's two nibbles mapped through ``nibble_codes`` (16 entries)."""
    table = torch.tensor(nibble_codes, dtype=torch.uint8)
    byte = torch.arange(256)
    return table[byte & 0xF] | (table[byte >> 4] << 4)


_BODY_BYTES = _byte_table([(u & 8) | _BODY_MAGNITUDES[u & 7] for u in range(16)])
# A peak byte: a peak code in the low nibble, an ordinary code in the high one.
_PEAK_BYTES = (_BODY_BYTES & 0xF0) | torch.tensor(
    [(b & 8) | _PEAK_MAGNITUDES[b & 3] for b in range(256)], dtype=torch.uint8)


def _random_bytes(count: int, gen: torch.Generator) -> torch.Tensor:
    """``count`` uniform bytes, drawn 8 per int64 (the generator's cost is per draw, not per bit)."""
    info = torch.iinfo(torch.int64)
    words = torch.randint(info.min, info.max, (-(-count // 8),), dtype=torch.int64, generator=gen)
    return words.view(torch.uint8)[:count]


def realistic_mxfp4(n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed MXFP4 codes (int8 ``[n, k/2]``) and E8M0 scales (``[n, k/32]``) of an expert-like weight.

    Drawn in stored form, statistically like :func:`realistic_matrix` quantized by DeepSeek's
    rule: block exponents ``X`` around ``log2(2.5 / sqrt(k) / 6)``, shifted per row over six
    binades, by up to one binade per block, and by +2..4 in the ~27% of column blocks that hold
    an outlier input channel; codes from a Gaussian-like histogram with one element per block
    at 3, 4 or 6 (a block's amax always lands there); one all-zero block stored as DeepSeek
    stores it (codes 0, ``X = -126``). Spreads stay within 14 binades per 128x128 tile, like real
    experts, so the lossless MXFP4 -> FP8/NVFP4 casts are lossless here too.
    """
    blocks = k // MXFP4_BLOCK
    base = round(math.log2(2.5 / math.sqrt(k) / 6))
    row_shift = torch.randint(-3, 3, (n, 1), generator=gen, dtype=torch.int32)
    block_shift = (0.5 * torch.randn(n, blocks, generator=gen)).round().clamp(-1, 1).to(torch.int32)
    outlier_cols = torch.rand(blocks, generator=gen) < 0.27
    outlier_shift = torch.randint(2, 5, (blocks,), generator=gen, dtype=torch.int32) * outlier_cols
    exponent = base + row_shift + block_shift + outlier_shift

    packed = _BODY_BYTES.index_select(0, _random_bytes(n * k // 2, gen).to(torch.int32)).reshape(n, blocks, MXFP4_BLOCK // 2)
    peak_at = torch.randint(0, MXFP4_BLOCK // 2, (n, blocks, 1), generator=gen)
    peak = _PEAK_BYTES.index_select(0, _random_bytes(n * blocks, gen).to(torch.int32)).reshape(n, blocks, 1)
    packed.scatter_(2, peak_at, peak)
    if n >= 2 and blocks >= 2:
        zi = int(torch.randint(0, n, (1,), generator=gen))
        zj = int(torch.randint(0, blocks, (1,), generator=gen))
        packed[zi, zj] = 0
        exponent[zi, zj] = 1 - E8M0_BIAS
    return packed.reshape(n, k // 2).view(torch.int8), exponent_to_e8m0(exponent)
