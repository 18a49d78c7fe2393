"""--engine sglang|vllm|both on every converter and in recipes, and validate's per-engine verdict.

What each engine's loader really does with these layouts is checked with the engines' own code in
tests/test_sglang_loading.py (SGLang 0.5.23) and tests/test_vllm_loading.py (vLLM 0.33.0); here:
the converters' choices, refusals and notices, and that validate holds an output to the engines
it says it is for.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from dsv4convert.checkpoint import Checkpoint
from dsv4convert.cli import main
from dsv4convert.errors import RecipeError
from dsv4convert.convert.recipe import parse_recipe
from dsv4convert.validate.cli import validate

# Each converter -> (--engine, what its dry run must show: a format line, and the engine line).
DRY_RUNS = [
    ("to-fp8", "both", "mxfp4 -> fp8 x120", "for SGLang 0.5.23 and vLLM 0.33.0 (--engine both)"),
    ("to-fp8", "sglang", "mxfp4 -> fp8 x120", "for SGLang 0.5.23 (--engine sglang)"),
    ("to-nvfp4", "vllm", "kept as mxfp4 x24", "for vLLM 0.33.0 (--engine vllm)"),
    ("to-w4a16", "vllm", "fp8 -> bf16 x30", "for vLLM 0.33.0 (--engine vllm)"),
    ("to-w4a16", "sglang", "kept as fp8 x30", "for SGLang 0.5.23 (--engine sglang)"),
    ("to-bf16", "both", "mxfp4 -> bf16 x120", "for SGLang 0.5.23 and vLLM 0.33.0 (--engine both)"),
]


@pytest.mark.parametrize("command,engine,formats,engines", DRY_RUNS)
def test_every_converter_takes_engine(tiny_ckpt, tmp_path, capsys, command, engine, formats, engines):
    dst = tmp_path / "dry"
    assert main([command, "--src", str(tiny_ckpt), "--dst", str(dst), "--dry-run", "--engine", engine]) == 0
    out = capsys.readouterr().out
    assert formats in out and engines in out, out
    assert not dst.exists()


def test_convert_takes_the_engine_from_the_recipe_and_the_flag_wins(tiny_ckpt, tmp_path, capsys):
    shipped = (Path(__file__).parents[1] / "dsv4convert" / "recipes" / "w4a16.yaml").read_text()
    recipe = tmp_path / "w4a16-sglang.yaml"
    recipe.write_text(shipped.replace("name: w4a16\n", "name: w4a16-sglang\nengine: sglang\n"))
    argv = ["convert", "--recipe", str(recipe), "--src", str(tiny_ckpt), "--dst", str(tmp_path / "d"), "--dry-run"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "for SGLang 0.5.23 (--engine sglang)" in out and "kept as fp8" in out
    assert main([*argv, "--engine", "both"]) == 0
    out = capsys.readouterr().out
    assert "for SGLang 0.5.23 and vLLM 0.33.0 (--engine both)" in out and "fp8 -> bf16" in out


# What "both" costs against each engine alone, as the converter says it before any work.
COSTS = [
    ("to-w4a16", ["52 modules (attention 25, attention (mtp) 5, indexer 2, mtp_projection 2, shared_expert 15, "
                  "shared_expert (mtp) 3) are stored bf16; --engine sglang alone would store them as in the source "
                  "(fp8)"]),
    ("to-fp8", ["144 modules (routed_expert 120, routed_expert (mtp) 24) are stored fp8 (float32 scales); "
                "--engine sglang alone would store them fp8 (e8m0 scales)"]),
    ("to-nvfp4", ["24 modules (routed_expert (mtp) 24) are stored bf16; --engine sglang alone would store them fp8 "
                  "(e8m0 scales)",
                  "24 modules (routed_expert (mtp) 24) are stored bf16; --engine vllm alone would store them as in "
                  "the source (mxfp4)"]),
    ("to-bf16", []),
]


@pytest.mark.parametrize("command,costs", COSTS)
def test_the_converter_says_what_both_engines_cost(tiny_ckpt, tmp_path, capsys, command, costs):
    argv = [command, "--src", str(tiny_ckpt), "--dst", str(tmp_path / "dry"), "--dry-run"]
    assert main(argv) == 0
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note: for both engines")]
    assert notes == [f"note: for both engines {cost} (docs/engines.md)" for cost in costs]
    for engine in ("sglang", "vllm"):   # one engine: nothing was given up for the other
        if main([*argv, "--engine", engine]) == 0:
            assert "for both engines" not in capsys.readouterr().out


def test_fp8_e8m0_expert_scales_are_refused_for_vllm(tiny_ckpt, tmp_path, capsys):
    dst = tmp_path / "out"
    argv = ["to-fp8", "--src", str(tiny_ckpt), "--dst", str(dst), "--scale-dtype", "e8m0", "--no-progress"]
    assert main([*argv, "--engine", "vllm"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--engine vllm: vLLM 0.33.0 views E8M0 expert scales as raw bytes" in err
    assert "tensor 'layers.0.ffn.experts.0.w1'" in err and "--scale-dtype float32" in err
    assert not dst.exists() or not (dst / "model.safetensors.index.json").exists()


# An NVFP4 hybrid whose MTP experts are FP8-block whatever the engine: SGLang serves it, vLLM cannot.
SGLANG_ONLY = """name: nvfp4-fp8-draft
rules:
  - match: {role: routed_expert, mtp: false}
    format: nvfp4
  - match: {role: routed_expert, mtp: true}
    format: fp8
  - match: {}
    format: keep
    reason: as released
"""


def test_a_layout_one_engine_loads_is_made_for_it_by_default_and_refused_for_both(tiny_ckpt, tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(SGLANG_ONLY)
    argv = ["convert", "--recipe", str(recipe), "--src", str(tiny_ckpt), "--no-progress"]
    assert main([*argv, "--dst", str(tmp_path / "dry"), "--dry-run"]) == 0
    captured = capsys.readouterr()
    assert "for SGLang 0.5.23 (--engine sglang)" in captured.out
    note = next(line for line in captured.err.splitlines() if line.startswith("note: "))
    assert "engine: sglang only (vLLM 0.33.0 cannot load mtp.0.ffn.experts.0.w1: " in note
    assert "--engine both refuses this layout" in note
    for engine, says in (("both", "--engine both: vLLM 0.33.0"), ("vllm", "--engine vllm: vLLM 0.33.0")):
        dst = tmp_path / engine
        assert main([*argv, "--dst", str(dst), "--engine", engine]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and says in err and "tensor 'mtp.0.ffn.experts.0.w1'" in err, err
        assert not dst.exists() or not (dst / "model.safetensors.index.json").exists()


def test_recipe_engine_keys_are_validated():
    base = "name: r\n{top}rules:\n  - match: {{role: routed_expert{match}}}\n    format: fp8\n"
    assert parse_recipe(base.format(top="engine: vllm\n", match=", engine: [sglang, both]"), "r.yaml").engine == "vllm"
    with pytest.raises(RecipeError, match="engine"):
        parse_recipe(base.format(top="engine: trtllm\n", match=""), "r.yaml")
    with pytest.raises(RecipeError, match=r"rules\[0\]\.match\.engine"):
        parse_recipe(base.format(top="", match=", engine: tgi"), "r.yaml")


# ------------------------------------------------------------------------------------- validate

def test_validate_reports_the_engines_an_output_is_for(outputs, tmp_path, capsys):
    for name, claimed in (("fp8", ["sglang", "vllm"]), ("fp8@sglang", ["sglang"])):
        report = tmp_path / name
        assert main(["validate", str(outputs[name]), "--report", str(report), "--no-progress"]) == 0
        out = capsys.readouterr().out
        summary = json.loads((report / "validate.json").read_text())["summary"]
        assert summary["integrity_ok"] and summary["engines"] == claimed
        assert summary["engine_checks"]["sglang"] is None
        line = next(x for x in out.splitlines() if x.strip().startswith("engines: "))
        if claimed == ["sglang", "vllm"]:
            assert summary["engine_checks"]["vllm"] is None
            assert "for SGLang 0.5.23 and vLLM 0.33.0" in line and "vLLM 0.33.0 loads it" in line
        else:  # E8M0 expert scales: what vLLM would do is reported, not held against an SGLang-only output
            assert summary["engine_checks"]["vllm"].startswith("layers.0.ffn.experts.0.w1: vLLM 0.33.0 views E8M0")
            assert "vLLM 0.33.0 cannot load it (" in line and "[not claimed]" in line
        assert "- engines: " in (report / "validate.md").read_text()


def test_validate_refuses_an_output_claiming_both_that_one_engine_cannot_load(outputs, tmp_path, capsys):
    """An SGLang-only FP8 output relabelled for both engines: vLLM's rule fails it, naming engine and module."""
    dst = tmp_path / "relabelled"
    shutil.copytree(outputs["fp8@sglang"], dst)
    provenance = json.loads((dst / "provenance.json").read_text())
    provenance["engines"] = ["sglang", "vllm"]
    (dst / "provenance.json").write_text(json.dumps(provenance))
    assert main(["validate", str(dst), "--report", str(tmp_path / "r"), "--no-progress"]) == 1
    out = capsys.readouterr().out
    assert "integrity FAILED" in out
    assert ("config: says it is for vLLM 0.33.0, which cannot load it: layers.0.ffn.experts.0.w1: vLLM 0.33.0 views "
            "E8M0 expert scales as raw bytes") in out


def test_validate_refuses_a_both_config_missing_what_vllm_reads(outputs, tmp_path):
    """A both-engine FP8 output whose config lost expert_dtype (vLLM would read MXFP4 experts) fails."""
    dst = tmp_path / "no-expert-dtype"
    shutil.copytree(outputs["fp8"], dst)
    config = json.loads((dst / "config.json").read_text())
    assert config.pop("expert_dtype") == "fp8"
    (dst / "config.json").write_text(json.dumps(config))
    result = validate(dst, report_dir=tmp_path / "r", progress=False)
    problems = result.summary["integrity_problems"]
    assert not result.summary["integrity_ok"]
    assert any(p.startswith("config.json: expert_dtype") for p in problems), problems
    assert Checkpoint.open(outputs["fp8"]).config["expert_dtype"] == "fp8"
