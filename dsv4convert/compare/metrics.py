"""Output-level fidelity of a variant against its base, from the two sides' logits (pure math).

The metric set of llama.cpp's ``llama-perplexity --kl-divergence`` (mean KLD ± standard error
and its percentiles, same top-1, Δp of the reference token, perplexity ratio) plus ModelOpt's
expected acceptance rate ``Σ min(p, q)``, in float64 over the full vocabulary (no storage floor).
KLD is ``KL(base || variant)`` in nats: how much the variant loses of what the base predicts.

Logits arrive a chunk of positions at a time (:meth:`OutputStats.add`); per-position values are
kept (a float per token and metric: 64K tokens are a few MB) so percentiles are exact.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

PERCENTILES = (100.0, 99.9, 99.0, 95.0, 90.0, 50.0, 10.0, 5.0, 1.0, 0.1, 0.0)


@dataclass
class OutputStats:
    """Per-position KLD, Δp, top-1 agreement and log-probabilities of both sides, accumulated."""

    kld: list[torch.Tensor] = field(default_factory=list)
    delta_p: list[torch.Tensor] = field(default_factory=list)       # p_variant(ref) - p_base(ref)
    same_top1: list[torch.Tensor] = field(default_factory=list)
    overlap: list[torch.Tensor] = field(default_factory=list)       # Σ min(p, q)
    base_logp: list[torch.Tensor] = field(default_factory=list)     # log p_base(ref)
    variant_logp: list[torch.Tensor] = field(default_factory=list)

    @torch.no_grad()
    def add(self, base_logits: torch.Tensor, variant_logits: torch.Tensor, reference: torch.Tensor) -> None:
        """Positions ``[..., vocab]`` of both sides and the token that really came next (``[...]``)."""
        if base_logits.shape != variant_logits.shape:
            raise ValueError(f"logit shapes differ: {tuple(base_logits.shape)} vs {tuple(variant_logits.shape)}")
        log_p = torch.log_softmax(base_logits.reshape(-1, base_logits.shape[-1]).double(), dim=-1)
        log_q = torch.log_softmax(variant_logits.reshape(-1, variant_logits.shape[-1]).double(), dim=-1)
        if not (torch.isfinite(log_p).all() and torch.isfinite(log_q).all()):
            raise ValueError("non-finite logits: a side produced NaN or Inf")
        ref = reference.reshape(-1, 1).to(log_p.device)
        p = log_p.exp()
        self.kld.append((p * (log_p - log_q)).sum(-1).clamp_min(0.0).float().cpu())
        p_ref, q_ref = log_p.gather(1, ref).squeeze(1), log_q.gather(1, ref).squeeze(1)
        self.delta_p.append((q_ref.exp() - p_ref.exp()).float().cpu())
        self.same_top1.append((log_p.argmax(-1) == log_q.argmax(-1)).cpu())
        self.overlap.append(torch.minimum(p, log_q.exp()).sum(-1).float().cpu())
        self.base_logp.append(p_ref.cpu())
        self.variant_logp.append(q_ref.cpu())

    def merge(self, other: "OutputStats") -> None:
        """Append another micro-batch's positions (in the global order: the summary is order-exact)."""
        for name in ("kld", "delta_p", "same_top1", "overlap", "base_logp", "variant_logp"):
            getattr(self, name).extend(getattr(other, name))

    @property
    def positions(self) -> int:
        return sum(t.numel() for t in self.kld)

    def summary(self) -> dict:
        """The headline numbers (JSON-ready)."""
        if not self.kld:
            raise ValueError("no positions were compared")
        kld, dp = torch.cat(self.kld).double(), torch.cat(self.delta_p).double()
        n = kld.numel()
        base_nll, variant_nll = -torch.cat(self.base_logp).mean(), -torch.cat(self.variant_logp).mean()
        return {
            "positions": n,
            "kld": {"mean": float(kld.mean()), "standard_error": float(kld.std() / math.sqrt(n)) if n > 1 else 0.0,
                    "percentiles": percentiles(kld)},
            "same_top1": float(torch.cat(self.same_top1).double().mean()),
            "delta_p": {"mean": float(dp.mean()), "rms": float(dp.square().mean().sqrt()),
                        "percentiles": percentiles(dp)},
            "expected_acceptance": float(torch.cat(self.overlap).double().mean()),
            "perplexity": {"base": float(base_nll.exp()), "variant": float(variant_nll.exp()),
                           "ratio": float((variant_nll - base_nll).exp())},
        }

    def kld_values(self) -> torch.Tensor:
        return torch.cat(self.kld) if self.kld else torch.zeros(0)


def percentiles(values: torch.Tensor) -> dict[str, float]:
    """llama.cpp's percentile set (``"99.9"`` etc.; ``"100"`` is the maximum, ``"0"`` the minimum)."""
    v = values.double()
    qs = torch.tensor([p / 100.0 for p in PERCENTILES], dtype=torch.float64)
    got = torch.quantile(v, qs, interpolation="linear") if v.numel() > 1 else v.expand(len(PERCENTILES))
    return {f"{p:g}": float(x) for p, x in zip(PERCENTILES, got)}


@dataclass
class HiddenError:
    """Running relative error and cosine of two sides' streams, over chunks of positions."""

    PIECE = 1 << 26
    diff_sq: float = 0.0
    ref_sq: float = 0.0
    other_sq: float = 0.0
    dot: float = 0.0

    def add(self, reference: torch.Tensor, other: torch.Tensor) -> None:
        a, b = reference.reshape(-1), other.reshape(-1)
        for start in range(0, a.numel(), self.PIECE):   # float64 a piece at a time: a 64K-token layer is 1G values
            x, y = a[start:start + self.PIECE].double(), b[start:start + self.PIECE].double()
            self.diff_sq += float((x - y).square().sum())
            self.ref_sq += float(x.square().sum())
            self.other_sq += float(y.square().sum())
            self.dot += float(x @ y)

    def merge(self, other: "HiddenError") -> None:
        self.diff_sq += other.diff_sq
        self.ref_sq += other.ref_sq
        self.other_sq += other.other_sq
        self.dot += other.dot

    def result(self) -> dict[str, float]:
        rel = math.sqrt(self.diff_sq / self.ref_sq) if self.ref_sq else (0.0 if self.diff_sq == 0 else math.inf)
        denom = math.sqrt(self.ref_sq * self.other_sq)
        cos = self.dot / denom if denom else (1.0 if self.diff_sq == 0 else 0.0)
        return {"relative_error": rel, "cosine": cos}
