"""``automix``: plan (menu, candidates, budget), check, measure, solve, write, convert, verify.

Everything that can be refused is refused before the sensitivity pass starts: the base must be a
DeepSeek-V4 checkpoint, the engine and GPU family must admit a family of mixed layouts
(:func:`dsv4convert.automix.menu.menu`), each family's uniform layout must get a quantization config the
engines load (:func:`dsv4convert.convert.quant_config.build_quant_config`), the text must hold the tokens
asked for, and the budget must admit at least the smallest mix of some family.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dsv4convert.automix import budget as budgets
from dsv4convert.automix.candidates import (
    GROUP_OF_LOCAL,
    LINEAR_GROUPS,
    Candidate,
    Decision,
    decisions,
    is_exact,
    scheme_of,
)
from dsv4convert.automix.menu import Excluded, Family, menu
from dsv4convert.automix.recipe import Line, write
from dsv4convert.automix.sensitivity import (
    Calibration,
    Measured,
    Probe,
    floor_label,
    floor_numerics,
    measure,
    stream_bytes,
)
from dsv4convert.automix.solve import Option, solve
from dsv4convert.calibration import build_input_scales
from dsv4convert.checkpoint import Checkpoint
from dsv4convert.compare.numerics import Numerics, serving_from_formats
from dsv4convert.convert.plan import build_plan, human_bytes
from dsv4convert.convert.recipe import Recipe
from dsv4convert.engines import SGLANG_LABEL, engines_for
from dsv4convert.engines.config import build_quant_config
from dsv4convert.engines.sglang.numerics import Serving
from dsv4convert.engines.vllm.memory import LOAD_RULES as VLLM_RULES
from dsv4convert.errors import DSV4Error, RecipeError
from dsv4convert.fit.source import from_plan
from dsv4convert.fit.verdict import Gpu, gpu_from, sglang_server, vllm_server
from dsv4convert.formats import Format
from dsv4convert.inspection import Inspection, inspect_checkpoint
from dsv4convert.layout import linear_shapes
from dsv4convert.model.blocks import COMPUTE_DTYPES, parse_device
from dsv4convert.model.text import token_windows


@dataclass
class AutomixOptions:
    src: str
    dst: str | None = None
    size: int | None = None              # --size: checkpoint bytes
    gpu: str | None = None               # --gpu/--tp/--kv-tokens: bytes per GPU
    tp: int | None = None
    kv_tokens: int | None = None
    mtp: bool = False                    # count the MTP draft's weights and KV (fit --mtp)
    engine: str = "sglang"
    gpu_family: str | None = None        # default: the --gpu's family, else sm120
    text: Path | None = None
    tokens: int = 8192                   # sensitivity pass
    verify_tokens: int = 8192            # held-out, for compare
    seq_len: int = 2048
    device: str = "cpu"
    dtype: str | None = None
    chunk: int = 2048
    calibration: Path | None = None      # NVFP4 input scales (as convert --calibration)
    report: Path | None = None
    progress: bool = True


@dataclass
class Layout:
    """One family as the solver sees it: its options per decision and the bytes no decision changes."""

    family: Family
    forced: dict[str, Format]            # decision groups in one format for the whole model (group -> format)
    serving: Serving
    options: dict[Decision, list[Format]]
    fixed_bytes: int
    unit: budgets.Unit
    capacity: int
    sources: dict[Decision, Format | None]
    notes: list[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        if not self.forced:
            return self.family.name
        fmts = set(self.forced.values())
        what = "linears" if len(self.forced) > 1 and len(fmts) == 1 else ", ".join(self.forced)
        return f"{self.family.name} ({what} {'/'.join(sorted(f.value for f in fmts))})"

    @property
    def slug(self) -> str:
        return self.label.replace("+", "-").replace(" (", "-").replace(")", "").replace(" ", "-").replace("/", "-")


@dataclass
class Mix:
    """A solved mix: its layout, its choice per decision, its bytes and predicted KLD."""

    layout: Layout
    picks: dict[Decision, Format]
    bytes: int
    predicted: float
    name: str = "automix"

    def recipe(self, plan: "AutomixPlan", measured: Measured, description: str, source: str | None = None) -> Recipe:
        lines = []
        for decision, fmt in self.picks.items():
            chosen = plan.cost(self.layout, decision, fmt, measured)
            others = ", ".join(f"{o.value} {plan.cost(self.layout, decision, o, measured):+.5f} at "
                               f"{human_bytes(plan.option_bytes(self.layout, decision, o))}"
                               for o in self.layout.options[decision] if o is not fmt)
            comment = (f"{decision.block} {decision.group}: {fmt.value}, predicted KLD {chosen:+.5f}, "
                       f"{human_bytes(plan.option_bytes(self.layout, decision, fmt))}"
                       + (f" (else {others})" if others else ""))
            lines.append(Line(decision, fmt, comment))
        header = [f"written by dsv4convert automix: family {self.layout.label}, {self.layout.unit.describe()}",
                  f"predicted mean KLD {self.predicted:.5f} (floor {plan.floor(self.layout, measured):.5f} + choices), "
                  f"{human_bytes(self.bytes)} of {human_bytes(self.layout.capacity)}"]
        return write(self.name, description, plan.options.engine, lines, self.layout.sources,
                     self.layout.family.mtp_experts, tuple(header), self.layout.forced, source)


@dataclass
class AutomixPlan:
    options: AutomixOptions
    ckpt: Checkpoint
    inspection: Inspection
    decisions: dict[Decision, list[str]]
    layouts: list[Layout]
    excluded: list[Excluded]
    probes: list[Probe]
    floors: dict[str, Numerics]
    calibrations: list[Calibration]
    gpu: Gpu | None
    gpu_family: str
    device: torch.device
    dtype: torch.dtype
    memory: dict[str, int]
    _bytes: dict = field(default_factory=dict, repr=False)
    _calibration_of: dict = field(default_factory=dict, repr=False)
    _shapes: dict = field(default_factory=dict, repr=False)

    def cost(self, layout: Layout, decision: Decision, fmt: Format, measured: Measured) -> float:
        """The predicted KLD a decision adds: its isolated cost, scaled by its format's calibration."""
        scheme = scheme_of(decision.group, fmt, layout.serving)
        if is_exact(scheme, layout.sources.get(decision)):
            return 0.0
        candidate = Candidate(decision, scheme)
        return measured.costs[candidate] * self.scale(candidate, measured)

    def scale(self, candidate: Candidate, measured: Measured) -> float:
        """Measured KLD of the candidate's calibration track over the sum of its members' isolated costs."""
        if not self._calibration_of:
            # the first calibration holding a candidate, as the pass ran them (reversed: earlier ones overwrite)
            self._calibration_of = {p.candidate: c for c in reversed(self.calibrations) for p in c.probes}
        calibration = self._calibration_of[candidate]
        isolated = sum(measured.costs[p.candidate] for p in calibration.probes)
        return measured.calibrations[calibration.label] / isolated if isolated > 0 else 1.0

    def floor(self, layout: Layout, measured: Measured) -> float:
        return measured.floors[floor_label(layout.serving)]

    def option_bytes(self, layout: Layout, decision: Decision, fmt: Format) -> int:
        """Bytes of one decision stored as ``fmt``, in the layout's unit."""
        key = (layout.label, decision, fmt)
        if key not in self._bytes:
            if not self._shapes:
                self._shapes = linear_shapes(self.inspection.config)
            shapes = self._shapes
            vllm_experts = decision.group == "experts" and "vllm" in engines_for(self.options.engine)
            scale = "F32" if fmt is Format.FP8 and vllm_experts else "F8_E8M0"
            tensors = [t for m in self.decisions[decision] for t in budgets.stored(m, fmt, shapes[m], scale)]
            self._bytes[key] = layout.unit.count(tensors)
        return self._bytes[key]

    def solve(self, measured: Measured, capacity: int | None = None) -> Mix | None:
        """The least-predicted-KLD mix over every layout within ``capacity`` (default: each layout's own)."""
        best = None
        for layout in self.layouts:
            limit = (layout.capacity if capacity is None else capacity) - layout.fixed_bytes
            order = list(layout.options)
            groups = [[Option(f.value, self.option_bytes(layout, d, f), self.cost(layout, d, f, measured))
                       for f in layout.options[d]] for d in order]
            picked = solve(groups, limit)
            if picked is None:
                continue
            picks = {d: layout.options[d][i] for d, i in zip(order, picked)}
            mix = self.mix(layout, picks, measured)
            if best is None or (mix.predicted, mix.bytes) < (best.predicted, best.bytes):
                best = mix
        return best

    def mix(self, layout: Layout, picks: dict[Decision, Format], measured: Measured, name: str = "automix") -> Mix:
        size = layout.fixed_bytes + sum(self.option_bytes(layout, d, f) for d, f in picks.items())
        predicted = self.floor(layout, measured) + sum(self.cost(layout, d, f, measured) for d, f in picks.items())
        return Mix(layout, picks, size, predicted, name)


# ------------------------------------------------------------------------------------------- planning

def uniform_picks(layout: Layout) -> dict[Decision, Format]:
    """Every decision at its first option: the family's main expert format, its first linear format."""
    return {decision: options[0] for decision, options in layout.options.items()}


def build(opts: AutomixOptions) -> AutomixPlan:
    """Everything but the measurement: see the module docstring."""
    ckpt = Checkpoint.open(opts.src)
    inspection = inspect_checkpoint(ckpt)
    if not inspection.ok:
        first = inspection.first_problem()
        raise DSV4Error(f"base checkpoint does not match the DeepSeek-V4 layout its config.json describes ({first})",
                        file=ckpt.root)
    budget_kinds = [opts.size is not None, any(v is not None for v in (opts.gpu, opts.tp, opts.kv_tokens))]
    if sum(budget_kinds) != 1:
        raise DSV4Error("give the budget as --size SIZE, or as --gpu G --tp N --kv-tokens T (not both)")
    gpu = None
    if opts.gpu is not None or opts.tp is not None or opts.kv_tokens is not None:
        if opts.gpu is None or opts.tp is None or opts.kv_tokens is None:
            raise DSV4Error("--gpu, --tp and --kv-tokens go together: the budget is bytes per GPU at that TP with "
                            "that many tokens of KV")
        if opts.tp < 1 or opts.kv_tokens < 1:
            raise DSV4Error(f"--tp and --kv-tokens must be positive, got {opts.tp} and {opts.kv_tokens}")
        gpu = gpu_from(opts.gpu, opts.gpu_family)
    gpu_family = opts.gpu_family or (gpu.family if gpu else "sm120")
    families, excluded = menu(opts.engine, gpu_family)
    if not families:
        reasons = "; ".join(f"{e.name}: {e.reason}" for e in excluded)
        raise DSV4Error(f"--engine {opts.engine} on {gpu_family}: no mixed layout is servable ({reasons})")
    device = parse_device(opts.device)
    dtype_name = opts.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    if dtype_name not in COMPUTE_DTYPES:
        raise DSV4Error(f"--dtype must be one of {', '.join(COMPUTE_DTYPES)}, got {dtype_name!r}")
    dtype = COMPUTE_DTYPES[dtype_name]
    decision_list = decisions(inspection)
    sources = {d: inspection.modules[mods[0]].format for d, mods in decision_list.items()}
    base = _Base(opts, ckpt, decision_list, sources, gpu, gpu_family)
    made = [_layout(base, family, forced) for family in families for forced in _model_wide(family)]
    layouts = [m for m in made if isinstance(m, Layout)]
    if not layouts:
        raise DSV4Error(f"no family's layout could be planned for --engine {opts.engine} on {gpu_family}")
    probes: dict[Candidate, Probe] = {}
    floors: dict[str, Numerics] = {}
    for layout in layouts:
        floors[floor_label(layout.serving)] = floor_numerics(layout.serving)
        for decision, options in layout.options.items():
            for fmt in options:
                scheme = scheme_of(decision.group, fmt, layout.serving)
                if not is_exact(scheme, sources[decision]):
                    candidate = Candidate(decision, scheme)
                    probes.setdefault(candidate, Probe(candidate, tuple(decision_list[decision]), layout.serving))
    calibrations = _calibrations(layouts, probes)
    cfg = inspection.config
    tracks = len(floors) + len(calibrations)
    memory = {"stream_bytes": stream_bytes(len(probes) + tracks + 2, max(opts.tokens // opts.seq_len, 1) * opts.seq_len,
                                           cfg.hc_mult, cfg.hidden_size, dtype),
              "layer_passes": sum(_passes_after(cfg, p.candidate.decision.block) for p in probes.values())}
    plan = AutomixPlan(opts, ckpt, inspection, decision_list, layouts,
                       [*excluded, *(m for m in made if isinstance(m, Excluded))], list(probes.values()), floors,
                       calibrations, gpu, gpu_family, device, dtype, memory)
    smallest = [(layout, layout.fixed_bytes + sum(min(plan.option_bytes(layout, d, f) for f in fmts)
                                                  for d, fmts in layout.options.items())) for layout in plan.layouts]
    if all(size > layout.capacity for layout, size in smallest):
        layout, size = min(smallest, key=lambda ls: ls[1] - ls[0].capacity)
        raise DSV4Error(f"the budget ({human_bytes(layout.capacity)} of {layout.unit.describe()}) is below the smallest "
                        f"mix any family can store ({layout.label}: {human_bytes(size)})")
    return plan


def _calibrations(layouts: list[Layout], probes: dict[Candidate, Probe]) -> list[Calibration]:
    """One whole-model track per format (and its serving) a layout offers: the experts in it everywhere, or
    every linear decision in it."""
    out: dict[str, Calibration] = {}
    for layout in layouts:
        kinds: dict[str, list[Probe]] = {}
        for decision, options in layout.options.items():
            for fmt in options:
                scheme = scheme_of(decision.group, fmt, layout.serving)
                probe = probes.get(Candidate(decision, scheme))
                if probe is None:
                    continue
                kind = "experts" if decision.group == "experts" else "linears"
                kinds.setdefault(f"{kind} {fmt.value} ({probe.candidate.scheme.rounding or 'weights only'})",
                                 []).append(probe)
        for label, members in kinds.items():
            out.setdefault(label, Calibration(label, tuple(members)))
    return list(out.values())


def _passes_after(cfg, block: str) -> int:
    return cfg.num_hidden_layers - int(block.split(".")[1])


def _model_wide(family: Family) -> list[dict[str, Format]]:
    """The family's layouts: one per format of the groups it fixes for the whole model (all its linears, one
    format; or SGLang's wo_a), or the one layout."""
    groups = list(LINEAR_GROUPS) if not family.linears_per_layer else [
        GROUP_OF_LOCAL[local] for local in family.model_wide_linears]
    if not groups:
        return [{}]
    return [{group: fmt for group in groups} for fmt in family.linears]


@dataclass(frozen=True)
class _Base:
    """What every layout of a plan is made from: the options, the base, its decisions, the budget's GPU."""

    options: AutomixOptions
    ckpt: Checkpoint
    decisions: dict[Decision, list[str]]
    sources: dict[Decision, Format | None]
    gpu: Gpu | None
    gpu_family: str


def _layout(base: _Base, family: Family, forced: dict[str, Format]) -> Layout | Excluded:
    """The family's layout: its uniform plan checked by the converter's own rules, its serving and its bytes (or
    why the base cannot be stored this way)."""
    opts, sources = base.options, base.sources
    options = {d: list(family.experts) if d.group == "experts"
               else [forced[d.group]] if d.group in forced else list(family.linears) for d in base.decisions}
    recipe = write(f"automix-{family.name.replace('+', '-')}", f"uniform layout of family {family.name}", opts.engine,
                   [Line(d, formats[0], "uniform") for d, formats in options.items()], sources, family.mtp_experts,
                   model_wide=forced, source=f"automix family {family.name}")
    try:
        uniform = build_plan(base.ckpt, recipe, engine=opts.engine)
        formats = uniform.module_formats()
        config, _ = build_quant_config(base.ckpt.config, formats, engines=engines_for(opts.engine))
    except RecipeError as exc:
        return Excluded(family.name, f"the base cannot be stored this way: {exc}")
    serving = serving_from_formats("automix", formats, config.get("quantization_config") or {}, engine="sglang",
                                   gpu_family=base.gpu_family)
    notes = []
    if base.gpu is None:
        unit, capacity = budgets.Unit(), int(opts.size)
    else:
        source = from_plan(family.name, uniform, base.ckpt.config, engines_for(opts.engine))
        rules = (budgets.sglang_rules(source, base.gpu, opts.tp, opts.mtp) if opts.engine != "vllm"
                 else VLLM_RULES)
        unit = budgets.Unit(opts.tp, rules, opts.mtp)
        capacity, notes = budgets.allowance(source, base.gpu, opts.tp, opts.kv_tokens, engine=opts.engine,
                                            mtp=opts.mtp)
    decided = {m for mods in base.decisions.values() for m in mods}
    fixed = [(p.name, p.dtype, tuple(p.shape)) for job in uniform.modules.values() if job.module not in decided
             for p in job.outputs]
    return Layout(family, forced, serving, options, unit.count(fixed), unit, capacity, sources, notes)


def check_fit(plan: AutomixPlan, mix: Mix, measured: Measured) -> list[str]:
    """``fit`` of the mix as the converter would write it, per engine asked for (the budget's sums, checked
    whole); raises when a server would not hold ``--kv-tokens``."""
    if plan.gpu is None:
        return []
    opts = plan.options
    recipe = mix.recipe(plan, measured, "fit check", "automix recipe (fit check)")
    source = from_plan(mix.name, build_plan(plan.ckpt, recipe, engine=opts.engine), plan.ckpt.config,
                       engines_for(opts.engine))
    lines = []
    for engine in engines_for(opts.engine):
        fit = (sglang_server(source, plan.gpu, "server", opts.tp, mtp=opts.mtp, context=opts.kv_tokens)
               if engine == "sglang" else vllm_server(source, plan.gpu, opts.tp, mtp=opts.mtp, context=opts.kv_tokens))
        line = (f"fit ({engine}): {fit.weights_bytes_per_rank / 2**30:.2f} GiB of weights per GPU, "
                f"{fit.kv_tokens} KV tokens at TP {opts.tp} on {plan.gpu.name} (asked {opts.kv_tokens})")
        if not fit.fits:
            raise DSV4Error(f"the chosen mix does not fit after all: {line}")
        lines.append(line)
    return lines


# ------------------------------------------------------------------------------------------- measuring

def windows(plan: AutomixPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """(sensitivity ids, held-out ids) from ``--text``: disjoint windows of ``--seq-len`` tokens."""
    opts = plan.options
    if opts.text is None:
        raise DSV4Error("no data: give --text FILE (UTF-8 text, or JSONL with a \"text\" field); the sensitivity pass "
                        "and the held-out verification both read it, nothing is downloaded")
    if opts.seq_len < 2 or opts.tokens < opts.seq_len or opts.verify_tokens < opts.seq_len:
        raise DSV4Error(f"--tokens and --verify-tokens must each hold one --seq-len {opts.seq_len} window at least")
    return token_windows(plan.ckpt.root, Path(opts.text), num_sequences=opts.tokens // opts.seq_len,
                         seq_len=opts.seq_len, holdout=opts.verify_tokens // opts.seq_len,
                         vocab_size=plan.inspection.config.vocab_size)


def run_sensitivity(plan: AutomixPlan, ids: torch.Tensor) -> Measured:
    needs_scales = any(Format.NVFP4 in layout.family.experts for layout in plan.layouts)
    scales = build_input_scales(plan.ckpt, calibration=plan.options.calibration) if needs_scales else None
    return measure(plan.ckpt, plan.inspection, ids, plan.probes, plan.floors, plan.calibrations, device=plan.device,
                   dtype=plan.dtype, chunk=plan.options.chunk, input_scales=scales, progress=plan.options.progress)


def print_plan(plan: AutomixPlan, out=None) -> None:
    out = out or sys.stdout
    opts = plan.options
    cfg = plan.inspection.config
    print(f"automix: {opts.src} -> {opts.dst or '(no checkpoint)'}; --engine {opts.engine}, {plan.gpu_family}", file=out)
    print(f"  decisions: {len(plan.decisions)} over {cfg.num_hidden_layers} layers "
          f"({', '.join(sorted({d.group for d in plan.decisions}))})", file=out)
    for layout in plan.layouts:
        fmts = "/".join(f.value for f in layout.family.experts)
        linear = "/".join(f.value for f in layout.family.linears)
        print(f"  family {layout.label}: experts {fmts} per layer, linears {linear}; fixed "
              f"{human_bytes(layout.fixed_bytes)}, budget {human_bytes(layout.capacity)} ({layout.unit.describe()})",
              file=out)
        for note in layout.notes:
            print(f"    {note}", file=out)
    for e in plan.excluded:
        print(f"  not on the menu: {e.name}: {e.reason}", file=out)
    if "vllm" in engines_for(opts.engine):
        print(f"  note: candidates are measured under {SGLANG_LABEL}'s served numerics on {plan.gpu_family} (compare "
              "emulates SGLang only); vLLM's kernels may round differently", file=out)
    print(f"  sensitivity: {len(plan.probes)} candidates measured ({plan.memory['layer_passes']} extra layer passes "
          f"beside the {cfg.num_hidden_layers} of the reference), {len(plan.floors)} floor and "
          f"{len(plan.calibrations)} calibration track(s), "
          f"{opts.tokens // opts.seq_len} x {opts.seq_len} tokens on {plan.device} ({str(plan.dtype)[6:]}); "
          f"the forks' streams ~{human_bytes(plan.memory['stream_bytes'])} (on the GPU when they fit)", file=out)
