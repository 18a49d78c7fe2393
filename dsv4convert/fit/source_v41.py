"""What ``fit`` sizes for DeepSeek-V4.1-Flash: the native release planned from its ``config.json`` (no weights).

The release is served as it is (no V4.1 variant is converted yet): its tensors are the inventory
``inspect --expected`` plans (:mod:`dsv4convert.models.deepseek_v41.inventory`, 96,085 tensors for the release).
"""

from __future__ import annotations

from dataclasses import dataclass

from dsv4convert.models.deepseek_v4.layout import TensorSpec
from dsv4convert.models.deepseek_v41.config import V41Config, is_v41, read_config
from dsv4convert.models.deepseek_v41.inventory import native_inventory

LABEL = "native"


@dataclass(frozen=True)
class PlannedV41:
    """The native release as planned: its checked config and every tensor."""

    config: V41Config
    tensors: list[TensorSpec]


def is_v41_config(config: object) -> bool:
    return is_v41(config)


def planned(config: dict, source: str) -> PlannedV41:
    """The native checkpoint ``config`` describes (one ``CheckpointError`` naming the key otherwise)."""
    cfg = read_config(config, source)
    return PlannedV41(cfg, native_inventory(cfg))
