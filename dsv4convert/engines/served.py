"""What a server loads: a checkpoint's stored tensors with their roles, its config, and the variant whose
engine rules apply. Both engines' memory sizing reads it; ``fit`` makes one from a checkpoint's headers or
from a conversion plan, the converter from its own output.
"""

from __future__ import annotations

from dataclasses import dataclass

from dsv4convert import variants
from dsv4convert.checkpoint import Checkpoint
from dsv4convert.engines.memory import KvGeometry, Tensor, classified
from dsv4convert.inspection import Inspection
from dsv4convert.models.deepseek_v4.layout import ModelConfig, TensorInfo


@dataclass(frozen=True)
class ServedModel:
    """One model to size: its stored tensors (classified once), config and the variant whose rules apply."""

    label: str
    variant: str           # variants.served_like(): the launch rules that apply
    config: dict
    tensors: list[tuple[Tensor, TensorInfo]]

    @property
    def has_draft(self) -> bool:
        return any(info.is_mtp for _, info in self.tensors)

    @property
    def model_config(self) -> ModelConfig:
        return ModelConfig.from_dict(self.config)

    @property
    def draft_blocks(self) -> int:
        """The ``mtp.*`` blocks stored: the preview's MTP blocks or a DSpark drafter's stages (0: none)."""
        return len({info.block for _, info in self.tensors if info.is_mtp})

    @property
    def geometry(self) -> KvGeometry:
        cfg = ModelConfig.from_dict(self.config)
        ratios = cfg.compress_ratios[: cfg.num_hidden_layers]
        return KvGeometry({r: ratios.count(r) for r in sorted(set(ratios))}, cfg.head_dim, cfg.index_head_dim)

    @classmethod
    def of(cls, label: str, ckpt: Checkpoint, inspection: Inspection) -> "ServedModel":
        """A checkpoint already opened and inspected (headers only: no weight is read)."""
        formats = {m.module: (m.format, m.params) for m in inspection.modules.values() if m.format is not None}
        tensors = classified(Tensor(e.name, e.dtype, tuple(e.shape), e.nbytes) for e in ckpt.tensors.values())
        return cls(label, variants.served_like(inspection.variant, formats), ckpt.config, tensors)
