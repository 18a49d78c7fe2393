"""GPTQ for W4A16 INT4 (symmetric, group-wise), in the same stored form as round-to-nearest.

GPTQ (Frantar et al., 2022) quantizes a weight ``W[N, K]`` one input column at a time and
spreads each column's rounding error over the columns not yet quantized, weighted by the
inverse Hessian ``H = sum x x^T`` of the layer's inputs, so the *output* error ``||XW^T -
XQ^T||`` is what is minimized rather than the weight error. The result is still plain
``q * scale`` with BF16 group scales ``amax / 7.5`` (each group's scale is taken from the
error-updated weights when GPTQ reaches the group) and codes packed exactly like
:func:`dsv4convert.formats.int4.quantize_int4_weight`, so SGLang loads it the same way.
"""

from __future__ import annotations

import torch

from dsv4convert.errors import FormatError
from dsv4convert.formats.int4 import (
    DEFAULT_SCALE_RULE,
    Int4Weight,
    ScaleRule,
    int4_group_scales,
    pack_int4,
    quantize_int4_weight,
    round_to_int4,
)


def _inverse_hessian_factor(hessian: torch.Tensor, damp: float, name: str | None) -> torch.Tensor:
    """Upper Cholesky factor of ``(H + damp * mean(diag H) * I)^-1`` (float32), GPTQ's update matrix."""
    h = hessian.to(torch.float64).clone()
    diag = torch.diagonal(h)
    dead = diag <= 0
    diag[dead] = 1.0   # an input channel that was always zero: no error to spread, keep it isolated
    diag += damp * float(diag.mean())
    factor, info = torch.linalg.cholesky_ex(h)
    if int(info):
        raise FormatError(f"GPTQ Hessian is not positive definite even with damping {damp} "
                          "(raise --gptq-damp or use more calibration tokens)", tensor=name)
    inverse = torch.cholesky_solve(torch.eye(h.shape[0], dtype=h.dtype, device=h.device), factor)
    return torch.linalg.cholesky(inverse, upper=True).to(torch.float32)


def _check(weight: torch.Tensor, hessian: torch.Tensor, group_size: int, damp: float, name: str | None) -> None:
    if weight.ndim != 2 or group_size <= 0 or weight.shape[1] % group_size:
        raise FormatError(f"GPTQ needs a 2-D weight [N, K] with K a multiple of {group_size}, "
                          f"got {list(weight.shape)}", tensor=name)
    k = weight.shape[1]
    if tuple(hessian.shape) != (k, k):
        raise FormatError(f"GPTQ Hessian must be [{k}, {k}] for weight {list(weight.shape)}, "
                          f"got {list(hessian.shape)}", tensor=name)
    if not bool(torch.isfinite(hessian).all()):
        raise FormatError("GPTQ Hessian holds NaN or Inf", tensor=name)
    if not 0 < damp < 1:
        raise FormatError(f"GPTQ damping must be in (0, 1), got {damp}", tensor=name)


def _gptq_codes(weight: torch.Tensor, hessian: torch.Tensor, group_size: int, damp: float, scale_rule: ScaleRule,
                name: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 codes ``[N, K]``, BF16 scales ``[N, K/g]``) chosen by GPTQ."""
    n, k = weight.shape
    # Transposed, so the column GPTQ works on is a contiguous row.
    wt = weight.to(torch.float32).T.contiguous()
    upper = _inverse_hessian_factor(hessian.to(wt.device), damp, name)
    codes = torch.empty((k, n), dtype=torch.int8, device=wt.device)
    scales = torch.empty((k // group_size, n), dtype=torch.bfloat16, device=wt.device)
    for g, start in enumerate(range(0, k, group_size)):
        stop = start + group_size
        block = wt[start:stop]                         # a view: updated in place below
        scale = int4_group_scales(block.T, group_size=group_size, scale_rule=scale_rule, name=name)[:, 0]
        scale = scale.to(torch.bfloat16)
        scales[g] = scale
        scale = scale.float()
        inv = upper[start:stop, start:stop]
        errors = torch.empty_like(block)
        for j in range(group_size):
            q = round_to_int4(block[j] / scale)
            codes[start + j] = q
            err = (block[j] - q.float() * scale) / inv[j, j]
            block[j:] -= inv[j, j:].unsqueeze(1) * err.unsqueeze(0)
            errors[j] = err
        wt[stop:] -= upper[start:stop, stop:].T @ errors
    return codes.T.contiguous(), scales.T.contiguous()


def gptq_quantize_int4(weight: torch.Tensor, hessian: torch.Tensor, *, group_size: int = 128, damp: float = 0.01,
                       scale_rule: ScaleRule = DEFAULT_SCALE_RULE, name: str | None = None) -> Int4Weight:
    """GPTQ INT4 of ``weight`` (float32 ``[N, K]``) for inputs with Hessian ``hessian`` ``[K, K]``.

    An all-zero Hessian (the expert received no calibration tokens) has no information:
    the weight is rounded to nearest instead (under the same ``scale_rule``).
    """
    _check(weight, hessian, group_size, damp, name)
    if not bool((torch.diagonal(hessian) > 0).any()):
        return quantize_int4_weight(weight, group_size=group_size, scale_rule=scale_rule, name=name)
    codes, scales = _gptq_codes(weight, hessian, group_size, damp, scale_rule, name)
    return Int4Weight(weight_packed=pack_int4(codes, name=name), weight_scale=scales,
                      weight_shape=torch.tensor(list(weight.shape), dtype=torch.int64))
