"""The Triton kernels. Imported only when Triton is installed (see ``_runtime.triton_installed``).

Here: dequantization and the tiled weight-only GEMMs (tile, halves, planes), with the decode
helpers they share. Beside it: ``triton_gemv`` (the small-batch GEMVs, M <= 16),
``triton_fp8_gemm`` (FP8 block GEMM, activation quantization) and ``triton_quantize`` (the
converters' quantize/transcode kernels).

The dequantize kernels and the fused GEMMs decode codes with the same formulas (FP32 for the
bit-exact dequantization, BF16 pairs where a GEMM rounds the weights to BF16 anyway). Layouts are
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

FORMAT_CODES = {"int4": 0, "mxfp4": 1, "nvfp4": 2}


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
def _to_out(value, OUT_DTYPE: tl.constexpr, HW_ROUND: tl.constexpr):
    """FP32 ``value`` in the output dtype; BF16 rounds to nearest even (a NaN stays a NaN).

    ``HW_ROUND`` uses the hardware conversion (half an instruction per element instead of the
    integer RNE's seven); the interpreter truncates, so it keeps the integer path.
    """
    if OUT_DTYPE == tl.bfloat16 and not HW_ROUND:
        return _round_to_bf16(value)
    else:
        return value.to(OUT_DTYPE)


@triton.jit
def _store_cast(ptrs, value, mask, HW_ROUND: tl.constexpr = False):
    """Store FP32 ``value`` in the pointer's dtype as :func:`_to_out` converts it (the integer RNE
    unless the launch passes ``HW_ROUND``: the GEMVs' and small tiles' stores are too few to matter)."""
    tl.store(ptrs, _to_out(value, ptrs.dtype.element_ty, HW_ROUND), mask=mask)


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
                  FMT: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """FP32 4-bit tile W[rn, k0:k0+BLOCK_K] in K order, 0 outside [N, K]. ``global_scale`` is NVFP4's weight_scale_2."""
    row_ok = rn < N
    rh = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    mask = row_ok[:, None] & (rh < K // 2)[None, :]
    packed = tl.load(w_ptr + rn[:, None] * stride_wn + rh[None, :], mask=mask, other=0)
    codes = _unpack_nibbles(packed, BLOCK_N, BLOCK_K)
    rg = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
    scale_mask = row_ok[:, None] & (rg < K // GROUP)[None, :]
    scale = _scale_values(s_ptr + rn[:, None] * stride_sn + rg[None, :], scale_mask, FMT)
    if FMT == FMT_INT4:
        values = _int4_to_f32(codes)
    else:
        values = _e2m1_to_f32(codes)
    grouped = tl.reshape(values, (BLOCK_N, BLOCK_K // GROUP, GROUP)) * scale[:, :, None]
    if FMT == FMT_NVFP4:
        # (code * block scale) is exact; one rounding on the global scale, as formats.nvfp4 does.
        grouped = grouped * global_scale
    return tl.reshape(grouped, (BLOCK_N, BLOCK_K))


@triton.jit
def dequant_fp8_kernel(w_ptr, s_ptr, out_ptr, N, K, stride_wn, stride_sn, stride_on,
                       SCALE_E8M0: tl.constexpr, HW_ROUND: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       WEIGHT_BLOCK_N: tl.constexpr, WEIGHT_BLOCK_K: tl.constexpr):
    """out[N, K] = FP8 codes times their ``WEIGHT_BLOCK_N x WEIGHT_BLOCK_K`` block scale; a stack of experts is
    one [E*N, K] matrix.

    ``BLOCK_N`` divides ``WEIGHT_BLOCK_N`` and ``BLOCK_K`` is a multiple of ``WEIGHT_BLOCK_K``, so a tile's rows
    share one row of scales: the tile loads ``BLOCK_K/WEIGHT_BLOCK_K`` scales and broadcasts them, not one per
    element.
    """
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rn < N)[:, None] & (rk < K)[None, :]
    codes = tl.load(w_ptr + rn[:, None] * stride_wn + rk[None, :], mask=mask, other=0.0)
    kb = pid_k * (BLOCK_K // WEIGHT_BLOCK_K) + tl.arange(0, BLOCK_K // WEIGHT_BLOCK_K)
    scale_ptrs = s_ptr + (pid_n * BLOCK_N // WEIGHT_BLOCK_N) * stride_sn + kb
    if SCALE_E8M0:
        scale = _e8m0_to_f32(tl.load(scale_ptrs, mask=kb < tl.cdiv(K, WEIGHT_BLOCK_K), other=127).to(tl.int32) & 0xFF)
    else:
        scale = tl.load(scale_ptrs, mask=kb < tl.cdiv(K, WEIGHT_BLOCK_K), other=0.0)
    tile = tl.reshape(codes.to(tl.float32), (BLOCK_N, BLOCK_K // WEIGHT_BLOCK_K, WEIGHT_BLOCK_K)) * scale[None, :, None]
    tile = tl.reshape(tile, (BLOCK_N, BLOCK_K))
    out = _to_out(tile, out_ptr.dtype.element_ty, HW_ROUND)
    tl.store(out_ptr + rn[:, None] * stride_on + rk[None, :], out, mask=mask)


@triton.jit
def _e2m1_pair_to_f32(packed):
    """E2M1 values of the low and high nibble of each byte (int32 0..255), without lookups.

    For a code c the FP16 bits ``((c & 7) << 9) | ((c & 8) << 12)`` are exactly ``e2m1(c) * 2^-14``
    (the 0.5 code lands on an FP16 subnormal), which FP32 represents exactly; 2^14 scales it back.
    """
    low = (((packed & 7) << 9) | ((packed & 8) << 12)).to(tl.uint16).to(tl.float16, bitcast=True)
    high = (((packed & 0x70) << 5) | ((packed & 0x80) << 8)).to(tl.uint16).to(tl.float16, bitcast=True)
    return low.to(tl.float32) * 16384.0, high.to(tl.float32) * 16384.0


@triton.jit
def _nibble_pair_to_f32(packed, FMT: tl.constexpr):
    """Float32 values of the low and high nibble of each byte, before scaling."""
    if FMT == FMT_INT4:
        return _int4_to_f32(packed & 0xF), _int4_to_f32(packed >> 4)
    else:
        return _e2m1_pair_to_f32(packed)


@triton.jit
def dequant_4bit_kernel(w_ptr, s_ptr, g_ptr, out_ptr, N, K, rows_per_global, stride_wn, stride_sn,
                        stride_on, FMT: tl.constexpr, GROUP: tl.constexpr, HW_ROUND: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """4-bit weights to BF16/FP32, a tile of ``[BLOCK_N, BLOCK_K/GROUP, GROUP/2]`` code bytes at a time.

    A group's scale broadcasts along the last axis (no per-element gather); the low and high
    nibble's values are joined into K order in registers.
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
    low, high = _nibble_pair_to_f32(packed, FMT)
    low = low * scale[:, :, None]
    high = high * scale[:, :, None]
    if FMT == FMT_NVFP4:
        # (code * block scale) is exact; one rounding on the global scale, as formats.nvfp4 does.
        global_scale = tl.load(g_ptr + rn // rows_per_global, mask=row_ok, other=0.0)[:, None, None]
        low = low * global_scale
        high = high * global_scale
    values = tl.reshape(tl.join(low, high), (BLOCK_N, BLOCK_K))
    rk = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    out_mask = row_ok[:, None] & (rk < K)[None, :]
    tl.store(out_ptr + rn[:, None] * stride_on + rk[None, :], _to_out(values, out_ptr.dtype.element_ty, HW_ROUND),
             mask=out_mask)


@triton.jit
def _expert_tile(offsets_ptr, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's output tile in a grouped launch: ``(expert, first row, row end, rm, rn)``.

    Grid axis 0 walks an expert's row tiles x column tiles (columns fastest), axis 2 the experts;
    expert ``e``'s tokens are rows ``offsets[e]:offsets[e+1]`` of X and Y. A tile whose first row
    is at or past the end has no work.
    """
    pid_mn = tl.program_id(0)
    expert = tl.program_id(2)
    num_n = tl.cdiv(N, BLOCK_N)
    row0 = tl.load(offsets_ptr + expert) + (pid_mn // num_n) * BLOCK_M
    row_end = tl.load(offsets_ptr + expert + 1)
    return expert, row0, row_end, row0 + tl.arange(0, BLOCK_M), (pid_mn % num_n) * BLOCK_N + tl.arange(0, BLOCK_N)


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
    pid_k = tl.program_id(1)
    expert, row0, row_end, rm, rn = _expert_tile(offsets_ptr, N, BLOCK_M, BLOCK_N)
    if row0 < row_end:
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
                              FMT, GROUP, BLOCK_N, BLOCK_K)
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
def _nibble_pair_to_bf16(packed, FMT: tl.constexpr):
    """BF16 values of the low and high nibble of each byte (int32 0..255), before scaling.

    INT4: the nibble ORed into the mantissa of 128.0, minus 136 (exact). E2M1: the BF16 bits
    ``((c & 7) << 6) | ((c & 8) << 12)`` are ``e2m1(c) * 2^-126`` (the 0.5 code is a BF16
    subnormal); one exact multiply by 2^126 brings it back. Both run as packed BF16 pairs on sm_90.
    """
    if FMT == FMT_INT4:
        low = ((packed & 0xF) | 0x4300).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        high = ((packed >> 4) | 0x4300).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        return low - 136.0, high - 136.0
    else:
        # One multiply places each nibble twice (no overlapping bits): magnitude at 6..8, sign at 15.
        low = (((packed & 0xF) * 0x1040) & 0x81C0).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        high = (((packed & 0xF0) * 0x104) & 0x81C0).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        return low * 8.507059173023462e37, high * 8.507059173023462e37


def _decode_asm(fmt: int, high: bool) -> str:
    """Inline PTX: four code bytes (one 32-bit register) to the BF16 values of their low (or high) nibbles.

    Operands: ``$0,$1`` the values of elements 0-1 and 2-3 times their scales, ``$2`` the four bytes,
    ``$3,$4`` the four BF16 scales. ``prmt`` reorders the bytes to (0, 2, 1, 3), so one shift and one
    mask put the nibbles of two consecutive bytes at bits 0 and 16, and every step runs on BF16
    pairs. INT4: the nibble ORed into the mantissa of 128.0 (``lop3`` 0xEA is ``(a & b) | c``),
    ``x * 1 - 136`` exact, times the scale rounding once. E2M1: the nibble times 0x1040 masked by
    0x81C0 is ``e2m1(c) * 2^-126`` (see :func:`_nibble_pair_to_bf16`); MXFP4 multiplies by 2^126
    exactly, NVFP4's scale carries 2^118 and the accumulator the other 2^8.
    """
    shifts = (4, 12) if high else (0, 8)
    lines = [".reg .b32 t, u, one, off, big, nz;", *_PTX_CONSTANTS, "prmt.b32 t, $2, $2, 0x3120;"]
    for out, shift in enumerate(shifts):
        lines += [f"shr.u32 u, t, {shift};", *_ptx_pair_decode(fmt), f"fma.rn.bf16x2 ${out}, u, ${3 + out}, nz;"]
    return "{\n" + "\n".join(lines) + "\n}"


_PTX_CONSTANTS = ("mov.b32 one, 0x3F803F80;", "mov.b32 off, 0xC308C308;", "mov.b32 big, 0x7E807E80;",
                  "mov.b32 nz, 0x80008000;")


def _ptx_pair_decode(fmt: int) -> list[str]:
    """PTX turning the nibbles at bits 0 and 16 of ``u`` into an unscaled BF16 pair (see _decode_asm)."""
    if fmt == FORMAT_CODES["int4"]:
        return ["lop3.b32 u, u, 0x000F000F, 0x43004300, 0xEA;", "fma.rn.bf16x2 u, u, one, off;"]
    lines = ["and.b32 u, u, 0x000F000F;", "mul.lo.u32 u, u, 0x1040;", "and.b32 u, u, 0x81C081C0;"]
    if fmt == FORMAT_CODES["mxfp4"]:
        lines.append("fma.rn.bf16x2 u, u, big, nz;")
    return lines


_ASM_LOW = tl.constexpr(tuple(_decode_asm(f, False) for f in range(3)))
_ASM_HIGH = tl.constexpr(tuple(_decode_asm(f, True) for f in range(3)))
NVFP4_ASM_SCALE_SHIFT = tl.constexpr(118)


@triton.jit
def _nibble_pair_to_bf16_asm(packed, scale, FMT: tl.constexpr):
    """BF16 ``(low, high nibble) * scale`` of uint8 ``packed``; ``scale`` BF16, broadcast to its shape.

    Two pure asm blocks, one per half tile: Triton then decodes each directly in the register
    layout of its wgmma operand (with one two-output block it decoded twice, once per layout; an
    impure block, kept in the load layout and staged through shared memory, was 10-40% slower on
    the H200). Compiled sm_80+ only: the interpreter cannot run inline PTX.
    """
    low = tl.inline_asm_elementwise(_ASM_LOW[FMT], "=r,=r,r,r,r", [packed, scale], dtype=tl.bfloat16,
                                    is_pure=True, pack=4)
    high = tl.inline_asm_elementwise(_ASM_HIGH[FMT], "=r,=r,r,r,r", [packed, scale], dtype=tl.bfloat16,
                                     is_pure=True, pack=4)
    return low, high


@triton.jit
def _nvfp4_global_scaled(acc, g_ptr, expert, FMT: tl.constexpr, ASM_DECODED: tl.constexpr):
    """NVFP4 sums times the expert's global scale, and back from the asm decode's exponent bias; others as they are."""
    if FMT == FMT_NVFP4:
        if ASM_DECODED:
            acc = acc * (2.0 ** (126 - NVFP4_ASM_SCALE_SHIFT))
        acc = acc * tl.load(g_ptr + expert)
    return acc


@triton.jit
def weight_only_halves_kernel(x_ptr, w_ptr, s_ptr, g_ptr, y_ptr, offsets_ptr, N, K,
                              stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_ym,
                              FMT: tl.constexpr, GROUP: tl.constexpr,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                              SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr, UPCAST_DOT: tl.constexpr,
                              ASM_DECODE: tl.constexpr = False):
    """Small-batch weight-only GEMM: ``Y^T = W X^T`` with the weights' even and odd K as two dots.

    Byte j of a row holds W[:, 2j] (low nibble) and W[:, 2j+1] (high nibble), so the tile is
    decoded as two half tiles that need no interleaving, and the *activations* are split into
    their even and odd K in registers (a ``[BLOCK_M, BLOCK_K]`` tile, small next to the weights).
    Group scales broadcast over a ``[BLOCK_N, BLOCK_K/GROUP, GROUP/2]`` view, so there is no
    per-byte gather. The weight tile is the dot's left operand, so a 64-row tile runs on
    Hopper's wgmma while the batch is only ``BLOCK_M`` wide. Decoding and scaling are BF16 pair
    operations; (code * scale) rounds once to BF16, as the tile kernel's does. NVFP4's global
    scale multiplies the FP32 accumulator.
    """
    pid_k = tl.program_id(1)
    expert, row0, row_end, rm, rn = _expert_tile(offsets_ptr, N, BLOCK_M, BLOCK_N)
    if row0 < row_end:
        rh = tl.arange(0, BLOCK_K // 2)
        rg = tl.arange(0, BLOCK_K // GROUP)
        row_ok = rm < row_end
        col_ok = rn < N
        w_rows = w_ptr + expert.to(tl.int64) * stride_we + rn[:, None] * stride_wn
        s_rows = s_ptr + expert.to(tl.int64) * stride_se + rn[:, None] * stride_sn
        x_rows = x_ptr + rm[:, None] * stride_xm
        k_per_split = tl.cdiv(K, SPLIT_K * BLOCK_K) * BLOCK_K
        k_begin = pid_k * k_per_split
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for k_step in range(0, k_per_split, BLOCK_K):
            k0 = k_begin + k_step
            if EVEN_K:
                packed = tl.load(w_rows + (k0 // 2 + rh)[None, :], mask=col_ok[:, None], other=0)
                scale = _scale_values(s_rows + (k0 // GROUP + rg)[None, :], col_ok[:, None], FMT)
                x = tl.load(x_rows + (k0 + tl.arange(0, BLOCK_K))[None, :], mask=row_ok[:, None], other=0.0)
            else:
                h_ok = k0 // 2 + rh < K // 2
                packed = tl.load(w_rows + (k0 // 2 + rh)[None, :], mask=col_ok[:, None] & h_ok[None, :], other=0)
                g_ok = k0 // GROUP + rg < K // GROUP
                scale = _scale_values(s_rows + (k0 // GROUP + rg)[None, :], col_ok[:, None] & g_ok[None, :], FMT)
                k_ok = k0 + tl.arange(0, BLOCK_K) < K
                x = tl.load(x_rows + (k0 + tl.arange(0, BLOCK_K))[None, :], mask=row_ok[:, None] & k_ok[None, :],
                            other=0.0)
            x_even, x_odd = tl.split(tl.reshape(x, (BLOCK_M, BLOCK_K // 2, 2)))
            if UPCAST_DOT:
                # The interpreter has no BF16 arithmetic: decode in FP32 and multiply in FP32.
                scale = tl.broadcast_to(scale.to(tl.float32)[:, :, None], (BLOCK_N, BLOCK_K // GROUP, GROUP // 2))
                scale = tl.reshape(scale, (BLOCK_N, BLOCK_K // 2))
                low, high = _nibble_pair_to_f32(packed.to(tl.int32) & 0xFF, FMT)
                acc = tl.dot(low * scale, tl.trans(x_even.to(tl.float32)), acc)
                acc = tl.dot(high * scale, tl.trans(x_odd.to(tl.float32)), acc)
            elif ASM_DECODE:
                if FMT == FMT_NVFP4:
                    scale = scale * (2.0 ** NVFP4_ASM_SCALE_SHIFT)
                scale = tl.broadcast_to(scale.to(tl.bfloat16)[:, :, None], (BLOCK_N, BLOCK_K // GROUP, GROUP // 2))
                low, high = _nibble_pair_to_bf16_asm(packed, tl.reshape(scale, (BLOCK_N, BLOCK_K // 2)), FMT)
                acc = tl.dot(low, tl.trans(x_even), acc)
                acc = tl.dot(high, tl.trans(x_odd), acc)
            else:
                scale = tl.broadcast_to(scale.to(tl.bfloat16)[:, :, None], (BLOCK_N, BLOCK_K // GROUP, GROUP // 2))
                scale = tl.reshape(scale, (BLOCK_N, BLOCK_K // 2))
                low, high = _nibble_pair_to_bf16(packed.to(tl.int32) & 0xFF, FMT)
                low = low * scale
                high = high * scale
                acc = tl.dot(low, tl.trans(x_even), acc)
                acc = tl.dot(high, tl.trans(x_odd), acc)
        acc = _nvfp4_global_scaled(acc, g_ptr, expert, FMT, ASM_DECODE and not UPCAST_DOT)
        mask = col_ok[:, None] & row_ok[None, :]
        y_ptrs = y_ptr + rm[None, :] * stride_ym + rn[:, None]
        if SPLIT_K == 1:
            _store_cast(y_ptrs, acc, mask)
        else:
            tl.atomic_add(y_ptrs, acc, mask=mask)


def _planes_asm(fmt: int) -> str:
    """Inline PTX: two 32-bit code words (eight nibbles each) to eight BF16 pairs, one per nibble plane.

    Operands: ``$0..$7`` plane 0..7 (nibble i of word a in the low half, of word b in the high half,
    times their scales), ``$8, $9`` the words a and b of two consecutive columns, ``$10`` their two BF16
    scales. Two ``prmt`` put the low (high) 16 bits of a and b side by side, so nibble i of both
    words sits at bits 4i and 16 + 4i after at most one shift; the rest is the pair decode of
    :func:`_decode_asm`.
    """
    lines = [".reg .b32 t0, t1, u, one, off, big, nz;", *_PTX_CONSTANTS,
             "prmt.b32 t0, $8, $9, 0x5410;", "prmt.b32 t1, $8, $9, 0x7632;"]
    for plane in range(8):
        source, shift = ("t0", "t1")[plane // 4], 4 * (plane % 4)
        lines += [f"shr.u32 u, {source}, {shift};" if shift else f"mov.b32 u, {source};", *_ptx_pair_decode(fmt),
                  f"fma.rn.bf16x2 ${plane}, u, $10, nz;"]
    return "{\n" + "\n".join(lines) + "\n}"


_ASM_PLANES = tl.constexpr(tuple(_planes_asm(f) for f in range(3)))


@triton.jit
def _plane_values(words, plane: tl.constexpr, FMT: tl.constexpr, BF16: tl.constexpr):
    """Value of nibble ``plane`` of each int32 code word, before scaling: FP32, or BF16 when ``BF16``."""
    nibble = (words >> (4 * plane)) & 0xF
    if BF16:
        if FMT == FMT_INT4:
            return (nibble | 0x4300).to(tl.uint16).to(tl.bfloat16, bitcast=True) - 136.0
        else:
            bits = ((nibble * 0x1040) & 0x81C0).to(tl.uint16).to(tl.bfloat16, bitcast=True)
            return bits * 8.507059173023462e37
    elif FMT == FMT_INT4:
        return _int4_to_f32(nibble)
    else:
        return _e2m1_to_f32(nibble)


@triton.jit
def _x_planes8(x8, BLOCK_M: tl.constexpr, COLS: tl.constexpr):
    """[BLOCK_M, COLS * 8] activations (runs of 8 consecutive K) as eight [BLOCK_M, COLS] tiles, plane i = K mod 8."""
    x8 = tl.reshape(x8, (BLOCK_M, COLS, 2, 2, 2))
    e, o = tl.split(x8)            # K bit 0
    ee, eo = tl.split(e)           # K bit 1
    oe, oo = tl.split(o)
    x0, x4 = tl.split(ee)          # K bit 2
    x2, x6 = tl.split(eo)
    x1, x5 = tl.split(oe)
    x3, x7 = tl.split(oo)
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def _x_planes(x_lo, x_hi, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """Activations as eight [BLOCK_M, BLOCK_K/8] tiles, plane i holding K = 8j + i.

    ``x_lo`` / ``x_hi`` are ``[BLOCK_M, BLOCK_K/2]``: the K of the even and of the odd words.
    Joining the two halves' planes keeps words j, j+1 of a plane in one thread, so each plane is
    written to shared memory for the dot 32 bits at a time, not 16.
    """
    a0, a1, a2, a3, a4, a5, a6, a7 = _x_planes8(x_lo, BLOCK_M, BLOCK_K // 16)
    b0, b1, b2, b3, b4, b5, b6, b7 = _x_planes8(x_hi, BLOCK_M, BLOCK_K // 16)
    shape: tl.constexpr = (BLOCK_M, BLOCK_K // 8)
    return (tl.reshape(tl.join(a0, b0), shape), tl.reshape(tl.join(a1, b1), shape),
            tl.reshape(tl.join(a2, b2), shape), tl.reshape(tl.join(a3, b3), shape),
            tl.reshape(tl.join(a4, b4), shape), tl.reshape(tl.join(a5, b5), shape),
            tl.reshape(tl.join(a6, b6), shape), tl.reshape(tl.join(a7, b7), shape))


@triton.jit
def _concat_planes(p0, p1, p2, p3, p4, p5, p6, p7, ROWS: tl.constexpr, COLS: tl.constexpr):
    """Eight [ROWS, COLS] planes side by side along K: [ROWS, 8 * COLS], plane i at columns i*COLS.

    Each thread keeps its registers: in a dot operand's layout the plane index lands on register
    bits, so the dot sees the same per-thread values as eight plane dots, in one dot.
    """
    j = tl.join(tl.join(tl.join(p0, p1), tl.join(p2, p3)), tl.join(tl.join(p4, p5), tl.join(p6, p7)))
    return tl.reshape(tl.permute(j, (0, 4, 3, 2, 1)), (ROWS, 8 * COLS))


@triton.jit
def weight_only_planes_kernel(x_ptr, w_ptr, s_ptr, g_ptr, y_ptr, offsets_ptr, part_ptr, ticket_ptr, N, K,
                              stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_ym, stride_part,
                              FMT: tl.constexpr, GROUP: tl.constexpr,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                              SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr, UPCAST_DOT: tl.constexpr,
                              ASM_DECODE: tl.constexpr = False, X_PERMUTED: tl.constexpr = False):
    """Small-batch weight-only GEMM on int32 code words: ``Y^T = W X^T`` with W decoded by nibble planes.

    ``w_ptr`` is the codes viewed as int32 ``[E, N, K/8]`` (strides in words): word j of a row holds
    K = 8j..8j+7, nibble i being K = 8j + i. Plane i is nibble i of every word of the tile; the eight
    planes side by side along K (:func:`_concat_planes`) are one ``[BLOCK_N, BLOCK_K]`` dot operand,
    and the activation tile is permuted the same way (in registers, or by the launcher when
    ``X_PERMUTED``), which a sum over K allows. In the dot's register layout a thread then holds two
    consecutive whole code words per row and decodes them with no byte shuffling (the halves kernel
    gets 16-bit pieces and rebuilds them), and the whole tile is one wgmma chain with one wait.
    A word lies in one scale group (GROUP is a multiple of 8), so a scale broadcasts per word;
    scales are loaded one K tile ahead. Numerics as the halves kernel: (code * scale) rounds once
    to BF16, NVFP4's global scale multiplies the FP32 accumulator. With ``SPLIT_K > 1`` the K
    slices meet in this launch (FP32 partials, a ticket per tile, the last slice sums them in
    order), so Y is written once, in BF16, with no zero-fill or cast kernels around it.
    """
    pid_k = tl.program_id(1)
    expert, row0, row_end, rm, rn = _expert_tile(offsets_ptr, N, BLOCK_M, BLOCK_N)
    if row0 < row_end:
        WORDS: tl.constexpr = BLOCK_K // 8
        rw = tl.arange(0, WORDS)
        rg = tl.arange(0, BLOCK_K // GROUP)
        row_ok = rm < row_end
        col_ok = rn < N
        w_rows = w_ptr + expert.to(tl.int64) * stride_we + rn[:, None] * stride_wn
        s_rows = s_ptr + expert.to(tl.int64) * stride_se + rn[:, None] * stride_sn
        # The even words' K (x_lo; x_hi is +8): runs of 8 consecutive K, 16 apart.
        x_cols = 16 * (tl.arange(0, BLOCK_K // 2) // 8) + tl.arange(0, BLOCK_K // 2) % 8
        x_rows = x_ptr + rm[:, None] * stride_xm
        x_rows3 = x_rows + x_cols[None, :]
        k_per_split = tl.cdiv(K, SPLIT_K * BLOCK_K) * BLOCK_K
        k_begin = pid_k * k_per_split
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        # Scales are read one K tile ahead into registers: Triton leaves their small loads out of its
        # cp.async pipeline, and a load used in the same iteration would wait for memory every time.
        s_next = _scale_values(s_rows + (k_begin // GROUP + rg)[None, :],
                               col_ok[:, None] & (k_begin // GROUP + rg < K // GROUP)[None, :], FMT)
        for k_step in range(0, k_per_split, BLOCK_K):
            k0 = k_begin + k_step
            scale = s_next
            g_next = (k0 + BLOCK_K) // GROUP + rg
            s_next = _scale_values(s_rows + g_next[None, :], col_ok[:, None] & (g_next < K // GROUP)[None, :], FMT)
            if X_PERMUTED:
                # The launcher laid each BLOCK_K tile of X out plane after plane (needs EVEN_K).
                words = tl.load(w_rows + (k0 // 8 + rw)[None, :], mask=col_ok[:, None], other=0)
                x_all = tl.load(x_rows + (k0 + tl.arange(0, BLOCK_K))[None, :], mask=row_ok[:, None], other=0.0)
            elif EVEN_K:
                words = tl.load(w_rows + (k0 // 8 + rw)[None, :], mask=col_ok[:, None], other=0)
                x_lo = tl.load(x_rows3 + k0, mask=row_ok[:, None], other=0.0)
                x_hi = tl.load(x_rows3 + (k0 + 8), mask=row_ok[:, None], other=0.0)
            else:
                w_ok = k0 // 8 + rw < K // 8
                words = tl.load(w_rows + (k0 // 8 + rw)[None, :], mask=col_ok[:, None] & w_ok[None, :], other=0)
                x_lo = tl.load(x_rows3 + k0, mask=row_ok[:, None] & (k0 + x_cols < K)[None, :], other=0.0)
                x_hi = tl.load(x_rows3 + (k0 + 8), mask=row_ok[:, None] & (k0 + 8 + x_cols < K)[None, :], other=0.0)
            if not X_PERMUTED:
                x0, x1, x2, x3, x4, x5, x6, x7 = _x_planes(x_lo, x_hi, BLOCK_M, BLOCK_K)
                x_all = _concat_planes(x0, x1, x2, x3, x4, x5, x6, x7, BLOCK_M, WORDS)
            if UPCAST_DOT:
                # The interpreter has no BF16 arithmetic: decode in FP32 and multiply in FP32.
                scale = tl.reshape(tl.broadcast_to(scale[:, :, None], (BLOCK_N, BLOCK_K // GROUP, GROUP // 8)),
                                   (BLOCK_N, WORDS))
                w0 = _plane_values(words, 0, FMT, False) * scale
                w1 = _plane_values(words, 1, FMT, False) * scale
                w2 = _plane_values(words, 2, FMT, False) * scale
                w3 = _plane_values(words, 3, FMT, False) * scale
                w4 = _plane_values(words, 4, FMT, False) * scale
                w5 = _plane_values(words, 5, FMT, False) * scale
                w6 = _plane_values(words, 6, FMT, False) * scale
                w7 = _plane_values(words, 7, FMT, False) * scale
                w_all = _concat_planes(w0, w1, w2, w3, w4, w5, w6, w7, BLOCK_N, WORDS)
                acc = tl.dot(w_all, tl.trans(x_all.to(tl.float32)), acc)
            else:
                if ASM_DECODE and FMT == FMT_NVFP4:
                    scale = scale * (2.0 ** NVFP4_ASM_SCALE_SHIFT)
                scale = tl.reshape(tl.broadcast_to(scale.to(tl.bfloat16)[:, :, None],
                                                   (BLOCK_N, BLOCK_K // GROUP, GROUP // 8)), (BLOCK_N, WORDS))
                if ASM_DECODE:
                    w0, w1, w2, w3, w4, w5, w6, w7 = tl.inline_asm_elementwise(
                        _ASM_PLANES[FMT], "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r", [words, scale],
                        dtype=(tl.bfloat16,) * 8, is_pure=True, pack=2)
                else:
                    w0 = _plane_values(words, 0, FMT, True) * scale
                    w1 = _plane_values(words, 1, FMT, True) * scale
                    w2 = _plane_values(words, 2, FMT, True) * scale
                    w3 = _plane_values(words, 3, FMT, True) * scale
                    w4 = _plane_values(words, 4, FMT, True) * scale
                    w5 = _plane_values(words, 5, FMT, True) * scale
                    w6 = _plane_values(words, 6, FMT, True) * scale
                    w7 = _plane_values(words, 7, FMT, True) * scale
                w_all = _concat_planes(w0, w1, w2, w3, w4, w5, w6, w7, BLOCK_N, WORDS)
                acc = tl.dot(w_all, tl.trans(x_all), acc)
        acc = _nvfp4_global_scaled(acc, g_ptr, expert, FMT, ASM_DECODE and not UPCAST_DOT)
        mask = col_ok[:, None] & row_ok[None, :]
        y_ptrs = y_ptr + rm[None, :] * stride_ym + rn[:, None]
        if SPLIT_K == 1:
            _store_cast(y_ptrs, acc, mask)
        else:
            # Split-K in the same launch: each slice stores its FP32 partial, takes a ticket, and the
            # last of the tile's slices sums the partials in slice order (deterministic) and writes
            # BF16 Y, then hands the ticket counter back at zero for the next launch.
            part = part_ptr + rm[None, :] * stride_ym + rn[:, None]
            tl.store(part + pid_k * stride_part, acc, mask=mask)
            tl.debug_barrier()
            tile = expert * tl.num_programs(0) + tl.program_id(0)
            ticket = tl.atomic_add(ticket_ptr + tile, 1, sem="acq_rel")
            if ticket == SPLIT_K - 1:
                total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
                for other in range(SPLIT_K):
                    total += tl.load(part + other * stride_part, mask=mask, other=0.0, cache_modifier=".cg")
                _store_cast(y_ptrs, total, mask)
                tl.atomic_xchg(ticket_ptr + tile, 0)
