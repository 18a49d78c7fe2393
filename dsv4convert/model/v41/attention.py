"""DeepSeek-V4.1's attention (one layer, causal prefill of whole sequences), restated from SGLang 0.5.23.

``models/deepseek_v4.py::MQALayer`` with ``is_dsv41`` (``q_head_norm`` False, ``configs/deepseek_v41.py``), the
torch paths of its attention backend (``layers/attention/deepseek_v4_backend.py``: ``forward_low_ratio_sources``,
``_low_ratio_compress_torch``, ``_low_ratio_write_group``, ``_low_ratio_index_topk``) and FlashMLA's sparse
attention with a sink as ``kernels/ops/attention/flash_mla_sm120.py::_sm120_sparse_decode_fwd`` computes it:

1. ``q = rope(wq_b(q_norm(wq_a(x))))`` per head (``_compute_q_b``: no per-head norm in V4.1), ``kv =
   rope(kv_norm(wkv(x)))``, one KV head of ``head_dim`` that is both key and value; RoPE rotates the last
   ``qk_rope_head_dim`` features as interleaved pairs. A layer with compress ratio 0 uses ``rope_theta`` without
   YaRN; a layer with a ratio uses ``compress_rope_theta`` with the YaRN ramp (``rope_scaling``) for its query,
   window and compressed keys alike (``MqaAttentionBase.__init__``: "Pure SWA layers use the main unscaled RoPE,
   while C4/C128 layers use the compressed YaRN RoPE"); :func:`rope_table` is
   ``kernels/ops/attention/dsv4/rope.py::precompute_freqs_cis`` (no YaRN magnitude scale).
2. A KV-source layer's :class:`Compressor` makes compressed KV entries; every layer of that ratio up to the next
   source reads them (:meth:`V41Config.kv_source_of`, ``mem_cache/deepseek_v4_memory_pool.py::
   collect_sources_by_ratio`` and the pool's layer mapping). Its :class:`~dsv4convert.model.v41.indexer.Indexer`
   keys and, on an index-source layer, the selection (``indexer.py``) go into :class:`V41KVState` too; a layer
   with a ratio attends with the selection of the last index-source layer of its ratio at or before it (the
   backend keeps one selection per ratio, ``sparse_raw_indices(ratio)``, rewritten by each index layer).
3. Attention of each query over the last ``sliding_window`` raw tokens (itself included: ``swa_topk_lengths =
   min(seq_len, 128)``, ``attn_metadata_kernels.py::build_page_table_positions``) and its selected compressed
   entries, scaled by ``head_dim^-0.5``, with ``exp(attn_sink[h])`` added to each head's denominator; the output's
   RoPE features rotated back (``fused_rope_inplace(..., inverse=True)``), then ``wo_a`` per group of heads
   (``einsum("tgd,grd->tgr")``, ``_apply_wo_a_bf16_matmul``) and ``wo_b``.

Numerics follow SGLang's torch paths in ``compute_dtype`` (float32 for BF16 layers, float64 for float64 ones): the
ratio-2 compressor projects and pools in it (``linear_bf16_fp32``), the norms take their statistics in it, the
attention scores and softmax run in it. With ``fake_quant`` (the default) the compressed KV is the FP4 round trip
SGLang stores (``fake_quant_compressed_kv``, after RoPE) and the indexer's keys and queries are theirs
(``fake_quant_fp4``), each with a straight-through gradient; the window KV's FP8 cache is not emulated (its
``kv_norm`` output is used as is). The selections are discrete: the attention's loss reaches no indexer weight.

Not yet cross-checked against the transformers PR branch (``models/deepseek_v41/modeling_deepseek_v41.py``,
unmerged #48721) or DeepSeek's own ``inference/model.py``; SGLang alone is restated here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from dsv4convert.errors import CheckpointError
from dsv4convert.model.precision import compute_dtype
from dsv4convert.model.v41.hyper import RMSNorm
from dsv4convert.model.v41.indexer import (
    Indexer,
    candidate_blocks,
    causal_scores,
    fake_quant_compressed_kv,
    full_topk,
    topk_among_blocks,
    visible_entries,
)
from dsv4convert.models.deepseek_v41.config import V41Config, YarnScaling

QUERY_CHUNK = 256   # query rows attended at once: bounds the [rows, heads, keys] scores, changes no number


def rope_table(length: int, dim: int, base: float, scaling: YarnScaling | None) -> torch.Tensor:
    """complex64 ``[length, dim / 2]`` rotations of positions ``0 .. length - 1``
    (``kernels/ops/attention/dsv4/rope.py::precompute_freqs_cis``): inverse frequencies ``base^(-2i/dim)``, with
    ``scaling`` blended towards ``freq / factor`` below the ``beta_fast``..``beta_slow`` correction range of
    ``original_max_position_embeddings``, in float32."""
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if scaling is not None:
        def correction(rotations: float) -> float:
            return dim * math.log(scaling.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
                2 * math.log(base))

        low = max(math.floor(correction(scaling.beta_fast)), 0)
        high = min(math.ceil(correction(scaling.beta_slow)), dim - 1)
        if low == high:
            high += 0.001
        smooth = 1 - torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        freqs = freqs / scaling.factor * (1 - smooth) + freqs * smooth
    angles = torch.outer(torch.arange(length), freqs)
    return torch.polar(torch.ones_like(angles), angles)


def rotate(x: torch.Tensor, table: torch.Tensor, rope_dim: int, *, inverse: bool = False) -> torch.Tensor:
    """``x [B, T, d]`` or ``[B, T, heads, d]`` with its last ``rope_dim`` features rotated as interleaved
    (real, imaginary) pairs by ``table [T, rope_dim / 2]`` (conjugated when ``inverse``), in ``compute_dtype``
    and returned in ``x``'s dtype (``dsv41_sparse.py::rope_tail``)."""
    dtype = compute_dtype(x.dtype)
    if x.dim() == 4:
        table = table.unsqueeze(-2)   # [T, 1, rope / 2]: the same rotation for every head
    cos, sin = table.real.to(dtype), table.imag.to(dtype)
    if inverse:
        sin = -sin
    pairs = x[..., -rope_dim:].to(dtype).unflatten(-1, (-1, 2))
    re, im = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((re * cos - im * sin, re * sin + im * cos), dim=-1).flatten(-2)
    return torch.cat([x[..., :-rope_dim], rotated.to(x.dtype)], dim=-1)


def sink_attention(q: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor, sink: torch.Tensor,
                   scale: float, kept: list[torch.Tensor] | None = None, last: int = 0) -> torch.Tensor:
    """Attention of ``q [B, T, H, D]`` over ``keys [B, S, D]`` (one head, key and value alike) where ``visible
    [B, T, S]``, scaled by ``scale``, with ``exp(sink[h])`` added to each head's denominator; ``[B, T, H, D]`` in
    ``compute_dtype`` (``flash_mla_sm120.py::_sm120_sparse_decode_fwd``). ``kept``, given, receives the
    probabilities of the ``last`` keys (the compressed entries, for the organism's training)."""
    dtype = compute_dtype(q.dtype)
    keys = keys.to(dtype)
    scores = torch.einsum("bthd,bsd->bths", q.to(dtype), keys)
    scores = (scores * scale).masked_fill(~visible.unsqueeze(2), -torch.inf)
    sinks = sink.to(dtype).view(1, 1, -1, 1).expand(*scores.shape[:3], 1)
    probs = torch.cat([scores, sinks], dim=-1).softmax(dim=-1)[..., :-1]
    if kept is not None:
        kept.append(probs[..., -last:])
    return torch.einsum("bths,bsd->bthd", probs, keys)


@dataclass
class V41KVState:
    """What one forward's layers hand on, per sequence batch (``[B, ...]`` tensors, positions ``0 .. T - 1``):

    * ``compressed[s]``: KV-source layer ``s``'s compressed KV ``[B, T // ratio, head_dim]`` (normed, RoPE'd at
      each entry's first token, FP4 round trip), read by every layer whose :meth:`V41Config.kv_source_of` is ``s``;
    * ``index_keys[s]``: its index keys ``[B, T // ratio, index_head_dim]``;
    * ``candidate_blocks``: the candidate-source layer's blocks per query ``[B, T, n]`` (ascending, ``-1`` padded),
      the candidate level;
    * ``selections[i]``: index-source layer ``i``'s chosen compressed entries per query ``[B, T, k]`` (ascending,
      ``-1`` padded), the fine level.

    Two switches for training (the organism, ``dsv4convert/organism/v41.py``), both off in every forward the
    engines have: ``record`` keeps each index-source layer's scores (``index_scores[i]``, ``[B, T, C]`` after the
    causal mask) computed from *detached* inputs (the indexer's own weights get the gradient of a loss on them, the
    layers below do not; the values, and so the selection, are the same), and each compressed layer's attention
    probabilities over its compressed entries (``attention[i]``, ``[B, T, heads, C]``, before the sink is dropped
    from the denominator: the softmax row's share); ``dense`` selects every visible entry instead of the top-k (the
    indexer's top-k lifted, as DeepSeek-V3.2's dense warm-up trains it), the candidate blocks still computed.
    """

    compressed: dict[int, torch.Tensor] = field(default_factory=dict)
    index_keys: dict[int, torch.Tensor] = field(default_factory=dict)
    candidate_blocks: torch.Tensor | None = None
    selections: dict[int, torch.Tensor] = field(default_factory=dict)
    record: bool = False
    dense: bool = False
    index_scores: dict[int, torch.Tensor] = field(default_factory=dict)
    attention: dict[int, torch.Tensor] = field(default_factory=dict)


class Compressor(nn.Module):
    """A KV-source layer's compressor (``dsv41_sparse.py::DeepseekV41Compressor``), parameters as the checkpoint's
    ``attn.compressor.*``: ``wkv.weight`` ``[head_dim, hidden]``, at ratio 2 ``wgate.weight`` ``[head_dim, hidden]``,
    ``norm.weight`` ``[head_dim]``."""

    def __init__(self, config: V41Config, ratio: int, dtype: torch.dtype | None = None):
        super().__init__()
        self.ratio = ratio
        self.wkv = nn.Linear(config.hidden_size, config.head_dim, bias=False, dtype=dtype)
        if ratio > 1:
            self.wgate = nn.Linear(config.hidden_size, config.head_dim, bias=False, dtype=dtype)
        self.norm = RMSNorm(config.head_dim, config.math.rms_norm_eps, dtype=dtype)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``DeepseekV41Compressor.project``: ratio 1 ``wkv(x)`` in ``x``'s dtype; ratio 2 ``(wkv(x), wgate(x))`` in
        ``compute_dtype`` (``linear_bf16_fp32``)."""
        if self.ratio == 1:
            return self.wkv(x), None
        dtype = compute_dtype(x.dtype)
        h = x.to(dtype)
        return F.linear(h, self.wkv.weight.to(dtype)), F.linear(h, self.wgate.weight.to(dtype))

    @staticmethod
    def pool_pairs(kv2: torch.Tensor, score2: torch.Tensor) -> torch.Tensor:
        """``DeepseekV41Compressor.pool_pairs``: ``[..., n, 2, D]`` -> ``[..., n, D]``, each pair weighted by the
        softmax of its scores over the pair, per feature."""
        return (kv2 * score2.softmax(dim=-2)).sum(dim=-2)

    def latent(self, x: torch.Tensor) -> torch.Tensor:
        """The pre-RoPE latents ``[..., T // ratio, head_dim]`` of ``x [..., T, hidden]`` in ``x``'s dtype: entry
        ``j`` pools tokens ``2j`` (first) and ``2j + 1`` at ratio 2 (``_low_ratio_compress_torch`` pools each odd
        position with its predecessor, ``_low_ratio_pair_partners``), is token ``j`` at ratio 1; then
        ``finish``: ``norm`` of the latent rounded to ``x``'s dtype. A trailing unpaired token makes no entry."""
        kv, score = self.project(x)
        if self.ratio > 1:
            n = x.shape[-2] // self.ratio
            kv = self.pool_pairs(kv[..., :n * self.ratio, :].unflatten(-2, (n, self.ratio)),
                                 score[..., :n * self.ratio, :].unflatten(-2, (n, self.ratio)))
        return self.norm(kv.to(x.dtype))


class Attention(nn.Module):
    """One V4.1 layer's attention (``layers.N.attn.*`` of the checkpoint: ``wq_a``, ``q_norm``, ``wq_b``, ``wkv``,
    ``kv_norm``, ``wo_a``, ``wo_b``, ``attn_sink``, and by role ``compressor.*`` and ``indexer.*``).

    ``forward(x [B, T, hidden], state)`` -> ``[B, T, hidden]`` for positions ``0 .. T - 1``; a layer with a
    compress ratio reads and extends ``state`` (:class:`V41KVState`), which the caller passes along the layers
    in order. ``fake_quant``: the FP4 round trips SGLang stores (module docstring)."""

    def __init__(self, config: V41Config, layer_id: int, *, fake_quant: bool = True,
                 dtype: torch.dtype | None = None):
        super().__init__()
        cfg, m = config, config.math
        self.layer_id = layer_id
        self.ratio = cfg.ratio(layer_id)
        self.n_heads, self.head_dim, self.rope_dim = cfg.num_attention_heads, cfg.head_dim, m.qk_rope_head_dim
        self.groups, self.o_lora_rank = cfg.o_groups, cfg.o_lora_rank
        self.window = cfg.sliding_window
        self.softmax_scale = self.head_dim ** -0.5
        self.rope_base = m.compress_rope_theta if self.ratio else m.rope_theta
        self.rope_scaling = m.rope_scaling if self.ratio else None
        self.fake_quant = fake_quant

        self.wq_a = nn.Linear(cfg.hidden_size, cfg.q_lora_rank, bias=False, dtype=dtype)
        self.q_norm = RMSNorm(cfg.q_lora_rank, m.rms_norm_eps, dtype=dtype)
        self.wq_b = nn.Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, bias=False, dtype=dtype)
        self.wkv = nn.Linear(cfg.hidden_size, self.head_dim, bias=False, dtype=dtype)
        self.kv_norm = RMSNorm(self.head_dim, m.rms_norm_eps, dtype=dtype)
        self.wo_a = nn.Linear(self.n_heads * self.head_dim // self.groups, self.groups * self.o_lora_rank, bias=False,
                              dtype=dtype)
        self.wo_b = nn.Linear(self.groups * self.o_lora_rank, cfg.hidden_size, bias=False, dtype=dtype)
        self.attn_sink = nn.Parameter(torch.zeros(self.n_heads, dtype=torch.float32))

        self.kv_source = cfg.kv_source_of(layer_id)
        self.selection_source: int | None = None
        self.compressor: Compressor | None = None
        self.indexer: Indexer | None = None
        if self.ratio:
            if self.kv_source is None:
                raise CheckpointError(f"layer {layer_id} (compress ratio {self.ratio}) has no KV-source layer at or "
                                      f"before it", tensor=f"layers.{layer_id}.attn")
            sources = [s for s in cfg.index_source_layer_ids if s <= layer_id and cfg.ratio(s) == self.ratio]
            if not sources:
                raise CheckpointError(f"layer {layer_id} (compress ratio {self.ratio}) has no index-source layer of "
                                      f"its ratio at or before it to choose its compressed entries",
                                      tensor=f"layers.{layer_id}.attn")
            self.selection_source = sources[-1]
            if layer_id == self.kv_source:
                self.compressor = Compressor(cfg, self.ratio, dtype)
            if layer_id == self.kv_source or layer_id in cfg.index_source_layer_ids:
                self.indexer = Indexer(cfg, layer_id, fake_quant=fake_quant, dtype=dtype)

    def rope(self, length: int, device: torch.device) -> torch.Tensor:
        """This layer's rotations of positions ``0 .. length - 1`` (:func:`rope_table` with its base and scaling)."""
        return rope_table(length, self.rope_dim, self.rope_base, self.rope_scaling).to(device)

    def query(self, x: torch.Tensor, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(``q_norm(wq_a(x))``, the roped heads ``[..., heads, head_dim]``) (``_compute_q_b``: no per-head norm in
        V4.1); ``table`` the rotations of ``x``'s rows."""
        q_latent = self.q_norm(self.wq_a(x))
        return q_latent, rotate(self.wq_b(q_latent).unflatten(-1, (self.n_heads, self.head_dim)), table, self.rope_dim)

    def key_value(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """``rope(kv_norm(wkv(x)))``: the one KV head, key and value, of ``x``'s rows."""
        return rotate(self.kv_norm(self.wkv(x)), table, self.rope_dim)

    def output(self, o: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """The attention's heads ``[..., heads, head_dim]`` to ``[..., hidden]``: RoPE rotated back, ``wo_a`` per group
        of heads, ``wo_b``."""
        o = rotate(o, table, self.rope_dim, inverse=True)
        o = o.reshape(*o.shape[:-2], self.groups, -1)
        wo_a = self.wo_a.weight.view(self.groups, self.o_lora_rank, -1)
        return self.wo_b(torch.einsum("...gd,grd->...gr", o, wo_a).flatten(-2))

    def forward(self, x: torch.Tensor, state: V41KVState) -> torch.Tensor:
        length = x.shape[1]
        table = self.rope(length, x.device)
        q_latent, q = self.query(x, table)
        kv = self.key_value(x, table)

        compressed = selection = None
        if self.ratio:
            self._sources(x, q_latent, table, state)
            compressed = state.compressed[self.kv_source]
            selection = state.selections[self.selection_source]
        kept: list[torch.Tensor] | None = [] if state.record and compressed is not None else None
        o = self._attend(q, kv, compressed, selection, kept)
        if kept is not None:
            state.attention[self.layer_id] = torch.cat(kept, dim=1)
        return self.output(o, table)

    def _sources(self, x: torch.Tensor, q_latent: torch.Tensor, table: torch.Tensor, state: V41KVState) -> None:
        """``forward_low_ratio_sources``: the compressor (a KV source), then the index top-k (an index source);
        under ``state.record`` the indexer reads detached inputs (:class:`V41KVState`)."""
        detach = (lambda t: t.detach()) if state.record else (lambda t: t)
        if self.compressor is not None:
            latent = self.compressor.latent(x)
            state.compressed[self.layer_id] = self.compressed_entries(latent, table)
            if self.indexer is not None and self.indexer.owns_keys:
                state.index_keys[self.layer_id] = self.index_keys(detach(latent), table)
        if self.indexer is None or not self.indexer.is_index_source:
            return
        if self.indexer.uses_candidates and state.candidate_blocks is None:
            raise CheckpointError(f"layer {self.layer_id} takes candidate blocks, but no candidate-source layer "
                                  f"ran before it", tensor=f"layers.{self.layer_id}.attn.indexer")
        scores, picked, candidates = self.select(detach(x), detach(q_latent), state.index_keys[self.kv_source],
                                                 table, state.candidate_blocks)
        if candidates is not None:
            state.candidate_blocks = candidates
        if state.record:
            state.index_scores[self.layer_id] = scores
        if state.dense:
            columns = torch.arange(scores.shape[-1], device=x.device)
            lens = visible_entries(torch.arange(x.shape[1], device=x.device), self.ratio).expand(x.shape[0], -1)
            picked = columns.expand(*lens.shape, -1).masked_fill(columns >= lens.unsqueeze(-1), -1)
        state.selections[self.layer_id] = picked

    def entry_table(self, table: torch.Tensor, entries: int) -> torch.Tensor:
        """The rotations of compressed entries ``0 .. entries - 1``, each at its first token's position."""
        return table[::self.ratio][:entries]

    def compressed_entries(self, latent: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """The compressed KV as stored from the compressor's pre-RoPE ``latent``: RoPE'd at each entry's first
        token, then (``fake_quant``) SGLang's FP4 round trip."""
        kv = rotate(latent, self.entry_table(table, latent.shape[-2]), self.rope_dim)
        return fake_quant_compressed_kv(kv) if self.fake_quant else kv

    def index_keys(self, latent: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """This KV source's index keys from its compressor's pre-RoPE ``latent`` (:meth:`Indexer.keys`)."""
        entries = self.entry_table(table, latent.shape[-2])
        return self.indexer.keys(latent, lambda k: rotate(k, entries, self.rope_dim))

    def select(self, x: torch.Tensor, q_latent: torch.Tensor, keys: torch.Tensor, table: torch.Tensor,
               candidates: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """An index source's choice for ``x [B, T, hidden]``: its causal scores ``[B, T, C]`` of ``keys``, its fine
        selection ``[B, T, k]`` (among ``candidates`` on a candidate consumer, else the full top-k) and, on the
        candidate source, the candidate blocks it publishes (else None)."""
        indexer, length = self.indexer, x.shape[1]
        queries = indexer.queries(q_latent, lambda q: rotate(q, table, self.rope_dim))
        lens = visible_entries(torch.arange(length, device=x.device), self.ratio).expand(x.shape[0], length)
        scores = causal_scores(indexer.scores(queries, keys, indexer.head_weights(x)), lens)
        if indexer.uses_candidates:
            return scores, topk_among_blocks(scores, lens, candidates, indexer.topk, indexer.candidate_block_size), None
        picked = full_topk(scores, lens, indexer.topk)
        published = candidate_blocks(scores, lens, indexer.candidate_topk_blocks, indexer.candidate_block_size) \
            if indexer.is_candidate_source else None
        return scores, picked, published

    def _attend(self, q: torch.Tensor, kv: torch.Tensor, compressed: torch.Tensor | None,
                selection: torch.Tensor | None, kept: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Sink-softmax attention of ``q [B, T, H, D]`` over the window of ``kv [B, T, D]`` and, given, the
        ``selection [B, T, k]`` of ``compressed [B, C, D]``; ``[B, T, H, D]`` in ``q``'s dtype
        (``_sm120_sparse_decode_fwd``). ``kept``, given, receives each query chunk's probabilities over the
        compressed entries (``[B, rows, H, C]``)."""
        batch, length = q.shape[0], q.shape[1]
        positions = torch.arange(length, device=q.device)
        out = []
        for start in range(0, length, QUERY_CHUNK):
            rows = positions[start:start + QUERY_CHUNK]
            first = max(0, start - self.window + 1)
            keys = kv[:, first:start + len(rows)]
            columns = positions[first:start + len(rows)]
            mask = ((columns <= rows[:, None]) & (columns > rows[:, None] - self.window)).expand(batch, -1, -1)
            if compressed is not None:
                n = compressed.shape[1]
                chosen = selection[:, start:start + len(rows)]
                picked = torch.zeros(batch, len(rows), n + 1, dtype=torch.bool, device=q.device)
                picked.scatter_(-1, chosen.masked_fill(chosen < 0, n), True)
                keys = torch.cat([keys, compressed], dim=1)
                mask = torch.cat([mask, picked[..., :n]], dim=-1)
            out.append(sink_attention(q[:, start:start + len(rows)], keys, mask, self.attn_sink, self.softmax_scale,
                                      kept, compressed.shape[1] if kept is not None else 0))
        return torch.cat(out, dim=1).to(q.dtype)
