"""Hostile inputs on the 0731 layout (a tiny DSpark checkpoint): each is one ``error:`` line naming the key or the
tensor and its file, exit status 2, no traceback and nothing that looks finished, whichever command reads it
(``inspect``, a conversion, ``validate``). The config reader checks every value before anything is sized by it,
two stored names for one module are refused, and ``validate`` reads every tensor for NaN/Inf (#52).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dsv4convert.cli import main
from dsv4convert.models.deepseek_v4.configs import with_dspark
from dsv4convert.synth import preset_config, synthesize

INDEX = "model.safetensors.index.json"
LAST_STAGE = "mtp.2"  # the tiny drafter has 3 stages


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """The tiny DSpark checkpoint, made once; cases hard-link its shards and replace only what they change."""
    return synthesize(tmp_path_factory.mktemp("hostile") / "src", with_dspark(preset_config("tiny")), seed=0)


def copy_of(source: Path, dst: Path) -> Path:
    """A copy whose shards are hard links: a case must replace (unlink, then write) any file it changes."""
    return Path(shutil.copytree(source, dst, copy_function=os.link))


def with_config(source: Path, dst: Path, **changes) -> Path:
    root = copy_of(source, dst)
    config = json.loads((root / "config.json").read_text())
    config.update(changes)
    (root / "config.json").unlink()
    (root / "config.json").write_text(json.dumps(config))
    return root


def shard_of(root: Path, tensor: str) -> str:
    return json.loads((root / INDEX).read_text())["weight_map"][tensor]


def with_shard(source: Path, dst: Path, tensor: str, edit) -> tuple[Path, str]:
    """A copy in which ``edit`` changed the tensors of the shard holding ``tensor`` (index updated to match)."""
    root = copy_of(source, dst)
    shard = shard_of(root, tensor)
    tensors = load_file(root / shard)
    edit(tensors)
    (root / shard).unlink()
    save_file(tensors, root / shard)
    index = json.loads((root / INDEX).read_text())
    index["weight_map"] = {**{k: v for k, v in index["weight_map"].items() if v != shard},
                           **{k: shard for k in tensors}}
    index.pop("metadata", None)
    (root / INDEX).unlink()
    (root / INDEX).write_text(json.dumps(index))
    return root, shard


def refused(capsys, argv: list[str], dst: Path | None = None) -> str:
    """Run the command line; require exit 2, exactly one ``error:`` line, no traceback, no finished output."""
    code = main(argv)
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert code == 2, (code, captured.out[-400:], err[-400:])
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    if dst is not None:
        assert not (dst / INDEX).exists()
    return err


def every_command(capsys, root: Path) -> list[str]:
    """The error of ``inspect``, a conversion (written for real: the refusal comes before any byte) and
    ``validate``, each checked by :func:`refused`."""
    dst = root.parent / f"{root.name}-out"
    errors = [refused(capsys, ["inspect", str(root)]),
              refused(capsys, ["to-fp8", "--src", str(root), "--dst", str(dst), "--no-progress"], dst),
              refused(capsys, ["validate", str(root), "--device", "cpu", "--no-progress"])]
    assert not (root.parent / f"{root.name}-validation").exists()
    return errors


def test_the_unmodified_source_passes(capsys, source):
    """The control: what the cases change is all that is wrong with them."""
    assert main(["inspect", str(source)]) == 0
    capsys.readouterr()


# ---------------------------------------------------------------- two stored names for one module


@pytest.mark.parametrize("real, alias", [("embed", "markov_w1"), ("head", "markov_w2")])
def test_markov_head_under_release_name_and_vllm_alias_is_refused(capsys, source, tmp_path, real, alias):
    """Each half of the Markov head: a zeroed alias stored after the real tensor used to win silently."""
    real = f"{LAST_STAGE}.markov_head.{real}.weight"
    alias = f"{LAST_STAGE}.markov_head.{alias}.weight"

    def add_zeroed_alias(tensors):
        tensors[alias] = torch.zeros_like(tensors[real])

    root, shard = with_shard(source, tmp_path / "alias", real, add_zeroed_alias)
    for err in every_command(capsys, root):
        assert real in err and alias in err and shard in err, err


def test_markov_head_under_the_alias_alone_still_passes(capsys, source, tmp_path):
    """vLLM outputs store the head under its alias only: one name per module is no duplicate."""
    real = f"{LAST_STAGE}.markov_head.embed.weight"

    def rename(tensors):
        tensors[f"{LAST_STAGE}.markov_head.markov_w1.weight"] = tensors.pop(real)

    root, _ = with_shard(source, tmp_path / "renamed", real, rename)
    assert main(["inspect", str(root)]) == 0
    capsys.readouterr()


# ---------------------------------------------------------------- counts, types and ranges of config values


@pytest.mark.parametrize("key, value", [
    ("dspark_n_routed_experts", 10**9),            # sized the inventory until the process was killed
    ("n_routed_experts", 10**9),
    ("dspark_n_routed_experts", "eight"),          # a ValueError traceback
    ("dspark_n_routed_experts", [8]),
    ("dspark_num_experts_per_tok", "two"),
    ("dspark_n_routed_experts", 8.7),              # converted as 8
    ("dspark_num_experts_per_tok", 1000),          # top-k beyond the 8 experts
    ("dspark_n_routed_experts", 0),                # fell back to the backbone's count
    ("dspark_n_routed_experts", 16),               # more experts than any stage stores
    ("n_routed_experts", 16),
])
def test_bad_expert_counts_are_refused_by_every_command(capsys, source, tmp_path, key, value):
    root = with_config(source, tmp_path / "case", **{key: value})
    for err in every_command(capsys, root):
        assert f"'{key}'" in err and "config.json" in err, err


@pytest.mark.parametrize("key, value", [
    ("hc_mult", 0), ("o_groups", 3), ("head_dim", -32), ("num_experts_per_tok", 9), ("num_hash_layers", 99),
    ("vocab_size", True), ("num_hidden_layers", 5.0), ("dspark_markov_rank", 10**6), ("index_n_heads", None),
    ("confidence_head_with_markov", "yes"), ("dspark_target_layer_ids", [2, 3, 4.0]), ("dspark_noise_token_id", 512),
    ("sliding_window", 0), ("index_topk", "64"), ("bos_token_id", 10**9),   # read by compare and the organism
])
def test_every_value_the_layout_reads_is_checked(capsys, source, tmp_path, key, value):
    root = with_config(source, tmp_path / "case", **{key: value})
    err = refused(capsys, ["inspect", str(root)])
    assert f"'{key}'" in err and "config.json" in err, err


def test_compress_ratios_must_be_integers(capsys, source, tmp_path):
    ratios = json.loads((source / "config.json").read_text())["compress_ratios"]
    root = with_config(source, tmp_path / "case", compress_ratios=[float(r) for r in ratios])
    assert "'compress_ratios'" in refused(capsys, ["inspect", str(root)])


# ---------------------------------------------------------------- NaN and Inf


def _poisoned(value: float | int):
    """Element 1 set to ``value``: a float for BF16/F32 tensors, a byte for FP8 (0x7F: E4M3's NaN) and E8M0
    (0xFF: its NaN) ones."""
    def poison(tensors, tensor):
        t = tensors[tensor]
        if isinstance(value, int):
            raw = t.view(torch.uint8).clone()
            raw.view(-1)[1] = value
            tensors[tensor] = raw.view(t.dtype)
        else:
            t.view(-1)[1] = value
    return poison


@pytest.mark.parametrize("tensor, value", [(f"{LAST_STAGE}.norm.weight", float("nan")),
                                           ("layers.1.hc_attn_base", float("inf")),
                                           ("layers.1.attn.wq_a.weight", 0x7F),
                                           ("layers.1.attn.wq_a.scale", 0xFF)])
def test_validate_reads_every_tensor_for_nan_and_inf(capsys, source, tmp_path, tensor, value):
    """Without ``--against`` as with it, in BF16, F32, FP8 and E8M0 tensors alike."""
    def poison(tensors):
        _poisoned(value)(tensors, tensor)

    root, shard = with_shard(source, tmp_path / "poisoned", tensor, poison)
    alone = refused(capsys, ["validate", str(root), "--device", "cpu", "--no-progress"])
    assert tensor in alone and shard in alone and str(root) in alone, alone
    as_source = refused(capsys, ["validate", str(source), "--against", str(root), "--device", "cpu", "--no-progress"])
    assert tensor in as_source and f"{root}/{shard}" in as_source and "--against" in as_source, as_source
    assert not (root.parent / f"{root.name}-validation").exists()


# ---------------------------------------------------------------- draft tensors where DSpark has none


def _experts_beyond(tensors):
    for name in [n for n in tensors if n.startswith("mtp.1.ffn.experts.0.")]:
        tensors[name.replace("experts.0.", "experts.8.")] = tensors[name].clone()


def _markov_head_on_the_first_stage(tensors):
    tensors["mtp.0.markov_head.embed.weight"] = torch.zeros(512, 64, dtype=torch.bfloat16)


@pytest.mark.parametrize("edit, near, tensor, reason", [
    (_experts_beyond, "mtp.1.ffn.experts.0.w1.weight", "mtp.1.ffn.experts.8.",
     "out of range for dspark_n_routed_experts"),
    (_markov_head_on_the_first_stage, "mtp.0.main_proj.weight", "mtp.0.markov_head.embed.weight",
     f"last stage, {LAST_STAGE}"),
])
def test_draft_tensors_outside_their_stage_are_refused_in_dspark_terms(capsys, source, tmp_path, edit, near, tensor,
                                                                      reason):
    """A converter refuses in one line; ``inspect`` and ``validate``, whose finding it is, fail (exit 1) and say
    the same reason beside the tensor, nothing about the preview's MTP block."""
    root, shard = with_shard(source, tmp_path / "case", near, edit)
    dst = tmp_path / "out"
    err = refused(capsys, ["to-fp8", "--src", str(root), "--dst", str(dst), "--no-progress"], dst)
    assert tensor in err and shard in err and reason in err and "e_proj" not in err, err
    for argv in (["inspect", str(root)], ["validate", str(root), "--device", "cpu", "--no-progress"]):
        assert main(argv) == 1, argv
        said = [line for line in capsys.readouterr().out.splitlines() if tensor in line]
        assert said and all(reason in line and "e_proj" not in line for line in said), (argv, said)


# ---------------------------------------------------------------- a missing --src


@pytest.mark.parametrize("src", ["./nonexistent", "../nonexistent/dir", "/nonexistent/dir", "a/b/c", "some/dir"])
def test_a_missing_src_is_one_error_line(capsys, monkeypatch, tmp_path, src):
    """``some/dir`` looks like a repo id, so the Hub (offline here) is asked, and its multi-line answer is
    joined into the one line; the others are never repo ids."""
    import huggingface_hub.constants as hf_constants

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    dst = tmp_path / "out"
    err = refused(capsys, ["to-fp8", "--src", src, "--dst", str(dst), "--no-progress"], dst)
    assert err.startswith(f"error: {src}: no such local directory"), err
    assert ("Hugging Face repo:" in err) == (src == "some/dir"), err
