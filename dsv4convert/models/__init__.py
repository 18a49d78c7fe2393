"""One home per model release (#52): what each release is, from its config.json.

Light on purpose (``synth --help`` imports the presets below it): the release modules and
:mod:`dsv4convert.models.registry` carry the rest.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable


def role_table(entries: Iterable[tuple[str, str, tuple[int, ...], int]], role_of: Callable[[str], str]) -> list[dict]:
    """Tensors, bytes and dtypes per role, the heaviest role first: ``inspect``'s table, from
    ``(name, dtype, shape, bytes)`` entries and a release's ``role_of(name)``."""
    rows: dict[str, dict] = {}
    for name, dtype, _shape, nbytes in entries:
        role = role_of(name)
        row = rows.setdefault(role, {"role": role, "tensors": 0, "bytes": 0, "dtypes": {}})
        row["tensors"] += 1
        row["bytes"] += nbytes
        row["dtypes"][dtype] = row["dtypes"].get(dtype, 0) + 1
    return sorted(rows.values(), key=lambda r: -r["bytes"])
