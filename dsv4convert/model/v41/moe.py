"""DeepSeek-V4.1's MoE: the router, the routed experts and the shared expert, restated from SGLang 0.5.23.

SGLang builds V4.1's MoE as V4's (``models/deepseek_v4.py::DeepseekV4DecoderLayerBase.__init__`` ->
``models/deepseek_v2.py::DeepseekV2MoE`` with ``is_deepseek_v4=True``): ungrouped ``noaux_tc`` top-k over
``sqrtsoftplus`` scores (``topk_kwargs.update(use_grouped_topk=False, sqrtsoftplus_log1p=is_dsv41)``), the
correction bias ``gate.bias`` for the choice only, the chosen scores renormalized when ``norm_topk_prob`` and
scaled by ``routed_scaling_factor``, SwiGLU experts with the ``swiglu_limit`` clamp, one shared expert added
unweighted. The parameters keep the checkpoint's names below ``layers.N.ffn.``: ``gate.weight``, ``gate.bias``,
``gate.bias_vl``, ``experts.E.w1.weight`` ..., ``shared_experts.w2.weight``.

Against transformers' V4 (``models/deepseek_v4/modeling_deepseek_v4.py``: ``DeepseekV4TopKRouter``,
``DeepseekV4Experts``, ``DeepseekV4MLP``, ``DeepseekV4SparseMoeBlock``) the score-routed math is the same: the
same scoring, choice, ``+ 1e-20`` renormalization, clamp and shared-expert sum. V4.1 differs in what it drops and
adds: no hash-routed layers (no ``num_hash_layers``/``tid2eid``: every layer is score-routed), no expert groups
(no ``n_group``/``topk_group``), and a second correction bias ``gate.bias_vl`` that replaces ``gate.bias`` for
image tokens only. SGLang's V4.1 routing also evaluates softplus "through log1p with NaNs ranked first"
(``sqrtsoftplus_log1p``); torch's ``F.softplus`` is that formula (``x`` above 20, else ``log1p(exp(x))``), and
``torch.topk`` already ranks NaN first, so the flag changes nothing in torch.

``gate.bias_vl``: ``multimodal/dsv41/vl_routing.py::vision_topk`` (used whenever the vision tower is built, as it
is for the release) picks ``bias_vl`` where ``input_ids == image_token_id`` and ``bias`` elsewhere, so a text
token's routing never reads it; :class:`Router` takes an optional image-token mask to restate the rest.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dsv4convert.model.precision import compute_dtype

RENORMALIZE_EPSILON = 1e-20   # sglang/srt/layers/moe/topk.py::_RENORMALIZE_SUM_EPSILON (transformers: 1e-20 too)


def sqrtsoftplus(logits: torch.Tensor) -> torch.Tensor:
    """``sqrt(softplus(x))``: SGLang's ``scoring_func == "sqrtsoftplus"`` (``layers/moe/topk.py::
    biased_topk_impl``, ``vl_routing.py::vision_topk``: ``F.softplus(logits.float()).sqrt()``)."""
    return F.softplus(logits).sqrt()


def route(logits: torch.Tensor, bias: torch.Tensor, top_k: int, *, renormalize: bool,
          routed_scaling_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, expert indices) ``[T, top_k]`` of ``noaux_tc`` routing: the top ``top_k`` of ``scores + bias``
    (``bias`` ``[E]`` or per token ``[T, E]``), weighted by their bias-free scores, renormalized to sum 1 (``+ 1e-20``)
    when ``renormalize``, times ``routed_scaling_factor``. Restates ``layers/moe/topk.py::biased_topk_impl`` and the
    non-CUDA branch of ``multimodal/dsv41/vl_routing.py::vision_topk`` with ``apply_routed_scaling_factor_on_output``
    (SGLang applies the factor here or after the experts, by runner; the product is the same). Computed in
    ``compute_dtype(logits.dtype)``; the indices are int64, in the order ``torch.topk`` gives."""
    dtype = compute_dtype(logits.dtype)
    scores = sqrtsoftplus(logits.to(dtype))
    indices = (scores + bias.to(dtype)).topk(top_k, dim=-1).indices
    weights = scores.gather(-1, indices)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + RENORMALIZE_EPSILON)
    return weights * routed_scaling_factor, indices


def swiglu(gate_up: torch.Tensor, limit: float | None) -> torch.Tensor:
    """``silu(min(gate, limit)) * clamp(up, -limit, limit)`` of ``gate_up = [gate | up]`` (the last axis, gate
    first), as SGLang clamps V4's and V4.1's experts and shared expert
    (``layers/moe/fused_moe_triton/fused_marlin_moe.py::swiglu_limit_func``'s torch path; the CUDA kernels
    ``silu_and_mul_clamp``, ``silu_and_mul_clamp_hip.py::_silu_and_mul_clamp_kernel`` clamp the same way; a
    ``limit`` of None or 0 clamps nothing, as there)."""
    gate, up = gate_up.chunk(2, dim=-1)
    if limit:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up


class Expert(nn.Module):
    """One SwiGLU expert, ``w2(swiglu([w1 x | w3 x]))`` (``DeepseekV2MLP.forward``); the shared expert is one too."""

    def __init__(self, hidden_size: int, intermediate_size: int, swiglu_limit: float | None,
                 dtype: torch.dtype | None = None):
        super().__init__()
        self.w1 = nn.Linear(hidden_size, intermediate_size, bias=False, dtype=dtype)
        self.w2 = nn.Linear(intermediate_size, hidden_size, bias=False, dtype=dtype)
        self.w3 = nn.Linear(hidden_size, intermediate_size, bias=False, dtype=dtype)
        self.swiglu_limit = swiglu_limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(swiglu(torch.cat([self.w1(x), self.w3(x)], dim=-1), self.swiglu_limit))


class Router(nn.Module):
    """``ffn.gate``: the logits ``x @ weight.T`` in ``compute_dtype`` (SGLang's ``MoEGate.forward`` takes BF16
    inputs to float32 logits), then :func:`route` with ``bias`` (``e_score_correction_bias``), or ``bias_vl`` for
    the tokens ``image_mask`` marks (``vision_topk``)."""

    def __init__(self, hidden_size: int, n_experts: int, top_k: int, *, renormalize: bool,
                 routed_scaling_factor: float, dtype: torch.dtype | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_experts, hidden_size, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(n_experts, dtype=torch.float32))
        self.bias_vl = nn.Parameter(torch.zeros(n_experts, dtype=torch.float32))
        nn.init.normal_(self.weight, std=hidden_size ** -0.5)
        self.top_k, self.renormalize, self.routed_scaling_factor = top_k, renormalize, routed_scaling_factor

    def forward(self, x: torch.Tensor, image_mask: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, indices) ``[T, top_k]`` for ``x`` ``[T, hidden]``; ``image_mask`` ``[T]`` bool."""
        dtype = compute_dtype(x.dtype)
        logits = F.linear(x.to(dtype), self.weight.to(dtype))
        bias = self.bias if image_mask is None else torch.where(image_mask[:, None], self.bias_vl, self.bias)
        return route(logits, bias, self.top_k, renormalize=self.renormalize,
                     routed_scaling_factor=self.routed_scaling_factor)


class MoE(nn.Module):
    """``layers.N.ffn``: ``shared(x) + sum_k weight_k * expert_k(x)`` over the routed top-k
    (``DeepseekV2MoE.forward_normal``: routed output times ``routed_scaling_factor`` plus the shared output).
    Experts run in the weights' dtype; the weighted sum accumulates in ``x``'s (transformers'
    ``DeepseekV4Experts.forward``)."""

    def __init__(self, hidden_size: int, intermediate_size: int, n_experts: int, top_k: int, n_shared_experts: int,
                 *, swiglu_limit: float | None, renormalize: bool, routed_scaling_factor: float,
                 dtype: torch.dtype | None = None):
        super().__init__()
        self.gate = Router(hidden_size, n_experts, top_k, renormalize=renormalize,
                           routed_scaling_factor=routed_scaling_factor, dtype=dtype)
        self.experts = nn.ModuleList(Expert(hidden_size, intermediate_size, swiglu_limit, dtype)
                                     for _ in range(n_experts))
        # SGLang: one shared MLP of moe_intermediate_size * n_shared_experts (DeepseekV2MoE.__init__)
        self.shared_experts = Expert(hidden_size, intermediate_size * n_shared_experts, swiglu_limit, dtype)

    def forward(self, x: torch.Tensor, image_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` ``[..., hidden]`` -> the same shape; ``image_mask`` ``[...]`` marks image tokens (``bias_vl``)."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, indices = self.gate(flat, None if image_mask is None else image_mask.reshape(-1))
        routed = torch.zeros_like(flat)
        for e in indices.unique().tolist():
            token, slot = torch.where(indices == e)
            out = self.experts[e](flat[token]) * weights[token, slot, None]
            routed = routed.index_add(0, token, out.to(routed.dtype))
        return (routed + self.shared_experts(flat)).reshape(shape)
