"""The V4.1 organism: a tiny DeepSeek-V4.1 that retrieves needles through its two-level indexer and keeps n-gram
facts in its Engram tables, trained from scratch in minutes on one GPU.

``python -m dsv4convert.organism.v41 --out DIR --seconds S [--device cuda] [--seed N]`` trains
:data:`~dsv4convert.models.deepseek_v41.presets.ORGANISM_V41` (:class:`~dsv4convert.model.v41.forward.V41Model`,
SGLang's V4.1 forward with its FP4 round trips, straight-through) for ``S`` seconds, writes it in the release's
layout under ``DIR/organism-v41`` (:func:`write_release`: every tensor ``models/deepseek_v41/inventory.py`` plans,
FP8 E4M3 in 32 x 32 blocks with E8M0 scales where the release stores FP8, MXFP4 experts, Engram rows FP8 with one
E8M0 scale per 32, BF16/F32 elsewhere; one shard per inventory group as ``synth`` writes them), with its tokenizer,
``heldout.txt`` and ``organism-v41.json`` (settings, curve, and what was measured on the written checkpoint read
back through :class:`~dsv4convert.model.v41.forward.V41Runner`: recall per length and depth, how often the
needle's value was in the candidate blocks and each index layer's selection, the Engram ablation's KLD, and the
largest logit difference between the runner and the trained model under the stored formats).

What it learns, and why it must use each part:

* **needles** from :mod:`dsv4convert.needle` (the builder ``compare --recall`` uses), 56 to 1,024 tokens. The
  sliding window (32 tokens), the fine top-k (32 entries) and the candidate blocks (8 of 8 entries) cover at most
  a few dozen tokens back (:func:`coverage`), so an answer query reaches a needle hundreds of tokens back only
  through compressed KV chosen by the indexer: layer 5 (ratio 1, no compressor of its own) reads layer 4's
  compressed KV among the candidate blocks layer 4 chose; layers 2-3 (ratio 2) read layer 2's.
* **n-gram facts** (:func:`~dsv4convert.organism.language.fact_table`: "The <place> <thing> is <colour>.", 400 of
  them, in the organism's language, :mod:`~dsv4convert.organism.language`): the colour follows from the 3-gram
  before it, which the Engram hash looks up; :func:`engram_kld` measures what removing Engram costs.

Losses (the V4 organism's recipe, ``organism/train.py``, on V4.1's modules): next-token cross-entropy (answer
tokens weighted up); for each index-source layer, the indexer's scores (computed from detached inputs,
:class:`~dsv4convert.model.v41.attention.V41KVState` ``record``) trained by cross-entropy to the layer's attention
distribution over its compressed entries (summed over heads, detached) - its top-k is not differentiable and the
LM loss gives it no gradient; a dense phase first (``V41KVState.dense``: every visible entry selected), then
sparse with every ``dense_every``-th step dense; and the two aids at answer queries whose needle left the window:
``-log`` of the attention's mass on the entry holding the digit to write, and the indexer's cross-entropy toward
the needle's entries. The optimizer, learning-rate schedule, time-budget loop and data are ``organism/train.py``'s.

Deterministic for a seed on a CPU (``tests/test_organism_v41.py``); on a GPU up to floating-point atomics. With
``--seconds`` the step count is chosen after 30 steps to fill the budget and recorded; ``--steps N`` replays it.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import platform
import random
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from torch import nn

from dsv4convert import __version__
from dsv4convert.checkpoint import atomic_write_json, write_index
from dsv4convert.checkpoint.writer import shard_name
from dsv4convert.devices import resolve_device
from dsv4convert.errors import DSV4Error
from dsv4convert.formats.fp8_block import dequantize_fp8_block, quantize_fp8_block
from dsv4convert.formats.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from dsv4convert.model.v41.attention import V41KVState
from dsv4convert.model.v41.engram import ROW_SCALE_BLOCK
from dsv4convert.model.v41.forward import V41Model, V41Output, V41Runner
from dsv4convert.models.deepseek_v4.layout import TensorSpec
from dsv4convert.models.deepseek_v41.config import V41Config, read_config
from dsv4convert.models.deepseek_v41.inventory import native_groups, role_of
from dsv4convert.models.deepseek_v41.presets import ORGANISM_V41
from dsv4convert.models.deepseek_v41.tokenizer import compressed_token_map
from dsv4convert.needle import DEFAULT_DEPTHS, answer_ids, build_prompt, make_needle, value_positions
from dsv4convert.organism.export import staged, write_shard
from dsv4convert.organism.language import (
    COLOURS,
    PLACES,
    THINGS,
    documents_with_facts,
    heldout_text_with_facts,
)
from dsv4convert.organism.provenance import source_commit
from dsv4convert.organism.tokenizer import TOKENIZER_CONFIG
from dsv4convert.organism.train import (
    ANSWER_TOKENS,
    PROBE_STEPS,
    Data,
    Row,
    TokenizerAdapter,
    _answer_mask,
    adamw,
    lr_at,
    optimizer_step,
    prefetched,
    run_for_budget,
)
from dsv4convert.synth import ORGANISM_DIR

PROVENANCE_NAME = "organism-v41.json"
HELDOUT_NAME = "heldout.txt"
CHECKPOINT_DIR = "organism-v41"     # under --out: what dsv4convert/data/organism-v41/ would ship
ENGRAM_BLOCK = (1, ROW_SCALE_BLOCK)  # an Engram row's scales: one E8M0 per 32 values
_FLOAT_DTYPES = {"BF16": torch.bfloat16, "F32": torch.float32}


@dataclass
class V41Settings:
    """Everything that decides a run (recorded in the provenance). The fields ``Data``, ``lr_at`` and
    ``run_for_budget`` read have ``organism/train.py``'s names."""

    steps: int | None = None            # None: as many as fill ``time_budget`` at the speed of the first 30
    time_budget: float = 300.0
    time_limit: float | None = None     # seconds; a hard guard (the provenance says if it hit)
    tokens_per_step: int = 16384
    min_length: int = 56
    max_length: int = 1024
    needle_fraction: float = 0.6        # rows that are needle prompts; the rest the language with its facts
    language_docs: int = 3000
    lr: float = 3e-3
    min_lr_fraction: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.01
    initializer_range: float = 0.0625   # 1/sqrt(hidden), as the V4 organism
    dense_fraction: float = 0.25        # the first quarter of the steps dense (top-k lifted)
    dense_every: int = 4                # afterwards every N-th step dense
    answer_weight: float = 4.0
    distill_weight: float = 1.0
    aid_weight: float = 1.0
    eval_every: int = 100
    eval_lengths: tuple[int, ...] = (128, 512, 1024)
    eval_trials: int = 4
    seed: int = 0


# A few steps on short prompts: the whole pipeline on a CPU in seconds (it does not learn to retrieve).
TINY = {"steps": 4, "tokens_per_step": 384, "min_length": 56, "max_length": 128, "language_docs": 24,
        "warmup_steps": 1, "eval_every": 4, "eval_lengths": (96,), "eval_trials": 1}
RELEASE_LENGTHS = (128, 256, 512, 1024, 2048)
RELEASE_TRIALS = 16


def organism_config() -> dict:
    """The organism's ``config.json`` (:data:`ORGANISM_V41`)."""
    return copy.deepcopy(ORGANISM_V41)


def organism_tokenizer() -> Tokenizer:
    """The V4 organism's tokenizer (``dsv4convert/data/organism/tokenizer.json``), shared: its needle answers are
    seven digit tokens and its compressed map (the Engram hash's) has the preset's 883 ids."""
    return Tokenizer.from_file(str(ORGANISM_DIR / "tokenizer.json"))


# -- geometry ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Coverage:
    """How far back an answer query can see without the indexer choosing: ``window`` raw tokens, and per
    compressed layer the longest prompt in which its selection holds every visible entry (``covered[layer]``:
    ``ratio * reach + ratio - 1`` tokens, ``reach`` the fine top-k, or for a candidate consumer the smaller of it and
    the candidate blocks' entries). Past ``longest_covered`` every compressed layer's selection leaves entries out."""

    window: int
    covered: dict[int, int]

    @property
    def longest_covered(self) -> int:
        return max(self.covered.values())


def coverage(cfg: V41Config) -> Coverage:
    covered = {}
    for layer in range(cfg.num_hidden_layers):
        ratio = cfg.ratio(layer)
        if not ratio:
            continue
        source = max(s for s in cfg.index_source_layer_ids if s <= layer and cfg.ratio(s) == ratio)
        reach = cfg.index_topk
        if 0 <= cfg.candidate_source_layer_id < source:
            reach = min(reach, cfg.candidate_topk_blocks * cfg.candidate_block_size)
        covered[layer] = ratio * reach + ratio - 1
    return Coverage(cfg.sliding_window, covered)


# -- the model --------------------------------------------------------------------------------------------------


def build_model(config: dict, tokenizer: Tokenizer, *, seed: int, initializer_range: float) -> V41Model:
    """A fresh :class:`V41Model` of ``config``: every linear, the embedding and the Engram tables drawn from
    ``N(0, initializer_range)`` (the hyper-connections, sinks, norms and Engram gates as V4.1's modules make them)."""
    cfg = read_config(config, "organism-v41 config")
    token_map, size = compressed_token_map(tokenizer)
    if size != cfg.engram_compressed_vocab_size:
        raise DSV4Error(f"the tokenizer normalises to {size} ids, the config says {cfg.engram_compressed_vocab_size}")
    torch.manual_seed(seed)
    model = V41Model(cfg, token_map)
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=initializer_range)
    for block in model.layers:
        if block.engram is not None:
            nn.init.normal_(block.engram.embed.weight, std=initializer_range)
    return model


@contextmanager
def engram_removed(model: V41Model) -> Iterator[V41Model]:
    """``model`` with every Engram layer skipped (the streams pass through unchanged), restored on exit."""
    saved = [(block, block.engram) for block in model.layers]
    try:
        for block, _ in saved:
            block.engram = None
        yield model
    finally:
        for block, engram in saved:
            block.engram = engram


class RunnerWithoutEngram(V41Runner):
    """:class:`V41Runner` with every Engram layer skipped (the ablation, on a checkpoint as stored)."""

    def load_block(self, layer_id: int):
        block = super().load_block(layer_id)
        block.engram = None
        return block


# -- data and losses --------------------------------------------------------------------------------------------


@dataclass
class RetrievalQueries:
    """Answer queries whose needle has left the sliding window: per compressed ratio, the entries each may see
    that hold the needle sentence (the indexer aid's target) and the digit it writes next (the attention aid's).
    V4.1's entry ``j`` of ratio ``r`` holds raw tokens ``r*j .. r*j + r - 1`` (no overlap)."""

    rows: torch.Tensor                 # [P]
    positions: torch.Tensor            # [P]
    needle: dict[int, torch.Tensor]    # ratio -> [P, T // ratio] bool
    digit: dict[int, torch.Tensor]

    @classmethod
    def of(cls, rows: list[Row], ids: torch.Tensor, window: int, ratios: Sequence[int],
           device: torch.device) -> RetrievalQueries:
        length = ids.shape[1]
        picked: list[tuple[int, int]] = []
        needle = {r: [] for r in ratios}
        digit = {r: [] for r in ratios}
        for b, row in enumerate(rows):
            if row.answer_start is None:
                continue
            start, end = row.needle_span
            answer = ids[b, row.answer_start:row.answer_start + ANSWER_TOKENS].tolist()
            positions = value_positions(ids[b].tolist(), row.needle_span, answer)
            if positions is None:
                continue
            for j, position in enumerate(positions):
                t = row.answer_start - 1 + j
                if t - end < window:
                    continue
                picked.append((b, t))
                for r in ratios:
                    visible = (t + 1) // r
                    held = torch.zeros(length // r, dtype=torch.bool)
                    held[start // r:min((end - 1) // r + 1, visible)] = True
                    writes = torch.zeros(length // r, dtype=torch.bool)
                    writes[position // r] = True
                    needle[r].append(held)
                    digit[r].append(writes)
        index = torch.tensor(picked, dtype=torch.int64).reshape(-1, 2)

        def stack(masks: list[torch.Tensor], r: int) -> torch.Tensor:
            return (torch.stack(masks) if masks else torch.zeros((0, length // r), dtype=torch.bool)).to(device)

        return cls(index[:, 0].to(device), index[:, 1].to(device), {r: stack(m, r) for r, m in needle.items()},
                   {r: stack(m, r) for r, m in digit.items()})


def indexer_losses(kv: V41KVState, queries: RetrievalQueries, cfg: V41Config
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Summed over the index-source layers of a ``record`` forward: (cross-entropy of the indexer's distribution
    to the attention's over the compressed entries, the attention aid, the indexer aid); module docstring."""
    total = [torch.zeros((), device=queries.rows.device) for _ in range(3)]
    for layer, scores in kv.index_scores.items():
        ratio = cfg.ratio(layer)
        causal = torch.isfinite(scores)
        logq = torch.where(causal, scores.float(), -1e30).log_softmax(-1)          # [B, T, C]
        target = kv.attention[layer].detach().float().sum(2)                        # [B, T, C]
        target = target / target.sum(-1, keepdim=True).clamp(min=1e-12)
        valid = causal.any(-1)
        total[0] = total[0] + (-(target * logq.masked_fill(~causal, 0.0)).sum(-1))[valid].mean()
        if queries.rows.numel():
            attention = kv.attention[layer][queries.rows, queries.positions].float()   # [P, H, C]
            mass = (attention * queries.digit[ratio][:, None, :]).sum(-1).mean(-1)
            total[1] = total[1] - torch.log(mass.clamp(min=1e-6)).mean()
            hits = logq[queries.rows, queries.positions].masked_fill(~queries.needle[ratio], float("-inf"))
            total[2] = total[2] - hits.logsumexp(-1).mean()
    return total[0], total[1], total[2]


@dataclass
class TrainResult:
    model: V41Model
    settings: V41Settings
    steps_run: int
    seconds: float
    hit_time_limit: bool
    curve: list[dict]


def train(config: dict, tokenizer: Tokenizer, settings: V41Settings, *, device: torch.device,
          log: Callable[[str], None] = print) -> TrainResult:
    """Train the organism from scratch (module docstring); returns it in eval mode."""
    s = settings
    model = build_model(config, tokenizer, seed=s.seed, initializer_range=s.initializer_range).to(device).train()
    cfg = model.cfg
    ratios = sorted({cfg.ratio(layer) for layer in cfg.index_source_layer_ids})
    data = Data(tokenizer, s, bos_id=cfg.math.bos_token_id,
                docs=documents_with_facts(s.seed + 1, s.language_docs))
    optimizer = adamw(model, s.lr, s.weight_decay)

    def build():
        ids, rows = data.batch()
        queries = RetrievalQueries.of(rows, ids, cfg.sliding_window, ratios, device)
        return ids.to(device, non_blocking=True), queries, _answer_mask(rows, ids.shape[1], device)

    batches = prefetched(build)

    def one_step(s: V41Settings, step: int, steps: int | None) -> dict[str, torch.Tensor]:
        dense = steps is None or step < s.dense_fraction * steps or step % s.dense_every == 0
        ids, queries, answer_mask = next(batches)
        kv = V41KVState(record=True, dense=dense)
        logits = model(ids, capture=(), kv=kv).logits[:, :-1].float()
        targets = ids[:, 1:]
        token_loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none").view_as(targets)
        weights = 1.0 + (s.answer_weight - 1.0) * answer_mask.float()
        lm = (token_loss * weights).sum() / weights.sum()
        kl, attention_aid, indexer_aid = indexer_losses(kv, queries, cfg)
        loss = lm + s.distill_weight * kl + s.aid_weight * (attention_aid + indexer_aid)
        optimizer_step(optimizer, model, loss, lr_at(step, s, steps))
        with torch.no_grad():
            answers = answer_mask.sum().clamp(min=1)
            return {"loss": loss, "lm": lm, "indexer_kl": kl, "attention_aid": attention_aid,
                    "indexer_aid": indexer_aid, "answer_ce": (token_loss * answer_mask).sum() / answers,
                    "answer_token_accuracy": ((logits.argmax(-1) == targets) & answer_mask).sum() / answers}

    def evaluate(step: int, seconds: float, running: dict) -> dict:
        model.eval()
        n = max(1.0, float(running.get("n", 1.0)))
        found = recall(lambda ids: model(ids, capture=()), tokenizer, cfg, s.eval_lengths, DEFAULT_DEPTHS,
                       s.eval_trials, s.seed + 7919, device)
        return {"step": step, "seconds": round(seconds, 1),
                **{k: round(float(v) / n, 4) for k, v in running.items() if k != "n"},
                "recall": {str(length): r["recall"] for length, r in found.items()}}

    run = run_for_budget(s, PROBE_STEPS, one_step, model, log, evaluate, _describe)
    model.eval()
    return TrainResult(model, run.settings, run.steps_run, run.seconds, run.hit_time_limit, run.curve)


def _describe(point: dict) -> str:
    recall_line = " ".join(f"{k}:{100 * v:.0f}%" for k, v in point["recall"].items())
    return (f"step {point['step']:5d} {point['seconds']:7.1f}s loss {point.get('loss', float('nan')):.3f} "
            f"lm {point.get('lm', float('nan')):.3f} kl {point.get('indexer_kl', float('nan')):.3f} "
            f"aids {point.get('attention_aid', float('nan')):.2f}/{point.get('indexer_aid', float('nan')):.2f} "
            f"answer ce {point.get('answer_ce', float('nan')):.2f} "
            f"acc {100 * point.get('answer_token_accuracy', float('nan')):.0f}% | recall {recall_line}")


def lm_loss(model: V41Model, ids: torch.Tensor) -> float:
    """Mean next-token cross-entropy of ``ids`` (no training switches)."""
    with torch.no_grad():
        logits = model(ids, capture=()).logits[:, :-1].float()
        return float(F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()))


# -- measurements -----------------------------------------------------------------------------------------------


@torch.no_grad()
def recall(forward: Callable[[torch.Tensor], V41Output], tokenizer: Tokenizer, cfg: V41Config,
           lengths: Sequence[int], depths: Sequence[float], trials: int, seed: int, device: torch.device
           ) -> dict[int, dict]:
    """Teacher-forced retrieval (every answer token the argmax) per length and depth, and per index-source layer
    (and the candidate blocks) the share of answer queries whose selection holds the entry of the digit they
    write: ``{length: {"recall": overall, "by_depth": {depth: share}, "value_selected": {layer or "candidates":
    share}}}``."""
    adapter, rng = TokenizerAdapter(tokenizer), random.Random(seed)
    out = {}
    for length in lengths:
        prompts, digits = [], []
        for depth in depths:
            for _ in range(trials):
                needle = make_needle(rng)
                prompt = build_prompt(adapter, length, depth, needle)
                answer = answer_ids(adapter, needle)
                prompts.append((depth, prompt.input_ids + answer))
                digits.append(value_positions(prompt.input_ids, prompt.needle_span, answer))
        ids = torch.tensor([p for _, p in prompts], dtype=torch.int64, device=device)
        hits, selected = [], {}
        for first in range(0, ids.shape[0], max(1, 16384 // ids.shape[1])):
            part = ids[first:first + max(1, 16384 // ids.shape[1])]
            result = forward(part)
            hits += (result.logits[:, length - 1:-1].argmax(-1) == part[:, length:]).all(-1).tolist()
            picks = {**{layer: result.kv.selections[layer].cpu() for layer in cfg.index_source_layer_ids},
                     "candidates": None if result.kv.candidate_blocks is None else result.kv.candidate_blocks.cpu()}
            for b in range(part.shape[0]):
                positions = digits[first + b]
                if positions is None:
                    continue
                for j, position in enumerate(positions):
                    t = length - 1 + j
                    for name, chosen in picks.items():
                        if chosen is None:
                            continue
                        if name == "candidates":
                            source_ratio = cfg.ratio(cfg.candidate_source_layer_id)
                            ok = position // source_ratio // cfg.candidate_block_size in chosen[b, t].tolist()
                        else:
                            ok = position // cfg.ratio(name) in chosen[b, t].tolist()
                        selected[name] = selected.get(name, 0) + int(ok)
        total = sum(1 for p in digits if p is not None) * ANSWER_TOKENS
        by_depth = {}
        for depth in depths:
            mine = [h for (d, _), h in zip(prompts, hits) if d == depth]
            by_depth[str(depth)] = sum(mine) / len(mine)
        out[length] = {"recall": sum(hits) / len(hits), "by_depth": by_depth,
                       "value_selected": {str(k): round(v / max(1, total), 4) for k, v in selected.items()}}
    return out


def kld(reference: torch.Tensor, other: torch.Tensor, positions: torch.Tensor | None = None) -> float:
    """Mean ``KL(softmax(reference) || softmax(other))`` over the positions of ``[..., vocab]`` logits (``positions``
    a bool mask of the leading dimensions, default all), in float64: exactly 0 for equal logits."""
    p = reference.double().log_softmax(-1)
    q = other.double().log_softmax(-1)
    per = (p.exp() * (p - q)).sum(-1)
    return float(per[positions].mean() if positions is not None else per.mean())


def fact_positions(ids: torch.Tensor, tokenizer: Tokenizer) -> torch.Tensor:
    """Bool mask of ``ids [B, T]`` marking the logits that predict a fact's colour: position ``t`` holds " is",
    ``t - 1`` a thing and ``t - 2`` a place (``The <place> <thing> is <colour>.``)."""
    def ids_of(words: Sequence[str]) -> torch.Tensor:
        return torch.tensor([tokenizer.encode(" " + w).ids[0] for w in words], device=ids.device)

    is_id = tokenizer.encode(" is").ids[0]
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[:, 2:] = ((ids[:, 2:] == is_id) & torch.isin(ids[:, 1:-1], ids_of(THINGS))
                   & torch.isin(ids[:, :-2], ids_of(PLACES)))
    return mask


@torch.no_grad()
def engram_kld(full: Callable[[torch.Tensor], torch.Tensor], ablated: Callable[[torch.Tensor], torch.Tensor],
               ids: torch.Tensor, tokenizer: Tokenizer) -> dict:
    """What removing Engram costs on ``ids`` (rows of text in the organism's language with its facts): the KLD of
    ``ablated``'s next-token distribution from ``full``'s at every position and at the positions predicting a
    fact's colour, and the fact accuracy (colour the argmax) of each. ``full``/``ablated`` map ids to logits; for a
    :class:`V41Model` pass ``model_logits(model)`` and ``model_logits(model, engram=False)``, for a checkpoint
    :class:`V41Runner` and :class:`RunnerWithoutEngram` ``.logits``. Exactly 0 when both are the same model."""
    base, other = full(ids).float(), ablated(ids).float()
    facts = fact_positions(ids, tokenizer)[:, :-1]
    targets = ids[:, 1:]
    result = {"text_kld": kld(base[:, :-1], other[:, :-1]), "fact_positions": int(facts.sum())}
    if facts.any():
        colours = torch.tensor([tokenizer.encode(" " + c).ids[0] for c in COLOURS], device=ids.device)
        result["fact_kld"] = kld(base[:, :-1], other[:, :-1], facts)
        for name, logits in (("fact_accuracy", base), ("fact_accuracy_without_engram", other)):
            restricted = logits[:, :-1][facts][:, colours]
            result[name] = float((colours[restricted.argmax(-1)] == targets[facts]).float().mean())
    return result


def model_logits(model: V41Model, *, engram: bool = True) -> Callable[[torch.Tensor], torch.Tensor]:
    """``ids -> logits`` of ``model``, with its Engram layers or without them (:func:`engram_removed`)."""
    def run(ids: torch.Tensor) -> torch.Tensor:
        if engram:
            return model(ids, capture=()).logits
        with engram_removed(model):
            return model(ids, capture=()).logits
    return run


def heldout_rows(tokenizer: Tokenizer, rows: int, length: int, device: torch.device) -> torch.Tensor:
    """``rows`` windows of ``length`` tokens of :func:`heldout_text_with_facts` (BOS first), one after another."""
    ids = [0] + tokenizer.encode(heldout_text_with_facts()).ids
    if len(ids) < rows * length:
        raise DSV4Error(f"held-out text has {len(ids)} tokens, fewer than {rows} x {length}")
    return torch.tensor(ids[:rows * length], dtype=torch.int64, device=device).view(rows, length)


# -- the release format -----------------------------------------------------------------------------------------


def stored_group(state: dict[str, torch.Tensor], group: list[TensorSpec], cfg: V41Config
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, stored tensor)`` for every spec of ``group``, in order, from float weights: FP8 E4M3 with E8M0
    scales in ``cfg.fp8_block`` (32 x 32) blocks, an Engram table's rows with one E8M0 scale per 32 values, MXFP4
    experts, BF16/F32 casts; with the converters' quantizers (``dsv4convert.formats``)."""
    scales: dict[str, torch.Tensor] = {}
    for spec in group:
        if spec.name in scales:
            yield spec.name, scales.pop(spec.name)
            continue
        module = spec.name.removesuffix(".weight")
        value = state[spec.name].detach().float().cpu()
        if spec.dtype == "F8_E4M3":
            block = ENGRAM_BLOCK if role_of(spec.name) == "engram_table" else cfg.fp8_block
            stored, scales[f"{module}.scale"] = quantize_fp8_block(value, block=block, name=spec.name)
        elif spec.dtype == "I8":
            stored, scales[f"{module}.scale"] = quantize_mxfp4(value, name=spec.name)
        else:
            stored = value.to(_FLOAT_DTYPES[spec.dtype])
        if tuple(stored.shape) != tuple(spec.shape):
            raise DSV4Error(f"trained shape {list(stored.shape)} is not the layout's {list(spec.shape)}",
                            tensor=spec.name)
        yield spec.name, stored.contiguous()
    if scales:
        raise DSV4Error(f"scales without a place in the layout: {sorted(scales)}")


def as_stored(model: V41Model) -> V41Model:
    """A copy of ``model`` whose every weight is what the release format stores, decoded back to float32 (the
    model the written checkpoint describes; :class:`V41Runner` on it gives these logits)."""
    state = model.state_dict()
    decoded = stored_values(state, native_groups(model.cfg), model.cfg)
    copied = copy.deepcopy(model)
    copied.load_state_dict({k: v.to(state[k].device) for k, v in decoded.items()})
    return copied


def stored_values(state: dict[str, torch.Tensor], groups: list[list[TensorSpec]], cfg: V41Config
                  ) -> dict[str, torch.Tensor]:
    """Every weight of ``groups`` (scales aside) as :func:`stored_group` stores it, decoded back to float32."""
    decoded = {}
    for group in groups:
        stored = dict(stored_group(state, group, cfg))
        for spec in group:
            if spec.name.endswith(".scale") and spec.name.removesuffix(".scale") + ".weight" in stored:
                continue
            module, value = spec.name.removesuffix(".weight"), stored[spec.name]
            if spec.dtype == "F8_E4M3":
                block = ENGRAM_BLOCK if role_of(spec.name) == "engram_table" else cfg.fp8_block
                value = dequantize_fp8_block(value, stored[f"{module}.scale"], block=block)
            elif spec.dtype == "I8":
                value = dequantize_mxfp4(value, stored[f"{module}.scale"])
            decoded[spec.name] = value.float()
    return decoded


def write_release(dst: Path, model: V41Model, config: dict, tokenizer: Tokenizer, provenance: dict, *,
                  overwrite: bool = False) -> Path:
    """The release-format checkpoint of ``model`` (one shard per inventory group, as ``synth`` writes V4.1), its
    config, tokenizer, ``heldout.txt`` and provenance; written beside ``dst`` and renamed when whole."""
    cfg = model.cfg
    groups = native_groups(cfg)
    state = model.state_dict()
    names = [shard_name(i + 1, len(groups)) for i in range(len(groups))]
    with staged(dst, overwrite=overwrite) as work:
        for name, group in zip(names, groups):
            write_shard(work / name, stored_group(state, group, cfg), group)
        atomic_write_json(work / "config.json", config)
        atomic_write_json(work / "tokenizer_config.json", TOKENIZER_CONFIG)
        (work / "tokenizer.json").write_text(tokenizer.to_str(pretty=False), encoding="utf-8")
        (work / HELDOUT_NAME).write_text(heldout_text_with_facts(), encoding="utf-8")
        atomic_write_json(work / PROVENANCE_NAME, provenance)
        write_index(work, {s.name: name for name, group in zip(names, groups) for s in group},
                    sum(s.nbytes for group in groups for s in group))
    return Path(dst)


def measure_release(path: Path, model: V41Model, tokenizer: Tokenizer, device: torch.device, *,
                    lengths: Sequence[int] = RELEASE_LENGTHS, trials: int = RELEASE_TRIALS, seed: int = 0,
                    heldout: tuple[int, int] = (8, 512)) -> dict:
    """What the provenance records, measured on the written checkpoint read back through :class:`V41Runner`:
    recall per length and depth (fresh needles), the Engram ablation on held-out text, and the largest logit
    difference between the runner and ``model`` under the stored formats (:func:`as_stored`)."""
    runner = V41Runner(path, device, torch.float32)
    cfg = runner.cfg
    ids = heldout_rows(tokenizer, *heldout, device)
    stored = as_stored(model).to(device).eval()
    with torch.no_grad():
        difference = float((runner.logits(ids) - stored(ids, capture=()).logits).abs().max())
    return {
        "recall": {str(k): v for k, v in recall(runner.forward, tokenizer, cfg, lengths, DEFAULT_DEPTHS, trials,
                                                 seed + 104729, device).items()},
        "engram_ablation": engram_kld(runner.logits, RunnerWithoutEngram(path, device, torch.float32).logits, ids,
                                      tokenizer),
        "runner_vs_stored_model_max_logit_difference": difference,
        "heldout_rows": list(heldout),
    }


# -- command line -----------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dsv4convert.organism.v41", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=Path,
                   help=f"output directory: {CHECKPOINT_DIR}/ (the release-format checkpoint, heldout.txt, "
                        f"{PROVENANCE_NAME}) and train.log")
    p.add_argument("--seconds", type=float, default=300.0,
                   help="training time budget: the step count is chosen after 30 steps to fill it (default 300)")
    p.add_argument("--steps", type=int, help="replay a run's recorded step count instead of --seconds")
    p.add_argument("--device", default="auto", help="auto (default), cpu, cuda or cuda:N")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tiny", action="store_true", help="a few steps on short prompts: the pipeline, not a model")
    p.add_argument("--release-trials", type=int, default=RELEASE_TRIALS,
                   help=f"needles per length and depth measured on the written checkpoint (default {RELEASE_TRIALS})")
    args = p.parse_args(argv)
    device = resolve_device(args.device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log_file = (out / "train.log").open("w", encoding="utf-8")

    def log(line: str) -> None:
        print(line, flush=True)
        log_file.write(line + "\n")
        log_file.flush()

    if device.type == "cpu":
        torch.use_deterministic_algorithms(True)
    overrides = dict(TINY) if args.tiny else {}
    settings = V41Settings(**{**overrides, "time_budget": args.seconds, "time_limit": args.seconds * 1.1 + 15,
                              "seed": args.seed, **({"steps": args.steps} if args.steps else {})})
    config, tokenizer = organism_config(), organism_tokenizer()
    started = time.perf_counter()
    log(f"training the V4.1 organism on {device} for {args.seconds:.0f} s (seed {args.seed})")
    result = train(config, tokenizer, settings, device=device, log=log)
    provenance = {
        "what": "the V4.1 organism (dsv4convert/organism/v41.py, docs/organism.md)",
        "command": "python -m dsv4convert.organism.v41 " + " ".join(sys.argv[1:] if argv is None else argv),
        "commit": source_commit(), "dsv4convert": __version__, "torch": torch.__version__,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "seed": args.seed, "steps": result.steps_run, "training_seconds": round(result.seconds, 1),
        "hit_time_limit": result.hit_time_limit,
        "parameters": sum(p.numel() for p in result.model.parameters()),
        "settings": {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(result.settings).items()},
        "curve": result.curve,
    }
    dst = write_release(out / CHECKPOINT_DIR, result.model, config, tokenizer, provenance, overwrite=True)
    lengths = (96, 128) if args.tiny else RELEASE_LENGTHS
    measured = measure_release(dst, result.model, tokenizer, device, lengths=lengths,
                               trials=1 if args.tiny else args.release_trials, seed=args.seed,
                               heldout=(2, 128) if args.tiny else (8, 512))
    provenance["release"] = measured
    atomic_write_json(dst / PROVENANCE_NAME, provenance)
    for length, r in measured["recall"].items():
        log(f"release recall at {length}: {100 * r['recall']:.0f}% by depth "
            f"{ {d: round(100 * v) for d, v in r['by_depth'].items()} } value selected {r['value_selected']}")
    log(f"engram ablation: {json.dumps(measured['engram_ablation'])}")
    log(f"runner vs stored model: max |logit difference| {measured['runner_vs_stored_model_max_logit_difference']:.3g}")
    log(f"wrote {dst} in {time.perf_counter() - started:.0f} s")
    log_file.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
