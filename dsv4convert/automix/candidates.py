"""What automix decides, and each candidate's weights and served rounding, made from the base's own tensors.

A *decision* is one group of modules of one backbone block that a mixed checkpoint can store in one
format: the block's routed experts (one FusedMoE, one format: both engines take a layer's scheme from
expert 0), its attention projections, its indexer's query projection, its shared expert. The MTP draft
is not a decision: the main model's output does not depend on it (its store follows the family's rule,
and ``compare`` measures its draft agreement).

A *candidate* is a decision in one format as one server runs it. Its weights are what the converter
would write, made by the converter's own code (:func:`dsv4convert.convert.modules.convert_module` over a
plan of the base), dequantized by the loader's rules; its served rounding is the emulation ``compare``
installs (:mod:`dsv4convert.compare.emulate`) for that format alone: :class:`CandidateView` answers the
emulation's questions as if only the candidate's modules were stored quantized, so nothing else rounds.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from dsv4convert.calibration import InputScales
from dsv4convert.checkpoint import Checkpoint, SourceBytes, TensorEntry, read_tensor
from dsv4convert.compare.numerics import Serving
from dsv4convert.convert.modules import ModuleContext, convert_module, dequantize_source
from dsv4convert.convert.plan import Plan, build_plan
from dsv4convert.convert.recipe import Recipe, rule
from dsv4convert.errors import DSV4Error
from dsv4convert.formats import Format, spec
from dsv4convert.inspection import Inspection
from dsv4convert.models.deepseek_v4.layout import Role, classify
from dsv4convert.model.blocks import LINEAR_PATHS, WeightSource, set_tensor

# Decision groups: the role each covers within one backbone block. ``wo_a`` is its own group because SGLang
# loads it in one format for the whole model (automix.menu.Family.model_wide_linears).
GROUPS: dict[str, Role] = {
    "experts": Role.ROUTED_EXPERT,
    "attention": Role.ATTENTION,
    "wo_a": Role.ATTENTION,
    "indexer": Role.INDEXER,
    "shared": Role.SHARED_EXPERT,
}
LINEAR_GROUPS = ("attention", "wo_a", "indexer", "shared")
# Local module names (inside a block) of the groups that a family may fix for the whole model.
GROUP_OF_LOCAL = {"attn.wo_a": "wo_a"}


def group_of(module: str) -> str | None:
    """The decision group of a linear module of a backbone block (None: no decision covers it)."""
    info = classify(module + ".weight")
    if info.is_mtp or info.block is None:
        return None
    local = module[len(info.block) + 1:]
    if local in GROUP_OF_LOCAL:
        return GROUP_OF_LOCAL[local]
    return next((g for g, role in GROUPS.items() if role is info.role and g not in GROUP_OF_LOCAL.values()), None)


@dataclass(frozen=True, order=True)
class Decision:
    block: str          # layers.N
    group: str          # a key of GROUPS


@dataclass(frozen=True)
class Scheme:
    """What decides a candidate's numbers: its stored format and how the server rounds around it."""

    format: Format
    rounding: str | None    # expert activation scheme, or dense "scale format/wo_a"; None: none


@dataclass(frozen=True)
class Candidate:
    decision: Decision
    scheme: Scheme

    @property
    def label(self) -> str:
        rounding = f" ({self.scheme.rounding})" if self.scheme.rounding else ""
        return f"{self.decision.block} {self.decision.group} {self.scheme.format.value}{rounding}"


def decisions(inspection: Inspection) -> dict[Decision, list[str]]:
    """Every decision of the backbone and its linear modules (sorted by layer, then group)."""
    out: dict[Decision, list[str]] = defaultdict(list)
    for module in inspection.modules:
        group = group_of(module)
        if group is not None:
            out[Decision(classify(module + ".weight").block, group)].append(module)
    order = list(GROUPS)
    return {d: sorted(out[d]) for d in sorted(out, key=lambda d: (int(d.block.split(".")[1]), order.index(d.group)))}


def scheme_of(group: str, fmt: Format, serving: Serving) -> Scheme:
    """The numerics a ``group`` stored as ``fmt`` gets from ``serving`` (compare.numerics' rules)."""
    if group == "experts":
        return Scheme(fmt, serving.expert_scheme(fmt, is_mtp=False))
    if fmt is Format.FP8 and group == "wo_a":   # wo_a's GEMM is FP8 or BF16 (dequantized at load) by its own rule
        return Scheme(fmt, serving.wo_a())
    if fmt is Format.FP8:
        return Scheme(fmt, serving.dense_scale_format())
    return Scheme(fmt, None)


def is_exact(scheme: Scheme, source: Format | None) -> bool:
    """True when the candidate computes exactly what the reference (the base, weights only) does: BF16 (an
    exact image of the FP8/MXFP4 source), or the source's own format with no served rounding."""
    return scheme.format is Format.BF16 or (scheme.format is source and scheme.rounding is None)


def _candidate_recipe(fmt: Format, group: str) -> Recipe:
    """Every module of ``group`` (outside the draft) made in ``fmt``, as the converter makes it; FP8 block scales
    E8M0 whatever the engine (the weights a server computes with are the same either way)."""
    params = {"scale_dtype": "e8m0"} if "scale_dtype" in spec(fmt).recipe_params else {}
    return Recipe.of(f"automix-candidates-{fmt.value}-{group}", f"{fmt.value} {group} candidates",
                     [rule(roles=(GROUPS[group],), mtp=False, fmt=fmt, params=params),
                      rule(reason="everything else as in the source")], source=f"automix candidates ({fmt.value} {group})")


class CandidateMaker:
    """Candidate weights of one block, made on ``device`` from the base's tensors as the converter makes them.

    One plan of the base per (format, group) says each module's job; :meth:`weights` runs the converter's
    ``convert_module`` on the block's tensors already read (``staged``) and dequantizes its output.
    """

    def __init__(self, ckpt: Checkpoint, device: torch.device, dtype: torch.dtype, input_scales: InputScales | None):
        self.ckpt, self.device, self.dtype, self.input_scales = ckpt, device, dtype, input_scales
        self._plans: dict[tuple[Format, str], Plan] = {}

    def plan(self, fmt: Format, group: str) -> Plan:
        key = (fmt, group)
        if key not in self._plans:
            recipe = _candidate_recipe(fmt, group)
            self._plans[key] = build_plan(self.ckpt, recipe, engine="sglang")
        return self._plans[key]

    def made(self, modules: list[str], fmt: Format, group: str, staged: dict[str, torch.Tensor],
             stored: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
        """Each module's weight as ``fmt`` (float, the compute dtype), one at a time so that a layer's candidate
        experts never exist twice; the NVFP4 ``input_scale`` scalars the emulation reads go into ``stored``."""
        plan = self.plan(fmt, group)

        def read(entry: TensorEntry) -> torch.Tensor:
            held = staged.get(entry.name)
            return held if held is not None else read_tensor(entry)

        for module in modules:
            job = plan.modules[module]
            partners = plan.modules[job.partner].sources if job.partner else {}
            ctx = ModuleContext(read=read, partner_sources=partners, input_scale=self.input_scales, device=self.device)
            tensors = {}
            for name, value in convert_module(job, ctx).tensors:
                if isinstance(value, SourceBytes):     # bytes the writer would copy unread (MXFP4 codes under NVFP4)
                    value = read(value.entry).to(self.device).view(torch.uint8).reshape(value.shape)
                tensors[name[len(module) + 1:]] = value.to(self.device)
                if name.endswith(".input_scale"):
                    stored[name] = tensors["input_scale"]
            yield module, dequantize_source(fmt, tensors, f"{module}.weight", job.target_params).to(self.dtype)


class CandidateView:
    """A weight source as :func:`dsv4convert.compare.emulate.install` sees it, for candidates applied together:
    their modules are stored in their formats, every other linear as BF16, so only their rounding goes in."""

    def __init__(self, source: WeightSource, formats: dict[str, Format], stored: dict[str, torch.Tensor]):
        self.source, self.formats, self.stored = source, formats, stored
        self.ckpt, self.device, self.fp8_block = source.ckpt, source.device, source.fp8_block

    def format_of(self, module: str) -> Format | None:
        if module in self.formats:
            return self.formats[module]
        return Format.BF16 if self.source.format_of(module) is not None else None

    def stored_tensor(self, name: str) -> torch.Tensor | None:
        return self.stored.get(name)


class Swapped:
    """A decision's weights replaced in a built layer (filled module by module from ``weights``), and put back
    by :meth:`restore`."""

    def __init__(self, layer, block: str, group: str, weights: Iterator[tuple[str, torch.Tensor]]):
        self.layer, self.saved = layer, {}
        if group == "experts":
            experts = layer.mlp.experts
            self.saved = {"mlp.experts.gate_up_proj": experts.gate_up_proj, "mlp.experts.down_proj": experts.down_proj}
            gate_up = torch.empty_like(experts.gate_up_proj)
            down = torch.empty_like(experts.down_proj)
            half = gate_up.shape[1] // 2
            prefix = f"{block}.ffn.experts."
            for module, weight in weights:
                expert, proj = module[len(prefix):].split(".")
                target = {"w1": gate_up[int(expert), :half], "w3": gate_up[int(expert), half:],
                          "w2": down[int(expert)]}[proj]
                target.copy_(weight)
            set_tensor(layer, "mlp.experts.gate_up_proj", gate_up)
            set_tensor(layer, "mlp.experts.down_proj", down)
            return
        for module, weight in weights:
            path = LINEAR_PATHS.get(module[len(block) + 1:])
            if path is None:
                raise DSV4Error(f"automix: no transformers parameter for '{module}'", tensor=module)
            self.saved[path] = layer.get_parameter(path)
            set_tensor(layer, path, weight)

    def restore(self) -> None:
        for path, value in self.saved.items():
            set_tensor(self.layer, path, value)
