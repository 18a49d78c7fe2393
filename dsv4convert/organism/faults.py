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

A DSpark drafter's faults (0731's layout; ``layer`` names the stage or the backbone layer as each says), each in
one component ``compare`` localizes:

* ``draft-experts``: stage ``layer``'s (``mtp.{layer}``) routed experts' down projections x 2**shift, as ``experts``;
* ``markov-zeroed``: the Markov head dropped: ``markov_head.head`` (SGLang's ``markov_w2``) zeroed, so the bias
  it adds to every draft step is 0; its ``embed``, which the confidence head also reads, is kept;
* ``confidence-flipped``: the confidence head's sign flipped. 0731's ``confidence_head.proj`` has no bias
  (``[1, H + R]``, nothing else: ``layout._dspark_extras``), so the flip is its weight's: ``sigmoid(-raw)``
  = ``1 - sigmoid(raw)``;
* ``target-layer``: stage 0 fed the wrong target layer: ``config.json``'s ``dspark_target_layer_ids`` with its first
  entry replaced by backbone layer ``layer``, the weights untouched (what a converter that rewrote the key does).

Deterministic for a seed. Shards are rewritten one at a time (small checkpoints: the organism, synth).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from dsv4convert.checkpoint import Checkpoint, atomic_write_json
from dsv4convert.errors import DSV4Error
from dsv4convert.formats.fp8_block import dequantize_fp8_block, quantize_fp8_block
from dsv4convert.formats.numerics import e8m0_to_exponent, exponent_to_e8m0
from dsv4convert.models.deepseek_v4.configs import with_first_target
from dsv4convert.models.deepseek_v4.layout import ModelConfig
from dsv4convert.models.registry import fp8_block_of_config
from dsv4convert.models.deepseek_v4.names import draft_block

KINDS = ("indexer-randomized", "indexer-crushed", "attention", "experts", "draft-experts", "markov-zeroed",
         "confidence-flipped", "target-layer")
DRAFTER_KINDS = frozenset(KINDS[4:])


@dataclass(frozen=True)
class Fault:
    kind: str
    layer: int = 0
    shift: int = 2          # ``experts``, ``draft-experts``: binades added to the down projections' block scales

    def __post_init__(self):
        if self.kind not in KINDS:
            raise DSV4Error(f"unknown fault {self.kind!r} (choose from {', '.join(KINDS)})")

    def describe(self) -> str:
        if self.kind == "draft-experts":
            return f"{draft_block(self.layer)}: routed experts' down projections x{2 ** self.shift}"
        if self.kind in DRAFTER_KINDS:
            return {"markov-zeroed": "the DSpark Markov head's projection to the vocabulary zeroed",
                    "confidence-flipped": "the DSpark confidence head's sign flipped (its weight: it has no bias)",
                    "target-layer": f"stage 0 fed layers.{self.layer} as its first target layer "
                                    "(dspark_target_layer_ids)"}[self.kind]
        what = {"indexer-randomized": "indexer weights randomized", "indexer-crushed": "indexer head weights zeroed",
                "attention": "compressed KV projection randomized (indexer untouched)",
                "experts": f"routed experts' down projections x{2 ** self.shift}"}[self.kind]
        return f"layers.{self.layer}: {what}"


def inject(src: Path, dst: Path, fault: Fault, *, seed: int = 0, overwrite: bool = False) -> Path:
    """Copy the checkpoint ``src`` to ``dst`` with ``fault`` applied; returns ``dst``."""
    ckpt = Checkpoint.open(src)
    config = None
    if fault.kind in DRAFTER_KINDS:
        edits, config = _drafter_edits(ckpt, fault)
    else:
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
    if config is not None:
        atomic_write_json(work / "config.json", config)
    for shard in sorted({ckpt.tensors[name].path.name for name in edits}):
        tensors = load_file(work / shard)
        tensors.update({name: t for name, t in edits.items() if ckpt.tensors[name].path.name == shard})
        save_file(tensors, work / f"{shard}.tmp", metadata={"format": "pt"})
        os.replace(work / f"{shard}.tmp", work / shard)
    os.replace(work, dst)
    return dst


def _drafter_edits(ckpt: Checkpoint, fault: Fault) -> tuple[dict[str, torch.Tensor], dict | None]:
    """The replaced drafter tensors and, for ``target-layer``, the new config.json."""
    cfg = ModelConfig.from_dict(ckpt.config)
    d = cfg.dspark
    if d is None:
        raise DSV4Error(f"the {fault.kind} fault needs a DSpark drafter (no dspark_* keys in config.json)",
                        file=ckpt.root)
    if fault.kind == "target-layer":
        first = d.target_layer_ids[0]
        if fault.layer == first or not 0 <= fault.layer < cfg.num_hidden_layers:
            raise DSV4Error(f"target-layer: layer {fault.layer} must be a backbone layer other than {first}",
                            file=ckpt.root)
        return {}, with_first_target(ckpt.config, fault.layer)
    if fault.kind == "draft-experts":
        if not 0 <= fault.layer < d.stages:
            raise DSV4Error(f"draft-experts: the drafter has stages 0..{d.stages - 1}, not {fault.layer}",
                            file=ckpt.root)
        return _scaled_experts(ckpt, f"{d.names.stage(fault.layer)}.", fault.shift), None
    names = d.names
    candidates = {"markov-zeroed": (f"{names.markov_head}.weight", f"{names.markov_head_alias}.weight"),
                  "confidence-flipped": (f"{names.confidence}.weight",)}[fault.kind]
    name = next((x for x in candidates if x in ckpt.tensors), None)
    if name is None:
        raise DSV4Error(f"the drafter has no {' or '.join(candidates)}", file=ckpt.root)
    weight = ckpt.read(name)
    return {name: torch.zeros_like(weight) if fault.kind == "markov-zeroed" else -weight}, None


def _scaled_experts(ckpt: Checkpoint, prefix: str, shift: int) -> dict[str, torch.Tensor]:
    """Every routed expert's down projection under ``prefix`` x 2**shift (MXFP4 block scales + shift binades)."""
    edits = {}
    for name in ckpt.tensors:
        if name.startswith(f"{prefix}ffn.experts.") and name.endswith(".w2.scale"):
            scale = ckpt.read(name)
            if scale.dtype != torch.float8_e8m0fnu:
                raise DSV4Error("the experts fault needs MXFP4 experts with E8M0 scales", file=ckpt.root, tensor=name)
            edits[name] = exponent_to_e8m0(e8m0_to_exponent(scale) + shift)
    if not edits:
        raise DSV4Error(f"{prefix.rstrip('.')} has no routed experts to damage", file=ckpt.root)
    return edits


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
    return _scaled_experts(ckpt, p, fault.shift)


def _redrawn(weight: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Gaussian values with the weight's own spread, in its dtype."""
    std = weight.float().std().clamp(min=1e-6)
    return (torch.randn(weight.shape, generator=gen) * std).to(weight.dtype)


def _redrawn_fp8(ckpt: Checkpoint, module: str, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """An FP8-block linear redrawn with its dequantized spread and stored by the checkpoint's rule."""
    block = fp8_block_of_config(ckpt.config, str(ckpt.root / "config.json"))
    w = dequantize_fp8_block(ckpt.read(f"{module}.weight"), ckpt.read(f"{module}.scale"), block=block)
    weight, scale = quantize_fp8_block(_redrawn(w, gen), block=block)
    return {f"{module}.weight": weight, f"{module}.scale": scale}
