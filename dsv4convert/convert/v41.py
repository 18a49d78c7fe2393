"""DeepSeek-V4.1-Flash through the shipped recipes: one output shard per source shard, tensor by tensor.

What each variant changes (everything else is the release's bytes, copied file to file by the writer, never read
into memory: the Engram tables above all, 98 GB each at full size):

* ``nvfp4``: the backbone's routed experts MXFP4 -> NVFP4 group 16, the E2M1 codes kept and only the scales
  rewritten (the registry's MXFP4 -> NVFP4 transcode), as NVIDIA's DeepSeek-V4.1-Flash-NVFP4; the DSpark stages'
  experts stay MXFP4 (both engines exclude ``mtp.*`` from NVFP4 and read them as MXFP4).
* ``fp8``: every routed expert MXFP4 -> FP8 in the release's 32 x 32 blocks with E8M0 scales (exact unless a tile's
  scales span more than 14 binades, reported), ``expert_dtype`` fp8: SGLang only (``Fp8MoEMethod``), since vLLM has no
  FP8 MoE kernel for 32-wide blocks (``engines/vllm/quant_config.py::v41_problem``).
* ``bf16``: every FP8 32 x 32 linear and every MXFP4 expert dequantized to BF16 (exact), no quantization_config.
* ``w4a16``: the backbone's routed experts INT4 (compressed-tensors pack-quantized, the recipe's group and scale rule),
  the DSpark stages' experts BF16 (exact), the FP8 linears kept (SGLang's ``linear_fp8_config``): SGLang only, since
  vLLM claims no compressed-tensors config for V4.1. SGLang 0.5.23's real V4.1 model and DSpark draft load it
  (tests/test_v41_convert.py), although no W4A16 of V4.1 was published.

In every variant the tensors both engines build in one dtype whatever the config (the Engram tables, the
compressor, the indexer's BF16 half, the vision tower: ``engines/stored.py::V41_NEVER_QUANTIZED``) are the release's.
"""

from __future__ import annotations

import hashlib
import sys
import time
from collections import Counter, defaultdict
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path

import torch
from tqdm import tqdm

from dsv4convert import __version__
from dsv4convert import engines as eng
from dsv4convert.calibration import InputScales
from dsv4convert.checkpoint import (
    INDEX_NAME,
    Checkpoint,
    PlannedTensor,
    ShardWriter,
    SourceBytes,
    TensorEntry,
    atomic_write_bytes,
    atomic_write_json,
    read_tensor,
)
from dsv4convert.checkpoint.writer import copy_small_files, write_index
from dsv4convert.convert.model_card_v41 import V41Card, render
from dsv4convert.convert.modules import (
    ModuleContext,
    check_finite,
    check_source_finite,
    convert_module,
    read_module,
)
from dsv4convert.convert.pipeline import init_worker, intra_op_threads, quiet_openmp_for_workers
from dsv4convert.convert.plan import ModuleJob
from dsv4convert.convert.recipe import Recipe, Target, canonical, load_recipe
from dsv4convert.convert.state import DestinationLock, prepare_destination, signature
from dsv4convert.engines.config import v41_config
from dsv4convert.engines.outputs_v41 import VARIANTS, action_of, expected_outputs
from dsv4convert.engines.vllm.quant_config import v41_problem as vllm_v41_problem
from dsv4convert.errors import DSV4Error, RecipeError
from dsv4convert.formats import Format, dequantize_fp8_block, linear_storage, mxfp4_to_fp8_block
from dsv4convert.models.deepseek_v4.layout import MXFP4_GROUP, Role, TensorSpec
from dsv4convert.models.deepseek_v4.names import in_draft
from dsv4convert.models.deepseek_v41 import inventory
from dsv4convert.models.deepseek_v41 import release as v41
from dsv4convert.models.deepseek_v41.config import V41Config
from dsv4convert.models.registry import release_of

GENERATED = {"config.json", "provenance.json", "README.md", "hf_quant_config.json", "model.safetensors.index.json"}


def handles(config: dict, source: str) -> bool:
    """Whether ``config`` is a DeepSeek-V4.1 checkpoint's (converted here, not by the V4 planner)."""
    return release_of(config, source) is v41


@dataclass
class V41Result:
    dst: Path
    variant: str
    stats: dict = field(default_factory=dict)
    seconds: float = 0.0
    engines: tuple[str, ...] = eng.ENGINES


@dataclass
class _Module:
    """One unit of the output: a linear (its weight and scale) or one tensor, with what it becomes."""

    name: str
    role: str
    sources: dict[str, TensorEntry]
    action: str                   # keep, nvfp4, fp8, int4, bf16 (experts), dequant (FP8 linear)
    job: ModuleJob | None = None  # the registry's module conversion, where it makes this one

    def outputs(self, cfg: V41Config) -> list[PlannedTensor]:
        if self.job is not None:
            return list(self.job.outputs)
        w = self.sources.get("weight")
        if self.action == "dequant":
            return [PlannedTensor(f"{self.name}.weight", "BF16", w.shape)]
        if self.action == "fp8":
            n, k = _mxfp4_shape(self.sources)
            b = cfg.fp8_block
            return [PlannedTensor(f"{self.name}.weight", "F8_E4M3", (n, k)),
                    PlannedTensor(f"{self.name}.scale", "F8_E8M0", (-(-n // b[0]), -(-k // b[1])))]
        return [PlannedTensor(e.name, e.dtype, e.shape) for e in self.sources.values()]


def _mxfp4_shape(sources: dict[str, TensorEntry]) -> tuple[int, int]:
    return sources["weight"].shape[0], sources["scale"].shape[1] * MXFP4_GROUP


def _shipped_variant(recipe: Recipe) -> str:
    """The V4.1 variant a recipe asks for: a shipped recipe exactly as shipped; anything else is refused."""
    name = recipe.name
    if name not in VARIANTS or recipe.digest != load_recipe(name).digest:
        raise RecipeError(f"DeepSeek-V4.1 is converted by the shipped recipes {', '.join(VARIANTS)} as shipped; "
                          f"recipe '{name}' is not one of them", file=recipe.source)
    return name


def check_source(ckpt: Checkpoint) -> V41Config:
    """A V4.1 source as the converters and ``validate --against`` need it: its config, every header against it,
    exactly the planned tensors, and its tokenizer (each refusal one line naming the file and tensor)."""
    source = str(ckpt.root / "config.json")
    cfg = v41.read_config(ckpt.config, source)
    if cfg.expert_dtype != "fp4":
        raise DSV4Error(f"a converted DeepSeek-V4.1 (expert_dtype {cfg.expert_dtype}); convert the release itself "
                        "(quantization_config with FP8 32x32 linears and MXFP4 experts)", file=source)
    v41.check_checkpoint(cfg, ckpt.tensors.values())
    planned = [s.name for s in inventory.native_inventory(cfg)]
    missing = [n for n in planned if n not in ckpt.tensors]
    if missing:
        raise DSV4Error("missing: the config plans it and both engines would leave its parameter unwritten without a "
                        "word (neither refuses a missing tensor)", file=ckpt.root, tensor=missing[0])
    known = set(planned)
    extra = [e for n, e in ckpt.tensors.items() if n not in known]
    if extra:
        raise DSV4Error("not a tensor of DeepSeek-V4.1's layout for this config", file=extra[0].path,
                        tensor=extra[0].name)
    v41.check_tokenizer(ckpt.root, cfg)
    return cfg


def _modules(ckpt: Checkpoint, variant: str, targets: dict[str, Target], block: tuple[int, int]
             ) -> list[list[_Module]]:
    """Per source shard, its modules in file order with what each becomes."""
    shards = []
    for shard in ckpt.shards:
        by_module: dict[str, dict[str, TensorEntry]] = defaultdict(dict)
        for entry in ckpt.tensors_in(shard):
            module, _, param = entry.name.rpartition(".")
            if param in ("weight", "scale") and f"{module}.scale" in ckpt.tensors:
                by_module[module][param] = entry
            else:
                by_module[entry.name]["tensor"] = entry
        shards.append([_module(name, sources, variant, targets, block) for name, sources in by_module.items()])
    return shards


def _module(name: str, sources: dict[str, TensorEntry], variant: str, targets: dict[str, Target],
            block: tuple[int, int]) -> _Module:
    role = inventory.role_of(next(iter(sources.values())).name)
    action = action_of(role, set(sources) == {"weight", "scale"}, variant)
    if action in targets:
        partner = name[:-2] + {"w1": "w3", "w3": "w1"}[name[-2:]] \
            if action == "nvfp4" and name.endswith((".w1", ".w3")) else None
        job = ModuleJob(name, Role.ROUTED_EXPERT, in_draft(name), sources, Format.MXFP4, targets[action],
                        block, _mxfp4_shape(sources), partner)
        return _Module(name, role, sources, action, job)
    return _Module(name, role, sources, action)


def _targets(recipe: Recipe) -> dict[str, Target]:
    """The registry's targets of the expert actions; INT4's group and scale rule are the shipped recipe's (its
    first rule: the routed experts)."""
    return {"nvfp4": Target(Format.NVFP4), "bf16": Target(Format.BF16), "int4": recipe.rules[0].target}


def _produce(module: _Module, cfg: V41Config, ctx: ModuleContext, partners: dict[str, dict]
             ) -> tuple[list[tuple[str, torch.Tensor | SourceBytes]], object]:
    """A module's output tensors (source bytes where kept) and its exactness report (transcodes only)."""
    if module.job is not None:
        job = module.job
        context = ModuleContext(partner_sources=partners.get(job.partner, {}) if job.partner else {},
                                input_scale=ctx.input_scale)
        result = convert_module(job, context, read_module(job, context))
        return result.tensors, result.report
    if module.action == "keep":
        for entry in module.sources.values():
            check_source_finite(entry)
        return [(e.name, SourceBytes(e, e.dtype, e.shape)) for e in module.sources.values()], None
    w, s = (_read(module.sources[p]) for p in ("weight", "scale"))
    if module.action == "dequant":
        return [(f"{module.name}.weight", dequantize_fp8_block(w, s, block=cfg.fp8_block, out_dtype=torch.bfloat16,
                                                               name=f"{module.name}.weight"))], None
    weight, scale, report = mxfp4_to_fp8_block(w, s, block=cfg.fp8_block, name=f"{module.name}.weight")
    return [(f"{module.name}.weight", weight), (f"{module.name}.scale", scale)], report


def _read(entry: TensorEntry) -> torch.Tensor:
    t = read_tensor(entry)
    check_finite(t, entry)
    return t


# The options a V4.1 conversion refuses, and why (one line each, before anything is read or written).
REFUSED = {
    "--calibration": "calibration files come from 'dsv4convert calibrate', which runs dsv4convert's DeepSeek-V4 "
                     "forward; there is no DeepSeek-V4.1 forward to calibrate with. V4.1's expert casts are exact "
                     "(MXFP4 codes kept) and its NVFP4 input_scales are the data-free bound",
    "--gptq": "GPTQ needs Hessians of the experts' inputs from a calibration run of DeepSeek-V4.1's forward, which "
              "dsv4convert does not have; to-w4a16 rounds V4.1's experts to nearest",
    "--input-scales-from": "another checkpoint's input_scales are not read for DeepSeek-V4.1 by this version; its "
                           "NVFP4 experts get the data-free input_scale bound",
    "--no-mtp": "the DSpark drafter is announced by text_config (num_nextn_predict_layers, dspark_*, the last "
                "compress_ratios), which a V4.1 conversion keeps as released; both engines would build the stages",
    "--delete-source-shards": "the V4.1 converter reads a local checkpoint; download it first (hf download)",
    "--device": "the V4.1 converter runs its numerics on the CPU (the outputs' bytes are the same)",
    "--max-shard-size": "a V4.1 output keeps the source's sharding: one output shard per source shard, so each "
                        "Engram table (one tensor of up to 98 GB, larger than any shard limit) stays alone in its own",
    "--max-memory": "a V4.1 conversion holds one module per worker (kept tensors, the Engram tables included, are "
                    "copied file to file): --workers is what sets its memory",
}


def refuse(flags: list[str], dst: Path) -> None:
    """The first of ``flags`` (options given on the command line) a V4.1 conversion does not take, in one line."""
    if flags:
        raise DSV4Error(f"{flags[0]} is not taken for DeepSeek-V4.1 sources: {REFUSED[flags[0]]}", file=dst)


@dataclass(frozen=True)
class _ShardTask:
    """One output shard: what a (worker) process needs to write it."""

    dst: str
    name: str
    modules: list[_Module]
    planned: list[PlannedTensor]
    cfg: V41Config
    input_scales: InputScales
    partners: dict[str, dict]


def _write_shard(task: _ShardTask, bar: tqdm | None = None) -> dict:
    """Write one output shard (to a temporary name, renamed when complete); its record for the resume state."""
    ctx = ModuleContext(input_scale=task.input_scales)
    record = {"converted": 0, "kept": 0, "blocks_total": 0, "blocks_exact": 0}
    path = Path(task.dst) / task.name
    with ShardWriter(path, task.planned, metadata={"format": "pt"}) as writer:
        for module in task.modules:
            tensors, report = _produce(module, task.cfg, ctx, task.partners)
            for tensor_name, tensor in tensors:
                writer.write(tensor_name, tensor)
            record["kept" if module.action == "keep" else "converted"] += 1
            if report is not None:
                record["blocks_total"] += report.blocks_total
                record["blocks_exact"] += report.blocks_exact
            if bar is not None:
                bar.update(sum(e.nbytes for e in module.sources.values()))
    record["bytes"] = path.stat().st_size
    return record


def _run_shards(tasks: list[_ShardTask], workers: int, finished, bar: tqdm) -> None:
    """Every task, in order in this process or on ``workers`` spawned processes; ``finished(task, record)`` after
    each shard is renamed into place (the order shards finish in changes no byte)."""
    if workers <= 1 or len(tasks) <= 1:
        for task in tasks:
            finished(task, _write_shard(task, bar))
        return
    quiet_openmp_for_workers()
    pool = ProcessPoolExecutor(workers, mp_context=get_context("spawn"), initializer=init_worker,
                               initargs=(intra_op_threads(workers),))
    try:
        running = {pool.submit(_write_shard, task): task for task in tasks}
        for future in as_completed(running):
            task = running[future]
            finished(task, future.result())
            bar.update(sum(e.nbytes for m in task.modules for e in m.sources.values()))
    except BaseException:
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown(wait=True)


def _write_card(ckpt: Checkpoint, dst: Path, recipe: Recipe, variant: str, engines: tuple[str, ...], config: dict,
                cfg: V41Config, shards: list[list[_Module]], planned: list[list[PlannedTensor]], stats: dict) -> None:
    """README.md: the model card (:mod:`dsv4convert.convert.model_card_v41`), from what this run planned and wrote."""
    quant = config.get("quantization_config")
    not_for = {e: (vllm_v41_problem(quant, variant) if e == eng.VLLM else None)
               or f"not asked for (--engine {eng.choice_of(engines)})" for e in eng.ENGINES if e not in engines}
    stored: dict[str, Counter] = defaultdict(Counter)
    for p in (p for ps in planned for p in ps):
        stored[inventory.role_of(p.name)][p.dtype] += 1
    card = V41Card(dst=dst, src=str(ckpt.root), variant=variant, recipe=recipe.name, engines=engines, config=config,
                   cfg=cfg, tensors=[TensorSpec(p.name, p.dtype, tuple(p.shape)) for ps in planned for p in ps],
                   actions=Counter((m.role, m.action) for mods in shards for m in mods), stored=dict(stored),
                   stats=stats, not_for=not_for)
    atomic_write_bytes(dst / "README.md", render(card).encode())


def convert_v41(ckpt: Checkpoint, *, dst: Path, recipe: Recipe, engine: str | None, overwrite: bool, resume: bool,
                workers: int, dry_run: bool, progress: bool, refused: list[str]) -> V41Result:
    """Convert a V4.1 checkpoint by a shipped recipe (module docstring); every check runs before anything is
    written, and a refusal is one line naming the file and tensor. One output shard per source shard, each
    written to a temporary name and renamed when complete, on ``workers`` processes; the resume state
    (:mod:`dsv4convert.convert.state`) records each, so ``resume`` after an interrupted run (kill -9 included)
    writes only the shards left and finishes byte-identical to an uninterrupted run."""
    t0 = time.monotonic()
    variant = _shipped_variant(recipe)
    refuse(refused, dst)
    cfg = check_source(ckpt)
    config, engines, note = v41_config(ckpt.config, variant, engine or recipe.engine)
    if note:
        print(f"note: {note}", file=sys.stderr)
    text = ckpt.config["text_config"]
    norms = {n.removesuffix(".ffn_norm.weight"): e for n, e in ckpt.tensors.items() if n.endswith(".ffn_norm.weight")}
    input_scales = InputScales(cfg.hidden_size, float(text["swiglu_limit"]), norms)
    shards = _modules(ckpt, variant, _targets(recipe), cfg.fp8_block)
    names = [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    planned = [[p for m in mods for p in m.outputs(cfg)] for mods in shards]
    total_out = sum(p.nbytes for ps in planned for p in ps)
    if dry_run:
        counts = Counter(f"{m.role}: {m.action}" for mods in shards for m in mods)
        print(f"plan: {ckpt.root} -> {dst}, DeepSeek-V4.1 variant {variant} for {eng.choice_of(engines)}: read "
              f"{ckpt.total_bytes:,} bytes, write {total_out:,} in {len(shards)} shards (one per source shard)")
        for key, n in sorted(counts.items()):
            print(f"  {key} x{n}")
        print("dry run: nothing written")
        return V41Result(dst, variant, engines=engines)
    sig = signature(ckpt, canonical(recipe), {"release": v41.NAME, "engines": list(engines)})
    state = prepare_destination(dst, sig, resume=resume, overwrite=overwrite, recipe_name=recipe.name)
    partners = {m.name: m.sources for mods in shards for m in mods if m.job is not None}
    tasks = [_ShardTask(str(dst), name, mods, plan, cfg, input_scales,
                        {m.job.partner: partners[m.job.partner] for m in mods if m.job is not None and m.job.partner})
             for name, mods, plan in zip(names, shards, planned)]
    with DestinationLock(dst):
        for stale in dst.glob(".*.partial"):
            stale.unlink()
        todo = [t for t in tasks if not state.done(dst, t.name)]
        if state.complete and not todo and (dst / INDEX_NAME).is_file():   # --resume of a finished run
            print(f"{dst}: already complete (DeepSeek-V4.1 variant {variant}, {len(tasks)} shards): nothing to do")
            return V41Result(dst, variant, engines=engines)
        for task in todo:
            state.shards.pop(task.name, None)
        state.complete = False
        state.save()

        def finished(task: _ShardTask, record: dict) -> None:
            state.shards[task.name] = record
            state.save()

        try:
            with tqdm(total=sum(e.nbytes for t in todo for m in t.modules for e in m.sources.values()), unit="B",
                      unit_scale=True, desc="convert", disable=not progress, file=sys.stderr) as bar:
                _run_shards(todo, workers, finished, bar)
        except KeyboardInterrupt:
            raise DSV4Error(f"interrupted; {len(state.shards)} of {len(tasks)} shards are complete. Run the same "
                            "command with --resume to continue", file=dst) from None
        except (BrokenProcessPool, EOFError, ConnectionError) as exc:
            raise DSV4Error(f"a worker process died ({type(exc).__name__}: killed by the system, out of memory?); "
                            f"{len(state.shards)} of {len(tasks)} shards are complete. Run the same command with "
                            "--resume to continue (fewer --workers use less memory)", file=dst) from None
        stats = {key: sum(r[key] for r in state.shards.values())
                 for key in ("converted", "kept", "blocks_total", "blocks_exact")}
        copy_small_files(ckpt.small_files(), dst, skip=GENERATED)
        atomic_write_json(dst / "config.json", config)
        atomic_write_json(dst / "provenance.json", {
            "tool": f"dsv4convert {__version__}", "source": str(ckpt.root), "release": v41.NAME, "variant": variant,
            "recipe": {"name": recipe.name, "sha256": recipe.digest}, "engines": list(engines), "stats": stats,
            "source_index_sha256": hashlib.sha256(ckpt.index_file.read_bytes()).hexdigest()
            if ckpt.index_file else None})
        write_index(dst, {p.name: t.name for t in tasks for p in t.planned}, total_out)   # last: until it exists
        _write_card(ckpt, dst, recipe, variant, engines, config, cfg, shards, planned, stats)  # no loader takes dst
        state.complete = True
        state.save()
    seconds = time.monotonic() - t0
    lossless = f", lossless blocks {stats['blocks_exact']}/{stats['blocks_total']}" if stats["blocks_total"] else ""
    print(f"converted DeepSeek-V4.1 to {dst} (variant {variant}, for {eng.choice_of(engines)}) in {seconds:.1f} s: "
          f"{stats['converted']} modules converted, {stats['kept']} kept byte for byte{lossless}")
    return V41Result(dst, variant, stats, seconds, engines)
