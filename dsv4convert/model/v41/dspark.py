"""DeepSeek-V4.1's DSpark drafter (the ``mtp.*`` stages), drafting as SGLang 0.5.23 drafts with it.

SGLang runs V4.1's drafter in V4's class, ``models/deepseek_v4_dspark.py::DeepseekV4ForCausalLMDSpark``, with V4.1's
config (``configs/deepseek_v41.py``: ``hc_pre_from_prev_sublayer``, no ``q_head_norm``). What it shares with V4's
(target features, blocks, greedy Markov steps, confidence, acceptance) is :mod:`dsv4convert.model.dspark_rules`;
what V4.1 does its own way, each rule naming SGLang's file::function:

* **Target features**: the stream mean of each ``dspark_target_layer_ids`` layer's *input*, after its Engram and
  before its attention (:func:`features_of` on :class:`~dsv4convert.model.v41.forward.V41Output` ``captured``,
  ``DeepseekV4Model._forward_impl``'s ``hc_pre_from_prev`` capture), in ascending layer order.
* **Context KV**: ``main_x = main_norm(main_proj(features))`` (stage 0's, ``project_target_hidden``); each stage's
  context row at ``t`` is its own ``wkv(main_x[t])`` (``project_commit_kv``, ``dspark_draft_model.py::
  commit_kv_proj``) stored with its ``kv_norm`` and RoPE at ``t`` (``store_commit_kv``): :func:`context_kv`.
* **Stages** (:class:`V41Stage`, ``DSparkV4StageMixin``): a V4.1 block with ``dspark_n_routed_experts`` experts,
  ``dspark_num_experts_per_tok`` chosen (``_dspark_stage_config``; 128 and 3 in the release) and no Engram,
  compressor or indexer. Its attention (:class:`StageAttention`, ``DSparkAttention``: ``compress_ratio=0``,
  ``rope_original_seq_len=0``) is V4.1's core without per-head query norm (``_compute_q`` with ``q_head_norm``
  False), plain RoPE at ``rope_theta`` (``MqaAttentionBase.__init__``), the sink, the inverse RoPE of the output and
  the grouped ``wo_a`` (``forward``), over the window of context KV and every row of its block (the shared
  :class:`~dsv4convert.model.dspark_rules.Blocks`). The hyper-connections are V4.1's lagged ones
  (``deepseek_v4_platform_stage.py::NonCudaDSparkMixin._forward_hc_pre_from_prev``): the first stage starts with
  no ``pre`` (stream 0), each stage hands its last ``pre`` to the next (``_forward_impl``: ``x, pre = stage(...,
  pre)``). The MoE runs without ``input_ids`` (``_run_ffn``), so ``gate.bias_vl`` is never read; SGLang does not
  even load it (``_remap_dspark_weight_name``), it is loaded here so that every ``mtp.*`` tensor has its parameter.
* **Base logits**: no ``hc_head`` (V4.1 ships none, ``DSparkV4StageMixin.__init__``); the last streams collapse
  with the last stage's ``pre`` (``_forward_impl``: ``mhc_combine``), that is ``x_post_hc``
  (``collapse_hc_head`` returns it as is), then the last stage's ``norm`` and the target's ``lm_head`` in its dtype
  (``_logits_from_x_post_hc``, ``dspark.py::project_through_lm_head``; ``SGLANG_DSPARK_FP32_LM_HEAD`` off).
* **Markov head** (``DSparkV4MarkovHead``): ``markov_w2`` held in BF16 (``SGLANG_DSPARK_OPT_MARKOV_W2_BF16``,
  default on in 0.5.23), the bias ``markov_w2(markov_w1(prev))`` computed in BF16 and added to the base logits in
  float32 (``project_bias``, ``step_bias``, ``step_logits_dtype``).
* **Confidence head** (``build_dspark_v4_confidence_head``): ``proj [1, H + markov_rank]`` without bias, float32
  (``DSparkConfidenceHead``'s default dtype), on ``[x_post_hc, markov_w1(prev)]`` (``with_markov``: V4.1's config
  has no ``confidence_head_with_markov``, and ``markov_rank > 0``). SGLang builds it only when
  ``SGLANG_RAGGED_VERIFY_MODE`` is not ``static``, its default; it is computed here always, from the release's
  trained weights.

Not emulated: the FP8 SWA KV cache SGLang stores the context and block KV in (as ``attention.py``'s window).

API (as ``model/dspark.py``'s, which ``compare/dspark.py`` uses): :class:`V41Drafter` resident (``forward`` drafts
every block at once, ``native_paths`` names each parameter by its release name), or streamed from a checkpoint one
stage at a time (:func:`load_entry`, :func:`load_stage`, :func:`load_head`, :func:`context_kv`, :func:`run_stage`,
:func:`finish`, :func:`stream_draft`). :class:`DSparkHead` ``markov_logits`` conditions the draft distributions
on any history (another side's drafts, the true tokens).

Checked against SGLang's own code on the CPU (tests/test_model_v41_dspark.py): ``DSparkAttention.forward`` and
``_compute_q`` (a stand-in backend for FlashMLA, which needs a GPU, and for the pool's fused norm-RoPE store),
``commit_kv_proj``, ``_dspark_stage_config``, the routing, ``_forward_hc_pre_from_prev`` over the three stages and
``_forward_impl``'s end with ``mhc_combine``, ``DSparkV4MarkovHead``, ``draft_markov_block`` and
``DSparkConfidenceHead.predict``. Not run: FlashMLA's sparse attention and the fused norm-RoPE KV store (CUDA),
the Triton/CUDA Markov and MoE kernels, TP sharding of ``markov_w2``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from dsv4convert.errors import CheckpointError
from dsv4convert.model.dspark_rules import (
    CONFIDENCE_DTYPE,
    MARKOV_W2_DTYPE,
    Blocks,
    DraftOutput,
    confidence,
    confidence_features,
    embed_blocks,
    markov_draft,
    project_bias,
)
from dsv4convert.model.v41.attention import Attention, sink_attention
from dsv4convert.model.v41.forward import V41Block
from dsv4convert.model.v41.hyper import RMSNorm, collapse
from dsv4convert.model.v41.weights import WeightSource, load
from dsv4convert.models.deepseek_v4.names import DSparkNames, draft_block
from dsv4convert.models.deepseek_v41.config import DSparkV41Config, V41Config



def dspark_of(cfg: V41Config) -> DSparkV41Config:
    if cfg.dspark is None:
        raise CheckpointError("the checkpoint has no DSpark drafter (no dspark_* keys in its text_config)",
                              tensor="text_config.dspark_target_layer_ids")
    return cfg.dspark


def features_of(captured: Mapping[int, torch.Tensor], target_layer_ids: Sequence[int]) -> torch.Tensor:
    """``[B, T, hidden * stages]``: the captured stream means (``V41Output.captured``) of the target layers in
    ascending order (``AuxHiddenStatePacker.slot``)."""
    missing = sorted(set(target_layer_ids) - set(captured))
    if missing:
        raise CheckpointError(f"the target's forward did not capture layers {missing}")
    return torch.cat([captured[i] for i in sorted(target_layer_ids)], dim=-1)


class StageAttention(Attention):
    """A stage's attention (``DSparkAttention``): V4.1's parameters and core at compress ratio 0, attending a block's
    rows to their window of context KV and their whole block."""

    def block_attention(self, x: torch.Tensor, window_kv: torch.Tensor, visible: torch.Tensor,
                        table: torch.Tensor) -> torch.Tensor:
        """``x [M, G, hidden]`` (the block rows), ``window_kv [M, W, head_dim]`` (:func:`context_kv` gathered at each
        block's context positions), ``visible [M, G, W + G]`` (:meth:`Blocks.visible`), ``table [M, G, rope / 2]``
        the rows' rotations -> ``[M, G, hidden]``."""
        _, q = self.query(x, table)
        keys = torch.cat([window_kv.to(x.dtype), self.key_value(x, table)], dim=1)
        o = sink_attention(q, keys, visible, self.attn_sink, self.softmax_scale).to(q.dtype)
        return self.output(o, table)


class V41Stage(V41Block):
    """``mtp.S``: a :class:`V41Block` at layer index ``num_hidden_layers + S`` (its ``compress_ratios`` entry, 0)
    with the drafter's experts and :class:`StageAttention`; parameters named as the checkpoint's below ``mtp.S.``."""

    def __init__(self, cfg: V41Config, stage: int, dtype: torch.dtype = torch.float32):
        super().__init__(cfg, cfg.num_hidden_layers + stage, dtype=dtype, block=draft_block(stage),
                         attention=StageAttention)
        self.stage = stage

    def forward(self, streams: torch.Tensor, pre: torch.Tensor | None, window_kv: torch.Tensor,
                visible: torch.Tensor, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention then MoE through their lagged hyper-connections (``_forward_hc_pre_from_prev``): ``(streams,
        pre)`` after the stage; ``streams [M, G, hc, hidden]``."""
        streams, pre = self.hyper("attn", streams, pre,
                                  lambda x: self.attn.block_attention(x, window_kv, visible, table))
        return self.hyper("ffn", streams, pre, self.ffn)

    def rope(self, length: int, device: torch.device) -> torch.Tensor:
        """The stage's rotations of positions ``0 .. length - 1`` (``rope_theta``, no YaRN)."""
        return self.attn.rope(length, device)


class DSparkEntry(nn.Module):
    """Stage 0's projection of the target features (``project_target_hidden``): ``main_norm(main_proj(f))``."""

    def __init__(self, cfg: V41Config, dtype: torch.dtype = torch.float32):
        super().__init__()
        hidden = cfg.hidden_size
        self.main_proj = nn.Linear(hidden * dspark_of(cfg).stages, hidden, bias=False, dtype=dtype)
        self.main_norm = RMSNorm(hidden, cfg.math.rms_norm_eps, dtype)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.main_norm(self.main_proj(features.to(self.main_proj.weight.dtype)))


class MarkovHead(nn.Module):
    """``DSparkV4MarkovHead``: ``markov_w1`` (the release's ``markov_head.embed`` ``[vocab, rank]``) and
    ``markov_w2`` (``markov_head.head`` ``[vocab, rank]``, BF16)."""

    def __init__(self, vocab: int, rank: int, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab, rank, dtype=dtype)
        self.markov_w2 = nn.Linear(rank, vocab, bias=False, dtype=MARKOV_W2_DTYPE)

    def forward(self, prev: torch.Tensor) -> torch.Tensor:
        """The float32 bias ``markov_w2(markov_w1(prev))`` (:func:`~dsv4convert.model.dspark_rules.project_bias`)."""
        return project_bias(self.markov_w1(prev), self.markov_w2.weight)


class ConfidenceHead(nn.Module):
    """``DSparkConfidenceHead``: ``proj`` ``[1, hidden + rank]``, no bias, float32."""

    def __init__(self, hidden: int, rank: int):
        super().__init__()
        self.proj = nn.Linear(hidden + rank, 1, bias=False, dtype=CONFIDENCE_DTYPE)


class DSparkHead(nn.Module):
    """The last stage's end: ``norm`` (base logits through the target's ``lm_head``), the Markov head and the
    confidence head."""

    def __init__(self, cfg: V41Config, dtype: torch.dtype = torch.float32):
        super().__init__()
        rank = dspark_of(cfg).markov_rank
        self.norm = RMSNorm(cfg.hidden_size, cfg.math.rms_norm_eps, dtype)
        self.markov_head = MarkovHead(cfg.vocab_size, rank, dtype)
        self.confidence_head = ConfidenceHead(cfg.hidden_size, rank)

    def settle_precision(self) -> "DSparkHead":
        """``markov_w2`` in BF16 and the confidence head in float32, as SGLang holds them whatever the weights
        were loaded in."""
        for linear, dtype in ((self.markov_head.markov_w2, MARKOV_W2_DTYPE), (self.confidence_head.proj,
                                                                               CONFIDENCE_DTYPE)):
            linear.weight = nn.Parameter(linear.weight.detach().to(dtype), requires_grad=linear.weight.requires_grad)
        return self

    def base(self, streams: torch.Tensor, pre: torch.Tensor, lm_head: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """(base logits float32 ``[..., vocab]``, ``x_post_hc [..., hidden]``) from the last stage's streams and
        ``pre`` (``mhc_combine``, ``norm``, ``project_through_lm_head``: the rows in the head's dtype)."""
        x_post_hc = collapse(streams, pre)
        return F.linear(self.norm(x_post_hc).to(lm_head.dtype), lm_head).float(), x_post_hc

    def markov_bias(self, prev: torch.Tensor) -> torch.Tensor:
        return self.markov_head(prev)

    def markov_logits(self, base_logits: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """Each row's Markov-corrected float32 logits given the token before it (``prev [M, G]``)."""
        return base_logits.float() + self.markov_bias(prev)

    def draft(self, base_logits: torch.Tensor, anchor_tokens: torch.Tensor, *, keep_logits: bool = True
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Greedy Markov drafting (:func:`~dsv4convert.model.dspark_rules.markov_draft`)."""
        return markov_draft(base_logits, anchor_tokens, self.markov_bias, keep_logits=keep_logits)

    def confidence_of(self, x_post_hc: torch.Tensor, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(``sigmoid(raw)``, raw) per row on ``[x_post_hc, markov_w1(prev)]``."""
        return confidence(self.confidence_head.proj, x_post_hc, self.markov_head.markov_w1(prev))

    def probe_confidence(self, x_post_hc: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """The raw confidence ``[M, G]`` on detached inputs (``x_post_hc``, ``markov_w1(prev)``): what training fits
        the head with, as a probe of the drafter's state (``organism/dspark.py``)."""
        proj = self.confidence_head.proj
        features = confidence_features(x_post_hc, self.markov_head.markov_w1(prev), proj.weight.dtype)
        return proj(features.detach()).squeeze(-1)


# -- running the stages ---------------------------------------------------------------------------


def context_kv(stage: V41Stage, main_x: torch.Tensor) -> torch.Tensor:
    """A stage's context rows ``[B, S, head_dim]`` for positions ``0 .. S - 1``: ``rope(kv_norm(wkv(main_x)))``
    (``commit_kv_proj``, then ``store_commit_kv``'s norm and RoPE)."""
    return stage.attn.key_value(main_x, stage.rope(main_x.shape[1], main_x.device))


def run_stage(stage: V41Stage, streams: torch.Tensor, pre: torch.Tensor | None, kv: torch.Tensor, blocks: Blocks,
              *, chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One stage over every block: ``streams [M, G, hc, hidden]`` and ``pre [M, G, hc]`` (None before stage 0), on
    any device -> the stage's ``(streams, pre)`` on ``kv``'s device; ``kv`` is this stage's :func:`context_kv` of
    the sequences the blocks index. ``chunk`` bounds the blocks per forward."""
    device = kv.device
    table = stage.rope(int(blocks.positions.max()) + 1 if len(blocks) else 1, device)
    outs, pres = [], []
    for rows in blocks.chunks(chunk):
        part = blocks.select(rows)
        window = kv[part.seq[:, None], part.context]                             # [m, W, D]
        hidden = streams[rows].to(device, non_blocking=True)
        given = None if pre is None else pre[rows].to(device, non_blocking=True)
        out, out_pre = stage(hidden, given, window, part.visible(), table[part.positions])
        outs.append(out)
        pres.append(out_pre)
    return (torch.cat(outs), torch.cat(pres)) if len(outs) != 1 else (outs[0], pres[0])


def finish(head: DSparkHead, streams: torch.Tensor, pre: torch.Tensor, blocks: Blocks, lm_head: torch.Tensor, *,
           teacher_prev: torch.Tensor | None = None, keep_draft_logits: bool = True) -> DraftOutput:
    """The head on the last stage's ``(streams, pre)``: base logits, greedy Markov drafts, confidence; with
    ``teacher_prev [M, G]`` the logits conditioned on it too."""
    base, x_post_hc = head.base(streams, pre, lm_head)
    tokens, prev, logits = head.draft(base, blocks.input_ids[:, 0], keep_logits=keep_draft_logits)
    sure, raw = head.confidence_of(x_post_hc, prev)
    teacher = head.markov_logits(base, teacher_prev) if teacher_prev is not None else None
    return DraftOutput(base, x_post_hc, tokens, prev, logits, sure, raw, teacher)


# -- weights --------------------------------------------------------------------------------------


def _paths(module: nn.Module) -> dict[int, str]:
    return {id(p): name for name, p in module.named_parameters()}


def stage_names(stage: V41Stage) -> dict[str, str]:
    """Release name -> parameter path of every tensor of ``mtp.S`` (a linear's ``.weight`` stands for however the
    checkpoint stores it)."""
    return {f"{draft_block(stage.stage)}.{name}": name for name, _ in stage.named_parameters()}


def entry_names(entry: DSparkEntry, names: DSparkNames) -> dict[str, str]:
    path = _paths(entry)
    return {f"{names.entry_proj}.weight": path[id(entry.main_proj.weight)],
            f"{names.entry_norm}.weight": path[id(entry.main_norm.weight)]}


def head_names(head: DSparkHead, names: DSparkNames) -> dict[str, str]:
    path = _paths(head)
    return {f"{names.norm}.weight": path[id(head.norm.weight)],
            f"{names.markov_embed}.weight": path[id(head.markov_head.markov_w1.weight)],
            f"{names.markov_head}.weight": path[id(head.markov_head.markov_w2.weight)],
            f"{names.confidence}.weight": path[id(head.confidence_head.proj.weight)]}


def load_entry(source: WeightSource) -> DSparkEntry:
    with torch.device("meta"):
        entry = DSparkEntry(source.cfg, source.dtype)
    return load(entry.eval(), source, entry_names(entry, DSparkNames(dspark_of(source.cfg).stages)))


def load_stage(source: WeightSource, stage: int) -> V41Stage:
    """``mtp.S`` with the checkpoint's weights on ``source.device``, decoded from whatever format stores them."""
    with torch.device("meta"):
        block = V41Stage(source.cfg, stage, source.dtype)
    return load(block.eval(), source, stage_names(block))


def load_head(source: WeightSource) -> DSparkHead:
    with torch.device("meta"):
        head = DSparkHead(source.cfg, source.dtype)
    head = load(head.eval(), source, head_names(head, DSparkNames(dspark_of(source.cfg).stages)))
    return head.settle_precision()


def shared_vocab(source: WeightSource) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's ``(embed [V, H], lm_head [V, H])`` the drafter shares (``attach_shared_modules``)."""
    cfg = source.cfg
    return source.tensor("embed.weight"), source.linear("head", (cfg.vocab_size, cfg.hidden_size))


# -- the drafter ----------------------------------------------------------------------------------


class V41Drafter(nn.Module):
    """The whole drafter resident: ``entry`` (:class:`DSparkEntry`), ``stages`` (:class:`V41Stage`), ``head``
    (:class:`DSparkHead`). The target's embedding and ``lm_head`` are passed to :meth:`forward`, never owned."""

    def __init__(self, cfg: V41Config, dtype: torch.dtype = torch.float32, *, entry: DSparkEntry | None = None,
                 stages: Sequence[V41Stage] | None = None, head: DSparkHead | None = None):
        super().__init__()
        self.cfg, self.d = cfg, dspark_of(cfg)
        # each block's context rows: SGLang's SWA_WINDOW (128, the release's sliding_window), here the config's
        self.window = cfg.sliding_window
        self.entry = entry if entry is not None else DSparkEntry(cfg, dtype)
        self.stages = nn.ModuleList(stages if stages is not None else
                                    [V41Stage(cfg, s, dtype) for s in range(self.d.stages)])
        self.head = head if head is not None else DSparkHead(cfg, dtype)

    @classmethod
    def from_source(cls, source: WeightSource) -> "V41Drafter":
        """The drafter of any V4.1 checkpoint (the release or a conversion), on ``source.device``."""
        stages = [load_stage(source, s) for s in range(dspark_of(source.cfg).stages)]
        return cls(source.cfg, source.dtype, entry=load_entry(source), stages=stages, head=load_head(source)).eval()

    def forward(self, features: torch.Tensor, blocks: Blocks, embed: torch.Tensor, lm_head: torch.Tensor, *,
                teacher_prev: torch.Tensor | None = None, keep_draft_logits: bool = True,
                chunk: int | None = None) -> DraftOutput:
        """Every block at once. ``features [B, S, hidden * stages]`` (:func:`features_of` of the sequences
        ``blocks`` index), ``embed``/``lm_head`` the target's ``[V, hidden]``."""
        main_x = self.entry(features)
        streams, pre = embed_blocks(blocks, embed, self.cfg.hc_mult), None
        for stage in self.stages:
            streams, pre = run_stage(stage, streams, pre, context_kv(stage, main_x), blocks, chunk=chunk)
        return finish(self.head, streams, pre, blocks, lm_head, teacher_prev=teacher_prev,
                      keep_draft_logits=keep_draft_logits)

    def native_paths(self) -> dict[str, str]:
        """Release name -> this module's parameter path, for every ``mtp.*`` tensor (the names off
        ``DSparkNames`` and ``draft_block``, the paths off the modules)."""
        names, path = DSparkNames(self.d.stages), _paths(self)
        out = {}
        for stage in self.stages:
            out.update({native: path[id(stage.get_parameter(p))] for native, p in stage_names(stage).items()})
        for part, named in ((self.entry, entry_names(self.entry, names)), (self.head, head_names(self.head, names))):
            out.update({native: path[id(part.get_parameter(p))] for native, p in named.items()})
        return out


def stream_draft(source: WeightSource, features: torch.Tensor, blocks: Blocks, *, chunk: int | None = None,
                 keep_draft_logits: bool = True) -> DraftOutput:
    """:meth:`V41Drafter.forward` with one stage's weights resident at a time, read from ``source``."""
    embed, lm_head = shared_vocab(source)
    main_x = load_entry(source)(features.to(source.device))
    streams, pre = embed_blocks(blocks, embed, source.cfg.hc_mult), None
    for s in range(dspark_of(source.cfg).stages):
        stage = load_stage(source, s)
        streams, pre = run_stage(stage, streams, pre, context_kv(stage, main_x), blocks, chunk=chunk)
        del stage   # freed before the next stage loads
    return finish(load_head(source), streams, pre, blocks, lm_head, keep_draft_logits=keep_draft_logits)
