"""DeepSeek-V4.1's two-level indexer (ratio-1/2 layers), restated from SGLang 0.5.23.

The fine level (``layers/attention/dsv4/dsv41_sparse.py::DeepseekV41Indexer``): an index-source layer scores
every compressed entry its query may see (entry ``j`` of ratio ``r`` covers raw tokens ``r*j .. r*j+r-1`` and is
visible to the query at position ``t`` once ``j < (t + 1) // r``: ``v41_indexer/scoring.py::prefill_requests``)
with ``sum_h relu(q_h . k_j) * w_h``: queries ``wq_b`` of the attention's normalized query latent, RoPE'd at
the query's position; keys ``k_norm(wk(latent_j))`` of the KV-source compressor's pre-RoPE latent, RoPE'd at the
entry's first token (only a KV-source layer owns ``wk``/``k_norm``; a later index layer of the same ratio reads
its source's keys); head weights ``weights_proj(x) * index_head_dim^-0.5 * index_n_heads^-0.5``. Queries and keys
are FP4 round-trips (per-32 UE8M0 scales, ``_rope_fq4``) as SGLang stores and scores them. It keeps the top
``index_topk`` (``v41_indexer/full_topk.py::FullTopKIndexer._torch_prefill``).

The candidate level (``v41_indexer/dense_blocks.py::DenseBlocksBackend``): the candidate-source layer
(``candidate_source_layer_id``) also publishes, per query row, the ``candidate_topk_blocks`` blocks of
``candidate_block_size`` compressed entries with the largest block maximum, the query's last visible block always
kept (``kernels/ops/attention/dsv4/candidate_blocks.py::select_candidate_block_ids``); every index layer after it
(``uses_candidates``) takes its top ``index_topk`` among those blocks only (``topk_among_blocks``). Index layers
before it take the full top-k. SGLang does not check that a consumer's ratio is the candidate source's (in the
release both are 1); neither does this.

Against DeepSeek's V4 indexer (transformers' ``DeepseekV4Indexer``): V4's owns a compressor of its own at ratio 4
and rotates queries and keys with a Hadamard transform; V4.1's reads the attention compressor's latent, has no
Hadamard, and adds the candidate level.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from dsv4convert.model.precision import compute_dtype
from dsv4convert.model.v41.hyper import RMSNorm
from dsv4convert.models.deepseek_v41.config import V41Config

FP4_MAX = 6.0               # kernels/ops/quantization/fp4_fake_quant.py
FP8_MAX = 448.0
FP4_BLOCK = 32              # the indexer's per-32 UE8M0 scales
FP4_AMAX_FLOOR = 6 * 2.0 ** -126
KV_FP4_BLOCK = 16           # the compressed KV's per-16 E4M3 scales

# Rotates the last qk_rope_head_dim features of [..., T, (heads,) d] at the T rows' positions.
RopeFn = Callable[[torch.Tensor], torch.Tensor]


def _round_fp4(x: torch.Tensor) -> torch.Tensor:
    """``fp4_fake_quant.py::round_fp4``: the E2M1 grid, round half to even."""
    magnitude = x.abs()
    step = torch.where(magnitude < 2.0, 0.5, torch.where(magnitude < 4.0, 1.0, 2.0))
    return torch.round(magnitude / step) * step * torch.sign(x)


def _straight_through(x: torch.Tensor, rounded: torch.Tensor) -> torch.Tensor:
    """``rounded``'s values with ``x``'s gradient, so a model with the round trips stays trainable."""
    return x + (rounded - x).detach()


def fake_quant_fp4(x: torch.Tensor) -> torch.Tensor:
    """``fp4_fake_quant.py::fake_quant_fp4``: per 32 values a power-of-two scale ``2^ceil(log2(amax / 6))``
    (amax floored at ``6 * 2^-126``), E2M1 codes, back in ``x``'s dtype. ``ceil_pow2`` there reads the float32 bits;
    ``torch.frexp`` gives the same power of two."""
    blocks = x.float().unflatten(-1, (-1, FP4_BLOCK))
    amax = blocks.abs().amax(dim=-1, keepdim=True).clamp_min(FP4_AMAX_FLOOR) * (1.0 / FP4_MAX)
    mantissa, exponent = torch.frexp(amax)
    scale = torch.ldexp(torch.ones_like(amax), exponent - (mantissa == 0.5).to(exponent.dtype))
    deq = _round_fp4((blocks / scale).clamp(-FP4_MAX, FP4_MAX)) * scale
    return _straight_through(x, deq.flatten(-2).to(x.dtype))


def fake_quant_compressed_kv(x: torch.Tensor) -> torch.Tensor:
    """``fp4_fake_quant.py::fake_quant_compressed_kv``: per 16 values an E4M3 scale ``amax / 6`` (clamped to
    ``[2^-9, 448]``), E2M1 codes, back in ``x``'s dtype."""
    blocks = x.float().unflatten(-1, (-1, KV_FP4_BLOCK))
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    scale = (amax * (1.0 / FP4_MAX)).clamp(min=2 ** -9, max=FP8_MAX).to(torch.float8_e4m3fn).float()
    deq = _round_fp4((blocks / scale).clamp(-FP4_MAX, FP4_MAX)) * scale
    return _straight_through(x, deq.flatten(-2).to(x.dtype))


def visible_entries(positions: torch.Tensor, ratio: int) -> torch.Tensor:
    """How many compressed entries each query position sees: ``(t + 1) // ratio`` (``scoring.py::prefill_requests``:
    "a compressed position is visible once the query has passed its last token")."""
    return (positions + 1) // ratio


def causal_scores(scores: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """``scores [..., T, C]`` with ``-inf`` past each row's visible length ``lens [..., T]``
    (``scoring.py::_score_chunks``)."""
    columns = torch.arange(scores.shape[-1], device=scores.device)
    return scores.masked_fill(columns >= lens.unsqueeze(-1), -torch.inf)


def full_topk(scores: torch.Tensor, lens: torch.Tensor, topk: int) -> torch.Tensor:
    """The fine level without candidates (``full_topk.py::FullTopKIndexer._torch_prefill`` with
    ``scoring.py::write_prefill``): per row the ``min(topk, C)`` best of its visible entries, ascending, ``-1``
    where it sees fewer. ``scores`` are already :func:`causal_scores`. int64 ``[..., T, min(topk, C)]``."""
    k = min(topk, scores.shape[-1])
    idx = scores.topk(k, dim=-1, sorted=False).indices.sort(dim=-1).values
    return idx.masked_fill(idx >= lens.unsqueeze(-1), -1)


def candidate_blocks(scores: torch.Tensor, lens: torch.Tensor, topk_blocks: int, block_size: int) -> torch.Tensor:
    """The candidate level (``candidate_blocks.py::select_candidate_block_ids``): per row the ``topk_blocks`` blocks
    of ``block_size`` entries with the largest maximum score, the block of the last visible entry always kept;
    int64 ``[..., T, min(topk_blocks, blocks)]``, ascending, ``-1`` past the visible blocks."""
    padding = -scores.shape[-1] % block_size
    padded = F.pad(scores, (0, padding), value=-torch.inf) if padding else scores
    best = padded.unflatten(-1, (-1, block_size)).amax(dim=-1)
    last = (lens - 1).div(block_size, rounding_mode="floor")
    best = best.masked_fill(torch.arange(best.shape[-1], device=scores.device) == last.unsqueeze(-1), torch.inf)
    top = best.topk(min(topk_blocks, best.shape[-1]), dim=-1)
    ids = top.indices.masked_fill(~(top.values > -torch.inf), best.shape[-1])
    ids = ids.sort(dim=-1).values
    return ids.masked_fill(ids == best.shape[-1], -1)


def topk_among_blocks(scores: torch.Tensor, lens: torch.Tensor, blocks: torch.Tensor, topk: int,
                      block_size: int) -> torch.Tensor:
    """The fine level of a candidate consumer (``candidate_blocks.py::topk_among_blocks`` as
    ``dense_blocks.py::DenseBlocksBackend._torch_consume_prefill`` writes it): per row the ``min(topk, C)`` best
    visible entries inside its ``blocks`` (``-1`` padded), ascending, ``-1`` where fewer are finite."""
    k = min(topk, scores.shape[-1])
    padding = -scores.shape[-1] % block_size
    padded = F.pad(scores, (0, padding), value=-torch.inf) if padding else scores
    by_block = padded.unflatten(-1, (-1, block_size))
    ids = blocks.clamp(0, by_block.shape[-2] - 1)
    picked = by_block.gather(-2, ids.unsqueeze(-1).expand(*ids.shape, block_size))
    room = lens.unsqueeze(-1) - blocks * block_size
    drop = (torch.arange(block_size, device=scores.device) >= room.unsqueeze(-1)) | (blocks < 0).unsqueeze(-1)
    flat = picked.masked_fill(drop, -torch.inf).flatten(-2)
    top = flat.topk(min(k, flat.shape[-1]), dim=-1, sorted=False)
    block = top.indices.div(block_size, rounding_mode="floor")
    entry = blocks.gather(-1, block) * block_size + top.indices - block * block_size
    entry = entry.masked_fill(top.values == -torch.inf, scores.shape[-1]).sort(dim=-1).values
    entry = entry.masked_fill(entry == scores.shape[-1], -1)
    return F.pad(entry, (0, k - entry.shape[-1]), value=-1) if entry.shape[-1] < k else entry


class Indexer(nn.Module):
    """A layer's indexer, parameters as the checkpoint's ``attn.indexer.*`` (``models/deepseek_v41/inventory.py``):
    on an index-source layer the query side, ``wq_b.weight`` ``[index_n_heads * index_head_dim, q_lora_rank]`` and
    ``weights_proj.weight`` ``[index_n_heads, hidden]``; on a KV-source layer the key side, ``wk.weight``
    ``[index_head_dim, head_dim]`` and ``k_norm.weight`` ``[index_head_dim]`` (SGLang builds the indexer on index
    sources only, ``owns_k`` there; the release's KV sources are all index sources)."""

    def __init__(self, config: V41Config, layer_id: int, *, fake_quant: bool = True,
                 dtype: torch.dtype | None = None):
        super().__init__()
        self.n_heads = config.index_n_heads
        self.head_dim = config.index_head_dim
        self.rope_dim = config.math.qk_rope_head_dim
        self.topk = config.index_topk
        self.fake_quant = fake_quant
        self.owns_keys = layer_id in config.kv_source_layer_ids
        self.is_index_source = layer_id in config.index_source_layer_ids
        self.is_candidate_source = layer_id == config.candidate_source_layer_id
        self.uses_candidates = 0 <= config.candidate_source_layer_id < layer_id
        self.candidate_topk_blocks = config.candidate_topk_blocks
        self.candidate_block_size = config.candidate_block_size
        if self.is_index_source:
            self.wq_b = nn.Linear(config.q_lora_rank, self.n_heads * self.head_dim, bias=False, dtype=dtype)
            self.weights_proj = nn.Linear(config.hidden_size, self.n_heads, bias=False, dtype=dtype)
        if self.owns_keys:
            self.wk = nn.Linear(config.head_dim, self.head_dim, bias=False, dtype=dtype)
            self.k_norm = RMSNorm(self.head_dim, config.math.rms_norm_eps, dtype=dtype)

    def _fq4(self, x: torch.Tensor) -> torch.Tensor:
        return fake_quant_fp4(x) if self.fake_quant else x

    def keys(self, latent: torch.Tensor, rope: RopeFn) -> torch.Tensor:
        """``DeepseekV41Indexer.index_keys``: ``fq4(rope(k_norm(wk(latent))))``, ``latent [..., C, head_dim]`` the
        compressor's pre-RoPE output; ``rope`` rotates the last ``qk_rope_head_dim`` features at each entry's
        position."""
        return self._fq4(rope(self.k_norm(self.wk(latent))))

    def queries(self, q_latent: torch.Tensor, rope: RopeFn) -> torch.Tensor:
        """``DeepseekV41Indexer.queries``: ``fq4(rope(wq_b(q_latent)))`` per head, ``[..., T, heads, index_head_dim]``;
        ``q_latent`` is the attention's ``q_norm(wq_a(x))``."""
        q = self.wq_b(q_latent).unflatten(-1, (self.n_heads, self.head_dim))
        return self._fq4(rope(q))

    def head_weights(self, x: torch.Tensor) -> torch.Tensor:
        """``DeepseekV41Indexer.head_weights``: ``weights_proj(x) * index_head_dim^-0.5 * index_n_heads^-0.5``."""
        return self.weights_proj(x) * (self.head_dim ** -0.5 * self.n_heads ** -0.5)

    @staticmethod
    def scores(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``DeepseekV41Indexer.scores``: ``sum_h relu(q_h . k) * w_h``, ``q [..., T, H, d]``, ``k [..., C, d]``,
        ``weights [..., T, H]`` -> ``[..., T, C]`` in ``compute_dtype`` (SGLang: the product in q's dtype, then
        float32)."""
        s = torch.einsum("...thd,...nd->...thn", q, k)
        return (s.relu() * weights.unsqueeze(-1)).sum(dim=-2).to(compute_dtype(q.dtype))
