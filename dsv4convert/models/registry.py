"""Which release a config.json is: the one place a feature asks (#52).

Each release family is one subpackage of :mod:`dsv4convert.models` whose ``release`` module answers the same small
set of questions (:class:`Release`): does a config belong to it, its checked config, the native inventory
``inspect --expected`` plans, its FP8 block. Features ask :func:`release_of`, never a ``model_type`` string.
Adding a release: a subpackage with a ``release`` module, one line in :data:`RELEASES`, and a rule per engine
(docs/architecture.md).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, Protocol

from dsv4convert.errors import CheckpointError
from dsv4convert.models.deepseek_v4 import release as deepseek_v4
from dsv4convert.models.deepseek_v4.layout import AttentionReach
from dsv4convert.models.deepseek_v41 import release as deepseek_v41


class Release(Protocol):
    """What every release module provides (a module, read structurally)."""

    NAME: str
    def not_yet(self, command: str) -> str | None: ...   # why ``command`` does not handle it yet (None: it does)
    def matches(self, config: dict) -> bool: ...
    def read_config(self, config: dict, source: str) -> Any: ...
    def fp8_block(self, cfg: Any) -> tuple[int, int]: ...
    def attention_reach(self, cfg: Any) -> AttentionReach: ...
    def expected_report(self, config: dict, source: str) -> dict: ...


# First match wins: V4.1's model_type is checked before V4's architecture, which SGLang rewrites V4.1's to.
RELEASES: tuple[ModuleType, ...] = (deepseek_v41, deepseek_v4)


def release_of(config: Any, source: str = "config.json") -> Release:
    """The release ``config`` belongs to; one ``CheckpointError`` naming what it says it is otherwise."""
    if not isinstance(config, dict):
        raise CheckpointError("config is not a JSON object", file=source)
    for release in RELEASES:
        if release.matches(config):
            return release
    known = ", ".join(r.NAME for r in RELEASES)
    raise CheckpointError(f"not a release dsv4convert knows (model_type={config.get('model_type')!r}, "
                          f"architectures={config.get('architectures')!r}; it knows {known})", file=source)


def fp8_block_of_config(config: Any, source: str = "config.json") -> tuple[int, int]:
    """The (rows, cols) FP8 block of the release ``config`` belongs to, for a caller that holds only the config."""
    release = release_of(config, source)
    return release.fp8_block(release.read_config(config, source))


def attention_reach_of_config(config: Any, source: str = "config.json") -> AttentionReach:
    """How far the attention of the release ``config`` belongs to reaches (a flat V4 config or V4.1's nested one)."""
    release = release_of(config, source)
    return release.attention_reach(release.read_config(config, source))
