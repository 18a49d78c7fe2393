"""Writing a whole checkpoint: bounded shards, the index, and the small files beside them.

Shards themselves are streamed by :class:`ShardWriter`; this module decides how tensors
are grouped into shards and writes the files that make the directory a checkpoint. The
index is written last, so a directory without one is visibly unfinished.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Iterable

from dsv4convert.checkpoint.reader import INDEX_NAME
from dsv4convert.checkpoint.safetensors_io import PlannedTensor, atomic_write_json, fsync_dir, partial_path, write_error
from dsv4convert.stop_points import reach

DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3


def shard_name(index: int, count: int) -> str:
    return f"model-{index:05d}-of-{count:05d}.safetensors"


def group_into_shards(groups: Iterable[list[list[PlannedTensor]]], max_shard_bytes: int) -> list[list[PlannedTensor]]:
    """Pack groups (e.g. one source layer) of units (e.g. one module's tensors) into shards.

    A group starts a new shard when it does not fit in the current one; a group larger than
    ``max_shard_bytes`` is split between units, never inside one. A shard exceeds the bound
    only when a single unit does.
    """
    shards: list[list[PlannedTensor]] = []
    current: list[PlannedTensor] = []
    size = 0
    for group in groups:
        group_bytes = sum(t.nbytes for unit in group for t in unit)
        if current and size + group_bytes > max_shard_bytes:
            shards.append(current)
            current, size = [], 0
        for unit in group:
            unit_bytes = sum(t.nbytes for t in unit)
            if current and size + unit_bytes > max_shard_bytes:
                shards.append(current)
                current, size = [], 0
            current.extend(unit)
            size += unit_bytes
    if current:
        shards.append(current)
    return shards


def write_index(dst: Path, weight_map: dict[str, str], total_size: int, metadata: dict | None = None) -> None:
    """Write ``model.safetensors.index.json`` atomically; ``total_size`` is the exact tensor byte count."""
    meta = {"total_size": int(total_size)}
    if metadata:
        meta.update(metadata)
    atomic_write_json(Path(dst) / INDEX_NAME, {"metadata": meta, "weight_map": dict(weight_map)})


def copy_small_files(files: Iterable[Path], dst: Path, *, skip: set[str] = frozenset()) -> list[str]:
    """Copy config, tokenizer and other small files (atomically each); returns the names copied."""
    copied = []
    for src in files:
        if src.name in skip:
            continue
        target = Path(dst) / src.name
        tmp = partial_path(target)
        try:
            reach(f"{src.name}: copying")
            shutil.copyfile(src, tmp)
            tmp.replace(target)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise write_error(exc, target) from None
        copied.append(src.name)
    fsync_dir(Path(dst))
    return copied
