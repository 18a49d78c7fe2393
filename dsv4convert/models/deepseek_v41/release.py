"""DeepSeek-V4.1-Flash as a release: what :mod:`dsv4convert.models.registry` asks of it (:mod:`.config`,
:mod:`.inventory`). What the tool does with it so far: plan it (``inspect --expected``), size it from its config
(``fit --config``), serve it (``serve``); the converters, ``validate``, ``inspect`` and ``compare`` refuse its
checkpoints, saying so (:func:`not_yet`)."""

from __future__ import annotations

from dsv4convert.models.deepseek_v41 import inventory
from dsv4convert.models.deepseek_v41.config import V41Config, is_v41
from dsv4convert.models.deepseek_v41.config import read_config as _read

NAME = "DeepSeek-V4.1-Flash"
SERVED = frozenset({"serve"})   # the commands that open a V4.1 checkpoint today


def not_yet(command: str) -> str | None:
    """Why ``command`` refuses a V4.1 checkpoint (None for the commands that take one)."""
    if command in SERVED:
        return None
    return ("DeepSeek-V4.1-Flash checkpoints are planned (inspect --expected --config config.json), sized from their "
            "config (fit --config config.json) and served (serve), but not yet converted, validated or inspected by "
            "this version of dsv4convert")


def matches(config: dict) -> bool:
    return is_v41(config)


def read_config(config: dict, source: str) -> V41Config:
    return _read(config, source)


def fp8_block(cfg: V41Config) -> tuple[int, int]:
    """The release's ``quantization_config.weight_block_size`` (32 x 32, E8M0 scales)."""
    return cfg.fp8_block


def expected_report(config: dict, source: str) -> dict:
    return inventory.expected_report(read_config(config, source))
