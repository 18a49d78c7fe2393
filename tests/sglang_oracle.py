"""SGLang 0.5.23 as a test oracle: what the real server would make of our commands and configs.

Test helper only (not part of the package). Answers come from SGLang's own code, imported from
the ``sglang`` wheel installed with ``--no-deps`` by ``ci/install-sglang-cpu.sh``: its argument
parser and resolution pipeline, ``ModelConfig`` and the loader's quant-config wrap, the config
classes and their exclusion predicates, the V4 weight-name remap, the router's parser. Two
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

``gpu`` is one of :data:`GPU_FACTS` ("sm90" H200, "sm100" B200, "sm120" RTX PRO 6000): SGLang's
platform probes are answered from that table through SGLang's own ``override_platform``.
Any ``env`` given is applied only for the call; ``os.environ`` is restored afterwards, including
the variables SGLang's resolution writes itself.

One accommodation for a CPU-only machine: PyPI's torchvision wheels are CUDA builds whose C++ ops
cannot load next to CPU torch. torchvision supports running without its ops, except that two
unconditional fake-kernel registrations (``nms``, ``qnms``) need the op names to exist under
torch 2.13. SGLang imports torchvision only for multimodal preprocessing, so if (and only if)
that exact import failure happens, the two op schemas are declared without kernels and the
import is retried. Nothing here calls a torchvision op.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import sys
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

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
from sglang.srt.layers.quantization.base_config import QuantizationConfig  # noqa: E402
from sglang.srt.layers.quantization.compressed_tensors.compressed_tensors import (  # noqa: E402
    CompressedTensorsConfig,
)
from sglang.srt.layers.quantization.compressed_tensors.schemes import CompressedTensorsMoEScheme  # noqa: E402
from sglang.srt.layers.quantization.compressed_tensors.utils import should_ignore_layer  # noqa: E402
from sglang.srt.layers.quantization.fp8 import Fp8Config  # noqa: E402
from sglang.srt.layers.quantization.modelopt_quant import HybridFp8NvFp4Config  # noqa: E402
from sglang.srt.layers.quantization.utils import is_layer_skipped  # noqa: E402
from sglang.srt.model_loader.loader import _get_quantization_config  # noqa: E402
from sglang.srt.models.deepseek_v4 import DeepseekV4ForCausalLM  # noqa: E402
from sglang.srt.runtime_context import get_flags, override_platform  # noqa: E402
from sglang.srt.layers.moe.utils import resolve_moe_runner_backend  # noqa: E402
from sglang.srt.layers.quantization.marlin_utils import (  # noqa: E402
    check_marlin_supported,
    check_moe_marlin_supports_layer,
    scalar_types,
)
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
    if variant == "nvfp4":
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

