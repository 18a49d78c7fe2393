"""NVFP4 (ModelOpt layout): hand-worked scales, error bounds, shared weight_scale_2, edge cases."""

from __future__ import annotations

import math

import pytest
import torch
from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4convert.errors import FormatError
from dsv4convert.formats import (
    NVFP4Weight,
    dequantize_nvfp4,
    error_metrics,
    input_scale_from_amax,
    quantize_nvfp4,
)

SETTINGS = settings(max_examples=50, deadline=None)


@st.composite
def weights(draw):
    rows = draw(st.integers(1, 8))
    cols = draw(st.integers(1, 8)) * 16
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    w = torch.randn(rows, cols, generator=generator) * 2.0 ** draw(st.floats(-40, 40))
    # Blocks spread over many binades exercise subnormal and clamped E4M3 block scales.
    spread = torch.exp2(-torch.randint(0, 24, (rows, cols // 16, 1), generator=generator).float())
    return (w.reshape(rows, -1, 16) * spread).reshape(rows, cols)


def _decode(q: NVFP4Weight) -> torch.Tensor:
    return dequantize_nvfp4(q.weight, q.weight_scale, q.weight_scale_2)


def test_hand_worked_unit_scales():
    # Global amax 6 * 448 gives weight_scale_2 = 1; a block with amax 6 gets block scale 1.
    w = torch.zeros(2, 16)
    w[0, :4] = torch.tensor([6.0, -1.0, 0.75, 2.5])
    w[1, 0] = 6.0 * 448.0
    q = quantize_nvfp4(w)
    assert q.weight_scale_2.dtype == torch.float32 and q.weight_scale_2.shape == ()
    assert float(q.weight_scale_2) == 1.0
    assert q.weight_scale.dtype == torch.float8_e4m3fn and q.weight_scale.shape == (2, 1)
    assert q.weight_scale.float().flatten().tolist() == [1.0, 448.0]
    assert q.weight.dtype == torch.uint8 and q.weight.shape == (2, 8)
    assert q.weight[0, :2].tolist() == [0x7 | 0xA << 4, 0x2 | 0x4 << 4]  # 6, -1 | 1.0 (tie up), 2 (tie down)
    assert q.weight[1].tolist() == [0x07] + [0] * 7


def test_block_scale_rounds_to_e4m3_and_codes_use_the_rounded_scale():
    w = torch.zeros(1, 32)
    w[0, 0] = 6.0 * 448.0  # weight_scale_2 = 1
    w[0, 16] = 6.0 * 1.0625  # block scale 1.0625 rounds (tie, even) to 1.0 in E4M3
    w[0, 17] = 1.0625 * 0.75
    q = quantize_nvfp4(w)
    assert q.weight_scale.float().flatten().tolist() == [448.0, 1.0]
    # Codes are computed against the stored scale 1.0: 6.375 saturates to 6, 0.797 -> 1.0.
    assert _decode(q)[0, 16:18].tolist() == [6.0, 1.0]


def test_decode_matches_compressed_tensors_unpacker_times_scales():
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(0))
    q = quantize_nvfp4(w)
    codes = unpack_fp4_from_uint8(q.weight, 8, 64, dtype=torch.float32)
    expected = codes * q.weight_scale.float().repeat_interleave(16, dim=1) * q.weight_scale_2
    assert torch.equal(_decode(q), expected)


@SETTINGS
@given(weights())
def test_round_trip_error_within_bound(w):
    q = quantize_nvfp4(w)
    restored = _decode(q)
    unit = (q.weight_scale.float() * q.weight_scale_2).repeat_interleave(16, dim=1)
    # Inside the E2M1 range an element moves by at most half the top spacing (1 unit);
    # beyond 6 units (block scale rounded down by E4M3) it saturates to exactly 6 units.
    bound = unit + (w.abs() - 6 * unit).clamp(min=0)
    assert bool(((w - restored).abs() <= bound * (1 + 2**-20)).all())
    assert q.weight_scale_2 == pytest.approx(float(w.abs().max()) / 2688, rel=1e-6)
    # Block scales stay in ModelOpt's clamped range [2**-9, 448].
    scales = q.weight_scale.float()
    assert bool(((scales >= 2.0**-9) & (scales <= 448)).all())


def test_gaussian_error_matches_reference_table():
    # formats.md §7 (numpy, independent of this code): NVFP4 on Gaussian = 0.0951.
    w = torch.randn(512, 4096, generator=torch.Generator().manual_seed(0))
    assert error_metrics(w, _decode(quantize_nvfp4(w))).rel_fro == pytest.approx(0.0951, rel=0.02)


def test_shared_global_amax_for_w1_w3():
    generator = torch.Generator().manual_seed(1)
    w1 = torch.randn(16, 64, generator=generator)
    w3 = torch.randn(16, 64, generator=generator) * 3
    shared = torch.maximum(w1.abs().max(), w3.abs().max())
    q1, q3 = quantize_nvfp4(w1, global_amax=shared), quantize_nvfp4(w3, global_amax=shared)
    assert torch.equal(q1.weight_scale_2, q3.weight_scale_2)
    assert torch.equal(q3.weight_scale_2, input_scale_from_amax(w3.abs().max()))
    assert error_metrics(w1, _decode(q1)).rel_fro < 0.12
    with pytest.raises(FormatError, match=r"tensor 'w1'.*below the tensor's own amax"):
        quantize_nvfp4(w3, global_amax=float(w1.abs().max()), name="w1")


def test_input_scale_from_amax():
    assert float(input_scale_from_amax(2688.0)) == 1.0
    scale = input_scale_from_amax(torch.tensor(10.0))
    assert scale.dtype == torch.float32 and scale.shape == ()
    assert float(scale) == pytest.approx(10.0 / 2688)


def test_all_zero_tensor_and_blocks():
    q = quantize_nvfp4(torch.zeros(2, 32))
    assert float(q.weight_scale_2) == 1.0
    assert q.weight_scale.float().flatten().tolist() == [1.0] * 4
    assert bool((q.weight == 0).all())
    w = torch.zeros(1, 32)
    w[0, 20] = -2688.0 / 1024  # weight_scale_2 = 2**-10 exactly, so the decode is exact
    q = quantize_nvfp4(w)
    assert q.weight_scale.float().flatten().tolist()[0] == 1.0  # zero block: sb == 0 -> 1
    assert torch.equal(_decode(q), w)


def test_tiny_blocks_use_the_smallest_subnormal_scale():
    w = torch.zeros(1, 32)
    w[0, 0] = 2688.0  # weight_scale_2 = 1
    w[0, 16] = 6.0 * 2.0**-12  # block scale 2**-12 < 2**-9: clamped up to 2**-9
    q = quantize_nvfp4(w)
    assert q.weight_scale.float()[0, 1] == 2.0**-9
    assert float(_decode(q)[0, 16]) == 2.0**-9  # 0.75 units, a tie that rounds up to code 1.0


@pytest.mark.parametrize("bad", [math.nan, -math.inf])
def test_non_finite_input_names_the_tensor(bad):
    w = torch.ones(2, 16)
    w[0, 3] = bad
    with pytest.raises(FormatError, match=r"tensor 'experts.0.w3'.*NaN or Inf"):
        quantize_nvfp4(w, name="experts.0.w3")
    with pytest.raises(FormatError, match="global_amax contain NaN"):
        quantize_nvfp4(torch.ones(2, 16), global_amax=math.nan)


def test_bad_shapes():
    with pytest.raises(FormatError, match="multiple of 16"):
        quantize_nvfp4(torch.ones(2, 24), name="w")
    q = quantize_nvfp4(torch.ones(2, 32))
    with pytest.raises(FormatError, match=r"expected \[2, 2\]"):
        dequantize_nvfp4(q.weight, q.weight_scale[:, :1], q.weight_scale_2)
    with pytest.raises(FormatError, match="float8_e4m3fn"):
        dequantize_nvfp4(q.weight, q.weight_scale.float(), q.weight_scale_2)
