"""The calibration file ``dsv4convert.calibration/1`` and the GPTQ Hessians it points to.

The JSON keeps the keys ``to-nvfp4 --calibration`` already reads (``format``, and per
calibrated expert ``w13_input_amax``, ``w2_input_amax``, ``tokens``) and adds, compatibly:

* ``uncalibrated_experts``: the experts that received no calibration tokens (they are not
  in ``experts``, so converters give them the data-free bound), and their count;
* ``hessians`` (with ``--hessians``): block -> safetensors file, relative to the JSON file,
  holding ``experts.<e>.w13_hessian`` (the ``sum x x^T`` of what ``w1``/``w3`` read) and
  ``experts.<e>.w2_hessian`` (of what ``w2`` reads), float32, for every calibrated expert;
* ``data``, ``source``, ``blocks`` (time, peak device memory and the ranks' shares of the tokens per
  block), ``distributed`` (the world size and tokens per rank of the last run) and ``report`` (held-out
  errors per block, with ``--report``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Protocol

import torch

from dsv4convert import __version__
from dsv4convert.calibrate.stats import ExpertStats
from dsv4convert.calibration import CALIBRATION_FORMAT
from dsv4convert.checkpoint import atomic_write_json, read_small_json


class FinishedRun(Protocol):
    """What the calibration file is gathered from (``calibrate.stream.Calibrator``): its options, its blocks and
    where each block's statistics and results were written."""

    opts: Any
    blocks: list[str]

    def stats_path(self, block: str) -> Path: ...

    def result_path(self, block: str) -> Path: ...


def write_calibration(run: FinishedRun, ids: torch.Tensor) -> dict:
    """Gather the finished blocks into the calibration JSON (written atomically); returns it."""
    opts, output = run.opts, Path(run.opts.output)
    experts: dict[str, dict] = {}
    uncalibrated: list[str] = []
    hessians: dict[str, str] = {}
    blocks, report = [], []
    for block in run.blocks:
        stats = ExpertStats.load_scalars(run.stats_path(block))
        for e, tokens in enumerate(stats.tokens.tolist()):
            name = f"{block}.ffn.experts.{e}"
            if tokens:
                experts[name] = {"w13_input_amax": float(stats.w13_amax[e]),
                                 "w2_input_amax": float(stats.w2_amax[e]), "tokens": int(tokens)}
            else:
                uncalibrated.append(name)
        if opts.hessians:
            hessians[block] = os.path.relpath(run.stats_path(block), output.parent)
        result = read_small_json(run.result_path(block))
        row = result.pop("report", None)
        blocks.append(result)
        if row is not None:
            report.append({"block": block, **row})
    content = {
        "format": CALIBRATION_FORMAT,
        "producer": f"dsv4convert {__version__}",
        "source": str(opts.source),
        "data": {"file": str(opts.data), "num_sequences": opts.num_sequences, "seq_len": opts.seq_len,
                 "holdout": opts.holdout, "tokens": int(ids[: opts.num_sequences].numel())},
        "experts": experts,
        "uncalibrated_experts": {"count": len(uncalibrated), "experts": uncalibrated},
        "blocks": blocks,
        # How the last run split the work (each block's own split is in its entry of "blocks").
        "distributed": blocks[-1].get("distributed") if blocks else None,
    }
    if opts.hessians:
        content["hessians"] = hessians
    if opts.report:
        content["report"] = report
    atomic_write_json(output, content)
    return content
