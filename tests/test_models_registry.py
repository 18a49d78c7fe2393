"""models/registry.py: a config.json names its release, and a feature asks the registry, never a model_type (#52).

* The preview's and 0731's configs are DeepSeek-V4's, V4.1's its own (checked before V4's: SGLang rewrites V4.1's
  architecture to V4's), anything else one error line naming what it says it is and what dsv4convert knows.
* A V4.1 checkpoint given to a command that does not handle it yet is refused in one line, nothing written.
* Adding a release is a module with the protocol's answers and one entry in ``RELEASES``: a toy release,
  registered here, is planned by ``inspect --expected`` through the same path the real ones take.
"""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from dsv4convert.cli import main
from dsv4convert.models import registry
from dsv4convert.models.deepseek_v4 import release as v4
from dsv4convert.models.deepseek_v41 import release as v41
from dsv4convert.models.deepseek_v4.configs import with_dspark, with_num_layers
from dsv4convert.models.deepseek_v4.layout import AttentionReach
from dsv4convert.synth import preset_config, reference_config

V41_CONFIG = Path(__file__).parent / "data" / "deepseek-v4.1-flash-config.json"


def test_each_config_names_its_release():
    tiny = preset_config("tiny")
    assert registry.release_of(reference_config()) is v4
    assert registry.release_of(with_dspark(with_num_layers(tiny, 5, mtp=False))) is v4
    assert registry.release_of(json.loads(V41_CONFIG.read_text())) is v41
    assert v4.fp8_block(v4.read_config(tiny, "tiny")) == (128, 128)
    assert v41.fp8_block(v41.read_config(json.loads(V41_CONFIG.read_text()), "v41")) == (32, 32)


def test_an_unknown_release_is_one_error_line(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    assert main(["inspect", "--expected", "--config", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "\n" not in err and "'llama'" in err and "DeepSeek-V4.1-Flash" in err


def test_a_v41_checkpoint_is_refused_by_what_does_not_handle_it_yet(tmp_path, capsys):
    src = tmp_path / "v41"
    src.mkdir()
    (src / "config.json").write_text(V41_CONFIG.read_text())
    save_file({"embed.weight": torch.zeros(2, 2, dtype=torch.bfloat16)}, str(src / "model.safetensors"))
    assert main(["calibrate", "--src", str(src), "--output", str(tmp_path / "scales"), "--calibration-data",
                 str(src / "config.json"), "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "\n" not in err and "not yet" in err and "config.json" in err, err
    # compare reads V4.1 checkpoints (tests/test_compare_v41.py): this one-tensor checkpoint fails its layout check.
    assert main(["compare", "--base", str(src), "--variant", str(src), "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "\n" not in err and "embed.weight" in err, err
    # inspect reads V4.1 checkpoints (tests/test_v41_convert.py): this one-tensor checkpoint fails its layout check.
    assert main(["inspect", str(src)]) == 1
    assert "missing" in capsys.readouterr().out
    # The converters take V4.1 now (tests/test_v41_convert.py): this one-tensor checkpoint is refused by its headers.
    dst = tmp_path / "out"
    assert main(["to-fp8", "--src", str(src), "--dst", str(dst)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "\n" not in err and "embed.weight" in err, err
    assert not dst.exists()


def test_a_new_release_is_one_module_and_one_registry_entry(tmp_path, capsys, monkeypatch):
    toy = types.SimpleNamespace(
        NAME="Toy-1", not_yet=lambda command: None,
        matches=lambda config: config.get("model_type") == "toy",
        read_config=lambda config, source: config,
        fp8_block=lambda cfg: (64, 64),
        attention_reach=lambda cfg: AttentionReach(128, (0,), None),
        expected_report=lambda config, source: {
            "release": "Toy-1", "variant": "native", "drafter": "none", "drafter_description": "no drafter",
            "tensor_count": 1, "total_bytes": 2 * config["width"], "shard_bytes": [2 * config["width"]],
            "roles": [{"role": "embed", "tensors": 1, "bytes": 2 * config["width"], "dtypes": {"BF16": 1}}],
            "tensors": [{"name": "embed.weight", "dtype": "BF16", "shape": [config["width"]]}]})
    # The protocol's every member, which docs/architecture.md's "Add a model release" names and each release has.
    members = {*registry.Release.__annotations__, *(n for n in vars(registry.Release) if not n.startswith("_"))}
    docs = (Path(__file__).parents[1] / "docs" / "architecture.md").read_text(encoding="utf-8")
    path_doc = docs.split("## Add a model release", 1)[1].split("\n## ", 1)[0]
    assert members and all(f"`{m}`" in path_doc for m in members), members
    assert all(hasattr(release, m) for release in (toy, *registry.RELEASES) for m in members)
    monkeypatch.setattr(registry, "RELEASES", (toy, *registry.RELEASES))
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "toy", "width": 8}))
    assert main(["inspect", "--expected", "--config", str(path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["release"] == "Toy-1" and report["total_bytes"] == 16
