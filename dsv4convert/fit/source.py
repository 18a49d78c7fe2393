"""What ``fit`` sizes: a checkpoint's real tensors, or a shipped variant planned from config.json alone.

A checkpoint is read header by header (``Checkpoint.open``, no weights); a planned variant runs the
shipped recipe's conversion plan over the native inventory the config implies (what
``inspect --expected`` lists), so its bytes are exactly what ``convert`` would write. Either way the
launch comes from ``serve``'s own planner (:func:`dsv4convert.serve.launch.server_args`) and the
loader's dtype rules from what ``compare`` derives from that launch
(:func:`dsv4convert.compare.numerics.serving_for`): one source for what a server runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dsv4convert.checkpoint import Checkpoint
from dsv4convert.checkpoint.safetensors_io import TensorEntry
from dsv4convert.compare.numerics import serving_for
from dsv4convert.dtypes import nbytes
from dsv4convert.fit.sizing import KvGeometry, LoadRules, ServerSettings, Tensor, classified, read_server_args
from dsv4convert.inspection import Inspection, inspect_checkpoint
from dsv4convert.layout import ModelConfig, TensorInfo, native_inventory
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
    inspection = inspect_checkpoint(ckpt)
    formats = {m.module: (m.format, m.params) for m in inspection.modules.values() if m.format is not None}
    tensors = classified(Tensor(e.name, e.dtype, tuple(e.shape), e.nbytes) for e in ckpt.tensors.values())
    return Source(label, served_like(inspection.variant, formats), ckpt.config, tensors, inspection)


def from_checkpoint(model: str | Path) -> Source:
    """A local checkpoint directory or Hub repo id: shard headers only (raises CheckpointError if not V4)."""
    ckpt = Checkpoint.open(model)
    ModelConfig.from_dict(ckpt.config, source=str(ckpt.root / "config.json"))
    return _source(str(model), ckpt)


def planned(variant: str, config: dict) -> Source:
    """A shipped variant as ``convert`` would write it from the native checkpoint ``config`` describes."""
    from dsv4convert.convert.plan import build_plan
    from dsv4convert.convert.quant_config import build_quant_config
    from dsv4convert.convert.recipe import load_recipe

    cfg = ModelConfig.from_dict(config)
    native = _virtual(config, [(s.name, s.dtype, s.shape) for s in native_inventory(cfg)])
    recipe = SHIPPED[variant]
    if recipe is None:
        return _source(variant, native)
    plan = build_plan(native, load_recipe(recipe), engine="both")
    out_config, _ = build_quant_config(config, plan.module_formats(), engines=("sglang", "vllm"))
    outputs = [(p.name, p.dtype, tuple(p.shape)) for job in plan.modules.values() for p in job.outputs]
    return _source(variant, _virtual(out_config, outputs))

