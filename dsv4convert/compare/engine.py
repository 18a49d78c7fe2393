"""Two checkpoints through the model in lockstep, one block at a time, on one device.

For each block (the backbone layers in order, then the MTP blocks) the base's layer is built
(:mod:`dsv4convert.model.blocks`), the base's streams go through it, it is freed; then the
variant's layer, which takes both its own streams (*free-running*: the drift a user gets) and the
base's input (*local*: what this block alone adds). Only one layer is resident at a time; the
streams ``[sequences, seq, hc_mult, hidden]`` of both sides live on the host between blocks, and
each micro-batch goes through the layer in query chunks (:class:`dsv4convert.model.forward.BlockRunner`).
After the backbone, each side's output head gives logits, scored against each other and the text
(:mod:`.metrics`); after each MTP block, its head gives the draft's prediction, scored against the
same side's main model.

Each side runs under its own :class:`~dsv4convert.compare.numerics.Numerics` (what its server
computes with), installed on every layer it builds (:mod:`.emulate`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from tqdm import tqdm

from dsv4convert.checkpoint import Checkpoint
from dsv4convert.compare.emulate import install
from dsv4convert.compare.metrics import HiddenError, OutputStats
from dsv4convert.compare.numerics import Numerics
from dsv4convert.inspection import Inspection
from dsv4convert.layout import ModelConfig
from dsv4convert.model.blocks import MtpEntry, OutputHead, WeightSource, build_layer, hf_config
from dsv4convert.model.forward import BlockRunner

# Positions per head evaluation: a float64 log-softmax over the real vocabulary (129,280) is 1 MB a position.
HEAD_POSITIONS = 1024


@dataclass
class Side:
    """One checkpoint as compared: its weights, its layout and the numerics its server runs."""

    label: str
    ckpt: Checkpoint
    inspection: Inspection
    source: WeightSource
    numerics: Numerics


@dataclass
class BlockResult:
    block: str
    free_running: dict
    local: dict
    seconds: dict[str, float]


@dataclass
class EngineResult:
    blocks: list[BlockResult]
    output: OutputStats
    mtp: dict[str, dict[str, float]] = field(default_factory=dict)   # side -> draft agreement per MTP block
    seconds: dict[str, float] = field(default_factory=dict)
    peak_device_bytes: int | None = None


class LockstepEngine:
    """Runs ``base`` and ``variant`` over ``ids`` ``[sequences, seq]``; see the module docstring."""

    def __init__(self, base: Side, variant: Side, ids: torch.Tensor, *, device: torch.device, dtype: torch.dtype,
                 chunk: int | None, batch_size: int = 1, mtp: bool = True, progress: bool = True):
        self.base, self.variant, self.ids = base, variant, ids
        self.device, self.dtype, self.batch_size, self.progress = device, dtype, batch_size, progress
        self.cfg: ModelConfig = base.inspection.config
        self.config = hf_config(base.ckpt.config)
        self.runner = BlockRunner(self.config, device, dtype, chunk=chunk)
        self.blocks = [b for b in self.cfg.block_prefixes() if mtp or b.startswith("layers.")]
        self.seconds: dict[str, float] = {"read": 0.0, "forward": 0.0, "metrics": 0.0}

    # -- the pieces -------------------------------------------------------------------------

    def _rows(self) -> list[slice]:
        n = self.ids.shape[0]
        return [slice(i, min(i + self.batch_size, n)) for i in range(0, n, self.batch_size)]

    def _host(self, seq: int) -> torch.Tensor:
        return torch.empty((self.ids.shape[0], seq, self.cfg.hc_mult, self.cfg.hidden_size), dtype=self.dtype,
                           pin_memory=self.device.type == "cuda")

    def _load(self, side: Side, block: str):
        """The side's layer for ``block`` with its numerics installed, and for an MTP block its entry and
        the embedding it mixes in."""
        t0 = time.perf_counter()
        layer = build_layer(side.source, self.config, self.cfg, block)
        mix = MtpEntry.load(side.source, self.config, block) if block.startswith("mtp.") else None
        handles = install(layer, block, side.numerics, side.source, mix)
        entry = (mix, side.source.tensor("embed.weight")) if mix is not None else None
        self._sync()
        self.seconds["read"] += time.perf_counter() - t0
        return layer, entry, handles

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _forward(self, layer, entry: tuple[MtpEntry, torch.Tensor] | None, streams: torch.Tensor, rows: slice,
                 block: str) -> torch.Tensor:
        """One micro-batch of the previous block's output ``streams`` through ``layer`` (result on the device)."""
        t0 = time.perf_counter()
        ids = self.ids[rows, _shift(block):]
        if entry is not None:   # MTP block j: the token j+1 ahead, mixed into the previous block's streams
            mix, embed = entry
            hidden = mix(F.embedding(ids.to(self.device), embed), streams[rows, : ids.shape[1]].to(self.device))
        else:
            hidden = streams[rows]
        out = self.runner(layer, hidden, ids)
        self._sync()
        self.seconds["forward"] += time.perf_counter() - t0
        return out

    # -- the run ----------------------------------------------------------------------------

    @torch.no_grad()
    def run(self) -> EngineResult:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        started = time.perf_counter()
        seq = self.ids.shape[1]
        sides = (self.base, self.variant)
        streams = {s.label: self._host(seq) for s in sides}
        for s in sides:   # the first layer's input: the embedding, copied to every stream
            embed = s.source.tensor("embed.weight")
            for rows in self._rows():
                emb = F.embedding(self.ids[rows].to(self.device), embed)
                streams[s.label][rows] = emb.unsqueeze(2).expand(-1, -1, self.cfg.hc_mult, -1).cpu()
            del embed
        scored = False
        results: list[BlockResult] = []
        output = OutputStats()
        mtp: dict[str, dict[str, float]] = {s.label: {} for s in sides}
        top1: dict[str, torch.Tensor] = {}
        bar = tqdm(total=2 * len(self.blocks), desc="compare", unit="block", disable=not self.progress)
        try:
            for block in self.blocks:
                is_mtp = block.startswith("mtp.")
                if is_mtp and not scored:
                    self._score_outputs(streams, output, top1)
                    scored = True
                before = dict(self.seconds)
                out_seq = seq - _shift(block)
                nxt = {s.label: self._host(out_seq) for s in sides}
                free, local = HiddenError(), HiddenError()
                # The base's layer first: its outputs are the reference for both measurements.
                layer, entry, handles = self._load(self.base, block)
                for rows in self._rows():
                    nxt["base"][rows] = self._forward(layer, entry, streams["base"], rows, block).cpu()
                handles.remove()
                del layer, entry
                bar.update()
                layer, entry, handles = self._load(self.variant, block)
                for rows in self._rows():
                    mine = self._forward(layer, entry, streams["variant"], rows, block)
                    given = self._forward(layer, entry, streams["base"], rows, block)
                    t0 = time.perf_counter()
                    reference = nxt["base"][rows].to(self.device)
                    free.add(reference, mine)
                    local.add(reference, given)
                    nxt["variant"][rows] = mine.cpu()
                    self.seconds["metrics"] += time.perf_counter() - t0
                handles.remove()
                del layer, entry
                bar.update()
                if is_mtp:
                    for s in sides:
                        mtp[s.label][block] = self._draft_agreement(s, block, nxt[s.label], top1[s.label])
                streams = nxt
                spent = {k: round(self.seconds[k] - before[k], 4) for k in self.seconds}
                results.append(BlockResult(block, free.result(), local.result(), spent))
            if not scored:
                self._score_outputs(streams, output, top1)
        finally:
            bar.close()
        self.seconds["total"] = time.perf_counter() - started
        peak = torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else None
        return EngineResult(results, output, mtp, {k: round(v, 3) for k, v in self.seconds.items()}, peak)

    def _heads(self, prefix: str = "") -> dict[str, OutputHead]:
        return {s.label: OutputHead(s.source, self.config, prefix) for s in (self.base, self.variant)}

    def _score_outputs(self, final: dict[str, torch.Tensor], output: OutputStats, top1: dict[str, torch.Tensor]) -> None:
        """Both sides' logits at every position but the last, scored against each other and the next token."""
        t0 = time.perf_counter()
        heads = self._heads()
        n, seq = self.ids.shape
        for label in heads:
            top1[label] = torch.empty((n, seq), dtype=torch.int64)
        for row in range(n):
            for start in range(0, seq, HEAD_POSITIONS):
                end = min(start + HEAD_POSITIONS, seq)
                logits = {label: head(final[label][row:row + 1, start:end].to(self.device))[0]
                          for label, head in heads.items()}
                for label, value in logits.items():
                    top1[label][row, start:end] = value.argmax(-1).cpu()
                scored = min(end, seq - 1)
                if scored > start:
                    output.add(logits["base"][: scored - start], logits["variant"][: scored - start],
                               self.ids[row, start + 1:scored + 1])
        del heads
        self.seconds["metrics"] += time.perf_counter() - t0

    def _draft_agreement(self, side: Side, block: str, streams: torch.Tensor, main_top1: torch.Tensor) -> float:
        """How often MTP block ``j``'s top-1 at ``t`` is its own main model's top-1 at ``t + j + 1``: the
        draft token a speculative decoder would accept (0 % is the broken-draft failure)."""
        t0 = time.perf_counter()
        head = OutputHead(side.source, self.config, f"{block}.")
        shift = _shift(block)
        agree = total = 0
        n, seq = streams.shape[:2]
        for row in range(n):
            for start in range(0, seq, HEAD_POSITIONS):
                end = min(start + HEAD_POSITIONS, seq)
                draft = head(streams[row:row + 1, start:end].to(self.device))[0].argmax(-1).cpu()
                want = main_top1[row, start + shift:end + shift]
                agree += int((draft == want).sum())
                total += want.numel()
        self.seconds["metrics"] += time.perf_counter() - t0
        return agree / total if total else math.nan


def _shift(block: str) -> int:
    """How many tokens shorter a block's sequences are: MTP block j reads the token j+1 ahead."""
    kind, idx = block.split(".")
    return 0 if kind == "layers" else int(idx) + 1
