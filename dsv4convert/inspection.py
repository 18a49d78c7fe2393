"""``dsv4convert inspect``: what a checkpoint is, and what it lacks.

Every module of the DeepSeek-V4 layout is matched against what the checkpoint stores:
a linear module may be in any known format (``formats.detect_format``), every
other tensor must keep the native dtype and shape. From the formats found per role the
checkpoint's variant follows (native FP8+MXFP4, FP8-only, NVFP4 hybrid with FP8-block MTP
experts or with MXFP4 (``nvfp4-mtp-mxfp4``) or BF16 (``nvfp4-mtp-bf16``) ones, W4A16 with FP8 or
BF16 linears, BF16, or mixed for a custom recipe).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from dsv4convert import variants
from dsv4convert.checkpoint import Checkpoint
from dsv4convert.errors import CheckpointError
from dsv4convert.formats import Format, detect_format
from dsv4convert.models.deepseek_v4.layout import (
    DSPARK_EXPERTS_KEY,
    ModelConfig,
    Role,
    TensorInfo,
    TensorSpec,
    check_top_k,
    linear_shapes,
    native_inventory,
    try_classify,
)
from dsv4convert.models.deepseek_v4.names import DSparkNames, in_draft
from dsv4convert.models.deepseek_v4.release import describe_drafter, role_table  # noqa: F401 (inspect's table)
from dsv4convert.models.registry import release_of

# Parameters that belong to a linear's weight storage in some format; others (router
# `bias`/`tid2eid`, `ape`, bare tensors) are compared with the native spec as they are.
WEIGHT_PARAMS = frozenset(
    {"weight", "scale", "weight_scale", "weight_scale_2", "weight_scale_inv", "input_scale", "weight_packed",
     "weight_shape", "weight_zero_point", "weight_g_idx", "weight_global_scale", "input_global_scale"}
)
VARIANTS = variants.NAMES


@dataclass
class ModuleFormat:
    module: str
    role: Role
    is_mtp: bool
    format: Format | None
    params: dict = field(default_factory=dict)


@dataclass
class Inspection:
    variant: str
    config: ModelConfig
    modules: dict[str, ModuleFormat]
    missing: list[str]
    unexpected: list[str]
    mismatched: list[str]
    problems: list[str]
    tensors: list[dict]
    fp8_block: tuple[int, int]   # the release's (rows, cols) FP8 block: what FP8 is written in, and read in where
                                 # a module's shapes leave it open

    @property
    def ok(self) -> bool:
        return not (self.missing or self.unexpected or self.mismatched or self.problems)

    @property
    def drafter(self) -> str:
        """``none``, ``mtp`` (the preview's MTP block) or ``dspark`` (0731's DSpark drafter), as config.json says."""
        return self.config.drafter.value

    def first_problem(self) -> str | None:
        """The first thing wrong, in words that name what the config announces where the drafter is at fault."""
        if self.ok:
            return None
        for name in self.unexpected:
            why = self.why_unexpected(name)
            if why is not None:
                return f"{name}: {why}"
        for name in self.missing:
            if in_draft(name):
                return (f"{name} is missing: config.json announces {describe_drafter(self.config)}, and the checkpoint "
                        "does not hold all of it")
        return (self.missing + self.mismatched + self.unexpected + self.problems)[0]

    def why_unexpected(self, name: str) -> str | None:
        """Why an unexpected drafter tensor is not part of the drafter config.json announces (None: not one)."""
        info = try_classify(name)
        return _drafter_surprise(self.config, info) if info is not None and info.is_mtp else None

    def formats_by_role(self) -> dict[str, dict[str, int]]:
        out: dict[str, Counter] = defaultdict(Counter)
        for m in self.modules.values():
            key = f"{m.role.value} (mtp)" if m.is_mtp and m.role is Role.ROUTED_EXPERT else m.role.value
            out[key][m.format.value if m.format else "?"] += 1
        return {k: dict(v) for k, v in sorted(out.items())}


def _drafter_surprise(cfg: ModelConfig, info) -> str:
    """Why an ``mtp.*`` tensor is not part of the layout config.json announces."""
    dspark_names = info.role is Role.DRAFT_HEAD or info.module.endswith(
        tuple(f".{local}" for local in DSparkNames.ENTRY_LOCAL))
    if dspark_names and cfg.dspark is None:
        return ("a DSpark drafter's tensor, but config.json announces " + describe_drafter(cfg)
                + " (no dspark_* keys): it would be dropped silently by every engine")
    stage = int(info.block.split(".")[1])
    if stage >= cfg.num_draft_blocks:
        return f"beyond {describe_drafter(cfg)} config.json announces"
    if info.expert is not None and info.expert >= cfg.experts_in(info.block):
        key = DSPARK_EXPERTS_KEY if cfg.dspark is not None else "n_routed_experts"
        n = cfg.experts_in(info.block)
        return f"routed expert {info.expert} is out of range for {key} = {n} (experts 0-{n - 1})"
    if cfg.dspark is None:
        return f"not part of {describe_drafter(cfg)}"
    names = cfg.dspark.names
    local = info.module[len(info.block) + 1:]
    if info.role is Role.DRAFT_HEAD or local in ("norm", "hc_head"):
        return (f"a DSpark drafter holds its Markov and confidence heads in its last stage, {names.last}, "
                f"not {info.block}")
    if local in DSparkNames.ENTRY_LOCAL:
        return (f"a DSpark drafter projects the target's hidden states in its first stage, {names.stage(0)}, "
                f"not {info.block}")
    return "not part of a DSpark stage (e_proj/h_proj/enorm/hnorm belong to the preview's MTP block)"


def _native_modules(specs: list[TensorSpec]) -> dict[str, dict[str, TensorSpec]]:
    modules: dict[str, dict[str, TensorSpec]] = {}
    for spec in specs:
        info = spec.info
        modules.setdefault(info.module, {})[info.param] = spec
    return modules


def stored_modules(ckpt: Checkpoint) -> dict[str, TensorInfo | None]:
    """Each stored tensor's meaning (None: not a layout name), refusing two names that map to one module's
    parameter (the release's and an engine's alias): a loader keeps whichever comes later and drops the other."""
    infos: dict[str, TensorInfo | None] = {}
    owner: dict[tuple[str, str], str] = {}
    for name, entry in ckpt.tensors.items():
        info = infos[name] = try_classify(name)
        if info is None:
            continue
        first = owner.setdefault((info.module, info.param), name)
        if first != name:
            raise CheckpointError(f"stored as '{first}' (in {ckpt.tensors[first].path.name}) and as '{name}' (in "
                                  f"{entry.path.name}): two names for {info.module}.{info.param}, of which a loader "
                                  "keeps one and drops the other", file=entry.path, tensor=name)
    return infos


def check_stored_experts(cfg: ModelConfig, infos: dict[str, TensorInfo | None], source: str) -> None:
    """The routed-expert counts config.json gives, against the experts the checkpoint stores (before the
    inventory is sized by them): a count beyond every block's stored experts is a config that lies."""
    stored: dict[str, set[int]] = defaultdict(set)
    for info in infos.values():
        if info is not None and info.expert is not None:
            stored[info.block].add(info.expert)
    for draft in (False, True):
        counts = {block: len(ids) for block, ids in stored.items() if in_draft(block) == draft}
        if not counts:
            continue
        block = max(counts, key=counts.__getitem__)
        wanted = cfg.experts_in(block)
        if wanted > counts[block]:
            key = DSPARK_EXPERTS_KEY if draft and cfg.dspark is not None else "n_routed_experts"
            raise CheckpointError(f"'{key}' is {wanted}, but no {'draft block' if draft else 'layer'} stores more "
                                  f"than {counts[block]} routed experts ({block}.ffn.experts.*)", file=source)


def check_routing(ckpt: Checkpoint) -> None:
    """:func:`check_top_k` for a checkpoint read from disk, called by the commands that read one; not part of
    :func:`inspect_checkpoint`, which also plans fit's compact copy (one expert per layer, the full top-k)."""
    source = str(ckpt.root / "config.json")
    check_top_k(_v4_config(ckpt.config, source), source)


V4_READER = "calibrate"   # what a V4.1 checkpoint reaching the V4 reader asks of its release (not_yet's wording)


def _v4_config(config: dict, source: str) -> ModelConfig:
    """A checkpoint's config, once its release is one this (V4) reader handles: the commands that reach it with a
    V4.1 checkpoint (calibrate, automix, tune; compare takes V4.1 by ``compare/v41.py`` before reaching here) are
    the ones V4.1 does not have yet, and say so by name."""
    why = release_of(config, source).not_yet(V4_READER)
    if why:
        raise CheckpointError(why, file=source)
    return ModelConfig.from_dict(config, source=source)


def inspect_checkpoint(ckpt: Checkpoint) -> Inspection:
    """Match a checkpoint against the layout its config.json describes."""
    source = str(ckpt.root / "config.json")
    cfg = _v4_config(ckpt.config, source)
    fp8_block = release_of(ckpt.config, source).fp8_block(cfg)
    infos = stored_modules(ckpt)
    check_stored_experts(cfg, infos, source)
    native = _native_modules(native_inventory(cfg))
    shapes = linear_shapes(cfg)
    actual: dict[str, dict[str, tuple[str, tuple[int, ...]]]] = defaultdict(dict)
    unexpected: list[str] = []
    for name, entry in ckpt.tensors.items():
        info = infos[name]
        if info is None or info.module not in native:
            unexpected.append(name)
        else:
            actual[info.module][info.param] = (entry.dtype, entry.shape)

    missing: list[str] = []
    mismatched: list[str] = []
    modules: dict[str, ModuleFormat] = {}
    for module, params in native.items():
        have = actual.get(module, {})
        info = next(iter(params.values())).info
        is_linear = module in shapes
        if is_linear:
            stored = {p: v for p, v in have.items() if p in WEIGHT_PARAMS}
            n, k = shapes[module]
            found = detect_format(stored, n, k, fp8_block=fp8_block, name=module) if stored else None
            if not stored:
                missing.append(f"{module}.weight")
            elif found is None:
                desc = ", ".join(f"{p} {d} {list(s)}" for p, (d, s) in sorted(stored.items()))
                mismatched.append(f"{module}: stored tensors ({desc}) match no known format for a [{n}, {k}] linear")
            modules[module] = ModuleFormat(module, info.role, info.is_mtp, found[0] if found else None,
                                           found[1] if found else {})
        for param, spec in params.items():
            if param in WEIGHT_PARAMS and is_linear:
                continue
            got = have.get(param)
            if got is None:
                missing.append(spec.name)
            elif got != (spec.dtype, spec.shape):
                mismatched.append(f"{spec.name}: expected {spec.dtype} {list(spec.shape)}, found {got[0]} {list(got[1])}")
    tensors = [{"name": n, "dtype": e.dtype, "shape": list(e.shape)} for n, e in ckpt.tensors.items()]
    return Inspection(
        variant=_variant(modules.values()),
        config=cfg,
        modules=modules,
        missing=missing,
        unexpected=unexpected,
        mismatched=mismatched,
        problems=list(ckpt.problems),
        tensors=tensors,
        fp8_block=fp8_block,
    )


def _variant(modules) -> str:
    by_role: dict[tuple[Role, bool], set] = defaultdict(set)
    for m in modules:
        by_role[(m.role, m.is_mtp)].add(m.format)
    return variants.name_of(
        experts=by_role[(Role.ROUTED_EXPERT, False)], draft=by_role[(Role.ROUTED_EXPERT, True)],
        attention=by_role[(Role.ATTENTION, False)],
        dense=by_role[(Role.SHARED_EXPERT, False)] | by_role[(Role.INDEXER, False)],
        everything=set().union(*by_role.values()) if by_role else set())


def detect_variant(path: str | Path) -> str:
    """The variant of a checkpoint directory: one of ``VARIANTS``."""
    return inspect_checkpoint(Checkpoint.open(path)).variant


def expected_report(config: dict, source: str) -> dict:
    """``inspect --expected``: the native checkpoint the config implies, from the release it names."""
    return release_of(config, source).expected_report(config, source)
