"""The three drafter layouts (the preview's MTP block, 0731's DSpark drafter, none) through synth -> convert ->
inspect -> fit -> serve --dry-run, and what goes wrong with a DSpark drafter's inputs.

The engines' own loaders read these outputs in tests/test_dspark_loading.py; SGLang's own argument resolution
reads every planned command here (tests/sglang_oracle.py). The release's numbers (72,317 tensors, 4,705 under
``mtp.*``) are the 0731 checkpoint's index (dsv4convert/data/deepseek-v4-flash-0731-config.json's provenance,
docs/drafters.md).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest
import sglang_oracle as sgl
import torch
from conftest import run
from safetensors import safe_open

from dsv4convert.checkpoint import Checkpoint
from dsv4convert.cli import main
from dsv4convert.engines.served import ServedModel
from dsv4convert.fit import source, verdict
from dsv4convert.inspection import inspect_checkpoint
from dsv4convert.models.deepseek_v4.layout import Drafter, ModelConfig, native_inventory
from dsv4convert.models.deepseek_v4.configs import with_dspark, with_num_layers
from dsv4convert.synth import preset_config, synthesize

DATA = Path(__file__).resolve().parents[1] / "dsv4convert" / "data"
RECIPES = ("fp8", "nvfp4", "w4a16", "bf16", "nvfp4-mtp-mxfp4")


def _tensors(root: Path) -> dict[str, torch.Tensor]:
    out = {}
    for shard in sorted(root.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            out.update({name: f.get_tensor(name) for name in f.keys()})
    return out


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    """The tiny preset with each drafter."""
    root = tmp_path_factory.mktemp("drafters")
    tiny = preset_config("tiny")
    configs = {"mtp": tiny, "dspark": with_dspark(with_num_layers(tiny, tiny["num_hidden_layers"], mtp=False)),
               "none": with_num_layers(tiny, tiny["num_hidden_layers"], mtp=False)}
    return {name: synthesize(root / name, config, seed=1) for name, config in configs.items()}


@pytest.fixture(scope="module")
def dspark_outputs(sources, tmp_path_factory) -> dict[str, Path]:
    """The DSpark checkpoint converted by every shipped recipe (for both engines), and fp8 for SGLang only."""
    root = tmp_path_factory.mktemp("dspark-variants")
    outputs = {recipe: root / recipe for recipe in RECIPES}
    for recipe, dst in outputs.items():
        run(sources["dspark"], dst, recipe)
    run(sources["dspark"], root / "fp8@sglang", "fp8", engine="sglang")
    outputs["fp8@sglang"] = root / "fp8@sglang"
    return outputs


# ------------------------------------------------------------------------------------------------ layout

def test_the_0731_config_plans_the_released_checkpoint():
    cfg = ModelConfig.from_dict(json.loads((DATA / "deepseek-v4-flash-0731-config.json").read_text()))
    inventory = native_inventory(cfg)
    assert cfg.drafter is Drafter.DSPARK and cfg.num_draft_blocks == 3 and cfg.dspark.block_size == 5
    assert len(inventory) == 72_317
    assert sum(spec.name.startswith("mtp.") for spec in inventory) == 4_705
    names = {spec.name for spec in inventory}
    assert {"mtp.0.main_proj.weight", "mtp.0.main_norm.weight", "mtp.2.markov_head.embed.weight",
            "mtp.2.markov_head.head.weight", "mtp.2.confidence_head.proj.weight", "mtp.2.hc_head_fn"} <= names
    assert not any(part in name for name in names for part in (".e_proj.", ".enorm.", "mtp.3."))


@pytest.mark.parametrize("drafter", ["mtp", "dspark", "none"])
def test_each_layout_inspects_as_what_it_is(sources, drafter):
    inspection = inspect_checkpoint(Checkpoint.open(sources[drafter]))
    assert inspection.ok and inspection.variant == "native", inspection.first_problem()
    assert inspection.config.drafter.value == drafter
    planned = {spec.name for spec in native_inventory(inspection.config)}
    assert planned == set(Checkpoint.open(sources[drafter]).tensors)


# ------------------------------------------------------------------------------------------------ convert

@pytest.mark.parametrize("recipe", [*RECIPES, "fp8@sglang"])
def test_a_converted_drafter_keeps_every_tensor_the_engines_read(sources, dspark_outputs, recipe):
    """Every source mtp.* module is in the output (under vLLM's Markov names where the output is for vLLM), and
    the Markov and confidence heads are the source's bytes."""
    out = Checkpoint.open(dspark_outputs[recipe])
    inspection = inspect_checkpoint(out)
    assert inspection.ok and inspection.config.drafter is Drafter.DSPARK, inspection.first_problem()
    src_modules = {m.module for m in inspect_checkpoint(Checkpoint.open(sources["dspark"])).modules.values()
                   if m.is_mtp}
    assert {m.module for m in inspection.modules.values() if m.is_mtp} == src_modules
    source_tensors, output_tensors = _tensors(sources["dspark"]), _tensors(dspark_outputs[recipe])
    vllm = "@sglang" not in recipe
    for name, renamed in (("mtp.2.markov_head.embed.weight", "mtp.2.markov_head.markov_w1.weight"),
                          ("mtp.2.markov_head.head.weight", "mtp.2.markov_head.markov_w2.weight"),
                          ("mtp.2.confidence_head.proj.weight", "mtp.2.confidence_head.proj.weight")):
        stored = output_tensors[renamed if vllm else name]
        assert stored.dtype == torch.bfloat16 and torch.equal(stored, source_tensors[name]), name
    config = json.loads((dspark_outputs[recipe] / "config.json").read_text())
    assert {key: config[key] for key in config if key.startswith("dspark_")} == \
        {key: value for key, value in json.loads((sources["dspark"] / "config.json").read_text()).items()
         if key.startswith("dspark_")}


def test_no_mtp_leaves_the_drafter_out_and_says_so(sources, tmp_path, capsys):
    dst = tmp_path / "fp8-no-mtp"
    assert main(["to-fp8", "--src", str(sources["dspark"]), "--dst", str(dst), "--no-progress", "--no-mtp"]) == 0
    said = capsys.readouterr().out
    assert "--no-mtp: the DSpark drafter (3 blocks under mtp.*, " in said
    inspection = inspect_checkpoint(Checkpoint.open(dst))
    assert inspection.ok and inspection.config.drafter is Drafter.NONE
    assert not any(name.startswith("mtp.") for name in Checkpoint.open(dst).tensors)
    config = json.loads((dst / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 0 and not any(key.startswith("dspark_") for key in config)
    card = (dst / "README.md").read_text()
    assert "None: the source's DSpark drafter was left out (`--no-mtp`)" in card
    assert "--speculative-algorithm" not in card and "--speculative-config" not in card
    capsys.readouterr()
    assert main(["serve", "--model", str(dst), "--gpu-family", "sm90", "--gpus", "0", "--mtp", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "no draft to serve" in err and err.count("\n") == 1


# ------------------------------------------------------------------------------------------------ bad inputs

def _refused(src: Path, dst: Path, capsys, *needles: str) -> None:
    """One ``error:`` line naming what is wrong, exit 2, nothing written."""
    assert main(["to-fp8", "--src", str(src), "--dst", str(dst), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    for needle in needles:
        assert needle in err, err
    assert not dst.exists()


def _copy(src: Path, dst: Path, *, drop: str | None = None, config: dict | None = None) -> Path:
    """A copy of a checkpoint without the tensors whose names start with ``drop``, or with another config."""
    shutil.copytree(src, dst)
    if drop:
        from safetensors.torch import save_file

        index = json.loads((dst / "model.safetensors.index.json").read_text())
        for shard in sorted({f for name, f in index["weight_map"].items() if name.startswith(drop)}):
            kept = {k: v for k, v in _tensors_of(dst / shard).items() if not k.startswith(drop)}
            save_file(kept, str(dst / shard), metadata={"format": "pt"})
        index["weight_map"] = {k: v for k, v in index["weight_map"].items() if not k.startswith(drop)}
        (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    if config is not None:
        (dst / "config.json").write_text(json.dumps(config))
    return dst


def _tensors_of(shard: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(shard), "pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


def test_a_drafter_with_a_missing_stage_is_refused(sources, tmp_path, capsys):
    src = _copy(sources["dspark"], tmp_path / "src", drop="mtp.1.")
    _refused(src, tmp_path / "out", capsys, "mtp.1.")


def test_dspark_keys_without_drafter_tensors_are_refused(sources, tmp_path, capsys):
    config = json.loads((sources["dspark"] / "config.json").read_text())
    src = _copy(sources["none"], tmp_path / "src", config={**json.loads((sources["none"] / "config.json").read_text()),
                                                           **{k: v for k, v in config.items()
                                                              if k.startswith("dspark_")},
                                                           "compress_ratios": config["compress_ratios"],
                                                           "num_nextn_predict_layers": 1})
    _refused(src, tmp_path / "out", capsys, "mtp.0.")


def test_drafter_tensors_without_dspark_keys_are_refused(sources, tmp_path, capsys):
    config = json.loads((sources["dspark"] / "config.json").read_text())
    src = _copy(sources["dspark"], tmp_path / "src", config={k: v for k, v in config.items()
                                                             if not k.startswith("dspark_")})
    _refused(src, tmp_path / "out", capsys, "mtp.")


# ------------------------------------------------------------------------------------------------ fit

def _model(root: Path) -> ServedModel:
    return source.from_checkpoint(str(root))


def test_fit_sizes_the_dspark_draft_as_each_engine_loads_it(dspark_outputs):
    """SGLang holds the stages' wo_a as BF16 and drops the confidence head (static ragged verify); vLLM keeps
    wo_a FP8, a second copy of every stage's wkv (context_wkv_proj) and an F32 confidence head."""
    model = _model(dspark_outputs["fp8"])
    gpu = verdict.gpu_of_family("sm90")
    with_draft = verdict.sglang_server(model, gpu, "server", 1, mtp=True)
    without = verdict.sglang_server(model, gpu, "server", 1, mtp=False)
    assert with_draft.drafter == "dspark" and without.drafter is None and without.draft_weights_bytes_per_rank == 0
    assert with_draft.draft_tokens == 6 and with_draft.weights_bytes_per_rank > without.weights_bytes_per_rank
    mtp = [(t, info) for t, info in model.tensors if info.is_mtp]
    stored = {t.name: t for t, _ in mtp}
    wo_a = [t for t in stored.values() if t.name.endswith("attn.wo_a.weight")]
    wo_a_scales = [stored[t.name.replace(".weight", ".scale")] for t in wo_a]
    confidence = stored["mtp.2.confidence_head.proj.weight"]
    wkv = [t for t in stored.values() if ".attn.wkv." in t.name]
    as_file = sum(t.nbytes for t in stored.values())
    fp8_scales = sum(t.nbytes * 3 for t in stored.values() if t.name.endswith(".scale") and t.dtype == "F8_E8M0")
    sglang = as_file + fp8_scales + sum(t.nbytes for t in wo_a) - sum(t.nbytes * 4 for t in wo_a_scales) \
        - confidence.nbytes
    assert with_draft.draft_weights_bytes_per_rank == sglang
    vllm = verdict.vllm_server(model, gpu, 1, mtp=True)
    wkv_loaded = sum(t.nbytes * (4 if t.name.endswith(".scale") else 1) for t in wkv)
    assert vllm.draft_weights_bytes_per_rank == as_file + fp8_scales + wkv_loaded + confidence.nbytes
    assert vllm.drafter == "dspark" and vllm.draft_tokens == 6


def test_sglang_budgets_one_draft_layer_and_allocates_one_per_stage(dspark_outputs, sources, tmp_path):
    """SGLang's own DSV4PoolConfigurator, on the 0731 config under DSPARK, inflates the per-token bytes as for
    EAGLE ((T+1)/T, pool_configurator.py); the DSPARK draft pool then holds one sliding-window layer per stage."""
    from dataclasses import replace

    from sglang.srt.runtime_context import restore_context, snapshot_context
    from test_fit import _sglang_pool

    from dsv4convert.engines.sglang import memory as sizing
    from dsv4convert.engines.sglang.server import drafter_of, server

    config = json.loads((DATA / "deepseek-v4-flash-0731-config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config))
    gpu = verdict.GPUS["h200"]
    settings = server(str(tmp_path), "fp8", gpu.family, tp=4, mtp=True, **drafter_of(ModelConfig.from_dict(config)))
    assert "DSPARK" in settings.argv()
    geometry = ServedModel.geometry.fget(type("M", (), {"config": config})())
    ours = sizing.kv_cost(geometry, settings)
    assert ours.bytes_per_full_token == sizing.kv_cost(geometry, replace(settings, drafter=Drafter.MTP)
                                                       ).bytes_per_full_token
    state = snapshot_context()
    try:
        pool = _sglang_pool(settings.argv(), gpu, settings.env, tmp_path)
        assert pool.bytes_per_full_token == pytest.approx(ours.bytes_per_full_token, rel=1e-12)
    finally:
        restore_context(state)
    h200 = verdict.gpu_of_family("sm90")
    dspark = verdict.sglang_server(_model(dspark_outputs["fp8"]), h200, "server", 1, mtp=True)
    preview = verdict.sglang_server(_model(sources["mtp"]), h200, "server", 1, mtp=True)
    assert dspark.draft_kv_bytes == pytest.approx(3 * preview.draft_kv_bytes * dspark.swa_tokens / preview.swa_tokens,
                                                  rel=1e-6)
    assert dspark.draft_kv_unbudgeted_bytes > 0 and preview.draft_kv_unbudgeted_bytes == 0


def test_fit_refuses_a_draft_the_checkpoint_does_not_have(sources):
    with pytest.raises(verdict.FitError, match="no draft to serve"):
        verdict.sglang_server(_model(sources["none"]), verdict.gpu_of_family("sm90"), "server", 1, mtp=True)


# ------------------------------------------------------------------------------------------------ serve

def _plan(model: Path, family: str, *extra: str) -> list:
    from dsv4convert.serve import cli as serve_cli

    parser = argparse.ArgumentParser()
    serve_cli.add_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", "--model", str(model), "--gpu-family", family, "--pd", "--prefill-gpus", "0,1",
                              "--decode-gpus", "2,3", "--mtp", "--dry-run", *extra])
    variant, config = serve_cli._inspect(args)
    args.variant = variant
    return serve_cli.plan(args, None, config)[0]


@pytest.mark.parametrize("recipe", ["fp8", "nvfp4", "w4a16"])
@pytest.mark.parametrize("family", ["sm90", "sm100", "sm120"])
def test_serve_launches_dspark_as_sglang_resolves_it(dspark_outputs, recipe, family):
    for command in _plan(dspark_outputs[recipe], family)[:2]:
        resolved = sgl.resolve_server_args(list(command.sglang_args), gpu=family, env=command.env).resolved_dict()
        assert resolved["speculative_algorithm"] == "DSPARK"
        assert (resolved["speculative_num_steps"], resolved["speculative_eagle_topk"],
                resolved["speculative_num_draft_tokens"]) == (1, 1, 6) == (1, 1, command.server.draft_tokens)
        assert resolved["speculative_draft_model_path"] == str(dspark_outputs[recipe])


def test_serve_refuses_eagle_on_a_dspark_checkpoint(dspark_outputs):
    from dsv4convert.serve.launch import LaunchError

    with pytest.raises(LaunchError, match="served by DSPARK; SGLang would build its one-layer NextN draft"):
        _plan(dspark_outputs["fp8"], "sm90", "--", "--speculative-algorithm", "EAGLE")
    with pytest.raises(LaunchError, match="--speculative-num-draft-tokens 4: DSPARK verifies its block"):
        _plan(dspark_outputs["fp8"], "sm90", "--", "--speculative-num-draft-tokens", "4")
    (prefill, _, _) = _plan(dspark_outputs["fp8"], "sm90", "--", "--speculative-dspark-block-size", "3")
    assert prefill.server.draft_tokens == 4 and prefill.sglang_args.count("--speculative-dspark-block-size") == 1


def test_the_nvfp4_hybrids_dspark_draft_where_sglang_runs_it(dspark_outputs):
    """DSPARK runs the stages' experts on the backbone's MoE runner (it ignores --speculative-moe-runner-backend):
    the FP8 draft experts of the SGLang-only NVFP4 hybrid have no Marlin path, the BF16 ones do (Triton)."""
    from dsv4convert.engines.sglang.rules import variant_rules

    assert not variant_rules("nvfp4", "sm120", Drafter.DSPARK).serves_draft
    assert variant_rules("nvfp4", "sm100", Drafter.DSPARK).serves_draft
    assert variant_rules("nvfp4", "sm120", Drafter.MTP).serves_draft
    assert variant_rules("nvfp4-mtp-bf16", "sm120", Drafter.DSPARK).serves_draft
    assert "--speculative-moe-runner-backend" not in " ".join(_plan(dspark_outputs["nvfp4"], "sm120")[0].argv)


def test_a_recipe_names_one_stage(sources, tmp_path):
    """A rule matching one stage's modules changes that stage only (here: its routed experts to BF16)."""
    recipe = tmp_path / "stage1-bf16.yaml"
    recipe.write_text("name: stage1-bf16\nrules:\n"
                      "  - match: {module: 'mtp\\.1\\..*', role: routed_expert}\n    format: bf16\n    reason: stage 1 exact\n"
                      "  - match: {role: routed_expert}\n    format: fp8\n"
                      "  - match: {}\n    format: keep\n    reason: as released\n")
    run(sources["dspark"], tmp_path / "out", str(recipe), engine="sglang")
    formats: dict[str, set[str]] = {}
    for m in inspect_checkpoint(Checkpoint.open(tmp_path / "out")).modules.values():
        if m.role.value == "routed_expert":
            formats.setdefault(m.module.split(".")[1] if m.is_mtp else "backbone", set()).add(m.format.value)
    assert formats["1"] == {"bf16"} and formats["0"] == formats["2"] == formats["backbone"] == {"fp8"}


def test_compare_runs_a_dspark_checkpoint_with_its_drafter(sources, dspark_outputs, tmp_path, capsys):
    """The lossless FP8 variant under weights-only numerics is the source, position for position, and so are its
    drafts: every draft position's KLD 0, the same agreement, every drafter component's local error 0 (the drafter
    reported in its own section, not among the backbone's blocks)."""
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 6)
    assert main(["compare", "--base", str(sources["dspark"]), "--variant", str(dspark_outputs["fp8"]), "--text",
                 str(text), "--seq-len", "128", "--numerics", "weights", "--draft-anchors", "64", "--no-progress",
                 "--report", str(tmp_path / "report")]) == 0
    assert "DSpark draft agreement per position (variant)" in capsys.readouterr().out
    report = json.loads((tmp_path / "report" / "compare.json").read_text())
    assert report["output"]["positions"] > 0 and report["output"]["kld"]["mean"] == 0.0
    assert report["output"]["same_top1"] == 1.0 and not any(report["mtp_draft_agreement"].values())
    assert not any(b["block"].startswith("mtp.") for b in report["blocks"])
    draft = report["dspark"]
    assert draft["anchors"]["blocks"] > 0 and len(draft["positions"]) == draft["block_size"]
    assert all(p["kld"] == 0.0 and p["agreement"]["base"] == p["agreement"]["variant"] for p in draft["positions"])
    assert {c["local"]["relative_error"] for c in draft["components"]} == {0.0}
    assert draft["verdict"]["component"] is None


@pytest.mark.parametrize("drafter,algorithm", [("mtp", "EAGLE"), ("dspark", "DSPARK"), ("none", None)])
def test_each_layout_converts_validates_fits_and_plans(sources, dspark_outputs, tmp_path, capsys, drafter,
                                                       algorithm):
    """synth -> fp8 -> validate (every module bit-exact, the drafter's too) -> fit -> serve --dry-run, with the
    speculative algorithm the layout needs (none without a drafter: --mtp is refused)."""
    out = dspark_outputs["fp8"] if drafter == "dspark" else tmp_path / "fp8"
    if drafter != "dspark":
        run(sources[drafter], out, "fp8")
    assert main(["validate", str(out), "--against", str(sources[drafter]), "--report", str(tmp_path / "v")]) == 0
    report = json.loads((tmp_path / "v" / "validate.json").read_text())
    mtp_modules = [m for m in report["modules"] if m["module"].startswith("mtp.")]
    assert bool(mtp_modules) == (drafter != "none") and all(m["exact"] for m in report["modules"])
    fit = verdict.sglang_server(_model(out), verdict.gpu_of_family("sm90"), "server", 1, mtp=algorithm is not None)
    assert fit.fits and fit.drafter == (None if algorithm is None else drafter)
    capsys.readouterr()
    argv = ["serve", "--model", str(out), "--gpu-family", "sm90", "--gpus", "0", "--dry-run"]
    assert main([*argv, "--mtp"]) == (0 if algorithm else 2)
    printed = capsys.readouterr()
    if algorithm:
        assert f"--speculative-algorithm {algorithm}" in printed.out
    else:
        assert "no draft to serve" in printed.err
