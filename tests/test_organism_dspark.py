"""The organism that drafts with DSpark (``dsv4convert/data/organism-dspark``, docs/organism.md), on the CPU.

* ``synth --preset organism --drafter dspark`` writes 0731's layout: ``inspect`` finds a DSpark checkpoint with
  no problem and exactly the tensors the layout plans (the MTP block gone, three stages under ``mtp.*``), the
  config's drafter keys those ``dspark.json`` ships; every backbone tensor holds the shipped organism's bytes.
* SGLang 0.5.23's own DSpark draft (``sglang_oracle``, launched as the model card launches it) loads every
  drafter tensor into its own stage; only the confidence head is dropped, by SGLang's default static verify.
* The shipped drafter's acceptance on the held-out rows its provenance names, recomputed here from the written
  checkpoint read back, is what ``dspark.json`` says (it was measured on an H200).
* ``--drafter none`` writes the backbone alone; a drafter file that lacks a tensor is refused, naming it.
* Training is deterministic for a seed and moves the weights (two tiny runs on the frozen organism).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import sglang_oracle as sgl
import torch
from test_dspark_loading import STATIC_DROPPED, _outside_its_stage, check_draft, dspark_launch
from tokenizers import Tokenizer

from dsv4convert.checkpoint import Checkpoint
from dsv4convert.checkpoint.reader import read_header, read_tensor
from dsv4convert.cli import main
from dsv4convert.errors import DSV4Error
from dsv4convert.inspection import inspect_checkpoint
from dsv4convert.models.deepseek_v4.layout import Drafter, ModelConfig, native_inventory
from dsv4convert.organism.dspark import DraftSettings, Target, draft_acceptance, heldout_rows, train_drafter
from dsv4convert.organism.export import (
    DSPARK_PROVENANCE_NAME,
    DSPARK_TENSORS_NAME,
    load_dspark_release,
    load_release,
    write_shard,
    write_with_drafter,
)
from dsv4convert.synth import ORGANISM_DIR, ORGANISM_DSPARK_DIR

PROVENANCE = json.loads((ORGANISM_DSPARK_DIR / DSPARK_PROVENANCE_NAME).read_text())


@pytest.fixture(scope="module")
def organism_dspark(tmp_path_factory) -> Path:
    """No path here may contain "dspark" (vLLM's rule; test_dspark_loading.source)."""
    dst = tmp_path_factory.mktemp("drafting") / "organism"
    assert main(["synth", "--preset", "organism", "--drafter", "dspark", "--dst", str(dst)]) == 0
    return dst


def test_synth_writes_the_0731_layout_with_the_shipped_backbone(organism_dspark):
    ckpt, base = Checkpoint.open(organism_dspark), Checkpoint.open(ORGANISM_DIR)
    inspection = inspect_checkpoint(ckpt)
    assert inspection.ok and inspection.config.drafter is Drafter.DSPARK and inspection.config.dspark.stages == 3
    assert list(ckpt.tensors) == [s.name for s in native_inventory(ModelConfig.from_dict(ckpt.config))]
    for key, value in PROVENANCE["config"].items():
        assert ckpt.config[key] == value, key
    assert {k: v for k, v in ckpt.config.items() if k not in PROVENANCE["config"]} == \
        {k: v for k, v in base.config.items() if k not in PROVENANCE["config"]}
    backbone = [n for n in base.tensors if not n.startswith("mtp.")]
    assert [n for n in ckpt.tensors if not n.startswith("mtp.")] == backbone
    for name in backbone:
        mine, theirs = ckpt.read(name), base.read(name)
        assert mine.dtype == theirs.dtype and torch.equal(mine.view(torch.uint8), theirs.view(torch.uint8)), name
    assert "mtp.0.e_proj.weight" in base.tensors and "mtp.0.e_proj.weight" not in ckpt.tensors
    assert "mtp.0.main_proj.weight" in ckpt.tensors and "mtp.2.markov_head.embed.weight" in ckpt.tensors
    assert (organism_dspark / DSPARK_PROVENANCE_NAME).read_text() == \
        (ORGANISM_DSPARK_DIR / DSPARK_PROVENANCE_NAME).read_text()
    assert (organism_dspark / "heldout.txt").read_bytes() == (ORGANISM_DIR / "heldout.txt").read_bytes()


def test_sglang_dspark_draft_loads_the_organisms_drafter(organism_dspark):
    """On sm100: the organism's experts are MXFP4 as released, which SGLang runs there (sm90 needs FlashInfer)."""
    argv, env = dspark_launch(organism_dspark, "sm100")
    loaded = sgl.load_checkpoint(organism_dspark, argv, gpu="sm100", env=env, draft=True)
    assert type(loaded.model).__name__ == "DeepseekV4ForCausalLMDSpark" and loaded.error is None, loaded.error
    assert loaded.model.num_stages == 3
    ckpt = Checkpoint.open(organism_dspark)
    report = check_draft(ckpt, loaded)
    assert [(v.tensor, v.outcome) for v in report.bad()] == [(STATIC_DROPPED, "dropped")]
    assert report.holes == [] and report.strays == []
    assert _outside_its_stage(loaded) == {} and loaded.not_found == []
    assert sorted(v.tensor for v in report.verdicts) == sorted(n for n in ckpt.tensors if n.startswith("mtp."))


def test_the_shipped_acceptance_is_what_the_cpu_recomputes(organism_dspark):
    backbone, drafter = load_dspark_release(organism_dspark)
    tokenizer = Tokenizer.from_file(str(organism_dspark / "tokenizer.json"))
    rows = heldout_rows(tokenizer, (organism_dspark / "heldout.txt").read_text(encoding="utf-8"),
                        PROVENANCE["measured_on"]["heldout_sequences"])
    got = draft_acceptance(drafter, Target(backbone, Checkpoint.open(organism_dspark).config), rows)
    want = PROVENANCE["acceptance"]["heldout"]
    assert got["blocks"] == want["blocks"] > 1000
    # measured on an H200: float32 there and here differ only in rounding, which may flip a near-tie or two
    assert got["agreement"] == pytest.approx(want["agreement"], abs=2e-3)
    assert got["accepted"] == pytest.approx(want["accepted"], abs=2e-3)
    assert got["expected_accept_length"] == pytest.approx(want["expected_accept_length"], abs=1e-2)
    assert want["accepted"][0] > 0.5       # the shipped drafter drafts: its first token agrees more often than not


def test_drafter_none_is_the_backbone_alone(tmp_path):
    assert main(["synth", "--preset", "organism", "--drafter", "none", "--dst", str(tmp_path / "bare")]) == 0
    ckpt = Checkpoint.open(tmp_path / "bare")
    assert inspect_checkpoint(ckpt).ok and ckpt.config["num_nextn_predict_layers"] == 0
    assert not any(n.startswith("mtp.") for n in ckpt.tensors) and ckpt.config.get("dspark_block_size") is None


def test_a_drafter_file_missing_a_tensor_is_refused(tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    shutil.copyfile(ORGANISM_DSPARK_DIR / DSPARK_PROVENANCE_NAME, broken / DSPARK_PROVENANCE_NAME)
    entries = read_header(ORGANISM_DSPARK_DIR / DSPARK_TENSORS_NAME).entries
    config = Checkpoint.open(ORGANISM_DIR).config | PROVENANCE["config"]
    specs = [s for s in native_inventory(ModelConfig.from_dict(config))
             if s.name in entries and s.name != "mtp.1.attn.wkv.weight"]
    write_shard(broken / DSPARK_TENSORS_NAME, ((s.name, read_tensor(entries[s.name])) for s in specs), specs)
    with pytest.raises(DSV4Error) as err:
        write_with_drafter(tmp_path / "out", ORGANISM_DIR, broken)
    assert err.value.tensor == "mtp.1.attn.wkv.weight" and DSPARK_TENSORS_NAME in str(err.value.file)
    assert not (tmp_path / "out").exists()


def test_training_is_deterministic_for_a_seed():
    tokenizer = Tokenizer.from_file(str(ORGANISM_DIR / "tokenizer.json"))
    config = Checkpoint.open(ORGANISM_DIR).config | PROVENANCE["config"]
    settings = DraftSettings(steps=1, tokens_per_step=128, min_length=64, max_length=64, warmup_steps=1,
                             eval_sequences=0, seed=3)
    target = load_release(ORGANISM_DIR)
    runs = [train_drafter(target, config, tokenizer, "", settings, device=torch.device("cpu"), log=lambda _: None)
            for _ in range(2)]
    first, second = (r.drafter.native_state() for r in runs)
    torch.manual_seed(settings.seed)
    fresh = type(runs[0].drafter)(config, initializer_range=settings.initializer_range)
    fresh.init_weights(target.backbone._init_weights)
    untrained = fresh.native_state()
    assert first.keys() == second.keys() == untrained.keys()
    assert all(torch.equal(first[n], second[n]) for n in first)
    moved = [n for n in first if not torch.equal(first[n], untrained[n])]
    assert len(moved) > len(first) // 2 and runs[0].curve[-1]["ce"] == runs[1].curve[-1]["ce"]
