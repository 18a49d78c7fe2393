"""W4A16 at group 32 and 128: SGLang 0.5.23 picks its WNA16 MoE path for the experts we write.

Not a mirror of SGLang's branch order: its own ``CompressedTensorsConfig.get_moe_scheme`` runs on
the config our converter writes, under each GPU family's platform facts and with the MoE runner
backend SGLang itself resolves from the launch that ``dsv4convert serve`` would make (the NextN
draft with the speculative runner), and its own Marlin predicates check the real expert shapes.
"""

from __future__ import annotations

import json

import pytest
import sglang_oracle as sgl

from dsv4convert.cli import main
from dsv4convert.engines.config import build_quant_config
from dsv4convert.engines.sglang.quant_config import serving_env
from dsv4convert.engines.sglang.rules import variant_rules as variant_defaults
from dsv4convert.formats import Format
from dsv4convert.models.deepseek_v4.layout import ModelConfig, Role, classify, linear_shapes

WNA16_MARLIN = "CompressedTensorsWNA16MoE"        # compressed_tensors_wNa16_moe.py, the Marlin MoE kernel
WNA16_TRITON = "CompressedTensorsWNA16TritonMoE"  # the Triton WNA16 kernel: SGLang's auto choice on sm_100


def _w4a16_config(source: dict, group_size: int) -> tuple[dict, dict]:
    formats = {}
    for module in linear_shapes(ModelConfig.from_dict(source)):
        role = classify(module + ".weight").role
        if role is Role.ROUTED_EXPERT:
            formats[module] = (Format.INT4, {"group_size": group_size})
        elif role in (Role.ATTENTION, Role.INDEXER, Role.SHARED_EXPERT, Role.MTP_PROJECTION):
            formats[module] = (Format.FP8, {"fp8_scale_dtype": "F8_E8M0"})
        else:
            formats[module] = (Format.BF16, {})
    config, _ = build_quant_config(source, formats)
    return config, serving_env(source, formats)


def _runner_backends(tmp_path, config: dict, gpu: str, env: dict) -> tuple[str, str]:
    """(target, draft) MoE runner backends SGLang resolves for the launch ``serve`` plans for W4A16."""
    (tmp_path / "config.json").write_text(json.dumps(config))
    defaults = variant_defaults("w4a16", gpu)
    argv = ["--model-path", str(tmp_path), "--tp-size", "4"]
    if defaults.moe_runner_backend:
        argv += ["--moe-runner-backend", defaults.moe_runner_backend]
    resolved = sgl.resolve_server_args(argv, gpu=gpu, env={**env, **defaults.env}).resolved_dict()
    target = resolved["moe_runner_backend"]
    return target, resolved.get("speculative_moe_runner_backend") or target


@pytest.mark.parametrize("group_size", [32, 128])
@pytest.mark.parametrize("gpu, scheme", [("sm90", WNA16_MARLIN), ("sm120", WNA16_MARLIN), ("sm100", WNA16_TRITON)])
def test_sglang_builds_the_wna16_moe_scheme_for_backbone_and_mtp_experts(tmp_path, real_config, group_size,
                                                                        gpu, scheme):
    config, env = _w4a16_config(real_config, group_size)
    assert env == {"SGLANG_DSV4_FP4_EXPERTS": "0"}
    target_backend, draft_backend = _runner_backends(tmp_path, config, gpu, env)
    quant = sgl.quant_config_from_checkpoint_config(config, gpu=gpu, env=env)
    layers = config["num_hidden_layers"]
    for prefix, backend in [*((f"model.layers.{i}.mlp.experts", target_backend) for i in (0, 3, layers - 1)),
                            ("model.decoder.mlp.experts", draft_backend)]:
        method = sgl.moe_method_for(quant, prefix, gpu=gpu, moe_runner_backend=backend)
        assert type(method).__name__ == scheme, (prefix, backend)
        assert method.group_size == group_size and method.num_bits == 4
        if scheme == WNA16_MARLIN:
            assert method.sym and not method.actorder


@pytest.mark.parametrize("gpu", ["sm90", "sm120"])
def test_marlin_moe_accepts_group_32_and_128_at_every_tensor_parallel_size(real_config, gpu):
    hidden, inter = real_config["hidden_size"], real_config["moe_intermediate_size"]
    for tp in (1, 2, 4, 8):
        for group_size in (32, 128):
            assert sgl.marlin_moe_supports(group_size, gpu=gpu, hidden_size=hidden,
                                           intermediate_per_partition=inter // tp), (group_size, tp)
    # the predicates can say no: a group Marlin has no kernel for, a partition a group does not divide
    assert not sgl.marlin_moe_supports(256, gpu=gpu, hidden_size=hidden, intermediate_per_partition=inter)
    assert not sgl.marlin_moe_supports(128, gpu=gpu, hidden_size=hidden, intermediate_per_partition=96)


@pytest.mark.parametrize("group_size", [32, 128])
def test_to_w4a16_output_is_read_by_sglang_at_its_group_size(tiny_ckpt, tmp_path, group_size):
    out = tmp_path / f"w4a16-g{group_size}"
    assert main(["to-w4a16", "--src", str(tiny_ckpt), "--dst", str(out), "--group-size", str(group_size),
                 "--no-progress"]) == 0
    config = json.loads((out / "config.json").read_text())
    (group,) = config["quantization_config"]["config_groups"].values()
    assert group["weights"]["group_size"] == group_size
    quant = sgl.quant_config_for_checkpoint(out, gpu="sm90", env={"SGLANG_DSV4_FP4_EXPERTS": "0"})
    for prefix in ("model.layers.0.mlp.experts", "model.decoder.mlp.experts"):
        method = sgl.moe_method_for(quant, prefix, gpu="sm90")
        assert type(method).__name__ == WNA16_MARLIN and method.group_size == group_size
