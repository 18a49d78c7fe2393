"""The organism drafts with DSpark: a three-stage drafter trained on the frozen organism, in 0731's layout.

The backbone is the shipped organism as released (every weight dequantized from the checkpoint, frozen): the
drafter learns from the features the released model computes. Its shape is 0731's in miniature
(:func:`dspark_organism_config`): three stages drafting from the organism's last three layers (1, 2, 3: 0731
drafts from its last three, 40-42 of 43; the organism has four layers, and layer 0 is the only one left out),
blocks of 5 (0731's ``dspark_block_size``), a Markov head of rank 64 (``synth.with_dspark``'s choice for a small
model, a quarter of the hidden size; 0731's is 256 over a 129,280-token vocabulary), and ``<think>`` as the
noise (mask) token: a real token of the organism's vocabulary that its data never contain (its prompts close the turn with
``</think>`` only, thinking off), so the mask means nothing else to the target, like 0731's reserved id 128799.

The objective, on the organism's own data (needle prompts and its language, :class:`~.train.Data`), every
step on a fresh batch run through the frozen backbone (features at the target layers, the target's top-1):

* cross-entropy of each block row's Markov-corrected logits, conditioned on the true previous token (teacher
  forcing: row ``j`` of the block anchored at ``p`` on the token at ``p + j``), against the true next token;
* the confidence head's binary cross-entropy against whether the greedy draft (drafted as SGLang drafts: each
  row on the previous *draft*) equals the target's greedy token there. Its inputs are detached: the head is a
  probe of the drafter's state and never trades draft quality for calibration.

Anchors are a seeded sample of every position with a full block of labels after it (and at least one context
row before it). Deterministic for a seed on a CPU; on a GPU up to the order of floating-point atomics.
"""

from __future__ import annotations

import dataclasses
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from dsv4convert.errors import DSV4Error
from dsv4convert.layout import ModelConfig
from dsv4convert.model.dspark import Blocks, DSparkDrafter, FeatureCapture, acceptance, anchor_grid
from dsv4convert.model.trainable import TrainableModel
from dsv4convert.needle import answer_ids, build_prompt, make_needle
from dsv4convert.organism.language import heldout_text
from dsv4convert.organism.train import Data, TokenizerAdapter, TrainSettings
from dsv4convert.synth import with_dspark, with_num_layers

NOISE_TOKEN = "<think>"
STAGES, BLOCK_SIZE, MARKOV_RANK = 3, 5, 64
PROBE_STEPS = 20


def dspark_organism_config(base_config: dict, tokenizer) -> dict:
    """The organism's config.json with its DSpark drafter in place of the MTP block (0731's layout)."""
    n = int(base_config["num_hidden_layers"])
    config = with_dspark(with_num_layers(base_config, n, mtp=False), stages=STAGES, block_size=BLOCK_SIZE,
                         markov_rank=MARKOV_RANK)
    noise = tokenizer.token_to_id(NOISE_TOKEN)
    if noise is None:
        raise DSV4Error(f"the organism's tokenizer has no {NOISE_TOKEN} token")
    config["dspark_noise_token_id"] = int(noise)
    return config


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
    eval_sequences: int = 8
    seed: int = 0
    time_limit: float | None = None


@dataclass
class DraftResult:
    drafter: DSparkDrafter
    settings: DraftSettings
    steps_run: int
    seconds: float
    hit_time_limit: bool
    curve: list[dict] = field(default_factory=list)


def lr_at(step: int, s: DraftSettings, steps: int | None) -> float:
    if step < s.warmup_steps:
        return s.lr * (step + 1) / s.warmup_steps
    if steps is None:
        return s.lr
    progress = (step - s.warmup_steps) / max(1, steps - s.warmup_steps)
    return s.lr * (s.min_lr_fraction + (1 - s.min_lr_fraction) * 0.5 * (1 + math.cos(math.pi * progress)))


class Target:
    """The frozen organism: features at the drafter's target layers and the greedy tokens, for a batch."""

    def __init__(self, model: TrainableModel, config: dict):
        self.model = model.eval().requires_grad_(False)
        self.d = ModelConfig.from_dict(config).dspark
        self.embed = model.backbone.model.embed_tokens.weight
        self.lm_head = model.backbone.lm_head.weight

    @torch.no_grad()
    def __call__(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(features ``[B, S, H * 3]``, the target's top-1 ``[B, S]``)."""
        with FeatureCapture(self.model.backbone.model.layers, self.d.target_layer_ids) as capture:
            logits = self.model(ids, mtp=False).logits
        return capture.features(), logits.argmax(-1)


def sample_anchors(ids: torch.Tensor, block_size: int, fraction: float, generator: torch.Generator) -> torch.Tensor:
    """A seeded ``fraction`` of the anchors ``1 .. S - 1 - block_size`` of every row (each with a context row
    before it and a label for every block row): ``[M, 2]``."""
    grid = anchor_grid(ids.shape[0], ids.shape[1], first=1, last=ids.shape[1] - 1 - block_size)
    keep = torch.rand(grid.shape[0], generator=generator) < fraction
    return grid[keep].to(ids.device)


def drafter_losses(drafter: DSparkDrafter, target: Target, ids: torch.Tensor, anchors: torch.Tensor
                   ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(cross-entropy, other terms and metrics) of one batch."""
    features, top1 = target(ids)
    d = drafter.d
    blocks = Blocks.make(ids, anchors, block_size=d.block_size, noise_token_id=d.noise_token_id,
                         window=drafter.window)
    labels, _ = blocks.gather(ids, 1)
    prev, _ = blocks.gather(ids, 0)
    greedy, _ = blocks.gather(top1, 0)
    out = drafter(features, blocks, target.embed, target.lm_head, teacher_prev=prev, keep_draft_logits=False)
    ce = F.cross_entropy(out.teacher_logits.flatten(0, 1), labels.flatten())
    features_c = torch.cat([out.x_post_hc.detach(), drafter.head.markov_w1(out.draft_prev).detach()], dim=-1)
    raw = drafter.head.confidence(features_c).squeeze(-1).float()
    accepted_each = (out.draft_tokens == greedy).float()
    bce = F.binary_cross_entropy_with_logits(raw, accepted_each)
    with torch.no_grad():
        metrics = {"ce": ce.detach(), "bce": bce.detach(),
                   "teacher_top1": (out.teacher_logits.argmax(-1) == labels).float().mean(),
                   "agreement": accepted_each.mean(0), "accepted": accepted_each.cumprod(-1).mean(0)}
    return ce, {"bce": bce, **metrics}


def train_drafter(target_model: TrainableModel, config: dict, tokenizer, settings: DraftSettings, *,
                  device: torch.device, log: Callable[[str], None] = print) -> DraftResult:
    """Train the DSpark drafter of ``config`` on the frozen ``target_model``; returns it in eval mode.

    With ``settings.steps`` None the step count is chosen once, after ``PROBE_STEPS`` steps, to fill
    ``settings.time_budget``; the result's settings record it, and ``steps=N`` replays the run."""
    s = settings
    torch.manual_seed(s.seed)
    target = Target(target_model.to(device), config)
    drafter = DSparkDrafter(config, initializer_range=s.initializer_range)
    drafter.init_weights(target_model.backbone._init_weights)
    drafter.to(device).train()
    d = drafter.d
    data = Data(tokenizer, TrainSettings(seed=s.seed, tokens_per_step=s.tokens_per_step, min_length=s.min_length,
                                         max_length=s.max_length, needle_fraction=s.needle_fraction),
                bos_id=int(config.get("bos_token_id", 0)))
    generator = torch.Generator().manual_seed(s.seed + 17)
    decay = [p for n, p in drafter.named_parameters() if p.ndim >= 2 and "hc" not in n]
    other = [p for n, p in drafter.named_parameters() if not (p.ndim >= 2 and "hc" not in n)]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": s.weight_decay},
                                   {"params": other, "weight_decay": 0.0}], lr=s.lr, betas=(0.9, 0.95))
    held = heldout_sets(tokenizer, d.block_size, sequences=s.eval_sequences, seed=s.seed)
    curve: list[dict] = []
    running: dict[str, torch.Tensor] = {}
    started = time.perf_counter()
    hit_limit, step, steps = False, 0, s.steps
    while steps is None or step < steps:
        if s.time_limit is not None and time.perf_counter() - started > s.time_limit:
            hit_limit = True
            break
        if steps is None and step == PROBE_STEPS:
            elapsed = time.perf_counter() - started
            steps = step + max(1, int((s.time_budget - elapsed) / (elapsed / step * 1.05)))
            s = dataclasses.replace(s, steps=steps)
            log(f"step {step}: {elapsed / step:.3f} s a step, {steps} steps fill the {s.time_budget:.0f} s budget")
        ids, _ = data.batch()
        if bool((ids == d.noise_token_id).any()):
            raise DSV4Error(f"the training data contain the noise token {d.noise_token_id}")
        ids = ids.to(device)
        anchors = sample_anchors(ids, d.block_size, s.anchor_fraction, generator)
        ce, terms = drafter_losses(drafter, target, ids, anchors)
        loss = ce + s.confidence_weight * terms["bce"]
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, s, steps)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        optimizer.step()
        for name, value in {"loss": loss.detach(), **terms}.items():
            running[name] = running.get(name, 0.0) + value.detach()
        running["n"] = running.get("n", 0.0) + 1
        step += 1
        if step % s.eval_every == 0 or step == steps:
            curve.append(_point(drafter, target, held, step, time.perf_counter() - started, running))
            running = {}
            log(_describe(curve[-1]))
            drafter.train()
    seconds = time.perf_counter() - started
    if hit_limit and (not curve or curve[-1]["step"] != step):
        curve.append(_point(drafter, target, held, step, seconds, running))
        log(_describe(curve[-1]))
    drafter.eval()
    return DraftResult(drafter, dataclasses.replace(s, steps=steps if steps is not None else step), step, seconds,
                       hit_limit, curve)


# -- held-out acceptance --------------------------------------------------------------------------


def heldout_sets(tokenizer, block_size: int, *, sequences: int = 16, seed: int = 0, length: int = 320
                 ) -> dict[str, tuple[torch.Tensor, int]]:
    """Held-out sequences and the first anchor scored in each: ``language`` (the organism's held-out text,
    ``language.heldout_text``, which no training step saw), ``needle`` (fresh needle prompts with their
    answers, past the 260-token selection threshold). Both teacher-forced: each block drafts from the text's
    own prefix and is checked against the target's greedy tokens on that prefix."""
    adapter = TokenizerAdapter(tokenizer)
    text = torch.tensor(adapter.encode(heldout_text()), dtype=torch.int64)
    if text.numel() < sequences * length:
        raise DSV4Error("the organism's held-out text is shorter than the held-out sequences asked for")
    language = text[: sequences * length].view(sequences, length)
    rng = random.Random(seed + 4093)
    rows = []
    for i in range(sequences):
        needle = make_needle(rng)
        prompt = build_prompt(adapter, length - 7, (i + 0.5) / sequences, needle)
        rows.append((prompt.input_ids + answer_ids(adapter, needle))[:length])
    needles = torch.tensor(rows, dtype=torch.int64)
    return {"language": (language, 32), "needle": (needles, 32)}


@torch.no_grad()
def greedy_continuation(target: Target, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """The target's own greedy continuation of ``prompts`` (full forwards, no cache): on such a sequence a
    draft checked against the target's top-1 is exactly what greedy verification accepts."""
    ids = prompts
    for _ in range(new_tokens):
        logits = target.model(ids, mtp=False).logits[:, -1]
        ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
    return ids


@torch.no_grad()
def draft_acceptance(drafter: DSparkDrafter, target: Target, ids: torch.Tensor, first: int, *,
                     chunk: int = 4096) -> dict:
    """Every block anchored at ``first .. S - block`` of ``ids``: per draft position the agreement and
    acceptance against the target's greedy tokens, the expected accepted length, the mean confidence, and how
    often the teacher-forced drafts (previous true token) predict the text."""
    device = drafter.head.norm.weight.device
    ids = ids.to(device)
    features, top1 = target(ids)
    d = drafter.d
    blocks = Blocks.make(ids, anchor_grid(ids.shape[0], ids.shape[1], first=first,
                                          last=ids.shape[1] - d.block_size),
                         block_size=d.block_size, noise_token_id=d.noise_token_id, window=drafter.window)
    out = drafter(features, blocks, target.embed, target.lm_head, keep_draft_logits=False, chunk=chunk)
    greedy, valid = blocks.gather(top1, 0)
    stats = acceptance(out.draft_tokens, greedy, valid).as_dict()
    stats["confidence"] = out.confidence[valid.all(-1)].mean(0).tolist()
    return stats


def measure(drafter: DSparkDrafter, target: Target, tokenizer, *, sequences: int = 32, seed: int = 0,
            greedy_prompts: int = 16, greedy_prompt_tokens: int = 128, greedy_new_tokens: int = 128) -> dict:
    """Per draft position, on held-out text (teacher-forced) and, exactly, on the target's own greedy
    continuations of held-out prompts."""
    device = drafter.head.norm.weight.device
    out = {name: draft_acceptance(drafter, target, ids, first)
           for name, (ids, first) in heldout_sets(tokenizer, drafter.d.block_size, sequences=sequences,
                                                  seed=seed).items()}
    if greedy_prompts:
        language, _ = heldout_sets(tokenizer, drafter.d.block_size, sequences=sequences, seed=seed)["language"]
        prompts = language[-greedy_prompts:, :greedy_prompt_tokens].to(device)
        ids = greedy_continuation(target, prompts, greedy_new_tokens)
        out["greedy"] = draft_acceptance(drafter, target, ids, greedy_prompt_tokens)
        _, top1 = target(ids)
        out["greedy"]["self_consistent"] = float((top1[:, greedy_prompt_tokens - 1:-1]
                                                  == ids[:, greedy_prompt_tokens:]).float().mean())
    return out


def _point(drafter, target, held, step, seconds, running) -> dict:
    drafter.eval()
    n = max(1.0, float(running.get("n", 1.0)))
    point = {"step": step, "seconds": round(seconds, 1)}
    for name, value in running.items():
        if name == "n":
            continue
        value = value / n
        point[name] = [round(float(v), 4) for v in value] if value.ndim else round(float(value), 4)
    point["heldout"] = {name: draft_acceptance(drafter, target, ids, first)["accepted"]
                        for name, (ids, first) in held.items()}
    return point


def _describe(point: dict) -> str:
    held = "  ".join(f"{k} " + "/".join(f"{100 * v:.0f}" for v in acc) for k, acc in point["heldout"].items())
    return (f"step {point['step']:5d} {point['seconds']:7.1f}s ce {point.get('ce', float('nan')):.3f} "
            f"bce {point.get('bce', float('nan')):.3f} teacher top1 {100 * point.get('teacher_top1', 0):.0f}% | "
            f"held-out accepted per position (%): {held}")


def describe_acceptance(measured: dict) -> list[str]:
    lines = []
    for name, stats in measured.items():
        lines.append(f"  {name:9s} accepted per position " + " ".join(f"{100 * v:5.1f}%" for v in stats["accepted"])
                     + f"  | agreement " + " ".join(f"{100 * v:5.1f}%" for v in stats["agreement"])
                     + f"  | expected accepted length {stats['expected_accept_length']:.2f} of "
                     f"{len(stats['accepted'])} ({stats['blocks']} blocks)")
    return lines
