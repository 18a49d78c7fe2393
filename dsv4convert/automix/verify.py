"""Verification: convert a mix with the converter, measure it with ``compare``, and the Pareto table.

Every row is a real checkpoint: written by :func:`dsv4convert.convert.execute.convert` from its recipe and
compared with the base by :mod:`dsv4convert.compare` on the held-out windows (the variant under its served
numerics, the base weights only: the reference the sensitivity pass measured against), which neither the
pass nor the choice read. The rows are the uniform layout of every family, the all-BF16 layout, the naive
mix (the first and last layers' decisions in BF16, the rest the family's main format: the heuristic
auto-round's AutoScheme was shown to beat), and automix's verified choice (:mod:`dsv4convert.automix.choose`)
at the user's budget and at each of those rows' bytes, so that each baseline meets automix at equal or fewer
bytes.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from dsv4convert.automix.choose import Choice, track_label
from dsv4convert.automix.plan import AutomixPlan, Layout, Mix, picks_key, uniform_picks
from dsv4convert.automix.sensitivity import Measured
from dsv4convert.compare.run import CompareOptions
from dsv4convert.compare.run import build_plan as build_compare
from dsv4convert.compare.run import run as run_compare
from dsv4convert.convert.execute import ConvertOptions, convert
from dsv4convert.convert.plan import human_bytes
from dsv4convert.formats import Format


@dataclass
class Row:
    name: str
    kind: str                  # uniform | naive | automix
    layout: str
    bytes: int
    predicted: float
    measured: float | None = None
    standard_error: float | None = None
    same_top1: float | None = None
    served_as: str | None = None
    selection: float | None = None       # measured on the selection windows (automix's candidates)
    corrected: float | None = None       # predicted x its family's measured/predicted on the selection windows
    note: str | None = None              # the choice's verdict, where the measurement overruled the estimate

    def to_json(self) -> dict:
        return dict(vars(self))


def write_mix(plan: AutomixPlan, mix: Mix, measured: Measured, dst: Path, *, overwrite: bool = False) -> Path:
    """Convert ``mix`` into ``dst`` (its recipe saved beside the weights as ``automix-recipe.yaml``)."""
    recipe = mix.recipe(plan, measured, f"{mix.name}: per-layer formats chosen by dsv4convert automix",
                        f"{dst}/automix-recipe.yaml")
    convert(ConvertOptions(src=plan.options.src, dst=dst, recipe=recipe, engine=plan.options.engine,
                           calibration=plan.options.calibration, progress=plan.options.progress,
                           device=plan.options.device, overwrite=overwrite))
    (dst / "automix-recipe.yaml").write_text(recipe.text, encoding="utf-8")
    return dst


def compare_mix(plan: AutomixPlan, variant: Path, heldout: torch.Tensor) -> dict:
    """``compare`` of a written mix against the base on the held-out ids: its ``compare.json`` content."""
    opts = plan.options
    compare_opts = CompareOptions(base=opts.src, variant=str(variant), ids=heldout, seq_len=heldout.shape[1],
                                  tokens=heldout.numel(), numerics="served", base_numerics="weights",
                                  engine="sglang", gpu_family=plan.gpu_family, device=opts.device, dtype=opts.dtype,
                                  chunk=opts.chunk, mtp=False, progress=opts.progress)
    return run_compare(build_compare(compare_opts))


def measure_row(plan: AutomixPlan, mix: Mix, kind: str, measured: Measured, heldout: torch.Tensor,
                work: Path, keep: Path | None = None, choice: Choice | None = None) -> Row:
    """Write, compare and (unless ``keep``) delete one mix; its row of the table (with what the choice measured of
    it, when it was chosen)."""
    dst = keep or work / mix.name
    write_mix(plan, mix, measured, dst, overwrite=keep is None)
    try:
        result = compare_mix(plan, dst, heldout)
    finally:
        if keep is None:
            shutil.rmtree(dst, ignore_errors=True)
    output = result["output"]
    verified = choice is not None and choice.selection is not None
    return Row(mix.name, kind, mix.layout.label, mix.bytes, mix.predicted, output["kld"]["mean"],
               output["kld"]["standard_error"], output["same_top1"], result["variant"]["numerics"]["serving"]
               ["variant_rules"], selection=choice.kld(choice.chosen) if verified else None,
               corrected=choice.corrected(mix) if choice is not None else None,
               note=choice.verdict() if verified and choice.overruled else None)


# Most precise first: what "high precision" means for the naive mix, within what a family allows.
PRECISION = (Format.BF16, Format.FP8, Format.MXFP4, Format.NVFP4, Format.INT4)


def naive_picks(layout: Layout) -> dict:
    """The first and last layers' decisions at their most precise option, the rest uniform."""
    picks = uniform_picks(layout)
    layers = sorted({int(d.block.split(".")[1]) for d in picks})
    ends = {f"layers.{layers[0]}", f"layers.{layers[-1]}"}
    for decision, options in layout.options.items():
        if decision.block in ends:
            picks[decision] = min(options, key=PRECISION.index)
    return picks


def baselines(plan: AutomixPlan, measured: Measured) -> list[tuple[str, Mix]]:
    """The servable uniform layouts (each family's main format, and all BF16 once) and each family's naive mix."""
    rows = [("uniform", plan.mix(layout, picks, measured, name)) for name, layout, picks in plan.uniform_layouts()]
    seen = {picks_key(mix.picks) for _, mix in rows}
    for layout in plan.layouts:
        picks = naive_picks(layout)
        if picks_key(picks) not in seen:
            seen.add(picks_key(picks))
            rows.append(("naive", plan.mix(layout, picks, measured, f"naive-{layout.slug}")))
    return rows


def pareto(plan: AutomixPlan, measured: Measured, heldout: torch.Tensor, work: Path, choices: dict[str, Choice],
           chosen: Mix | None) -> list[Row]:
    """Every baseline, and automix's choice at each baseline's bytes (``choices``, by baseline name) and at the
    user's budget (``chosen``, when not converted already), measured on the held-out windows; a mix stored
    twice (a choice that is a baseline's own mix, or the same choice at two budgets) is converted once."""
    done: dict[tuple, Row] = {}
    factors = next(iter(choices.values())).factors if choices else {}    # one selection pass: the same for all

    def row(mix: Mix, kind: str, choice: Choice | None = None) -> Row:
        verified = choice is not None and choice.selection is not None
        key = picks_key(mix.picks)
        if key not in done:
            done[key] = measure_row(plan, mix, kind, measured, heldout, work)
        factor = factors.get(mix.layout.label)
        return replace(done[key], name=mix.name, kind=kind, layout=mix.layout.label, bytes=mix.bytes,
                       predicted=mix.predicted, selection=choice.kld(choice.chosen) if verified else None,
                       note=choice.verdict() if verified and choice.overruled else None,
                       corrected=mix.predicted * factor if factor is not None else None)

    table = [row(mix, kind) for kind, mix in baselines(plan, measured)]
    table += [row(replace(choice.chosen, name=f"automix-at-{name}"), "automix", choice)
              for name, choice in choices.items()]
    if chosen is not None:
        table.append(row(chosen, "automix"))
    return sorted(table, key=lambda r: (r.bytes, r.name))


def rank_agreement(rows: list[Row]) -> float:
    """Kendall's tau between the predicted and the measured KLD of the measured rows: 1 when the predictions
    order every pair of mixes as the measurements do (ties in either count for neither)."""
    pairs = [(r.predicted, r.measured) for r in rows if r.measured is not None]
    agree = disagree = 0
    for i, (p1, m1) in enumerate(pairs):
        for p2, m2 in pairs[i + 1:]:
            sign = (p1 - p2) * (m1 - m2)
            agree += sign > 0
            disagree += sign < 0
    return (agree - disagree) / (agree + disagree) if agree + disagree else float("nan")


def by_family(pairs: list[tuple[str, float, float]]) -> dict[str, tuple[float, float, int]]:
    """Measured over predicted KLD per family, from (family, predicted, measured): (least, most, mixes)."""
    ratios: dict[str, list[float]] = {}
    for family, predicted, measured in pairs:
        if predicted > 0:
            ratios.setdefault(family, []).append(measured / predicted)
    return {family: (min(r), max(r), len(r)) for family, r in sorted(ratios.items())}


def selection_pairs(choices: list[Choice]) -> list[tuple[Mix, Choice]]:
    """Every candidate measured on the selection windows, once (the choices share one selection pass)."""
    seen: dict[str, tuple[Mix, Choice]] = {}
    for choice in choices:
        if choice.selection is not None:
            for mix in choice.candidates:
                seen.setdefault(track_label(mix), (mix, choice))
    return sorted(seen.values(), key=lambda mc: (mc[0].bytes, mc[0].name))


def render(plan: AutomixPlan, measured: Measured, rows: list[Row], chosen: Row | None,
           choices: list[Choice] = ()) -> str:
    """The report's markdown: the choice and its candidates, predicted against measured per family, the Pareto
    table (``choices``: the user's choice first, then the report's)."""
    lines = [f"# automix: {plan.options.src}", "",
             f"--engine {plan.options.engine}, {plan.gpu_family}; sensitivity on {measured.positions} positions "
             f"({measured.sequences} x {measured.seq_len} tokens), the choice verified on selection windows, the "
             f"table measured on held-out windows neither read; reference: the base weights only; floor (served "
             f"caches) " + ", ".join(f"{k}: {v:.5f}" for k, v in measured.floors.items()), ""]
    if chosen is not None:
        corrected = f" (corrected for its family {chosen.corrected:.5f})" if chosen.corrected else ""
        lines += [f"Chosen: **{chosen.name}** ({chosen.layout}), {human_bytes(chosen.bytes)}; predicted KLD "
                  f"{chosen.predicted:.5f}{corrected}, measured {chosen.measured:.5f} ± {chosen.standard_error:.5f}", ""]
    if choices and choices[0].selection is not None:
        lines += [f"Choice: {choices[0].verdict()}", ""]
    measured_rows = [r for r in rows if r.measured is not None and r.predicted > 0]
    if len(measured_rows) > 1:
        ratios = [r.measured / r.predicted for r in measured_rows]
        lines += [f"Measured / predicted KLD over {len(measured_rows)} mixes: {min(ratios):.2f}-{max(ratios):.2f}; "
                  f"the predictions order {rank_agreement(measured_rows):.2f} of the pairs as measured (Kendall's "
                  "tau)", ""]
    held = by_family([(r.layout, r.predicted, r.measured) for r in measured_rows])
    held_corrected = by_family([(r.layout, r.corrected, r.measured) for r in measured_rows if r.corrected])
    candidates = selection_pairs(list(choices))
    chose = by_family([(m.layout.label, m.predicted, c.kld(m)) for m, c in candidates])
    if held or chose:
        factors = choices[0].factors if choices else {}
        lines += ["Measured / predicted KLD per family (corrected: the prediction times the family's measured/predicted "
                  "on the selection windows, pooled over its candidates there):", "",
                  "| family | factor | held-out rows | held-out rows, corrected | selection candidates |",
                  "|---|---|---|---|---|"]

        def cell(stats: tuple[float, float, int] | None) -> str:
            return f"{stats[0]:.2f}-{stats[1]:.2f} ({stats[2]})" if stats else "-"

        for family in sorted({*held, *chose}):
            factor = f"{factors[family]:.2f}" if family in factors else "-"
            lines.append(f"| {family} | {factor} | {cell(held.get(family))} | {cell(held_corrected.get(family))} | "
                         f"{cell(chose.get(family))} |")
        lines.append("")
    lines += ["| recipe | kind | family | bytes | predicted KLD | corrected | selection KLD | measured KLD | "
              "measured/predicted | measured/corrected | same top-1 |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = r.measured / r.predicted if r.measured is not None and r.predicted > 0 else float("nan")
        ratio_corrected = f"{r.measured / r.corrected:.2f}" if r.measured is not None and r.corrected else "-"
        measured_text = f"{r.measured:.5f} ± {r.standard_error:.5f}" if r.measured is not None else "-"
        corrected = f"{r.corrected:.5f}" if r.corrected is not None else "-"
        selection = f"{r.selection:.5f}" if r.selection is not None else "-"
        top1 = f"{r.same_top1:.4f}" if r.same_top1 is not None else "-"
        lines.append(f"| {r.name} | {r.kind} | {r.layout} | {human_bytes(r.bytes)} | {r.predicted:.5f} | {corrected} | "
                     f"{selection} | {measured_text} | {ratio:.2f} | {ratio_corrected} | {top1} |")
    notes = [f"- {r.name}: {r.note}" for r in rows if r.note]
    if notes:
        lines += ["", "Where the measurement overruled the estimate:", "", *notes]
    if candidates:
        tokens = candidates[0][1].selection.sequences * candidates[0][1].selection.seq_len
        lines += ["", f"Candidates measured whole on the {tokens} selection tokens:", "",
                  "| candidate | family | bytes | predicted KLD | selection KLD | measured/predicted |",
                  "|---|---|---|---|---|---|"]
        for mix, choice in candidates:
            kld = choice.kld(mix)
            lines.append(f"| {mix.name} | {mix.layout.label} | {human_bytes(mix.bytes)} | {mix.predicted:.5f} | "
                         f"{kld:.5f} ± {choice.error(mix):.5f} | {kld / mix.predicted:.2f} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[Row], path: Path, unit: str) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for kind, marker in (("uniform", "s"), ("naive", "^"), ("automix", "o")):
        pts = [(r.bytes / 1e9, r.measured) for r in rows if r.kind == kind and r.measured is not None]
        if pts:
            ax.scatter(*zip(*pts), marker=marker, label=f"{kind} (measured)", zorder=3)
    auto = sorted((r.bytes / 1e9, r.measured, r.predicted) for r in rows if r.kind == "automix" and r.measured)
    if auto:
        ax.plot([a[0] for a in auto], [a[1] for a in auto], "-", alpha=0.5)
        ax.scatter([a[0] for a in auto], [a[2] for a in auto], marker="x", color="gray", label="automix (predicted)")
    ax.set_xlabel(f"GB ({unit})")
    ax.set_ylabel("mean KLD vs base (nats)")
    ax.set_yscale("log")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_report(plan: AutomixPlan, measured: Measured, rows: list[Row], chosen: Row | None, out: Path,
                 choices: list[Choice] = ()) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    candidates = selection_pairs(list(choices))
    data = {"options": {k: str(v) if isinstance(v, Path) else v for k, v in vars(plan.options).items()},
            "gpu_family": plan.gpu_family, "sensitivity": measured.to_json(),
            "layouts": [{"label": lay.label, "capacity": lay.capacity, "fixed_bytes": lay.fixed_bytes,
                         "unit": lay.unit.describe(), "notes": lay.notes} for lay in plan.layouts],
            "excluded": [{"name": e.name, "reason": e.reason} for e in plan.excluded],
            "chosen": chosen.to_json() if chosen else None,
            "choice": choices[0].verdict() if choices and choices[0].selection is not None else None,
            "family_factors": choices[0].factors if choices else {},
            "candidates": [{"name": m.name, "layout": m.layout.label, "bytes": m.bytes, "predicted": m.predicted,
                            "selection": c.kld(m), "selection_error": c.error(m)} for m, c in candidates],
            "selection_seconds": candidates[0][1].selection.seconds if candidates else None,
            "rows": [r.to_json() for r in rows]}
    paths = [out / "automix.json", out / "automix.md"]
    paths[0].write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    paths[1].write_text(render(plan, measured, rows, chosen, choices), encoding="utf-8")
    if any(r.measured is not None for r in rows):
        paths.append(plot(rows, out / "pareto.png", plan.layouts[0].unit.describe()))
    return paths
