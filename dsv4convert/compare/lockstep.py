"""Checkpoints through the model in lockstep, one block at a time, on one device.

For each block (the backbone layers in order, then the MTP blocks) each checkpoint's layer is built
once (:mod:`dsv4convert.model.blocks`) and every *track* on that checkpoint runs through it: a track
is a checkpoint under one set of numerics (the base as served, the variant as served, the variant
with only some parts of its serving numerics for an ablation, the base once more in other chunks
for a noise floor, which may run only some of the sequences). The reference track goes first and
runs every sequence; its outputs are what every other track's are
measured against, *free-running* (each track on its own streams: the drift a user gets) and, for a
track that asks, *local* (its layer fed the reference's input: what this block alone adds). Only one
layer is resident at a time; each track's streams ``[sequences, seq, hc_mult, hidden]`` live on the
host between blocks, and each micro-batch goes through the layer in query chunks
(:class:`dsv4convert.model.forward.BlockRunner`). Batches of different lengths (a needle grid)
share each loaded layer, so a checkpoint is read once whatever the grid. The next layer's stored
bytes are read from disk on a background thread while the tracks run through the current one (into
page-locked host memory); building it (copies to the device, dequantizing) waits for its turn, so the
device never holds more than one layer, and reading costs only what the forwards do not hide.

After the backbone, each track's output head gives logits at the scored positions, compared with the
reference's (:mod:`.metrics`) and, where a batch marks answer tokens, checked for retrieval; after each
MTP block, its head gives the draft's prediction, scored against the same track's main model. A DSpark
drafter (0731) is not a block in that sequence: the target layers' outputs are captured as the backbone
streams through, and its stages run after the backbone (:class:`~.dspark.DraftPass`).
Observers (:class:`BlockObserver`) see each track's pass through each block, as the recall diagnosis
needs (the indexer's choices).

Under torch.distributed (:mod:`dsv4convert.distributed`) each rank runs its own micro-batches (round
robin) of every track through every block and keeps only their streams; per micro-batch results
(error sums, per-position metrics, retrievals, draft agreement counts) are gathered on rank 0 and
combined in the global micro-batch order, so rank 0's result is the same for any number of ranks.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F
from tqdm import tqdm

from dsv4convert.checkpoint import Checkpoint
from dsv4convert.compare import DEFAULT_ANCHORS
from dsv4convert.compare.dspark import DraftPass, UnitDraft
from dsv4convert.compare.emulate import Installed, install
from dsv4convert.compare.metrics import HiddenError, OutputStats
from dsv4convert.compare.numerics import Numerics
from dsv4convert.distributed import World
from dsv4convert.inspection import Inspection
from dsv4convert.models.deepseek_v4.layout import ModelConfig
from dsv4convert.models.deepseek_v4.names import in_draft
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
    rows: frozenset[tuple[int, int]] | None = None   # the (batch, row)s it runs (None: all; the reference runs all)

    def runs(self, unit: Unit) -> bool:
        return self.rows is None or any((unit.batch, r) in self.rows for r in range(unit.rows.start, unit.rows.stop))


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
    """Sees each pass of a track through a block: ``local`` when the track's layer takes the reference's input.
    ``merge`` folds the other ranks' observers into rank 0's (``exported`` is what a rank sends)."""

    def install(self, layer, block: str, track: Track, batch: int, rows: slice, local: bool) -> Installed | None: ...

    def finished(self, block: str, track: Track, batch: int, rows: slice, local: bool) -> None: ...

    def exported(self) -> object: ...

    def merge(self, parts: list[object]) -> None: ...


@dataclass(frozen=True)
class Unit:
    """A micro-batch: rows of one batch, the smallest piece of work a rank runs."""

    index: int          # position in the global order
    batch: int
    rows: slice


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
    retrieval: dict[str, list[list[tuple[bool, float] | None]]]   # track -> per batch, per row: (retrieved,
    #                                                                log p(answer)); None where the track did not run
    mtp: dict[str, dict[str, float]] = field(default_factory=dict)   # track -> draft agreement per MTP block
    dspark: list[UnitDraft] = field(default_factory=list)  # a DSpark drafter's results per micro-batch, in order
    seconds: dict[str, float] = field(default_factory=dict)
    peak_device_bytes: int | None = None
    tokens_per_rank: list[int] = field(default_factory=list)
    peak_device_bytes_per_rank: list[int | None] = field(default_factory=list)


class LockstepEngine:
    """Runs ``tracks`` (the first is the reference) over ``batches``; see the module docstring. On ranks
    other than 0 of a ``world``, :meth:`run` returns None (rank 0 holds the combined result)."""

    def __init__(self, tracks: list[Track], batches: list[Batch], *, device: torch.device, dtype: torch.dtype,
                 chunk: int | None, batch_size: int = 1, mtp: bool = True, progress: bool = True,
                 observers: list[BlockObserver] = (), world: World = World(), draft_anchors: int = DEFAULT_ANCHORS,
                 first_block: Callable[[float], None] | None = None):
        if len({t.label for t in tracks}) != len(tracks):
            raise ValueError("track labels must differ")
        if tracks[0].rows is not None:
            raise ValueError("the reference track runs every sequence")
        self.tracks, self.reference, self.batches = tracks, tracks[0], batches
        self.device, self.dtype, self.batch_size, self.progress = device, dtype, batch_size, progress
        self.observers, self.world = list(observers), world
        self.first_block = first_block    # told the first block's seconds (the expected-time line's refinement)
        self.cfg: ModelConfig = tracks[0].side.inspection.config
        self.config = hf_config(tracks[0].side.ckpt.config)
        self.runners = {t.label: BlockRunner(self.config, device, dtype, chunk=t.chunk or chunk) for t in tracks}
        self.sides = list({id(t.side): t.side for t in tracks}.values())   # reference's checkpoint first
        # The preview's MTP blocks run as blocks; a DSpark drafter's stages run after the backbone (DraftPass).
        dspark = self.cfg.dspark is not None
        self.blocks = [b for b in self.cfg.block_prefixes() if (mtp and not dspark) or b.startswith("layers.")]
        # Per block: read, forward, metrics, new host buffers, and the rest of the block (numerics installed,
        # buffers handed over); outside blocks: embedding and output heads (in "metrics"), the total.
        self.seconds: dict[str, float] = {"read": 0.0, "forward": 0.0, "metrics": 0.0, "buffers": 0.0, "other": 0.0}
        self._spare: dict[tuple[int, ...], list[torch.Tensor]] = {}
        self._registered: list[torch.Tensor] = []       # page-locked host buffers, unregistered after the run
        self.background_read = 0.0                      # seconds the reading thread spent (mostly hidden)
        units = [(b, slice(i, min(i + batch_size, batch.ids.shape[0])))
                 for b, batch in enumerate(batches) for i in range(0, batch.ids.shape[0], batch_size)]
        self.units = [Unit(i, b, rows) for i, (b, rows) in enumerate(units)]
        self.mine = [u for u in self.units if world.owns(u.index)]
        self.units_of = {t.label: [u for u in self.mine if t.runs(u)] for t in tracks}
        self.draft = DraftPass(self, draft_anchors) if mtp and dspark else None

    # -- the pieces -------------------------------------------------------------------------

    def phase(self, desc: str, total: int) -> tqdm:
        """A progress bar of its own for work after the blocks (output heads, the DSpark pass), so the block
        bar never sits full while minutes of work remain."""
        return tqdm(total=total, desc=f"compare: {desc}", unit="unit",
                    disable=not (self.progress and self.world.is_main))

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _host(self, unit: Unit, shift: int) -> torch.Tensor:
        """A host buffer for a micro-batch's streams: one freed by an earlier block if its shape fits (pinning
        host memory is slow: allocating every block's outputs afresh cost a minute a block on a long grid)."""
        ids = self.batches[unit.batch].ids[unit.rows]
        shape = (ids.shape[0], ids.shape[1] - shift, self.cfg.hc_mult, self.cfg.hidden_size)
        spare = self._spare.get(shape)
        if spare:
            return spare.pop()
        t0 = time.perf_counter()
        buffer = torch.empty(shape, dtype=self.dtype)
        if self.device.type == "cuda":
            # Page-locked in place: torch's pinned allocator rounds each buffer up to a power of two, which
            # took a 64K needle grid's host streams past 125 GB; these are unregistered when the run ends.
            size = buffer.numel() * buffer.element_size()
            torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), size, 0))
            self._registered.append(buffer)
        self.seconds["buffers"] += time.perf_counter() - t0
        return buffer

    def _unregister(self) -> None:
        while self._registered:
            torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(self._registered.pop().data_ptr()))

    def _release(self, streams: dict[str, dict[int, torch.Tensor]]) -> None:
        """A finished block's inputs become spare buffers (tracks of one checkpoint share the first block's)."""
        unique = {id(t): t for buffers in streams.values() for t in buffers.values()}
        for t in unique.values():
            self._spare.setdefault(tuple(t.shape), []).append(t)

    def _read(self, side: Side, block: str) -> dict[str, torch.Tensor]:
        """The block's stored tensors on the host (on the reading thread)."""
        t0 = time.perf_counter()
        tensors = side.source.read_block(block)
        self.background_read += time.perf_counter() - t0
        return tensors

    def _build(self, side: Side, block: str, tensors: dict[str, torch.Tensor]):
        """The side's layer for ``block``, and for an MTP block its entry and the embedding it mixes in."""
        with side.source.staged(tensors):
            layer = build_layer(side.source, self.config, self.cfg, block)
            entry = None
            if in_draft(block):
                entry = (MtpEntry.load(side.source, self.config, block), side.source.tensor("embed.weight"))
        self._sync()
        return layer, entry

    def _layers(self, order: list[tuple[Side, str]]) -> Iterator[tuple[object, object]]:
        """The layers of ``order`` one after another; the next one's bytes are read while the caller runs the
        current. "read" counts the time the caller waits for the bytes and builds the layer."""
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="dsv4convert-read") as pool:
            pending = pool.submit(self._read, *order[0]) if order else None
            try:
                for i, (side, block) in enumerate(order):
                    t0 = time.perf_counter()
                    tensors = pending.result()
                    pending = pool.submit(self._read, *order[i + 1]) if i + 1 < len(order) else None
                    layer, entry = self._build(side, block, tensors)
                    del tensors
                    self.seconds["read"] += time.perf_counter() - t0
                    yield layer, entry
                    del layer, entry
            finally:
                if pending is not None:
                    pending.cancel()

    def _forward(self, track: Track, layer, entry, streams: torch.Tensor, unit: Unit, block: str,
                 local: bool = False) -> torch.Tensor:
        """One micro-batch of the previous block's output ``streams`` through ``layer`` (result on the device)."""
        t0 = time.perf_counter()
        ids = self.batches[unit.batch].ids[unit.rows, _shift(block):]
        handles = [h for obs in self.observers
                   if (h := obs.install(layer, block, track, unit.batch, unit.rows, local)) is not None]
        try:
            if entry is not None:   # MTP block j: the token j+1 ahead, mixed into the previous block's streams
                mix, embed = entry
                hidden = mix(F.embedding(ids.to(self.device), embed), streams[:, : ids.shape[1]].to(self.device))
            else:
                hidden = streams
            out = self.runners[track.label](layer, hidden, ids)
            self._sync()
        finally:
            for h in handles:
                h.remove()
        for obs in self.observers:
            obs.finished(block, track, unit.batch, unit.rows, local)
        self.seconds["forward"] += time.perf_counter() - t0
        return out

    # -- the run ----------------------------------------------------------------------------

    @torch.no_grad()
    def run(self) -> EngineResult | None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        started = time.perf_counter()
        results: list[BlockResult] = []
        output: dict[str, dict[int, OutputStats]] = {t.label: {} for t in self.tracks[1:]}
        retrieval: dict[str, dict[tuple[int, int], tuple[bool, float]]] = {t.label: {} for t in self.tracks}
        top1: dict[str, dict[int, torch.Tensor]] = {}
        agreement: dict[str, dict[str, tuple[int, int]]] = {t.label: {} for t in self.tracks}
        scored = False
        drafts: dict[int, UnitDraft] = {}
        bar = tqdm(total=len(self.blocks), desc="compare", unit="block",   # as the dry run counts them
                   disable=not (self.progress and self.world.is_main))
        layers = self._layers([(side, block) for block in self.blocks for side in self.sides])
        try:
            streams = self._embedded()
            for block in self.blocks:
                if in_draft(block) and not scored:
                    self._score_outputs(streams, output, retrieval, top1)
                    scored = True
                before, block_started = dict(self.seconds), time.perf_counter()
                shift = _shift(block)
                nxt = {t.label: {u.index: self._host(u, shift) for u in self.units_of[t.label]} for t in self.tracks}
                free = {t.label: {} for t in self.tracks[1:]}
                local = {t.label: {} for t in self.tracks[1:] if t.local}
                for side in self.sides:
                    layer, entry = next(layers)
                    for track in (t for t in self.tracks if t.side is side):
                        installed = install(layer, block, track.numerics, side.source,
                                            entry[0] if entry is not None else None)
                        try:
                            self._pass(track, layer, entry, block, streams, nxt, free, local)
                        finally:
                            installed.remove()
                    del layer, entry
                bar.update()
                if self.draft is not None:
                    self.draft.capture(block, nxt)
                if in_draft(block):
                    for track in self.tracks:
                        agreement[track.label][block] = self._draft_agreement(track, block, nxt[track.label],
                                                                              top1[track.label])
                self._release(streams)
                streams = nxt
                counted = sum(self.seconds[k] - before[k] for k in self.seconds)
                self.seconds["other"] += time.perf_counter() - block_started - counted
                spent = {k: round(self.seconds[k] - before[k], 4) for k in self.seconds}
                results.append(self._block_result(block, free, local, spent))
                if len(results) == 1 and self.first_block is not None and self.world.is_main:
                    self.first_block(time.perf_counter() - started)
            bar.close()           # the phases after the blocks have bars of their own
            if not scored:
                self._score_outputs(streams, output, retrieval, top1)
            if self.draft is not None:
                drafts = self.draft.run(top1)
                self.seconds["dspark"] = self.draft.seconds
        finally:
            layers.close()
            bar.close()
            self._unregister()
            self._spare.clear()
        self.seconds["total"] = time.perf_counter() - started
        return self._combined(results, output, retrieval, agreement, drafts)

    def _pass(self, track: Track, layer, entry, block: str, streams, nxt, free, local) -> None:
        """``track`` through the loaded ``layer`` for this rank's micro-batches; errors against the reference."""
        ref = self.reference.label
        for unit in self.units_of[track.label]:
            mine = self._forward(track, layer, entry, streams[track.label][unit.index], unit, block)
            if track.label != ref:
                reference = nxt[ref][unit.index].to(self.device)
                free[track.label][unit.index] = self._measure(reference, mine)
                if track.local:
                    given = self._forward(track, layer, entry, streams[ref][unit.index], unit, block, local=True)
                    local[track.label][unit.index] = self._measure(reference, given)
            nxt[track.label][unit.index].copy_(mine)

    def _measure(self, reference: torch.Tensor, other: torch.Tensor) -> HiddenError:
        t0 = time.perf_counter()
        error = HiddenError()
        error.add(reference, other)
        self.seconds["metrics"] += time.perf_counter() - t0
        return error

    def _block_result(self, block: str, free: dict, local: dict, spent: dict) -> BlockResult:
        """The block's errors over every rank's micro-batches, summed on rank 0 in the global order."""
        def combined(parts: dict[str, dict[int, HiddenError]]) -> dict[str, dict]:
            gathered = self.world.gather(parts)
            if gathered is None:
                return {}
            out = {}
            for label in parts:
                total = HiddenError()
                for _, error in sorted((i, e) for rank in gathered for i, e in rank[label].items()):
                    total.merge(error)
                out[label] = total.result()
            return out
        return BlockResult(block, combined(free), combined(local), spent)

    def _embedded(self) -> dict[str, dict[int, torch.Tensor]]:
        """Every track's first-layer input: its checkpoint's embedding, copied to every stream."""
        out: dict[str, dict[int, torch.Tensor]] = {}
        for side in self.sides:
            embed = side.source.tensor("embed.weight")
            per_unit = {}
            for unit in self.mine:
                host = self._host(unit, 0)
                emb = F.embedding(self.batches[unit.batch].ids[unit.rows].to(self.device), embed)
                host.copy_(emb.unsqueeze(2).expand(-1, -1, self.cfg.hc_mult, -1))
                per_unit[unit.index] = host
            del embed
            for track in (t for t in self.tracks if t.side is side):
                out[track.label] = per_unit    # shared until a block writes each track's own output
        return out

    def _score_outputs(self, final, output: dict[str, dict[int, OutputStats]],
                       retrieval: dict[str, dict[tuple[int, int], tuple[bool, float]]],
                       top1: dict[str, dict[int, torch.Tensor]]) -> None:
        """Each track's logits at the scored positions against the reference's, and retrieval of the answers."""
        t0 = time.perf_counter()
        ref = self.reference.label
        heads = {side.label: OutputHead(side.source, self.config) for side in self.sides}
        bar = self.phase("output heads", len(self.mine))
        # the drafts need every top-1
        need_all = any(in_draft(block) for block in self.blocks) or self.draft is not None
        for track in self.tracks:
            top1[track.label] = {}
        for unit in self.mine:
            batch = self.batches[unit.batch]
            ids = batch.ids[unit.rows]
            tracks = [t for t in self.tracks if t.runs(unit)]
            for track in tracks:
                top1[track.label][unit.index] = torch.empty(ids.shape, dtype=torch.int64)
            for label in output:
                if any(t.label == label for t in tracks):
                    output[label][unit.index] = OutputStats()
            for i, row in enumerate(range(unit.rows.start, unit.rows.stop)):
                first, last = batch.scored(row)
                seq = ids.shape[1]
                answer = {t.label: [] for t in tracks}
                for start in range(0 if need_all else first - first % HEAD_POSITIONS, seq, HEAD_POSITIONS):
                    end = min(start + HEAD_POSITIONS, seq)
                    if not need_all and start >= last:
                        break
                    logits = {t.label: heads[t.side.label](final[t.label][unit.index][i:i + 1, start:end]
                                                           .to(self.device))[0] for t in tracks}
                    for label, value in logits.items():
                        top1[label][unit.index][i, start:end] = value.argmax(-1).cpu()
                    lo, hi = max(start, first), min(end, last)
                    if hi <= lo:
                        continue
                    nxt_ids = ids[i, lo + 1:hi + 1]
                    for label, value in logits.items():
                        if label != ref:
                            output[label][unit.index].add(logits[ref][lo - start:hi - start],
                                                          value[lo - start:hi - start], nxt_ids)
                        if batch.answers is not None:
                            part = value[lo - start:hi - start].double()
                            logp = torch.log_softmax(part, -1).gather(1, nxt_ids[:, None].to(part.device))
                            answer[label].append((part.argmax(-1).cpu() == nxt_ids, logp.sum().cpu()))
                for label, parts in answer.items():
                    if parts:
                        hits = torch.cat([p[0] for p in parts])
                        retrieval[label][(unit.batch, row)] = (bool(hits.all()), float(sum(p[1] for p in parts)))
            bar.update()
        bar.close()
        del heads
        self.seconds["metrics"] += time.perf_counter() - t0

    def _draft_agreement(self, track: Track, block: str, streams: dict[int, torch.Tensor],
                         main_top1: dict[int, torch.Tensor]) -> tuple[int, int]:
        """(agreeing, total): MTP block ``j``'s top-1 at ``t`` against its own main model's top-1 at
        ``t + j + 1``, the draft token a speculative decoder would accept (0 % is the broken-draft failure)."""
        t0 = time.perf_counter()
        head = OutputHead(track.side.source, self.config, f"{block}.")
        shift = _shift(block)
        agree = total = 0
        for unit in self.units_of[track.label]:
            unit_streams = streams[unit.index]
            n, seq = unit_streams.shape[:2]
            for row in range(n):
                for start in range(0, seq, HEAD_POSITIONS):
                    end = min(start + HEAD_POSITIONS, seq)
                    draft = head(unit_streams[row:row + 1, start:end].to(self.device))[0].argmax(-1).cpu()
                    want = main_top1[unit.index][row, start + shift:end + shift]
                    agree += int((draft == want).sum())
                    total += want.numel()
        self.seconds["metrics"] += time.perf_counter() - t0
        return agree, total

    def _combined(self, results: list[BlockResult], output, retrieval, agreement, drafts) -> EngineResult | None:
        """Every rank's per-micro-batch results on rank 0, in the global order."""
        peak = torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else None
        tokens = sum(self.batches[u.batch].ids[u.rows].numel() for u in self.mine)
        parts = self.world.gather({"output": output, "retrieval": retrieval, "agreement": agreement,
                                   "observers": [obs.exported() for obs in self.observers], "tokens": tokens,
                                   "peak": peak, "seconds": dict(self.seconds), "drafts": drafts})
        if parts is None:
            return None
        merged_output = {}
        for label in output:
            stats = OutputStats()
            for _, part in sorted((i, s) for rank in parts for i, s in rank["output"][label].items()):
                stats.merge(part)
            merged_output[label] = stats
        by_row = {label: {k: v for rank in parts for k, v in rank["retrieval"][label].items()} for label in retrieval}
        merged_retrieval = {}
        if any(b.answers is not None for b in self.batches):
            merged_retrieval = {label: [[rows.get((b, r)) for r in range(batch.ids.shape[0])]
                                        for b, batch in enumerate(self.batches)] for label, rows in by_row.items()}
        mtp = {}
        for label in agreement:
            mtp[label] = {}
            for block in agreement[label]:
                agree = sum(rank["agreement"][label][block][0] for rank in parts)
                total = sum(rank["agreement"][label][block][1] for rank in parts)
                mtp[label][block] = agree / total if total else math.nan
        for i, obs in enumerate(self.observers):
            obs.merge([rank["observers"][i] for rank in parts[1:]])
        peaks = [rank["peak"] for rank in parts if rank["peak"] is not None]
        seconds = {**{k: round(v, 3) for k, v in self.seconds.items()}, "read_in_background": round(self.background_read, 3)}
        dspark = [d for _, d in sorted(((i, d) for rank in parts for i, d in rank["drafts"].items()),
                                         key=lambda pair: pair[0])]
        return EngineResult(results, merged_output, merged_retrieval, mtp, dspark, seconds,
                            max(peaks) if peaks else None, [rank["tokens"] for rank in parts],
                            [rank["peak"] for rank in parts])


def _shift(block: str) -> int:
    """How many tokens shorter a block's sequences are: MTP block j reads the token j+1 ahead."""
    kind, idx = block.split(".")
    return 0 if kind == "layers" else int(idx) + 1
