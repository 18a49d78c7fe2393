"""Checkpoint I/O: validated lazy reading and atomic streaming writing of safetensors."""

from dsv4convert.checkpoint.hub import HubRemote, Remote, ShardFetcher
from dsv4convert.checkpoint.reader import (
    INDEX_NAME,
    Checkpoint,
    TensorEntry,
    prefetch,
    read_chunks,
    read_header,
    read_pieces,
    read_small_json,
    read_tensor,
)
from dsv4convert.checkpoint.writer import (
    WRITER_MEMORY,
    PlannedTensor,
    ShardWriter,
    SourceBytes,
    atomic_write_bytes,
    atomic_write_json,
    copy_small_files,
    partial_path,
    write_index,
)

__all__ = [
    "INDEX_NAME",
    "Checkpoint",
    "HubRemote",
    "PlannedTensor",
    "Remote",
    "ShardFetcher",
    "ShardWriter",
    "SourceBytes",
    "TensorEntry",
    "WRITER_MEMORY",
    "atomic_write_bytes",
    "atomic_write_json",
    "copy_small_files",
    "partial_path",
    "prefetch",
    "read_chunks",
    "read_header",
    "read_pieces",
    "read_small_json",
    "read_tensor",
    "write_index",
]
