"""dsv4convert compare: the lockstep engine against transformers, the served numerics against SGLang's own
resolution, the metrics on variants whose distance is known, the reports, and bad inputs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers_oracle import load

from dsv4convert import dtypes
from dsv4convert.checkpoint import Checkpoint, PlannedTensor, ShardWriter
from dsv4convert.cli import main
from dsv4convert.compare.lockstep import LockstepEngine
from dsv4convert.compare.numerics import serving_for
from dsv4convert.compare.run import CompareOptions, build_plan, run
from dsv4convert.formats import Format
from dsv4convert.inspection import inspect_checkpoint

SEQ = 259       # not a multiple of 4; past the tiny model's HCA window (128) and top-k threshold (4 * 4 + 4 = 20)


def compare(base: Path, variant: Path, **kw) -> dict:
    """One sequence through both sides; in chunks of 100 queries when ``chunk`` is not given."""
    options = dict(random_tokens=True, tokens=SEQ, seq_len=SEQ, chunk=100, progress=False)
    result = run(build_plan(CompareOptions(base=str(base), variant=str(variant), **{**options, **kw})))
    result.pop("_kld_values")
    return result


@pytest.fixture(scope="module")
def variants(outputs, tiny_ckpt) -> dict[str, Path]:
    return {"native": tiny_ckpt, **outputs}


def test_the_engine_computes_transformers_logits(tiny_ckpt):
    """The base side's log-probabilities of the next token are those of transformers' full forward."""
    plan = build_plan(CompareOptions(base=str(tiny_ckpt), variant=str(tiny_ckpt), random_tokens=True,
                                     tokens=2 * SEQ, seq_len=SEQ, chunk=SEQ, numerics="weights", progress=False))
    result = LockstepEngine(plan.tracks, plan.batches, device=plan.device, dtype=plan.dtype,
                            chunk=SEQ, progress=False).run()
    model, _ = load(tiny_ckpt)
    with torch.no_grad():
        log_p = torch.log_softmax(model(plan.batches[0].ids).logits.double(), dim=-1)
    ids = plan.batches[0].ids
    want = log_p[:, :-1].gather(2, ids[:, 1:, None]).reshape(-1)
    got = torch.cat(result.output["variant"].base_logp)
    # float32 through five layers, one sequence at a time against both at once: the GEMMs' shapes differ, and so
    # does their rounding, by CPU (an AMD EPYC gave 1.4e-4 on a log-probability of -29); a wrong layer is off by O(1).
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    assert [b.block for b in result.blocks] == ["layers.0", "layers.1", "layers.2", "layers.3", "layers.4", "mtp.0"]


@pytest.mark.threads(1, 2)    # exactly 0 at any thread count: both sides run the same shapes in lockstep
@pytest.mark.parametrize("numerics", ["weights", "served"])
def test_a_checkpoint_against_itself_is_exactly_zero(tiny_ckpt, numerics):
    result = compare(tiny_ckpt, tiny_ckpt, numerics=numerics)
    out = result["output"]
    assert out["positions"] == SEQ - 1
    assert out["kld"]["mean"] == 0.0 and out["kld"]["percentiles"]["100"] == 0.0
    assert out["same_top1"] == 1.0 and out["perplexity"]["ratio"] == 1.0
    assert all(b["free_running"]["relative_error"] == 0.0 and b["local"]["relative_error"] == 0.0
               for b in result["blocks"])
    agreement = result["mtp_draft_agreement"]
    assert agreement["base"] == agreement["variant"] and 0.0 <= agreement["base"]["mtp.0"] <= 1.0


@pytest.mark.threads(1, 2)
@pytest.mark.parametrize("variant", ["fp8", "nvfp4"])
def test_lossless_casts_are_exactly_the_base_weights_only(variants, variant):
    out = compare(variants["native"], variants[variant], numerics="weights", chunk=SEQ)["output"]
    assert out["kld"]["mean"] == 0.0 and out["same_top1"] == 1.0 and out["expected_acceptance"] == pytest.approx(1.0)


def test_served_w4a4_nvfp4_is_worse_than_marlin_w4a16(variants):
    """On sm120 the NVFP4 experts run W4A4 under flashinfer's cutlass runner and W4A16 under Marlin; the
    weights are the base's exactly (lossless cast), so Marlin serves the base's numbers and W4A4 does not."""
    marlin = compare(variants["native"], variants["nvfp4"], gpu_family="sm120", moe_runner_backend="marlin")
    cutlass = compare(variants["native"], variants["nvfp4"], gpu_family="sm120",
                      moe_runner_backend="flashinfer_cutlass")
    assert marlin["output"]["kld"]["mean"] == 0.0
    assert cutlass["output"]["kld"]["mean"] > 0.0 and cutlass["output"]["same_top1"] < 1.0
    assert cutlass["variant"]["numerics"]["serving"]["moe_runner_backend"] == "flashinfer_cutlass"
    # Where the damage comes from: the first layer's own error, on its own input.
    assert cutlass["blocks"][0]["local"]["relative_error"] > 0.0 == marlin["blocks"][0]["local"]["relative_error"]


def test_w4a16_is_lossy_and_further_than_fp8(variants):
    fp8 = compare(variants["native"], variants["fp8"], numerics="weights", chunk=SEQ)["output"]
    w4a16 = compare(variants["native"], variants["w4a16"], numerics="weights", chunk=SEQ)
    out = w4a16["output"]
    assert out["kld"]["mean"] > fp8["kld"]["mean"] == 0.0
    assert out["kld"]["percentiles"]["100"] >= out["kld"]["percentiles"]["99"] >= out["kld"]["percentiles"]["50"]
    assert 0.0 < out["expected_acceptance"] < 1.0 and out["same_top1"] < 1.0
    # Local error: every block with INT4 experts adds some; the free-running drift includes the earlier blocks'.
    assert all(b["local"]["relative_error"] > 0 for b in w4a16["blocks"])
    assert w4a16["blocks"][0]["local"] == w4a16["blocks"][0]["free_running"]


GPU = ("sm90", "sm100", "sm120")


def sglang_activation(scheme: str, runner: str, gpu: str) -> str | None:
    """The routed experts' activation numerics for SGLang's own MoE scheme and resolved runner
    (docs/served-numerics.md R1-R9), independent of how dsv4convert derives them."""
    if scheme == "fp8":
        return "fp8"
    if scheme == "mxfp4":
        return None if runner == "marlin" or (runner == "flashinfer_mxfp4" and gpu == "sm90") else "mxfp8"
    if scheme == "nvfp4":
        return None if runner == "marlin" else "nvfp4"
    return None


@pytest.mark.parametrize("gpu", GPU)
@pytest.mark.parametrize("variant", ["native", "fp8", "nvfp4", "nvfp4-mtp-mxfp4", "w4a16", "bf16"])
def test_served_expert_numerics_follow_sglangs_own_resolution(variants, variant, gpu):
    """The backbone's and the MTP draft's experts, against SGLang's own scheme and resolved runner (the draft's
    MXFP4 experts in an NVFP4 checkpoint go to its TRT-LLM MXFP4 method whatever the runner: W4A8)."""
    import sglang_oracle as sgl

    ckpt = Checkpoint.open(variants[variant])
    inspection = inspect_checkpoint(ckpt)
    serving = serving_for(inspection, ckpt.config, engine="sglang", gpu_family=gpu, model=str(ckpt.root))
    resolved = sgl.resolve_server_args(list(serving.server_args), gpu=gpu, env=serving.env).resolved_dict()
    qc = sgl.quant_config_for_checkpoint(ckpt.root, gpu=gpu, env=serving.env)
    for block, prefix, is_mtp in (("layers.3", "model.layers.3.mlp.experts", False),
                                  ("mtp.0", "model.decoder.mlp.experts", True)):
        scheme = sgl.moe_scheme_for(qc, prefix) if qc is not None else "unquantized"
        runner = resolved["moe_runner_backend"]
        if is_mtp and scheme == "mxfp4" and variant.startswith("nvfp4"):
            runner = "flashinfer_mxfp4 (TRT-LLM)"
        fmt = inspection.modules[f"{block}.ffn.experts.0.w1"].format
        assert serving.expert_scheme(fmt, is_mtp=is_mtp) == sglang_activation(scheme, runner, gpu), block
    assert serving.kv_cache_dtype == resolved["kv_cache_dtype"] == "fp8_e4m3"


def test_served_dense_numerics_per_gpu_family(variants):
    cases = {("native", "sm90"): ("ue8m0", None), ("native", "sm100"): ("ue8m0", "ue8m0"),
             ("native", "sm120"): ("float32", None), ("w4a16", "sm90"): ("float32", None),
             ("w4a16", "sm100"): ("ue8m0", None), ("fp8", "sm120"): ("float32", None)}
    for (variant, gpu), (dense, wo_a) in cases.items():
        ckpt = Checkpoint.open(variants[variant])
        serving = serving_for(inspect_checkpoint(ckpt), ckpt.config, engine="sglang", gpu_family=gpu)
        assert (serving.dense_scale_format(), serving.wo_a()) == (dense, wo_a), (variant, gpu)
    ckpt = Checkpoint.open(variants["nvfp4"])
    serving = serving_for(inspect_checkpoint(ckpt), ckpt.config, engine="sglang", gpu_family="sm100")
    assert serving.expert_scheme(Format.NVFP4, is_mtp=False) == "nvfp4"


def test_cli_writes_the_reports_and_fails_above_the_kld_bar(variants, tmp_path, capsys):
    report = tmp_path / "report"
    argv = ["compare", "--base", str(variants["native"]), "--variant", str(variants["w4a16"]), "--random-tokens",
            "--tokens", str(SEQ), "--seq-len", str(SEQ), "--numerics", "weights", "--no-progress",
            "--report", str(report)]
    assert main(argv + ["--fail-above-kld", "1e9"]) == 0
    printed = capsys.readouterr().out
    result = json.loads((report / "compare.json").read_text())
    assert f"mean KLD {result['output']['kld']['mean']:.6g}" in printed
    assert {p.name for p in report.iterdir()} == {"compare.json", "compare.md", "error_per_layer.png",
                                                  "kld_distribution.png"}
    md = (report / "compare.md").read_text()
    assert "| same top-1 |" in md and "layers.4" in md and "MTP draft" in md
    assert main(argv + ["--fail-above-kld", "0"]) == 1
    assert "above --fail-above-kld 0" in capsys.readouterr().out


def test_dry_run_prints_the_plan_and_writes_nothing(variants, tmp_path, capsys):
    report = tmp_path / "report"
    assert main(["compare", "--base", str(variants["native"]), "--variant", str(variants["nvfp4"]),
                 "--random-tokens", "--tokens", "512", "--seq-len", "256", "--dry-run", "--report", str(report)]) == 0
    out = capsys.readouterr().out
    assert "blocks: 6 (layers.0 .. mtp.0)" in out and "estimated peak device memory" in out
    assert "MoE runner marlin" in out and "dry run: nothing run" in out
    assert not report.exists()


def one_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    return err


def test_bad_inputs_are_one_line_and_exit_2(variants, tiny_ckpt, tmp_path, capsys):
    from dsv4convert.synth import preset_config, synthesize

    base = str(variants["native"])
    common = ["--random-tokens", "--tokens", str(SEQ), "--seq-len", str(SEQ), "--no-progress"]
    other = preset_config("tiny")
    other["num_hidden_layers"] = 4
    other["compress_ratios"] = other["compress_ratios"][:3] + other["compress_ratios"][4:]
    foreign = synthesize(tmp_path / "foreign", other, seed=1)
    assert main(["compare", "--base", base, "--variant", str(foreign), *common]) == 2
    err = one_error(capsys)
    assert "not a variant of the base model" in err and "compress_ratios" in err and str(foreign) in err

    wider = preset_config("tiny")
    wider["vocab_size"] *= 2
    vocab = synthesize(tmp_path / "vocab", wider, seed=1)
    assert main(["compare", "--base", base, "--variant", str(vocab), *common]) == 2
    assert "config key 'vocab_size' is 1024" in one_error(capsys)
    shutil.copy(vocab / "config.json", tmp_path / "vocab-config.json")
    lying = tmp_path / "lying"
    shutil.copytree(variants["fp8"], lying)
    shutil.copy(tmp_path / "vocab-config.json", lying / "config.json")   # says 1024, stores 512
    assert main(["compare", "--base", base, "--variant", str(lying), *common]) == 2
    assert "does not match the DeepSeek-V4 layout" in (err := one_error(capsys)) and "embed" in err

    broken = tmp_path / "broken"
    shutil.copytree(variants["fp8"], broken)
    index = json.loads((broken / "model.safetensors.index.json").read_text())
    dropped = next(n for n in index["weight_map"] if n.endswith("attn.wo_b.weight"))
    # A checkpoint whose index and shards agree but which lacks a tensor the layout needs.
    shard = broken / index["weight_map"][dropped]
    ckpt = Checkpoint.open(broken)
    kept = [e for e in ckpt.tensors_in(shard) if e.name != dropped]
    tensors = {e.name: ckpt.read(e.name) for e in kept}
    with ShardWriter(shard, [PlannedTensor(n, dtypes.of_tensor(t).name, dtypes.safetensors_shape(t))
                             for n, t in tensors.items()]) as writer:
        for n, t in tensors.items():
            writer.write(n, t)
    del index["weight_map"][dropped]
    index["metadata"].pop("total_size", None)
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    assert main(["compare", "--base", base, "--variant", str(broken), *common]) == 2
    assert "does not match the DeepSeek-V4 layout" in (err := one_error(capsys)) and "layers.0.attn.wo_b" in err

    text = tmp_path / "short.txt"
    text.write_text("a few words only")
    assert main(["compare", "--base", base, "--variant", str(variants["fp8"]), "--text", str(text), "--seq-len", "512",
                 "--tokens", "512", "--no-progress"]) == 2
    assert "less than one sequence" in (err := one_error(capsys)) and str(text) in err

    untokenized = tmp_path / "no-tokenizer"
    shutil.copytree(tiny_ckpt, untokenized)
    for f in untokenized.glob("tokenizer*"):
        f.unlink()
    text.write_text("hello world " * 400)
    assert main(["compare", "--base", str(untokenized), "--variant", str(variants["fp8"]), "--text", str(text),
                 "--seq-len", "64", "--tokens", "64", "--no-progress"]) == 2
    assert "tokenizer" in (err := one_error(capsys)) and str(untokenized) in err

    assert main(["compare", "--base", base, "--variant", str(variants["fp8"]), "--no-progress"]) == 2
    assert "no data: give --text FILE" in one_error(capsys)


def test_gptq_lowers_the_kld_of_round_to_nearest(tiny_ckpt, outputs, tmp_path):
    """GPTQ from the calibration data's Hessians against round-to-nearest INT4, judged on that data."""
    import random

    from dsv4convert.calibrate.stream import CalibrateOptions, Calibrator

    rng = random.Random(5)
    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing matches".split()
    data = tmp_path / "text.jsonl"
    data.write_text("".join(json.dumps({"text": " ".join(rng.choice(words) for _ in range(300))}) + "\n"
                            for _ in range(12)))
    calib = tmp_path / "calib.json"
    Calibrator(CalibrateOptions(source=tiny_ckpt, output=calib, data=data, num_sequences=4, seq_len=SEQ,
                                batch_size=4, dtype="float32", hessians=True, progress=False)).run()
    gptq = tmp_path / "gptq"
    assert main(["to-w4a16", "--src", str(tiny_ckpt), "--dst", str(gptq), "--calibration", str(calib), "--gptq",
                 "--no-progress"]) == 0
    kld = {name: compare(tiny_ckpt, path, random_tokens=False, texts=[data], tokens=2 * SEQ, chunk=SEQ,
                         numerics="weights")["output"]["kld"]["mean"]
           for name, path in (("rtn", outputs["w4a16"]), ("gptq", gptq))}
    assert 0 < kld["gptq"] < kld["rtn"], kld


def test_a_layer_that_fails_to_read_in_the_background_is_one_error(variants, tmp_path, capsys, monkeypatch):
    """A block's bytes are read on the reading thread while the previous block runs: its error still reaches the
    user as one line naming the file and tensor, exit 2, and no report is written."""
    import threading

    from dsv4convert.errors import CheckpointError
    from dsv4convert.model.blocks import WeightSource

    real, threads = WeightSource.read_block, set()

    def read_block(self, block):
        threads.add(threading.current_thread().name)
        if block == "layers.3":
            raise CheckpointError("truncated shard", file=self.ckpt.root, tensor=f"{block}.attn.wq_a.weight")
        return real(self, block)

    monkeypatch.setattr(WeightSource, "read_block", read_block)
    report = tmp_path / "report"
    assert main(["compare", "--base", str(variants["native"]), "--variant", str(variants["fp8"]), "--random-tokens",
                 "--tokens", str(SEQ), "--seq-len", str(SEQ), "--no-progress", "--report", str(report)]) == 2
    *said, err = capsys.readouterr().err.strip().splitlines()   # the expected time was said before the work (#54)
    assert said and all(line.startswith(("compare: expected ~", "compare: the first block took ")) for line in said)
    assert err.startswith("error: ") and "Traceback" not in err
    assert "layers.3.attn.wq_a.weight" in err and str(variants["native"]) in err
    assert threads and all(name.startswith("dsv4convert-read") for name in threads)
    assert not (report / "compare.json").exists()
