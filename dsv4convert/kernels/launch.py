"""Launchers: pick a config for the device, check it once against the reference, run the kernel.

Imported only when Triton is installed.
"""

from __future__ import annotations

import dataclasses

import torch
import triton

from dsv4convert.errors import DSV4Error
from dsv4convert.kernels import configs, reference
from dsv4convert.kernels._runtime import arch_of, interpreting
from dsv4convert.kernels.configs import GemmConfig
from dsv4convert.kernels.operands import QuantizedWeight, quantized_weight
from dsv4convert.kernels.samples import random_activations, random_weight
from dsv4convert.kernels.triton_fp8_gemm import act_quant_kernel, fp8_block_gemm_kernel
from dsv4convert.kernels.triton_gemv import (
    MMA_CHUNK_K,
    MMA_ROWS,
    weight_only_gemv_kernel,
    weight_only_mma_kernel,
    word_dot_variant,
)
from dsv4convert.kernels.triton_kernels import (
    FORMAT_CODES,
    dequant_4bit_kernel,
    dequant_fp8_kernel,
    weight_only_gemm_kernel,
    weight_only_halves_kernel,
    weight_only_planes_kernel,
)

# GEMM outputs are compared with the FP32 reference at BF16 rounding noise (formats.md §7
# measured 1.7e-3 in a BF16 output); the config check allows a little more.
GEMM_REL_TOLERANCE = 5e-3


def dequantize(weight: QuantizedWeight, out_dtype: torch.dtype,
               cfg: configs.ElementwiseConfig | None = None) -> torch.Tensor:
    """All experts at once: the stack is one [E*N, K] matrix to the kernel."""
    cfg = cfg or configs.dequant_config(arch_of(weight.device), weight.fmt)
    rows = weight.experts * weight.n
    out = torch.empty(rows, weight.k, dtype=out_dtype, device=weight.device)
    if weight.fmt == "fp8" and weight.n % weight.block[0] and weight.experts > 1:
        # Ragged row blocks do not line up across a flattened stack: one launch per expert.
        parts = [dequantize(_one_expert(weight, e), out_dtype, cfg) for e in range(weight.experts)]
        return torch.stack(parts)
    codes = weight.codes.reshape(rows, -1)
    scale = weight.scale.reshape(-1, weight.scale.shape[-1])
    hw_round = not interpreting()
    if weight.fmt == "fp8":
        # A tile's rows must share one row of block scales, and its columns whole scale blocks.
        scale_rows, scale_cols = weight.block
        block_n = min(cfg.block_rows, scale_rows)
        block_k = triton.cdiv(cfg.block_cols, scale_cols) * scale_cols
        grid = (triton.cdiv(rows, block_n), triton.cdiv(weight.k, block_k))
        dequant_fp8_kernel[grid](
            codes, scale, out, rows, weight.k, codes.stride(0), scale.stride(0), out.stride(0),
            SCALE_E8M0=weight.scale_is_e8m0, HW_ROUND=hw_round, BLOCK_N=block_n, BLOCK_K=block_k,
            WEIGHT_BLOCK_N=scale_rows, WEIGHT_BLOCK_K=scale_cols, num_warps=cfg.num_warps,
        )
    else:
        global_scale = weight.global_scale if weight.global_scale is not None else scale
        block_k = max(cfg.block_cols, weight.group)
        grid = (triton.cdiv(rows, cfg.block_rows), triton.cdiv(weight.k, block_k))
        dequant_4bit_kernel[grid](
            codes, scale, global_scale, out, rows, weight.k, weight.n, codes.stride(0), scale.stride(0),
            out.stride(0), FMT=FORMAT_CODES[weight.fmt], GROUP=weight.group, HW_ROUND=hw_round,
            BLOCK_N=cfg.block_rows, BLOCK_K=block_k, num_warps=cfg.num_warps,
        )
    return out.reshape(weight.experts, weight.n, weight.k) if weight.stacked else out


def _one_expert(weight: QuantizedWeight, expert: int) -> QuantizedWeight:
    return dataclasses.replace(
        weight,
        codes=weight.codes[expert:expert + 1], scale=weight.scale[expert:expert + 1],
        global_scale=None if weight.global_scale is None else weight.global_scale[expert:expert + 1],
        source=tuple(t[expert:expert + 1] for t in weight.source), stacked=False,
    )


# Activation quantization tile: (tokens, channel groups, warps) per program. On the H200 at
# M=4096 seven tiles measured within 0.5 us of each other (12.4-13.1 us at K=4096); below 64
# tokens the 16-token, one-group tile the kernel had before is kept (more programs).
ACT_QUANT_TILE = (32, 2, 4)
ACT_QUANT_TILE_FEW_TOKENS = (16, 1, 4)
_ACT_QUANT_WIDTH = 128   # the channels per group the tiles above were measured with


def quantize_activations_fp8(x: torch.Tensor, *, group: int, pow2_scale: bool = True,
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 codes ``[M, K]`` and FP32 scales ``[M, ceil(K/group)]`` (``group``: the weight block's columns).

    The scales are stored M-major (a transposed view, stride 1 along M), so the GEMM reads a
    row tile's scales for one K block as one contiguous vector. A program covers ``per_program``
    128-channel groups' width whatever the group (the tile measured for DeepSeek-V4's 128).
    """
    m, k = x.shape
    groups = triton.cdiv(k, group)
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(groups, m, dtype=torch.float32, device=x.device).t()
    block_m, per_program, warps = ACT_QUANT_TILE if m > 64 else ACT_QUANT_TILE_FEW_TOKENS
    per_program = max(1, per_program * _ACT_QUANT_WIDTH // group)
    act_quant_kernel[(triton.cdiv(m, block_m), triton.cdiv(groups, per_program))](
        x, q.view(torch.uint8), scale, m, k, x.stride(0), q.stride(0), scale.stride(0), scale.stride(1),
        reference.ACTIVATION_EPS, POW2_SCALE=pow2_scale, HW_ROUND=not interpreting(), BLOCK_M=block_m,
        GROUPS=per_program, GROUP=group, num_warps=warps,
    )
    return q, scale


def _gemm_kind(weight: QuantizedWeight) -> str:
    return "fp8" if weight.fmt == "fp8" else "weight_only"


def _launch(weight: QuantizedWeight, x: torch.Tensor, offsets: torch.Tensor, max_rows: int,
            cfg: GemmConfig) -> torch.Tensor:
    """Run the grouped GEMM with exactly ``cfg``; returns BF16 ``[T, N]``."""
    split_k = cfg.split_k
    if cfg.variant in PLANES_VARIANTS:
        split_k = 1  # reduces its K slices in the launch itself, into BF16 Y
    y = (torch.zeros if split_k > 1 else torch.empty)(
        x.shape[0], weight.n, dtype=torch.float32 if split_k > 1 else torch.bfloat16, device=x.device)
    tile_n = cfg.block_n
    if weight.fmt == "fp8":
        block_n, halves = _fp8_tile(cfg, weight)
        tile_n = block_n * halves
    grid = (triton.cdiv(max(max_rows, 1), cfg.block_m) * triton.cdiv(weight.n, tile_n), cfg.split_k,
            weight.experts)
    if weight.fmt == "fp8":
        _launch_fp8_block(weight, x, offsets, y, grid, cfg)
    else:
        _launch_weight_only(weight, x, offsets, y, grid, cfg)
    return y.to(torch.bfloat16) if split_k > 1 else y


def _fp8_uses_tma(cfg: GemmConfig, weight: QuantizedWeight) -> bool:
    """Tensor-descriptor operand loads: configs that ask for them, compiled on sm_90, 16-byte rows."""
    return (cfg.variant.startswith("tma") and not interpreting() and arch_of(weight.device) == "sm_90"
            and weight.k % 16 == 0 and weight.codes.is_contiguous())


def _fp8_tile(cfg: GemmConfig, weight: QuantizedWeight) -> tuple[int, int]:
    """(columns per half, halves) of ``cfg``'s tile on FP8 weights: a half lies within one row of weight scale
    blocks, so ``cfg.block_n`` twice the block's rows runs as two halves (256 on 128-row blocks) and a wider one
    is narrowed to one block."""
    rows = weight.block[0]
    if cfg.block_n == 2 * rows:
        return rows, 2
    return min(cfg.block_n, rows), 1


def _launch_fp8_block(weight: QuantizedWeight, x: torch.Tensor, offsets: torch.Tensor, y: torch.Tensor,
                      grid: tuple[int, int, int], cfg: GemmConfig) -> None:
    """``cfg.block_n`` is the tile width (:func:`_fp8_tile`): on 128x128 blocks 256 runs as two 128-column
    halves (one weight scale each).

    ``cfg.variant``: ``tile`` (pointer loads), ``tma`` (tensor descriptors on sm_90), ``*rescale*``
    (E8M0 weight scales: the accumulator is rescaled between K blocks and fed to the dot, see the
    kernel).
    """
    scale_rows, scale_cols = weight.block
    xq, xs = quantize_activations_fp8(x, group=scale_cols)
    w_scale = weight.scale
    block_n, halves = _fp8_tile(cfg, weight)
    x_desc = w_desc = None
    if _fp8_uses_tma(cfg, weight):
        from triton.tools.tensor_descriptor import TensorDescriptor

        x_desc = TensorDescriptor.from_tensor(xq, [cfg.block_m, scale_cols])
        w_desc = TensorDescriptor.from_tensor(weight.codes.view(-1, weight.k), [block_n, scale_cols])
    fp8_block_gemm_kernel[grid](
        xq, xs, weight.codes, w_scale, y, offsets, x_desc, w_desc, x.shape[0], weight.n, weight.k,
        xq.stride(0), xs.stride(0), xs.stride(1), weight.codes.stride(0), weight.codes.stride(1),
        w_scale.stride(0), w_scale.stride(1), y.stride(0),
        SCALE_E8M0=weight.scale_is_e8m0, BLOCK_M=cfg.block_m, BLOCK_N=block_n, N_HALVES=halves,
        SPLIT_K=cfg.split_k, GROUP_M=cfg.group_m, EVEN_K=weight.k % scale_cols == 0,
        USE_TMA=x_desc is not None, RESCALE="rescale" in cfg.variant and weight.scale_is_e8m0 and halves == 1,
        HW_ROUND=not interpreting(), WEIGHT_BLOCK_N=scale_rows, WEIGHT_BLOCK_K=scale_cols,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


PLANES_VARIANTS = ("planes", "planes_xperm")
_TICKETS: dict[tuple[torch.device, int], torch.Tensor] = {}


def _tickets(device: torch.device, count: int) -> torch.Tensor:
    """Zeroed int32 counters, one per output tile, for the planes kernel's in-launch split-K.

    Every launch leaves them at zero again (the last K slice of a tile resets its counter), so one
    buffer per stream serves every call on it, CUDA-graph replays included; launches on different
    streams, which may overlap, get different buffers.
    """
    key = (device, torch.cuda.current_stream(device).stream_id if device.type == "cuda" else 0)
    buffer = _TICKETS.get(key)
    if buffer is None or buffer.numel() < count:
        buffer = torch.zeros(max(count, 1 << 14), dtype=torch.int32, device=device)
        _TICKETS[key] = buffer
    return buffer


def _launch_weight_only(weight: QuantizedWeight, x: torch.Tensor, offsets: torch.Tensor, y: torch.Tensor,
                        grid: tuple[int, int, int], cfg: GemmConfig) -> None:
    n, k = weight.n, weight.k
    global_scale = weight.global_scale if weight.global_scale is not None else weight.scale
    block_k = max(cfg.block_k, weight.group)
    args = (x, weight.codes, weight.scale, global_scale, y, offsets, n, k,
            x.stride(0), weight.codes.stride(0), weight.codes.stride(1), weight.scale.stride(0),
            weight.scale.stride(1), y.stride(0))
    if cfg.variant in PLANES_VARIANTS:
        codes = weight.codes.view(torch.int32)  # [E, N, K/8] words; K is a multiple of 8 in every format
        even_k = k % (block_k * cfg.split_k) == 0
        x_permuted = cfg.variant == "planes_xperm" and even_k
        if x_permuted:
            # Each BLOCK_K tile of X plane after plane: column i*BLOCK_K/8 + j holds K = 8j + i.
            x = x.view(x.shape[0], k // block_k, block_k // 8, 8).transpose(2, 3).reshape(x.shape[0], k)
        parts = torch.empty((cfg.split_k, *y.shape) if cfg.split_k > 1 else (1,), dtype=torch.float32,
                            device=y.device)
        tickets = _tickets(y.device, grid[0] * grid[2]) if cfg.split_k > 1 else parts
        weight_only_planes_kernel[grid](
            x, codes, weight.scale, global_scale, y, offsets, parts, tickets, n, k,
            x.stride(0), codes.stride(0), codes.stride(1), weight.scale.stride(0), weight.scale.stride(1), y.stride(0),
            parts.stride(0),
            FMT=FORMAT_CODES[weight.fmt], GROUP=weight.group,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=block_k, SPLIT_K=cfg.split_k,
            EVEN_K=even_k, UPCAST_DOT=interpreting(),
            ASM_DECODE=asm_decode_runs_on(weight.device), X_PERMUTED=x_permuted,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    elif cfg.variant in ("gemv", "mma"):
        codes = weight.codes.view(torch.int32)
        if x.data_ptr() % 16:  # both PTXs read a code word's eight activations as one 16-byte vector
            x = x.clone()
        word_args = (x, codes, weight.scale, global_scale, y, offsets, n, k, x.stride(0), codes.stride(0),
                     codes.stride(1), weight.scale.stride(0), weight.scale.stride(1), y.stride(0))
        word_kwargs = dict(FMT=FORMAT_CODES[weight.fmt], GROUP=weight.group, ASM_DECODE=asm_decode_runs_on(weight.device),
                           VARIANT=word_dot_variant(weight.fmt, str(weight.scale.dtype).removeprefix("torch.")))
        if cfg.variant == "gemv":
            weight_only_gemv_kernel[grid](
                *word_args, **word_kwargs,
                BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            )
        else:
            shares = _mma_k_shares(cfg)
            if k % (MMA_CHUNK_K * shares) or codes.data_ptr() % 16:
                raise DSV4Error(f"{cfg} needs K a multiple of {MMA_CHUNK_K * shares} and 16-byte aligned code words "
                                f"(K={k}, code words at byte {codes.data_ptr() % 16} of 16)")
            weight_only_mma_kernel[grid](
                *word_args, **word_kwargs, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, WARPS=cfg.num_warps,
                AHEAD=cfg.num_stages, num_warps=cfg.num_warps, num_stages=1,
            )
    elif cfg.variant == "halves":
        weight_only_halves_kernel[grid](
            *args, FMT=FORMAT_CODES[weight.fmt], GROUP=weight.group,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=block_k, SPLIT_K=cfg.split_k,
            EVEN_K=k % (block_k * cfg.split_k) == 0, UPCAST_DOT=interpreting(),
            ASM_DECODE=asm_decode_runs_on(weight.device),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    else:
        weight_only_gemm_kernel[grid](
            *args, FMT=FORMAT_CODES[weight.fmt], GROUP=weight.group,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=block_k,
            SPLIT_K=cfg.split_k, UPCAST_DOT=interpreting(),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )


def asm_decode_runs_on(device: torch.device) -> bool:
    """Whether the weight-only kernels decode with inline PTX here: compiled for sm_90 or sm_120 only.

    The halves and planes kernels' PTX (``prmt``, ``lop3``, ``fma.rn.bf16x2``) is valid from
    sm_80, the GEMV's and the mma GEMV's (``cvt.rn.f16x2.e4m3x2`` for NVFP4 scales; the latter's
    ``mma.sync.m16n8k16`` BF16 from sm_80) from sm_89, but only these two
    have been chosen for; the interpreter and other GPUs keep the pure-Triton decode. Either way
    the config is checked against the reference once per device (``checked_config``).
    """
    return not interpreting() and device.type == "cuda" and arch_of(device) in ("sm_90", "sm_120")


def relative_error(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """||approx - reference||_F / ||reference||_F in float64; NaN anywhere makes it infinite."""
    diff = approx.double() - reference.double()
    if not bool(torch.isfinite(diff).all()):
        return float("inf")
    return float(diff.norm() / reference.double().norm().clamp(min=1e-30))


def _config_passes(fmt: str, group: int, block: tuple[int, int] | None, cfg: GemmConfig,
                   device: torch.device) -> bool:
    """Run ``cfg`` on a small random two-expert problem that covers its split-K and tile edges (FP8 in ``block``)."""
    generator = torch.Generator().manual_seed(1234)
    block_k = block[1] if fmt == "fp8" else max(cfg.block_k, group)
    n, k = 2 * cfg.block_n, 2 * cfg.split_k * block_k
    if cfg.variant == "mma":  # two chunks per K share
        k = 2 * MMA_CHUNK_K * _mma_k_shares(cfg)
    tensors = random_weight(fmt, n, k, experts=2, group_size=group, block=block, device=device, generator=generator)
    weight = quantized_weight(fmt, tensors, block=block)
    rows = (cfg.block_m + 3, 1)
    offsets = torch.tensor([0, rows[0], rows[0] + rows[1]], dtype=torch.int32, device=device)
    x = random_activations(sum(rows), k, device=device, generator=generator)
    y = _launch(weight, x, offsets, max(rows), cfg)
    return relative_error(reference.grouped_gemm(weight, x, offsets), y) <= GEMM_REL_TOLERANCE


def _fit_split_k(cfg: GemmConfig, weight: QuantizedWeight, max_rows: int) -> GemmConfig:
    """Fit the table's config to this problem: halve its split-K while the grid overfills the GPU.

    Splitting K only pays when there are too few output tiles to fill the GPU (one expert at
    M <= 16); a large matrix or a grouped launch over experts runs unsplit. The halves kernel keeps
    up to ~4 programs per SM (its slices meet through FP32 atomics); the planes kernel, whose
    8-warp programs hold ~2 per SM, up to 2 per SM and at least two K tiles per slice. The planes
    kernel also takes its activations pre-permuted (``planes_xperm``, one small torch copy) for
    more than 4 rows on a matrix of 2^25 weights or more: on the H200 that copy saved more than it
    cost there (8192^2 INT4 M=16 25.1 -> 21.8 us) and cost more than it saved on one expert.
    """
    if weight.device.type != "cuda":
        return cfg
    if cfg.variant == "gemv":
        return _fit_gemv(cfg, weight)
    if cfg.variant == "mma":
        fitted = _fit_mma(cfg, weight)
        if fitted is None:
            return _fit_split_k(configs.next_gemm_config("weight_only", arch_of(weight.device), cfg), weight, max_rows)
        return fitted
    planes = cfg.variant in PLANES_VARIANTS
    if planes and max_rows > 4 and weight.n * weight.k >= 1 << 25:
        cfg = dataclasses.replace(cfg, variant="planes_xperm")
    if cfg.split_k == 1:
        return cfg
    sms = torch.cuda.get_device_properties(weight.device).multi_processor_count
    row_tiles = triton.cdiv(max(max_rows, 1), cfg.block_m) * weight.experts
    if weight.fmt == "fp8" and row_tiles * triton.cdiv(weight.n, 2 * cfg.block_n) >= sms:
        # Tiles twice as wide already fill the GPU unsplit (wq_b, a grouped launch): on the H200 the
        # 16x64 tile ran wq_b at M=1 in 15.8 us, the narrow 16x32 one in 22.6.
        return dataclasses.replace(cfg, block_n=2 * cfg.block_n, split_k=1)
    tiles = row_tiles * triton.cdiv(weight.n, cfg.block_n)
    split = cfg.split_k
    if planes:
        block_k = max(cfg.block_k, weight.group)
        while split > 1 and (tiles * split > 2 * sms or weight.k < 2 * split * block_k):
            split //= 2
    else:
        while split > 1 and tiles * split > 4 * sms:
            split //= 2
    return dataclasses.replace(cfg, split_k=split)


def _fit_gemv(cfg: GemmConfig, weight: QuantizedWeight) -> GemmConfig:
    """Fit the GEMV tile: rows of fewer than two K tiles (wq_b, K=1024) take tiles 4x as tall and 4x as short
    (32 x 256 from 8 x 1024, the same codes per tile). On the H200 (bench/results/gemv-h200-cudacore.md)
    8 x 1024 was 1.6-2.7x faster than 32 x 256 on one expert and on 8192^2, and 32 x 256 1.2x faster
    on wq_b."""
    if weight.k < 2 * cfg.block_k and cfg.block_k >= 1024:
        return dataclasses.replace(cfg, block_n=4 * cfg.block_n, block_k=cfg.block_k // 4)
    return cfg


MMA_MAX_WEIGHTS = 1 << 25  # per launch (all its experts) with 16 tokens per tile; bigger ones run the next entry
MMA_TARGET_WARPS = 4096  # K shares are halved while the launch would have more warps than this


def _fit_mma(cfg: GemmConfig, weight: QuantizedWeight) -> GemmConfig | None:
    """Fit the tensor-core GEMV: K shares and rows per program for this launch's size, or ``None``
    where it does not serve.

    Each warp takes 16 rows; the table entry's K shares (8) of the 128-wide chunks, halved while they do not
    divide the chunks, leave fewer than four per share, or put more than ``MMA_TARGET_WARPS`` warps
    in the launch. Programs are 4 warps (more rows per program) unless there are 8 shares. On the
    H200 this picks what was fastest in bench/results/mma-rows-h200-prototype.json: 16 rows x 8 shares on
    one expert and 8192^2, 32 rows x 2 shares on wq_b (K=1024), 64 rows x 1 share over 64 stacked
    experts. ``None``: K not a multiple of 128, code words off a 16-byte boundary (its PTX loads four
    at once), or, at 16 tokens per tile, ``MMA_MAX_WEIGHTS`` weights or more in the launch (one big
    matrix, a grouped launch: there the planes kernel's tiles re-read the activations less and were
    1.0-1.8x faster).
    """
    if weight.k % MMA_CHUNK_K or weight.codes.data_ptr() % 16:
        return None
    if cfg.block_m > 8 and weight.experts * weight.n * weight.k >= MMA_MAX_WEIGHTS:
        return None
    chunks = weight.k // MMA_CHUNK_K
    row_groups = weight.experts * triton.cdiv(weight.n, MMA_ROWS)
    shares = _mma_k_shares(cfg)
    while shares > 1 and (chunks % shares or chunks // shares < 4 or row_groups * shares > MMA_TARGET_WARPS):
        shares //= 2
    warps = max(4, shares)
    return dataclasses.replace(cfg, block_n=MMA_ROWS * warps // shares, num_warps=warps)


def _mma_k_shares(cfg: GemmConfig) -> int:
    """The tensor-core GEMV's warps are ``block_n / 16`` row groups times this many K shares."""
    return cfg.num_warps // (cfg.block_n // MMA_ROWS)


def checked_config(weight: QuantizedWeight, max_rows: int) -> GemmConfig:
    """The table's config for this batch size, or the safe one if the table's fails its check."""
    device = weight.device
    arch = arch_of(device)
    kind = _gemm_kind(weight)
    for cfg in (_fit_split_k(configs.gemm_config(kind, arch, max_rows), weight, max_rows), configs.SAFE_GEMM[kind]):
        key = (kind, weight.fmt, weight.group, weight.block, cfg, arch, str(device))
        if configs.verified(key, lambda: _config_passes(weight.fmt, weight.group, weight.block, cfg, device)):
            return cfg
    raise DSV4Error(f"no {kind} GEMM config for {weight.fmt} passed its check against the reference on {arch}")


def grouped_gemm(weight: QuantizedWeight, x: torch.Tensor, offsets: torch.Tensor,
                 cfg: GemmConfig | None = None) -> torch.Tensor:
    """BF16 ``[T, N]``: expert e multiplies token rows ``offsets[e]:offsets[e+1]`` of ``x``."""
    max_rows = int(offsets.diff().max()) if offsets.numel() > 1 else 0
    cfg = cfg or checked_config(weight, max_rows)
    return _launch(weight, x.contiguous(), offsets.to(torch.int32).contiguous(), max_rows, cfg)
