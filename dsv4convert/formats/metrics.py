"""Error metrics between a reference tensor and its approximation, in one place.

Definitions (formats.md §7): ``e = ||R - A||_F / ||R||_F``, ``SNR = -20 log10(e)`` dB,
cosine similarity of the flattened tensors, and the largest absolute difference. Sums are
accumulated in float64 chunk by chunk, so a large weight never needs a whole float64 copy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dsv4convert.errors import FormatError
from dsv4convert.formats.transcode import ExactnessReport

_CHUNK = 1 << 22


@dataclass(frozen=True)
class ErrorMetrics:
    rel_fro: float  # ||R - A||_F / ||R||_F (0 when both are zero, inf when only R is)
    snr_db: float   # -20 log10(rel_fro); inf for an exact copy
    cosine: float   # <R, A> / (|R| |A|); 1 when R == A (also both zero), 0 when exactly one is zero
    max_abs: float  # max |R - A|


def error_metrics(reference: torch.Tensor, approx: torch.Tensor, *, name: str | None = None) -> ErrorMetrics:
    """Compare ``approx`` with ``reference`` (same shape, any float dtypes)."""
    if reference.shape != approx.shape:
        raise FormatError(f"cannot compare shapes {list(reference.shape)} and {list(approx.shape)}", tensor=name)
    ref_flat, approx_flat = reference.reshape(-1), approx.reshape(-1)
    ref_sq = approx_sq = dot = diff_sq = 0.0
    max_abs = 0.0
    for start in range(0, ref_flat.numel(), _CHUNK):
        r = ref_flat[start:start + _CHUNK].double()
        a = approx_flat[start:start + _CHUNK].double()
        d = r - a
        ref_sq += float(torch.dot(r, r))
        approx_sq += float(torch.dot(a, a))
        dot += float(torch.dot(r, a))
        diff_sq += float(torch.dot(d, d))
        if d.numel():
            max_abs = max(max_abs, float(d.abs().max()))
    if not all(math.isfinite(v) for v in (ref_sq, approx_sq, dot, diff_sq)):
        raise FormatError("tensors contain NaN or Inf; error metrics are undefined", tensor=name)
    ref_norm, approx_norm = math.sqrt(ref_sq), math.sqrt(approx_sq)
    if ref_norm == 0.0:
        rel_fro = 0.0 if diff_sq == 0.0 else math.inf
    else:
        rel_fro = math.sqrt(diff_sq) / ref_norm
    snr_db = math.inf if rel_fro == 0.0 else -20.0 * math.log10(rel_fro)
    if diff_sq == 0.0:
        cosine = 1.0  # identical (the formula could round to 1 - 2**-53)
    elif ref_norm == 0.0 or approx_norm == 0.0:
        cosine = 0.0
    else:
        cosine = min(1.0, max(-1.0, dot / (ref_norm * approx_norm)))
    return ErrorMetrics(rel_fro=rel_fro, snr_db=snr_db, cosine=cosine, max_abs=max_abs)


def lossless_block_fraction(*reports: ExactnessReport) -> float:
    """Fraction of blocks preserved bit-exactly over all given transcode reports (1.0 if none)."""
    total = sum(r.blocks_total for r in reports)
    return sum(r.blocks_exact for r in reports) / total if total else 1.0
