"""The INT4 squared-error scale search ("mse" rule): never worse than amax / 7.5, exact, deterministic.

Errors here are computed exactly (Fractions of the float64 differences, which are exact: a
difference of a float32 weight and a 12-bit ``q * scale`` spans fewer than 53 bits), so the
comparisons do not depend on any rounding of our own. compressed-tensors 0.18.0 decodes the
stored tensors, whichever rule chose the scales.
"""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4convert.errors import FormatError
from dsv4convert.formats import (
    dequantize_int4,
    dequantize_mxfp4,
    error_metrics,
    int4_group_scales,
    quantize_int4,
    quantize_int4_weight,
)
from dsv4convert.formats import int4
from dsv4convert.synth import realistic_mxfp4

SETTINGS = settings(max_examples=40, deadline=None)


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@st.composite
def groups(draw):
    """Weights [rows, groups * g] in the shapes that make scale choices differ."""
    group_size = draw(st.sampled_from([32, 128]))
    rows = draw(st.integers(1, 4))
    cols = draw(st.integers(1, 3)) * group_size
    gen = _generator(draw(st.integers(0, 2**31 - 1)))
    kind = draw(st.sampled_from(["gaussian", "heavy", "outlier", "mxfp4", "constant"]))
    if kind == "gaussian":
        w = torch.randn(rows, cols, generator=gen)
    elif kind == "heavy":   # Student-t-like: a Gaussian over the root of a chi-square of 3
        w = torch.randn(rows, cols, generator=gen) / (torch.randn(rows, cols, 3, generator=gen).square().mean(-1)).sqrt()
    elif kind == "outlier":
        w = torch.randn(rows, cols, generator=gen)
        w[:, draw(st.integers(0, cols - 1))] = draw(st.sampled_from([-1.0, 1.0])) * draw(st.floats(5, 500))
    elif kind == "mxfp4":
        packed, scale = realistic_mxfp4(rows, cols, gen)
        w = dequantize_mxfp4(packed, scale)
    else:                   # every element equal: ties between candidates
        w = torch.full((rows, cols), draw(st.sampled_from([1.0, -3.0, 0.1])))
    w = w * 2.0 ** draw(st.integers(-20, 20))
    w[:, :group_size] *= draw(st.sampled_from([0.0, 1.0, 1.0]))  # sometimes an all-zero group
    return w.to(draw(st.sampled_from([torch.float32, torch.bfloat16]))), group_size


def _exact_group_errors(w: torch.Tensor, scale: torch.Tensor, group_size: int) -> list[Fraction]:
    """Exact ``sum (w - q * scale)^2`` per group (row-major) for the codes stored under ``scale``."""
    codes = quantize_int4(w, scale, group_size=group_size)
    diff = w.double() - codes.double() * scale.double().repeat_interleave(group_size, dim=1)
    return [sum((Fraction(x) ** 2 for x in group), Fraction(0))
            for group in diff.reshape(-1, group_size).tolist()]


def _candidates(w: torch.Tensor, group_size: int) -> torch.Tensor:
    amax = w.float().unflatten(-1, (w.shape[1] // group_size, group_size)).abs().amax(-1)
    return int4.mse_candidate_scales(amax, w.dtype).to(torch.bfloat16)


@SETTINGS
@given(groups())
def test_search_is_never_worse_than_amax_on_any_group(case):
    w, group_size = case
    chosen = int4_group_scales(w, group_size=group_size, scale_rule="mse").to(torch.bfloat16)
    baseline = int4_group_scales(w, group_size=group_size, scale_rule="amax").to(torch.bfloat16)
    candidates = _candidates(w, group_size)
    assert torch.equal(candidates[0], baseline)  # candidate 0 is the amax rule's stored scale
    # the chosen scale is one of the candidates of its group
    assert bool((candidates == chosen.unsqueeze(0)).any(0).all())
    chosen_error = _exact_group_errors(w, chosen, group_size)
    baseline_error = _exact_group_errors(w, baseline, group_size)
    assert all(c <= b for c, b in zip(chosen_error, baseline_error))
    # and it is the least error among the candidates, up to the margin the search allows itself
    # (2^-20 relative plus one unit of 4^(E - N) per element, E the group amax's exponent)
    per_candidate = [_exact_group_errors(w, candidates[i], group_size) for i in range(len(int4.MSE_DIVISORS))]
    amax = w.float().unflatten(-1, (w.shape[1] // group_size, group_size)).abs().amax(-1).flatten().tolist()
    for g, error in enumerate(chosen_error):
        best = min(errors[g] for errors in per_candidate)
        exponent = math.frexp(amax[g])[1] - 1 - int4.mse_norm_exponent(group_size)
        unit = Fraction(2) ** (2 * exponent) if amax[g] else Fraction(0)
        assert error <= best * (1 + Fraction(1, 2**19)) + 4 * (group_size + 2) * unit


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale_rule", ["mse", "amax"])
def test_all_zero_groups_get_epsilon_scale_and_zero_codes(dtype, scale_rule):
    w = torch.randn(3, 64, generator=_generator(1)).to(dtype)
    w[:, :32] = 0.0
    w[1, 32:] = -0.0
    q = quantize_int4_weight(w, group_size=32, scale_rule=scale_rule)
    eps = torch.finfo(dtype).eps
    assert q.weight_scale[:, 0].tolist() == [torch.tensor(eps, dtype=torch.bfloat16).item()] * 3
    assert q.weight_scale[1, 1].item() == torch.tensor(eps, dtype=torch.bfloat16).item()
    codes = int4.unpack_int4(q.weight_packed, q.weight_shape)
    assert not codes[:, :32].any() and not codes[1].any()


@pytest.mark.parametrize("sign, code", [(1.0, 7), (-1.0, -8)])
def test_a_single_outlier_lands_exactly_on_the_end_of_the_grid(sign, code):
    # amax / 7.5 would put +100 on 7.5 -> 8 -> clamped to 7 (error 0.5 scale); the search finds
    # the scale that puts it on 7 (amax / 7) or -100 on -8 (amax / 8). The rest are below half a step.
    w = torch.randn(1, 128, generator=_generator(2)) * 0.5
    w[0, 77] = sign * 100.0
    q = quantize_int4_weight(w, group_size=128, scale_rule="mse")
    scale = float(q.weight_scale)
    assert scale == float(torch.tensor(100.0 / (7 if sign > 0 else 8)).bfloat16())
    codes = int4.unpack_int4(q.weight_packed, q.weight_shape)
    assert int(codes[0, 77]) == code and int(codes[0].abs().sum()) == abs(code)
    restored = dequantize_int4(q.weight_packed, q.weight_scale, q.weight_shape)
    amax = quantize_int4_weight(w, group_size=128, scale_rule="amax")
    amax_restored = dequantize_int4(amax.weight_packed, amax.weight_scale, amax.weight_shape)
    assert float((restored - w).square().sum()) < float((amax_restored - w).square().sum())


def test_search_is_deterministic_whatever_the_chunking_and_row_order(monkeypatch):
    packed, scale = realistic_mxfp4(96, 512, _generator(3))
    w = dequantize_mxfp4(packed, scale)
    reference = quantize_int4_weight(w, group_size=32, scale_rule="mse")
    again = quantize_int4_weight(w.clone(), group_size=32, scale_rule="mse")
    assert torch.equal(again.weight_packed, reference.weight_packed)
    monkeypatch.setattr(int4, "_SEARCH_CHUNK_CPU", 3 * 512)   # 3 rows per chunk, ragged at the end
    chunked = quantize_int4_weight(w, group_size=32, scale_rule="mse")
    assert torch.equal(chunked.weight_scale.view(torch.int16), reference.weight_scale.view(torch.int16))
    assert torch.equal(chunked.weight_packed, reference.weight_packed)
    order = torch.randperm(96, generator=_generator(4))
    shuffled = quantize_int4_weight(w[order], group_size=32, scale_rule="mse")
    assert torch.equal(shuffled.weight_packed, reference.weight_packed[order])


@pytest.mark.parametrize("group_size, gain_db", [(32, 2.5), (128, 0.7)])
def test_search_gains_on_mxfp4_sourced_weights(group_size, gain_db):
    # Issue 25: group 32 with the search is 3.2 dB above amax / 7.5 on these weights, group 128 1.0 dB.
    packed, scale = realistic_mxfp4(256, 1024, _generator(5))
    w = dequantize_mxfp4(packed, scale)
    snr = {}
    for rule in ("amax", "mse"):
        q = quantize_int4_weight(w, group_size=group_size, scale_rule=rule)
        snr[rule] = error_metrics(w, dequantize_int4(q.weight_packed, q.weight_scale, q.weight_shape,
                                                     group_size=group_size)).snr_db
    assert snr["mse"] > snr["amax"] + gain_db, snr


def _scheme(group_size: int) -> QuantizationScheme:
    return QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=4, type="int", symmetric=True, strategy="group", group_size=group_size))


@settings(max_examples=25, deadline=None)
@given(groups())
def test_compressed_tensors_decodes_searched_scales_bit_exactly(case):
    w, group_size = case
    ours = quantize_int4_weight(w, group_size=group_size, scale_rule="mse")
    stored = {"weight_packed": ours.weight_packed, "weight_scale": ours.weight_scale, "weight_shape": ours.weight_shape}
    theirs = PackedQuantizationCompressor.decompress(stored, _scheme(group_size))["weight"]
    decoded = dequantize_int4(ours.weight_packed, ours.weight_scale, ours.weight_shape, group_size=group_size,
                              out_dtype=torch.bfloat16)
    assert torch.equal(theirs.to(torch.bfloat16), decoded)
    # Given our scales, compressed-tensors' own compressor writes our codes for the original weights.
    again = PackedQuantizationCompressor.compress({"weight": w, "weight_scale": ours.weight_scale}, _scheme(group_size))
    assert torch.equal(again["weight_packed"], ours.weight_packed)


def test_unknown_scale_rule_names_the_tensor():
    with pytest.raises(FormatError, match=r"tensor 'experts.1.w2.weight'.*scale rule must be one of mse, amax"):
        quantize_int4_weight(torch.ones(2, 128), scale_rule="minmax", name="experts.1.w2.weight")
