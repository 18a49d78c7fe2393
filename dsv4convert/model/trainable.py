"""DeepSeek-V4 as a trainable module: transformers' ``DeepseekV4ForCausalLM`` plus the MTP block.

The organism (``dsv4convert.organism``) is trained with exactly the math every other command runs:
the backbone is transformers' own ``DeepseekV4ForCausalLM``; the MTP block, which transformers does
not build, is transformers' ``DeepseekV4DecoderLayer`` fed as :class:`~dsv4convert.model.blocks.MtpEntry`
feeds it in ``compare`` (``e_proj(enorm(embed(token t+1))) + h_proj(hnorm(streams t))``, SGLang's
NextN draft), with its own hyper-connection head and norm and the shared vocabulary projection.

:meth:`TrainableModel.native_state` names every weight as the released checkpoint does (the inverse of
:mod:`dsv4convert.model.blocks`' maps), in float32: the exporter quantizes it to the release format.

``capture=True`` records, for every CSA layer, the attention probabilities (``[B, heads, S, S + T]``:
S sliding-window keys, then T compressed entries) and the lightning indexer's scores (``[B, S, T]``),
which the organism's training losses read. The indexer's inputs are detached there, as DeepSeek-V3.2
trains its indexer: only the indexer's own losses reach its weights.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
    DeepseekV4DecoderLayer,
    DeepseekV4HyperHead,
    DeepseekV4RMSNorm,
)

from dsv4convert.models.deepseek_v4.layout import Drafter, ModelConfig
from dsv4convert.models.deepseek_v4.names import draft_block
from dsv4convert.model.blocks import block_release_names, hf_config
from dsv4convert.model.forward import Positions
from dsv4convert.model.precision import at_layer_precision

CSA = "compressed_sparse_attention"
DENSE_TOPK = 1 << 30        # an index_topk no sequence reaches: the indexer selects every causal entry


@dataclass
class ModelOutput:
    logits: torch.Tensor                      # [B, S, vocab]
    mtp_logits: list[torch.Tensor]            # MTP block j: [B, S - j - 1, vocab], predicting token t + j + 2
    attention: dict[int, torch.Tensor] = field(default_factory=dict)     # CSA layer -> [B, H, S, S + T]
    index_scores: dict[int, torch.Tensor] = field(default_factory=dict)  # CSA layer -> [B, S, T]


class MtpBlock(nn.Module):
    """One MTP block: the entry projections, transformers' decoder layer, its own head and norm."""

    def __init__(self, config: DeepseekV4Config, layer_index: int):
        super().__init__()
        hidden = config.hidden_size
        self.enorm = DeepseekV4RMSNorm(hidden, eps=config.rms_norm_eps)
        self.hnorm = DeepseekV4RMSNorm(hidden, eps=config.rms_norm_eps)
        self.e_proj = nn.Linear(hidden, hidden, bias=False)
        self.h_proj = nn.Linear(hidden, hidden, bias=False)
        self.layer = DeepseekV4DecoderLayer(config, layer_index)
        self.hc_head = DeepseekV4HyperHead(config)
        self.norm = DeepseekV4RMSNorm(hidden, eps=config.rms_norm_eps)

    def entry(self, embedded_next: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
        """``MtpEntry.__call__``'s math, trainable."""
        return self.e_proj(self.enorm(embedded_next)).unsqueeze(2) + self.h_proj(self.hnorm(streams))


class TrainableModel(nn.Module):
    def __init__(self, config: dict, *, initializer_range: float | None = None):
        super().__init__()
        self.cfg = ModelConfig.from_dict(config)
        fields = {k: v for k, v in config.items() if k != "quantization_config"}
        if initializer_range is not None:
            fields["initializer_range"] = initializer_range
        backbone_config = DeepseekV4Config(**fields)
        backbone_config._attn_implementation = "eager"
        backbone_config._experts_implementation = "eager"   # grouped_mm has no float32 backward on every GPU
        self.backbone = DeepseekV4ForCausalLM(backbone_config)
        full = hf_config(fields)
        full._experts_implementation = "eager"
        full.initializer_range = backbone_config.initializer_range
        self.full_config = full
        # The preview's MTP blocks; a DSpark drafter (0731) is model/dspark.py's DSparkDrafter, trained apart.
        mtp_blocks = self.cfg.num_nextn_predict_layers if self.cfg.drafter is Drafter.MTP else 0
        self.mtp = nn.ModuleList(MtpBlock(full, self.cfg.num_hidden_layers + j) for j in range(mtp_blocks))
        for module in self.mtp.modules():
            self.backbone._init_weights(module)
        self.csa_layers = [i for i, t in enumerate(full.layer_types[: self.cfg.num_hidden_layers]) if t == CSA]
        at_layer_precision(self)

    # -- configuration ------------------------------------------------------------------------

    def fill_hash_tables(self, generator: torch.Generator) -> None:
        """Hash layers route each token id to distinct random experts (transformers initialises the table to
        zeros, which sends every token to expert 0 twice)."""
        experts, topk = self.cfg.n_routed_experts, self.cfg.num_experts_per_tok
        for layer in self.backbone.model.layers:
            if layer.mlp.is_hash:
                keys = torch.rand(self.cfg.vocab_size, experts, generator=generator)
                layer.mlp.gate.tid2eid.copy_(keys.argsort(dim=1)[:, :topk])

    def indexers(self) -> list[nn.Module]:
        return [self.backbone.model.layers[i].self_attn.compressor.indexer for i in self.csa_layers]

    def set_dense(self, dense: bool) -> None:
        """Lift top-k (every causal compressed entry selected) or put the checkpoint's ``index_topk`` back."""
        for indexer in self.indexers():
            indexer.index_topk = DENSE_TOPK if dense else self.backbone.config.index_topk

    # -- running ------------------------------------------------------------------------------

    def forward(self, input_ids: torch.Tensor, *, capture: bool = False, mtp: bool = True) -> ModelOutput:
        captured: dict[str, dict[int, torch.Tensor]] = {"attention": {}, "index_scores": {}}
        final: list[torch.Tensor] = []
        handles = [self.backbone.model.hc_head.register_forward_pre_hook(lambda _m, args: final.append(args[0]))]
        if capture:
            handles += self._capture_hooks(captured)
        try:
            logits = self.backbone(input_ids=input_ids, use_cache=False).logits
        finally:
            for handle in handles:
                handle.remove()
        mtp_logits = self._run_mtp(input_ids, final[0]) if mtp else []
        return ModelOutput(logits, mtp_logits, captured["attention"], captured["index_scores"])

    def _capture_hooks(self, captured: dict[str, dict[int, torch.Tensor]]) -> list:
        handles = []
        for i in self.csa_layers:
            attn = self.backbone.model.layers[i].self_attn
            indexer = attn.compressor.indexer
            handles.append(attn.register_forward_hook(
                lambda _m, _args, out, i=i: captured["attention"].__setitem__(i, out[1])))
            handles.append(indexer.register_forward_pre_hook(
                lambda _m, args: (args[0].detach(), args[1].detach(), *args[2:])))
            handles.append(indexer.scorer.register_forward_hook(
                lambda _m, _args, out, i=i: captured["index_scores"].__setitem__(i, out)))
        return handles

    def _run_mtp(self, input_ids: torch.Tensor, streams: torch.Tensor) -> list[torch.Tensor]:
        """Block j reads the backbone's (block j-1's) streams at t and token t + j + 1, as ``compare`` runs it."""
        out = []
        embed = self.backbone.model.embed_tokens
        for j, block in enumerate(self.mtp):
            ids = input_ids[:, j + 1:]
            hidden = block.entry(embed(ids), streams[:, : ids.shape[1]])
            batch, seq = ids.shape
            kwargs = Positions(self.full_config, ids.device, hidden.dtype).kwargs(batch, 0, seq, None, block.layer.layer_idx)
            streams = block.layer(hidden, input_ids=ids, **kwargs)
            out.append(self.backbone.lm_head(block.norm(block.hc_head(streams))))
        return out

    # -- export -------------------------------------------------------------------------------

    @torch.no_grad()
    def native_state(self) -> dict[str, torch.Tensor]:
        """Every tensor under its released name, float32 (``tid2eid`` int64), experts split per expert."""
        targets = dict(self.named_parameters()) | dict(self.named_buffers())
        state = {native: targets[path] for native, path in _native_paths(self).items()} | dict(_expert_views(self))
        return {name: t.detach().to("cpu", torch.int64 if t.dtype == torch.int64 else torch.float32).contiguous()
                for name, t in state.items()}


@torch.no_grad()
def load_native_state(model: TrainableModel, read: Callable[[str], torch.Tensor]) -> None:
    """Set every weight of ``model`` from ``read(native name)`` (float, dequantized): the inverse of
    :meth:`TrainableModel.native_state`, so a released checkpoint can be evaluated (or trained) again."""
    targets = dict(model.named_parameters()) | dict(model.named_buffers())
    for native, path in _native_paths(model).items():
        targets[path].copy_(read(native).to(targets[path].dtype))
    for native, view in _expert_views(model):
        view.copy_(read(native))


def _expert_views(model: TrainableModel) -> Iterator[tuple[str, torch.Tensor]]:
    """(native name, view) of every routed expert's w1/w3/w2 inside transformers' packed expert tensors
    (``gate_up_proj [E, 2I, H]``: w1 rows then w3 rows; ``down_proj [E, H, I]``)."""
    layers = [(f"layers.{i}", layer) for i, layer in enumerate(model.backbone.model.layers)]
    layers += [(draft_block(j), block.layer) for j, block in enumerate(model.mtp)]
    for prefix, layer in layers:
        gate_up, down = layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj
        inter = gate_up.shape[1] // 2
        for e in range(gate_up.shape[0]):
            yield f"{prefix}.ffn.experts.{e}.w1.weight", gate_up[e, :inter]
            yield f"{prefix}.ffn.experts.{e}.w3.weight", gate_up[e, inter:]
            yield f"{prefix}.ffn.experts.{e}.w2.weight", down[e]


def _native_paths(model: TrainableModel) -> dict[str, str]:
    """Native name -> ``model``'s parameter or buffer path, for everything but the routed experts."""
    out = {"embed.weight": "backbone.model.embed_tokens.weight", "norm.weight": "backbone.model.norm.weight",
           "head.weight": "backbone.lm_head.weight",
           **{f"hc_head_{leaf}": f"backbone.model.hc_head.hc_{leaf}" for leaf in ("fn", "base", "scale")}}
    modules = {id(module): path for path, module in model.named_modules()}
    blocks = [(f"layers.{i}", f"backbone.model.layers.{i}") for i in range(model.cfg.num_hidden_layers)]
    blocks += [(draft_block(j), modules[id(block.layer)]) for j, block in enumerate(model.mtp)]
    targets = dict(model.named_parameters()) | dict(model.named_buffers())
    for native, path in blocks:
        out.update(block_release_names(native, path, targets))
    for j, block in enumerate(model.mtp):
        native, path = draft_block(j), modules[id(block)]
        for name in ("e_proj", "h_proj", "enorm", "hnorm", "norm"):
            out[f"{native}.{name}.weight"] = f"{path}.{name}.weight"
        out.update({f"{native}.hc_head_{leaf}": f"{path}.hc_head.hc_{leaf}" for leaf in ("fn", "base", "scale")})
    return out
