"""SGLang 0.5.23's own config classes read every config build_quant_config writes as intended.

Each case builds the stored formats of a variant from the layout, writes the config, lets
SGLang parse it (``sglang_oracle``: ModelConfig, the loader's hybrid wrap, the quant classes)
under the environment ``serving_env`` prescribes, and asks SGLang about every module that
consults the quant config: each answer must be the format that was stored.
"""

from __future__ import annotations

import copy
import json
from collections import defaultdict

import pytest
import sglang_oracle as sgl
import torch
from safetensors.torch import save_file
from sglang.srt.models.deepseek_common.utils import is_wint4afp8_or_wint4a16_config

from dsv4convert.engines.config import build_quant_config
from dsv4convert.engines.sglang.quant_config import HF_QUANT_CONFIG, serving_env
from dsv4convert.errors import RecipeError
from dsv4convert.formats import Format
from dsv4convert.models.deepseek_v4.layout import ModelConfig, Role, classify, linear_shapes
from dsv4convert.synth import preset_config

# What SGLang's quant-method dispatch calls each stored format (see sglang_oracle).
MOE_SCHEME = {Format.NVFP4: "nvfp4", Format.MXFP4: "mxfp4", Format.FP8: "fp8", Format.INT4: "wna16",
              Format.BF16: "unquantized"}
LINEAR_SCHEME = {Format.FP8: "fp8", Format.BF16: "unquantized"}
# Linears SGLang builds with the model's quant config (the others get quant_config=None).
CONFIG_LINEAR_ROLES = {Role.ATTENTION, Role.INDEXER, Role.SHARED_EXPERT, Role.MTP_PROJECTION}
# Halves SGLang loads into one fused linear (wqkv_a in DeepseekV4 attention, shared gate_up_proj).
FUSED = {"wq_a": "wqkv_a", "wkv": "wqkv_a", "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}
E8M0 = {"fp8_scale_dtype": "F8_E8M0"}


@pytest.fixture(scope="module")
def tiny() -> dict:
    return preset_config("tiny")


@pytest.fixture(params=["tiny", "real"])
def any_config(request, tiny, real_config) -> dict:
    return tiny if request.param == "tiny" else real_config


def stored_formats(config: dict, *, experts: Format, mtp_experts: Format, linears: Format = Format.FP8,
                   expert_params: dict | None = None, overrides: dict | None = None) -> dict:
    """Stored format of every linear module: one format per group, ``overrides`` by module name."""
    out = {}
    for module in linear_shapes(ModelConfig.from_dict(config)):
        info = classify(module + ".weight")
        if info.role is Role.ROUTED_EXPERT:
            fmt = mtp_experts if info.is_mtp else experts
        elif info.role in CONFIG_LINEAR_ROLES:
            fmt = linears
        else:
            fmt = Format.BF16
        fmt = (overrides or {}).get(module, fmt)
        if fmt is Format.INT4:
            params = dict(expert_params or {"group_size": 128})
        elif fmt is Format.FP8:
            params = dict(expert_params if info.role is Role.ROUTED_EXPERT and expert_params else E8M0)
        else:
            params = {}
        out[module] = (fmt, params)
    return out


def sglang_prefixes(module: str, num_hidden_layers: int) -> list[str]:
    """The SGLang layer prefixes a stored module is loaded into, from SGLang's own name remap."""
    info = classify(module + ".weight")
    if info.role is Role.MTP_PROJECTION:
        # deepseek_v4_nextn.py: DeepseekV4ModelNextN builds e_proj/h_proj as model.e_proj/model.h_proj.
        return [f"model.{module.rsplit('.', 1)[1]}"]
    prefix = sgl.module_prefix(module + ".weight", num_hidden_layers=num_hidden_layers)
    parent, last = prefix.rsplit(".", 1)
    if info.role is not Role.ROUTED_EXPERT and last in FUSED:
        return [prefix, f"{parent}.{FUSED[last]}"]
    return [prefix]


def sglang_decisions(config: dict, module_formats: dict, env: dict) -> dict:
    """(expected, decided) per SGLang layer for every module that consults the quant config."""
    quant = sgl.quant_config_from_checkpoint_config(config, env=env)
    n_layers = config["num_hidden_layers"]
    expected: dict[tuple[str, str], set[str]] = defaultdict(set)
    moe_prefix: dict[str, list[str]] = {}  # block -> its one FusedMoE (the remap is the slow part)
    for module, (fmt, _params) in module_formats.items():
        info = classify(module + ".weight")
        if info.role is Role.ROUTED_EXPERT:
            kind, want = "moe", MOE_SCHEME[fmt]
            prefixes = moe_prefix.setdefault(info.block, sglang_prefixes(module, n_layers))
        elif info.role in CONFIG_LINEAR_ROLES and not (module.endswith(".wo_a") and fmt is Format.BF16):
            # A BF16 wo_a is built without quant config once SGLANG_OPT_FP8_WO_A_GEMM=0 (checked separately).
            kind, want = "linear", LINEAR_SCHEME[fmt]
            prefixes = sglang_prefixes(module, n_layers)
        else:
            continue
        for prefix in prefixes:
            expected[(kind, prefix)].add(want)
    ask = {"moe": sgl.moe_scheme_for, "linear": sgl.linear_scheme_for}
    return {key: (want, ask[key[0]](quant, key[1])) for key, want in expected.items()}


def assert_sglang_reads(config: dict, module_formats: dict, env: dict) -> None:
    decisions = sglang_decisions(config, module_formats, env)
    wrong = {key: pair for key, pair in decisions.items() if pair[0] != {pair[1]}}
    assert not wrong, f"{len(wrong)} SGLang layers disagree, e.g. {sorted(wrong.items())[:4]}"


def convert_config(source: dict, module_formats: dict) -> tuple[dict, dict, dict]:
    config, extra = build_quant_config(source, module_formats)
    return config, extra, serving_env(source, module_formats)


# --- the shipped variants -------------------------------------------------------------------

def test_fp8_variant_keeps_the_block_config_and_reads_every_expert_as_fp8(any_config):
    formats = stored_formats(any_config, experts=Format.FP8, mtp_experts=Format.FP8)
    config, extra, env = convert_config(any_config, formats)
    assert config["quantization_config"] == {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                             "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}
    assert "expert_dtype" not in config and extra == {}
    assert env == {"SGLANG_DSV4_FP4_EXPERTS": "0"}
    assert type(sgl.quant_config_from_checkpoint_config(config, env=env)).__name__ == "Fp8Config"
    assert_sglang_reads(config, formats, env)


def test_fp8_with_f32_expert_scales_drops_the_ue8m0_claim(tiny):
    formats = stored_formats(tiny, experts=Format.FP8, mtp_experts=Format.FP8,
                             expert_params={"fp8_scale_dtype": "F32"})
    config, _, env = convert_config(tiny, formats)
    quant = config["quantization_config"]
    assert "scale_fmt" not in quant and quant["weight_block_size"] == [128, 128]
    assert sgl.quant_config_from_checkpoint_config(config, env=env).scale_fmt is None
    assert_sglang_reads(config, formats, env)


def test_nvfp4_variant_is_detected_as_hybrid_with_mxfp4_mtp_experts(any_config):
    formats = stored_formats(any_config, experts=Format.NVFP4, mtp_experts=Format.MXFP4)
    config, extra, env = convert_config(any_config, formats)
    quant = config["quantization_config"]
    assert (quant["quant_method"], quant["quant_algo"], quant["moe_quant_algo"], quant["group_size"]) == \
           ("fp8", "MIXED_PRECISION", "NVFP4", 16)
    assert "mtp.*" in quant["ignore"] and quant["kv_cache_quant_algo"] is None
    n_layers = any_config["num_hidden_layers"]
    assert set(quant["quantized_layers"]) == {f"layers.{i}.ffn.experts" for i in range(n_layers)}
    assert "expert_dtype" not in config
    assert env == {"SGLANG_DSV4_FP4_EXPERTS": "1"}
    assert quant["mtp_experts_format"] == "mxfp4"
    nested = extra[HF_QUANT_CONFIG]
    assert set(nested) == {"producer", "quantization"}
    assert nested["quantization"]["quantized_layers"] == quant["quantized_layers"]
    assert nested["quantization"]["exclude_modules"] == quant["ignore"]
    assert type(sgl.quant_config_from_checkpoint_config(config, env=env)).__name__ == "HybridFp8NvFp4Config"
    assert_sglang_reads(config, formats, env)


def test_nvfp4_hybrid_needs_its_fields_in_config_json(tiny):
    """Without moe_quant_algo SGLang falls back to the plain FP8 dispatch: the walk must catch it."""
    formats = stored_formats(tiny, experts=Format.NVFP4, mtp_experts=Format.MXFP4)
    config, _, env = convert_config(tiny, formats)
    broken = copy.deepcopy(config)
    del broken["quantization_config"]["moe_quant_algo"]
    with pytest.raises(AssertionError, match="disagree"):
        assert_sglang_reads(broken, formats, env)


def test_nvfp4_shard_probe_agrees_with_the_stated_env(tiny, tmp_path):
    """With the env unset SGLang probes the first expert's dtype (U8) and must reach the same config."""
    formats = stored_formats(tiny, experts=Format.NVFP4, mtp_experts=Format.MXFP4)
    config, extra, _ = convert_config(tiny, formats)
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / HF_QUANT_CONFIG).write_text(json.dumps(extra[HF_QUANT_CONFIG]))
    key = "layers.0.ffn.experts.0.w1.weight"
    save_file({key: torch.zeros(2, 2, dtype=torch.uint8)}, str(tmp_path / "model-00001-of-00001.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": {key: "model-00001-of-00001.safetensors"}}))
    quant = sgl.quant_config_for_checkpoint(tmp_path, env={})
    assert type(quant).__name__ == "HybridFp8NvFp4Config" and quant.is_fp4_experts
    assert sgl.moe_scheme_for(quant, "model.decoder.mlp.experts") == "mxfp4"


@pytest.mark.parametrize("group_size", [128, 32])
def test_w4a16_variant_is_compressed_tensors_with_fp8_linears(any_config, group_size):
    formats = stored_formats(any_config, experts=Format.INT4, mtp_experts=Format.INT4,
                             expert_params={"group_size": group_size})
    config, extra, env = convert_config(any_config, formats)
    quant = config["quantization_config"]
    assert (quant["quant_method"], quant["format"]) == ("compressed-tensors", "pack-quantized")
    (group,) = quant["config_groups"].values()
    assert group["targets"] == ["Linear"]
    assert {k: group["weights"][k] for k in ("num_bits", "type", "symmetric", "strategy", "group_size", "dynamic")} \
        == {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": group_size,
            "dynamic": False}
    assert quant["linear_fp8_config"]["weight_block_size"] == [128, 128]
    assert extra == {} and "expert_dtype" not in config
    assert env == {"SGLANG_DSV4_FP4_EXPERTS": "0"}
    parsed = sgl.quant_config_from_checkpoint_config(config, env=env)
    assert type(parsed).__name__ == "CompressedTensorsConfig"
    # DeepseekV4ForCausalLM.load_weights takes its W4A16 expert mapping only when this holds.
    assert is_wint4afp8_or_wint4a16_config(parsed)
    assert parsed.target_scheme_map["Linear"]["weights"].group_size == group_size
    assert parsed.get_lm_head_scheme(None, "lm_head") is None
    # compressed-tensors itself (transformers, llm-compressor) accepts the same object; imported
    # here because its transformers import needs the torchvision shim sglang_oracle installs.
    from compressed_tensors.quantization import QuantizationConfig as CTQuantizationConfig

    assert CTQuantizationConfig.model_validate(quant).config_groups["group_0"].weights.group_size == group_size
    assert_sglang_reads(config, formats, env)


def test_bf16_variant_has_no_quantization_config(any_config):
    formats = stored_formats(any_config, experts=Format.BF16, mtp_experts=Format.BF16, linears=Format.BF16)
    config, extra, env = convert_config(any_config, formats)
    assert "quantization_config" not in config and "expert_dtype" not in config and extra == {}
    # The probe reads BF16 experts as "unknown" and would keep the FP4 default (flashinfer_mxfp4 runner).
    assert env == {"SGLANG_DSV4_FP4_EXPERTS": "0"}
    assert sgl.quant_config_from_checkpoint_config(config, env=env) is None
    assert_sglang_reads(config, formats, env)


def test_native_layout_keeps_expert_dtype_and_mxfp4_experts(tiny):
    formats = stored_formats(tiny, experts=Format.MXFP4, mtp_experts=Format.MXFP4)
    config, _, env = convert_config(tiny, formats)
    assert config["expert_dtype"] == "fp4"
    assert config["quantization_config"] == tiny["quantization_config"]
    assert env == {"SGLANG_DSV4_FP4_EXPERTS": "1"}
    assert_sglang_reads(config, formats, env)


def test_source_config_is_not_modified(tiny):
    before = copy.deepcopy(tiny)
    build_quant_config(tiny, stored_formats(tiny, experts=Format.NVFP4, mtp_experts=Format.MXFP4))
    assert tiny == before


# --- mixed recipes ------------------------------------------------------------------------------

def _indexer_wq_b(config: dict) -> list[str]:
    return [m for m in linear_shapes(ModelConfig.from_dict(config)) if m.endswith(".attn.indexer.wq_b")]


def test_nvfp4_experts_with_bf16_indexer_query(any_config):
    wq_b = _indexer_wq_b(any_config)
    formats = stored_formats(any_config, experts=Format.NVFP4, mtp_experts=Format.MXFP4,
                             overrides={m: Format.BF16 for m in wq_b})
    config, _, env = convert_config(any_config, formats)
    assert len(config["quantization_config"]["ignored_layers"]) == len(wq_b)
    decisions = sglang_decisions(config, formats, env)
    indexer = [d for (kind, prefix), d in decisions.items() if prefix.endswith("self_attn.indexer.wq_b")]
    assert len(indexer) == len(wq_b) and all(got == "unquantized" for _, got in indexer)
    assert_sglang_reads(config, formats, env)


def test_walk_catches_a_missing_ignore_entry(tiny):
    formats = stored_formats(tiny, experts=Format.NVFP4, mtp_experts=Format.MXFP4,
                             overrides={m: Format.BF16 for m in _indexer_wq_b(tiny)})
    config, _, env = convert_config(tiny, formats)
    broken = copy.deepcopy(config)
    broken["quantization_config"]["ignore"] = broken["quantization_config"].pop("ignored_layers")
    with pytest.raises(AssertionError, match="disagree"):
        assert_sglang_reads(broken, formats, env)


def test_fp8_with_bf16_shared_experts_attention_and_mtp_experts(tiny):
    # SGLang loads wo_a all FP8 or all BF16 (its _dequant_fp8_wo_a_streaming asserts otherwise): every
    # block's wo_a is BF16 here, the rest of the attention BF16 in layers.1 only.
    overrides = {m: Format.BF16 for m in linear_shapes(ModelConfig.from_dict(tiny))
                 if ".shared_experts." in m or m.startswith("layers.1.attn.") or m.startswith("mtp.0.e_proj")
                 or m.endswith(".attn.wo_a")}
    formats = stored_formats(tiny, experts=Format.FP8, mtp_experts=Format.BF16, overrides=overrides)
    formats.update({m: (Format.BF16, {}) for m in formats if m.startswith("layers.3.ffn.experts.")})
    config, _, env = convert_config(tiny, formats)
    # wo_a is BF16: the FP8 wo_a GEMM must be off.
    assert env == {"SGLANG_DSV4_FP4_EXPERTS": "0", "SGLANG_OPT_FP8_WO_A_GEMM": "0"}
    assert_sglang_reads(config, formats, env)
    # One block's wo_a BF16 beside FP8 ones cannot load in SGLang: refused, naming it.
    formats.update({m: (Format.FP8, {"fp8_scale_dtype": "F8_E8M0"}) for m in formats
                    if m.endswith(".attn.wo_a") and not m.startswith("layers.1.")})
    with pytest.raises(RecipeError, match="wo_a all FP8 or all BF16") as refused:
        convert_config(tiny, formats)
    assert refused.value.tensor == "layers.1.attn.wo_a"


def test_hybrid_with_a_backbone_layer_kept_mxfp4(tiny):
    formats = stored_formats(tiny, experts=Format.NVFP4, mtp_experts=Format.MXFP4,
                             overrides={m: Format.MXFP4 for m in linear_shapes(ModelConfig.from_dict(tiny))
                                        if m.startswith("layers.2.ffn.experts.")})
    config, extra, env = convert_config(tiny, formats)
    assert "layers.2.ffn.experts" not in config["quantization_config"]["quantized_layers"]
    assert_sglang_reads(config, formats, env)


@pytest.mark.parametrize("mtp_experts", [Format.FP8, Format.BF16])
def test_hybrid_with_fp8_or_bf16_mtp_experts_turns_fp4_experts_off(tiny, mtp_experts):
    formats = stored_formats(tiny, experts=Format.NVFP4, mtp_experts=mtp_experts)
    config, _, env = convert_config(tiny, formats)
    assert env["SGLANG_DSV4_FP4_EXPERTS"] == "0"
    names = {Format.FP8: "fp8_block", Format.BF16: "bf16"}
    assert config["quantization_config"]["mtp_experts_format"] == names[mtp_experts]
    assert_sglang_reads(config, formats, env)


def test_w4a16_with_bf16_mtp_experts(tiny):
    formats = stored_formats(tiny, experts=Format.INT4, mtp_experts=Format.BF16)
    config, _, env = convert_config(tiny, formats)
    assert_sglang_reads(config, formats, env)


def test_w4a16_with_every_linear_bf16_has_no_linear_fp8_config(tiny):
    """INT4 experts with the rest dequantized (GPUs without FP8): the linears must stay unquantized."""
    formats = stored_formats(tiny, experts=Format.INT4, mtp_experts=Format.INT4, linears=Format.BF16,
                             expert_params={"group_size": 32})
    config, _, env = convert_config(tiny, formats)
    assert "linear_fp8_config" not in config["quantization_config"]
    assert_sglang_reads(config, formats, env)


# --- what SGLang cannot load ------------------------------------------------------------------

def _error(config: dict, formats: dict) -> RecipeError:
    with pytest.raises(RecipeError) as info:
        build_quant_config(config, formats)
    return info.value


def test_missing_and_unknown_modules_are_named(tiny):
    formats = stored_formats(tiny, experts=Format.FP8, mtp_experts=Format.FP8)
    del formats["layers.2.attn.wq_b"]
    assert _error(tiny, formats).tensor == "layers.2.attn.wq_b"
    formats = stored_formats(tiny, experts=Format.FP8, mtp_experts=Format.FP8)
    formats["layers.9.attn.wq_b"] = (Format.FP8, E8M0)
    assert _error(tiny, formats).tensor == "layers.9.attn.wq_b"


@pytest.mark.parametrize(("module", "fmt", "message"), [
    ("layers.2.attn.compressor.wkv", Format.FP8, "only in BF16"),
    ("head", Format.FP8, "only in BF16"),
    ("layers.2.attn.wq_b", Format.NVFP4, "only for routed experts"),
    ("layers.0.ffn.shared_experts.w2", Format.INT4, "only for routed experts"),
    ("layers.1.attn.wq_a", Format.BF16, "fuses"),
    ("layers.1.ffn.shared_experts.w3", Format.BF16, "fuses"),
    ("layers.1.ffn.experts.3.w2", Format.BF16, "one FusedMoE"),
])
def test_unloadable_module_formats(tiny, module, fmt, message):
    formats = stored_formats(tiny, experts=Format.FP8, mtp_experts=Format.FP8, overrides={module: fmt})
    error = _error(tiny, formats)
    assert message in str(error)
    assert error.tensor is not None


@pytest.mark.parametrize(("experts", "mtp_experts", "override", "message"), [
    (Format.FP8, Format.MXFP4, None, "mix FP8 and MXFP4"),
    (Format.NVFP4, Format.NVFP4, None, "store the MTP experts FP8"),
    (Format.NVFP4, Format.MXFP4, Format.FP8, "all MXFP4 or FP8/BF16"),
    (Format.INT4, Format.FP8, None, "cannot also hold fp8"),
    (Format.INT4, Format.INT4, Format.INT4, "group sizes"),
])
def test_unloadable_expert_combinations(tiny, experts, mtp_experts, override, message):
    formats = stored_formats(tiny, experts=experts, mtp_experts=mtp_experts)
    if override is not None:
        params = {"group_size": 32} if override is Format.INT4 else E8M0
        formats.update({m: (override, params) for m in formats if m.startswith("layers.1.ffn.experts.")})
    assert message in str(_error(tiny, formats))


def test_w4a16_refuses_a_mix_of_fp8_and_bf16_linears(tiny):
    formats = stored_formats(tiny, experts=Format.INT4, mtp_experts=Format.INT4,
                             overrides={"layers.2.attn.indexer.wq_b": Format.BF16})
    assert _error(tiny, formats).tensor == "layers.2.attn.indexer.wq_b"


def test_a_bf16_wo_a_is_allowed_under_compressed_tensors_without_env(tiny):
    # Under compressed-tensors SGLang dequantizes wo_a at load, so BF16 works without an env -- for every
    # wo_a at once: _dequant_fp8_wo_a_streaming asserts "<wo_a>.scale is missing" for a BF16 wo_a once it
    # has seen a scale (SGLang's own loader shows it: tests/test_mixed_layouts.py).
    every = {m: Format.BF16 for m in linear_shapes(ModelConfig.from_dict(tiny)) if m.endswith(".attn.wo_a")}
    formats = stored_formats(tiny, experts=Format.INT4, mtp_experts=Format.INT4, overrides=every)
    config, _, env = convert_config(tiny, formats)
    assert "linear_fp8_config" in config["quantization_config"]
    assert env == {"SGLANG_DSV4_FP4_EXPERTS": "0"}
    one = stored_formats(tiny, experts=Format.INT4, mtp_experts=Format.INT4, overrides={"layers.2.attn.wo_a": Format.BF16})
    with pytest.raises(RecipeError, match="wo_a all FP8 or all BF16") as refused:
        convert_config(tiny, one)
    assert refused.value.tensor == "layers.2.attn.wo_a"


def test_not_a_deepseek_v4_config_is_refused():
    with pytest.raises(Exception, match="not a DeepSeek-V4 config"):
        build_quant_config({"model_type": "llama"}, {})
