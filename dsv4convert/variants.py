"""The variants: what a checkpoint is called by the formats it stores, defined once.

A variant names one combination of formats: the backbone's routed experts, the MTP draft's routed
experts and the attention linears. ``inspect`` names a checkpoint by the first variant here that it
matches (else ``mixed``), the shipped recipes make them, ``fit`` plans them from a config, the model card
tags them, and each engine keys its serving rules on them (``engines/``); a mixed checkpoint is served by
the rules of the variant whose experts it holds (:func:`served_like`).
"""

from __future__ import annotations

from dataclasses import dataclass

from dsv4convert.format_names import Format
from dsv4convert.models.deepseek_v4.names import in_draft

BF16, FP8, MXFP4, NVFP4, INT4 = Format.BF16, Format.FP8, Format.MXFP4, Format.NVFP4, Format.INT4
MIXED = "mixed"


@dataclass(frozen=True)
class Variant:
    """One named combination of stored formats, and how this tool makes and describes it."""

    name: str
    experts: Format                      # the backbone's routed experts
    draft_experts: frozenset[Format]     # what the MTP draft's routed experts may be (a subset matches)
    attention: frozenset[Format]         # what the backbone's attention linears may be
    recipe: str | None                   # the shipped recipe that makes it (None: as released, or not shipped)
    summary: str
    tags: tuple[str, ...] = ()           # the Hub's tags on its model card
    needs_draft: bool = False            # the draft's experts must be present (an empty draft does not match)
    dense_only: frozenset[Format] | None = None  # shared experts and indexer restricted to these (None: any)

    def matches(self, experts: set[Format], draft: set[Format], attention: set[Format], dense: set[Format]) -> bool:
        """Whether a checkpoint storing these formats (per role, backbone unless named) is this variant."""
        return (experts == {self.experts} and draft <= self.draft_experts and (draft or not self.needs_draft)
                and attention <= self.attention and bool(attention)
                and (self.dense_only is None or dense <= self.dense_only))


_NVFP4_TAGS = ("nvfp4", "modelopt")
# In match order: the first that matches names the checkpoint.
VARIANTS: tuple[Variant, ...] = (
    Variant("w4a16", INT4, frozenset({INT4}), frozenset({BF16}), "w4a16",
            "routed experts requantized to INT4 W4A16 (compressed-tensors pack-quantized; group 32 and squared-error "
            "scales by default)",
            ("int4", "w4a16", "compressed-tensors"), dense_only=frozenset({BF16})),
    Variant("native", MXFP4, frozenset({MXFP4}), frozenset({FP8}), None,
            "the release: FP8 128x128 linears, MXFP4 routed experts"),
    Variant("fp8", FP8, frozenset({FP8}), frozenset({FP8}), "fp8",
            "routed experts cast MXFP4 -> FP8 128x128 losslessly; everything else kept", ("fp8",)),
    Variant("nvfp4", NVFP4, frozenset({FP8}), frozenset({FP8}), "nvfp4",
            "backbone experts cast MXFP4 -> NVFP4 (ModelOpt layout), lossless where the scales fit; MTP draft experts "
            "as the engines need them (--mtp-experts)", _NVFP4_TAGS),
    Variant("nvfp4-mtp-mxfp4", NVFP4, frozenset({MXFP4}), frozenset({FP8}), "nvfp4-mtp-mxfp4",
            "NVFP4 backbone experts; the draft's MXFP4 experts as released", _NVFP4_TAGS, needs_draft=True),
    Variant("nvfp4-mtp-bf16", NVFP4, frozenset({BF16}), frozenset({FP8}), None,
            "NVFP4 backbone experts; BF16 draft experts", _NVFP4_TAGS, needs_draft=True),
    Variant("w4a16-fp8-linears", INT4, frozenset({INT4}), frozenset({FP8}), None,
            "INT4 W4A16 routed experts, FP8 linears (SGLang's linear_fp8_config)", ("int4", "w4a16", "compressed-tensors")),
)
# Every linear BF16 (checked before the table: BF16 is what the table's formats decode to).
ALL_BF16 = Variant("bf16", BF16, frozenset({BF16}), frozenset({BF16}), "bf16",
                   "everything dequantized to BF16 (F32/I64 kept): the reference", ("bf16",))
# The last name is the SGLang-only W4A16 layout; inspect has always called it w4a16 too.
_ALIASES = {"w4a16-fp8-linears": "w4a16"}

# What each `to-*` command makes (the shipped recipes, in the order `--help` lists them).
SHIPPED_RECIPES = ("fp8", "nvfp4", "nvfp4-mtp-mxfp4", "w4a16", "bf16")
# Every name `inspect` gives: the variants, all-BF16, and a custom mix.
NAMES = ("native", "fp8", "nvfp4", "nvfp4-mtp-mxfp4", "nvfp4-mtp-bf16", "w4a16", "bf16", MIXED)
# The names an engine has serving rules for (a mix is served as one of them: served_like).
SERVED = tuple(name for name in NAMES if name != MIXED)
# The variants `fit` sizes without a model: each as `convert` makes it by default (recipe), or as released.
PLANNED: dict[str, str | None] = {"native": None, "fp8": "fp8", "nvfp4": "nvfp4", "nvfp4-mtp-mxfp4": "nvfp4-mtp-mxfp4",
                                  "w4a16": "w4a16", "bf16": "bf16"}
TAGS: dict[str, tuple[str, ...]] = {_ALIASES.get(v.name, v.name): v.tags for v in (*VARIANTS, ALL_BF16)}
# What each shipped recipe makes, in a line (the converters' --help).
SUMMARIES: dict[str, str] = {v.recipe: v.summary for v in (*VARIANTS, ALL_BF16) if v.recipe}


def name_of(experts: set[Format], draft: set[Format], attention: set[Format], dense: set[Format],
            everything: set[Format]) -> str:
    """The variant a checkpoint storing these formats is (backbone routed experts, the draft's routed experts,
    backbone attention, backbone shared experts and indexer, and every linear), else ``mixed``."""
    if everything == {BF16}:
        return ALL_BF16.name
    for variant in VARIANTS:
        if variant.matches(experts, draft, attention, dense):
            return _ALIASES.get(variant.name, variant.name)
    return MIXED


# A mix is served by the rules of its quantized backbone experts' variant, in this order (NVFP4 first: one NVFP4
# layer makes the ModelOpt hybrid config, whose draft decides among its variants).
_SERVED_BY_EXPERTS = ((INT4, "w4a16"), (MXFP4, "native"))


def served_like(variant: str, module_formats: dict[str, tuple[Format, dict]]) -> str:
    """The variant whose serving rules apply to a checkpoint storing ``module_formats`` (module -> format,
    params): itself, or for a mix the variant of its backbone routed experts with its draft's."""
    if variant in SERVED:
        return variant
    experts = {fmt for module, (fmt, _) in module_formats.items()
               if ".ffn.experts." in module and not in_draft(module)}
    draft = {fmt for module, (fmt, _) in module_formats.items()
             if ".ffn.experts." in module and in_draft(module)}
    if NVFP4 in experts:
        if MXFP4 in draft:
            return "nvfp4-mtp-mxfp4"
        return "nvfp4-mtp-bf16" if draft == {BF16} else "nvfp4"
    return next((like for fmt, like in _SERVED_BY_EXPERTS if fmt in experts), "fp8")
