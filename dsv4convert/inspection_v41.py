"""``inspect DIR`` for a DeepSeek-V4.1 checkpoint: the release or any of our conversions, headers only.

What it reports is what the converter, ``validate`` and ``fit`` read of the same checkpoint, from the same places:
the variant its ``quantization_config`` names (``engines/config.py::v41_variant_of``), every tensor against that
variant's layout for its config (``engines/outputs_v41.py::layout_problems``: a tensor no engine parameter takes, a
dtype or shape the engines would cast or refuse, one missing), the release's own header checks where it is the
release (the Engram rows, the 32 x 32 scales: ``models/deepseek_v41/release.py::check_checkpoint``), and the
tokenizer both engines build the Engram hasher from (``check_tokenizer``). Nothing is loaded.
"""

from __future__ import annotations

from dsv4convert.checkpoint import Checkpoint
from dsv4convert.engines.config import v41_variant_of
from dsv4convert.engines.outputs_v41 import NATIVE, layout_problems
from dsv4convert.errors import DSV4Error
from dsv4convert.models import role_table
from dsv4convert.models.deepseek_v41 import inventory
from dsv4convert.models.deepseek_v41 import release as v41
from dsv4convert.models.registry import release_of


def is_v41_checkpoint(ckpt: Checkpoint) -> bool:
    """Whether ``ckpt``'s release is V4.1 (its config read by the registry, which names an unknown one)."""
    return release_of(ckpt.config, str(ckpt.root / "config.json")) is v41


def inspect_v41(ckpt: Checkpoint) -> dict:
    """The report ``inspect`` prints (and ``--json`` writes) for a V4.1 checkpoint; ``ok`` is False with problems."""
    source = str(ckpt.root / "config.json")
    cfg = v41.read_config(ckpt.config, source)
    variant = v41_variant_of(ckpt.config)
    qc = ckpt.config.get("quantization_config") or {}
    group = (((qc.get("config_groups") or {}).get("group_0") or {}).get("weights") or {}).get("group_size", 32)
    problems = layout_problems(ckpt.tensors.values(), cfg, variant, group)
    checks = [lambda: v41.check_tokenizer(ckpt.root, cfg)]
    if variant == NATIVE and not problems:
        checks.insert(0, lambda: v41.check_checkpoint(cfg, ckpt.tensors.values()))
    for check in checks:
        try:
            check()
        except DSV4Error as exc:
            problems.append(str(exc))
    entries = [(e.name, e.dtype, tuple(e.shape), e.nbytes) for e in ckpt.tensors.values()]
    planned = inventory.expected_report(cfg)
    return {
        "source": str(ckpt.root),
        "release": v41.NAME,
        "variant": variant,
        "drafter": planned["drafter"],
        "drafter_description": planned["drafter_description"],
        "fp8_block": list(cfg.fp8_block),
        "tensor_count": len(entries),
        "total_bytes": ckpt.total_bytes,
        "shards": len(ckpt.shards),
        "engram_table_bytes": sum(n for name, _, _, n in entries if inventory.role_of(name) == "engram_table"),
        "roles": role_table(entries, inventory.role_of),
        "problems": problems,
        "ok": not problems,
    }
