"""Converters end to end on the tiny synthetic checkpoint, checked against independent code."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from dsv4convert.checkpoint import Checkpoint
from dsv4convert.cli import main
from dsv4convert.convert import execute
from dsv4convert.formats import dequantize_fp8_block, dequantize_nvfp4
from dsv4convert.inspection import inspect_checkpoint
from transformers_oracle import load, logits, prompt_ids

from conftest import SHARD, run


def tensor_bytes(path: Path) -> dict[str, bytes]:
    ckpt = Checkpoint.open(path)
    return {n: ckpt.read(n).reshape(-1).view(torch.uint8).numpy().tobytes() for n in ckpt.tensors}


# conftest's outputs -> (the variant inspect names, the engines it was made for)
DETECTED = {"fp8": ("fp8", ["sglang", "vllm"]), "nvfp4": ("nvfp4-mtp-bf16", ["sglang", "vllm"]),
            "nvfp4-mtp-mxfp4": ("nvfp4-mtp-mxfp4", ["sglang", "vllm"]), "w4a16": ("w4a16", ["sglang", "vllm"]),
            "bf16": ("bf16", ["sglang", "vllm"]), "fp8@sglang": ("fp8", ["sglang"]),
            "nvfp4@sglang": ("nvfp4", ["sglang"]), "nvfp4@vllm": ("nvfp4-mtp-mxfp4", ["vllm"]),
            "w4a16@sglang": ("w4a16", ["sglang"])}


@pytest.mark.parametrize("output", list(DETECTED))
def test_every_output_is_a_complete_checkpoint(outputs, tiny_ckpt, output):
    dst = outputs[output]
    variant, engines = DETECTED[output]
    ckpt = Checkpoint.open(dst)
    result = inspect_checkpoint(ckpt)
    assert result.ok and result.variant == variant
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == ckpt.total_bytes
    assert len(ckpt.shards) > 4
    assert all(p.stat().st_size <= SHARD + 200_000 for p in ckpt.shards)
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "README.md", "provenance.json"):
        assert (dst / name).is_file(), name
    assert not list(dst.glob(".*.partial"))
    source = Checkpoint.open(tiny_ckpt)
    # F32 tensors (hc_*, attn_sink, ape, gate.bias) and I64 tid2eid keep their dtype and bytes.
    for name, entry in source.tensors.items():
        if entry.dtype in ("F32", "I64"):
            assert ckpt.tensors[name].dtype == entry.dtype, name
            assert torch.equal(ckpt.read(name), source.read(name)), name
    provenance = json.loads((dst / "provenance.json").read_text())
    assert provenance["recipe"]["name"] == output.split("@")[0] and provenance["source"] == str(tiny_ckpt)
    assert provenance["engines"] == engines
    card = (dst / "README.md").read_text()
    assert variant in card.lower() and all(engine in card.lower() for engine in engines)


def test_fp8_and_bf16_give_bit_identical_logits(outputs, tiny_ckpt):
    ids = prompt_ids(tiny_ckpt)
    reference = logits(tiny_ckpt, ids)
    for variant in ("fp8", "bf16"):
        assert torch.equal(logits(outputs[variant], ids), reference), variant


def _kl_top1(got: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    kl = torch.nn.functional.kl_div(got.log_softmax(-1), ref.log_softmax(-1), log_target=True, reduction="none")
    return float(kl.sum(-1).mean()), float((got.argmax(-1) == ref.argmax(-1)).float().mean())


@torch.no_grad()
def test_w4a16_logits_are_as_close_as_its_weight_error_allows(outputs, tiny_ckpt, tmp_path):
    """W4A16 is lossy, and a tiny random model amplifies weight error. Dequantize the output to
    BF16 and compare next-token distributions with the source's, against a control: the source
    with Gaussian noise of the same per-matrix SNR in its experts. A wrong decode (nibble order,
    scale, offset) would be far worse than noise of the measured SNR; correct INT4 is not."""
    run(outputs["w4a16"], tmp_path / "w4a16-bf16", "bf16")
    ids = prompt_ids(tiny_ckpt)
    source, _ = load(tiny_ckpt)
    converted, _ = load(tmp_path / "w4a16-bf16")
    ref = source(ids).logits[0]
    got = converted(ids).logits[0]
    g = torch.Generator().manual_seed(0)
    snrs = []
    for src_layer, out_layer in zip(source.model.layers, converted.model.layers):
        for name in ("gate_up_proj", "down_proj"):
            w, q = getattr(src_layer.mlp.experts, name), getattr(out_layer.mlp.experts, name)
            rel = (q - w).flatten(1).norm(dim=1) / w.flatten(1).norm(dim=1)
            snrs.append(float(-20 * torch.log10(rel).mean()))
            w.add_(torch.randn(w.shape, generator=g) * rel[:, None, None] * w.flatten(1).norm(dim=1)[:, None, None]
                   / w[0].numel() ** 0.5)
    control = source(ids).logits[0]
    kl, top1 = _kl_top1(got, ref)
    kl_control, top1_control = _kl_top1(control, ref)
    print(f"w4a16 vs source: mean KL {kl:.3f}, top-1 agreement {top1:.3f} (expert weight SNR {min(snrs):.1f}-"
          f"{max(snrs):.1f} dB); Gaussian noise of the same SNR: KL {kl_control:.3f}, top-1 {top1_control:.3f}")
    assert 8.0 < min(snrs) and max(snrs) < 25.0
    assert 0.0 < kl < 1.5 * kl_control
    assert top1 > 0.5 * top1_control


def test_mxfp4_experts_are_lossless_in_fp8_and_nvfp4(outputs, tiny_ckpt):
    """Decode both sides independently: the source with transformers' MXFP4 decoder, the outputs
    with our FP8/NVFP4 decoders; every routed expert must be bit-identical."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    decode_source = Fp8Dequantize(None)._dequantize_one
    src = Checkpoint.open(tiny_ckpt)
    fp8 = {name: Checkpoint.open(outputs[name]) for name in ("fp8", "fp8@sglang")}  # F32 and E8M0 scales
    nv = Checkpoint.open(outputs["nvfp4"])
    nv_sglang, nv_vllm = Checkpoint.open(outputs["nvfp4@sglang"]), Checkpoint.open(outputs["nvfp4@vllm"])
    assert fp8["fp8"].entry("layers.0.ffn.experts.0.w1.scale").dtype == "F32"
    assert fp8["fp8@sglang"].entry("layers.0.ffn.experts.0.w1.scale").dtype == "F8_E8M0"
    experts = [n[: -len(".weight")] for n in src.tensors if ".experts." in n and n.endswith(".weight")]
    assert len(experts) == 144
    w2_shared = 0
    for module in experts:
        reference = decode_source(src.read(f"{module}.weight"), src.read(f"{module}.scale"), output_dtype=torch.float32)
        for out in fp8.values():
            got = dequantize_fp8_block(out.read(f"{module}.weight"), out.read(f"{module}.scale"), block=(128, 128))
            assert torch.equal(got, reference), module
        if module.startswith("mtp."):  # the draft's experts: BF16 for both engines, FP8 for SGLang, MXFP4 for vLLM
            assert torch.equal(nv.read(f"{module}.weight").float(), reference), module
            got = dequantize_fp8_block(nv_sglang.read(f"{module}.weight"), nv_sglang.read(f"{module}.scale"), block=(128, 128))
            assert torch.equal(got, reference), module
            for suffix in ("weight", "scale"):
                assert torch.equal(nv_vllm.read(f"{module}.{suffix}"), src.read(f"{module}.{suffix}")), module
            continue
        got = dequantize_nvfp4(nv.read(f"{module}.weight"), nv.read(f"{module}.weight_scale"),
                               nv.read(f"{module}.weight_scale_2"))
        assert torch.equal(got, reference), module
        if module.endswith(".w1"):
            partner = module[:-2] + "w3"
            assert torch.equal(nv.read(f"{module}.weight_scale_2"), nv.read(f"{partner}.weight_scale_2"))
            assert torch.equal(nv.read(f"{module}.input_scale"), nv.read(f"{partner}.input_scale"))
            w2_shared += 1
    assert w2_shared == 40
    stats = json.loads((outputs["nvfp4"] / "provenance.json").read_text())["stats"]
    assert stats["lossless_blocks"] == stats["total_blocks"] > 0


def test_nvfp4_data_free_input_scales_bound_the_activations(outputs, tiny_ckpt):
    src = Checkpoint.open(tiny_ckpt)
    nv = Checkpoint.open(outputs["nvfp4"])
    hidden = src.config["hidden_size"]
    norm = src.read("layers.3.ffn_norm.weight").float().abs().max()
    w1 = float(nv.read("layers.3.ffn.experts.0.w1.input_scale"))
    w2 = float(nv.read("layers.3.ffn.experts.0.w2.input_scale"))
    assert w1 == pytest.approx(float(hidden ** 0.5 * norm) / (6 * 448), rel=1e-6)
    assert w2 == pytest.approx(src.config["swiglu_limit"] ** 2 / (6 * 448), rel=1e-6)


def test_workers_and_resume_are_byte_identical(outputs, tiny_ckpt, tmp_path, monkeypatch):
    reference = tensor_bytes(outputs["nvfp4"])
    # Two workers: same bytes.
    run(tiny_ckpt, tmp_path / "two", "nvfp4", workers=2)
    assert tensor_bytes(tmp_path / "two") == reference
    # Interrupted after three shards, then resumed: same bytes, finished shards not rewritten.
    original = execute.run_shard_job
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 4:
            raise KeyboardInterrupt
        return original(*args, **kwargs)

    monkeypatch.setattr(execute, "run_shard_job", flaky)
    dst = tmp_path / "resumed"
    with pytest.raises(execute.DSV4Error, match="--resume"):
        run(tiny_ckpt, dst, "nvfp4")
    assert not (dst / "model.safetensors.index.json").exists()
    finished = {p.name: p.stat().st_mtime_ns for p in dst.glob("model-*.safetensors")}
    assert len(finished) == 3
    monkeypatch.setattr(execute, "run_shard_job", original)
    with pytest.raises(execute.DSV4Error, match="not empty"):
        run(tiny_ckpt, dst, "nvfp4")
    with pytest.raises(execute.DSV4Error, match="differ from the interrupted run"):
        run(tiny_ckpt, dst, "fp8", resume=True)
    run(tiny_ckpt, dst, "nvfp4", resume=True)
    assert tensor_bytes(dst) == reference
    assert {n: (dst / n).stat().st_mtime_ns for n in finished} == finished
    for name in ("config.json", "hf_quant_config.json", "model.safetensors.index.json"):
        assert (dst / name).read_bytes() == (outputs["nvfp4"] / name).read_bytes(), name
    # The model card's launch commands name the output directory; otherwise it is the same.
    card = (dst / "README.md").read_text().replace(str(dst), "DST")
    assert card == (outputs["nvfp4"] / "README.md").read_text().replace(str(outputs["nvfp4"]), "DST")


def test_nvfp4_mtp_experts_option_picks_the_mxfp4_recipe(tiny_ckpt, tmp_path, capsys):
    dst = tmp_path / "dry"
    argv = ["to-nvfp4", "--src", str(tiny_ckpt), "--dst", str(dst), "--dry-run", "--no-progress"]
    assert main([*argv, "--mtp-experts", "mxfp4"]) == 0
    out = capsys.readouterr().out
    assert "nvfp4-mtp-mxfp4" in out and "mxfp4 -> nvfp4 x120" in out and "kept as mxfp4 x24" in out
    with pytest.raises(SystemExit):
        main([*argv, "--mtp-experts", "nvfp4"])
    assert not dst.exists()


def test_dry_run_writes_nothing(tiny_ckpt, tmp_path, capsys):
    dst = tmp_path / "dry"
    assert main(["to-nvfp4", "--src", str(tiny_ckpt), "--dst", str(dst), "--dry-run", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "mxfp4 -> nvfp4 x120" in out and "mxfp4 -> bf16 x24" in out and "dry run: nothing written" in out
    assert "for SGLang 0.5.23 and vLLM 0.33.0 (--engine both)" in out
    assert main(["to-nvfp4", "--src", str(tiny_ckpt), "--dst", str(dst), "--dry-run", "--engine", "sglang"]) == 0
    out = capsys.readouterr().out
    assert "mxfp4 -> fp8 x24" in out and "for SGLang 0.5.23 (--engine sglang)" in out
    assert not dst.exists()


def test_destination_rules(tiny_ckpt, tmp_path, capsys):
    code = main(["to-fp8", "--src", str(tiny_ckpt), "--dst", str(tiny_ckpt / "out"), "--no-progress"])
    assert code == 2 and "inside the source" in capsys.readouterr().err
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("user data")
    code = main(["to-fp8", "--src", str(tiny_ckpt), "--dst", str(tmp_path / "full"), "--no-progress"])
    assert code == 2 and "not empty" in capsys.readouterr().err
    assert (tmp_path / "full" / "keep.txt").read_text() == "user data"


def test_lock_refuses_a_second_run_and_recovers_a_stale_one(tiny_ckpt, tmp_path, capsys):
    dst = tmp_path / "locked"
    (dst / ".dsv4convert").mkdir(parents=True)
    lock = dst / ".dsv4convert" / "lock"
    lock.write_text(json.dumps({"pid": os.getpid(), "host": os.uname().nodename}))
    with pytest.raises(execute.DSV4Error, match="another conversion"):
        run(tiny_ckpt, dst, "fp8", overwrite=True)
    dead = os.fork()
    if dead == 0:
        os._exit(0)
    os.waitpid(dead, 0)
    lock.write_text(json.dumps({"pid": dead, "host": os.uname().nodename}))
    run(tiny_ckpt, dst, "fp8", overwrite=True)
    assert "stale lock" in capsys.readouterr().err
    assert inspect_checkpoint(Checkpoint.open(dst)).variant == "fp8" and not lock.exists()


def test_nan_in_source_stops_the_run_naming_the_tensor(tiny_ckpt, tmp_path, capsys):
    src = tmp_path / "nan"
    shutil.copytree(tiny_ckpt, src)
    ckpt = Checkpoint.open(src)
    entry = ckpt.entry("layers.3.ffn.experts.2.w1.scale")
    with open(entry.path, "r+b") as f:
        f.seek(entry.start + 5)
        f.write(b"\xff")  # E8M0 0xFF is NaN
    code = main(["to-nvfp4", "--src", str(src), "--dst", str(tmp_path / "out"), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and "layers.3.ffn.experts.2.w1.scale" in err and "NaN" in err and entry.path.name in err
    assert not (tmp_path / "out" / "model.safetensors.index.json").exists()


KEEP_REST = "  - match: {}\n    format: keep\n    reason: everything else as in the source\n"


@pytest.mark.parametrize(
    "recipe, message",
    [
        ("name: x\nrules:\n  - match: {role: routed_expert}\n    format: nvfp4\n    colour: red\n",
         "rules[0]: unknown key"),
        ("name: x\nrules:\n  - match: {role: routed_expert}\n    format: fp4\n", "rules[0].format"),
        ("name: x\nrules:\n  - match: {role: routed_expert}\n    format: int4\n    params: {group_size: 64}\n",
         "rules[0].params.group_size"),
        ("name: x\nrules:\n  - match: {role: norm}\n    format: keep\n", "rules[0]: 'reason' is a required"),
        ("name: x\nrules:\n  - match: {role: [routed_expert, norm]}\n    format: nvfp4\n" + KEEP_REST,
         "not a linear weight"),
        ("name: x\nrules:\n  - match: {role: compressor, module: '.*wkv'}\n    format: fp8\n" + KEEP_REST,
         "rules[0] asks for fp8 on 'layers.2.attn.compressor.wkv', but SGLang builds the compressor"),
        ("name: x\nrules:\n  - match: {role: routed_expert}\n    format: fp8\n", "no rule matches module"),
        ("name: x\nrules:\n  - match: {role: routed_expert, module: '.*w1'}\n    format: nvfp4\n" + KEEP_REST,
         "SGLang fuses w1 and w3"),
    ],
)
def test_bad_recipes_name_the_path(tiny_ckpt, tmp_path, capsys, recipe, message):
    path = tmp_path / "recipe.yaml"
    path.write_text(recipe)
    code = main(["convert", "--recipe", str(path), "--src", str(tiny_ckpt), "--dst", str(tmp_path / "o"),
                 "--dry-run", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "recipe.yaml" in err, err
    assert not (tmp_path / "o").exists()


def test_mixed_recipe_keeps_indexer_bf16(tiny_ckpt, tmp_path):
    dst = tmp_path / "mixed"
    main(["convert", "--recipe", "recipes/nvfp4-bf16-indexer.yaml", "--src", str(tiny_ckpt), "--dst", str(dst),
          "--no-progress"])
    ckpt = Checkpoint.open(dst)
    assert ckpt.tensors["layers.2.attn.indexer.wq_b.weight"].dtype == "BF16"
    assert "layers.2.attn.indexer.wq_b.scale" not in ckpt.tensors
    assert ckpt.tensors["layers.2.ffn.experts.0.w1.weight"].dtype == "U8"
    assert inspect_checkpoint(ckpt).ok


def test_fp8_with_float32_scales(tiny_ckpt, tmp_path, capsys):
    dst = tmp_path / "fp8-f32"
    assert main(["to-fp8", "--scale-dtype", "float32", "--src", str(tiny_ckpt), "--dst", str(dst),
                 "--no-progress"]) == 0
    ckpt = Checkpoint.open(dst)
    assert ckpt.tensors["layers.3.ffn.experts.1.w2.scale"].dtype == "F32"
    assert ckpt.tensors["layers.3.attn.wq_a.scale"].dtype == "F8_E8M0"  # kept modules stay as they were
    assert inspect_checkpoint(ckpt).variant == "fp8"
    ids = prompt_ids(tiny_ckpt)
    assert torch.equal(logits(dst, ids), logits(tiny_ckpt, ids))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_check_finite_finds_nan_and_inf_anywhere(dtype, tmp_path):
    from dsv4convert.checkpoint import TensorEntry
    from dsv4convert.convert.modules import check_finite
    from dsv4convert.errors import FormatError

    entry = TensorEntry("w", "BF16", (1,), tmp_path / "s.safetensors", 0, 2)
    for n in (1, 33, 4099):
        check_finite(torch.randn(n).to(dtype), entry)
        for pos in {0, n // 2, n - 1}:
            for bad in (float("nan"), float("inf"), float("-inf")):
                t = torch.randn(n).to(dtype)
                t[pos] = bad
                with pytest.raises(FormatError, match="NaN or Inf"):
                    check_finite(t, entry)
    for raw, dt in ((0xFF, torch.float8_e8m0fnu), (0x7F, torch.float8_e4m3fn), (0xFF, torch.float8_e4m3fn)):
        t = torch.full((300,), 0x30, dtype=torch.uint8)
        check_finite(t.view(dt), entry)
        t[123] = raw
        with pytest.raises(FormatError, match="NaN or Inf"):
            check_finite(t.view(dt), entry)
