"""The five weight formats, one registered :class:`~dsv4convert.formats.registry.FormatSpec` each.

Storage follows what SGLang 0.5.23 and vLLM 0.33.0 load for DeepSeek-V4: the native ``.scale`` for FP8
and MXFP4, ModelOpt's names for NVFP4, compressed-tensors' names for INT4. Encoding chooses the numerics
for each (source, target) pair, and is the only place that does: lossless paths (MXFP4 -> FP8, MXFP4 ->
NVFP4, FP8/MXFP4 -> BF16) never go through float rounding; requantizations (-> INT4, BF16/FP8 -> NVFP4
or FP8) decode to float32 first.
"""

from __future__ import annotations

import math

import torch

from dsv4convert.errors import FormatError
from dsv4convert.formats.fp8_block import (
    dequantize_fp8_block,
    e8m0_scale_to_float32,
    float32_scale_to_e8m0,
    fp8_block_of,
    quantize_fp8_block,
    scale_grid,
)
from dsv4convert.formats.gptq import gptq_quantize_int4
from dsv4convert.formats.int4 import DEFAULT_SCALE_RULE, SCALE_RULES, dequantize_int4, quantize_int4_weight
from dsv4convert.formats.mxfp4 import MXFP4_BLOCK, dequantize_mxfp4, mxfp4_shape
from dsv4convert.formats.nvfp4 import NVFP4_BLOCK, dequantize_nvfp4, quantize_nvfp4
from dsv4convert.formats.registry import (
    Calibration,
    Encoded,
    EncodeInput,
    Format,
    FormatSpec,
    Passthrough,
    StoredParam,
    register,
    spec,
)
from dsv4convert.formats.transcode import (
    mxfp4_to_fp8_block,
    mxfp4_to_nvfp4_scales,
    nvfp4_global_exponent,
    nvfp4_rescale_report,
)

DENSE_DTYPES = ("BF16", "F16", "F32")
INT4_GROUP_SIZES = (32, 64, 128, 256)


def decoded(inputs: EncodeInput) -> torch.Tensor:
    """The source weight as float32 (what every requantization starts from)."""
    return spec(inputs.source).decode(inputs.tensors, f"{inputs.name}.weight", inputs.source_params)


@register
class BF16(FormatSpec):
    format = Format.BF16
    weight_params = ("weight",)
    bits_per_weight = 16

    def storage(self, n, k, *, dense_dtype="BF16", **_):
        return [StoredParam("weight", dense_dtype, (n, k))]

    def storage_keywords(self, stored, n, k, **_):
        weight = stored.get("weight")
        return {"dense_dtype": weight[0]} if set(stored) == {"weight"} and weight[0] in DENSE_DTYPES else None

    def decode(self, tensors, name, params):
        return tensors["weight"].float()

    def encode(self, inputs):
        return Encoded([("weight", decoded(inputs).to(torch.bfloat16))])


@register
class FP8(FormatSpec):
    format = Format.FP8
    weight_params = ("weight", "scale")
    kernel_params = ("weight", "scale")
    bits_per_weight = 8
    # Without scale_dtype the block scales are left to the engines (recipe.Recipe.target_for). The block is not a
    # recipe's: the caller puts the release's in the target's params as ``fp8_block`` (rows, cols).
    recipe_params = {"scale_dtype": {"enum": ["e8m0", "float32"]}}

    def storage(self, n, k, *, fp8_block, fp8_scale_dtype="F8_E8M0", **_):
        return [StoredParam("weight", "F8_E4M3", (n, k)),
                StoredParam("scale", fp8_scale_dtype, scale_grid(n, k, fp8_block))]

    def storage_keywords(self, stored, n, k, *, fp8_block=None, name=None):
        weight, scale = stored.get("weight"), stored.get("scale")
        if not (weight and scale and weight[0] == "F8_E4M3" and scale[0] in ("F8_E8M0", "F32") and len(scale[1]) == 2):
            return None
        block = fp8_block_of((n, k), scale[1], known=fp8_block, name=f"{name}.scale" if name else None)
        return {"fp8_scale_dtype": scale[0], "fp8_block": block} if block else None

    def params(self, keywords):
        return {"fp8_scale_dtype": keywords["fp8_scale_dtype"], "fp8_block": keywords["fp8_block"]}

    def decode(self, tensors, name, params):
        return dequantize_fp8_block(tensors["weight"], tensors["scale"], block=params["fp8_block"], name=name)

    def applicable(self, n, k, source, params):
        rows, cols = params["fp8_block"]
        if source is Format.MXFP4 and (n % rows or k % cols):
            return f"the lossless MXFP4->FP8 cast needs multiples of its {rows}x{cols} blocks"
        return None

    def unchanged(self, source, source_dtypes, source_params, params):
        wanted = "F32" if params.get("scale_dtype") == "float32" else "F8_E8M0"
        return (source is Format.FP8 and source_dtypes.get("scale") == wanted
                and source_params.get("fp8_block") == params["fp8_block"])

    def encode(self, inputs):
        src, m, block = inputs.tensors, inputs.name, inputs.params["fp8_block"]
        want_f32 = inputs.params.get("scale_dtype") == "float32"
        report = None
        if inputs.source is Format.FP8 and inputs.source_params.get("fp8_block") == block:
            # only the scale form changes: exact both ways
            weight, scale = src["weight"], src["scale"]
            scale = e8m0_scale_to_float32(scale) if want_f32 else float32_scale_to_e8m0(scale, name=f"{m}.scale")
        elif inputs.source is Format.MXFP4:
            weight, scale, report = mxfp4_to_fp8_block(src["weight"], src["scale"], block=block, name=f"{m}.weight")
            scale = e8m0_scale_to_float32(scale) if want_f32 else scale
        else:
            weight, scale = quantize_fp8_block(decoded(inputs), block=block,
                                               scale_fmt="float32" if want_f32 else "ue8m0", name=f"{m}.weight")
        return Encoded([("weight", weight), ("scale", scale)], report)


@register
class MXFP4(FormatSpec):
    format = Format.MXFP4
    weight_params = ("weight", "scale")
    kernel_params = ("weight", "scale")
    bits_per_weight = 4
    recipe_target = False

    def storage(self, n, k, **_):
        return [StoredParam("weight", "I8", (n, k // 2)), StoredParam("scale", "F8_E8M0", (n, k // MXFP4_BLOCK))]

    def decode(self, tensors, name, params):
        return dequantize_mxfp4(tensors["weight"], tensors["scale"], name=name)


@register
class NVFP4(FormatSpec):
    format = Format.NVFP4
    weight_params = ("weight", "weight_scale", "weight_scale_2", "input_scale")
    kernel_params = ("weight", "weight_scale", "weight_scale_2")
    bits_per_weight = 4
    calibration = Calibration.ACTIVATION_AMAX
    fused_partner = True

    def storage(self, n, k, **_):
        return [StoredParam("weight", "U8", (n, k // 2)),
                StoredParam("weight_scale", "F8_E4M3", (n, k // NVFP4_BLOCK)),
                StoredParam("weight_scale_2", "F32", ()),
                StoredParam("input_scale", "F32", ())]

    def applicable(self, n, k, source, params):
        return f"nvfp4 needs K divisible by {NVFP4_BLOCK}" if k % NVFP4_BLOCK else None

    def decode(self, tensors, name, params):
        return dequantize_nvfp4(tensors["weight"], tensors["weight_scale"], tensors["weight_scale_2"], name=name)

    def passthrough(self, source):
        # MXFP4 -> NVFP4 keeps the E2M1 codes (the experts' bulk) and rewrites only the scales.
        return frozenset({"weight"}) if source is Format.MXFP4 else frozenset()

    def partner_params(self, source):
        # The shared global scale of an MXFP4 pair depends on the E8M0 exponents alone, so the partner's
        # codes are never read twice.
        return frozenset({"scale"}) if source is Format.MXFP4 else frozenset(spec(source).weight_params)

    def encode(self, inputs):
        src, m, partner = inputs.tensors, inputs.name, inputs.partner
        weight_name = f"{m}.weight"
        if inputs.input_scale is None:
            raise FormatError("no input_scale source for an NVFP4 module", tensor=weight_name)
        report = None
        if inputs.source is Format.MXFP4:   # the codes stay, copied unread; only the scales are rewritten
            scales = [src["scale"]] + ([partner["scale"]] if partner else [])
            exponent = nvfp4_global_exponent(*scales, name=weight_name)
            codes_shape = inputs.passthrough_shape
            mxfp4_shape(torch.empty(codes_shape, dtype=torch.int8, device="meta"), src["scale"], weight_name)
            rescale = mxfp4_to_nvfp4_scales(src["scale"], global_exponent=exponent, name=weight_name)
            rows, cols = (t.tolist() for t in rescale.outside)  # blocks whose codes decide the error: few
            outside = inputs.read_codes([r * codes_shape[-1] + c * MXFP4_BLOCK // 2 for r, c in zip(rows, cols)],
                                        MXFP4_BLOCK // 2)
            report = nvfp4_rescale_report(rescale, src["scale"], outside.to(src["scale"].device))
            weight, weight_scale, weight_scale_2 = Passthrough("weight", "U8"), rescale.weight_scale, \
                rescale.weight_scale_2
        else:
            w = decoded(inputs)
            amax = w.abs().amax()
            if partner:
                amax = torch.maximum(amax, spec(inputs.source).decode(partner, weight_name,
                                                                      inputs.source_params).abs().amax())
            q = quantize_nvfp4(w, global_amax=amax, name=weight_name)
            weight, weight_scale, weight_scale_2 = q.weight, q.weight_scale, q.weight_scale_2
        return Encoded([("weight", weight), ("weight_scale", weight_scale),
                        ("weight_scale_2", weight_scale_2.reshape(())),
                        ("input_scale", inputs.input_scale.to(torch.float32).reshape(()))], report)


@register
class INT4(FormatSpec):
    format = Format.INT4
    weight_params = ("weight_packed", "weight_scale", "weight_shape")
    kernel_params = ("weight_packed", "weight_scale")
    bits_per_weight = 4
    calibration = Calibration.HESSIAN
    recipe_params = {"group_size": {"enum": [32, 128]}, "scale_rule": {"enum": list(SCALE_RULES)}}
    recipe_defaults = {"group_size": 128, "scale_rule": DEFAULT_SCALE_RULE}

    def storage(self, n, k, *, group_size=128, **_):
        return [StoredParam("weight_packed", "I32", (n, math.ceil(k / 8))),
                StoredParam("weight_scale", "BF16", (n, math.ceil(k / group_size))),
                StoredParam("weight_shape", "I64", (2,))]

    def storage_keywords(self, stored, n, k, **_):
        scale = stored.get("weight_scale")
        if "weight_packed" not in stored or not scale or len(scale[1]) != 2 or not scale[1][1]:
            return None
        cols = scale[1][1]
        return {"group_size": next((g for g in INT4_GROUP_SIZES if math.ceil(k / g) == cols), max(1, k // cols))}

    def params(self, keywords):
        return {"group_size": keywords["group_size"]}

    def applicable(self, n, k, source, params):
        group = params["group_size"]
        return f"int4 group {group} does not divide K" if k % group else None

    def unchanged(self, source, source_dtypes, source_params, params):
        # A kept INT4 module keeps its group; another group size is a requantization.
        return source is Format.INT4 and source_params.get("group_size") == params["group_size"]

    def decode(self, tensors, name, params):
        shape = tuple(int(d) for d in tensors["weight_shape"].tolist())
        group = shape[1] // tensors["weight_scale"].shape[1]
        return dequantize_int4(tensors["weight_packed"], tensors["weight_scale"], shape, group_size=group, name=name)

    def encode(self, inputs):
        w = decoded(inputs)
        group, rule, name = inputs.params["group_size"], inputs.params["scale_rule"], f"{inputs.name}.weight"
        if inputs.hessian is not None:
            q = gptq_quantize_int4(w, inputs.hessian, group_size=group, scale_rule=rule, name=name)
        else:   # round-to-nearest (also for experts that saw no calibration tokens)
            q = quantize_int4_weight(w, group_size=group, scale_rule=rule, name=name)
        return Encoded([("weight_packed", q.weight_packed), ("weight_scale", q.weight_scale),
                        ("weight_shape", q.weight_shape)])
