"""dsv4convert calibrate: the layer-streaming forward against one full transformers forward,
GPTQ against round-to-nearest and compressed-tensors, the calibration file, resume, bad inputs."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from transformers import DeepseekV4ForCausalLM, FineGrainedFP8Config
from transformers_oracle import load

from dsv4convert import dtypes
from dsv4convert.calibrate.report import nvfp4_activation_roundtrip
from dsv4convert.calibrate.stats import ExpertStats
from dsv4convert.calibrate.stream import CalibrateOptions, Calibrator, batches, work_dir
from dsv4convert.calibration import calibration_hessians, load_calibration
from dsv4convert.checkpoint import Checkpoint
from dsv4convert.cli import main
from dsv4convert.convert.modules import dequantize_source
from dsv4convert.errors import DSV4Error, FormatError
from dsv4convert.formats import (
    Format,
    dequantize_int4,
    dequantize_nvfp4,
    input_scale_from_amax,
    int4_group_scales,
    linear_storage,
    quantize_int4_weight,
    quantize_nvfp4,
)
from dsv4convert.formats.gptq import gptq_quantize_int4
from dsv4convert.inspection import inspect_checkpoint
from dsv4convert.models.deepseek_v4.layout import ModelConfig
from dsv4convert.model.blocks import COMPUTE_DTYPES, WeightSource, build_layer, hf_config
from dsv4convert.model.text import read_documents, token_windows

WORDS = ("the quick brown fox jumps over lazy dog model layer expert token weight scale calibration data "
         "stream alpha beta gamma delta 0 1 2 3 4 5 6 7 8 9 , . ; : ( ) [ ]").split()
N_SEQ, SEQ_LEN = 3, 64


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> Path:
    rng = random.Random(1)
    path = tmp_path_factory.mktemp("data") / "calib.jsonl"
    path.write_text("\n".join(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(400))})
                              for _ in range(40)) + "\n")
    return path


def _opts(src, output, data, **kw) -> CalibrateOptions:
    base = dict(num_sequences=N_SEQ, seq_len=SEQ_LEN, batch_size=N_SEQ, dtype="float32", hessians=True,
                progress=False)
    return CalibrateOptions(source=src, output=output, data=data, **{**base, **kw})


@pytest.fixture(scope="module")
def streamed(tiny_ckpt, data_file, tmp_path_factory) -> tuple[dict, Path]:
    """One calibration run of the whole tiny model (5 layers + MTP) with Hessians."""
    output = tmp_path_factory.mktemp("calib") / "calib.json"
    return Calibrator(_opts(tiny_ckpt, output, data_file)).run(), output


@pytest.fixture(scope="module")
def full_model(tiny_ckpt):
    """transformers' DeepseekV4ForCausalLM as from_pretrained loads the native checkpoint (BF16,
    FP8/MXFP4 dequantized by transformers), in float32: every stored value is exact in BF16."""
    model, _ = load(tiny_ckpt)
    return model.float()


def _oracle_stats(model, ids: torch.Tensor) -> dict[int, dict[str, torch.Tensor]]:
    """Per-expert statistics of one full forward, observed by hooks written independently here."""
    seen: dict[int, dict[str, torch.Tensor]] = {}

    def hook(layer_index):
        def observe(experts, args):
            x, top_k_index = args[0], args[1]
            n = experts.num_experts
            out = {"w13": torch.zeros(n), "w2": torch.zeros(n), "tokens": torch.zeros(n, dtype=torch.int64),
                   "h13": {}, "h2": {}}
            for e in range(n):
                routed = (top_k_index == e).any(dim=-1)
                if routed.any():
                    x13 = x[routed]
                    x2 = experts._apply_gate(F.linear(x13, experts.gate_up_proj[e]))
                    out["w13"][e], out["w2"][e] = x13.abs().max(), x2.abs().max()
                    out["tokens"][e] = int(routed.sum())
                    x13, x2 = x13.float(), x2.float()
                    out["h13"][e] = x13.T @ x13
                    out["h2"][e] = x2.T @ x2
            seen[layer_index] = out
        return observe

    handles = [layer.mlp.experts.register_forward_pre_hook(hook(i)) for i, layer in enumerate(model.model.layers)]
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for h in handles:
            h.remove()
    return seen


def test_streamed_statistics_equal_one_full_transformers_forward(streamed, full_model, tiny_ckpt, data_file):
    content, output = streamed
    ids, _ = token_windows(tiny_ckpt, data_file, num_sequences=N_SEQ, seq_len=SEQ_LEN)
    oracle = _oracle_stats(full_model, ids)
    cfg = ModelConfig.from_dict(Checkpoint.open(tiny_ckpt).config)
    hessians = calibration_hessians(output)
    assert len(oracle) == cfg.num_hidden_layers
    for layer_index, want in oracle.items():
        block = f"layers.{layer_index}"
        got = ExpertStats.load_scalars(work_dir(output) / f"{block}.safetensors")
        assert torch.equal(got.tokens, want["tokens"]), block
        assert torch.equal(got.w13_amax, want["w13"]), block
        assert torch.equal(got.w2_amax, want["w2"]), block
        assert int(got.tokens.sum()) == N_SEQ * SEQ_LEN * cfg.num_experts_per_tok
        for e in range(cfg.n_routed_experts):
            name = f"{block}.ffn.experts.{e}"
            if int(want["tokens"][e]) == 0:
                assert name in content["uncalibrated_experts"]["experts"] and name not in content["experts"]
                assert hessians(f"{name}.w1") is None
                continue
            assert content["experts"][name] == {"w13_input_amax": float(want["w13"][e]),
                                                "w2_input_amax": float(want["w2"][e]),
                                                "tokens": int(want["tokens"][e])}
            torch.testing.assert_close(hessians(f"{name}.w1"), want["h13"][e], rtol=1e-5, atol=1e-4)
            assert torch.equal(hessians(f"{name}.w3"), hessians(f"{name}.w1"))
            torch.testing.assert_close(hessians(f"{name}.w2"), want["h2"][e], rtol=1e-5, atol=1e-4)


def test_bf16_streaming_equals_the_bf16_transformers_forward(tiny_ckpt, data_file, tmp_path):
    """BF16, as on the GPU: the same equality against from_pretrained's own BF16 model."""
    output = tmp_path / "calib.json"
    Calibrator(_opts(tiny_ckpt, output, data_file, num_sequences=1, seq_len=48, batch_size=1, dtype="bfloat16",
                     hessians=False, mtp=False)).run()
    model = DeepseekV4ForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.bfloat16,
                                                  quantization_config=FineGrainedFP8Config(dequantize=True)).eval()
    assert model.model.layers[0].mlp.experts.gate_up_proj.dtype == torch.bfloat16
    ids, _ = token_windows(tiny_ckpt, data_file, num_sequences=1, seq_len=48)
    for layer_index, want in _oracle_stats(model, ids).items():
        got = ExpertStats.load_scalars(work_dir(output) / f"layers.{layer_index}.safetensors")
        assert torch.equal(got.tokens, want["tokens"]) and torch.equal(got.w13_amax, want["w13"]), layer_index
        assert torch.equal(got.w2_amax, want["w2"]), layer_index


def test_layers_hold_exactly_what_transformers_loads(full_model, tiny_ckpt):
    ckpt = Checkpoint.open(tiny_ckpt)
    cfg = ModelConfig.from_dict(ckpt.config)
    source = WeightSource(ckpt, inspect_checkpoint(ckpt), torch.device("cpu"), COMPUTE_DTYPES["float32"])
    for index in (0, 2, 3):    # hash + sliding, hash + CSA (compressor, indexer), top-k + HCA
        ours = build_layer(source, hf_config(ckpt.config), cfg, f"layers.{index}")
        theirs = full_model.model.layers[index]
        mine = dict([*ours.named_parameters(), *ours.named_buffers()])
        reference = dict([*theirs.named_parameters(), *theirs.named_buffers()])
        assert mine.keys() == reference.keys()
        for name, tensor in reference.items():
            assert torch.equal(mine[name], tensor), (index, name)


def test_mtp_block_is_calibrated(streamed, tiny_ckpt):
    content, output = streamed
    cfg = ModelConfig.from_dict(Checkpoint.open(tiny_ckpt).config)
    stats = ExpertStats.load_scalars(work_dir(output) / "mtp.0.safetensors")
    # MTP reads token t+1 with the backbone's streams at t: one position fewer per sequence.
    assert int(stats.tokens.sum()) == N_SEQ * (SEQ_LEN - 1) * cfg.num_experts_per_tok
    calibrated = [k for k in content["experts"] if k.startswith("mtp.0.")]
    assert len(calibrated) + sum(k.startswith("mtp.0.") for k in content["uncalibrated_experts"]["experts"]) == \
        cfg.n_routed_experts
    assert all(content["experts"][k]["w13_input_amax"] > 0 for k in calibrated)
    assert [b["block"] for b in content["blocks"]] == cfg.block_prefixes()


def test_calibration_file_is_what_to_nvfp4_reads(streamed):
    content, output = streamed
    assert load_calibration(output) == content["experts"]
    total = len(content["experts"]) + content["uncalibrated_experts"]["count"]
    assert total == 6 * 8 and content["data"]["tokens"] == N_SEQ * SEQ_LEN


def test_gptq_from_the_calibration_file_gives_the_w4a16_layout(streamed, tiny_ckpt):
    """What ``to-w4a16 --calibration FILE --gptq`` does per expert: the stored tensors are the ones
    the INT4 format plans (same names, dtypes, shapes as round-to-nearest), the codes are not."""
    _, output = streamed
    ckpt = Checkpoint.open(tiny_ckpt)
    hessians = calibration_hessians(output)
    for proj in ("w1", "w2"):
        module = f"layers.3.ffn.experts.5.{proj}"
        src = {p: ckpt.read(f"{module}.{p}") for p in ("weight", "scale")}
        w = dequantize_source(Format.MXFP4, src, f"{module}.weight", {})
        q = gptq_quantize_int4(w, hessians(module), group_size=128, name=module)
        planned = {p.suffix: (p.dtype, p.shape) for p in linear_storage(Format.INT4, *w.shape, group_size=128)}
        stored = {"weight_packed": q.weight_packed, "weight_scale": q.weight_scale, "weight_shape": q.weight_shape}
        assert {k: (dtypes.of_tensor(v).name, dtypes.safetensors_shape(v)) for k, v in stored.items()} == planned
        assert not torch.equal(q.weight_packed, quantize_int4_weight(w).weight_packed)


def test_interrupted_run_resumes_to_the_same_result(streamed, tiny_ckpt, data_file, tmp_path):
    reference, reference_output = streamed
    output = tmp_path / "calib.json"
    assert Calibrator(_opts(tiny_ckpt, output, data_file, hessians=False, max_blocks=2)).run() == {}
    finished = sorted(p.name for p in work_dir(output).glob("*.safetensors"))
    assert finished == ["layers.0.safetensors", "layers.1.safetensors"]
    resumed = Calibrator(_opts(tiny_ckpt, output, data_file, hessians=False)).run()
    assert resumed["experts"] == reference["experts"]
    assert not (work_dir(output) / "states").exists()
    with pytest.raises(DSV4Error, match="another checkpoint, data or options"):
        Calibrator(_opts(tiny_ckpt, output, data_file, hessians=False, seq_len=32)).run()


def test_gptq_lowers_held_out_error_on_every_layer(tiny_ckpt, data_file, tmp_path, capsys):
    content = Calibrator(_opts(tiny_ckpt, tmp_path / "calib.json", data_file, num_sequences=8, seq_len=128,
                               holdout=2, batch_size=10, hessians=False, report=True, report_experts=4)).run()
    rows = content["report"]
    with capsys.disabled():
        print("\nblock     nvfp4 calibrated  nvfp4 data-free  int4 RTN amax  int4 RTN  int4 GPTQ")
        for r in rows:
            print(f"{r['block']:<9} {r['nvfp4_calibrated']:16.5f} {r['nvfp4_data_free']:16.5f} "
                  f"{r['int4_rtn_amax']:14.5f} {r['int4_rtn']:9.5f} {r['int4_gptq']:10.5f}")
    assert [r["block"] for r in rows] == ModelConfig.from_dict(Checkpoint.open(tiny_ckpt).config).block_prefixes()
    for r in rows:
        assert r["experts_evaluated"] == 4 and r["heldout_rows"] > 0
        assert 0 < r["int4_gptq"] < r["int4_rtn"], r      # GPTQ beats data-free (both searched scales)
        assert 0 < r["int4_rtn"] < r["int4_rtn_amax"], r  # the search beats amax / 7.5 on outputs too
        assert 0 < r["nvfp4_calibrated"] < 0.5 and 0 < r["nvfp4_data_free"] < 0.5
    assert "hessians" not in content   # the report's Hessians are not kept without --hessians


def _correlated_inputs(k: int, rows: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(k, k, generator=g) / k**0.5 + torch.eye(k)
    x = torch.randn(rows, k, generator=g) @ mix
    x[:, :3] *= 20.0      # outlier channels, as real activations have
    return x


def test_gptq_output_packs_like_compressed_tensors():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 256, generator=g)
    x = _correlated_inputs(256, 1024, 1)
    gptq = gptq_quantize_int4(w, x.T @ x)
    rtn = quantize_int4_weight(w)
    for a, b in ((gptq.weight_packed, rtn.weight_packed), (gptq.weight_scale, rtn.weight_scale),
                 (gptq.weight_shape, rtn.weight_shape)):
        assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(gptq.weight_shape, rtn.weight_shape) and not torch.equal(gptq.weight_packed, rtn.weight_packed)
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=4, type="int", symmetric=True, strategy="group", group_size=128))
    stored = {"weight_packed": gptq.weight_packed, "weight_scale": gptq.weight_scale, "weight_shape": gptq.weight_shape}
    theirs = PackedQuantizationCompressor.decompress(stored, scheme)["weight"]
    ours = dequantize_int4(gptq.weight_packed, gptq.weight_scale, gptq.weight_shape)
    assert torch.equal(theirs, ours.to(theirs.dtype))
    # compressed-tensors re-compresses the GPTQ weights to the same codes: they lie on its grid.
    again = PackedQuantizationCompressor.compress({"weight": ours, "weight_scale": gptq.weight_scale}, scheme)
    assert torch.equal(again["weight_packed"], gptq.weight_packed)
    out_error = [float((x @ w.T - x @ dequantize_int4(q.weight_packed, q.weight_scale, q.weight_shape).T).norm())
                 for q in (gptq, rtn)]
    assert out_error[0] < 0.8 * out_error[1]


@pytest.mark.parametrize("scale_rule", ["mse", "amax"])
@pytest.mark.parametrize("group_size", [32, 128])
def test_gptq_with_uncorrelated_inputs_is_round_to_nearest(scale_rule, group_size):
    w = torch.randn(16, 256, generator=torch.Generator().manual_seed(2))
    diagonal = torch.diag(torch.rand(256, generator=torch.Generator().manual_seed(3)) + 0.5)
    q = gptq_quantize_int4(w, diagonal, group_size=group_size, scale_rule=scale_rule)
    r = quantize_int4_weight(w, group_size=group_size, scale_rule=scale_rule)
    assert torch.equal(q.weight_packed, r.weight_packed) and torch.equal(q.weight_scale, r.weight_scale)
    no_tokens = gptq_quantize_int4(w, torch.zeros(256, 256), group_size=group_size, scale_rule=scale_rule)
    assert torch.equal(no_tokens.weight_packed, r.weight_packed)


@pytest.mark.parametrize("group_size", [32, 128])
def test_gptq_searches_each_group_scale_on_the_updated_weights(group_size):
    """The squared-error search runs inside GPTQ's column loop: the first group (which no earlier
    column has updated) gets round-to-nearest's searched scale, later groups their own search."""
    g = torch.Generator().manual_seed(6)
    w = torch.randn(64, 256, generator=g)
    x, held = _correlated_inputs(256, 3072, 7).split([2048, 1024])  # one input distribution
    hessian = x.T @ x
    searched = gptq_quantize_int4(w, hessian, group_size=group_size, scale_rule="mse")
    amax = gptq_quantize_int4(w, hessian, group_size=group_size, scale_rule="amax")
    first = int4_group_scales(w[:, :group_size], group_size=group_size, scale_rule="mse").to(torch.bfloat16)
    assert torch.equal(searched.weight_scale[:, :1], first)
    assert not torch.equal(searched.weight_scale, amax.weight_scale)

    def output_error(q):
        restored = dequantize_int4(q.weight_packed, q.weight_scale, q.weight_shape, group_size=group_size)
        return float((held @ w.T - held @ restored.T).norm())

    rtn = quantize_int4_weight(w, group_size=group_size, scale_rule="mse")
    assert output_error(searched) < output_error(amax) and output_error(searched) < output_error(rtn)


@pytest.mark.parametrize("hessian, group, match", [
    (torch.eye(128), 128, "must be \\[256, 256\\]"),
    (torch.full((256, 256), float("nan")), 128, "NaN"),
    (torch.eye(256), 100, "multiple of 100"),
    (torch.eye(256) - 0.9 * torch.ones(256, 256), 128, "not positive definite"),
])
def test_gptq_refuses_bad_inputs(hessian, group, match):
    w = torch.randn(8, 256, generator=torch.Generator().manual_seed(4))
    with pytest.raises(FormatError, match=match):
        gptq_quantize_int4(w, hessian, group_size=group)


def test_nvfp4_activation_roundtrip_is_modelopt_quantization():
    x = torch.randn(32, 256, generator=torch.Generator().manual_seed(5)) * 3
    amax = x.abs().max()
    q = quantize_nvfp4(x, global_amax=amax)
    reference = dequantize_nvfp4(q.weight, q.weight_scale, q.weight_scale_2)
    assert torch.equal(nvfp4_activation_roundtrip(x, input_scale_from_amax(amax)), reference)
    # a scale calibrated too small saturates at 6 * 448 * input_scale
    clipped = nvfp4_activation_roundtrip(x, input_scale_from_amax(amax / 100))
    assert float(clipped.abs().max()) == pytest.approx(float(amax) / 100, rel=1e-6)


def test_hessian_loader_refuses_what_it_cannot_serve(streamed, tmp_path):
    _, output = streamed
    hessians = calibration_hessians(output)
    with pytest.raises(DSV4Error, match="not a routed expert projection"):
        hessians("layers.1.attn.wq_a")
    with pytest.raises(DSV4Error, match="no Hessians for block"):
        hessians("layers.9.ffn.experts.0.w1")
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps({"format": "dsv4convert.calibration/1", "experts": {}}))
    with pytest.raises(DSV4Error, match="has no Hessians"):
        calibration_hessians(bare)
    content = json.loads(output.read_text())
    content["hessians"]["layers.0"] = "missing.safetensors"
    moved = tmp_path / "moved.json"
    moved.write_text(json.dumps(content))
    with pytest.raises(DSV4Error, match="missing"):
        calibration_hessians(moved)


def test_calibration_data_inputs(tiny_ckpt, tmp_path):
    text = tmp_path / "plain.txt"
    text.write_text("hello world " * 50)
    assert read_documents(text) == ["hello world " * 50]
    calib, held = token_windows(tiny_ckpt, text, num_sequences=2, seq_len=16, holdout=1)
    assert calib.shape == (2, 16) and held.shape == (1, 16) and calib.dtype == torch.int64
    with pytest.raises(DSV4Error, match="need 2000"):
        token_windows(tiny_ckpt, text, num_sequences=100, seq_len=20)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": 3}\n')
    with pytest.raises(DSV4Error, match="line 2 has no"):
        read_documents(bad)
    bad.write_text('{"text": "fine"}\nnot json\n')
    with pytest.raises(DSV4Error, match="line 2 is not JSON"):
        read_documents(bad)
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    with pytest.raises(DSV4Error, match="no text"):
        read_documents(empty)
    with pytest.raises(DSV4Error, match="not found"):
        read_documents(tmp_path / "absent.txt")


def test_batches_never_mix_calibration_and_held_out():
    assert batches(5, 7, 2) == [slice(0, 2), slice(2, 4), slice(4, 5), slice(5, 7)]
    assert batches(3, 3, 8) == [slice(0, 3)]


def test_cli_reports_bad_options_in_one_line(tiny_ckpt, data_file, tmp_path, capsys):
    base = ["calibrate", "--src", str(tiny_ckpt), "--output", str(tmp_path / "c.json"), "--device", "cpu"]
    assert main(base + ["--calibration-data", str(tmp_path / "absent.txt")]) == 2
    assert "text file not found" in capsys.readouterr().err
    assert main(base + ["--calibration-data", str(data_file), "--batch-size", "0"]) == 2
    assert "--batch-size must be at least 1" in capsys.readouterr().err
    assert main(base + ["--calibration-data", str(data_file), "--report", "--holdout", "0"]) == 2
    assert "--report needs held-out sequences" in capsys.readouterr().err
    assert main(["calibrate", "--src", str(tiny_ckpt), "--output", str(tmp_path / "c.json"), "--device", "tpu",
                 "--calibration-data", str(data_file)]) == 2
    assert "unknown --device 'tpu'" in capsys.readouterr().err


def test_cli_writes_the_file_and_prints_the_report(tiny_ckpt, data_file, tmp_path, capsys):
    output = tmp_path / "c.json"
    assert main(["calibrate", "--src", str(tiny_ckpt), "--output", str(output), "--calibration-data", str(data_file),
                 "--device", "cpu", "--dtype", "float32", "--num-sequences", "1", "--seq-len", "32", "--no-mtp",
                 "--report", "--holdout", "1", "--report-experts", "2"]) == 0
    captured = capsys.readouterr()
    printed = captured.out
    # the expected time (#54) comes before the first block's progress line, from the plan's counts (5 blocks)
    err = captured.err.splitlines()
    assert err[0].startswith("calibrate: expected ~") and " for 5 block(s) x 2 x 32 tokens: " in err[0]
    assert float(err[0].split(" GFLOP at")[0].rsplit(" ", 1)[1]) > 0
    assert err[1].startswith("calibrate: the first block took ") and err[2].startswith("calibrate: layers.0 done")
    content = json.loads(output.read_text())
    assert f"{len(content['experts'])} experts calibrated" in printed
    assert [r["block"] for r in content["report"]] == [f"layers.{i}" for i in range(5)]
    assert all(f"\n{r['block']} " in printed for r in content["report"])


def test_to_w4a16_gptq_uses_the_calibration_hessians(streamed, tiny_ckpt, outputs, tmp_path, capsys):
    """`to-w4a16 --calibration FILE --gptq`: same layout as round-to-nearest, lower GPTQ objective
    tr((W - Q) H (W - Q)^T) on every expert that saw calibration tokens."""
    from dsv4convert.calibration import calibration_hessians
    from dsv4convert.checkpoint import Checkpoint

    _, calib = streamed
    dst = tmp_path / "gptq"
    assert main(["to-w4a16", "--src", str(tiny_ckpt), "--dst", str(dst), "--calibration", str(calib), "--gptq",
                 "--no-progress"]) == 0
    gptq, rtn, src = Checkpoint.open(dst), Checkpoint.open(outputs["w4a16"]), Checkpoint.open(tiny_ckpt)
    assert [(n, e.dtype, e.shape) for n, e in gptq.tensors.items()] == [(n, e.dtype, e.shape) for n, e in rtn.tensors.items()]
    assert inspect_checkpoint(gptq).ok
    # The same quantization_config as round-to-nearest, which SGLang's own config classes accept
    # module by module (tests/test_quant_config.py, tests/test_model_card.py).
    assert json.loads((dst / "config.json").read_text()) == json.loads((outputs["w4a16"] / "config.json").read_text())
    hessians = calibration_hessians(calib)
    improved = 0
    for module in [n[: -len(".weight_packed")] for n in gptq.tensors if n.endswith(".weight_packed")]:
        h = hessians(module)
        w = dequantize_source(Format.MXFP4, {"weight": src.read(f"{module}.weight"), "scale": src.read(f"{module}.scale")},
                              module, {})

        def objective(ck: Checkpoint) -> float:
            q = dequantize_source(Format.INT4, {p: ck.read(f"{module}.{p}") for p in
                                                ("weight_packed", "weight_scale", "weight_shape")}, module, {})
            d = (q - w).double()
            return float(torch.einsum("nk,kl,nl->", d, h.double(), d))

        if h is None or float(h.abs().sum()) == 0:
            assert torch.equal(gptq.read(f"{module}.weight_packed"), rtn.read(f"{module}.weight_packed")), module
            continue
        assert objective(gptq) < objective(rtn), module
        improved += 1
    assert improved >= 20
    assert main(["to-w4a16", "--src", str(tiny_ckpt), "--dst", str(tmp_path / "x"), "--gptq", "--no-progress"]) == 2
    assert "--gptq needs --calibration" in capsys.readouterr().err
