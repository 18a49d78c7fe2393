"""The layout model against the real config's counts, and name classification."""

from __future__ import annotations

import pytest

from dsv4convert.errors import CheckpointError
from dsv4convert.models.deepseek_v4.layout import ModelConfig, Role, classify, native_groups, native_inventory


def test_real_config_inventory_matches_released_index(real_config):
    cfg = ModelConfig.from_dict(real_config)
    specs = native_inventory(cfg)
    # The released index: 69,187 tensors, total_size 159,609,485,896 (dsv4-checkpoint.md §3, §6).
    assert len(specs) == 69_187
    assert sum(s.nbytes for s in specs) == 159_609_485_896
    assert len({s.name for s in specs}) == len(specs)


def test_real_config_block_structure(real_config):
    cfg = ModelConfig.from_dict(real_config)
    groups = native_groups(cfg)
    assert len(groups) == 1 + 43 + 1 + 1  # embed, 43 layers, final norm/hc/head, MTP: the 46 shards
    names = {s.name for s in native_inventory(cfg)}
    indexers = {n.split(".attn")[0] for n in names if ".attn.indexer.wq_b.weight" in n}
    compressors = {n.split(".attn")[0] for n in names if n.endswith(".attn.compressor.wkv.weight")}
    assert len(indexers) == 21 and len(compressors) == 41
    assert {f"layers.{i}.ffn.gate.tid2eid" for i in range(3)} <= names
    assert "layers.3.ffn.gate.tid2eid" not in names and "layers.3.ffn.gate.bias" in names
    assert "mtp.0.ffn.gate.bias" in names and not any(n.startswith("mtp.0.attn.compressor") for n in names)
    # Layer 2 and layer 4 differ only by tid2eid (I64 [129280, 6]) vs bias (F32 [256]); the released
    # shard files differ by 6,204,496 B, i.e. this plus 80 B of longer header names.
    size = lambda g: sum(s.nbytes for s in g)  # noqa: E731
    assert size(groups[1 + 2]) - size(groups[1 + 4]) == 129280 * 6 * 8 - 256 * 4 == 6_204_496 - 80


def test_dtype_table(real_config):
    specs = {s.name: s for s in native_inventory(ModelConfig.from_dict(real_config))}
    expect = {
        "layers.7.ffn.experts.3.w1.weight": ("I8", (2048, 2048)),
        "layers.7.ffn.experts.3.w1.scale": ("F8_E8M0", (2048, 128)),
        "layers.7.ffn.experts.3.w2.weight": ("I8", (4096, 1024)),
        "layers.7.ffn.experts.3.w2.scale": ("F8_E8M0", (4096, 64)),
        "layers.7.attn.wo_a.weight": ("F8_E4M3", (8192, 4096)),
        "layers.7.attn.wo_a.scale": ("F8_E8M0", (64, 32)),
        "layers.7.attn.wq_b.scale": ("F8_E8M0", (256, 8)),
        "layers.3.attn.compressor.ape": ("F32", (128, 512)),
        "layers.4.attn.compressor.ape": ("F32", (4, 1024)),
        "layers.4.attn.indexer.compressor.ape": ("F32", (4, 256)),
        "layers.4.attn.indexer.compressor.wkv.weight": ("BF16", (256, 4096)),
        "layers.0.ffn.gate.tid2eid": ("I64", (129280, 6)),
        "layers.9.hc_attn_fn": ("F32", (24, 16384)),
        "layers.9.hc_ffn_scale": ("F32", (3,)),
        "hc_head_fn": ("F32", (4, 16384)),
        "mtp.0.hc_head_scale": ("F32", (1,)),
        "mtp.0.e_proj.scale": ("F8_E8M0", (32, 32)),
        "layers.5.attn.attn_sink": ("F32", (64,)),
    }
    for name, (dtype, shape) in expect.items():
        assert (specs[name].dtype, specs[name].shape) == (dtype, shape), name


@pytest.mark.parametrize(
    "name, role, module, param, expert, proj, mtp",
    [
        ("layers.4.ffn.experts.17.w3.weight_packed", Role.ROUTED_EXPERT, "layers.4.ffn.experts.17.w3", "weight_packed", 17, "w3", False),
        ("mtp.0.ffn.experts.2.w2.scale", Role.ROUTED_EXPERT, "mtp.0.ffn.experts.2.w2", "scale", 2, "w2", True),
        ("layers.4.ffn.experts.0.w1.weight_scale_2", Role.ROUTED_EXPERT, "layers.4.ffn.experts.0.w1", "weight_scale_2", 0, "w1", False),
        ("layers.4.attn.indexer.weights_proj.weight", Role.INDEXER_WEIGHTS_PROJ, "layers.4.attn.indexer.weights_proj", "weight", None, None, False),
        ("layers.4.attn.indexer.compressor.ape", Role.INDEXER_COMPRESSOR, "layers.4.attn.indexer.compressor", "ape", None, None, False),
        ("layers.4.attn.compressor.wgate.weight", Role.COMPRESSOR, "layers.4.attn.compressor.wgate", "weight", None, None, False),
        ("layers.4.attn.wo_b.scale", Role.ATTENTION, "layers.4.attn.wo_b", "scale", None, None, False),
        ("layers.4.attn.q_norm.weight", Role.NORM, "layers.4.attn.q_norm", "weight", None, None, False),
        ("layers.1.ffn.gate.tid2eid", Role.ROUTER, "layers.1.ffn.gate", "tid2eid", None, None, False),
        ("layers.1.ffn.shared_experts.w2.weight", Role.SHARED_EXPERT, "layers.1.ffn.shared_experts.w2", "weight", None, "w2", False),
        ("mtp.0.h_proj.weight", Role.MTP_PROJECTION, "mtp.0.h_proj", "weight", None, None, True),
        ("mtp.0.hc_head_base", Role.HYPER_CONNECTION, "mtp.0.hc_head", "base", None, None, True),
        ("hc_head_fn", Role.HYPER_CONNECTION, "hc_head", "fn", None, None, False),
        ("embed.weight", Role.EMBED, "embed", "weight", None, None, False),
    ],
)
def test_classify(name, role, module, param, expert, proj, mtp):
    info = classify(name)
    assert (info.role, info.module, info.param, info.expert, info.proj, info.is_mtp) == (role, module, param, expert, proj, mtp)


@pytest.mark.parametrize("name", ["model.layers.0.mlp.gate.weight", "layers.x.attn.wq_a.weight", "layers.0.attn.wq_a.qweight", ""])
def test_classify_rejects_foreign_names(name):
    with pytest.raises(CheckpointError, match="not part of the DeepSeek-V4 layout"):
        classify(name)


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda c: c.update(model_type="llama", architectures=["LlamaForCausalLM"]), "not a DeepSeek-V4 config"),
        (lambda c: c.update(hidden_size="4096"), "hidden_size"),
        (lambda c: c.update(compress_ratios=[0, 4]), "compress_ratios"),
        (lambda c: c.update(compress_ratios=[3] * 44), "compress_ratios"),
    ],
)
def test_bad_configs_are_refused(real_config, mutate, message):
    config = dict(real_config)
    mutate(config)
    with pytest.raises(CheckpointError, match=message):
        ModelConfig.from_dict(config, source="cfg.json")
