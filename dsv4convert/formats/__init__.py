"""Pure numerics of every weight format dsv4convert reads or writes, and their registry (no file I/O).

Each format's numerics live in their own module (vectorized torch code that runs on any device), and
each format is one registered spec (:mod:`.registry`, :mod:`.specs`): how it is stored and recognised,
decoded, made from each source format, its bytes, its kernel operands and the calibration it takes.
The algorithms that choose weights (the INT4 scale search in :mod:`.int4`, GPTQ in :mod:`.gptq`) live
beside the numerics. Definitions and sources: the project reference ``formats.md``.
"""

from dsv4convert.formats import specs as _specs  # noqa: F401 - registers the five formats
from dsv4convert.formats.fp8_block import (
    dequantize_fp8_block,
    e8m0_scale_to_float32,
    float32_scale_to_e8m0,
    fp8_block_of,
    quantize_fp8_block,
    scale_grid,
)
from dsv4convert.formats.int4 import (
    Int4Weight,
    dequantize_int4,
    int4_group_scales,
    pack_int4,
    quantize_int4,
    quantize_int4_weight,
    round_to_int4,
    unpack_int4,
)
from dsv4convert.formats.metrics import ErrorMetrics, error_metrics, lossless_block_fraction
from dsv4convert.formats.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from dsv4convert.formats.numerics import (
    E2M1_MAX,
    E2M1_VALUES,
    E4M3_MAX,
    E4M3_MAX_EXP,
    E4M3_MIN_EXP,
    decode_e2m1,
    e8m0_to_exponent,
    e8m0_to_float,
    encode_e2m1,
    exponent_to_e8m0,
    pack_nibbles,
    unpack_nibbles,
)
from dsv4convert.formats.nvfp4 import NVFP4_BLOCK, NVFP4Weight, dequantize_nvfp4, input_scale_from_amax, quantize_nvfp4
from dsv4convert.formats.registry import (
    REGISTRY,
    Calibration,
    Encoded,
    EncodeInput,
    Format,
    FormatSpec,
    Passthrough,
    StoredParam,
    calibrated_by,
    detect_format,
    linear_storage,
    recipe_targets,
    spec,
    stored_bytes,
    stored_params,
)
from dsv4convert.formats.transcode import (
    ExactnessReport,
    NVFP4Rescale,
    mxfp4_to_fp8_block,
    mxfp4_to_nvfp4,
    mxfp4_to_nvfp4_scales,
    nvfp4_global_exponent,
    nvfp4_rescale_report,
)

__all__ = [
    "NVFP4_BLOCK", "REGISTRY", "Calibration", "Encoded", "EncodeInput", "Format", "FormatSpec", "Passthrough",
    "StoredParam", "calibrated_by", "detect_format", "linear_storage", "recipe_targets", "spec", "stored_bytes", "stored_params",
    "E2M1_MAX", "E2M1_VALUES", "E4M3_MAX", "E4M3_MAX_EXP", "E4M3_MIN_EXP",
    "ErrorMetrics", "ExactnessReport", "Int4Weight", "NVFP4Rescale", "NVFP4Weight",
    "decode_e2m1", "dequantize_fp8_block", "dequantize_int4", "dequantize_mxfp4", "dequantize_nvfp4",
    "e8m0_scale_to_float32", "e8m0_to_exponent", "e8m0_to_float", "encode_e2m1", "error_metrics",
    "exponent_to_e8m0", "float32_scale_to_e8m0", "fp8_block_of", "input_scale_from_amax", "int4_group_scales",
    "lossless_block_fraction", "mxfp4_to_fp8_block", "mxfp4_to_nvfp4", "mxfp4_to_nvfp4_scales",
    "nvfp4_global_exponent", "nvfp4_rescale_report",
    "pack_int4", "pack_nibbles", "quantize_fp8_block", "quantize_int4", "quantize_int4_weight",
    "quantize_mxfp4", "quantize_nvfp4", "round_to_int4", "scale_grid", "unpack_int4", "unpack_nibbles",
]
