"""DeepSeek-V4.1's whole text model (prefill of whole sequences), assembled as SGLang 0.5.23 assembles it.

``models/deepseek_v4.py::DeepseekV4Model._forward_impl`` with ``hc_pre_from_prev_sublayer`` (V4.1's, set by
``configs/deepseek_v41.py``) and ``_forward_layers_hc_pre_from_prev``, each layer's sublayers as
``models/deepseek_v4_platform_stage.py::NonCudaDecoderMixin.forward_hc_pre_from_prev`` runs them:

1. ``embed`` the ids, broadcast to ``hc_mult`` equal streams (``hc_broadcast``); the Engram hash of every Engram
   layer runs once, before layer 0 (``self.engram_hasher(input_ids, ...)``);
2. per layer ``i``: on an Engram layer, ``engram(R, hash_ids[:, layer_hash_index], input_ids)`` replaces the
   streams and keeps ``pre`` (``HcState.with_residual``); on a DSpark target layer, the mean over the streams of
   ``R`` at this point, after Engram and before the attention, is that layer's DSpark feature
   (``mhc_stream_mean(state.residual)``: "the draft head reads the attention input of its target layers");
   then the attention sublayer and the MoE sublayer, each through its hyper-connection, lagged
   (``hyper.py``'s module docstring), the attention layers sharing one :class:`V41KVState`;
3. the final streams collapsed with the last sublayer's ``pre`` (``mhc_combine(pre_hc_head, last_pre)``),
   ``norm``, ``head`` (``logits_processor.py::_compute_lm_head``: the hidden rows in the head's dtype).

The MoE's ``bias_vl`` and Engram's image rows read the image token only when the model has a vision tower
(``engram.py::engram_image_token_id``, ``vl_routing.py::vision_topk``); a text-only config has none.

Two ways to hold the weights: :class:`V41Model`, every parameter resident, trainable, named as the checkpoint
(``state_dict()`` keys ``embed.weight``, ``layers.N.attn.*``, ``layers.N.hc_attn_fn``, ``layers.N.engram.*``,
``norm.weight``, ``head.weight``); :class:`V41Runner`, which streams a checkpoint one layer at a time
(:func:`load_block`: built on the meta device, decoded from whatever format stores it, freed after its turn),
the Engram tables kept FP8 and gathered by row.

The transformers PR-branch code (PR #48721, ``modeling_deepseek_v41.py``: ``DeepseekV41TextModel.forward``,
``DeepseekV41DecoderLayer.forward``) agrees on the order: Engram first in its layer, keeping the pre-mix; each
sublayer collapsed with the previous one's pre-mix (the first with a one-hot on stream 0, which is ``R[0]``);
the end collapsed with the last FFN's pre-mix, then ``norm``. It differs in what it leaves out: no DSpark capture
(its drafter is a follow-up), no image rows in the MoE routing (``token_mask`` None), and its ``lm_head`` output
is cast to float32 where SGLang's default head keeps the model dtype.

SGLang's full model does not run on a CPU (its attention is FlashMLA, its pools CUDA), so this assembly is
checked by properties (``tests/test_model_v41_forward.py``); each piece is checked against SGLang in its own test.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from dsv4convert.checkpoint import Checkpoint
from dsv4convert.checkpoint.reader import read_pieces
from dsv4convert.errors import CheckpointError
from dsv4convert.model.precision import compute_dtype
from dsv4convert.model.v41.attention import Attention, V41KVState
from dsv4convert.model.v41.engram import Engram, EngramEmbedding, EngramHasher, engram_image_token_id
from dsv4convert.model.v41.hyper import HyperConnection, RMSNorm, broadcast, collapse, split_sinkhorn
from dsv4convert.model.v41.moe import MoE
from dsv4convert.model.v41.weights import WeightSource, load
from dsv4convert.models.deepseek_v41.config import V41Config
from dsv4convert.models.deepseek_v41.tokenizer import compressed_token_map

SUBLAYERS = ("attn", "ffn")   # in order; each has hc_<sub>_fn/_base/_scale and <sub>_norm


@dataclass
class V41Output:
    """What one forward gives: ``logits [B, T, vocab]``; ``kv``, the forward's :class:`V41KVState` (the candidate
    blocks and each index-source layer's fine selection); ``captured[i]``, layer ``i``'s DSpark feature
    ``[B, T, hidden]`` (the stream mean after its Engram, before its attention) for each captured layer."""

    logits: torch.Tensor
    kv: V41KVState
    captured: dict[int, torch.Tensor] = field(default_factory=dict)


def image_token(cfg: V41Config) -> int | None:
    """The image token the MoE routing and Engram read, or None without a vision tower."""
    return None if cfg.math.image_token_id is None else engram_image_token_id(cfg, cfg.math.image_token_id)


class V41Block(nn.Module):
    """``layers.N``: ``attn`` (:class:`Attention`), ``ffn`` (:class:`MoE`), the two hyper-connections under the
    checkpoint's names (``hc_attn_fn``/``hc_attn_base``/``hc_attn_scale``/``attn_norm``, ``hc_ffn_*``/
    ``ffn_norm``), and on an Engram layer ``engram`` (:class:`Engram`; ``fp8_table`` keeps its table FP8)."""

    def __init__(self, cfg: V41Config, layer_id: int, *, fp8_table: bool = False, fake_quant: bool = True,
                 dtype: torch.dtype = torch.float32, block: str | None = None,
                 attention: type[Attention] = Attention):
        """``block``: the checkpoint's name of the block (``layers.N`` by default; a DSpark stage passes its own,
        which sets its experts), ``attention`` its attention's class."""
        super().__init__()
        m = cfg.math
        self.layer_id, self.hc_mult = layer_id, cfg.hc_mult
        self.sinkhorn_iters, self.hc_eps, self.rms_eps = m.hc_sinkhorn_iters, m.hc_eps, m.rms_norm_eps
        self.engram = Engram.from_config(cfg, layer_id, eps=m.rms_norm_eps, image_token_id=image_token(cfg),
                                         fp8_table=fp8_table, dtype=dtype) \
            if layer_id in cfg.engram_layer_ids else None
        self.attn = attention(cfg, layer_id, fake_quant=fake_quant, dtype=dtype)
        n_experts, top_k = cfg.experts_in(block or f"layers.{layer_id}")
        self.ffn = MoE(cfg.hidden_size, cfg.moe_intermediate_size, n_experts, top_k, cfg.n_shared_experts,
                       swiglu_limit=m.swiglu_limit, renormalize=m.norm_topk_prob,
                       routed_scaling_factor=m.routed_scaling_factor, dtype=dtype)
        for sub in SUBLAYERS:   # HyperConnection's own parameters and init, under the checkpoint's names
            hc = HyperConnection(cfg.hidden_size, cfg.hc_mult, sinkhorn_iters=m.hc_sinkhorn_iters, hc_eps=m.hc_eps,
                                 rms_eps=m.rms_norm_eps, dtype=dtype)
            setattr(self, f"hc_{sub}_fn", hc.fn)
            setattr(self, f"hc_{sub}_base", hc.base)
            setattr(self, f"hc_{sub}_scale", hc.scale)
            setattr(self, f"{sub}_norm", hc.norm)

    def hyper(self, sub: str, streams: torch.Tensor, pre: torch.Tensor | None,
              body: Callable[[torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`HyperConnection.forward` on sublayer ``sub``'s native-named parameters: the next streams and
        the ``pre`` that collapses the next sublayer's input."""
        norm: RMSNorm = getattr(self, f"{sub}_norm")
        y = body(norm(streams[..., 0, :] if pre is None else collapse(streams, pre)))
        dtype = compute_dtype(streams.dtype)
        flat = streams.flatten(-2).to(dtype)
        rsqrt = torch.rsqrt(flat.square().mean(-1, keepdim=True) + self.rms_eps)
        mixes = F.linear(flat, getattr(self, f"hc_{sub}_fn").to(dtype)) * rsqrt
        pre_next, post, comb = split_sinkhorn(mixes, getattr(self, f"hc_{sub}_scale"),
                                              getattr(self, f"hc_{sub}_base"), self.hc_mult, self.sinkhorn_iters,
                                              self.hc_eps)
        return HyperConnection.post(y, streams, post, comb), pre_next

    def with_engram(self, streams: torch.Tensor, hash_ids: torch.Tensor | None,
                    input_ids: torch.Tensor) -> torch.Tensor:
        """The streams after this layer's Engram (unchanged on other layers); ``hash_ids`` the hasher's output."""
        if self.engram is None:
            return streams
        return self.engram(streams, hash_ids[..., self.engram.layer_hash_index, :], input_ids)

    def forward(self, streams: torch.Tensor, pre: torch.Tensor | None, kv: V41KVState,
                image_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention then MoE, each through its lagged hyper-connection: ``(streams, pre)`` after the layer."""
        streams, pre = self.hyper("attn", streams, pre, lambda x: self.attn(x, kv))
        return self.hyper("ffn", streams, pre, lambda x: self.ffn(x, image_mask))


def _layers_to_capture(cfg: V41Config, layers: Sequence[int] | None) -> tuple[int, ...]:
    """``layers``, or the DSpark drafter's ``target_layer_ids`` (``set_dspark_layers_to_capture``)."""
    if layers is not None:
        return tuple(layers)
    return cfg.dspark.target_layer_ids if cfg.dspark is not None else ()


class ForwardState:
    """One forward's running state over the layers (``_forward_layers_hc_pre_from_prev``), shared by the resident
    and the streaming model: ``streams`` and ``pre`` (the lagged hyper-connection's), ``kv`` (:class:`V41KVState`),
    the Engram ``hash_ids``, the DSpark ``captured`` features."""

    def __init__(self, cfg: V41Config, input_ids: torch.Tensor, embedded: torch.Tensor,
                 hasher: EngramHasher | None, capture: Sequence[int] | None, kv: V41KVState | None = None):
        self.input_ids = input_ids
        image = image_token(cfg)
        self.image_mask = None if image is None else input_ids == image
        self.hash_ids = hasher(input_ids) if hasher is not None else None
        self.streams, self.pre = broadcast(embedded, cfg.hc_mult), None
        self.kv = V41KVState() if kv is None else kv
        self.capture, self.captured = _layers_to_capture(cfg, capture), {}

    def layer(self, block: V41Block) -> None:
        self.streams = block.with_engram(self.streams, self.hash_ids, self.input_ids)
        if block.layer_id in self.capture:
            self.captured[block.layer_id] = self.streams.mean(dim=-2)   # mhc_stream_mean: x.mean(dim=1)
        self.streams, self.pre = block(self.streams, self.pre, self.kv, self.image_mask)

    def hidden(self, norm: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        return norm(collapse(self.streams, self.pre))


def _hasher(cfg: V41Config, token_map: Sequence[int] | None) -> EngramHasher | None:
    if not cfg.engram_layer_ids:
        return None
    if token_map is None:
        raise CheckpointError("the model has Engram layers: its hash needs the tokenizer's compressed token map",
                              tensor="text_config.engram_layer_ids")
    return EngramHasher(cfg, token_map, pad_token_id=cfg.math.engram_pad_token_id, image_token_id=image_token(cfg))


class V41Model(nn.Module):
    """The whole text model resident and trainable (module docstring): ``embed``, ``layers`` (:class:`V41Block`),
    ``norm``, ``head``; ``token_map`` is the tokenizer's compressed map (``compressed_token_map``) for the Engram
    hash, required when the config has Engram layers. ``forward(input_ids [B, T])`` -> :class:`V41Output`."""

    def __init__(self, cfg: V41Config, token_map: Sequence[int] | None, dtype: torch.dtype = torch.float32, *,
                 fake_quant: bool = True):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(V41Block(cfg, i, fake_quant=fake_quant, dtype=dtype)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.math.rms_norm_eps, dtype)
        self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype)
        self.hasher = _hasher(cfg, token_map)

    def forward(self, input_ids: torch.Tensor, capture: Sequence[int] | None = None, *,
                kv: V41KVState | None = None) -> V41Output:
        """``capture``: the layers whose DSpark feature to keep (default: the drafter's target layers); ``kv``: an
        empty :class:`V41KVState` to fill, its ``record``/``dense`` switches set (training), instead of a new one."""
        run = ForwardState(self.cfg, input_ids, self.embed(input_ids), self.hasher, capture, kv)
        for block in self.layers:
            run.layer(block)
        return V41Output(self.head(run.hidden(self.norm)), run.kv, run.captured)


def read_table_rows(ckpt: Checkpoint, table: str, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``rows`` (sorted, unique) of an Engram table ``table`` (``layers.N.engram.embed``): its F8_E4M3
    ``weight`` rows and F8_E8M0 ``scale`` rows read by position from the shard, nothing else of the table."""
    out = []
    for part, dtype in (("weight", torch.float8_e4m3fn), ("scale", torch.float8_e8m0fnu)):
        entry = ckpt.entry(f"{table}.{part}")
        if len(entry.shape) != 2 or (rows.numel() and int(rows[-1]) >= entry.shape[0]):
            raise CheckpointError(f"an Engram hash id past the table's {entry.shape[0]} rows", file=entry.path,
                                  tensor=entry.name)
        row_bytes = entry.nbytes // entry.shape[0]
        pieces = read_pieces(entry, [int(r) * row_bytes for r in rows.tolist()], row_bytes)
        out.append(pieces.view(dtype))
    return out[0], out[1]


def load_block(source: WeightSource, layer_id: int, *, fp8_table: bool = True, fake_quant: bool = True,
               table_rows: torch.Tensor | None = None) -> V41Block:
    """``layers.N`` with the checkpoint's weights on ``source.device``: built on the meta device, every linear
    decoded from its stored format (:func:`weights.load`), the Engram table (F8_E4M3 rows, F8_E8M0 per-32 row
    scales, in the release and every conversion) kept FP8 (``fp8_table``) or dequantized whole; with
    ``table_rows`` (sorted unique hash ids) only those rows are read (:func:`read_table_rows`)."""
    with torch.device("meta"):
        block = V41Block(source.cfg, layer_id, fp8_table=fp8_table, fake_quant=fake_quant, dtype=source.dtype)
    prefix = f"layers.{layer_id}."
    if block.engram is not None:
        table = prefix + "engram.embed"
        if table_rows is not None:
            weight, scale = read_table_rows(source.ckpt, table, table_rows.cpu())
            block.engram.embed = EngramEmbedding.gathered(
                weight.to(source.device), scale.to(source.device), table_rows.to(source.device),
                block.engram.embed.num_embeddings, dtype=source.dtype)
        else:
            weight, scale = (source.ckpt.read(f"{table}.{p}").to(source.device) for p in ("weight", "scale"))
            block.engram.embed = EngramEmbedding.from_fp8(weight, scale, keep_fp8=fp8_table, dtype=source.dtype)
    names = {prefix + name: name for name, _ in block.named_parameters() if not name.startswith("engram.embed.")}
    return load(block.eval(), source, names)


class V41Runner:
    """The text model streamed from a V4.1 checkpoint (the release or any conversion) for comparisons on big
    models: each layer is loaded (:func:`load_block`), run over the whole batch and freed before the next, as
    are the embedding and the head, so one layer's weights (plus the forward's activations and
    :class:`V41KVState`) are resident at a time. ``token_map`` defaults to the checkpoint's ``tokenizer.json``'s."""

    def __init__(self, ckpt: Checkpoint | str | Path, device: torch.device | str, dtype: torch.dtype, *,
                 token_map: Sequence[int] | None = None, fake_quant: bool = True):
        ckpt = ckpt if isinstance(ckpt, Checkpoint) else Checkpoint.open(ckpt)
        self.source = WeightSource(ckpt, device, dtype)
        self.cfg, self.fake_quant = self.source.cfg, fake_quant
        if token_map is None and self.cfg.engram_layer_ids:
            from tokenizers import Tokenizer

            path = ckpt.root / "tokenizer.json"
            if not path.is_file():
                raise CheckpointError("no tokenizer.json: the Engram hash needs its compressed token map", file=path)
            token_map = compressed_token_map(Tokenizer.from_file(str(path)))[0]
        hasher = _hasher(self.cfg, token_map)
        self.hasher = hasher.to(self.source.device) if hasher is not None else None
        self._table_rows: dict[int, torch.Tensor] = {}   # per Engram layer, the rows begun forwards look up

    def load_block(self, layer_id: int) -> V41Block:
        """``layers.N``, its Engram table (if any) holding only the rows that the sequences begun so far
        (:meth:`begin`) look up: SGLang gathers a lookup's rows (``layers/engram.py::EngramEmbedding``), and a
        release table is 101 GB, more than a GPU holds."""
        rows = None
        if layer_id in self.cfg.engram_layer_ids:
            rows = self._table_rows.get(self.cfg.engram_layer_ids.index(layer_id), torch.empty(0, dtype=torch.long))
        return load_block(self.source, layer_id, fake_quant=self.fake_quant, table_rows=rows)

    @torch.no_grad()
    def begin(self, input_ids: torch.Tensor, capture: Sequence[int] | None = None) -> ForwardState:
        """A forward's state before layer 0 (the embedded ids broadcast to the streams, the Engram hash): the caller
        runs the layers (``state.layer(self.load_block(i))``) and ends with :meth:`finish`; ``compare`` on V4.1
        steps two checkpoints through the layers this way, in lockstep."""
        input_ids = input_ids.to(self.source.device)
        embedded = F.embedding(input_ids, self.source.tensor("embed.weight"))
        run = ForwardState(self.cfg, input_ids, embedded, self.hasher, capture)
        if run.hash_ids is not None:
            for index in range(len(self.cfg.engram_layer_ids)):
                ids = run.hash_ids[..., index, :].reshape(-1).cpu()
                seen = self._table_rows.get(index)
                self._table_rows[index] = torch.unique(ids if seen is None else torch.cat([seen, ids]))
        return run

    @torch.no_grad()
    def final(self) -> tuple[RMSNorm, torch.Tensor]:
        """The final ``norm`` and the ``head`` weight ``[vocab, hidden]``, on the device."""
        norm = RMSNorm(self.cfg.hidden_size, self.cfg.math.rms_norm_eps, self.source.dtype).to(self.source.device)
        norm.weight = nn.Parameter(self.source.tensor("norm.weight"), requires_grad=False)
        return norm, self.source.linear("head", (self.cfg.vocab_size, self.cfg.hidden_size))

    @torch.no_grad()
    def finish(self, run: ForwardState) -> V41Output:
        """The logits of a forward whose every layer has run (``norm`` and ``head`` on the collapsed streams)."""
        norm, head = self.final()
        return V41Output(F.linear(run.hidden(norm), head), run.kv, run.captured)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, capture: Sequence[int] | None = None) -> V41Output:
        """As :meth:`V41Model.forward`, one layer resident at a time."""
        run = self.begin(input_ids, capture)
        for i in range(self.cfg.num_hidden_layers):
            block = self.load_block(i)
            run.layer(block)
            del block   # freed before the next layer loads
        return self.finish(run)

    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[B, T, vocab]`` logits of ``input_ids [B, T]``."""
        return self.forward(input_ids, capture=()).logits
