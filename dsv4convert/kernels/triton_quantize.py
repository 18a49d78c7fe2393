"""Triton kernels that write quantized weights: BF16 -> FP8 block / INT4, MXFP4 -> NVFP4 / FP8 block.

Each kernel reproduces one ``dsv4convert.formats`` function operation by operation, so the
bytes match the CPU path exactly: divisions are ``div_rn`` (Triton's ``/`` is approximate on
the GPU), roundings to BF16 and E4M3 are the integer RNE helpers of :mod:`triton_kernels`
(exact both compiled and interpreted), and rounding to an integer uses the 1.5 * 2^23 trick.
Non-finite input is not rejected here: the kernels leave a marker (NaN, or E8M0 byte 255)
that the launchers turn into the same FormatError the CPU path raises.

The exactness reports of the transcodes are computed in the same pass, in float64 exactly as
``formats.transcode`` does, and only for the blocks that can be inexact; each program writes
partial counts that the launcher sums.
"""

from __future__ import annotations

import triton
import triton.language as tl

from dsv4convert.kernels.triton_kernels import _bf16_bits, _e2m1_to_f32, _e4m3_code

_MAGIC_ROUND = tl.constexpr(12582912.0)  # 1.5 * 2^23: x + M - M rounds |x| < 2^22 to an integer, ties to even


@triton.jit
def _load_f32(ptrs, mask, BF16_BITS: tl.constexpr):
    """Load weights as float32; BF16 arrives as its int16 bits and is widened by a shift.

    Triton's interpreter widens BF16 subnormals wrongly, so BF16 never goes through its cast.
    """
    if BF16_BITS:
        bits = tl.load(ptrs, mask=mask, other=0).to(tl.int32) & 0xFFFF
        return (bits << 16).to(tl.float32, bitcast=True)
    return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _pow2_f32(exponent):
    """Exact float32 2^e for integer e in [-127, 127] (2^-127 is a float32 subnormal)."""
    bits = tl.where(exponent >= -126, (exponent + 127) << 23, 0x00400000)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _pow2_f64(exponent):
    """Exact float64 2^e for integer e in [-1022, 1023]."""
    return ((exponent.to(tl.int64) + 1023) << 52).to(tl.float64, bitcast=True)


@triton.jit
def _ceil_log2_pow2_scale(quotient):
    """``ceil_log2(q)`` of a non-negative float32 clamped at -127, as ``formats.fp8_block`` computes it.

    ``formats.numerics.ceil_log2`` is frexp-based: 0 gives 0; subnormals give -127 or below
    (clamped) up to 2^-127 and -126 above it; normal values add one unless they are a power of two.
    """
    bits = quotient.to(tl.int32, bitcast=True)
    field = bits >> 23
    normal = field - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    subnormal = tl.where(bits <= 0x00400000, -127, -126)
    exponent = tl.where(field == 0, subnormal, normal)
    return tl.where(bits == 0, 0, exponent)


@triton.jit
def fp8_block_quant_kernel(w_ptr, q_ptr, s_ptr, amax_ptr, N, K, stride_wn, stride_qn, stride_sn,
                           SCALE_E8M0: tl.constexpr, BF16_BITS: tl.constexpr, WEIGHT_BLOCK_N: tl.constexpr,
                           WEIGHT_BLOCK_K: tl.constexpr):
    """One ``WEIGHT_BLOCK_N x WEIGHT_BLOCK_K`` tile per program: amax, scale, and the E4M3 codes of ``w / scale``.

    The tile's amax is also written (NaN when the tile holds a NaN) for the launcher's finite check.
    """
    tile_n = tl.program_id(0)
    tile_k = tl.program_id(1)
    rn = tile_n * WEIGHT_BLOCK_N + tl.arange(0, WEIGHT_BLOCK_N)
    rk = tile_k * WEIGHT_BLOCK_K + tl.arange(0, WEIGHT_BLOCK_K)
    mask = (rn < N)[:, None] & (rk < K)[None, :]
    x = _load_f32(w_ptr + rn[:, None] * stride_wn + rk[None, :], mask, BF16_BITS)
    # Row reductions first, kept as [WEIGHT_BLOCK_N] vectors so every step below is a tensor op.
    row_amax = tl.max(tl.abs(x), axis=1)
    row_nan = tl.max((x != x).to(tl.int32), axis=1)
    amax = tl.zeros_like(row_amax) + tl.max(row_amax, axis=0)
    has_nan = (tl.zeros_like(row_nan) + tl.max(row_nan, axis=0)) > 0
    quotient = tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32))
    first = tl.arange(0, WEIGHT_BLOCK_N) == 0
    if SCALE_E8M0:
        exponent = tl.maximum(_ceil_log2_pow2_scale(quotient), -127)
        exponent = tl.where(amax == 0, 0, exponent)
        scale = _pow2_f32(exponent)
        stored = tl.where(has_nan, 255, exponent + 127).to(tl.uint8)
    else:
        scale = tl.where(amax == 0, 1.0, quotient)
        stored = scale
    tl.store(s_ptr + tile_n * stride_sn + tile_k + tl.zeros_like(row_nan), stored, mask=first)
    tl.store(amax_ptr + tile_n * tl.num_programs(1) + tile_k + tl.zeros_like(row_nan),
             tl.where(has_nan, float("nan"), amax), mask=first)
    scaled = tl.math.div_rn(x, tl.broadcast_to(scale[:, None], x.shape))
    scaled = tl.minimum(tl.maximum(scaled, -448.0), 448.0)
    tl.store(q_ptr + rn[:, None] * stride_qn + rk[None, :], _e4m3_code(scaled), mask=mask)


@triton.jit
def _int4_codes(values, divisor, BF16_QUOTIENT: tl.constexpr):
    """``round_half_even(clamp(values / divisor, -8, 7)) + 8`` as compressed-tensors computes it."""
    quotient = tl.math.div_rn(values, divisor)
    if BF16_QUOTIENT:
        quotient = (_bf16_bits(quotient) << 16).to(tl.float32, bitcast=True)
    clamped = tl.minimum(tl.maximum(quotient, -8.0), 7.0)
    return ((clamped + _MAGIC_ROUND) - _MAGIC_ROUND).to(tl.int32) + 8


@triton.jit
def _int4_scale_error(values, scale, BF16_QUOTIENT: tl.constexpr):
    """int32 ``[rows]``: ``sum trunc((values - q * scale)^2)`` of normalized weights, as ``formats.int4`` measures it.

    The terms are integers whose sum stays below 2^31 (``formats.int4.mse_norm_exponent``), so the
    reduction order does not matter. ``q * scale`` is exact, so contracting it into an FMA changes nothing.
    """
    quotient = tl.math.div_rn(values, tl.broadcast_to(scale[:, None], values.shape))
    if BF16_QUOTIENT:
        quotient = (_bf16_bits(quotient) << 16).to(tl.float32, bitcast=True)
    codes = (tl.minimum(tl.maximum(quotient, -8.0), 7.0) + _MAGIC_ROUND) - _MAGIC_ROUND
    error = codes * scale[:, None] - values
    return tl.sum((error * error).to(tl.int32), axis=1)


@triton.jit
def _bf16_scale(amax, divisor, eps):
    """``bf16(amax / divisor)`` as float32, a zero quotient replaced by ``eps`` first (``formats.int4``)."""
    scale = tl.math.div_rn(amax, tl.full(amax.shape, divisor, tl.float32))
    scale = tl.where(scale == 0, eps, scale)
    return (_bf16_bits(scale) << 16).to(tl.float32, bitcast=True)


@triton.jit
def int4_quant_kernel(w_ptr, packed_ptr, s_ptr, divisors_ptr, N, stride_wn, stride_pn, stride_sn, eps,
                      NUM_DIVISORS: tl.constexpr, NORM_EXPONENT: tl.constexpr, BF16_QUOTIENT: tl.constexpr,
                      BF16_BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_ROWS: tl.constexpr):
    """compressed-tensors W4A16 for ``BLOCK_ROWS`` rows of one group: BF16 scale bits and packed codes.

    Even and odd columns are loaded apart, so each output byte is ``code[2j] | code[2j+1] << 4``
    without interleaving registers. A group holding NaN or Inf gets the scale bits of NaN.
    ``NUM_DIVISORS == 1``: the scale is ``amax / divisors[0]`` (the ``"amax"`` rule, 7.5). More:
    the ``"mse"`` search of ``formats.int4.mse_group_scales`` over all of them, divisors[0] first.
    """
    rn = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    group = tl.program_id(1)
    row_ok = rn < N
    half = tl.arange(0, GROUP // 2)
    even_ptrs = w_ptr + rn[:, None] * stride_wn + group * GROUP + 2 * half[None, :]
    even = _load_f32(even_ptrs, row_ok[:, None], BF16_BITS)
    odd = _load_f32(even_ptrs + 1, row_ok[:, None], BF16_BITS)
    amax = tl.maximum(tl.max(tl.abs(even), axis=1), tl.max(tl.abs(odd), axis=1))
    has_nan = tl.max(((even != even) | (odd != odd)).to(tl.int32), axis=1) > 0
    baseline = _bf16_scale(amax, tl.load(divisors_ptr), eps)
    scale = baseline
    if NUM_DIVISORS > 1:
        # formats.int4.mse_norm_factor: 2^clamp(NORM_EXPONENT - E, -126, 127), E from amax's exponent field.
        exponent = tl.minimum(tl.maximum(NORM_EXPONENT + 127 - (amax.to(tl.int32, bitcast=True) >> 23), -126), 127)
        factor = ((exponent + 127) << 23).to(tl.float32, bitcast=True)
        even_n = even * factor[:, None]
        odd_n = odd * factor[:, None]
        base_error = (_int4_scale_error(even_n, baseline * factor, BF16_QUOTIENT)
                      + _int4_scale_error(odd_n, baseline * factor, BF16_QUOTIENT))
        best_error = tl.full(base_error.shape, 2147483647, tl.int32)  # a candidate that cannot win
        best = baseline
        for i in range(1, NUM_DIVISORS):
            candidate = _bf16_scale(amax, tl.load(divisors_ptr + i), eps)
            error = (_int4_scale_error(even_n, candidate * factor, BF16_QUOTIENT)
                     + _int4_scale_error(odd_n, candidate * factor, BF16_QUOTIENT))
            better = (candidate > 0) & (error < best_error)  # strict: the first of equal errors wins
            best_error = tl.where(better, error, best_error)
            best = tl.where(better, candidate, best)
        threshold = base_error - (base_error >> 20) - (GROUP + 1)
        scale = tl.where((best_error < threshold) & (baseline > 0), best, baseline)
    scale_bits = _bf16_bits(scale)
    stored = tl.where(has_nan | (amax == float("inf")), 0x7FC0, scale_bits)
    tl.store(s_ptr + rn * stride_sn + group, stored.to(tl.int16), mask=row_ok)
    divisor = tl.broadcast_to((scale_bits << 16).to(tl.float32, bitcast=True)[:, None], even.shape)
    packed = _int4_codes(even, divisor, BF16_QUOTIENT) | (_int4_codes(odd, divisor, BF16_QUOTIENT) << 4)
    tl.store(packed_ptr + rn[:, None] * stride_pn + group * (GROUP // 2) + half[None, :], packed.to(tl.uint8),
             mask=row_ok[:, None])


@triton.jit
def _e4m3_power_byte(t):
    """E4M3 byte of ``clamp(2^t, 2^-9, 448)`` for integer t: 1 below the window, 0x7E above it."""
    normal = (t + 7) << 3
    subnormal = 1 << tl.maximum(t + 9, 0)
    byte = tl.where(t >= -6, normal, subnormal)
    return tl.where(t > 8, 0x7E, byte)


@triton.jit
def mxfp4_to_nvfp4_kernel(codes_ptr, scale_ptr, out_scale_ptr, blocks_ptr, elements_ptr, error_ptr,
                          total, global_exp, BLOCK: tl.constexpr):
    """``BLOCK`` MXFP4 blocks per program: two E4M3 block scales each, and the inexact-block tallies.

    Blocks are numbered row-major over ``[N, K/32]``; block b's 16 code bytes start at ``16 * b``
    and its two NVFP4 scales are one little-endian 16-bit word at index b. Only blocks outside
    E4M3's power-of-two window can be inexact, and only their bytes are read; every program writes
    its tally slots (zeros where none is outside).
    """
    block = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = block < total
    exponent = (tl.load(scale_ptr + block, mask=live, other=127).to(tl.int32) & 0xFF) - 127
    relative = exponent - global_exp
    byte = _e4m3_power_byte(relative)
    tl.store(out_scale_ptr + block, (byte | (byte << 8)).to(tl.int16), mask=live)
    outside = live & ((relative < -9) | (relative > 8))
    if tl.max(outside.to(tl.int32), axis=0) > 0:
        packed = tl.load(codes_ptr + block[:, None] * 16 + tl.arange(0, 16)[None, :], mask=outside[:, None],
                         other=0).to(tl.int32) & 0xFF
        low = tl.abs(_e2m1_to_f32(packed & 0xF))
        high = tl.abs(_e2m1_to_f32(packed >> 4))
        count = tl.sum((low != 0).to(tl.int32) + (high != 0).to(tl.int32), axis=1)
        magnitude = tl.maximum(tl.max(low, axis=1), tl.max(high, axis=1)).to(tl.float64)
        source_scale = _pow2_f64(exponent)
        window = tl.minimum(tl.maximum(relative, -9), 8) + global_exp
        new_scale = tl.where(relative > 8, _pow2_f64(window - 8) * 448.0, _pow2_f64(window))
        error = tl.where(outside, magnitude * tl.abs(source_scale - new_scale), 0.0)
        tl.store(blocks_ptr + tl.program_id(0), tl.sum((outside & (count > 0)).to(tl.int32), axis=0))
        tl.store(elements_ptr + tl.program_id(0), tl.sum(tl.where(outside, count, 0), axis=0))
        tl.store(error_ptr + tl.program_id(0), tl.max(error, axis=0))
    else:
        tl.store(blocks_ptr + tl.program_id(0), 0)
        tl.store(elements_ptr + tl.program_id(0), 0)
        tl.store(error_ptr + tl.program_id(0), 0.0)


@triton.jit
def _e4m3_to_f32(code):
    """float32 value of an E4M3 (fn) byte held in an int32, exact (the codes here are never NaN)."""
    field = (code >> 3) & 0xF
    mantissa = code & 7
    normal = (((field + 120) << 23) | (mantissa << 20)).to(tl.float32, bitcast=True)
    magnitude = tl.where(field == 0, mantissa.to(tl.float32) * 0.001953125, normal)
    return tl.where((code & 0x80) != 0, -magnitude, magnitude)


@triton.jit
def _fp8_cast_tallies(code, fp8, suspect, source_scale, tile_scale):
    """Per element: 1 where a suspect element changed, and its |source - result| (float64)."""
    original = _e2m1_to_f32(code).to(tl.float64) * source_scale
    converted = _e4m3_to_f32(fp8).to(tl.float64) * tile_scale
    changed = (suspect & (original != converted)).to(tl.int32)
    return changed, tl.where(suspect, tl.abs(original - converted), 0.0)


@triton.jit
def mxfp4_to_fp8_block_kernel(codes_ptr, scale_ptr, w_ptr, out_scale_ptr, elements_ptr, error_ptr,
                              stride_cn, stride_sn, stride_wn, stride_on,
                              WEIGHT_BLOCK_N: tl.constexpr, WEIGHT_BLOCK_K: tl.constexpr):
    """One FP8 block (``WEIGHT_BLOCK_N x WEIGHT_BLOCK_K``, its columns whole 32-element MXFP4 blocks) per
    program: DeepSeek's ``cast_e2m1fn_to_e4m3fn``, and its exactness tallies.

    The tile exponent is ``max(sub-block exponents) - 6`` (at least -127); each element becomes
    ``e4m3(e2m1 * 2^max(shift, -13))`` with -0 written as +0, the two output bytes of a code
    byte stored as one 16-bit word. Sub-blocks with shift < -8 can lose bits and are compared
    in float64; every tile writes its tally slots (zeros where none is).
    """
    tile_n = tl.program_id(0)
    tile_k = tl.program_id(1)
    SUBS: tl.constexpr = WEIGHT_BLOCK_K // 32
    rows = tile_n * WEIGHT_BLOCK_N + tl.arange(0, WEIGHT_BLOCK_N)
    subs = tl.arange(0, SUBS)
    pair = tl.arange(0, 16)
    sub_exp = (tl.load(scale_ptr + rows[:, None] * stride_sn + tile_k * SUBS + subs[None, :]).to(tl.int32) & 0xFF) - 127
    top = tl.max(tl.max(sub_exp, axis=1), axis=0)
    tile_exp = tl.maximum(top - 6, -127)
    shift = sub_exp - tile_exp
    column = tile_k * (WEIGHT_BLOCK_K // 2) + subs[None, :, None] * 16 + pair[None, None, :]
    packed = tl.load(codes_ptr + rows[:, None, None] * stride_cn + column).to(tl.int32) & 0xFF
    low = packed & 0xF
    high = packed >> 4
    power = _pow2_f32(tl.maximum(shift, -13))[:, :, None]
    low_fp8 = _e4m3_code(_e2m1_to_f32(tl.where(low == 8, 0, low)) * power).to(tl.int32)
    high_fp8 = _e4m3_code(_e2m1_to_f32(tl.where(high == 8, 0, high)) * power).to(tl.int32)
    tl.store(w_ptr + rows[:, None, None] * stride_wn + column, (low_fp8 | (high_fp8 << 8)).to(tl.int16))
    first = subs == 0
    tl.store(out_scale_ptr + tile_n * stride_on + tile_k + subs * 0, (tl.zeros_like(subs) + tile_exp + 127).to(tl.uint8),
             mask=first)
    tile = tile_n * tl.num_programs(1) + tile_k
    if tl.min(tl.min(shift, axis=1), axis=0) < -8:
        suspect = tl.broadcast_to((shift < -8)[:, :, None], packed.shape)
        source_scale = _pow2_f64(sub_exp)[:, :, None]
        tile_scale = _pow2_f64(tile_exp)
        changed_low, error_low = _fp8_cast_tallies(low, low_fp8, suspect, source_scale, tile_scale)
        changed_high, error_high = _fp8_cast_tallies(high, high_fp8, suspect, source_scale, tile_scale)
        changed = tl.sum(tl.sum(tl.sum(changed_low + changed_high, axis=2), axis=1), axis=0)
        worst = tl.max(tl.max(tl.max(tl.maximum(error_low, error_high), axis=2), axis=1), axis=0)
        tl.store(elements_ptr + tile, changed)
        tl.store(error_ptr + tile, worst)
    else:
        tl.store(elements_ptr + tile, 0)
        tl.store(error_ptr + tile, 0.0)
