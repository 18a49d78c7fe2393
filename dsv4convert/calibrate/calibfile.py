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
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from dsv4convert import __version__
from dsv4convert.calibrate.stats import ExpertStats, hessian_key
from dsv4convert.checkpoint import atomic_write_json, read_header, read_small_json, read_tensor
from dsv4convert.checkpoint.safetensors_io import TensorEntry
from dsv4convert.convert.input_scales import CALIBRATION_FORMAT, load_calibration
from dsv4convert.errors import DSV4Error

if TYPE_CHECKING:
    from dsv4convert.calibrate.stream import Calibrator


def write_calibration(run: "Calibrator", ids: torch.Tensor) -> dict:
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


@dataclass
class CalibrationHessians:
    """GPTQ Hessians of a calibration file, read one expert at a time; picklable for workers.

    ``calibration_hessians(path)("layers.3.ffn.experts.7.w1")`` is the ``[hidden, hidden]``
    Hessian of that expert's ``w1`` input (shared with ``w3``); ``None`` for an expert that
    received no calibration tokens (round-to-nearest is all that is left for it).
    """

    files: dict[str, Path]                                  # block -> statistics file
    _entries: dict[str, dict[str, TensorEntry]] = field(default_factory=dict, repr=False)

    def __call__(self, module: str) -> torch.Tensor | None:
        head, sep, proj = module.rpartition(".")
        block, _, expert = head.partition(".ffn.experts.")
        if not sep or proj not in ("w1", "w2", "w3") or not expert.isdigit():
            raise DSV4Error(f"'{module}' is not a routed expert projection (layers.N.ffn.experts.E.w1|w2|w3)")
        if block not in self.files:
            raise DSV4Error(f"the calibration file has no Hessians for block '{block}'", tensor=module)
        if block not in self._entries:
            self._entries[block] = read_header(self.files[block]).entries
        entry = self._entries[block].get(hessian_key(int(expert), "w2" if proj == "w2" else "w13"))
        return read_tensor(entry) if entry is not None else None

    def __getstate__(self) -> dict:
        return {"files": self.files, "_entries": {}}


def calibration_hessians(path: Path) -> CalibrationHessians:
    """The Hessians a calibration file (``calibrate --hessians``) points to, checked to exist."""
    path = Path(path)
    load_calibration(path)
    data = read_small_json(path)
    files = data.get("hessians")
    if not isinstance(files, dict) or not files:
        raise DSV4Error("calibration file has no Hessians (run 'dsv4convert calibrate --hessians')", file=path)
    resolved = {}
    for block, rel in files.items():
        target = path.parent / str(rel)
        if not target.is_file():
            raise DSV4Error(f"Hessian file for '{block}' is missing", file=target)
        resolved[block] = target
    return CalibrationHessians(resolved)
