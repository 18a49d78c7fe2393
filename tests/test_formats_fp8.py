"""FP8 block quantization (128x128 for V4, 32x32 for V4.1): scale rules, compressed-tensors' codes, edge cases,
and the block read off stored shapes."""

from __future__ import annotations

import math

import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.lifecycle.forward import quantize
from compressed_tensors.quantization.utils import calculate_qparams
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4convert.errors import FormatError
from dsv4convert.formats import (
    Format,
    detect_format,
    dequantize_fp8_block,
    e8m0_scale_to_float32,
    error_metrics,
    float32_scale_to_e8m0,
    fp8_block_of,
    quantize_fp8_block,
)

SETTINGS = settings(max_examples=50, deadline=None)
FP8_BLOCK_ARGS = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="block",
                                  block_structure=[128, 128])


def _block_amax(w: torch.Tensor) -> torch.Tensor:
    n, k = w.shape
    return w.abs().reshape(n // 128, 128, k // 128, 128).amax(dim=(1, 3))


@st.composite
def weights(draw, max_blocks: int = 2):
    rows = draw(st.integers(1, max_blocks)) * 128
    cols = draw(st.integers(1, max_blocks)) * 128
    seed = draw(st.integers(0, 2**31 - 1))
    log_scale = draw(st.floats(-30, 30))
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=generator) * 2.0**log_scale


@SETTINGS
@given(weights())
def test_ue8m0_scale_is_ceil_power_of_two(w):
    weight, scale = quantize_fp8_block(w, block=(128, 128))
    assert scale.dtype == torch.float8_e8m0fnu and weight.dtype == torch.float8_e4m3fn
    for amax, byte in zip(_block_amax(w).flatten().tolist(), scale.view(torch.uint8).flatten().tolist()):
        mantissa, exponent = math.frexp(amax / 448)  # float64 quotient: ceil(log2) is exact here
        assert byte - 127 == (exponent - 1 if mantissa == 0.5 else exponent)


@SETTINGS
@given(weights())
def test_float32_scale_and_codes_match_compressed_tensors(w):
    weight, scale = quantize_fp8_block(w, scale_fmt="float32", block=(128, 128))
    blocks = w.reshape(w.shape[0] // 128, 128, w.shape[1] // 128, 128)
    ct_scale, ct_zero = calculate_qparams(blocks.amin(dim=(1, 3)), blocks.amax(dim=(1, 3)), FP8_BLOCK_ARGS)
    assert torch.equal(scale, ct_scale)
    ct_codes = quantize(w, ct_scale, ct_zero, FP8_BLOCK_ARGS, dtype=torch.float8_e4m3fn)
    assert torch.equal(weight.view(torch.uint8), ct_codes.view(torch.uint8))


@SETTINGS
@given(weights(), st.sampled_from(["ue8m0", "float32"]))
def test_round_trip_error_within_e4m3_half_ulp(w, scale_fmt):
    weight, scale = quantize_fp8_block(w, scale_fmt=scale_fmt, block=(128, 128))
    restored = dequantize_fp8_block(weight, scale, block=(128, 128))
    scale_full = e8m0_scale_to_float32(scale) if scale_fmt == "ue8m0" else scale
    scale_full = scale_full.repeat_interleave(128, 0).repeat_interleave(128, 1)
    # Normals keep 3 mantissa bits (relative half-ulp 2**-4); subnormals have spacing 2**-9.
    bound = torch.maximum(w.abs() * 2.0**-4, scale_full * 2.0**-10) * (1 + 1e-6)
    assert bool(((w - restored).abs() <= bound).all())


def test_gaussian_error_matches_reference_table():
    # formats.md §7 (numpy, independent of this code): 0.0265 (UE8M0) and 0.0264 (F32 scale).
    w = torch.randn(512, 4096, generator=torch.Generator().manual_seed(0))
    for scale_fmt, expected in (("ue8m0", 0.0265), ("float32", 0.0264)):
        weight, scale = quantize_fp8_block(w, scale_fmt=scale_fmt, block=(128, 128))
        assert error_metrics(w, dequantize_fp8_block(weight, scale, block=(128, 128))).rel_fro == pytest.approx(expected, rel=0.03)


def test_largest_value_lands_on_448():
    w = torch.zeros(128, 128)
    w[3, 5] = 448.0 * 2.0**-10
    w[7, 9] = -1.0 * 2.0**-10
    weight, scale = quantize_fp8_block(w, block=(128, 128))
    assert int(scale.view(torch.uint8)) == 127 - 10
    assert float(weight[3, 5].float()) == 448.0 and float(weight[7, 9].float()) == -1.0
    huge = torch.full((128, 128), 448.0 * 2.0**119)  # 1.75 * 2**127, on both grids
    weight, scale = quantize_fp8_block(huge, block=(128, 128))
    assert torch.equal(dequantize_fp8_block(weight, scale, block=(128, 128)), huge)


def test_all_zero_block_gets_unit_scale():
    w = torch.zeros(256, 128)
    w[200, 3] = 1.0
    weight, scale = quantize_fp8_block(w, block=(128, 128))
    assert scale.view(torch.uint8).flatten().tolist()[0] == 127
    assert bool((weight[:128].float() == 0).all())
    weight, scale = quantize_fp8_block(w, scale_fmt="float32", block=(128, 128))
    assert torch.equal(scale.flatten(), torch.tensor([1.0, 1.0]) / torch.tensor([1.0, 448.0]))


def test_subnormal_codes_and_tiny_scales():
    w = torch.zeros(128, 128)
    w[0, 0] = 448.0
    w[0, 1] = 2.0**-9  # the smallest E4M3 subnormal at scale 1
    w[0, 2] = 2.0**-11  # below half of it: rounds to zero
    weight, scale = quantize_fp8_block(w, block=(128, 128))
    assert weight[0, :3].float().tolist() == [448.0, 2.0**-9, 0.0]
    tiny = torch.full((128, 128), 2.0**-133)  # amax/448 is below E8M0's 2**-127: clamped
    weight, scale = quantize_fp8_block(tiny, block=(128, 128))
    assert int(scale.view(torch.uint8)) == 0
    assert torch.equal(dequantize_fp8_block(weight, scale, block=(128, 128)), tiny)


def test_ragged_shape_pads_blocks_with_zeros():
    w = torch.randn(130, 200, generator=torch.Generator().manual_seed(1))
    weight, scale = quantize_fp8_block(w, block=(128, 128))
    assert weight.shape == (130, 200) and scale.shape == (2, 2)
    # The ragged edge block's amax comes from its real elements only.
    edge_amax = w[128:, 128:].abs().max().item()
    mantissa, exponent = math.frexp(edge_amax / 448)
    assert int(scale.view(torch.uint8)[1, 1]) - 127 == (exponent - 1 if mantissa == 0.5 else exponent)
    restored = dequantize_fp8_block(weight, scale, block=(128, 128))
    assert error_metrics(w, restored).rel_fro < 0.04


@SETTINGS
@given(weights())
def test_scale_forms_convert_losslessly(w):
    weight, scale = quantize_fp8_block(w, block=(128, 128))
    as_float = e8m0_scale_to_float32(scale)
    assert torch.equal(as_float, scale.to(torch.float32))  # torch's own E8M0 decode
    assert torch.equal(float32_scale_to_e8m0(as_float).view(torch.uint8), scale.view(torch.uint8))
    assert torch.equal(dequantize_fp8_block(weight, as_float, block=(128, 128)), dequantize_fp8_block(weight, scale, block=(128, 128)))


@pytest.mark.parametrize("bad", [0.3, 0.0, -0.5, math.inf, math.nan, 2.0**-130])
def test_float32_scale_that_is_not_a_power_of_two_is_refused(bad):
    with pytest.raises(FormatError, match=r"tensor 'wo_b.weight_scale_inv'.*power of two"):
        float32_scale_to_e8m0(torch.tensor([[1.0, bad]]), name="wo_b.weight_scale_inv")


def test_bf16_output_is_exact_for_e8m0_scales():
    w = torch.randn(128, 256, generator=torch.Generator().manual_seed(2))
    weight, scale = quantize_fp8_block(w, block=(128, 128))
    as_bf16 = dequantize_fp8_block(weight, scale, out_dtype=torch.bfloat16, block=(128, 128))
    assert torch.equal(as_bf16.float(), dequantize_fp8_block(weight, scale, block=(128, 128)))


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_input_names_the_tensor(bad):
    w = torch.ones(128, 128)
    w[5, 5] = bad
    with pytest.raises(FormatError, match=r"tensor 'attn.wq_a.weight'.*NaN or Inf"):
        quantize_fp8_block(w, name="attn.wq_a.weight", block=(128, 128))


def test_bad_arguments():
    with pytest.raises(FormatError, match="2-D"):
        quantize_fp8_block(torch.ones(128), block=(128, 128))
    with pytest.raises(FormatError, match="scale_fmt"):
        quantize_fp8_block(torch.ones(128, 128), scale_fmt="e4m3", block=(128, 128))
    weight, scale = quantize_fp8_block(torch.ones(256, 128), block=(128, 128))
    with pytest.raises(FormatError, match=r"expected \[2, 1\]"):
        dequantize_fp8_block(weight, scale[:1], block=(128, 128))
    with pytest.raises(FormatError, match="float8_e4m3fn"):
        dequantize_fp8_block(weight.float(), scale, block=(128, 128))


# --------------------------------------------------------------------------- the block is the caller's (#52)

def test_non_square_and_v41_blocks_round_trip_and_shape_the_scale():
    w = torch.randn(96, 160, generator=torch.Generator().manual_seed(3))
    for block in ((32, 32), (16, 64), (128, 128)):
        weight, scale = quantize_fp8_block(w, block=block)
        assert scale.shape == (-(-96 // block[0]), -(-160 // block[1]))
        assert torch.equal(dequantize_fp8_block(weight, scale, block=block),
                           dequantize_fp8_block(*quantize_fp8_block(w, block=block), block=block))
    with pytest.raises(FormatError, match="in 32x32 blocks"):
        dequantize_fp8_block(*quantize_fp8_block(w, block=(128, 128)), block=(32, 32))


def test_the_block_is_read_off_the_shapes_where_they_say_it():
    assert fp8_block_of((4096, 7168), (32, 56)) == (128, 128)
    assert fp8_block_of((4096, 7168), (128, 224)) == (32, 32)
    assert fp8_block_of((200, 4096), (2, 32)) == (128, 128)          # ragged rows still say 128
    # one scale over a whole axis: any block from the axis up fits; the release's decides where it fits
    assert fp8_block_of((64, 4096), (1, 32), known=(128, 128)) == (128, 128)
    assert fp8_block_of((64, 4096), (2, 128), known=(128, 128)) == (32, 32)   # the shapes win over the release
    with pytest.raises(FormatError, match="tensor 'layers.0.attn.wo_b.scale'.*does not say its block"):
        fp8_block_of((64, 4096), (1, 32), name="layers.0.attn.wo_b.scale")
    with pytest.raises(FormatError, match="release's \\[32, 32\\] does not fit"):
        fp8_block_of((64, 4096), (1, 32), known=(32, 32))
    assert fp8_block_of((100, 128), (3, 1), known=(128, 128)) is None   # no power of two gives 3 scales for 100


def test_detection_reads_the_block_and_refuses_naming_the_module_where_it_cannot():
    stored = {"weight": ("F8_E4M3", (64, 4096)), "scale": ("F8_E8M0", (1, 32))}
    assert detect_format(stored, 64, 4096, fp8_block=(128, 128)) == (
        Format.FP8, {"fp8_scale_dtype": "F8_E8M0", "fp8_block": (128, 128)})
    with pytest.raises(FormatError, match="tensor 'layers.0.attn.wo_b.scale'"):
        detect_format(stored, 64, 4096, name="layers.0.attn.wo_b")
    v41 = {"weight": ("F8_E4M3", (4096, 1024)), "scale": ("F8_E8M0", (128, 32))}
    assert detect_format(v41, 4096, 1024, fp8_block=(128, 128))[1]["fp8_block"] == (32, 32)
