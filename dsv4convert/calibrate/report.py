"""Held-out output error per layer: what calibration buys over the data-free choices.

For the routed experts of a block, on held-out tokens (routed by the unquantized model),
the relative output error ``||Y - Y'||_F / ||Y||_F`` summed over ``w1``, ``w3`` and ``w2``:

* NVFP4 activation quantization with the calibrated ``input_scale`` against the data-free
  bound (weights exact, so only the activation side differs);
* INT4 W4A16 weights from GPTQ against round-to-nearest (activations exact), both with the
  squared-error scale search (the converter's default), and round-to-nearest with
  compressed-tensors' ``amax / 7.5`` scales beside them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from dsv4convert.calibrate.stats import ExpertStats
from dsv4convert.formats import decode_e2m1, dequantize_int4, encode_e2m1, quantize_int4_weight
from dsv4convert.formats.gptq import gptq_quantize_int4
from dsv4convert.formats.numerics import E2M1_MAX, E4M3_MAX, E4M3_MIN_EXP
from dsv4convert.formats.nvfp4 import NVFP4_BLOCK, input_scale_from_amax

METHODS = ("nvfp4_calibrated", "nvfp4_data_free", "int4_rtn_amax", "int4_rtn", "int4_gptq")


def nvfp4_activation_roundtrip(x: torch.Tensor, input_scale: torch.Tensor | float) -> torch.Tensor:
    """Activations after NVFP4 quantization with global ``input_scale`` (float32, same shape).

    Per 16 values an E4M3 block scale ``amax16 / (6 * input_scale)`` (clamped to E4M3's range,
    so values beyond ``6 * 448 * input_scale`` saturate), then E2M1 codes.
    """
    rows, k = x.shape
    blocks = x.float().reshape(rows, k // NVFP4_BLOCK, NVFP4_BLOCK)
    scale = torch.as_tensor(input_scale, dtype=torch.float32, device=x.device).reshape(())
    block_scale = (blocks.abs().amax(dim=-1) / (E2M1_MAX * scale)).clamp(2.0**E4M3_MIN_EXP, E4M3_MAX)
    block_scale = block_scale.to(torch.float8_e4m3fn).float()[..., None]
    codes = encode_e2m1(blocks / (block_scale * scale))
    return (decode_e2m1(codes) * block_scale * scale).reshape(rows, k)


@dataclass
class _Sums:
    reference: float = 0.0
    errors: dict[str, float] | None = None

    def add(self, method: str, reference: torch.Tensor, approx: torch.Tensor) -> None:
        self.errors = self.errors or {}
        self.errors[method] = self.errors.get(method, 0.0) + float((reference - approx).double().square().sum())

    def relative(self) -> dict[str, float | None]:
        errors = self.errors or {}
        return {m: (math.sqrt(errors[m] / self.reference) if self.reference else 0.0) if m in errors else None
                for m in METHODS}


def _int4_output(x: torch.Tensor, q) -> torch.Tensor:
    w = dequantize_int4(q.weight_packed, q.weight_scale, q.weight_shape,
                        group_size=x.shape[1] // q.weight_scale.shape[1])
    return x @ w.T


@torch.no_grad()
def block_errors(experts: nn.Module, captured: dict[int, list[tuple[torch.Tensor, torch.Tensor]]],
                 stats: ExpertStats, data_free_amax: tuple[float, float], *, max_experts: int,
                 group_size: int = 32, damp: float = 0.01) -> dict:
    """The report row of one block, over its ``max_experts`` experts with the most held-out tokens."""
    held = {e: sum(x.shape[0] for x, _ in parts) for e, parts in captured.items()}
    chosen = sorted(held, key=lambda e: (-held[e], e))[:max_experts]
    sums = _Sums()
    for e in chosen:
        x13 = torch.cat([x for x, _ in captured[e]]).float()
        x2 = torch.cat([y for _, y in captured[e]]).float()
        w13 = experts.gate_up_proj[e].float()
        w2 = experts.down_proj[e].float()
        ref13, ref2 = x13 @ w13.T, x2 @ w2.T
        sums.reference += float(ref13.double().square().sum() + ref2.double().square().sum())
        tokens = int(stats.tokens[e])
        calibrated = (float(stats.w13_amax[e]), float(stats.w2_amax[e])) if tokens else data_free_amax
        for method, (a13, a2) in (("nvfp4_calibrated", calibrated), ("nvfp4_data_free", data_free_amax)):
            sums.add(method, ref13, nvfp4_activation_roundtrip(x13, input_scale_from_amax(a13)) @ w13.T)
            sums.add(method, ref2, nvfp4_activation_roundtrip(x2, input_scale_from_amax(a2)) @ w2.T)
        # w1 and w3 read the same inputs: quantizing them stacked is the same as one by one
        # (INT4 scales and GPTQ's updates are per output row) with one Hessian factorization.
        for x, w, ref, hessians in ((x13, w13, ref13, stats.w13_hessian), (x2, w2, ref2, stats.w2_hessian)):
            sums.add("int4_rtn_amax", ref, _int4_output(x, quantize_int4_weight(w, group_size=group_size,
                                                                                scale_rule="amax")))
            sums.add("int4_rtn", ref, _int4_output(x, quantize_int4_weight(w, group_size=group_size, scale_rule="mse")))
            if hessians is not None:
                q = gptq_quantize_int4(w, hessians[e].to(w.device), group_size=group_size, damp=damp,
                                       scale_rule="mse")
                sums.add("int4_gptq", ref, _int4_output(x, q))
    return {"experts_evaluated": len(chosen), "heldout_rows": sum(held[e] for e in chosen), **sums.relative()}
