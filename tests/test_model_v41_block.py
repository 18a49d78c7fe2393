"""DeepSeek-V4.1's MoE, hyper-connections and block loader (``dsv4convert/model/v41/``) against SGLang 0.5.23's code.

What runs SGLang's own code on the CPU: the routing (``layers/moe/topk.py::fused_topk_torch_native``, and
``multimodal/dsv41/vl_routing.py::vision_topk``'s non-CUDA branch, the path the release's model takes since its
vision tower is built; its EPLB/recorder epilogue ``_finish_vision_topk`` is replaced by identity, nothing of the
routing itself), the clamp (``fused_marlin_moe.py::swiglu_limit_func``'s torch path), the mix
(``deepseek_v4_mhc.py::mix_stats`` with ``hc_split_sinkhorn``'s Triton port, ``_hc_split_sinkhorn_triton``, in the
Triton interpreter, since the TileLang kernel needs a GPU; and ``kernels/ops/layernorm/mhc.py::_mhc_pre_torch``),
the combine (``deepseek_v4_mhc.py::combine``, its ``mhc_combine`` Triton kernel interpreted), the post
(``_mhc_post_torch``) and the lagged order itself (``deepseek_v4_platform_stage.py::NonCudaDSparkMixin.
_forward_hc_pre_from_prev`` with stand-in sublayers and ``hc_post`` as ``_mhc_post_torch``: ``deepseek_v4_mhc.post``
asks for a published parallel config, which a CPU process has not). Not run: the CUDA router ``moe_fused_gate``
(its Triton kernel fails in the interpreter), so V4.1's routing is also checked by its properties.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

from dsv4convert.checkpoint import Checkpoint
from dsv4convert.formats import Format, dequantize_fp8_block, dequantize_mxfp4, spec
from dsv4convert.model.v41 import hyper, moe
from dsv4convert.model.v41.weights import HYPER_PATHS, WeightSource, load_parts, v41_config

pytest.importorskip("sglang_oracle")   # imports SGLang as its CPU oracle does (torchvision without ops)


@pytest.fixture(scope="module")
def sglang_mhc():
    from sglang.kernels.ops.layernorm import mhc as kernels
    from sglang.srt.models import deepseek_v4_mhc

    return deepseek_v4_mhc, kernels


def _logits(tokens: int, experts: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, experts, generator=g) * 4, torch.randn(experts, generator=g) * 0.3


def _by_expert(weights: torch.Tensor, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    order = indices.argsort(dim=-1)
    return weights.gather(-1, order), indices.long().gather(-1, order)


def test_routing_equals_sglangs_torch_router():
    from sglang.srt.layers.moe.topk import fused_topk_torch_native

    logits, bias = _logits(64, 48, 0)
    weights, indices = moe.route(logits, bias, 6, renormalize=True, routed_scaling_factor=1.5)
    ref_w, ref_i = fused_topk_torch_native(logits, logits, 6, True, correction_bias=bias, scoring_func="sqrtsoftplus")
    ours, theirs = _by_expert(weights, indices), _by_expert(ref_w * 1.5, ref_i)
    assert torch.equal(ours[1], theirs[1])
    torch.testing.assert_close(ours[0], theirs[0], rtol=1e-6, atol=0)
    # the bias chooses but does not weigh: the weights are the chosen experts' own scores, renormalized
    scores = moe.sqrtsoftplus(logits).gather(-1, indices)
    torch.testing.assert_close(weights, 1.5 * scores / scores.sum(-1, keepdim=True))
    assert not torch.equal(indices.sort().values, logits.topk(6).indices.sort().values)


def test_vision_routing_equals_sglangs_v41_router():
    from sglang.srt.layers.moe.topk import TopKConfig
    from sglang.srt.multimodal.dsv41 import vl_routing

    logits, bias = _logits(40, 32, 1)
    bias_vl = torch.randn(32, generator=torch.Generator().manual_seed(2))
    image_id = 7
    ids = torch.arange(40) % 9
    fake = SimpleNamespace(
        topk=SimpleNamespace(routing_inputs=lambda: (None, None),
                             topk_config=TopKConfig(top_k=6, renormalize=True, routed_scaling_factor=1.5,
                                                    apply_routed_scaling_factor_on_output=True)),
        gate=SimpleNamespace(e_score_correction_bias=bias, e_score_correction_bias_vl=bias_vl),
        config=SimpleNamespace(image_token_id=image_id), layer_id=0)
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(vl_routing, "_finish_vision_topk", lambda m, l, w, i, *a, **k: (w, i)))
        stack.enter_context(mock.patch.object(vl_routing, "get_moe_a2a_backend",
                                              lambda: SimpleNamespace(is_megamoe=lambda: False)))
        ref_w, ref_i = vl_routing.vision_topk(fake, logits, ids)[:2]   # StandardTopKOutput(weights, ids, logits)
    bias_rows = torch.where((ids == image_id)[:, None], bias_vl, bias)
    ours = _by_expert(*moe.route(logits, bias_rows, 6, renormalize=True, routed_scaling_factor=1.5))
    theirs = _by_expert(ref_w, ref_i)
    assert torch.equal(ours[1], theirs[1])
    torch.testing.assert_close(ours[0], theirs[0], rtol=1e-6, atol=0)
    # text tokens never read bias_vl
    text = ids != image_id
    plain = _by_expert(*moe.route(logits[text], bias, 6, renormalize=True, routed_scaling_factor=1.5))
    assert torch.equal(plain[1], ours[1][text])


def test_swiglu_clamp_equals_sglangs():
    from sglang.srt.layers.moe.fused_moe_triton.fused_marlin_moe import swiglu_limit_func

    gate_up = torch.randn(9, 64, generator=torch.Generator().manual_seed(3)) * 20
    ref = torch.empty(9, 32)
    swiglu_limit_func(ref, gate_up, 10.0)
    ours = moe.swiglu(gate_up, 10.0)
    torch.testing.assert_close(ours, ref, rtol=0, atol=0)
    assert (gate_up.abs() > 10).any() and not torch.equal(ours, moe.swiglu(gate_up, None))


def test_moe_is_the_weighted_experts_plus_the_shared_one():
    torch.manual_seed(4)
    layer = moe.MoE(32, 16, 6, 2, 1, swiglu_limit=10.0, renormalize=True, routed_scaling_factor=1.5)
    x = torch.randn(2, 5, 32, requires_grad=True)
    out = layer(x)
    flat = x.reshape(-1, 32)
    weights, indices = layer.gate(flat)
    want = layer.shared_experts(flat).clone()
    for t in range(flat.shape[0]):
        for w, e in zip(weights[t], indices[t].tolist()):
            want[t] += w * layer.experts[e](flat[t:t + 1])[0]
    torch.testing.assert_close(out.reshape(-1, 32), want)
    out.sum().backward()
    assert x.grad is not None and layer.experts[indices[0, 0]].w1.weight.grad is not None


def _hc(hidden: int, seed: int) -> hyper.HyperConnection:
    torch.manual_seed(seed)
    hc = hyper.HyperConnection(hidden, 4, sinkhorn_iters=20, hc_eps=1e-6, rms_eps=1e-20)
    hc.base.data.normal_()
    hc.scale.data.uniform_(0.5, 2)
    hc.norm.weight.data.normal_()
    return hc


def _sglang_sublayer(mhc, hc: hyper.HyperConnection):
    from sglang.srt.layers.layernorm import RMSNorm

    norm = RMSNorm(hc.norm.weight.shape[0], eps=hc.rms_eps)
    norm.weight.data = hc.norm.weight.data.clone()
    cfg = mhc.HcConfig(mult=4, sinkhorn_iters=hc.sinkhorn_iters, eps=hc.hc_eps, rms_eps=hc.rms_eps,
                       hidden=norm.weight.shape[0], pre_from_prev=True, cp_prefill=False)
    return mhc.HcSubLayer(cfg, hc.fn.data, hc.scale.data, hc.base.data, norm)


def test_mix_combine_post_equal_sglangs(sglang_mhc):
    mhc, kernels = sglang_mhc
    hc = _hc(64, 5)
    streams = torch.randn(7, 4, 64)
    pre, post, comb = hc.mix(streams)
    with mock.patch.object(kernels, "hc_split_sinkhorn", kernels._hc_split_sinkhorn_triton):
        ref = mhc.mix_stats(_sglang_sublayer(mhc, hc), streams)
    for ours, theirs in zip((pre, post, comb), ref):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    post_t, comb_t, collapsed = kernels._mhc_pre_torch(streams, hc.fn.data, hc.scale.data, hc.base.data, 1e-20, 1e-6,
                                                       1e-6, 2.0, 20)
    torch.testing.assert_close(post, post_t.squeeze(-1))
    torch.testing.assert_close(comb, comb_t)
    torch.testing.assert_close(hyper.collapse(streams, pre), collapsed)
    # comb is doubly stochastic
    torch.testing.assert_close(comb.sum(-2), torch.ones(7, 4), atol=1e-5, rtol=0)
    torch.testing.assert_close(comb.sum(-1), torch.ones(7, 4), atol=1e-3, rtol=0)

    sub = _sglang_sublayer(mhc, hc)
    torch.testing.assert_close(hc.combine(streams, pre), mhc.combine(sub, mhc.HcState(streams, pre)))
    torch.testing.assert_close(hc.combine(streams, None), mhc.combine(sub, mhc.HcState(streams, None)))
    y = torch.randn(7, 64)
    torch.testing.assert_close(hc.post(y, streams, post, comb),
                               kernels._mhc_post_torch(y, streams, post.unsqueeze(-1), comb))


def test_lagged_order_equals_sglangs(sglang_mhc):
    """One layer (attention, MoE) through SGLang's own lagged order, sublayers stood in by fixed maps."""
    from sglang.srt.models.deepseek_v4_platform_stage import NonCudaDSparkMixin

    mhc, kernels = sglang_mhc
    attn_hc, ffn_hc = _hc(64, 6), _hc(64, 7)
    w_attn, w_ffn = torch.randn(64, 64) / 8, torch.randn(64, 64) / 8
    attn, ffn = (lambda x: torch.tanh(x @ w_attn)), (lambda x: torch.tanh(x @ w_ffn))
    streams, prev_pre = torch.randn(5, 4, 64), torch.rand(5, 4)

    class Attention:
        def __call__(self, positions, x, batch):
            return attn(x)

        def maybe_use_decode_attn_tp(self, batch):
            return contextlib.nullcontext()

    layer = SimpleNamespace(
        attn_hc=_sglang_sublayer(mhc, attn_hc), ffn_hc=_sglang_sublayer(mhc, ffn_hc), hc_stats_stream=None,
        self_attn=Attention(), _run_ffn=lambda x, batch: ffn(x),
        hc_post=lambda x, r, p, c: kernels._mhc_post_torch(x, r, p.unsqueeze(-1), c))
    layer.hc_cfg = layer.attn_hc.cfg
    batch = SimpleNamespace(forward_mode=SimpleNamespace(is_decode=lambda: False, is_target_verify=lambda: False))
    with mock.patch.object(kernels, "hc_split_sinkhorn", kernels._hc_split_sinkhorn_triton):
        ref_streams, ref_pre = NonCudaDSparkMixin._forward_hc_pre_from_prev(layer, None, streams, batch, prev_pre)

    mid, pre = attn_hc(streams, prev_pre, attn)
    out, pre = ffn_hc(mid, pre, ffn)
    torch.testing.assert_close(out, ref_streams, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pre, ref_pre, rtol=1e-5, atol=1e-6)


def test_the_pre_mix_lags_one_sublayer():
    """Sublayer k's input is collapsed by the pre sublayer k-1 predicted: changing sublayer k's own pre weights
    changes nothing it sees, only what the next sublayer sees; the first sublayer reads stream 0."""
    attn_hc, ffn_hc = _hc(32, 8), _hc(32, 9)
    streams = hyper.broadcast(torch.randn(3, 32), 4) + torch.randn(3, 4, 32) * 0.1
    seen = []

    def sublayer(x):
        seen.append(x)
        return torch.tanh(x)

    def run():
        seen.clear()
        mid, pre = attn_hc(streams, None, sublayer)
        out, pre = ffn_hc(mid, pre, sublayer)
        return [s.clone() for s in seen], hyper.collapse(out, pre)

    (first, second), end = run()
    torch.testing.assert_close(first, attn_hc.norm(streams[:, 0]))
    with torch.no_grad():
        ffn_hc.fn[:4] += 1.0   # ffn_hc's pre rows: its own input must not move, the model's end must
    (first2, second2), end2 = run()
    assert torch.equal(first, first2) and torch.equal(second, second2) and not torch.allclose(end, end2)
    with torch.no_grad():
        attn_hc.fn[:4] += 1.0   # attn_hc's pre rows: the FFN's input moves, attention's does not
    (first3, second3), _ = run()
    assert torch.equal(first, first3) and not torch.allclose(second, second3)


def _covered(name: str, names: dict[str, str]) -> bool:
    module = name.rpartition(".")[0]
    return name in names or f"{module}.weight" in names


def _ours(name: str) -> bool:
    """A block's non-attention, non-Engram tensor."""
    parts = name.split(".", 2)
    return len(parts) == 3 and parts[2].startswith(("ffn.", "hc_", "attn_norm.", "ffn_norm."))


def test_every_block_tensor_loads_and_decodes_as_stored(tiny_v41):
    from dsv4convert.model.v41.weights import hyper_names, moe_names

    ckpt = Checkpoint.open(tiny_v41)
    source = WeightSource(ckpt, "cpu", torch.float32)
    assert source.fp8_block == (32, 32)
    blocks = sorted({".".join(n.split(".")[:2]) for n in ckpt.tensors if _ours(n)})
    assert any(b.startswith("layers.") for b in blocks) and len(blocks) == 6 + 3
    for block in blocks:
        parts = load_parts(source, block)
        names = {**moe_names(block, parts.ffn), **hyper_names(block)}
        mine = [n for n in ckpt.tensors if n.startswith(f"{block}.") and _ours(n)]
        assert all(_covered(n, names) for n in mine), block
        assert not any(p.is_meta for p in parts.parameters())
    stored = {n: ckpt.read(n) for n in ("layers.3.ffn.experts.5.w2.weight", "layers.3.ffn.experts.5.w2.scale",
                                        "layers.3.ffn.shared_experts.w1.weight", "layers.3.ffn.shared_experts.w1.scale")}
    parts = load_parts(source, "layers.3")
    assert torch.equal(parts.ffn.experts[5].w2.weight, dequantize_mxfp4(stored["layers.3.ffn.experts.5.w2.weight"],
                                                                        stored["layers.3.ffn.experts.5.w2.scale"]))
    assert torch.equal(parts.ffn.shared_experts.w1.weight,
                       dequantize_fp8_block(stored["layers.3.ffn.shared_experts.w1.weight"],
                                            stored["layers.3.ffn.shared_experts.w1.scale"], block=(32, 32)))
    for suffix, path in HYPER_PATHS.items():
        assert torch.equal(parts.get_parameter(path), ckpt.read(f"layers.3.{suffix}").float())
    assert parts.attn_hc.fn.dtype == torch.float32 and parts.ffn.gate.bias.dtype == torch.float32
    math = v41_config(ckpt.config).math
    assert (math.routed_scaling_factor, math.swiglu_limit, math.hc_sinkhorn_iters) == (1.5, 10.0, 20)
    parts = load_parts(WeightSource(ckpt, "cpu", torch.bfloat16), "layers.3")
    assert parts.ffn.experts[0].w1.weight.dtype == torch.bfloat16 and parts.ffn_hc.fn.dtype == torch.float32


@pytest.fixture(scope="module")
def converted(tiny_v41, tmp_path_factory):
    from dsv4convert.cli import main

    root = tmp_path_factory.mktemp("v41-block")
    made = {}
    for variant in ("nvfp4", "w4a16"):
        made[variant] = root / variant
        assert main(["convert", "--recipe", variant, "--src", str(tiny_v41), "--dst", str(made[variant]),
                     "--no-progress"]) == 0
    return made


def test_converted_experts_decode_as_their_source(tiny_v41, converted):
    src = Checkpoint.open(tiny_v41)

    def mxfp4(name):
        return dequantize_mxfp4(src.read(f"{name}.weight"), src.read(f"{name}.scale"))

    nvfp4 = Checkpoint.open(converted["nvfp4"])
    parts = load_parts(WeightSource(nvfp4, "cpu", torch.float32), "layers.4")
    assert "layers.4.ffn.experts.3.w1.weight_scale_2" in nvfp4.tensors
    for e in range(len(parts.ffn.experts)):   # MXFP4 -> NVFP4 keeps every value here (lossless transcode)
        for w in ("w1", "w2", "w3"):
            assert torch.equal(getattr(parts.ffn.experts[e], w).weight, mxfp4(f"layers.4.ffn.experts.{e}.{w}"))

    w4a16 = Checkpoint.open(converted["w4a16"])
    source = WeightSource(w4a16, "cpu", torch.float32)
    parts = load_parts(source, "layers.4")
    name = "layers.4.ffn.experts.2.w3"
    int4 = spec(Format.INT4).decode({p: w4a16.read(f"{name}.{p}") for p in ("weight_packed", "weight_scale",
                                                                           "weight_shape")}, name, {})
    assert torch.equal(parts.ffn.experts[2].w3.weight, int4)
    assert not torch.equal(int4, mxfp4(name))   # INT4 is lossy: the decode is the stored one, not the source's
    stage = load_parts(source, "mtp.0")   # the DSpark stages' experts: BF16, exactly the source's MXFP4 values
    assert torch.equal(stage.ffn.experts[1].w2.weight, mxfp4("mtp.0.ffn.experts.1.w2"))
