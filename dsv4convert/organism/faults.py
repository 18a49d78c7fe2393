"""Known faults, injected into a copy of a checkpoint: the truths the organism's verdicts are checked against.

Each fault damages one part of one layer and nothing else, in the stored format (FP8 weights are
re-quantized with the checkpoint's own rule, BF16 stays BF16), so ``compare`` reads the copy like any
variant:

* ``indexer-randomized``: a CSA layer's lightning indexer (query projection ``wq_b`` and head weights
  ``weights_proj``) redrawn at random with the trained weights' spread: it still picks ``index_topk``
  entries, but not the ones the model needs;
* ``indexer-crushed``: its head weights zeroed, so every entry scores the same and top-k keeps an
  arbitrary set;
* ``attention``: the CSA layer's compressor (``attn.compressor.wkv``, the compressed keys and values the
  attention reads) redrawn, its indexer untouched: needles are still selected, then misread;
* ``experts``: every routed expert's down projection in a layer scaled by 2**shift (its MXFP4 block
  scales raised by ``shift`` binades): the layer's output changes, its attention and indexer do not.

Deterministic for a seed. Shards are rewritten one at a time (small checkpoints: the organism, synth).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from dsv4convert.checkpoint import Checkpoint
from dsv4convert.errors import DSV4Error
from dsv4convert.formats.fp8_block import dequantize_fp8_block, quantize_fp8_block
from dsv4convert.formats.numerics import e8m0_to_exponent, exponent_to_e8m0

KINDS = ("indexer-randomized", "indexer-crushed", "attention", "experts")


@dataclass(frozen=True)
class Fault:
    kind: str
    layer: int
    shift: int = 2          # ``experts``: binades added to the down projections' block scales

    def __post_init__(self):
        if self.kind not in KINDS:
            raise DSV4Error(f"unknown fault {self.kind!r} (choose from {', '.join(KINDS)})")

    def describe(self) -> str:
        what = {"indexer-randomized": "indexer weights randomized", "indexer-crushed": "indexer head weights zeroed",
                "attention": "compressed KV projection randomized (indexer untouched)",
                "experts": f"routed experts' down projections x{2 ** self.shift}"}[self.kind]
        return f"layers.{self.layer}: {what}"


def inject(src: Path, dst: Path, fault: Fault, *, seed: int = 0, overwrite: bool = False) -> Path:
    """Copy the checkpoint ``src`` to ``dst`` with ``fault`` applied; returns ``dst``."""
    ckpt = Checkpoint.open(src)
    prefix = f"layers.{fault.layer}."
    if not any(name.startswith(prefix) for name in ckpt.tensors):
        raise DSV4Error(f"the checkpoint has no layer {fault.layer}", file=ckpt.root)
    edits = _edits(ckpt, fault, torch.Generator().manual_seed(seed))
    dst = Path(dst)
    if dst.exists():
        if not overwrite:
            raise DSV4Error("destination exists (pass overwrite=True to replace it)", file=dst)
        shutil.rmtree(dst)
    work = dst.parent / f".{dst.name}.partial"
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(ckpt.root, work)
    for path in work.iterdir():
        path.chmod(0o644)
    for shard in sorted({ckpt.tensors[name].path.name for name in edits}):
        tensors = load_file(work / shard)
        tensors.update({name: t for name, t in edits.items() if ckpt.tensors[name].path.name == shard})
        save_file(tensors, work / f"{shard}.tmp", metadata={"format": "pt"})
        os.replace(work / f"{shard}.tmp", work / shard)
    os.replace(work, dst)
    return dst


def _edits(ckpt: Checkpoint, fault: Fault, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """The replaced tensors, by name."""
    p = f"layers.{fault.layer}."
    if fault.kind.startswith("indexer") or fault.kind == "attention":
        if f"{p}attn.indexer.wq_b.weight" not in ckpt.tensors:
            raise DSV4Error(f"layers.{fault.layer} is not a CSA layer (it has no lightning indexer)", file=ckpt.root)
    if fault.kind == "indexer-randomized":
        return {**_redrawn_fp8(ckpt, f"{p}attn.indexer.wq_b", gen),
                f"{p}attn.indexer.weights_proj.weight": _redrawn(ckpt.read(f"{p}attn.indexer.weights_proj.weight"), gen)}
    if fault.kind == "indexer-crushed":
        proj = ckpt.read(f"{p}attn.indexer.weights_proj.weight")
        return {f"{p}attn.indexer.weights_proj.weight": torch.zeros_like(proj)}
    if fault.kind == "attention":
        name = f"{p}attn.compressor.wkv.weight"
        return {name: _redrawn(ckpt.read(name), gen)}
    edits = {}
    for name in ckpt.tensors:
        if name.startswith(f"{p}ffn.experts.") and name.endswith(".w2.scale"):
            scale = ckpt.read(name)
            if scale.dtype != torch.float8_e8m0fnu:
                raise DSV4Error("the experts fault needs MXFP4 experts with E8M0 scales", file=ckpt.root, tensor=name)
            edits[name] = exponent_to_e8m0(e8m0_to_exponent(scale) + fault.shift)
    if not edits:
        raise DSV4Error(f"layers.{fault.layer} has no routed experts to damage", file=ckpt.root)
    return edits


def _redrawn(weight: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Gaussian values with the weight's own spread, in its dtype."""
    std = weight.float().std().clamp(min=1e-6)
    return (torch.randn(weight.shape, generator=gen) * std).to(weight.dtype)


def _redrawn_fp8(ckpt: Checkpoint, module: str, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """An FP8-block linear redrawn with its dequantized spread and stored by the checkpoint's rule."""
    w = dequantize_fp8_block(ckpt.read(f"{module}.weight"), ckpt.read(f"{module}.scale"))
    weight, scale = quantize_fp8_block(_redrawn(w, gen))
    return {f"{module}.weight": weight, f"{module}.scale": scale}
