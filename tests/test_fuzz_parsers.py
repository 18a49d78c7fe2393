"""Fuzzing the parsers of untrusted input: safetensors headers, checkpoint indexes and recipes.

Whatever the bytes, each parser either succeeds or raises its own DSV4Error subclass (which the
CLI prints as one line); any other exception, or an input that takes more than PER_CASE_SECONDS,
fails. CI runs a bounded, derandomized number of cases; DSV4_FUZZ_EXAMPLES raises it (bench/
torture.py --fuzz-examples does, and records the count in docs/reliability.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import string
import struct
import tempfile
from pathlib import Path

import torch
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsv4convert.checkpoint import Checkpoint, PlannedTensor, ShardWriter, read_header, read_tensor, write_index
from dsv4convert.convert.recipe import RECIPE_DIR, SHIPPED, parse_recipe
from dsv4convert.errors import CheckpointError, RecipeError

EXAMPLES = int(os.environ.get("DSV4_FUZZ_EXAMPLES", "120"))
PER_CASE_SECONDS = 5.0
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=EXAMPLES <= 500, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@contextlib.contextmanager
def time_limit(seconds: float = PER_CASE_SECONDS):
    """Fail a case that hangs instead of hanging the suite (SIGALRM interrupts pure-Python loops)."""
    def expire(signum, frame):
        raise TimeoutError(f"one fuzz case ran longer than {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)

# ---------------------------------------------------------------- safetensors headers


def valid_shard() -> bytes:
    """A small real shard (three dtypes) to mutate."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "s.safetensors"
        tensors = {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(4, dtype=torch.bfloat16),
                   "c": torch.arange(8, dtype=torch.uint8).view(torch.float8_e4m3fn)}
        planned = [PlannedTensor(n, {"a": "F32", "b": "BF16", "c": "F8_E4M3"}[n], tuple(t.shape)) for n, t in tensors.items()]
        with ShardWriter(path, planned, metadata={"format": "pt"}) as writer:
            for name, tensor in tensors.items():
                writer.write(name, tensor)
        return path.read_bytes()


VALID_SHARD = valid_shard()
HEADER_LEN = struct.unpack("<Q", VALID_SHARD[:8])[0]


def parse_bytes(data: bytes) -> None:
    """read_header on ``data`` and, when it passes, read every tensor: the only allowed error is ours."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "fuzz.safetensors"
        path.write_bytes(data)
        with time_limit():
            try:
                header = read_header(path)
                for entry in header.entries.values():
                    tensor = read_tensor(entry)
                    assert tensor.numel() * tensor.element_size() == entry.nbytes or entry.dtype == "F4"
            except CheckpointError as exc:
                assert "fuzz.safetensors" in str(exc)


@FUZZ
@given(st.binary(max_size=256))
def test_random_bytes_as_a_shard(data):
    parse_bytes(data)


@FUZZ
@given(st.lists(st.tuples(st.integers(0, len(VALID_SHARD) - 1), st.integers(1, 255)), min_size=1, max_size=6))
def test_bit_flipped_shard(flips):
    data = bytearray(VALID_SHARD)
    for position, mask in flips:
        data[position] ^= mask
    parse_bytes(bytes(data))


@FUZZ
@given(st.integers(0, len(VALID_SHARD)), st.integers(0, 2**64 - 1))
def test_truncated_shard_or_lying_length(cut, length):
    parse_bytes(VALID_SHARD[:cut])
    parse_bytes(struct.pack("<Q", length) + VALID_SHARD[8:])


entries = st.fixed_dictionaries({}, optional={
    "dtype": st.sampled_from(["F32", "BF16", "F8_E4M3", "F8_E8M0", "F4", "I64", "U8", "Q7", "", None, 3]),
    "shape": st.lists(st.integers(-2, 9), max_size=3) | json_values,
    "data_offsets": st.lists(st.integers(-4, 40), min_size=0, max_size=3) | json_values,
}) | json_values


@FUZZ
@given(st.dictionaries(st.text(string.printable, max_size=6), entries, max_size=5), st.binary(max_size=64))
def test_structured_header_with_arbitrary_entries(header, payload):
    raw = json.dumps(header, allow_nan=True).encode()
    parse_bytes(struct.pack("<Q", len(raw)) + raw + payload)


# ---------------------------------------------------------------- checkpoint indexes

SHARD_NAMES = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "../x.safetensors",
               "/etc/passwd", "..", ".", "", "a/b.safetensors", "x.bin", "model-00003-of-00002.safetensors"]


def open_with_index(index_text: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "ck"
        root.mkdir()
        for i, name in enumerate(SHARD_NAMES[:2]):
            with ShardWriter(root / name, [PlannedTensor(f"t{i}", "F32", (2,))]) as writer:
                writer.write(f"t{i}", torch.zeros(2))
        write_index(root, {"t0": SHARD_NAMES[0], "t1": SHARD_NAMES[1]}, 16)
        (root / "model.safetensors.index.json").write_text(index_text)
        with time_limit():
            try:
                Checkpoint.open(root)
            except CheckpointError as exc:
                assert str(root) in str(exc)


@FUZZ
@given(st.dictionaries(st.sampled_from(["t0", "t1", "t2", ""]) | st.text(max_size=4),
                       st.sampled_from(SHARD_NAMES) | json_values, max_size=4),
       json_values)
def test_index_with_arbitrary_weight_map(weight_map, metadata):
    open_with_index(json.dumps({"metadata": metadata, "weight_map": weight_map}))


@FUZZ
@given(json_values)
def test_index_that_is_any_json(value):
    open_with_index(json.dumps(value))


@FUZZ
@given(st.integers(0, 200), st.text(max_size=8))
def test_index_text_cut_or_spliced(cut, splice):
    text = json.dumps({"metadata": {"total_size": 16}, "weight_map": {"t0": SHARD_NAMES[0], "t1": SHARD_NAMES[1]}})
    open_with_index(text[:cut] + splice + text[cut:])


# ---------------------------------------------------------------- recipes

SHIPPED_TEXTS = [(RECIPE_DIR / f"{name}.yaml").read_text() for name in SHIPPED]


def parse(text: str) -> None:
    with time_limit():
        try:
            parse_recipe(text, "fuzz.yaml")
        except RecipeError as exc:
            assert "fuzz.yaml" in str(exc)


@FUZZ
@given(json_values)
def test_recipe_from_any_structure(value):
    parse(yaml.safe_dump(value))
    parse(json.dumps(value))


rule_values = st.fixed_dictionaries({}, optional={
    "match": st.fixed_dictionaries({}, optional={
        "role": st.sampled_from(["routed_expert", "norm", "attention", "nonsense"]) | json_values,
        "mtp": st.booleans() | json_values,
        "module": st.sampled_from([".*", "layers\\.[0-9]+", "(", "a{99999}"]) | json_values,
    }) | json_values,
    "format": st.sampled_from(["keep", "bf16", "fp8", "nvfp4", "int4", "fp4"]) | json_values,
    "params": st.fixed_dictionaries({}, optional={"group_size": st.sampled_from([32, 64, 128]) | json_values,
                                                  "scale_dtype": st.sampled_from(["e8m0", "float32"]) | json_values}),
    "reason": st.text(max_size=6) | json_values,
})


@FUZZ
@given(st.text(max_size=6) | json_values, st.lists(rule_values, max_size=4) | json_values)
def test_recipe_with_arbitrary_rules(name, rules):
    parse(yaml.safe_dump({"name": name, "rules": rules}))


@FUZZ
@given(st.sampled_from(range(len(SHIPPED_TEXTS))),
       st.lists(st.tuples(st.integers(0, 4000), st.integers(0, 8), st.text(string.printable, max_size=6)),
                min_size=1, max_size=4))
def test_mutated_shipped_recipe(which, edits):
    text = SHIPPED_TEXTS[which]
    for position, delete, insert in edits:
        position %= len(text) + 1
        text = text[:position] + insert + text[position + delete:]
    parse(text)


def test_a_shipped_name_never_reads_the_working_directory(tmp_path, monkeypatch):
    """`to-fp8` run where a folder (or file) is called fp8 still converts with the shipped recipe; a file named
    like a shipped recipe is reached as ./fp8."""
    from dsv4convert.convert.recipe import load_recipe

    monkeypatch.chdir(tmp_path)
    (tmp_path / "fp8").mkdir()
    (tmp_path / "nvfp4").write_text("not a recipe")
    assert load_recipe("fp8").source == str(RECIPE_DIR / "fp8.yaml")
    assert load_recipe("nvfp4").source == str(RECIPE_DIR / "nvfp4.yaml")
    (tmp_path / "mine").write_text((RECIPE_DIR / "bf16.yaml").read_text())
    assert load_recipe("./mine").name == "bf16"
    try:
        load_recipe("./nvfp4")
    except RecipeError as exc:
        assert "nvfp4" in str(exc)
    else:
        raise AssertionError("./nvfp4 is the file there, which is not a recipe")
