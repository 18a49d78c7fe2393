"""tiny-v41 (``synth --preset tiny-v41``) through every DeepSeek-V4.1 variant, ``validate``, and both engines' real
V4.1 models and DSpark drafts on CPU, #53.

Each output is made once for the session (``convert --recipe nvfp4|fp8|bf16|w4a16``: conftest's ``v41_outputs``).
Asserted: the Engram tables' bytes are the source's in every output (hashed); ``text_config`` and ``vision_config``
are the source's and only ``quantization_config`` changes; the tokenizer ships; ``validate --against`` passes each
and names the same Engram hashes; SGLang 0.5.23's V4.1 model and DSpark draft load every output where SGLang runs it (NVFP4 on sm_100, its
only family), every tensor reaching a parameter and every parameter written (``test_v41_loading.unaccounted``,
``unwritten``); vLLM 0.33.0's loads NVFP4 and BF16, and fails to build FP8 experts in 32x32 blocks, the reason the
converter names; an engine asked for that cannot load a variant, and each bad input, is one ``error:`` line naming
the file and tensor, exit 2, nothing written.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import sglang_oracle as sgl
import sglang_v41_oracle as v41
import torch
import vllm_oracle as vllm
from safetensors import safe_open
from safetensors.torch import save_file
from conftest import V41_VARIANTS as VARIANTS
from test_v41_loading import unaccounted

from dsv4convert.cli import main
from dsv4convert.engines.sglang.quant_config import v41_serving_env

ENGRAM = [f"layers.{layer}.engram.embed.{kind}" for layer in (1, 2) for kind in ("weight", "scale")]
# What each variant's routed experts are built as in SGLang's V4.1 model.
SGLANG_EXPERTS = {"nvfp4": "ModelOptNvFp4FusedMoEMethod", "fp8": "Fp8MoEMethod", "bf16": "UnquantizedFusedMoEMethod",
                  "w4a16": "CompressedTensorsFusedMoEMethod"}
# A family SGLang runs each variant on (nvfp4: sm_100 only, engines/sglang/quant_config.py::v41_family_problem).
SGLANG_FAMILY = {"nvfp4": "sm100", "fp8": "sm120", "bf16": "sm90", "w4a16": "sm90"}


def _entry_bytes(ckpt: Path, name: str) -> bytes:
    shard = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"][name]
    with safe_open(ckpt / shard, "pt") as f:
        return f.get_tensor(name).contiguous().view(torch.uint8).numpy().tobytes()


def _sha(ckpt: Path, name: str) -> str:
    return hashlib.sha256(_entry_bytes(ckpt, name)).hexdigest()


def _config(ckpt: Path) -> dict:
    return json.loads((ckpt / "config.json").read_text())


def test_the_engram_tables_are_the_sources_bytes_in_every_output(tiny_v41, v41_outputs):
    source = {name: _sha(tiny_v41, name) for name in ENGRAM}
    for variant, out in v41_outputs.items():
        assert {name: _sha(out, name) for name in ENGRAM} == source, variant


def test_only_the_quantization_config_changes(tiny_v41, v41_outputs):
    src = _config(tiny_v41)
    for variant, out in v41_outputs.items():
        cfg = _config(out)
        assert {k: v for k, v in cfg.items() if k != "quantization_config"} == \
            {k: v for k, v in src.items() if k != "quantization_config"}, variant
        assert (out / "tokenizer.json").read_bytes() == (tiny_v41 / "tokenizer.json").read_bytes()
    nvfp4 = _config(v41_outputs["nvfp4"])["quantization_config"]
    assert {k: nvfp4[k] for k in ("quant_method", "quant_algo", "moe_quant_algo", "group_size", "weight_block_size",
                                  "scale_fmt")} == {"quant_method": "fp8", "quant_algo": "MIXED_PRECISION",
                                                    "moe_quant_algo": "NVFP4", "group_size": 16,
                                                    "weight_block_size": [32, 32], "scale_fmt": "ue8m0"}
    assert "mtp.*" in nvfp4["ignore"] and nvfp4["producer"]["engines"] == ["sglang", "vllm"]
    assert _config(v41_outputs["fp8"])["quantization_config"]["expert_dtype"] == "fp8"
    assert _config(v41_outputs["fp8"])["quantization_config"]["producer"]["engines"] == ["sglang"]
    assert "quantization_config" not in _config(v41_outputs["bf16"])
    w4a16 = _config(v41_outputs["w4a16"])["quantization_config"]
    assert w4a16["quant_method"] == "compressed-tensors" and w4a16["linear_fp8_config"]["weight_block_size"] == [32, 32]


def test_what_each_variant_converts_and_keeps(tiny_v41, v41_outputs):
    """NVFP4 keeps the MXFP4 codes and the drafter's MXFP4 experts; every variant keeps the compressor, the indexer's
    BF16 half and the vision tower byte for byte."""
    kept = ["layers.2.attn.compressor.wkv.weight", "layers.2.attn.indexer.wk.weight", "vision.blocks.1.mlp.w2.weight",
            "layers.1.engram.q_weight"]
    for variant, out in v41_outputs.items():
        assert [_sha(out, n) for n in kept] == [_sha(tiny_v41, n) for n in kept], variant
    codes = "layers.0.ffn.experts.0.w1.weight"
    assert _entry_bytes(v41_outputs["nvfp4"], codes) == _entry_bytes(tiny_v41, codes)
    assert _sha(v41_outputs["nvfp4"], "mtp.0.ffn.experts.0.w1.scale") == _sha(tiny_v41, "mtp.0.ffn.experts.0.w1.scale")
    index = json.loads((v41_outputs["bf16"] / "model.safetensors.index.json").read_text())["weight_map"]
    assert not any(n.endswith(".scale") and ".engram.embed." not in n for n in index)   # every linear BF16


def test_validate_passes_every_output_and_names_the_engram_hashes(tiny_v41, v41_outputs, tmp_path, capsys):
    for variant, out in v41_outputs.items():
        report = tmp_path / variant
        assert main(["validate", str(out), "--against", str(tiny_v41), "--report", str(report), "--no-progress"]) == 0
        summary = json.loads((report / "validate.json").read_text())
        assert summary["variant"] == variant and summary["integrity_ok"], summary["integrity_problems"]
        assert summary["engram_sha256"] == {name: _sha(tiny_v41, name) for name in ENGRAM}
        exact = summary["modules"] if variant != "w4a16" else summary["modules"] - summary["exact_modules"]
        assert summary["modules"] > 0 and (summary["exact_modules"] == exact if variant != "w4a16" else exact > 0)
    assert "sm100 runs" in capsys.readouterr().out


def test_validate_names_a_tensor_whose_bytes_changed(tiny_v41, v41_outputs, tmp_path):
    broken = tmp_path / "nvfp4"
    shutil.copytree(v41_outputs["nvfp4"], broken)
    name = "layers.1.engram.embed.scale"
    shard = broken / json.loads((broken / "model.safetensors.index.json").read_text())["weight_map"][name]
    with safe_open(shard, "pt") as f:
        tensors = {n: f.get_tensor(n) for n in f.keys()}
    tensors[name] = tensors[name].view(torch.uint8).add(1).view(tensors[name].dtype)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    assert main(["validate", str(broken), "--against", str(tiny_v41), "--report", str(tmp_path / "r"),
                 "--no-progress"]) == 1
    problems = json.loads((tmp_path / "r" / "validate.json").read_text())["integrity_problems"]
    assert problems == [f"{shard.name}: {name}: kept by a nvfp4 output but its bytes differ from the source's"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_sglang_v41_model_and_draft_load_every_output(v41_outputs, variant):
    out, gpu = v41_outputs[variant], SGLANG_FAMILY[variant]
    env = v41_serving_env(variant)   # as serve launches it
    loaded = v41.load_checkpoint(out, gpu=gpu, env=env)
    assert loaded.error is None and loaded.not_found == [], (loaded.error, loaded.error_tensor, loaded.not_found)
    assert unaccounted(out, loaded) == []
    never = tuple(f".{suffix}" for suffix in sgl.NEVER_LOADED)
    unwritten = [n for n, w in loaded.written.items() if not w.all() and not n.endswith(never)]
    # W4A16 without act-order: its g_idx parameters stay empty (sglang_oracle.NEVER_LOADED says why)
    assert [n for n in unwritten if "g_idx" not in n] == []
    methods = {type(m.quant_method).__name__ for n, m in loaded.model.named_modules()
               if n.endswith("mlp.experts") and hasattr(m, "quant_method")}
    assert methods == {SGLANG_EXPERTS[variant]}
    draft = v41.load_draft(out, gpu=gpu, env=env)
    assert draft.error is None and draft.not_found == [], (draft.error, draft.error_tensor, draft.not_found)
    left = {n for n, w in draft.written.items() if not w.all()}
    assert all(n.endswith(tuple(sgl.DSPARK_NEVER_LOADED)) for n in left), left


@pytest.fixture(scope="module")
def vllm_answers(v41_outputs) -> dict[tuple[str, str, str], dict]:
    text = _config(v41_outputs["nvfp4"])["text_config"]
    dspark = json.dumps({"method": "dspark", "num_speculative_tokens": text["dspark_block_size"]})
    asked = {}
    for variant, gpu in (("nvfp4", "sm100"), ("bf16", "sm120")):
        asked[variant, gpu, "target"] = vllm.request_v41(v41_outputs[variant], [], gpu=gpu)
        asked[variant, gpu, "draft"] = vllm.request_v41(v41_outputs[variant], ["--speculative-config", dspark], gpu=gpu,
                                                        draft=True)
    for gpu in ("sm90", "sm100", "sm120"):
        asked["fp8", gpu, "target"] = vllm.request_v41(v41_outputs["fp8"], [], gpu=gpu)
    keys = list(asked)
    return dict(zip(keys, vllm.run([asked[k] for k in keys])))


@pytest.mark.parametrize("variant,gpu", [("nvfp4", "sm100"), ("bf16", "sm120")])
def test_vllm_v41_model_and_draft_load_nvfp4_and_bf16(vllm_answers, v41_outputs, variant, gpu):
    names = set(json.loads((v41_outputs[variant] / "model.safetensors.index.json").read_text())["weight_map"])
    target, draft = vllm_answers[variant, gpu, "target"], vllm_answers[variant, gpu, "draft"]
    for answer in (target, draft):
        assert "raised" not in answer, answer.get("traceback", answer.get("raised"))
        assert answer["error"] is None and answer["replaced"] == {}
        assert set(answer["tensors"]) == names
    assert {n: v for n, v in target["tensors"].items() if not n.startswith("mtp.") and v != "landed"} == {}
    assert {n: v for n, v in draft["tensors"].items() if n.startswith("mtp.") and v != "landed"} == {}
    assert target["unwritten"] == {}
    assert set(draft["unwritten"]) == {"model.embed_tokens.weight", "lm_head.weight"}   # the target's, aliased
    experts = {"nvfp4": "ModelOptNvFp4FusedMoE", "bf16": "UnquantizedFusedMoEMethod"}[variant]
    assert experts in set(target["methods"].values())
    for layer in (1, 2):
        assert target["identical"][f"layers.{layer}.engram.embed.weight"].endswith("engram.embed_tokens.weight")


@pytest.mark.parametrize("gpu", ["sm90", "sm100", "sm120"])
def test_vllm_refuses_fp8_experts_in_32x32_blocks(vllm_answers, gpu):
    """What ``engines/vllm/quant_config.py::v41_problem`` says of the fp8 variant, seen in vLLM's own model."""
    answer = vllm_answers["fp8", gpu, "target"]
    assert "No FP8 MoE backend supports the deployment configuration" in answer.get("raised", "") + \
        answer.get("traceback", "")


def _one_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "\n" not in err, err
    return err


@pytest.mark.parametrize("recipe,engine", [("w4a16", "vllm"), ("w4a16", "both"), ("fp8", "both")])
def test_an_engine_that_cannot_load_the_variant_is_refused(tiny_v41, tmp_path, capsys, recipe, engine):
    dst = tmp_path / "out"
    assert main([f"to-{recipe}", "--src", str(tiny_v41), "--dst", str(dst), "--engine", engine, "--no-progress"]) == 2
    assert "vLLM 0.33.0" in _one_error(capsys) and not dst.exists()


def _rewrite(ckpt: Path, name: str, make) -> Path:
    shard = ckpt / json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"][name]
    with safe_open(shard, "pt") as f:
        tensors = {n: f.get_tensor(n) for n in f.keys()}
    tensors[name] = make(tensors[name])
    save_file(tensors, str(shard), metadata={"format": "pt"})
    return shard


def _break_engram_rows(src: Path) -> tuple[str, str]:
    name = "layers.1.engram.embed.weight"
    shard = _rewrite(src, name, lambda t: t[:-1].contiguous())
    return shard.name, name


def _break_scales(src: Path) -> tuple[str, str]:
    name = "layers.0.attn.wq_b.scale"
    shard = _rewrite(src, name, lambda t: t[: -(-t.shape[0] * 32 // 128), : -(-t.shape[1] * 32 // 128)].contiguous())
    return shard.name, name


def _drop_tokenizer(src: Path) -> tuple[str, str]:
    (src / "tokenizer.json").unlink()
    return "tokenizer.json", "missing"


def _drop_text_config(src: Path) -> tuple[str, str]:
    config = _config(src)
    del config["text_config"]
    (src / "config.json").write_text(json.dumps(config))
    return "config.json", "text_config"


@pytest.mark.parametrize("breaking", [_break_engram_rows, _break_scales, _drop_tokenizer, _drop_text_config])
def test_bad_v41_input_is_one_error_line_and_nothing_written(tiny_v41, tmp_path, capsys, breaking):
    src = tmp_path / "src"
    shutil.copytree(tiny_v41, src)
    file, what = breaking(src)
    dst = tmp_path / "out"
    assert main(["to-nvfp4", "--src", str(src), "--dst", str(dst), "--no-progress"]) == 2
    err = _one_error(capsys)
    assert file in err and what in err, err
    assert not dst.exists()


def test_validate_names_fused_halves_of_two_dtypes(v41_outputs, tmp_path):
    """SGLang and vLLM load ``wq_a`` and ``wkv`` into one parameter: a BF16 ``wkv`` beside an FP8 ``wq_a`` is named."""
    broken = tmp_path / "bf16"
    shutil.copytree(v41_outputs["bf16"], broken)
    name = "layers.0.attn.wkv.weight"
    shard = _rewrite(broken, name, lambda t: t.to(torch.float16))
    assert main(["validate", str(broken), "--report", str(tmp_path / "r"), "--no-progress"]) == 1
    problems = json.loads((tmp_path / "r" / "validate.json").read_text())["integrity_problems"]
    assert any(p.startswith(f"{shard.name}: layers.0.attn.wq_a.weight: BF16 but {name} is F16") for p in problems), \
        problems


def _shard_bytes(ckpt: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(ckpt.glob("model*"))}


def test_one_output_shard_per_source_shard_the_engram_tables_alone(tiny_v41, v41_outputs):
    """Every output keeps the source's sharding: each tensor (or the module it was converted from) in the shard of
    the same number, and each Engram table's shard holds that table alone."""
    source = json.loads((tiny_v41 / "model.safetensors.index.json").read_text())["weight_map"]
    for variant, out in v41_outputs.items():
        index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
        assert sorted(set(index.values())) == sorted(set(source.values())), variant
        for name, shard in index.items():
            module = name.rsplit(".", 1)[0]
            origin = source.get(name) or next(s for n, s in source.items() if n.rsplit(".", 1)[0] == module)
            assert shard == origin, (variant, name)
        for layer in (1, 2):
            shard = index[f"layers.{layer}.engram.embed.weight"]
            assert sorted(n for n, s in index.items() if s == shard) == \
                [f"layers.{layer}.engram.embed.{kind}" for kind in ("scale", "weight")], variant


def test_workers_and_an_interrupted_run_resumed_are_byte_identical(tiny_v41, v41_outputs, tmp_path, monkeypatch, capsys):
    """--workers 2 writes the same bytes; a run interrupted after three shards says --resume, keeps them, and
    --resume writes only the rest, byte-identical to an uninterrupted run."""
    from dsv4convert.convert import v41 as convert_v41

    reference = _shard_bytes(v41_outputs["nvfp4"])
    argv = ["convert", "--recipe", "nvfp4", "--src", str(tiny_v41), "--no-progress"]
    assert main([*argv, "--dst", str(tmp_path / "two"), "--workers", "2"]) == 0
    assert _shard_bytes(tmp_path / "two") == reference
    original, calls = convert_v41._write_shard, []

    def interrupted(task, bar=None):
        calls.append(task.name)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return original(task, bar)

    monkeypatch.setattr(convert_v41, "_write_shard", interrupted)
    dst = tmp_path / "resumed"
    assert main([*argv, "--dst", str(dst)]) == 2
    assert "interrupted; 3 of 14 shards are complete. Run the same command with --resume" in _one_error(capsys)
    assert not (dst / "model.safetensors.index.json").exists() and not list(dst.glob(".*.partial"))
    finished = {p.name: p.stat().st_mtime_ns for p in dst.glob("model-*.safetensors")}
    assert sorted(finished) == calls[:3]
    monkeypatch.setattr(convert_v41, "_write_shard", original)
    assert main([*argv, "--dst", str(dst)]) == 2                      # not empty: --resume or --overwrite
    assert main(["convert", "--recipe", "bf16", "--src", str(tiny_v41), "--no-progress", "--dst", str(dst),
                 "--resume"]) == 2                                     # another recipe: refused
    assert main([*argv, "--dst", str(dst), "--resume"]) == 0
    assert _shard_bytes(dst) == reference
    assert {n: (dst / n).stat().st_mtime_ns for n in finished} == finished
    for name in ("config.json", "tokenizer.json"):
        assert (dst / name).read_bytes() == (v41_outputs["nvfp4"] / name).read_bytes(), name


@pytest.mark.parametrize("flags,named", [
    (["--gptq", "--calibration", "calib.json"], "--gptq"), (["--calibration", "calib.json"], "--calibration"),
    (["--input-scales-from", "other"], "--input-scales-from"), (["--no-mtp"], "--no-mtp"),
    (["--max-shard-size", "1G"], "--max-shard-size"), (["--max-memory", "4G"], "--max-memory"),
    (["--device", "cuda"], "--device")])
def test_what_a_v41_conversion_does_not_take_is_refused_by_name(tiny_v41, tmp_path, capsys, flags, named):
    dst = tmp_path / "out"
    assert main(["convert", "--recipe", "w4a16", "--src", str(tiny_v41), "--dst", str(dst), "--no-progress",
                 *flags]) == 2
    err = _one_error(capsys)
    assert f"{named} is not taken for DeepSeek-V4.1 sources: " in err and not dst.exists(), err


def test_inspect_reads_the_release_and_every_output(tiny_v41, v41_outputs, capsys):
    """``inspect DIR`` on a V4.1 checkpoint: its variant, the Engram bytes, the layout check of that variant."""
    for variant, path in {"native": tiny_v41, **v41_outputs}.items():
        assert main(["inspect", str(path), "--json"]) == 0, variant
        report = json.loads(capsys.readouterr().out)
        assert report["variant"] == variant and report["ok"] and not report["problems"], report["problems"]
        assert report["engram_table_bytes"] == sum(r["bytes"] for r in report["roles"] if r["role"] == "engram_table")
        assert report["engram_table_bytes"] > 0 and report["drafter"] == "dspark"


def test_inspect_names_an_engram_table_the_engines_would_cast(v41_outputs, tmp_path, capsys):
    """An Engram table stored as BF16 (as community NVFP4 builds store theirs re-quantized): named, exit 1."""
    broken = tmp_path / "nvfp4"
    shutil.copytree(v41_outputs["nvfp4"], broken)
    name = "layers.2.engram.embed.weight"
    shard = _rewrite(broken, name, lambda t: t.float().to(torch.bfloat16))
    assert main(["inspect", str(broken)]) == 1
    out = capsys.readouterr().out
    assert f"{shard.name}: {name}: is BF16" in out and "layout check: OK" not in out
