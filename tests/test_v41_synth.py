"""``synth --preset tiny-v41`` (dsv4convert/models/deepseek_v41/synth.py), #53: a tiny DeepSeek-V4.1-Flash in the
release's native format, with every tensor kind the release has.

* What it writes is what ``inspect --expected --config`` plans from its config: every name, dtype and shape, in
  order, shard by shard (one shard per inventory group, each Engram table alone).
* Its config is the release's scaled down: the same keys at every level, the same ``quantization_config``; its
  Engram rows and compressed vocabulary are what SGLang 0.5.23's own code derives (``EngramLayout``,
  ``build_compressed_token_map`` on the tokenizer written beside the weights).
* Values are realistic and deterministic by seed; Engram tables go to the writer in row chunks.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open

from dsv4convert.checkpoint import PlannedTensor, ShardWriter
from dsv4convert.cli import main
from dsv4convert.errors import CheckpointError
from dsv4convert.models.deepseek_v41 import synth as v41_synth
from dsv4convert.models.deepseek_v41.presets import TINY

RELEASE = Path(__file__).parent / "data" / "deepseek-v4.1-flash-config.json"


@pytest.fixture(scope="module")
def tiny(tiny_v41) -> Path:
    return tiny_v41


def _header(path: Path) -> list[tuple[str, str, list[int]]]:
    raw = path.read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + size])
    header.pop("__metadata__", None)
    entries = sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0])
    return [(name, e["dtype"], e["shape"]) for name, e in entries]


def test_synth_writes_exactly_what_inspect_plans(tiny, capsys):
    capsys.readouterr()
    assert main(["inspect", "--expected", "--config", str(tiny / "config.json"), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    shards = sorted(tiny.glob("model-*.safetensors"))
    assert len(shards) == len(plan["shard_bytes"]) > 10
    written = [t for shard in shards for t in _header(shard)]
    assert written == [(t["name"], t["dtype"], t["shape"]) for t in plan["tensors"]]
    index = json.loads((tiny / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == {t[0] for t in written}
    assert index["metadata"]["total_size"] == plan["total_bytes"]
    roles = {r["role"] for r in plan["roles"]}
    assert {"engram_table", "engram", "vision", "compressor", "indexer", "indexer_bf16", "routed_expert (mtp)",
            "mtp_projection", "draft_head"} <= roles and "unknown" not in roles


def test_preset_is_the_release_config_scaled_down():
    release = json.loads(RELEASE.read_text())
    assert set(TINY) == set(release)
    for level in ("text_config", "vision_config", "rope_scaling"):
        ours = TINY["text_config"]["rope_scaling"] if level == "rope_scaling" else TINY[level]
        theirs = release["text_config"]["rope_scaling"] if level == "rope_scaling" else release[level]
        assert set(ours) == set(theirs), level
    assert TINY["quantization_config"] == release["quantization_config"]


def test_engram_rows_and_compressed_vocab_are_sglangs(tiny):
    from sglang.srt.configs.deepseek_v41 import normalize_deepseek_v41_config
    from sglang.srt.layers.engram import EngramLayout, build_compressed_token_map
    from transformers import AutoTokenizer

    config = json.loads((tiny / "config.json").read_text())
    flat = normalize_deepseek_v41_config(config)
    layout = EngramLayout.from_config(SimpleNamespace(**flat))
    assert [layout.column_bounds(i)[-1] for i in range(2)] == flat["engram_num_embeddings"]
    assert 2_000 < min(flat["engram_num_embeddings"]) < 10_000
    tokenizer = AutoTokenizer.from_pretrained(str(tiny))
    assert len(tokenizer) == flat["vocab_size"]
    _, compressed = build_compressed_token_map(tokenizer)
    assert compressed == flat["engram_compressed_vocab_size"] < flat["vocab_size"]


def test_values_are_realistic(tiny):
    index = json.loads((tiny / "model.safetensors.index.json").read_text())["weight_map"]

    def read(name: str) -> torch.Tensor:
        with safe_open(tiny / index[name], "pt") as f:
            return f.get_tensor(name)

    codes = read("layers.1.engram.embed.weight").float()
    amax = codes.reshape(codes.shape[0], -1, 32).abs().amax(-1)
    assert ((amax >= 224) & (amax <= 448)).all()                    # each 1 x 32 block's largest code
    exponents = read("layers.1.engram.embed.scale").view(torch.uint8).int() - 127
    assert exponents.shape == (codes.shape[0], 2) and len(exponents.unique()) >= 5
    scale = read("layers.0.attn.wq_b.scale")
    text = TINY["text_config"]
    assert scale.dtype == torch.float8_e8m0fnu and tuple(scale.shape) == (
        text["num_attention_heads"] * text["head_dim"] // 32, text["q_lora_rank"] // 32)
    experts = read("mtp.0.ffn.experts.3.w2.weight")
    assert experts.dtype == torch.int8 and tuple(experts.shape) == (256, 64)
    assert (read("layers.0.attn_norm.weight").float() - 1).abs().max() < 1


def test_same_seed_same_bytes_other_seed_other_values(tiny, tmp_path):
    again, other = tmp_path / "again", tmp_path / "other"
    assert main(["synth", "--preset", "tiny-v41", "--dst", str(again)]) == 0
    assert main(["synth", "--preset", "tiny-v41", "--dst", str(other), "--seed", "1"]) == 0

    def digests(d: Path) -> dict[str, str]:
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}

    assert digests(again) == digests(tiny)
    changed = {n for n, h in digests(other).items() if digests(tiny)[n] != h}
    assert {p.name for p in tiny.glob("model-*.safetensors")} <= changed


def test_engram_tables_reach_the_writer_in_row_chunks(tmp_path, monkeypatch):
    chunks: list[tuple[str, int]] = []
    write_rows = ShardWriter.write_rows

    def recorded(self, name, pieces):
        def each():
            for piece in pieces:
                chunks.append((name, piece.shape[0]))
                yield piece
        return write_rows(self, name, each())

    monkeypatch.setattr(v41_synth, "ENGRAM_CHUNK_ROWS", 1000)
    monkeypatch.setattr(ShardWriter, "write_rows", recorded)
    v41_synth.synthesize(tmp_path / "ck", TINY)
    rows = TINY["text_config"]["engram_num_embeddings"][0]
    table = [n for name, n in chunks if name == "layers.1.engram.embed.weight"]
    assert max(table) == 1000 and sum(table) == rows and len(table) == -(-rows // 1000)
    assert {name for name, _ in chunks} == {f"layers.{i}.engram.embed.{k}" for i in (1, 2) for k in ("weight", "scale")}


def test_row_chunks_that_miss_the_plan_leave_nothing(tmp_path):
    path = tmp_path / "shard.safetensors"
    writer = ShardWriter(path, [PlannedTensor("t", "F32", (10, 4))])
    with pytest.raises(CheckpointError, match="planned 10 rows but got 6"):
        writer.write_rows("t", [torch.zeros(3, 4), torch.zeros(3, 4)])
    assert list(tmp_path.iterdir()) == []
