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

import dataclasses
import hashlib
import json
import struct
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open

from dsv4convert.checkpoint import Checkpoint, PlannedTensor, ShardWriter
from dsv4convert.cli import main
from dsv4convert.errors import CheckpointError
from dsv4convert.models.deepseek_v41 import release
from dsv4convert.models.deepseek_v41 import synth as v41_synth
from dsv4convert.models.deepseek_v41.config import read_config
from dsv4convert.models.deepseek_v41.inventory import check_headers, native_inventory
from dsv4convert.models.deepseek_v41.tokenizer import compressed_token_map
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
    """... and the same bytes whether the shards are written in one process or side by side (--workers)."""
    again, other = tmp_path / "again", tmp_path / "other"
    assert main(["synth", "--preset", "tiny-v41", "--dst", str(again), "--workers", "2"]) == 0
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


# -- synth --config <V4.1 config.json> --num-layers N --engram-rows R: real-size layers, scaled tables ----------------

def _release() -> dict:
    return json.loads(RELEASE.read_text())


def test_one_real_size_layer_is_the_releases_layer_14_with_a_scaled_table():
    """The plan, not the bytes (one real layer is 7.3 GB): every shape of the release's layer 14 (Engram, compressor
    with gate, both indexer halves) as layer 0, the table's rows alone scaled, the rows the engines' hash needs."""
    from sglang.srt.configs.deepseek_v41 import normalize_deepseek_v41_config
    from sglang.srt.layers.engram import EngramLayout

    config = v41_synth.scaled_config(_release(), 1, 5_000, drafter=False)
    cfg = read_config(config)
    ours = {s.name: (s.dtype, s.shape) for s in native_inventory(cfg)}
    real = {s.name: (s.dtype, s.shape) for s in native_inventory(read_config(_release()))}
    layer = {n.replace("layers.14.", "layers.0.", 1): v for n, v in real.items() if n.startswith("layers.14.")}
    assert {n for n in ours if n.startswith("layers.")} == set(layer) and not any(n.startswith("mtp.") for n in ours)
    table = "layers.0.engram.embed.weight"
    assert all(ours[n] == v for n, v in layer.items() if not n.startswith("layers.0.engram.embed."))
    assert {n: v for n, v in real.items() if not n.startswith(("layers.", "mtp."))} == \
        {n: v for n, v in ours.items() if not n.startswith("layers.")}              # embed, head, vision
    rows = ours[table][1][0]
    assert 5_000 <= rows < 7_500 and ours[table] == ("F8_E4M3", (rows, 256))
    assert ours["layers.0.engram.embed.scale"] == ("F8_E8M0", (rows, 8))
    flat = normalize_deepseek_v41_config(config)
    assert EngramLayout.from_config(SimpleNamespace(**flat)).column_bounds(0)[-1] == rows
    assert cfg.engram_compressed_vocab_size == 99_092 and cfg.kv_source_layer_ids == (0,) == cfg.engram_layer_ids


def test_more_real_layers_keep_the_release_order_and_the_drafter():
    text = v41_synth.scaled_config(_release(), 4, 5_000)["text_config"]
    assert text["compress_ratios"] == [0, 0, 2, 2, 0, 0, 0]            # layers 0, 1, 2 and 14, then three stages
    assert text["engram_layer_ids"] == [1, 3] and text["kv_source_layer_ids"] == [2, 3]
    assert text["candidate_source_layer_id"] == 3 and text["dspark_target_layer_ids"] == [1, 2, 3]
    assert v41_synth.scaled_config(_release(), 21, 5_000)["text_config"]["candidate_source_layer_id"] == 20


def test_synth_config_cli_writes_what_inspect_plans_and_says_what_it_scaled(tmp_path, capsys):
    """The CLI path written for real on the tiny preset's config (its layer 2 is the Engram + KV + index layer)."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY))
    dst = tmp_path / "ck"
    capsys.readouterr()
    assert main(["synth", "--config", str(path), "--num-layers", "1", "--engram-rows", "300", "--dst", str(dst),
                 "--drafter", "none"]) == 0
    out = capsys.readouterr().out
    assert "--engram-rows 300" in out and "1 real-size" in out
    assert main(["inspect", "--expected", "--config", str(dst / "config.json"), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    written = [t for shard in sorted(dst.glob("model-*.safetensors")) for t in _header(shard)]
    assert written == [(t["name"], t["dtype"], t["shape"]) for t in plan["tensors"]]
    assert {"engram_table", "compressor", "indexer", "vision"} <= {r["role"] for r in plan["roles"]}
    assert release.check_tokenizer(dst, read_config(json.loads((dst / "config.json").read_text()))) == 406


@pytest.mark.parametrize("args, named", [
    (["--num-layers", "2"], "--drafter none"),                           # three DSpark stages need three layers
    (["--num-layers", "1", "--engram-rows", "5", "--drafter", "none"], "--engram-rows"),
    (["--num-layers", "41"], "--num-layers"),
])
def test_bad_scaling_is_one_error_line(args, named, tmp_path, capsys):
    capsys.readouterr()
    assert main(["synth", "--config", str(RELEASE), "--dst", str(tmp_path / "ck"), *args]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and named in lines[0]
    assert not (tmp_path / "ck").exists()


@pytest.mark.parametrize("flag", [["--engram-rows", "1000"], ["--workers", "2"]])
def test_engram_rows_and_workers_are_refused_for_v4(flag, tmp_path, capsys):
    assert main(["synth", "--preset", "tiny", *flag, "--dst", str(tmp_path / "ck")]) == 2
    assert "V4.1" in capsys.readouterr().err and not (tmp_path / "ck").exists()


# -- the tokenizer: the compressed map both engines build, and the release's check ---------------------------------

def _sglang_map(directory: Path) -> tuple[list[int], int]:
    from sglang.srt.layers.engram import build_compressed_token_map
    from transformers import AutoTokenizer

    return build_compressed_token_map(AutoTokenizer.from_pretrained(str(directory)))


def test_compressed_map_is_sglangs_on_the_tiny_tokenizer(tiny):
    from tokenizers import Tokenizer

    ours = compressed_token_map(Tokenizer.from_file(str(tiny / "tokenizer.json")))
    assert ours == _sglang_map(tiny) and ours[1] == TINY["text_config"]["engram_compressed_vocab_size"]


def test_compressed_map_is_sglangs_on_a_crafted_tokenizer(tmp_path):
    """Case, accents, full-width forms, whitespace runs and partial UTF-8 bytes, and the release's sizes."""
    tokenizer = v41_synth.crafted_tokenizer(1_200, 1_000)
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(v41_synth.TOKENIZER_CONFIG))
    ours = compressed_token_map(tokenizer)
    assert ours == _sglang_map(tmp_path) and ours[1] == 1_000 and len(ours[0]) == 1_200
    assert ours[0][tokenizer.token_to_id("W7")] == ours[0][tokenizer.token_to_id("w7")]
    real = v41_synth.crafted_tokenizer(129_280, 99_092)
    assert real.get_vocab_size() == 129_280 and compressed_token_map(real)[1] == 99_092


def _one_line(exc: pytest.ExceptionInfo, *named: str) -> None:
    text = str(exc.value)
    assert "\n" not in text and all(n in text for n in named), text


def test_tokenizer_check_passes_the_tiny_one_and_names_a_missing_or_wrong_size_file(tiny, tmp_path):
    cfg = read_config(TINY)
    assert release.check_tokenizer(tiny, cfg) == 406
    with pytest.raises(CheckpointError) as exc:
        release.check_tokenizer(tmp_path, cfg)
    _one_line(exc, str(tmp_path / "tokenizer.json"), "missing")
    (tmp_path / "tokenizer").mkdir()
    (tmp_path / "tokenizer" / "tokenizer.json").write_bytes((tiny / "tokenizer.json").read_bytes())
    with pytest.raises(CheckpointError) as exc:
        release.check_tokenizer(tmp_path, cfg)
    _one_line(exc, "tokenizer/", "beside the weights")
    v41_synth.crafted_tokenizer(512, 400).save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(CheckpointError) as exc:
        release.check_tokenizer(tmp_path, cfg)
    _one_line(exc, str(tmp_path / "tokenizer.json"), "400", "engram_compressed_vocab_size is 406")
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(CheckpointError) as exc:
        release.check_tokenizer(tmp_path, cfg)
    _one_line(exc, str(tmp_path / "tokenizer.json"), "not a fast tokenizer")


def test_the_release_tokenizer_size_is_checked_against_99092(tmp_path):
    cfg = read_config(_release())
    v41_synth.crafted_tokenizer(129_280, 99_092).save(str(tmp_path / "tokenizer.json"))
    assert release.check_tokenizer(tmp_path, cfg) == 99_092
    v41_synth.crafted_tokenizer(129_280, 99_091).save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(CheckpointError) as exc:
        release.check_tokenizer(tmp_path, cfg)
    _one_line(exc, "tokenizer.json", "99,091", "99,092")


# -- a checkpoint's headers against its config ------------------------------------------------------------------------

def test_headers_that_agree_pass(tiny):
    release.check_checkpoint(read_config(TINY), Checkpoint.open(tiny).tensors.values())


def test_engram_rows_that_disagree_with_the_config_are_refused_naming_shard_and_tensor(tiny):
    entries = dict(Checkpoint.open(tiny).tensors)
    name = "layers.2.engram.embed.weight"
    entries[name] = dataclasses.replace(entries[name], shape=(entries[name].shape[0] - 1, 64))
    with pytest.raises(CheckpointError) as exc:
        release.check_checkpoint(read_config(TINY), entries.values())
    _one_line(exc, str(entries[name].path), name, "engram_num_embeddings")


@pytest.mark.parametrize("config", ["tiny", "release"])
def test_128x128_scales_are_refused_naming_the_tensor(config, tiny):
    cfg = read_config(TINY if config == "tiny" else _release())
    name = "layers.0.attn.wq_b.scale"
    n, k = next(s.shape for s in native_inventory(cfg) if s.name == "layers.0.attn.wq_b.weight")
    entries = [(s.name, s.dtype, s.shape, "model-00002-of-00048.safetensors") for s in native_inventory(cfg)
               if s.name.startswith("layers.0.")]
    entries = [(e[0], e[1], (-(-n // 128), -(-k // 128)), e[3]) if e[0] == name else e for e in entries]
    with pytest.raises(CheckpointError) as exc:
        check_headers(cfg, entries)
    _one_line(exc, "model-00002-of-00048.safetensors", name, "128x128", "32x32")
