"""The SGLang oracle answers from SGLang 0.5.23 itself, on the real V4 config and on variant configs."""

from __future__ import annotations

import argparse
import copy
import json
import os

import pytest

import sglang_oracle as sgl

def _with_quant(real_config: dict, quantization_config: dict) -> dict:
    config = copy.deepcopy(real_config)
    config["quantization_config"] = quantization_config
    return config


@pytest.fixture(scope="module")
def nvfp4_config(real_config) -> dict:
    return sgl.variant_config("nvfp4", real_config)


@pytest.fixture(scope="module")
def w4a16_config(real_config) -> dict:
    return sgl.variant_config("w4a16", real_config)


def test_base_config_is_fp8_with_fp4_experts(real_config):
    qc = sgl.quant_config_from_checkpoint_config(real_config)
    assert type(qc) is sgl.Fp8Config
    assert qc.weight_block_size == [128, 128] and qc.is_fp4_experts
    assert sgl.linear_scheme_for(qc, "model.layers.3.self_attn.wo_a") == "fp8"
    assert sgl.linear_scheme_for(qc, "model.layers.4.self_attn.indexer.wq_b") == "fp8"
    assert sgl.moe_scheme_for(qc, "model.layers.3.mlp.experts") == "mxfp4"


def test_fp8_variant_needs_env_without_shards(real_config):
    qc = sgl.quant_config_from_checkpoint_config(real_config, env={"SGLANG_DSV4_FP4_EXPERTS": "0"})
    assert type(qc) is sgl.Fp8Config and not qc.is_fp4_experts
    assert sgl.moe_scheme_for(qc, "model.layers.3.mlp.experts") == "fp8"
    assert "SGLANG_DSV4_FP4_EXPERTS" not in os.environ


def test_nvfp4_hybrid_detected_and_mtp_excluded(nvfp4_config):
    qc = sgl.quant_config_from_checkpoint_config(nvfp4_config)
    assert type(qc) is sgl.HybridFp8NvFp4Config
    assert "model.decoder.*" in qc.nvfp4_config.exclude_modules
    assert sgl.moe_scheme_for(qc, "model.layers.0.mlp.experts") == "nvfp4"
    assert sgl.moe_scheme_for(qc, "model.layers.42.mlp.experts") == "nvfp4"
    assert sgl.moe_scheme_for(qc, sgl.module_prefix("mtp.0.ffn.experts.5.w2.weight")) == "mxfp4"
    assert sgl.linear_scheme_for(qc, "model.layers.3.self_attn.wo_a") == "fp8"
    assert sgl.linear_scheme_for(qc, "model.layers.3.mlp.shared_experts.gate_up_proj") == "fp8"


def test_nvfp4_fields_only_in_config_json_count(real_config):
    quant = dict(real_config["quantization_config"], moe_quant_algo="NVFP4")  # no quant_algo/group_size
    qc = sgl.quant_config_from_checkpoint_config(_with_quant(real_config, quant))
    assert type(qc) is sgl.Fp8Config


def test_w4a16_compressed_tensors(w4a16_config):
    qc = sgl.quant_config_from_checkpoint_config(w4a16_config, env={"SGLANG_DSV4_FP4_EXPERTS": "0"})
    assert type(qc) is sgl.CompressedTensorsConfig
    assert sgl.moe_scheme_for(qc, "model.layers.7.mlp.experts") == "wna16"
    assert sgl.moe_scheme_for(qc, "model.decoder.mlp.experts") == "wna16"
    assert sgl.linear_scheme_for(qc, "model.layers.7.self_attn.wo_b") == "fp8"


def test_w4a16_ignore_is_dotted_suffix(w4a16_config):
    config = copy.deepcopy(w4a16_config)
    config["quantization_config"]["ignore"] = ["re:model[.]decoder[.].*", "layers.3.mlp.experts.0.gate_proj"]
    qc = sgl.quant_config_from_checkpoint_config(config, env={"SGLANG_DSV4_FP4_EXPERTS": "0"})
    assert sgl.moe_scheme_for(qc, "model.decoder.mlp.experts") == "unquantized"
    with pytest.raises(ValueError, match="differ"):
        sgl.moe_scheme_for(qc, "model.layers.3.mlp.experts")


def test_fp8_ignored_layers_unquantize(real_config):
    quant = dict(real_config["quantization_config"], ignored_layers=["model.layers.5.self_attn.wo_b"])
    qc = sgl.quant_config_from_checkpoint_config(_with_quant(real_config, quant))
    assert sgl.linear_scheme_for(qc, "model.layers.5.self_attn.wo_b") == "unquantized"
    assert sgl.linear_scheme_for(qc, "model.layers.6.self_attn.wo_b") == "fp8"


def test_sglang_name_remap():
    assert sgl.sglang_name("layers.3.ffn.experts.7.w1.scale") == "model.layers.3.mlp.experts.7.gate_proj.weight_scale_inv"
    assert sgl.sglang_name("layers.3.attn.wo_a.scale") == "model.layers.3.self_attn.wo_a.weight_scale_inv"
    assert sgl.sglang_name("layers.0.ffn.gate.tid2eid") == "model.layers.0.mlp.topk.tid2eid"
    assert sgl.sglang_name("layers.3.ffn.experts.7.w1.weight_scale") == "model.layers.3.mlp.experts.7.gate_proj.weight_scale"
    assert sgl.sglang_name("mtp.0.e_proj.scale") == "model.layers.43.e_proj.weight_scale_inv"
    assert sgl.module_prefix("layers.9.ffn.experts.255.w2.weight") == "model.layers.9.mlp.experts"
    assert sgl.module_prefix("mtp.0.attn.wq_a.weight") == "model.decoder.self_attn.wq_a"


def test_server_args_parse_and_reject():
    args = sgl.parse_server_args(["--model-path", "m", "--tp-size", "4", "--moe-runner-backend", "marlin"])
    assert args.tp_size == 4 and args.moe_runner_backend == "marlin"
    with pytest.raises(SystemExit):
        sgl.parse_server_args(["--model-path", "m", "--no-such-flag"])
    with pytest.raises(argparse.ArgumentError, match="invalid choice: 'rdma'"):
        sgl.parse_server_args(["--model-path", "m", "--disaggregation-transfer-backend", "rdma"])


def _model_dir(tmp_path, config: dict) -> str:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def test_resolution_applies_v4_defaults(tmp_path, real_config):
    model = _model_dir(tmp_path, real_config)
    resolved = sgl.resolve_server_args(["--model-path", model, "--tp-size", "4"], gpu="sm120").resolved_dict()
    assert resolved["attention_backend"] == "dsv4" and resolved["page_size"] == 256
    assert resolved["kv_cache_dtype"] == "fp8_e4m3"
    assert not any(key.startswith("SGLANG_OPT_") for key in os.environ)


def test_resolution_rejects_bf16_kv_cache(tmp_path, real_config):
    model = _model_dir(tmp_path, real_config)
    with pytest.raises(Exception, match="not supported"):
        sgl.resolve_server_args(["--model-path", model, "--kv-cache-dtype", "bf16"], gpu="sm90")


def test_auto_runner_for_nvfp4_hybrid_is_sm100_only(tmp_path, nvfp4_config):
    model = _model_dir(tmp_path, nvfp4_config)
    auto = sgl.resolve_server_args(["--model-path", model, "--tp-size", "4"], gpu="sm120").resolved_dict()
    assert auto["moe_runner_backend"] == "flashinfer_trtllm_routed"
    marlin = sgl.resolve_server_args(
        ["--model-path", model, "--tp-size", "4", "--moe-runner-backend", "marlin"], gpu="sm120"
    ).resolved_dict()
    assert marlin["moe_runner_backend"] == "marlin"


def test_bf16_variant_has_no_quant_config(real_config):
    config = sgl.variant_config("bf16", real_config)
    assert "quantization_config" not in config
    qc = sgl.quant_config_from_checkpoint_config(config, env={"SGLANG_DSV4_FP4_EXPERTS": "0"})
    assert qc is None
    assert sgl.moe_scheme_for(qc, "model.layers.3.mlp.experts") == "unquantized"


def test_unknown_gpu_family():
    with pytest.raises(ValueError, match="unknown GPU family"):
        sgl.platform_facts("sm89")


def test_router_args_parse_and_reject():
    router = sgl.parse_router_args(
        ["--pd-disaggregation", "--mini-lb", "--prefill", "http://127.0.0.1:30000", "8998",
         "--decode", "http://127.0.0.1:30001", "--host", "127.0.0.1", "--port", "8000"]
    )
    assert router.pd_disaggregation and router.mini_lb
    assert router.prefill_urls == [("http://127.0.0.1:30000", 8998)]
    assert router.decode_urls == ["http://127.0.0.1:30001"]
    with pytest.raises(SystemExit):
        sgl.parse_router_args(["--pd-disaggregation", "--no-such-router-flag"])
