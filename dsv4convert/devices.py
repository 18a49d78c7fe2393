"""``--device`` for every command that computes (convert, calibrate, compare, automix, train-organism)."""

from __future__ import annotations

import torch

from dsv4convert.errors import DSV4Error


def resolve_device(name: str) -> torch.device:
    """The device ``name`` (auto, cpu, cuda or cuda:N) means on this machine, refused in one line when unknown or
    absent; ``auto`` is the first CUDA GPU when there is one, else the CPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        raise DSV4Error(f"unknown --device {name!r} (use auto, cpu, cuda or cuda:N)") from None
    if device.type not in ("cpu", "cuda"):
        raise DSV4Error(f"--device {name!r} is not supported (use auto, cpu, cuda or cuda:N)")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise DSV4Error(f"--device {name}: no CUDA GPU is available on this machine")
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            raise DSV4Error(f"--device {name}: this machine has {torch.cuda.device_count()} GPU(s)")
        device = torch.device("cuda", index)
    return device
