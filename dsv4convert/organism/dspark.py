"""The organism drafts with DSpark: a three-stage drafter trained on the frozen organism, in 0731's layout.

The backbone is the shipped organism as released (every weight dequantized from the checkpoint, frozen): the
drafter learns from the features the released model computes. Its shape is 0731's in miniature
(:func:`dspark_organism_config`): three stages drafting from the organism's last three layers (1, 2, 3: 0731
drafts from its last three, 40-42 of 43; the organism has four layers, and layer 0 is the only one left out),
blocks of 5 (0731's ``dspark_block_size``), a Markov head of rank 64 (``configs.with_dspark``'s choice for a small
model, a quarter of the hidden size; 0731's is 256 over a 129,280-token vocabulary), and ``<think>`` as the
noise (mask) token: a real token of the organism's vocabulary that its data never contain (its prompts close
the turn with ``</think>`` only, thinking off), so the mask means nothing else to the target, like 0731's
reserved id 128799.

The objective, on the organism's own data (needle prompts and its language, :class:`~.train.Data`), every
step on a fresh batch run through the frozen backbone (features at the target layers, the target's logits):

* distillation: the cross-entropy of each block row's Markov-corrected logits against the target's own
  next-token distribution at that position (what greedy verification accepts is the target's argmax, not the
  text's next token), row ``j`` of the block anchored at ``p`` conditioned on the token at ``p + j`` (teacher
  forcing the Markov head's input);
* the confidence head's binary cross-entropy against whether the greedy draft (drafted as SGLang drafts: each
  row on the previous *draft*) equals the target's greedy token there. Its inputs are detached: the head is a
  probe of the drafter's state and never trades draft quality for calibration.

Anchors are a seeded sample of every position with a full block after it (and at least one context row before
it). Deterministic for a seed: a replay with the recorded step count writes the same bytes (on a CPU, and on the
H200 the shipped drafter was trained on).

The objective, the loop (:func:`train_on_target`) and the measurements (:func:`measure`) are release-independent:
V4.1's drafter (``organism/dspark_v41.py``) trains by them too. What a release brings is a target (:class:`DraftTarget`:
features, logits, the shared embedding and ``lm_head``; V4's is :class:`Target`) and a fresh drafter (V4's
:class:`~dsv4convert.model.dspark.DSparkDrafter`, V4.1's :class:`~dsv4convert.model.v41.dspark.V41Drafter`: one API,
``probe_confidence`` on their heads included).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

from dsv4convert.errors import DSV4Error
from dsv4convert.models.deepseek_v4.configs import with_dspark, with_num_layers
from dsv4convert.models.deepseek_v4.layout import ModelConfig
from dsv4convert.model.dspark import Blocks, DSparkDrafter, FeatureCapture, acceptance, anchor_grid
from dsv4convert.model.trainable import TrainableModel
from dsv4convert.model.v41.dspark import V41Drafter
from dsv4convert.needle import answer_ids, build_prompt, make_needle
from dsv4convert.organism.train import (
    Data,
    TokenizerAdapter,
    TrainSettings,
    adamw,
    lr_at,
    optimizer_step,
    prefetched,
    run_for_budget,
)

NOISE_TOKEN = "<think>"
STAGES, BLOCK_SIZE, MARKOV_RANK = 3, 5, 64
PROBE_STEPS = 20                  # steps timed before an automatic step count is chosen
HELDOUT_LENGTH, FIRST_ANCHOR = 320, 32   # held-out rows; the first anchor scored has a full window before it


def dspark_organism_config(base_config: dict, tokenizer) -> dict:
    """The organism's config.json with its DSpark drafter in place of the MTP block (0731's layout)."""
    n = ModelConfig.from_dict(base_config).num_hidden_layers
    noise = tokenizer.token_to_id(NOISE_TOKEN)
    if noise is None:
        raise DSV4Error(f"the organism's tokenizer has no {NOISE_TOKEN} token")
    return with_dspark(with_num_layers(base_config, n, mtp=False), stages=STAGES, block_size=BLOCK_SIZE,
                       markov_rank=MARKOV_RANK, noise_token_id=int(noise))


@dataclass
class DraftSettings:
    """Everything that decides a drafter run (recorded in the provenance)."""

    steps: int | None = None          # None: as many as fill ``time_budget`` at the speed of the first steps
    time_budget: float = 180.0
    tokens_per_step: int = 16384
    min_length: int = 64
    max_length: int = 640
    needle_fraction: float = 0.5
    anchor_fraction: float = 0.5      # of the positions that can anchor a full block
    lr: float = 3e-3
    min_lr_fraction: float = 0.1
    warmup_steps: int = 30
    weight_decay: float = 0.01
    initializer_range: float = 0.0625  # the organism's
    confidence_weight: float = 1.0
    eval_every: int = 100
    eval_sequences: int = 4           # held-out and needle rows the curve measures (0: none)
    seed: int = 0
    time_limit: float | None = None


Drafter = DSparkDrafter | V41Drafter


@dataclass
class DraftResult:
    drafter: Drafter
    settings: DraftSettings
    steps_run: int
    seconds: float
    hit_time_limit: bool
    curve: list[dict] = field(default_factory=list)


class DraftTarget(Protocol):
    """A frozen target as the trainer and the measurements read it (one per release)."""

    embed: torch.Tensor       # [V, H] the target's embedding and lm_head, which the drafter shares
    lm_head: torch.Tensor

    def __call__(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(features at the drafter's target layers ``[B, S, H * stages]``, logits ``[B, S, V]``), no gradient."""

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        """The logits alone ``[B, S, V]``, no gradient."""


class Target:
    """The frozen V4 organism: features at the drafter's target layers and the logits, for a batch."""

    def __init__(self, model: TrainableModel, config: dict):
        self.model = model.eval().requires_grad_(False)
        self.d = ModelConfig.from_dict(config).dspark
        self.embed = model.backbone.model.embed_tokens.weight
        self.lm_head = model.backbone.lm_head.weight

    @torch.no_grad()
    def __call__(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(features ``[B, S, H * 3]``, logits ``[B, S, V]``)."""
        with FeatureCapture(self.model.backbone.model.layers, self.d.target_layer_ids) as capture:
            logits = self.model(ids, mtp=False).logits
        return capture.features(), logits

    @torch.no_grad()
    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(ids, mtp=False).logits


def sample_anchors(ids: torch.Tensor, block_size: int, fraction: float, generator: torch.Generator) -> torch.Tensor:
    """A seeded ``fraction`` of the anchors ``1 .. S - 1 - block_size`` of every row (each with a context row
    before it and the target's prediction for every block row): ``[M, 2]``."""
    grid = anchor_grid(ids.shape[0], ids.shape[1], first=1, last=ids.shape[1] - 1 - block_size)
    keep = torch.rand(grid.shape[0], generator=generator) < fraction
    return grid[keep].to(ids.device)


def drafter_losses(drafter: Drafter, target: DraftTarget, ids: torch.Tensor, anchors: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """(distillation cross-entropy, confidence BCE, metrics) of one batch."""
    features, logits = target(ids)
    d = drafter.d
    blocks = Blocks.make(ids, anchors, block_size=d.block_size, noise_token_id=d.noise_token_id,
                         window=drafter.window)
    prev, _ = blocks.gather(ids, 0)
    wanted = logits[blocks.seq[:, None], blocks.positions].float()        # [M, G, V]: row j predicts p + j + 1
    greedy = wanted.argmax(-1)
    out = drafter(features, blocks, target.embed, target.lm_head, teacher_prev=prev, keep_draft_logits=False)
    ce = -(wanted.softmax(-1) * out.teacher_logits.log_softmax(-1)).sum(-1).mean()
    raw = drafter.head.probe_confidence(out.x_post_hc, out.draft_prev).float()
    agree = (out.draft_tokens == greedy).float()
    bce = F.binary_cross_entropy_with_logits(raw, agree)
    metrics = {"ce": ce.detach(), "bce": bce.detach(),
               "teacher_agreement": (out.teacher_logits.argmax(-1) == greedy).float().mean(),
               "agreement": agree.mean(0), "accepted": agree.cumprod(-1).mean(0)}
    return ce, bce, metrics


@contextmanager
def deterministic_on_cpu(device: torch.device) -> Iterator[None]:
    """On a CPU, torch's deterministic algorithms while the block lasts: the backward of each block's gather of
    its context window (``index_put`` with accumulation: context rows are shared by many blocks) otherwise adds
    across threads in no fixed order. CUDA's already sorts its indices; its kernels are left as they are."""
    if device.type != "cpu" or torch.are_deterministic_algorithms_enabled():
        yield
        return
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = False     # a cost only: no kernel here reads one
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)
        torch.utils.deterministic.fill_uninitialized_memory = fill


def train_drafter(target_model: TrainableModel, config: dict, tokenizer, text: str, settings: DraftSettings, *,
                  device: torch.device, log: Callable[[str], None] = print) -> DraftResult:
    """Train the DSpark drafter of ``config`` on the frozen V4 ``target_model``; returns it in eval mode. ``text``
    is held-out text (the curve's acceptance is measured on it).

    With ``settings.steps`` None the step count is chosen once, after ``PROBE_STEPS`` steps, to fill
    ``settings.time_budget``; the result's settings record it, and ``steps=N`` replays the run bit for bit (on
    a CPU, and on the H200 as measured: bench/results/organism-dspark-h200.md)."""
    def new_drafter() -> DSparkDrafter:
        drafter = DSparkDrafter(config, initializer_range=settings.initializer_range)
        drafter.init_weights(target_model.backbone._init_weights)
        return drafter

    return train_on_target(Target(target_model.to(device), config), new_drafter, tokenizer, text, settings,
                           bos_id=ModelConfig.from_dict(config).bos_token_id, device=device, log=log)


def train_on_target(target: DraftTarget, new_drafter: Callable[[], Drafter], tokenizer, text: str,
                    settings: DraftSettings, *, bos_id: int, device: torch.device, docs: Sequence[str] | None = None,
                    log: Callable[[str], None] = print) -> DraftResult:
    """Train the drafter ``new_drafter()`` makes (called once, after ``torch.manual_seed(settings.seed)``) on the
    frozen ``target``, on the organism's data (``Data``: needles and the language, its ``docs`` if given); returns
    it in eval mode. Any release's drafter: :func:`train_drafter` is V4's."""
    with deterministic_on_cpu(device):
        return _train(target, new_drafter, tokenizer, text, settings, bos_id, docs, device, log)


def _train(target: DraftTarget, new_drafter: Callable[[], Drafter], tokenizer, text: str, settings: DraftSettings,
           bos_id: int, docs: Sequence[str] | None, device: torch.device, log: Callable[[str], None]) -> DraftResult:
    s = settings
    torch.manual_seed(s.seed)
    drafter = new_drafter()
    drafter.to(device).train()
    d = drafter.d
    data = Data(tokenizer, TrainSettings(seed=s.seed, tokens_per_step=s.tokens_per_step, min_length=s.min_length,
                                         max_length=s.max_length, needle_fraction=s.needle_fraction),
                bos_id=bos_id, docs=docs)
    generator = torch.Generator().manual_seed(s.seed + 17)
    optimizer = adamw(drafter, s.lr, s.weight_decay)
    held = heldout_sets(tokenizer, text, sequences=s.eval_sequences, seed=s.seed) if s.eval_sequences else {}
    batches = prefetched(lambda: data.batch()[0])

    def one_step(s: DraftSettings, step: int, steps: int | None) -> dict[str, torch.Tensor]:
        ids = next(batches)
        if bool((ids == d.noise_token_id).any()):
            raise DSV4Error(f"the training data contain the noise token {d.noise_token_id}")
        ids = ids.to(device)
        anchors = sample_anchors(ids, d.block_size, s.anchor_fraction, generator)
        ce, bce, metrics = drafter_losses(drafter, target, ids, anchors)
        loss = ce + s.confidence_weight * bce
        optimizer_step(optimizer, drafter, loss, lr_at(step, s, steps))
        return {"loss": loss, **metrics}

    run = run_for_budget(settings, PROBE_STEPS, one_step, drafter, log,
                         lambda step, seconds, running: _point(drafter, target, held, step, seconds, running), _describe)
    drafter.eval()
    return DraftResult(drafter, run.settings, run.steps_run, run.seconds, run.hit_time_limit, run.curve)


# -- held-out acceptance --------------------------------------------------------------------------


def heldout_rows(tokenizer, text: str, sequences: int, length: int = HELDOUT_LENGTH) -> torch.Tensor:
    """The first ``sequences`` rows of ``length`` tokens of held-out ``text`` (the organism's ``heldout.txt``,
    which no training step saw and ``compare`` scores on): ``[sequences, length]``."""
    ids = torch.tensor(TokenizerAdapter(tokenizer).encode(text), dtype=torch.int64)
    if ids.numel() < sequences * length:
        raise DSV4Error(f"the held-out text has {ids.numel()} tokens, fewer than {sequences} rows of {length}")
    return ids[: sequences * length].view(sequences, length)


def needle_rows(tokenizer, sequences: int, seed: int, length: int = HELDOUT_LENGTH) -> torch.Tensor:
    """Fresh needle prompts with their answers, past the 260-token selection threshold, depths spread."""
    adapter, rng = TokenizerAdapter(tokenizer), random.Random(seed + 4093)
    rows = []
    for i in range(sequences):
        needle = make_needle(rng)
        prompt = build_prompt(adapter, length - 7, (i + 0.5) / sequences, needle)
        rows.append((prompt.input_ids + answer_ids(adapter, needle))[:length])
    return torch.tensor(rows, dtype=torch.int64)


def heldout_sets(tokenizer, text: str, *, sequences: int, seed: int) -> dict[str, torch.Tensor]:
    return {"heldout": heldout_rows(tokenizer, text, sequences), "needle": needle_rows(tokenizer, sequences, seed)}


@torch.no_grad()
def greedy_continuation(target: DraftTarget, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """The target's own greedy continuation of ``prompts`` (full forwards, no cache): on such a sequence a
    draft checked against the target's top-1 is exactly what greedy verification accepts."""
    ids = prompts
    for _ in range(new_tokens):
        logits = target.logits(ids)[:, -1]
        ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
    return ids


@torch.no_grad()
def draft_acceptance(drafter: Drafter, target: DraftTarget, ids: torch.Tensor, first: int = FIRST_ANCHOR, *,
                     chunk: int = 4096) -> dict:
    """Every block anchored at ``first .. S - block`` of ``ids`` (teacher-forced: each drafts from the
    sequence's own prefix): per draft position the agreement with the target's greedy token and the
    acceptance, the expected accepted length, the mean confidence."""
    device = drafter.head.norm.weight.device
    ids = ids.to(device)
    features, logits = target(ids)
    d = drafter.d
    blocks = Blocks.make(ids, anchor_grid(ids.shape[0], ids.shape[1], first=first,
                                          last=ids.shape[1] - d.block_size),
                         block_size=d.block_size, noise_token_id=d.noise_token_id, window=drafter.window)
    out = drafter(features, blocks, target.embed, target.lm_head, keep_draft_logits=False, chunk=chunk)
    greedy, valid = blocks.gather(logits.argmax(-1), 0)
    stats = acceptance(out.draft_tokens, greedy, valid).as_dict()
    stats["confidence"] = out.confidence[valid.all(-1)].mean(0).tolist()
    return stats


@dataclass(frozen=True)
class MeasureSettings:
    """What the provenance's acceptance is measured on (recorded with it, so a test recomputes it)."""

    heldout_sequences: int = 4        # rows of HELDOUT_LENGTH tokens of heldout.txt (the CPU recomputes these)
    needle_sequences: int = 16
    greedy_prompts: int = 16          # prompts from heldout.txt past the rows above, continued greedily
    greedy_prompt_tokens: int = 96
    greedy_new_tokens: int = 96
    seed: int = 0


def measure(drafter: Drafter, target: DraftTarget, tokenizer, text: str, m: MeasureSettings) -> dict:
    """Per draft position on held-out text, on fresh needle prompts (both teacher-forced), and exactly on the
    target's own greedy continuations of held-out prompts."""
    device = drafter.head.norm.weight.device
    rows = heldout_rows(tokenizer, text, m.heldout_sequences + m.greedy_prompts)
    out = {"heldout": draft_acceptance(drafter, target, rows[: m.heldout_sequences]),
           "needle": draft_acceptance(drafter, target, needle_rows(tokenizer, m.needle_sequences, m.seed))}
    if m.greedy_prompts:
        prompts = rows[m.heldout_sequences:, : m.greedy_prompt_tokens].to(device)
        out["greedy"] = draft_acceptance(drafter, target, greedy_continuation(target, prompts, m.greedy_new_tokens),
                                         m.greedy_prompt_tokens)
    return out


def _point(drafter, target, held, step, seconds, running) -> dict:
    drafter.eval()
    n = max(1.0, float(running.get("n", 1.0)))
    point = {"step": step, "seconds": round(seconds, 1)}
    for name, value in running.items():
        if name != "n":
            value = value / n
            point[name] = [round(float(v), 4) for v in value] if value.ndim else round(float(value), 4)
    point["heldout"] = {name: draft_acceptance(drafter, target, ids)["accepted"] for name, ids in held.items()}
    return point


def _describe(point: dict) -> str:
    held = "  ".join(f"{k} " + "/".join(f"{100 * v:.0f}" for v in acc) for k, acc in point["heldout"].items())
    return (f"step {point['step']:5d} {point['seconds']:7.1f}s ce {point.get('ce', float('nan')):.3f} "
            f"bce {point.get('bce', float('nan')):.3f} teacher agreement "
            f"{100 * point.get('teacher_agreement', 0):.0f}% | held-out accepted per position (%): {held}")


def describe_acceptance(measured: dict) -> list[str]:
    lines = []
    for name, stats in measured.items():
        lines.append(f"  {name:8s} agreement " + " ".join(f"{100 * v:5.1f}%" for v in stats["agreement"])
                     + "  | accepted " + " ".join(f"{100 * v:5.1f}%" for v in stats["accepted"])
                     + f"  | expected accepted length {stats['expected_accept_length']:.2f} of "
                     f"{len(stats['accepted'])} ({stats['blocks']} blocks)")
    return lines
