"""How each weight format stores one linear module on disk.

A linear ``W[N, K]`` becomes a small set of tensors whose suffixes, dtypes and shapes
depend only on the format: this table is shared by the converters (to plan output
shards before any data exists) and by ``inspect``/``validate`` (to recognise what a
checkpoint holds). Names follow what SGLang 0.5.23 loads for DeepSeek-V4: the native
``.scale`` for FP8 and MXFP4, ModelOpt's names for NVFP4, compressed-tensors' names for
INT4.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

from dsv4convert.layout import FP8_BLOCK, MXFP4_GROUP

NVFP4_GROUP = 16


class Format(str, Enum):
    BF16 = "bf16"
    FP8 = "fp8"      # e4m3, 128x128 blocks, E8M0 (or F32) `.scale`
    MXFP4 = "mxfp4"  # the native experts: I8 packed E2M1 + E8M0 per 32
    NVFP4 = "nvfp4"  # ModelOpt: U8 packed E2M1 + E4M3 per 16 + F32 global + F32 input scale
    INT4 = "int4"    # compressed-tensors pack-quantized W4A16


@dataclass(frozen=True)
class StoredParam:
    suffix: str
    dtype: str
    shape: tuple[int, ...]


def linear_storage(fmt: Format, n: int, k: int, *, group_size: int = 128, fp8_scale_dtype: str = "F8_E8M0",
                   dense_dtype: str = "BF16") -> list[StoredParam]:
    """The tensors (suffix after the module name, dtype, shape) a linear W[n, k] needs in ``fmt``."""
    if fmt is Format.BF16:
        return [StoredParam("weight", dense_dtype, (n, k))]
    if fmt is Format.FP8:
        return [StoredParam("weight", "F8_E4M3", (n, k)),
                StoredParam("scale", fp8_scale_dtype, (math.ceil(n / FP8_BLOCK), math.ceil(k / FP8_BLOCK)))]
    if fmt is Format.MXFP4:
        return [StoredParam("weight", "I8", (n, k // 2)), StoredParam("scale", "F8_E8M0", (n, k // MXFP4_GROUP))]
    if fmt is Format.NVFP4:
        return [StoredParam("weight", "U8", (n, k // 2)),
                StoredParam("weight_scale", "F8_E4M3", (n, k // NVFP4_GROUP)),
                StoredParam("weight_scale_2", "F32", ()),
                StoredParam("input_scale", "F32", ())]
    if fmt is Format.INT4:
        return [StoredParam("weight_packed", "I32", (n, math.ceil(k / 8))),
                StoredParam("weight_scale", "BF16", (n, math.ceil(k / group_size))),
                StoredParam("weight_shape", "I64", (2,))]
    raise ValueError(f"unknown format {fmt}")


def detect_linear_format(params: dict[str, tuple[str, tuple[int, ...]]], n: int, k: int) -> tuple[Format, dict] | None:
    """Which format a module's stored tensors are in, given the module's logical shape.

    ``params`` maps suffix -> (dtype, shape). Returns (format, parameters) when the set
    matches one format exactly (e.g. ``{"group_size": 32}`` for INT4), else None.
    """
    keys = set(params)
    candidates: list[tuple[Format, dict]] = [(Format.NVFP4, {}), (Format.MXFP4, {})]
    if "weight_packed" in keys:
        scale = params.get("weight_scale")
        if scale and len(scale[1]) == 2 and scale[1][1]:
            candidates = [(Format.INT4, {"group_size": _group_from_cols(k, scale[1][1])})]
    elif "scale" in keys and params["scale"][0] in ("F8_E8M0", "F32"):
        candidates = [(Format.FP8, {"fp8_scale_dtype": params["scale"][0]}), (Format.MXFP4, {})]
    elif keys == {"weight"} and params["weight"][0] in ("BF16", "F16", "F32"):
        candidates = [(Format.BF16, {"dense_dtype": params["weight"][0]})]
    for fmt, extra in candidates:
        expected = {p.suffix: (p.dtype, p.shape) for p in linear_storage(fmt, n, k, **extra)}
        if expected == params:
            return fmt, {key: v for key, v in extra.items() if key == "group_size"}
    return None


def _group_from_cols(k: int, cols: int) -> int:
    for g in (32, 64, 128, 256):
        if math.ceil(k / g) == cols:
            return g
    return max(1, k // cols)
