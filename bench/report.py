"""What a GPU benchmark records about its run, and how it writes ``<out>.json`` beside ``<out>.md``."""

from __future__ import annotations

import json
import os
import platform
import sys
from pathlib import Path


def gpu_run() -> dict:
    """The device, host, torch and Triton versions, the commit (``DSV4_COMMIT``) and the exact command."""
    import torch
    import triton

    return {"device": torch.cuda.get_device_name(0), "host": platform.node(), "torch": torch.__version__,
            "triton": triton.__version__, "commit": os.environ.get("DSV4_COMMIT", "unknown"),
            "command": "python " + " ".join(sys.argv)}


def write(out: str, result: dict, markdown: str) -> None:
    """``<out>.json`` (every number) and ``<out>.md`` (the summary), and the summary on stdout."""
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.json").write_text(json.dumps(result, indent=1))
    Path(f"{out}.md").write_text(markdown)
    print(markdown)
