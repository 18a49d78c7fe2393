"""One DeepSeek-V4.1 block's MoE and hyper-connections, read from any V4.1 checkpoint our tools read or write.

A block (``layers.N`` or a DSpark stage) is built on the meta device (no memory, no init) and each parameter is
then set from the checkpoint, dequantized on the target device from whatever the checkpoint stores, as
``dsv4convert/model/blocks.py`` does for V4: the release's FP8 linears (E4M3 in the release's 32 x 32 blocks,
``release_of(config).fp8_block``, E8M0 scales), its MXFP4 experts (I8 codes, E8M0 ``[out, in/32]``), and what
``convert/v41.py`` writes (NVFP4, INT4 W4A16, FP8 or BF16 experts, BF16 linears). The format of each linear is the
registry's answer for its stored tensors (``formats.detect_format``) and it decodes by the registry's spec, so
only one block's weights are ever resident. Float32 tensors (the router's biases, the hyper-connections) stay
float32; every other float becomes the block's dtype (quantized weights decode in float32 and round once).

The parameters' names are the checkpoint's: below ``<block>.ffn.`` the MoE's (:func:`moe_names`), and the
hyper-connections' ``hc_attn_*``/``attn_norm`` and ``hc_ffn_*``/``ffn_norm`` as ``attn_hc.*``/``ffn_hc.*``
(:data:`HYPER_PATHS`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dsv4convert.checkpoint import Checkpoint
from dsv4convert.errors import CheckpointError
from dsv4convert.formats import Format, detect_format, spec
from dsv4convert.inspection import WEIGHT_PARAMS
from dsv4convert.model.v41.hyper import HyperConnection
from dsv4convert.model.v41.moe import MoE
from dsv4convert.models.deepseek_v4.names import in_draft
from dsv4convert.models.deepseek_v41.config import V41Config
from dsv4convert.models.registry import release_of

# The hyper-connections' native tensors (after ``<block>.``) -> their path in :class:`BlockParts`.
HYPER_PATHS = {
    "hc_attn_fn": "attn_hc.fn", "hc_attn_base": "attn_hc.base", "hc_attn_scale": "attn_hc.scale",
    "attn_norm.weight": "attn_hc.norm.weight",
    "hc_ffn_fn": "ffn_hc.fn", "hc_ffn_base": "ffn_hc.base", "hc_ffn_scale": "ffn_hc.scale",
    "ffn_norm.weight": "ffn_hc.norm.weight",
}


def v41_config(config: Any, source: str = "config.json") -> V41Config:
    """The checked :class:`V41Config` of a V4.1 ``config.json`` (the release's or one our converters wrote), read by
    its release; any other model is refused."""
    release = release_of(config, source)
    cfg = release.read_config(config, source)
    if not isinstance(cfg, V41Config):
        raise CheckpointError(f"not a DeepSeek-V4.1 config ({release.NAME})", file=source)
    return cfg


class BlockParts(nn.Module):
    """A block's non-attention, non-Engram parts: ``ffn`` (:class:`MoE`), ``attn_hc`` and ``ffn_hc``
    (:class:`HyperConnection`, each with its sublayer's input norm)."""

    def __init__(self, cfg: V41Config, block: str, dtype: torch.dtype | None = None):
        super().__init__()
        math = cfg.math
        n_experts, top_k = cfg.experts_in(block)
        self.ffn = MoE(cfg.hidden_size, cfg.moe_intermediate_size, n_experts, top_k, cfg.n_shared_experts,
                       swiglu_limit=math.swiglu_limit, renormalize=math.norm_topk_prob,
                       routed_scaling_factor=math.routed_scaling_factor, dtype=dtype)
        hc = dict(sinkhorn_iters=math.hc_sinkhorn_iters, hc_eps=math.hc_eps, rms_eps=math.rms_norm_eps, dtype=dtype)
        self.attn_hc = HyperConnection(cfg.hidden_size, cfg.hc_mult, **hc)
        self.ffn_hc = HyperConnection(cfg.hidden_size, cfg.hc_mult, **hc)


def moe_names(block: str, moe: MoE, path: str = "ffn") -> dict[str, str]:
    """Native tensor name -> module path of every parameter of ``moe`` built at ``path`` for ``block``
    (``layers.3.ffn.experts.7.w1.weight`` -> ``ffn.experts.7.w1.weight``): a linear's ``.weight`` stands for
    however the checkpoint stores it."""
    return {f"{block}.ffn.{name}": f"{path}.{name}" for name, _ in moe.named_parameters()}


def hyper_names(block: str, attn_hc: str = "attn_hc", ffn_hc: str = "ffn_hc") -> dict[str, str]:
    """Native tensor name -> module path of both hyper-connections (and their norms) of ``block``."""
    paths = {"attn_hc": attn_hc, "ffn_hc": ffn_hc}
    out = {}
    for suffix, path in HYPER_PATHS.items():
        owner, _, leaf = path.partition(".")
        out[f"{block}.{suffix}"] = f"{paths[owner]}.{leaf}"
    return out


class WeightSource:
    """Reads and dequantizes a V4.1 checkpoint's tensors onto ``device`` in ``dtype`` (module docstring)."""

    def __init__(self, ckpt: Checkpoint, device: torch.device | str, dtype: torch.dtype):
        self.cfg = v41_config(ckpt.config, str(ckpt.root / "config.json"))
        self.fp8_block = self.cfg.fp8_block   # the release's: release_of(config).fp8_block(cfg)
        self.ckpt, self.device, self.dtype = ckpt, torch.device(device), dtype
        self._parts: dict[str, dict[str, str]] = {}   # module -> {weight param: tensor name}
        for name in ckpt.tensors:
            module, _, param = name.rpartition(".")
            if param in WEIGHT_PARAMS:
                self._parts.setdefault(module, {})[param] = name

    def tensor(self, name: str) -> torch.Tensor:
        """A plain tensor on the device: float32 kept, other floats in the block's dtype."""
        if name not in self.ckpt.tensors:
            raise CheckpointError("missing: the block needs it", file=self.ckpt.root, tensor=name)
        t = self.ckpt.read(name).to(self.device)
        return t.to(self.dtype) if t.is_floating_point() and t.dtype != torch.float32 else t

    def stored_format(self, module: str, shape: tuple[int, int]) -> tuple[Format, dict]:
        """The format (and its parameters) linear ``module`` of weight shape ``[n, k]`` is stored in, from its
        headers (the registry's ``detect_format``)."""
        parts = self._parts.get(module)
        if not parts:
            raise CheckpointError("missing: the block needs this linear", file=self.ckpt.root, tensor=f"{module}.weight")
        entries = {p: self.ckpt.entry(name) for p, name in parts.items()}
        stored = {p: (e.dtype, tuple(e.shape)) for p, e in entries.items()}
        n, k = shape
        found = detect_format(stored, n, k, fp8_block=self.fp8_block, name=module)
        if found is None:
            layout = ", ".join(f"{p} {d}{list(s)}" for p, (d, s) in sorted(stored.items()))
            raise CheckpointError(f"stored as {layout}: no format holds a [{n}, {k}] weight that way",
                                  file=entries["weight" if "weight" in entries else next(iter(entries))].path,
                                  tensor=f"{module}.weight")
        return found

    def linear(self, module: str, shape: tuple[int, int]) -> torch.Tensor:
        """The weight ``[n, k]`` of linear ``module``, decoded on the device from its stored format."""
        fmt, params = self.stored_format(module, shape)
        parts = self._parts[module]
        tensors = {p: self.ckpt.read(name).to(self.device) for p, name in parts.items()}
        return spec(fmt).decode(tensors, f"{module}.weight", params).to(self.dtype)


def load(module: nn.Module, source: WeightSource, names: dict[str, str]) -> nn.Module:
    """Set every parameter ``names`` maps (native tensor name -> path in ``module``) from ``source``: a 2-D
    ``.weight`` by :meth:`WeightSource.linear` (whatever format stores it), anything else as stored; refuses a shape
    that does not fit, and any parameter still on the meta device afterwards. Returns ``module``."""
    for native, path in names.items():
        owner_path, _, leaf = path.rpartition(".")
        owner = module.get_submodule(owner_path) if owner_path else module
        expected = tuple(getattr(owner, leaf).shape)
        if leaf == "weight" and len(expected) == 2:
            value = source.linear(native.removesuffix(".weight"), expected)
        else:
            value = source.tensor(native)
        if tuple(value.shape) != expected:
            raise CheckpointError(f"shape {list(value.shape)} does not fit '{path}' {list(expected)}",
                                  file=source.ckpt.root, tensor=native)
        setattr(owner, leaf, nn.Parameter(value, requires_grad=False))
    left = [n for n, t in [*module.named_parameters(), *module.named_buffers()] if t.is_meta]
    if left:
        raise CheckpointError(f"the checkpoint does not provide {', '.join(left)}", file=source.ckpt.root)
    return module


def load_parts(source: WeightSource, block: str) -> BlockParts:
    """``block``'s :class:`BlockParts` (``layers.N`` or a DSpark stage) with the checkpoint's weights on
    ``source.device``, built on the meta device first so only this block is ever resident."""
    with torch.device("meta"):
        parts = BlockParts(source.cfg, block, source.dtype)
    return load(parts.eval(), source, {**moe_names(block, parts.ffn), **hyper_names(block)})
