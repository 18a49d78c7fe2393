"""DeepSeek-V4.1-Flash as a release: what :mod:`dsv4convert.models.registry` asks of it (:mod:`.config`,
:mod:`.inventory`). What the tool does with it so far: plan it (``inspect --expected``), inspect, convert,
validate, size, serve and compare its checkpoints (``compare`` on V4.1 goes its own way, ``compare/v41.py``, before
V4's reader); ``calibrate``, ``automix`` and ``tune`` refuse them, saying so (:func:`not_yet`). What a converter and ``validate`` check of a checkpoint before using it:
its headers against the config (:func:`check_checkpoint`), its tokenizer against the Engram hasher's vocabulary
(:func:`check_tokenizer`)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from dsv4convert.checkpoint.reader import TensorEntry
from dsv4convert.models.deepseek_v4.layout import AttentionReach
from dsv4convert.models.deepseek_v41 import inventory, tokenizer
from dsv4convert.models.deepseek_v41.config import V41Config, is_v41
from dsv4convert.models.deepseek_v41.config import read_config as _read

NAME = "DeepSeek-V4.1-Flash"
# The commands that open a V4.1 checkpoint today.
SERVED = frozenset({"serve", "convert", "validate", "inspect", "compare"})


def not_yet(command: str) -> str | None:
    """Why ``command`` refuses a V4.1 checkpoint (None for the commands that take one)."""
    if command in SERVED:
        return None
    return ("DeepSeek-V4.1-Flash checkpoints are inspected, converted (to-nvfp4, to-fp8, to-bf16, to-w4a16), "
            "validated, sized (fit), served and compared, but not yet calibrated, mixed or tuned by this version of "
            "dsv4convert")


def matches(config: dict) -> bool:
    return is_v41(config)


def read_config(config: dict, source: str) -> V41Config:
    return _read(config, source)


def attention_reach(cfg: V41Config) -> AttentionReach:
    """The window, the backbone's compress ratios (2 and 1: no ratio-4 layer), the fine indexer's top-k, and the
    candidate level's reach: ``candidate_topk_blocks`` blocks of ``candidate_block_size`` tokens chosen once at
    ``candidate_source_layer_id`` (16,384 tokens in the release)."""
    return AttentionReach(cfg.sliding_window, cfg.compress_ratios[:cfg.num_hidden_layers], cfg.index_topk,
                          cfg.candidate_topk_blocks * cfg.candidate_block_size)


def fp8_block(cfg: V41Config) -> tuple[int, int]:
    """The release's ``quantization_config.weight_block_size`` (32 x 32, E8M0 scales)."""
    return cfg.fp8_block


def expected_report(config: dict, source: str) -> dict:
    return inventory.expected_report(read_config(config, source))


def check_checkpoint(cfg: V41Config, tensors: Iterable[TensorEntry]) -> None:
    """A native V4.1 checkpoint's headers against its config (:func:`inventory.check_headers`): Engram rows, 32 x 32
    FP8 scales, every planned dtype and shape."""
    inventory.check_headers(cfg, ((t.name, t.dtype, t.shape, str(t.path)) for t in tensors))


def check_tokenizer(directory: Path, cfg: V41Config) -> int:
    """The compressed vocabulary of the tokenizer beside the weights, checked against the config
    (:func:`tokenizer.check_tokenizer`)."""
    return tokenizer.check_tokenizer(directory, cfg)
