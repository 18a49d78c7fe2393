"""DeepSeek-V4.1's DSpark drafter (``dsv4convert/model/v41/dspark.py``) against SGLang 0.5.23's own code on the CPU,
and by its properties.

SGLang's code run here, with our weights copied in (``models/deepseek_v4_dspark.py`` unless said):

* ``DSparkAttention.forward`` and ``_compute_q`` (its torch RoPE ``apply_rotary_emb``, forward and inverse, the
  grouped ``wo_a`` einsum, ``wo_b``) on the frequencies ``MqaAttentionBase.__init__`` makes for a stage
  (``precompute_freqs_cis``, ratio 0). Two GPU pieces are stood in for: the pool's fused norm-RoPE store
  (``fused_k_norm_rope_flashmla``, CUDA JIT) and FlashMLA's sparse attention; the stand-ins are our
  ``kv_norm``/``rotate`` and ``sink_attention`` (each checked against SGLang in test_model_v41_attention.py);
* ``project_target_hidden`` and ``CommitKvProj.torch`` (the context KV projection), ``_dspark_stage_config`` and
  ``layers/moe/topk.py::fused_topk_torch_native`` on a stage's router;
* ``DeepseekV4ForCausalLMDSpark._forward_impl`` over the three stages, each ``deepseek_v4_platform_stage.py::
  NonCudaDSparkMixin._forward_hc_pre_from_prev`` with our attention and MoE as its sublayers, its end's
  ``mhc_combine`` (Triton, interpreted) and ``_logits_from_x_post_hc``;
* ``DSparkV4MarkovHead`` with ``speculative/dspark_components/dspark_draft.py::draft_markov_block`` (greedy) and
  ``models/dspark.py::DSparkConfidenceHead.predict``.

By properties: the stage weights' names are the release inventory's ``mtp.*`` names, each read from the tiny
checkpoint; many blocks in one forward equal one block at a time written out here without ``Blocks`` or
``run_stage``; a block sees its window of context and nothing after its anchor; the drafter streamed from the
checkpoint equals the resident one on features the target's ``capture=`` gives.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

from dsv4convert.checkpoint import Checkpoint
from dsv4convert.model.dspark_rules import Blocks, anchor_grid, embed_blocks
from dsv4convert.model.v41 import hyper
from dsv4convert.model.v41.attention import rotate, sink_attention
from dsv4convert.model.v41.dspark import (
    V41Drafter,
    V41Stage,
    context_kv,
    features_of,
    stream_draft,
)
from dsv4convert.model.v41.forward import V41Runner
from dsv4convert.model.v41.weights import WeightSource
from dsv4convert.models.deepseek_v41.config import read_config
from dsv4convert.models.deepseek_v41.inventory import stage_inventory
from dsv4convert.models.deepseek_v41.presets import TINY

import sglang_oracle  # noqa: E402,F401  SGLang imported as its CPU oracle does (torchvision without ops): missing, this fails

CFG = read_config(TINY)
D = CFG.dspark
LENGTH = 21   # > sliding_window (8) + block: the first blocks see a partial window, the later ones a full one


def _drafter(dtype=torch.float64, seed=0) -> V41Drafter:
    """tiny-v41's drafter with random weights, every part non-trivial (sinks, routing biases, Markov head)."""
    torch.manual_seed(seed)
    drafter = V41Drafter(CFG, dtype)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("_scale"):
                p.uniform_(0.5, 2.0)
            elif p.ndim == 1:
                p.normal_(0.0, 0.5)
            else:
                p.normal_(0.0, 0.08)
    return drafter.eval()


def _inputs(batch=2, length=LENGTH, seed=1, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, CFG.vocab_size - 32, (batch, length), generator=g)
    features = torch.randn(batch, length, CFG.hidden_size * D.stages, generator=g, dtype=dtype)
    vocab = torch.randn(2, CFG.vocab_size, CFG.hidden_size, generator=g, dtype=dtype) * 0.5
    return ids, features, vocab[0], vocab[1]


def _blocks(ids, first=0, **kw) -> Blocks:
    return Blocks.make(ids, anchor_grid(ids.shape[0], ids.shape[1], first=first), block_size=D.block_size,
                       noise_token_id=D.noise_token_id, window=CFG.sliding_window, **kw)


@pytest.fixture(scope="module")
def sglang_mhc():
    from sglang.kernels.ops.layernorm import mhc as kernels
    from sglang.srt.models import deepseek_v4_mhc

    with mock.patch.object(kernels, "hc_split_sinkhorn", kernels._hc_split_sinkhorn_triton):
        yield deepseek_v4_mhc, kernels


class _Linear:
    """A SGLang linear (``out, bias = linear(x)``) over one of our weights."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight

    def __call__(self, x, skip_all_reduce=False):
        return torch.nn.functional.linear(x, self.weight), None


def _sglang_freqs(stage: V41Stage, length: int) -> torch.Tensor:
    """The frequencies ``MqaAttentionBase.__init__`` gives a DSpark stage (``compress_ratio=0``,
    ``rope_original_seq_len=0``)."""
    from sglang.kernels.ops.attention.dsv4.rope import precompute_freqs_cis

    m = CFG.math
    return precompute_freqs_cis(dim=m.qk_rope_head_dim, seqlen=length, original_seq_len=0, base=m.rope_theta,
                                factor=m.rope_scaling.factor, beta_fast=m.rope_scaling.beta_fast,
                                beta_slow=m.rope_scaling.beta_slow)


def test_stage_attention_equals_sglangs_dspark_attention():
    from sglang.srt.models import deepseek_v4_dspark as dspark

    drafter = _drafter(torch.float32)
    stage, attn = drafter.stages[1], drafter.stages[1].attn
    ids, features, _, _ = _inputs(dtype=torch.float32)
    blocks = _blocks(ids, first=2)
    main_x = drafter.entry(features)
    kv = context_kv(stage, main_x)
    window = kv[blocks.seq[:, None], blocks.context]
    x = torch.randn(len(blocks), D.block_size, CFG.hidden_size)
    table = stage.rope(LENGTH + D.block_size, x.device)
    with torch.no_grad():
        ours = attn.block_attention(x, window, blocks.visible(), table[blocks.positions])

    freqs = _sglang_freqs(stage, LENGTH + D.block_size)
    torch.testing.assert_close(freqs, table, rtol=0, atol=1e-6)
    stored = {}

    def store(*, layer_id, swa_loc, kv, kv_weight, eps, freqs_cis, positions):
        """The fused norm-RoPE store (CUDA JIT), stood in by our norm and rotation with SGLang's frequencies."""
        normed = hyper.RMSNorm(kv.shape[-1], eps)
        normed.weight.data = kv_weight
        stored["kv"] = rotate(normed(kv), freqs_cis[positions], CFG.math.qk_rope_head_dim)

    def flash_mla(*, q, k, v, layer, forward_batch, compress_ratio, attn_sink, save_kv_cache):
        """FlashMLA's sparse decode (GPU), stood in by the sink attention over [window ; block]."""
        heads = attn.n_heads
        q = q[:, :heads].unflatten(0, (len(blocks), D.block_size))
        keys = torch.cat([window, stored["kv"].unflatten(0, (len(blocks), D.block_size))], dim=1)
        return sink_attention(q, keys, blocks.visible(), attn_sink, attn.softmax_scale).flatten(0, 1)

    pool = SimpleNamespace(uniform_fp8=False, set_swa_key_buffer_radix_fused_norm_rope=store)
    backend = SimpleNamespace(forward=flash_mla, get_swa_out_cache_loc=lambda batch: None)
    theirs = SimpleNamespace(
        wq_a=_Linear(attn.wq_a.weight.data), q_norm=_sglang_norm(attn.q_norm), wq_b=_Linear(attn.wq_b.weight.data),
        wkv=_Linear(attn.wkv.weight.data), kv_norm=attn.kv_norm, wo_a=attn.wo_a, wo_b=_Linear(attn.wo_b.weight.data),
        n_local_heads=attn.n_heads, head_dim=attn.head_dim, rope_head_dim=attn.rope_dim, q_head_norm=False,
        _use_fast_kernel=False, freqs_cis=freqs, n_local_groups=attn.groups, o_lora_rank=attn.o_lora_rank,
        alt_streams=None, layer_id=1, eps=CFG.math.rms_norm_eps, attn=None, attn_sink=attn.attn_sink.data,
        attn_tp_size=1, is_dsv41=True)
    for method in ("kv_proj_only", "_store_block_kv", "_compute_q", "_local_attn_sink"):
        setattr(theirs, method, getattr(dspark.DSparkAttention, method).__get__(theirs))
    batch = SimpleNamespace(forward_mode=SimpleNamespace(is_idle=lambda: False, is_decode=lambda: False,
                                                         is_target_verify=lambda: True))
    with mock.patch.object(dspark, "_resolve_dspark_pool", lambda: pool), \
            mock.patch("sglang.srt.model_executor.forward_context.get_attn_backend", lambda: backend), \
            torch.no_grad():
        out = dspark.DSparkAttention.forward(theirs, blocks.positions.flatten(), x.flatten(0, 1), batch)
    torch.testing.assert_close(ours.flatten(0, 1), out, rtol=1e-5, atol=1e-5)
    # the stand-in store received SGLang's own KV projection, and it is the block's key_value
    torch.testing.assert_close(stored["kv"], attn.key_value(x, table[blocks.positions]).flatten(0, 1).detach(),
                               rtol=1e-5, atol=1e-5)


def _sglang_norm(norm: hyper.RMSNorm):
    from sglang.srt.layers.layernorm import RMSNorm

    theirs = RMSNorm(norm.weight.shape[0], eps=norm.eps)
    theirs.weight.data = norm.weight.data.clone()
    return theirs


def test_entry_and_context_kv_equal_sglangs_projection():
    from sglang.kernels.ops.speculative.dspark.dspark_draft_model import CommitKvProj
    from sglang.srt.models.deepseek_v4_dspark import DeepseekV4ForCausalLMDSpark

    drafter = _drafter(torch.float32)
    _, features, _, _ = _inputs(dtype=torch.float32)
    flat = features.flatten(0, 1)
    entry = drafter.entry
    stage0 = SimpleNamespace(main_proj=_Linear(entry.main_proj.weight.data), main_norm=_sglang_norm(entry.main_norm))
    with torch.no_grad():
        main_x = DeepseekV4ForCausalLMDSpark.project_target_hidden(SimpleNamespace(stages=[stage0]), flat)
        torch.testing.assert_close(entry(features).flatten(0, 1), main_x, rtol=1e-5, atol=1e-5)
        kvs = CommitKvProj.torch(main_x=main_x, wkv_linears=[_Linear(s.attn.wkv.weight.data) for s in drafter.stages])
        for stage, kv in zip(drafter.stages, kvs):
            # what store_commit_kv then writes: the stage's kv_norm and RoPE at each position
            positions = torch.arange(LENGTH).repeat(features.shape[0])
            stored = rotate(stage.attn.kv_norm(kv), _sglang_freqs(stage, LENGTH)[positions], CFG.math.qk_rope_head_dim)
            torch.testing.assert_close(context_kv(stage, entry(features)).flatten(0, 1), stored, rtol=1e-5, atol=1e-5)


def test_stage_experts_and_routing_are_sglangs():
    import json
    from pathlib import Path

    from sglang.srt.layers.moe.topk import fused_topk_torch_native
    from sglang.srt.models.deepseek_v4_dspark import _dspark_stage_config

    release = json.loads((Path(__file__).parent / "data" / "deepseek-v4.1-flash-config.json").read_text())
    flat = SimpleNamespace(**release["text_config"], vision_n_layers=release["vision_config"]["num_hidden_layers"])
    theirs = _dspark_stage_config(flat)
    with torch.device("meta"):
        stage = V41Stage(read_config(release), 2)
    assert (len(stage.ffn.experts), stage.ffn.gate.top_k) == (theirs.n_routed_experts, theirs.num_experts_per_tok)
    assert (theirs.n_routed_experts, theirs.num_experts_per_tok) == (128, 3) and stage.engram is None
    assert stage.attn.ratio == 0 and stage.attn.compressor is None and stage.attn.indexer is None

    gate = _drafter().stages[0].ffn.gate
    x = torch.randn(40, CFG.hidden_size, dtype=torch.float64)
    with torch.no_grad():
        weights, indices = gate(x)
        logits = x @ gate.weight.T
        ref_w, ref_i = fused_topk_torch_native(logits, logits, D.num_experts_per_tok, True,
                                               correction_bias=gate.bias.data, scoring_func="sqrtsoftplus")
    order, ref_order = indices.argsort(-1), ref_i.long().argsort(-1)
    assert torch.equal(indices.gather(-1, order), ref_i.long().gather(-1, ref_order))
    torch.testing.assert_close(weights.gather(-1, order), (ref_w * CFG.math.routed_scaling_factor).gather(
        -1, ref_order).to(weights.dtype), rtol=1e-6, atol=1e-7)


def _sglang_sublayer(mhc, block: V41Stage, sub: str):
    """SGLang's ``HcSubLayer`` over a stage's ``hc_<sub>_*`` and ``<sub>_norm``."""
    norm = getattr(block, f"{sub}_norm")
    cfg = mhc.HcConfig(mult=CFG.hc_mult, sinkhorn_iters=CFG.math.hc_sinkhorn_iters, eps=CFG.math.hc_eps,
                       rms_eps=CFG.math.rms_norm_eps, hidden=CFG.hidden_size, pre_from_prev=True, cp_prefill=False)
    return mhc.HcSubLayer(cfg, getattr(block, f"hc_{sub}_fn").data, getattr(block, f"hc_{sub}_scale").data,
                          getattr(block, f"hc_{sub}_base").data, _sglang_norm(norm))


def test_stages_and_end_follow_sglangs_forward_impl(sglang_mhc):
    """SGLang's own draft assembly (``_forward_impl``: stages chained through ``pre``, ``mhc_combine`` at the end;
    ``_logits_from_x_post_hc``) with each stage's ``_forward_hc_pre_from_prev``, our attention and MoE inside."""
    from sglang.srt.models.deepseek_v4_dspark import DeepseekV4ForCausalLMDSpark
    from sglang.srt.models.deepseek_v4_platform_stage import NonCudaDSparkMixin

    mhc, kernels = sglang_mhc
    drafter = _drafter(torch.float32)
    ids, features, embed, lm_head = _inputs(batch=1, dtype=torch.float32)
    # a few blocks (SGLang's Sinkhorn and combine run in the Triton interpreter): a partial window, full ones
    blocks = Blocks.make(ids, anchor_grid(1, LENGTH, first=2, stride=6), block_size=D.block_size,
                         noise_token_id=D.noise_token_id, window=CFG.sliding_window)
    with torch.no_grad():
        ours = drafter(features, blocks, embed, lm_head)
        main_x = drafter.entry(features)

    class Attention:
        def __init__(self, stage):
            self.stage, self.kv = stage, context_kv(stage, main_x)

        def __call__(self, positions, x, batch):
            table = self.stage.rope(LENGTH + D.block_size, x.device)[blocks.positions]
            window = self.kv[blocks.seq[:, None], blocks.context]
            rows = x.unflatten(0, (len(blocks), D.block_size))
            return self.stage.attn.block_attention(rows, window, blocks.visible(), table).flatten(0, 1)

        def maybe_use_decode_attn_tp(self, batch):
            return contextlib.nullcontext()

    def sglang_stage(stage: V41Stage):
        layer = SimpleNamespace(attn_hc=_sglang_sublayer(mhc, stage, "attn"), ffn_hc=_sglang_sublayer(mhc, stage, "ffn"),
                                hc_stats_stream=None, self_attn=Attention(stage), _run_ffn=lambda x, batch: stage.ffn(x),
                                hc_post=lambda x, r, p, c: kernels._mhc_post_torch(x, r, p.unsqueeze(-1), c))
        layer.hc_cfg = layer.attn_hc.cfg
        return lambda positions, x, batch, pre: NonCudaDSparkMixin._forward_hc_pre_from_prev(layer, positions, x,
                                                                                               batch, pre)

    model = SimpleNamespace(stages=[sglang_stage(s) for s in drafter.stages], hc_pre_from_prev_sublayer=True,
                            hc_mult=CFG.hc_mult, _use_fp32_lm_head=False, _opt_markov_w2_tp_shard=True,
                            lm_head=SimpleNamespace(weight=lm_head, quant_method=None))
    batch = SimpleNamespace(forward_mode=SimpleNamespace(is_decode=lambda: False, is_target_verify=lambda: False,
                                                         is_idle=lambda: False))
    with torch.no_grad():
        streams = embed_blocks(blocks, embed, CFG.hc_mult).flatten(0, 1)
        x = DeepseekV4ForCausalLMDSpark._forward_impl(model, None, blocks.positions.flatten(), batch,
                                                      streams).hidden_states
        model.stages = [SimpleNamespace(norm=_sglang_norm(drafter.head.norm))]
        logits = DeepseekV4ForCausalLMDSpark._logits_from_x_post_hc(model, x)
    torch.testing.assert_close(ours.x_post_hc.flatten(0, 1), x, rtol=1e-4, atol=5e-5)
    torch.testing.assert_close(ours.base_logits.flatten(0, 1), logits.float(), rtol=1e-4, atol=1e-4)


def test_markov_drafts_and_confidence_equal_sglangs():
    from sglang.srt.models.deepseek_v4_dspark import DSparkV4MarkovHead
    from sglang.srt.models.dspark import DSparkConfidenceHead
    from sglang.srt.runtime_context import get_parallel
    from sglang.srt.speculative.dspark_components.dspark_draft import DraftNoise, draft_markov_block

    head = _drafter(torch.float32).head
    with torch.no_grad():
        head.markov_head.markov_w2.weight.mul_(20)      # a bias strong enough to move the argmax
    g = torch.Generator().manual_seed(3)
    base = torch.randn(6, D.block_size, CFG.vocab_size, generator=g)
    anchors = torch.randint(3, CFG.vocab_size, (6,), generator=g)
    x_post_hc = torch.randn(6, D.block_size, CFG.hidden_size, generator=g)
    tokens, prev, logits = head.draft(base, anchors)
    sure, raw = head.confidence_of(x_post_hc, prev)
    assert not torch.equal(tokens, base.argmax(-1))     # the Markov bias changed some drafts

    markov = DSparkV4MarkovHead(vocab_size=CFG.vocab_size, markov_rank=D.markov_rank, is_dsv41=True)
    markov.markov_w1.weight.data[: CFG.vocab_size] = head.markov_head.markov_w1.weight.data
    markov.markov_w2.weight.data = head.markov_head.markov_w2.weight.data.clone()
    assert markov.markov_w2.weight.dtype == head.markov_head.markov_w2.weight.dtype == torch.bfloat16
    sync = SimpleNamespace(sync=lambda site, t: t)
    # the embedding lookup reads the TP group only to place its output in symmetric memory
    with get_parallel().override(tp_group=None), torch.no_grad():
        theirs, their_logits = draft_markov_block(
            markov_head=markov, base_logits=base, anchor_tokens=anchors, draft_hidden=None,
            step_temperatures=torch.zeros(6), noise=DraftNoise(key=0, offset=torch.zeros((), dtype=torch.int64)),
            tp_sync=sync)
        proj = DSparkConfidenceHead(hidden_size=CFG.hidden_size, markov_rank=D.markov_rank, bias=False)
        proj.proj.weight.data = head.confidence_head.proj.weight.data.clone()
        their_sure, their_raw = proj.predict(x_post_hc.flatten(0, 1), anchor_tokens=anchors, draft_tokens=theirs,
                                             markov_head=markov)
    assert torch.equal(tokens, theirs)
    torch.testing.assert_close(logits, their_logits.float(), rtol=0, atol=1e-5)
    torch.testing.assert_close(raw, their_raw, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(sure, their_sure, rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def source(tiny_v41):
    return WeightSource(Checkpoint.open(tiny_v41), "cpu", torch.float32)


def test_stage_weights_are_the_inventorys_mtp_tensors_every_one_read(source):
    ckpt = source.ckpt
    read = []
    with mock.patch.object(ckpt, "read", side_effect=lambda name, _read=ckpt.read: read.append(name) or _read(name)):
        drafter = V41Drafter.from_source(source)
    inventory = {spec.name for s in range(D.stages) for spec in stage_inventory(source.cfg, s)}
    # a linear's .weight stands for however it is stored (weight and scale here: FP8 blocks, MXFP4 experts)
    weights = {n for n in inventory if not n.endswith(".scale")}
    assert all(n.removesuffix(".scale") + ".weight" in weights for n in inventory - weights)
    paths = drafter.native_paths()
    assert set(paths) == weights
    assert sorted(paths.values()) == sorted(name for name, _ in drafter.named_parameters())
    assert set(read) == inventory == {n for n in ckpt.tensors if n.startswith(tuple(f"mtp.{s}." for s in
                                                                                    range(D.stages)))}
    # SGLang's precisions: markov_w2 BF16 (bit for bit the checkpoint's), the confidence head float32
    w2 = drafter.head.markov_head.markov_w2.weight
    native = next(name for name, path in paths.items() if drafter.get_parameter(path) is w2)
    assert w2.dtype == torch.bfloat16 and torch.equal(w2, ckpt.read(native))
    assert drafter.head.confidence_head.proj.weight.dtype == torch.float32


def _one_block(drafter: V41Drafter, features, ids, b: int, p: int, embed, lm_head):
    """Block (row ``b``, anchor ``p``) written out: each stage's attention over exactly its context rows
    ``max(0, p - W) .. p - 1`` and the block's rows, no mask, no gather."""
    g, window = D.block_size, CFG.sliding_window
    main_x = drafter.entry(features[b:b + 1, :p])                                      # what the context can see
    row_ids = torch.full((1, g), D.noise_token_id)
    row_ids[0, 0] = ids[b, p]
    streams, pre = hyper.broadcast(torch.nn.functional.embedding(row_ids, embed), CFG.hc_mult), None
    for stage in drafter.stages:
        table = stage.rope(p + g, features.device)
        kv = context_kv(stage, main_x)[:, max(0, p - window):] if p else main_x.new_zeros(1, 0, CFG.head_dim)
        every = torch.ones(1, g, kv.shape[1] + g, dtype=torch.bool)
        streams, pre = stage(streams, pre, kv, every, table[p:p + g][None])
    base, x_post_hc = drafter.head.base(streams, pre, lm_head)
    return drafter.head.draft(base, row_ids[:, 0]), base


def test_many_blocks_at_once_equal_one_block_at_a_time():
    drafter = _drafter()
    ids, features, embed, lm_head = _inputs()
    blocks = _blocks(ids)
    with torch.no_grad():
        out = drafter(features, blocks, embed, lm_head)
        chunked = drafter(features, blocks, embed, lm_head, chunk=5)
        for m in range(len(blocks)):
            (tokens, _, _), base = _one_block(drafter, features, ids, int(blocks.seq[m]), int(blocks.anchor[m]),
                                              embed, lm_head)
            assert torch.equal(out.draft_tokens[m], tokens[0]), m
            torch.testing.assert_close(out.base_logits[m], base[0], rtol=1e-6, atol=1e-6)
    assert torch.equal(out.draft_tokens, chunked.draft_tokens)
    torch.testing.assert_close(out.base_logits, chunked.base_logits, rtol=0, atol=1e-6)


def test_a_block_sees_its_window_and_nothing_after_its_anchor():
    drafter = _drafter()
    ids, features, embed, lm_head = _inputs(batch=1)
    p, window = 15, CFG.sliding_window

    def draft(feats, token_ids=ids, block_causal=False):
        blocks = Blocks.make(token_ids, torch.tensor([[0, p]]), block_size=D.block_size,
                             noise_token_id=D.noise_token_id, window=window, block_causal=block_causal)
        with torch.no_grad():
            return drafter(feats, blocks, embed, lm_head).base_logits

    reference = draft(features)
    later, earlier, inside = features.clone(), features.clone(), features.clone()
    later[:, p:] += 1.0                       # the anchor's own feature and after: not committed context
    earlier[:, : p - window] += 1.0           # before the window
    inside[:, p - 1] += 1.0                   # the last context row
    other_ids = ids.clone()
    other_ids[:, p + 1:] = 3                  # tokens after the anchor: the block holds noise there
    for moved in (draft(later), draft(earlier), draft(features, other_ids)):
        torch.testing.assert_close(moved, reference, rtol=0, atol=0)
    assert not torch.allclose(draft(inside), reference)
    # the block's rows see each other both ways (SGLang's page indices): causal rows give row 0 other logits
    assert not torch.allclose(draft(features, block_causal=True)[:, 0], reference[:, 0])


def test_the_streamed_drafter_equals_the_resident_one_on_the_targets_captured_features(tiny_v41):
    """Float64 throughout, so that the batch shape (``chunk``) moves nothing beyond float64 rounding."""
    source = WeightSource(Checkpoint.open(tiny_v41), "cpu", torch.float64)
    runner = V41Runner(tiny_v41, "cpu", torch.float64)
    ids = torch.randint(3, CFG.vocab_size - 32, (1, 14), generator=torch.Generator().manual_seed(5))
    captured = runner.forward(ids).captured
    features = features_of(captured, source.cfg.dspark.target_layer_ids)
    assert features.shape == (1, 14, CFG.hidden_size * D.stages)
    blocks = _blocks(ids, first=1)
    streamed = stream_draft(source, features, blocks, chunk=4)
    with torch.no_grad():
        embed, lm_head = source.tensor("embed.weight"), source.linear("head", (CFG.vocab_size, CFG.hidden_size))
        resident = V41Drafter.from_source(source)(features, blocks, embed, lm_head)
    assert torch.equal(streamed.draft_tokens, resident.draft_tokens)
    torch.testing.assert_close(streamed.draft_logits, resident.draft_logits, rtol=0, atol=1e-9)
    torch.testing.assert_close(streamed.confidence_raw, resident.confidence_raw, rtol=0, atol=1e-6)
    with pytest.raises(Exception, match="did not capture layers"):
        features_of({k: v for k, v in captured.items() if k != max(captured)}, source.cfg.dspark.target_layer_ids)
