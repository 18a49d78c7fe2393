"""MXFP4 -> FP8 block and MXFP4 -> NVFP4: exact on realistic experts, honest reports otherwise.

Every report is checked against a full decode of both sides; the FP8 bytes are checked
against DeepSeek's float-path cast (convert.py's ``cast_e2m1fn_to_e4m3fn``, restated here).
"""

from __future__ import annotations

import pytest
import torch
from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4convert.errors import FormatError
from dsv4convert.formats import (
    ExactnessReport,
    dequantize_fp8_block,
    dequantize_mxfp4,
    dequantize_nvfp4,
    mxfp4_to_fp8_block,
    mxfp4_to_nvfp4,
    mxfp4_to_nvfp4_scales,
    nvfp4_rescale_report,
    nvfp4_global_exponent,
    quantize_mxfp4,
)

SETTINGS = settings(max_examples=30, deadline=None)


def synthetic_expert(rows: int, cols: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An MXFP4 expert weight like the released ones: Gaussian rows of varied magnitude."""
    generator = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=generator) * 0.02
    w *= torch.exp2(torch.randn(rows, 1, generator=generator))
    return quantize_mxfp4(w)


def random_mxfp4(rows: int, cols: int, seed: int, spread: int, base: int = 120):
    """Random codes and E8M0 bytes spread over ``spread`` binades below ``base``."""
    generator = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8, generator=generator).view(torch.int8)
    scale = base - torch.randint(0, spread + 1, (rows, cols // 32), generator=generator)
    # Zero out some whole blocks, which are exact whatever their scale.
    dead = torch.rand(rows, cols // 32, generator=generator) < 0.1
    packed = packed.view(rows, -1, 16).masked_fill(dead[..., None], 0).view(rows, -1)
    return packed, scale.to(torch.uint8).view(torch.float8_e8m0fnu)


def deepseek_fp8_cast(packed: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's float-path rule: tile scale = max sub-scale / 2**6, elements times sub/tile."""
    n, k = packed.shape[0], packed.shape[1] * 2
    values = unpack_fp4_from_uint8(packed.view(torch.uint8), n, k, dtype=torch.float32) + 0.0  # table has +0
    tiles = values.view(n // 128, 128, k // 128, 128).transpose(1, 2)
    sub = scale.float().view(n // 128, 128, k // 128, 4).transpose(1, 2).flatten(2)
    tile_scale = sub.amax(dim=-1, keepdim=True) / 2**6
    offset = (sub / tile_scale).unflatten(-1, (128, 4)).repeat_interleave(32, dim=-1)
    out = (tiles * offset).transpose(1, 2).reshape(n, k)
    return out.to(torch.float8_e4m3fn), tile_scale.squeeze(-1).to(torch.float8_e8m0fnu)


def full_decode_report(reference: torch.Tensor, result: torch.Tensor, block_rows: int, block_cols: int):
    equal = reference == result
    n, k = equal.shape
    per_block = equal.view(n // block_rows, block_rows, k // block_cols, block_cols).all(dim=3).all(dim=1)
    diff = (reference.double() - result.double()).abs()
    return int(per_block.sum()), per_block.numel(), int(equal.sum()), float(diff.max())


@pytest.mark.parametrize(("rows", "cols"), [(256, 512), (512, 256)])
def test_synthetic_experts_cast_to_fp8_exactly(rows, cols):
    packed, scale = synthetic_expert(rows, cols, seed=rows)
    weight, tile_scale, report = mxfp4_to_fp8_block(packed, scale, name="w1", block=(128, 128))
    assert report.exact and report.exact_fraction == 1.0 and report.max_abs_error == 0.0
    assert report.blocks_total == rows * cols // 128**2 and report.elements_total == rows * cols
    assert torch.equal(dequantize_fp8_block(weight, tile_scale, block=(128, 128)), dequantize_mxfp4(packed, scale))
    ds_weight, ds_scale = deepseek_fp8_cast(packed, scale)
    assert torch.equal(weight.view(torch.uint8), ds_weight.view(torch.uint8))
    assert torch.equal(tile_scale.view(torch.uint8), ds_scale.view(torch.uint8))


@pytest.mark.parametrize(("rows", "cols"), [(256, 512), (512, 256)])
def test_synthetic_experts_transcode_to_nvfp4_exactly(rows, cols):
    packed, scale = synthetic_expert(rows, cols, seed=rows + 1)
    nv, report = mxfp4_to_nvfp4(packed, scale)
    assert report.exact and report.blocks_total == rows * cols // 32
    assert nv.weight.dtype == torch.uint8 and nv.weight.data_ptr() == packed.data_ptr()
    assert nv.weight_scale.shape == (rows, cols // 16) and nv.weight_scale.dtype == torch.float8_e4m3fn
    k_max = int(scale.view(torch.uint8).max()) - 127
    assert float(nv.weight_scale_2) == 2.0 ** (k_max - 8)
    assert torch.equal(dequantize_nvfp4(nv.weight, nv.weight_scale, nv.weight_scale_2),
                       dequantize_mxfp4(packed, scale))


def test_w1_w3_share_one_exact_global_scale():
    p1, s1 = synthetic_expert(128, 256, seed=7)
    p3, s3 = synthetic_expert(128, 256, seed=8)
    s3 = (s3.view(torch.uint8) + 3).view(torch.float8_e8m0fnu)  # w3 is 8x larger
    m = nvfp4_global_exponent(s1, s3)
    assert m == int(torch.cat([s1.view(torch.uint8), s3.view(torch.uint8)]).max()) - 127 - 8
    for packed, scale in ((p1, s1), (p3, s3)):
        nv, report = mxfp4_to_nvfp4(packed, scale, global_exponent=m)
        assert report.exact and float(nv.weight_scale_2) == 2.0**m
        assert torch.equal(dequantize_nvfp4(nv.weight, nv.weight_scale, nv.weight_scale_2),
                           dequantize_mxfp4(packed, scale))


@SETTINGS
@given(st.integers(0, 2**31 - 1), st.integers(0, 30))
def test_fp8_report_agrees_with_full_decode(seed, spread):
    packed, scale = random_mxfp4(256, 256, seed, spread)
    weight, tile_scale, report = mxfp4_to_fp8_block(packed, scale, block=(128, 128))
    source, result = dequantize_mxfp4(packed, scale), dequantize_fp8_block(weight, tile_scale, block=(128, 128))
    blocks_exact, blocks_total, elements_exact, max_error = full_decode_report(source, result, 128, 128)
    assert (report.blocks_exact, report.blocks_total) == (blocks_exact, blocks_total)
    assert report.elements_exact == elements_exact and report.elements_total == source.numel()
    assert report.max_abs_error == max_error
    assert report.exact == torch.equal(source, result)
    if spread <= 14:  # formats.md §4: a 14-binade span always fits
        assert report.exact
    ds_weight, ds_scale = deepseek_fp8_cast(packed, scale)
    assert torch.equal(weight.view(torch.uint8), ds_weight.view(torch.uint8))
    assert torch.equal(tile_scale.view(torch.uint8), ds_scale.view(torch.uint8))


@SETTINGS
@given(st.integers(0, 2**31 - 1), st.integers(0, 30))
def test_nvfp4_report_agrees_with_full_decode(seed, spread):
    packed, scale = random_mxfp4(64, 256, seed, spread)
    nv, report = mxfp4_to_nvfp4(packed, scale)
    source = dequantize_mxfp4(packed, scale)
    result = dequantize_nvfp4(nv.weight, nv.weight_scale, nv.weight_scale_2)
    blocks_exact, blocks_total, elements_exact, max_error = full_decode_report(source, result, 1, 32)
    assert (report.blocks_exact, report.blocks_total) == (blocks_exact, blocks_total)
    assert report.elements_exact == elements_exact
    assert report.max_abs_error == pytest.approx(max_error, rel=1e-6)
    assert report.exact == torch.equal(source, result)
    if spread <= 17:  # formats.md §4: k_max - k_j <= 17 for every block
        assert report.exact


@SETTINGS
@given(st.integers(0, 2**31 - 1), st.integers(0, 30))
def test_nvfp4_scales_alone_and_the_outside_codes_give_the_full_transcode(seed, spread):
    """A converter copies the codes unread and reads only the outside blocks: same scales, same report."""
    packed, scale = random_mxfp4(64, 256, seed, spread)
    nv, report = mxfp4_to_nvfp4(packed, scale)
    rescale = mxfp4_to_nvfp4_scales(scale)
    assert torch.equal(rescale.weight_scale.view(torch.uint8), nv.weight_scale.view(torch.uint8))
    assert torch.equal(rescale.weight_scale_2, nv.weight_scale_2)
    rows, cols = rescale.outside
    if spread <= 17:  # formats.md §4: within 17 binades no block leaves the window
        assert rows.numel() == 0
    codes = packed.view(torch.uint8).reshape(64, -1, 16)[rows, cols]
    assert nvfp4_rescale_report(rescale, scale, codes) == report


def test_nvfp4_out_of_window_block_is_rounded_and_counted():
    packed = torch.full((1, 48), 0x11, dtype=torch.uint8)  # every code 0.5
    packed[0, 32:] = 0  # third block: all zero codes
    scale = torch.tensor([[127, 127 - 20, 127 - 30]], dtype=torch.uint8)
    nv, report = mxfp4_to_nvfp4(packed, scale)
    assert float(nv.weight_scale_2) == 2.0**-8
    # Block 2: 2**(-20 + 8) = 2**-12 is under E4M3's window, so it gets the nearest non-zero 2**-9.
    assert nv.weight_scale.float().tolist() == [[256.0, 256.0, 2.0**-9, 2.0**-9, 2.0**-9, 2.0**-9]]
    assert (report.blocks_total, report.blocks_exact) == (3, 2)
    assert (report.elements_total, report.elements_exact) == (96, 64)
    assert report.max_abs_error == 0.5 * (2.0**-17 - 2.0**-20)
    assert report.exact_fraction == pytest.approx(2 / 3) and not report.exact


def test_nvfp4_block_above_the_window_saturates_at_448():
    packed = torch.full((1, 32), 0x77, dtype=torch.uint8)  # every code 6
    scale = torch.tensor([[127, 100]], dtype=torch.uint8)
    nv, report = mxfp4_to_nvfp4(packed, scale, global_exponent=-27 - 8)
    assert nv.weight_scale.float().tolist() == [[448.0, 448.0, 256.0, 256.0]]
    assert report.blocks_exact == 1 and report.max_abs_error == 6 * (1.0 - 448 * 2.0**-35)


def test_global_exponent_ignores_zero_sentinel_and_handles_all_zero():
    assert nvfp4_global_exponent(torch.zeros(4, 4, dtype=torch.uint8)) == 0
    scale = torch.tensor([[0, 100]], dtype=torch.uint8).view(torch.float8_e8m0fnu)
    assert nvfp4_global_exponent(scale) == 100 - 127 - 8
    assert nvfp4_global_exponent(torch.ones(1, 1, dtype=torch.uint8)) == -126  # clamped to float32 normals
    packed = torch.zeros(2, 16, dtype=torch.int8)
    nv, report = mxfp4_to_nvfp4(packed, torch.zeros(2, 1, dtype=torch.uint8))
    assert report.exact and float(nv.weight_scale_2) == 1.0


def test_fp8_writes_code_8_as_positive_zero():
    packed = torch.full((128, 64), 0x88, dtype=torch.uint8).view(torch.int8)  # -0 everywhere
    weight, _, report = mxfp4_to_fp8_block(packed, torch.full((128, 4), 120, dtype=torch.uint8), block=(128, 128))
    assert report.exact and bool((weight.view(torch.uint8) == 0).all())


def test_fp8_tile_exponent_is_clamped_at_e8m0_floor():
    packed = torch.full((128, 64), 0x77, dtype=torch.uint8).view(torch.int8)
    scale = torch.full((128, 4), 2, dtype=torch.uint8)  # 2**-125: tile exponent -131 -> -127
    weight, tile_scale, report = mxfp4_to_fp8_block(packed, scale, block=(128, 128))
    assert int(tile_scale.view(torch.uint8)) == 0 and report.exact
    assert torch.equal(dequantize_fp8_block(weight, tile_scale, block=(128, 128)), dequantize_mxfp4(packed, scale))


def test_report_merge_and_fraction():
    a = ExactnessReport(4, 4, 128, 128, 0.0)
    b = ExactnessReport(4, 1, 128, 40, 0.25)
    merged = a.merged(b)
    assert merged == ExactnessReport(8, 5, 256, 168, 0.25)
    assert merged.exact_fraction == 5 / 8 and not merged.exact and a.exact
    assert ExactnessReport(0, 0, 0, 0, 0.0).exact_fraction == 1.0


def test_bad_inputs_name_the_tensor():
    packed, scale = synthetic_expert(128, 128, seed=0)
    bad_scale = scale.view(torch.uint8).clone()
    bad_scale[3, 1] = 255
    for call in (lambda *a, **k: mxfp4_to_fp8_block(*a, block=(128, 128), **k), mxfp4_to_nvfp4):
        with pytest.raises(FormatError, match=r"tensor 'layers.3.ffn.experts.9.w2'.*0xFF"):
            call(packed, bad_scale, name="layers.3.ffn.experts.9.w2")
        with pytest.raises(FormatError, match="does not match"):
            call(packed, scale[:, :2], name="w")
    with pytest.raises(FormatError, match="N a multiple of 128"):
        mxfp4_to_fp8_block(packed[:64], scale[:64], block=(128, 128))
    with pytest.raises(FormatError, match="a multiple of 32"):
        mxfp4_to_fp8_block(packed, scale, block=(32, 16))
    with pytest.raises(FormatError, match="float32's normal range"):
        mxfp4_to_nvfp4(packed, scale, global_exponent=-130)
    with pytest.raises(FormatError, match=r"scale\[1\]"):
        nvfp4_global_exponent(scale, bad_scale)


def test_mxfp4_to_fp8_in_deepseek_v41_32x32_tiles_is_exact():
    """DeepSeek-V4.1's FP8 blocks are 32x32 (``block=(32, 32)``): one MXFP4 block per tile row, exact while the 32 rows'
    scales span at most 14 binades (these do); one scale per tile; a tile not a multiple of MXFP4's 32 is refused."""
    packed, scale = synthetic_expert(64, 96, seed=3)
    weight, tile_scale, report = mxfp4_to_fp8_block(packed, scale, block=(32, 32))
    assert tile_scale.shape == (2, 3) and report.exact and report.blocks_total == 6
    assert torch.equal(dequantize_fp8_block(weight, tile_scale, block=(32, 32)), dequantize_mxfp4(packed, scale))
    with pytest.raises(FormatError, match="a multiple of 48"):
        mxfp4_to_fp8_block(packed, scale, block=(48, 48))
