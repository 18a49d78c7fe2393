"""Corrupt and hostile inputs through the conversion CLI: one ``error:`` line naming the file (and
the tensor where there is one), exit status 2, no traceback, no output that looks finished.

tests/test_checkpoint_io.py already covers these through ``inspect`` (missing/truncated shard,
absurd header length, unknown dtype, overlapping offsets, ``../`` and symlinked shards, duplicates
across shards); tests/test_convert.py covers E8M0 NaN in an expert scale and bad recipe rules.
Here every kind of bad input is run through a conversion, with the variants those files lack.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest

from dsv4convert.checkpoint import Checkpoint
from dsv4convert.cli import main

INDEX = "model.safetensors.index.json"


@pytest.fixture
def src(tiny_ckpt, tmp_path) -> Path:
    """A private copy of the tiny checkpoint that a test may corrupt."""
    return Path(shutil.copytree(tiny_ckpt, tmp_path / "src"))


def convert(capsys, src: Path, *extra: str, recipe: str = "fp8", dry_run: bool = True) -> str:
    """Run ``to-<recipe>``; require exit 2 with exactly one error line and no finished output."""
    dst = src.parent / "out"
    argv = [f"to-{recipe}", "--src", str(src), "--dst", str(dst), "--no-progress", *extra]
    code = main(argv + (["--dry-run"] if dry_run else []))
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert code == 2, (code, err)
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    assert not (dst / INDEX).exists()
    return err


def entry(src: Path, name: str):
    return Checkpoint.open(src).entry(name)


def header_of(path: Path) -> tuple[int, dict, bytes]:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return n, json.loads(data[8 : 8 + n]), data


def rewrite_header(path: Path, mutate) -> None:
    """Change header entries; the tensor bytes stay as they are (offsets count from the data start)."""
    n, header, data = header_of(path)
    mutate(header)
    raw = json.dumps(header, separators=(",", ":")).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n :])


def first_tensor(path: Path) -> str:
    _, header, _ = header_of(path)
    return min((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])


def shard(src: Path, i: int) -> Path:
    return sorted(src.glob("model-*.safetensors"))[i]


# ---------------------------------------------------------------- truncated and bit-flipped shards


def test_shard_truncated_inside_a_tensor(capsys, src):
    path = shard(src, 3)
    _, header, data = header_of(path)
    last = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][1])
    begin, end = header[last]["data_offsets"]
    path.write_bytes(data[: len(data) - (end - begin) // 2])
    err = convert(capsys, src)
    assert path.name in err and f"tensor '{last}'" in err and "truncated shard" in err


@pytest.mark.parametrize("keep, message", [(0, "0 bytes, too short"), (5, "5 bytes, too short"),
                                           (12, "truncated or corrupt")])
def test_shard_truncated_into_its_header(capsys, src, keep, message):
    path = shard(src, 1)
    path.write_bytes(path.read_bytes()[:keep])
    err = convert(capsys, src)
    assert path.name in err and message in err


@pytest.mark.parametrize("what", ["opening brace", "quote", "colon", "dtype letter", "offset digit"])
def test_bit_flipped_header(capsys, src, what):
    """One flipped bit anywhere in the header JSON is either invalid JSON or a header that
    disagrees with itself or the index; either way the run stops before writing anything."""
    path = shard(src, 2)
    n, header, data = header_of(path)
    raw = data[8 : 8 + n]
    at = {
        "opening brace": 0,
        "quote": raw.index(b'"'),
        "colon": raw.index(b":"),
        "dtype letter": raw.index(b'"dtype":"') + len(b'"dtype":"'),
        "offset digit": raw.index(b'"data_offsets":[') + len(b'"data_offsets":['),
    }[what]
    flipped = bytearray(data)
    flipped[8 + at] ^= 0x02
    path.write_bytes(bytes(flipped))
    err = convert(capsys, src)
    assert path.name in err
    if what in ("dtype letter", "offset digit"):
        assert "tensor '" in err


def test_header_length_field_cuts_the_json(capsys, src):
    path = shard(src, 2)
    data = bytearray(path.read_bytes())
    data[:8] = struct.pack("<Q", 7)
    path.write_bytes(bytes(data))
    assert "header is not valid JSON" in convert(capsys, src)


def test_header_nested_too_deeply(capsys, src):
    path = shard(src, 2)
    n, _, data = header_of(path)
    raw = b"[" * 50_000 + b"]" * 50_000
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n :])
    err = convert(capsys, src)
    assert path.name in err and "header JSON is nested too deeply" in err


# ---------------------------------------------------------------- header entries that lie


@pytest.mark.parametrize("mutate, message", [
    (lambda e: e.update(data_offsets=[e["data_offsets"][1], e["data_offsets"][0]]), "negative or reversed"),
    (lambda e: e.update(data_offsets=[-8, e["data_offsets"][1]]), "negative or reversed"),
    (lambda e: e.update(data_offsets=[e["data_offsets"][0], 10**12]), "run past the end of the data"),
    (lambda e: e.update(data_offsets=[0, 1.5]), "bad data_offsets"),
    (lambda e: e.update(shape=[-1]), "bad shape"),
    (lambda e: e.update(shape="12"), "bad shape"),
    (lambda e: e.update(dtype="BF16" if e["dtype"] != "BF16" else "F32"), "bytes but data_offsets"),
    (lambda e: e.update(dtype="F4", shape=[3]), "F4 tensor needs an even last dim"),
    (lambda e: e.update(dtype=None), "unknown dtype None"),
])
def test_header_entry_that_disagrees_with_its_bytes(capsys, src, mutate, message):
    path = shard(src, 1)
    tensor = first_tensor(path)
    rewrite_header(path, lambda h: mutate(h[tensor]))
    err = convert(capsys, src)
    assert path.name in err and f"tensor '{tensor}'" in err and message in err


def test_two_tensors_sharing_bytes(capsys, src):
    path = shard(src, 1)
    _, header, _ = header_of(path)
    names = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
    a, b = names[0], names[1]
    rewrite_header(path, lambda h: h[b].update(dtype=h[a]["dtype"], shape=h[a]["shape"],
                                               data_offsets=h[a]["data_offsets"]))
    err = convert(capsys, src)
    assert path.name in err and "overlaps" in err


def test_tensor_named_twice_in_one_header(capsys, src):
    """JSON keeps the last duplicate silently; two readers could then disagree on a tensor's bytes."""
    path = shard(src, 1)
    n, header, data = header_of(path)
    tensor = first_tensor(path)
    raw = json.dumps(header, separators=(",", ":"))
    duplicate = raw[:-1] + "," + json.dumps(tensor) + ":" + json.dumps(header[tensor], separators=(",", ":")) + "}"
    raw = duplicate.encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n :])
    err = convert(capsys, src)
    assert path.name in err and f"tensor '{tensor}'" in err and "names this tensor twice" in err


# ---------------------------------------------------------------- indexes that point elsewhere


def set_index(src: Path, mutate) -> None:
    index = json.loads((src / INDEX).read_text())
    mutate(index)
    (src / INDEX).write_text(json.dumps(index))


@pytest.mark.parametrize("evil, message", [
    ("../../etc/passwd", "is not a plain file name"),
    ("/etc/passwd", "is not a plain file name"),
    ("..\\..\\x.safetensors", "is not a plain file name"),
    ("a\x00.safetensors", "is not a plain file name"),
    ("", "is not a plain file name"),
    (7, "is not a plain file name"),
    (None, "is not a plain file name"),
    (["model-00001-of-00008.safetensors"], "is not a plain file name"),  # found by tests/test_fuzz_parsers.py
])
def test_index_naming_a_shard_outside_the_directory(capsys, src, evil, message):
    set_index(src, lambda ix: ix["weight_map"].update({"embed.weight": evil}))
    err = convert(capsys, src)
    assert INDEX in err and "tensor 'embed.weight'" in err and message in err


def test_shard_symlink_to_a_system_file(capsys, src):
    target = shard(src, 0)
    target.unlink()
    target.symlink_to("/etc/passwd")
    err = convert(capsys, src)
    assert INDEX in err and "resolves outside the checkpoint directory (to /etc/passwd)" in err


def test_index_that_is_not_an_index(capsys, src):
    (src / INDEX).write_text(json.dumps({"weight_map": ["model-00001-of-00008.safetensors"]}))
    assert "index has no 'weight_map' object" in convert(capsys, src)
    (src / INDEX).write_text('{"weight_map": {"a": "x.safetensors", "a": "y.safetensors"}}')
    assert "key 'a' appears twice" in convert(capsys, src)
    (src / INDEX).write_text("[" * 100_000 + "]" * 100_000)
    assert "nested too deeply" in convert(capsys, src)


def test_duplicate_tensor_across_shards_stops_a_conversion(capsys, src):
    """Shard 2 gains a copy of a tensor of shard 1 (the index still names shard 1 for it)."""
    one, two = shard(src, 0), shard(src, 1)
    tensor = first_tensor(one)
    n1, h1, d1 = header_of(one)
    n2, h2, d2 = header_of(two)
    begin, end = h1[tensor]["data_offsets"]
    payload = d1[8 + n1 + begin : 8 + n1 + end]
    data_len = len(d2) - 8 - n2
    h2[tensor] = {**h1[tensor], "data_offsets": [data_len, data_len + len(payload)]}
    raw = json.dumps(h2, separators=(",", ":")).encode()
    two.write_bytes(struct.pack("<Q", len(raw)) + raw + d2[8 + n2 :] + payload)
    err = convert(capsys, src)
    assert f"tensor '{tensor}'" in err and "stored in two shards" in err


# ---------------------------------------------------------------- values that cannot be right


@pytest.mark.parametrize("tensor, offset, data", [
    ("embed.weight", 4, b"\xc0\x7f"),                      # BF16 NaN
    ("layers.0.attn_norm.weight", 2, b"\x80\xff"),         # BF16 -Inf
    ("layers.0.hc_attn_base", 0, b"\x00\x00\x80\x7f"),     # F32 +Inf
    ("layers.0.hc_attn_fn", 4, b"\x01\x00\xc0\x7f"),       # F32 NaN with payload
    ("layers.0.attn.wq_a.weight", 3, b"\x7f"),             # FP8 e4m3 NaN
    ("layers.0.ffn.shared_experts.w1.weight", 9, b"\xff"),  # FP8 e4m3 -NaN
    ("layers.0.attn.wq_a.scale", 0, b"\xff"),              # E8M0 NaN on a kept FP8 weight
])
@pytest.mark.parametrize("recipe", ["fp8", "nvfp4"])
def test_nan_or_inf_in_a_source_tensor(capsys, src, tensor, offset, data, recipe):
    e = entry(src, tensor)
    with open(e.path, "r+b") as f:
        f.seek(e.start + offset)
        f.write(data)
    err = convert(capsys, src, recipe=recipe, dry_run=False)
    assert e.path.name in err and f"tensor '{tensor}'" in err and "NaN or Inf" in err


# ---------------------------------------------------------------- configs and recipes


@pytest.mark.parametrize("config, message", [
    ({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}, "not a release dsv4convert knows (model_type='llama'"),
    ({"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"]}, "not a release dsv4convert knows (model_type='deepseek_v3'"),
    ("[1, 2", "not valid JSON"),
    ("[1, 2]", "not a JSON object"),
    ('{"model_type": "deepseek_v4", "model_type": "llama"}', "key 'model_type' appears twice"),
])
def test_config_that_is_not_deepseek_v4(capsys, src, config, message):
    (src / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    err = convert(capsys, src)
    assert "config.json" in err and message in err


KEEP_REST = "  - match: {}\n    format: keep\n    reason: everything else as released\n"


@pytest.mark.parametrize("recipe, message", [
    ("name: x\ncolour: red\nrules:\n" + KEEP_REST, "at (top level): unknown key"),
    ("name: x\nrules:\n  - match: {role: routed_expert, layer: 3}\n    format: fp8\n" + KEEP_REST,
     "at rules[0].match: unknown key"),
    ("name: x\nrules:\n  - match: {role: routed_expert}\n    format: fp8\n    params: {bits: 4}\n" + KEEP_REST,
     "at rules[0].params: unknown key"),
    ("name: x\nrules:\n  - match: {role: router}\n    format: int4\n" + KEEP_REST, "router"),
    ("name: x\nrules:\n  - match: {role: embed}\n    format: fp8\n" + KEEP_REST, "embed"),
    ("name: x\nrules:\n  - match: {role: hyper_connection}\n    format: nvfp4\n" + KEEP_REST, "hyper_connection"),
    ("name: x\nrules:\n  - &r {match: {}, format: keep, reason: all kept}\n  - *r\n", "aliases (*r) are not allowed"),
    ("name: x\nrules: " + "[" * 5000 + "]" * 5000 + "\n", "nested too deeply"),
    ("- just\n- a list\n", "is not of type 'object'"),
    ("", "None is not of type 'object'"),
    ("name: x\nrules:\n  - match: {module: '(unclosed'}\n    format: keep\n    reason: broken regex\n",
     "bad regular expression"),
])
def test_recipe_that_does_not_apply(capsys, src, tmp_path, recipe, message):
    path = tmp_path / "hostile.yaml"
    path.write_text(recipe)
    dst = tmp_path / "out"
    code = main(["convert", "--recipe", str(path), "--src", str(src), "--dst", str(dst), "--dry-run", "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    assert "hostile.yaml" in err and message in err, err
    assert not dst.exists()
