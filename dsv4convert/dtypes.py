"""safetensors dtype names, their torch dtypes and their sizes.

The native DeepSeek-V4-Flash checkpoint uses F8_E4M3, F8_E8M0, I8, U8, BF16, F32 and I64;
variants add F4, I32 and F16. ``F4`` is a sub-byte type: its shape counts 4-bit elements,
two per byte, which torch holds as ``float4_e2m1fn_x2`` with the last dim halved.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DType:
    name: str            # safetensors name
    torch: torch.dtype   # dtype of the tensor as read
    bits: int            # bits per element of the safetensors shape


_DTYPES = [
    DType("F64", torch.float64, 64),
    DType("F32", torch.float32, 32),
    DType("F16", torch.float16, 16),
    DType("BF16", torch.bfloat16, 16),
    DType("F8_E4M3", torch.float8_e4m3fn, 8),
    DType("F8_E5M2", torch.float8_e5m2, 8),
    DType("F8_E8M0", torch.float8_e8m0fnu, 8),
    DType("F4", torch.float4_e2m1fn_x2, 4),
    DType("I64", torch.int64, 64),
    DType("I32", torch.int32, 32),
    DType("I16", torch.int16, 16),
    DType("I8", torch.int8, 8),
    DType("U8", torch.uint8, 8),
    DType("BOOL", torch.bool, 8),
]

BY_NAME: dict[str, DType] = {d.name: d for d in _DTYPES}
BY_TORCH: dict[torch.dtype, DType] = {d.torch: d for d in _DTYPES}


def lookup(name: str) -> DType | None:
    return BY_NAME.get(name)


def of_tensor(t: torch.Tensor) -> DType:
    try:
        return BY_TORCH[t.dtype]
    except KeyError:
        raise ValueError(f"torch dtype {t.dtype} has no safetensors name") from None


def nbytes(name: str, shape: tuple[int, ...] | list[int]) -> int:
    """Bytes a tensor of this safetensors dtype and shape occupies on disk."""
    bits = BY_NAME[name].bits * math.prod(shape)
    return (bits + 7) // 8


def torch_shape(name: str, shape: tuple[int, ...] | list[int]) -> tuple[int, ...]:
    """Shape of the torch tensor that holds a safetensors tensor (F4: last dim halved)."""
    shape = tuple(shape)
    if BY_NAME[name].bits == 4:
        if not shape or shape[-1] % 2:
            raise ValueError(f"F4 tensor needs an even last dim, got {list(shape)}")
        return shape[:-1] + (shape[-1] // 2,)
    return shape


def safetensors_shape(t: torch.Tensor) -> tuple[int, ...]:
    """Inverse of :func:`torch_shape`."""
    shape = tuple(t.shape)
    if of_tensor(t).bits == 4:
        return shape[:-1] + (shape[-1] * 2,)
    return shape
