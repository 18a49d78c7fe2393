"""Writing checkpoints: safetensors shards streamed atomically, bounded shards, the index, the small files.

A shard is streamed: its header is laid out from the planned tensor list, tensors are appended one by one,
and the file only gets its final name once it is complete and fsynced. Shards are written with
``O_DIRECT`` where the file system allows it, so the output never passes through the page cache; a
tensor whose bytes pass through unchanged (:class:`SourceBytes`) is read straight into the writer's
staging chunk (or, through the page cache, copied file to file by the kernel).

The rest of this module decides how tensors are grouped into shards and writes the files that make the
directory a checkpoint. The index is written last, so a directory without one is visibly unfinished.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import shutil
import struct
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Iterable

import torch

from dsv4convert import dtypes
from dsv4convert.checkpoint.reader import INDEX_NAME, TensorEntry, open_source, read_chunks, read_into, truncated
from dsv4convert.errors import CheckpointError, DSV4Error
from dsv4convert.stop_points import reach

DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3
_ALIGN = 8
_WRITE_CHUNK = 1024 * 1024  # write() of 64 MB at once measured ~3x slower into the page cache than 1 MB pieces
# Written bytes handed to the kernel's writeback at this interval (see _PageCacheOutput._start_writeback).
_WRITEBACK_EVERY = 64 * 1024 * 1024
# copy_file_range errors that mean "not between these files": copy through a buffer instead.
_NO_KERNEL_COPY = {errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.EBADF}
# Shards are written with O_DIRECT where the file system allows it (_DirectOutput), in chunks of
# _DIRECT_CHUNK, _DIRECT_DEPTH of them in flight, offsets and lengths multiples of _DIRECT_ALIGN.
# bench/direct_copy.py on the 2-core VM: 8 x 16 MB in flight copied 2 layers in 0.72-0.90x the
# time of cp + sync with a sixth of its system time; one at a time took twice cp's time.
DIRECT_IO = hasattr(os, "O_DIRECT")  # tests turn it off to run the page-cache writer
_DIRECT_CHUNK = 16 * 1024 * 1024
_DIRECT_DEPTH = 6
_DIRECT_ALIGN = 4096
# What a writer holds beyond the tensors it is given: its staging chunks.
WRITER_MEMORY = (_DIRECT_DEPTH + 1) * _DIRECT_CHUNK


# -- one safetensors shard ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class SourceBytes:
    """A source tensor's bytes, to be written unchanged under the output's ``dtype`` and ``shape``.

    Lets a converter pass bulk bytes through (MXFP4 codes kept by NVFP4) without reading
    them: the writer copies them file to file in the kernel, one copy instead of a read into
    a fresh buffer and a write out of it.
    """

    entry: TensorEntry
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class PlannedTensor:
    """A tensor a shard will hold, known before its data exists."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return dtypes.nbytes(self.dtype, self.shape)


def partial_path(path: Path) -> Path:
    """Temporary name of a shard being written: hidden, and never matched as a shard."""
    return path.with_name(f".{path.name}.partial")


def write_error(exc: OSError, path: Path, tensor: str | None = None) -> CheckpointError:
    """A failed write (disk full, file-size limit, I/O error) as one line naming the file, not a traceback."""
    code = errno.errorcode.get(exc.errno, str(exc.errno)) if exc.errno is not None else "OSError"
    return CheckpointError(f"cannot write ({code}: {exc.strerror or exc}); its temporary file was removed",
                           file=path, tensor=tensor)


class ShardWriter:
    """Streams tensors into one safetensors file in a planned order, atomically.

    The header is laid out first from the plan; ``write`` appends each tensor and checks it
    against the plan; ``commit`` fsyncs and renames the temporary file to its final name.
    Leaving the ``with`` block by an exception removes the temporary file. The bytes go to
    disk through :class:`_DirectOutput` where the file system takes ``O_DIRECT`` writes, else
    through the page cache (:class:`_PageCacheOutput`).
    """

    def __init__(self, path: Path, planned: list[PlannedTensor], metadata: dict[str, str] | None = None):
        self.path = Path(path)
        self.tmp = partial_path(self.path)
        self.planned = planned
        self._next = 0
        header: dict[str, object] = {}
        if metadata:
            header["__metadata__"] = dict(metadata)
        offset = 0
        for p in planned:
            header[p.name] = {"dtype": p.dtype, "shape": list(p.shape), "data_offsets": [offset, offset + p.nbytes]}
            offset += p.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
        raw += b" " * (-len(raw) % _ALIGN)
        self.size = 8 + len(raw) + offset
        self._out: _DirectOutput | _PageCacheOutput | None = None
        reach(f"{self.path.name}: opening its .partial")
        try:
            self._out = _open_output(self.tmp)
            self._out.put(memoryview(struct.pack("<Q", len(raw)) + raw))
            reach(f"{self.path.name}: .partial opened")
        except BaseException as exc:  # Ctrl-C/SIGTERM here comes before any ``with`` could clean up
            self.abort()
            if isinstance(exc, OSError):
                raise write_error(exc, self.path) from None
            raise

    def write(self, name: str, data: torch.Tensor | SourceBytes) -> None:
        """Append the next planned tensor: a tensor's bytes, or a source tensor's bytes copied file to file."""
        if self._next >= len(self.planned):
            raise CheckpointError("more tensors written than planned", file=self.path, tensor=name)
        want = self.planned[self._next]
        if name != want.name:
            raise CheckpointError(f"written out of order (expected '{want.name}')", file=self.path, tensor=name)
        if isinstance(data, SourceBytes):
            got_dtype, got_shape = data.dtype, tuple(data.shape)
            if data.entry.nbytes != want.nbytes:
                raise CheckpointError(f"planned {want.nbytes} bytes but the source tensor '{data.entry.name}' "
                                      f"has {data.entry.nbytes}", file=self.path, tensor=name)
        else:
            got_dtype, got_shape = dtypes.of_tensor(data).name, dtypes.safetensors_shape(data)
        # F8_E8M0 scales may be planned as U8 views and vice versa only by explicit conversion.
        if got_dtype != want.dtype or got_shape != want.shape:
            raise CheckpointError(
                f"planned {want.dtype} {list(want.shape)} but got {got_dtype} {list(got_shape)}",
                file=self.path,
                tensor=name,
            )
        reach(f"{self.path.name}: writing tensor {self._next + 1} of {len(self.planned)}")
        try:
            if isinstance(data, SourceBytes):
                self._out.copy(data.entry, f" while copying it to {self.path.name}")
            else:
                self._out.put(memoryview(data.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()))
        except OSError as exc:
            self.abort()
            raise write_error(exc, self.path, name) from None
        except CheckpointError:  # the source failed (missing, truncated)
            self.abort()
            raise
        self._next += 1

    def write_rows(self, name: str, chunks: Iterable[torch.Tensor]) -> None:
        """Append the next planned tensor from consecutive row chunks, so that a tensor larger than memory (an
        Engram table: 98 GB in DeepSeek-V4.1) is never whole in it; the chunks must add up to the plan exactly."""
        if self._next >= len(self.planned):
            raise CheckpointError("more tensors written than planned", file=self.path, tensor=name)
        want = self.planned[self._next]
        if name != want.name:
            raise CheckpointError(f"written out of order (expected '{want.name}')", file=self.path, tensor=name)
        rows = 0
        for chunk in chunks:
            got_dtype, got_shape = dtypes.of_tensor(chunk).name, dtypes.safetensors_shape(chunk)
            if got_dtype != want.dtype or got_shape[1:] != want.shape[1:] or rows + got_shape[0] > want.shape[0]:
                self.abort()
                raise CheckpointError(f"planned {want.dtype} {list(want.shape)} but got a chunk of {got_dtype} "
                                      f"{list(got_shape)} after {rows} rows", file=self.path, tensor=name)
            try:
                self._out.put(memoryview(chunk.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()))
            except OSError as exc:
                self.abort()
                raise write_error(exc, self.path, name) from None
            rows += got_shape[0]
        if rows != want.shape[0]:
            self.abort()
            raise CheckpointError(f"planned {want.shape[0]} rows but got {rows}", file=self.path, tensor=name)
        self._next += 1

    def commit(self) -> None:
        if self._next != len(self.planned):
            missing = self.planned[self._next].name
            self.abort()
            raise CheckpointError(f"shard closed with tensor '{missing}' unwritten", file=self.path)
        try:
            self._out.finish()
            self._out = None
            reach(f"{self.path.name}: renaming its .partial")
            os.replace(self.tmp, self.path)
        except OSError as exc:
            self.abort()
            raise write_error(exc, self.path) from None
        fsync_dir(self.path.parent)
        reach(f"{self.path.name}: complete")

    def abort(self) -> None:
        if self._out is not None:
            self._out.close()
            self._out = None
        self.tmp.unlink(missing_ok=True)

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
        elif self._out is not None:
            self.commit()


def _open_output(path: Path) -> "_DirectOutput | _PageCacheOutput":
    """``path`` created for writing: with ``O_DIRECT`` where the file system takes aligned direct writes.

    One aligned block is written first as a probe, then cut off again: some file systems accept
    the flag at open and refuse the writes.
    """
    if DIRECT_IO:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
        else:
            try:
                os.pwritev(fd, [mmap.mmap(-1, _DIRECT_ALIGN)], 0)  # anonymous maps are page aligned
                os.ftruncate(fd, 0)
                return _DirectOutput(fd, path)
            except OSError as exc:
                os.close(fd)
                if exc.errno != errno.EINVAL:
                    raise
    return _PageCacheOutput(open(path, "wb", buffering=0))  # tensors arrive in large pieces anyway


class _DirectOutput:
    """Writes a file front to back through aligned staging chunks with ``O_DIRECT``, several at once.

    No byte of the output goes through the page cache, so the kernel allocates, accounts, writes
    back and reclaims no page per byte written; on the 2-core VM that work was most of a
    conversion's CPU (docs/performance.md; ``bench/direct_copy.py``). Bytes are gathered into a
    ``_DIRECT_CHUNK`` buffer (a source tensor's bytes read straight into it), each full chunk goes
    to a pool of ``_DIRECT_DEPTH`` writer threads; the last one's tail past its last whole block
    goes through the page cache (:func:`_write_at`). A failed chunk write surfaces at a later
    ``put``, ``copy`` or ``finish``.
    """

    def __init__(self, fd: int, path: Path):
        self.fd = fd
        self.path = path
        self._pool = ThreadPoolExecutor(_DIRECT_DEPTH, thread_name_prefix="direct-write")
        self._free = [mmap.mmap(-1, _DIRECT_CHUNK) for _ in range(_DIRECT_DEPTH + 1)]  # page aligned
        self._writing: deque[Future] = deque()
        self._view = memoryview(self._free.pop())
        self._filled = 0
        self._offset = 0  # of the chunk being filled

    def put(self, data: memoryview) -> None:
        data = data.cast("B")
        done = 0
        while done < len(data):
            n = min(len(data) - done, _DIRECT_CHUNK - self._filled)
            self._view[self._filled:self._filled + n] = data[done:done + n]
            self._advance(n)
            done += n

    def copy(self, entry: TensorEntry, detail: str) -> None:
        fd = open_source(entry)
        try:
            done = 0
            while done < entry.nbytes:
                n = min(entry.nbytes - done, _DIRECT_CHUNK - self._filled)
                read_into(fd, entry, done, self._view[self._filled:self._filled + n], detail)
                self._advance(n)
                done += n
        finally:
            os.close(fd)

    def _advance(self, n: int) -> None:
        self._filled += n
        if self._filled == _DIRECT_CHUNK:
            self._write_chunk()

    def _write_chunk(self) -> None:
        self._writing.append(self._pool.submit(_write_at, self.fd, self.path, self._view[:self._filled],
                                               self._offset))
        self._offset += self._filled
        while not self._free:
            self._free.append(self._written(self._writing.popleft()))
        self._view = memoryview(self._free.pop())
        self._filled = 0

    def _written(self, write: Future) -> mmap.mmap:
        """The chunk ``write`` took, once it is on disk (its error raised here)."""
        view = write.result()
        return view.obj

    def finish(self) -> None:
        if self._filled:
            self._write_chunk()
        while self._writing:
            self._written(self._writing.popleft())
        os.fsync(self.fd)
        self.close()

    def close(self) -> None:
        """Wait for the chunks in flight (their errors no longer matter), then release the file."""
        for write in self._writing:
            write.exception()
        self._writing.clear()
        self._pool.shutdown()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _write_at(fd: int, path: Path, view: memoryview, offset: int) -> memoryview:
    """Write ``view`` at ``offset``: its whole blocks directly, what is left through the page cache.

    What is left is the last chunk's tail (no padding, so the file never grows past its size), or
    what a direct write did not take where the file or the device ends: a short write, or EINVAL
    when a size limit cut the write to an unaligned length. Unaligned, it cannot go direct, and
    the page-cache write then takes it or says why not (EFBIG, ENOSPC).
    """
    whole = len(view) // _DIRECT_ALIGN * _DIRECT_ALIGN
    try:
        done = os.pwritev(fd, [view[:whole]], offset) if whole else 0
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        done = 0
    if done < len(view):
        plain = os.open(path, os.O_WRONLY)
        try:
            while done < len(view):
                done += os.pwrite(plain, view[done:], offset + done)
        finally:
            os.close(plain)
    return view


class _PageCacheOutput:
    """Writes a file through the page cache, for file systems that refuse ``O_DIRECT`` (tmpfs).

    Source bytes are copied file to file by the kernel (``copy_file_range``, through a buffer
    where it cannot copy between the two files), and written bytes are handed to writeback as
    they accumulate (:meth:`_start_writeback`).
    """

    def __init__(self, file: BinaryIO):
        self.file = file
        self._written_back = 0

    def put(self, data: memoryview) -> None:
        for i in range(0, len(data), _WRITE_CHUNK):
            piece = data[i : i + _WRITE_CHUNK]
            while piece:  # an unbuffered write may be short
                piece = piece[self.file.write(piece):]
        self._start_writeback()

    def copy(self, entry: TensorEntry, detail: str) -> None:
        if not self._kernel_copy(entry, detail):
            for piece in read_chunks(entry, torch.empty(min(entry.nbytes, _WRITE_CHUNK), dtype=torch.uint8)):
                self.put(memoryview(piece.numpy()))
        self._start_writeback()

    def _kernel_copy(self, entry: TensorEntry, detail: str) -> bool:
        """``copy_file_range``; False, having written nothing, where it cannot copy between these files."""
        if not hasattr(os, "copy_file_range"):
            return False
        src = open_source(entry)
        try:
            done = 0
            while done < entry.nbytes:
                try:
                    n = os.copy_file_range(src, self.file.fileno(), min(entry.nbytes - done, _WRITEBACK_EVERY),
                                           entry.start + done)
                except OSError as exc:
                    if exc.errno in _NO_KERNEL_COPY and not done:
                        return False
                    raise
                if n == 0:
                    raise truncated(entry, done, detail)
                done += n
            return True
        finally:
            os.close(src)

    def _start_writeback(self) -> None:
        """Start writing what was written since the last call to disk now, without waiting.

        Left alone, the kernel holds gigabytes of dirty pages until the final fsync, which then
        stalls for seconds with the disk busy and nothing else running; and the cached output
        crowds out the page cache. ``POSIX_FADV_DONTNEED`` on dirty pages queues their
        writeback (it does not wait for it) and drops the pages already written.
        """
        end = self.file.tell()
        if end - self._written_back >= _WRITEBACK_EVERY and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self.file.fileno(), self._written_back, end - self._written_back,
                             os.POSIX_FADV_DONTNEED)
            self._written_back = end

    def finish(self) -> None:
        os.fsync(self.file.fileno())
        self.close()

    def close(self) -> None:
        try:
            self.file.close()
        except OSError:
            pass


def fsync_dir(path: Path) -> None:
    """Make a rename in ``path`` durable (no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes, *, point: str | None = None) -> None:
    """Write a small file so that it is either absent, or complete under its final name.

    ``point`` names the write's stop points (:mod:`dsv4convert.stop_points`; default: the file name).
    """
    path = Path(path)
    tmp = partial_path(path)
    point = point or path.name
    try:
        reach(f"{point}: writing")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        reach(f"{point}: renaming")
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise write_error(exc, path) from None
    fsync_dir(path.parent)


def atomic_write_json(path: Path, obj: object, *, point: str | None = None) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2) + "\n").encode("utf-8"), point=point)


# -- a checkpoint --------------------------------------------------------------------------------------------


def empty_destination(dst: Path, *, overwrite: bool) -> Path:
    """``dst`` as an empty directory to write a checkpoint into: a non-empty one is refused, or with ``overwrite``
    emptied (synth and the organism's writer)."""
    dst = Path(dst)
    if dst.exists() and any(dst.iterdir()):
        if not overwrite:
            raise DSV4Error("destination is not empty (pass --overwrite to replace it)", file=dst)
        shutil.rmtree(dst)
    dst.mkdir(parents=True, exist_ok=True)
    return dst


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
