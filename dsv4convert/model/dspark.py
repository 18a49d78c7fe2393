"""DeepSeek-V4-Flash-0731's DSpark drafter, drafting as SGLang 0.5.23 drafts with it, on transformers' layers.

What SGLang 0.5.23 computes (``python/sglang/srt/``; each rule names the file and function it follows):

* **Target features.** For every committed position ``t`` the target's output streams after each layer in
  ``dspark_target_layer_ids``, averaged over the ``hc_mult`` hyper-connection streams
  (``models/deepseek_v4.py::DeepseekV4Model._forward_impl``: ``mhc_stream_mean(completed)`` after layer ``i``
  when ``i in dspark_layers_to_capture``), concatenated in layer order
  (``layers/aux_hidden_states.py::AuxHiddenStatePacker.slot``): ``[t, hidden * T]``. (V4.1's
  ``hc_pre_from_prev_sublayer`` path captures the layer's *input* instead; V4-Flash does not take it.)
* **Context KV.** ``main_x = main_norm(main_proj(features))`` (stage 0's, ``models/deepseek_v4_dspark.py::
  DeepseekV4ForCausalLMDSpark.project_target_hidden``); every stage's context row at ``t`` is that stage's own
  ``wkv(main_x[t])`` (``project_commit_kv``, ``kernels/ops/speculative/dspark/dspark_draft_model.py::
  commit_kv_proj``), stored with the stage's ``kv_norm`` and RoPE at ``t`` (``store_commit_kv``:
  ``set_swa_key_buffer_radix_fused_norm_rope``): no ``attn_norm``, no hyper-connection on that path.
* **The block.** ``gamma = dspark_block_size`` query rows ``[anchor, noise, ..., noise]`` at positions
  ``p .. p + gamma - 1``, the anchor being the last committed (bonus) token at ``p`` and ``noise``
  ``dspark_noise_token_id`` (``speculative/dspark_components/dspark_draft.py::DraftBlockProposer._run_forward``
  with ``sample_from_anchor``, default True: ``dspark_config.py::get_dspark_sample_from_anchor``;
  ``positions_2d = prefix_lens + arange``: ``dspark_planner.py``), embedded with the target's embedding and
  repeated over the streams (``DeepseekV4ForCausalLMDSpark.forward_embed``).
* **Stages**, in sequence (``DeepseekV4ForCausalLMDSpark._forward_impl``): each a V4 decoder layer
  (hyper-connections, ``attn_norm``, attention, ``ffn_norm``, MoE with a scored gate: ``is_nextn=True``,
  ``DSparkV4StageMixin``) whose attention (``DSparkAttention.forward``) is sliding-window only, plain RoPE
  (``rope_theta``, no YaRN: ``MqaAttentionBase.__init__`` with ``compress_ratio=0``, ``rope_original_seq_len=0``),
  ``q = wq_b(q_norm(wq_a(x)))`` with the per-head RMS norm, block KV ``wkv(x)`` stored like the context's, an
  attention sink, inverse RoPE on the output, grouped ``wo_a`` and ``wo_b``: transformers'
  ``DeepseekV4DecoderLayer`` as is.
* **What a block row sees.** The last ``min(p, window)`` context rows (positions ``p - window .. p - 1``) and
  *every* row of its block: the draft's page indices are ``[window ; block]`` for all ``gamma`` rows alike
  with ``topk_length = context + gamma`` (``kernels/ops/speculative/dspark/dspark_attn_metadata.py::
  compute_dspark_window_gather``, ``build_dspark_swa_page_indices``; FlashMLA's sparse decode applies no other
  mask). Attention inside the block is bidirectional, as vLLM says outright
  (``models/deepseek_v4/nvidia/dspark.py``: "non-causal attention ... include the future query tokens");
  ``build_block_seq_lens_causal``'s per-row lengths only locate the window. SGLang's window is
  ``SWA_WINDOW = 128`` (``layers/attention/deepseek_v4_backend.py``), V4-Flash's ``sliding_window``; here it is
  the config's ``sliding_window`` (the organism's 32), as the backbone's layers use it.
* **Base logits**: the last stage's ``hc_head`` collapse and ``norm``, then the target's ``lm_head``
  (``compute_base_logits``, ``collapse_hc_head``: ``models/deepseek_v4.py::hc_head_torch``, transformers'
  ``DeepseekV4HyperHead``). Row ``j`` predicts the token at ``p + j + 1``.
* **Markov head** (``DSparkV4MarkovHead``; ``dspark_draft.py::draft_markov_block``, ``_draft_step``): step by
  step over the block, ``logits_j = base_j + markov_w2(markov_w1(prev))`` in float32 (``project_bias``), greedy
  ``draft_j = argmax``, ``prev = draft_j``, starting from the anchor. ``markov_w1`` is the release's
  ``markov_head.embed`` ``[vocab, rank]``, ``markov_w2`` its ``markov_head.head`` ``[vocab, rank]``.
* **Confidence** (``models/dspark.py::DSparkConfidenceHead.predict``): ``sigmoid(proj([x_post_hc_j,
  markov_w1(prev_j)]))``, ``prev_j`` the anchor for ``j = 0`` and ``draft_{j-1}`` after; ``proj`` ``[1, H + R]``
  without bias (``build_dspark_v4_confidence_head(bias=False)``); SGLang builds it unless
  ``SGLANG_RAGGED_VERIFY_MODE`` is ``static``. Its STS temperature is 1 unless calibrated.
* **Greedy verification** accepts the drafts as a prefix while they equal the target's greedy tokens.

The rules V4.1's drafter shares (target features, blocks, Markov drafting, confidence, acceptance) live in
:mod:`dsv4convert.model.dspark_rules`, restated once for both releases.

How it is computed here: transformers' ``DeepseekV4DecoderLayer`` is the math of every stage. Its attention
reads its keys from ``past_key_values.update`` (sliding-window layers: ``kv = cache.update(kv, kv)``), so the
one adapter is :class:`ContextKV`, a stand-in cache that puts each block's window of context KV (computed by
the stage's own ``kv_proj``/``kv_norm`` modules, roped by transformers' ``apply_rotary_pos_emb``) in front of
the block's KV, with an additive mask hiding the window slots before position 0. Every block of every sequence
is one batch row of ``gamma`` queries against ``window + gamma`` keys: many anchors of a sequence in one
forward, memory linear in the number of blocks. Hooks a caller puts on a stage's modules (``compare``'s served
numerics: W8A8 inputs, the FP8 KV cache on ``kv_norm``) reach the context rows too, as SGLang's stored KV does.

Checked (tests/test_dspark.py): a block's rows equal transformers' own layer over ``[context ; block]`` with its
causal mask where they coincide (``block_causal=True``, the context's KV taken from that layer's ``kv_norm``),
the batched many-blocks forward equals a one-block-at-a-time loop, and :meth:`DSparkDrafter.native_state`
names every tensor the layout's ``mtp.*`` inventory has. No SGLang kernel runs here.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DeepseekV4Config
from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
    DeepseekV4DecoderLayer,
    DeepseekV4HyperHead,
    DeepseekV4RMSNorm,
    DeepseekV4RotaryEmbedding,
    apply_rotary_pos_emb,
)

from dsv4convert.errors import DSV4Error
from dsv4convert.models.deepseek_v4.layout import DSparkConfig, ModelConfig
from dsv4convert.models.deepseek_v4.names import draft_block
from dsv4convert.model.blocks import (
    WeightSource,
    block_config,
    block_index,
    block_release_names,
    build_layer,
    hf_config,
    set_tensor,
)
# The release-independent rules; Acceptance, acceptance, anchor_grid and target_features are re-exported for V4's
# callers (organism, calibrate, compare, tests), which import them from here as they import embed_blocks.
from dsv4convert.model.dspark_rules import (
    CONFIDENCE_DTYPE,
    MARKOV_W2_DTYPE,
    Acceptance,
    Blocks,
    DraftOutput,
    acceptance,
    anchor_grid,
    confidence,
    confidence_features,
    embed_blocks,
    markov_draft,
    project_bias,
    stream_mean,
    target_features,
)
from dsv4convert.model.precision import at_layer_precision

ROPE = "main"       # sliding-window layers' rope type in transformers (plain rope_theta, no YaRN)


def dspark_of(cfg: ModelConfig) -> DSparkConfig:
    if cfg.dspark is None:
        raise DSV4Error("the checkpoint has no DSpark drafter (no dspark_* keys in config.json)")
    return cfg.dspark


# -- target features ------------------------------------------------------------------------------


class FeatureCapture:
    """Records the target features while a backbone runs: forward hooks on its decoder layers
    (``layers[i]`` for ``i`` in the target layer ids) keep each one's output streams' mean over the streams.

    ``with FeatureCapture(model.backbone.model.layers, ids) as capture: model(...); capture.features()``.
    Streamed callers (``compare``) instead keep :func:`stream_mean` of the target blocks' outputs themselves.
    """

    def __init__(self, layers: Sequence[nn.Module], target_layer_ids: Sequence[int]):
        self.layers, self.ids = layers, sorted(target_layer_ids)
        self._handles: list = []
        self._means: dict[int, torch.Tensor] = {}

    def __enter__(self) -> "FeatureCapture":
        for i in self.ids:
            self._handles.append(self.layers[i].register_forward_hook(
                lambda _m, _args, out, i=i: self._means.__setitem__(i, stream_mean(out))))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def features(self) -> torch.Tensor:
        missing = [i for i in self.ids if i not in self._means]
        if missing:
            raise DSV4Error(f"the backbone did not run target layers {missing}")
        return torch.cat([self._means[i] for i in self.ids], dim=-1)


# -- the blocks -----------------------------------------------------------------------------------


class ContextKV:
    """The stand-in cache a stage's transformers attention reads its keys from: the block's window of context
    KV ``[m, 1, W, D]`` in front of the block's own KV (K = V, one head), which is all ``update`` must return
    for a sliding-window layer (``DeepseekV4Attention.forward``). Nothing is stored: each call is one block
    batch."""

    def __init__(self, context: torch.Tensor):
        self.context = context

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        keys = torch.cat([self.context.to(key_states.dtype), key_states], dim=2)
        return keys, keys


# -- the pieces of a stage ------------------------------------------------------------------------


def rope_tables(rotary: DeepseekV4RotaryEmbedding, positions: torch.Tensor, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
    probe = torch.zeros((), dtype=dtype, device=positions.device)
    return rotary(probe, position_ids=positions, layer_type=ROPE)


def context_kv(layer: DeepseekV4DecoderLayer, main_x: torch.Tensor, rotary: DeepseekV4RotaryEmbedding
               ) -> torch.Tensor:
    """A stage's context rows ``[B, 1, S, D]`` for positions ``0 .. S - 1``: ``kv_norm(kv_proj(main_x))`` roped at
    each position, exactly as transformers' attention makes its own KV (SGLang: the stage's ``wkv`` on
    ``main_x``, stored with ``kv_norm`` and RoPE)."""
    attn = layer.self_attn
    kv = attn.kv_norm(attn.kv_proj(main_x)).unsqueeze(1)
    positions = torch.arange(main_x.shape[1], device=main_x.device)[None]
    cos, sin = rope_tables(rotary, positions, kv.dtype)
    return apply_rotary_pos_emb(kv, cos, sin)


def run_stage(layer: DeepseekV4DecoderLayer, streams: torch.Tensor, kv: torch.Tensor, blocks: Blocks,
              rotary: DeepseekV4RotaryEmbedding, *, chunk: int | None = None) -> torch.Tensor:
    """One stage over every block: ``streams [M, G, hc, H]`` (any device) -> the stage's output streams on the
    layer's device; ``kv`` is this stage's :func:`context_kv` of the sequences the blocks index. ``chunk`` bounds
    the blocks per forward."""
    device = kv.device
    outs = []
    for rows in blocks.chunks(chunk):
        part = blocks.select(rows)
        window = kv[part.seq[:, None], 0, part.context].unsqueeze(1)           # [m, 1, W, D]
        hidden = streams[rows].to(device, non_blocking=True)
        cos, sin = rope_tables(rotary, part.positions, hidden.dtype)
        outs.append(layer(hidden, input_ids=part.input_ids, position_embeddings={ROPE: (cos, sin)},
                          position_ids=part.positions, attention_mask=part.mask(hidden.dtype),
                          past_key_values=ContextKV(window)))
    return torch.cat(outs) if len(outs) != 1 else outs[0]


class DSparkEntry(nn.Module):
    """Stage 0's projection of the target features: ``main_x = main_norm(main_proj(features))``."""

    def __init__(self, hidden: int, targets: int, eps: float):
        super().__init__()
        self.main_proj = nn.Linear(hidden * targets, hidden, bias=False)
        self.main_norm = DeepseekV4RMSNorm(hidden, eps=eps)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.main_norm(self.main_proj(features))

    @classmethod
    def load(cls, source: WeightSource, config: DeepseekV4Config, cfg: ModelConfig) -> "DSparkEntry":
        with torch.device("meta"):
            entry = cls(cfg.hidden_size, dspark_of(cfg).stages, config.rms_norm_eps)
        names = dspark_of(cfg).names
        set_tensor(entry.main_proj, "weight", source.linear(names.entry_proj))
        set_tensor(entry.main_norm, "weight", source.tensor(f"{names.entry_norm}.weight"))
        return entry


class DSparkHead(nn.Module):
    """The last stage's end: hyper-connection head and norm (base logits through the target's ``lm_head``),
    the rank-R Markov head and the confidence head."""

    def __init__(self, config: DeepseekV4Config, d: DSparkConfig):
        super().__init__()
        hidden = config.hidden_size
        self.hc_head = DeepseekV4HyperHead(config)
        self.norm = DeepseekV4RMSNorm(hidden, eps=config.rms_norm_eps)
        self.markov_w1 = nn.Embedding(config.vocab_size, d.markov_rank)                  # markov_head.embed
        self.markov_w2 = nn.Linear(d.markov_rank, config.vocab_size, bias=False)          # markov_head.head
        self.confidence = nn.Linear(hidden + (d.markov_rank if d.confidence_with_markov else 0), 1, bias=False)
        self.with_markov = d.confidence_with_markov

    @classmethod
    def load(cls, source: WeightSource, config: DeepseekV4Config, cfg: ModelConfig) -> "DSparkHead":
        d = dspark_of(cfg)
        with torch.device("meta"):
            head = cls(config, d)
        for leaf in ("fn", "base", "scale"):
            set_tensor(head.hc_head, f"hc_{leaf}", source.tensor(f"{d.names.last}.hc_head_{leaf}"))
        set_tensor(head.norm, "weight", source.tensor(f"{d.names.norm}.weight"))
        set_tensor(head.markov_w1, "weight", source.linear(d.names.markov_embed))
        set_tensor(head.markov_w2, "weight", source.linear(d.names.markov_head).to(MARKOV_W2_DTYPE))
        set_tensor(head.confidence, "weight", source.linear(d.names.confidence).to(CONFIDENCE_DTYPE))
        return head

    def base(self, streams: torch.Tensor, lm_head: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(base logits float32 ``[..., vocab]``, ``x_post_hc [..., H]``) from the last stage's streams."""
        x_post_hc = self.hc_head(streams)
        return F.linear(self.norm(x_post_hc), lm_head).float(), x_post_hc

    def markov_bias(self, prev: torch.Tensor) -> torch.Tensor:
        """``markov_w2(markov_w1(prev))``, float32 (:func:`~dsv4convert.model.dspark_rules.project_bias`)."""
        return project_bias(self.markov_w1(prev), self.markov_w2.weight)

    def markov_logits(self, base_logits: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """Each row's Markov-corrected logits given the token before it (``prev [M, G]``: the anchor, then
        whatever conditions row ``j``: the previous draft, or the true previous token for teacher forcing)."""
        return base_logits + self.markov_bias(prev)

    def draft(self, base_logits: torch.Tensor, anchor_tokens: torch.Tensor, *, keep_logits: bool = True
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Greedy Markov drafting (:func:`~dsv4convert.model.dspark_rules.markov_draft` with :meth:`markov_bias`):
        (draft tokens ``[M, G]``, the token each row was conditioned on ``[M, G]`` (anchor, then the drafts), the
        step logits or None)."""
        return markov_draft(base_logits, anchor_tokens, self.markov_bias, keep_logits=keep_logits)

    def prev_embedding(self, prev: torch.Tensor) -> torch.Tensor | None:
        """``markov_w1(prev)``, what the confidence head reads beside ``x_post_hc``; None without
        ``confidence_head_with_markov``."""
        return self.markov_w1(prev) if self.with_markov else None

    def confidence_features(self, x_post_hc: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """What the confidence head reads (:func:`~dsv4convert.model.dspark_rules.confidence_features`)."""
        return confidence_features(x_post_hc, self.prev_embedding(prev), self.confidence.weight.dtype)

    def confidence_of(self, x_post_hc: torch.Tensor, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(``sigmoid(raw)``, raw) per row (:func:`~dsv4convert.model.dspark_rules.confidence`), ``prev`` as
        :meth:`draft` gives it."""
        return confidence(self.confidence, x_post_hc, self.prev_embedding(prev))

    def probe_confidence(self, x_post_hc: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """The raw confidence ``[M, G]`` on detached inputs: what training fits the head with, as a probe of the
        drafter's state that never trades draft quality for calibration (``organism/dspark.py``)."""
        return self.confidence(self.confidence_features(x_post_hc, prev).detach()).squeeze(-1)


# -- the drafter ----------------------------------------------------------------------------------


class DSparkDrafter(nn.Module):
    """The drafter as a module: :class:`DSparkEntry`, the stages (transformers' ``DeepseekV4DecoderLayer`` at
    layer indices ``n .. n + S - 1``), :class:`DSparkHead`. The target's embedding and ``lm_head`` are shared,
    passed to :meth:`forward`, never owned."""

    def __init__(self, config: dict, *, experts_implementation: str = "eager", initializer_range: float | None = None,
                 stages: Sequence[DeepseekV4DecoderLayer] | None = None, entry: DSparkEntry | None = None,
                 head: DSparkHead | None = None):
        super().__init__()
        self.cfg = ModelConfig.from_dict(config)
        d = dspark_of(self.cfg)
        full = hf_config(config)
        full._experts_implementation = experts_implementation
        if initializer_range is not None:
            full.initializer_range = initializer_range
        self.config, self.d = full, d
        self.window = int(full.sliding_window)
        self.entry = entry if entry is not None else DSparkEntry(self.cfg.hidden_size, d.stages, full.rms_norm_eps)
        if stages is None:
            stages = [DeepseekV4DecoderLayer(block_config(full, self.cfg, draft_block(s)),
                                             block_index(self.cfg, draft_block(s))) for s in range(d.stages)]
        self.stages = nn.ModuleList(stages)
        self.head = head if head is not None else DSparkHead(full, d)
        self.rotary = DeepseekV4RotaryEmbedding(full)
        at_layer_precision(self)

    @classmethod
    def from_source(cls, source: WeightSource, config: dict) -> "DSparkDrafter":
        """The drafter of a checkpoint, every weight dequantized on ``source.device`` from whatever format it is
        stored in, by the backbone's own path (:func:`~dsv4convert.model.blocks.build_layer`, ``source.linear``)."""
        cfg = ModelConfig.from_dict(config)
        d = dspark_of(cfg)
        full = hf_config(config)
        stages = [build_layer(source, full, cfg, draft_block(s)) for s in range(d.stages)]
        drafter = cls(config, experts_implementation=full._experts_implementation, stages=stages,
                      entry=DSparkEntry.load(source, full, cfg), head=DSparkHead.load(source, full, cfg))
        drafter.rotary = DeepseekV4RotaryEmbedding(full, device=source.device)
        return drafter.eval()

    @torch.no_grad()
    def init_weights(self, init) -> None:
        """Initialise every module with ``init`` (transformers' ``DeepseekV4PreTrainedModel._init_weights`` of a
        model with this config), then the Markov bias and the confidence at zero: a fresh drafter drafts from
        its base logits alone and is unsure."""
        for module in self.modules():
            if module is not self.rotary:
                init(module)
        nn.init.zeros_(self.head.markov_w2.weight)
        nn.init.zeros_(self.head.confidence.weight)

    def forward(self, features: torch.Tensor, blocks: Blocks, embed: torch.Tensor, lm_head: torch.Tensor, *,
                teacher_prev: torch.Tensor | None = None, keep_draft_logits: bool = True,
                chunk: int | None = None) -> DraftOutput:
        """Every block at once. ``features [B, S, H * T]`` (:func:`target_features` of the sequences ``blocks``
        index), ``embed``/``lm_head`` the target's ``[V, H]``; ``teacher_prev [M, G]`` (e.g. ``blocks.gather(ids)``)
        adds the teacher-forced logits."""
        main_x = self.entry(features)
        streams = embed_blocks(blocks, embed, self.cfg.hc_mult)
        for layer in self.stages:
            streams = run_stage(layer, streams, context_kv(layer, main_x, self.rotary), blocks, self.rotary,
                                chunk=chunk)
        return self.finish(streams, blocks, lm_head, teacher_prev=teacher_prev, keep_draft_logits=keep_draft_logits)

    def finish(self, streams: torch.Tensor, blocks: Blocks, lm_head: torch.Tensor, *,
               teacher_prev: torch.Tensor | None = None, keep_draft_logits: bool = True) -> DraftOutput:
        """The head on the last stage's streams: base logits, Markov drafts, confidence."""
        return finish(self.head, streams, blocks, lm_head, teacher_prev=teacher_prev,
                      keep_draft_logits=keep_draft_logits)

    # -- export -----------------------------------------------------------------------------------

    def native_paths(self) -> dict[str, str]:
        """Release name -> this module's parameter or buffer path, routed experts aside. The paths are read off
        the modules (their attributes mirror SGLang's: ``main_proj``, ``markov_w1``...), the release names off
        ``DSparkNames``: neither is written out here."""
        d, targets = self.d, dict(self.named_parameters()) | dict(self.named_buffers())
        path = {id(x): name for name, x in [*self.named_modules(), *targets.items()]}
        out = {}
        for s, stage in enumerate(self.stages):
            out.update(block_release_names(draft_block(s), path[id(stage)], targets))
        names, head = d.names, self.head
        out[f"{names.entry_proj}.weight"] = path[id(self.entry.main_proj.weight)]
        out[f"{names.entry_norm}.weight"] = path[id(self.entry.main_norm.weight)]
        out[f"{names.norm}.weight"] = path[id(head.norm.weight)]
        out.update({f"{names.last}.hc_head_{leaf}": path[id(getattr(head.hc_head, f"hc_{leaf}"))]
                    for leaf in ("fn", "base", "scale")})
        out[f"{names.markov_embed}.weight"] = path[id(head.markov_w1.weight)]
        out[f"{names.markov_head}.weight"] = path[id(head.markov_w2.weight)]
        out[f"{names.confidence}.weight"] = path[id(head.confidence.weight)]
        return out

    def expert_views(self):
        for s, layer in enumerate(self.stages):
            gate_up, down = layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj
            inter = gate_up.shape[1] // 2
            for e in range(gate_up.shape[0]):
                p = f"{draft_block(s)}.ffn.experts.{e}"
                yield f"{p}.w1.weight", gate_up[e, :inter]
                yield f"{p}.w3.weight", gate_up[e, inter:]
                yield f"{p}.w2.weight", down[e]

    @torch.no_grad()
    def native_state(self) -> dict[str, torch.Tensor]:
        """Every ``mtp.*`` tensor under its release name (``layout._dspark_extras`` and the stages' blocks), in
        float32, experts split per expert: what the exporter quantizes."""
        targets = dict(self.named_parameters()) | dict(self.named_buffers())
        state = {native: targets[path] for native, path in self.native_paths().items()} | dict(self.expert_views())
        return {name: t.detach().to("cpu", torch.float32).contiguous() for name, t in state.items()}


def finish(head: DSparkHead, streams: torch.Tensor, blocks: Blocks, lm_head: torch.Tensor, *,
           teacher_prev: torch.Tensor | None = None, keep_draft_logits: bool = True) -> DraftOutput:
    """:meth:`DSparkDrafter.finish` for a head loaded on its own (a streamed drafter)."""
    base, x_post_hc = head.base(streams, lm_head)
    tokens, prev, logits = head.draft(base, blocks.input_ids[:, 0], keep_logits=keep_draft_logits)
    confidence, raw = head.confidence_of(x_post_hc, prev)
    teacher = head.markov_logits(base, teacher_prev) if teacher_prev is not None else None
    return DraftOutput(base, x_post_hc, tokens, prev, logits, confidence, raw, teacher)
