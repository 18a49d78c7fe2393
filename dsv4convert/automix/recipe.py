"""A mix as a recipe in the project's recipe language: one rule per decision, a comment on each.

Every decision becomes a rule matching its role inside its block (``module: 'layers\\.3\\..*'``), with the
predicted cost and the bytes of the choice (and of the alternatives) in a comment above it; the rules after
them are the family's fixed ones (the MTP draft's experts, and everything no format choice touches, kept
as in the source). The recipe is built as objects (:meth:`dsv4convert.convert.recipe.Recipe.of`), checked by
the recipe schema like any file, and writes itself as YAML.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from dsv4convert.automix.candidates import GROUPS, Decision
from dsv4convert.convert.recipe import Recipe, Rule, rule
from dsv4convert.formats import Format
from dsv4convert.models.deepseek_v4.layout import Role

# What no format choice touches: kept as in the source.
_FIXED = (
    rule(roles=(Role.ATTENTION, Role.INDEXER, Role.SHARED_EXPERT, Role.MTP_PROJECTION), mtp=True,
         reason="the MTP draft's linears as in the source (the main model's output does not depend on them)"),
    rule(roles=(Role.ROUTER, Role.NORM, Role.HYPER_CONNECTION, Role.ATTN_SINK),
         reason="router, norms, hyper-connections and attention sinks are tiny and precision-critical"),
    rule(roles=(Role.COMPRESSOR, Role.INDEXER_COMPRESSOR, Role.INDEXER_WEIGHTS_PROJ),
         reason="SGLang builds the compressors and the indexer's weights_proj unquantized"),
    rule(roles=(Role.EMBED, Role.HEAD), reason="embedding and LM head as released"),
    rule(roles=(Role.DRAFT_HEAD,), reason="a DSpark drafter's Markov and confidence heads as released"),
)
_MTP_REASONS = {
    None: "the MTP draft's experts as in the source",
    Format.BF16: "BF16 draft experts (exact from the source), the layout this family serves the draft from",
}
_GROUP_MODULES = {"attention": r"attn\.(wq_a|wkv|wq_b|wo_b)", "wo_a": r"attn\.wo_a", "experts": r"ffn\.experts\..*",
                  "indexer": r"attn\.indexer\.wq_b", "shared": r"ffn\.shared_experts\..*"}
_MTP_ROLES = {"attention": Role.ATTENTION, "wo_a": Role.ATTENTION, "indexer": Role.INDEXER,
              "shared": Role.SHARED_EXPERT}


@dataclass(frozen=True)
class Line:
    """One decision's rule: its format, and the comment saying why."""

    decision: Decision
    format: Format
    comment: str


def _decision_rule(line: Line, source: Format | None) -> Rule:
    d, fmt = line.decision, line.format
    what = f"{d.block} {d.group}"
    where = dict(roles=(GROUPS[d.group],), mtp=False, module=rf"{re.escape(d.block)}\.{_GROUP_MODULES[d.group]}",
                 comment=line.comment)
    if fmt is source:
        return rule(**where, reason=f"{what} as in the source ({fmt.value})")
    if fmt is Format.BF16:
        return rule(**where, fmt=fmt, reason=f"{what} in BF16 (exact from the source) where the budget allows")
    return rule(**where, fmt=fmt)


def write(name: str, description: str, engine: str, lines: list[Line], sources: dict[Decision, Format | None],
          mtp_experts: Format | None, header: tuple[str, ...] = (), model_wide: dict[str, Format] | None = None,
          source: str | None = None) -> Recipe:
    """The mix as a recipe (its text: YAML with the comments). ``model_wide``: decision groups the family stores
    in one format for the whole model (SGLang's ``wo_a``; every linear under compressed-tensors'
    ``linear_fp8_config``), which the MTP block's modules of that group then take too."""
    rules = [_decision_rule(line, sources.get(line.decision)) for line in lines]
    rules.append(rule(roles=(Role.ROUTED_EXPERT,), mtp=True, fmt=mtp_experts,
                      reason=_MTP_REASONS.get(mtp_experts)))
    for group, fmt in (model_wide or {}).items():
        if fmt is Format.BF16:    # (the MTP block's linears are FP8 in the source: kept below otherwise)
            rules.append(rule(roles=(_MTP_ROLES[group],), mtp=True, module=rf"mtp\.\d+\.{_GROUP_MODULES[group]}",
                              fmt=fmt, reason=f"{group} in one format for the whole model in this family"))
    if model_wide and len(model_wide) > 1 and set(model_wide.values()) == {Format.BF16}:
        rules.append(rule(roles=(Role.MTP_PROJECTION,), fmt=Format.BF16,
                          reason="every linear in one format for the whole model in this family"))
    rules.append(rule(roles=(Role.ATTENTION, Role.INDEXER, Role.SHARED_EXPERT), mtp=False,
                      reason="linears no decision covers, as in the source"))
    return Recipe.of(name, description, [*rules, *_FIXED], engine=engine, header=tuple(header), source=source)
