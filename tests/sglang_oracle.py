"""SGLang 0.5.23 as a test oracle: what the real server would make of our commands and configs.

Test helper only (not part of the package). Answers come from SGLang's own code, imported from
the ``sglang`` wheel installed with ``--no-deps`` by ``ci/install-sglang-cpu.sh``: its argument
parser and resolution pipeline, ``ModelConfig`` and the loader's quant-config wrap, the config
classes and their exclusion predicates, the V4 weight-name remap, the router's parser, and the
V4 model itself with its weight loader (section 5). Two
things are mirrored because they cannot run on CPU, and say so where they are: the branch order
of ``get_quant_method`` (in ``moe_scheme_for``/``linear_scheme_for``, calling SGLang's predicates)
and the ``bench_serving`` parser (replayed from its source, see ``parse_bench_args``).

How to use it (the first import costs ~10-15 s: SGLang imports its whole model registry):

    import sglang_oracle as sgl       # tests/ is on sys.path under pytest

    # 1. Command lines -> SGLang's own ServerArgs.
    args = sgl.parse_server_args(["--model-path", d, "--tp-size", "4"])   # argparse only
    args = sgl.resolve_server_args(argv, gpu="sm120", env={"SGLANG_DSV4_FP4_EXPERTS": "0"})
    args.resolved_dict()["moe_runner_backend"]                 # what the server would run
    router = sgl.parse_router_args(["--pd-disaggregation", "--prefill", url, "8998", ...])
    bench = sgl.parse_bench_args(["--backend", "sglang", "--dataset-name", "random-ids", ...])
    # resolve_* needs argv to name a local directory with a V4 config.json (--model-path);
    # it raises whatever SGLang raises (e.g. ValueError for --kv-cache-dtype bf16).

    # 2. An output checkpoint's config.json -> SGLang's quantization config object.
    qc = sgl.quant_config_from_checkpoint_config(json.load(open(out / "config.json")))
    qc = sgl.quant_config_for_checkpoint(out_dir)              # also runs SGLang's shard dtype probe
    type(qc).__name__   # "Fp8Config" | "HybridFp8NvFp4Config" | "CompressedTensorsConfig"

    # 3. Per-module decisions, with SGLang module prefixes.
    sgl.moe_scheme_for(qc, "model.layers.3.mlp.experts")       # "nvfp4" | "mxfp4" | "fp8" |
    sgl.moe_scheme_for(qc, "model.decoder.mlp.experts")        #   "wna16" | "unquantized"
    sgl.linear_scheme_for(qc, "model.layers.3.self_attn.wo_a") # "fp8" | "unquantized" | "wna16" ...
    sgl.moe_method_for(qc, "model.decoder.mlp.experts", gpu="sm90")  # SGLang's get_moe_scheme object:
                                                               #   CompressedTensorsWNA16MoE (Marlin), ...
    sgl.marlin_moe_supports(32, gpu="sm120", hidden_size=4096, intermediate_per_partition=512)
    sgl.sglang_name("layers.3.ffn.experts.7.w1.weight")        # SGLang's own checkpoint-name remap
    sgl.module_prefix("layers.3.ffn.experts.7.w1.weight")      # -> "model.layers.3.mlp.experts"

    # 4. Reference configs per sglang-contract.md section 1 (to compare a converter's output with).
    sgl.variant_config("nvfp4", native_config)                 # native config.json, NVFP4-hybrid quant

    # 5. SGLang's real DeepseekV4ForCausalLM (or, draft=True, the draft the launch asks for: the NextN
    #    MTP draft under EAGLE, DeepseekV4ForCausalLMDSpark under --speculative-algorithm DSPARK), built
    #    on CPU for a launch command and loaded from a checkpoint by its own loader and load_weights.
    loaded = sgl.load_checkpoint(out_dir, argv, gpu="sm120", env=env, draft=False)
    loaded.params["model.layers.1.mlp.experts.w13_weight"]    # as load_weights left it
    loaded.written[...]                                         # per element: did loading write it
    loaded.moe_methods, loaded.not_initialized, loaded.error    # what SGLang built, warned, raised
    loaded.reached["mtp.0.main_proj.weight"]                    # the parameters a checkpoint tensor was written into

``gpu`` is one of :data:`GPU_FACTS` ("sm90" H200, "sm100" B200, "sm120" RTX PRO 6000): SGLang's
platform probes are answered from that table through SGLang's own ``override_platform``.
Any ``env`` given is applied only for the call; ``os.environ`` is restored afterwards, including
the variables SGLang's resolution writes itself.

``load_checkpoint`` answers what a CPU host lacks as a GPU host would (platform facts, DeepGEMM's
availability, device placement, the rope kernel import, GPU-only post-load steps) and builds
SGLang's process groups over a one-rank gloo world once per process; test_sglang_loading.py lists
each accommodation and why. It publishes SGLang's runtime context for the call and restores it
afterwards.

One accommodation for a CPU-only machine: PyPI's torchvision wheels are CUDA builds whose C++ ops
cannot load next to CPU torch. torchvision supports running without its ops, except that two
unconditional fake-kernel registrations (``nms``, ``qnms``) need the op names to exist under
torch 2.13. SGLang imports torchvision only for multimodal preprocessing, so if (and only if)
that exact import failure happens, the two op schemas are declared without kernels and the
import is retried. Nothing here calls a torchvision op.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import functools
import json
import logging
import os
import sys
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import torch

# CUDA facts SGLang reads through `get_platform()`, per GPU family we serve on.
GPU_FACTS: dict[str, dict[str, Any]] = {
    "sm90": {"major": 9, "minor": 0},
    "sm100": {"major": 10, "minor": 0},
    "sm120": {"major": 12, "minor": 0},
}

_TORCHVISION_LIBRARY: torch.library.Library | None = None


def _import_torchvision_without_ops() -> None:
    """Import torchvision; on CPU torch, declare the two op names its import insists on."""
    global _TORCHVISION_LIBRARY
    try:
        import torchvision  # noqa: F401
        return
    except RuntimeError as exc:
        if "torchvision::nms" not in str(exc):
            raise
    for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
        del sys.modules[name]
    _TORCHVISION_LIBRARY = torch.library.Library("torchvision", "FRAGMENT")
    for op in ("nms", "qnms"):
        _TORCHVISION_LIBRARY.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    import torchvision  # noqa: F401,F811


_import_torchvision_without_ops()

from sglang.srt.configs.load_config import LoadConfig  # noqa: E402
from sglang.srt.configs.model_config import ModelConfig  # noqa: E402
from sglang.srt.layers.linear import ReplicatedLinear  # noqa: E402
from sglang.srt.layers.moe.fused_moe_triton import FusedMoE  # noqa: E402
from sglang.srt.layers.moe.utils import resolve_moe_runner_backend  # noqa: E402
from sglang.srt.layers.quantization.base_config import QuantizationConfig  # noqa: E402
from sglang.srt.layers.quantization.compressed_tensors.compressed_tensors import (  # noqa: E402
    CompressedTensorsConfig,
)
from sglang.srt.layers.quantization.compressed_tensors.schemes import CompressedTensorsMoEScheme  # noqa: E402
from sglang.srt.layers.quantization.compressed_tensors.utils import should_ignore_layer  # noqa: E402
from sglang.srt.layers.quantization.fp8 import Fp8Config  # noqa: E402
from sglang.srt.layers.quantization.marlin_utils import (  # noqa: E402
    check_marlin_supported,
    check_moe_marlin_supports_layer,
    scalar_types,
)
from sglang.srt.layers.quantization.modelopt_quant import HybridFp8NvFp4Config  # noqa: E402
from sglang.srt.layers.quantization.utils import is_layer_skipped  # noqa: E402
from sglang.srt.model_loader.loader import _get_quantization_config  # noqa: E402
from sglang.srt.models.deepseek_v4 import DeepseekV4ForCausalLM  # noqa: E402
from sglang.srt.models.deepseek_v4_dspark import DeepseekV4ForCausalLMDSpark  # noqa: E402
from sglang.srt.runtime_context import get_flags, override_platform  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402
from sglang_router.launch_router import parse_router_args as _parse_router_args  # noqa: E402
from sglang_router.router_args import RouterArgs  # noqa: E402


def platform_facts(gpu: str) -> dict[str, Any]:
    """Every platform fact SGLang probes, answered for one CUDA GPU family."""
    if gpu not in GPU_FACTS:
        raise ValueError(f"unknown GPU family {gpu!r}; known: {sorted(GPU_FACTS)}")
    major, minor = GPU_FACTS[gpu]["major"], GPU_FACTS[gpu]["minor"]
    return {
        "is_cuda": True,
        "is_hip": False,
        "is_npu": False,
        "is_xpu": False,
        "is_musa": False,
        "is_mps": False,
        "is_sm90": major == 9,
        "is_sm100": major == 10,
        "is_sm100_or_sm110": major in (10, 11),
        "is_sm110": major == 11,
        "is_sm120": major == 12,
        "is_blackwell": major in (10, 11, 12),
        "is_hopper_with_cuda_12_3": major == 9,
        "has_amx": False,
        "has_flashinfer": False,
        "device_sm": major * 10 + minor,
        "device_capability": (major, minor),
    }


@contextlib.contextmanager
def _scoped_environ(env: Mapping[str, str] | None) -> Iterator[None]:
    """Apply ``env`` for one call and undo every change, SGLang's own included."""
    saved = dict(os.environ)
    os.environ.update(env or {})
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@functools.lru_cache(maxsize=1)
def _parser() -> argparse.ArgumentParser:
    """SGLang's full parser, built once (parse_args does not mutate it)."""
    parser = argparse.ArgumentParser(prog="sglang.launch_server", exit_on_error=False)
    ServerArgs.add_cli_args(parser)
    return parser


def parse_server_args(argv: list[str]) -> ServerArgs:
    """Parse a ``launch_server`` argv with SGLang's parser; unknown flags raise SystemExit."""
    namespace = _parser().parse_args(argv)
    return ServerArgs.from_cli_args(namespace)


def parse_router_args(argv: list[str]) -> RouterArgs:
    """Parse a ``sglang_router.launch_router`` argv with the router package's own parser."""
    return _parse_router_args(argv)


def parse_bench_args(argv: list[str]) -> argparse.Namespace:
    """Parse a ``sglang.benchmark.serving`` argv with a parser rebuilt from that module's source.

    The benchmark builds its parser inside ``cli_main`` and the module imports HF ``datasets``
    at import time, which the CPU install leaves out. So the ``add_argument`` calls of
    ``cli_main`` are read from the installed file and replayed with their literal keywords
    (flags, ``choices``, ``action``, ``nargs``, ``default``) and builtin ``type``; keywords that
    are not literals are dropped. Unknown flags and bad choices fail exactly as in SGLang.
    """
    parser = argparse.ArgumentParser(prog="sglang.benchmark.serving", exit_on_error=False)
    for flags, keywords in _bench_cli_arguments():
        parser.add_argument(*flags, **keywords)
    return parser.parse_args(argv)


@functools.lru_cache(maxsize=1)
def _bench_cli_arguments() -> list[tuple[list[str], dict[str, Any]]]:
    import ast
    import importlib.util

    spec = importlib.util.find_spec("sglang.benchmark.serving")
    tree = ast.parse(Path(spec.origin).read_text())
    cli_main = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "cli_main")
    builtin_types = {"int": int, "float": float, "str": str}
    arguments = []
    for node in ast.walk(cli_main):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument"):
            continue
        flags = [ast.literal_eval(arg) for arg in node.args]
        keywords: dict[str, Any] = {}
        for keyword in node.keywords:
            if keyword.arg == "type" and isinstance(keyword.value, ast.Name):
                if keyword.value.id in builtin_types:
                    keywords["type"] = builtin_types[keyword.value.id]
                continue
            try:
                value = ast.literal_eval(keyword.value)
            except ValueError:
                continue
            if keyword.arg in ("choices", "action", "nargs", "default", "dest", "const"):
                keywords[keyword.arg] = value
        arguments.append((flags, keywords))
    return arguments


def resolve_server_args(
    argv: list[str], *, gpu: str = "sm120", env: Mapping[str, str] | None = None
) -> ServerArgs:
    """Parse and run SGLang's full resolution (V4 overrides, flag checks) as on ``gpu``."""
    server_args = parse_server_args([*argv, "--device", "cuda"])
    with _scoped_environ(env), override_platform(**platform_facts(gpu)):
        server_args.resolve_once()
    return server_args


def quant_config_for_checkpoint(
    model_dir: str | os.PathLike[str], *, gpu: str = "sm120", env: Mapping[str, str] | None = None
) -> QuantizationConfig | None:
    """The quantization config SGLang's loader builds for a local checkpoint directory.

    Runs ``ModelConfig`` (quant parsing, the FP4-expert dtype probe, NVFP4-hybrid detection)
    and the loader's ``_get_quantization_config`` wrap, exactly as the server does.
    """
    with _scoped_environ(env), override_platform(**platform_facts(gpu)):
        model_config = ModelConfig(str(model_dir))
        return _get_quantization_config(model_config, LoadConfig())


def quant_config_from_checkpoint_config(
    config: Mapping[str, Any], *, gpu: str = "sm120", env: Mapping[str, str] | None = None
) -> QuantizationConfig | None:
    """Like :func:`quant_config_for_checkpoint` for a ``config.json`` dict with no shards.

    Without shards SGLang's dtype probe finds nothing, so ``is_fp4_experts`` follows
    ``SGLANG_DSV4_FP4_EXPERTS`` (default true) exactly as on a server whose probe fails.
    """
    with tempfile.TemporaryDirectory(prefix="sglang-oracle-") as directory:
        Path(directory, "config.json").write_text(json.dumps(dict(config)))
        return quant_config_for_checkpoint(directory, gpu=gpu, env=env)


def is_fp4_experts(model_dir: str | os.PathLike[str], *, gpu: str = "sm120",
                   env: Mapping[str, str] | None = None) -> bool:
    """SGLang's ``is_fp4_experts`` for a checkpoint (its header probe when ``SGLANG_DSV4_FP4_EXPERTS`` is unset)."""
    with _scoped_environ(env), override_platform(**platform_facts(gpu)):
        return bool(ModelConfig(str(model_dir)).is_fp4_experts)


def _bare(module_type: type[torch.nn.Module]) -> torch.nn.Module:
    """An instance SGLang's ``isinstance`` dispatch recognises, without allocating weights."""
    module = module_type.__new__(module_type)
    torch.nn.Module.__init__(module)
    return module


def _compressed_tensors_scheme(config: CompressedTensorsConfig, scheme: dict | None) -> str:
    if scheme is None:
        return "unquantized"
    weights, activations = scheme.get("weights"), scheme.get("input_activations")
    if config._is_wNa16_group_channel(weights, activations):
        return "wna16"
    if config._is_fp4a16_nvfp4(weights, activations) or config._is_fp4a4_nvfp4(weights, activations):
        return "nvfp4"
    if config._is_fp8_w8a8(weights, activations) or config._is_fp8_w8a16(weights, activations):
        return "fp8"
    raise ValueError(f"compressed-tensors scheme outside what dsv4convert writes: {scheme}")


def moe_scheme_for(config: QuantizationConfig | None, sglang_prefix: str) -> str:
    """The routed-expert weight format SGLang expects for the FusedMoE at ``sglang_prefix``.

    Follows each config class's ``get_quant_method`` FusedMoE branch using SGLang's own
    exclusion predicates; the runner (Marlin, FlashInfer, ...) is a separate choice.
    """
    if config is None:
        return "unquantized"
    if isinstance(config, HybridFp8NvFp4Config):
        if not config.nvfp4_config.is_layer_excluded(sglang_prefix):
            return "nvfp4"
        if config.is_fp4_experts:  # excluded draft experts stay source MXFP4
            return "mxfp4"
    if isinstance(config, Fp8Config):
        if is_layer_skipped(sglang_prefix, config.ignored_layers, fused_mapping=config.packed_modules_mapping):
            return "unquantized"
        # FP4 experts are read as MXFP4 even when SGLANG_DSV4_FP4_DEQUANT recasts them at load.
        return "mxfp4" if config.is_fp4_experts else "fp8"
    if isinstance(config, CompressedTensorsConfig):
        if config._is_mxfp4_moe(layer_name=sglang_prefix):
            return "mxfp4"
        config._add_fused_moe_to_target_scheme_map()
        layer = _bare(FusedMoE)
        schemes = [
            config.get_scheme_dict(layer, f"{sglang_prefix}.0.{projection}")
            for projection in ("gate_proj", "up_proj", "down_proj")
        ]
        if any(scheme != schemes[0] for scheme in schemes):
            raise ValueError(f"{sglang_prefix}: SGLang refuses experts whose projections differ: {schemes}")
        return _compressed_tensors_scheme(config, schemes[0])
    raise TypeError(f"no MoE rule for {type(config).__name__}")


def moe_method_for(config: CompressedTensorsConfig, sglang_prefix: str, *, gpu: str,
                   moe_runner_backend: str = "auto") -> CompressedTensorsMoEScheme | None:
    """The MoE scheme object SGLang's own ``CompressedTensorsConfig.get_moe_scheme`` builds.

    Not mirrored: SGLang's method runs, on ``gpu``'s platform facts and with the MoE runner
    backend the server resolved (``ServerArgs.resolved_dict()["moe_runner_backend"]``, or the
    speculative one for the NextN draft). The runner flag is restored afterwards.
    """
    moe = get_flags().moe
    saved = moe.runner_backend
    try:
        with override_platform(**platform_facts(gpu)):
            moe.runner_backend = resolve_moe_runner_backend(moe_runner_backend)
            return config.get_moe_scheme(_bare(FusedMoE), layer_name=sglang_prefix)
    finally:
        moe.runner_backend = saved


def marlin_moe_supports(group_size: int, *, gpu: str, hidden_size: int, intermediate_per_partition: int) -> bool:
    """SGLang's own Marlin checks for a symmetric INT4 (``uint4b8``) FusedMoE: the quant type and
    group on ``gpu``'s capability, and the layer shape (``check_moe_marlin_supports_layer``)."""
    major, minor = GPU_FACTS[gpu]["major"], GPU_FACTS[gpu]["minor"]
    layer = argparse.Namespace(hidden_size=hidden_size, intermediate_size_per_partition=intermediate_per_partition,
                               moe_runner_config=argparse.Namespace(apply_router_weight_on_input=False,
                                                                    is_gated=True, activation="silu"))
    return (check_marlin_supported(scalar_types.uint4b8, group_size, has_zp=False, device_capability=major * 10 + minor)
            and check_moe_marlin_supports_layer(layer, group_size))


def linear_scheme_for(config: QuantizationConfig | None, sglang_prefix: str) -> str:
    """The weight format SGLang expects for the ``LinearBase`` at ``sglang_prefix``."""
    if config is None:
        return "unquantized"
    if isinstance(config, Fp8Config):  # HybridFp8NvFp4Config included: linears use the FP8 path
        skipped = is_layer_skipped(sglang_prefix, config.ignored_layers, fused_mapping=config.packed_modules_mapping)
        return "unquantized" if skipped else "fp8"
    if isinstance(config, CompressedTensorsConfig):
        if config.linear_fp8_config is not None:
            return "fp8"
        if should_ignore_layer(sglang_prefix, ignore=config.ignore, fused_mapping=config.packed_modules_mapping):
            return "unquantized"
        return _compressed_tensors_scheme(config, config.get_scheme_dict(_bare(ReplicatedLinear), sglang_prefix))
    raise TypeError(f"no linear rule for {type(config).__name__}")


def sglang_name(native_name: str, *, num_hidden_layers: int = 43) -> str:
    """SGLang's own remap of a checkpoint tensor name (``mtp.*`` as the NextN draft sees it)."""
    return DeepseekV4ForCausalLM.remap_weight_name_to_dpsk_hf_format(
        native_name, is_nextn=native_name.startswith("mtp."), num_hidden_layers=num_hidden_layers
    )


def module_prefix(native_name: str, *, num_hidden_layers: int = 43) -> str:
    """The SGLang module prefix a quant config is asked about for a checkpoint tensor.

    Routed experts collapse into one FusedMoE (``...mlp.experts``); the NextN draft builds its
    block as ``model.decoder`` rather than ``model.layers.<num_hidden_layers>``.
    """
    module = sglang_name(native_name, num_hidden_layers=num_hidden_layers).rsplit(".", 1)[0]
    parts = module.split(".")
    if "experts" in parts and parts.index("experts") + 1 < len(parts):
        module = ".".join(parts[: parts.index("experts") + 1])
    draft_block = f"model.layers.{num_hidden_layers}."
    if native_name.startswith("mtp.") and module.startswith(draft_block):
        module = "model.decoder." + module.removeprefix(draft_block)
    return module


def contract_quantization_config(variant: str, base: Mapping[str, Any], *,
                                 group_size: int = 128) -> dict[str, Any] | None:
    """A variant's ``quantization_config`` as sglang-contract.md section 1 specifies it, for tests.

    ``base`` is the native checkpoint's ``quantization_config``; None means no quantization (BF16).
    ``group_size`` is W4A16's (the contract allows 128 or 32).
    """
    if variant in ("native", "fp8"):
        return dict(base)
    if variant in ("nvfp4", "nvfp4-mtp-mxfp4", "nvfp4-mtp-bf16"):  # these differ in the MTP experts only
        return {**base, "quant_algo": "MIXED_PRECISION", "moe_quant_algo": "NVFP4", "group_size": 16,
                "ignore": ["*.attn.*", "*.ffn.shared_experts.*", "head", "mtp.*"]}
    if variant == "w4a16":
        int4_group = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                      "group_size": group_size, "dynamic": False}
        return {
            "quant_method": "compressed-tensors",
            "format": "pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": int4_group}},
            "linear_fp8_config": {"quant_method": "fp8", "activation_scheme": "dynamic",
                                  "weight_block_size": list(base["weight_block_size"])},
            "ignore": ["lm_head"],
        }
    if variant == "bf16":
        return None
    raise ValueError(f"unknown variant {variant!r}")


def variant_config(variant: str, native_config: Mapping[str, Any], *, group_size: int = 128) -> dict[str, Any]:
    """``native_config`` with the variant's ``quantization_config`` (dropped for BF16)."""
    config = {k: v for k, v in native_config.items() if k != "quantization_config"}
    quant = contract_quantization_config(variant, native_config["quantization_config"], group_size=group_size)
    if quant is not None:
        config["quantization_config"] = quant
    return config



# 5. SGLang's real model, built on CPU, loading a checkpoint through its own load_weights.

# DeepGEMM as SGLang computes it at import on a GPU host with the wheel's sgl-deep-gemm pin:
# (ENABLE_JIT_DEEPGEMM, DEEPGEMM_SCALE_UE8M0). SM120 needs a DeepGEMM build with its DSV4 APIs,
# which configurer.py probes; off, as SGLang's model hook turns the FP8 wo_a GEMM off there anyway.
DEEPGEMM_FACTS: dict[str, tuple[bool, bool]] = {"sm90": (True, False), "sm100": (True, True), "sm120": (False, False)}

# The cookbook's balanced EAGLE preset (what `serve --mtp` adds): one step, one candidate, two tokens verified.
EAGLE_ARGS = ("--speculative-algorithm", "EAGLE", "--speculative-num-steps", "1", "--speculative-eagle-topk", "1",
              "--speculative-num-draft-tokens", "2")

SENTINELS = (0xA5, 0x5A)  # every parameter byte is filled with one, then the other, before loading

# Parameters SGLang registers that no checkpoint tensor fills, and why (SGLang's own
# "not initialized" warning skips the first three and lists the last on every W4A16 load).
NEVER_LOADED = {
    "attn_mqa.k_scale": "FP8 KV-cache scales default to 1.0; V4 checkpoints carry none",
    "attn_mqa.v_scale": "FP8 KV-cache scales default to 1.0; V4 checkpoints carry none",
    "blockscale_swizzled": "derived from weight_scale after loading (NVFP4 cutlass/marlin layout)",
    "g_idx": "act-order indices; a W4A16 checkpoint without act-order has none (emptied after loading)",
}
DRAFT_SHARED = {
    "model.embed_tokens.weight": "the draft takes the target's embedding (set_embed_and_head)",
    "lm_head.weight": "the draft takes the target's LM head (set_embed_and_head)",
}
_NOT_INITIALIZED = "Some weights are not initialized from checkpoints: "
_NOT_FOUND = " not found in params_dict."
# models/deepseek_v4_dspark.py::DeepseekV4ForCausalLMDSpark.load_weights, for a mapped name it has no parameter for.
_DSPARK_UNEXPECTED = "DSpark V4 draft: unexpected weight "
# Parameters the DSpark draft registers that no checkpoint tensor fills: each stage's RadixAttention
# (DSparkAttention.__init__) gets Fp8KVCacheMethod's k_scale/v_scale, 1.0 by default.
DSPARK_NEVER_LOADED = {
    ".self_attn.attn.k_scale": "FP8 KV-cache scales default to 1.0; V4 checkpoints carry none",
    ".self_attn.attn.v_scale": "FP8 KV-cache scales default to 1.0; V4 checkpoints carry none",
}


@dataclass
class LoadedModel:
    """SGLang's model after its ``load_weights`` ran on one checkpoint, as on one GPU family.

    ``params`` are the parameters exactly as ``load_weights`` left them, taken just before it calls
    ``post_load_weights`` (which then runs too). ``written`` marks, per element, whether loading wrote
    it: the model is built and loaded twice, its bytes filled first with one sentinel and then with
    another; an element holding its sentinel both times was never written.
    """

    gpu: str
    draft: bool
    model: torch.nn.Module
    params: dict[str, torch.Tensor]
    written: dict[str, torch.Tensor]
    yielded: list[str]                 # checkpoint tensors SGLang's own weight iterator produced
    reached: dict[str, set[str]]       # checkpoint tensor -> parameters whose weight_loader received it
    moe_methods: dict[str, str]        # FusedMoE prefix -> routed-expert method (scheme for compressed-tensors)
    wo_a_fp8: bool                     # the FP8 wo_a GEMM is on: wo_a stays FP8 instead of BF16
    not_initialized: set[str]          # what SGLang's own "Some weights are not initialized" warning lists
                                       # (the DSpark draft's load_weights has no such warning: always empty)
    not_found: list[str]               # checkpoint tensors SGLang logged it has no parameter for: V4/NextN
                                       # "<name> not found in params_dict.", DSpark "unexpected weight <name>"
    error: BaseException | None = None  # what load_weights raised, if it did
    error_tensor: str | None = None     # the checkpoint tensor being loaded when it did
    moe_runners: dict[str, str] = field(default_factory=dict)  # FusedMoE prefix -> the runner backend it
                                                                # chose at construction (FusedMoE.runner_backend)


def load_checkpoint(model_dir: str | os.PathLike[str], argv: list[str], *, gpu: str,
                    env: Mapping[str, str] | None = None, draft: bool = False) -> LoadedModel:
    """Build SGLang's ``DeepseekV4ForCausalLM`` (``draft``: the draft model ``argv`` launches, i.e. the
    ``DeepseekV4ForCausalLMNextN`` MTP draft under EAGLE, ``DeepseekV4ForCausalLMDSpark`` under DSPARK on a
    checkpoint that bundles a DSpark drafter) for ``launch_server`` arguments ``argv`` and environment
    ``env`` on ``gpu``, and load ``model_dir``.

    Everything the server does on its way there is SGLang's own: argument parsing and resolution
    (``publish``), the MoE/GEMM runner flags, ``ModelConfig.from_server_args`` (FP4-expert probe,
    NVFP4-hybrid detection, the draft architecture), ``_get_quantization_config``, model
    construction (the draft inside the speculative MoE scopes EAGLE builds it in), the default
    loader's file discovery and safetensors iterator, and ``load_weights``. What a CPU lacks is
    answered as on ``gpu`` by :func:`_cpu_host_fakes` and the two GPU-only post-load stubs in
    :func:`_load_weights`. A raise inside ``load_weights`` is returned (``error``, with the
    checkpoint tensor), not raised; anything earlier raises.
    """
    first = _build_and_load(str(model_dir), argv, gpu, env, draft, SENTINELS[0])
    second = _build_and_load(str(model_dir), argv, gpu, env, draft, SENTINELS[1])
    if set(first.params) != set(second.params):
        raise AssertionError("SGLang built different parameters in two identical loads")
    for name, tensor in first.params.items():
        unwritten = ((_byte_view(tensor) == SENTINELS[0]).all(-1)
                     & (_byte_view(second.params[name]) == SENTINELS[1]).all(-1))
        first.written[name] = (~unwritten).reshape(tensor.shape)
    return first


_PROCESS_GROUPS: dict[str, Any] = {}


def _one_rank_process_groups() -> None:
    """SGLang's own TP/PP/EP groups over a one-rank gloo world, built once per process."""
    import torch.distributed as dist
    from sglang.srt.distributed import parallel_state
    from sglang.srt.runtime_context import get_parallel

    if _PROCESS_GROUPS:
        get_parallel().override_permanently(**_PROCESS_GROUPS)
        return
    if not dist.is_initialized():
        store = Path(tempfile.mkdtemp(prefix="sglang-oracle-pg-")) / "store"
        parallel_state.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                                    distributed_init_method=f"file://{store}")
    parallel_state.initialize_model_parallel()
    _PROCESS_GROUPS.update({k: v for k, v in get_parallel()._stamp.items() if k.endswith("_group")})


@contextlib.contextmanager
def _cpu_host_fakes(gpu: str) -> Iterator[None]:
    """What a CPU host lacks, answered as a ``gpu`` host would (listed in test_sglang_loading.py)."""
    import sglang.srt.layers.rotary_embedding.base as rope
    import sglang.srt.platforms as platforms
    import sglang.srt.utils.common as common
    from sglang.srt.layers import deep_gemm_wrapper
    from sglang.srt.layers.deep_gemm_wrapper import configurer
    from sglang.srt.platforms.cpu import CpuSRTPlatform

    jit, ue8m0 = DEEPGEMM_FACTS[gpu]
    capability = (GPU_FACTS[gpu]["major"], GPU_FACTS[gpu]["minor"])
    host = CpuSRTPlatform()
    with contextlib.ExitStack() as stack:
        stack.enter_context(override_platform(**platform_facts(gpu)))
        for module in (deep_gemm_wrapper, configurer):
            stack.enter_context(mock.patch.multiple(module, ENABLE_JIT_DEEPGEMM=jit, DEEPGEMM_SCALE_UE8M0=ue8m0,
                                                    DEEPGEMM_BLACKWELL=jit and capability[0] == 10))
        stack.enter_context(mock.patch.object(torch.cuda, "get_device_capability", lambda *_a, **_k: capability))
        stack.enter_context(mock.patch.object(platforms, "_current_platform", host))
        stack.enter_context(mock.patch.object(common, "current_platform", host))
        stack.enter_context(mock.patch.object(rope, "_is_cuda", True))
        yield


@contextlib.contextmanager
def pool_configurator(server_argv: list[str], gpu: str, env: Mapping[str, str] | None
                      ) -> Iterator[tuple[Any, dict[str, Any]]]:
    """SGLang's ``DSV4PoolConfigurator`` for a launch (over SGLang's ``ModelConfig`` of the model the argv names),
    with the resolved arguments, as a scheduler on ``gpu`` builds it; the host fakes stay on while the caller
    sizes pools with it (tests/test_fit.py for V4, tests/test_fit_v41.py for V4.1)."""
    from types import SimpleNamespace

    from sglang.srt.model_executor.pool_configurator import DSV4PoolConfigurator
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    with _scoped_environ(env), _cpu_host_fakes(gpu), mock.patch.object(torch.cuda, "is_available", lambda: True), \
            mock.patch.object(torch.version, "cuda", "12.9"):
        server = parse_server_args([*server_argv, "--device", "cuda"])
        publish(server, role="scheduler", ranks=SpawnRanks(world_rank=0, gpu_id=0))
        model_config = ModelConfig.from_server_args(server)
        resolved = server.resolved_dict()
        kvc = SimpleNamespace(
            kv_cache_dtype_str=resolved["kv_cache_dtype"], model_config=model_config,
            layer_info=SimpleNamespace(start_layer=0, end_layer=model_config.num_hidden_layers), pp_size=1,
            spec_algorithm=SpeculativeAlgorithm.from_string(resolved["speculative_algorithm"]),
            spec_aux_config=None, sliding_window_size=model_config.window_size, page_size=resolved["page_size"],
            attn_dp_size=1)
        yield DSV4PoolConfigurator(kvc), resolved


def _build_and_load(model_dir: str, argv: list[str], gpu: str, env: Mapping[str, str] | None, draft: bool,
                    sentinel: int) -> LoadedModel:
    """Resolve, publish, build and load once, as a scheduler process on ``gpu`` does."""
    import sglang.srt.models.deepseek_v4 as deepseek_v4
    from sglang.srt.environ import envs
    from sglang.srt.layers import deep_gemm_wrapper
    from sglang.srt.layers.moe import initialize_moe_config
    from sglang.srt.layers.quantization.fp4_utils import initialize_fp4_gemm_config
    from sglang.srt.layers.quantization.fp8_utils import initialize_fp8_gemm_config
    from sglang.srt.model_executor.model_runner_components.load_model_utils import build_load_config
    from sglang.srt.model_loader.loader import _initialize_model, set_default_torch_dtype
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, restore_context, snapshot_context

    state = snapshot_context()
    try:
        with _scoped_environ(env), _cpu_host_fakes(gpu), contextlib.ExitStack() as scopes:
            server_args = parse_server_args([*argv, "--device", "cuda"])
            publish(server_args, role="scheduler", ranks=SpawnRanks(world_rank=0, gpu_id=0))  # resolves it
            _one_rank_process_groups()
            initialize_moe_config()
            initialize_fp8_gemm_config()
            initialize_fp4_gemm_config()
            # The scheduler process imports the model after resolution wrote SGLANG_OPT_FP8_WO_A_GEMM.
            wo_a_gemm = envs.SGLANG_OPT_FP8_WO_A_GEMM.get()
            wo_a_ue8m0 = wo_a_gemm and deep_gemm_wrapper.DEEPGEMM_SCALE_UE8M0
            scopes.enter_context(mock.patch.multiple(deepseek_v4, _FP8_WO_A_GEMM=wo_a_gemm,
                                                     _FP8_WO_A_UE8M0=wo_a_ue8m0))
            model_config = ModelConfig.from_server_args(server_args, is_draft_model=draft)
            load_config = build_load_config(
                server_args=server_args, tp_rank=0, remote_instance_weight_transporter_engine=None,
                remote_instance_weight_transporter_session_id="", draft_model_idx=None, weight_cache_mode="off",
                weight_cache_socket=None)
            quant_config = _get_quantization_config(model_config, load_config)
            if draft:
                for scope in _draft_build_scopes(server_args.speculative_algorithm):
                    scopes.enter_context(scope)
            with set_default_torch_dtype(model_config.dtype), torch.device("cpu"):
                model = _initialize_model(model_config, load_config, quant_config)
            if isinstance(model, DeepseekV4ForCausalLMDSpark):
                return _load_dspark_weights(model, model_config, load_config, gpu=gpu, sentinel=sentinel)
            return _load_weights(model, model_config, load_config, gpu=gpu, draft=draft, sentinel=sentinel,
                                 stub_deep_gemm=wo_a_ue8m0)
    finally:
        # The one-rank groups are stamped permanently (restore_context keeps stamps): left there, they contradict
        # any later publish of a wider TP in this process (test_fit's pool check); the next call stamps them again.
        get_parallel().clear_stamp()
        restore_context(state)


def _draft_build_scopes(algorithm: str | None) -> list[contextlib.AbstractContextManager]:
    """The MoE scopes SGLang's draft worker builds its draft model in.

    EAGLE's worker builds (and runs) its draft inside the speculative MoE runner and A2A backends
    (speculative/eagle_worker_v2.py). The DSpark worker builds it with
    ``speculative/draft_worker_common.py::build_draft_tp_worker`` (called from
    ``speculative/dspark_components/dspark_worker_v2.py::DSparkWorkerV2.__init__``) inside
    ``draft_model_build_scope`` alone, which "deliberately does not swap runner_backend": a DSpark draft's
    experts run on the target's ``--moe-runner-backend``, and ``--speculative-moe-runner-backend`` does not
    reach them.
    """
    from sglang.srt.layers.moe.utils import (
        draft_model_build_scope,
        speculative_moe_a2a_backend_context,
        speculative_moe_backend_context,
    )

    if algorithm == "DSPARK":
        return [draft_model_build_scope()]
    return [speculative_moe_backend_context(), speculative_moe_a2a_backend_context(), draft_model_build_scope()]


def _load_dspark_weights(model: DeepseekV4ForCausalLMDSpark, model_config: ModelConfig, load_config: LoadConfig,
                         *, gpu: str, sentinel: int) -> LoadedModel:
    """Sentinel-fill the DSpark draft, stream the checkpoint through SGLang's loader into its load_weights.

    ``DeepseekV4ForCausalLMDSpark.load_weights`` (models/deepseek_v4_dspark.py) differs from the V4 one
    :func:`_load_weights` observes: it calls each parameter's ``weight_loader`` itself (no
    ``maybe_executor_submit``, no mHC kernel prewarm), after ``deepseek_v4.py::_dequant_fp8_wo_a_streaming``
    replaced each FP8 ``wo_a`` weight/scale pair by one BF16 tensor, and it passes every name through
    ``_remap_dspark_weight_name`` first. So a write into a parameter's storage (every in-place aten write,
    seen by a dispatch mode: weight loaders copy into views, and ``ModelWeightParameter.weight_loader`` is a
    read-only property that cannot be wrapped) is attributed to the checkpoint name last remapped.
    """
    import sglang.srt.models.deepseek_v4_dspark as dspark
    from sglang.srt.model_loader.loader import get_model_loader
    from torch.utils._python_dispatch import TorchDispatchMode

    params = dict(model.named_parameters())
    for parameter in params.values():
        _byte_view(parameter.data).fill_(sentinel)
    storages = {p.untyped_storage().data_ptr(): n for n, p in params.items()}
    snapshot: dict[str, torch.Tensor] = {}
    post_load_weights = model.post_load_weights

    def snapshot_then_post_load(*args, **kwargs):
        snapshot.update({n: p.detach().clone() for n, p in model.named_parameters()})
        return post_load_weights(*args, **kwargs)

    yielded: list[str] = []
    reached: dict[str, set[str]] = {}
    current: list[str] = []  # the checkpoint name load_weights is placing
    remap = model._remap_dspark_weight_name

    def recorded(weights):
        for name, tensor in weights:
            yielded.append(name)
            yield name, tensor

    def observed_remap(name: str) -> str | None:
        current[:] = [name]
        return remap(name)

    in_place = (torch.ops.aten.copy_.default, torch.ops.aten.index_put_.default, torch.ops.aten.index_copy_.default,
                torch.ops.aten.fill_.Scalar, torch.ops.aten.zero_.default)

    class Writes(TorchDispatchMode):
        """Notes which parameter each in-place write of the loading loop lands in."""

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func in in_place and current and isinstance(args[0], torch.Tensor):
                target = storages.get(args[0].untyped_storage().data_ptr())
                if target is not None:
                    reached.setdefault(current[0], set()).add(target)
            return out

    capture = _LogCapture()
    logger = logging.getLogger(dspark.__name__)
    logger.addHandler(capture)
    error = None
    loader = get_model_loader(load_config, model_config)
    try:
        with mock.patch.object(model, "post_load_weights", snapshot_then_post_load), \
             mock.patch.object(model, "_remap_dspark_weight_name", observed_remap), Writes():
            model.load_weights(recorded(loader._get_all_weights(model_config, model)))
    except Exception as exc:  # noqa: BLE001 - returned: the caller decides what a raise means
        error = exc
    finally:
        logger.removeHandler(capture)
    unexpected = [m.removeprefix(_DSPARK_UNEXPECTED) for m in capture.messages if m.startswith(_DSPARK_UNEXPECTED)]
    return LoadedModel(
        gpu=gpu, draft=True, model=model,
        params=snapshot or {n: p.detach().clone() for n, p in model.named_parameters()},
        written={}, yielded=yielded, reached=reached,
        moe_methods={n: _moe_method_name(m) for n, m in model.named_modules() if isinstance(m, FusedMoE)},
        moe_runners=_moe_runners(model),
        wo_a_fp8=any(stage.self_attn.wo_a_fp8 for stage in model.stages), not_initialized=set(),
        not_found=[ast.literal_eval(m.split(" -> ")[0]) for m in unexpected],
        error=error, error_tensor=current[0] if error is not None and current else None)


def _load_weights(model: torch.nn.Module, model_config: ModelConfig, load_config: LoadConfig, *, gpu: str,
                  draft: bool, sentinel: int, stub_deep_gemm: bool) -> LoadedModel:
    """Sentinel-fill ``model``, stream the checkpoint through SGLang's loader into its load_weights."""
    import types

    import sglang.srt.models.deepseek_v4 as deepseek_v4
    from sglang.srt.model_loader.loader import get_model_loader
    from sglang.srt.model_loader.utils import maybe_executor_submit

    param_names = {id(p): n for n, p in model.named_parameters()}
    for parameter in model.parameters():
        _byte_view(parameter.data).fill_(sentinel)
    snapshot: dict[str, torch.Tensor] = {}
    post_load_weights = model.post_load_weights

    def snapshot_then_post_load(*args, **kwargs):
        snapshot.update({n: p.detach().clone() for n, p in model.named_parameters()})
        return post_load_weights(*args, **kwargs)

    model.post_load_weights = snapshot_then_post_load
    yielded: list[str] = []
    sources: dict[int, tuple[str, torch.Tensor]] = {}  # holding the tensors keeps their ids unique
    reached: dict[str, set[str]] = {}

    def recorded(weights):
        for name, tensor in weights:
            yielded.append(name)
            sources[id(tensor)] = (name, tensor)
            yield name, tensor

    def observed_submit(*, func, func_args=(), func_kwargs=None, **kwargs):
        """SGLang's submit, noting which checkpoint tensor reached which parameter and naming it in a raise."""
        # Fused pairs (wq_a+wkv, compressor wkv+wgate) and dequantized wo_a arrive as new tensors:
        # they are attributed to the tensor read last.
        source = sources.get(id(func_args[1]), (yielded[-1] if yielded else "?",))[0]
        reached.setdefault(source, set()).add(param_names.get(id(func_args[0]), "?"))

        def named(*a, **k):
            try:
                return func(*a, **k)
            except Exception as exc:
                exc.add_note(f"checkpoint tensor: {source}")
                raise

        return maybe_executor_submit(func=named, func_args=func_args, func_kwargs=func_kwargs, **kwargs)

    deep_gemm = types.ModuleType("deep_gemm")  # DeepGEMM's scale-layout transform is a GPU kernel
    deep_gemm.transform_sf_into_required_layout = lambda sf, **_kw: sf
    capture = _LogCapture()
    logger = logging.getLogger(deepseek_v4.__name__)
    logger.addHandler(capture)
    error = None
    loader = get_model_loader(load_config, model_config)
    try:
        with mock.patch.object(type(model), "_prewarm_mhc_kernels", lambda self: None), \
             mock.patch.object(deepseek_v4, "maybe_executor_submit", observed_submit), \
             mock.patch.dict(sys.modules, {"deep_gemm": deep_gemm} if stub_deep_gemm else {}):
            model.load_weights(recorded(loader._get_all_weights(model_config, model)))
    except Exception as exc:  # noqa: BLE001 - returned: the caller decides what a raise means
        error = exc
    finally:
        logger.removeHandler(capture)
    error_tensor = None
    if error is not None:  # ours (raised in a weight_loader), or SGLang's own "name=" (raised in its loop)
        notes = getattr(error, "__notes__", [])
        ours = [n.split(": ", 1)[1] for n in notes if n.startswith("checkpoint tensor: ")]
        in_loop = any(n.startswith("name=") for n in notes)
        error_tensor = ours[0] if ours else (yielded[-1] if in_loop and yielded else None)
    not_initialized: set[str] = set()
    for message in capture.messages:
        if message.startswith(_NOT_INITIALIZED):
            not_initialized |= set(ast.literal_eval(message.removeprefix(_NOT_INITIALIZED)))
    return LoadedModel(
        gpu=gpu, draft=draft, model=model,
        params=snapshot or {n: p.detach().clone() for n, p in model.named_parameters()},
        written={}, yielded=yielded, reached=reached,
        moe_methods={n: _moe_method_name(m) for n, m in model.named_modules() if isinstance(m, FusedMoE)},
        moe_runners=_moe_runners(model),
        wo_a_fp8=bool(model.wo_a_fp8), not_initialized=not_initialized,
        not_found=[m.removesuffix(_NOT_FOUND) for m in capture.messages if m.endswith(_NOT_FOUND)],
        error=error, error_tensor=error_tensor)


def _byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s bytes as [numel, itemsize] uint8 (a view: writing it writes the tensor)."""
    flat = tensor.detach().reshape(-1)
    return flat.view(torch.uint8).view(flat.numel(), tensor.element_size())


def _moe_runners(model: torch.nn.Module) -> dict[str, str]:
    """Each FusedMoE's runner backend, as ``FusedMoE.__init__`` asked its quant method (``get_moe_runner_backend``)
    right after ``create_moe_runner``; None where the method has none."""
    return {n: m.runner_backend.value if m.runner_backend is not None else None
            for n, m in model.named_modules() if isinstance(m, FusedMoE)}


def _moe_method_name(layer: torch.nn.Module) -> str:
    if type(layer.quant_method).__name__ == "CompressedTensorsFusedMoEMethod":
        return type(layer.scheme).__name__
    return type(layer.quant_method).__name__


class _LogCapture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


# 6. What each TP rank of SGLang's real model holds, built on the meta device (no memory) at any TP.

def rank_parameters(model_dir: str | os.PathLike[str], argv: list[str], *, gpu: str, tp: int,
                    env: Mapping[str, str] | None = None, draft: bool = False) -> dict[str, torch.Tensor]:
    """The parameters (meta tensors: shape and dtype) rank 0 of a ``--tp-size tp`` server builds.

    SGLang's own resolution, ModelConfig, quant config and model classes run as in :func:`load_checkpoint`;
    what is faked is the TP world: SGLang's one-rank process groups are published with ``world_size``
    set to the configured widths (``runtime_context._WIDTH_AND_GROUP``), so every layer asks SGLang's
    own TP size and shards as rank 0 of ``tp`` would. Nothing is allocated (``torch.device("meta")``).
    """
    import copy as _copy

    import sglang.srt.models.deepseek_v4 as deepseek_v4
    from sglang.srt import runtime_context
    from sglang.srt.environ import envs
    from sglang.srt.layers import deep_gemm_wrapper
    from sglang.srt.layers.moe import initialize_moe_config
    from sglang.srt.layers.quantization.fp4_utils import initialize_fp4_gemm_config
    from sglang.srt.layers.quantization.fp8_utils import initialize_fp8_gemm_config
    from sglang.srt.model_executor.model_runner_components.load_model_utils import build_load_config
    from sglang.srt.model_loader.loader import _initialize_model, set_default_torch_dtype
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, restore_context, snapshot_context

    state = snapshot_context()
    try:
        with _scoped_environ(env), _cpu_host_fakes(gpu), contextlib.ExitStack() as scopes:
            get_parallel().clear_stamp()
            one_rank = [*argv, "--tp-size", "1", "--device", "cuda"]
            publish(parse_server_args(one_rank), role="scheduler", ranks=SpawnRanks(world_rank=0, gpu_id=0))
            _one_rank_process_groups()                      # the real groups, built once over one rank
            get_parallel().clear_stamp()
            server_args = parse_server_args([*argv, "--tp-size", str(tp), "--device", "cuda"])
            publish(server_args, role="scheduler", ranks=SpawnRanks(world_rank=0, gpu_id=0))
            parallel = get_parallel()
            groups = dict(_PROCESS_GROUPS)
            for size_name, group_name in runtime_context._WIDTH_AND_GROUP:
                if group_name in groups:
                    wide = _copy.copy(groups[group_name])
                    wide.world_size, wide.rank_in_group = getattr(parallel, size_name), 0
                    groups[group_name] = wide
            parallel.override_permanently(**groups)
            initialize_moe_config()
            initialize_fp8_gemm_config()
            initialize_fp4_gemm_config()
            wo_a_gemm = envs.SGLANG_OPT_FP8_WO_A_GEMM.get()
            scopes.enter_context(mock.patch.multiple(deepseek_v4, _FP8_WO_A_GEMM=wo_a_gemm,
                                                     _FP8_WO_A_UE8M0=wo_a_gemm and deep_gemm_wrapper.DEEPGEMM_SCALE_UE8M0))
            model_config = ModelConfig.from_server_args(server_args, is_draft_model=draft)
            load_config = build_load_config(
                server_args=server_args, tp_rank=0, remote_instance_weight_transporter_engine=None,
                remote_instance_weight_transporter_session_id="", draft_model_idx=None, weight_cache_mode="off",
                weight_cache_socket=None)
            quant_config = _get_quantization_config(model_config, load_config)
            if draft:
                for scope in _draft_build_scopes(server_args.speculative_algorithm):
                    scopes.enter_context(scope)
            with set_default_torch_dtype(model_config.dtype), torch.device("meta"):
                model = _initialize_model(model_config, load_config, quant_config)
            return dict(model.named_parameters())
    finally:
        get_parallel().clear_stamp()
        restore_context(state)
