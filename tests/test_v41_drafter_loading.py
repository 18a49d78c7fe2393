"""The tiny V4.1's DSpark drafter (``synth --preset tiny-v41``: ``mtp.0-2``) through SGLang 0.5.23's real V4.1
DSpark draft and ``load_weights`` on CPU, #53.

``sglang_v41_oracle.load_draft`` builds ``models/deepseek_v4_dspark.py::DeepseekV4ForCausalLMDSpark`` on the V4.1
config as ``--speculative-algorithm DSPARK`` does (V4.1's only speculative algorithm) and loads the checkpoint twice
with sentinels. Every ``mtp.*`` tensor is then found where the draft needs it (test_dspark_loading's
``check_draft``: bit-exactly, or converted the way SGLang converts), in its own stage; ``wo_a`` is BF16 in a DSpark
stage, so the FP8 ``wo_a`` with its 32x32 E8M0 scale must equal our own dequantization. Every parameter element is
written but the FP8 KV-cache scales.

What SGLang drops, by name and by design (../shared/reference/v41-flash.md section 9.6): each stage's
``gate.bias_vl`` (``_remap_dspark_weight_name`` maps it to nothing; the draft has no vision routing) and, under the
default ``SGLANG_RAGGED_VERIFY_MODE=static``, the confidence head (not built); under ``compact`` the head lands.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import sglang_oracle as sgl
import sglang_v41_oracle as v41
import torch
from test_dspark_loading import _outside_its_stage, check_draft, landings
from test_sglang_loading import CONSUMED, GOOD, LANDED, Landing

from dsv4convert.checkpoint import Checkpoint
from dsv4convert.formats import dequantize_fp8_block

STAGES = 3                                            # tiny-v41: dspark_target_layer_ids [3, 4, 5]
BIAS_VL = [f"mtp.{s}.ffn.gate.bias_vl" for s in range(STAGES)]
CONFIDENCE = "mtp.2.confidence_head.proj.weight"      # the last stage carries the heads


@pytest.fixture(scope="module")
def tiny(tiny_v41) -> Path:
    return tiny_v41


def v41_landings(name: str, ckpt: Checkpoint, loaded: sgl.LoadedModel) -> list[Landing] | str | None:
    """test_dspark_loading's places, but V4.1's FP8 ``wo_a`` is dequantized in 32x32 blocks
    (``deepseek_v4.py::_dequant_fp8_wo_a_streaming`` infers the block from the shapes)."""
    module, _, kind = name.rpartition(".")
    if name.startswith("mtp.") and module.endswith(".attn.wo_a") and f"{module}.scale" in ckpt.tensors \
            and not loaded.wo_a_fp8:
        weight = loaded.model._remap_dspark_weight_name(f"{module}.weight")
        if kind == "scale":
            return [Landing(weight, (), None, "consumed: wo_a dequantized to BF16 with it")]
        dequantized = dequantize_fp8_block(ckpt.read(name), ckpt.read(f"{module}.scale"), block=(32, 32))
        return [Landing(weight, (), dequantized.to(torch.bfloat16), "converted: FP8 wo_a dequantized to BF16")]
    return landings(name, ckpt, loaded)


@pytest.fixture(scope="module")
def drafted(tiny):
    """SGLang's V4.1 DSpark draft per (family, environment), built and loaded once per module."""
    cache: dict[tuple[str, tuple], tuple[sgl.LoadedModel, object]] = {}

    def get(gpu: str, env: tuple = ()):
        if (gpu, env) not in cache:
            loaded = v41.load_draft(tiny, gpu=gpu, env=dict(env))
            cache[gpu, env] = loaded, check_draft(Checkpoint.open(tiny), loaded, v41_landings)
        return cache[gpu, env]

    return get


@pytest.mark.parametrize("gpu", ["sm90", "sm100", "sm120"])
def test_sglang_v41_dspark_draft_loads_every_drafter_tensor(tiny, drafted, gpu):
    loaded, report = drafted(gpu)
    assert type(loaded.model).__name__ == "DeepseekV4ForCausalLMDSpark" and loaded.error is None, loaded.error
    assert loaded.model.config.model_type == "deepseek_v41"
    assert loaded.model.num_stages == STAGES and loaded.model.confidence_head is None   # static verify mode
    ckpt = Checkpoint.open(tiny)
    mtp = sorted(n for n in ckpt.tensors if n.startswith("mtp."))
    assert sorted(loaded.yielded) == sorted(ckpt.tensors)            # SGLang's iterator produced every tensor
    assert sorted(v.tensor for v in report.verdicts) == mtp
    # Exactly the tensors SGLang leaves out by design, by name; every other one holds the checkpoint's values.
    assert sorted((v.tensor, v.outcome) for v in report.bad()) == sorted(
        (n, "dropped") for n in [*BIAS_VL, CONFIDENCE])
    assert report.holes == [] and report.strays == []
    consumed = sorted(v.tensor for v in report.verdicts if v.outcome == CONSUMED)
    assert consumed == [f"mtp.{s}.attn.wo_a.scale" for s in range(STAGES)]
    assert sorted(n for n in mtp if not loaded.reached.get(n)) == sorted([*BIAS_VL, CONFIDENCE, *consumed])
    assert _outside_its_stage(loaded) == {}
    assert loaded.not_found == []
    assert sum(v.outcome == LANDED for v in report.verdicts) > len(mtp) // 2
    # The stages are the drafter's own MoE (dspark_n_routed_experts, not the target's n_routed_experts).
    experts = ckpt.config["text_config"]["dspark_n_routed_experts"]
    assert experts != ckpt.config["text_config"]["n_routed_experts"]
    assert {loaded.params[f"stages.{s}.mlp.experts.w2_weight"].shape[0] for s in range(STAGES)} == {experts}
    assert set(loaded.moe_methods) == {f"stages.{s}.mlp.experts" for s in range(STAGES)}


def test_sglang_v41_confidence_head_lands_under_compact_verify(drafted):
    """``build_dspark_v4_confidence_head`` builds the head unless the verify mode is static: then it lands and only
    ``gate.bias_vl`` is left."""
    loaded, report = drafted("sm90", (("SGLANG_RAGGED_VERIFY_MODE", "compact"),))
    assert loaded.error is None and loaded.model.confidence_head is not None
    assert sorted(v.tensor for v in report.bad()) == BIAS_VL
    assert report.holes == [] and report.strays == []
    assert next(v for v in report.verdicts if v.tensor == CONFIDENCE).outcome in GOOD
    assert loaded.reached[CONFIDENCE] == {"confidence_head.proj.weight"}
