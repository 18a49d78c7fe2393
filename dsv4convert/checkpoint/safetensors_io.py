"""safetensors shards, one tensor at a time.

We parse headers ourselves instead of trusting a library to do it because a converter
reads files it did not write: the header length is bounded, every entry's dtype, shape
and byte range is checked against the file before any tensor is touched, and every
error names the file and the tensor. Tensors are read with positioned reads into a
fresh buffer (no mmap), so resident memory stays at one tensor however large the shard.
Writing is streaming too: the header is laid out from the planned tensor list, tensors
are appended one by one, and the file only gets its final name once it is complete and
fsynced. Shards are written with ``O_DIRECT`` where the file system allows it, so the output
never passes through the page cache; a tensor whose bytes pass through unchanged
(:class:`SourceBytes`) is read straight into the writer's staging chunk (or, through the page
cache, copied file to file by the kernel).
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import struct
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Iterable, Iterator

import torch

from dsv4convert import dtypes
from dsv4convert.errors import CheckpointError
from dsv4convert.stop_points import reach

# Real DeepSeek-V4 layer shards have ~170 KB headers; 64 MiB is far above any real one
# and far below what would hurt to allocate.
MAX_HEADER_BYTES = 64 * 1024 * 1024
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


def _truncated(entry: TensorEntry, got: int, detail: str = "") -> CheckpointError:
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
    fd = _open_source(entry)
    try:
        done = 0
        while done < entry.nbytes:
            want = min(len(view), entry.nbytes - done)
            _read_into(fd, entry, done, view[:want])
            yield buffer[:want]
            done += want
    finally:
        os.close(fd)


def _open_source(entry: TensorEntry) -> int:
    try:
        return os.open(entry.path, os.O_RDONLY)
    except OSError as exc:
        raise _read_error(exc, entry) from None


def _read_into(fd: int, entry: TensorEntry, offset: int, view: memoryview, detail: str = "") -> None:
    """Fill ``view`` with the tensor's bytes from ``offset`` on: positioned reads, a short file an error."""
    got = 0
    while got < len(view):
        try:
            n = os.preadv(fd, [view[got:]], entry.start + offset + got)
        except OSError as exc:
            raise _read_error(exc, entry) from None
        if not n:
            raise _truncated(entry, offset + got, detail)
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
                    raise _truncated(entry, offset + len(piece))
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
        fd = _open_source(entry)
        try:
            done = 0
            while done < entry.nbytes:
                n = min(entry.nbytes - done, _DIRECT_CHUNK - self._filled)
                _read_into(fd, entry, done, self._view[self._filled:self._filled + n], detail)
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
        src = _open_source(entry)
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
                    raise _truncated(entry, done, detail)
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
