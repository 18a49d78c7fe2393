"""Run a plan: shard jobs on worker processes within a memory budget, resumable.

Each output shard is one job. Jobs are started while the sum of their estimated peak
memory fits ``max_memory`` (a job that can never fit is refused before anything runs),
each writes its shard to a temporary name and renames it when complete, and the resume
state is updated after each. The index is written last: a destination without one is
visibly unfinished.

Within a job, reading, converting and writing overlap (:mod:`dsv4convert.convert.pipeline`).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import time
import traceback
from collections import defaultdict
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path

import torch
from tqdm import tqdm

from dsv4convert import __version__
from dsv4convert import engines as eng
from dsv4convert.calibration import CalibrationHessians, InputScales, build_input_scales, calibration_hessians
from dsv4convert.checkpoint import (
    INDEX_NAME,
    Checkpoint,
    Remote,
    ShardFetcher,
    atomic_write_bytes,
    atomic_write_json,
)
from dsv4convert.checkpoint.writer import copy_small_files, write_index
from dsv4convert.convert.model_card import (
    base_model_id,
    default_launch,
    draft_lines,
    render_model_card,
    source_card_metadata,
    vllm_default_launch,
)
from dsv4convert.convert.pipeline import (
    BarFeed,
    init_worker,
    intra_op_threads,
    pipeline_memory,
    quiet_openmp_for_workers,
    run_shard_job,
)
from dsv4convert.convert.plan import Plan, ShardJob, build_plan, cost_of_both, human_bytes
from dsv4convert.convert.recipe import Recipe, canonical
from dsv4convert.convert import DEFAULT_MAX_SHARD_BYTES, v41
from dsv4convert.convert.state import DestinationLock, RunState, prepare_destination, signature
from dsv4convert.convert.v41 import V41Result
from dsv4convert.devices import resolve_device
from dsv4convert.engines.config import build_quant_config, servable_engines
from dsv4convert.errors import DSV4Error
from dsv4convert.formats import Calibration, calibrated_by
from dsv4convert.inspection import check_routing, inspect_checkpoint
from dsv4convert.models.deepseek_v4.layout import Drafter, Role, without_drafter
from dsv4convert.stop_points import reach

# Files the converter writes itself rather than copying from the source.
GENERATED_FILES = {"config.json", "hf_quant_config.json", "README.md", "provenance.json", INDEX_NAME}


@dataclass
class ConvertOptions:
    src: str
    dst: Path
    recipe: Recipe
    workers: int = 1
    max_memory: int | None = None
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
    resume: bool = False
    overwrite: bool = False
    dry_run: bool = False
    input_scales_from: str | None = None
    calibration: Path | None = None
    progress: bool = True
    device: str = "cpu"
    gptq: bool = False                        # INT4 experts by GPTQ with the Hessians of --calibration
    revision: str | None = None               # of a Hugging Face repo id source
    delete_source_shards: bool = False        # Hub sources: delete each shard from the cache after its last use
    remote: Remote | None = None              # stands in for the Hub (tests); None: huggingface_hub
    engine: str | None = None                 # sglang/vllm/both (--engine); None: the recipe's, else both
    no_mtp: bool = False                      # leave the mtp.* drafter out (--no-mtp); the card says so


@dataclass
class ConvertResult:
    plan: Plan
    dst: Path
    stats: dict = field(default_factory=dict)
    seconds: float = 0.0
    engines: tuple[str, ...] = eng.ENGINES


def choose_engines(plan: Plan, source_config: dict, asked: str | None) -> tuple[tuple[str, ...], str | None]:
    """The engines the output is made for, and a notice when the default could not be both.

    An engine asked for (``--engine`` or the recipe's ``engine:``) is checked by
    ``build_quant_config``, which refuses naming the engine and module. Without one the output is for
    both engines where its layout allows, else for the one that can load it, with the other's reason.
    """
    if asked is not None:
        return eng.engines_for(asked), None
    problems = servable_engines(source_config, plan.module_formats())
    engines = tuple(e for e, problem in problems.items() if problem is None)
    if engines == eng.ENGINES or not engines:
        return engines or eng.ENGINES, None  # none: build_quant_config raises SGLang's reason
    notes = [f"{eng.LABELS[e]} cannot load {problem}" for e, problem in problems.items() if problem]
    return engines, (f"engine: {eng.choice_of(engines)} only ({'; '.join(notes)}); --engine {eng.choice_of(engines)} "
                     "says so explicitly, --engine both refuses this layout")


def available_memory() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _check_paths(src_root: Path, dst: Path) -> None:
    s, d = src_root.resolve(), dst.resolve()
    if d == s or s in d.parents:
        raise DSV4Error("destination is inside the source checkpoint; choose another directory", file=dst)
    if d in s.parents:
        raise DSV4Error("the source checkpoint is inside the destination; choose another directory", file=dst)


def _check_disk(dst: Path, needed: int) -> None:
    free = shutil.disk_usage(dst).free
    if free < needed:
        raise DSV4Error(f"not enough free disk: the conversion writes {human_bytes(needed)} more, "
                        f"{human_bytes(free)} is free", file=dst)


def _remaining(plan: Plan, state: RunState, dst: Path) -> list[ShardJob]:
    todo = []
    for shard in plan.shards:
        if state.done(dst, shard.name):
            continue
        state.shards.pop(shard.name, None)
        todo.append(shard)
    return todo


def _partners(plan: Plan, shard: ShardJob) -> dict[str, dict]:
    return {m.module: plan.modules[m.partner].sources for m in shard.modules if m.partner}


def convert(opts: ConvertOptions) -> ConvertResult | V41Result:
    """Plan, validate and run a conversion; see the module docstring. A DeepSeek-V4.1 source goes to its own
    converter (:mod:`dsv4convert.convert.v41`)."""
    t0 = time.monotonic()
    ckpt = Checkpoint.open(opts.src, revision=opts.revision, remote=opts.remote)
    _check_paths(ckpt.root, opts.dst)
    if v41.handles(ckpt.config, str(ckpt.root / "config.json")):
        return v41.convert_v41(ckpt, dst=opts.dst, recipe=opts.recipe, engine=opts.engine, overwrite=opts.overwrite,
                               resume=opts.resume, workers=opts.workers, dry_run=opts.dry_run, progress=opts.progress,
                               refused=_not_for_v41(opts))
    check_routing(ckpt)
    asked = opts.engine or opts.recipe.engine
    plan = build_plan(ckpt, opts.recipe, max_shard_bytes=opts.max_shard_bytes, engine=asked or eng.DEFAULT_CHOICE,
                      drop_draft=opts.no_mtp)
    source_config = _source_config(ckpt, opts)
    engines, engine_note = choose_engines(plan, source_config, asked)
    config, extra_files = build_quant_config(source_config, plan.module_formats(), engines=engines)
    if engine_note:
        print(f"note: {engine_note}", file=sys.stderr)
    if opts.no_mtp:
        print(f"note: {_dropped_draft(plan)}")
    for line in cost_of_both(plan) if engines == eng.ENGINES else []:
        print(f"note: {line} (docs/engines.md)")   # stdout: stderr is kept for the one line an error gets
    hessians = _gptq_hessians(plan, opts)
    needs_input_scales = any(m.target.format in calibrated_by(Calibration.ACTIVATION_AMAX) for m in plan.modules.values())
    input_scales = build_input_scales(ckpt, from_checkpoint=opts.input_scales_from,
                                      calibration=opts.calibration) if needs_input_scales else None
    resolve_device(opts.device)
    max_memory = opts.max_memory or int(available_memory() * 0.8)
    too_big = [s for s in plan.shards if pipeline_memory(s) > max_memory]
    if too_big:
        raise DSV4Error(f"shard job {too_big[0].name} needs about {human_bytes(pipeline_memory(too_big[0]))} of "
                        f"memory but --max-memory is {human_bytes(max_memory)}", file=opts.dst)
    options = {"max_shard_bytes": opts.max_shard_bytes, "input_scales_from": opts.input_scales_from, "gptq": opts.gptq,
               "calibration": _file_digest(opts.calibration), "engines": list(engines)}
    if opts.no_mtp:
        options["no_mtp"] = True   # only when set: earlier runs' signatures stay valid for --resume
    sig = signature(ckpt, canonical(opts.recipe), options)
    if opts.dry_run:
        print_plan(plan, ckpt, opts, max_memory, engines)
        return ConvertResult(plan, opts.dst, engines=engines)

    state = prepare_destination(opts.dst, sig, resume=opts.resume, overwrite=opts.overwrite,
                                recipe_name=opts.recipe.name)
    with DestinationLock(opts.dst):
        for stale in opts.dst.glob(".*.partial"):
            stale.unlink()
        todo = _remaining(plan, state, opts.dst)
        if state.complete and not todo and (opts.dst / INDEX_NAME).is_file():   # --resume of a finished run
            print(f"{opts.dst}: already complete (recipe '{plan.recipe.name}', {len(plan.shards)} shards): "
                  "nothing to do")
            return ConvertResult(plan, opts.dst, engines=engines)
        _check_disk(opts.dst, sum(s.bytes_out for s in todo) + _download_bytes(ckpt, todo, opts, input_scales) + 64 * 1024**2)
        state.complete = False
        state.save()
        try:
            sources = SourceShards(ckpt, todo, input_scales, delete_after_use=opts.delete_source_shards)
            try:
                # closed on the way out, so an interrupted run's error line comes after the bar, not above a redraw
                with tqdm(total=sum(s.bytes_in for s in todo), unit="B", unit_scale=True, desc="convert",
                          disable=not opts.progress, file=sys.stderr) as bar:
                    _run_jobs(plan, todo, opts, state, input_scales, max_memory, sources, hessians, bar)
            finally:
                sources.close()
            stats = _finish(plan, ckpt, opts, state, config, extra_files, engines)
        except KeyboardInterrupt:
            raise DSV4Error(f"interrupted; {len(state.shards)} of {len(plan.shards)} shards are complete. "
                            "Run the same command with --resume to continue", file=opts.dst) from None
        except (BrokenProcessPool, EOFError, ConnectionError) as exc:
            raise DSV4Error(f"a worker process died ({type(exc).__name__}: killed by the system, out of memory?); "
                            f"{len(state.shards)} of {len(plan.shards)} shards are complete. Run the same command "
                            "with --resume to continue (fewer --workers or a lower --max-memory use less memory)",
                            file=opts.dst) from None
    result = ConvertResult(plan, opts.dst, stats, time.monotonic() - t0, engines)
    print_stats(result)
    return result


def _not_for_v41(opts: ConvertOptions) -> list[str]:
    """The options given that a DeepSeek-V4.1 conversion refuses (``v41.REFUSED`` says why)."""
    given = {"--gptq": opts.gptq, "--calibration": opts.calibration, "--input-scales-from": opts.input_scales_from,
             "--no-mtp": opts.no_mtp, "--delete-source-shards": opts.delete_source_shards,
             "--device": opts.device != "cpu", "--max-shard-size": opts.max_shard_bytes != DEFAULT_MAX_SHARD_BYTES,
             "--max-memory": opts.max_memory is not None}
    return [flag for flag, value in given.items() if value]


def _run_jobs(plan: Plan, todo: list[ShardJob], opts: ConvertOptions, state: RunState,
              input_scales: InputScales | None, max_memory: int, sources: "SourceShards",
              hessians: CalibrationHessians | None, bar: tqdm) -> None:

    def finished(shard: ShardJob, shard_stats: dict) -> None:
        state.shards[shard.name] = shard_stats
        state.save()

    if opts.workers <= 1:
        previous_threads = torch.get_num_threads()
        torch.set_num_threads(intra_op_threads(1))
        try:
            for shard in todo:
                sources.acquire(shard)
                stats = run_shard_job(str(opts.dst), shard, _partners(plan, shard), input_scales, BarFeed(bar),
                                      opts.device, hessians=hessians)
                finished(shard, stats)
                sources.done(shard)
        finally:
            torch.set_num_threads(previous_threads)
        return

    ctx = get_context("spawn")
    quiet_openmp_for_workers()
    with ctx.Manager() as manager:
        q = manager.Queue()
        pool = ProcessPoolExecutor(opts.workers, mp_context=ctx, initializer=init_worker,
                                   initargs=(intra_op_threads(opts.workers),))
        running: dict[Future, ShardJob] = {}
        pending = list(todo)
        try:
            while pending or running:
                while pending and len(running) < opts.workers and (
                        sum(pipeline_memory(s) for s in running.values()) + pipeline_memory(pending[0]) <= max_memory
                        or not running):
                    shard = pending.pop(0)
                    sources.acquire(shard)
                    fut = pool.submit(run_shard_job, str(opts.dst), shard, _partners(plan, shard), input_scales, q,
                                      opts.device, hessians=hessians)
                    running[fut] = shard
                done, _ = wait(running, timeout=0.2, return_when=FIRST_COMPLETED)
                while not q.empty():
                    bar.update(q.get())
                for fut in done:
                    shard = running.pop(fut)
                    finished(shard, fut.result())
                    sources.done(shard)
        except BaseException:
            for fut in running:
                fut.cancel()
            pool.shutdown(wait=True, cancel_futures=True)
            raise
        pool.shutdown(wait=True)


def _gptq_hessians(plan: Plan, opts: ConvertOptions) -> CalibrationHessians | None:
    if not opts.gptq:
        return None
    if opts.calibration is None:
        raise DSV4Error("--gptq needs --calibration FILE with Hessians (dsv4convert calibrate --hessians)")
    gptq = calibrated_by(Calibration.HESSIAN)
    if not any(m.target.format in gptq and m.role is Role.ROUTED_EXPERT for m in plan.modules.values()):
        raise DSV4Error(f"--gptq applies to INT4 routed experts, and recipe '{plan.recipe.name}' makes none",
                        file=plan.recipe.source)
    return calibration_hessians(opts.calibration)


class SourceShards:
    """Which source shards each job reads; for a Hub source, fetches them ahead and frees them after.

    A local source needs nothing: ``acquire`` and ``done`` only count. With a Hub source the
    shards a job reads are downloaded before it starts (the next job's while it runs), and with
    ``delete_after_use`` a shard leaves the cache once every job that reads it is done.
    """

    def __init__(self, ckpt: Checkpoint, todo: list[ShardJob], input_scales: InputScales | None, *,
                 delete_after_use: bool):
        self.needs = {job.name: sorted(_source_files(job, input_scales)) for job in todo}
        self.order = [job.name for job in todo]
        self.readers = {f: sum(f in files for files in self.needs.values()) for f in
                        {f for files in self.needs.values() for f in files}}
        self.fetcher = ShardFetcher(ckpt.remote, ckpt.root, delete_after_use=delete_after_use) \
            if ckpt.remote is not None else None

    def acquire(self, job: ShardJob) -> None:
        if self.fetcher is None:
            return
        later = self.order[self.order.index(job.name) + 1:]
        self.fetcher.acquire(self.needs[job.name], upcoming=[f for name in later for f in self.needs[name]])

    def done(self, job: ShardJob) -> None:
        for f in self.needs[job.name]:
            self.readers[f] -= 1
            if self.readers[f] == 0 and self.fetcher is not None:
                self.fetcher.release(f)

    def close(self) -> None:
        if self.fetcher is not None:
            self.fetcher.close()


def _source_files(job: ShardJob, input_scales: InputScales | None) -> set[str]:
    files = {e.path.name for m in job.modules for e in m.sources.values()}
    for m in job.modules:
        if m.target.format in calibrated_by(Calibration.ACTIVATION_AMAX) and input_scales is not None:
            norm = input_scales.norm_entries.get(m.module.split(".ffn.")[0])
            if norm is not None:
                files.add(norm.path.name)
    return files


def source_windows(todo: list[ShardJob], input_scales: InputScales | None, workers: int,
                   ahead: int = 1) -> list[set[str]]:
    """The source shards held at once while each job starts, when shards are deleted after use.

    An output shard may read several source shards (its modules need not fall in one), up to
    ``workers`` jobs run at once, and the fetcher downloads the next ``ahead`` shards the later
    jobs read: so peak disk is the largest of these windows, not a fixed two shards.
    """
    needs = [sorted(_source_files(job, input_scales)) for job in todo]
    windows = []
    for i in range(len(needs)):
        held = {f for files in needs[i:i + workers] for f in files}
        upcoming = [f for files in needs[i + workers:] for f in files if f not in held]
        windows.append(held | set(dict.fromkeys(upcoming[:ahead])))
    return windows


def _download_bytes(ckpt: Checkpoint, todo: list[ShardJob], opts: ConvertOptions,
                    input_scales: InputScales | None) -> int:
    """Disk the source shards still to be downloaded will take (the largest window of
    :func:`source_windows` when deleted after use)."""
    if ckpt.remote is None:
        return 0
    sizes = {p.name: ckpt.headers[p].file_size for p in ckpt.shards if not p.exists()}
    if not opts.delete_source_shards:
        return sum(sizes.values())
    return max((sum(sizes.get(f, 0) for f in window) for window in source_windows(todo, input_scales, opts.workers)),
               default=0)


def _file_digest(path: Path | None) -> str | None:
    if path is None:
        return None
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def aggregate(state: RunState) -> dict:
    roles: dict[str, dict] = defaultdict(lambda: defaultdict(float))
    sources: dict[str, int] = defaultdict(int)
    for shard in state.shards.values():
        for role, row in shard["roles"].items():
            for key, value in row.items():
                roles[role][key] = max(roles[role][key], value) if key == "max_abs_error" else roles[role][key] + value
        for key, value in shard.get("input_scale_sources", {}).items():
            sources[key] += value
    total = sum(r.get("blocks_total", 0) for r in roles.values())
    exact = sum(r.get("blocks_exact", 0) for r in roles.values())
    return {
        "roles": {k: {kk: (int(v) if kk != "max_abs_error" else v) for kk, v in r.items()} for k, r in sorted(roles.items())},
        "total_blocks": int(total),
        "lossless_blocks": int(exact),
        "input_scale_source": dict(sources),
    }


def _finish(plan: Plan, ckpt: Checkpoint, opts: ConvertOptions, state: RunState, config: dict,
            extra_files: dict[str, dict], engines: tuple[str, ...]) -> dict:
    """The last step, after every shard is written; an unexpected failure in it keeps the shards for ``--resume``
    (no index is written, so the directory does not look complete) and says where it failed, in one line."""
    try:
        return _finalize(plan, ckpt, opts, state, config, extra_files, engines)
    except (DSV4Error, KeyboardInterrupt):
        raise
    except Exception as exc:
        where = traceback.extract_tb(exc.__traceback__)[-1]
        raise DSV4Error(f"the last step (model card, index) failed: {type(exc).__name__}: {exc} "
                        f"({Path(where.filename).name}:{where.lineno}, a bug: please report it); all "
                        f"{len(state.shards)} shards are written and kept, and no index was written: run the same "
                        "command with --resume to finish without converting again", file=opts.dst) from exc


def _finalize(plan: Plan, ckpt: Checkpoint, opts: ConvertOptions, state: RunState, config: dict,
              extra_files: dict[str, dict], engines: tuple[str, ...]) -> dict:
    dst = opts.dst
    copy_small_files(ckpt.small_files(), dst, skip=GENERATED_FILES)
    atomic_write_json(dst / "config.json", config)
    for name, obj in extra_files.items():
        atomic_write_json(dst / name, obj)
    stats = aggregate(state)
    stats["tensors_quantized"] = sum(len(m.outputs) for m in plan.modules.values() if m.converts)
    stats["tensors_kept"] = sum(len(m.outputs) for m in plan.modules.values() if not m.converts)
    stats["bytes_in"] = plan.bytes_in
    stats["bytes_out"] = plan.bytes_out
    weight_map = {p.name: shard.name for shard in plan.shards for p in shard.planned}
    provenance = {
        "tool": f"dsv4convert {__version__}",
        "source": str(opts.src),
        "source_index_sha256": _file_digest(ckpt.index_file) if ckpt.index_file else None,
        "recipe": {"name": plan.recipe.name, "sha256": plan.recipe.digest, "text": plan.recipe.text},
        "started": state.started,
        "input_scales_from": opts.input_scales_from,
        "calibration_sha256": _file_digest(opts.calibration),
        "engines": list(engines),
        "stats": stats,
    }
    atomic_write_json(dst / "provenance.json", provenance)
    reach("output: re-inspecting")
    output = Checkpoint.from_weight_map(dst, weight_map, config, total_size=plan.bytes_out)
    result = inspect_checkpoint(output)
    if not result.ok:
        problem = result.first_problem()
        raise DSV4Error(f"output failed its layout check ({problem}); no index was written", file=dst)
    opened = (output, result)
    problems = servable_engines(_source_config(ckpt, opts), plan.module_formats())
    not_for = {e: problems[e] or f"made for --engine {eng.choice_of(engines)} only" for e in eng.ENGINES
               if e not in engines}
    card = render_model_card(
        variant=result.variant, base_model=base_model_id(str(opts.src), ckpt.root), recipe_name=plan.recipe.name,
        recipe_text=plan.recipe.text, formats_by_role=result.formats_by_role(), stats=stats,
        launch=default_launch(dst, result.variant, opened=opened) if eng.SGLANG in engines else {},
        engines=engines, not_for=not_for, source_meta=source_card_metadata(ckpt.root), model_dir=dst,
        source=str(opts.src), draft=draft_lines(plan.config, kept=not opts.no_mtp),
        vllm_launch=vllm_default_launch(dst, result.variant, opened=opened) if eng.VLLM in engines else None)
    atomic_write_bytes(dst / "README.md", card.encode("utf-8"))
    # The index goes last: until it exists no loader takes the directory for a checkpoint.
    write_index(dst, weight_map, plan.bytes_out)
    state.complete = True
    state.save()
    stats["variant"] = result.variant
    return stats


def _source_config(ckpt: Checkpoint, opts: ConvertOptions) -> dict:
    """The source's config.json as the output describes it: without the drafter under ``--no-mtp``."""
    return without_drafter(ckpt.config) if opts.no_mtp else ckpt.config


def _dropped_draft(plan: Plan) -> str:
    """What ``--no-mtp`` left out, in one sentence."""
    if not plan.dropped:
        return "--no-mtp: the source has no mtp.* drafter; nothing is left out"
    what = "DSpark drafter" if plan.config.drafter is Drafter.DSPARK else "MTP draft block"
    blocks = len({e.name.split(".")[1] for e in plan.dropped})
    return (f"--no-mtp: the {what} ({blocks} block{'s' if blocks > 1 else ''} under mtp.*, {len(plan.dropped):,} "
            f"tensors, {human_bytes(sum(e.nbytes for e in plan.dropped))}) is left out: the output serves without "
            "speculative decoding, and its model card says so")


def print_plan(plan: Plan, ckpt: Checkpoint, opts: ConvertOptions, max_memory: int, engines: tuple[str, ...]) -> None:
    print(f"plan: {ckpt.root} -> {opts.dst} with recipe '{plan.recipe.name}' ({plan.recipe.source})")
    print(f"  for {' and '.join(eng.LABELS[e] for e in engines)} (--engine {eng.choice_of(engines)})")
    print(f"  read {human_bytes(plan.bytes_in)}, write {human_bytes(plan.bytes_out)} in {len(plan.shards)} shards")
    per_worker = max((pipeline_memory(s) for s in plan.shards), default=0)
    print(f"  estimated peak memory {human_bytes(per_worker)} per worker x {opts.workers} "
          f"(budget {human_bytes(max_memory)}); disk needed {human_bytes(plan.bytes_out)}")
    print(f"  {'role':28s} modules")
    for role, row in plan.summary().items():
        print(f"  {role:28s} " + ", ".join(f"{k} x{v}" for k, v in sorted(row.items())))
    print("dry run: nothing written")


def print_stats(result: ConvertResult) -> None:
    s = result.stats
    print(f"\nconverted to {result.dst} (variant {s.get('variant')}) in {result.seconds:.1f} s, "
          f"{human_bytes(s['bytes_in'] / max(result.seconds, 1e-9))}/s of source")
    print(f"  {'role':28s} {'converted':>9s} {'kept':>6s} {'lossless blocks':>18s}")
    for role, row in s["roles"].items():
        blocks = f"{row.get('blocks_exact', 0)}/{row['blocks_total']}" if row.get("blocks_total") else "-"
        print(f"  {role:28s} {row.get('converted', 0):9d} {row.get('kept', 0):6d} {blocks:>18s}")
    if s["total_blocks"]:
        print(f"  lossless blocks: {s['lossless_blocks']}/{s['total_blocks']} "
              f"({100.0 * s['lossless_blocks'] / s['total_blocks']:.4f}%)")
    if s["input_scale_source"]:
        print("  NVFP4 input_scale from: " + ", ".join(f"{k} x{v}" for k, v in s["input_scale_source"].items()))
    print(f"  bytes in {human_bytes(s['bytes_in'])}, out {human_bytes(s['bytes_out'])}")


