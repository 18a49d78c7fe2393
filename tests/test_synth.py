"""Synthetic checkpoints: exact native layout, realistic values, and loadable by transformers."""

from __future__ import annotations

import torch

from dsv4convert.checkpoint import Checkpoint
from dsv4convert.formats import dequantize_fp8_block, dequantize_mxfp4
from dsv4convert.inspection import inspect_checkpoint
from dsv4convert.models.deepseek_v4.layout import ModelConfig, native_groups, native_inventory
from dsv4convert.models.deepseek_v4.configs import with_num_layers
from dsv4convert.synth import preset_config, synth_tensors
from transformers_oracle import load, prompt_ids


def test_tiny_inventory_matches_layout(tiny_ckpt):
    ckpt = Checkpoint.open(tiny_ckpt)
    cfg = ModelConfig.from_dict(ckpt.config)
    expected = [(s.name, s.dtype, s.shape) for s in native_inventory(cfg)]
    assert [(n, e.dtype, e.shape) for n, e in ckpt.tensors.items()] == expected
    result = inspect_checkpoint(ckpt)
    assert result.ok and result.variant == "native"
    assert len(ckpt.shards) == len(native_groups(cfg)) > 4
    ratios = set(cfg.compress_ratios)
    assert ratios == {0, 4, 128} and cfg.num_hash_layers >= 3 and cfg.num_nextn_predict_layers == 1


def test_tiny_is_deterministic(tiny_ckpt):
    ckpt = Checkpoint.open(tiny_ckpt)
    cfg = ModelConfig.from_dict(ckpt.config)
    group = native_groups(cfg)[3]  # layer 2: ratio 4, hash-routed, indexer
    for name, tensor in synth_tensors(group, cfg, seed=0):
        assert torch.equal(ckpt.read(name).reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)), name
    other = dict(synth_tensors(group, cfg, seed=1))
    name = "layers.2.ffn.experts.0.w1.weight"
    assert not torch.equal(ckpt.read(name), other[name])


def test_tiny_values_are_realistic(tiny_ckpt):
    ckpt = Checkpoint.open(tiny_ckpt)
    cfg = ModelConfig.from_dict(ckpt.config)
    fp8_exponents, mx_exponents, zero_blocks, mx_zero_groups = set(), set(), 0, 0
    for name, entry in ckpt.tensors.items():
        if entry.dtype == "F8_E8M0" and ".experts." in name:
            e = ckpt.read(name).view(torch.uint8)
            mx_exponents |= set(e.unique().tolist())
            w = ckpt.read(name.replace(".scale", ".weight"))
            mx_zero_groups += int((w.view(torch.uint8).reshape(w.shape[0], -1, 16) == 0).all(-1).sum())
        elif entry.dtype == "F8_E8M0":
            fp8_exponents |= set(ckpt.read(name).view(torch.uint8).unique().tolist())
            w = dequantize_fp8_block(ckpt.read(name.replace(".scale", ".weight")), ckpt.read(name), block=(128, 128))
            if w.shape[0] >= 256 and w.shape[1] >= 256:
                blocks = w[: w.shape[0] // 128 * 128, : w.shape[1] // 128 * 128].unflatten(0, (-1, 128)).unflatten(2, (-1, 128))
                zero_blocks += int((blocks == 0).all(dim=(1, 3)).sum())
    assert len(mx_exponents) >= 5 and len(fp8_exponents) >= 4, "scales must spread over several binades"
    assert zero_blocks >= 1 and mx_zero_groups >= 1, "some all-zero blocks must exist"
    w = dequantize_mxfp4(ckpt.read("layers.3.ffn.experts.1.w2.weight"), ckpt.read("layers.3.ffn.experts.1.w2.scale"))
    kurtosis = float(((w - w.mean()) ** 4).mean() / w.var() ** 2)
    assert kurtosis > 4.0, f"weights should be heavy-tailed, kurtosis {kurtosis:.1f}"
    tid2eid = ckpt.read("layers.0.ffn.gate.tid2eid")
    assert tid2eid.dtype == torch.int64 and tid2eid.shape == (cfg.vocab_size, cfg.num_experts_per_tok)
    assert int(tid2eid.min()) >= 0 and int(tid2eid.max()) < cfg.n_routed_experts
    assert all(len(set(row)) == len(row) for row in tid2eid[:64].tolist())


def test_transformers_loads_tiny_and_runs_a_forward_pass(tiny_ckpt):
    model, info = load(tiny_ckpt)
    assert not info["missing_keys"], sorted(info["missing_keys"])[:10]
    assert not info["mismatched_keys"]
    # transformers does not instantiate the MTP block: every other tensor must have been used.
    assert all(k.startswith("mtp.") for k in info["unexpected_keys"])
    ids = prompt_ids(tiny_ckpt)
    assert ids.shape[1] > 40
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], ModelConfig.from_dict(Checkpoint.open(tiny_ckpt).config).vocab_size)
    assert torch.isfinite(logits).all() and float(logits.float().std()) > 0
    # transformers' own FP8/MXFP4 dequantization agrees with ours on the native layout.
    ckpt = Checkpoint.open(tiny_ckpt)
    ours = dequantize_mxfp4(ckpt.read("layers.1.ffn.experts.3.w2.weight"), ckpt.read("layers.1.ffn.experts.3.w2.scale"))
    theirs = model.model.layers[1].mlp.experts.down_proj[3].float()
    assert torch.equal(ours.bfloat16().float(), theirs)
    ours = dequantize_fp8_block(ckpt.read("layers.4.attn.wq_b.weight"), ckpt.read("layers.4.attn.wq_b.scale"), block=(128, 128))
    assert torch.equal(ours.bfloat16().float(), model.model.layers[4].self_attn.q_b_proj.weight.float())


def test_num_layers_keeps_structure():
    config = with_num_layers(preset_config("small"), 4)
    cfg = ModelConfig.from_dict(config)
    assert cfg.num_hidden_layers == 4 and cfg.compress_ratios == (0, 0, 4, 128, 0)
    assert ModelConfig.from_dict(with_num_layers(preset_config("small"), 2, mtp=False)).num_nextn_predict_layers == 0
