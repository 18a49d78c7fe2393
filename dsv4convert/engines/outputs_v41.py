"""What each DeepSeek-V4.1 variant's output holds, tensor by tensor: the converter writes it (``convert/v41.py``),
``validate`` and ``inspect`` check a checkpoint against it, ``fit --model`` and ``serve`` size from it.

A variant is defined by what the engines load (``engines/stored.py::V41_NEVER_QUANTIZED`` says, per role, why a
module stays the release's bytes); :func:`action_of` is the one place that decides what a variant does with a
module, and :func:`expected_outputs` is every tensor (dtype, shape) that follows from it for a config.
"""

from __future__ import annotations

from collections.abc import Iterable

from dsv4convert.checkpoint import TensorEntry
from dsv4convert.engines.stored import V41_FUSED_PAIRS, V41_NEVER_QUANTIZED
from dsv4convert.formats import Format, linear_storage
from dsv4convert.models.deepseek_v4.layout import MXFP4_GROUP
from dsv4convert.models.deepseek_v41 import inventory
from dsv4convert.models.deepseek_v41.config import V41Config

VARIANTS = ("nvfp4", "fp8", "bf16", "w4a16")   # what convert writes
NATIVE = "native"                              # the release as DeepSeek ships it


def action_of(role: str, linear: bool, variant: str) -> str:
    """What ``variant`` does with a module (its role, whether it is a linear with a scale):
    keep (the release's bytes), nvfp4 / fp8 / int4 / bf16 (a routed expert made in that format), dequant (an FP8
    linear to BF16)."""
    if not linear or role in V41_NEVER_QUANTIZED:
        return "keep"
    expert = role.startswith("routed_expert")
    if variant == "nvfp4":   # backbone experts only: mtp.* stays MXFP4 (NVIDIA's ignore list, both engines' rule)
        return "nvfp4" if role == "routed_expert" else "keep"
    if variant == "bf16":
        return "bf16" if expert else "dequant"
    if variant == "w4a16":   # the DSpark draft's experts BF16: SGLang builds its stages with the INT4 config ignored
        return ("int4" if role == "routed_expert" else "bf16") if expert else "keep"
    return "fp8" if expert else "keep"


def expected_outputs(cfg: V41Config, variant: str, group_size: int = 32) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Every tensor a ``variant`` output of a release with this config holds (the release's own for ``native``):
    name -> (dtype, shape) (``group_size``: INT4's)."""
    native = {s.name: s for s in inventory.native_inventory(cfg)}
    if variant == NATIVE:
        return {name: (spec.dtype, tuple(spec.shape)) for name, spec in native.items()}
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for name, spec in native.items():
        module, _, param = name.rpartition(".")
        linear = param in ("weight", "scale") and f"{module}.scale" in native and f"{module}.weight" in native
        action = action_of(inventory.role_of(name), linear, variant)
        if action == "keep":
            out[name] = (spec.dtype, tuple(spec.shape))
            continue
        if param == "scale":
            continue
        weight, scale = native[f"{module}.weight"], native[f"{module}.scale"]
        n, k = (weight.shape if action == "dequant" else (weight.shape[0], scale.shape[1] * MXFP4_GROUP))
        if action == "fp8":
            b = cfg.fp8_block
            out[name] = ("F8_E4M3", (n, k))
            out[f"{module}.scale"] = ("F8_E8M0", (-(-n // b[0]), -(-k // b[1])))
            continue
        fmt = {"nvfp4": Format.NVFP4, "int4": Format.INT4}.get(action, Format.BF16)
        out.update({f"{module}.{p.suffix}": (p.dtype, tuple(p.shape))
                    for p in linear_storage(fmt, n, k, group_size=group_size)})
    return out


def layout_problems(tensors: Iterable[TensorEntry], cfg: V41Config, variant: str, group_size: int = 32
                    ) -> list[str]:
    """Every way the stored ``tensors`` differ from a ``variant`` output of this config (a tensor no engine
    parameter takes, a dtype or shape the engines would cast or refuse, one missing, which both engines would
    leave unwritten without a word), and fused pairs stored in two dtypes; one line each, naming file and tensor."""
    stored = {e.name: e for e in tensors}
    expected = expected_outputs(cfg, variant, group_size)
    problems = []
    for name, entry in stored.items():
        want = expected.get(name)
        if want is None:
            problems.append(f"{entry.path.name}: {name}: not a tensor of a DeepSeek-V4.1 {variant} output; no "
                            "engine parameter takes it")
        elif want != (entry.dtype, tuple(entry.shape)):
            problems.append(f"{entry.path.name}: {name}: is {entry.dtype} {list(entry.shape)}, a {variant} output "
                            f"stores {want[0]} {list(want[1])} (the engines would cast or refuse it)")
    problems += [f"{name}: missing: its parameter would be left unwritten, silently in both engines"
                 for name in expected if name not in stored]
    for name, entry in stored.items():   # the halves both engines load into one fused parameter
        for first, (second, fused) in V41_FUSED_PAIRS.items():
            other = stored.get(name.replace(f".{first}.", f".{second}.")) if f".{first}." in name else None
            if other is not None and other.dtype != entry.dtype:
                problems.append(f"{entry.path.name}: {name}: {entry.dtype} but {other.name} is {other.dtype}; both "
                                f"engines load them into one {fused}")
    return problems
