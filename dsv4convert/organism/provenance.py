"""What a trained organism's provenance records about the code that trained it."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path


def source_commit() -> str:
    """``DSV4_COMMIT`` when set (a copied working tree whose git does not know the commit, as on the device
    machine), else this checkout's short HEAD, else ``unknown``."""
    if os.environ.get("DSV4_COMMIT"):
        return os.environ["DSV4_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=Path(__file__).resolve().parent)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"
