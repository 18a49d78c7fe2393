"""A checkpoint streamed from a (stand-in) Hugging Face Hub: headers by range reads, shards on demand."""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import pytest
import torch

from dsv4convert.checkpoint import Checkpoint, ShardFetcher
from dsv4convert.errors import CheckpointError


class StandInHub:
    """Serves a local checkpoint as the Hub would: small files at once, shards only on download."""

    def __init__(self, origin: Path, cache: Path):
        self.repo_id = "acme/tiny-v4"
        self.origin = origin
        self.cache = cache
        self.downloads: list[str] = []
        self.header_reads: list[str] = []

    def small_files(self) -> Path:
        self.cache.mkdir(parents=True, exist_ok=True)
        for f in self.origin.iterdir():
            if f.suffix != ".safetensors":
                shutil.copy(f, self.cache / f.name)
        return self.cache

    def size(self, filename: str) -> int:
        return (self.origin / filename).stat().st_size

    def open(self, filename: str):
        self.header_reads.append(filename)
        with open(self.origin / filename, "rb") as f:
            return io.BytesIO(f.read(1 << 20))  # a range read of the first MiB, enough for a header

    def download(self, filename: str) -> Path:
        self.downloads.append(filename)
        shutil.copy(self.origin / filename, self.cache / filename)
        return self.cache / filename


def test_open_reads_every_header_without_downloading(tiny_ckpt, tmp_path):
    hub = StandInHub(tiny_ckpt, tmp_path / "cache")
    ckpt = Checkpoint.open(hub.repo_id, remote=hub)
    local = Checkpoint.open(tiny_ckpt)
    assert hub.downloads == [] and sorted(hub.header_reads) == sorted(p.name for p in local.shards)
    assert ckpt.remote is hub
    assert [(n, e.dtype, e.shape, e.start, e.nbytes) for n, e in ckpt.tensors.items()] == \
        [(n, e.dtype, e.shape, e.start, e.nbytes) for n, e in local.tensors.items()]


def test_fetcher_downloads_ahead_and_deletes_after_use(tiny_ckpt, tmp_path):
    hub = StandInHub(tiny_ckpt, tmp_path / "cache")
    ckpt = Checkpoint.open(hub.repo_id, remote=hub)
    names = [p.name for p in ckpt.shards]
    fetcher = ShardFetcher(hub, ckpt.root, delete_after_use=True)
    try:
        fetcher.acquire([names[0]], upcoming=names[1:])
        name = "embed.weight"
        assert torch.equal(ckpt.read(name), Checkpoint.open(tiny_ckpt).read(name))
        fetcher.acquire([names[1]], upcoming=names[2:])
        assert hub.downloads[:2] == names[:2]
        fetcher.release(names[0])
        assert not (ckpt.root / names[0]).exists() and (ckpt.root / names[1]).exists()
    finally:
        fetcher.close()


def test_a_missing_remote_shard_is_named(tiny_ckpt, tmp_path):
    origin = tmp_path / "origin"
    shutil.copytree(tiny_ckpt, origin)
    victim = sorted(origin.glob("*.safetensors"))[2]
    victim.unlink()
    with pytest.raises(CheckpointError, match=f"acme/tiny-v4/{victim.name}"):
        Checkpoint.open("acme/tiny-v4", remote=StandInHub(origin, tmp_path / "cache"))


def test_conversion_from_the_hub_matches_a_local_one_and_frees_source_shards(tiny_ckpt, outputs, tmp_path):
    from conftest import SHARD, run

    hub = StandInHub(tiny_ckpt, tmp_path / "cache")
    peak = {"shards": 0}
    download = hub.download

    def counting_download(filename: str) -> Path:
        got = download(filename)
        peak["shards"] = max(peak["shards"], len(list(hub.cache.glob("*.safetensors"))))
        return got

    hub.download = counting_download
    dst = tmp_path / "from-hub"
    run(hub.repo_id, dst, "fp8", remote=hub, delete_source_shards=True)
    local = Checkpoint.open(outputs["fp8"])
    streamed = Checkpoint.open(dst)
    assert list(streamed.tensors) == list(local.tensors)
    for name in local.tensors:
        assert torch.equal(streamed.read(name).reshape(-1).view(torch.uint8),
                           local.read(name).reshape(-1).view(torch.uint8)), name
    assert sorted(hub.downloads) == sorted(p.name for p in Checkpoint.open(tiny_ckpt).shards)
    assert not list(hub.cache.glob("*.safetensors")), "every source shard is deleted after its last use"
    # Peak: the source shards one output shard reads plus the next one, as the disk check plans it.
    from dsv4convert.convert.execute import source_windows
    from dsv4convert.convert.plan import build_plan
    from dsv4convert.convert.recipe import load_recipe

    plan = build_plan(Checkpoint.open(tiny_ckpt), load_recipe("fp8"), max_shard_bytes=SHARD)
    planned = max(len(w) for w in source_windows(plan.shards, None, 1))
    assert 2 <= peak["shards"] <= planned < len(hub.downloads)
