"""Where the kernels can run: optional Triton, the interpreter, and the device's architecture.

Triton is an optional dependency (``pip install dsv4convert[gpu]``): the package must import and
fall back to the torch references without it. Under ``TRITON_INTERPRET=1`` the same Triton
kernels run on CPU tensors through Triton's interpreter, which is how CI exercises them.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch


@functools.cache
def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_can_run_on(device: torch.device) -> bool:
    """Whether a Triton kernel can take tensors that live on ``device``."""
    if not triton_installed():
        return False
    if interpreting():
        return device.type == "cpu"
    return device.type == "cuda" and torch.cuda.is_available()


def arch_of(device: torch.device) -> str:
    """The config family for ``device``: ``sm_90``, ``sm_120``, ``interpreter`` or ``fallback``."""
    if device.type != "cuda":
        return "interpreter"
    return family_of_capability(torch.cuda.get_device_capability(device)[0])


def family_of_capability(major: int) -> str:
    """The config family of a GPU of compute capability ``major.x``.

    sm_100 (datacenter Blackwell) shares Hopper's large shared memory, so it gets Hopper's
    tiles; consumer/workstation Blackwell (sm_120, 99 KB of shared memory per block) gets its own.
    """
    if major in (9, 10):
        return "sm_90"
    if major == 12:
        return "sm_120"
    return "fallback"
