"""FP8 block GEMM kernels: per-token-group activation quantization and the grouped FP8 x FP8 GEMM.

DeepSeek's W8A8 scheme: activations get one FP32 scale per token per 128 channels, weights one
per 128x128 block; each 128-wide K slice is a tensor-core dot scaled into an FP32 accumulator.
"""

from __future__ import annotations

import triton
import triton.language as tl

from dsv4convert.kernels.triton_kernels import _e4m3_code, _e8m0_to_f32, _store_cast


@triton.jit
def _pow2_ceil(scale):
    """Smallest power of two >= a positive normal FP32 ``scale`` (DeepSeek's ue8m0 rounding)."""
    bits = scale.to(tl.int32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    return (exponent << 23).to(tl.float32, bitcast=True)


@triton.jit
def act_quant_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_xm, stride_qm, stride_sm, eps,
                     POW2_SCALE: tl.constexpr, HW_ROUND: tl.constexpr, BLOCK_M: tl.constexpr):
    """Per token, per 128 channels: s = max(amax, eps)/448 (rounded up to 2^k), q = e4m3(x/s).

    With a power-of-two scale, x/s is exactly x times 1/s, and |x/s| <= 448, so ``HW_ROUND``
    lets the hardware's round-to-nearest-even E4M3 conversion replace the integer one (the
    interpreter truncates, so it keeps the integer path); other scales divide correctly rounded.
    """
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    group = tl.program_id(1)
    rk = group * 128 + tl.arange(0, 128)
    mask = (rm < M)[:, None] & (rk < K)[None, :]
    x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    scale = tl.math.div_rn(tl.maximum(amax, eps), tl.full(amax.shape, 448.0, tl.float32))
    if POW2_SCALE:
        scale = _pow2_ceil(scale)
    if POW2_SCALE and HW_ROUND:
        q = (x * (1.0 / scale)[:, None]).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    else:
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
