"""The DSpark draft forward (dsv4convert/model/dspark.py) against code it did not write.

* Where SGLang's draft and a plain decoder layer coincide (the block's rows causal among themselves, the
  window covering the context), a stage's block rows equal transformers' own ``DeepseekV4DecoderLayer`` run over
  ``[context ; block]`` with its own causal mask, the context's KV taken from that layer's ``kv_norm``.
* Every block of a batch in one forward equals a loop drafting one block at a time (each stage's attention over
  exactly the context rows of its window and the block, no mask), written here without ``Blocks``/``run_stage``:
  the same drafts, base logits equal to their float32 rounding (SGLang's base logits are float32).
* Each at 1, 2 and 4 CPU threads (``@pytest.mark.threads``): float64 throughout (model/precision.py), so the
  batch shape and the threads move a result by float64 rounding alone. Before that fix, transformers'
  float32 hyper-connection projection made a stage's last block row 5e-6 off with 2 threads on an AMD EPYC.
* The drafter's tensors are named as the layout's ``mtp.*`` inventory names them, shapes included.

The organism's trained drafter, its 0731-layout checkpoint and its training: tests/test_organism_dspark.py.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from transformers.models.deepseek_v4.modeling_deepseek_v4 import apply_rotary_pos_emb

from dsv4convert.models.deepseek_v4.layout import ModelConfig, native_inventory
from dsv4convert.model.dspark import (
    Blocks,
    ContextKV,
    DSparkDrafter,
    acceptance,
    anchor_grid,
    context_kv,
    rope_tables,
    run_stage,
)
from dsv4convert.model.forward import Positions
from dsv4convert.models.deepseek_v4.configs import with_dspark, with_num_layers
from dsv4convert.synth import preset_config

pytestmark = pytest.mark.threads


def tiny_dspark(**overrides) -> dict:
    config = preset_config("tiny")
    config = with_dspark(with_num_layers(config, config["num_hidden_layers"], mtp=False))
    config.update(overrides)
    return config


def drafter_of(config: dict, seed: int = 0, dtype=torch.float64) -> DSparkDrafter:
    torch.manual_seed(seed)
    drafter = DSparkDrafter(config)
    with torch.no_grad():
        for name, p in drafter.named_parameters():       # random, with every head non-trivial
            if p.ndim >= 2:
                p.normal_(0, 0.08)
            elif name.endswith("scale"):
                p.fill_(1.0)
            else:
                p.normal_(0, 0.1).add_(1.0 if "norm" in name else 0.0)
        for layer in drafter.stages:
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.1)
    return drafter.to(dtype).eval()


def test_a_stage_equals_transformers_layer_where_the_draft_and_a_plain_layer_coincide():
    config = tiny_dspark(sliding_window=16)
    drafter = drafter_of(config)
    layer, rotary = drafter.stages[0], drafter.rotary
    hc, hidden, p, g = drafter.cfg.hc_mult, drafter.cfg.hidden_size, 9, drafter.d.block_size
    gen = torch.Generator().manual_seed(1)
    streams = torch.randn(1, p + g, hc, hidden, generator=gen, dtype=torch.float64)
    ids = torch.randint(0, 500, (1, p + g), generator=gen)
    captured = {}
    handle = layer.self_attn.kv_norm.register_forward_hook(lambda _m, _a, out: captured.__setitem__("kv", out))
    with torch.no_grad():
        kwargs = Positions(drafter.config, torch.device("cpu"), torch.float64).kwargs(1, 0, p + g, None,
                                                                                      layer.layer_idx)
        want = layer(streams, input_ids=ids, **kwargs)[:, p:]
        handle.remove()
        cos, sin = rope_tables(rotary, torch.arange(p)[None], torch.float64)
        context = apply_rotary_pos_emb(captured["kv"][:, :p].unsqueeze(1), cos, sin)       # [1, 1, p, D]
        blocks = Blocks.make(ids, torch.tensor([[0, p]]), block_size=g, noise_token_id=0, window=16,
                             block_causal=True)
        got = run_stage(layer, streams[:, p:], context, blocks, rotary)
    assert torch.allclose(got, want, rtol=0, atol=1e-10 * want.abs().max())


def naive_draft(drafter: DSparkDrafter, features, ids, b: int, p: int, embed, lm_head):
    """One block at ``(b, p)``, step by step: SGLang's semantics with no mask and no batching over blocks."""
    g, w, noise = drafter.d.block_size, drafter.window, drafter.d.noise_token_id
    main_x = drafter.entry(features[b:b + 1])
    block_ids = torch.tensor([[int(ids[b, p])] + [noise] * (g - 1)])
    x = F.embedding(block_ids, embed)[:, :, None].repeat(1, 1, drafter.cfg.hc_mult, 1)
    lo = max(0, p - w)
    positions = torch.arange(p, p + g)[None]
    for layer in drafter.stages:
        attn = layer.self_attn
        kv = attn.kv_norm(attn.kv_proj(main_x[:, lo:p])).unsqueeze(1)
        cos, sin = rope_tables(drafter.rotary, torch.arange(lo, p)[None], kv.dtype)
        context = apply_rotary_pos_emb(kv, cos, sin)
        cos, sin = rope_tables(drafter.rotary, positions, kv.dtype)
        x = layer(x, input_ids=block_ids, position_embeddings={"main": (cos, sin)}, position_ids=positions,
                  attention_mask=None, past_key_values=ContextKV(context))
    head = drafter.head
    x_post = head.hc_head(x)[0]
    base = F.linear(head.norm(x_post), lm_head).float()
    prev, tokens, conf = int(ids[b, p]), [], []
    for j in range(g):
        step = base[j] + F.linear(head.markov_w1.weight[prev].float(), head.markov_w2.weight.float())
        feats = torch.cat([x_post[j], head.markov_w1.weight[prev].to(x_post.dtype)])
        conf.append(torch.sigmoid(head.confidence(feats.to(head.confidence.weight.dtype)).float())[0])
        prev = int(step.argmax())
        tokens.append(prev)
    return base, torch.tensor(tokens), torch.stack(conf)


def test_many_blocks_in_one_forward_equal_one_block_at_a_time():
    config = tiny_dspark()                      # sliding window 8: anchors before and past it
    drafter = drafter_of(config, seed=3)
    cfg, d = drafter.cfg, drafter.d
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 500, (2, 19), generator=gen)
    features = torch.randn(2, 19, cfg.hidden_size * d.stages, generator=gen, dtype=torch.float64)
    embed = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=gen, dtype=torch.float64)
    lm_head = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=gen, dtype=torch.float64) * 0.2
    anchors = anchor_grid(2, 19, last=14)
    blocks = Blocks.make(ids, anchors, block_size=d.block_size, noise_token_id=d.noise_token_id,
                         window=drafter.window)
    with torch.no_grad():
        out = drafter(features, blocks, embed, lm_head, teacher_prev=blocks.gather(ids)[0], chunk=7)
        for m, (b, p) in enumerate(anchors.tolist()):
            base, tokens, conf = naive_draft(drafter, features, ids, b, p, embed, lm_head)
            # float64 to the base logits, which are float32 (SGLang's): one float32 rounding apart at most
            assert torch.allclose(out.base_logits[m], base, rtol=0, atol=1e-6 * base.abs().max()), (b, p)
            assert torch.equal(out.draft_tokens[m], tokens), (b, p)
            assert torch.allclose(out.confidence[m], conf, rtol=0, atol=1e-5), (b, p)
    # teacher forcing conditions row j on the true token at p + j; drafting on the draft before it
    assert torch.equal(out.teacher_logits, out.base_logits + drafter.head.markov_bias(blocks.gather(ids)[0]))
    assert torch.equal(out.draft_prev[:, 1:], out.draft_tokens[:, :-1])
    assert torch.equal(out.draft_tokens, out.draft_logits.argmax(-1))


def test_native_state_names_every_drafter_tensor_of_the_layout():
    config = tiny_dspark()
    drafter = DSparkDrafter(config)
    state = drafter.native_state()
    specs = {s.name: s for s in native_inventory(ModelConfig.from_dict(config))
             if s.name.startswith("mtp.") and not s.name.endswith(".scale")}
    assert state.keys() == specs.keys()
    for name, spec in specs.items():
        n = spec.shape
        want = (n[0], n[1] * 2) if spec.dtype == "I8" else n
        assert tuple(state[name].shape) == tuple(want), name


def test_acceptance_is_the_accepted_prefix():
    drafts = torch.tensor([[1, 2, 3], [1, 9, 3], [7, 2, 3]])
    greedy = torch.tensor([[1, 2, 3], [1, 2, 3], [1, 2, 3]])
    got = acceptance(drafts, greedy)
    assert got.agreement == pytest.approx([2 / 3, 2 / 3, 1.0])
    assert got.accepted == pytest.approx([2 / 3, 1 / 3, 1 / 3])
    assert got.expected_accept_length == pytest.approx((3 + 1 + 0) / 3)
