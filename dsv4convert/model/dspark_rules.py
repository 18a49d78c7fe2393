"""The DSpark rules every release shares, as SGLang 0.5.23 runs them (``python/sglang/srt/``).

DeepSeek-V4-Flash-0731's drafter (``model/dspark.py``) and V4.1's (``model/v41/dspark.py``) differ in their stages'
layers, their hyper-connection collapse and their Markov head's precision; what they draft around is one code path
in SGLang (``speculative/dspark_components/``, ``kernels/ops/speculative/dspark/``, ``models/dspark.py``), so it
lives here once:

* **target features**: the mean over the ``hc_mult`` streams at each target layer (:func:`stream_mean`,
  ``kernels/ops/layernorm/mhc.py::mhc_stream_mean``), concatenated in ascending layer order
  (``layers/aux_hidden_states.py::AuxHiddenStatePacker.slot``);
* **the blocks** (:class:`Blocks`): ``gamma`` query rows ``[anchor, noise, ...]`` at positions ``p .. p + gamma - 1``
  (``dspark_draft.py::DraftBlockProposer._run_forward``, ``dspark_planner.py``), each seeing the ``window`` context
  rows before ``p`` and every row of its block (``kernels/ops/speculative/dspark/dspark_attn_metadata.py::
  compute_dspark_window_gather``, ``build_dspark_swa_page_indices``); :func:`anchor_grid` lays anchors out;
* **the first stage's input** (:func:`embed_blocks`) and what a drafter gives (:class:`DraftOutput`);
* **the Markov head's precision** (:data:`MARKOV_W2_DTYPE`, :func:`project_bias`: ``models/deepseek_v4_dspark.py::
  DSparkV4MarkovHead``, one class for both releases) and the confidence head's (:data:`CONFIDENCE_DTYPE`);
* **greedy Markov drafting** (:func:`markov_draft`, ``dspark_draft.py::draft_markov_block``, ``_draft_step``);
* **the confidence head** (:func:`confidence_features`, :func:`confidence`: ``models/dspark.py::DSparkConfidenceHead.predict``);
* **greedy acceptance** (:func:`acceptance`).

Each release's docstring says how its own pieces feed these.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dsv4convert.errors import DSV4Error


# ``DSparkV4MarkovHead.__init__``: ``markov_w2`` in BF16 (``SGLANG_DSPARK_OPT_MARKOV_W2_BF16``, EnvBool(True) in
# ``environ.py``), whatever the checkpoint stores; ``DSparkConfidenceHead(dtype=torch.float32)``.
MARKOV_W2_DTYPE = torch.bfloat16
CONFIDENCE_DTYPE = torch.float32


def project_bias(latent: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The float32 Markov bias ``markov_w2(latent)`` as ``DSparkV4MarkovHead.project_bias`` computes it: the product in
    BF16 when ``markov_w2`` is held in BF16 (as served), else in float32 (a drafter in training, with float32 master
    weights)."""
    if weight.dtype == torch.bfloat16:
        return F.linear(latent.to(weight.dtype), weight).float()
    return F.linear(latent.float(), weight.float())


def stream_mean(streams: torch.Tensor) -> torch.Tensor:
    """``[..., hc_mult, hidden] -> [..., hidden]``: SGLang's ``kernels/ops/layernorm/mhc.py::mhc_stream_mean``
    (bitwise ``x.mean(dim=1)`` of its ``[tokens, hc, hidden]``)."""
    return streams.mean(dim=-2)


def target_features(captured: Iterable[torch.Tensor]) -> torch.Tensor:
    """The drafter's input from the target layers' streams ``[B, S, hc, H]`` (in ascending layer order): each
    averaged over its streams, concatenated: ``[B, S, H * T]``."""
    return torch.cat([stream_mean(s) for s in captured], dim=-1)


@dataclass
class Blocks:
    """Draft blocks over a batch of sequences ``ids [B, S]``: block ``m`` anchors at position ``anchor[m]`` of
    row ``seq[m]``; its rows are ``[ids[seq, anchor], noise, ...]`` at positions ``anchor .. anchor + gamma - 1``;
    it attends to the context rows ``anchor - window .. anchor - 1`` (``context``; ``context_valid`` False
    before position 0) and to every row of its block (``block_causal``: row ``j`` to rows ``0..j`` only, not
    what SGLang runs; V4's cross-check against transformers' causal layer uses it)."""

    seq: torch.Tensor              # [M]
    anchor: torch.Tensor           # [M]
    input_ids: torch.Tensor        # [M, G]
    positions: torch.Tensor        # [M, G]
    context: torch.Tensor          # [M, W] context positions, clamped to >= 0
    context_valid: torch.Tensor    # [M, W]
    block_causal: bool = False

    @classmethod
    def make(cls, ids: torch.Tensor, anchors: torch.Tensor, *, block_size: int, noise_token_id: int,
             window: int, block_causal: bool = False) -> "Blocks":
        """``anchors``: ``[M, 2]`` (batch row, anchor position), each position in ``0 .. S - 1``."""
        anchors = anchors.to(torch.int64).reshape(-1, 2)
        seq, anchor = anchors[:, 0].to(ids.device), anchors[:, 1].to(ids.device)
        if anchor.numel() and (int(anchor.min()) < 0 or int(anchor.max()) >= ids.shape[1]):
            raise DSV4Error(f"anchor positions must lie in 0..{ids.shape[1] - 1}")
        steps = torch.arange(block_size, device=ids.device)
        input_ids = torch.full((seq.numel(), block_size), noise_token_id, dtype=torch.int64, device=ids.device)
        input_ids[:, 0] = ids[seq, anchor]
        context = anchor[:, None] - window + torch.arange(window, device=ids.device)
        return cls(seq, anchor, input_ids, anchor[:, None] + steps, context.clamp(min=0), context >= 0,
                   block_causal)

    def __len__(self) -> int:
        return self.seq.numel()

    @property
    def block_size(self) -> int:
        return self.input_ids.shape[1]

    @property
    def window(self) -> int:
        return self.context.shape[1]

    def select(self, rows: slice | torch.Tensor) -> "Blocks":
        return Blocks(self.seq[rows], self.anchor[rows], self.input_ids[rows], self.positions[rows],
                      self.context[rows], self.context_valid[rows], self.block_causal)

    def chunks(self, chunk: int | None) -> Iterable[slice]:
        step = self.seq.numel() if not chunk else chunk
        return (slice(i, min(i + step, self.seq.numel())) for i in range(0, self.seq.numel(), max(1, step)))

    def visible(self) -> torch.Tensor:
        """``[M, G, W + G]`` bool: which keys each block row sees, ordered the context window, then the block."""
        m, g = self.input_ids.shape
        visible = torch.ones((m, g, self.window + g), dtype=torch.bool, device=self.seq.device)
        visible[:, :, : self.window] = self.context_valid[:, None, :]
        if self.block_causal:
            visible[:, :, self.window:] = torch.ones(g, g, dtype=torch.bool, device=self.seq.device).tril()
        return visible

    def mask(self, dtype: torch.dtype) -> torch.Tensor:
        """:meth:`visible` as an additive attention mask ``[M, 1, G, W + G]`` (0 visible, the dtype's minimum
        hidden), as transformers' attention takes it."""
        visible = self.visible()
        out = torch.zeros(visible.shape, dtype=dtype, device=self.seq.device)
        return out.masked_fill_(~visible, torch.finfo(dtype).min)[:, None]

    def gather(self, per_position: torch.Tensor, offset: int = 0, fill: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
        """``per_position [B, S]`` at each block row's position ``+ offset``: ``([M, G], valid [M, G])``; rows past
        the sequence get ``fill``. With ``offset=1`` on the ids: the tokens each row predicts (the labels); on the
        target's top-1 with ``offset=0``: the greedy tokens verification compares the drafts with."""
        where = self.positions + offset
        valid = where < per_position.shape[1]
        got = per_position[self.seq[:, None], where.clamp(max=per_position.shape[1] - 1)]
        return got.masked_fill(~valid, fill), valid


def anchor_grid(batch: int, seq_len: int, *, first: int = 0, last: int | None = None, stride: int = 1,
                device: torch.device | str = "cpu") -> torch.Tensor:
    """Every ``stride``-th anchor from ``first`` to ``last`` (default ``seq_len - 1``) in every row: ``[M, 2]``."""
    last = seq_len - 1 if last is None else min(last, seq_len - 1)
    positions = torch.arange(first, last + 1, stride, device=device)
    rows = torch.arange(batch, device=device)
    return torch.stack(torch.meshgrid(rows, positions, indexing="ij"), dim=-1).reshape(-1, 2)


def embed_blocks(blocks: Blocks, embed: torch.Tensor, hc_mult: int) -> torch.Tensor:
    """The first stage's input streams ``[M, G, hc, H]``: the target's embedding of ``[anchor, noise, ...]``,
    repeated over the streams (``models/deepseek_v4_dspark.py::DeepseekV4ForCausalLMDSpark.forward_embed``)."""
    x = F.embedding(blocks.input_ids, embed)
    return x.unsqueeze(2).expand(-1, -1, hc_mult, -1).contiguous()


def markov_draft(base_logits: torch.Tensor, anchor_tokens: torch.Tensor,
                 markov_bias: Callable[[torch.Tensor], torch.Tensor], *, keep_logits: bool = True
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Greedy Markov drafting, sequential over the block (``dspark_draft.py::draft_markov_block``: each step's
    logits ``base_j + markov_bias(prev)``, ``prev`` the anchor, then the previous draft; ``_draft_step`` adds in
    float32 whatever precision the release's bias has): (draft tokens ``[M, G]``, the token each row was
    conditioned on ``[M, G]``, the float32 step logits ``[M, G, V]`` or None)."""
    prev = anchor_tokens.to(torch.int64)
    tokens, prevs, logits = [], [], []
    for j in range(base_logits.shape[1]):
        step = base_logits[:, j].float() + markov_bias(prev).float()
        prevs.append(prev)
        prev = step.argmax(-1)
        tokens.append(prev)
        if keep_logits:
            logits.append(step)
    return (torch.stack(tokens, 1), torch.stack(prevs, 1),
            torch.stack(logits, 1) if keep_logits else None)


def confidence_features(x_post_hc: torch.Tensor, prev_embedding: torch.Tensor | None, dtype: torch.dtype
                        ) -> torch.Tensor:
    """What the confidence head reads (``models/dspark.py::DSparkConfidenceHead.forward``): ``[x_post_hc,
    prev_embedding]`` (the Markov head's ``markov_w1`` of each row's previous token; ``x_post_hc`` alone without
    ``confidence_head_with_markov``), in the head's ``dtype``."""
    features = x_post_hc
    if prev_embedding is not None:
        features = torch.cat([x_post_hc, prev_embedding.to(x_post_hc.dtype)], dim=-1)
    return features.to(dtype)


def confidence(proj: nn.Linear, x_post_hc: torch.Tensor, prev_embedding: torch.Tensor | None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(``sigmoid(raw)``, raw) per row (``DSparkConfidenceHead.predict``): ``raw = proj(`` :func:`confidence_features`
    ``)``; the STS temperature is 1 uncalibrated (``apply_sts``)."""
    raw = proj(confidence_features(x_post_hc, prev_embedding, proj.weight.dtype)).squeeze(-1)
    return torch.sigmoid(raw.float()), raw


@dataclass
class DraftOutput:
    """What a drafter gives for ``M`` blocks of ``G`` rows (row ``j`` predicts the token at ``anchor + j + 1``)."""

    base_logits: torch.Tensor                 # [M, G, V] float32
    x_post_hc: torch.Tensor                   # [M, G, H] what the confidence head reads beside markov_w1(prev)
    draft_tokens: torch.Tensor                # [M, G] the greedy Markov drafts
    draft_prev: torch.Tensor                  # [M, G] what each row was conditioned on (anchor, drafts)
    draft_logits: torch.Tensor | None         # [M, G, V] base + Markov(previous draft)
    confidence: torch.Tensor                  # [M, G] sigmoid
    confidence_raw: torch.Tensor
    teacher_logits: torch.Tensor | None = None  # [M, G, V] base + Markov(previous true token)


@dataclass
class Acceptance:
    """Greedy verification of drafts against the target's greedy tokens, per draft position ``j`` (0-based):
    ``agreement[j]`` how often draft ``j`` equals the target's greedy token there, ``accepted[j]`` how often it
    is accepted (it and every draft before it equal), ``expected_accept_length`` the mean accepted prefix
    (drafts only: the bonus token is not counted), over ``blocks`` blocks whose every row is scored."""

    agreement: list[float]
    accepted: list[float]
    expected_accept_length: float
    blocks: int

    def as_dict(self) -> dict:
        return {"agreement": self.agreement, "accepted": self.accepted,
                "expected_accept_length": self.expected_accept_length, "blocks": self.blocks}


def acceptance(drafts: torch.Tensor, greedy: torch.Tensor, valid: torch.Tensor | None = None) -> Acceptance:
    """``drafts``, ``greedy`` ``[M, G]``; only blocks whose rows are all ``valid`` count."""
    if valid is not None:
        keep = valid.all(-1)
        drafts, greedy = drafts[keep], greedy[keep]
    if drafts.shape[0] == 0:
        nan = float("nan")
        return Acceptance([nan] * drafts.shape[1], [nan] * drafts.shape[1], nan, 0)
    equal = (drafts == greedy).double()
    accepted = equal.cumprod(-1)
    return Acceptance(equal.mean(0).tolist(), accepted.mean(0).tolist(), float(accepted.sum(-1).mean()),
                      int(drafts.shape[0]))
