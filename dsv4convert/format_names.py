"""The weight formats' names and the INT4 scale rules': what recipes, configs, reports and the command line say.

They live apart from ``formats/`` (numerics on torch) so that the variants and the command line can name them
without loading torch: ``formats.Format`` and ``formats.int4.SCALE_RULES`` are these very objects.
"""

from __future__ import annotations

from enum import Enum
from typing import Literal, get_args


class Format(str, Enum):
    """A weight format's one name (its value is what recipes, configs, reports and kernels say)."""

    BF16 = "bf16"    # dense BF16 (F16/F32 read as well)
    FP8 = "fp8"      # e4m3, 128x128 blocks, E8M0 (or F32) `.scale`
    MXFP4 = "mxfp4"  # the native experts: I8 packed E2M1 + E8M0 per 32
    NVFP4 = "nvfp4"  # ModelOpt: U8 packed E2M1 + E4M3 per 16 + F32 global + F32 input scale
    INT4 = "int4"    # compressed-tensors pack-quantized W4A16


# How an INT4 group's scale is chosen (formats/int4.py says what each rule computes).
ScaleRule = Literal["mse", "amax"]
SCALE_RULES: tuple[str, ...] = get_args(ScaleRule)
DEFAULT_SCALE_RULE: ScaleRule = "mse"
