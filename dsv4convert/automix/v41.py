"""``automix`` on DeepSeek-V4.1: the least-KLD layout the engines serve within the budget, measured, written, checked.

On V4.1 the pinned engines' menu is uniform layouts only (``engines/mixes_v41.py``: which layouts each engine runs
per GPU family, and why no per-layer mix is offered, naming the engines' code): the release as shipped and each
variant ``convert/v41.py`` writes. So automix here

1. plans: the menu for ``--engine`` on the GPU family, each layout's bytes (``fit/source_v41.py::planned``: the
   tensors the converter writes, summed; the release's own headers for the release) against ``--size``, or, with
   ``--gpu --tp --kv-tokens``, whether ``fit``'s own V4.1 sizing of each engine's server holds the KV tokens
   (``engines/sglang/memory_v41.py::choose_placement``, ``engines/vllm/memory_v41.py::size_server``);
2. measures every layout within the budget whole through ``compare/v41.py`` (``V41Runner`` in lockstep, the base
   weights only against the layout under SGLang's served numerics on the family; per component the culprit pass's
   relative error): the release against itself (the served numerics' floor), each variant after converting it with
   ``convert/v41.py`` into a scratch directory (one conversion each, the only way a V4.1 layout is made);
3. chooses the least mean KLD, ties to fewer bytes (the knapsack ``solve.py`` is not needed for one decision: a
   uniform layout is a single option; the choice is the measurement itself);
4. delivers: the chosen variant's conversion moved to ``--dst`` (the release: its files copied byte for byte), then
   ``compare`` of the delivered checkpoint on held-out windows, ``automix.json``/``automix.md`` beside it.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from dsv4convert.checkpoint import Checkpoint, atomic_write_bytes, atomic_write_json
from dsv4convert.compare import DEFAULT_GPU_FAMILY
from dsv4convert.compare import v41 as compare_v41
from dsv4convert.compare.eta import device_words, duration
from dsv4convert.compare.run import CompareOptions
from dsv4convert.convert.recipe import load_recipe
from dsv4convert.convert.v41 import convert_v41
from dsv4convert.devices import resolve_device
from dsv4convert.engines import SGLANG, SGLANG_LABEL, VLLM, engines_for
from dsv4convert.engines.mixes_v41 import V41Option, no_mix_reason, v41_menu
from dsv4convert.engines.outputs_v41 import NATIVE
from dsv4convert.engines.sglang.memory_v41 import choose_placement
from dsv4convert.engines.sglang.server import server_v41
from dsv4convert.engines.vllm import memory_v41 as vllm_sizing
from dsv4convert.errors import DSV4Error
from dsv4convert.fit.source_v41 import PlannedV41, planned
from dsv4convert.fit.v41 import launch
from dsv4convert.fit.verdict import Gpu, gpu_of
from dsv4convert.model.text import read_documents, tokenize
from dsv4convert.models.deepseek_v4.layout import TensorSpec
from dsv4convert.sizes import human_bytes

COMPUTE = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def is_v41_source(src: str | Path) -> bool:
    """Whether ``--src`` is a DeepSeek-V4.1 checkpoint (the release registry decides; False if it is none)."""
    try:
        return compare_v41.is_v41(src)
    except Exception:        # not a checkpoint at all: the V4 path reports it
        return False


@dataclass
class V41Layout:
    """One uniform layout on the menu, its bytes (the checkpoint's, or the most per GPU over the engines asked for
    with a ``--gpu`` budget) and whether it fits."""

    variant: str
    bytes: int
    fits: bool
    budget_note: str = ""

    @property
    def label(self) -> str:
        return "release (as shipped)" if self.variant == NATIVE else self.variant


@dataclass
class V41AutomixPlan:
    opts: object
    ckpt: Checkpoint
    menu: list[V41Option]
    layouts: list[V41Layout]          # the servable ones, menu order
    gpu: Gpu | None
    gpu_family: str
    numerics: str                     # the candidates' numerics: served (SGLang's on the family), else weights
    device: torch.device
    dtype: torch.dtype
    unit: str

    @property
    def fitting(self) -> list[V41Layout]:
        return [layout for layout in self.layouts if layout.fits]


@dataclass
class Measured:
    variant: str
    bytes: int
    kld: float
    kld_se: float
    same_top1: float
    positions: int
    culprit: str
    components: list[dict] = field(default_factory=list)   # the three largest relative errors, compare's names


def _planned(ckpt: Checkpoint, variant: str) -> PlannedV41:
    plan = planned(ckpt.config, str(ckpt.root / "config.json"), variant)
    if variant == NATIVE:   # the release as it is stored: its own headers
        return PlannedV41(plan.config, [TensorSpec(e.name, e.dtype, tuple(e.shape)) for e in ckpt.tensors.values()],
                          raw=ckpt.config)
    return plan


def _gpu_bytes(plan: PlannedV41, gpu: Gpu, opts, engine: str) -> tuple[bool, int, str]:
    """Whether ``engine``'s server of ``--tp`` GPUs holds ``plan`` with ``--kv-tokens`` of KV (fit's own V4.1 sizing,
    the Engram placement serve would choose), its weights per GPU, and the line saying so."""
    if engine == SGLANG:
        server = launch(gpu, "server", opts.tp, "gpu", None, plan=plan, mtp=opts.mtp)
        choice = choose_placement(plan.config, plan.tensors, gpu, [server], context=opts.kv_tokens)
        fits = choice.placement is not None
        fit = choice.fits[choice.placement or "gpu"][0]
        where = f"Engram tables {choice.placement}" if fits else "no Engram placement fits"
    else:
        fits_all = [vllm_sizing.size_server(plan.config, plan.tensors, gpu, opts.tp, p, context=opts.kv_tokens,
                                            mtp=opts.mtp) for p in vllm_sizing.ENGRAM_PLACEMENTS]
        fit = next((f for f in fits_all if f.fits), fits_all[0])
        fits = fit.fits
        where = f"Engram tables {fit.engram}" if fits else "no Engram placement fits"
    return fits, int(fit.weights_bytes_per_rank), (f"{engine}: {fit.weights_bytes_per_rank / 2**30:.2f} GiB of "
                                                   f"weights per GPU, {fit.kv_tokens} KV tokens ({where})")


def build(opts) -> V41AutomixPlan:
    """The menu, each layout's bytes and budget verdict; every refusal before anything runs (one ``error:`` line)."""
    ckpt = Checkpoint.open(opts.src)
    for flag, value in (("--calibration", opts.calibration),):
        if value is not None:
            raise DSV4Error(f"{flag}: DeepSeek-V4.1's conversions take no calibration (convert/v41.py::REFUSED)")
    budget_kinds = [opts.size is not None, any(v is not None for v in (opts.gpu, opts.tp, opts.kv_tokens))]
    if sum(budget_kinds) != 1:
        raise DSV4Error("give the budget as --size SIZE, or as --gpu G --tp N --kv-tokens T (not both)")
    if opts.size is not None and opts.size < 1:
        raise DSV4Error(f"--size must be positive, got {opts.size}")
    gpu = None
    if budget_kinds[1]:
        if opts.gpu is None or opts.tp is None or opts.kv_tokens is None:
            raise DSV4Error("--gpu, --tp and --kv-tokens go together: the budget is bytes per GPU at that TP with "
                            "that many tokens of KV")
        if opts.tp < 1 or opts.kv_tokens < 1:
            raise DSV4Error(f"--tp and --kv-tokens must be positive, got {opts.tp} and {opts.kv_tokens}")
        gpu = gpu_of(opts.gpu, opts.gpu_family)
    family = opts.gpu_family or (gpu.family if gpu else DEFAULT_GPU_FAMILY)
    menu = v41_menu(opts.engine, family, ckpt.config.get("quantization_config"))
    layouts = []
    for option in (o for o in menu if o.problem is None):
        plan = _planned(ckpt, option.variant)
        if gpu is None:
            size = sum(t.nbytes for t in plan.tensors)
            layouts.append(V41Layout(option.variant, size, size <= opts.size))
            continue
        verdicts = [_gpu_bytes(plan, gpu, opts, e) for e in engines_for(opts.engine)]
        layouts.append(V41Layout(option.variant, max(v[1] for v in verdicts), all(v[0] for v in verdicts),
                                 "; ".join(v[2] for v in verdicts)))
    if not layouts:
        reasons = "; ".join(f"{o.variant}: {o.problem}" for o in menu)
        raise DSV4Error(f"--engine {opts.engine} on {family}: no DeepSeek-V4.1 layout is servable ({reasons})")
    unit = (f"checkpoint bytes (--size {human_bytes(opts.size)})" if gpu is None else
            f"per GPU on {gpu.name}, TP {opts.tp}, {opts.kv_tokens} KV tokens (fit)")
    if not any(layout.fits for layout in layouts):
        smallest = min(layouts, key=lambda layout: layout.bytes)
        if gpu is None:
            raise DSV4Error(f"the budget ({human_bytes(opts.size)} of checkpoint bytes) is below the smallest "
                            f"DeepSeek-V4.1 layout --engine {opts.engine} serves on {family} ({smallest.label}: "
                            f"{human_bytes(smallest.bytes)})")
        raise DSV4Error(f"no DeepSeek-V4.1 layout --engine {opts.engine} serves on {family} holds {opts.kv_tokens} KV "
                        f"tokens at TP {opts.tp} on {gpu.name} (the smallest, {smallest.label}: "
                        f"{smallest.budget_note})")
    device = resolve_device(opts.device)
    dtype_name = opts.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    if dtype_name not in COMPUTE:
        raise DSV4Error(f"--dtype must be one of {', '.join(COMPUTE)}, got {dtype_name!r}")
    numerics = "served"
    for layout in layouts:         # compare emulates SGLang's launch: a layout it refuses there is measured on weights
        try:
            server_v41(str(ckpt.root), family, variant=layout.variant)
        except Exception:
            numerics = "weights"
    return V41AutomixPlan(opts, ckpt, menu, layouts, gpu, family, numerics, device, COMPUTE[dtype_name], unit)


def windows(plan: V41AutomixPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """``--tokens`` to measure the layouts on, then ``--verify-tokens`` held out for the delivered checkpoint."""
    opts = plan.opts
    if opts.text is None:
        raise DSV4Error("no data: give --text FILE (UTF-8 text, or JSONL with a \"text\" field); the layouts' "
                        "measurement and the held-out comparison read it, nothing is downloaded")
    if opts.seq_len < 2:
        raise DSV4Error(f"--seq-len must be at least 2, got {opts.seq_len}")
    counts = {"--tokens": opts.tokens, "--verify-tokens": opts.verify_tokens}
    short = [flag for flag, count in counts.items() if count < opts.seq_len]
    if short:
        raise DSV4Error(f"{' and '.join(short)} must each hold one --seq-len {opts.seq_len} window at least")
    ids = tokenize(plan.ckpt.root, read_documents(Path(opts.text)))
    sizes = [count // opts.seq_len for count in counts.values()]
    if ids.numel() < sum(sizes) * opts.seq_len:
        raise DSV4Error(f"the text holds {ids.numel()} tokens; --tokens {opts.tokens} + --verify-tokens "
                        f"{opts.verify_tokens} need {sum(sizes) * opts.seq_len} (whole --seq-len {opts.seq_len} "
                        "windows): give more text or fewer tokens", file=opts.text)
    cut = ids[:sum(sizes) * opts.seq_len].view(-1, opts.seq_len)
    measure, heldout = (part.clone() for part in cut.split(sizes))
    return measure, heldout


def _compare_options(plan: V41AutomixPlan, variant: str | Path, ids: torch.Tensor) -> CompareOptions:
    o = plan.opts
    return CompareOptions(base=str(plan.ckpt.root), variant=str(variant), ids=ids, seq_len=ids.shape[1],
                          tokens=ids.numel(), numerics=plan.numerics, base_numerics="weights", engine=SGLANG,
                          gpu_family=plan.gpu_family, device=o.device, dtype=o.dtype, chunk=o.chunk, mtp=False,
                          progress=o.progress)


def expected_seconds(plan: V41AutomixPlan, measure: torch.Tensor, heldout: torch.Tensor) -> tuple[float, str]:
    """compare/v41.py's own estimate of one comparison (the release against itself on the windows), times the
    layouts measured, plus the held-out compare of the delivered checkpoint; conversions are not counted."""
    one = compare_v41.build_plan(_compare_options(plan, plan.ckpt.root, measure)).estimate["seconds"]
    held = compare_v41.build_plan(_compare_options(plan, plan.ckpt.root, heldout)).estimate["seconds"] \
        if plan.opts.dst else 0.0
    n = len(plan.fitting)
    conversions = sum(1 for layout in plan.fitting if layout.variant != NATIVE)
    what = (f"{n} compare(s) of {measure.shape[0]} x {measure.shape[1]} tokens"
            + (f" and the delivered checkpoint's compare on {heldout.shape[0]} x {heldout.shape[1]} held-out tokens"
               if plan.opts.dst else "")
            + f"; {conversions} conversion(s) through convert/v41.py come on top")
    return n * one + held, what


def print_plan(plan: V41AutomixPlan, out=None) -> None:
    out = out or sys.stdout
    opts = plan.opts
    print(f"automix: {opts.src} -> {opts.dst or '(no checkpoint)'}; DeepSeek-V4.1, --engine {opts.engine}, "
          f"{plan.gpu_family}; budget {plan.unit}", file=out)
    print(f"  per-layer mixes: none. {no_mix_reason(opts.engine)}", file=out)
    layouts = {layout.variant: layout for layout in plan.layouts}
    for option in plan.menu:
        layout = layouts.get(option.variant)
        if layout is None:
            print(f"  not on the menu: {option.variant}: {option.problem}", file=out)
            continue
        verdict = "within the budget" if layout.fits else "over the budget"
        note = f" ({layout.budget_note})" if layout.budget_note else ""
        print(f"  uniform {layout.label}: {human_bytes(layout.bytes)}{' per GPU' if plan.gpu else ''}, {verdict}"
              f"{note}", file=out)
    if VLLM in engines_for(opts.engine):
        print(f"  note: the layouts are measured under {SGLANG_LABEL}'s numerics (compare emulates SGLang only)",
              file=out)
    numerics = ("SGLang's served numerics (activation quantization, FP4 compressed KV and indexer)"
                if plan.numerics == "served" else
                "weights only (SGLang does not run every layout on this family, so none gets its served numerics)")
    print(f"  measured: {', '.join(layout.label for layout in plan.fitting)}, each whole against the base's weights "
          f"through compare/v41.py, under {numerics}, on {opts.tokens // opts.seq_len} x {opts.seq_len} tokens on "
          f"{plan.device} ({str(plan.dtype)[6:]})", file=out)
    print(f"  held out: {opts.verify_tokens // opts.seq_len} x {opts.seq_len} tokens for compare of the delivered "
          "checkpoint", file=out)


def _measure_one(plan: V41AutomixPlan, layout: V41Layout, path: Path, ids: torch.Tensor) -> Measured:
    result = compare_v41.run(compare_v41.build_plan(_compare_options(plan, path, ids)))
    out = result["output"]
    comps = [{"component": c["component"] if "component" in c else c.get("name"),
              "relative_error": c["relative_error"]} for c in result["v41"]["components"][:3]]
    return Measured(layout.variant, layout.bytes, float(out["kld"]["mean"]), float(out["kld"]["standard_error"]),
                    float(out["same_top1"]), int(out["positions"]), result["v41"]["culprit"]["sentence"], comps)


def _convert(plan: V41AutomixPlan, variant: str, dst: Path) -> None:
    convert_v41(plan.ckpt, dst=dst, recipe=load_recipe(variant), engine=plan.opts.engine, overwrite=False,
                resume=False, workers=1, dry_run=False, progress=plan.opts.progress, refused=[])


def measure(plan: V41AutomixPlan, ids: torch.Tensor, work: Path) -> tuple[list[Measured], dict[str, Path]]:
    """Every layout within the budget measured whole (variants converted into ``work`` first)."""
    rows, paths = [], {}
    for layout in plan.fitting:
        path = plan.ckpt.root
        if layout.variant != NATIVE:
            path = work / layout.variant
            _convert(plan, layout.variant, path)
        paths[layout.variant] = path
        row = _measure_one(plan, layout, path, ids)
        print(f"  {layout.label:22} {human_bytes(layout.bytes):>10}  mean KLD {row.kld:.6f} ± {row.kld_se:.6f}, "
              f"same top-1 {100 * row.same_top1:.2f}%", flush=True)
        rows.append(row)
    return rows, paths


def choose(rows: list[Measured]) -> Measured:
    """The least mean KLD, ties to fewer bytes (then the menu's order)."""
    return min(rows, key=lambda r: (r.kld, r.bytes))


def _copy_release(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for item in sorted(src.iterdir()):
        if item.is_file():
            shutil.copyfile(item, dst / item.name)
        elif item.is_dir():
            shutil.copytree(item, dst / item.name)


def deliver(plan: V41AutomixPlan, variant: str, paths: dict[str, Path], dst: Path) -> None:
    """The chosen layout at ``dst`` (empty or absent): a variant's ``convert/v41.py`` output moved there whole (its
    model card, provenance and the release's bytes for everything the variant keeps), the release copied file by
    file."""
    if dst.exists():
        dst.rmdir()                     # empty: checked by the caller
    dst.parent.mkdir(parents=True, exist_ok=True)
    if variant == NATIVE:
        _copy_release(plan.ckpt.root, dst)
    else:
        shutil.move(str(paths[variant]), str(dst))


def run(plan: V41AutomixPlan, dry_run: bool) -> int:
    """``dsv4convert automix`` on a V4.1 base (called by ``automix/cli.py``)."""
    opts = plan.opts
    print_plan(plan)
    measure_ids, heldout = windows(plan)
    seconds, what = expected_seconds(plan, measure_ids, heldout)
    line = f"automix: expected {duration(seconds)} on this device ({device_words(plan.device)}) for {what}"
    print(f"  {line}" if dry_run else line, flush=True)
    if dry_run:
        return 0
    dst = Path(opts.dst) if opts.dst else None
    report = Path(opts.report) if opts.report else (dst.parent / f"{dst.name}-automix" if dst else None)
    t0 = time.perf_counter()
    if report is not None:
        report.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="automix-v41-",
                                     dir=str(report.parent if report else Path(tempfile.gettempdir()))) as scratch:
        rows, paths = measure(plan, measure_ids, Path(scratch))
        chosen = choose(rows)
        layout = next(x for x in plan.layouts if x.variant == chosen.variant)
        print(f"automix: chosen {layout.label}: mean KLD {chosen.kld:.6f} ± {chosen.kld_se:.6f} at "
              f"{human_bytes(chosen.bytes)}{' per GPU' if plan.gpu else ''} (the least measured within the budget"
              f"{', fewest bytes among equals' if sum(r.kld == chosen.kld for r in rows) > 1 else ''})")
        heldout_row = None
        if dst is not None:
            deliver(plan, chosen.variant, paths, dst)
            heldout_row = _measure_one(plan, layout, dst, heldout)
            print(f"automix: {dst} on {heldout.numel()} held-out tokens: mean KLD {heldout_row.kld:.6f} ± "
                  f"{heldout_row.kld_se:.6f}, same top-1 {100 * heldout_row.same_top1:.2f}%")
    if report is not None:
        _write_report(plan, rows, chosen, heldout_row, report, time.perf_counter() - t0)
        print(f"report: {report / 'automix.md'}")
    if dst is not None:
        print(f"next: dsv4convert validate --model {dst} --against {plan.ckpt.root}; dsv4convert serve --model {dst} "
              "--dry-run")
    return 0


def _write_report(plan: V41AutomixPlan, rows: list[Measured], chosen: Measured, heldout: Measured | None,
                  out: Path, seconds: float) -> None:
    out.mkdir(parents=True, exist_ok=True)
    opts = plan.opts
    record = {"release": "DeepSeek-V4.1", "src": str(plan.ckpt.root), "dst": opts.dst, "engine": opts.engine,
              "gpu_family": plan.gpu_family, "budget": plan.unit, "numerics": plan.numerics,
              "no_mix": no_mix_reason(opts.engine),
              "menu": [{"variant": o.variant, "excluded": o.problem} for o in plan.menu],
              "layouts": [asdict(layout) for layout in plan.layouts],
              "measured": [asdict(r) for r in rows], "chosen": chosen.variant,
              "heldout": asdict(heldout) if heldout else None, "seconds": round(seconds, 3)}
    atomic_write_json(out / "automix.json", record)
    lines = [f"# automix on DeepSeek-V4.1: {chosen.variant}", "", record["no_mix"] + ".", "",
             "| layout | bytes | mean KLD | ± | same top-1 | largest component error |", "|---|---|---|---|---|---|"]
    for r in rows:
        top = r.components[0] if r.components else {}
        lines.append(f"| {r.variant}{' (chosen)' if r is chosen else ''} | {human_bytes(r.bytes)} | {r.kld:.6f} | "
                     f"{r.kld_se:.6f} | {100 * r.same_top1:.2f}% | {top.get('component', '-')} "
                     f"{top.get('relative_error', 0):.3g} |")
    if heldout:
        lines += ["", f"Delivered, on held-out tokens: mean KLD {heldout.kld:.6f} ± {heldout.kld_se:.6f}."]
    atomic_write_bytes(out / "automix.md", ("\n".join(lines) + "\n").encode())
