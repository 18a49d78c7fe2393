"""E2M1 codes, nibble packing and E8M0 exponents against oracles we did not write.

Oracles: the OCP E2M1 bit definition, compressed-tensors' FP4 rounding and packer, and
torch's native float8_e8m0fnu conversion. (torch 2.13 has no conversion kernels for
float4_e2m1fn_x2 on CPU, so the E2M1 grid is checked against the other two.)
"""

from __future__ import annotations

import math

import pytest
import torch
from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8, unpack_fp4_from_uint8
from compressed_tensors.quantization.quant_args import FP4_E2M1_DATA
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4convert.errors import FormatError
from dsv4convert.formats import numerics
from dsv4convert.formats.numerics import (
    E2M1_VALUES,
    ceil_log2,
    decode_e2m1,
    decode_e2m1_packed,
    e8m0_to_exponent,
    e8m0_to_float,
    encode_e2m1,
    exp2_float32,
    exponent_to_e8m0,
    pack_nibbles,
    unpack_nibbles,
)

SETTINGS = settings(max_examples=50, deadline=None)


def test_e2m1_table_follows_the_ocp_bit_layout():
    # OCP MX spec: 1 sign, 2 exponent (bias 1), 1 mantissa bit; exponent 0 is subnormal.
    for code in range(16):
        sign = -1.0 if code & 8 else 1.0
        exponent, mantissa = (code >> 1) & 3, code & 1
        magnitude = mantissa * 0.5 if exponent == 0 else 2.0 ** (exponent - 1) * (1 + mantissa / 2)
        assert E2M1_VALUES[code] == sign * magnitude
        assert math.copysign(1.0, E2M1_VALUES[code]) == sign


def test_decode_matches_compressed_tensors_unpacker():
    every_byte = torch.arange(256, dtype=torch.uint8).reshape(16, 16)
    expected = unpack_fp4_from_uint8(every_byte, 16, 32, dtype=torch.float32)
    assert torch.equal(decode_e2m1_packed(every_byte), expected)
    assert torch.equal(decode_e2m1(unpack_nibbles(every_byte)), expected)


@pytest.mark.parametrize(
    ("value", "code"),
    [
        (0.25, 0), (0.2500001, 1), (0.75, 2), (0.7499999, 1), (1.25, 2), (1.75, 4),
        (2.5, 4), (2.5000002, 5), (3.5, 6), (5.0, 6), (5.0000005, 7), (6.0, 7), (1e30, 7),
        (-0.75, 10), (-5.5, 15), (-1e30, 15), (0.0, 0), (-0.0, 8), (-0.1, 8),
    ],
)
def test_encode_hand_worked_ties_and_saturation(value, code):
    # formats.md §1: ties at 0.25, 1.25, 2.5, 5 go down, ties at 0.75, 1.75, 3.5 go up.
    assert int(encode_e2m1(torch.tensor([value]))[0]) == code


@SETTINGS
@given(st.lists(st.floats(-8, 8, width=32).filter(lambda v: not (v == 0 and math.copysign(1, v) < 0)),
                min_size=2, max_size=64).filter(lambda v: len(v) % 2 == 0))
def test_encode_and_pack_match_compressed_tensors(values):
    x = torch.tensor(values, dtype=torch.float32).reshape(1, -1)
    # compressed-tensors rounds with the same thresholds, then packs values to codes.
    expected = pack_fp4_to_uint8(FP4_E2M1_DATA.cast_to_fp4(x.clone()))
    assert torch.equal(pack_nibbles(encode_e2m1(x)), expected)


def test_encode_exact_grid_values_round_trip():
    grid = torch.tensor(E2M1_VALUES)
    assert torch.equal(decode_e2m1(encode_e2m1(grid)), grid)
    assert torch.equal(encode_e2m1(grid), torch.arange(16, dtype=torch.uint8))


def test_nibble_order_even_element_low():
    packed = pack_nibbles(torch.tensor([[0x1, 0x2, 0xF, 0x0]], dtype=torch.uint8))
    assert packed.tolist() == [[0x21, 0x0F]]
    assert unpack_nibbles(torch.tensor([[0x21, 0x0F]], dtype=torch.uint8)).tolist() == [[1, 2, 15, 0]]
    # int8 storage (the checkpoint's I8) unpacks identically.
    assert unpack_nibbles(torch.tensor([[0x21, -16]], dtype=torch.int8)).tolist() == [[1, 2, 0, 15]]


def test_pack_rejects_odd_length():
    with pytest.raises(FormatError, match="odd number"):
        pack_nibbles(torch.zeros(3, dtype=torch.uint8), name="w")


def test_e8m0_values_match_torch_native_dtype():
    every_byte = torch.arange(255, dtype=torch.uint8)
    native = every_byte.view(torch.float8_e8m0fnu).to(torch.float32)
    assert torch.equal(e8m0_to_float(every_byte), native)
    assert torch.equal(e8m0_to_float(every_byte.view(torch.float8_e8m0fnu)), native)
    assert torch.equal(e8m0_to_exponent(every_byte), torch.arange(-127, 128, dtype=torch.int32))


def test_exponent_to_e8m0_round_trip_and_range():
    exponents = torch.arange(-127, 128)
    scale = exponent_to_e8m0(exponents)
    assert scale.dtype == torch.float8_e8m0fnu
    assert torch.equal(scale.to(torch.float32), torch.exp2(exponents.double()).float())
    with pytest.raises(FormatError, match=r"outside E8M0"):
        exponent_to_e8m0(torch.tensor([128]), name="s")
    with pytest.raises(FormatError, match=r"outside E8M0"):
        exponent_to_e8m0(torch.tensor([-128]))


def test_e8m0_nan_byte_names_the_tensor():
    with pytest.raises(FormatError, match=r"tensor 'layers.0.ffn.experts.1.w1.scale'.*0xFF"):
        e8m0_to_float(torch.tensor([127, 255], dtype=torch.uint8), name="layers.0.ffn.experts.1.w1.scale")
    with pytest.raises(FormatError, match="float8_e8m0fnu or uint8"):
        e8m0_to_exponent(torch.tensor([1.0]))


def test_exp2_float32_is_exact_down_to_subnormals():
    exponents = torch.arange(-149, 128)
    expected = torch.tensor([math.ldexp(1.0, int(e)) for e in exponents], dtype=torch.float32)
    assert torch.equal(exp2_float32(exponents), expected)


@SETTINGS
@given(st.lists(st.floats(min_value=2.0**-126, max_value=2.0**127, width=32, allow_subnormal=False),
                min_size=1, max_size=32))
def test_ceil_log2_matches_exact_arithmetic(values):
    x = torch.tensor(values, dtype=torch.float32)
    for value, result in zip(x.tolist(), ceil_log2(x).tolist()):
        mantissa, exponent = math.frexp(value)  # exact in Python floats
        assert result == (exponent - 1 if mantissa == 0.5 else exponent)


def test_ceil_log2_powers_and_neighbours():
    powers = torch.tensor([2.0**e for e in range(-149, 128)], dtype=torch.float32)
    assert torch.equal(ceil_log2(powers), torch.arange(-149, 128, dtype=torch.int32))
    above = torch.nextafter(powers, torch.full_like(powers, math.inf))
    assert torch.equal(ceil_log2(above), torch.arange(-148, 129, dtype=torch.int32))


def test_require_finite_names_tensor():
    with pytest.raises(FormatError, match=r"tensor 'w'.*NaN or Inf"):
        numerics.require_finite(torch.tensor([1.0, math.inf]), "w")
