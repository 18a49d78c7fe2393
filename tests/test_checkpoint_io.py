"""Checkpoint reading and writing: dtypes, laziness, atomicity and every bad input."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from conftest import write_plain_checkpoint
from dsv4convert.checkpoint import Checkpoint, PlannedTensor, ShardWriter, SourceBytes, partial_path
from dsv4convert.checkpoint import writer as shard_writer
from dsv4convert.cli import main
from dsv4convert.errors import CheckpointError


def all_dtypes() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    raw = lambda *shape: torch.randint(0, 255, shape, generator=g, dtype=torch.uint8)  # noqa: E731
    return {
        "f8_e4m3": raw(4, 8).view(torch.float8_e4m3fn),
        "f8_e8m0": raw(2, 3).view(torch.float8_e8m0fnu),
        "i8": raw(4, 6).view(torch.int8),
        "u8": raw(5),
        "bf16": torch.randn(3, 5, generator=g).bfloat16(),
        "f32": torch.randn(7, generator=g),
        "f16": torch.randn(2, 2, generator=g).half(),
        "i64": torch.randint(-(2**40), 2**40, (3, 2), generator=g),
        "i32": torch.randint(-(2**30), 2**30, (4,), generator=g, dtype=torch.int32),
        "f4": raw(2, 4).view(torch.float4_e2m1fn_x2),
        "scalar": torch.tensor(3.5),
    }


def test_every_dtype_round_trips_and_matches_safetensors(tmp_path):
    tensors = all_dtypes()
    root = write_plain_checkpoint(tmp_path / "ck", [dict(list(tensors.items())[:5]), dict(list(tensors.items())[5:])])
    ckpt = Checkpoint.open(root)
    assert list(ckpt.tensors) == list(tensors)
    for name, want in tensors.items():
        got = ckpt.read(name)
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), name
        # Independent reader: the safetensors library must see the same bytes.
        with safe_open(ckpt.entry(name).path, "pt") as f:
            oracle = f.get_tensor(name)
        assert torch.equal(oracle.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), name
    index = json.loads((root / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == ckpt.total_bytes == sum(t.numel() * t.element_size() for t in tensors.values())
    assert ckpt.problems == []


def test_single_file_checkpoint(tmp_path):
    root = tmp_path / "single"
    root.mkdir()
    with ShardWriter(root / "model.safetensors", [PlannedTensor("a", "F32", (2,))]) as w:
        w.write("a", torch.tensor([1.0, 2.0]))
    assert torch.equal(Checkpoint.open(root).read("a"), torch.tensor([1.0, 2.0]))


def test_writer_refuses_off_plan_tensors_and_leaves_no_partial_file(tmp_path):
    path = tmp_path / "s.safetensors"
    with pytest.raises(CheckpointError, match="planned F32"):
        with ShardWriter(path, [PlannedTensor("a", "F32", (2,)), PlannedTensor("b", "F32", (1,))]) as w:
            w.write("a", torch.zeros(2, dtype=torch.bfloat16))
    assert not path.exists() and not partial_path(path).exists()
    with pytest.raises(CheckpointError, match="unwritten"):
        w = ShardWriter(path, [PlannedTensor("a", "F32", (2,)), PlannedTensor("b", "F32", (1,))])
        w.write("a", torch.zeros(2))
        w.commit()
    assert not path.exists() and not partial_path(path).exists()


def _takes_direct_writes(directory: Path) -> bool:
    """Whether ``directory``'s file system takes an aligned O_DIRECT write (what the writer probes)."""
    import mmap
    import os

    probe = directory / "probe"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
    except OSError:
        return False
    try:
        os.pwritev(fd, [mmap.mmap(-1, 4096)], 0)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        probe.unlink()


@pytest.mark.parametrize("writer", ["direct", "page cache, kernel copy", "page cache, buffered copy"])
def test_source_bytes_are_copied_as_written(tmp_path, monkeypatch, writer):
    """A SourceBytes output holds exactly the source tensor's bytes, under its planned dtype: read
    into the O_DIRECT writer's chunks, or through the page cache by ``copy_file_range`` or, where
    the kernel cannot copy between the files, through a buffer."""
    import errno
    import os

    codes = torch.randint(-128, 128, (300, 77), dtype=torch.int8)
    norm = torch.randn(77)
    root = write_plain_checkpoint(tmp_path / "src", [{"w": codes, "n": norm}])
    entry = Checkpoint.open(root).entry("w")
    calls = []
    if writer != "direct":
        monkeypatch.setattr(shard_writer, "DIRECT_IO", False)
    if writer == "page cache, buffered copy":
        def unsupported(*args):
            calls.append(args)
            raise OSError(errno.EXDEV, "cross-device")
        monkeypatch.setattr(os, "copy_file_range", unsupported)
    monkeypatch.setattr(shard_writer, "_WRITEBACK_EVERY", 4096)  # several pieces per tensor
    monkeypatch.setattr(shard_writer, "_DIRECT_CHUNK", 8192)  # several chunks per tensor
    path = tmp_path / "out.safetensors"
    with ShardWriter(path, [PlannedTensor("n", "F32", (77,)), PlannedTensor("w", "U8", (300, 77))]) as w:
        direct = writer == "direct" and _takes_direct_writes(tmp_path)
        assert isinstance(w._out, shard_writer._DirectOutput) == direct
        w.write("n", norm)
        w.write("w", SourceBytes(entry, "U8", (300, 77)))
    with safe_open(path, "pt") as f:
        assert torch.equal(f.get_tensor("w"), codes.view(torch.uint8)) and torch.equal(f.get_tensor("n"), norm)
    assert path.stat().st_size == w.size
    assert len(calls) == (1 if writer == "page cache, buffered copy" else 0)  # the fallback is chosen once


def test_the_direct_writer_falls_back_where_direct_writes_are_refused(tmp_path, monkeypatch):
    """A file system that takes O_DIRECT at open but refuses the writes gets the page-cache writer."""
    import errno
    import fcntl
    import os

    real = os.pwritev

    def refuse_direct(fd, buffers, offset):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "pwritev", refuse_direct)
    path = tmp_path / "out.safetensors"
    with ShardWriter(path, [PlannedTensor("a", "F32", (3,))]) as w:
        assert isinstance(w._out, shard_writer._PageCacheOutput)
        w.write("a", torch.tensor([1.0, 2.0, 3.0]))
    with safe_open(path, "pt") as f:
        assert torch.equal(f.get_tensor("a"), torch.tensor([1.0, 2.0, 3.0]))


@pytest.mark.parametrize("fail_at", ["put", "commit"])
def test_a_direct_chunk_write_that_fails_later_stops_the_shard_and_leaves_nothing(tmp_path, monkeypatch, fail_at):
    """Chunks go to disk in the background; a failure surfaces at a later write or at commit, as one error."""
    import errno
    import os

    if not _takes_direct_writes(tmp_path):
        pytest.skip("this file system refuses O_DIRECT writes: the page-cache writer is tested instead")
    real, calls = os.pwritev, []

    def full_disk(fd, buffers, offset):
        calls.append(offset)
        if len(calls) > 1:  # the writer's probe passes
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "pwritev", full_disk)
    monkeypatch.setattr(shard_writer, "_DIRECT_CHUNK", 8192)
    path = tmp_path / "s.safetensors"
    big = (40000,) if fail_at == "put" else (1000,)  # several chunks, or one: then only commit writes
    with pytest.raises(CheckpointError, match=r"s\.safetensors: .*cannot write \(ENOSPC"):
        with ShardWriter(path, [PlannedTensor("a", "F32", big), PlannedTensor("b", "F32", big)]) as w:
            w.write("a", torch.zeros(big))
            w.write("b", torch.zeros(big))
    assert not path.exists() and not partial_path(path).exists()


def test_source_bytes_from_a_shrunken_or_mismatched_source_fail_naming_both(tmp_path):
    root = write_plain_checkpoint(tmp_path / "src", [{"w": torch.zeros(4096, dtype=torch.uint8)}])
    entry = Checkpoint.open(root).entry("w")
    path = tmp_path / "out.safetensors"
    with pytest.raises(CheckpointError, match=r"planned 4000 bytes but the source tensor 'w' has 4096"):
        with ShardWriter(path, [PlannedTensor("x", "U8", (4000,))]) as w:
            w.write("x", SourceBytes(entry, "U8", (4000,)))
    assert not partial_path(path).exists()
    with open(entry.path, "r+b") as f:  # the source shrinks after it was opened and checked
        f.truncate(entry.start + 1000)
    with pytest.raises(CheckpointError, match=rf"{entry.path.name}: tensor 'w': file ends after 1000 of 4096 bytes"
                                              rf".*while copying it to out\.safetensors"):
        with ShardWriter(path, [PlannedTensor("x", "U8", (4096,))]) as w:
            w.write("x", SourceBytes(entry, "U8", (4096,)))
    assert not partial_path(path).exists() and not path.exists()


def test_reading_is_lazy_and_memory_stays_near_one_tensor(tmp_path):
    # 8 tensors of 48 MiB in 4 shards: iterating must not hold more than ~one tensor at a time.
    tensor_mib = 48
    shards = [{f"s{s}.t{t}": torch.full((tensor_mib * 2**18,), float(s * 2 + t)) for t in range(2)} for s in range(4)]
    root = write_plain_checkpoint(tmp_path / "big", shards)
    del shards
    script = textwrap.dedent(f"""
        import resource, torch
        from dsv4convert.checkpoint import Checkpoint
        ck = Checkpoint.open({str(root)!r})
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        total = 0.0
        for name, t in ck.iter_tensors():
            total += float(t[0])
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print((peak - base) / 1024, total)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout.split()
    growth_mib, total = float(out[0]), float(out[1])
    assert total == sum(range(8))
    assert growth_mib < 2.5 * tensor_mib, f"peak RSS grew {growth_mib:.0f} MiB while iterating {8 * tensor_mib} MiB"


# ---------------------------------------------------------------- bad inputs, through the CLI


def run_inspect(capsys, path) -> tuple[int, str]:
    code = main(["inspect", str(path)])
    err = capsys.readouterr().err.strip()
    return code, err


@pytest.fixture
def good(tmp_path):
    return write_plain_checkpoint(tmp_path / "ck", [{"a": torch.ones(4), "b": torch.ones(2, 2)}, {"c": torch.zeros(3)}])


def shard_of(root: Path, i: int) -> Path:
    return sorted(root.glob("*.safetensors"))[i]


def set_index(root: Path, mutate) -> None:
    path = root / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    mutate(index)
    path.write_text(json.dumps(index))


def assert_one_line_error(code: int, err: str, *needles: str) -> None:
    assert code == 2
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err
    for needle in needles:
        assert needle in err, (needle, err)


def test_missing_index(capsys, tmp_path):
    (tmp_path / "empty").mkdir()
    assert_one_line_error(*run_inspect(capsys, tmp_path / "empty"), "empty", "model.safetensors.index.json")


def test_missing_shard(capsys, good):
    shard_of(good, 1).unlink()
    assert_one_line_error(*run_inspect(capsys, good), "model-00002-of-00002.safetensors", "missing", "'c'")


def test_truncated_shard(capsys, good):
    path = shard_of(good, 0)
    path.write_bytes(path.read_bytes()[:-5])
    assert_one_line_error(*run_inspect(capsys, good), path.name, "truncated", "tensor")


def test_header_disagrees_with_index(capsys, good):
    set_index(good, lambda ix: ix["weight_map"].update({"c": "model-00001-of-00002.safetensors"}))
    assert_one_line_error(*run_inspect(capsys, good), "model-00001-of-00002.safetensors", "tensor 'c'", "does not hold")


@pytest.mark.parametrize("evil", ["../x.safetensors", "/etc/passwd.safetensors", "sub/../../x.safetensors", "..", "x.bin"])
def test_index_shard_outside_directory(capsys, good, evil):
    set_index(good, lambda ix: ix["weight_map"].update({"c": evil}))
    assert_one_line_error(*run_inspect(capsys, good), "model.safetensors.index.json", "tensor 'c'")


def test_symlinked_shard_leading_out(capsys, good, tmp_path):
    outside = tmp_path / "outside.safetensors"
    shard_of(good, 1).rename(outside)
    (good / "model-00002-of-00002.safetensors").symlink_to(outside)
    assert_one_line_error(*run_inspect(capsys, good), "outside the checkpoint directory")


def test_absurd_header_length(capsys, good):
    path = shard_of(good, 0)
    data = bytearray(path.read_bytes())
    data[:8] = struct.pack("<Q", 2**62)
    path.write_bytes(bytes(data))
    assert_one_line_error(*run_inspect(capsys, good), path.name, "header length")


def test_header_length_larger_than_file(capsys, good):
    path = shard_of(good, 0)
    data = bytearray(path.read_bytes())
    data[:8] = struct.pack("<Q", len(data))
    path.write_bytes(bytes(data))
    assert_one_line_error(*run_inspect(capsys, good), path.name, "truncated or corrupt")


def rewrite_header(path: Path, mutate) -> None:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    mutate(header)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (n - len(raw)) if len(raw) <= n else b""
    assert len(raw) == n, "test mutation must not grow the header"
    path.write_bytes(data[:8] + raw + data[8 + n :])


def test_unknown_dtype(capsys, good):
    rewrite_header(shard_of(good, 0), lambda h: h["a"].update(dtype="Q7"))
    assert_one_line_error(*run_inspect(capsys, good), "tensor 'a'", "unknown dtype 'Q7'")


def test_dtype_shape_disagrees_with_byte_range(capsys, good):
    rewrite_header(shard_of(good, 0), lambda h: h["a"].update(shape=[5]))
    assert_one_line_error(*run_inspect(capsys, good), "tensor 'a'", "needs 20 bytes")


def test_overlapping_offsets(capsys, good):
    rewrite_header(shard_of(good, 0), lambda h: h["b"].update(data_offsets=[0, 16]))
    assert_one_line_error(*run_inspect(capsys, good), "overlaps")


def test_bit_flipped_header_json(capsys, good):
    path = shard_of(good, 0)
    data = bytearray(path.read_bytes())
    data[9] ^= 0x40
    path.write_bytes(bytes(data))
    code, err = run_inspect(capsys, good)
    assert_one_line_error(code, err, path.name)


def test_duplicate_tensor_across_shards(capsys, tmp_path):
    root = write_plain_checkpoint(tmp_path / "dup", [{"a": torch.ones(2), "b": torch.ones(1)},
                                                    {"a": torch.ones(2), "c": torch.ones(1)}])
    assert_one_line_error(*run_inspect(capsys, root), "two shards", "tensor 'a'")


def test_config_that_is_not_deepseek_v4(capsys, good):
    (good / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    assert_one_line_error(*run_inspect(capsys, good), "config.json", "not a release dsv4convert knows (model_type='llama'")


def test_hugging_face_repo_id_resolves_through_the_local_cache(tmp_path, monkeypatch):
    """A repo id is looked up in the Hugging Face cache first (no network here: offline mode)."""
    cache = tmp_path / "hub"
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = cache / "models--acme--tiny-v4" / "snapshots" / commit
    write_plain_checkpoint(snapshot, [{"a": torch.arange(4.0)}], config={"model_type": "deepseek_v4"})
    (cache / "models--acme--tiny-v4" / "refs").mkdir()
    (cache / "models--acme--tiny-v4" / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as hf_constants

    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    ckpt = Checkpoint.open("acme/tiny-v4")
    assert ckpt.root == snapshot and torch.equal(ckpt.read("a"), torch.arange(4.0))
    with pytest.raises(CheckpointError, match="cannot resolve Hugging Face repo"):
        Checkpoint.open("acme/not-cached")
    with pytest.raises(CheckpointError, match="not a Hugging Face repo id"):
        Checkpoint.open(str(tmp_path / "missing" / "dir"))
