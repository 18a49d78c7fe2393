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
    MixTrack,
    Probe,
    floor_label,
    floor_numerics,
    measure,
    stream_bytes,
)
from dsv4convert.automix.solve import Option, solve
from dsv4convert.calibration import InputScales, build_input_scales
from dsv4convert.checkpoint import Checkpoint
from dsv4convert.compare import DEFAULT_GPU_FAMILY
from dsv4convert.compare.eta import Eta, Work
from dsv4convert.compare.numerics import Numerics, serving_from_formats
from dsv4convert.convert.plan import build_plan, human_bytes
from dsv4convert.convert.recipe import Recipe
from dsv4convert.devices import resolve_device
from dsv4convert.engines import SGLANG_LABEL, engines_for
from dsv4convert.engines.config import build_quant_config
from dsv4convert.engines.sglang.numerics import Serving
from dsv4convert.engines.vllm.memory import LOAD_RULES as VLLM_RULES
from dsv4convert.errors import DSV4Error, RecipeError
from dsv4convert.fit.source import from_plan
from dsv4convert.fit.verdict import Gpu, gpu_of, sglang_server, vllm_server
from dsv4convert.formats import Format
from dsv4convert.inspection import Inspection, inspect_checkpoint
from dsv4convert.models.deepseek_v4.layout import linear_shapes
from dsv4convert.model.blocks import COMPUTE_DTYPES
from dsv4convert.model.text import read_documents, tokenize


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
    select_tokens: int = 8192            # the verified choice's selection windows
    verify_tokens: int = 8192            # held-out, for compare
    verify_top: int = 4                  # best predicted mixes measured whole before choosing (0: trust the estimate)
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
                  f"predicted mean KLD {self.predicted:.5f} (floor {plan.floor(self.layout, measured):.5f} + choices, "
                  f"as the family's uniform mix adds them up), {human_bytes(self.bytes)} of "
                  f"{human_bytes(self.layout.capacity)}"]
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
    _probe_of: dict = field(default_factory=dict, repr=False)

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

    def predict(self, layout: Layout, picks: dict[Decision, Format], measured: Measured) -> float:
        """The floor plus the choices' costs as the family's whole uniform mix says they add up."""
        total = sum(self.cost(layout, d, f, measured) for d, f in picks.items())
        return self.floor(layout, measured) + total * self.interaction(layout, measured, total)

    def interaction(self, layout: Layout, measured: Measured, total: float) -> float:
        """How the costs of this family's choices add up, per family: at the uniform mix, its measured track over
        its summed costs (c: formats interact within a layout, experts with linears and with the served caches,
        which the per-format calibration does not see); with no choice applied, 1; in between, 1 + (c - 1) x
        the mix's share of the uniform's summed cost. The prediction is then exact at both ends and increases
        with the sum (c is held within [0.5, 2]), so the knapsack's least sum is still the least prediction."""
        uniform = sum(self.cost(layout, d, f, measured) for d, f in uniform_picks(layout).items())
        if uniform <= 0:
            return 1.0
        track = measured.mix_kld(uniform_label(layout)) - self.floor(layout, measured)
        c = min(max(track / uniform, 0.5), 2.0)
        return 1 + (c - 1) * min(total / uniform, 1.0)

    def option_bytes(self, layout: Layout, decision: Decision, fmt: Format) -> int:
        """Bytes of one decision stored as ``fmt``, in the layout's unit."""
        key = (layout.label, decision, fmt)
        if key not in self._bytes:
            if not self._shapes:
                self._shapes = linear_shapes(self.inspection.config)
            shapes = self._shapes
            vllm_experts = decision.group == "experts" and "vllm" in engines_for(self.options.engine)
            scale = "F32" if fmt is Format.FP8 and vllm_experts else "F8_E8M0"
            block = self.inspection.fp8_block
            tensors = [t for m in self.decisions[decision] for t in budgets.stored(m, fmt, shapes[m], block, scale)]
            self._bytes[key] = layout.unit.count(tensors)
        return self._bytes[key]

    def solve(self, measured: Measured, capacity: int | None = None, layouts: list[Layout] | None = None) -> Mix | None:
        """The least-predicted-KLD mix over ``layouts`` (default: every one) within ``capacity`` (default: each
        layout's own)."""
        best = None
        for layout in self.layouts if layouts is None else layouts:
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

    @property
    def uniforms(self) -> list[MixTrack]:
        """Each layout's uniform mix on a track of the pass: what its family's predictions are corrected with."""
        return [self.track(layout, uniform_picks(layout), uniform_label(layout)) for layout in self.layouts]

    def track(self, layout: Layout, picks: dict[Decision, Format], label: str) -> MixTrack:
        """The mix on a track of the pass: its candidates (none where it stores a decision exactly), its serving."""
        if not self._probe_of:
            self._probe_of = {p.candidate: p for p in self.probes}
        candidates = (Candidate(d, scheme_of(d.group, f, layout.serving)) for d, f in picks.items())
        return MixTrack(label, tuple(self._probe_of[c] for c in candidates
                                     if not is_exact(c.scheme, layout.sources[c.decision])), layout.serving)

    def uniform_layouts(self) -> list[tuple[str, Layout, dict[Decision, Format]]]:
        """(name, layout, picks) of each servable uniform layout: every layout's uniform mix, and all BF16 once
        (in the first layout that offers BF16 everywhere)."""
        out = [(f"uniform-{layout.slug}", layout, uniform_picks(layout)) for layout in self.layouts]
        bf16 = next((layout for layout in self.layouts if all(Format.BF16 in o for o in layout.options.values())), None)
        if bf16 is not None:
            out.append(("uniform-bf16", bf16, {d: Format.BF16 for d in bf16.options}))
        seen: set[tuple] = set()
        unique = []
        for name, layout, picks in out:      # layouts that store the same uniform checkpoint: the first one
            key = picks_key(picks)
            if key not in seen:
                seen.add(key)
                unique.append((name, layout, picks))
        return unique

    def bytes_of(self, layout: Layout, picks: dict[Decision, Format]) -> int:
        return layout.fixed_bytes + sum(self.option_bytes(layout, d, f) for d, f in picks.items())

    def mix(self, layout: Layout, picks: dict[Decision, Format], measured: Measured, name: str = "automix") -> Mix:
        return Mix(layout, picks, self.bytes_of(layout, picks), self.predict(layout, picks, measured), name)


# ------------------------------------------------------------------------------------------- planning

def uniform_label(layout: Layout) -> str:
    return f"uniform {layout.label}"


def picks_key(picks: dict[Decision, Format]) -> tuple:
    """What a mix stores, comparable across layouts."""
    return tuple(sorted((d.block, d.group, f.value) for d, f in picks.items()))


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
        gpu = gpu_of(opts.gpu, opts.gpu_family)     # as fit: a size in MiB needs its family
    gpu_family = opts.gpu_family or (gpu.family if gpu else DEFAULT_GPU_FAMILY)
    families, excluded = menu(opts.engine, gpu_family)
    if not families:
        reasons = "; ".join(f"{e.name}: {e.reason}" for e in excluded)
        raise DSV4Error(f"--engine {opts.engine} on {gpu_family}: no mixed layout is servable ({reasons})")
    device = resolve_device(opts.device)
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
    tracks = len(floors) + len(calibrations) + len(layouts)     # + each layout's uniform, whole
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

@dataclass(frozen=True)
class Windows:
    """Disjoint windows of ``--seq-len`` tokens, in the text's order: the pass's, the choice's, the report's."""

    sensitivity: torch.Tensor
    selection: torch.Tensor
    heldout: torch.Tensor


def windows(plan: AutomixPlan) -> Windows:
    """``--tokens`` for the pass, ``--select-tokens`` to verify the choice (none without ``--verify-top``), and
    ``--verify-tokens`` held out for ``compare``, from ``--text``."""
    opts = plan.options
    if opts.text is None:
        raise DSV4Error("no data: give --text FILE (UTF-8 text, or JSONL with a \"text\" field); the sensitivity pass, "
                        "the choice's verification and the held-out comparison all read it, nothing is downloaded")
    counts = {"--tokens": opts.tokens, "--select-tokens": opts.select_tokens if opts.verify_top else 0,
              "--verify-tokens": opts.verify_tokens}
    if opts.seq_len < 2:
        raise DSV4Error(f"--seq-len must be at least 2, got {opts.seq_len}")
    short = [flag for flag, count in counts.items() if count < opts.seq_len and (count or flag != "--select-tokens")]
    if short:
        raise DSV4Error(f"{' and '.join(short)} must each hold one --seq-len {opts.seq_len} window at least")
    ids = tokenize(plan.ckpt.root, read_documents(Path(opts.text)))
    vocab = plan.inspection.config.vocab_size
    if ids.numel() and int(ids.max()) >= vocab:
        raise DSV4Error(f"the tokenizer produced id {int(ids.max())} but the model has {vocab} tokens",
                        file=plan.ckpt.root)
    sizes = [count // opts.seq_len for count in counts.values()]
    if ids.numel() < sum(sizes) * opts.seq_len:
        wanted = " + ".join(f"{flag} {count}" for flag, count in counts.items() if count)
        raise DSV4Error(f"the text holds {ids.numel()} tokens; {wanted} need {sum(sizes) * opts.seq_len} (whole "
                        f"--seq-len {opts.seq_len} windows): give more text or fewer tokens", file=opts.text)
    cut = ids[:sum(sizes) * opts.seq_len].view(-1, opts.seq_len)
    return Windows(*(part.clone() for part in cut.split(sizes)))


def input_scales(plan: AutomixPlan) -> InputScales | None:
    """The NVFP4 experts' input scales, as the converter sets them (``--calibration``), when NVFP4 is on the menu."""
    needs_scales = any(Format.NVFP4 in layout.family.experts for layout in plan.layouts)
    return build_input_scales(plan.ckpt, calibration=plan.options.calibration) if needs_scales else None


def run_sensitivity(plan: AutomixPlan, ids: torch.Tensor, eta: Eta | None = None) -> Measured:
    return measure(plan.ckpt, plan.inspection, ids, plan.probes, plan.floors, plan.calibrations, device=plan.device,
                   dtype=plan.dtype, chunk=plan.options.chunk, input_scales=input_scales(plan), mixes=plan.uniforms,
                   progress=plan.options.progress, first_block=eta.refine if eta else None)


def expected(plan: AutomixPlan, windows: Windows) -> tuple[Eta, str]:
    """The expected-time line's model of the run, from the plan's own counts: the sensitivity pass (the reference,
    every candidate's extra layer passes, every whole-model track), the verification pass (its tracks and the
    reference on the selection windows) and compare of the written mix (base, mix, the mix on the base's input);
    conversions are not counted. Returns the model and what it covers, in words."""
    cfg, opts = plan.inspection.config, plan.options
    layers = cfg.num_hidden_layers
    sens = windows.sensitivity.numel()
    tracks = len(plan.floors) + len(plan.calibrations) + len(plan.layouts)
    sensitivity = sens * (layers * (1 + tracks) + plan.memory["layer_passes"])
    heads = sens * (1 + len(plan.probes) + tracks)
    verify = opts.verify_top + len(plan.layouts) if opts.verify_top else 0
    selection = windows.selection.numel() * (verify + 1) if verify else 0
    held = windows.heldout.numel() if opts.dst or opts.report else 0
    work = Work(sensitivity + layers * (selection + 3 * held), heads + selection + 2 * held, opts.seq_len // 2,
                sens * (1 + tracks))
    what = ("the sensitivity pass" + (", the verification pass" if verify else "")
            + (", compare of the written mix" if held else "")
            + (" (the report's conversions and compares come on top)" if opts.report else ""))
    return Eta("automix", cfg, work, plan.device, plan.dtype), what


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
          f"beside the {cfg.num_hidden_layers} of the reference), {len(plan.floors)} floor, "
          f"{len(plan.calibrations)} calibration and {len(plan.layouts)} uniform-layout track(s), "
          f"{opts.tokens // opts.seq_len} x {opts.seq_len} tokens on {plan.device} ({str(plan.dtype)[6:]}); "
          f"the candidates' hidden states ~{human_bytes(plan.memory['stream_bytes'])} (on the GPU when they fit)",
          file=out)
    if not opts.verify_top:
        print("  verification: none (--verify-top 0): the least predicted mix is returned as the estimate ranks it",
              file=out)
    else:
        fitting = [name for name, layout, picks in plan.uniform_layouts()
                   if plan.bytes_of(layout, picks) <= layout.capacity]
        tracks = opts.verify_top + len(fitting)
        select = opts.select_tokens // opts.seq_len
        streams = stream_bytes(tracks + 2, select * opts.seq_len, cfg.hc_mult, cfg.hidden_size, plan.dtype)
        print(f"  verification: the {opts.verify_top} best predicted mixes (the best of as many layouts) and the "
              f"{len(fitting)} uniform layout(s) within the budget ({', '.join(fitting) or 'none'}) measured whole on "
              f"{select} x {opts.seq_len} selection tokens: up to {tracks} tracks, one more pass over the model "
              f"({tracks * cfg.num_hidden_layers} layer passes, no conversion; streams ~{human_bytes(streams)})"
              + ("; the report adds each baseline's candidates to that pass" if opts.report else ""), file=out)
    print(f"  held out: {opts.verify_tokens // opts.seq_len} x {opts.seq_len} tokens for compare of the written mix"
          + (" and the report's every row (one conversion and compare each)" if opts.report else ""), file=out)
