"""Served numerics (formats/activations.py, formats/kv_cache.py): bit-exact against the weight
quantizers of dsv4convert.formats where the format is the same, the SGLang kernels' rules at their
edges (floors, ties, saturation, flushed scales), idempotence, and bad input refused."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from dsv4convert.errors import FormatError
from dsv4convert.formats import (
    dequantize_fp8_block,
    dequantize_mxfp4,
    dequantize_nvfp4,
    input_scale_from_amax,
    quantize_fp8_block,
    quantize_mxfp4,
    quantize_nvfp4,
)
from dsv4convert.formats.activations import (
    FP8_AMAX_FLOOR,
    ActivationFormatError,
    fp8_token_groups,
    mxfp8_activations,
    nvfp4_activations,
)
from dsv4convert.formats.kv_cache import (
    CACHE_AMAX_FLOOR,
    hadamard_transform,
    indexer_fp4,
    indexer_fp8,
    kv_cache_fp8,
    round_e2m1_threshold,
)
from dsv4convert.formats.numerics import ceil_log2, divide, exp2_float32

SETTINGS = settings(max_examples=40, deadline=None)
E4M3_NORMAL_MIN = 2.0**-6


@st.composite
def activations(draw, group: int, max_groups: int = 3):
    """Activations ``[*lead, groups * group]``: Gaussian at a random magnitude, with one edge case
    planted in the first group of every row (all zero, all equal, one outlier, spread binades)."""
    lead = draw(st.lists(st.integers(1, 3), max_size=2))
    groups = draw(st.integers(1, max_groups))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    x = torch.randn(*lead, groups, group, generator=generator) * 2.0 ** draw(st.integers(-20, 20))
    case = draw(st.sampled_from(["gaussian", "zeros", "equal", "outlier", "spread"]))
    if case == "zeros":
        x[..., 0, :] = 0.0
    elif case == "equal":
        x[..., 0, :] = draw(st.floats(-1e4, 1e4, allow_nan=False, width=32))
    elif case == "outlier":
        x[..., 0, 0] *= 2.0 ** draw(st.integers(4, 12))
    elif case == "spread":
        x *= torch.exp2(-torch.randint(0, 8, (*lead, groups, 1), generator=generator).float())
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    return x.reshape(*lead, groups * group).to(dtype)


def group_amax(x: torch.Tensor, group: int) -> torch.Tensor:
    return x.float().reshape(*x.shape[:-1], -1, group).abs().amax(dim=-1)


def fp8_block_rows(x: torch.Tensor, group: int, scale_fmt: str) -> torch.Tensor:
    """formats.fp8_block applied to every row as a [1, K] matrix in 1 x group blocks."""
    rows = x.float().reshape(-1, x.shape[-1])
    out = [dequantize_fp8_block(*quantize_fp8_block(r[None], block=(1, group), scale_fmt=scale_fmt),
                                block=(1, group))[0]
           for r in rows]
    return torch.stack(out).reshape(x.shape)


def e4m3_step(v: torch.Tensor) -> torch.Tensor:
    """Spacing of E4M3 numbers at |v| (subnormal spacing 2**-9 below 2**-6)."""
    exponent = torch.floor(torch.log2(v.abs().clamp(min=E4M3_NORMAL_MIN)))
    return torch.exp2(exponent - 3)


# ---------------------------------------------------------------- FP8 per token group

@SETTINGS
@given(activations(128), st.sampled_from([32, 64, 128]))
def test_fp8_ue8m0_is_bit_exact_with_fp8_block_on_a_row_view(x, group):
    amax = group_amax(x, group)
    assume(not bool(((amax > 0) & (amax < FP8_AMAX_FLOOR)).any()))
    out = fp8_token_groups(x, group, scale_format="ue8m0", out_dtype=torch.float32)
    assert torch.equal(out, fp8_block_rows(x, group, "ue8m0"))


def test_fp8_ue8m0_exponent_rule_matches_the_exact_ceiling_over_every_bf16_amax_and_an_fp32_binade():
    # The kernels take ceil(log2(amax * fl(1/448))) from the bits; formats.fp8_block takes
    # ceil(log2(fl(amax / 448))). Every positive finite bf16 amax through the function itself:
    amaxes = torch.arange(1, 0x7F80, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    amaxes = amaxes[amaxes.float() >= FP8_AMAX_FLOOR]
    x = torch.zeros(amaxes.numel(), 32, dtype=torch.bfloat16)
    x[:, 0] = amaxes
    exponent = ceil_log2(divide(amaxes.float(), 448.0))
    expected = (amaxes.float() * exp2_float32(-exponent)).to(torch.float8_e4m3fn).float() * exp2_float32(exponent)
    assert torch.equal(fp8_token_groups(x, 32, scale_format="ue8m0", out_dtype=torch.float32)[:, 0], expected)
    # ... and the arithmetic fact behind it for every float32 mantissa of one binade (the rule is
    # invariant under powers of two away from under/overflow).
    binade = ((torch.tensor(130, dtype=torch.int64) << 23) | torch.arange(1 << 23)).to(torch.int32).view(torch.float32)
    by_product = ceil_log2(binade * torch.tensor(1.0 / 448.0, dtype=torch.float32))
    assert torch.equal(by_product, ceil_log2(divide(binade, 448.0)))


def test_fp8_float32_scale_is_amax_times_rounded_reciprocal_and_codes_agree_with_fp8_block():
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(64, 1024, generator=generator) * torch.exp2(torch.randint(-8, 8, (64, 1), generator=generator))
    out = fp8_token_groups(x, 128, scale_format="float32")
    amax = group_amax(x, 128)
    scale = amax * torch.tensor(1.0 / 448.0)
    # The largest element of every group maps onto code 448: it comes back as 448 * s.
    peak = out.reshape(64, 8, 128).abs().amax(dim=-1)
    assert torch.equal(peak, 448.0 * scale)
    # The kernel multiplies by fl(448/amax) where fp8_block divides by fl(amax/448), and its scale is
    # amax * fl(1/448), not fl(amax/448): the values differ in the last bits, the E4M3 codes only
    # for elements within a few ulps of a rounding midpoint, and then by one E4M3 step.
    ours = (out / scale.repeat_interleave(128, dim=1)).to(torch.float8_e4m3fn).float()
    reference_scale = divide(amax, 448.0).repeat_interleave(128, dim=1)
    theirs = (fp8_block_rows(x, 128, "float32") / reference_scale).to(torch.float8_e4m3fn).float()
    differ = ours != theirs
    assert int(differ.sum()) <= x.numel() // 1000
    assert bool(((ours - theirs).abs() <= e4m3_step(ours)).all())
    assert bool(((out - theirs * reference_scale).abs() <= e4m3_step(ours) * reference_scale * 1.0001).all())


@SETTINGS
@given(activations(128))
def test_fp8_properties_zero_equal_outlier_groups(x):
    for scale_format in ("float32", "ue8m0"):
        out = fp8_token_groups(x, 128, scale_format=scale_format, out_dtype=torch.float32)
        first = x.float().reshape(*x.shape[:-1], -1, 128)[..., 0, :]
        first_out = out.reshape(*x.shape[:-1], -1, 128)[..., 0, :]
        assert not bool(torch.isnan(out).any())
        # Signs survive, zeros stay zero, and nothing grows past the group's amax by more than half
        # an E4M3 step (UE8M0 rounds the amax itself) or the float32 rounding of s (code 448 * s).
        assert bool((torch.sign(out) * torch.sign(x.float()) >= 0).all())
        assert bool((out[x.float() == 0] == 0).all())
        amax = group_amax(x, 128).clamp(min=FP8_AMAX_FLOOR).repeat_interleave(128, dim=-1)
        slack = 2**-4 if scale_format == "ue8m0" else 2**-22
        assert bool((out.abs() <= amax * (1 + slack)).all())
        # An all-equal group comes back uniform; with a float32 scale it is the value itself to
        # within the two roundings of s = amax * fl(1/448), unless its amax is below the floor
        # (then s = floor / 448 and the group flushes toward zero, as the server's does).
        if bool((first == first[..., :1]).all()):
            assert bool((first_out == first_out[..., :1]).all())
            if scale_format == "float32" and bool((first.abs() >= FP8_AMAX_FLOOR).all()):
                assert bool(((first_out - first).abs() <= first.abs() * 2**-22).all())
        # Relative error of the group's largest element is at most half an E4M3 ulp (2**-4).
        big = x.float().abs() >= amax * 0.999
        assert bool(((out - x.float()).abs()[big] <= amax[big] * 2**-4).all())


def test_fp8_ue8m0_equals_the_torch_reference_of_the_triton_kernels():
    # dsv4convert.kernels.reference quantizes activations for the project's own FP8 GEMMs; on rows
    # SGLang accepts it is the same rule.
    from dsv4convert.kernels.reference import dequantize_activations_fp8, quantize_activations_fp8

    generator = torch.Generator().manual_seed(7)
    x = torch.randn(32, 512, generator=generator) * torch.exp2(torch.randint(-30, 30, (32, 1), generator=generator))
    x[0] = 0.0
    assert torch.equal(fp8_token_groups(x, 128, scale_format="ue8m0"),
                       dequantize_activations_fp8(*quantize_activations_fp8(x, group=128), group=128))


@SETTINGS
@given(activations(128))
def test_fp8_ue8m0_is_idempotent(x):
    once = fp8_token_groups(x, 128, scale_format="ue8m0", out_dtype=torch.float32)
    assert torch.equal(fp8_token_groups(once, 128, scale_format="ue8m0"), once)


def test_fp8_hand_worked():
    x = torch.zeros(1, 128)
    x[0, :4] = torch.tensor([1.0, -0.5, 1.1, 2.0**-12])
    # UE8M0: amax 1.1, s = 2**ceil(log2(1.1/448)) = 2**-8; 1.1 * 256 = 281.6 rounds to 288.
    out = fp8_token_groups(x, 128, scale_format="ue8m0")
    assert out[0, :4].tolist() == [1.0, -0.5, 288 / 256, 2.0**-12]
    # float32: s = 1.1 * fl(1/448), codes x * fl(448/1.1): the amax lands on 448, 1.0 on 407.3 -> 416.
    out = fp8_token_groups(x, 128, scale_format="float32")
    s = torch.tensor(1.1) * torch.tensor(1.0 / 448.0)
    assert out[0, 2] == 448 * s and out[0, 0] == 416 * s and out[0, 1] == -208 * s


def test_fp8_rejects_ragged_rows_unknown_format_and_non_float_input():
    with pytest.raises(ActivationFormatError, match=r"\[2, 100\].*multiple of the group size 128"):
        fp8_token_groups(torch.zeros(2, 100), 128, scale_format="ue8m0", name="layers.0.attn.wq_a")
    with pytest.raises(ActivationFormatError, match="scale_format"):
        fp8_token_groups(torch.zeros(2, 128), 128, scale_format="e8m0")
    with pytest.raises(ActivationFormatError, match="float32 or bfloat16"):
        fp8_token_groups(torch.zeros(2, 128, dtype=torch.float16), 128, scale_format="ue8m0")
    with pytest.raises(ActivationFormatError, match="group size"):
        fp8_token_groups(torch.zeros(2, 128), 0, scale_format="ue8m0")


# ---------------------------------------------------------------- NVFP4 W4A4

@SETTINGS
@given(activations(16, max_groups=4), st.floats(1.0, 16.0), st.integers(0, 24))
def test_nvfp4_is_bit_exact_with_quantize_nvfp4_given_the_same_global_scale(x, headroom, spread):
    # Blocks spread over binades reach subnormal E4M3 block scales; the calibrated amax may exceed
    # the tensor's (headroom), as a real input_scale does.
    rows = x.float().reshape(-1, x.shape[-1] // 16, 16)
    binades = torch.randint(0, spread + 1, (*rows.shape[:2], 1), generator=torch.Generator().manual_seed(spread))
    rows = (rows * torch.exp2(-binades.float())).reshape(-1, x.shape[-1])
    tensor_amax = float(rows.abs().max())
    assume(tensor_amax > 0)
    global_amax = torch.tensor(tensor_amax * headroom, dtype=torch.float32)
    input_scale = input_scale_from_amax(global_amax)
    block_scale = group_amax(rows, 16) / (6.0 * input_scale)
    flushed = (block_scale > 0) & (block_scale <= 2.0**-10)
    out = nvfp4_activations(rows, input_scale)
    q = quantize_nvfp4(rows, global_amax=global_amax)
    reference = dequantize_nvfp4(q.weight, q.weight_scale, q.weight_scale_2)
    keep = ~flushed.repeat_interleave(16, dim=-1)
    assert torch.equal(out[keep], reference[keep])
    # The kernel's E4M3 cast rounds a block scale at or below 2**-10 to 0: that block is served as 0.
    assert bool((out[~keep] == 0).all())


def test_nvfp4_bit_exact_over_thirty_binades_of_block_amax():
    generator = torch.Generator().manual_seed(6)
    x = torch.randn(64, 32, 16, generator=generator) * torch.exp2(-torch.randint(0, 30, (64, 32, 1), generator=generator))
    x = x.reshape(64, 512).bfloat16().float()
    global_amax = x.abs().max() * 1.5
    input_scale = input_scale_from_amax(global_amax)
    block_scale = group_amax(x, 16) / (6.0 * input_scale)
    flushed = (block_scale > 0) & (block_scale <= 2.0**-10)
    subnormal = (block_scale > 2.0**-10) & (block_scale < E4M3_NORMAL_MIN)
    assert int(flushed.sum()) > 50 and int(subnormal.sum()) > 50  # both regimes are exercised
    q = quantize_nvfp4(x, global_amax=global_amax)
    reference = dequantize_nvfp4(q.weight, q.weight_scale, q.weight_scale_2)
    out = nvfp4_activations(x, input_scale)
    keep = ~flushed.repeat_interleave(16, dim=-1)
    assert torch.equal(out[keep], reference[keep]) and bool((out[~keep] == 0).all())
    assert bool((reference[~keep] != 0).any())  # where ModelOpt's 2**-9 clamp keeps what the kernel drops


def test_nvfp4_hand_worked_ties_saturation_and_flush():
    input_scale = torch.tensor(1.0)  # global amax 2688
    x = torch.zeros(3, 16)
    x[0, :4] = torch.tensor([6.0, -1.0, 0.75, 2.5])  # block scale 1: 0.75 ties up to 1, 2.5 down to 2
    x[1, :2] = torch.tensor([6.0 * 448.0 * 4, -3.0])  # beyond the calibrated range: scale 448, clip at 6
    x[2, 0] = 6.0 * 2.0**-11  # block scale 2**-11 rounds to 0 in E4M3: the block is served as zero
    out = nvfp4_activations(x, input_scale)
    assert out[0, :4].tolist() == [6.0, -1.0, 1.0, 2.0]
    assert out[1, :2].tolist() == [6.0 * 448.0, 0.0]  # -3 / 448 is below the first E2M1 step
    assert out[2].abs().sum() == 0
    assert torch.equal(nvfp4_activations(x.bfloat16(), input_scale).float(), out)


@SETTINGS
@given(activations(16, max_groups=4), st.floats(1.0, 4.0))
def test_nvfp4_is_idempotent_where_block_scales_are_normal(x, headroom):
    amax = float(x.float().abs().max())
    assume(amax > 0)
    input_scale = input_scale_from_amax(amax * headroom)
    block_scale = group_amax(x, 16) / (6.0 * input_scale)
    assume(bool(((block_scale == 0) | (block_scale >= E4M3_NORMAL_MIN)).all()))
    once = nvfp4_activations(x, input_scale, out_dtype=torch.float32)
    assert torch.equal(nvfp4_activations(once, input_scale), once)


def test_nvfp4_rejects_bad_input_scale_and_shapes():
    x = torch.ones(2, 32)
    for bad in (0.0, -1.0, float("nan"), float("inf"), torch.ones(2)):
        with pytest.raises(ActivationFormatError, match="input_scale"):
            nvfp4_activations(x, bad, name="layers.3.ffn.experts")
    with pytest.raises(ActivationFormatError, match=r"\[2, 24\].*16"):
        nvfp4_activations(torch.ones(2, 24), 1.0)


# ---------------------------------------------------------------- MXFP8 W4A8

@SETTINGS
@given(activations(32, max_groups=4))
def test_mxfp8_equals_fp8_ue8m0_per_32_and_fp8_block_on_a_row_view(x):
    amax = group_amax(x, 32)
    assume(not bool(((amax > 0) & (amax < FP8_AMAX_FLOOR)).any()))
    out = mxfp8_activations(x, out_dtype=torch.float32)
    assert torch.equal(out, fp8_token_groups(x, 32, scale_format="ue8m0", out_dtype=torch.float32))
    assert torch.equal(out, fp8_block_rows(x, 32, "ue8m0"))


def test_mxfp8_scale_rounds_up_with_no_floor_and_zero_blocks_stay_zero():
    x = torch.zeros(4, 32)
    x[0, 0] = 448.0  # amax / 448 = 1 exactly: scale 1
    x[1, 0] = 449.0  # just above: rounded up to 2 (a floor rule would clip 449 to 448)
    x[2, 0] = 1e-30  # far below the FP8 linears' 1e-10 floor: MXFP8 keeps it
    out = mxfp8_activations(x)
    assert out[0, 0] == 448.0 and out[1, 0] == 448.0 and out[1, 0] / 2 == 224.0
    exponent = ceil_log2(divide(torch.tensor(1e-30), 448.0))
    assert out[2, 0] == (torch.tensor(1e-30) * exp2_float32(-exponent)).to(torch.float8_e4m3fn).float() * exp2_float32(exponent)
    assert out[2, 0] != 0 and fp8_token_groups(x, 32, scale_format="ue8m0")[2, 0] == 0
    assert out[3].abs().sum() == 0 and not bool(torch.isnan(out).any())


@SETTINGS
@given(activations(32), st.integers(1, 31))
def test_mxfp8_pads_a_ragged_tail_with_zeros_and_is_idempotent(x, cut):
    x = x[..., :-cut] if x.shape[-1] > cut else x
    padded = torch.nn.functional.pad(x.float(), (0, -x.shape[-1] % 32))
    out = mxfp8_activations(x, out_dtype=torch.float32)
    assert out.shape == x.shape
    assert torch.equal(out, mxfp8_activations(padded)[..., : x.shape[-1]])
    assert torch.equal(mxfp8_activations(out), out)


# ---------------------------------------------------------------- KV cache

@SETTINGS
@given(activations(64, max_groups=7), st.booleans())
def test_kv_cache_nope_dims_are_fp8_block_per_64_and_rope_dims_bf16(nope, bf16_source):
    rope = torch.randn(*nope.shape[:-1], 64).to(nope.dtype)
    kv = torch.cat([nope, rope], dim=-1)
    amax = group_amax(nope, 64)
    assume(not bool(((amax > 0) & (amax < CACHE_AMAX_FLOOR)).any()))
    out = kv_cache_fp8(kv, rope_dim=64, bf16_source=bf16_source, out_dtype=torch.float32)
    source = nope.bfloat16() if bf16_source else nope
    assert torch.equal(out[..., : nope.shape[-1]], fp8_block_rows(source, 64, "ue8m0"))
    assert torch.equal(out[..., nope.shape[-1]:], rope.bfloat16().float())
    # What the cache holds is exact in BF16 (E4M3 times a power of two), as the reader returns it.
    assert torch.equal(kv_cache_fp8(kv, rope_dim=64, bf16_source=bf16_source, out_dtype=torch.bfloat16).float(), out)
    assert torch.equal(kv_cache_fp8(out, rope_dim=64), out)


def test_kv_cache_real_layout_floor_and_source_rounding():
    kv = torch.zeros(2, 512)
    kv[0, 0] = 1e-6  # below the 1e-4 floor: scale 2**ceil(log2(1e-4/448)) = 2**-22
    kv[0, 448:] = 1.0 + 2.0**-10  # RoPE dims: rounded to BF16 (1 + 2**-10 is not a BF16 number)
    kv[1, 64] = 1.0 + 2.0**-9 + 2.0**-12  # in a float32 source 1.00244 rounds to 1.0 in E4M3 ...
    out = kv_cache_fp8(kv, rope_dim=64)
    assert out[0, 0] == round(1e-6 * 2**22) * 2.0**-22
    assert bool((out[0, 448:] == 1.0).all())
    assert out[1, 64] == 1.0
    assert kv_cache_fp8(torch.zeros(3, 512), rope_dim=64).abs().sum() == 0


def test_kv_cache_rejects_a_layout_it_cannot_hold():
    for shape, rope in (((2, 500), 64), ((2, 64), 64), ((2, 128), -1), ((2, 128), True)):
        with pytest.raises(ActivationFormatError, match="rope_dim"):
            kv_cache_fp8(torch.zeros(shape), rope_dim=rope, name="layers.2.attn.kv")


# ---------------------------------------------------------------- indexer

def sylvester_hadamard(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.kron(torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64), h)
    return h / math.sqrt(n)


@pytest.mark.parametrize("n", [1, 2, 64, 128])
def test_hadamard_is_the_orthonormal_sylvester_matrix_and_its_own_inverse(n):
    x = torch.randn(3, 5, n, generator=torch.Generator().manual_seed(n))
    y = hadamard_transform(x)
    assert torch.allclose(y.double(), x.double() @ sylvester_hadamard(n), rtol=0, atol=1e-5)
    assert torch.allclose(hadamard_transform(y), x, rtol=0, atol=1e-5)
    assert hadamard_transform(x.bfloat16()).dtype == torch.bfloat16
    with pytest.raises(ActivationFormatError, match="power-of-two"):
        hadamard_transform(torch.zeros(2, 96))


@SETTINGS
@given(activations(128, max_groups=1))
def test_indexer_fp8_one_float32_scale_per_row(x):
    out = indexer_fp8(x, rotate=False, out_dtype=torch.float32)
    amax = x.float().abs().amax(dim=-1, keepdim=True)
    scale = amax.clamp(min=CACHE_AMAX_FLOOR) / torch.tensor(448.0)
    codes = (out / scale).to(torch.float8_e4m3fn).float()
    assert torch.equal(codes * scale, out)  # E4M3 codes times the row's float32 s
    assert bool((out.abs().amax(dim=-1, keepdim=True)[amax >= CACHE_AMAX_FLOOR] ==
                 (448.0 * scale)[amax >= CACHE_AMAX_FLOOR]).all())
    assert bool(((out - x.float()).abs() <= e4m3_step(x.float() / scale) * scale).all())


def test_indexer_fp8_agrees_with_fp8_block_float32_and_rotation_preserves_scores():
    generator = torch.Generator().manual_seed(2)
    k = torch.randn(256, 128, generator=generator)
    q = torch.randn(8, 128, generator=generator)
    # fp8_block's float32 scale is the same fl(amax/448); it divides where the kernel multiplies
    # by fl(1/s), so codes differ only next to rounding midpoints.
    differ = indexer_fp8(k, rotate=False) != fp8_block_rows(k, 128, "float32")
    assert int(differ.sum()) <= k.numel() // 1000
    # rotate=True is H(Q(Hx)): the same as quantizing in the rotated basis and rotating back.
    assert torch.equal(indexer_fp8(k), hadamard_transform(indexer_fp8(hadamard_transform(k), rotate=False)))
    served = (hadamard_transform(indexer_fp8(q)) @ hadamard_transform(indexer_fp8(k)).T)
    assert torch.allclose(indexer_fp8(q) @ indexer_fp8(k).T, served, rtol=0, atol=1e-4)


def test_indexer_fp4_threshold_rounding_ties_toward_zero_and_no_negative_zero():
    v = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -0.2, -0.75, -5.0, 0.26, 0.76, 1.76, 3.51])
    assert round_e2m1_threshold(v).tolist() == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                                                0.0, -0.5, -4.0, 0.5, 1.0, 2.0, 4.0]
    assert not bool(torch.signbit(round_e2m1_threshold(v[8:9])).any())
    # A block with amax 6 has scale 2**0: the codes are the rounded values themselves.
    x = torch.zeros(1, 32)
    x[0, :5] = torch.tensor([6.0, 0.75, -1.75, 3.5, -0.1])
    out = indexer_fp4(x, rotate=False)
    assert out[0, :5].tolist() == [6.0, 0.5, -1.5, 3.0, 0.0] and not bool(torch.signbit(out[0, 4]))


def test_indexer_fp4_is_bit_exact_with_mxfp4_away_from_ties():
    # Same ceil rule as DeepSeek's MXFP4 (formats.mxfp4) above the 1e-4 floor; the codes differ only
    # at exact E2M1 ties, which random float32 data does not hit.
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(64, 128, generator=generator) * torch.exp2(torch.randint(-10, 10, (64, 4, 1),
                                                                             generator=generator)).repeat_interleave(32, 1).reshape(64, 128)
    out = indexer_fp4(x, rotate=False)
    assert torch.equal(out, dequantize_mxfp4(*quantize_mxfp4(x)))
    assert torch.equal(indexer_fp4(x), hadamard_transform(indexer_fp4(hadamard_transform(x), rotate=False)))


@SETTINGS
@given(activations(32, max_groups=4))
def test_indexer_fp4_floor_and_idempotence(x):
    once = indexer_fp4(x, rotate=False, out_dtype=torch.float32)
    assert torch.equal(indexer_fp4(once, rotate=False), once)
    amax = group_amax(x, 32).clamp(min=CACHE_AMAX_FLOOR)
    scale = exp2_float32(ceil_log2(amax / torch.tensor(6.0))).repeat_interleave(32, dim=-1)
    codes = once / scale
    assert bool(torch.isin(codes.abs(), torch.tensor([0.0, 0.5, 1, 1.5, 2, 3, 4, 6])).all())


# ---------------------------------------------------------------- every function

FUNCTIONS = {
    "fp8_float32": lambda x, **kw: fp8_token_groups(x, 128, scale_format="float32", **kw),
    "fp8_ue8m0": lambda x, **kw: fp8_token_groups(x, 128, scale_format="ue8m0", **kw),
    "nvfp4": lambda x, **kw: nvfp4_activations(x, 0.01, **kw),
    "mxfp8": lambda x, **kw: mxfp8_activations(x, **kw),
    "kv_cache": lambda x, **kw: kv_cache_fp8(x, rope_dim=64, **kw),
    "indexer_fp8": lambda x, **kw: indexer_fp8(x, **kw),
    "indexer_fp4": lambda x, **kw: indexer_fp4(x, **kw),
}


@pytest.mark.parametrize("fn", FUNCTIONS.values(), ids=FUNCTIONS.keys())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shape_dtype_zeros_and_non_finite_input(fn, dtype):
    x = torch.randn(2, 3, 256, generator=torch.Generator().manual_seed(4)).to(dtype)
    out = fn(x)
    assert out.shape == x.shape and out.dtype == dtype
    assert fn(x, out_dtype=torch.float32).dtype == torch.float32
    assert fn(x[0, 0]).shape == (256,)
    assert fn(torch.zeros(4, 256, dtype=dtype)).abs().sum() == 0
    assert not torch.equal(out.float(), x.float())  # it did quantize
    for bad in (float("nan"), float("inf"), float("-inf")):
        poisoned = x.clone()
        poisoned[1, 2, 200] = bad
        with pytest.raises(ActivationFormatError, match="NaN or Inf") as caught:
            fn(poisoned, name="layers.5.ffn")
        assert isinstance(caught.value, ValueError) and isinstance(caught.value, FormatError)
        assert "layers.5.ffn" in str(caught.value)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("fn", FUNCTIONS.values(), ids=FUNCTIONS.keys())
def test_cuda_matches_cpu_bit_for_bit(fn):
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(64, 512, generator=generator) * torch.exp2(torch.randint(-12, 12, (64, 1), generator=generator))
    for dtype in (torch.float32, torch.bfloat16):
        cpu = fn(x.to(dtype), out_dtype=torch.float32)
        assert torch.equal(fn(x.to(dtype).cuda(), out_dtype=torch.float32).cpu(), cpu)
