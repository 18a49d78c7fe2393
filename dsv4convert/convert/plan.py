"""Plan a conversion before any byte is written.

The plan says, for every module of the source, its target format and parameters, the
exact tensors it becomes (so output shard headers are known up front), which output
shard they go to, and which modules must be handled together (an expert's ``w1``/``w3``
share one NVFP4 ``weight_scale_2`` and ``input_scale``). Building it checks the recipe
against the checkpoint: a format that cannot apply to a module, or that SGLang cannot
load, is an error naming both.
"""

from __future__ import annotations

import functools
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from dsv4convert.checkpoint import Checkpoint, PlannedTensor, TensorEntry
from dsv4convert.checkpoint.writer import group_into_shards, shard_name
from dsv4convert.convert import DEFAULT_MAX_SHARD_BYTES
from dsv4convert.convert.recipe import Recipe, Target
from dsv4convert.engines import ENGINES, engines_for
from dsv4convert.engines.config import output_module
from dsv4convert.engines.stored import NEVER_QUANTIZED
from dsv4convert.errors import RecipeError
from dsv4convert.formats import Format, detect_format, linear_storage, spec, stored_params
from dsv4convert.inspection import WEIGHT_PARAMS, inspect_checkpoint
from dsv4convert.models.deepseek_v4.layout import ModelConfig, Role, classify, linear_shapes
from dsv4convert.sizes import human_bytes, parse_size  # noqa: F401 - imported from here by the features

# What a module's conversion holds at once, per element of its logical weight: the
# float32 dequantized copy, one float32 temporary, and source plus output bytes.
_WORK_BYTES_PER_ELEMENT = 4 + 4 + 2 + 2


@dataclass
class ModuleJob:
    """One module: its source tensors, its target, the tensors it becomes."""

    module: str
    role: Role
    is_mtp: bool
    sources: dict[str, TensorEntry]          # param -> source tensor
    source_format: Format | None             # None: not a linear (norms, hc, sink, router bias...)
    target: Target
    fp8_block: tuple[int, int]               # the release's FP8 block (rows, cols): what FP8 is written in
    logical_shape: tuple[int, int] | None = None
    partner: str | None = None               # module sharing NVFP4 global scales (w1 <-> w3)
    output_module: str = ""                  # its name in the output where the engines read another ("": module)

    def output_name(self, name: str) -> str:
        """A tensor's name in the output: as read or planned, unless the engines read this module under another."""
        return f"{self.output_module}.{classify(name).param}" if self.output_module else name

    @functools.cached_property
    def outputs(self) -> list[PlannedTensor]:
        """The tensors this module becomes (names, dtypes, shapes), known before any data is read."""
        if not self.converts:
            return [PlannedTensor(self.output_name(e.name), e.dtype, e.shape) for e in self.sources.values()]
        n, k = self.logical_shape
        params = self.target.params
        stored = linear_storage(self.target.format, n, k, group_size=params.get("group_size", 128),
                                fp8_scale_dtype="F32" if params.get("scale_dtype") == "float32" else "F8_E8M0",
                                fp8_block=self.fp8_block)
        out = [PlannedTensor(self.output_name(f"{self.module}.{p.suffix}"), p.dtype, p.shape) for p in stored]
        # Non-weight tensors of a converted module (none in DeepSeek-V4 today) travel unchanged.
        return out + [PlannedTensor(self.output_name(e.name), e.dtype, e.shape) for p, e in self.sources.items()
                      if p not in WEIGHT_PARAMS]

    @property
    def converts(self) -> bool:
        """False when the output tensors are the source tensors, byte for byte."""
        fmt = self.target.format
        if fmt is None:
            return False
        dtypes = {p: e.dtype for p, e in self.sources.items()}
        return not spec(fmt).unchanged(self.source_format, dtypes, self.source_params, self.target_params)

    @property
    def target_params(self) -> dict:
        """What the target format's spec is given: the recipe's params and the release's FP8 block."""
        return {**self.target.params, "fp8_block": self.fp8_block}

    @property
    def source_params(self) -> dict:
        """The stored parameters of the module's source format (``group_size`` of INT4, ``fp8_block`` of FP8)."""
        found = _detect(self.sources, self.logical_shape, self.fp8_block, self.module)
        return found[1] if found else {}

    @property
    def output_format(self) -> Format | None:
        return self.target.format if self.target.format is not None else self.source_format

    @property
    def bytes_in(self) -> int:
        return sum(e.nbytes for e in self.sources.values())

    @property
    def work_bytes(self) -> int:
        if self.logical_shape is None or not self.converts:
            return self.bytes_in
        n, k = self.logical_shape
        return n * k * _WORK_BYTES_PER_ELEMENT * (2 if self.partner else 1)


@dataclass
class ShardJob:
    name: str
    modules: list[ModuleJob]
    planned: list[PlannedTensor]

    @property
    def bytes_out(self) -> int:
        return sum(p.nbytes for p in self.planned)

    @property
    def bytes_in(self) -> int:
        return sum(m.bytes_in for m in self.modules)

    @property
    def memory_estimate(self) -> int:
        """Peak resident bytes: one module's working set at a time, plus write buffers."""
        return max((m.work_bytes for m in self.modules), default=0) + 256 * 1024**2


@dataclass
class Plan:
    recipe: Recipe
    config: ModelConfig
    shards: list[ShardJob]
    modules: dict[str, ModuleJob] = field(default_factory=dict)
    engine: str = "both"  # the engine choice the recipe's rules were resolved for
    dropped: tuple[TensorEntry, ...] = ()   # source tensors left out (--no-mtp: the drafter)

    @property
    def bytes_in(self) -> int:
        return sum(s.bytes_in for s in self.shards)

    @property
    def bytes_out(self) -> int:
        return sum(s.bytes_out for s in self.shards)

    @property
    def peak_memory(self) -> int:
        return max((s.memory_estimate for s in self.shards), default=0)

    def module_formats(self) -> dict[str, tuple[Format, dict]]:
        """Stored format of every linear module of the output (what quantization_config describes)."""
        out = {}
        for job in self.modules.values():
            if job.logical_shape is None:
                continue
            fmt = job.output_format
            # What the stored tensors say: a kept module keeps the parameters it is stored with.
            stored = {p.name.rsplit(".", 1)[1]: (p.dtype, tuple(p.shape)) for p in job.outputs}
            out[job.module] = (fmt, stored_params(fmt, stored, *job.logical_shape, fp8_block=job.fp8_block,
                                                  name=job.module))
        return out

    def summary(self) -> dict[str, dict[str, int]]:
        """Modules per role and target, e.g. {"routed_expert": {"mxfp4 -> nvfp4": 1032}}."""
        table: dict[str, Counter] = defaultdict(Counter)
        for job in self.modules.values():
            role = f"{job.role.value} (mtp)" if job.is_mtp and job.role is Role.ROUTED_EXPERT else job.role.value
            src = job.source_format.value if job.source_format else "tensor"
            dst = job.output_format.value if job.output_format else "tensor"
            table[role]["kept as " + src if not job.converts else f"{src} -> {dst}"] += 1
        return {role: dict(c) for role, c in sorted(table.items())}


def _detect(job_sources: dict[str, TensorEntry], native_shape: tuple[int, int] | None, fp8_block: tuple[int, int],
            module: str) -> tuple[Format, dict] | None:
    if native_shape is None:
        return None
    stored = {p: (e.dtype, e.shape) for p, e in job_sources.items() if p in WEIGHT_PARAMS}
    return detect_format(stored, *native_shape, fp8_block=fp8_block, name=module)


def _source_format(job_sources: dict[str, TensorEntry], native_shape: tuple[int, int] | None,
                   fp8_block: tuple[int, int], module: str) -> Format | None:
    found = _detect(job_sources, native_shape, fp8_block, module)
    return found[0] if found else None


def _check_applicable(job: ModuleJob, recipe: Recipe) -> None:
    fmt = job.target.format
    where = f"rules[{job.target.rule}]"
    if fmt is None:
        return
    if job.logical_shape is None:
        raise RecipeError(f"{where} asks for {fmt.value} but '{job.module}' is not a linear weight "
                          f"(role {job.role.value}); only 'keep' applies to it", file=recipe.source)
    if fmt is not Format.BF16 and job.role in NEVER_QUANTIZED:
        raise RecipeError(f"{where} asks for {fmt.value} on '{job.module}', but {NEVER_QUANTIZED[job.role]}; "
                          "SGLang would not load it", file=recipe.source)
    n, k = job.logical_shape
    why = spec(fmt).applicable(n, k, job.source_format, job.target_params) if job.source_format else None
    if why:
        raise RecipeError(f"{where}: {why}: '{job.module}' is [{n}, {k}]", file=recipe.source)
    if job.source_format is None:
        raise RecipeError(f"'{job.module}' is stored in a format dsv4convert cannot read", file=recipe.source)


def build_plan(ckpt: Checkpoint, recipe: Recipe, *, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
               engine: str = "both", drop_draft: bool = False) -> Plan:
    """Plan a conversion of ``ckpt`` by ``recipe`` for ``engine`` (sglang/vllm/both), without the ``mtp.*``
    drafter where ``drop_draft``; raises on anything that would fail later."""
    inspection = inspect_checkpoint(ckpt)
    problem = inspection.first_problem() if inspection.missing or inspection.mismatched or inspection.unexpected \
        else None
    if problem:
        entry = ckpt.tensors.get(problem.split(":")[0])
        raise RecipeError(f"source does not match the DeepSeek-V4 layout: {problem}",
                          file=entry.path if entry else ckpt.root, tensor=None)
    native_shapes = linear_shapes(inspection.config)

    by_module: dict[str, dict[str, TensorEntry]] = defaultdict(dict)
    module_shard: dict[str, object] = {}
    dropped: list[TensorEntry] = []
    for shard in ckpt.shards:
        for entry in ckpt.tensors_in(shard):
            info = classify(entry.name)
            if drop_draft and info.is_mtp:
                dropped.append(entry)
                continue
            by_module[info.module][info.param] = entry
            module_shard.setdefault(info.module, shard)

    infos = {module: classify(next(iter(sources.values())).name) for module, sources in by_module.items()}
    targets = {module: recipe.target_for(info, engine) for module, info in infos.items()}
    modules: dict[str, ModuleJob] = {}
    groups: dict[object, list[ModuleJob]] = defaultdict(list)
    for module, sources in by_module.items():
        info, shape = infos[module], native_shapes.get(module)
        renamed = output_module(module, engines_for(engine))
        block = inspection.fp8_block
        job = ModuleJob(module, info.role, info.is_mtp, sources, _source_format(sources, shape, block, module),
                        targets[module], block, shape, _partner(module, info.role, targets, recipe), "" if renamed == module else renamed)
        _check_applicable(job, recipe)
        modules[module] = job
        groups[module_shard[module]].append(job)

    planned_groups = [[job.outputs for job in jobs] for jobs in groups.values()]
    shard_lists = group_into_shards(planned_groups, max_shard_bytes)
    owner = {p.name: job for job in modules.values() for p in job.outputs}
    shards = []
    for i, planned in enumerate(shard_lists):
        jobs: list[ModuleJob] = []
        for p in planned:
            if not jobs or jobs[-1] is not owner[p.name]:
                jobs.append(owner[p.name])
        shards.append(ShardJob(shard_name(i + 1, len(shard_lists)), jobs, planned))
    return Plan(recipe, inspection.config, shards, modules, engine, tuple(dropped))


def _partner(module: str, role: Role, targets: dict[str, Target], recipe: Recipe) -> str | None:
    """The module sharing this one's global scales (an expert's w1 with its w3) where its format fuses them."""
    fmt = targets[module].format
    if not (fmt and spec(fmt).fused_partner and role is Role.ROUTED_EXPERT and module.endswith((".w1", ".w3"))):
        return None
    partner = module[:-2] + ("w3" if module.endswith("w1") else "w1")
    if partner not in targets or targets[partner].format is not fmt:
        raise RecipeError(f"'{module}' is {fmt.value} but '{partner}' is not: SGLang fuses w1 and w3 "
                          f"with one shared global scale, so both must be {fmt.value}", file=recipe.source)
    return partner


def cost_of_both(plan: Plan) -> list[str]:
    """What storing for both engines changes against each engine alone, one line per engine and change
    (modules counted by role): the converter prints them, so nobody is surprised by BF16 where they
    expected FP8. Empty when the plan is for one engine or no rule depends on the engine."""
    if engines_for(plan.engine) != ENGINES:
        return []
    lines = []
    for engine in ENGINES:
        changed: dict[tuple[str, str], Counter] = defaultdict(Counter)
        for job in plan.modules.values():
            alone = plan.recipe.target_for(classify(next(iter(job.sources.values())).name), engine)
            if (alone.format, alone.params) != (job.target.format, job.target.params):
                role = f"{job.role.value} (mtp)" if job.is_mtp and job.role.value != "mtp_projection" else job.role.value
                changed[(_stored(job.target, job.source_format), _stored(alone, job.source_format))][role] += 1
        for (stored, alone), roles in changed.items():
            by_role = ", ".join(f"{role} {n}" for role, n in sorted(roles.items()))
            lines.append(f"for both engines {sum(roles.values())} modules ({by_role}) are stored {stored}; "
                         f"--engine {engine} alone would store them {alone}")
    return lines


def _stored(target: Target, source: Format | None) -> str:
    if target.format is None:
        return f"as in the source ({source.value})" if source is not None else "as in the source"
    scale = target.params.get("scale_dtype")   # FP8's block scales, where the recipe or the engines chose them
    return f"{target.format.value} ({scale} scales)" if scale else target.format.value
