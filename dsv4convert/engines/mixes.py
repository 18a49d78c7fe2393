"""Which per-layer mixes an engine serves: one verdict per (config family, GPU family), from its code.

A *config family* is one quantization config this tool can write (one ``quantization_config``, one SGLang
environment and MoE runner); each engine module (``engines/sglang/mixes.py``, ``engines/vllm/mixes.py``)
says, per GPU family, which expert formats a backbone MoE layer may take in it, which formats the
config-quantized linears may take, how the MTP draft's experts may be stored, and why the rest is refused.
``automix`` intersects the engines asked for (``automix/menu.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from dsv4convert.formats import Format

BF16, FP8, MXFP4, NVFP4, INT4 = Format.BF16, Format.FP8, Format.MXFP4, Format.NVFP4, Format.INT4
FP8_OR_BF16 = (FP8, BF16)

# Config families dsv4convert can write, each with every expert format it could describe at most.
CANDIDATES: dict[str, tuple[Format, ...]] = {
    "nvfp4-hybrid": (NVFP4, FP8, BF16),         # Fp8Config + ModelOpt hybrid fields, is_fp4_experts False
    "nvfp4-hybrid-mxfp4": (NVFP4, MXFP4, BF16),  # the same, is_fp4_experts True (SGLANG_DSV4_FP4_EXPERTS=1)
    "fp8": (FP8, BF16),                          # Fp8Config, FP8-block experts
    "mxfp4": (MXFP4, BF16),                      # Fp8Config, the release's MXFP4 experts
    "int4": (INT4, BF16),                        # compressed-tensors pack-quantized W4A16
}


@dataclass(frozen=True)
class MixRule:
    """One engine's verdict on one config family on one GPU family."""

    experts: tuple[Format, ...]
    refused: dict[Format, str]
    linears: tuple[Format, ...]
    linears_per_layer: bool
    mtp: tuple[Format | None, ...]     # draft storages this engine loads and runs, preferred first
    env_note: str
    model_wide: tuple[str, ...] = ()   # linears one format for the whole model even when the others are per layer
