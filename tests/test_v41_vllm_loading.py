"""The tiny V4.1 (``synth --preset tiny-v41``) through vLLM 0.33.0's real V4.1 model and DSpark draft on CPU, #53.

``vllm_oracle.request_v41``: ``vllm serve`` on the checkpoint (no flags: the release's own config) goes through vLLM's
parser and ``create_engine_config``; vLLM's ``DeepseekV41ForCausalLM`` (``models/deepseek_v41/nvidia/vl_model.py``:
vision tower, aligner and image tokens around the text backbone ``nvidia/model.py::DeepseekV41LLMForCausalLM``) and,
with ``--speculative-config {"method":"dspark"}``, the ``DSparkDeepseekV4ForCausalLM`` draft Model Runner V2 builds
(``DSparkV41DraftModel``) are built for sm_90, sm_100 and sm_120 and loaded by vLLM's default loader through their
own ``load_weights``. The oracle attributes every write into a parameter to the checkpoint tensor being loaded
(including the vision tensors the VL model holds back until the backbone is loaded) and checks the values: the
32x32 block scales as vLLM's MXFP8 loader writes them (each repeated over its 32 rows, raw E8M0 bytes). What is
faked on CPU, and why, is in ``vllm_oracle._FakeCuda`` and ``_v41_host_fakes`` (../shared/reference/v41-flash.md
section 9.7).

Asserted: every backbone and vision tensor lands in the target with its exact values, every ``mtp.*`` one in the
draft (``gate.bias_vl`` and the confidence head included: vLLM's draft loads both, the release's Markov names
``embed``/``head`` as ``markov_w1``/``markov_w2``); every parameter element is written but the draft's embedding
and LM head (aliased from the target); the Engram tables land byte for byte as FP8 E4M3 rows with uint8 (raw E8M0)
scales in ``ParallelEngramEmbedding``. One vLLM process answers the module.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import vllm_oracle as vllm
from conftest import V41_DROPPED
from safetensors import safe_open


GPUS = ("sm90", "sm100", "sm120")
ENGRAM_LAYERS = (1, 2)                                   # tiny-v41's engram_layer_ids
# Parameters the DSpark draft aliases from the target (v1/worker/gpu/spec_decode/dspark/utils.py::load_dspark_model).
DRAFT_ALIASED = {"model.embed_tokens.weight", "lm_head.weight"}


@pytest.fixture(scope="module")
def tiny(tiny_v41) -> Path:
    return tiny_v41


def _text(tiny: Path) -> dict:
    return json.loads((tiny / "config.json").read_text())["text_config"]


@pytest.fixture(scope="module")
def broken(tiny_v41_missing_vision) -> Path:
    return tiny_v41_missing_vision


@pytest.fixture(scope="module")
def answers(tiny, broken) -> dict[tuple[str, str], dict]:
    """The target and the DSpark draft on every family, and the broken copy's target, from one vLLM process."""
    dspark = json.dumps({"method": "dspark", "num_speculative_tokens": _text(tiny)["dspark_block_size"]})
    asked = {}
    for gpu in GPUS:
        asked[gpu, "target"] = vllm.request_v41(tiny, [], gpu=gpu)
        asked[gpu, "draft"] = vllm.request_v41(tiny, ["--speculative-config", dspark], gpu=gpu, draft=True)
    asked["sm90", "missing-vision"] = vllm.request_v41(broken, [], gpu="sm90")
    keys = list(asked)
    return dict(zip(keys, vllm.run([asked[k] for k in keys])))


def _index(tiny: Path) -> dict[str, str]:
    return json.loads((tiny / "model.safetensors.index.json").read_text())["weight_map"]


@pytest.fixture(scope="module")
def names(tiny) -> set[str]:
    return set(_index(tiny))


def _ok(answer: dict) -> dict:
    assert "raised" not in answer, answer.get("traceback", answer.get("raised"))
    assert answer["error"] is None, (answer["error"], answer["error_tensor"])
    return answer


@pytest.mark.parametrize("gpu", GPUS)
def test_vllm_v41_model_loads_every_tensor_into_every_parameter(answers, names, gpu):
    target = _ok(answers[gpu, "target"])
    assert target["model_class"] == "DeepseekV41ForCausalLM"
    assert target["resolved"]["quant_config"] == "DeepseekV4FP8Config"
    assert set(target["tensors"]) == names
    assert {n: v for n, v in target["tensors"].items() if not n.startswith("mtp.") and v != "landed"} == {}
    assert {v for n, v in target["tensors"].items() if n.startswith("mtp.")} == {"dropped"}   # the VL mapper drops them
    assert target["unwritten"] == {} and target["replaced"] == {}
    # The vision tower is built and fed from the checkpoint's vision tensors (held back, then loaded).
    assert target["reached"]["vision.blocks.1.mlp.w2.weight"] == ["vision.blocks.1.mlp.w2.weight"]
    assert target["reached"]["image_newline"] == ["image_newline"]
    assert set(target["methods"].values()) >= {"ModelOptLinearMethod", "Mxfp4MoEMethod"}


@pytest.mark.parametrize("gpu", GPUS)
def test_vllm_v41_block_scales_are_repeated_per_row(answers, tiny, gpu):
    """A 32x32 block scale lands as vLLM's MXFP8 loader writes it: its raw E8M0 bytes, each row repeated over the
    block's 32 rows (the oracle compared the values; here: that this path, not a plain copy, was taken)."""
    target = _ok(answers[gpu, "target"])
    name = "layers.0.attn.wq_b.scale"
    with safe_open(tiny / _index(tiny)[name], "pt") as f:
        scale = f.get_tensor(name)
    [param] = target["reached"][name]
    dtype, shape = target["params"][param]
    assert (dtype, shape) == ("uint8", [scale.shape[0] * vllm.V41_SCALE_BLOCK_ROWS, scale.shape[1]])
    assert target["tensors"][name] == "landed"


@pytest.mark.parametrize("gpu", GPUS)
def test_vllm_v41_engram_tables_land_byte_for_byte(answers, gpu):
    target = _ok(answers[gpu, "target"])
    for layer in ENGRAM_LAYERS:
        prefix = f"language_model.model.layers.{layer}.engram.embed_tokens"
        assert target["identical"][f"layers.{layer}.engram.embed.weight"] == f"{prefix}.weight"
        assert target["identical"][f"layers.{layer}.engram.embed.scale"] == f"{prefix}.weight_scale_inv"
        assert target["params"][f"{prefix}.weight"][0] == "float8_e4m3fn"
        assert target["params"][f"{prefix}.weight_scale_inv"][0] == "uint8"


@pytest.mark.parametrize("gpu", GPUS)
def test_vllm_v41_dspark_draft_loads_every_drafter_tensor(answers, names, tiny, gpu):
    draft = _ok(answers[gpu, "draft"])
    assert draft["model_class"] == "DSparkDeepseekV4ForCausalLM"
    resolved = draft["resolved"]
    assert (resolved["speculative_method"], resolved["model_runner"]) == ("dspark", "v2")
    mtp = {n for n in names if n.startswith("mtp.")}
    assert set(draft["tensors"]) == names
    assert {n: v for n, v in draft["tensors"].items() if n in mtp and v != "landed"} == {}
    assert {v for n, v in draft["tensors"].items() if n not in mtp} == {"dropped"}
    assert set(draft["unwritten"]) == DRAFT_ALIASED and draft["replaced"] == {}
    # What SGLang's draft leaves out, vLLM's loads; the release's Markov names are mapped.
    stages = len(_text(tiny)["dspark_target_layer_ids"])
    for s in range(stages):
        assert draft["reached"][f"mtp.{s}.ffn.gate.bias_vl"] == [f"model.layers.{s}.ffn.gate.bias_vl"]
    last = stages - 1
    assert draft["reached"][f"mtp.{last}.confidence_head.proj.weight"] == ["model.confidence_head.proj.weight"]
    assert draft["reached"][f"mtp.{last}.markov_head.embed.weight"] == ["model.markov_head.markov_w1.weight"]
    assert draft["reached"][f"mtp.{last}.markov_head.head.weight"] == ["model.markov_head.markov_w2.weight"]
    # The stages are the drafter's own MoE: dspark_n_routed_experts, not the target's n_routed_experts.
    experts = {shape[0] for p, (_, shape) in draft["params"].items() if p.endswith("routed_experts.w2_weight")}
    assert experts == {_text(tiny)["dspark_n_routed_experts"]} != {_text(tiny)["n_routed_experts"]}


def test_a_missing_vision_tensor_loads_silently_in_vllm_and_is_named_here(answers, tiny):
    """``DefaultModelLoader`` tracks weights only for unquantized models: vLLM builds and loads the model without
    the tensor and says nothing; the unwritten parameter names it."""
    loaded = _ok(answers["sm90", "missing-vision"])
    vision = json.loads((tiny / "config.json").read_text())["vision_config"]
    assert loaded["unwritten"] == {V41_DROPPED: vision["intermediate_size"] * vision["hidden_size"]}   # the w2 [H, I]
    assert {n: v for n, v in loaded["tensors"].items() if not n.startswith("mtp.") and v != "landed"} == {}
