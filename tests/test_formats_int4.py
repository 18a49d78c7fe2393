"""INT4 W4A16 bit-compatibility with compressed-tensors 0.18.0 (scales, codes, packing, decode)."""

from __future__ import annotations

import math

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from compressed_tensors.quantization.lifecycle.forward import quantize
from compressed_tensors.quantization.utils import calculate_qparams
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4convert.errors import FormatError
from dsv4convert.formats import (
    dequantize_int4,
    error_metrics,
    int4_group_scales,
    pack_int4,
    quantize_int4,
    quantize_int4_weight,
    round_to_int4,
    unpack_int4,
)

SETTINGS = settings(max_examples=50, deadline=None)


def _args(group_size: int) -> QuantizationArgs:
    return QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group_size)


@st.composite
def weights(draw):
    group_size = draw(st.sampled_from([32, 128]))
    rows = draw(st.integers(1, 6))
    cols = draw(st.integers(1, 3)) * group_size
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    w = torch.randn(rows, cols, generator=generator) * 2.0 ** draw(st.floats(-20, 20))
    w[:, :group_size] *= draw(st.sampled_from([0.0, 1.0]))  # sometimes an all-zero group
    return w.to(dtype), group_size


def _ct_scale(w: torch.Tensor, group_size: int) -> torch.Tensor:
    groups = w.unflatten(-1, (w.shape[1] // group_size, group_size))
    scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), _args(group_size))
    return scale


@SETTINGS
@given(weights())
def test_scales_match_compressed_tensors(case):
    w, group_size = case
    ours = int4_group_scales(w, group_size=group_size, scale_rule="amax")
    assert ours.dtype == torch.float32
    assert torch.equal(ours.to(w.dtype), _ct_scale(w, group_size))
    assert torch.equal(ours.to(torch.bfloat16), _ct_scale(w, group_size).to(torch.bfloat16))


@SETTINGS
@given(weights())
def test_codes_match_compressed_tensors_with_bf16_scale(case):
    w, group_size = case
    scale = int4_group_scales(w, group_size=group_size, scale_rule="amax").to(torch.bfloat16)
    zero = torch.zeros_like(scale, dtype=torch.int8)
    expected = quantize(w, scale, zero, _args(group_size), dtype=torch.int8)
    assert torch.equal(quantize_int4(w, scale, group_size=group_size), expected)


@SETTINGS
@given(weights())
def test_stored_tensors_match_the_compressor(case):
    w, group_size = case
    ours = quantize_int4_weight(w, group_size=group_size, scale_rule="amax")
    scheme = QuantizationScheme(targets=["Linear"], weights=_args(group_size))
    scale = _ct_scale(w, group_size).to(torch.bfloat16)
    theirs = PackedQuantizationCompressor.compress({"weight": w, "weight_scale": scale}, scheme)
    assert torch.equal(ours.weight_scale, scale) and ours.weight_scale.dtype == torch.bfloat16
    assert torch.equal(ours.weight_packed, theirs["weight_packed"])
    assert torch.equal(ours.weight_shape, theirs["weight_shape"]) and ours.weight_shape.dtype == torch.int64
    decompressed = PackedQuantizationCompressor.decompress(theirs, scheme)["weight"]
    ours_decoded = dequantize_int4(ours.weight_packed, ours.weight_scale, ours.weight_shape,
                                   group_size=group_size, out_dtype=torch.bfloat16)
    assert torch.equal(ours_decoded, decompressed.to(torch.bfloat16))


@SETTINGS
@given(st.integers(1, 5), st.integers(1, 70), st.integers(0, 2**31 - 1))
def test_pack_and_unpack_match_compressed_tensors(rows, cols, seed):
    codes = torch.randint(-8, 8, (rows, cols), dtype=torch.int8, generator=torch.Generator().manual_seed(seed))
    packed = pack_int4(codes)
    assert torch.equal(packed, pack_to_int32(codes, 4))
    assert torch.equal(unpack_int4(packed, (rows, cols)), codes)
    assert torch.equal(unpack_int4(packed, (rows, cols)), unpack_from_int32(packed, 4, torch.Size((rows, cols))))


def test_hand_worked_packing_lsb_first():
    codes = torch.tensor([[-8, -7, 0, 7, 1, 2, 3, -1]], dtype=torch.int8)
    # Stored values (+8): 0, 1, 8, 15, 9, 10, 11, 7 -> nibble i at bits 4i.
    expected = sum(v << (4 * i) for i, v in enumerate([0, 1, 8, 15, 9, 10, 11, 7]))
    expected -= 1 << 32 if expected >= 1 << 31 else 0
    assert pack_int4(codes).tolist() == [[expected]]
    # As uint8 the word is the FP4-style nibble layout, even element in the low nibble.
    assert pack_int4(codes).view(torch.uint8).tolist() == [[0x10, 0xF8, 0xA9, 0x7B]]


def test_hand_worked_rounding_and_range():
    # One group of 32, amax 7.5 -> scale 1: +amax is 7.5 -> 8 -> clamped to 7, -amax -> -8.
    w = torch.zeros(1, 32)
    w[0, :6] = torch.tensor([7.5, -7.5, 2.5, 3.5, -0.5, 6.9])
    q = quantize_int4_weight(w, group_size=32, scale_rule="amax")
    assert float(q.weight_scale) == 1.0
    codes = unpack_int4(q.weight_packed, q.weight_shape)
    assert codes[0, :6].tolist() == [7, -8, 2, 4, 0, 7]  # ties to even: 2.5 -> 2, 3.5 -> 4


def test_split_api_supports_column_by_column_rounding():
    w = torch.randn(8, 256, generator=torch.Generator().manual_seed(5))
    scale = int4_group_scales(w).to(torch.bfloat16)
    columns = [round_to_int4(w[:, j] / scale[:, j // 128].float()) for j in range(w.shape[1])]
    assert torch.equal(torch.stack(columns, dim=1), quantize_int4(w, scale))


def test_gaussian_error_matches_reference_table():
    # formats.md §7 (numpy, independent of this code): INT4 sym g128 amax/7.5 on Gaussian = 0.1108.
    w = torch.randn(512, 4096, generator=torch.Generator().manual_seed(0))
    q = quantize_int4_weight(w, scale_rule="amax")
    restored = dequantize_int4(q.weight_packed, q.weight_scale, q.weight_shape)
    assert error_metrics(w, restored).rel_fro == pytest.approx(0.1108, rel=0.02)


def test_all_zero_group_gets_epsilon_scale():
    q = quantize_int4_weight(torch.zeros(2, 128, dtype=torch.bfloat16))
    assert q.weight_scale.flatten().tolist() == [torch.finfo(torch.bfloat16).eps] * 2
    assert torch.equal(unpack_int4(q.weight_packed, q.weight_shape), torch.zeros(2, 128, dtype=torch.int8))


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_input_names_the_tensor(bad):
    w = torch.ones(2, 128)
    w[1, 1] = bad
    with pytest.raises(FormatError, match=r"tensor 'experts.5.w1.weight'.*NaN or Inf"):
        quantize_int4_weight(w, name="experts.5.w1.weight")
    with pytest.raises(FormatError, match=r"NaN or Inf"):
        quantize_int4(w, torch.ones(2, 1))


def test_bad_arguments():
    with pytest.raises(FormatError, match="multiple of the group size 128"):
        quantize_int4_weight(torch.ones(2, 96))
    with pytest.raises(FormatError, match="does not match weight"):
        quantize_int4(torch.ones(2, 256), torch.ones(2, 1))
    with pytest.raises(FormatError, match="positive and finite"):
        quantize_int4(torch.ones(2, 128), torch.zeros(2, 1))
    with pytest.raises(FormatError, match=r"\[-8, 7\]"):
        pack_int4(torch.tensor([[8]], dtype=torch.int8))
    with pytest.raises(FormatError, match="int8"):
        pack_int4(torch.tensor([[1]], dtype=torch.int32))
    with pytest.raises(FormatError, match=r"int32 \[2, 2\]"):
        unpack_int4(torch.zeros(2, 1, dtype=torch.int32), (2, 16))
