"""Streaming a checkpoint from the Hugging Face Hub, shard by shard.

A repo that is not fully in the local cache is opened without downloading its weights:
the small files (config, index, tokenizer) are fetched, and every shard header is read
with range requests, so the whole checkpoint is validated before any work starts. The
converter then asks a :class:`ShardFetcher` for the shards each job needs: the next
shard downloads while the current one converts, and with ``delete_after_use`` a shard is
deleted from the cache as soon as no remaining job needs it, which keeps peak disk to the
output plus the source shards the running jobs read and the next one
(``convert.execute.source_windows``).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Protocol

from dsv4convert.errors import CheckpointError

SMALL_FILE_PATTERNS = ["*.json", "*.txt", "*.model", "*.md", "*.jinja", "tokenizer*", "*.tiktoken"]


def one_line(exc: BaseException) -> str:
    """The Hub client's error as one line: its messages run over several, and an error is one ``error:`` line."""
    return " ".join(str(exc).split()) or type(exc).__name__


class Remote(Protocol):
    """The Hub operations streaming needs (an interface so tests can stand in for the Hub)."""

    repo_id: str

    def small_files(self) -> Path: ...            # local snapshot dir holding config, index, tokenizer
    def size(self, filename: str) -> int: ...
    def open(self, filename: str) -> BinaryIO: ...  # random access, for headers
    def download(self, filename: str) -> Path: ...  # local path of the downloaded shard


@dataclass
class HubRemote:
    """:class:`Remote` through ``huggingface_hub`` (local cache first, then the Hub)."""

    repo_id: str
    revision: str | None = None
    _commit_dir: Path | None = field(default=None, repr=False)

    def small_files(self) -> Path:
        from huggingface_hub import snapshot_download

        self._commit_dir = Path(snapshot_download(self.repo_id, revision=self.revision,
                                                  allow_patterns=SMALL_FILE_PATTERNS))
        # Pin every later request to the commit the small files came from.
        self.revision = self._commit_dir.name
        return self._commit_dir

    def _fs_path(self, filename: str) -> str:
        return f"{self.repo_id}/{filename}"

    def size(self, filename: str) -> int:
        from huggingface_hub import HfFileSystem

        return int(HfFileSystem().info(self._fs_path(filename), revision=self.revision)["size"])

    def open(self, filename: str) -> BinaryIO:
        from huggingface_hub import HfFileSystem

        return HfFileSystem().open(self._fs_path(filename), "rb", revision=self.revision, block_size=1 << 20)

    def download(self, filename: str) -> Path:
        from huggingface_hub import hf_hub_download

        return Path(hf_hub_download(self.repo_id, filename, revision=self.revision))


class ShardFetcher:
    """Downloads source shards ahead of use, and deletes them after their last use if asked."""

    def __init__(self, remote: Remote, local_dir: Path, *, delete_after_use: bool = False, ahead: int = 1):
        self.remote = remote
        self.local_dir = Path(local_dir)
        self.delete_after_use = delete_after_use
        self.ahead = ahead
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-download")
        self._pending: dict[str, Future] = {}
        self._lock = threading.Lock()

    def _start(self, filename: str) -> Future:
        with self._lock:
            if filename not in self._pending:
                self._pending[filename] = self._pool.submit(self._download, filename)
            return self._pending[filename]

    def _download(self, filename: str) -> Path:
        target = self.local_dir / filename
        if target.exists():
            return target
        try:
            got = self.remote.download(filename)
        except Exception as exc:  # network and Hub errors come in many types; name the shard
            raise CheckpointError(f"download from {self.remote.repo_id} failed: {one_line(exc)}",
                                  file=filename) from None
        if got.resolve() != target.resolve():
            raise CheckpointError(f"downloaded to {got}, expected {target}", file=filename)
        return target

    def acquire(self, filenames: list[str], upcoming: list[str]) -> None:
        """Block until ``filenames`` are local; start downloading the first ``ahead`` of ``upcoming``."""
        futures = [self._start(f) for f in filenames]
        for f in [u for u in upcoming if u not in filenames][: self.ahead]:
            self._start(f)
        for fut in futures:
            fut.result()

    def release(self, filename: str) -> None:
        """The last job that reads ``filename`` is done."""
        if not self.delete_after_use:
            return
        path = self.local_dir / filename
        blob = path.resolve()
        path.unlink(missing_ok=True)
        if blob != path:
            blob.unlink(missing_ok=True)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
