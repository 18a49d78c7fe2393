"""Error metrics: hand-worked values, degenerate inputs, chunked accumulation against numpy."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dsv4convert.errors import FormatError
from dsv4convert.formats import ExactnessReport, error_metrics, lossless_block_fraction
from dsv4convert.formats import metrics


def test_hand_worked_values():
    result = error_metrics(torch.tensor([3.0, 4.0]), torch.tensor([3.0, 0.0]))
    assert result.rel_fro == pytest.approx(0.8)  # |(0, 4)| / |(3, 4)|
    assert result.snr_db == pytest.approx(-20 * math.log10(0.8))
    assert result.cosine == pytest.approx(9 / 15)
    assert result.max_abs == 4.0


def test_identical_tensors():
    w = torch.randn(64, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    result = error_metrics(w, w.clone())
    assert (result.rel_fro, result.snr_db, result.cosine, result.max_abs) == (0.0, math.inf, 1.0, 0.0)


def test_zero_reference_has_no_nan():
    zero = torch.zeros(8)
    assert error_metrics(zero, zero) == metrics.ErrorMetrics(0.0, math.inf, 1.0, 0.0)
    result = error_metrics(zero, torch.ones(8))
    assert result.rel_fro == math.inf and result.snr_db == -math.inf and result.cosine == 0.0
    assert result.max_abs == 1.0
    assert error_metrics(torch.ones(8), zero).cosine == 0.0


def test_chunked_accumulation_matches_numpy(monkeypatch):
    monkeypatch.setattr(metrics, "_CHUNK", 1000)  # force many chunks, one of them ragged
    generator = torch.Generator().manual_seed(0)
    reference = torch.randn(77, 131, generator=generator)
    approx = reference + 0.01 * torch.randn(77, 131, generator=generator)
    r, a = reference.numpy().astype(np.float64).ravel(), approx.numpy().astype(np.float64).ravel()
    result = error_metrics(reference, approx)
    expected_rel = np.linalg.norm(r - a) / np.linalg.norm(r)
    assert result.rel_fro == pytest.approx(expected_rel, rel=1e-12)
    assert result.snr_db == pytest.approx(-20 * np.log10(expected_rel), rel=1e-12)
    assert result.cosine == pytest.approx(r @ a / (np.linalg.norm(r) * np.linalg.norm(a)), rel=1e-12)
    assert result.max_abs == np.abs(r - a).max()


def test_mixed_dtypes_compare_in_float64():
    reference = torch.tensor([1.0 + 2.0**-20])
    result = error_metrics(reference, reference.to(torch.bfloat16))
    assert result.max_abs == 2.0**-20


def test_bad_inputs():
    with pytest.raises(FormatError, match=r"tensor 'w'.*cannot compare shapes"):
        error_metrics(torch.zeros(2, 3), torch.zeros(3, 2), name="w")
    with pytest.raises(FormatError, match="NaN or Inf"):
        error_metrics(torch.tensor([1.0, math.nan]), torch.zeros(2))


def test_lossless_block_fraction_over_reports():
    reports = [ExactnessReport(10, 10, 320, 320, 0.0), ExactnessReport(30, 20, 960, 700, 1e-3)]
    assert lossless_block_fraction(*reports) == 30 / 40
    assert lossless_block_fraction() == 1.0
