"""``compare --recall``: needle retrieval and the indexer's choices, base against variant, offline.

Prompts come from :mod:`dsv4convert.needle` (the builder ``serve --check recall`` uses), each followed
by its answer's tokens (teacher forcing): a prompt is retrieved when every answer token is the argmax
given the ones before, which is exactly what greedy decoding would produce. All prompts of the grid
share each loaded block (:class:`~dsv4convert.compare.engine.LockstepEngine`), so a checkpoint is read
once. A hook on every CSA layer's indexer (``DeepseekV4Indexer``: ``[B, S, k]`` compressed-entry
indices, -1 invalid) gives, per track:

* where the needle stood in the query rows that produce the answer: is a compressed entry holding it
  selected, and at what rank (the indexer's top-k is sorted by score);
* the top-k overlap ``|A ∩ B| / k`` with the reference on every sparse row (position ``t >= threshold - 1``
  of :func:`~dsv4convert.needle.selection_threshold`; before it both sets are everything), free-running
  and local, and the same for a *noise floor*: the base once more in other query chunks, which changes
  nothing but float rounding. Rounding does not depend on where the needle sits, so by default the noise
  floor runs one prompt per length (the middle depth): every length, a third of a three-depth grid's
  forward work (``noise_floor="all"`` runs every prompt).

``--ablate`` adds tracks that switch the served numerics on one part at a time, for the base too,
against the base with its weights only: weights only; + activation quantization; + FP8 KV cache;
+ FP8 indexer (all of it: what the server runs); FP4 indexer instead. The first row that loses the
needle names the culprit.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch

from dsv4convert.compare.emulate import Installed
from dsv4convert.compare.engine import Batch, Track
from dsv4convert.compare.numerics import Numerics
from dsv4convert.errors import DSV4Error
from dsv4convert.needle import (
    DEFAULT_DEPTHS,
    PromptTemplate,
    RecallPrompt,
    answer_ids,
    default_lengths,
    needle_entries,
    recall_grid,
    selection_threshold,
    shortest_prompt,
)


NOISE_FLOORS = ("per-length", "all")    # the noise floor's prompts (``--noise-floor``)


@dataclass
class RecallOptions:
    lengths: list[int] | None = None        # default: needle.default_lengths of the checkpoint's threshold
    depths: tuple[float, ...] = DEFAULT_DEPTHS
    trials: int = 1
    seed: int = 0
    ablate: bool = False
    local: bool = False                     # also run the variant's blocks on the base's input (one more pass)
    noise_floor: str = "per-length"         # the noise floor's prompts: "per-length" (middle depth) or "all"
    longest: int | None = None              # the default lengths' longest (default: 64 x the threshold)


@dataclass
class Grid:
    """The prompts, their batches (one per total length) and where each prompt landed."""

    prompts: list[RecallPrompt]
    batches: list[Batch]
    where: list[tuple[int, int]]            # prompt index -> (batch, row)
    threshold: int                          # the first prompt length whose answer query leaves an entry out


def build_grid(tokenizer, config: dict, opts: RecallOptions, template: PromptTemplate = PromptTemplate()) -> Grid:
    threshold = selection_threshold(int(config["index_topk"]))
    shortest = shortest_prompt(tokenizer, template)
    lengths = opts.lengths or default_lengths(threshold, shortest, opts.longest)
    if not lengths:
        raise DSV4Error(f"no needle length fits: a prompt needs at least {shortest} tokens")
    if opts.trials < 1:
        raise DSV4Error(f"--trials must be at least 1, got {opts.trials}")
    try:
        prompts = recall_grid(tokenizer, lengths, opts.depths, opts.trials, opts.seed, template)
    except ValueError as exc:
        raise DSV4Error(f"needle grid: {exc}") from None
    rows: dict[int, list[tuple[int, list[int], tuple[int, int]]]] = defaultdict(list)
    for i, prompt in enumerate(prompts):
        answer = answer_ids(tokenizer, prompt.needle)
        ids = prompt.input_ids + answer
        rows[len(ids)].append((i, ids, (len(prompt.input_ids), len(ids))))
    batches, where = [], [(0, 0)] * len(prompts)
    for total in sorted(rows):
        group = rows[total]
        for r, (i, _, _) in enumerate(group):
            where[i] = (len(batches), r)
        batches.append(Batch(torch.tensor([ids for _, ids, _ in group], dtype=torch.int64),
                             answers=[span for _, _, span in group]))
    return Grid(prompts, batches, where, threshold)


def noise_rows(grid: Grid, which: str) -> frozenset[tuple[int, int]] | None:
    """The (batch, row)s the noise floor runs: None for every prompt, else the first prompt of each length
    at the grid's middle depth."""
    if which not in NOISE_FLOORS:
        raise DSV4Error(f"--noise-floor must be one of {', '.join(NOISE_FLOORS)}, got {which!r}")
    if which == "all":
        return None
    depths = sorted({p.depth for p in grid.prompts})
    middle = depths[(len(depths) - 1) // 2]
    first: dict[int, int] = {}
    for i, prompt in enumerate(grid.prompts):
        if prompt.depth == middle:
            first.setdefault(prompt.length, i)
    return frozenset(grid.where[i] for i in first.values())


def ablation_rows(served: Numerics, *, fp4_allowed: bool) -> list[tuple[str, Numerics]]:
    """The served numerics switched on one part at a time (the last two differ in the indexer only)."""
    rows = [("weights only", served.with_parts(activations=False, kv_cache=False, indexer=None)),
            ("+ activations", served.with_parts(activations=True, kv_cache=False, indexer=None)),
            ("+ FP8 KV cache", served.with_parts(activations=True, kv_cache=True, indexer=None)),
            ("+ FP8 indexer (served)", served.with_parts(activations=True, kv_cache=True, indexer="fp8"))]
    if fp4_allowed:
        rows.append(("FP8 -> FP4 indexer", served.with_parts(activations=True, kv_cache=True, indexer="fp4")))
    return rows


@dataclass
class _Overlap:
    rows: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)  # (batch, row) -> float16 per position

    def summary(self) -> dict:
        if not self.rows:
            return {"rows": 0, "mean": None, "p1": None, "min": None}
        v = torch.cat([self.rows[k] for k in sorted(self.rows)]).float()
        return {"rows": v.numel(), "mean": float(v.mean()),
                "p1": float(torch.quantile(v, 0.01)) if v.numel() > 1 else float(v[0]), "min": float(v.min())}


class TopkObserver:
    """Hooks every CSA layer's indexer; keeps needle ranks and top-k overlaps per track and layer."""

    def __init__(self, grid: Grid, reference: str):
        self.grid, self.reference = grid, reference
        self._index = {where: i for i, where in enumerate(grid.where)}
        self._calls: list[torch.Tensor] = []
        self._reference_picks: dict[tuple[int, int], torch.Tensor] = {}   # (batch, row) -> [S, k] this block
        self._block: str | None = None
        self.ranks: dict[str, dict[str, dict[int, int | None]]] = defaultdict(lambda: defaultdict(dict))
        self.overlap: dict[tuple[str, str, str], _Overlap] = defaultdict(_Overlap)  # (track, kind, block)
        self.layers: list[str] = []

    def install(self, layer, block: str, track: Track, batch: int, rows: slice, local: bool) -> Installed | None:
        indexer = getattr(getattr(layer.self_attn, "compressor", None), "indexer", None)
        if indexer is None:
            return None
        if block != self._block:
            self._block = block
            self._reference_picks.clear()
            self.layers.append(block)
        self._calls = []
        installed = Installed()
        installed.hook(indexer.register_forward_hook(lambda module, args, out: self._calls.append(out.to("cpu"))))
        return installed

    def finished(self, block: str, track: Track, batch: int, rows: slice, local: bool) -> None:
        if not self._calls:
            return
        # [rows, S, k], the chunks in order; early chunks pick from a smaller pool (fewer than k): pad with -1.
        k = max(c.shape[-1] for c in self._calls)
        picks = torch.cat([torch.nn.functional.pad(c, (0, k - c.shape[-1]), value=-1) for c in self._calls],
                          dim=1).to(torch.int32)
        self._calls = []
        threshold = self.grid.threshold
        for i, row in enumerate(range(rows.start, rows.stop)):
            key = (batch, row)
            if track.label == self.reference and not local:
                self._reference_picks[key] = picks[i]
            if not local:
                self.ranks[track.label][block][self._prompt(key)] = self._needle_rank(picks[i], key)
            if track.label != self.reference and key in self._reference_picks:
                past = slice(threshold - 1, None)       # the rows whose top-k leaves entries out
                self.overlap[(track.label, "local" if local else "free_running", block)].rows[key] = \
                    overlap(self._reference_picks[key][past], picks[i][past]).half()

    def exported(self) -> dict:
        return {"ranks": {t: {b: dict(v) for b, v in blocks.items()} for t, blocks in self.ranks.items()},
                "overlap": {k: v.rows for k, v in self.overlap.items()}, "layers": list(self.layers)}

    def merge(self, parts: list[dict]) -> None:
        """The other ranks' needle ranks and overlaps; rows keep their global (batch, row) order."""
        for part in parts:
            for track, blocks in part["ranks"].items():
                for block, ranks in blocks.items():
                    self.ranks[track][block].update(ranks)
            for key, rows in part["overlap"].items():
                self.overlap[key].rows.update(rows)
            self.layers += [layer for layer in part["layers"] if layer not in self.layers]

    def _prompt(self, key: tuple[int, int]) -> int:
        return self._index[key]

    def _needle_rank(self, picks: torch.Tensor, key: tuple[int, int]) -> int | None:
        """Rank of the best entry holding the needle in the top-k of the query that gives the first answer token."""
        prompt = self.grid.prompts[self._prompt(key)]
        start, _ = self.grid.batches[key[0]].answers[key[1]]
        row = picks[start - 1]
        entries = torch.tensor(list(needle_entries(prompt.needle_span)), dtype=row.dtype)
        hits = torch.isin(row, entries).nonzero()
        return int(hits[0]) if hits.numel() else None


def overlap(reference: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """Per row, ``|A ∩ B| / |A|`` of two ``[rows, k]`` index sets (-1 entries are not picks)."""
    if reference.numel() == 0:
        return torch.zeros(0)
    a = torch.where(reference < 0, torch.iinfo(reference.dtype).max, reference).sort(dim=-1).values
    b = torch.where(other < 0, torch.iinfo(other.dtype).min, other)
    pos = torch.searchsorted(a.contiguous(), b.contiguous()).clamp(max=a.shape[-1] - 1)
    hits = (a.gather(-1, pos) == b).sum(-1).double()
    size = (reference >= 0).sum(-1).double()
    return torch.where(size > 0, hits / size.clamp(min=1), torch.ones_like(hits))


def summarize(grid: Grid, tracks: list[Track], retrieval: dict, observer: TopkObserver) -> dict:
    """recall.json's content: per track the needle accuracy per (length, depth), per CSA layer the needle's
    selection and rank and the top-k overlap with the reference; the verdicts."""
    out: dict = {"threshold": grid.threshold, "lengths": sorted({p.length for p in grid.prompts}),
                 "depths": sorted({p.depth for p in grid.prompts}), "csa_layers": observer.layers, "tracks": {}}
    for track in tracks:
        trials, ran = [], []
        for i, prompt in enumerate(grid.prompts):
            b, r = grid.where[i]
            if retrieval[track.label][b][r] is None:
                continue            # a prompt this track does not run (the noise floor's other depths)
            retrieved, logp = retrieval[track.label][b][r]
            ran.append(i)
            trials.append({"length": prompt.length, "depth": prompt.depth, "key": prompt.needle.key,
                           "value": prompt.needle.value, "retrieved": retrieved, "answer_logprob": logp})
        cells = defaultdict(list)
        for t in trials:
            cells[(t["length"], t["depth"])].append(t["retrieved"])
        layers = []
        for block in observer.layers:
            ranks = [observer.ranks[track.label][block].get(i) for i in ran]
            selected = [r for r in ranks if r is not None]
            layers.append({
                "layer": block,
                "needle_selected_rate": len(selected) / len(ranks) if ranks else None,
                "needle_median_rank": float(torch.tensor(selected, dtype=torch.float64).median()) if selected else None,
                "overlap_free_running": observer.overlap[(track.label, "free_running", block)].summary(),
                "overlap_local": observer.overlap[(track.label, "local", block)].summary(),
            })
        out["tracks"][track.label] = {
            "numerics": track.numerics.describe(), "chunk": track.chunk, "prompts": len(trials),
            "accuracy": sum(t["retrieved"] for t in trials) / len(trials),
            "cells": [{"length": L, "depth": d, "accuracy": sum(v) / len(v), "trials": len(v)}
                      for (L, d), v in sorted(cells.items())],
            "layers": layers, "trials": trials,
        }
    return out


def accuracy_by_length(track: dict) -> dict[int, float]:
    per: dict[int, list[float]] = defaultdict(list)
    for cell in track["cells"]:
        per[cell["length"]].append(cell["accuracy"])
    return {length: sum(v) / len(v) for length, v in sorted(per.items())}


def verdict(summary: dict, reference: str, track: str) -> str:
    """One sentence: where ``track`` loses needles the reference finds."""
    ref, mine = accuracy_by_length(summary["tracks"][reference]), accuracy_by_length(summary["tracks"][track])
    longest = max(ref)
    lost = [length for length in ref if mine[length] < ref[length]]
    if not lost:
        return (f"{track}: recall matches {reference} at every length to {_k(longest)} "
                f"({100 * summary['tracks'][track]['accuracy']:.0f}% of needles, {reference} "
                f"{100 * summary['tracks'][reference]['accuracy']:.0f}%)")
    first = lost[0]
    side = "past" if first >= summary["threshold"] else "below"
    return (f"{track}: loses needles {reference} finds from {_k(first)} on ({side} the {summary['threshold']}-token "
            f"selection threshold): {100 * mine[first]:.0f}% against {100 * ref[first]:.0f}% there")


def ablation_verdict(summary: dict, reference: str, rows: list[str]) -> str:
    """The first ablation row that loses needles the reference keeps, or that none does."""
    ref = accuracy_by_length(summary["tracks"][reference])
    for label in rows:
        mine = accuracy_by_length(summary["tracks"][label])
        lost = [length for length in ref if mine[length] < ref[length]]
        if lost:
            return f"recall first breaks at '{label}' (from {_k(lost[0])} on); the rows before it keep every needle"
    return "no step of the served numerics loses a needle the base with its weights only finds"


def _k(tokens: int) -> str:
    return f"{tokens / 1024:g}K" if tokens >= 1024 and tokens % 256 == 0 else str(tokens)


def noise_chunk(chunk: int, threshold: int) -> int:
    """The noise floor's query chunk: about half the run's or the threshold's, whichever is smaller, and not
    a multiple of the compress ratio, so prompts past the threshold run in other chunks than the reference."""
    return max(1, min(chunk, threshold) // 2 + 3)
