"""Expected time of long work on this device, said before the work starts (compare, automix, calibrate).

The cost model counts the work as the engines run it: *layer tokens* (tokens through one decoder layer, summed
over every pass: each token's linears, its top-k routed experts only, and attention over its context) and
output-head positions, in FLOPs; the device's rate is a GEMM of the model's width timed here (a fraction of a
second). On a small model per-call overheads make that a floor, so the line says so, and once the first block
has run, its measured seconds per FLOP replace the GEMM's (:meth:`Eta.refine`). Nothing is refused: the line
only tells a user on a CPU what they are in for.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass
from typing import TextIO

import torch
from tqdm import tqdm

from dsv4convert.models.deepseek_v4.layout import ModelConfig, linear_shapes


@dataclass(frozen=True)
class Work:
    """What a command will run: ``layer_tokens`` tokens through one decoder layer (summed over passes), each
    attending over about ``context`` earlier tokens, and ``head_positions`` output-head evaluations."""

    layer_tokens: float
    head_positions: float
    context: int
    block_tokens: float      # the first block's share of the layer tokens (its time refines the estimate)


def layer_flops_per_token(cfg: ModelConfig, context: int) -> float:
    """FLOPs of one token through an average decoder layer: every dense linear, ``num_experts_per_tok`` of the
    routed experts, attention over the sliding window and the compressed pool, the indexer's scores."""
    blocks: dict[str, float] = {}
    for module, (n, k) in linear_shapes(cfg).items():
        if not module.startswith("layers."):
            continue
        block = ".".join(module.split(".")[:2])
        share = cfg.num_experts_per_tok / cfg.n_routed_experts if ".ffn.experts." in module else 1.0
        blocks[block] = blocks.get(block, 0.0) + 2.0 * n * k * share
    linears = sum(blocks.values()) / max(len(blocks), 1)
    pool = context / 4
    attention = 4.0 * cfg.num_attention_heads * cfg.head_dim * (min(context, 128) + pool)
    indexer = 2.0 * cfg.index_n_heads * cfg.index_head_dim * pool
    return linears + attention + indexer


def flops(cfg: ModelConfig, work: Work) -> float:
    return work.layer_tokens * layer_flops_per_token(cfg, work.context) + \
        work.head_positions * 2.0 * cfg.vocab_size * cfg.hidden_size


def gemm_rate(device: torch.device, dtype: torch.dtype, width: int) -> float:
    """FLOP/s of a [512, width] x [width, width] GEMM on ``device`` (width clamped to 256..4096), timed over
    about 50 ms after one warm-up."""
    w = min(max(width, 256), 4096)
    a = torch.randn(512, w, device=device).to(dtype)
    b = torch.randn(w, w, device=device).to(dtype)
    a @ b
    _sync(device)
    runs, t0 = 0, time.perf_counter()
    while runs < 200 and (time.perf_counter() - t0 < 0.05 or runs < 2):
        a @ b
        _sync(device)
        runs += 1
    return 2.0 * 512 * w * w * runs / max(time.perf_counter() - t0, 1e-9)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_words(device: torch.device) -> str:
    """``cpu, 2 threads`` or ``cuda:0, NVIDIA H200``: the device the estimate is for."""
    if device.type == "cuda":
        return f"{device}, {torch.cuda.get_device_name(device)}"
    return f"cpu, {torch.get_num_threads()} threads"


def duration(seconds: float) -> str:
    """``~40 s``, ``~12 min``, ``~2.5 h``."""
    if seconds < 90:
        return f"~{max(1, round(seconds))} s"
    if seconds < 90 * 60:
        return f"~{round(seconds / 60)} min"
    return f"~{seconds / 3600:.1f} h"


class Eta:
    """The expected-time line of one command, and its refinement once the first block is measured."""

    def __init__(self, command: str, cfg: ModelConfig, work: Work, device: torch.device, dtype: torch.dtype,
                 rate: float | None = None):
        self.command, self.cfg, self.work, self.device = command, cfg, work, device
        self.flops = flops(cfg, work)
        self.rate = rate if rate is not None else gemm_rate(device, dtype, cfg.hidden_size)
        self.refined = False

    @property
    def seconds(self) -> float:
        return self.flops / self.rate

    def line(self, what: str) -> str:
        return (f"{self.command}: expected {duration(self.seconds)} on this device ({device_words(self.device)}) "
                f"for {what}: {self.flops / 1e9:.3g} GFLOP at a measured {self.rate / 1e9:.3g} GFLOP/s, a floor "
                "where per-call overheads dominate (small models); the first block refines it")

    def announce(self, what: str, file: TextIO | None = None) -> None:
        print(self.line(what), file=file or sys.stderr, flush=True)

    def refine(self, seconds: float, file: TextIO | None = None) -> float | None:
        """After the first block (its share of the layer tokens took ``seconds``): the whole at the measured rate,
        printed once (through tqdm, under any bar); returns the seconds."""
        done = self.work.block_tokens * layer_flops_per_token(self.cfg, self.work.context)
        if self.refined or done <= 0 or seconds <= 0 or not math.isfinite(seconds):
            return None
        self.refined = True
        total = self.flops * seconds / done
        tqdm.write(f"{self.command}: the first block took {seconds:.1f} s: expected {duration(total)} in all on "
                   f"this device, {duration(max(total - seconds, 0.0))} more", file=file or sys.stderr)
        return total
