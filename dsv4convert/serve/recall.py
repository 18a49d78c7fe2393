"""Needle-in-a-haystack recall on a server, and where DeepSeek-V4's sparse indexer looked while answering.

Prompts come from :mod:`dsv4convert.needle` (the builder ``compare --recall`` uses too): token-id
lists built with the model's own tokenizer to an exact length, and sent as ``input_ids`` to SGLang's
native ``/generate``, so no re-tokenisation can shift the length or the needle position. With ``return_indexer_topk`` SGLang returns, per prompt position and CSA
(ratio-4) layer, the compressed positions its indexer kept; a needle whose compressed block is
kept but whose answer is wrong points at quantization, one that is dropped points at the indexer.
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dsv4convert.errors import FormatError
from dsv4convert.models.deepseek_v4.layout import AttentionReach
from dsv4convert.needle import (
    CSA_RATIO,
    Needle,
    PromptTemplate,
    RecallPrompt,
    Tokenizer,
    answer_ids,
    answer_is_correct,
    recall_grid,
    value_entries,
    value_rank,
)
from dsv4convert.serve.defaults import DEFAULT_DEPTHS, DEFAULT_LENGTHS


def decode_indexer_topk(encoded: str, num_layers: int, topk: int) -> np.ndarray:
    """SGLang's ``meta_info["indexer_topk"]``: base64 int32 -> ``(positions, num_layers, topk)``."""
    try:
        raw = base64.b64decode(encoded, validate=True)
    except ValueError as exc:
        raise FormatError(f"indexer_topk is not valid base64: {exc}") from exc
    per_position = num_layers * topk * 4
    if len(raw) == 0 or len(raw) % per_position:
        raise FormatError(
            f"indexer_topk holds {len(raw)} bytes, not a whole number of positions of "
            f"{num_layers} layers x {topk} int32 indices"
        )
    return np.frombuffer(raw, dtype="<i4").reshape(-1, num_layers, topk)


def indexer_layer_ids(compress_ratios: Sequence[int], num_hidden_layers: int) -> list[int]:
    """Model layer index of each indexer layer, in the order SGLang returns them."""
    return [i for i, ratio in enumerate(compress_ratios[:num_hidden_layers]) if ratio == CSA_RATIO]


def needle_block_ranks(topk: np.ndarray, query_row: int, groups: Sequence[Sequence[int]]) -> list[int | None]:
    """Per indexer layer, the rank by which the needle's value is selected (None: some answer token has no
    selected entry holding it): :func:`dsv4convert.needle.value_rank` of the groups
    :func:`dsv4convert.needle.value_entries` gives, as ``compare --recall`` reads them.

    Row ``p`` holds the indices used by the query at token position ``p``; SGLang returns rows for
    positions ``0 .. prompt + generated - 2``, so the query that produced the first answer token is
    row ``prompt_length - 1``. Entry ``w`` of a ratio-4 layer pools tokens ``4(w-1) .. 4w+3`` (its window
    and the previous one), in SGLang as in transformers. The rank is the position in SGLang's top-k list;
    whether that list is sorted by score is unconfirmed, so read ranks as "selected or not" first.
    """
    if not 0 <= query_row < topk.shape[0]:
        raise FormatError(f"query row {query_row} is outside the {topk.shape[0]} positions indexer_topk returned")
    return [value_rank(layer_row.tolist(), groups) for layer_row in topk[query_row]]


@dataclass
class RecallTrial:
    length: int
    depth: float
    needle: Needle
    output: str
    correct: bool
    ranks: list[int | None] | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "length": self.length, "depth": self.depth, "key": self.needle.key, "value": self.needle.value,
            "output": self.output, "correct": self.correct, "needle_block_ranks": self.ranks,
        }


@dataclass
class RecallSweep:
    """Settings of a sweep; ``run`` sends one request per trial through ``generate``."""

    lengths: Sequence[int] = DEFAULT_LENGTHS
    depths: Sequence[float] = DEFAULT_DEPTHS
    trials: int = 3
    seed: int = 0
    max_new_tokens: int = 24
    indexer_topk: bool = False
    indexer_layers: int = 21
    index_topk: int = 512
    template: PromptTemplate = field(default_factory=PromptTemplate)

    def request(self, prompt: RecallPrompt) -> dict[str, Any]:
        payload: dict[str, Any] = {
            "input_ids": prompt.input_ids,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": self.max_new_tokens},
        }
        if self.indexer_topk:
            payload["return_indexer_topk"] = True
        return payload

    def score(self, prompt: RecallPrompt, response: dict[str, Any], answer: Sequence[int] = ()) -> RecallTrial:
        """One trial from the server's response; ``answer`` is the needle value's token ids (what the ranks
        look for in the needle sentence; without it, any entry of the sentence)."""
        output = response.get("text")
        if not isinstance(output, str):
            raise FormatError(f"/generate answered without a text field: {sorted(response)}")
        ranks = None
        if self.indexer_topk:
            encoded = response.get("meta_info", {}).get("indexer_topk")
            if not isinstance(encoded, str):
                raise FormatError("return_indexer_topk was requested but meta_info has no indexer_topk string")
            topk = decode_indexer_topk(encoded, self.indexer_layers, self.index_topk)
            groups = value_entries(prompt.input_ids, prompt.needle_span, answer)
            ranks = needle_block_ranks(topk, prompt.length - 1, groups)
        return RecallTrial(prompt.length, prompt.depth, prompt.needle, output,
                           answer_is_correct(output, prompt.needle), ranks)

    def prompts(self, tokenizer: Tokenizer) -> list[RecallPrompt]:
        return recall_grid(tokenizer, self.lengths, self.depths, self.trials, self.seed, self.template)

    def run(
        self,
        tokenizer: Tokenizer,
        generate: Callable[[dict[str, Any]], dict[str, Any]],
        progress: Callable[[RecallTrial], None] = lambda trial: None,
        prompts: Sequence[RecallPrompt] | None = None,
    ) -> list[RecallTrial]:
        """One trial per prompt (``prompts``: the sweep's own, built once by the caller; default built here)."""
        results = []
        for prompt in self.prompts(tokenizer) if prompts is None else prompts:
            trial = self.score(prompt, generate(self.request(prompt)), answer_ids(tokenizer, prompt.needle))
            progress(trial)
            results.append(trial)
        return results


def farthest_needle(prompts: Sequence[RecallPrompt]) -> int:
    """Tokens from the grid's farthest needle to the end of its prompt, where the answer's query sits."""
    return max((p.length - p.needle_span[0] for p in prompts), default=0)


def reach_lines(reach: AttentionReach, farthest: int) -> list[str]:
    """What a grid whose farthest needle lies ``farthest`` tokens back tests of the release's attention: one line
    per level (the sliding window, a candidate level) the needles never pass, whose selection goes untested."""
    levels = {"sliding window": reach.sliding_window, "candidate level's reach": reach.candidate_reach}
    return [f"note: the farthest needle is {farthest:,} tokens back, within the {what} ({tokens:,} tokens): the "
            f"selection beyond it is not tested (longer --lengths or smaller --depths reach past it)"
            for what, tokens in levels.items() if tokens is not None and farthest <= tokens]


def summarize(trials: Sequence[RecallTrial], layer_ids: Sequence[int] | None = None) -> dict[str, Any]:
    """Accuracy per (length, depth) cell and, with ranks, per-layer needle selection rates."""
    cells: dict[tuple[int, float], list[bool]] = {}
    for trial in trials:
        cells.setdefault((trial.length, trial.depth), []).append(trial.correct)
    summary: dict[str, Any] = {
        "accuracy": sum(t.correct for t in trials) / len(trials) if trials else None,
        "cells": [
            {"length": length, "depth": depth, "accuracy": sum(v) / len(v), "trials": len(v)}
            for (length, depth), v in sorted(cells.items())
        ],
    }
    ranked = [t for t in trials if t.ranks is not None]
    if ranked:
        layers = len(ranked[0].ranks)
        names = list(layer_ids) if layer_ids is not None else list(range(layers))
        per_layer = []
        for i in range(layers):
            ranks = [t.ranks[i] for t in ranked]
            selected = [r for r in ranks if r is not None]
            per_layer.append({
                "layer": names[i],
                "selected_rate": len(selected) / len(ranks),
                "median_rank": float(np.median(selected)) if selected else None,
                "selected_when_wrong": _rate([t.ranks[i] is not None for t in ranked if not t.correct]),
            })
        summary["indexer_layers"] = per_layer
    return summary


def _rate(flags: list[bool]) -> float | None:
    return sum(flags) / len(flags) if flags else None
