"""A mix as a recipe in the project's recipe language: one rule per decision, a comment on each.

Every decision becomes a rule matching its role inside its block (``module: 'layers\\.3\\..*'``), with the
predicted cost and the bytes of the choice (and of the alternatives) in a comment above it; the rules after
them are the family's fixed ones (the MTP draft's experts, and everything no format choice touches, kept
as in the source). The text goes through :func:`dsv4convert.convert.recipe.parse_recipe` before it is used,
so a recipe automix writes is checked like any other.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from dsv4convert.automix.candidates import GROUPS, Decision
from dsv4convert.storage import Format

_FIXED = """\
  - match: {role: [attention, indexer, shared_expert, mtp_projection], mtp: true}
    format: keep
    reason: the MTP draft's linears as in the source (the main model's output does not depend on them)
  - match: {role: [router, norm, hyper_connection, attn_sink]}
    format: keep
    reason: router, norms, hyper-connections and attention sinks are tiny and precision-critical
  - match: {role: [compressor, indexer_compressor, indexer_weights_proj]}
    format: keep
    reason: SGLang builds the compressors and the indexer's weights_proj unquantized
  - match: {role: [embed, head]}
    format: keep
    reason: embedding and LM head as released
"""

_MTP_REASONS = {
    None: "the MTP draft's experts as in the source",
    Format.BF16: "BF16 draft experts (exact from the source), the layout this family serves the draft from",
}


@dataclass(frozen=True)
class Line:
    """One decision's rule: its format, and the comment saying why."""

    decision: Decision
    format: Format
    comment: str


def _format(fmt: Format, source: Format | None, what: str) -> str:
    if fmt is source:
        return f"    format: keep\n    reason: {what} as in the source ({fmt.value})\n"
    if fmt is Format.BF16:
        return f"    format: bf16\n    reason: {what} in BF16 (exact from the source) where the budget allows\n"
    return f"    format: {fmt.value}\n"


_GROUP_MODULES = {"attention": r"attn\.(wq_a|wkv|wq_b|wo_b)", "wo_a": r"attn\.wo_a", "experts": r"ffn\.experts\..*",
                  "indexer": r"attn\.indexer\.wq_b", "shared": r"ffn\.shared_experts\..*"}
_MTP_ROLES = {"attention": "attention", "wo_a": "attention", "indexer": "indexer", "shared": "shared_expert"}


def write(name: str, description: str, engine: str, lines: list[Line], sources: dict[Decision, Format | None],
          mtp_experts: Format | None, header: list[str] = (), model_wide: dict[str, Format] | None = None) -> str:
    """The recipe text (YAML with comments). ``model_wide``: decision groups the family stores in one format
    for the whole model (SGLang's ``wo_a``; every linear under compressed-tensors' ``linear_fp8_config``), which
    the MTP block's modules of that group then take too."""
    out = [f"# {h}" for h in header]
    out += [f"name: {name}", "description: >", f"  {description}", f"engine: {engine}", "rules:"]
    for line in lines:
        d = line.decision
        role = GROUPS[d.group].value
        out.append(f"  # {line.comment}")
        out.append(f"  - match: {{role: {role}, mtp: false, module: '{re.escape(d.block)}\\.{_GROUP_MODULES[d.group]}'}}")
        out.append(_format(line.format, sources.get(d), f"{d.block} {d.group}").rstrip("\n"))
    out.append("  - match: {role: routed_expert, mtp: true}")
    if mtp_experts is None:
        out.append(f"    format: keep\n    reason: {_MTP_REASONS[None]}")
    elif mtp_experts is Format.BF16:
        out.append(f"    format: bf16\n    reason: {_MTP_REASONS[Format.BF16]}")
    else:
        out.append(f"    format: {mtp_experts.value}")
    for group, fmt in (model_wide or {}).items():
        if fmt is not Format.BF16:
            continue                  # the MTP block's linears are FP8 in the source: kept below
        out.append(f"  - match: {{role: {_MTP_ROLES[group]}, mtp: true, module: 'mtp\\.\\d+\\.{_GROUP_MODULES[group]}'}}")
        out.append(f"    format: bf16\n    reason: {group} in one format for the whole model in this family")
    if model_wide and all(fmt is Format.BF16 for fmt in model_wide.values()) and len(model_wide) > 1:
        out.append("  - match: {role: mtp_projection}")
        out.append("    format: bf16\n    reason: every linear in one format for the whole model in this family")
    out.append("  - match: {role: [attention, indexer, shared_expert], mtp: false}")
    out.append("    format: keep\n    reason: linears no decision covers, as in the source")
    return "\n".join(out) + "\n" + _FIXED
