"""Opening a checkpoint: a local directory or a Hugging Face repo id.

``Checkpoint.open`` reads the index and every shard *header* (never the data) and checks
them against each other before any work starts, so a missing shard, a tensor the index
names but no shard holds, a duplicate, or a shard name that escapes the directory is
reported up front, naming the file and tensor.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch

from dsv4convert.checkpoint.hub import HubRemote, Remote, one_line
from dsv4convert.checkpoint.safetensors_io import (
    DuplicateKey,
    ShardHeader,
    TensorEntry,
    read_header,
    read_tensor,
    unique_keys,
)
from dsv4convert.errors import CheckpointError
from dsv4convert.stop_points import reach

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
MAX_INDEX_BYTES = 64 * 1024 * 1024
MAX_SMALL_FILE_BYTES = 64 * 1024 * 1024
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# A conversion's work directory inside its destination, and its resume state (``convert/state.py``):
# ``"complete": false`` there marks a destination whose conversion has not run its last step.
WORK_DIR = ".dsv4convert"
CONVERSION_STATE = f"{WORK_DIR}/state.json"


def safe_shard_path(root: Path, shard: str, *, index_file: Path, tensor: str | None = None) -> Path:
    """Resolve a shard name from an index, refusing anything that leaves ``root``."""
    if (
        not isinstance(shard, str)
        or not shard
        or shard in (".", "..")
        or "/" in shard
        or "\\" in shard
        or "\x00" in shard
        or os.path.isabs(shard)
    ):
        raise CheckpointError(f"shard name {shard!r} is not a plain file name in the checkpoint directory",
                              file=index_file, tensor=tensor)
    if not shard.endswith(".safetensors"):
        raise CheckpointError(f"shard name {shard!r} is not a .safetensors file", file=index_file, tensor=tensor)
    path = root / shard
    resolved = path.resolve()
    if resolved.parent != root.resolve() and root.resolve() not in resolved.parents:
        raise CheckpointError(f"shard {shard!r} resolves outside the checkpoint directory (to {resolved})",
                              file=index_file, tensor=tensor)
    return path


def read_small_json(path: Path) -> dict:
    try:
        if path.stat().st_size > MAX_SMALL_FILE_BYTES:
            raise CheckpointError(f"file is larger than {MAX_SMALL_FILE_BYTES} bytes", file=path)
        obj = json.loads(path.read_text(encoding="utf-8"), object_pairs_hook=unique_keys)
    except FileNotFoundError:
        raise CheckpointError("file not found", file=path) from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"not valid JSON ({exc})", file=path) from None
    except DuplicateKey as exc:
        raise CheckpointError(f"key {exc.key!r} appears twice (readers would disagree on its value)", file=path) from None
    except RecursionError:
        raise CheckpointError("JSON is nested too deeply: corrupt or hostile file", file=path) from None
    except OSError as exc:
        raise CheckpointError(f"cannot read: {exc.strerror or exc}", file=path) from None
    if not isinstance(obj, dict):
        raise CheckpointError("not a JSON object", file=path)
    return obj


@dataclass
class Checkpoint:
    """A validated checkpoint: tensors by name (index order), shards in order, config."""

    root: Path
    tensors: dict[str, TensorEntry]
    shards: list[Path]
    headers: dict[Path, ShardHeader]
    config: dict
    index_file: Path | None
    index_total_size: int | None
    problems: list[str] = field(default_factory=list)
    remote: Remote | None = None  # set when shards still have to come from the Hub

    @classmethod
    def open(cls, src: str | Path, *, revision: str | None = None, remote: Remote | None = None) -> "Checkpoint":
        """A local directory, or a Hugging Face repo id (``remote`` stands in for the Hub in tests)."""
        path = Path(src)
        if remote is None and not path.is_dir():
            if path.exists():
                raise CheckpointError("source is a file, not a checkpoint directory", file=path)
            if not _REPO_ID.match(str(src)) or ".." in str(src):
                raise CheckpointError("no such local directory (and not a Hugging Face repo id 'org/name')",
                                      file=str(src))
            remote = HubRemote(str(src), revision)
        if remote is not None:
            try:
                root = remote.small_files()
            except CheckpointError:
                raise
            except Exception as exc:  # the Hub client raises many types; say which repo failed
                raise CheckpointError(f"no such local directory, and cannot resolve Hugging Face repo: {one_line(exc)}",
                                      file=str(src)) from None
        else:
            root = path
            refuse_unfinished(root)
        index_file = root / INDEX_NAME
        config_path = root / "config.json"
        config = read_small_json(config_path) if config_path.exists() else {}
        if index_file.exists():
            ckpt = cls._open_indexed(root, index_file, config, remote)
            ckpt.remote = remote if any(not p.exists() for p in ckpt.shards) else None
            return ckpt
        single = root / SINGLE_NAME
        if single.exists() or remote is not None:
            header = _header(single, remote)
            return cls(root, dict(header.entries), [single], {single: header}, config, None, None,
                       remote=remote if not single.exists() else None)
        raise CheckpointError(f"no {INDEX_NAME} and no {SINGLE_NAME}: not a safetensors checkpoint", file=root)

    @classmethod
    def _open_indexed(cls, root: Path, index_file: Path, config: dict, remote: Remote | None) -> "Checkpoint":
        if index_file.stat().st_size > MAX_INDEX_BYTES:
            raise CheckpointError(f"index is larger than {MAX_INDEX_BYTES} bytes", file=index_file)
        reach("checkpoint: reading the index")
        index = read_small_json(index_file)
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError("index has no 'weight_map' object", file=index_file)
        total = (index.get("metadata") or {}).get("total_size") if isinstance(index.get("metadata"), dict) else None
        return cls.from_weight_map(root, weight_map, config, index_file=index_file, total_size=total, remote=remote)

    @classmethod
    def from_weight_map(cls, root: Path, weight_map: dict, config: dict, *, index_file: Path | None = None,
                        total_size: int | None = None, remote: Remote | None = None) -> "Checkpoint":
        """The checkpoint ``weight_map`` (tensor -> shard) describes, checked against the shards' headers.

        The converter opens its output this way before it writes the index, so the index can be the last
        file written: until then the directory does not look complete to any loader."""
        label = index_file or root
        total = total_size
        shard_order: dict[str, Path] = {}
        for name, shard in weight_map.items():
            if not isinstance(shard, str) or shard not in shard_order:  # safe_shard_path refuses non-strings
                path = safe_shard_path(root, shard, index_file=label, tensor=name)
                if not path.is_file() and remote is None:
                    raise CheckpointError(f"shard '{shard}' named by the index is missing", file=path, tensor=name)
                shard_order[shard] = path
        headers = {}
        for i, path in enumerate(shard_order.values()):
            reach(f"checkpoint: reading header {i + 1} of {len(shard_order)}")
            headers[path] = _header(path, remote)

        tensors: dict[str, TensorEntry] = {}
        for name, shard in weight_map.items():
            path = shard_order[shard]
            entry = headers[path].entries.get(name)
            if entry is None:
                raise CheckpointError(f"the index puts this tensor in '{shard}' but that shard does not hold it",
                                      file=path, tensor=name)
            tensors[name] = entry
        owner: dict[str, Path] = {}
        for path, header in headers.items():
            for name in header.entries:
                if name in owner:
                    raise CheckpointError(f"tensor is stored in two shards ('{owner[name].name}' and '{path.name}')",
                                          file=path, tensor=name)
                owner[name] = path
                if name not in tensors:
                    raise CheckpointError("shard holds a tensor the index does not name", file=path, tensor=name)

        problems = []
        data_bytes = sum(e.nbytes for e in tensors.values())
        if isinstance(total, int) and total != data_bytes:
            problems.append(f"{label}: metadata.total_size is {total} but the tensors hold {data_bytes} bytes")
        return cls(root, tensors, list(shard_order.values()), headers, config, index_file,
                   total if isinstance(total, int) else None, problems)

    @property
    def total_bytes(self) -> int:
        return sum(e.nbytes for e in self.tensors.values())

    def entry(self, name: str) -> TensorEntry:
        try:
            return self.tensors[name]
        except KeyError:
            raise CheckpointError("tensor not in checkpoint", file=self.root, tensor=name) from None

    def read(self, name: str) -> torch.Tensor:
        return read_tensor(self.entry(name))

    def tensors_in(self, shard: Path) -> list[TensorEntry]:
        """Tensors of one shard in file order (the order that streams best)."""
        return sorted((e for e in self.tensors.values() if e.path == shard), key=lambda e: e.start)

    def iter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor, one at a time, shard by shard in file order."""
        for shard in self.shards:
            for entry in self.tensors_in(shard):
                yield entry.name, read_tensor(entry)

    def small_files(self) -> list[Path]:
        """Files a converted checkpoint carries over: everything but weights, the index and hidden files."""
        out = []
        for path in sorted(self.root.iterdir()):
            if path.name.startswith(".") or not path.is_file():
                continue
            if path.suffix == ".safetensors" or path.name == INDEX_NAME:
                continue
            if path.stat().st_size > MAX_SMALL_FILE_BYTES:
                continue
            out.append(path)
        return out


def refuse_unfinished(root: Path) -> None:
    """Refuse a destination whose conversion did not finish: its shards may all be there, but its last step
    (config, model card, index) has not run, so nothing may read it as a checkpoint; ``--resume`` finishes it."""
    state = root / CONVERSION_STATE
    if not state.is_file():
        return
    try:
        data = read_small_json(state)
    except CheckpointError:
        data = {}
    if data.get("complete") is not True:
        shards = data.get("shards")
        written = f" ({len(shards)} shard(s) written)" if isinstance(shards, dict) else ""
        raise CheckpointError(f"an unfinished conversion{written}: run the same dsv4convert command with --resume to "
                              "finish it (or --overwrite to start over)", file=root)


def _header(path: Path, remote: Remote | None) -> ShardHeader:
    """A local shard's header, or (for a shard still on the Hub) one read by range requests."""
    if path.is_file() or remote is None:
        return read_header(path)
    label = f"{remote.repo_id}/{path.name}"
    try:
        size = remote.size(path.name)
        with remote.open(path.name) as stream:
            return read_header(path, stream=stream, size=size, label=label)
    except CheckpointError:
        raise
    except Exception as exc:  # the Hub client raises many types; name the shard
        raise CheckpointError(f"cannot read the shard header from the Hub: {one_line(exc)}", file=label) from None
