"""Launchers of the quantize/transcode kernels, with the same checks, errors and results as ``formats``.

Imported only when Triton is installed. Each function mirrors one ``dsv4convert.formats``
function (same arguments, same return types, same bytes), so the converters can call either;
the tests compare them bit for bit. The few inputs a kernel does not cover (block or group
sizes that are not powers of two, or an FP8 tile whose float32 scale underflows to zero, where
the CPU path divides by zero) are handed to the formats function itself, on the same device.
"""

from __future__ import annotations

import torch
import triton

from dsv4convert.errors import FormatError
from dsv4convert.formats import fp8_block, int4
from dsv4convert.formats.int4 import Int4Weight
from dsv4convert.formats.numerics import e8m0_max_byte, require_finite
from dsv4convert.formats.nvfp4 import NVFP4Weight
from dsv4convert.formats.transcode import ExactnessReport, global_exponent_of_top_byte
from dsv4convert.formats.transcode import mxfp4_to_fp8_block as cpu_mxfp4_to_fp8_block
from dsv4convert.kernels.operands import quantized_weight
from dsv4convert.kernels.triton_quantize import (
    fp8_block_quant_kernel,
    int4_quant_kernel,
    mxfp4_to_fp8_block_kernel,
    mxfp4_to_nvfp4_kernel,
)

# Global exponents whose 2**m float32 holds as a normal number (formats.transcode's range).
GLOBAL_EXP_RANGE = (-126, 127)
_NVFP4_BLOCKS_PER_PROGRAM = 1024
_INT4_ELEMENTS_PER_PROGRAM = 4096


def _power_of_two(value: int, low: int, high: int) -> bool:
    return low <= value <= high and value & (value - 1) == 0


def _kernel_input(w: torch.Tensor) -> torch.Tensor:
    """The weight as the kernels read it: contiguous, BF16 as its int16 bits (see ``_load_f32``)."""
    w = w.contiguous()
    return w.view(torch.int16) if w.dtype == torch.bfloat16 else w


def _kernel_block(block: fp8_block.Block) -> bool:
    """Whether the FP8 kernels take ``block`` (rows, cols): powers of two from 16 to 128."""
    return all(_power_of_two(side, 16, 128) for side in block)


def _block_warps(block: fp8_block.Block) -> int:
    return 8 if block[0] * block[1] >= 128 * 128 else 4


def quantize_fp8_block(w: torch.Tensor, *, block: fp8_block.Block, scale_fmt: str = "ue8m0",
                       name: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`dsv4convert.formats.quantize_fp8_block` on the GPU: one program per block."""
    if w.ndim != 2 or scale_fmt not in ("ue8m0", "float32") or not _kernel_block(block):
        return fp8_block.quantize_fp8_block(w, block=block, scale_fmt=scale_fmt, name=name)
    n, k = w.shape
    w = w.contiguous()
    grid = fp8_block.scale_grid(n, k, block)
    codes = torch.empty(n, k, dtype=torch.float8_e4m3fn, device=w.device)
    scale = torch.empty(grid, dtype=torch.uint8 if scale_fmt == "ue8m0" else torch.float32, device=w.device)
    amax = torch.empty(grid, dtype=torch.float32, device=w.device)
    fp8_block_quant_kernel[grid](
        _kernel_input(w), codes.view(torch.uint8), scale, amax, n, k, w.stride(0), codes.stride(0), scale.stride(0),
        SCALE_E8M0=scale_fmt == "ue8m0", BF16_BITS=w.dtype == torch.bfloat16, WEIGHT_BLOCK_N=block[0],
        WEIGHT_BLOCK_K=block[1], num_warps=_block_warps(block),
    )
    require_finite(amax, name, "weights")
    if scale_fmt == "float32":
        if bool((scale == 0).any()):  # amax below 448 * 2**-149: reproduce the CPU path's division by zero
            return fp8_block.quantize_fp8_block(w, block=block, scale_fmt=scale_fmt, name=name)
        return codes, scale
    return codes, scale.view(torch.float8_e8m0fnu)


def quantize_int4_weight(w: torch.Tensor, *, group_size: int = 128, scale_rule: int4.ScaleRule = int4.DEFAULT_SCALE_RULE,
                         name: str | None = None) -> Int4Weight:
    """:func:`dsv4convert.formats.quantize_int4_weight` on the GPU: one program per rows x group.

    The ``"mse"`` scale search runs inside the same program, over the group already loaded.
    """
    int4.check_scale_rule(scale_rule, name)
    if w.ndim != 2 or not _power_of_two(group_size, 16, 1024) or w.shape[1] % group_size or not w.is_floating_point():
        return int4.quantize_int4_weight(w, group_size=group_size, scale_rule=scale_rule, name=name)
    n, k = w.shape
    w = w.contiguous()
    packed = torch.empty(n, k // 2, dtype=torch.uint8, device=w.device)
    scale = torch.empty(n, k // group_size, dtype=torch.bfloat16, device=w.device)
    divisors = int4.MSE_DIVISORS if scale_rule == "mse" else (int4.INT4_SCALE_DIVISOR,)
    divisors = torch.tensor(divisors, dtype=torch.float32, device=w.device)
    block_rows = max(1, _INT4_ELEMENTS_PER_PROGRAM // group_size)
    grid = (triton.cdiv(n, block_rows), k // group_size)
    # compressed-tensors divides the weight by the stored BF16 scale in torch's promoted dtype.
    bf16_quotient = torch.promote_types(w.dtype, torch.bfloat16) == torch.bfloat16
    int4_quant_kernel[grid](
        _kernel_input(w), packed, scale.view(torch.int16), divisors, n, w.stride(0), packed.stride(0),
        scale.stride(0), torch.finfo(w.dtype).eps, NUM_DIVISORS=divisors.numel(),
        NORM_EXPONENT=int4.mse_norm_exponent(group_size), BF16_QUOTIENT=bf16_quotient,
        BF16_BITS=w.dtype == torch.bfloat16, GROUP=group_size, BLOCK_ROWS=block_rows,
        num_warps=4,
    )
    require_finite(scale, name, "weights")
    if not bool((scale > 0).all()):
        raise FormatError("INT4 scales must be positive and finite", tensor=name)
    return Int4Weight(weight_packed=packed.view(torch.int32), weight_scale=scale,
                      weight_shape=torch.tensor([n, k], dtype=torch.int64))


def _mxfp4_operands(packed: torch.Tensor, scale: torch.Tensor,
                    name: str | None) -> tuple[int, int, torch.Tensor, int]:
    """(N, K, raw scale bytes, largest scale byte) after the CPU path's layout and NaN-byte checks.

    The largest byte is read once (one ``amax``, one synchronization): it is both the NaN check
    (0xFF is the largest byte) and all :func:`nvfp4_global_exponent` needs.
    """
    if packed.ndim != 2:
        raise FormatError(f"MXFP4 codes must be int8/uint8 [N, K/2], got {packed.dtype} {list(packed.shape)}",
                          tensor=name)
    weight = quantized_weight("mxfp4", (packed, scale), name=name)
    top_byte = e8m0_max_byte(scale, name=name)
    return weight.n, weight.k, scale.view(torch.uint8).contiguous(), top_byte


def _tally_views(buffer: torch.Tensor, programs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A transcode kernel's per-program tallies in one buffer: two int32 counts and one float64 error.

    The kernels write every program's slots, so a fresh buffer needs no zero fill, and one copy
    reads all three back (``_tally_views(buffer.cpu(), programs)``).
    """
    counts = buffer[:8 * programs].view(torch.int32)
    return counts[:programs], counts[programs:], buffer[8 * programs:].view(torch.float64)


def _tally_buffer(programs: int, device: torch.device) -> torch.Tensor:
    return torch.empty(programs * 16, dtype=torch.uint8, device=device)


def mxfp4_to_nvfp4(packed: torch.Tensor, scale: torch.Tensor, *, global_exponent: int | None = None,
                   name: str | None = None) -> tuple[NVFP4Weight, ExactnessReport]:
    """:func:`dsv4convert.formats.mxfp4_to_nvfp4` on the GPU: scales rewritten, codes shared.

    Two synchronizations per matrix: the scale's largest byte, and the tallies' one read back.
    """
    n, k, scale_bytes, top_byte = _mxfp4_operands(packed, scale, name)
    m = global_exponent_of_top_byte(top_byte) if global_exponent is None else int(global_exponent)
    if not GLOBAL_EXP_RANGE[0] <= m <= GLOBAL_EXP_RANGE[1]:
        raise FormatError(f"global exponent {m} is outside float32's normal range "
                          f"[{GLOBAL_EXP_RANGE[0]}, {GLOBAL_EXP_RANGE[1]}]", tensor=name)
    device = packed.device
    blocks_total = n * (k // 32)
    weight_scale = torch.empty(n, k // 16, dtype=torch.float8_e4m3fn, device=device)
    programs = max(1, triton.cdiv(blocks_total, _NVFP4_BLOCKS_PER_PROGRAM))
    buffer = _tally_buffer(programs, device)
    inexact_blocks, changed, error = _tally_views(buffer, programs)
    mxfp4_to_nvfp4_kernel[(programs,)](
        packed.view(torch.uint8).contiguous(), scale_bytes, weight_scale.view(torch.int16), inexact_blocks,
        changed, error, blocks_total, m, BLOCK=_NVFP4_BLOCKS_PER_PROGRAM, num_warps=4,
    )
    # 2**m for m in float32's normal range: exact from the host's double
    global_scale = torch.full((), 2.0 ** m, dtype=torch.float32, device=device)
    result = NVFP4Weight(packed.view(torch.uint8), weight_scale, global_scale)
    inexact_blocks, changed, error = _tally_views(buffer.cpu(), programs)
    blocks_changed = int(inexact_blocks.sum())
    elements_changed = int(changed.sum())
    return result, ExactnessReport(blocks_total=blocks_total, blocks_exact=blocks_total - blocks_changed,
                                   elements_total=n * k, elements_exact=n * k - elements_changed,
                                   max_abs_error=float(error.max()))


def mxfp4_to_fp8_block(packed: torch.Tensor, scale: torch.Tensor, *, block: fp8_block.Block,
                       name: str | None = None) -> tuple[torch.Tensor, torch.Tensor, ExactnessReport]:
    """:func:`dsv4convert.formats.mxfp4_to_fp8_block` on the GPU: one program per FP8 block.

    Two synchronizations per matrix, as :func:`mxfp4_to_nvfp4`.
    """
    n, k, scale_bytes, _ = _mxfp4_operands(packed, scale, name)
    rows, cols = block
    if n % rows or k % cols or cols % 32:
        raise FormatError(f"MXFP4 -> FP8 {rows}x{cols} blocks need N a multiple of {rows} and K of {cols} "
                          f"({cols} a multiple of 32), got [{n}, {k}]", tensor=name)
    if not _kernel_block(block):
        return cpu_mxfp4_to_fp8_block(packed, scale, block=block, name=name)
    device = packed.device
    codes = packed.view(torch.uint8).contiguous()
    grid = (n // rows, k // cols)
    tiles = grid[0] * grid[1]
    weight = torch.empty(n, k, dtype=torch.float8_e4m3fn, device=device)
    tile_scale = torch.empty(grid, dtype=torch.uint8, device=device)
    buffer = _tally_buffer(tiles, device)
    changed, _, error = _tally_views(buffer, tiles)
    pairs = weight.view(torch.int16)
    mxfp4_to_fp8_block_kernel[grid](
        codes, scale_bytes, pairs, tile_scale, changed, error, codes.stride(0), scale_bytes.stride(0),
        pairs.stride(0), tile_scale.stride(0), WEIGHT_BLOCK_N=rows, WEIGHT_BLOCK_K=cols, num_warps=_block_warps(block),
    )
    changed, _, error = _tally_views(buffer.cpu(), tiles)
    tiles_changed = int((changed > 0).sum())
    report = ExactnessReport(blocks_total=tiles, blocks_exact=tiles - tiles_changed, elements_total=n * k,
                             elements_exact=n * k - int(changed.sum()), max_abs_error=float(error.max()))
    return weight, tile_scale.view(torch.float8_e8m0fnu), report
