"""Quantized weight operands: one checked description shared by the kernels and the references.

A caller hands each format's tensors exactly as they sit in a checkpoint (formats.md §0):

* ``fp8``: ``(weight float8_e4m3fn [N, K], scale [ceil(N/rows), ceil(K/cols)])`` with the ``block`` (rows, cols)
  the caller names (the release's: 128x128 for DeepSeek-V4), the scale float8_e8m0fnu (DeepSeek-V4
  ``.scale``), its raw uint8 bytes, or float32 (``weight_scale_inv``);
* ``mxfp4``: ``(codes int8/uint8 [N, K/2], scale float8_e8m0fnu/uint8 [N, K/32])``;
* ``nvfp4``: ``(weight uint8 [N, K/2], weight_scale float8_e4m3fn [N, K/16], weight_scale_2 float32 [])``;
* ``int4`` (compressed-tensors pack-quantized): ``(weight_packed int32 [N, K/8], weight_scale [N, K/g])``
  with an optional ``weight_shape`` int64 ``[2]``; the group size g follows from the shapes.

A stack of experts adds a leading ``E`` to every tensor (``weight_scale_2`` becomes ``[E]``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv4convert.errors import FormatError
from dsv4convert.formats import NVFP4_BLOCK, REGISTRY
from dsv4convert.formats.fp8_block import Block, scale_grid
from dsv4convert.formats.mxfp4 import MXFP4_BLOCK

# The formats the kernels take (the registry's names: every spec with kernel operands).
FORMATS = tuple(fmt.value for fmt, spec in REGISTRY.items() if spec.kernel_params)
_GROUP = {"mxfp4": MXFP4_BLOCK, "nvfp4": NVFP4_BLOCK}


@dataclass(frozen=True)
class QuantizedWeight:
    """A [E, N, K] stack of quantized matrices (E = 1 for a single matrix)."""

    fmt: str
    codes: torch.Tensor            # uint8 [E, N, K/2] (4-bit formats) or float8_e4m3fn [E, N, K]
    scale: torch.Tensor            # [E, N, K/group]; FP8: [E, ceil(N/rows), ceil(K/cols)]
    global_scale: torch.Tensor | None  # NVFP4 weight_scale_2 as float32 [E]
    source: tuple[torch.Tensor, ...]   # the caller's tensors, each with a leading E
    n: int
    k: int
    group: int                     # FP8: the block's columns (the activations' group)
    stacked: bool
    block: Block | None = None     # FP8's (rows, cols)

    @property
    def experts(self) -> int:
        return self.codes.shape[0]

    @property
    def device(self) -> torch.device:
        return self.codes.device

    @property
    def scale_is_e8m0(self) -> bool:
        return self.scale.dtype == torch.uint8 and self.fmt in ("fp8", "mxfp4")

    def expert_tensors(self, expert: int) -> tuple[torch.Tensor, ...]:
        """The caller's tensors of one expert, as the ``dsv4convert.formats`` functions take them."""
        return tuple(t[expert] for t in self.source)


def _fail(message: str, name: str | None) -> FormatError:
    return FormatError(message, tensor=name)


def quantized_weight(fmt: str, tensors: tuple[torch.Tensor, ...], *, block: Block | None = None,
                     name: str | None = None) -> QuantizedWeight:
    """Check ``tensors`` against ``fmt``'s layout and describe them; raises FormatError on a mismatch.

    ``block``: the (rows, cols) an ``fp8`` weight was written in (required for it, refused for the others)."""
    if fmt not in FORMATS:
        raise _fail(f"unknown weight format {fmt!r} (expected one of {', '.join(FORMATS)})", name)
    if fmt == "fp8" and block is None:
        raise _fail("an fp8 weight needs the block (rows, cols) it was written in", name)
    if fmt != "fp8" and block is not None:
        raise _fail(f"a block applies to fp8 weights, not {fmt}", name)
    expected = {"fp8": (2,), "mxfp4": (2,), "nvfp4": (3,), "int4": (2, 3)}[fmt]
    if len(tensors) not in expected:
        raise _fail(f"{fmt} takes {' or '.join(map(str, expected))} tensors, got {len(tensors)}", name)
    codes = tensors[0]
    if codes.ndim not in (2, 3):
        raise _fail(f"{fmt} weight must be [N, K'] or a stack [E, N, K'], got shape {list(codes.shape)}", name)
    stacked = codes.ndim == 3
    global_scale = None
    source = tensors
    if fmt == "nvfp4":
        global_scale = tensors[2].reshape(-1).float()
        if global_scale.numel() != (codes.shape[0] if stacked else 1):
            raise _fail(f"nvfp4 weight_scale_2 must hold one value per matrix, got shape {list(tensors[2].shape)}",
                        name)
        source = tensors[:2] + (tensors[2].reshape(-1) if stacked else tensors[2].reshape(()),)
    source = tuple(t if stacked else t.unsqueeze(0) for t in source)
    codes, scale = source[0], source[1]
    experts, n = codes.shape[0], codes.shape[1]
    if any(t.device != codes.device for t in tensors):
        raise _fail(f"{fmt} tensors are on different devices", name)

    if fmt == "fp8":
        if codes.dtype != torch.float8_e4m3fn:
            raise _fail(f"fp8 weight must be float8_e4m3fn, got {codes.dtype}", name)
        k = codes.shape[2]
        grid = (experts, *scale_grid(n, k, block))
        if tuple(scale.shape) != grid:
            raise _fail(f"fp8 scale shape {list(scale.shape)} does not match weight {list(codes.shape)} "
                        f"in {block[0]}x{block[1]} blocks (expected {list(grid[1:] if not stacked else grid)})", name)
        if scale.dtype in (torch.float8_e8m0fnu, torch.uint8):
            scale = scale.view(torch.uint8)
        elif scale.dtype != torch.float32:
            raise _fail(f"fp8 scale must be float8_e8m0fnu, uint8 or float32, got {scale.dtype}", name)
        group = block[1]
    else:
        if fmt == "int4":
            if codes.dtype != torch.int32:
                raise _fail(f"int4 weight_packed must be int32 [N, K/8], got {codes.dtype}", name)
            k = codes.shape[2] * 8
            codes = codes.contiguous().view(torch.uint8)
            if scale.ndim != 3 or scale.shape[:2] != (experts, n) or scale.shape[2] == 0 or k % scale.shape[2]:
                raise _fail(f"int4 weight_scale shape {list(scale.shape)} does not match weight_packed "
                            f"{list(source[0].shape)}", name)
            group = k // scale.shape[2]
            if group % 8 or group < 8:
                raise _fail(f"int4 group size {group} must be a multiple of 8", name)
            if scale.dtype not in (torch.bfloat16, torch.float16, torch.float32):
                raise _fail(f"int4 weight_scale must be a float dtype, got {scale.dtype}", name)
            if len(source) == 3:
                shapes = source[2].reshape(experts, 2).tolist()
                if any(tuple(s) != (n, k) for s in shapes):
                    raise _fail(f"int4 weight_shape {shapes[0]} does not match the packed [{n}, {k}] "
                                "(padded K is not supported by the kernels)", name)
        else:
            if codes.dtype not in (torch.int8, torch.uint8):
                raise _fail(f"{fmt} codes must be int8/uint8 [N, K/2], got {codes.dtype}", name)
            codes = codes.view(torch.uint8)
            k = codes.shape[2] * 2
            group = _GROUP[fmt]
            if k % group or tuple(scale.shape) != (experts, n, k // group):
                raise _fail(f"{fmt} scale shape {list(scale.shape)} does not match codes {list(codes.shape)} "
                            f"(expected [{n}, {k // group}] per matrix)", name)
            if fmt == "mxfp4":
                if scale.dtype not in (torch.float8_e8m0fnu, torch.uint8):
                    raise _fail(f"mxfp4 scale must be float8_e8m0fnu or uint8, got {scale.dtype}", name)
                scale = scale.view(torch.uint8)
            else:
                if scale.dtype != torch.float8_e4m3fn:
                    raise _fail(f"nvfp4 weight_scale must be float8_e4m3fn, got {scale.dtype}", name)
    return QuantizedWeight(fmt=fmt, codes=codes.contiguous(), scale=scale.contiguous(),
                           global_scale=global_scale, source=source, n=n, k=k, group=group, stacked=stacked,
                           block=block)
