"""One error type for everything a user can get wrong.

Every failure the tool reports names the file and, where there is one, the tensor, in a
single line. The CLI prints ``error: <message>`` and exits with status 2; anything else
that escapes is a bug in dsv4convert.
"""

from __future__ import annotations

from pathlib import Path


class DSV4Error(Exception):
    """A user-facing error: bad input, a refused operation, a failed check."""

    def __init__(self, message: str, *, file: str | Path | None = None, tensor: str | None = None):
        self.file = str(file) if file is not None else None
        self.tensor = tensor
        self.detail = message
        where = []
        if self.file:
            where.append(self.file)
        if tensor:
            where.append(f"tensor '{tensor}'")
        super().__init__(f"{': '.join(where)}: {message}" if where else message)


class CheckpointError(DSV4Error):
    """A checkpoint (index, shard header, tensor bytes) is missing, corrupt or unexpected."""


class FormatError(DSV4Error):
    """A tensor cannot be encoded or decoded in the requested format (shape, NaN/Inf, range)."""


class RecipeError(DSV4Error):
    """A recipe file is invalid or does not apply to the checkpoint."""
