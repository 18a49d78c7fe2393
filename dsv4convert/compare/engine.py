"""Checkpoints through the model in lockstep, one block at a time, on one device.

For each block (the backbone layers in order, then the MTP blocks) each checkpoint's layer is built
once (:mod:`dsv4convert.model.blocks`) and every *track* on that checkpoint runs through it: a track
is a checkpoint under one set of numerics (the base as served, the variant as served, the variant
with only some parts of its serving numerics for an ablation, the base once more in other chunks
for a noise floor). The reference track goes first; its outputs are what every other track's are
measured against, *free-running* (each track on its own streams: the drift a user gets) and, for a
track that asks, *local* (its layer fed the reference's input: what this block alone adds). Only one
layer is resident at a time; each track's streams ``[sequences, seq, hc_mult, hidden]`` live on the
host between blocks, and each micro-batch goes through the layer in query chunks
(:class:`dsv4convert.model.forward.BlockRunner`). Batches of different lengths (a needle grid)
share each loaded layer, so a checkpoint is read once whatever the grid.

After the backbone, each track's output head gives logits at the scored positions, compared with the
reference's (:mod:`.metrics`) and, where a batch marks answer tokens, checked for retrieval; after each
MTP block, its head gives the draft's prediction, scored against the same track's main model.
Observers (:class:`BlockObserver`) see each track's pass through each block, as the recall diagnosis
needs (the indexer's choices).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F
from tqdm import tqdm

from dsv4convert.checkpoint import Checkpoint
from dsv4convert.compare.emulate import Installed, install
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
    """One checkpoint: its weights and its layout."""

    label: str
    ckpt: Checkpoint
    inspection: Inspection
    source: WeightSource


@dataclass
class Track:
    """A checkpoint under one set of numerics, run through every block."""

    label: str
    side: Side
    numerics: Numerics
    chunk: int | None = None      # queries per forward (None: the engine's)
    local: bool = False           # also run this track's layers on the reference's input


@dataclass
class Batch:
    """Sequences of one length; optionally only some positions scored, optionally an answer to retrieve.

    ``answers[i] = (start, end)``: tokens ``start..end-1`` of row ``i`` are the answer, appended to the
    prompt (teacher forcing); positions ``start-1 .. end-2`` predict them, and only those are scored.
    """

    ids: torch.Tensor
    answers: list[tuple[int, int]] | None = None

    def scored(self, row: int) -> tuple[int, int]:
        """Positions ``[first, last)`` whose next-token prediction is scored."""
        if self.answers is None:
            return 0, self.ids.shape[1] - 1
        start, end = self.answers[row]
        return start - 1, end - 1


class BlockObserver(Protocol):
    """Sees each pass of a track through a block: ``local`` when the track's layer takes the reference's input."""

    def install(self, layer, block: str, track: Track, batch: int, rows: slice, local: bool) -> Installed | None: ...

    def finished(self, block: str, track: Track, batch: int, rows: slice, local: bool) -> None: ...


@dataclass
class BlockResult:
    block: str
    free_running: dict[str, dict]          # track -> relative error / cosine against the reference
    local: dict[str, dict]
    seconds: dict[str, float]


@dataclass
class EngineResult:
    blocks: list[BlockResult]
    output: dict[str, OutputStats]                         # track -> its logits against the reference's
    retrieval: dict[str, list[list[tuple[bool, float]]]]   # track -> per batch, per row: (retrieved, log p(answer))
    mtp: dict[str, dict[str, float]] = field(default_factory=dict)   # track -> draft agreement per MTP block
    seconds: dict[str, float] = field(default_factory=dict)
    peak_device_bytes: int | None = None


class LockstepEngine:
    """Runs ``tracks`` (the first is the reference) over ``batches``; see the module docstring."""

    def __init__(self, tracks: list[Track], batches: list[Batch], *, device: torch.device, dtype: torch.dtype,
                 chunk: int | None, batch_size: int = 1, mtp: bool = True, progress: bool = True,
                 observers: list[BlockObserver] = ()):
        if len({t.label for t in tracks}) != len(tracks):
            raise ValueError("track labels must differ")
        self.tracks, self.reference, self.batches = tracks, tracks[0], batches
        self.device, self.dtype, self.batch_size, self.progress = device, dtype, batch_size, progress
        self.observers = list(observers)
        self.cfg: ModelConfig = tracks[0].side.inspection.config
        self.config = hf_config(tracks[0].side.ckpt.config)
        self.runners = {t.label: BlockRunner(self.config, device, dtype, chunk=t.chunk or chunk) for t in tracks}
        self.sides = list({id(t.side): t.side for t in tracks}.values())   # reference's checkpoint first
        self.blocks = [b for b in self.cfg.block_prefixes() if mtp or b.startswith("layers.")]
        self.seconds: dict[str, float] = {"read": 0.0, "forward": 0.0, "metrics": 0.0}
        self._spare: dict[tuple[int, ...], list[torch.Tensor]] = {}

    # -- the pieces -------------------------------------------------------------------------

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _rows(self, batch: Batch) -> list[slice]:
        n = batch.ids.shape[0]
        return [slice(i, min(i + self.batch_size, n)) for i in range(0, n, self.batch_size)]

    def _host(self, batch: Batch, shift: int) -> torch.Tensor:
        """A host buffer for a batch's streams: one freed by an earlier block if its shape fits (pinning host
        memory is slow: allocating every block's outputs afresh cost a minute a block on a long grid)."""
        n, seq = batch.ids.shape
        shape = (n, seq - shift, self.cfg.hc_mult, self.cfg.hidden_size)
        spare = self._spare.get(shape)
        if spare:
            return spare.pop()
        return torch.empty(shape, dtype=self.dtype, pin_memory=self.device.type == "cuda")

    def _release(self, streams: dict[str, list[torch.Tensor]]) -> None:
        """A finished block's inputs become spare buffers (tracks of one checkpoint share the first block's)."""
        unique = {id(t): t for buffers in streams.values() for t in buffers}
        for t in unique.values():
            self._spare.setdefault(tuple(t.shape), []).append(t)

    def _load(self, side: Side, block: str):
        """The side's layer for ``block``, and for an MTP block its entry and the embedding it mixes in."""
        t0 = time.perf_counter()
        layer = build_layer(side.source, self.config, self.cfg, block)
        entry = None
        if block.startswith("mtp."):
            entry = (MtpEntry.load(side.source, self.config, block), side.source.tensor("embed.weight"))
        self._sync()
        self.seconds["read"] += time.perf_counter() - t0
        return layer, entry

    def _forward(self, track: Track, layer, entry, streams: torch.Tensor, batch: int, rows: slice,
                 block: str, local: bool = False) -> torch.Tensor:
        """One micro-batch of the previous block's output ``streams`` through ``layer`` (result on the device)."""
        t0 = time.perf_counter()
        ids = self.batches[batch].ids[rows, _shift(block):]
        handles = [h for obs in self.observers
                   if (h := obs.install(layer, block, track, batch, rows, local)) is not None]
        try:
            if entry is not None:   # MTP block j: the token j+1 ahead, mixed into the previous block's streams
                mix, embed = entry
                hidden = mix(F.embedding(ids.to(self.device), embed), streams[rows, : ids.shape[1]].to(self.device))
            else:
                hidden = streams[rows]
            out = self.runners[track.label](layer, hidden, ids)
            self._sync()
        finally:
            for h in handles:
                h.remove()
        for obs in self.observers:
            obs.finished(block, track, batch, rows, local)
        self.seconds["forward"] += time.perf_counter() - t0
        return out

    # -- the run ----------------------------------------------------------------------------

    @torch.no_grad()
    def run(self) -> EngineResult:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        started = time.perf_counter()
        streams = self._embedded()
        results: list[BlockResult] = []
        output = {t.label: OutputStats() for t in self.tracks[1:]}
        retrieval: dict[str, list] = {}
        top1: dict[str, list[torch.Tensor]] = {}
        mtp: dict[str, dict[str, float]] = {t.label: {} for t in self.tracks}
        scored = False
        bar = tqdm(total=len(self.sides) * len(self.blocks), desc="compare", unit="block", disable=not self.progress)
        try:
            for block in self.blocks:
                if block.startswith("mtp.") and not scored:
                    retrieval = self._score_outputs(streams, output, top1)
                    scored = True
                before = dict(self.seconds)
                shift = _shift(block)
                nxt = {t.label: [self._host(b, shift) for b in self.batches] for t in self.tracks}
                free = {t.label: HiddenError() for t in self.tracks[1:]}
                local = {t.label: HiddenError() for t in self.tracks[1:] if t.local}
                for side in self.sides:
                    layer, entry = self._load(side, block)
                    for track in (t for t in self.tracks if t.side is side):
                        installed = install(layer, block, track.numerics, side.source,
                                            entry[0] if entry is not None else None)
                        try:
                            self._pass(track, layer, entry, block, streams, nxt, free, local)
                        finally:
                            installed.remove()
                    del layer, entry
                    bar.update()
                if block.startswith("mtp."):
                    for track in self.tracks:
                        mtp[track.label][block] = self._draft_agreement(track, block, nxt[track.label], top1[track.label])
                self._release(streams)
                streams = nxt
                spent = {k: round(self.seconds[k] - before[k], 4) for k in self.seconds}
                results.append(BlockResult(block, {k: v.result() for k, v in free.items()},
                                           {k: v.result() for k, v in local.items()}, spent))
            if not scored:
                retrieval = self._score_outputs(streams, output, top1)
        finally:
            bar.close()
        self.seconds["total"] = time.perf_counter() - started
        peak = torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else None
        return EngineResult(results, output, retrieval, mtp, {k: round(v, 3) for k, v in self.seconds.items()}, peak)

    def _embedded(self) -> dict[str, list[torch.Tensor]]:
        """Every track's first-layer input: its checkpoint's embedding, copied to every stream."""
        out: dict[str, list[torch.Tensor]] = {}
        for side in self.sides:
            embed = side.source.tensor("embed.weight")
            per_batch = []
            for batch in self.batches:
                host = self._host(batch, 0)
                for rows in self._rows(batch):
                    emb = F.embedding(batch.ids[rows].to(self.device), embed)
                    host[rows] = emb.unsqueeze(2).expand(-1, -1, self.cfg.hc_mult, -1).cpu()
                per_batch.append(host)
            del embed
            for track in (t for t in self.tracks if t.side is side):
                out[track.label] = per_batch    # shared until a block writes each track's own output
        return out

    def _pass(self, track: Track, layer, entry, block: str, streams, nxt, free, local) -> None:
        """``track`` through the loaded ``layer`` for every batch; its errors against the reference."""
        ref = self.reference.label
        for b, batch in enumerate(self.batches):
            for rows in self._rows(batch):
                mine = self._forward(track, layer, entry, streams[track.label][b], b, rows, block)
                if track.label != ref:
                    reference = nxt[ref][b][rows].to(self.device)
                    self._measure(free[track.label], reference, mine)
                    if track.local:
                        given = self._forward(track, layer, entry, streams[ref][b], b, rows, block, local=True)
                        self._measure(local[track.label], reference, given)
                nxt[track.label][b][rows] = mine.cpu()

    def _measure(self, error: HiddenError, reference: torch.Tensor, other: torch.Tensor) -> None:
        t0 = time.perf_counter()
        error.add(reference, other)
        self.seconds["metrics"] += time.perf_counter() - t0

    def _score_outputs(self, final, output: dict[str, OutputStats], top1: dict[str, list[torch.Tensor]]) -> dict:
        """Each track's logits at the scored positions against the reference's, and retrieval of the answers."""
        t0 = time.perf_counter()
        ref = self.reference.label
        heads = {side.label: OutputHead(side.source, self.config) for side in self.sides}
        retrieval: dict[str, list] = {t.label: [] for t in self.tracks}
        for track in self.tracks:
            top1[track.label] = [torch.empty(b.ids.shape, dtype=torch.int64) for b in self.batches]
        for b, batch in enumerate(self.batches):
            for track in self.tracks:
                retrieval[track.label].append([])
            for row in range(batch.ids.shape[0]):
                first, last = batch.scored(row)
                seq = batch.ids.shape[1]
                answer = {t.label: [] for t in self.tracks}
                # The MTP blocks need every position's top-1; without them only the scored positions matter.
                need_all = any(block.startswith("mtp.") for block in self.blocks)
                for start in range(0 if need_all else first - first % HEAD_POSITIONS, seq, HEAD_POSITIONS):
                    end = min(start + HEAD_POSITIONS, seq)
                    if not need_all and start >= last:
                        break
                    logits = {t.label: heads[t.side.label](final[t.label][b][row:row + 1, start:end].to(self.device))[0]
                              for t in self.tracks}
                    for label, value in logits.items():
                        top1[label][b][row, start:end] = value.argmax(-1).cpu()
                    lo, hi = max(start, first), min(end, last)
                    if hi > lo:
                        nxt_ids = batch.ids[row, lo + 1:hi + 1]
                        for label, value in logits.items():
                            if label != ref:
                                output[label].add(logits[ref][lo - start:hi - start], value[lo - start:hi - start],
                                                  nxt_ids)
                            if batch.answers is not None:
                                part = value[lo - start:hi - start].double()
                                logp = torch.log_softmax(part, -1).gather(1, nxt_ids[:, None].to(part.device))
                                answer[label].append((part.argmax(-1).cpu() == nxt_ids, logp.sum().cpu()))
                for label, parts in answer.items():
                    if parts:
                        hits = torch.cat([p[0] for p in parts])
                        retrieval[label][b].append((bool(hits.all()), float(sum(p[1] for p in parts))))
        del heads
        self.seconds["metrics"] += time.perf_counter() - t0
        return retrieval if any(b.answers is not None for b in self.batches) else {}

    def _draft_agreement(self, track: Track, block: str, streams: list[torch.Tensor],
                         main_top1: list[torch.Tensor]) -> float:
        """How often MTP block ``j``'s top-1 at ``t`` is its own main model's top-1 at ``t + j + 1``: the
        draft token a speculative decoder would accept (0 % is the broken-draft failure)."""
        t0 = time.perf_counter()
        head = OutputHead(track.side.source, self.config, f"{block}.")
        shift = _shift(block)
        agree = total = 0
        for b, batch_streams in enumerate(streams):
            n, seq = batch_streams.shape[:2]
            for row in range(n):
                for start in range(0, seq, HEAD_POSITIONS):
                    end = min(start + HEAD_POSITIONS, seq)
                    draft = head(batch_streams[row:row + 1, start:end].to(self.device))[0].argmax(-1).cpu()
                    want = main_top1[b][row, start + shift:end + shift]
                    agree += int((draft == want).sum())
                    total += want.numel()
        self.seconds["metrics"] += time.perf_counter() - t0
        return agree / total if total else math.nan


def _shift(block: str) -> int:
    """How many tokens shorter a block's sequences are: MTP block j reads the token j+1 ahead."""
    kind, idx = block.split(".")
    return 0 if kind == "layers" else int(idx) + 1
