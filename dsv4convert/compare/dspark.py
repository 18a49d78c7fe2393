"""``compare`` on a DSpark drafter: draft fidelity per draft position, base against variant, and which part moved it.

The drafter runs as SGLang 0.5.23 drafts with it (the forward is :mod:`dsv4convert.model.dspark`, whose docstring
cites every rule), on each side's own served numerics (the hooks :func:`~dsv4convert.compare.emulate.install`
puts on a stage reach its context KV too: the stage's ``kv_proj``/``kv_norm`` make both):

* **Target features**, captured while the backbone streams through in lockstep: after each layer a side's
  ``dspark_target_layer_ids`` names, the mean of its output streams (``[tokens, hidden]`` per layer, on the host).
* **Anchors**: every ``stride``-th position from 1 to ``S - gamma`` of each sequence (:func:`anchor_positions`):
  position 1 because SGLang drafts only after a prefill of at least one token (the anchor is the bonus token of
  the last verify, ``dspark_draft.py::DraftBlockProposer._run_forward``), ``S - gamma`` so that every draft
  row has the target's greedy token to be checked against; the stride keeps the count under a budget.
* **Stages** streamed one at a time like the backbone's blocks (each side's stage built, its numerics installed,
  every track's blocks through it), then each side's head: base logits, greedy Markov drafts (each step on the
  previous *draft*: ``dspark_draft.py::draft_markov_block``), the confidence.

Per draft position ``j`` (1 = the first drafted token):

* **agreement**: the draft equals its own target's greedy token there (teacher-forced: the target's top-1 at
  ``p + j - 1`` given the text, the token greedy verification compares draft ``j`` with:
  ``kernels/ops/speculative/dflash.py::compute_dflash_correct_drafts_and_bonus``, "accept while
  candidates[:, 1:] == target_predict[:, :-1] consecutively");
* **accepted**: it and every draft before it agree (the accepted prefix);
* **KLD** ``KL(base || variant)`` of the draft distribution (``softmax(base_j + markov(prev))``), both sides
  conditioned on the **base's** previous draft: the distribution the base really drafts from at ``j``, and the
  variant's at the same history (the two sides' own drafts diverge after one disagreement, and comparing
  distributions over different histories would measure the history, not the drafter; the true text token
  would score a distribution SGLang never drafts from);
* **expected accepted length** as SGLang counts ``spec_accept_length``: accepted drafts plus the bonus token
  per verify step (``managers/tokenizer_manager.py::TokenizerManager._calculate_spec_decoding_metrics``:
  ``completion_tokens / spec_verify_ct``, "includes bonus token");
* **confidence calibration** as SGLang's own probe measures it (``speculative/dspark_components/
  dspark_observability.py::ConfidenceMetricsProbe``, ``PerPositionConfidenceMetrics``): the predicted survival
  ``cumprod(sigmoid(raw))`` against the accepted prefix, per position: mean predicted, measured, Brier.

**The noise floors.** Of agreement, acceptance, accepted length and Brier: three standard errors of the paired
per-block difference (variant minus base, on the same anchors), what drawing other anchors could move it by
(exactly equal drafts have a floor of 0). Of the draft KLD: float rounding, as compare's recall noise floor is:
the base drafted once more with its blocks in batches of half the size, and its KLD against itself (mean plus
three standard errors). A drafter that differs at all moves its KLD beyond rounding; whether that costs
acceptance is the other floors' question.

**Localization**, as compare's per-block *local* error: each component of the variant fed the base's inputs,
against the base's output: *target features* (the base's backbone streams read at the variant's target layers,
against the base's features: the drafter's wiring), each *stage* (``mtp.0`` with ``main_proj``/``main_norm`` on
the base's features; every stage on the base's block streams and ``main_x``), the *draft head* (``hc_head``,
``norm`` and the target's ``lm_head``: base logits), the *Markov head* (its bias on the base's previous drafts),
the *confidence head* (its raw logit on the base's ``x_post_hc`` and previous drafts). When the draft distribution,
agreement, acceptance or calibration moved beyond its noise floor, the verdict names the component with the largest
local error (among those that make the drafts when the drafts moved; any, the confidence head included, when only
calibration did), and says when agreement and acceptance stayed within theirs.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

from dsv4convert.compare import DEFAULT_ANCHORS
from dsv4convert.compare.emulate import install, install_dspark_entry
from dsv4convert.compare.metrics import HiddenError
from dsv4convert.models.deepseek_v4.layout import ModelConfig
from dsv4convert.models.deepseek_v4.names import draft_block, in_draft
from dsv4convert.model.blocks import build_layer, vocab_projection
from dsv4convert.model.dspark_rules import DraftOutput
from dsv4convert.model.dspark import (
    Blocks,
    DSparkEntry,
    DSparkHead,
    context_kv,
    embed_blocks,
    finish,
    run_stage,
    stream_mean,
)

ROUNDING = "rounding"       # the base re-drafted in other batches: the KLD float rounding alone gives
NOISE_SIGMAS = 3.0
TARGET_FEATURES, DRAFT_HEAD, MARKOV_HEAD, CONFIDENCE_HEAD = ("target features", "draft head", "Markov head",
                                                             "confidence head")


def anchor_stride(sequences: int, seq_len: int, block_size: int, budget: int) -> int:
    """The stride that keeps every sequence's anchors ``1 .. seq_len - block_size`` within ``budget`` in all."""
    per_sequence = max(0, seq_len - block_size)
    return max(1, math.ceil(sequences * per_sequence / max(1, budget)))


def anchor_positions(rows: int, seq_len: int, block_size: int, stride: int) -> torch.Tensor:
    """``[M, 2]`` (row, anchor) for anchors ``1, 1 + stride, ... <= seq_len - block_size`` of every row."""
    positions = torch.arange(1, seq_len - block_size + 1, stride)
    grid = torch.stack(torch.meshgrid(torch.arange(rows), positions, indexing="ij"), dim=-1)
    return grid.reshape(-1, 2)


def target_ids(track) -> tuple[int, ...]:
    return tuple(sorted(track.side.inspection.config.dspark.target_layer_ids))


@dataclass
class UnitDraft:
    """One micro-batch's draft results, per track (gathered to rank 0, combined in the global order)."""

    agree: dict[str, torch.Tensor] = field(default_factory=dict)        # [M, G] bool: draft == own greedy
    survival: dict[str, torch.Tensor] = field(default_factory=dict)     # [M, G] cumprod(sigmoid(raw))
    kld: dict[str, torch.Tensor] = field(default_factory=dict)          # [M, G] float64, non-reference tracks
    local: dict[str, dict[str, HiddenError]] = field(default_factory=dict)   # track -> component -> error
    free: dict[str, dict[str, HiddenError]] = field(default_factory=dict)


class DraftPass:
    """The DSpark part of a lockstep run (see the module docstring). The engine calls :meth:`capture` after each
    backbone block and :meth:`run` once the backbone's top-1 tokens are known."""

    def __init__(self, engine, anchors: int = DEFAULT_ANCHORS):
        self.engine = engine
        self.cfg: ModelConfig = engine.cfg
        self.d = self.cfg.dspark
        self.block_size = self.d.block_size
        ref = engine.reference
        lengths = {b.ids.shape[1] for b in engine.batches}
        sequences = sum(b.ids.shape[0] for b in engine.batches)
        self.stride = anchor_stride(sequences, max(lengths), self.block_size, anchors)
        self.ids = {t.label: target_ids(t) for t in engine.tracks}
        wanted = {i for ids in self.ids.values() for i in ids}
        self.wanted = {t.label: set(wanted if t is ref else self.ids[t.label]) for t in engine.tracks}
        self.means: dict[str, dict[int, dict[int, torch.Tensor]]] = {t.label: {} for t in engine.tracks}
        self.seconds = 0.0

    # -- during the backbone --------------------------------------------------------------------

    def capture(self, block: str, outputs: dict[str, dict[int, torch.Tensor]]) -> None:
        """Keep the stream mean of a target layer's output, per track and micro-batch (on the host)."""
        layer = int(block.split(".")[1])
        t0 = time.perf_counter()
        for label, units in outputs.items():
            if layer in self.wanted[label]:
                for index, streams in units.items():
                    self.means[label].setdefault(index, {})[layer] = stream_mean(streams)
        self.seconds += time.perf_counter() - t0

    def features(self, label: str, index: int, ids: tuple[int, ...]) -> torch.Tensor:
        return torch.cat([self.means[label][index][i] for i in ids], dim=-1)

    # -- after the backbone ---------------------------------------------------------------------

    @torch.no_grad()
    def run(self, top1: dict[str, dict[int, torch.Tensor]]) -> dict[int, UnitDraft]:
        e, ref = self.engine, self.engine.reference.label
        t0 = time.perf_counter()
        device = e.device
        g = self.block_size
        chunk = max(1, (e.runners[ref].chunk or 2048) // g)
        units = e.units_of[ref]
        blocks = {}
        for u in units:
            ids = e.batches[u.batch].ids[u.rows].to(device)
            blocks[u.index] = Blocks.make(ids, anchor_positions(ids.shape[0], ids.shape[1], g, self.stride),
                                          block_size=g, noise_token_id=self.d.noise_token_id,
                                          window=int(e.config.sliding_window))
        result = {u.index: UnitDraft() for u in units}
        for track in e.tracks[1:]:
            for u in e.units_of[track.label]:
                result[u.index].local[track.label] = {}
                result[u.index].free[track.label] = {}
                if track.local:
                    result[u.index].local[track.label][TARGET_FEATURES] = error_of(
                        self.features(ref, u.index, self.ids[ref]),
                        self.features(ref, u.index, self.ids[track.label]))
                result[u.index].free[track.label][TARGET_FEATURES] = error_of(
                    self.features(ref, u.index, self.ids[ref]), self.features(track.label, u.index,
                                                                              self.ids[track.label]))
        streams: dict[str, dict[int, torch.Tensor]] = {t.label: {} for t in e.tracks}
        rounding: dict[int, torch.Tensor] = {}
        bar = e.phase("DSpark drafter", self.d.stages * sum(len(e.units_of[t.label]) for t in e.tracks) + 1)
        main_x: dict[str, dict[int, torch.Tensor]] = {t.label: {} for t in e.tracks}
        for s in range(self.d.stages):
            block = draft_block(s)
            nxt: dict[str, dict[int, torch.Tensor]] = {t.label: {} for t in e.tracks}
            rounding_next: dict[int, torch.Tensor] = {}
            for side in e.sides:
                layer = build_layer(side.source, e.config, self.cfg, block)
                entry = DSparkEntry.load(side.source, e.config, self.cfg) if s == 0 else None
                embed = side.source.tensor("embed.weight") if s == 0 else None
                rotary = DeepseekV4RotaryEmbedding(e.config, device=device)
                for track in (t for t in e.tracks if t.side is side):
                    installed = install(layer, block, track.numerics, side.source, dspark_stage=True)
                    if entry is not None:
                        install_dspark_entry(entry, track.numerics, side.source, installed)
                    try:
                        for u in e.units_of[track.label]:
                            b = blocks[u.index]
                            if s == 0:
                                feats = self.features(track.label, u.index, self.ids[track.label])
                                main_x[track.label][u.index] = entry(feats.to(device)).cpu()
                                streams[track.label][u.index] = embed_blocks(b, embed, e.cfg.hc_mult).cpu()
                            kv = context_kv(layer, main_x[track.label][u.index].to(device), rotary)
                            out = run_stage(layer, streams[track.label][u.index], kv, b, rotary,
                                            chunk=chunk).cpu()
                            nxt[track.label][u.index] = out
                            if track.label == ref:
                                # The rounding floor: the base once more, its blocks in batches of half the size.
                                given = streams[ref][u.index] if s == 0 else rounding[u.index]
                                rounding_next[u.index] = run_stage(layer, given, kv, b, rotary,
                                                                   chunk=max(1, (len(b) + 1) // 2)).cpu()
                                bar.update()
                                continue
                            result[u.index].free[track.label][block] = error_of(nxt[ref][u.index], out)
                            if track.local:
                                given = main_x[ref][u.index].to(device)
                                if s == 0:
                                    given = entry(self.features(ref, u.index, self.ids[ref]).to(device))
                                kv = context_kv(layer, given, rotary)
                                mine = run_stage(layer, streams[ref][u.index], kv, b, rotary,
                                                 chunk=chunk).cpu()
                                result[u.index].local[track.label][block] = error_of(nxt[ref][u.index], mine)
                            bar.update()
                    finally:
                        installed.remove()
                del layer, entry, embed
            streams, rounding = nxt, rounding_next
        bar.set_postfix_str("draft heads")
        self._heads(streams, rounding, blocks, top1, result)
        bar.update()
        bar.close()
        self.seconds += time.perf_counter() - t0
        return result

    def _heads(self, streams, rounding: dict[int, torch.Tensor], blocks: dict[int, Blocks], top1,
               result: dict[int, UnitDraft]) -> None:
        """Each side's head on its last stage's streams, a chunk of blocks at a time (draft logits are
        ``[blocks, gamma, vocab]``: never all at once)."""
        e, ref = self.engine, self.engine.reference.label
        device = e.device
        heads = {id(side): (DSparkHead.load(side.source, e.config, self.cfg).to(device), vocab_projection(side.source))
                 for side in e.sides}
        step = max(1, 4 * 1024 ** 2 // max(1, self.block_size * self.cfg.vocab_size))   # ~16 MB of logits a side
        for u in e.units_of[ref]:
            b = blocks[u.index]
            parts: dict[str, list[torch.Tensor]] = {}
            for rows in b.chunks(step):
                part = b.select(rows)
                drafted = {}
                for track in e.tracks:
                    head, lm_head = heads[id(track.side)]
                    greedy, _ = part.gather(top1[track.label][u.index].to(device), 0)
                    on_base = None
                    if track.label != ref and track.local:
                        on_base, _ = head.base(streams[ref][u.index][rows].to(device), lm_head)
                    drafted[track.label] = Drafted(head, finish(head, streams[track.label][u.index][rows].to(device),
                                                                part, lm_head), greedy, on_base)
                base_head, base_lm_head = heads[id(e.reference.side)]
                again = finish(base_head, rounding[u.index][rows].to(device), part, base_lm_head)
                score_heads(parts, result[u.index].local, ref, drafted, again)
            collect(result[u.index], parts)


@dataclass
class Drafted:
    """One track's drafts of a chunk of blocks, as :func:`score_heads` reads them (either release's head: its
    ``markov_bias``, ``markov_logits`` and ``confidence_of`` take the same arguments)."""

    head: object                        # model/dspark.py's or model/v41/dspark.py's DSparkHead
    out: DraftOutput
    greedy: torch.Tensor                # [m, G] the track's own target's greedy token at each block row
    on_base: torch.Tensor | None = None  # the local pass: its draft head's base logits on the base's last stage


def score_heads(parts: dict[str, list[torch.Tensor]], local: dict[str, dict[str, HiddenError]], reference: str,
                drafted: dict[str, Drafted], again: DraftOutput) -> None:
    """The measures of one chunk of blocks, release-independent (module docstring): each track's agreement and
    predicted survival, the KLD of each other track's draft distribution against the reference's (and of
    ``again``, the reference re-drafted in other batches: the rounding floor), both conditioned on the
    reference's previous drafts, and for each track with ``on_base`` the local error of its draft, Markov and
    confidence heads. Appends to ``parts`` (``"kind:label"`` -> chunks, :func:`collect`) and ``local``."""
    base = drafted[reference]
    prev = base.out.draft_prev
    for label, d in drafted.items():
        parts.setdefault(f"agree:{label}", []).append((d.out.draft_tokens == d.greedy).cpu())
        parts.setdefault(f"survival:{label}", []).append(d.out.confidence.cumprod(-1).cpu())
    base_logp = torch.log_softmax(base.out.draft_logits.double(), -1)
    parts.setdefault(f"kld:{ROUNDING}", []).append(_kld(base_logp, base.head, again, prev))
    for label, d in drafted.items():
        if label == reference:
            continue
        parts.setdefault(f"kld:{label}", []).append(_kld(base_logp, d.head, d.out, prev))
        if d.on_base is None:
            continue
        errors = local[label]
        _add(errors, DRAFT_HEAD, base.out.base_logits, d.on_base)
        _add(errors, MARKOV_HEAD, base.head.markov_bias(prev), d.head.markov_bias(prev))
        _, raw = d.head.confidence_of(base.out.x_post_hc, prev)
        _add(errors, CONFIDENCE_HEAD, base.out.confidence_raw.float(), raw.float())


def collect(unit: UnitDraft, parts: dict[str, list[torch.Tensor]]) -> None:
    """A micro-batch's chunks (:func:`score_heads`) concatenated into its :class:`UnitDraft`."""
    for key, values in parts.items():
        kind, label = key.split(":", 1)
        getattr(unit, kind)[label] = torch.cat(values)


def _kld(base_logp: torch.Tensor, head: DSparkHead, out, prev: torch.Tensor) -> torch.Tensor:
    """``KL(base || other)`` per block row, float64, of ``out``'s draft distribution conditioned on ``prev``."""
    other = torch.log_softmax(head.markov_logits(out.base_logits, prev).double(), -1)
    return (base_logp.exp() * (base_logp - other)).sum(-1).clamp_min(0.0).cpu()


def error_of(reference: torch.Tensor, other: torch.Tensor) -> HiddenError:
    error = HiddenError()
    error.add(reference, other)
    return error


def _add(errors: dict[str, HiddenError], name: str, reference: torch.Tensor, other: torch.Tensor) -> None:
    errors.setdefault(name, HiddenError()).add(reference, other)


# -- rank 0: the summary ----------------------------------------------------------------------------


def _paired(diff: torch.Tensor) -> tuple[float, float]:
    """(mean, noise floor) of per-block differences: the floor is NOISE_SIGMAS standard errors."""
    n = diff.shape[0]
    if n == 0:
        return math.nan, math.nan
    se = float(diff.std() / math.sqrt(n)) if n > 1 else 0.0
    return float(diff.mean()), NOISE_SIGMAS * se


def summarize(units: list[UnitDraft], reference: str, subject: str, components: list[str], *,
              stride: int, block_size: int, ids: dict[str, tuple[int, ...]]) -> dict:
    """``compare.json``'s ``dspark`` section from every micro-batch's results, in the global order."""
    def cat(kind: str, label: str) -> torch.Tensor:
        return torch.cat([getattr(u, kind)[label] for u in units if label in getattr(u, kind)])

    def errors(kind: str, name: str) -> dict | None:
        total, seen = HiddenError(), False
        for u in units:
            part = getattr(u, kind).get(subject, {}).get(name)
            if part is not None:
                total.merge(part)
                seen = True
        return total.result() if seen else None

    sides = {}
    for label in (reference, subject):
        agree = cat("agree", label)
        survival = cat("survival", label).double()
        accepted = agree.double().cumprod(-1)
        sides[label] = {"agree": agree.double(), "accepted": accepted, "survival": survival,
                        "brier": (survival - accepted).square()}
    base, mine = sides[reference], sides[subject]
    kld, rounding = cat("kld", subject), cat("kld", ROUNDING)
    positions, moved = [], []
    for j in range(block_size):
        row = {"position": j + 1}
        mean = float(kld[:, j].mean())
        row["kld"] = mean
        row["kld_standard_error"] = float(kld[:, j].std() / math.sqrt(kld.shape[0])) if kld.shape[0] > 1 else 0.0
        floor_mean, floor_spread = _paired(rounding[:, j])
        row["kld_noise_floor"] = floor_mean + floor_spread
        if mean > row["kld_noise_floor"]:
            moved.append(f"draft distribution at position {j + 1}")
        for key in ("agreement", "accepted"):
            source = "agree" if key == "agreement" else "accepted"
            delta, floor = _paired(mine[source][:, j] - base[source][:, j])
            row[key] = {"base": float(base[source][:, j].mean()), "variant": float(mine[source][:, j].mean()),
                        "delta": delta, "noise_floor": floor}
            if abs(delta) > floor:
                moved.append(f"{key} at position {j + 1}")
        delta, floor = _paired(mine["brier"][:, j] - base["brier"][:, j])
        row["confidence"] = {
            label: {"predicted": float(sides[side]["survival"][:, j].mean()),
                    "measured": float(sides[side]["accepted"][:, j].mean()),
                    "brier": float(sides[side]["brier"][:, j].mean())}
            for label, side in (("base", reference), ("variant", subject))}
        row["confidence"]["brier_delta"], row["confidence"]["noise_floor"] = delta, floor
        calibration_moved = abs(delta) > floor
        if calibration_moved:
            moved.append(f"confidence calibration at position {j + 1}")
        positions.append(row)
    lengths = {label: 1.0 + sides[label]["accepted"].sum(-1) for label in (reference, subject)}
    delta, floor = _paired(lengths[subject] - lengths[reference])
    if abs(delta) > floor:
        moved.append("expected accepted length")
    component_rows = [{"component": name, "local": errors("local", name), "free_running": errors("free", name)}
                      for name in components]
    verdict = name_component(moved, component_rows)
    return {
        "anchors": {"blocks": int(base["agree"].shape[0]), "stride": stride, "first": 1},
        "block_size": block_size,
        "draft_conditioned_on": "the base's previous draft",
        "target_layer_ids": {"base": list(ids[reference]), "variant": list(ids[subject])},
        "positions": positions,
        "expected_accept_length": {"base": float(lengths[reference].mean()), "variant": float(lengths[subject].mean()),
                                   "delta": delta, "noise_floor": floor},
        "accept_length_counts": "accepted drafts + 1 bonus token per verify step (SGLang's spec_accept_length)",
        "components": component_rows,
        "moved": moved,
        "verdict": verdict,
    }


DRAFTING = (TARGET_FEATURES, DRAFT_HEAD, MARKOV_HEAD)     # with the stages: what makes the drafts


def draft_components(stages: int) -> list[str]:
    """The drafter's parts the report localizes, in the order the data flows through them."""
    return [TARGET_FEATURES, *(draft_block(s) for s in range(stages)), DRAFT_HEAD, MARKOV_HEAD, CONFIDENCE_HEAD]


# What each entry of ``moved`` measures, in the reader's terms.
MOVED_WORDS = {"draft distribution": "the draft's token distribution (KLD)",
               "agreement": "agreement with the target's greedy token",
               "accepted": "the share of drafts accepted",
               "confidence calibration": "the confidence head's calibration",
               "expected accepted length": "the expected accepted length"}


def moved_in_words(moved: list[str]) -> str:
    """``moved`` ("agreement at position 2", ...) as one phrase, each measure once with every draft position it
    moved at: "the draft's token distribution (KLD) at positions 1-5 and agreement ... at positions 2, 4"."""
    positions: dict[str, list[int]] = {}
    for entry in moved:
        what, at, position = entry.rpartition(" at position ")
        positions.setdefault(what if at else entry, []).extend([int(position)] if at else [])
    parts = [MOVED_WORDS.get(what, what) + (f" at position{'s' if len(p) > 1 else ''} {_positions(p)}" if p else "")
             for what, p in positions.items()]
    return ", ".join(parts[:-1]) + (" and " if len(parts) > 1 else "") + parts[-1]


def _positions(numbers: list[int]) -> str:
    """[1, 2, 3, 5] -> "1-3, 5"."""
    runs: list[list[int]] = []
    for n in sorted(numbers):
        if runs and n == runs[-1][-1] + 1:
            runs[-1].append(n)
        else:
            runs.append([n])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 2 else ", ".join(map(str, r)) for r in runs)


def name_component(moved: list[str], components: list[dict]) -> dict:
    """The component to blame: none when nothing moved beyond the noise floor; else the largest local error
    among those that make the drafts (every stage, the target features, the draft and Markov heads) when the
    drafts moved, among all (the confidence head too) when only the calibration did."""
    if not moved:
        return {"component": None, "sentence": "draft agreement, acceptance and confidence calibration are "
                                                "within the noise floor at every position"}
    drafts_moved = any(not m.startswith("confidence") for m in moved)
    pool = [c for c in components if c["local"] is not None
            and (not drafts_moved or c["component"] in DRAFTING or in_draft(c["component"]))]
    worst = max(pool, key=lambda c: c["local"]["relative_error"], default=None)
    what = f"{moved_in_words(moved)} moved beyond the noise floor (more than float rounding and sampling move them)"
    if worst is None or worst["local"]["relative_error"] == 0.0:
        return {"component": "backbone", "sentence": f"{what}; no drafter component differs on the base's inputs: "
                "the target features it reads (the backbone) do"}
    costs = any(m.startswith(("agreement", "accepted", "expected")) for m in moved)
    return {"component": worst["component"],
            "sentence": what + ("" if costs or not drafts_moved else "; agreement and acceptance stayed within theirs")
                        + f"; the largest local error is the {worst['component']}'s "
                        f"({worst['local']['relative_error']:.3g} on the base's inputs)"}
