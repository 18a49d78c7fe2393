"""One block of transformers' DeepSeek-V4, built from our checkpoint on demand.

``calibrate`` and ``compare`` must see the activations the real model produces, so the math is
transformers' own (``DeepseekV4DecoderLayer``: attention, compressor, indexer, hash routing and
hyper-connections), not a re-implementation. What this module adds is the loading: the layer is
created on the meta device (no memory, no init), and each parameter is then set from the
checkpoint, dequantized on the target device from whatever format the source stores (FP8, MXFP4,
NVFP4, INT4, BF16), so only one layer's weights are ever resident. :class:`OutputHead` is the
model's end (hyper-connection head, norm, vocabulary projection), for the backbone and each MTP block.

Dtypes follow what ``DeepseekV4ForCausalLM.from_pretrained(..., dtype=D)`` gives the native
checkpoint: F32 tensors (hyper-connections, sinks, ``ape``, router bias) stay float32,
everything else becomes ``D`` (quantized weights are dequantized in float32 and rounded once).
``D`` is BF16 on a GPU, as served; float32 makes small CPU runs several times faster.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn
from transformers import DeepseekV4Config
from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
    DeepseekV4DecoderLayer,
    DeepseekV4HyperHead,
    DeepseekV4RMSNorm,
    DeepseekV4RotaryEmbedding,
)

from dsv4convert.checkpoint import Checkpoint
from dsv4convert.checkpoint.reader import read_tensor
from dsv4convert.errors import CheckpointError
from dsv4convert.formats import Format, spec
from dsv4convert.inspection import WEIGHT_PARAMS, Inspection
from dsv4convert.models.deepseek_v4.layout import ModelConfig, try_classify
from dsv4convert.models.deepseek_v4.names import in_draft
from dsv4convert.model.precision import at_layer_precision

COMPUTE_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


# Linear modules of a block: native module suffix -> transformers parameter path.
LINEAR_PATHS = {
    "attn.wq_a": "self_attn.q_a_proj.weight",
    "attn.wq_b": "self_attn.q_b_proj.weight",
    "attn.wkv": "self_attn.kv_proj.weight",
    "attn.wo_a": "self_attn.o_a_proj.weight",
    "attn.wo_b": "self_attn.o_b_proj.weight",
    "attn.compressor.wkv": "self_attn.compressor.kv_proj.weight",
    "attn.compressor.wgate": "self_attn.compressor.gate_proj.weight",
    "attn.indexer.wq_b": "self_attn.compressor.indexer.q_b_proj.weight",
    "attn.indexer.weights_proj": "self_attn.compressor.indexer.scorer.weights_proj.weight",
    "attn.indexer.compressor.wkv": "self_attn.compressor.indexer.kv_proj.weight",
    "attn.indexer.compressor.wgate": "self_attn.compressor.indexer.gate_proj.weight",
    "ffn.shared_experts.w1": "mlp.shared_experts.gate_proj.weight",
    "ffn.shared_experts.w3": "mlp.shared_experts.up_proj.weight",
    "ffn.shared_experts.w2": "mlp.shared_experts.down_proj.weight",
    "ffn.gate": "mlp.gate.weight",
}
# Plain tensors of a block: native name suffix -> transformers parameter or buffer path.
TENSOR_PATHS = {
    "hc_attn_fn": "attn_hc.fn",
    "hc_attn_base": "attn_hc.base",
    "hc_attn_scale": "attn_hc.scale",
    "hc_ffn_fn": "ffn_hc.fn",
    "hc_ffn_base": "ffn_hc.base",
    "hc_ffn_scale": "ffn_hc.scale",
    "attn.attn_sink": "self_attn.sinks",
    "attn.q_norm.weight": "self_attn.q_a_norm.weight",
    "attn.kv_norm.weight": "self_attn.kv_norm.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn.compressor.ape": "self_attn.compressor.position_bias",
    "attn.compressor.norm.weight": "self_attn.compressor.kv_norm.weight",
    "attn.indexer.compressor.ape": "self_attn.compressor.indexer.position_bias",
    "attn.indexer.compressor.norm.weight": "self_attn.compressor.indexer.kv_norm.weight",
    "ffn.gate.bias": "mlp.gate.e_score_correction_bias",
    "ffn.gate.tid2eid": "mlp.gate.tid2eid",
}


def block_release_names(native: str, path: str, targets: dict) -> dict[str, str]:
    """Release name -> module path of one block's linears and plain tensors (routed experts aside): block
    ``native`` (``layers.3``, ``mtp.0``) built at ``path`` of a module whose parameters and buffers are
    ``targets``; what the block does not hold (a compressor, a hash table) is left out."""
    out = {f"{native}.{suffix}.weight": f"{path}.{hf}" for suffix, hf in LINEAR_PATHS.items()
           if f"{path}.{hf}" in targets}
    out.update({f"{native}.{suffix}": f"{path}.{hf}" for suffix, hf in TENSOR_PATHS.items()
                if f"{path}.{hf}" in targets})
    return out


def hf_config(config: dict) -> DeepseekV4Config:
    """transformers' config for every block, the drafter's included (as layers ``n .. n+d-1``: the preview's
    MTP blocks, or a DSpark drafter's stages, sliding-window and score-routed as their compress ratios 0 and
    indices past ``num_hash_layers`` make them).

    Eager attention is the only one DeepSeek-V4 supports; ``grouped_mm`` is the experts
    implementation ``from_pretrained`` picks, so the layers compute what the full model does.
    """
    cfg = ModelConfig.from_dict(config)
    fields = {k: v for k, v in config.items() if k != "quantization_config"}
    fields["num_hidden_layers"] = cfg.num_hidden_layers + cfg.num_draft_blocks
    hf = DeepseekV4Config(**fields)
    hf._attn_implementation = "eager"
    hf._experts_implementation = "grouped_mm"
    return hf


def block_index(cfg: ModelConfig, block: str) -> int:
    kind, idx = block.split(".")
    return int(idx) if kind == "layers" else cfg.num_hidden_layers + int(idx)


class WeightSource:
    """Reads and dequantizes one block's tensors from a checkpoint onto a device.

    A block's stored bytes can be read ahead (:meth:`read_block`, safe on another thread: each read
    opens its file) and handed in with :meth:`staged`; the build then only copies and dequantizes.
    """

    def __init__(self, ckpt: Checkpoint, inspection: Inspection, device: torch.device, dtype: torch.dtype):
        self.ckpt, self.inspection, self.device, self.dtype = ckpt, inspection, device, dtype
        self.fp8_block = inspection.fp8_block   # the release's (rows, cols): a W8A8 linear's activation groups
        self._weights: dict[str, dict[str, str]] = {}   # module -> {weight param: tensor name}
        self._staged: dict[str, torch.Tensor] = {}
        for name in ckpt.tensors:
            info = try_classify(name)
            if info is not None and info.param in WEIGHT_PARAMS:
                self._weights.setdefault(info.module, {})[info.param] = name

    def read_block(self, block: str) -> dict[str, torch.Tensor]:
        """Every stored tensor of ``block`` (and the embedding an MTP block mixes in), on the host: page-locked
        for a GPU, so the build's copies are plain DMA."""
        pin = self.device.type == "cuda"
        names = [n for n in self.ckpt.tensors if n.startswith(f"{block}.")]
        if in_draft(block):
            names.append("embed.weight")
        return {name: read_tensor(self.ckpt.entry(name), pin_memory=pin) for name in names}

    @contextlib.contextmanager
    def staged(self, tensors: dict[str, torch.Tensor]) -> Iterator[None]:
        """Reads of these names come from ``tensors`` (a :meth:`read_block` result) inside the block."""
        self._staged = dict(tensors)
        try:
            yield
        finally:
            self._staged = {}

    def _read(self, name: str) -> torch.Tensor:
        staged = self._staged.pop(name, None)
        return staged if staged is not None else self.ckpt.read(name)

    def tensor(self, name: str) -> torch.Tensor:
        t = self._read(name).to(self.device)
        if t.is_floating_point() and t.dtype != torch.float32:
            return t.to(self.dtype)
        return t

    def format_of(self, module: str) -> Format | None:
        """The stored format of a linear module (None: not a linear of this checkpoint)."""
        info = self.inspection.modules.get(module)
        return info.format if info is not None else None

    def stored_tensor(self, name: str) -> torch.Tensor | None:
        """A stored tensor as the file holds it (None if the checkpoint has no such tensor)."""
        return self.ckpt.read(name) if name in self.ckpt.tensors else None

    def linear(self, module: str) -> torch.Tensor:
        """Float weight of a linear module, dequantized on the device from its stored format."""
        info = self.inspection.modules.get(module)
        if info is None or info.format is None:
            raise CheckpointError("linear module missing or in an unknown format", file=self.ckpt.root, tensor=module)
        src = {param: self._read(name).to(self.device) for param, name in self._weights[module].items()}
        return spec(info.format).decode(src, f"{module}.weight", info.params).to(self.dtype)

    def experts(self, block: str, n_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``gate_up_proj [E, 2I, H]`` (w1 rows then w3 rows) and ``down_proj [E, H, I]``, filled in place."""
        gate_up = down = None
        for e in range(n_experts):
            p = f"{block}.ffn.experts.{e}"
            w1, w3, w2 = (self.linear(f"{p}.{proj}") for proj in ("w1", "w3", "w2"))
            if gate_up is None:
                gate_up = torch.empty((n_experts, 2 * w1.shape[0], w1.shape[1]), dtype=self.dtype, device=self.device)
                down = torch.empty((n_experts, *w2.shape), dtype=self.dtype, device=self.device)
            gate_up[e, : w1.shape[0]] = w1
            gate_up[e, w1.shape[0]:] = w3
            down[e] = w2
        return gate_up, down


def set_tensor(module: nn.Module, path: str, value: torch.Tensor) -> None:
    """Put ``value`` at ``path`` (a parameter or buffer of ``module``), refusing a shape that does not fit."""
    owner_path, _, leaf = path.rpartition(".")
    owner = module.get_submodule(owner_path) if owner_path else module
    if leaf in owner._parameters:
        expected = owner._parameters[leaf].shape
        owner._parameters[leaf] = nn.Parameter(value, requires_grad=False)
    elif leaf in owner._buffers:
        expected = owner._buffers[leaf].shape
        owner._buffers[leaf] = value
    else:
        raise CheckpointError(f"transformers' layer has no parameter '{path}'")
    if tuple(expected) != tuple(value.shape):
        raise CheckpointError(f"shape {list(value.shape)} does not fit '{path}' {list(expected)}")


def _rebuild_rotary(layer: nn.Module, config: DeepseekV4Config, device: torch.device) -> None:
    """Rotary tables are computed at construction; rebuild the meta ones on the device."""
    for name, child in list(layer.named_modules()):
        if isinstance(child, DeepseekV4RotaryEmbedding):
            owner_path, _, leaf = name.rpartition(".")
            owner = layer.get_submodule(owner_path) if owner_path else layer
            setattr(owner, leaf, DeepseekV4RotaryEmbedding(config, device=device))


def block_config(config: DeepseekV4Config, cfg: ModelConfig, block: str) -> DeepseekV4Config:
    """The config ``block``'s layer is built with: ``config`` itself, or for a DSpark stage with its own expert
    count (``dspark_n_routed_experts`` / ``dspark_num_experts_per_tok``) a copy carrying it, as SGLang's
    ``models/deepseek_v4_dspark.py::_dspark_stage_config`` builds the stages."""
    d = cfg.dspark
    if d is None or not in_draft(block) or (
            d.n_routed_experts, d.num_experts_per_tok) == (cfg.n_routed_experts, cfg.num_experts_per_tok):
        return config
    stage = copy.copy(config)
    stage.n_routed_experts, stage.num_experts_per_tok = d.n_routed_experts, d.num_experts_per_tok
    return stage


def build_layer(source: WeightSource, config: DeepseekV4Config, cfg: ModelConfig, block: str) -> DeepseekV4DecoderLayer:
    """transformers' decoder layer for ``block`` with the checkpoint's weights on ``source.device``."""
    config = block_config(config, cfg, block)
    with torch.device("meta"):
        layer = DeepseekV4DecoderLayer(config, block_index(cfg, block))
    _rebuild_rotary(layer, config, source.device)
    for suffix, path in LINEAR_PATHS.items():
        if f"{block}.{suffix}" in source.inspection.modules:
            set_tensor(layer, path, source.linear(f"{block}.{suffix}"))
    for suffix, path in TENSOR_PATHS.items():
        if f"{block}.{suffix}" in source.ckpt.tensors:
            set_tensor(layer, path, source.tensor(f"{block}.{suffix}"))
    gate_up, down = source.experts(block, cfg.experts_in(block))
    set_tensor(layer, "mlp.experts.gate_up_proj", gate_up)
    set_tensor(layer, "mlp.experts.down_proj", down)
    left = [n for n, t in [*layer.named_parameters(), *layer.named_buffers()] if t.is_meta]
    if left:
        raise CheckpointError(f"block '{block}': the checkpoint does not provide {', '.join(left)}",
                              file=source.ckpt.root)
    return at_layer_precision(layer.eval())


@dataclass
class MtpEntry:
    """How an MTP block mixes the next token into the backbone's hyper-connection streams.

    ``x = e_proj(enorm(embed(next_token)))`` broadcast over the ``hc_mult`` streams, plus
    ``h_proj(hnorm(h))`` per stream, as SGLang's DeepSeek-V4 NextN draft model computes it.
    """

    enorm: DeepseekV4RMSNorm
    hnorm: DeepseekV4RMSNorm
    e_proj: torch.Tensor
    h_proj: torch.Tensor
    quantize: Callable[[torch.Tensor], torch.Tensor] | None = None   # the projections' served input rounding

    @classmethod
    def load(cls, source: WeightSource, config: DeepseekV4Config, block: str) -> "MtpEntry":
        norms = []
        for name in ("enorm", "hnorm"):
            norm = DeepseekV4RMSNorm(config.hidden_size, eps=config.rms_norm_eps).to(source.device)
            norm.weight = nn.Parameter(source.tensor(f"{block}.{name}.weight"), requires_grad=False)
            norms.append(norm)
        return cls(*norms, source.linear(f"{block}.e_proj"), source.linear(f"{block}.h_proj"))

    def __call__(self, embedded_next: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
        e_in, h_in = self.enorm(embedded_next), self.hnorm(streams)
        if self.quantize is not None:
            e_in, h_in = self.quantize(e_in), self.quantize(h_in)
        e = nn.functional.linear(e_in, self.e_proj)
        h = nn.functional.linear(h_in, self.h_proj)
        return e.unsqueeze(2) + h


def vocab_projection(source: WeightSource) -> torch.Tensor:
    """The target's ``head`` ``[vocab, hidden]`` (dequantized where a variant stores it quantized), which the
    output head and a DSpark drafter's head share."""
    return source.linear("head") if source.inspection.modules.get("head") else source.tensor("head.weight")


class OutputHead(nn.Module):
    """Streams ``[B, S, hc_mult, hidden]`` to logits: ``head(norm(hc_head(streams)))``, as transformers'
    ``DeepseekV4Model``/``ForCausalLM`` end. ``prefix`` is ``""`` for the backbone and ``"mtp.j."`` for an
    MTP block, which has its own hyper-connection head and norm and shares the vocabulary projection."""

    def __init__(self, source: WeightSource, config: DeepseekV4Config, prefix: str = ""):
        super().__init__()
        with torch.device("meta"):
            self.hc_head = DeepseekV4HyperHead(config)
            self.norm = DeepseekV4RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        for leaf in ("fn", "base", "scale"):
            set_tensor(self.hc_head, f"hc_{leaf}", source.tensor(f"{prefix}hc_head_{leaf}"))
        set_tensor(self.norm, "weight", source.tensor(f"{prefix}norm.weight"))
        self.head = vocab_projection(source)
        at_layer_precision(self)

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(self.norm(self.hc_head(streams)), self.head)
