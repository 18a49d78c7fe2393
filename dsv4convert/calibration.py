"""Calibration data a conversion reads: the calibration file, and where an NVFP4 expert's ``input_scale`` comes from.

``dsv4convert calibrate`` writes the file (``calibrate/calibfile.py``); ``convert``, ``automix`` and
``calibrate`` itself read it here: activation amaxes per expert, and the GPTQ Hessians it points to.

Where an NVFP4 expert's activation ``input_scale`` comes from:

In order of preference: another NVFP4 checkpoint of this model (only its scalars are
read), a calibration file, or a data-free bound that can never overflow:

* ``w1``/``w3`` read the output of the FFN RMSNorm. ``x / rms(x)`` has no element larger
  than ``sqrt(hidden)`` in magnitude, so ``sqrt(hidden) * max|ffn_norm.weight|`` bounds it.
* ``w2`` reads ``silu(min(gate, L)) * clamp(up, -L, L)`` with ``L = swiglu_limit``; silu is
  below its argument for positive inputs and above -0.28 for negative ones, so ``L * L``
  bounds it.

``input_scale = amax / (6 * 448)``, as ModelOpt writes it. ``w1`` and ``w3`` share one value
because SGLang fuses them. The calibration file format is ours:

    {"format": "dsv4convert.calibration/1",
     "experts": {"layers.3.ffn.experts.7": {"w13_input_amax": 12.5, "w2_input_amax": 80.0, "tokens": 41}}}

Experts the file does not list (they received no calibration tokens) get the data-free
bound, and are counted.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dsv4convert.checkpoint import Checkpoint, TensorEntry, read_header, read_small_json, read_tensor
from dsv4convert.errors import DSV4Error
from dsv4convert.formats import input_scale_from_amax

CALIBRATION_FORMAT = "dsv4convert.calibration/1"


@dataclass
class InputScales:
    """Picklable provider, called once per NVFP4 module (its native name) by the workers."""

    hidden_size: int
    swiglu_limit: float
    norm_entries: dict[str, TensorEntry]                     # block -> its ffn_norm.weight
    checkpoint_entries: dict[str, TensorEntry] = field(default_factory=dict)  # module -> input_scale
    calibration: dict[str, dict] = field(default_factory=dict)
    _norm_max: dict[str, float] = field(default_factory=dict, repr=False)

    def __call__(self, module: str) -> tuple[torch.Tensor, str]:
        expert = module.rsplit(".", 1)[0]
        is_w2 = module.endswith(".w2")
        if self.checkpoint_entries:
            names = [module] if is_w2 else [f"{expert}.w1", f"{expert}.w3"]
            values = [read_tensor(self.checkpoint_entries[n]).float().reshape(()) for n in names
                      if n in self.checkpoint_entries]
            if values:
                return torch.stack(values).amax(), "checkpoint"
        calibrated = self.calibration.get(expert, {}).get("w2_input_amax" if is_w2 else "w13_input_amax")
        if calibrated is not None:
            return input_scale_from_amax(float(calibrated)), "calibration"
        return input_scale_from_amax(self.data_free_amax(module)), "data-free bound"

    def data_free_amax(self, module: str) -> float:
        if module.endswith(".w2"):
            return self.swiglu_limit * self.swiglu_limit
        block = module.split(".ffn.")[0]
        if block not in self._norm_max:
            self._norm_max[block] = float(read_tensor(self.norm_entries[block]).float().abs().max())
        return math.sqrt(self.hidden_size) * self._norm_max[block]


def build_input_scales(source: Checkpoint, *, from_checkpoint: str | None = None,
                       calibration: Path | None = None) -> InputScales:
    config = source.config
    limit = config.get("swiglu_limit")
    if not isinstance(limit, (int, float)) or limit <= 0:
        raise DSV4Error("config.json has no positive 'swiglu_limit' for the data-free w2 bound",
                        file=source.root / "config.json")
    norms = {name[: -len(".ffn_norm.weight")]: e for name, e in source.tensors.items()
             if name.endswith(".ffn_norm.weight")}
    scales = InputScales(int(config["hidden_size"]), float(limit), norms)
    if from_checkpoint:
        other = Checkpoint.open(from_checkpoint)
        scales.checkpoint_entries = {n[: -len(".input_scale")]: e for n, e in other.tensors.items()
                                     if n.endswith(".input_scale") and ".experts." in n}
        if not scales.checkpoint_entries:
            raise DSV4Error("no expert input_scale tensors found (is it an NVFP4 checkpoint?)", file=other.root)
    if calibration:
        scales.calibration = load_calibration(calibration)
    return scales


def load_calibration(path: Path) -> dict[str, dict]:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DSV4Error(f"cannot read calibration file ({exc})", file=path) from None
    if not isinstance(data, dict) or data.get("format") != CALIBRATION_FORMAT or not isinstance(data.get("experts"), dict):
        raise DSV4Error(f"not a calibration file (expected \"format\": \"{CALIBRATION_FORMAT}\" and an "
                        "\"experts\" object)", file=path)
    for expert, stats in data["experts"].items():
        for key in ("w13_input_amax", "w2_input_amax"):
            value = stats.get(key) if isinstance(stats, dict) else None
            if value is not None and (not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0):
                raise DSV4Error(f"'{key}' must be a positive number, got {value!r}", file=path, tensor=expert)
    return data["experts"]


def hessian_key(expert: int, inputs: str) -> str:
    """Tensor name of one expert's Hessian in a block file (``inputs``: ``w13`` or ``w2``)."""
    return f"experts.{expert}.{inputs}_hessian"


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
