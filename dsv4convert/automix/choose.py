"""The verified choice: the best predicted mixes and the uniform layouts within the budget, measured whole.

The estimate orders mixes well but misjudges some by a factor 0.7-1.5 on text it was not made from (formats
interact, per family, and the text differs), so the solver alone can hand over a mix that measures worse than a
layout it was compared with (issue 46). Here the ``--verify-top`` mixes of least predicted KLD (each the best of
its layout) and every servable uniform layout within the budget are measured, and the one that measures least
is returned. Each candidate is measured on a track of its own in one more pass over the model, on the
selection windows (text neither the sensitivity pass nor the report reads): all its candidates applied at once
under its served numerics, caches included, which is exactly what ``compare`` measures on the converted mix
(``tests/test_automix.py`` checks it). No candidate is converted: a pass reads the model once and each track
costs one forward per layer, where converting and comparing each candidate would cost a conversion and a read of
two checkpoints apiece (the arithmetic is in ``docs/automix.md``). The same measurements correct the
estimate per family (:func:`family_factors`): what the report states beside the pass's prediction.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field, replace

import torch

from dsv4convert.automix.plan import AutomixPlan, Mix, input_scales, picks_key
from dsv4convert.automix.sensitivity import Measured, measure
from dsv4convert.convert.plan import human_bytes
from dsv4convert.errors import DSV4Error


def track_label(mix: Mix) -> str:
    """A mix's track: its layout and what it stores (the same for the same mix, whatever it is called)."""
    return f"{mix.layout.slug}/{zlib.crc32(repr(picks_key(mix.picks)).encode()):08x}"


def candidates(plan: AutomixPlan, measured: Measured, capacity: int | None = None) -> list[Mix]:
    """The ``--verify-top`` least predicted of each layout's best mix (at least the best of all) and every servable
    uniform layout within ``capacity`` (default: each layout's own budget), each once, least predicted first."""
    best = [mix for layout in plan.layouts if (mix := plan.solve(measured, capacity, [layout])) is not None]
    best.sort(key=lambda m: (m.predicted, m.bytes))
    uniforms = [plan.mix(layout, picks, measured, name) for name, layout, picks in plan.uniform_layouts()]
    fitting = [m for m in uniforms if m.bytes <= (m.layout.capacity if capacity is None else capacity)]
    by_key: dict[tuple, Mix] = {}
    for mix in [*fitting, *(replace(m, name=f"best-{m.layout.slug}") for m in best[:max(plan.options.verify_top, 1)])]:
        by_key.setdefault(picks_key(mix.picks), mix)        # a best mix that is a uniform layout keeps that name
    return sorted(by_key.values(), key=lambda m: (m.predicted, m.bytes))


def measure_candidates(plan: AutomixPlan, mixes: list[Mix], ids: torch.Tensor) -> Measured:
    """One pass over the model measuring every mix whole on ``ids`` (the selection windows)."""
    tracks = {track_label(m): plan.track(m.layout, m.picks, track_label(m)) for m in mixes}
    return measure(plan.ckpt, plan.inspection, ids, [], {}, [], device=plan.device, dtype=plan.dtype,
                   chunk=plan.options.chunk, input_scales=input_scales(plan), mixes=list(tracks.values()),
                   progress=plan.options.progress, desc="automix selection")


@dataclass
class Choice:
    """The mix that measured least of ``candidates`` on the selection windows, beside the one predicted least
    (``selection`` None: not verified, ``--verify-top 0``, the predicted best)."""

    chosen: Mix
    predicted: Mix
    candidates: list[Mix]
    selection: Measured | None
    factors: dict[str, float] = field(default_factory=dict)    # family -> measured / predicted (selection)

    def kld(self, mix: Mix) -> float:
        return self.selection.mix_kld(track_label(mix))

    def error(self, mix: Mix, against: Mix | None = None) -> float:
        return self.selection.mix_error(track_label(mix), track_label(against) if against is not None else None)

    def corrected(self, mix: Mix) -> float | None:
        """The mix's predicted KLD scaled by its family's measured/predicted on the selection windows (None: no
        candidate of its family was measured)."""
        factor = self.factors.get(mix.layout.label)
        return mix.predicted * factor if factor is not None else None

    @property
    def overruled(self) -> bool:
        """True when the measurement chose another mix than the estimate."""
        return self.chosen is not self.predicted

    def verdict(self) -> str:
        """One sentence on what was chosen and why, for the user and the report."""
        what = f"{self.chosen.name} ({self.chosen.layout.label}, {human_bytes(self.chosen.bytes)})"
        if self.selection is None:
            return f"{what}: the least predicted KLD ({self.chosen.predicted:.5f}), not verified (--verify-top 0)"
        tokens = self.selection.sequences * self.selection.seq_len
        measured = (f"{what} measured least of {len(self.candidates)} candidates on {tokens} selection tokens "
                    f"({self.kld(self.chosen):.5f} ± {self.error(self.chosen):.5f}, "
                    f"predicted {self.chosen.predicted:.5f})")
        if not self.overruled:
            return f"{measured}, as predicted"
        gap = self.kld(self.predicted) - self.kld(self.chosen)
        paired = self.error(self.predicted, self.chosen)
        return (f"{measured}, not the predicted best {self.predicted.name} ({self.predicted.layout.label}, "
                f"{human_bytes(self.predicted.bytes)}, predicted {self.predicted.predicted:.5f}, measured "
                f"{self.kld(self.predicted):.5f}): {gap:.5f} ± {paired:.5f} less"
                + (" (within one standard error of the difference: indistinguishable here)" if gap < paired else ""))


def family_factors(mixes: list[Mix], selection: Measured) -> dict[str, float]:
    """Each family's measured over predicted KLD on the selection windows, pooled over its candidates there: how
    far the pass's estimate is off for that family on text it did not read (the interaction of its formats that
    its uniform track did not capture, and the text)."""
    sums: dict[str, list[float]] = {}
    for mix in mixes:
        pair = sums.setdefault(mix.layout.label, [0.0, 0.0])
        pair[0] += selection.mix_kld(track_label(mix))
        pair[1] += mix.predicted
    return {family: measured / predicted for family, (measured, predicted) in sums.items() if predicted > 0}


def choose(mixes: list[Mix], selection: Measured | None, factors: dict[str, float] | None = None) -> Choice:
    """The least measured of ``mixes`` (ties: fewer bytes), beside the least predicted; ``factors``: the
    families' corrections (default: from ``mixes`` alone)."""
    predicted = min(mixes, key=lambda m: (m.predicted, m.bytes))
    if selection is None:
        return Choice(predicted, predicted, [predicted], None)
    chosen = min(mixes, key=lambda m: (selection.mix_kld(track_label(m)), m.bytes))
    return Choice(chosen, predicted, mixes, selection,
                  family_factors(mixes, selection) if factors is None else factors)


def choose_at(plan: AutomixPlan, measured: Measured, capacities: dict[str, int | None],
              ids: torch.Tensor) -> dict[str, Choice]:
    """The verified choice within each named capacity (None: the user's budget), the candidates of all of them
    measured in one selection pass over ``ids``; with ``--verify-top 0``, the least predicted, unverified."""
    sets = {name: candidates(plan, measured, capacity) for name, capacity in capacities.items()}
    if any(not mixes for mixes in sets.values()):
        raise DSV4Error("no mix fits the budget")
    if not plan.options.verify_top:
        return {name: choose(mixes, None) for name, mixes in sets.items()}
    union = list({track_label(m): m for mixes in sets.values() for m in mixes}.values())
    selection = measure_candidates(plan, union, ids)
    factors = family_factors(union, selection)
    return {name: choose(mixes, selection, factors) for name, mixes in sets.items()}
