"""FP8 block GEMM kernels: per-token-group activation quantization and the grouped FP8 x FP8 GEMM.

DeepSeek's W8A8 scheme: activations get one FP32 scale per token per group of channels, weights one per
block (the release's: 128x128 for DeepSeek-V4, 32x32 for V4.1, a ``tl.constexpr`` of each kernel); the
activation groups are the weight block's columns, so each K slice of that width is a tensor-core dot scaled
into an FP32 accumulator.
"""

from __future__ import annotations

import triton
import triton.language as tl

from dsv4convert.kernels.triton_kernels import _e4m3_code, _e8m0_to_f32, _store_cast


RESCALE_MIN_WEIGHT_SCALE = tl.constexpr(2.0**-40)


@triton.jit
def _pow2_ceil(scale):
    """Smallest power of two >= a positive normal FP32 ``scale`` (DeepSeek's ue8m0 rounding)."""
    bits = scale.to(tl.int32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    return (exponent << 23).to(tl.float32, bitcast=True)


@triton.jit
def act_quant_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_xm, stride_qm, stride_sm, stride_sg, eps,
                     POW2_SCALE: tl.constexpr, HW_ROUND: tl.constexpr, BLOCK_M: tl.constexpr,
                     GROUPS: tl.constexpr, GROUP: tl.constexpr):
    """Per token, per ``GROUP`` channels: s = max(amax, eps)/448 (rounded up to 2^k), q = e4m3(x/s).

    Each program quantizes ``BLOCK_M`` tokens x ``GROUPS`` groups of ``GROUP`` channels. With a
    power-of-two scale, x/s is exactly x times 1/s, and |x/s| <= 448, so ``HW_ROUND`` lets the
    hardware's round-to-nearest-even E4M3 conversion replace the integer one (the interpreter
    truncates, so it keeps the integer path); other scales divide correctly rounded.
    """
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    first_group = tl.program_id(1) * GROUPS
    rk = first_group * GROUP + tl.arange(0, GROUPS * GROUP)
    mask = (rm < M)[:, None] & (rk < K)[None, :]
    x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=mask, other=0.0).to(tl.float32)
    x = tl.reshape(x, (BLOCK_M, GROUPS, GROUP))
    amax = tl.max(tl.abs(x), axis=2)
    scale = tl.math.div_rn(tl.maximum(amax, eps), tl.full(amax.shape, 448.0, tl.float32))
    if POW2_SCALE:
        scale = _pow2_ceil(scale)
    if POW2_SCALE and HW_ROUND:
        q = (x * (1.0 / scale)[:, :, None]).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    else:
        q = _e4m3_code(tl.math.div_rn(x, scale[:, :, None]))
    tl.store(q_ptr + rm[:, None] * stride_qm + rk[None, :], tl.reshape(q, (BLOCK_M, GROUPS * GROUP)), mask=mask)
    rg = first_group + tl.arange(0, GROUPS)
    tl.store(s_ptr + rm[:, None] * stride_sm + rg[None, :] * stride_sg, scale,
             mask=(rm < M)[:, None] & (rg < tl.cdiv(K, GROUP))[None, :])


@triton.jit
def _weight_block_scale(ws_row_ptr, kb, SCALE_E8M0: tl.constexpr):
    """The one FP32 scale of a weight block (a scalar load)."""
    if SCALE_E8M0:
        return _e8m0_to_f32(tl.load(ws_row_ptr + kb).to(tl.int32) & 0xFF)
    else:
        return tl.load(ws_row_ptr + kb)


@triton.jit
def fp8_block_gemm_kernel(xq_ptr, xs_ptr, w_ptr, ws_ptr, y_ptr, offsets_ptr, x_desc, w_desc, T, N, K,
                          stride_xm, stride_xsm, stride_xsk, stride_we, stride_wn, stride_wse, stride_wsn,
                          stride_ym,
                          SCALE_E8M0: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          N_HALVES: tl.constexpr, SPLIT_K: tl.constexpr, GROUP_M: tl.constexpr,
                          EVEN_K: tl.constexpr, USE_TMA: tl.constexpr,
                          RESCALE: tl.constexpr, HW_ROUND: tl.constexpr,
                          WEIGHT_BLOCK_N: tl.constexpr, WEIGHT_BLOCK_K: tl.constexpr):
    """Grouped FP8 x FP8 GEMM with 1 x ``WEIGHT_BLOCK_K`` activation scales (FP32) and ``WEIGHT_BLOCK_N x
    WEIGHT_BLOCK_K`` weight scales (128x128 for DeepSeek-V4).

    Each ``WEIGHT_BLOCK_K``-wide K slice is an FP8 tensor-core dot whose FP32 result is scaled into the
    accumulator (DeepGEMM's two-level accumulation). A program's ``BLOCK_N`` (<= ``WEIGHT_BLOCK_N``) columns
    lie in one weight scale block's rows, so the weight scale is one scalar per K slice, folded
    into the activations' scale vector: one FMA per accumulator element. ``N_HALVES == 2``
    (``BLOCK_N == WEIGHT_BLOCK_N``) makes the tile two scale blocks wide: two dots and two accumulators, one per
    scale block. With ``GROUP_M > 1`` consecutive programs sweep the columns for ``GROUP_M`` row
    tiles at a time, so weight tiles are reused from L2.

    ``RESCALE`` (power-of-two, never-zero E8M0 weight scales, ``N_HALVES == 1``) keeps the
    accumulator in units of the current K block's scales instead: before each dot it is multiplied
    by the ratio of the previous block's scales to this one's (exact for powers of two) and passed
    to the dot as its accumulator, and the final scales are applied once after the loop. This
    needs no second register tile for the dot's result (128x128 tiles: 128 registers, two CTAs
    per SM on Hopper), but the running sum now goes through the tensor core's reduced-precision
    FP8 accumulation over all of K (what ``use_fast_accum`` does in cuBLAS): on the H200 the error
    against the FP32 reference grew from 1.7e-3 to 1.9e-3 (K=2048), 2.2e-3 (K=4096) and 2.6e-3
    (K=8192). Weight scales below 2^-40 (an all-zero block's E8M0 byte 0, say) count as 2^-40
    so that the ratios cannot overflow the accumulator; such a block's share stays below
    2^-40 * 448 * 448 * WEIGHT_BLOCK_K of the activation scale.

    Loads are unmasked along M and N: row and column indices are clamped into the tensors, the
    extra rows (another expert's tokens) and columns only reach masked-out outputs. ``USE_TMA``
    reads the operand tiles through tensor descriptors (``x_desc`` over ``[T, K]``, ``w_desc``
    over the expert stack as ``[E*N, K]``), which zero-fill past the ends. ``HW_ROUND`` rounds the
    BF16 outputs with the hardware conversion (the same bits): with the integer rounding's seven
    instructions per output, M=4096 ran 1.02-1.19x longer on the H200 (most on wq_b, whose tiles
    have only 8 K blocks to spread the epilogue over).
    """
    pid_mn = tl.program_id(0)
    pid_k = tl.program_id(1)
    expert = tl.program_id(2)
    TILE_N: tl.constexpr = BLOCK_N * N_HALVES
    num_n = tl.cdiv(N, TILE_N)
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
    row0 = row_begin + pid_m * BLOCK_M
    if row0 < row_end:
        n0 = pid_n * TILE_N
        rm = row0 + tl.arange(0, BLOCK_M)
        rm_in = tl.minimum(rm, T - 1)
        rn = n0 + tl.arange(0, BLOCK_N)
        rn_hi = rn + BLOCK_N
        w_expert = w_ptr + expert.to(tl.int64) * stride_we
        ws_expert = ws_ptr + expert.to(tl.int64) * stride_wse
        ws_row = ws_expert + (n0 // WEIGHT_BLOCK_N) * stride_wsn
        ws_row_hi = ws_expert + tl.minimum(n0 // WEIGHT_BLOCK_N + 1, tl.cdiv(N, WEIGHT_BLOCK_N) - 1) * stride_wsn
        w_rows = w_expert + tl.minimum(rn, N - 1)[:, None] * stride_wn
        w_rows_hi = w_expert + tl.minimum(rn_hi, N - 1)[:, None] * stride_wn
        x_rows = xq_ptr + rm_in[:, None] * stride_xm
        xs_rows = xs_ptr + rm_in * stride_xsm
        w_desc_row = expert * N + n0
        k_blocks = tl.cdiv(K, WEIGHT_BLOCK_K)
        per_split = tl.cdiv(k_blocks, SPLIT_K)
        kb_begin = pid_k * per_split
        kb_end = tl.minimum(kb_begin + per_split, k_blocks)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_hi = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        # The scales are loaded one K block ahead, so their latency overlaps the previous dot.
        kb_last = tl.maximum(kb_end - 1, kb_begin)
        x_scale = tl.load(xs_rows + kb_begin * stride_xsk)
        w_scale = _weight_block_scale(ws_row, kb_begin, SCALE_E8M0)
        w_scale_hi = _weight_block_scale(ws_row_hi, kb_begin, SCALE_E8M0)
        if RESCALE:
            w_scale = tl.maximum(w_scale, RESCALE_MIN_WEIGHT_SCALE)
        ratio = tl.full((BLOCK_M,), 1.0, tl.float32)  # RESCALE: previous block's scales / this one's
        for kb in tl.range(kb_begin, kb_end):
            k0 = kb * WEIGHT_BLOCK_K
            if USE_TMA:
                x = x_desc.load([row0, k0])
                w = w_desc.load([w_desc_row, k0])
                if N_HALVES == 2:
                    w_hi = w_desc.load([w_desc_row + BLOCK_N, k0])
            else:
                rk = k0 + tl.arange(0, WEIGHT_BLOCK_K)
                if EVEN_K:
                    x = tl.load(x_rows + rk[None, :])
                    w = tl.load(w_rows + rk[None, :])
                    if N_HALVES == 2:
                        w_hi = tl.load(w_rows_hi + rk[None, :])
                else:
                    k_ok = (rk < K)[None, :]
                    x = tl.load(x_rows + rk[None, :], mask=k_ok, other=0.0)
                    w = tl.load(w_rows + rk[None, :], mask=k_ok, other=0.0)
                    if N_HALVES == 2:
                        w_hi = tl.load(w_rows_hi + rk[None, :], mask=k_ok, other=0.0)
            kb_next = tl.minimum(kb + 1, kb_last)
            x_scale_next = tl.load(xs_rows + kb_next * stride_xsk)
            w_scale_next = _weight_block_scale(ws_row, kb_next, SCALE_E8M0)
            if RESCALE:
                w_scale_next = tl.maximum(w_scale_next, RESCALE_MIN_WEIGHT_SCALE)
                # acc holds the sum in units of the previous block's scales: convert, then accumulate.
                acc = tl.dot(x, tl.trans(w), acc * ratio[:, None])
                ratio = tl.math.div_rn(x_scale, x_scale_next) * tl.math.div_rn(w_scale, w_scale_next)
            else:
                acc += tl.dot(x, tl.trans(w)) * (x_scale * w_scale)[:, None]
            if N_HALVES == 2:
                w_scale_hi_next = _weight_block_scale(ws_row_hi, kb_next, SCALE_E8M0)
                acc_hi += tl.dot(x, tl.trans(w_hi)) * (x_scale * w_scale_hi)[:, None]
                w_scale_hi = w_scale_hi_next
            x_scale = x_scale_next
            w_scale = w_scale_next
        if RESCALE:
            acc = acc * x_scale[:, None] * w_scale  # the last block's scales (kb_next stops there)
        row_ok = (rm < row_end)[:, None]
        y_ptrs = y_ptr + rm[:, None] * stride_ym + rn[None, :]
        if SPLIT_K == 1:
            _store_cast(y_ptrs, acc, row_ok & (rn < N)[None, :], HW_ROUND)
            if N_HALVES == 2:
                _store_cast(y_ptrs + BLOCK_N, acc_hi, row_ok & (rn_hi < N)[None, :], HW_ROUND)
        else:
            tl.atomic_add(y_ptrs, acc, mask=row_ok & (rn < N)[None, :])
            if N_HALVES == 2:
                tl.atomic_add(y_ptrs + BLOCK_N, acc_hi, mask=row_ok & (rn_hi < N)[None, :])
