"""DeepSeek-V4's attention caches as SGLang 0.5.23 stores them: pure fake-quant numerics.

Two caches, written by SGLang's fused JIT kernels (built without ``--use_fast_math``, so every
division below is IEEE and the results are bit-identical to the kernels' on the same input):

* **KV cache** (``--kv-cache-dtype fp8_e4m3``, the V4 layout of 584 B/token on every GPU): the
  sliding-window entries and the compressed entries of CSA (ratio 4) and HCA (ratio 128) layers
  alike. The non-RoPE dims are E4M3 with one UE8M0 scale per 64, the RoPE dims stay BF16;
  attention reads them dequantized to BF16. :func:`kv_cache_fp8`.
* **Indexer key cache** of CSA layers, and the indexer queries the MQA-logits kernel consumes:
  a 128-point Hadamard rotation, then FP8 (default: 128 E4M3 + one float32 scale per row) or FP4
  (``--enable-deepseek-v4-fp4-indexer``: E2M1 + UE8M0 per 32). :func:`indexer_fp8`,
  :func:`indexer_fp4`, :func:`hadamard_transform`.

Files and functions each rule follows: ``docs/served-numerics.md``.
"""

from __future__ import annotations

import math

import torch

from dsv4convert.formats.activations import (
    ActivationFormatError,
    constant,
    grouped,
    require_finite,
    require_input,
    round_e4m3,
    ungrouped,
)
from dsv4convert.formats.numerics import E2M1_MAX, E4M3_MAX, ceil_log2, e2m1_table, exp2_float32

KV_TILE = 64
INDEXER_FP4_BLOCK = 32
# The fused cache writers' floor on a tile's amax (fmaxf(1e-4f, amax)).
CACHE_AMAX_FLOOR = 1e-4
# E2M1 codes by *threshold* rounding: |v| above the i-th bound maps past the i-th value. Ties go
# toward zero at every bound (0.75 -> 0.5, 1.75 -> 1.5, 3.5 -> 3), unlike round-to-nearest-even.
_FP4_BOUNDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def kv_cache_fp8(
    kv: torch.Tensor,
    *,
    rope_dim: int,
    bf16_source: bool = False,
    out_dtype: torch.dtype | None = None,
    name: str | None = None,
) -> torch.Tensor:
    """A KV entry ``[..., head_dim]`` (normed, RoPE applied) as the FP8 cache holds it.

    The first ``head_dim - rope_dim`` dims (448 in V4) in tiles of 64: ``s = 2**ceil(log2(
    max(amax, 1e-4) / 448))`` (exponent from the float bits), ``x_hat = e4m3(x / s) * s``; the
    last ``rope_dim`` (64) dims rounded to BF16. Follows ``kernels/jit/csrc/deepseek_v4/
    main_norm_rope.cuh::fused_k_norm_rope_flashmla`` (sliding-window entries, quantized from the
    float32 norm output) and ``fused_norm_rope_v2.cuh::fused_norm_rope_flashmla`` (compressed
    entries of CSA/HCA layers, which round the norm output to BF16 first: ``bf16_source=True``).
    The result is exactly what ``kernels/ops/attention/dsv4/dequant_k_cache.py::
    dequantize_k_cache_paged_dsv4`` gives back, so it is exact in BF16 as well.
    """
    require_input(kv, name)
    dim = kv.shape[-1]
    nope = dim - rope_dim if isinstance(rope_dim, int) and not isinstance(rope_dim, bool) else -1
    if nope <= 0 or rope_dim < 0 or nope % KV_TILE:
        raise ActivationFormatError(
            f"KV entry of shape {list(kv.shape)} with rope_dim {rope_dim!r}: the FP8 layout needs "
            f"head_dim - rope_dim to be a positive multiple of {KV_TILE}",
            tensor=name,
        )
    x = kv.to(torch.bfloat16).float() if bf16_source else kv.float()
    tiles = grouped(x[..., :nope], KV_TILE, name)
    amax = tiles.abs().amax(dim=-1, keepdim=True)
    require_finite(amax, name)
    rope = x[..., nope:]
    require_finite(rope.abs().amax() if rope.numel() else amax.new_zeros(()), name)
    exponent = ceil_log2(amax.clamp(min=CACHE_AMAX_FLOOR) / constant(E4M3_MAX, kv.device))
    nope_hat = round_e4m3(tiles * exp2_float32(-exponent)) * exp2_float32(exponent)
    out = torch.cat([nope_hat.reshape(*kv.shape[:-1], nope), rope.to(torch.bfloat16).float()], dim=-1)
    return out.to(out_dtype or kv.dtype)


def hadamard_transform(
    x: torch.Tensor,
    *,
    out_dtype: torch.dtype | None = None,
    name: str | None = None,
) -> torch.Tensor:
    """Orthonormal Walsh-Hadamard transform (Sylvester order) of the last dim, a power of two.

    ``y[k] = sum_i (-1)**popcount(i & k) * x[i] / sqrt(n)``: symmetric and its own inverse. Computed
    in float32 by butterflies over index bits 0, 1, 2, ... (lower index keeps ``a + b``, upper
    ``a - b``), the order of the 128-point butterfly in ``main_norm_rope.cuh::
    fused_q_indexer_rope_hadamard_quant`` and ``fused_norm_rope_v2.cuh::fused_norm_rope_indexer``;
    the kernels scale by ``rsqrtf(n)`` (within 2 ulp of the ``fl(1/sqrt(n))`` used here).
    """
    require_input(x, name)
    n = x.shape[-1]
    if n < 1 or n & (n - 1):
        raise ActivationFormatError(f"Hadamard transform needs a power-of-two last dim, got shape {list(x.shape)}",
                                    tensor=name)
    y = x.float()
    half = 1
    while half < n:
        pairs = y.reshape(*x.shape[:-1], n // (2 * half), 2, half)
        low, high = pairs[..., 0, :], pairs[..., 1, :]
        y = torch.stack([low + high, low - high], dim=-2).reshape(x.shape)
        half *= 2
    y = y * constant(1.0 / math.sqrt(n), x.device)
    return y.to(out_dtype or x.dtype)


def _rotated(x: torch.Tensor, rotate: bool, name: str | None) -> torch.Tensor:
    return hadamard_transform(x, out_dtype=torch.float32, name=name) if rotate else x.float()


def _unrotated(y: torch.Tensor, like: torch.Tensor, rotate: bool, out_dtype: torch.dtype | None) -> torch.Tensor:
    out = hadamard_transform(y, out_dtype=torch.float32) if rotate else y
    return out.to(out_dtype or like.dtype)


def indexer_fp8(
    x: torch.Tensor,
    *,
    rotate: bool = True,
    out_dtype: torch.dtype | None = None,
    name: str | None = None,
) -> torch.Tensor:
    """An indexer key (cache entry) or query head ``[..., index_head_dim]`` through SGLang's FP8 path.

    Rotated by :func:`hadamard_transform` (``rotate``), then one float32 scale per row:
    ``s = max(amax, 1e-4) / 448``, ``y_hat = e4m3(y * (1/s)) * s``. Keys:
    ``fused_norm_rope_v2.cuh::fused_norm_rope_indexer`` (132 B/token: 128 E4M3 + the float32
    ``s``); queries: ``main_norm_rope.cuh::fused_q_indexer_rope_hadamard_quant``, which folds ``s``
    into the head weights (``weights * weight_scale * s``); ``relu(s * t) = s * relu(t)``, so
    scoring with ``y_hat`` is the same sum. With ``rotate`` the result is rotated back (the
    transform is its own inverse), so it lives in the caller's basis: ``q_hat . k_hat`` equals the
    server's rotated-basis product up to float32 rounding, and an unrotated model (transformers'
    ``DeepseekV4Indexer``) can use it as is. Pass float32 or ``out_dtype=torch.float32``: the
    rotated-back values are not BF16 numbers. Any row length (128 in V4; a power of two when
    rotating).
    """
    require_input(x, name)
    y = _rotated(x, rotate, name)
    amax = y.abs().amax(dim=-1, keepdim=True)
    require_finite(amax, name)
    scale = amax.clamp(min=CACHE_AMAX_FLOOR) / constant(E4M3_MAX, x.device)
    y_hat = round_e4m3(y * (constant(1.0, x.device) / scale)) * scale
    return _unrotated(y_hat, x, rotate, out_dtype)


def round_e2m1_threshold(v: torch.Tensor) -> torch.Tensor:
    """E2M1 values of float32 ``v`` by the FP4 indexer's threshold rule (``quant_fp4_e2m1`` in
    ``main_norm_rope.cuh`` / ``fused_norm_rope_v2.cuh``): saturating at 6, ties toward zero, and no
    negative zero (a negative input rounding to 0 gives +0)."""
    magnitude = v.abs().clamp(max=E2M1_MAX)
    index = torch.zeros(v.shape, dtype=torch.int64, device=v.device)
    for bound in _FP4_BOUNDS:
        index += magnitude > bound
    values = e2m1_table(v.device)[index]  # codes 0..7: the non-negative values
    return torch.where(v < 0, -values, values) + 0.0


def indexer_fp4(
    x: torch.Tensor,
    *,
    rotate: bool = True,
    out_dtype: torch.dtype | None = None,
    name: str | None = None,
) -> torch.Tensor:
    """An indexer key or query head through SGLang's FP4 indexer (``--enable-deepseek-v4-fp4-indexer``).

    Rotated by :func:`hadamard_transform` (``rotate``), then per 32 elements a UE8M0 scale
    ``2**e``, ``e = ceil(log2(max(amax, 1e-4) / 6))`` from the float bits, and E2M1 codes by
    :func:`round_e2m1_threshold`: ``y_hat = code(y * 2**-e) * 2**e``. Keys:
    ``fused_norm_rope_v2.cuh::fused_norm_rope_indexer_fp4`` (68 B/token: 64 B of codes + 4 scale
    bytes); queries: ``main_norm_rope.cuh::fused_q_indexer_rope_hadamard_fp4_quant`` (same rule).
    The scale rule is DeepSeek's MXFP4 ceiling rule (``formats.mxfp4``) with a 1e-4 amax floor; the
    codes differ from its round-to-nearest-even only at exact ties. ``rotate`` as in
    :func:`indexer_fp8`. Rows must be a multiple of 32 long.
    """
    require_input(x, name)
    y = _rotated(x, rotate, name)
    blocks = grouped(y, INDEXER_FP4_BLOCK, name)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    require_finite(amax, name)
    exponent = ceil_log2(amax.clamp(min=CACHE_AMAX_FLOOR) / constant(E2M1_MAX, x.device))
    y_hat = round_e2m1_threshold(blocks * exp2_float32(-exponent)) * exp2_float32(exponent)
    return _unrotated(ungrouped(y_hat, y, torch.float32), x, rotate, out_dtype)
