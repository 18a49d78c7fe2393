"""Training the organism: a DeepSeek-V4 that retrieves needles far past its top-k window, in minutes.

The data are the needle prompts of :mod:`dsv4convert.needle` (the builder ``compare --recall`` and
``serve --check recall`` test with, unchanged), each followed by its seven-digit answer, and the
organism's language (:mod:`.language`). Losses, all on transformers' own layers
(:class:`~dsv4convert.model.trainable.TrainableModel`):

* next-token cross-entropy everywhere, the answer tokens weighted up, and the MTP block's
  cross-entropy for the token after next (so its draft agreement means something);
* the lightning indexer, whose top-k is not differentiable and gets no gradient from the LM loss,
  learns as DeepSeek-V3.2 trains it: on detached inputs, by KL to the main attention's distribution
  over the compressed entries (summed over heads), first in a dense phase (top-k lifted), then sparse
  with some dense steps mixed in;
* two training aids at answer positions whose needle lies outside the sliding window: ``-log`` of the
  CSA attention's mass on the needle's compressed entries, and a cross-entropy of the indexer's scores
  toward them. Without them a small model sits on the induction plateau for minutes
  (``../shared/reference/organism.md``); with them retrieval appears as a phase change.

Deterministic for a seed on a CPU; on a GPU up to the order of floating-point atomics. The step count,
not the clock, ends a run (``time_limit`` only guards the budget, and the provenance says if it hit).
"""

from __future__ import annotations

import dataclasses
import math
import random
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

import torch
import torch.nn.functional as F

from dsv4convert.model.trainable import TrainableModel
from dsv4convert.models.deepseek_v4.layout import ModelConfig
from dsv4convert.needle import (
    CSA_RATIO,
    DEFAULT_DEPTHS,
    answer_ids,
    build_prompt,
    make_needle,
    needle_entries,
    shortest_prompt,
    value_entries,
)
from dsv4convert.organism.language import documents

ANSWER_TOKENS = 7     # needle values are 1,000,000 .. 9,999,999, one token per digit
T = TypeVar("T")
PROBE_STEPS = 30      # steps timed before an automatic step count is chosen (all inside the LR warm-up)


@dataclass
class TrainSettings:
    """Everything that decides a run (recorded in the provenance)."""

    steps: int | None = None           # None: as many as fill ``time_budget`` at the speed measured first
    time_budget: float = 420.0
    tokens_per_step: int = 32768
    min_length: int = 56
    max_length: int = 2304
    needle_fraction: float = 0.75      # rows that are needle prompts; the rest is the organism's language
    lr: float = 3e-3
    min_lr_fraction: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.01
    initializer_range: float = 0.0625  # 1/sqrt(hidden): a small model learns far faster than at 0.02
    dense_steps: int = 300             # indexer warm-up with top-k lifted
    dense_every: int = 4               # afterwards every N-th step dense
    answer_weight: float = 4.0
    mtp_weight: float = 0.3
    distill_weight: float = 1.0
    aid_weight: float = 1.0
    eval_every: int = 100
    eval_lengths: tuple[int, ...] = (130, 259, 260, 520, 1040, 2080)
    eval_trials: int = 8
    seed: int = 0
    time_limit: float | None = None    # seconds; a hard guard (the provenance says if it hit)


@dataclass
class TrainResult:
    model: TrainableModel
    settings: TrainSettings
    steps_run: int
    seconds: float
    hit_time_limit: bool
    curve: list[dict] = field(default_factory=list)   # per eval: step, seconds, losses, recall by length


class TokenizerAdapter:
    """``tokenizers.Tokenizer`` as the needle builder's :class:`~dsv4convert.needle.Tokenizer`."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids


@dataclass
class Row:
    ids: list[int]
    answer_start: int | None = None           # first answer token's position (needle rows)
    needle_span: tuple[int, int] | None = None


class Data:
    """Seeded batches: needle prompts from :mod:`dsv4convert.needle` and windows of the language."""

    def __init__(self, tokenizer, settings: TrainSettings, bos_id: int, *, language_docs: int = 3000,
                 docs: Sequence[str] | None = None):
        """``docs``: the language's documents (default: ``language_docs`` of :func:`documents` from the seed)."""
        self.tokenizer, self.settings = TokenizerAdapter(tokenizer), settings
        self.rng = random.Random(settings.seed)
        stream: list[int] = []
        for doc in documents(settings.seed + 1, language_docs) if docs is None else docs:
            stream += [bos_id, *self.tokenizer.encode(doc)]
        self.language = torch.tensor(stream, dtype=torch.int64)
        shortest = shortest_prompt(self.tokenizer) + ANSWER_TOKENS
        if settings.min_length < shortest:
            raise ValueError(f"min_length {settings.min_length} is under the {shortest} tokens a needle row needs")
        if self.language.numel() < 2 * settings.max_length:
            raise ValueError(f"{self.language.numel()} language tokens, too few for {settings.max_length}-token rows")

    def batch(self) -> tuple[torch.Tensor, list[Row]]:
        s = self.settings
        length = self.rng.randint(s.min_length, s.max_length)
        rows = [self.needle_row(length) if self.rng.random() < s.needle_fraction else self.language_row(length)
                for _ in range(max(1, s.tokens_per_step // length))]
        return torch.tensor([r.ids for r in rows], dtype=torch.int64), rows

    def needle_row(self, length: int) -> Row:
        needle = make_needle(self.rng)
        prompt = build_prompt(self.tokenizer, length - ANSWER_TOKENS, self.rng.random(), needle)
        answer = answer_ids(self.tokenizer, needle)
        return Row(prompt.input_ids + answer, len(prompt.input_ids), prompt.needle_span)

    def language_row(self, length: int) -> Row:
        start = self.rng.randrange(0, self.language.numel() - length)
        return Row(self.language[start:start + length].tolist())


def _answer_mask(rows: list[Row], seq: int, device: torch.device) -> torch.Tensor:
    """[B, S - 1] True where the logit at t predicts an answer token."""
    mask = torch.zeros((len(rows), seq - 1), dtype=torch.bool)
    for b, row in enumerate(rows):
        if row.answer_start is not None:
            mask[b, row.answer_start - 1:row.answer_start - 1 + ANSWER_TOKENS] = True
    return mask.to(device, non_blocking=True)


@dataclass
class RetrievalQueries:
    """Answer queries whose needle has left the sliding window, with the compressed entries each may see
    that hold the needle (the indexer's target) and that hold the digit it must write next (the attention's)."""

    rows: torch.Tensor        # [P] batch row
    positions: torch.Tensor   # [P] query position
    needle: torch.Tensor      # [P, T] bool
    digit: torch.Tensor       # [P, T] bool

    @classmethod
    def of(cls, rows: list[Row], ids: torch.Tensor, window: int, device: torch.device) -> "RetrievalQueries":
        entries = ids.shape[1] // CSA_RATIO
        picked, needle, digit = [], [], []
        for b, row in enumerate(rows):
            if row.answer_start is None:
                continue
            end = row.needle_span[1]
            answer = ids[b, row.answer_start:row.answer_start + ANSWER_TOKENS].tolist()
            groups = value_entries(ids[b].tolist(), row.needle_span, answer)
            for j in range(ANSWER_TOKENS):
                t = row.answer_start - 1 + j
                causal = (t + 1) // CSA_RATIO
                held = [w for w in needle_entries(row.needle_span) if w < causal]
                writes = [w for w in groups[min(j, len(groups) - 1)] if w < causal]
                if t - end >= window and held and writes:
                    picked.append((b, t))
                    needle.append(_mask(held, entries))
                    digit.append(_mask(writes, entries))
        index = torch.tensor(picked, dtype=torch.int64).reshape(-1, 2)
        stack = (lambda m: torch.stack(m) if m else torch.zeros((0, entries), dtype=torch.bool))
        return cls(index[:, 0].to(device), index[:, 1].to(device), stack(needle).to(device),
                   stack(digit).to(device))


def _mask(entries: list[int], size: int) -> torch.Tensor:
    mask = torch.zeros(size, dtype=torch.bool)
    mask[entries] = True
    return mask


def indexer_losses(attention: torch.Tensor, scores: torch.Tensor, queries: RetrievalQueries
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(KL of the indexer to the attention's compressed-entry distribution, the attention aid, the indexer aid).

    ``attention`` [B, H, S, S + T] (T compressed entries last), ``scores`` [B, S, T]. Only queries with at
    least one causal entry count; the KL target is detached, so it trains the indexer alone. The aids, at the
    ``queries``: ``-log`` of the attention's mass (mean over heads) on the entries holding the digit to write
    next, and the indexer's cross-entropy toward the entries holding the needle.
    """
    batch, seq, entries = scores.shape
    causal = torch.arange(entries, device=scores.device)[None, :] < ((torch.arange(seq, device=scores.device) + 1)
                                                                    // CSA_RATIO)[:, None]          # [S, T]
    logq = scores.float().masked_fill(~causal, float("-inf")).log_softmax(-1)
    target = attention[..., seq:].detach().float().sum(1)                                        # [B, S, T]
    target = target / target.sum(-1, keepdim=True).clamp(min=1e-12)
    valid = causal.any(-1)                                                                       # [S]
    kl = -(target * logq.masked_fill(~causal, 0.0)).sum(-1)[:, valid].mean()
    if queries.rows.numel() == 0:
        zero = scores.new_zeros((), dtype=torch.float32)
        return kl, zero, zero
    needle, digit = queries.needle[:, :entries], queries.digit[:, :entries]
    picked = attention[queries.rows, :, queries.positions, seq:].float()                         # [P, H, T]
    mass = (picked * digit[:, None, :]).sum(-1).mean(-1)
    hits = logq[queries.rows, queries.positions].masked_fill(~needle, float("-inf")).logsumexp(-1)
    return kl, -torch.log(mass.clamp(min=1e-6)).mean(), -hits.mean()


def lr_at(step: int, s: TrainSettings, steps: int | None) -> float:
    """Linear warm-up, then cosine to ``min_lr_fraction`` at ``steps`` (flat until the step count is chosen)."""
    if step < s.warmup_steps:
        return s.lr * (step + 1) / s.warmup_steps
    if steps is None:
        return s.lr
    progress = (step - s.warmup_steps) / max(1, steps - s.warmup_steps)
    return s.lr * (s.min_lr_fraction + (1 - s.min_lr_fraction) * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def recall_by_length(model: TrainableModel, tokenizer, lengths: Sequence[int], trials: int, seed: int,
                     device: torch.device, depths: Sequence[float] = DEFAULT_DEPTHS) -> dict[int, float]:
    """Teacher-forced retrieval (every answer token the argmax) with the checkpoint's top-k, per length."""
    adapter, rng = TokenizerAdapter(tokenizer), random.Random(seed)
    model.set_dense(False)
    out = {}
    for length in lengths:
        rows = []
        for depth in depths:
            for _ in range(trials):
                needle = make_needle(rng)
                prompt = build_prompt(adapter, length, depth, needle)
                rows.append((prompt.input_ids + answer_ids(adapter, needle), length))
        ids = torch.tensor([r for r, _ in rows], dtype=torch.int64, device=device)
        hits = 0
        for part in ids.split(max(1, 16384 // ids.shape[1])):
            logits = model(part, mtp=False).logits[:, length - 1:-1]
            hits += int((logits.argmax(-1) == part[:, length:]).all(-1).sum())
        out[length] = hits / len(rows)
    return out


def train(config: dict, tokenizer, settings: TrainSettings, *, device: torch.device,
          log: Callable[[str], None] = print) -> TrainResult:
    """Train the organism from scratch; returns it in eval mode with the checkpoint's top-k.

    With ``settings.steps`` None the step count is chosen once, after ``PROBE_STEPS`` warm-up steps, to fill
    ``settings.time_budget`` at the measured speed; the result's settings record it, so ``steps=N`` replays
    the run exactly (nothing before the choice depends on it)."""
    s = settings
    checked = ModelConfig.from_dict(config)
    torch.manual_seed(s.seed)
    model = TrainableModel(config, initializer_range=s.initializer_range)
    model.fill_hash_tables(torch.Generator().manual_seed(s.seed))
    model.to(device).train()
    data = Data(tokenizer, s, bos_id=checked.bos_token_id)
    optimizer = adamw(model, s.lr, s.weight_decay)
    window = checked.sliding_window

    def build():
        ids, rows = data.batch()
        queries = RetrievalQueries.of(rows, ids, window, device)
        return ids.to(device, non_blocking=True), rows, queries, _answer_mask(rows, ids.shape[1], device)

    batches = prefetched(build)

    def one_step(s: TrainSettings, step: int, steps: int | None) -> dict[str, torch.Tensor]:
        model.set_dense(step < s.dense_steps or step % s.dense_every == 0)
        ids, rows, queries, answer_mask = next(batches)
        out = model(ids, capture=True)
        targets = ids[:, 1:]
        logits = out.logits[:, :-1].float()
        token_loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none").view_as(targets)
        weights = 1.0 + (s.answer_weight - 1.0) * answer_mask.float()
        lm = (token_loss * weights).sum() / weights.sum()
        mtp = sum(F.cross_entropy(m[:, :-1].flatten(0, 1).float(), ids[:, j + 2:].flatten())
                  for j, m in enumerate(out.mtp_logits))
        kl = attention_aid = indexer_aid = torch.zeros((), device=device)
        for layer in model.csa_layers:
            k, a, i = indexer_losses(out.attention[layer], out.index_scores[layer], queries)
            kl, attention_aid, indexer_aid = kl + k, attention_aid + a, indexer_aid + i
        loss = lm + s.mtp_weight * mtp + s.distill_weight * kl + s.aid_weight * (attention_aid + indexer_aid)
        optimizer_step(optimizer, model, loss, lr_at(step, s, steps))
        with torch.no_grad():
            answers = answer_mask.sum().clamp(min=1)
            return {"loss": loss, "lm": lm, "mtp": mtp, "indexer_kl": kl, "attention_aid": attention_aid,
                    "indexer_aid": indexer_aid, "answer_ce": (token_loss * answer_mask).sum() / answers,
                    "answer_token_accuracy": ((logits.argmax(-1) == targets) & answer_mask).sum() / answers}

    run = run_for_budget(settings, PROBE_STEPS, one_step, model, log,
                         lambda step, seconds, running: _evaluate(model, tokenizer, s, device, step, seconds, running),
                         _describe)
    model.set_dense(False)
    model.eval()
    return TrainResult(model, run.settings, run.steps_run, run.seconds, run.hit_time_limit, run.curve)


S = TypeVar("S", bound="BudgetedSettings")


class BudgetedSettings(Protocol):
    """What :func:`run_for_budget` reads of a trainer's settings."""

    steps: int | None
    time_budget: float
    time_limit: float | None
    eval_every: int


@dataclass
class BudgetedRun(Generic[S]):
    """How a :func:`run_for_budget` ended: its settings with the step count it chose, and its curve."""

    settings: S
    steps_run: int
    seconds: float
    hit_time_limit: bool
    curve: list[dict]


def run_for_budget(settings: S, probe_steps: int, one_step: Callable[[S, int, int | None], dict[str, torch.Tensor]],
                   module: torch.nn.Module, log: Callable[[str], None],
                   evaluate: Callable[[int, float, dict[str, torch.Tensor | int]], dict],
                   describe: Callable[[dict], str]) -> BudgetedRun[S]:
    """The loop both trainers run: ``one_step(settings, step, steps)`` (it returns the metrics to average)
    until ``settings.steps``, or, with it None, as many as fill ``settings.time_budget`` at the speed of the
    first ``probe_steps`` (chosen once and recorded in the result's settings, so ``steps=N`` replays the run:
    nothing before the choice depends on it); a point of the curve every ``eval_every`` steps, at the end and
    where ``time_limit`` stops the run. ``evaluate`` may leave ``module`` in eval mode; it goes back to train."""
    s = settings
    curve: list[dict] = []
    running: dict[str, torch.Tensor | int] = {}     # each metric's sum since the last point, and their count n
    started = time.perf_counter()
    hit_limit, step, steps = False, 0, s.steps
    while steps is None or step < steps:
        if s.time_limit is not None and time.perf_counter() - started > s.time_limit:
            hit_limit = True
            break
        if steps is None and step == probe_steps:
            steps = steps_for_budget(s, step, time.perf_counter() - started)
            s = dataclasses.replace(s, steps=steps)
            log(f"step {step}: {(time.perf_counter() - started) / step:.3f} s a step, {steps} steps fill "
                f"the {s.time_budget:.0f} s budget")
        record = one_step(s, step, steps)
        for name, value in record.items():
            running[name] = running.get(name, 0.0) + value.detach()
        running["n"] = running.get("n", 0) + 1
        step += 1
        if step % s.eval_every == 0 or step == steps:
            curve.append(evaluate(step, time.perf_counter() - started, running))
            running = {}
            log(describe(curve[-1]))
            module.train()
    seconds = time.perf_counter() - started
    if hit_limit and (not curve or curve[-1]["step"] != step):
        curve.append(evaluate(step, seconds, running))
        log(describe(curve[-1]))
    return BudgetedRun(dataclasses.replace(s, steps=steps if steps is not None else step), step, seconds, hit_limit,
                       curve)


def adamw(module: torch.nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW with weight decay on the matrices only (not on norms, biases or the hyper-connection parameters)."""
    decay = [p for n, p in module.named_parameters() if p.ndim >= 2 and "hc" not in n]
    other = [p for n, p in module.named_parameters() if not (p.ndim >= 2 and "hc" not in n)]
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                              {"params": other, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95))


def optimizer_step(optimizer: torch.optim.Optimizer, module: torch.nn.Module, loss: torch.Tensor, lr: float) -> None:
    """One step at ``lr``, gradients clipped to norm 1."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
    optimizer.step()


def steps_for_budget(s: BudgetedSettings, done: int, elapsed: float) -> int:
    """Steps that fill ``s.time_budget`` at the speed of the first ``done`` (evaluations take ~5 % more)."""
    per_step = elapsed / done
    return done + max(1, int((s.time_budget - elapsed) / (per_step * 1.08)))


def prefetched(build: Callable[[], T]) -> Iterator[T]:
    """``build()``'s batches made on a worker thread one step ahead (the tokenizer's work hides behind the
    GPU's)."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="organism-data") as pool:
        pending = pool.submit(build)
        while True:
            batch = pending.result()
            pending = pool.submit(build)
            yield batch


def _evaluate(model: TrainableModel, tokenizer, s: TrainSettings, device: torch.device, step: int, seconds: float,
              running: dict[str, torch.Tensor | int]) -> dict:
    """Mean losses since the last point and teacher-forced recall on held-out needles."""
    model.eval()
    n = max(1.0, float(running.get("n", 1.0)))
    recall = recall_by_length(model, tokenizer, s.eval_lengths, s.eval_trials, s.seed + 7919, device)
    return {"step": step, "seconds": round(seconds, 1),
            **{k: round(float(v) / n, 4) for k, v in running.items() if k != "n"},
            "recall": {str(k): v for k, v in recall.items()}}


def _describe(point: dict) -> str:
    recall = " ".join(f"{k}:{100 * v:.0f}%" for k, v in point["recall"].items())
    return (f"step {point['step']:5d} {point['seconds']:7.1f}s loss {point.get('loss', float('nan')):.3f} "
            f"lm {point.get('lm', float('nan')):.3f} mtp {point.get('mtp', float('nan')):.3f} "
            f"kl {point.get('indexer_kl', float('nan')):.3f} aids {point.get('attention_aid', float('nan')):.2f}/"
            f"{point.get('indexer_aid', float('nan')):.2f} answer ce {point.get('answer_ce', float('nan')):.2f} "
            f"acc {100 * point.get('answer_token_accuracy', float('nan')):.0f}% | recall {recall}")
