"""DeepSeek-V4.1-Flash's config reader and native inventory (dsv4convert/models/deepseek_v41/), #53.

* ``inspect --expected --config`` on the release's config.json (``tests/data/deepseek-v4.1-flash-config.json``,
  byte-identical to the published file, sha256 8be45ce0...) plans the real checkpoint: 96,085 tensors,
  510,286,023,000 bytes, and each dtype's count and bytes as the release's headers give them
  (../shared/reference/v41-flash.md section 2, from the published index).
* The Engram tables' rows are derived, not chosen: the reader's prime layout equals SGLang 0.5.23's own
  (``layers/engram.py::EngramLayout.from_config``) and a config whose rows disagree is refused.
* Every hostile config is one ``error:`` line naming the key (and the level it sits at), exit 2.
"""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from dsv4convert.cli import main
from dsv4convert.models.deepseek_v41.config import engram_primes, read_config
from dsv4convert.models.deepseek_v41.inventory import native_inventory, role_of

RELEASE = Path(__file__).parent / "data" / "deepseek-v4.1-flash-config.json"
PUBLISHED_SHA256 = "8be45ce0476004a3f529fd896115a4a2e800a129ad2d3ec05b16050f52e21879"
# The release's headers (its published model.safetensors.index.json): count and bytes per dtype.
PUBLISHED = {"BF16": (520, 3_952_883_712), "F32": (387, 169_229_128), "F8_E4M3": (357, 204_015_223_296),
             "F8_E8M0": (47_589, 23_563_015_184), "I8": (47_232, 278_585_671_680)}


def release() -> dict:
    return json.loads(RELEASE.read_text())


def inspect_expected(config: dict, tmp_path: Path, capsys) -> tuple[int, str, str]:
    """``dsv4convert inspect --expected --config ... --json``, in process: (exit code, stdout, stderr)."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    code = main(["inspect", "--expected", "--config", str(path), "--json"])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_the_shipped_config_is_the_published_file():
    assert hashlib.sha256(RELEASE.read_bytes()).hexdigest() == PUBLISHED_SHA256


def test_inspect_plans_the_release_exactly(tmp_path, capsys):
    code, out, err = inspect_expected(release(), tmp_path, capsys)
    assert code == 0, err
    report = json.loads(out)
    assert report["tensor_count"] == 96_085 and report["total_bytes"] == 510_286_023_000
    assert len(report["shard_bytes"]) == 48
    per_dtype: dict[str, list[int]] = {}
    for spec in native_inventory(read_config(release())):
        row = per_dtype.setdefault(spec.dtype, [0, 0])
        row[0] += 1
        row[1] += spec.nbytes
    assert {k: tuple(v) for k, v in per_dtype.items()} == PUBLISHED
    roles = {r["role"]: r for r in report["roles"]}
    assert roles["engram_table"]["tensors"] == 4 and report["engram_table_bytes"] == 202_758_032_400
    assert roles["routed_expert (mtp)"]["tensors"] == 2_304 and "unknown" not in roles
    names = {t["name"]: t for t in report["tensors"]}
    assert names["layers.0.attn.wq_b.scale"]["shape"] == [1024, 40]           # 32 x 32 blocks
    assert "layers.20.attn.compressor.wgate.weight" not in names               # ratio 1: no gate
    assert names["layers.14.attn.compressor.wgate.weight"]["dtype"] == "BF16"
    assert "layers.24.attn.indexer.wq_b.weight" in names and "layers.24.attn.indexer.wk.weight" not in names
    assert names["mtp.2.confidence_head.proj.weight"]["shape"] == [1, 5376]
    assert all(role_of(name) != "unknown" for name in names)


def test_engram_rows_are_sglangs_own_prime_layout():
    from sglang.srt.configs.deepseek_v41 import normalize_deepseek_v41_config
    from sglang.srt.layers.engram import EngramLayout

    flat = normalize_deepseek_v41_config(release())
    theirs = EngramLayout.from_config(SimpleNamespace(**flat))
    ours = engram_primes(2, flat["engram_max_ngram_size"], flat["engram_n_heads"], flat["engram_vocab_size"])
    assert ours == [[p for per_ngram in layer for p in per_ngram] for layer in theirs.primes]
    assert [sum(layer) for layer in ours] == flat["engram_num_embeddings"] == [384_006_168, 384_016_682]


def test_a_later_snapshot_with_v41s_keys_is_read():
    config = release()
    config["text_config"]["index_topk"] = 1024            # another value, the same keys: read
    assert read_config(config).index_topk == 1024


def _text(**changes):
    def edit(config: dict) -> None:
        config["text_config"].update(changes)
    return edit


def _drop(*path: str):
    def edit(config: dict) -> None:
        node = config
        for key in path[:-1]:
            node = node[key]
        del node[path[-1]]
    return edit


def _vision(**changes):
    def edit(config: dict) -> None:
        config["vision_config"].update(changes)
    return edit


HOSTILE = {
    "no text_config": (_drop("text_config"), "text_config"),
    "an unknown text key": (_text(engram_new_thing=1), "engram_new_thing"),
    "an unknown top key": (lambda c: c.update(audio_config={}), "audio_config"),
    "an unknown vision key": (_vision(temporal_patch_size=2), "temporal_patch_size"),
    "engram rows off by one": (_text(engram_num_embeddings=[384_006_169, 384_016_682]), "engram_num_embeddings"),
    "a table missing": (_text(engram_num_embeddings=[384_006_168]), "engram_num_embeddings"),
    "experts as a word": (_text(n_routed_experts="eight"), "n_routed_experts"),
    "a billion experts": (_text(n_routed_experts=1_000_000_000), "n_routed_experts"),
    "a fractional top-k": (_text(num_experts_per_tok=6.5), "num_experts_per_tok"),
    "top-k above the experts": (_text(num_experts_per_tok=400), "num_experts_per_tok"),
    "drafter top-k above its experts": (_text(dspark_num_experts_per_tok=129), "dspark_num_experts_per_tok"),
    "drafter experts as a list": (_text(dspark_n_routed_experts=[128]), "dspark_n_routed_experts"),
    "a KV source at ratio 0": (_text(kv_source_layer_ids=[1, 2, 8, 14, 20]), "KV-source layer 1"),
    "ratio-1 layers without a source": (_text(kv_source_layer_ids=[2, 8, 14]), "no KV-source layer"),
    "candidate level not an index source": (_text(candidate_source_layer_id=21), "candidate_source_layer_id"),
    "V4's 128x compression": (_text(compress_ratios=[0, 0] + [2] * 18 + [128] * 20 + [0, 0, 0]), "compress_ratios"),
    "a ratio list too short": (_text(compress_ratios=[0, 0] + [2] * 18 + [1] * 20), "compress_ratios"),
    "stages disagree": (_text(num_nextn_predict_layers=2), "num_nextn_predict_layers"),
    "an unaligned hidden size": (_text(hidden_size=5100), "hidden_size"),
    "no FP8 block": (lambda c: c["quantization_config"].pop("weight_block_size"), "weight_block_size"),
    "vision heads not dividing": (_vision(num_attention_heads=7), "num_attention_heads"),
    "softmax routing": (_text(scoring_func="softmax"), "scoring_func"),
    "an RMS eps as a word": (_text(rms_norm_eps="tiny"), "rms_norm_eps"),
    "an infinite SwiGLU limit": (_text(swiglu_limit=float("inf")), "swiglu_limit"),
    "Sinkhorn a million times": (_text(hc_sinkhorn_iters=1_000_000), "hc_sinkhorn_iters"),
    "an odd RoPE dim": (_text(qk_rope_head_dim=63), "qk_rope_head_dim"),
    "an unknown YaRN key": (_text(rope_scaling={"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                                                "original_max_position_embeddings": 65536, "mscale": 1}), "mscale"),
    "an Engram pad past the vocabulary": (_text(engram_pad_token_id=129280), "engram_pad_token_id"),
    "an image token past the vocabulary": (lambda c: c.update(image_token_id=-1), "image_token_id"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_configs_are_one_error_line_naming_the_key(case, tmp_path, capsys):
    edit, named = HOSTILE[case]
    config = copy.deepcopy(release())
    edit(config)
    code, out, err = inspect_expected(config, tmp_path, capsys)
    assert code == 2 and not out, (case, out[-500:], err)
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and named in lines[0], (case, err)
    assert "config.json" in lines[0]
