"""MXFP4 (DeepSeek-V4 experts): the ceil scale rule, the checkpoint's decode formula, edge cases."""

from __future__ import annotations

import math
import struct

import pytest
import torch
from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4convert.errors import FormatError
from dsv4convert.formats import dequantize_mxfp4, error_metrics, quantize_mxfp4
from dsv4convert.formats.mxfp4 import mxfp4_exponents

SETTINGS = settings(max_examples=50, deadline=None)


@st.composite
def weights(draw):
    rows = draw(st.integers(1, 8))
    cols = draw(st.integers(1, 8)) * 32
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    w = torch.randn(rows, cols, generator=generator) * 2.0 ** draw(st.floats(-60, 60))
    # Some blocks far smaller than others, and some all-zero blocks.
    w = w * torch.where(torch.rand(rows, cols // 32, 1, generator=generator) < 0.2, 2.0**-40, 1.0).repeat_interleave(
        32, dim=1).reshape(rows, cols)
    return w * (torch.rand(rows, cols // 32, generator=generator) > 0.1).repeat_interleave(32, dim=1)


def _reference_decode(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """dsv4-checkpoint.md §5 with compressed-tensors' FP4 unpacker and torch's E8M0 decode."""
    n, half = packed.shape
    values = unpack_fp4_from_uint8(packed.view(torch.uint8), n, half * 2, dtype=torch.float32)
    return values * scale.to(torch.float32).repeat_interleave(32, dim=1)


def test_hand_worked_block():
    w = torch.zeros(1, 32)
    w[0, :6] = torch.tensor([6.0, -3.0, 0.5, 1.25, -0.2, 5.5]) * 2.0**-4
    packed, scale = quantize_mxfp4(w)
    # amax = 6 * 2**-4, so X = ceil(log2(2**-4)) = -4: byte 123, codes of w * 2**4.
    assert scale.view(torch.uint8).tolist() == [[123]]
    assert packed.dtype == torch.int8 and packed.shape == (1, 16)
    codes = [0x7, 0xD, 0x1, 0x2, 0x8, 0x7]  # 6, -3, 0.5, 1 (tie down), -0, 6 (5.5 > 5)
    expected_bytes = [codes[0] | codes[1] << 4, codes[2] | codes[3] << 4, codes[4] | codes[5] << 4]
    assert packed.view(torch.uint8)[0, :3].tolist() == expected_bytes
    assert packed.view(torch.uint8)[0, 3:].tolist() == [0] * 13


@SETTINGS
@given(st.lists(st.floats(min_value=2.0**-126, max_value=2.0**127, width=32, allow_subnormal=False),
                min_size=1, max_size=32))
def test_scale_rule_is_ceil_and_matches_deepseek_bit_trick(amaxes):
    amax = torch.tensor(amaxes, dtype=torch.float32)
    ours = mxfp4_exponents(amax).tolist()
    inv6 = struct.unpack("f", struct.pack("f", 1 / 6))[0]
    for value, exponent in zip(amax.tolist(), ours):
        # Exact rule on Python floats: ceil(log2(max(amax, 6 * 2**-126) / 6)).
        mantissa, e = math.frexp(max(value, 6 * 2.0**-126) / 6)
        assert exponent == (e - 1 if mantissa == 0.5 else e)
        # DeepSeek's kernel: float32 product with float32(1/6), ceil from the IEEE bits.
        product = struct.unpack("f", struct.pack("f", max(value, 6 * 2.0**-126) * inv6))[0]
        bits = struct.unpack("I", struct.pack("f", product))[0]
        assert exponent == ((bits >> 23) & 0xFF) - 127 + (1 if bits & 0x7FFFFF else 0)


def test_scale_rule_at_exact_multiples_of_six():
    powers = torch.arange(-120, 120)
    amax = 6.0 * torch.exp2(powers.double()).float()
    assert torch.equal(mxfp4_exponents(amax), powers.int())
    above = torch.nextafter(amax, torch.full_like(amax, math.inf))
    assert torch.equal(mxfp4_exponents(above), powers.int() + 1)


@SETTINGS
@given(weights())
def test_dequantize_matches_checkpoint_formula(w):
    packed, scale = quantize_mxfp4(w)
    assert torch.equal(dequantize_mxfp4(packed, scale), _reference_decode(packed, scale))


@SETTINGS
@given(weights())
def test_round_trip_error_bound_and_no_clipping(w):
    packed, scale = quantize_mxfp4(w)
    restored = dequantize_mxfp4(packed, scale)
    unit = scale.to(torch.float32).repeat_interleave(32, dim=1)
    # The ceil rule puts amax/2**X in (3, 6], so every element is rounded, never clipped:
    # the error is at most half the E2M1 spacing at the top binade (1 unit).
    assert bool(((w - restored).abs() <= unit).all())
    amax = w.abs().reshape(w.shape[0], -1, 32).amax(-1)
    live = amax > 6 * 2.0**-126
    ratio = (amax / scale.to(torch.float32))[live]
    assert bool(((ratio > 3) & (ratio <= 6)).all())


@SETTINGS
@given(weights())
def test_requantizing_decoded_weights_is_lossless(w):
    decoded = dequantize_mxfp4(*quantize_mxfp4(w))
    assert torch.equal(dequantize_mxfp4(*quantize_mxfp4(decoded)), decoded)


def test_gaussian_error_matches_reference_table():
    # formats.md §7 (numpy, independent of this code): MXFP4 ceil rule on Gaussian = 0.1154.
    w = torch.randn(512, 4096, generator=torch.Generator().manual_seed(0))
    assert error_metrics(w, dequantize_mxfp4(*quantize_mxfp4(w))).rel_fro == pytest.approx(0.1154, rel=0.02)


def test_all_zero_block_uses_deepseek_floor():
    packed, scale = quantize_mxfp4(torch.zeros(2, 64))
    assert scale.view(torch.uint8).tolist() == [[1, 1], [1, 1]]  # 2**-126, the kernel's amax floor
    assert bool((packed == 0).all())


def test_largest_float32_values():
    w = torch.full((1, 32), torch.finfo(torch.float32).max)
    packed, scale = quantize_mxfp4(w)
    assert int(scale.view(torch.uint8)) == 127 + 126  # amax/2**126 = 4 * (1 - 2**-24): rounds to 4
    assert bool((packed.view(torch.uint8) == 0x66).all())  # code 6 (value 4) in both nibbles


def test_bf16_output_is_exact():
    w = torch.randn(4, 64, generator=torch.Generator().manual_seed(3))
    packed, scale = quantize_mxfp4(w)
    assert torch.equal(dequantize_mxfp4(packed, scale, out_dtype=torch.bfloat16).float(),
                       dequantize_mxfp4(packed, scale))


def test_uint8_storage_is_accepted():
    w = torch.randn(4, 64, generator=torch.Generator().manual_seed(4))
    packed, scale = quantize_mxfp4(w)
    assert torch.equal(dequantize_mxfp4(packed.view(torch.uint8), scale.view(torch.uint8)),
                       dequantize_mxfp4(packed, scale))


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_input_names_the_tensor(bad):
    w = torch.ones(2, 32)
    w[1, 7] = bad
    with pytest.raises(FormatError, match=r"tensor 'ffn.experts.3.w2.weight'.*NaN or Inf"):
        quantize_mxfp4(w, name="ffn.experts.3.w2.weight")


def test_bad_shapes_and_scales():
    with pytest.raises(FormatError, match="multiple of 32"):
        quantize_mxfp4(torch.ones(2, 48), name="w")
    packed, scale = quantize_mxfp4(torch.ones(2, 64))
    with pytest.raises(FormatError, match=r"expected \[2, 2\]"):
        dequantize_mxfp4(packed, scale[:, :1])
    with pytest.raises(FormatError, match="0xFF"):
        dequantize_mxfp4(packed, torch.full((2, 2), 255, dtype=torch.uint8), name="s")
    with pytest.raises(FormatError, match="int8/uint8"):
        dequantize_mxfp4(packed.float(), scale)
