"""What a conversion stored, grouped the way the engines build their layers.

:class:`StoredFormats` is the one description both engines' rules read: SGLang 0.5.23's
(:mod:`dsv4convert.convert.quant_config`, which builds it from the plan's module formats) and
vLLM 0.33.0's (:mod:`dsv4convert.convert.engines`). It holds data only, so that both can
import it without importing each other: imports flow ``stored <- engines <- recipe <- plan``
and ``stored, engines <- quant_config``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dsv4convert.storage import Format


@dataclass
class StoredFormats:
    """The output's linear formats, grouped the way SGLang builds its layers.

    ``formats`` maps every linear module (native name) to its stored format and parameters
    (``group_size`` for INT4, ``fp8_scale_dtype`` for FP8); the rest is derived from it by
    ``quant_config._analyse``: one format per block's FusedMoE (every routed expert of a block),
    the INT4 group sizes, the formats of the linears whose quant method comes from the config
    (attention, indexer ``wq_b``, shared experts, MTP projections) and the FP8 scale dtypes.
    """

    formats: dict[str, tuple[Format, dict]]
    experts: dict[str, Format] = field(default_factory=dict)    # block -> the one format of its FusedMoE
    int4_groups: set[int] = field(default_factory=set)
    config_linears: dict[str, Format] = field(default_factory=dict)  # native module -> format
    fp8_scale_dtypes: set[str] = field(default_factory=set)

    @property
    def everything_bf16(self) -> bool:
        return all(fmt is Format.BF16 for fmt, _ in self.formats.values())

    def expert_formats(self, *, mtp: bool | None = None) -> set[Format]:
        """Formats of the blocks' FusedMoEs: all blocks, only the MTP draft's (True) or only the backbone's."""
        return {f for block, f in self.experts.items() if mtp is None or block.startswith("mtp.") == mtp}

    @property
    def wo_a_bf16(self) -> bool:
        return any(f is Format.BF16 for m, f in self.config_linears.items() if m.endswith(".attn.wo_a"))
