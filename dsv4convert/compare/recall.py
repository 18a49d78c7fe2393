"""``compare --recall``: needle retrieval and the indexer's choices, base against variant, offline.

Prompts come from :mod:`dsv4convert.needle` (the builder ``serve --check recall`` uses), each followed
by its answer's tokens (teacher forcing): a prompt is retrieved when every answer token is the argmax
given the ones before, which is exactly what greedy decoding would produce. All prompts of the grid
share each loaded block (:class:`~dsv4convert.compare.lockstep.LockstepEngine`), so a checkpoint is read
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

:func:`diagnose` turns a track's numbers into the part that lost the needle: the indexer of one CSA layer
(it drops the needle's entry in the prompts the track loses, and on the reference's input its top-k is
clearly off the reference's, below the noise floor), or what comes after selection (the needle is lost
below the threshold, or stays selected, or is dropped only by indexers whose own top-k matches on the
reference's input); :func:`verdict` and :func:`ablation_verdict` say it in a sentence.
"""

from __future__ import annotations

import random
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from dsv4convert.compare.emulate import Installed
from dsv4convert.compare.lockstep import Batch, Track
from dsv4convert.compare.numerics import Numerics
from dsv4convert.errors import DSV4Error
from dsv4convert.models.deepseek_v4.layout import ModelConfig
from dsv4convert.needle import (
    DEFAULT_DEPTHS,
    PromptTemplate,
    RecallPrompt,
    answer_ids,
    default_lengths,
    fully_covered,
    make_needle,
    recall_grid,
    selection_threshold,
    shortest_prompt,
    value_entries,
    value_rank,
)

NOISE_FLOORS = ("per-length", "all")    # the noise floor's prompts (``--noise-floor``)


@dataclass
class RecallOptions:
    lengths: list[int] | None = None        # default: needle.default_lengths of the checkpoint's threshold
    depths: tuple[float, ...] = DEFAULT_DEPTHS
    trials: int = 1
    seed: int = 0
    ablate: bool = False
    local: bool = False                     # also run the variant's blocks on the base's input (one more pass):
                                            # what lets diagnose() tell an indexer from damage upstream of it
    noise_floor: str = "per-length"         # the noise floor's prompts: "per-length" (middle depth) or "all"
    longest: int | None = None              # the default lengths' longest (default: 64 x the threshold)


@dataclass
class Grid:
    """The prompts, their batches (one per total length) and where each prompt landed."""

    prompts: list[RecallPrompt]
    batches: list[Batch]
    where: list[tuple[int, int]]            # prompt index -> (batch, row)
    threshold: int                          # the first prompt length whose answer query leaves an entry out
    values: list[list[tuple[int, ...]]]     # prompt index -> per answer token, the entries holding it
    answer_tokens: list[int]                # prompt index -> teacher-forced answer tokens


def build_grid(tokenizer, config: dict, opts: RecallOptions, template: PromptTemplate = PromptTemplate()) -> Grid:
    index_topk = ModelConfig.from_dict(config).index_topk
    if index_topk is None:
        raise DSV4Error("config.json names no 'index_topk': the recall grid's lengths start from 4 x index_topk + 4")
    threshold = selection_threshold(index_topk)
    shortest = shortest_prompt(tokenizer, template)
    typical_answer = len(answer_ids(tokenizer, make_needle(random.Random(opts.seed))))
    lengths = opts.lengths or default_lengths(threshold, shortest, opts.longest, typical_answer)
    if not lengths:
        raise DSV4Error(f"no needle length fits: a prompt needs at least {shortest} tokens")
    if opts.trials < 1:
        raise DSV4Error(f"--trials must be at least 1, got {opts.trials}")
    try:
        prompts = recall_grid(tokenizer, lengths, opts.depths, opts.trials, opts.seed, template)
    except ValueError as exc:
        raise DSV4Error(f"needle grid: {exc}") from None
    rows: dict[int, list[tuple[int, list[int], tuple[int, int]]]] = defaultdict(list)
    values, answer_tokens = [], []
    for i, prompt in enumerate(prompts):
        answer = answer_ids(tokenizer, prompt.needle)
        ids = prompt.input_ids + answer
        rows[len(ids)].append((i, ids, (len(prompt.input_ids), len(ids))))
        values.append(value_entries(prompt.input_ids, prompt.needle_span, answer))
        answer_tokens.append(len(answer))
    batches, where = [], [(0, 0)] * len(prompts)
    for total in sorted(rows):
        group = rows[total]
        for r, (i, _, _) in enumerate(group):
            where[i] = (len(batches), r)
        batches.append(Batch(torch.tensor([ids for _, ids, _ in group], dtype=torch.int64),
                             answers=[span for _, _, span in group]))
    return Grid(prompts, batches, where, threshold, values, answer_tokens)


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
        v = torch.cat([self.rows[k] for k in sorted(self.rows)] or [torch.zeros(0)]).float()
        if v.numel() == 0:      # no row past the threshold (every prompt shorter than it)
            return {"rows": 0, "mean": None, "p1": None, "min": None}
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
        """Where the needle's value stands in the top-k of the query that writes the first answer token
        (:func:`~dsv4convert.needle.value_rank`)."""
        start, _ = self.grid.batches[key[0]].answers[key[1]]
        return value_rank(picks[start - 1].tolist(), self.grid.values[self._prompt(key)])


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
    """recall.json's content: per track the needle accuracy per (length, depth), every trial with the needle's
    rank per CSA layer (``needle_ranks``, None: not selected), per CSA layer the needle's selection and rank
    (over every prompt, and over the prompts at or past the threshold: ``*_past``) and the top-k overlap
    with the reference. The caller adds the verdicts and diagnoses (:func:`diagnose`)."""
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
            trials.append({"prompt": i, "length": prompt.length, "depth": prompt.depth, "key": prompt.needle.key,
                           "fully_covered": fully_covered(prompt.length, grid.answer_tokens[i], grid.threshold),
                           "value": prompt.needle.value, "retrieved": retrieved, "answer_logprob": logp,
                           "needle_ranks": {block: observer.ranks[track.label][block].get(i)
                                            for block in observer.layers}})
        cells = defaultdict(list)
        for t in trials:
            cells[(t["length"], t["depth"])].append(t["retrieved"])
        past = [i for i in ran if grid.prompts[i].length >= grid.threshold]
        layers = []
        for block in observer.layers:
            layers.append({
                "layer": block,
                **_selection([observer.ranks[track.label][block].get(i) for i in ran], ""),
                **_selection([observer.ranks[track.label][block].get(i) for i in past], "_past"),
                "prompts_past": len(past),
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


def _selection(ranks: list[int | None], suffix: str) -> dict:
    selected = [r for r in ranks if r is not None]
    return {f"needle_selected_rate{suffix}": len(selected) / len(ranks) if ranks else None,
            f"needle_median_rank{suffix}": float(torch.tensor(selected, dtype=torch.float64).median())
            if selected else None}


def accuracy_by_length(track: dict) -> dict[int, float]:
    per: dict[int, list[float]] = defaultdict(list)
    for cell in track["cells"]:
        per[cell["length"]].append(cell["accuracy"])
    return {length: sum(v) / len(v) for length, v in sorted(per.items())}


# A layer's indexer is suspected when it drops the needle's entry (the reference's indexer kept it) in at least
# this share of the prompts the track loses past the threshold: the needle was lost mostly where it dropped it.
DROPPED_SHARE = 0.5
# A layer whose indexer keeps less than this share of the reference's picks on the reference's input (and is
# under the noise floor) is a fault by itself, whether or not the needle's own entries are among its losses:
# served FP8/FP4 indexers keep well above it (docs/compare.md).
DEPARTED_OVERLAP = 0.8


def diagnose(summary: dict, reference: str, track: str) -> dict:
    """Which part makes ``track`` lose needles ``reference`` finds, from the summary alone (pure).

    Per CSA layer, over the prompts at or past the threshold that both tracks ran (paired by prompt): the
    needle's selection rate of each, and in how many of the prompts the track *loses* (the reference
    retrieves, the track does not) this layer's indexer dropped the needle's entry the reference's kept;
    the track's local top-k overlap (its layer on the reference's input: the indexer's own doing) against
    the noise floor's (``summary["noise_floor"]``: the reference in other query chunks, rounding only).
    The decision, in order:

    * ``none``: no length where the track retrieves less than the reference;
    * ``after_selection`` (``below_threshold``): it loses needles below the threshold, where every indexer
      keeps every entry, so selection cannot be the cause;
    * ``indexer`` (``departs``): no layer drops the needle's value in at least ``DROPPED_SHARE`` of the lost
      prompts, but a layer's indexer on the reference's input keeps less than ``DEPARTED_OVERLAP`` of the
      reference's picks (and is under the noise floor): the entries it drops instead cost the needles;
    * ``after_selection`` (``still_selected``): no layer's indexer drops the needle in at least
      ``DROPPED_SHARE`` of the lost prompts, and none departs;
    * ``indexer``: a layer that does (and selects the needle less often than the reference) has a local
      overlap clearly under the noise floor (its mean below the noise floor's 1st percentile): the one
      dropping it most (then the lowest local overlap) is named;
    * ``after_selection`` (``damaged_input``): the layers dropping it match the reference on its input
      (local overlap at the noise floor): their input was damaged upstream;
    * ``unlocalized``: layers drop it but there is no local pass (``--local``) or no noise floor to tell
      their indexer from damage upstream.

    Returns ``{"kind", "reason", "layer", "first_lost_length", "past_threshold", "lost_prompts_past",
    "layers": [per-layer evidence], "sentence"}``.
    """
    threshold, tracks = summary["threshold"], summary["tracks"]
    ref_acc, mine_acc = accuracy_by_length(tracks[reference]), accuracy_by_length(tracks[track])
    lost_lengths = [n for n in ref_acc if n in mine_acc and mine_acc[n] < ref_acc[n]]
    ref_trials = {t["prompt"]: t for t in tracks[reference]["trials"] if "prompt" in t}
    mine_trials = {t["prompt"]: t for t in tracks[track]["trials"] if "prompt" in t}
    past = [i for i in sorted(ref_trials.keys() & mine_trials.keys()) if ref_trials[i]["length"] >= threshold]
    lost = [i for i in past if ref_trials[i]["retrieved"] and not mine_trials[i]["retrieved"]]
    noise = summary.get("noise_floor")
    noise_layers = {x["layer"]: x for x in tracks[noise]["layers"]} if noise in tracks else {}
    ref_layers = {x["layer"]: x for x in tracks[reference]["layers"]}
    evidence = []
    for layer in tracks[track]["layers"]:
        name = layer["layer"]

        def rate(trials: dict, prompts: list[int]) -> float | None:
            ranks = [trials[i].get("needle_ranks", {}).get(name) for i in prompts]
            return sum(r is not None for r in ranks) / len(ranks) if ranks else None

        dropped = sum(1 for i in lost if ref_trials[i].get("needle_ranks", {}).get(name) is not None
                      and mine_trials[i].get("needle_ranks", {}).get(name) is None)
        floor = noise_layers.get(name, {}).get("overlap_free_running", {})
        floor_p1 = floor.get("p1") if floor.get("p1") is not None else floor.get("mean")
        local = layer["overlap_local"]["mean"]
        evidence.append({
            "layer": name,
            "selected_rate_past": rate(mine_trials, past),
            "reference_selected_rate_past": rate(ref_trials, past),
            "median_rank_past": layer.get("needle_median_rank_past"),
            "reference_median_rank_past": ref_layers.get(name, {}).get("needle_median_rank_past"),
            "dropped_in_lost": dropped,
            "dropped_share": dropped / len(lost) if lost else None,
            "overlap_local": local,
            "overlap_free_running": layer["overlap_free_running"]["mean"],
            "noise_floor_mean": floor.get("mean"),
            "noise_floor_p1": floor_p1,
            "local_under_noise_floor": None if local is None or floor_p1 is None else local < floor_p1,
        })
    out = {"kind": "none", "reason": None, "layer": None,
           "first_lost_length": lost_lengths[0] if lost_lengths else None,
           "past_threshold": lost_lengths[0] >= threshold if lost_lengths else None,
           "lost_prompts_past": len(lost), "layers": evidence}
    after = "the loss is after selection (attention or the layers after it), not the indexer"
    if not lost_lengths:
        return {**out, "sentence": "no needle lost"}
    covered_lost = [i for i in sorted(ref_trials.keys() & mine_trials.keys())
                    if ref_trials[i]["retrieved"] and not mine_trials[i]["retrieved"]
                    and ref_trials[i].get("fully_covered", ref_trials[i]["length"] < threshold)]
    if covered_lost or (lost_lengths[0] < threshold and not ref_trials):
        return {**out, "kind": "after_selection", "reason": "below_threshold",
                "sentence": f"it loses needles below the {threshold}-token threshold, where every indexer keeps every "
                            f"compressed entry: {after}"}
    suspects = [e for e in evidence if e["dropped_share"] is not None and e["dropped_share"] >= DROPPED_SHARE
                and (e["selected_rate_past"] or 0) < (e["reference_selected_rate_past"] or 0)]
    departed = [e for e in evidence if e["local_under_noise_floor"] and e["overlap_local"] < DEPARTED_OVERLAP]
    if not suspects and departed:
        e = min(departed, key=lambda e: e["overlap_local"])
        return {**out, "kind": "indexer", "reason": "departs", "layer": e["layer"],
                "sentence": f"every lost needle is past the threshold, and {e['layer']}'s indexer, on {reference}'s "
                            f"input, picks other entries than {reference}'s (local top-k overlap "
                            f"{e['overlap_local']:.3g} against the noise floor's {e['noise_floor_mean']:.3g}) while "
                            f"still keeping the needle's value ({_rates(e, reference)}): what it drops instead "
                            f"costs the needles: the indexer"}
    if not suspects:
        most = max((e["dropped_in_lost"] for e in evidence), default=0)
        return {**out, "kind": "after_selection", "reason": "still_selected",
                "sentence": f"the needle is still selected by every CSA layer's indexer as in {reference} (of the "
                            f"{len(lost)} prompts lost past the threshold, no layer's indexer drops it in "
                            + (f"more than {most} of them" if most else "any") + f"): {after}"}
    confirmed = [e for e in suspects if e["local_under_noise_floor"]]
    if confirmed:
        e = min(confirmed, key=lambda e: (-e["dropped_share"], e["overlap_local"]))
        others = [x["layer"] for x in confirmed if x is not e]
        return {**out, "kind": "indexer", "reason": "dropped_and_diverges", "layer": e["layer"],
                "sentence": f"the needle's compressed entry stops being selected by {e['layer']}'s indexer "
                            f"({_rates(e, reference)}, dropped in {e['dropped_in_lost']} of the {len(lost)} prompts "
                            f"lost; local top-k overlap {e['overlap_local']:.3g} against the noise floor's "
                            f"{e['noise_floor_mean']:.3g}): the indexer"
                            + (f" (also {', '.join(others)})" if others else "")}
    e = max(suspects, key=lambda e: e["dropped_share"])
    if any(x["local_under_noise_floor"] is None for x in suspects):
        return {**out, "kind": "unlocalized", "reason": "no_local_pass", "layer": e["layer"],
                "sentence": f"the needle's compressed entry stops being selected by {e['layer']}'s indexer "
                            f"({_rates(e, reference)}, dropped in {e['dropped_in_lost']} of the {len(lost)} prompts "
                            f"lost); without the local pass (--local) and a noise floor to compare it with, this "
                            f"cannot be told from damage upstream of {e['layer']}"}
    return {**out, "kind": "after_selection", "reason": "damaged_input", "layer": None,
            "sentence": f"{e['layer']}'s indexer drops the needle in {e['dropped_in_lost']} of the {len(lost)} prompts "
                        f"lost past the threshold, but on {reference}'s input its top-k matches {reference}'s (local "
                        f"overlap {e['overlap_local']:.3g}, noise floor {e['noise_floor_mean']:.3g}): its input was "
                        f"damaged upstream; {after}"}


def _rates(e: dict, reference: str) -> str:
    return (f"selected in {100 * (e['selected_rate_past'] or 0):.0f}% of the prompts past the threshold against "
            f"{100 * (e['reference_selected_rate_past'] or 0):.0f}% for {reference}")


def verdict(summary: dict, reference: str, track: str) -> str:
    """One sentence: where ``track`` loses needles the reference finds, and which part loses them (:func:`diagnose`)."""
    ref, mine = accuracy_by_length(summary["tracks"][reference]), accuracy_by_length(summary["tracks"][track])
    longest = max(ref)
    lost = [length for length in ref if mine[length] < ref[length]]
    if not lost:
        return (f"{track}: recall matches {reference} at every length to {_k(longest)} "
                f"({100 * summary['tracks'][track]['accuracy']:.0f}% of needles, {reference} "
                f"{100 * summary['tracks'][reference]['accuracy']:.0f}%)")
    first = lost[0]
    side = _side(summary, reference, track, first)
    return (f"{track}: loses needles {reference} finds from {_k(first)} on ({side} the {summary['threshold']}-token "
            f"selection threshold): {100 * mine[first]:.0f}% against {100 * ref[first]:.0f}% there; "
            + diagnose(summary, reference, track)["sentence"])


def _side(summary: dict, reference: str, track: str, length: int) -> str:
    """Where ``length`` stands to the threshold for the prompts lost there: past it (the first answer query
    leaves entries out), below it (every answer query keeps every entry), or at it (the first answer token's
    query keeps them all, later ones of a multi-token answer do not)."""
    threshold = summary["threshold"]
    if length >= threshold:
        return "past"
    kept = {t["prompt"]: t["retrieved"] for t in summary["tracks"][reference]["trials"] if "prompt" in t}
    lost = [t for t in summary["tracks"][track]["trials"]
            if t["length"] == length and not t["retrieved"] and kept.get(t.get("prompt"), True)]
    return "below" if any(t.get("fully_covered", True) for t in lost) else "at"


def ablation_verdict(summary: dict, reference: str, rows: list[str]) -> str:
    """The first ablation row that loses needles the reference keeps, and its diagnosis; or that none does."""
    ref = accuracy_by_length(summary["tracks"][reference])
    for label in rows:
        mine = accuracy_by_length(summary["tracks"][label])
        lost = [length for length in ref if mine[length] < ref[length]]
        if lost:
            return (f"recall first breaks at '{label}' (from {_k(lost[0])} on); the rows before it keep every needle; "
                    + diagnose(summary, reference, label)["sentence"])
    return "no step of the served numerics loses a needle the base with its weights only finds"


def _k(tokens: int) -> str:
    return f"{tokens / 1024:g}K" if tokens >= 1024 and tokens % 256 == 0 else str(tokens)


def noise_chunk(chunk: int, threshold: int) -> int:
    """The noise floor's query chunk: about half the run's or the threshold's, whichever is smaller, and not
    a multiple of the compress ratio, so prompts past the threshold run in other chunks than the reference."""
    return max(1, min(chunk, threshold) // 2 + 3)
