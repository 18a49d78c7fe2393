"""The small-batch weight-only GEMVs: whole code words per lane, no tiles (imported with Triton only).

``weight_only_gemv_kernel`` (M = 1) runs on CUDA cores, one inline-PTX block per int32 code word;
``weight_only_mma_kernel`` (2 <= M <= 16 in the sm_90 table) feeds ``mma.sync`` lane by lane.
Both read code words and activations in 16-byte loads and keep every operand in the lane that
loaded it. They share the formats' decode conventions and helpers with ``triton_kernels``.
"""

from __future__ import annotations

import struct

import triton
import triton.language as tl

from dsv4convert.kernels.triton_kernels import (
    _PTX_CONSTANTS,
    FMT_INT4,
    FMT_NVFP4,
    FORMAT_CODES,
    NVFP4_ASM_SCALE_SHIFT,
    _e2m1_to_f32,
    _expert_tile,
    _int4_to_f32,
    _ptx_pair_decode,
    _round_to_bf16,
    _scale_values,
    _store_cast,
)


@triton.jit
def _shift(value, bits: tl.constexpr):
    """``value << bits``, or ``>> -bits`` when ``bits`` is negative (the caller masks what it keeps)."""
    if bits >= 0:
        return value << bits
    else:
        return value >> -bits


@triton.jit
def _gemv_plane(words, plane: tl.constexpr, FMT: tl.constexpr):
    """FP32 value of nibble ``plane`` of each int32 code word, before scaling (the portable decode).

    INT4: the nibble, at bits 4p..4p+3 of ``words`` (p = plane) or of ``words >> 12`` (p = plane - 3
    for planes 5-7), stays in place inside the mantissa of 2^23: the float is 2^23 + c * 2^4p, and
    ``f * 2^-4p - (2^23 * 2^-4p + 8)`` is c - 8 exactly. E2M1: the FP16 bits
    ``((c & 7) << 9) | ((c & 8) << 12)`` are e2m1(c) * 2^-14 (the 0.5 code an FP16 subnormal),
    widened to FP32; the kernel multiplies its sums by 2^14.
    """
    if FMT == FMT_INT4:
        position: tl.constexpr = plane - 3 * (plane // 5)
        if plane < 5:
            source = words
        else:
            source = words >> 12
        bits = (source & (0xF << (4 * position))) | 0x4B000000
        unit: tl.constexpr = 1.0 / (1 << (4 * position))
        return bits.to(tl.float32, bitcast=True) * unit - (8388608.0 * unit + 8.0)
    else:
        bits = (_shift(words, 9 - 4 * plane) & 0x0E00) | (_shift(words, 12 - 4 * plane) & 0x8000)
        return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


def _f32_hex(value: float) -> str:
    return "0f%08X" % struct.unpack("<I", struct.pack("<f", value))[0]


def _ptx_shift(out: str, source: str, bits: int) -> str:
    return f"shl.b32 {out}, {source}, {bits};" if bits >= 0 else f"shr.u32 {out}, {source}, {-bits};"


# The order in which a code word's eight products are summed, the same compiled and interpreted, so
# the per-word sums are bit-identical: E2M1 decodes planes p and p + 4 together.
_GEMV_PLANE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)
# The word-dot PTX's variants, by index: (format, scale dtype); INT4 scales may be any float dtype.
_GEMV_WORD_DOT_VARIANTS = (("int4", "bf16"), ("int4", "f16"), ("int4", "f32"), ("mxfp4", "e8m0"), ("nvfp4", "e4m3"))
_WORD_DOT_VARIANT_COUNT = tl.constexpr(len(_GEMV_WORD_DOT_VARIANTS))
_INT4_SCALE_NAMES = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}


def word_dot_variant(fmt: str, scale_dtype: str) -> int:
    """Both GEMVs' PTX variant for a format and its scale dtype (torch's name, e.g. ``"bfloat16"``):
    its index in ``_GEMV_WORD_DOT_VARIANTS``, passed to the kernels as ``VARIANT``."""
    scale = {"mxfp4": "e8m0", "nvfp4": "e4m3"}.get(fmt) or _INT4_SCALE_NAMES[scale_dtype]
    return _GEMV_WORD_DOT_VARIANTS.index((fmt, scale))


def _e8m0_bits_ptx(out: str, mantissa_bits: int) -> list[str]:
    """PTX: into ``out``, the bits of the float with ``mantissa_bits`` (23: FP32, 7: BF16) whose value
    is the E8M0 byte in ``t``, as :func:`_e8m0_to_f32`: the byte is the exponent field, 0 the
    subnormal 2^-127, 255 NaN (both GEMVs' scale PTX)."""
    half = 1 << (mantissa_bits - 1)
    nan = (255 << mantissa_bits) | half
    return [f"shl.b32 {out}, t, {mantissa_bits};", "setp.eq.u32 zero, t, 0;", "setp.eq.u32 nan, t, 255;",
            f"selp.b32 {out}, 0x{half:X}, {out}, zero;", f"selp.b32 {out}, 0x{nan:X}, {out}, nan;"]


def _gemv_word_dot_asm(fmt: int, scale: str) -> str:
    """Inline PTX: ``$0 = scale * sum_p x[8j + p] * value(nibble p of code word $1)`` in FP32.

    ``$2`` is the address of the word's eight BF16 activations (one 16-byte load), ``$3`` that of
    its group scale. Loading both inside the PTX, per code word, keeps every operand in the code
    words' register layout: Triton's own loads of the activations needed a layout conversion
    through shared memory (8 barriers per K tile). Repeated loads of one address (the same
    activations for another row) are merged by ``ptxas``. INT4 decodes one ``lop3`` and one
    ``fma`` per nibble (the nibble in place in the mantissa of 2^23); E2M1 one ``lop3`` pair,
    two shifts and two FP16 -> FP32 conversions per two nibbles (values times 2^-14, as
    :func:`_gemv_plane`). The products are exact; the sum runs in ``_GEMV_PLANE_ORDER``.
    """
    lines = [".reg .b32 hw, t, m, sg, xa, xb, xc, xd, xv, s, acc, v;", ".reg .b16 lo16, hi16, sb, z;",
             "ld.global.nc.v4.b32 {xa, xb, xc, xd}, [$2];"]
    values = {}
    if fmt == FORMAT_CODES["int4"]:
        lines.append("shr.u32 hw, $1, 12;")
        for plane in range(8):
            source, position = ("$1", plane) if plane < 5 else ("hw", plane - 3)
            unit = 2.0 ** (-4 * position)
            values[plane] = [f"lop3.b32 t, {source}, {0xF << 4 * position}, 0x4B000000, 0xEA;",
                             f"fma.rn.f32 v, t, {_f32_hex(unit)}, {_f32_hex(-(8388608.0 * unit + 8.0))};"]
    else:
        for plane in range(4):
            pair = [_ptx_shift("m", "$1", 9 - 4 * plane), _ptx_shift("sg", "$1", 12 - 4 * plane),
                    "and.b32 sg, sg, 0x80008000;", "lop3.b32 m, m, 0x0E000E00, sg, 0xEA;", "mov.b32 {lo16, hi16}, m;"]
            values[plane] = pair + ["cvt.f32.f16 v, lo16;"]
            values[plane + 4] = ["cvt.f32.f16 v, hi16;"]
    for index, plane in enumerate(_GEMV_PLANE_ORDER):
        pair_register = ("xa", "xb", "xc", "xd")[plane // 2]  # K = 8j + plane: BF16 pairs, the even one low
        x_bits = f"shl.b32 xv, {pair_register}, 16;" if plane % 2 == 0 else f"and.b32 xv, {pair_register}, 0xFFFF0000;"
        lines += values[plane] + [x_bits, "mul.f32 acc, v, xv;" if index == 0 else "fma.rn.f32 acc, v, xv, acc;"]
    lines += {
        "bf16": ["ld.global.nc.b16 sb, [$3];", "mov.b16 z, 0;", "mov.b32 s, {z, sb};"],
        "f16": ["ld.global.nc.b16 sb, [$3];", "cvt.f32.f16 s, sb;"],
        "f32": ["ld.global.nc.b32 s, [$3];"],
        "e8m0": [".reg .pred zero, nan;", "ld.global.nc.u8 sb, [$3];", "cvt.u32.u16 t, sb;",
                 *_e8m0_bits_ptx("s", 23)],
        "e4m3": ["ld.global.nc.u8 sb, [$3];", "cvt.rn.f16x2.e4m3x2 t, sb;", "mov.b32 {lo16, hi16}, t;",
                 "cvt.f32.f16 s, lo16;"],
    }[scale]
    lines.append("fma.rn.f32 $0, acc, s, 0f00000000;")  # an fma, as the portable path's (no contraction there)
    return "{\n" + "\n".join(lines) + "\n}"


_ASM_WORD_DOT = tl.constexpr(tuple(_gemv_word_dot_asm(FORMAT_CODES[fmt], scale) for fmt, scale in _GEMV_WORD_DOT_VARIANTS))


@triton.jit
def _gemv_word_dots_asm(words, x_addresses, s_addresses, VARIANT: tl.constexpr):
    """:func:`_gemv_word_dot_asm` on every code word, its PTX picked by :func:`word_dot_variant`."""
    return tl.inline_asm_elementwise(_ASM_WORD_DOT[VARIANT], "=r,r,l,l",
                                     [words, x_addresses.to(tl.int64, bitcast=True),
                                      s_addresses.to(tl.int64, bitcast=True)],
                                     dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _x_word_planes(x_words, mask, BLOCK_N: tl.constexpr, WORDS: tl.constexpr):
    """FP32 activations ``[1, BLOCK_N, WORDS]`` of the eight nibble planes (K = 8j + plane for word j)."""
    x = tl.load(x_words[:, :, :, None] + tl.arange(0, 8)[None, None, None, :], mask=mask[:, :, :, None], other=0.0)
    x = tl.reshape(x.to(tl.float32), (1, BLOCK_N, WORDS, 2, 2, 2))
    even, odd = tl.split(x)
    x04, x26 = tl.split(even)
    x15, x37 = tl.split(odd)
    x0, x4 = tl.split(x04)
    x2, x6 = tl.split(x26)
    x1, x5 = tl.split(x15)
    x3, x7 = tl.split(x37)
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def _gemv_word_dots_portable(words, x_row, s_addresses, index, k_ok, FMT: tl.constexpr, BLOCK_N: tl.constexpr,
                             WORDS: tl.constexpr):
    """What :func:`_gemv_word_dots_asm` computes, in Triton (the interpreter and other GPUs), in the same order."""
    x0, x1, x2, x3, x4, x5, x6, x7 = _x_word_planes(x_row + 8 * index, k_ok, BLOCK_N, WORDS)
    # planes in _GEMV_PLANE_ORDER: 0, 4, 1, 5, 2, 6, 3, 7
    acc = _gemv_plane(words, 0, FMT) * x0
    acc = tl.fma(_gemv_plane(words, 4, FMT), x4, acc)
    acc = tl.fma(_gemv_plane(words, 1, FMT), x1, acc)
    acc = tl.fma(_gemv_plane(words, 5, FMT), x5, acc)
    acc = tl.fma(_gemv_plane(words, 2, FMT), x2, acc)
    acc = tl.fma(_gemv_plane(words, 6, FMT), x6, acc)
    acc = tl.fma(_gemv_plane(words, 3, FMT), x3, acc)
    acc = tl.fma(_gemv_plane(words, 7, FMT), x7, acc)
    # fma(., ., 0), not a product: a product would be contracted into the caller's sum, unlike the PTX's
    return tl.fma(acc, _scale_values(s_addresses, k_ok, FMT), 0.0)


@triton.jit
def _gemv_words(w_rows, kw, k_words, WORDS: tl.constexpr, EVEN_K: tl.constexpr):
    """Code words ``[1, BLOCK_N, WORDS]`` from word ``kw`` on; 0 past K."""
    offsets = kw + tl.arange(0, WORDS)
    if EVEN_K:  # whole tiles: one condition per tile keeps the 16-byte loads (a per-word mask splits them).
        # Splat, not a scalar: Triton 3.9's interpreter turns a scalar mask into int32 and refuses it (the PTX is the same).
        return tl.load(w_rows + offsets[None, None, :], mask=tl.full((1, 1, WORDS), kw, tl.int32) < k_words, other=0)
    else:
        return tl.load(w_rows + offsets[None, None, :], mask=offsets[None, None, :] < k_words, other=0)


@triton.jit
def weight_only_gemv_kernel(x_ptr, w_ptr, s_ptr, g_ptr, y_ptr, offsets_ptr, N, K,
                            stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_ym,
                            FMT: tl.constexpr, GROUP: tl.constexpr, VARIANT: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            EVEN_K: tl.constexpr, ASM_DECODE: tl.constexpr = False):
    """Weight-only GEMV on CUDA cores, one token per program: every program owns ``BLOCK_N`` whole rows of W.

    At M = 1 a GEMM is a stream over the weights and a tensor-core tile is 1/16 used: this kernel
    reads int32 code words ``[BLOCK_N, BLOCK_K/8]`` (16-byte loads along K), the next K tile's
    while this one is decoded (Triton does not pipeline loads that stay in registers), and adds
    each word's scaled dot product with the activations (:func:`_gemv_word_dot_asm`) to that
    word's FP32 running sum. So the only cross-thread reduction is one per program, and whole
    rows per program need no split-K. The products are exact FP32 (the halves and planes kernels
    round code * scale to BF16). Each decoded weight costs one FMA per token, so at M >= 2 the
    planes kernel is faster (configs.py).
    """
    tl.static_assert(BLOCK_M == 1, "the GEMV runs one token per program")
    expert, row0, row_end, rm, rn = _expert_tile(offsets_ptr, N, BLOCK_M, BLOCK_N)
    if row0 < row_end:
        WORDS: tl.constexpr = BLOCK_K // 8
        rw = tl.arange(0, WORDS)
        col_ok = rn < N
        rows = tl.minimum(rn, N - 1)  # rows past N read row N-1 (their results are not stored)
        w_rows = w_ptr + expert.to(tl.int64) * stride_we + rows[None, :, None] * stride_wn
        s_rows = s_ptr + expert.to(tl.int64) * stride_se + rows[None, :, None] * stride_sn
        x_row = x_ptr + row0 * stride_xm
        k_words = tl.cdiv(K, 8)
        acc = tl.zeros((1, BLOCK_N, WORDS), dtype=tl.float32)
        words_next = _gemv_words(w_rows, 0, k_words, WORDS, EVEN_K)
        for kw in range(0, k_words, WORDS):
            kw = tl.multiple_of(kw, WORDS)
            words = words_next
            words_next = _gemv_words(w_rows, kw + WORDS, k_words, WORDS, EVEN_K)
            # Word indices in the code words' own register layout (``words & 0``): no layout conversion.
            index = (kw + rw)[None, None, :] + (words & 0)
            k_ok = index < k_words
            if not EVEN_K:
                index = tl.minimum(index, k_words - 1)
            s_addresses = s_rows + index // (GROUP // 8)
            if ASM_DECODE:
                dots = _gemv_word_dots_asm(words, x_row + 8 * index, s_addresses, VARIANT)
            else:
                dots = _gemv_word_dots_portable(words, x_row, s_addresses, index, k_ok, FMT, BLOCK_N, WORDS)
            if not EVEN_K:
                dots = tl.where(k_ok, dots, 0.0)
            acc += dots
        y = tl.sum(acc, axis=2)
        if FMT != FMT_INT4:
            y = y * 16384.0
        if FMT == FMT_NVFP4:
            y = y * tl.load(g_ptr + expert)
        _store_cast(y_ptr + rm[:, None] * stride_ym + rn[None, :], y, (rm < row_end)[:, None] & col_ok[None, :])


# ---- Tensor-core GEMV: mma.sync fed lane by lane (M <= 16) ------------------------------------
#
# mma.sync.m16n8k16 (BF16 in, FP32 accumulate) puts lane 4g + t's operands at fixed places:
# A[m][k] for m in {g, g+8} and k in {2t, 2t+1, 2t+8, 2t+9}, B[k][n] for n = g and the same k,
# C[m][n] for m in {g, g+8} and n in {2t, 2t+1}. The kernel makes W the A operand: lane 4g + t
# holds whole code words of W rows g and g+8 (words 4t..4t+3 of each row's 16-word, 128-K chunk)
# and, for each word, feeds two MMAs with nibbles (0,2 | 1,3) and (4,6 | 5,7) in the k slots
# 2t,2t+1 | 2t+8,2t+9. Which K a slot holds depends on t only, so B, the same K positions of token
# g's activations loaded by the lane itself, lines up with A for all 16 rows at once: no data
# moves between lanes, and one MMA multiplies 256 weights by up to 8 tokens (a second B, tokens
# g+8, reuses the decoded A for 16). A dot product does not depend on the order of its K, so the
# MMA's k slots need not be K order.
MMA_CHUNK_K = 128  # K per warp step: 4 lanes x 4 words x 8 nibbles
MMA_ROWS = 16  # rows of W per warp: the MMA's m
_CHUNK_K = tl.constexpr(MMA_CHUNK_K)


def _mma_scale_ptx(scale: str, register: str, address: str) -> list[str]:
    """PTX: the BF16 pair (s, s) of one group scale into ``register``.

    NVFP4's E4M3 scale carries 2^NVFP4_ASM_SCALE_SHIFT, as the halves kernel's; E8M0 is
    built from bits as :func:`_e8m0_to_f32` (0 is the subnormal 2^-127, 255 NaN).
    """
    if scale == "bf16":
        lines = [f"ld.global.nc.b16 sb, [{address}];"]
    elif scale == "f16":
        lines = [f"ld.global.nc.b16 sb, [{address}];", "cvt.f32.f16 f, sb;", "cvt.rn.bf16.f32 sb, f;"]
    elif scale == "f32":
        lines = [f"ld.global.nc.f32 f, [{address}];", "cvt.rn.bf16.f32 sb, f;"]
    elif scale == "e8m0":
        lines = [f"ld.global.nc.u8 sb, [{address}];", "cvt.u32.u16 t, sb;", *_e8m0_bits_ptx("u", 7),
                 "cvt.u16.u32 sb, u;"]
    else:  # e4m3
        lines = [f"ld.global.nc.u8 sb, [{address}];", "cvt.rn.f16x2.e4m3x2 u, sb;", "mov.b32 {sb, hb}, u;",
                 "cvt.f32.f16 f, sb;", f"mul.f32 f, f, {_f32_hex(2.0 ** NVFP4_ASM_SCALE_SHIFT.value)};", "cvt.rn.bf16.f32 sb, f;"]
    return lines + [f"mov.b32 {register}, {{sb, sb}};"]


def _mma_chunk_asm(fmt: int, scale: str, token_cols: int) -> str:
    """Inline PTX for one lane's share of a 128-K chunk of rows g and g+8: ``C += A @ B`` over its eight code words.

    Operands, with ``c = 4 * token_cols`` accumulators: ``$0..$(c-1)`` C out (FP32; tokens 2t, 2t+1,
    then 2t+8, 2t+9), the next eight code words out (rows g then g+8); then C in, the four code
    words of row g and of row g+8, the addresses of a later chunk's words of both rows (loaded here,
    one or two chunks ahead), of tokens g's (and g+8's) activations at this lane's first word (a
    word's eight BF16 in one 16-byte load) and of the group scales of rows g and g+8. The weights
    are decoded as the halves kernel's (``_ptx_pair_decode``) and multiplied by their scale as BF16
    pairs, so (code * scale) rounds once to BF16, as a serving kernel's dequantized weights do.
    """
    c = 4 * token_cols
    w_lo, w_hi = 2 * c + 8, 2 * c + 12  # operand numbers of the two rows' code words
    next_lo, next_hi, x_lo, x_hi, s_lo, s_hi = (f"${2 * c + 16 + i}" for i in range(6))
    lines = [".reg .b32 xa, xb, xc, xd, ya, yb, yc, yd, a0, a1, a2, a3, b0, b1, e0, e1, t, th, u;",
             ".reg .b32 sl, slb, sh, shb, one, off, big, nz;", f".reg .b32 c<{c}>, n<8>;", ".reg .b16 sb, hb;",
             ".reg .f32 f;", ".reg .pred zero, nan;", *_PTX_CONSTANTS,
             # into temporaries: an output may share a register with an input (the loop-carried words do)
             f"ld.global.nc.v4.b32 {{n0, n1, n2, n3}}, [{next_lo}];",
             f"ld.global.nc.v4.b32 {{n4, n5, n6, n7}}, [{next_hi}];",
             *(f"mov.b32 c{i}, ${c + 8 + i};" for i in range(c))]
    lines += _mma_scale_ptx(scale, "sl", s_lo) + _mma_scale_ptx(scale, "sh", s_hi)
    if scale == "e4m3":  # GROUP 16: words 2-3 of the lane's four are the next group
        lines += _mma_scale_ptx(scale, "slb", f"{s_lo}+1") + _mma_scale_ptx(scale, "shb", f"{s_hi}+1")
    for word in range(4):
        lines.append(f"ld.global.nc.v4.b32 {{xa, xb, xc, xd}}, [{x_lo}+{16 * word}];")
        if token_cols == 2:
            lines.append(f"ld.global.nc.v4.b32 {{ya, yb, yc, yd}}, [{x_hi}+{16 * word}];")
        lines += [f"prmt.b32 t, ${w_lo + word}, ${w_lo + word}, 0x3120;",  # bytes (0, 2, 1, 3), as _decode_asm
                  f"prmt.b32 th, ${w_hi + word}, ${w_hi + word}, 0x3120;"]
        lo_scale, hi_scale = ("slb", "shb") if scale == "e4m3" and word >= 2 else ("sl", "sh")
        for half, (x0, x1, y0, y1) in enumerate((("xa", "xb", "ya", "yb"), ("xc", "xd", "yc", "yd"))):
            # A: rows g (a0, a2) and g + 8 (a1, a3), k slots 2t,2t+1 (a0, a1) and 2t+8,2t+9 (a2, a3)
            for operand, source, shift, group_scale in (
                    ("a0", "t", 8 * half, lo_scale), ("a2", "t", 8 * half + 4, lo_scale),
                    ("a1", "th", 8 * half, hi_scale), ("a3", "th", 8 * half + 4, hi_scale)):
                lines += [f"shr.u32 u, {source}, {shift};", *_ptx_pair_decode(fmt),
                          f"fma.rn.bf16x2 {operand}, u, {group_scale}, nz;"]
            lines += [f"prmt.b32 b0, {x0}, {x1}, 0x5410;", f"prmt.b32 b1, {x0}, {x1}, 0x7632;"]
            if token_cols == 2:
                lines += [f"prmt.b32 e0, {y0}, {y1}, 0x5410;", f"prmt.b32 e1, {y0}, {y1}, 0x7632;"]
            for col, b in enumerate(("{b0, b1}", "{e0, e1}")[:token_cols]):
                acc = "{" + ", ".join(f"c{4 * col + i}" for i in range(4)) + "}"
                lines.append(
                    f"mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {acc}, {{a0, a1, a2, a3}}, {b}, {acc};")
    lines += [f"mov.b32 ${i}, c{i};" for i in range(c)] + [f"mov.b32 ${c + i}, n{i};" for i in range(8)]
    return "{\n" + "\n".join(lines) + "\n}"


# The chunk PTX's variants: _GEMV_WORD_DOT_VARIANTS' (format, scale dtype), for one token column of B
# (M <= 8), then the same for two (M <= 16).
_ASM_MMA_CHUNK = tl.constexpr(tuple(_mma_chunk_asm(FORMAT_CODES[fmt], scale, cols)
                                    for cols in (1, 2) for fmt, scale in _GEMV_WORD_DOT_VARIANTS))
# Its operands' constraints, by token columns: C and the next words out, C, the words and six addresses in.
_MMA_CONSTRAINTS = tl.constexpr(tuple("=r," * (4 * cols + 8) + "r," * (4 * cols + 8) + "l,l,l,l,l,l"
                                      for cols in (1, 2)))


@triton.jit
def _mma_chunk(acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, lo0, lo1, lo2, lo3, hi0, hi1, hi2, hi3,
               lo_next, hi_next, x_lo, x_hi, s_lo, s_hi, VARIANT: tl.constexpr, TOKEN_COLS: tl.constexpr):
    """:func:`_mma_chunk_asm` for one chunk: :func:`word_dot_variant`'s PTX for one or two token columns.

    Returns the eight accumulators (the last four unchanged with one column) and the next code words.
    """
    INDEX: tl.constexpr = VARIANT + _WORD_DOT_VARIANT_COUNT * (TOKEN_COLS - 1)
    lo_next, hi_next = lo_next.to(tl.int64, bitcast=True), hi_next.to(tl.int64, bitcast=True)
    x_lo, x_hi = x_lo.to(tl.int64, bitcast=True), x_hi.to(tl.int64, bitcast=True)
    s_lo, s_hi = s_lo.to(tl.int64, bitcast=True), s_hi.to(tl.int64, bitcast=True)
    if TOKEN_COLS == 1:
        acc0, acc1, acc2, acc3, n0, n1, n2, n3, n4, n5, n6, n7 = tl.inline_asm_elementwise(
            _ASM_MMA_CHUNK[INDEX], _MMA_CONSTRAINTS[0],
            [acc0, acc1, acc2, acc3, lo0, lo1, lo2, lo3, hi0, hi1, hi2, hi3, lo_next, hi_next, x_lo, x_hi, s_lo, s_hi],
            dtype=(tl.float32,) * 4 + (tl.int32,) * 8, is_pure=False, pack=1)
    else:
        acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, n0, n1, n2, n3, n4, n5, n6, n7 = tl.inline_asm_elementwise(
            _ASM_MMA_CHUNK[INDEX], _MMA_CONSTRAINTS[1],
            [acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, lo0, lo1, lo2, lo3, hi0, hi1, hi2, hi3, lo_next, hi_next,
             x_lo, x_hi, s_lo, s_hi],
            dtype=(tl.float32,) * 8 + (tl.int32,) * 8, is_pure=False, pack=1)
    return acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, n0, n1, n2, n3, n4, n5, n6, n7


@triton.jit
def _mma_lane_guard(lane_index):
    """0.0 where element ``lane_index`` runs in thread ``lane_index`` of the block, NaN elsewhere.

    The chunk PTX relies on it (an MMA's operands are placed by lane); Triton gives a 1-D tensor
    of one element per thread that layout, and a NaN in the result would fail the config check.
    """
    return tl.inline_asm_elementwise(
        "{\n.reg .b32 t;\n.reg .pred p;\nmov.u32 t, %tid.x;\nsetp.ne.u32 p, t, $1;\nselp.b32 $0, 0x7FC00000, 0, p;\n}",
        "=r,r", [lane_index], dtype=tl.float32, is_pure=False, pack=1)


@triton.jit
def _mma_load_words(address):
    """Four code words from a 16-byte aligned ``address``, in the lane that asks (one ``ld.global.nc.v4``)."""
    return tl.inline_asm_elementwise("ld.global.nc.v4.b32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l",
                                     [address.to(tl.int64, bitcast=True)], dtype=(tl.int32,) * 4, is_pure=False,
                                     pack=1)


@triton.jit
def _mma_portable_rows(acc_a, acc_b, w_row, s_row, x_a, x_b, kk, FMT: tl.constexpr, GROUP: tl.constexpr):
    """What the MMAs add to two C entries of one W row (tokens ``x_a``, ``x_b``) for K indices ``kk`` ``[T, 128]``."""
    words = tl.load(w_row[:, None] + kk // 8)
    nibble = (words >> (4 * (kk % 8))) & 0xF
    if FMT == FMT_INT4:
        values = _int4_to_f32(nibble)
    else:
        values = _e2m1_to_f32(nibble)
    # (code * scale) rounded to BF16, as the PTX's pair arithmetic does
    values = _round_to_bf16(values * _scale_values(s_row[:, None] + kk // GROUP, kk >= 0, FMT))
    acc_a += tl.sum(x_a * values, axis=1)
    acc_b += tl.sum(x_b * values, axis=1)
    return acc_a, acc_b


@triton.jit
def _mma_store(y_ptrs, acc0, acc1, acc2, acc3, token, row, row_end, N, stride_ym, factor,
               SHARES: tl.constexpr, ROW_GROUPS: tl.constexpr):
    """Sum the K shares' C registers (tokens ``token``, +1 x rows ``row``, +8) and store them."""
    # Element j of the row groups' lanes (j = 32 x group + lane) holds the same outputs in every K share.
    c0 = tl.sum(tl.reshape(acc0, (SHARES, 32 * ROW_GROUPS)), axis=0) * factor
    c1 = tl.sum(tl.reshape(acc1, (SHARES, 32 * ROW_GROUPS)), axis=0) * factor
    c2 = tl.sum(tl.reshape(acc2, (SHARES, 32 * ROW_GROUPS)), axis=0) * factor
    c3 = tl.sum(tl.reshape(acc3, (SHARES, 32 * ROW_GROUPS)), axis=0) * factor
    _store_cast(y_ptrs, c0, (token < row_end) & (row < N))
    _store_cast(y_ptrs + stride_ym, c1, (token + 1 < row_end) & (row < N))
    _store_cast(y_ptrs + 8, c2, (token < row_end) & (row + 8 < N))
    _store_cast(y_ptrs + stride_ym + 8, c3, (token + 1 < row_end) & (row + 8 < N))


@triton.jit
def weight_only_mma_kernel(x_ptr, w_ptr, s_ptr, g_ptr, y_ptr, offsets_ptr, N, K,
                           stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_ym,
                           FMT: tl.constexpr, GROUP: tl.constexpr, VARIANT: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, WARPS: tl.constexpr, AHEAD: tl.constexpr = 1,
                           ASM_DECODE: tl.constexpr = False):
    """Weight-only GEMM for M <= 16 on tensor cores without tiles: each warp streams 16 rows of W.

    A program owns ``BLOCK_N`` rows of W and 8 or 16 tokens (one or two B operands of 8 tokens,
    sharing each decoded A). Its ``WARPS`` warps are ``BLOCK_N / 16`` row groups (the MMA's m) times
    K shares that take 128-K chunks in turn; the shares' FP32 sums meet in one reduction at the
    end. No lane ever exchanges operands and nothing is staged through shared memory in the loop
    (see the note above ``MMA_CHUNK_K``). Code words are loaded ``AHEAD`` chunks ahead (the
    config's ``num_stages``). Needs K a multiple of 128 x the K shares and 16-byte aligned rows (the
    launcher checks). Compiled on sm_90/sm_120 the chunk is :func:`_mma_chunk_asm`; elsewhere each
    element computes the same sums in Triton.
    """
    tl.static_assert(BLOCK_M == 8 or BLOCK_M == 16, "B holds tokens g (and g + 8)")
    tl.static_assert(AHEAD == 1 or AHEAD == 2, "code words are loaded one or two chunks ahead")
    TOKEN_COLS: tl.constexpr = BLOCK_M // 8
    ROW_GROUPS: tl.constexpr = BLOCK_N // 16
    SHARES: tl.constexpr = WARPS // ROW_GROUPS
    tl.static_assert(ROW_GROUPS * SHARES == WARPS, "the warps are row groups x K shares")
    THREADS: tl.constexpr = 32 * WARPS
    expert, row0, row_end, rm, rn = _expert_tile(offsets_ptr, N, BLOCK_M, BLOCK_N)
    if row0 < row_end:
        first_row = tl.min(rn, axis=0)
        index = tl.arange(0, THREADS)
        lane = index % 32
        row_g = first_row + 16 * ((index // 32) % ROW_GROUPS) + lane // 4  # this lane's rows: g and g + 8
        share = index // (32 * ROW_GROUPS)
        t = lane % 4
        chunks = K // (_CHUNK_K * SHARES)  # per warp
        # this lane's first word: chunk ``share``, words 4t..4t+3
        word = share * (_CHUNK_K // 8) + 4 * t
        step = SHARES * (_CHUNK_K // 8)
        w_base = w_ptr + expert.to(tl.int64) * stride_we
        s_base = s_ptr + expert.to(tl.int64) * stride_se
        w_lo = w_base + tl.minimum(row_g, N - 1) * stride_wn
        w_hi = w_base + tl.minimum(row_g + 8, N - 1) * stride_wn
        s_lo = s_base + tl.minimum(row_g, N - 1) * stride_sn
        s_hi = s_base + tl.minimum(row_g + 8, N - 1) * stride_sn
        acc0 = tl.zeros((THREADS,), dtype=tl.float32)
        acc1 = tl.zeros((THREADS,), dtype=tl.float32)
        acc2 = tl.zeros((THREADS,), dtype=tl.float32)
        acc3 = tl.zeros((THREADS,), dtype=tl.float32)
        acc4 = tl.zeros((THREADS,), dtype=tl.float32)
        acc5 = tl.zeros((THREADS,), dtype=tl.float32)
        acc6 = tl.zeros((THREADS,), dtype=tl.float32)
        acc7 = tl.zeros((THREADS,), dtype=tl.float32)
        if ASM_DECODE:
            acc0 += _mma_lane_guard(index)
            g = lane // 4
            x_lo = x_ptr + tl.minimum(row0 + g, row_end - 1) * stride_xm  # B's token columns g and g + 8
            x_hi = x_ptr + tl.minimum(row0 + g + 8, row_end - 1) * stride_xm
            lo0, lo1, lo2, lo3 = _mma_load_words(w_lo + word)
            hi0, hi1, hi2, hi3 = _mma_load_words(w_hi + word)
            if AHEAD == 2:
                second = tl.where(chunks > 1, word + step, word)
                lo4, lo5, lo6, lo7 = _mma_load_words(w_lo + second)
                hi4, hi5, hi6, hi7 = _mma_load_words(w_hi + second)
            for i in range(chunks):
                # the chunk AHEAD steps on (the last one again at the end): its words arrive while these are used
                ahead = word + step * tl.minimum(AHEAD, chunks - 1 - i)
                acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, n0, n1, n2, n3, n4, n5, n6, n7 = _mma_chunk(
                    acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, lo0, lo1, lo2, lo3, hi0, hi1, hi2, hi3,
                    w_lo + ahead, w_hi + ahead, x_lo + 8 * word, x_hi + 8 * word, s_lo + (8 * word) // GROUP,
                    s_hi + (8 * word) // GROUP, VARIANT, TOKEN_COLS)
                if AHEAD == 2:
                    lo0, lo1, lo2, lo3, hi0, hi1, hi2, hi3 = lo4, lo5, lo6, lo7, hi4, hi5, hi6, hi7
                    lo4, lo5, lo6, lo7, hi4, hi5, hi6, hi7 = n0, n1, n2, n3, n4, n5, n6, n7
                else:
                    lo0, lo1, lo2, lo3, hi0, hi1, hi2, hi3 = n0, n1, n2, n3, n4, n5, n6, n7
                word += step
        else:
            # Element ``index`` sums what lane ``index``'s C registers hold: rows g, g+8 x tokens 2t, 2t+1 (+8).
            token = row0 + 2 * t
            x_a = x_ptr + tl.minimum(token, row_end - 1)[:, None] * stride_xm
            x_b = x_ptr + tl.minimum(token + 1, row_end - 1)[:, None] * stride_xm
            x_c = x_ptr + tl.minimum(token + 8, row_end - 1)[:, None] * stride_xm
            x_d = x_ptr + tl.minimum(token + 9, row_end - 1)[:, None] * stride_xm
            for i in range(chunks):
                kk = (i * SHARES + share)[:, None] * _CHUNK_K + tl.arange(0, _CHUNK_K)[None, :]
                xa = tl.load(x_a + kk).to(tl.float32)
                xb = tl.load(x_b + kk).to(tl.float32)
                acc0, acc1 = _mma_portable_rows(acc0, acc1, w_lo, s_lo, xa, xb, kk, FMT, GROUP)
                acc2, acc3 = _mma_portable_rows(acc2, acc3, w_hi, s_hi, xa, xb, kk, FMT, GROUP)
                if TOKEN_COLS == 2:
                    xc = tl.load(x_c + kk).to(tl.float32)
                    xd = tl.load(x_d + kk).to(tl.float32)
                    acc4, acc5 = _mma_portable_rows(acc4, acc5, w_lo, s_lo, xc, xd, kk, FMT, GROUP)
                    acc6, acc7 = _mma_portable_rows(acc6, acc7, w_hi, s_hi, xc, xd, kk, FMT, GROUP)
        factor = 1.0
        if FMT == FMT_NVFP4:
            factor = tl.load(g_ptr + expert)
            if ASM_DECODE:
                factor = factor * (2.0 ** (126 - NVFP4_ASM_SCALE_SHIFT))
        j = tl.arange(0, 32 * ROW_GROUPS)
        row = first_row + 16 * (j // 32) + (j % 32) // 4
        token = row0 + 2 * (j % 4)
        y_ptrs = y_ptr + token * stride_ym + row
        _mma_store(y_ptrs, acc0, acc1, acc2, acc3, token, row, row_end, N, stride_ym, factor, SHARES, ROW_GROUPS)
        if TOKEN_COLS == 2:
            _mma_store(y_ptrs + 8 * stride_ym, acc4, acc5, acc6, acc7, token + 8, row, row_end, N, stride_ym, factor,
                       SHARES, ROW_GROUPS)
