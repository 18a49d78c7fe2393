"""A conversion is complete only once its last step has run, and that step works for every model it accepts.

The last step (config, model card with its ``fit`` lines, index) once divided by zero for a model with no
compressed layer (vLLM's growing caches cost nothing per token), after the whole conversion, leaving a
destination that looked complete. Here: small shapes the converters accept go through every recipe and
engine choice and the card's figures are checked; a failure in the last step leaves no index, readers refuse
the directory naming ``--resume``, and ``--resume`` finishes without converting a shard again.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import pytest

from dsv4convert.checkpoint import INDEX_NAME, Checkpoint
from dsv4convert.checkpoint.reader import CONVERSION_STATE
from dsv4convert.cli import main
from dsv4convert.convert import execute
from dsv4convert.errors import CheckpointError, DSV4Error
from dsv4convert.fit.source import from_checkpoint
from dsv4convert.fit.verdict import Gpu, sglang_server, vllm_server
from dsv4convert.models.deepseek_v4.configs import with_num_layers
from dsv4convert.synth import preset_config, synthesize

from conftest import run

RECIPES = ("fp8", "nvfp4", "nvfp4-mtp-mxfp4", "w4a16", "bf16")
ENGINE_CHOICES = ("both", "sglang", "vllm")


def _shapes() -> dict[str, dict]:
    tiny = preset_config("tiny")
    # One backbone layer, sliding-window only (no compressed KV per token anywhere), a hash layer, the MTP block.
    one_sliding = with_num_layers(tiny, 1)
    # Compressed layers only, no hash layer, no MTP draft, one routed expert chosen per token.
    compressed = with_num_layers(tiny, 2, mtp=False)
    compressed.update(compress_ratios=[4, 128], num_hash_layers=0, n_routed_experts=2, num_experts_per_tok=1)
    return {"one-sliding-layer": one_sliding, "compressed-no-mtp": compressed}


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("shapes")
    return {name: synthesize(root / name, config, seed=1) for name, config in _shapes().items()}


_SIZED = re.compile(r"Sized by `dsv4convert fit` for this command on ([^:]+): ([\d.]+) GiB of weights per GPU, "
                    r"([\d,]+) KV tokens\.")


@pytest.mark.parametrize("shape", list(_shapes()))
def test_every_recipe_and_engine_finishes_with_a_card(sources, shape, tmp_path):
    """Each conversion either is refused before anything is written, or finishes: index last, state complete,
    and a card whose fit line for every launch it prints is a number of KV tokens the GPU really holds."""
    finished = 0
    for recipe in RECIPES:
        for engine in ENGINE_CHOICES:
            dst = tmp_path / f"{recipe}@{engine}"
            try:
                result = run(sources[shape], dst, recipe, engine=engine)
            except DSV4Error as exc:
                assert exc.tensor or exc.file, f"{recipe}@{engine}: a refusal names its file or tensor"
                assert not dst.exists() or not any(dst.iterdir()), f"{recipe}@{engine}: refused after writing"
                continue
            finished += 1
            assert (dst / INDEX_NAME).is_file()
            assert '"complete": true' in (dst / CONVERSION_STATE).read_text()
            card = (dst / "README.md").read_text()
            sized = _SIZED.findall(card)
            # Three GPU families per engine the output is made for, each with a fit line.
            assert len(sized) == 3 * len(result.engines), f"{recipe}@{engine}: {len(sized)} fit lines"
            for gpu, weights, tokens in sized:
                assert float(weights) >= 0 and int(tokens.replace(",", "")) > 0, (recipe, engine, gpu)
            Checkpoint.open(dst)   # readable as a finished checkpoint
    assert finished >= len(RECIPES), "most recipes are servable on this shape"


@pytest.mark.parametrize("shape", list(_shapes()))
def test_fit_figures_on_a_gpu_that_holds_nothing(sources, shape, tmp_path):
    """A GPU too small to hold anything gives 'does not fit' with zero KV tokens from both engines' sizing, not
    an exception or a negative count."""
    run(sources[shape], tmp_path / "fp8", "fp8")
    source = from_checkpoint(tmp_path / "fp8")
    tiny_gpu = Gpu("1 GiB GPU", "sm90", 1024)
    for server in (sglang_server(source, tiny_gpu, "server", 1, mtp=False), vllm_server(source, tiny_gpu, 1, mtp=False)):
        assert not server.fits and server.kv_tokens == 0 and server.shortfall_bytes > 0, server.engine


def _digests(root: Path) -> dict[str, str]:
    """Every file's SHA-256; the card with the directory's own path taken out, provenance's start time left out."""
    out = {}
    for p in sorted(root.iterdir()):
        if p.is_file() and p.name != "provenance.json":
            out[p.name] = hashlib.sha256(p.read_bytes().replace(str(root).encode(), b"DIR")).hexdigest()
    return out


def test_a_failed_last_step_leaves_an_unfinished_output_that_resume_finishes(tiny_ckpt, tmp_path, monkeypatch, capsys):
    reference = tmp_path / "reference"
    run(tiny_ckpt, reference, "nvfp4")
    dst = tmp_path / "dst"

    def broken_card(**_):
        raise ZeroDivisionError("float division by zero")

    monkeypatch.setattr(execute, "render_model_card", broken_card)
    with pytest.raises(DSV4Error) as failed:
        run(tiny_ckpt, dst, "nvfp4")
    message = str(failed.value)
    assert "ZeroDivisionError" in message and "--resume" in message and "without converting again" in message
    assert not (dst / INDEX_NAME).exists() and not (dst / "README.md").exists()
    shards = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in dst.glob("*.safetensors")}
    assert shards, "the converted shards are kept"

    # The tool's own readers refuse it, in one line that says how to finish.
    with pytest.raises(CheckpointError, match="unfinished conversion.*--resume"):
        Checkpoint.open(dst)
    capsys.readouterr()
    assert main(["validate", str(dst)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--resume" in err[0]

    monkeypatch.undo()
    run(tiny_ckpt, dst, "nvfp4", resume=True)
    assert {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in dst.glob("*.safetensors")} == shards
    assert _digests(dst) == _digests(reference)
