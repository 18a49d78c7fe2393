"""What ``fit`` sizes: a checkpoint's real tensors, or a shipped variant planned from config.json alone.

A checkpoint is read header by header (``Checkpoint.open``, no weights); a planned variant runs the
shipped recipe's conversion plan over the native inventory the config implies (what
``inspect --expected`` lists), so its bytes are exactly what ``convert`` would write. Either way the
launch comes from ``serve``'s own planner (:func:`dsv4convert.serve.launch.server_args`) and the
loader's dtype rules from what ``compare`` derives from that launch
(:func:`dsv4convert.compare.numerics.serving_for`): one source for what a server runs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from dsv4convert.checkpoint import Checkpoint
from dsv4convert.checkpoint.safetensors_io import TensorEntry
from dsv4convert.compare.numerics import serving_for
from dsv4convert.dtypes import nbytes
from dsv4convert.fit.sizing import KvGeometry, LoadRules, ServerSettings, Tensor, classified, read_server_args
from dsv4convert.inspection import Inspection, inspect_checkpoint
from dsv4convert.layout import ModelConfig, Role, TensorInfo, native_inventory
from dsv4convert.serve.launch import LaunchOptions, served_like, server_args, variant_defaults

# Shipped variants and the recipe that makes each (None: the native checkpoint as released), as
# ``convert`` makes them by default (for both engines).
SHIPPED: dict[str, str | None] = {"native": None, "fp8": "fp8", "nvfp4": "nvfp4", "nvfp4-mtp-mxfp4": "nvfp4-mtp-mxfp4",
                                  "w4a16": "w4a16", "bf16": "bf16"}
PLANNED_ROOT = Path("<planned>")


@dataclass(frozen=True)
class Source:
    """One model to size: its stored tensors, config and the shipped variant whose launch rules apply."""

    label: str
    variant: str           # served_like(): the launch rules that apply
    config: dict
    tensors: list[tuple[Tensor, TensorInfo]]   # with their roles, classified once
    inspection: Inspection

    @property
    def has_draft(self) -> bool:
        return any(info.is_mtp for _, info in self.tensors)

    @property
    def geometry(self) -> KvGeometry:
        cfg = ModelConfig.from_dict(self.config)
        ratios = cfg.compress_ratios[: cfg.num_hidden_layers]
        return KvGeometry({r: ratios.count(r) for r in sorted(set(ratios))}, cfg.head_dim, cfg.index_head_dim)

    def settings(self, gpu_family: str, role: str, tp: int, *, mtp: bool,
                 extra_args: tuple[str, ...] = ()) -> ServerSettings:
        """The server ``serve`` would start for this model (its own argv, read back)."""
        options = LaunchOptions(model="MODEL", variant=self.variant, gpu_family=gpu_family, mtp=mtp,
                                extra_args=extra_args)
        return read_server_args(role, server_args(options, role, tp, options.server_port, options.prefill_nccl_port))

    def load_rules(self, gpu_family: str, settings: ServerSettings) -> LoadRules:
        """How SGLang stores these tensors on this family: ``wo_a`` as BF16 where the FP8 wo_a GEMM is off,
        the NVFP4 MoE method's second copy of its block scales except under TRT-LLM (sm_100's runner), and
        MXFP4 expert scales as F32 in the TRT-LLM MXFP4 method (``serve``'s ``variant_defaults`` names it)."""
        serving = serving_for(self.inspection, self.config, engine="sglang", gpu_family=gpu_family)
        trtllm = settings.moe_runner_backend is None and gpu_family == "sm100"
        methods = variant_defaults(self.variant, gpu_family)
        mxfp4 = tuple(4 if method == "Mxfp4FlashinferTrtllmMoEMethod" else 1      # it holds E8M0 scales as F32
                      for method in (methods.moe_method, methods.draft_moe_method))
        return LoadRules(wo_a_bf16=serving.wo_a() is None, nvfp4_scale_copies=1 if trtllm else 2,
                         mxfp4_scale_bytes=mxfp4)


def _virtual(config: dict, specs: list[tuple[str, str, tuple[int, ...]]]) -> Checkpoint:
    """A checkpoint of headers only (no file is ever read): what the planner and ``inspect`` need."""
    entries = {name: TensorEntry(name, dtype, tuple(shape), PLANNED_ROOT, 0, nbytes(dtype, shape))
               for name, dtype, shape in specs}
    return Checkpoint(PLANNED_ROOT, entries, [PLANNED_ROOT], {}, config, None, None)


def _source(label: str, ckpt: Checkpoint) -> Source:
    return from_opened(label, ckpt, inspect_checkpoint(ckpt))


def from_opened(label: str, ckpt: Checkpoint, inspection: Inspection) -> Source:
    """A checkpoint already opened and inspected (the converter's output, for its model card)."""
    formats = {m.module: (m.format, m.params) for m in inspection.modules.values() if m.format is not None}
    tensors = classified(Tensor(e.name, e.dtype, tuple(e.shape), e.nbytes) for e in ckpt.tensors.values())
    return Source(label, served_like(inspection.variant, formats), ckpt.config, tensors, inspection)


def from_checkpoint(model: str | Path) -> Source:
    """A local checkpoint directory or Hub repo id: shard headers only (raises CheckpointError if not V4)."""
    ckpt = Checkpoint.open(model)
    ModelConfig.from_dict(ckpt.config, source=str(ckpt.root / "config.json"))
    return _source(str(model), ckpt)


def from_plan(label: str, plan, source_config: dict, engines: tuple[str, ...] = ("sglang", "vllm")) -> Source:
    """What a conversion plan (``convert.plan.Plan`` of the checkpoint ``source_config`` describes) would
    write, sized before anything is written."""
    from dsv4convert.convert.quant_config import build_quant_config

    config, _ = build_quant_config(source_config, plan.module_formats(), engines=engines)
    return _source(label, _virtual(config, [(p.name, p.dtype, tuple(p.shape)) for job in plan.modules.values()
                                            for p in job.outputs]))


def _compact(config: dict) -> tuple[dict, dict[str, int], int]:
    """The config of a model with one backbone layer of each kind V4 has (compress ratio, hash or score
    routing) and one routed expert per layer: (its config, how many full-model layers each of its layers
    stands for, how many experts its one stands for). Every layer of a kind plans alike (the recipes match
    roles, not layer numbers), and so does every expert; the router's gate rows scale with the experts."""
    cfg = ModelConfig.from_dict(config)
    kinds: dict[tuple[bool, int], int] = {}
    for i in range(cfg.num_hidden_layers):
        key = (not cfg.is_hash_block(f"layers.{i}"), cfg.ratio(f"layers.{i}"))
        kinds[key] = kinds.get(key, 0) + 1
    order = sorted(kinds, key=lambda kind: kind[0])            # hash layers first, as V4 numbers them
    ratios = [ratio for _, ratio in order] + list(cfg.compress_ratios[cfg.num_hidden_layers:])
    compact = {**config, "num_hidden_layers": len(order), "num_hash_layers": sum(not score for score, _ in order),
               "compress_ratios": ratios, "n_routed_experts": 1}
    return compact, {f"layers.{i}": kinds[kind] for i, kind in enumerate(order)}, cfg.n_routed_experts


def _copies(info: TensorInfo, layers: dict[str, int], experts: int) -> int:
    block = ".".join(info.module.split(".")[:2])
    per_expert = info.role is Role.ROUTED_EXPERT or (info.role is Role.ROUTER and info.param != "tid2eid")
    return layers.get(block, 1) * (experts if per_expert else 1)



def planned(variant: str, config: dict, *, compact: bool = True) -> Source:
    """A shipped variant as ``convert`` would write it from the native checkpoint ``config`` describes.

    ``compact``: plan one layer of each kind with one expert and count each planned tensor for the
    full-model tensors it stands for (``Tensor.copies``; tests/test_fit.py checks it against the full
    plan): the full V4-Flash plan classifies ~200,000 tensors (10-20 s per variant), this one ~200.
    """
    from dsv4convert.convert.plan import build_plan
    from dsv4convert.convert.recipe import load_recipe

    plan_config, layers, experts = _compact(config) if compact else (config, {}, 1)
    native = _virtual(plan_config, [(s.name, s.dtype, s.shape) for s in native_inventory(ModelConfig.from_dict(plan_config))])
    recipe = SHIPPED[variant]
    src = _source(variant, native) if recipe is None else from_plan(
        variant, build_plan(native, load_recipe(recipe), engine="both"), plan_config)
    # The full model's layer counts (the KV geometry reads them) over what the plan wrote.
    full = {key: config[key] for key in ("num_hidden_layers", "num_hash_layers", "compress_ratios", "n_routed_experts")
            if key in config}
    tensors = [(replace(t, copies=_copies(info, layers, experts)), info) for t, info in src.tensors]
    return replace(src, config={**src.config, **full}, tensors=tensors)
