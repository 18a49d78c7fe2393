"""Every tensor of every vLLM-bound output through vLLM 0.33.0's own model and loader, on CPU.

For each output made for vLLM (``--engine both``, the default, and ``--engine vllm``), the model
card's ``vllm serve`` commands go through vLLM's own parser and ``create_engine_config`` on each
GPU family; on sm_90 and sm_100 vLLM's ``DeepseekV4ForCausalLM`` and its ``DeepSeekV4MTP`` draft are
built and loaded by vLLM's default loader through their own ``load_weights`` (the DeepSeek-V4
weight-name mapper included). ``vllm_oracle`` attributes every write into a parameter to the
checkpoint tensor being loaded and checks the values (see its docstring for what is faked on CPU).

Asserted: every tensor lands in exactly one of the two models (``mtp.*`` in the draft), with its
exact values; every parameter element is written (but the draft's embedding and LM head, which vLLM
shares from the target); vLLM's quant config chooses the intended method for every module. Then the
layouts made for SGLang alone fail in vLLM exactly as the converter says they would (the issue's
claims, checked against vLLM's code rather than taken on trust).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import vllm_oracle as vllm
from conftest import run

from dsv4convert.checkpoint import Checkpoint
from dsv4convert.convert.model_card import vllm_default_launch
from dsv4convert.convert.recipe import RECIPE_DIR
from dsv4convert.engines import GPU_FAMILIES, gpu_of_family
from dsv4convert.engines.config import servable_engines
from dsv4convert.engines.vllm.server import VLLM_MOE_METHODS
from dsv4convert.inspection import inspect_checkpoint

FAMILIES = {family: gpu_of_family(family).label for family in GPU_FAMILIES}
# Models are built on sm_90: vLLM's quant methods do not depend on the family (the MoE backend does, and it
# follows the kernels installed, which a CPU host lacks); sm_120's attention class needs FlashInfer DSV4
# kernels for the head count. Every family's command is resolved.
BUILT_ON = ("sm90",)
# conftest's outputs made for vLLM -> the layout vLLM's methods are looked up by (inspect's variant)
VLLM_OUTPUTS = {"fp8": "fp8", "nvfp4": "nvfp4-mtp-bf16", "nvfp4-mtp-mxfp4": "nvfp4-mtp-mxfp4",
                "nvfp4@vllm": "nvfp4-mtp-mxfp4", "w4a16": "w4a16", "bf16": "bf16",
                # the mixed example recipe: NVFP4 experts, BF16 indexer and compressors (ignored_layers), BF16 draft
                "mixed": "nvfp4-mtp-bf16"}
# The FP8 DeepSeek-V4 config vLLM builds on CUDA (quantization/__init__.py get_quantization_config).
FP8_CONFIG = ("DeepseekV4FP8Config", "vllm.models.deepseek_v41.quant_config")
QUANT_CONFIG = {"fp8": FP8_CONFIG, "nvfp4-mtp-bf16": FP8_CONFIG, "nvfp4-mtp-mxfp4": FP8_CONFIG,
                "w4a16": ("CompressedTensorsConfig",
                          "vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors"),
                "bf16": (None, None)}
# Linear methods per stored format (the compressed-tensors path wraps its scheme).
LINEAR_METHOD = {"fp8": "Fp8LinearMethod", "bf16": "UnquantizedLinearMethod"}


def _card(output_dir: Path, variant: str) -> dict[str, dict]:
    ckpt = Checkpoint.open(output_dir)
    return vllm_default_launch(output_dir, variant, opened=(ckpt, inspect_checkpoint(ckpt)))


def _argv(spec: dict) -> list[str]:
    argv = spec["argv"]
    assert argv[:2] == ["vllm", "serve"]
    return argv[3:]


@pytest.fixture(scope="module")
def bound(outputs, tiny_ckpt, tmp_path_factory) -> dict[str, Path]:
    """conftest's outputs plus the mixed example recipe (recipes/nvfp4-bf16-indexer.yaml), for both engines."""
    mixed = tmp_path_factory.mktemp("vllm-mixed") / "out"
    run(tiny_ckpt, mixed, str(RECIPE_DIR / "nvfp4-bf16-indexer.yaml"))
    return {**outputs, "mixed": mixed}


@pytest.fixture(scope="module")
def negative(outputs, tmp_path_factory) -> dict[str, Path]:
    """Layouts for SGLang alone, and one config edited the way the issue warns about."""
    root = tmp_path_factory.mktemp("vllm-negative")
    cases = {"fp8@sglang": outputs["fp8@sglang"], "w4a16@sglang": outputs["w4a16@sglang"],
             "nvfp4@sglang": outputs["nvfp4@sglang"]}
    # E8M0 expert scales with expert_dtype fp8 in the config: vLLM picks Fp8MoEMethod, then copies raw bytes.
    edited = root / "fp8-e8m0-expert-dtype"
    shutil.copytree(outputs["fp8@sglang"], edited)
    config = json.loads((edited / "config.json").read_text())
    config["expert_dtype"] = "fp8"
    (edited / "config.json").write_text(json.dumps(config))
    cases["fp8-e8m0-expert-dtype"] = edited
    return cases


MTP = '{"method":"mtp","num_speculative_tokens":1}'
NEGATIVE_ARGV = ["--kv-cache-dtype", "fp8", "--block-size", "256", "--speculative-config", MTP]


@pytest.fixture(scope="module")
def answers(bound, negative) -> dict[tuple, dict]:
    """One vLLM process answers every question of this module (vLLM's import costs ~30 s)."""
    asked: dict[tuple, dict] = {}
    for name, variant in VLLM_OUTPUTS.items():
        card = _card(bound[name], variant)
        for gpu, family in FAMILIES.items():
            spec = card[family]
            asked[(name, gpu, "resolve")] = vllm.request(bound[name], _argv(spec), gpu=gpu, resolve_only=True)
            if spec.get("mtp"):
                asked[(name, gpu, "resolve-mtp")] = vllm.request(bound[name], _argv(spec["mtp"]), gpu=gpu,
                                                                 resolve_only=True)
            if gpu in BUILT_ON:
                asked[(name, gpu, "target")] = vllm.request(bound[name], _argv(spec["mtp"]), gpu=gpu)
                asked[(name, gpu, "draft")] = vllm.request(bound[name], _argv(spec["mtp"]), gpu=gpu, draft=True)
    for name, path in negative.items():
        for model in ("target", "draft") if name in ("fp8-e8m0-expert-dtype", "nvfp4@sglang") else ("target",):
            asked[(name, "sm90", model)] = vllm.request(path, NEGATIVE_ARGV, gpu="sm90", draft=model == "draft")
    # A larger TP with expert parallelism, as the card writes it for the real model (resolution only).
    asked[("fp8", "sm90", "resolve-tp4")] = vllm.request(
        bound["fp8"], ["--tensor-parallel-size", "4", "--enable-expert-parallel", "--kv-cache-dtype", "fp8",
                         "--block-size", "256"], gpu="sm90", resolve_only=True)
    keys = list(asked)
    return dict(zip(keys, vllm.run([asked[k] for k in keys])))


def _ok(answer: dict) -> dict:
    assert "raised" not in answer, answer.get("traceback", answer.get("raised"))
    return answer


@pytest.mark.parametrize("gpu", BUILT_ON)
@pytest.mark.parametrize("output", list(VLLM_OUTPUTS))
def test_every_tensor_lands_in_vllm(answers, bound, output, gpu):
    target, draft = _ok(answers[(output, gpu, "target")]), _ok(answers[(output, gpu, "draft")])
    assert target["error"] is None and draft["error"] is None, (target["error"], draft["error"])
    names = set(Checkpoint.open(bound[output]).tensors)
    mtp = {n for n in names if n.startswith("mtp.")}
    # The target reads every tensor and its name mapper drops mtp.*; the draft's loader is handed only the
    # MTP block's tensors (DeepSeekV4MTP.is_unused_checkpoint_weight skips the rest).
    assert set(target["tensors"]) == names and set(draft["tensors"]) == mtp and mtp
    for name in sorted(names):
        if name in mtp:
            assert draft["tensors"][name] == "landed", (name, draft["tensors"][name])
            assert target["tensors"][name] == "dropped", (name, target["tensors"][name])
        else:
            assert target["tensors"][name] == "landed", (name, target["tensors"][name])
    assert target["unwritten"] == {} and target["replaced"] == {}
    assert set(draft["unwritten"]) == {p for p in draft["params"] if p.endswith(vllm.DRAFT_SHARED)}, draft["unwritten"]
    assert draft["replaced"] == {}


def _moe(answer: dict) -> dict[str, str]:
    return {m: method for m, method in answer["methods"].items() if m.endswith(".ffn.experts.routed_experts")}


@pytest.mark.parametrize("output", list(VLLM_OUTPUTS))
def test_vllm_chooses_the_intended_method_for_every_module(answers, bound, output):
    variant = VLLM_OUTPUTS[output]
    backbone, draft_method = VLLM_MOE_METHODS[variant]
    ckpt = Checkpoint.open(bound[output])
    layers = ckpt.config["num_hidden_layers"]
    formats = inspect_checkpoint(ckpt).modules
    for gpu in BUILT_ON:
        target, draft = answers[(output, gpu, "target")], answers[(output, gpu, "draft")]
        assert (target["resolved"]["quant_config"], target["resolved"]["quant_config_module"]) == QUANT_CONFIG[variant]
        moe = _moe(target)
        assert len(moe) == layers and set(moe.values()) == {backbone}, moe
        assert set(_moe(draft).values()) == {draft_method}
        expected_dtype = "fp8" if variant == "fp8" else None
        assert target["resolved"]["expert_dtype"] == expected_dtype
        methods = {**target["methods"], **draft["methods"]}
        for module, info in formats.items():
            if info.format is None or ".ffn.experts." in module or info.role.value in ("embed", "head"):
                continue
            name = _vllm_module(module, layers)
            got = methods.get(name)
            assert got is not None, (module, name)
            assert got == LINEAR_METHOD[info.format.value], (module, name, got)


def _vllm_module(native: str, layers: int) -> str:
    """vLLM's module path (named_modules) of a native linear, the draft's block under mtp_block."""
    parts = native.split(".")
    kind, index, rest = parts[0], int(parts[1]), ".".join(parts[2:])
    fused = {"attn.wq_a": "attn.fused_wqa_wkv", "attn.wkv": "attn.fused_wqa_wkv",
             "ffn.shared_experts.w1": "ffn.shared_experts.gate_up_proj",
             "ffn.shared_experts.w3": "ffn.shared_experts.gate_up_proj",
             "ffn.shared_experts.w2": "ffn.shared_experts.down_proj",
             "attn.compressor.wkv": "attn.compressor.fused_wkv_wgate",
             "attn.compressor.wgate": "attn.compressor.fused_wkv_wgate",
             "attn.indexer.compressor.wkv": "attn.indexer.compressor.fused_wkv_wgate",
             "attn.indexer.compressor.wgate": "attn.indexer.compressor.fused_wkv_wgate"}
    rest = fused.get(rest, rest)
    if kind == "layers":
        return f"model.layers.{index}.{rest}"
    if rest in ("e_proj", "h_proj"):
        return f"model.layers.{layers + index}.{rest}"
    return f"model.layers.{layers + index}.mtp_block.{rest}"


@pytest.mark.parametrize("gpu", list(FAMILIES))
@pytest.mark.parametrize("output", list(VLLM_OUTPUTS))
def test_card_commands_resolve_in_vllm(answers, output, gpu):
    plain = _ok(answers[(output, gpu, "resolve")])["resolved"]
    assert (plain["kv_cache_dtype"], plain["block_size"], plain["tensor_parallel_size"]) == ("fp8", 256, 1)
    assert plain["speculative_method"] is None and plain["trust_remote_code"] is False
    mtp = answers.get((output, gpu, "resolve-mtp"))
    if gpu == "sm120":
        assert mtp is None  # vLLM's recipe has no MTP setting for the RTX PRO 6000
        return
    resolved = _ok(mtp)["resolved"]
    assert resolved["speculative_method"] == "mtp" and resolved["draft_architectures"] == ["DeepSeekV4MTPModel"]
    assert resolved["num_speculative_tokens"] == (1 if gpu == "sm90" else 2)


def test_tensor_and_expert_parallel_flags_resolve(answers):
    resolved = _ok(answers[("fp8", "sm90", "resolve-tp4")])["resolved"]
    assert resolved["tensor_parallel_size"] == 4 and resolved["enable_expert_parallel"] is True


# --------------------------------------------------------------------------------------------
# Layouts made for SGLang alone, in vLLM: what the issue expected, checked against vLLM's code.

def _converter_says(outputs_dir: Path) -> str | None:
    ckpt = Checkpoint.open(outputs_dir)
    info = inspect_checkpoint(ckpt)
    formats = {m: (f.format, dict(f.params)) for m, f in info.modules.items() if f.format is not None}
    for module, (fmt, params) in formats.items():
        if fmt.value == "fp8":
            params["fp8_scale_dtype"] = ckpt.entry(f"{module}.scale").dtype
    return servable_engines(ckpt.config, formats)["vllm"]


def test_fp8_without_expert_dtype_is_read_as_mxfp4(answers, negative):
    """vLLM takes a missing expert_dtype for "fp4" (DeepseekV4FP8Config.expert_dtype) and builds MXFP4 experts."""
    target = _ok(answers[("fp8@sglang", "sm90", "target")])
    assert target["resolved"]["expert_dtype"] is None
    assert set(_moe(target).values()) == {"Mxfp4MoEMethod"}
    assert target["error"] and "size of tensor" in target["error"], target["error"]
    assert target["error_tensor"].startswith("layers.0.ffn.experts.")
    assert _converter_says(negative["fp8@sglang"]).startswith("layers.0.ffn.experts.0.w1: vLLM 0.33.0 views E8M0")


def test_e8m0_expert_scales_reach_vllm_as_raw_bytes(answers, negative):
    """With expert_dtype fp8 vLLM picks Fp8MoEMethod, then views E8M0 scales as uint8 before copy_ into float32."""
    for model, prefix in (("target", "layers."), ("draft", "mtp.")):
        answer = _ok(answers[("fp8-e8m0-expert-dtype", "sm90", model)])
        assert set(_moe(answer).values()) == {"Fp8MoEMethod"} and answer["error"] is None
        wrong = {n: v for n, v in answer["tensors"].items() if v.startswith("wrong")}
        scales = {n for n in answer["tensors"] if n.startswith(prefix) and ".ffn.experts." in n and n.endswith(".scale")}
        assert set(wrong) == scales and scales, sorted(wrong)[:3]
        # e.g. 2^-6 (E8M0 byte 121) arrives as 121.0; the attention's E8M0 scales convert exactly.
        assert all("w13_weight_scale_inv" in v or "w2_weight_scale_inv" in v for v in wrong.values())
        some = next(iter(wrong.values()))
        got, want = some.rsplit("(", 1)[1].rstrip(")").split(" vs ")
        assert float(got) == float(int(float(got))) and float(got) > 100 and float(want) < 1, some
    assert _converter_says(negative["fp8-e8m0-expert-dtype"]).startswith("layers.0.ffn.experts.0.w1")


def test_w4a16_with_sglang_names_makes_vllm_quantize_attention(answers, negative):
    """SGLang-named ignore regexes match nothing in vLLM (attn/ffn names): attention gets the INT4 scheme."""
    target = _ok(answers[("w4a16@sglang", "sm90", "target")])
    assert target["methods"]["model.layers.0.attn.wq_b"] == "CompressedTensorsLinearMethod/CompressedTensorsWNA16"
    assert "weight_scale_inv" in target["error"], target["error"]
    assert _converter_says(negative["w4a16@sglang"]).split(":")[0].startswith("layers.0.attn.")


def test_nvfp4_with_fp8_draft_experts_cannot_load_the_draft(answers, negative):
    """The MTP experts an NVFP4 hybrid's ignore list excludes are MXFP4 to vLLM; FP8-block ones do not fit."""
    target = _ok(answers[("nvfp4@sglang", "sm90", "target")])
    draft = _ok(answers[("nvfp4@sglang", "sm90", "draft")])
    assert target["error"] is None and set(_moe(target).values()) == {"ModelOptNvFp4FusedMoE"}
    assert set(_moe(draft).values()) == {"Mxfp4MoEMethod"} and draft["error"], draft["error"]
    assert draft["error_tensor"].startswith("mtp.0.ffn.experts.")
    assert _converter_says(negative["nvfp4@sglang"]).startswith("mtp.0.ffn.experts.0.w1: vLLM 0.33.0 reads experts "
                                                               "outside NVFP4 as MXFP4")


def test_refused_recipe_names_the_engine_and_module(tiny_ckpt, tmp_path):
    """NVFP4 MTP experts load in neither engine; --engine both says so in one line, naming both."""
    from dsv4convert.errors import RecipeError

    recipe = tmp_path / "nvfp4-all.yaml"
    recipe.write_text("name: nvfp4-all\nrules:\n  - match: {role: routed_expert}\n    format: nvfp4\n"
                      "  - match: {}\n    format: keep\n    reason: as released\n")
    with pytest.raises(RecipeError) as refused:
        run(tiny_ckpt, tmp_path / "out", str(recipe), engine="both")
    message = str(refused.value)
    assert "\n" not in message and "tensor 'mtp.0.ffn.experts.0.w1'" in message
    assert "--engine both: vLLM 0.33.0" in message and "SGLang 0.5.23's NVFP4 hybrid" in message
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())
