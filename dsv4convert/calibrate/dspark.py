"""Calibrating a DSpark drafter (V4-Flash-0731's ``mtp.*``) under the drafting forward SGLang 0.5.23 runs.

The forward is :mod:`dsv4convert.model.dspark`'s (its docstring cites SGLang rule by rule); here it is streamed
like the backbone, one stage per block of the resumable loop:

* **Target features.** While the backbone streams, the rank that runs a micro-batch through a layer named in
  ``dspark_target_layer_ids`` keeps :func:`stream_mean` of its output streams in a memory-mapped state file
  (``states/features/layers.i/``), committed before the layer counts as done: a resumed run finds them.
* **Anchors.** Every committed position ``1 .. S - 1`` of every sequence (:func:`draft_blocks`), stride 1: in
  serving any committed position becomes an anchor (the bonus token of whichever verify step ended there), so
  every one is part of the distribution the stages' experts see; position 0 is not, as SGLang drafts only after
  a prefill of at least one token, and the last is ``S - 1``, the last position with a target feature. Blocks
  reach past the sequence end as served blocks do (their rows need no label here). A stage therefore routes
  ``dspark_block_size`` times a backbone layer's tokens, its attention only ``window + block`` keys long.
* **Stages**, in order: stage 0's input is :func:`embed_blocks` of the anchor blocks, every stage's context KV
  :func:`context_kv` of that stage's layer on ``main_x = DSparkEntry(features)``, and :func:`run_stage` runs
  with the block's :class:`~dsv4convert.calibrate.stats.ExpertRecorder` on the stage's experts; a stage's
  outputs ``[blocks, block_size, hc_mult, hidden]`` are the next stage's input state files.
"""

from __future__ import annotations

import torch
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4DecoderLayer, DeepseekV4RotaryEmbedding

from dsv4convert.models.deepseek_v4.layout import DSparkConfig
from dsv4convert.model.dspark import Blocks, DSparkEntry, anchor_grid, context_kv, embed_blocks, run_stage, stream_mean

FIRST_ANCHOR = 1        # SGLang drafts after a prefill of at least one token


def draft_blocks(ids: torch.Tensor, d: DSparkConfig, window: int) -> Blocks:
    """The blocks calibration drafts for sequences ``ids [B, S]``: anchors at every position ``1 .. S - 1``."""
    anchors = anchor_grid(ids.shape[0], ids.shape[1], first=FIRST_ANCHOR, device=ids.device)
    return Blocks.make(ids, anchors, block_size=d.block_size, noise_token_id=d.noise_token_id, window=window)


def blocks_per_sequence(seq_len: int) -> int:
    return max(0, seq_len - FIRST_ANCHOR)


def stage_chunk(rows: int, seq_len: int, block_size: int) -> int:
    """Blocks per stage forward: about the tokens of one backbone forward of the micro-batch (the rows through
    the experts at once), whatever the number of anchors."""
    return max(1, rows * seq_len // block_size)


@torch.no_grad()
def run_draft_stage(layer: DeepseekV4DecoderLayer, entry: DSparkEntry, features: torch.Tensor, blocks: Blocks,
                    streams: torch.Tensor | None, embed: torch.Tensor | None, hc_mult: int,
                    rotary: DeepseekV4RotaryEmbedding, chunk: int) -> torch.Tensor:
    """One stage over one micro-batch's blocks: ``features [B, S, H * T]`` of its sequences, ``streams`` the
    previous stage's outputs ``[M, G, hc, H]`` (None for stage 0, whose input is ``embed_blocks`` of ``embed``)."""
    if streams is None:
        streams = embed_blocks(blocks, embed, hc_mult)
    kv = context_kv(layer, entry(features), rotary)
    return run_stage(layer, streams, kv, blocks, rotary, chunk=chunk)


def feature_slice(streams: torch.Tensor) -> torch.Tensor:
    """A target layer's part of the features, ``[B, S, 1, H]`` as the state files hold it."""
    return stream_mean(streams).unsqueeze(2)
