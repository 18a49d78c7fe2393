"""``compare`` on V4.1's DSpark drafter (``compare/v41_dspark.py``, measures from ``compare/dspark.py``) on tiny-v41.

tiny-v41's drafter has random weights (3 stages, blocks of 5, target layers 3, 4, 5): it drafts badly, but the
known truths hold whatever it drafts. The checkpoint against itself and its lossless conversions (to-fp8: MXFP4 ->
FP8 experts; to-bf16) reads the same drafts (KLD 0, agreement and accepted length equal, every component exact);
a tensor changed in one drafter component is named by that component, with every other component's local error
0 (a stage's, a Markov head's, a confidence head's, the last moving the calibration alone). ``--no-mtp`` and
``--dry-run`` say what runs and what it costs.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dsv4convert.cli import main
from dsv4convert.compare.dspark import CONFIDENCE_HEAD, DRAFT_HEAD, MARKOV_HEAD, TARGET_FEATURES
from dsv4convert.compare.run import CompareOptions
from dsv4convert.compare.v41 import build_plan, run

from test_compare_v41 import TOKENS, _compare, _redrawn, _with_tensor_changed

COMPONENTS = [TARGET_FEATURES, "mtp.0", "mtp.1", "mtp.2", DRAFT_HEAD, MARKOV_HEAD, CONFIDENCE_HEAD]
BLOCKS = 2 * 43     # two sequences of 48 tokens, anchors 1 .. 48 - 5


def dspark_of(base: Path, variant: Path, numerics: str = "served", gpu_family: str | None = None) -> dict:
    """compare's DSpark section on 2 x 48 random tokens, in process (served numerics, the default)."""
    opts = CompareOptions(base=str(base), variant=str(variant), random_tokens=True, tokens=96, seq_len=48,
                          device="cpu", progress=False, numerics=numerics,
                          **({"gpu_family": gpu_family} if gpu_family else {}))
    return run(build_plan(opts))["dspark"]


def local_errors(section: dict) -> dict[str, float]:
    return {c["component"]: c["local"]["relative_error"] for c in section["components"]}


def _zeroed(name: str):
    """A confidence head that knows nothing: survival ``0.5 ** j`` (a fresh drafter's, ``init_weights``)."""
    def change(t):
        return {name: torch.zeros_like(t[name])}
    return change


FAULTS = {   # component -> (tensor changed, how)
    "mtp.1": ("mtp.1.attn.wq_b.weight", _redrawn("mtp.1.attn.wq_b.weight")),
    MARKOV_HEAD: ("mtp.2.markov_head.head.weight", _redrawn("mtp.2.markov_head.head.weight")),
    CONFIDENCE_HEAD: ("mtp.2.confidence_head.proj.weight", _zeroed("mtp.2.confidence_head.proj.weight")),
}


@pytest.fixture(scope="module")
def faulty(tiny_v41, tmp_path_factory) -> dict[str, Path]:
    """tiny-v41 with each of :data:`FAULTS` in a copy of its own, made once."""
    root = tmp_path_factory.mktemp("v41-dspark-faults")
    return {component: _with_tensor_changed(tiny_v41, root / component.replace(" ", "-"), [name], change)
            for component, (name, change) in FAULTS.items()}


@pytest.mark.parametrize("variant", ["itself", "fp8", "bf16"])
def test_itself_and_lossless_conversions_read_the_same_drafts(variant, tiny_v41, v41_outputs):
    """The release against itself under served numerics; the lossless conversions weights only (served, their
    activations are quantized otherwise: :func:`test_served_activations_reach_the_stages`)."""
    section = dspark_of(tiny_v41, tiny_v41 if variant == "itself" else v41_outputs[variant],
                        numerics="served" if variant == "itself" else "weights")
    assert section["anchors"] == {"blocks": BLOCKS, "stride": 1, "first": 1} and section["block_size"] == 5
    assert section["target_layer_ids"] == {"base": [3, 4, 5], "variant": [3, 4, 5]}
    for p in section["positions"]:
        assert p["kld"] == 0.0 and p["agreement"]["base"] == p["agreement"]["variant"], p
        assert p["accepted"]["delta"] == 0.0 and p["confidence"]["brier_delta"] == 0.0, p
        assert 0.0 < p["confidence"]["base"]["predicted"] < 1.0        # the confidence head ran
    length = section["expected_accept_length"]
    assert length["base"] == length["variant"] >= 1.0 and length["delta"] == 0.0
    assert [c["component"] for c in section["components"]] == COMPONENTS
    assert set(local_errors(section).values()) == {0.0}
    assert section["moved"] == [] and section["verdict"]["component"] is None
    assert "within the noise floor at every position" in section["verdict"]["sentence"]


def test_served_activations_reach_the_stages(tiny_v41, v41_outputs):
    """The FP8 conversion's stages hold the release's expert weights exactly (lossless), but SGLang quantizes their
    activations otherwise: per-token-group FP8 for ``Fp8MoEMethod``'s Triton runner
    (``kernels/ops/moe/fused_moe_triton_kernels.py::invoke_fused_moe_kernel``) where the release's MXFP4 experts take
    MXFP8 under ``flashinfer_mxfp4`` on sm100. Every stage carries local error on the base's inputs under served
    numerics, none weights only."""
    served = local_errors(dspark_of(tiny_v41, v41_outputs["fp8"], gpu_family="sm100"))
    assert all(served[f"mtp.{s}"] > 0 for s in range(3)), served
    weights = local_errors(dspark_of(tiny_v41, v41_outputs["fp8"], numerics="weights"))
    assert all(weights[f"mtp.{s}"] == 0 for s in range(3)), weights


def test_a_changed_stage_is_named_and_its_error_reaches_the_next_stage_free_running(tiny_v41, faulty):
    section = dspark_of(tiny_v41, faulty["mtp.1"])
    assert section["verdict"]["component"] == "mtp.1", section["verdict"]["sentence"]
    assert "the largest local error is the mtp.1's" in section["verdict"]["sentence"]
    errors = local_errors(section)
    assert errors["mtp.1"] > 0 and all(e == 0.0 for c, e in errors.items() if c != "mtp.1"), errors
    free = {c["component"]: (c["free_running"] or {}).get("relative_error") for c in section["components"]}
    assert free["mtp.0"] == 0.0 and free["mtp.1"] > 0 and free["mtp.2"] > 0, free   # mtp.2 reads mtp.1's output
    assert any(p["kld"] > p["kld_noise_floor"] for p in section["positions"]), section["positions"]


def test_a_changed_markov_head_is_named(tiny_v41, faulty):
    section = dspark_of(tiny_v41, faulty[MARKOV_HEAD])
    assert section["verdict"]["component"] == MARKOV_HEAD, section["verdict"]["sentence"]
    errors = local_errors(section)
    assert errors[MARKOV_HEAD] > 0 and all(e == 0.0 for c, e in errors.items() if c != MARKOV_HEAD), errors
    # the Markov bias shapes every draft distribution, the first one's (on the anchor) included
    assert all(p["kld"] > p["kld_noise_floor"] for p in section["positions"]), section["positions"]


def test_a_changed_confidence_head_moves_the_calibration_alone(tiny_v41, faulty):
    section = dspark_of(tiny_v41, faulty[CONFIDENCE_HEAD])
    verdict, moved = section["verdict"], section["moved"]
    assert verdict["component"] == CONFIDENCE_HEAD, verdict["sentence"]
    assert moved and all(m.startswith("confidence calibration") for m in moved), moved
    assert "the confidence head's calibration" in verdict["sentence"]
    errors = local_errors(section)
    assert errors[CONFIDENCE_HEAD] > 0 and all(e == 0.0 for c, e in errors.items() if c != CONFIDENCE_HEAD), errors
    for p in section["positions"]:
        assert p["kld"] == 0.0 and p["agreement"]["base"] == p["agreement"]["variant"], p
        assert p["confidence"]["variant"]["predicted"] == pytest.approx(0.5 ** p["position"]), p


def test_the_report_the_plan_and_no_mtp(tiny_v41, v41_outputs, tmp_path, capsys):
    """Through the command line: the printed lines and compare.md's section as for V4; --dry-run states the pass
    and counts its cost; --no-mtp leaves the drafter out."""
    variant = v41_outputs["fp8"]
    argv = ["compare", "--base", str(tiny_v41), "--variant", str(variant), *TOKENS]
    assert main([*argv, "--dry-run"]) == 0
    plan = capsys.readouterr().out
    assert "DSpark drafter: 86 blocks of 5 drafts (anchored at every position), 3 stages per track" in plan
    assert main([*argv, "--no-mtp", "--dry-run"]) == 0
    skipped = capsys.readouterr().out
    assert "DSpark drafter: not compared (--no-mtp)" in skipped
    assert gflop(plan) > gflop(skipped) > 0
    result = _compare(tiny_v41, variant, tmp_path / "report")
    out = capsys.readouterr().out
    section = result["dspark"]
    assert result["settings"]["mtp"] is True and result["seconds"]["dspark"] > 0
    assert result["v41"]["not_compared"] == "the vision tower"
    assert "DSpark draft agreement per position (variant): " in out
    assert f"DSpark: {section['verdict']['sentence']}" in out
    markdown = (tmp_path / "report" / "compare.md").read_text()
    assert "## DSpark draft" in markdown and section["verdict"]["sentence"] in markdown
    assert "Not compared: the vision tower." in markdown
    skipped = _compare(tiny_v41, variant, tmp_path / "no-mtp", "--no-mtp")
    assert skipped["dspark"] is None and skipped["settings"]["mtp"] is False
    assert skipped["output"] == result["output"]        # the text model's numbers do not depend on the drafter
    assert "DSpark" not in capsys.readouterr().out


def gflop(printed: str) -> float:
    said = re.findall(r"compare: expected ~.* ([0-9.e+]+) GFLOP at", printed)
    assert len(said) == 1, printed
    return float(said[0])


def test_the_drafter_runs_on_each_sides_own_captured_features(tiny_v41):
    """The target features compare drafts from are V41Runner's capture (the stream mean of each target layer's
    input): the base's local target-feature error is 0 against features a plain forward captures."""
    from dsv4convert.compare.v41 import Lockstep
    from dsv4convert.compare.v41_dspark import V41DraftPass
    from dsv4convert.model.v41.forward import V41Runner

    plan = build_plan(CompareOptions(base=str(tiny_v41), variant=str(tiny_v41), random_tokens=True, tokens=96,
                                     seq_len=48, device="cpu", progress=False, numerics="weights"))
    ids = plan.ids
    draft = V41DraftPass(plan.base.runner.source, plan.variant.runner.source, [ids], anchors=4096, chunk=2048)
    engine = Lockstep(plan, [ids], {"variant": None}, measure=False, capture=draft.capture())
    with torch.no_grad():
        engine.run()
        captured = V41Runner(tiny_v41, "cpu", torch.float32, fake_quant=False).forward(ids).captured
    assert sorted(engine.base_runs[0].captured) == [3, 4, 5]
    for layer in (3, 4, 5):
        torch.testing.assert_close(engine.base_runs[0].captured[layer], captured[layer], rtol=0, atol=0)
    assert draft.capture() == {"base": (3, 4, 5), "variant": (3, 4, 5)}


def test_a_drafter_tensor_missing_is_one_error_before_any_layer_unless_no_mtp(tiny_v41, tmp_path, capsys):
    name = "mtp.1.attn.wkv.scale"
    broken = tmp_path / "no-wkv-scale"
    shutil.copytree(tiny_v41, broken)
    index_path = broken / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = broken / index["weight_map"].pop(name)
    with safe_open(shard, "pt") as f:
        kept = {n: f.get_tensor(n) for n in f.keys() if n != name}
        metadata = f.metadata()
    save_file(kept, shard, metadata=metadata)
    index_path.write_text(json.dumps(index))
    argv = ["compare", "--base", str(tiny_v41), "--variant", str(broken), *TOKENS, "--dry-run"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and name in err and "missing" in err
    assert main([*argv, "--no-mtp"]) == 0      # the text model alone is whole
