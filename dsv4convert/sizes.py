"""Byte sizes as people write them (``--max-memory 16G``) and read them (``5.4 GB``): decimal units, as disks are
sold. A leaf, so that the command line parses sizes without loading the converter."""

from __future__ import annotations

import math

from dsv4convert.errors import RecipeError


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n:.1f} TB"


def parse_size(text: str) -> int:
    """'8G', '512M', '3.5GB', '1000000' -> bytes (decimal units, as disks are sold)."""
    units = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = t[-1] if t and t[-1] in units else ""
    try:
        value = float(t[: len(t) - len(unit)] if unit else t)
    except ValueError:
        raise RecipeError(f"cannot read size {text!r} (examples: 8G, 512M, 5GB)") from None
    if value <= 0 or math.isinf(value) or math.isnan(value):
        raise RecipeError(f"size must be positive, got {text!r}")
    return int(value * units[unit])
