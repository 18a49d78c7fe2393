"""The three places transformers' DeepSeek-V4 computes in float32 whatever the layer's dtype, run at the layer's
precision when that is higher.

transformers (``models/deepseek_v4/modeling_deepseek_v4.py``) casts to float32 in the hyper-connections'
mixing projection (``DeepseekV4HyperConnection.forward``, ``DeepseekV4HyperHead.forward``: ``F.linear(x.float(),
fn.float())``) and in the indexer's scores (``DeepseekV4IndexerScorer.forward``: ``matmul(q.float(), k.float())``).
For BF16 and float32 layers that is the math SGLang runs too (its mHC and indexer score in float32). In a float64
layer it puts a float32 matrix product inside a float64 computation, and a float32 product's row is not a function
of that row alone: MKL's sgemm computes the rows past the last multiple of four (the tail) with another kernel and
another summation order, and which rows are the tail depends on how many rows the call has and how the threads
split them. Measured on a 2-core AMD EPYC (Zen 5, AVX-512, torch 2.14.1 with MKL 2024.2): ``F.linear`` of the same
row in a 5-row and a 14-row float32 call differs by 2.7e-5 with 2 threads and not at all with 1; a DSpark stage's
float64 output moved by 5.0e-6 (tests/test_dspark.py). A 16-core Intel Xeon showed no difference at 1-16 threads.

So every model this package builds computes those three products in ``promote_types(dtype, float32)``: exactly
transformers' operations for BF16, FP16 and float32 layers (the same bytes: ``.to(float32)`` of a float32 tensor
is the tensor), and float64 throughout for a float64 layer, where a row's result then moves with the batch shape
and the threads only by float64 rounding (about 1e-14 relative). :func:`at_layer_precision` switches a module
tree's instances over; the model's builders (``blocks.build_layer``, ``trainable``, ``dspark``) call it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
    DeepseekV4HyperConnection,
    DeepseekV4HyperHead,
    DeepseekV4IndexerScorer,
)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for BF16, FP16 and float32 inputs (transformers' own), float64 for float64."""
    return torch.promote_types(dtype, torch.float32)


class HyperConnection(DeepseekV4HyperConnection):
    """``DeepseekV4HyperConnection.forward`` with ``.float()`` read as :func:`compute_dtype`."""

    def forward(self, hidden_streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        batch_size, seq_len = hidden_streams.shape[:2]
        hc, dtype = self.hc_mult, compute_dtype(hidden_streams.dtype)
        flattened = self.input_norm(hidden_streams.view(batch_size, seq_len, -1).to(dtype))
        flattened = F.linear(flattened, self.fn.to(dtype))
        pre_w, post_w, comb_w = flattened.split([hc, hc, hc * hc], dim=-1)
        pre_b, post_b, comb_b = self.base.split([hc, hc, hc * hc])
        pre_scale, post_scale, comb_scale = self.scale.unbind(0)
        comb_w = comb_w.view(*comb_w.shape[:-1], hc, hc)
        pre = torch.sigmoid(pre_w * pre_scale + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * post_scale + post_b)
        comb = torch.softmax(comb_w * comb_scale + comb_b.view(hc, hc), dim=-1) + self.hc_eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        for _ in range(self.hc_sinkhorn_iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        collapsed = (pre.unsqueeze(-1) * hidden_streams).sum(dim=2).to(hidden_streams.dtype)
        return post, comb, collapsed


class HyperHead(DeepseekV4HyperHead):
    """``DeepseekV4HyperHead.forward`` with ``.float()`` read as :func:`compute_dtype`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = compute_dtype(x.dtype)
        flat = self.input_norm(x.flatten(2).to(dtype))
        mixes = F.linear(flat, self.hc_fn.to(dtype))
        pre = torch.sigmoid(mixes * self.hc_scale.to(dtype) + self.hc_base.to(dtype)) + self.eps
        return (pre.unsqueeze(-1) * x).sum(dim=2).to(x.dtype)


class IndexerScorer(DeepseekV4IndexerScorer):
    """``DeepseekV4IndexerScorer.forward`` with ``.float()`` read as :func:`compute_dtype`."""

    def forward(self, q: torch.Tensor, compressed_kv: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        dtype = compute_dtype(q.dtype)
        scores = torch.matmul(q.to(dtype), compressed_kv.transpose(-1, -2).to(dtype).unsqueeze(1))
        scores = F.relu(scores) * self.softmax_scale
        weights = self.weights_proj(hidden_states).to(dtype) * self.weights_scaling
        return (scores * weights.unsqueeze(-1)).sum(dim=2)


_AT_LAYER_PRECISION = {DeepseekV4HyperConnection: HyperConnection, DeepseekV4HyperHead: HyperHead,
                       DeepseekV4IndexerScorer: IndexerScorer}


def at_layer_precision(module: nn.Module) -> nn.Module:
    """Switch every hyper-connection, hyper-head and indexer scorer under ``module`` (itself included) to the
    classes above, in place (same parameters, same state dict); returns ``module``."""
    for sub in module.modules():
        replacement = _AT_LAYER_PRECISION.get(type(sub))
        if replacement is not None:
            sub.__class__ = replacement
    return module
