"""dsv4convert calibrate on a DSpark drafter (V4-Flash-0731's layout, the organism's trained drafter): the stages'
expert statistics against one unstreamed drafting forward, resume in the middle of the stages, and the recipes
that read the file (to-w4a16 --gptq, to-nvfp4) converting the drafter's experts with them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dsv4convert.calibrate import stream
from dsv4convert.calibrate.stats import ExpertStats
from dsv4convert.calibrate.stream import CalibrateOptions, Calibrator, work_dir
from dsv4convert.calibration import build_input_scales, calibration_hessians
from dsv4convert.checkpoint import Checkpoint
from dsv4convert.cli import main
from dsv4convert.convert.modules import dequantize_source
from dsv4convert.formats import Format, input_scale_from_amax
from dsv4convert.models.deepseek_v4.layout import ModelConfig
from dsv4convert.model.dspark import Blocks
from dsv4convert.model.text import token_windows
from dsv4convert.organism.dspark import Target
from dsv4convert.organism.export import load_dspark_release

N_SEQ, SEQ_LEN = 2, 48


@pytest.fixture(scope="module")
def organism(tmp_path_factory) -> Path:
    """No path here may contain "dspark" (vLLM's rule; test_dspark_loading.source)."""
    dst = tmp_path_factory.mktemp("drafting") / "organism"
    assert main(["synth", "--preset", "organism", "--drafter", "dspark", "--dst", str(dst)]) == 0
    return dst


def _opts(src: Path, output: Path, **kw) -> CalibrateOptions:
    """The organism's own held-out text unless ``data`` says otherwise."""
    base = dict(data=src / "heldout.txt", num_sequences=N_SEQ, seq_len=SEQ_LEN, batch_size=1, dtype="float32",
                hessians=True, progress=False)
    return CalibrateOptions(source=src, output=output, **{**base, **kw})


@pytest.fixture(scope="module")
def streamed(organism, tmp_path_factory) -> tuple[dict, Path]:
    output = tmp_path_factory.mktemp("calib") / "calib.json"
    return Calibrator(_opts(organism, output)).run(), output


def _direct_stage_stats(organism: Path) -> dict[int, dict]:
    """Each stage's per-expert statistics of one unstreamed drafting forward: the organism's backbone as one model
    (target features by its own hooks), the drafter as one module over every anchor 1 .. S - 1 of every sequence,
    observed by hooks written here."""
    backbone, drafter = load_dspark_release(organism)
    config = Checkpoint.open(organism).config
    target = Target(backbone, config)
    ids, _ = token_windows(organism, organism / "heldout.txt", num_sequences=N_SEQ, seq_len=SEQ_LEN,
                           vocab_size=drafter.cfg.vocab_size)
    anchors = torch.tensor([(b, p) for b in range(N_SEQ) for p in range(1, SEQ_LEN)])
    d = drafter.d
    blocks = Blocks.make(ids, anchors, block_size=d.block_size, noise_token_id=d.noise_token_id, window=drafter.window)
    seen: dict[int, dict] = {}

    def hook(stage: int):
        def observe(experts, args):
            x, top_k_index = args[0], args[1]
            n = experts.num_experts
            out = seen.setdefault(stage, {"w13": torch.zeros(n), "w2": torch.zeros(n),
                                          "tokens": torch.zeros(n, dtype=torch.int64), "h13": {}, "h2": {}})
            for e in range(n):
                routed = (top_k_index == e).any(dim=-1)
                if routed.any():
                    x13 = x[routed]
                    x2 = experts._apply_gate(F.linear(x13, experts.gate_up_proj[e]))
                    out["w13"][e] = max(out["w13"][e], x13.abs().max())
                    out["w2"][e] = max(out["w2"][e], x2.abs().max())
                    out["tokens"][e] += int(routed.sum())
                    out["h13"][e] = out["h13"].get(e, 0) + x13.double().T @ x13.double()
                    out["h2"][e] = out["h2"].get(e, 0) + x2.double().T @ x2.double()
        return observe

    handles = [s.mlp.experts.register_forward_pre_hook(hook(i)) for i, s in enumerate(drafter.stages)]
    try:
        with torch.no_grad():
            features, _ = target(ids)
            drafter(features, blocks, target.embed, target.lm_head, keep_draft_logits=False)
    finally:
        for h in handles:
            h.remove()
    return seen


def test_stage_statistics_equal_one_unstreamed_drafting_forward(streamed, organism):
    content, output = streamed
    cfg = ModelConfig.from_dict(Checkpoint.open(organism).config)
    d = cfg.dspark
    direct = _direct_stage_stats(organism)
    hessians = calibration_hessians(output)
    assert sorted(direct) == list(range(d.stages)) == [0, 1, 2]
    assert [b["block"] for b in content["blocks"]] == cfg.block_prefixes()
    for stage, want in direct.items():
        block = f"mtp.{stage}"
        got = ExpertStats.load_scalars(work_dir(output) / f"{block}.safetensors")
        assert got.tokens.numel() == cfg.experts_in(block)
        assert torch.equal(got.tokens, want["tokens"]), block
        # every anchor 1 .. S - 1 of every sequence, a block of rows each, each row to top-k experts
        assert int(got.tokens.sum()) == N_SEQ * (SEQ_LEN - 1) * d.block_size * d.num_experts_per_tok
        torch.testing.assert_close(got.w13_amax, want["w13"], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got.w2_amax, want["w2"], rtol=1e-4, atol=1e-5)
        for e in range(cfg.experts_in(block)):
            name = f"{block}.ffn.experts.{e}"
            if int(want["tokens"][e]) == 0:
                assert name in content["uncalibrated_experts"]["experts"] and hessians(f"{name}.w1") is None
                continue
            assert content["experts"][name]["tokens"] == int(want["tokens"][e])
            torch.testing.assert_close(hessians(f"{name}.w1").double(), want["h13"][e], rtol=1e-4, atol=1e-3)
            torch.testing.assert_close(hessians(f"{name}.w2").double(), want["h2"][e], rtol=1e-4, atol=1e-3)


def test_a_run_interrupted_inside_a_stage_resumes_to_the_same_file(streamed, organism, tmp_path, monkeypatch):
    reference, reference_output = streamed
    output = tmp_path / "calib.json"

    class Interrupted(Exception):
        pass

    def stop_at(point: str) -> None:
        """The run dies here: mtp.0 done, mtp.1 half done (stage 2's input of micro-batch 0 already written)."""
        if point == "calibrate: mtp.1: micro-batch 0 done":
            raise Interrupted(point)

    monkeypatch.setattr(stream, "reach", stop_at)
    with pytest.raises(Interrupted):
        Calibrator(_opts(organism, output)).run()
    monkeypatch.undo()
    work = work_dir(output)
    assert sorted(p.name for p in work.glob("mtp.*.safetensors")) == ["mtp.0.safetensors"]
    assert (work / "states" / "features").is_dir() and (work / "states" / "mtp.2" / "00000.states").is_file()
    resumed = Calibrator(_opts(organism, output)).run()
    assert resumed["experts"] == reference["experts"]
    assert resumed["uncalibrated_experts"] == reference["uncalibrated_experts"]
    assert not (work / "states").exists()
    want, got = calibration_hessians(reference_output), calibration_hessians(output)
    for name in (n for n in reference["experts"] if n.startswith("mtp.")):
        for proj in ("w1", "w2"):
            assert torch.equal(got(f"{name}.{proj}"), want(f"{name}.{proj}")), name


def test_no_mtp_leaves_the_drafter_out(organism, tmp_path):
    content = Calibrator(_opts(organism, tmp_path / "calib.json", hessians=False, mtp=False)).run()
    assert [b["block"] for b in content["blocks"]] == [f"layers.{i}" for i in range(4)]
    assert not any(name.startswith("mtp.") for name in content["experts"])
    assert not (work_dir(tmp_path / "calib.json") / "states").exists()


def test_recipes_convert_the_drafter_with_the_file(streamed, organism, tmp_path):
    """to-w4a16 --gptq: every calibrated drafter expert is GPTQ's (lower objective tr((W - Q) H (W - Q)^T) than
    round-to-nearest); to-nvfp4 --calibration converts too, and the file gives the stages' experts its maxima."""
    content, calib = streamed
    gptq_dst, rtn_dst = tmp_path / "gptq", tmp_path / "rtn"
    assert main(["to-w4a16", "--src", str(organism), "--dst", str(gptq_dst), "--calibration", str(calib), "--gptq",
                 "--no-progress"]) == 0
    assert main(["to-w4a16", "--src", str(organism), "--dst", str(rtn_dst), "--no-progress"]) == 0
    assert main(["to-nvfp4", "--src", str(organism), "--dst", str(tmp_path / "nvfp4"), "--calibration", str(calib),
                 "--no-progress"]) == 0
    gptq, rtn, src = Checkpoint.open(gptq_dst), Checkpoint.open(rtn_dst), Checkpoint.open(organism)
    hessians = calibration_hessians(calib)
    modules = [n[: -len(".weight_packed")] for n in gptq.tensors
               if n.startswith("mtp.") and n.endswith(".weight_packed")]
    assert len(modules) == 3 * 8 * 3

    def objective(ck: Checkpoint, module: str, w: torch.Tensor, h: torch.Tensor) -> float:
        q = dequantize_source(Format.INT4, {p: ck.read(f"{module}.{p}") for p in
                                            ("weight_packed", "weight_scale", "weight_shape")}, module, {})
        diff = (q - w).double()
        return float(torch.einsum("nk,kl,nl->", diff, h.double(), diff))

    improved = 0
    for module in modules:
        h = hessians(module)
        if h is None:
            continue
        w = dequantize_source(Format.MXFP4, {p: src.read(f"{module}.{p}") for p in ("weight", "scale")}, module, {})
        assert objective(gptq, module, w, h) < objective(rtn, module, w, h), module
        improved += 1
    assert improved == 3 * sum(1 for n in content["experts"] if n.startswith("mtp."))
    scales = build_input_scales(src, calibration=calib)
    for name in ("mtp.0.ffn.experts.3", "mtp.2.ffn.experts.7"):
        value, origin = scales(f"{name}.w2")
        assert origin == "calibration"
        assert torch.equal(value, input_scale_from_amax(content["experts"][name]["w2_input_amax"]))


def test_stages_with_their_own_expert_count_and_the_report(tmp_path):
    """A drafter whose stages have fewer routed experts than the backbone (``dspark_n_routed_experts``, as V4.1
    ships): each stage's statistics are per stage expert, and ``--report`` evaluates the stages too."""
    base = tmp_path / "base"
    assert main(["synth", "--preset", "tiny", "--drafter", "dspark", "--dst", str(base)]) == 0
    config = json.loads((base / "config.json").read_text())
    config.update(dspark_n_routed_experts=config["n_routed_experts"] // 2, dspark_num_experts_per_tok=2)
    (tmp_path / "config.json").write_text(json.dumps(config))
    src = tmp_path / "fewer"
    assert main(["synth", "--config", str(tmp_path / "config.json"), "--dst", str(src)]) == 0
    data = tmp_path / "text.txt"
    data.write_text(" ".join(f"token {i % 97} layer expert {i % 13} stage." for i in range(400)))
    content = Calibrator(_opts(src, tmp_path / "calib.json", data=data,
                              seq_len=32, holdout=1, batch_size=2, hessians=False, report=True,
                              report_experts=2)).run()
    cfg = ModelConfig.from_dict(config)
    stages = [f"mtp.{s}" for s in range(cfg.dspark.stages)]
    for block in stages:
        got = ExpertStats.load_scalars(work_dir(tmp_path / "calib.json") / f"{block}.safetensors")
        assert got.tokens.numel() == cfg.experts_in(block) == config["n_routed_experts"] // 2
        assert int(got.tokens.sum()) == N_SEQ * 31 * cfg.dspark.block_size * 2
        listed = [n for n in [*content["experts"], *content["uncalibrated_experts"]["experts"]]
                  if n.startswith(f"{block}.")]
        assert sorted(listed) == [f"{block}.ffn.experts.{e}" for e in range(cfg.experts_in(block))]
    rows = {r["block"]: r for r in content["report"]}
    for block in stages:
        assert rows[block]["heldout_rows"] > 0 and 0 < rows[block]["int4_gptq"] < 1, rows[block]
