"""The Triton kernels. Imported only when Triton is installed (see ``_runtime.triton_installed``).

One weight-tile decoder (:func:`_dequant_tile`) serves every kernel here, so the dequantize
kernels and the fused GEMMs compute the weights with the very same arithmetic. Layouts are
those of ``docs/formats`` (formats.md): W is ``[N, K]`` with K the reduction dim; 4-bit codes
sit two per byte with the even element in the low nibble (INT4 ``int32 [N, K/8]`` is the same
bytes viewed as ``uint8 [N, K/2]``); scales are per row, per ``GROUP`` columns, except FP8's
128x128 blocks.

Triton's interpreter multiplies BF16 operands of ``tl.dot`` as their raw 16-bit patterns
(it stores BF16 as uint16), so kernels take an ``UPCAST_DOT`` flag that widens the operands to
FP32 when interpreted; compiled kernels keep BF16 tensor-core dots. The interpreter also
rounds FP32 -> BF16 and FP32 -> E4M3 incorrectly (it truncates, and loses carries into the
exponent), so results that must be bit-exact are rounded by :func:`_round_to_bf16` and
:func:`_e4m3_code`, integer RNE that is exact both interpreted and compiled.
"""

from __future__ import annotations

import triton
import triton.language as tl

FMT_INT4 = tl.constexpr(0)
FMT_MXFP4 = tl.constexpr(1)
FMT_NVFP4 = tl.constexpr(2)
FMT_FP8 = tl.constexpr(3)

FORMAT_CODES = {"int4": 0, "mxfp4": 1, "nvfp4": 2, "fp8_block": 3}


@triton.jit
def _e8m0_to_f32(byte):
    """2^(byte-127) built from bits: byte 0 is the subnormal 2^-127, byte 255 is NaN."""
    bits = tl.where(byte == 0, 0x00400000, byte << 23)
    bits = tl.where(byte == 255, 0x7FC00000, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _e2m1_to_f32(nibble):
    """E2M1 value of a 4-bit code: bit 3 sign, bits 2..0 index [0, .5, 1, 1.5, 2, 3, 4, 6]."""
    magnitude = nibble & 7
    # For m >= 2 the FP32 bits are 0x3F000000 + (m << 22); m = 1 is 0.5 (0x3F000000), m = 0 is 0.
    bits = tl.where(magnitude >= 2, 0x3F000000 + (magnitude << 22), magnitude * 0x3F000000).to(tl.uint32)
    # OR in the sign bit (negation could turn code 8, -0, into +0).
    bits = bits | ((nibble & 8).to(tl.uint32) << 28)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _bf16_bits(value):
    """uint32 holding the 16-bit pattern of FP32 ``value`` rounded to BF16, nearest even (NaN stays NaN)."""
    bits = value.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return tl.where(value != value, 0x7FC0, rounded)


@triton.jit
def _round_to_bf16(value):
    """FP32 -> BF16, round to nearest even (NaN stays NaN)."""
    return _bf16_bits(value).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _store_cast(ptrs, value, mask):
    """Store FP32 ``value`` in the pointer's dtype, BF16 with exact RNE."""
    if ptrs.dtype.element_ty == tl.bfloat16:
        tl.store(ptrs, _round_to_bf16(value), mask=mask)
    else:
        tl.store(ptrs, value.to(ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _e4m3_code(value):
    """uint8 E4M3 (fn) code of FP32 ``value`` with |value| <= 448, round to nearest even.

    Normal results round the FP32 mantissa to 3 bits (a carry moves into the exponent);
    below 2^-6 the result is the integer RNE of value * 2^9 (subnormal steps of 2^-9), done
    with the 1.5 * 2^23 trick. The sign is kept, so -0 and tiny negatives give 0x80.
    """
    bits = value.to(tl.uint32, bitcast=True)
    sign = (bits >> 24) & 0x80
    magnitude = bits & 0x7FFFFFFF
    rounded = (magnitude + 0x7FFFF + ((magnitude >> 20) & 1)) & 0xFFF00000
    normal = (((rounded >> 23) - 120) << 3) | ((rounded >> 20) & 7)
    tiny = tl.abs(value) * 512.0
    subnormal = ((tiny + 12582912.0) - 12582912.0).to(tl.uint32)
    code = tl.where(magnitude >= 0x3C800000, normal, subnormal)
    return (code | sign).to(tl.uint8)


@triton.jit
def _int4_to_f32(nibble):
    """``nibble - 8`` as float32 without an int->float convert: bits 2^23 + nibble, minus 2^23 + 8."""
    return (nibble | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0


@triton.jit
def _nibble_values(nibble, FMT: tl.constexpr):
    """Float32 value of each 4-bit code before scaling (INT4 offset-8 integers or E2M1)."""
    if FMT == FMT_INT4:
        return _int4_to_f32(nibble)
    else:
        return _e2m1_to_f32(nibble)


@triton.jit
def _scale_values(scale_ptrs, mask, FMT: tl.constexpr):
    """Float32 group scales: E8M0 bytes for MXFP4, the stored float dtype otherwise."""
    if FMT == FMT_MXFP4:
        return _e8m0_to_f32(tl.load(scale_ptrs, mask=mask, other=0).to(tl.int32) & 0xFF)
    else:
        return tl.load(scale_ptrs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _unpack_nibbles(packed, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """uint8 codes [BLOCK_N, BLOCK_K/2] -> int32 nibbles [BLOCK_N, BLOCK_K], even k from the low nibble."""
    byte = packed.to(tl.int32) & 0xFF
    return tl.reshape(tl.join(byte & 0xF, byte >> 4), (BLOCK_N, BLOCK_K))


@triton.jit
def _dequant_tile(w_ptr, s_ptr, global_scale, rn, k0, N, K, stride_wn, stride_sn,
                  FMT: tl.constexpr, GROUP: tl.constexpr, SCALE_E8M0: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """FP32 tile W[rn, k0:k0+BLOCK_K], 0 outside [N, K]. ``global_scale`` is NVFP4's weight_scale_2."""
    row_ok = rn < N
    if FMT == FMT_FP8:
        rk = k0 + tl.arange(0, BLOCK_K)
        mask = row_ok[:, None] & (rk < K)[None, :]
        codes = tl.load(w_ptr + rn[:, None] * stride_wn + rk[None, :], mask=mask, other=0.0)
        scale_ptrs = s_ptr + (rn // 128)[:, None] * stride_sn + (rk // 128)[None, :]
        if SCALE_E8M0:
            scale = _e8m0_to_f32(tl.load(scale_ptrs, mask=mask, other=127).to(tl.int32) & 0xFF)
        else:
            scale = tl.load(scale_ptrs, mask=mask, other=0.0)
        return codes.to(tl.float32) * scale
    else:
        rh = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        mask = row_ok[:, None] & (rh < K // 2)[None, :]
        packed = tl.load(w_ptr + rn[:, None] * stride_wn + rh[None, :], mask=mask, other=0)
        codes = _unpack_nibbles(packed, BLOCK_N, BLOCK_K)
        rg = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
        scale_mask = row_ok[:, None] & (rg < K // GROUP)[None, :]
        scale_ptrs = s_ptr + rn[:, None] * stride_sn + rg[None, :]
        if FMT == FMT_INT4:
            values = _int4_to_f32(codes)
            scale = tl.load(scale_ptrs, mask=scale_mask, other=0.0).to(tl.float32)
        elif FMT == FMT_MXFP4:
            values = _e2m1_to_f32(codes)
            scale = _e8m0_to_f32(tl.load(scale_ptrs, mask=scale_mask, other=0).to(tl.int32) & 0xFF)
        else:
            values = _e2m1_to_f32(codes)
            scale = tl.load(scale_ptrs, mask=scale_mask, other=0.0).to(tl.float32)
        grouped = tl.reshape(values, (BLOCK_N, BLOCK_K // GROUP, GROUP)) * scale[:, :, None]
        if FMT == FMT_NVFP4:
            # (code * block scale) is exact; one rounding on the global scale, as formats.nvfp4 does.
            grouped = grouped * global_scale
        return tl.reshape(grouped, (BLOCK_N, BLOCK_K))


@triton.jit
def dequant_kernel(w_ptr, s_ptr, g_ptr, out_ptr, N, K, rows_per_global, stride_wn, stride_sn, stride_on,
                   FMT: tl.constexpr, GROUP: tl.constexpr, SCALE_E8M0: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[N, K] = W dequantized; a stack of experts is passed as one [E*N, K] matrix."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    if FMT == FMT_NVFP4:
        global_scale = tl.load(g_ptr + rn // rows_per_global, mask=rn < N, other=0.0)[:, None, None]
    else:
        global_scale = 1.0
    tile = _dequant_tile(w_ptr, s_ptr, global_scale, rn, k0, N, K, stride_wn, stride_sn,
                         FMT, GROUP, SCALE_E8M0, BLOCK_N, BLOCK_K)
    rk = k0 + tl.arange(0, BLOCK_K)
    mask = (rn < N)[:, None] & (rk < K)[None, :]
    _store_cast(out_ptr + rn[:, None] * stride_on + rk[None, :], tile, mask)


@triton.jit
def dequant_4bit_pairs_kernel(w_ptr, s_ptr, g_ptr, out_ptr, N, K, rows_per_global, stride_wn, stride_sn,
                              stride_on, FMT: tl.constexpr, GROUP: tl.constexpr, OUT_F32: tl.constexpr,
                              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """4-bit weights to BF16/FP32 with no register interleaving: each code byte becomes one word.

    The tile is ``[BLOCK_N, BLOCK_K/GROUP, GROUP/2]`` bytes, so a group's scale broadcasts along
    the last axis; the low and high nibble's values are packed into one 32-bit (BF16 pair) or
    64-bit (FP32 pair) word and stored through ``out_ptr``, the output viewed as ``[N, K/2]`` words.
    Same arithmetic as :func:`_dequant_tile`, so the results are identical.
    """
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rg = tl.program_id(1) * (BLOCK_K // GROUP) + tl.arange(0, BLOCK_K // GROUP)
    half = tl.arange(0, GROUP // 2)
    row_ok = rn < N
    group_ok = rg < K // GROUP
    column = rg[None, :, None] * (GROUP // 2) + half[None, None, :]
    mask = row_ok[:, None, None] & group_ok[None, :, None]
    packed = tl.load(w_ptr + rn[:, None, None] * stride_wn + column, mask=mask, other=0).to(tl.int32) & 0xFF
    scale = _scale_values(s_ptr + rn[:, None] * stride_sn + rg[None, :], row_ok[:, None] & group_ok[None, :], FMT)
    scale = scale[:, :, None]
    low = _nibble_values(packed & 0xF, FMT) * scale
    high = _nibble_values(packed >> 4, FMT) * scale
    if FMT == FMT_NVFP4:
        global_scale = tl.load(g_ptr + rn // rows_per_global, mask=row_ok, other=0.0)[:, None, None]
        low = low * global_scale
        high = high * global_scale
    ptrs = out_ptr + rn[:, None, None] * stride_on + column
    if OUT_F32:
        words = low.to(tl.uint32, bitcast=True).to(tl.uint64) | (high.to(tl.uint32, bitcast=True).to(tl.uint64) << 32)
        tl.store(ptrs, words.to(tl.int64, bitcast=True), mask=mask)
    else:
        words = _bf16_bits(low) | (_bf16_bits(high) << 16)
        tl.store(ptrs, words.to(tl.int32, bitcast=True), mask=mask)


@triton.jit
def weight_only_gemm_kernel(x_ptr, w_ptr, s_ptr, g_ptr, y_ptr, offsets_ptr, N, K,
                            stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_ym,
                            FMT: tl.constexpr, GROUP: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            SPLIT_K: tl.constexpr, UPCAST_DOT: tl.constexpr):
    """Y[rows of e] = X[rows of e] @ W[e]^T for every expert e in one launch (grid axis 2).

    Expert e owns token rows ``offsets[e]:offsets[e+1]`` of X and Y. With ``SPLIT_K > 1`` each
    program sums a slice of K into a zeroed FP32 Y with atomics.
    """
    pid_mn = tl.program_id(0)
    pid_k = tl.program_id(1)
    expert = tl.program_id(2)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid_mn // num_n
    pid_n = pid_mn % num_n
    row_begin = tl.load(offsets_ptr + expert)
    row_end = tl.load(offsets_ptr + expert + 1)
    if row_begin + pid_m * BLOCK_M < row_end:
        rm = row_begin + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        w_expert = w_ptr + expert.to(tl.int64) * stride_we
        s_expert = s_ptr + expert.to(tl.int64) * stride_se
        if FMT == FMT_NVFP4:
            global_scale = tl.load(g_ptr + expert)
        else:
            global_scale = 1.0
        k_per_split = tl.cdiv(K, SPLIT_K * BLOCK_K) * BLOCK_K
        k_begin = pid_k * k_per_split
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        # The last split may run past K: its loads are masked to zero there.
        for k_step in range(0, k_per_split, BLOCK_K):
            k0 = k_begin + k_step
            rk = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :],
                        mask=(rm < row_end)[:, None] & (rk < K)[None, :], other=0.0)
            w = _dequant_tile(w_expert, s_expert, global_scale, rn, k0, N, K, stride_wn, stride_sn,
                              FMT, GROUP, False, BLOCK_N, BLOCK_K)
            if UPCAST_DOT:
                acc = tl.dot(x.to(tl.float32), tl.trans(w), acc)
            else:
                acc = tl.dot(x, tl.trans(w.to(tl.bfloat16)), acc)
        mask = (rm < row_end)[:, None] & (rn < N)[None, :]
        y_ptrs = y_ptr + rm[:, None] * stride_ym + rn[None, :]
        if SPLIT_K == 1:
            _store_cast(y_ptrs, acc, mask)
        else:
            tl.atomic_add(y_ptrs, acc, mask=mask)


@triton.jit
def _pow2_ceil(scale):
    """Smallest power of two >= a positive normal FP32 ``scale`` (DeepSeek's ue8m0 rounding)."""
    bits = scale.to(tl.int32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    return (exponent << 23).to(tl.float32, bitcast=True)


@triton.jit
def act_quant_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_xm, stride_qm, stride_sm, eps,
                     POW2_SCALE: tl.constexpr, BLOCK_M: tl.constexpr):
    """Per token, per 128 channels: s = max(amax, eps)/448 (rounded up to 2^k), q = e4m3(x/s)."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    group = tl.program_id(1)
    rk = group * 128 + tl.arange(0, 128)
    mask = (rm < M)[:, None] & (rk < K)[None, :]
    x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    scale = tl.math.div_rn(tl.maximum(amax, eps), tl.full(amax.shape, 448.0, tl.float32))
    if POW2_SCALE:
        scale = _pow2_ceil(scale)
    q = _e4m3_code(tl.math.div_rn(x, scale[:, None]))
    tl.store(q_ptr + rm[:, None] * stride_qm + rk[None, :], q, mask=mask)
    tl.store(s_ptr + rm * stride_sm + group, scale, mask=rm < M)


@triton.jit
def fp8_block_gemm_kernel(xq_ptr, xs_ptr, w_ptr, ws_ptr, y_ptr, offsets_ptr, N, K,
                          stride_xm, stride_xsm, stride_we, stride_wn, stride_wse, stride_wsn, stride_ym,
                          SCALE_E8M0: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          SPLIT_K: tl.constexpr, GROUP_M: tl.constexpr):
    """Grouped FP8 x FP8 GEMM with 1x128 activation scales (FP32) and 128x128 weight scales.

    Each 128-wide K slice is an FP8 tensor-core dot whose FP32 result is scaled into the
    accumulator (DeepGEMM's two-level accumulation). With ``GROUP_M > 1`` consecutive programs
    sweep the columns for ``GROUP_M`` row tiles at a time, so weight tiles are reused from L2.
    """
    pid_mn = tl.program_id(0)
    pid_k = tl.program_id(1)
    expert = tl.program_id(2)
    num_n = tl.cdiv(N, BLOCK_N)
    if GROUP_M > 1:
        num_m = tl.num_programs(0) // num_n
        width = GROUP_M * num_n
        first_m = (pid_mn // width) * GROUP_M
        rows_here = tl.minimum(num_m - first_m, GROUP_M)
        pid_m = first_m + (pid_mn % width) % rows_here
        pid_n = (pid_mn % width) // rows_here
    else:
        pid_m = pid_mn // num_n
        pid_n = pid_mn % num_n
    row_begin = tl.load(offsets_ptr + expert)
    row_end = tl.load(offsets_ptr + expert + 1)
    if row_begin + pid_m * BLOCK_M < row_end:
        rm = row_begin + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rm < row_end
        col_ok = rn < N
        w_expert = w_ptr + expert.to(tl.int64) * stride_we
        ws_expert = ws_ptr + expert.to(tl.int64) * stride_wse
        k_blocks = tl.cdiv(K, 128)
        per_split = tl.cdiv(k_blocks, SPLIT_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb_step in range(0, per_split):
            kb = pid_k * per_split + kb_step
            rk = kb * 128 + tl.arange(0, 128)
            k_ok = rk < K
            x = tl.load(xq_ptr + rm[:, None] * stride_xm + rk[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_expert + rn[:, None] * stride_wn + rk[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            # Past the last block the dot is zero; clamp the scale index so it stays in bounds.
            kb_scale = tl.minimum(kb, k_blocks - 1)
            x_scale = tl.load(xs_ptr + rm * stride_xsm + kb_scale, mask=row_ok, other=0.0)
            if SCALE_E8M0:
                w_scale = _e8m0_to_f32(
                    tl.load(ws_expert + (rn // 128) * stride_wsn + kb_scale, mask=col_ok, other=0).to(tl.int32) & 0xFF)
            else:
                w_scale = tl.load(ws_expert + (rn // 128) * stride_wsn + kb_scale, mask=col_ok, other=0.0)
            partial = tl.dot(x, tl.trans(w))
            acc += partial * x_scale[:, None] * w_scale[None, :]
        mask = row_ok[:, None] & col_ok[None, :]
        y_ptrs = y_ptr + rm[:, None] * stride_ym + rn[None, :]
        if SPLIT_K == 1:
            _store_cast(y_ptrs, acc, mask)
        else:
            tl.atomic_add(y_ptrs, acc, mask=mask)
