"""Per-expert activation statistics, observed at the input of transformers' experts module.

``DeepseekV4Experts.forward(hidden_states, top_k_index, top_k_weights)`` receives every
token's FFN input and the experts it is routed to, so a forward pre-hook sees exactly
what each routed expert's ``w1``/``w3`` read. What ``w2`` reads is recomputed from those rows
with the module's own weights and gating (``_apply_gate``: clamped SiLU times the clamped
up projection), the same expression its forward evaluates.

Per expert we keep ``max|x|`` at both inputs, the number of tokens routed, and optionally
the GPTQ Hessians ``sum x x^T`` (float32) of both inputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from dsv4convert import dtypes
from dsv4convert.calibration import hessian_key
from dsv4convert.checkpoint import PlannedTensor, ShardWriter, read_header, read_tensor
from dsv4convert.errors import CheckpointError

AMAX_W13, AMAX_W2, TOKENS = "w13_input_amax", "w2_input_amax", "tokens"


@dataclass
class ExpertStats:
    """One block's statistics, one entry per routed expert."""

    w13_amax: torch.Tensor               # float32 [E]
    w2_amax: torch.Tensor                # float32 [E]
    tokens: torch.Tensor                 # int64 [E]
    w13_hessian: torch.Tensor | None = None  # float32 [E, H, H]
    w2_hessian: torch.Tensor | None = None   # float32 [E, I, I]

    @classmethod
    def zeros(cls, n_experts: int, hidden: int, inter: int, *, hessians: bool, device: torch.device) -> "ExpertStats":
        def z(*shape, dtype=torch.float32):
            return torch.zeros(shape, dtype=dtype, device=device)

        return cls(z(n_experts), z(n_experts), z(n_experts, dtype=torch.int64),
                   z(n_experts, hidden, hidden) if hessians else None,
                   z(n_experts, inter, inter) if hessians else None)

    def save(self, path: Path) -> None:
        """Atomically, as safetensors; each expert's Hessians are separate tensors so a
        converter reads one expert at a time (a real layer's hold 20 GiB)."""
        tensors = {AMAX_W13: self.w13_amax, AMAX_W2: self.w2_amax, TOKENS: self.tokens}
        if self.w13_hessian is not None:
            for e in torch.nonzero(self.tokens).flatten().tolist():
                tensors[hessian_key(e, "w13")] = self.w13_hessian[e]
                tensors[hessian_key(e, "w2")] = self.w2_hessian[e]
        planned = [PlannedTensor(k, dtypes.of_tensor(v).name, dtypes.safetensors_shape(v)) for k, v in tensors.items()]
        with ShardWriter(path, planned) as writer:
            for k, v in tensors.items():
                writer.write(k, v.detach().cpu().contiguous())

    @classmethod
    def load_scalars(cls, path: Path) -> "ExpertStats":
        """amax and token counts of a saved block (the Hessians stay on disk)."""
        entries = read_header(path).entries
        for key in (AMAX_W13, AMAX_W2, TOKENS):
            if key not in entries:
                raise CheckpointError("not a calibration statistics file", file=path, tensor=key)
        return cls(read_tensor(entries[AMAX_W13]), read_tensor(entries[AMAX_W2]), read_tensor(entries[TOKENS]))




def rows_by_expert(top_k_index: torch.Tensor, n_experts: int) -> list[tuple[int, torch.Tensor]]:
    """(expert, token rows in ascending order) for every expert that received tokens."""
    top_k = top_k_index.shape[1]
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=n_experts)[:n_experts].tolist()
    out, start = [], 0
    for expert, count in enumerate(counts):
        if count:
            out.append((expert, order[start:start + count] // top_k))
            start += count
    return out


def expert_inputs(experts: nn.Module, x: torch.Tensor, expert: int) -> torch.Tensor:
    """What ``w2`` of ``expert`` reads for FFN inputs ``x`` (rows routed to it)."""
    return experts._apply_gate(F.linear(x, experts.gate_up_proj[expert]))


@dataclass
class ExpertRecorder:
    """A forward pre-hook on a layer's experts module that accumulates :class:`ExpertStats`.

    ``capture`` (instead of accumulating) keeps the routed inputs themselves, per expert, for
    the held-out error report.
    """

    experts: nn.Module
    stats: ExpertStats
    capture: bool = False
    captured: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)

    def __post_init__(self):
        self._handle = self.experts.register_forward_pre_hook(self._observe)

    def remove(self) -> None:
        self._handle.remove()

    @torch.no_grad()
    def _observe(self, experts: nn.Module, args: tuple) -> None:
        x, top_k_index = args[0], args[1]
        for expert, rows in rows_by_expert(top_k_index, self.stats.tokens.numel()):
            x13 = x[rows]
            x2 = expert_inputs(experts, x13, expert)
            if self.capture:
                self.captured.setdefault(expert, []).append((x13, x2))
                continue
            s = self.stats
            s.tokens[expert] += rows.numel()
            s.w13_amax[expert] = torch.maximum(s.w13_amax[expert], x13.abs().amax().float())
            s.w2_amax[expert] = torch.maximum(s.w2_amax[expert], x2.abs().amax().float())
            if s.w13_hessian is not None:
                a, b = x13.float(), x2.float()
                s.w13_hessian[expert].addmm_(a.T, a)
                s.w2_hessian[expert].addmm_(b.T, b)
