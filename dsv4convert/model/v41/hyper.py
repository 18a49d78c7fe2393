"""DeepSeek-V4.1's manifold-constrained hyper-connections (mHC) in their lagged form, restated from SGLang 0.5.23.

The residual is ``R [..., hc_mult, hidden]``: the embedding broadcast to ``hc_mult`` equal streams at the start
(``DeepseekV4Model._forward_impl``: ``hc_broadcast``). Each sublayer k (attention, then MoE, in every layer) owns
one hyper-connection (``hc_attn_*``/``attn_norm`` or ``hc_ffn_*``/``ffn_norm``) and runs, as
``models/deepseek_v4_platform_stage.py::NonCudaDSparkMixin._forward_hc_pre_from_prev`` and
``NonCudaDecoderMixin.forward_hc_pre_from_prev`` do:

1. ``x_k = norm_k(sum_j pre_{k-1}[j] * R_k[j])``, or ``norm_k(R_k[0])`` for the model's first sublayer, which has
   no ``pre`` yet (``models/deepseek_v4_mhc.py::_combine``);
2. ``y_k = sublayer_k(x_k)``;
3. ``(pre_k, post_k, comb_k) = mix_k(R_k)``: this sublayer's ``fn``/``scale``/``base`` on its own input streams
   (``_mix_stats_impl``, ``kernels/ops/layernorm/mhc.py::hc_split_sinkhorn``);
4. ``R_{k+1}[i] = post_k[i] * y_k + sum_j comb_k[j][i] * R_k[j]`` (``deepseek_v4_mhc.py::post``); ``pre_k`` goes to
   sublayer k+1.

So the pre-mix that collapses sublayer k's input is the one sublayer k-1 predicted from *its* input streams with
*its* weights (``hc_pre_from_prev_sublayer=True``, the class default SGLang's V4.1 config sets,
``configs/deepseek_v41.py``); an Engram layer rewrites ``R`` between layers and keeps ``pre``
(``HcState.with_residual``). V4.1 has no ``hc_head_*``: the model's end collapses the final streams with the last
sublayer's ``pre`` (``DeepseekV4Model._forward_impl``: ``mhc_combine(pre_hc_head, last_pre)``), then ``norm``.

Against transformers' V4 (``DeepseekV4HyperConnection`` in ``DeepseekV4DecoderLayer``, and ``HyperConnection`` in
``dsv4convert/model/precision.py``): the mix is the same numbers (RMS-normalized flattened streams times ``fn``,
``sigmoid + eps`` pre, ``2 * sigmoid`` post, softmax + ``eps`` then column/row Sinkhorn for ``iters`` in all, the
same ``comb[j][i]`` orientation: transformers' ``comb^T @ R``); SGLang multiplies the unnormalized product by
``rsqrt(mean(x^2) + eps)`` where transformers normalizes first, equal up to rounding. The differences are V4.1's:
V4 collapses sublayer k with the ``pre`` computed from ``R_k`` by sublayer k's own weights, and ends with a
hyper-head (``hc_head_fn/base/scale``: its own sigmoid pre-mix); V4.1 lags ``pre`` by one sublayer, starts from
stream 0, and ends with the last ``pre``. The products run in ``precision.compute_dtype`` (float32 for BF16 and
float32 layers, as SGLang; float64 for a float64 layer).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from dsv4convert.model.precision import compute_dtype

POST_MULT = 2.0   # models/deepseek_v4_mhc.py::MHC_POST_MULT_VALUE


class RMSNorm(nn.Module):
    """SGLang's ``layers/layernorm.py::RMSNorm.forward_native``: ``(x * rsqrt(mean(x^2) + eps) * weight)`` in
    ``compute_dtype``, returned in ``x``'s dtype."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(compute_dtype(x.dtype))
        h = h * torch.rsqrt(h.square().mean(-1, keepdim=True) + self.eps)
        return (h * self.weight.to(h.dtype)).to(x.dtype)


def broadcast(x: torch.Tensor, hc_mult: int) -> torch.Tensor:
    """``[..., hidden]`` -> ``[..., hc_mult, hidden]``, every stream ``x``: the first residual
    (``kernels/ops/layernorm/mhc.py::hc_broadcast``)."""
    return x.unsqueeze(-2).expand(*x.shape[:-1], hc_mult, x.shape[-1]).contiguous()


def collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """``sum_j pre[j] * R[j]`` in ``compute_dtype``, returned in the streams' dtype
    (``kernels/ops/layernorm/mhc.py::mhc_combine``: each element widened to float32)."""
    dtype = compute_dtype(streams.dtype)
    return (pre.to(dtype).unsqueeze(-1) * streams.to(dtype)).sum(dim=-2).to(streams.dtype)


def split_sinkhorn(mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc_mult: int, iters: int,
                   eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``mixes [..., (2 + hc) * hc]`` -> ``pre [..., hc]``, ``post [..., hc]``, ``comb [..., hc, hc]``
    (``kernels/ops/layernorm/mhc.py::hc_split_sinkhorn``, its torch twin ``_mhc_pre_torch``): ``pre =
    sigmoid(m * scale0 + b) + eps``, ``post = 2 sigmoid(m * scale1 + b)``, ``comb`` a row softmax + ``eps``,
    divided by its column sums, then ``iters - 1`` row/column rounds (``+ eps`` in each divisor)."""
    hc = hc_mult
    pre_m, post_m, comb_m = mixes.split([hc, hc, hc * hc], dim=-1)
    pre_b, post_b, comb_b = base.to(mixes.dtype).split([hc, hc, hc * hc])
    scale = scale.to(mixes.dtype)
    pre = torch.sigmoid(pre_m * scale[0] + pre_b) + eps
    post = POST_MULT * torch.sigmoid(post_m * scale[1] + post_b)
    comb = (comb_m * scale[2] + comb_b).unflatten(-1, (hc, hc)).softmax(-1) + eps
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return pre, post, comb


class HyperConnection(nn.Module):
    """One sublayer's hyper-connection: ``fn [(2 + hc) * hc, hc * hidden]``, ``base``, ``scale [3]`` (float32, the
    checkpoint's ``hc_attn_*``/``hc_ffn_*``) and the sublayer's input ``norm`` (``attn_norm``/``ffn_norm``), as
    SGLang's ``deepseek_v4_mhc.py::HcSubLayer`` holds them."""

    def __init__(self, hidden_size: int, hc_mult: int, *, sinkhorn_iters: int, hc_eps: float, rms_eps: float,
                 dtype: torch.dtype | None = None):
        super().__init__()
        mix = (2 + hc_mult) * hc_mult
        self.fn = nn.Parameter(torch.empty(mix, hc_mult * hidden_size, dtype=torch.float32))
        self.base = nn.Parameter(torch.zeros(mix, dtype=torch.float32))
        self.scale = nn.Parameter(torch.ones(3, dtype=torch.float32))
        nn.init.normal_(self.fn, std=(hc_mult * hidden_size) ** -0.5)
        self.norm = RMSNorm(hidden_size, rms_eps, dtype)
        self.hc_mult, self.sinkhorn_iters, self.hc_eps, self.rms_eps = hc_mult, sinkhorn_iters, hc_eps, rms_eps

    def mix(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(pre, post, comb) from ``streams [..., hc, hidden]``: ``(x @ fn.T) * rsqrt(mean(x^2) + rms_eps)`` of the
        flattened streams, split by :func:`split_sinkhorn` (``deepseek_v4_mhc.py::_mix_stats_impl``, torch branch)."""
        dtype = compute_dtype(streams.dtype)
        flat = streams.flatten(-2).to(dtype)
        rsqrt = torch.rsqrt(flat.square().mean(-1, keepdim=True) + self.rms_eps)
        mixes = F.linear(flat, self.fn.to(dtype)) * rsqrt
        return split_sinkhorn(mixes, self.scale, self.base, self.hc_mult, self.sinkhorn_iters, self.hc_eps)

    def combine(self, streams: torch.Tensor, pre: torch.Tensor | None) -> torch.Tensor:
        """The sublayer's input: ``norm(collapse(R, pre))``, ``norm(R[0])`` without a ``pre``
        (``deepseek_v4_mhc.py::_combine``)."""
        return self.norm(streams[..., 0, :] if pre is None else collapse(streams, pre))

    @staticmethod
    def post(y: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """``R'[i] = post[i] * y + sum_j comb[j][i] * R[j]`` in ``compute_dtype``, returned in ``y``'s dtype
        (``deepseek_v4_mhc.py::post``'s ``post_torch_impl``)."""
        dtype = compute_dtype(y.dtype)
        out = post.to(dtype).unsqueeze(-1) * y.to(dtype).unsqueeze(-2) + (
            comb.to(dtype).unsqueeze(-1) * streams.to(dtype).unsqueeze(-2)).sum(dim=-3)
        return out.to(y.dtype)

    def forward(self, streams: torch.Tensor, pre: torch.Tensor | None,
                sublayer: Callable[[torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """One lagged sublayer (the module docstring's steps 1-4): the next streams and this sublayer's ``pre``,
        which collapses the next sublayer's input."""
        y = sublayer(self.combine(streams, pre))
        pre_next, post, comb = self.mix(streams)
        return self.post(y, streams, post, comb), pre_next
