"""`automix`: per-layer formats chosen from measured sensitivity under a memory budget (docs/automix.md)."""
