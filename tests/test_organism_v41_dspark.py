"""The V4.1 organism's DSpark drafter (``python -m dsv4convert.organism.dspark_v41``, docs/organism.md), on the CPU.

* ``--tiny`` trains and writes the drafter; a second tiny training with the same seed stores the same bytes, and
  the training moved the weights off their initialisation.
* ``synth --preset organism-v41 --drafter dspark`` (its data directory pointed at the tiny run's output) writes V4.1's
  layout: ``inspect`` finds a V4.1 checkpoint with a DSpark drafter and no problem, exactly the tensors the release
  plans, every backbone tensor with the shipped organism's bytes, the ``text_config`` the base's plus the drafter's
  keys (checked by ``models/deepseek_v41/config.py``).
* Read back (``V41Drafter.from_source``), the drafter is the trained one under the stored formats, exactly.
* SGLang 0.5.23's own V4.1 DSpark draft (``DeepseekV4ForCausalLMDSpark``, ``sglang_v41_oracle.load_draft``) loads the
  assembled checkpoint: every ``mtp.*`` tensor reaches its parameter but the stages' ``gate.bias_vl``, which SGLang
  drops by design (``_remap_dspark_weight_name``), and the FP8 ``wo_a`` scales, consumed dequantizing ``wo_a``.
* Without the drafter's data ``synth`` refuses, naming the directory, and writes nothing.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import sglang_v41_oracle as v41
import torch
from test_dspark_loading import _outside_its_stage, check_draft
from test_sglang_loading import CONSUMED
from test_v41_drafter_loading import v41_landings
from tokenizers import Tokenizer

from dsv4convert.checkpoint import Checkpoint
from dsv4convert.cli import main
from dsv4convert.inspection_v41 import inspect_v41
from dsv4convert.model.v41.dspark import V41Drafter
from dsv4convert.model.v41.weights import WeightSource
from dsv4convert.models.deepseek_v41.config import read_config
from dsv4convert.models.deepseek_v41.inventory import native_inventory
from dsv4convert.organism import dspark_v41, export
from dsv4convert.organism.dspark import DraftSettings
from dsv4convert.organism.export import DSPARK_PROVENANCE_NAME, DSPARK_TENSORS_NAME
from dsv4convert.organism.v41 import HELDOUT_NAME, stored_values
from dsv4convert.synth import ORGANISM_V41_DIR

STAGES = 3
BIAS_VL = [f"mtp.{s}.ffn.gate.bias_vl" for s in range(STAGES)]
WO_A_SCALES = [f"mtp.{s}.attn.wo_a.scale" for s in range(STAGES)]
SEED = 5


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(ORGANISM_V41_DIR / "tokenizer.json"))


@pytest.fixture(scope="module")
def config(tokenizer) -> dict:
    return dspark_v41.dspark_v41_config(json.loads((ORGANISM_V41_DIR / "config.json").read_text()), tokenizer)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    """``--tiny`` on the CPU: the drafter's directory it writes. No "dspark" in the path above it (vLLM's rule)."""
    out = tmp_path_factory.mktemp("drafting")
    assert dspark_v41.main(["--out", str(out), "--tiny", "--device", "cpu", "--seed", str(SEED)]) == 0
    return out / dspark_v41.CHECKPOINT_DIR


@pytest.fixture(scope="module")
def trained(tokenizer, config):
    """The tiny run's training again, by the library (what the command runs)."""
    settings = DraftSettings(**{**dspark_v41.V41_DATA, **dspark_v41.TINY, "seed": SEED})
    text = (ORGANISM_V41_DIR / HELDOUT_NAME).read_text(encoding="utf-8")
    return dspark_v41.train(config, tokenizer, text, settings, device=torch.device("cpu"),
                            language_docs=dspark_v41.TINY_LANGUAGE_DOCS, log=lambda _: None)


@pytest.fixture(scope="module")
def assembled(tiny_run, tmp_path_factory) -> Path:
    """``synth --preset organism-v41 --drafter dspark`` with the package's drafter data being the tiny run's."""
    dst = tmp_path_factory.mktemp("assembled") / "organism"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(export, "ORGANISM_V41_DSPARK_DIR", tiny_run)
        assert main(["synth", "--preset", "organism-v41", "--drafter", "dspark", "--dst", str(dst)]) == 0
    return dst


def test_the_tiny_run_is_deterministic_for_a_seed_and_trains(tiny_run, trained, config, tmp_path):
    again = dspark_v41.write_drafter(tmp_path / "again", trained.drafter, config, {})
    assert (again / DSPARK_TENSORS_NAME).read_bytes() == (tiny_run / DSPARK_TENSORS_NAME).read_bytes()
    provenance = json.loads((tiny_run / DSPARK_PROVENANCE_NAME).read_text())
    assert provenance["steps"] == trained.steps_run == dspark_v41.TINY["steps"]
    assert provenance["curve"][-1]["ce"] == trained.curve[-1]["ce"]
    assert provenance["config"] == dspark_v41.drafter_keys(config)
    heldout = provenance["acceptance"]["heldout"]
    assert len(heldout["accepted"]) == 5 and heldout["blocks"] > 0
    torch.manual_seed(SEED)
    fresh = dspark_v41.native_state(dspark_v41.new_drafter(trained.drafter.cfg, trained.settings.initializer_range))
    state = dspark_v41.native_state(trained.drafter)
    assert fresh.keys() == state.keys()
    moved = [n for n in state if not torch.equal(state[n], fresh[n])]
    assert len(moved) > len(state) // 2 and "mtp.2.markov_head.head.weight" in moved


def test_synth_writes_v41s_layout_with_the_shipped_backbone(assembled, tiny_run, capsys):
    ckpt, base = Checkpoint.open(assembled), Checkpoint.open(ORGANISM_V41_DIR)
    inspection = inspect_v41(ckpt)
    assert inspection["ok"] and inspection["variant"] == "native" and inspection["drafter"] == "dspark", \
        inspection["problems"]
    cfg = read_config(ckpt.config)
    assert cfg.dspark.stages == STAGES and cfg.dspark.target_layer_ids == (3, 4, 5)
    assert cfg.experts_in("mtp.0") == (dspark_v41.EXPERTS, dspark_v41.EXPERTS_PER_TOKEN)
    assert list(ckpt.tensors) == [s.name for s in native_inventory(cfg)]
    keys = json.loads((tiny_run / DSPARK_PROVENANCE_NAME).read_text())["config"]["text_config"]
    assert ckpt.config["text_config"] == base.config["text_config"] | keys
    assert {k: v for k, v in ckpt.config.items() if k != "text_config"} == \
        {k: v for k, v in base.config.items() if k != "text_config"}
    backbone = list(base.tensors)
    assert sorted(n for n in ckpt.tensors if not n.startswith("mtp.")) == sorted(backbone)
    for name in backbone:
        mine, theirs = ckpt.read(name), base.read(name)
        assert mine.dtype == theirs.dtype and torch.equal(mine.view(torch.uint8), theirs.view(torch.uint8)), name
    for name in ("heldout.txt", "tokenizer.json", "organism-v41.json"):
        assert (assembled / name).read_bytes() == (ORGANISM_V41_DIR / name).read_bytes(), name
    capsys.readouterr()
    assert main(["inspect", str(assembled), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["drafter"] == "dspark" and not report["problems"]


def test_read_back_the_drafter_is_the_trained_one_under_the_stored_formats(assembled, trained):
    source = WeightSource(Checkpoint.open(assembled), "cpu", torch.float32)
    read = V41Drafter.from_source(source)
    cfg = trained.drafter.cfg
    want = stored_values(dspark_v41.native_state(trained.drafter), dspark_v41.drafter_groups(cfg), cfg)
    params = dict(read.named_parameters())
    paths = read.native_paths()
    assert sorted(paths) == sorted(want)
    for native, path in paths.items():
        assert torch.equal(params[path].float(), want[native]), native
    assert params[paths["mtp.2.markov_head.head.weight"]].dtype == torch.bfloat16   # as SGLang holds it


def test_sglang_v41_dspark_draft_loads_every_drafter_tensor(assembled):
    """Under the compact verify mode, so that the confidence head is built and must land too."""
    loaded = v41.load_draft(assembled, gpu="sm90", env={"SGLANG_RAGGED_VERIFY_MODE": "compact"})
    assert type(loaded.model).__name__ == "DeepseekV4ForCausalLMDSpark" and loaded.error is None, loaded.error
    assert loaded.model.num_stages == STAGES and loaded.model.confidence_head is not None
    ckpt = Checkpoint.open(assembled)
    report = check_draft(ckpt, loaded, v41_landings)
    mtp = sorted(n for n in ckpt.tensors if n.startswith("mtp."))
    assert sorted(v.tensor for v in report.verdicts) == mtp
    assert sorted((v.tensor, v.outcome) for v in report.bad()) == [(n, "dropped") for n in BIAS_VL]
    assert report.holes == [] and report.strays == [] and loaded.not_found == []
    assert sorted(v.tensor for v in report.verdicts if v.outcome == CONSUMED) == WO_A_SCALES
    assert sorted(n for n in mtp if not loaded.reached.get(n)) == sorted([*BIAS_VL, *WO_A_SCALES])
    assert _outside_its_stage(loaded) == {}
    assert {loaded.params[f"stages.{s}.mlp.experts.w2_weight"].shape[0] for s in range(STAGES)} == \
        {dspark_v41.EXPERTS}


def test_synth_without_the_drafters_data_names_its_directory(tmp_path, monkeypatch, capsys):
    missing = tmp_path / "organism-v41-drafter"
    monkeypatch.setattr(export, "ORGANISM_V41_DSPARK_DIR", missing)
    dst = tmp_path / "out"
    assert main(["synth", "--preset", "organism-v41", "--drafter", "dspark", "--dst", str(dst)]) == 2
    err = capsys.readouterr().err
    assert str(missing) in err and "no DSpark drafter for the V4.1 organism" in err and not dst.exists()
    assert main(["synth", "--preset", "organism-v41", "--drafter", "mtp", "--dst", str(dst)]) == 2
    assert "--drafter mtp" in capsys.readouterr().err and not dst.exists()


def test_drafter_none_is_the_shipped_organism_as_it_is(tmp_path):
    dst = tmp_path / "bare"
    assert main(["synth", "--preset", "organism-v41", "--drafter", "none", "--dst", str(dst)]) == 0
    shipped = sorted(p.name for p in ORGANISM_V41_DIR.iterdir() if p.is_file())
    assert sorted(p.name for p in dst.iterdir()) == shipped
    assert all((dst / name).read_bytes() == (ORGANISM_V41_DIR / name).read_bytes() for name in shipped)
    assert read_config(Checkpoint.open(dst).config).dspark is None
