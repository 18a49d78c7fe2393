"""Reading checkpoints: safetensors shards one tensor at a time, and a checkpoint directory or Hub repo.

We parse headers ourselves instead of trusting a library to do it because a converter
reads files it did not write: the header length is bounded, every entry's dtype, shape
and byte range is checked against the file before any tensor is touched, and every
error names the file and the tensor. Tensors are read with positioned reads into a
fresh buffer (no mmap), so resident memory stays at one tensor however large the shard.

``Checkpoint.open`` reads the index and every shard *header* (never the data) and checks
them against each other before any work starts, so a missing shard, a tensor the index
names but no shard holds, a duplicate, or a shard name that escapes the directory is
reported up front, naming the file and tensor. Writing is :mod:`.writer`'s.
"""

from __future__ import annotations

import json
import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Iterable, Iterator

import torch

from dsv4convert import dtypes
from dsv4convert.checkpoint.hub import HubRemote, Remote, one_line
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
# Real DeepSeek-V4 layer shards have ~170 KB headers; 64 MiB is far above any real one
# and far below what would hurt to allocate.
MAX_HEADER_BYTES = 64 * 1024 * 1024


# -- one safetensors shard ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lives: its shard, dtype, safetensors shape and absolute byte range."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    path: Path
    start: int  # absolute file offset of the first byte
    nbytes: int

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtypes.BY_NAME[self.dtype].torch


@dataclass(frozen=True)
class ShardHeader:
    path: Path
    entries: dict[str, TensorEntry]
    metadata: dict[str, str]
    file_size: int


class DuplicateKey(ValueError):
    """A JSON object names the same key twice; Python keeps the last, other readers may not."""

    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


def _raw_header(f: BinaryIO, size: int, where: str | Path) -> bytes:
    head = f.read(8)
    if len(head) < 8:
        raise CheckpointError(f"file is {size} bytes, too short for a safetensors header", file=where)
    (header_len,) = struct.unpack("<Q", head)
    if header_len > MAX_HEADER_BYTES:
        raise CheckpointError(
            f"header length field says {header_len} bytes (limit {MAX_HEADER_BYTES}): corrupt or hostile file",
            file=where,
        )
    if header_len > size - 8:
        raise CheckpointError(
            f"header length field says {header_len} bytes but the file has only {size - 8} after it "
            "(truncated or corrupt)",
            file=where,
        )
    return f.read(header_len)


def unique_keys(pairs: list[tuple[str, object]]) -> dict:
    """``object_pairs_hook`` for json.loads that refuses duplicate keys instead of keeping the last."""
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise DuplicateKey(key)
        out[key] = value
    return out


def read_header(path: Path, *, stream: BinaryIO | None = None, size: int | None = None,
                label: str | None = None) -> ShardHeader:
    """Parse and fully validate one shard's header; raises CheckpointError naming the file/tensor.

    ``stream`` and ``size`` read the header from elsewhere than ``path`` (a shard still on the
    Hugging Face Hub, read by range requests); entries still point at ``path``, where the
    shard will be, and errors name ``label``.
    """
    path = Path(path)
    where = label or path
    try:
        if stream is None:
            size = path.stat().st_size
            with open(path, "rb") as f:
                raw = _raw_header(f, size, where)
        else:
            raw = _raw_header(stream, size, where)
    except OSError as exc:
        raise CheckpointError(f"cannot read: {exc.strerror or exc}", file=where) from None
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=unique_keys)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"header is not valid JSON ({exc})", file=where) from None
    except DuplicateKey as exc:
        raise CheckpointError("the header names this tensor twice (readers would disagree on its bytes)",
                              file=where, tensor=exc.key) from None
    except RecursionError:
        raise CheckpointError("header JSON is nested too deeply: corrupt or hostile file", file=where) from None
    if not isinstance(header, dict):
        raise CheckpointError("header is not a JSON object", file=where)

    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointError("__metadata__ must map strings to strings", file=where)
    data_start = 8 + len(raw)
    data_size = size - data_start
    entries: dict[str, TensorEntry] = {}
    for name, info in header.items():
        entries[name] = _parse_entry(path, name, info, data_start, data_size, where)
    _check_no_overlap(where, entries.values())
    return ShardHeader(path=path, entries=entries, metadata=metadata, file_size=size)


def _parse_entry(path: Path, name: str, info: object, data_start: int, data_size: int,
                 where: str | Path) -> TensorEntry:
    if not isinstance(info, dict):
        raise CheckpointError("header entry is not an object", file=where, tensor=name)
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str) or dtypes.lookup(dtype) is None:
        raise CheckpointError(f"unknown dtype {dtype!r}", file=where, tensor=name)
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise CheckpointError(f"bad shape {shape!r}", file=where, tensor=name)
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
    ):
        raise CheckpointError(f"bad data_offsets {offsets!r}", file=where, tensor=name)
    begin, end = offsets
    if not 0 <= begin <= end:
        raise CheckpointError(f"data_offsets {offsets} are negative or reversed", file=where, tensor=name)
    if end > data_size:
        raise CheckpointError(
            f"data_offsets {offsets} run past the end of the data ({data_size} bytes): truncated shard",
            file=where,
            tensor=name,
        )
    if dtype == "F4" and shape and shape[-1] % 2:
        raise CheckpointError(f"F4 tensor needs an even last dim, got {shape}", file=where, tensor=name)
    expected = dtypes.nbytes(dtype, shape)
    if end - begin != expected:
        raise CheckpointError(
            f"{dtype} {shape} needs {expected} bytes but data_offsets {offsets} hold {end - begin}",
            file=where,
            tensor=name,
        )
    return TensorEntry(name, dtype, tuple(shape), path, data_start + begin, end - begin)


def _check_no_overlap(where: str | Path, entries: Iterable[TensorEntry]) -> None:
    ordered = sorted((e for e in entries if e.nbytes), key=lambda e: e.start)
    for prev, cur in zip(ordered, ordered[1:]):
        if cur.start < prev.start + prev.nbytes:
            raise CheckpointError(f"byte range overlaps tensor '{prev.name}'", file=where, tensor=cur.name)


def _read_error(exc: OSError, entry: TensorEntry) -> CheckpointError:
    return CheckpointError(f"cannot read: {exc.strerror or exc}", file=entry.path, tensor=entry.name)


def truncated(entry: TensorEntry, got: int, detail: str = "") -> CheckpointError:
    return CheckpointError(f"file ends after {got} of {entry.nbytes} bytes of this tensor (truncated shard){detail}",
                           file=entry.path, tensor=entry.name)


def read_tensor(entry: TensorEntry, *, pin_memory: bool = False) -> torch.Tensor:
    """Read one tensor into a fresh CPU tensor of its on-disk dtype (F4 as float4_e2m1fn_x2).

    ``pin_memory`` reads into page-locked memory, from which a GPU copies asynchronously.
    """
    buf = torch.empty(entry.nbytes, dtype=torch.uint8, pin_memory=pin_memory)
    for _ in read_chunks(entry, buf):  # a buffer of the tensor's size: one piece, the whole tensor
        pass
    return buf.view(entry.torch_dtype).reshape(dtypes.torch_shape(entry.dtype, entry.shape))


def read_chunks(entry: TensorEntry, buffer: torch.Tensor) -> Iterator[torch.Tensor]:
    """The tensor's bytes, read piece by piece into ``buffer`` (uint8; each piece is a view of it,
    valid until the next one). Lets a caller look at every byte without a tensor-sized allocation:
    no fresh pages to fault in and zero. Pieces hold whole elements when ``buffer``'s size is a
    multiple of the element size.
    """
    view = memoryview(buffer.numpy())
    fd = open_source(entry)
    try:
        done = 0
        while done < entry.nbytes:
            want = min(len(view), entry.nbytes - done)
            read_into(fd, entry, done, view[:want])
            yield buffer[:want]
            done += want
    finally:
        os.close(fd)


def open_source(entry: TensorEntry) -> int:
    try:
        return os.open(entry.path, os.O_RDONLY)
    except OSError as exc:
        raise _read_error(exc, entry) from None


def read_into(fd: int, entry: TensorEntry, offset: int, view: memoryview, detail: str = "") -> None:
    """Fill ``view`` with the tensor's bytes from ``offset`` on: positioned reads, a short file an error."""
    got = 0
    while got < len(view):
        try:
            n = os.preadv(fd, [view[got:]], entry.start + offset + got)
        except OSError as exc:
            raise _read_error(exc, entry) from None
        if not n:
            raise truncated(entry, offset + got, detail)
        got += n


def read_pieces(entry: TensorEntry, offsets: list[int], size: int) -> torch.Tensor:
    """``size`` bytes at each of ``offsets`` (from the tensor's start), as uint8 ``[len(offsets), size]``.

    For the few blocks of a tensor a caller must see while the rest is copied unread.
    """
    out = torch.empty(len(offsets), size, dtype=torch.uint8)
    for offset in offsets:
        if not 0 <= offset <= entry.nbytes - size:
            raise CheckpointError(f"bytes [{offset}, {offset + size}) lie outside this tensor's {entry.nbytes}",
                                  file=entry.path, tensor=entry.name)
    if not offsets:
        return out
    try:
        fd = os.open(entry.path, os.O_RDONLY)
        try:
            for row, offset in enumerate(offsets):
                piece = os.pread(fd, size, entry.start + offset)
                if len(piece) != size:
                    raise truncated(entry, offset + len(piece))
                out[row] = torch.frombuffer(bytearray(piece), dtype=torch.uint8)
        finally:
            os.close(fd)
    except OSError as exc:
        raise _read_error(exc, entry) from None
    return out


def prefetch(entries: Iterable[TensorEntry]) -> None:
    """Ask the kernel to start reading these tensors' bytes now (``POSIX_FADV_WILLNEED``).

    The reads run in the background at full queue depth while the caller still works on
    the previous tensors, instead of one sequential readahead window at a time. Only a hint:
    errors are ignored here and surface when the tensor is actually read.
    """
    if not hasattr(os, "posix_fadvise"):
        return
    by_path: dict[Path, list[TensorEntry]] = {}
    for entry in entries:
        by_path.setdefault(Path(entry.path), []).append(entry)
    for path, group in by_path.items():
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            for entry in group:
                os.posix_fadvise(fd, entry.start, entry.nbytes, os.POSIX_FADV_WILLNEED)
        except OSError:
            pass
        finally:
            os.close(fd)



# -- a checkpoint --------------------------------------------------------------------------------------------


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
