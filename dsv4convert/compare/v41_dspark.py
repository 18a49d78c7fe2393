"""``compare`` on DeepSeek-V4.1's DSpark drafter: the draft's fidelity per draft position, as for 0731.

The measures, noise floors, localization and verdict are :mod:`.dspark`'s, one implementation for both releases
(its docstring says what each number means and which SGLang code it follows: :func:`~.dspark.score_heads`,
:func:`~.dspark.summarize`); what is V4.1's own is how the drafter runs (:mod:`dsv4convert.model.v41.dspark`):

* **Target features**: captured while the backbone streams through in lockstep (``compare/v41.py::Lockstep``,
  ``capture=``): each ``dspark_target_layer_ids`` layer's *input*, the stream mean after its Engram and before its
  attention (``DeepseekV4Model._forward_impl``'s ``hc_pre_from_prev`` capture); the base's run also captures the
  variant's layers, for the target features' local error (the base's backbone read at the variant's layers).
* **Stages** streamed one at a time (:func:`~dsv4convert.model.v41.dspark.load_stage`: the base's and the
  variant's ``mtp.S`` resident together, every micro-batch's blocks through both, then freed), each handing its
  ``(streams, pre)`` to the next (V4.1's lagged hyper-connections); the local error of a stage is over both.
  ``mtp.0``'s includes ``main_proj``/``main_norm`` (the variant's entry on the base's features).
* **Heads**: no ``hc_head``; the draft head is the last ``pre``'s collapse, ``norm`` and the target's ``lm_head``.

Served numerics: a stage has compress ratio 0, so no compressor or indexer, where compare's V4.1 FP4 round trips
live; each side's activation quantization is put on its stages and its entry's ``main_proj`` (:mod:`.emulate_v41`:
the FP8 linears' 1 x 32 token groups, the experts' scheme for their stored format, e.g. MXFP8 for the NVFP4
hybrid's MXFP4 stages on sm100). The FP8 KV cache SGLang stores the context and block KV in is not emulated (as
the backbone's window).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from dsv4convert.compare import emulate_v41
from dsv4convert.compare.dspark import (
    TARGET_FEATURES,
    Drafted,
    UnitDraft,
    anchor_positions,
    anchor_stride,
    collect,
    draft_components,
    error_of,
    score_heads,
    summarize,
)
from dsv4convert.compare.metrics import HiddenError
from dsv4convert.model.dspark_rules import Blocks, embed_blocks
from dsv4convert.model.v41.dspark import (
    context_kv,
    dspark_of,
    features_of,
    finish,
    load_entry,
    load_head,
    load_stage,
    run_stage,
    shared_vocab,
)
from dsv4convert.model.v41.forward import ForwardState
from dsv4convert.engines.sglang.numerics import V41Serving
from dsv4convert.model.v41.weights import WeightSource
from dsv4convert.models.deepseek_v4.names import draft_block

BASE, VARIANT = "base", "variant"
LOGIT_BYTES = 16 * 1024 ** 2     # draft logits per head chunk and side ([blocks, gamma, vocab] float32)

State = tuple[torch.Tensor, torch.Tensor | None]    # a stage's (streams [M, G, hc, hidden], pre [M, G, hc]), host


class V41DraftPass:
    """The drafter part of a V4.1 comparison: :meth:`capture` says which layers each side's backbone run keeps,
    :meth:`run` drafts once the backbone and each side's greedy tokens are known, :meth:`summary` is
    ``compare.json``'s ``dspark``."""

    def __init__(self, base: WeightSource, variant: WeightSource, batches: list[torch.Tensor], *, anchors: int,
                 chunk: int, progress: Callable[[int], object] | None = None,
                 servings: dict[str, V41Serving | None] | None = None):
        """``servings``: each side's served numerics (``base``, ``variant``), None for weights only."""
        self.sources = {BASE: base, VARIANT: variant}
        self.servings = servings or {}
        self.d = dspark_of(base.cfg)
        self.block_size, self.stages = self.d.block_size, self.d.stages
        self.ids = {label: tuple(sorted(dspark_of(s.cfg).target_layer_ids)) for label, s in self.sources.items()}
        self.stride = anchor_stride(sum(b.shape[0] for b in batches), max(b.shape[1] for b in batches),
                                    self.block_size, anchors)
        self.blocks = [Blocks.make(ids, anchor_positions(ids.shape[0], ids.shape[1], self.block_size, self.stride),
                                   block_size=self.block_size, noise_token_id=self.d.noise_token_id,
                                   window=base.cfg.sliding_window) for ids in batches]
        self.chunk = max(1, chunk // self.block_size)      # blocks per stage forward
        self.progress = progress
        self.seconds = 0.0

    def capture(self) -> dict[str, tuple[int, ...]]:
        """The layers whose input each side's backbone run keeps: the base's at both sides' target layers."""
        return {BASE: tuple(sorted(set(self.ids[BASE]) | set(self.ids[VARIANT]))), VARIANT: self.ids[VARIANT]}

    @torch.no_grad()
    def run(self, base_runs: list[ForwardState], variant_runs: list[ForwardState],
            top1: dict[str, list[torch.Tensor]]) -> list[UnitDraft]:
        """Both drafters over every micro-batch's blocks; ``top1[label][m]`` is that side's greedy token at every
        position of micro-batch ``m`` ``[B, S]``."""
        t0 = time.perf_counter()
        device = self.sources[BASE].device
        feats = {BASE: [features_of(r.captured, self.ids[BASE]) for r in base_runs],
                 VARIANT: [features_of(r.captured, self.ids[VARIANT]) for r in variant_runs]}
        units = [UnitDraft() for _ in self.blocks]
        for m, unit in enumerate(units):
            unit.local[VARIANT] = {TARGET_FEATURES: error_of(feats[BASE][m],
                                                           features_of(base_runs[m].captured, self.ids[VARIANT]))}
            unit.free[VARIANT] = {TARGET_FEATURES: error_of(feats[BASE][m], feats[VARIANT][m])}
        bar = self.progress(self.stages * len(self.blocks) + 1) if self.progress is not None else None
        main_x: dict[str, list[torch.Tensor]] = {}
        entry_of_variant = None
        state: dict[str, list[State]] = {}
        rounding: list[State] = []
        for s in range(self.stages):
            stage = {label: load_stage(src, s) for label, src in self.sources.items()}
            for label, src in self.sources.items():
                emulate_v41.install(stage[label], draft_block(s), self.servings.get(label), src)
            if s == 0:
                entries = {label: load_entry(src) for label, src in self.sources.items()}
                for label, src in self.sources.items():
                    emulate_v41.install_entry(entries[label], self.servings.get(label), src)
                for label, src in self.sources.items():
                    embed = src.tensor("embed.weight")
                    main_x[label] = [entries[label](f.to(device)) for f in feats[label]]
                    state[label] = [(embed_blocks(b, embed, src.cfg.hc_mult).cpu(), None) for b in self.blocks]
                entry_of_variant = entries[VARIANT]
                rounding = state[BASE]
            nxt: dict[str, list[State]] = {BASE: [], VARIANT: []}
            rounding_next: list[State] = []
            for m, b in enumerate(self.blocks):
                kv = {label: context_kv(stage[label], main_x[label][m]) for label in self.sources}
                for label in self.sources:
                    nxt[label].append(_host(run_stage(stage[label], *state[label][m], kv[label], b,
                                                      chunk=self.chunk)))
                # The rounding floor: the base once more, its blocks in batches of half the size.
                rounding_next.append(_host(run_stage(stage[BASE], *rounding[m], kv[BASE], b,
                                                     chunk=max(1, (len(b) + 1) // 2))))
                units[m].free[VARIANT][draft_block(s)] = _stage_error(nxt[BASE][m], nxt[VARIANT][m])
                # local: the variant's stage on the base's streams, pre and context (mtp.0: its entry on the
                # base's features)
                given = entry_of_variant(feats[BASE][m].to(device)) if s == 0 else main_x[BASE][m]
                mine = run_stage(stage[VARIANT], *state[BASE][m], context_kv(stage[VARIANT], given), b,
                                 chunk=self.chunk)
                units[m].local[VARIANT][draft_block(s)] = _stage_error(nxt[BASE][m], _host(mine))
                if bar is not None:
                    bar.update()
            del stage
            state, rounding = nxt, rounding_next
        if bar is not None:
            bar.set_postfix_str("draft heads")
        self._heads(state, rounding, top1, units)
        if bar is not None:
            bar.update()
            bar.close()
        self.seconds += time.perf_counter() - t0
        return units

    def _heads(self, state: dict[str, list[State]], rounding: list[State], top1: dict[str, list[torch.Tensor]],
               units: list[UnitDraft]) -> None:
        """Each side's head on its last stage, a chunk of blocks at a time (draft logits are ``[blocks, gamma,
        vocab]``: never all at once), scored by :func:`~.dspark.score_heads`."""
        device = self.sources[BASE].device
        heads = {label: (load_head(src), shared_vocab(src)[1]) for label, src in self.sources.items()}
        step = max(1, LOGIT_BYTES // (4 * self.block_size * self.sources[BASE].cfg.vocab_size))
        for m, b in enumerate(self.blocks):
            parts: dict[str, list[torch.Tensor]] = {}
            for rows in b.chunks(step):
                part = b.select(rows)
                last = {label: _rows(state[label][m], rows, device) for label in self.sources}
                drafted = {}
                for label, (head, lm_head) in heads.items():
                    greedy, _ = part.gather(top1[label][m].to(device), 0)
                    on_base = head.base(*last[BASE], lm_head)[0] if label != BASE else None
                    drafted[label] = Drafted(head, finish(head, *last[label], part, lm_head), greedy, on_base)
                base_head, base_lm_head = heads[BASE]
                again = finish(base_head, *_rows(rounding[m], rows, device), part, base_lm_head)
                score_heads(parts, units[m].local, BASE, drafted, again)
            collect(units[m], parts)

    def summary(self, units: list[UnitDraft]) -> dict:
        """``compare.json``'s ``dspark``, the same section as 0731's (:func:`~.dspark.summarize`)."""
        return summarize(units, BASE, VARIANT, draft_components(self.stages), stride=self.stride,
                         block_size=self.block_size, ids=self.ids)


def _host(state: State) -> State:
    streams, pre = state
    return streams.cpu(), pre.cpu()


def _rows(state: State, rows: slice, device: torch.device) -> State:
    streams, pre = state
    return streams[rows].to(device), pre[rows].to(device)


def _stage_error(reference: State, other: State) -> HiddenError:
    """A stage's error over what it hands on: its streams and its ``pre`` (V4.1's lagged hyper-connection)."""
    error = error_of(reference[0], other[0])
    error.add(reference[1], other[1])
    return error
