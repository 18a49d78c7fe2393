"""The one place ``tune`` touches SGLang 0.5.23: its Triton fused-MoE kernel, config names and lookup.

Everything comes from the installed ``sglang`` package, nothing is copied: the kernel launcher
``invoke_fused_moe_kernel`` and the activation kernel (``kernels/ops/moe/fused_moe_triton_kernels.py``),
the file name (``get_config_file_name``), the lookup (``get_moe_configs``: ``SGLANG_MOE_CONFIG_DIR``
*replaces* the shipped folder, then ``configs/triton_<version>/``, then the other Triton versions'
folders newest first) and the default tiles (``get_default_config``), from
``srt/layers/moe/moe_runner/triton_utils/fused_moe_triton_config.py``.

Two accommodations, neither of which changes what SGLang computes:

* On a CUDA host without ``sglang-kernel`` the package ``triton_utils`` cannot be imported (its
  ``__init__`` imports the CUDA MoE wrapper, which imports ``sgl_kernel``), but its config module
  needs nothing of it; it is then loaded from its file under its own name.
* ``get_moe_configs`` and ``get_default_config`` read one server setting (deterministic inference);
  outside a server nothing is published, so SGLang's defaults are (``ServerArgs(model_path="dummy")``,
  as SGLang's own tests do, without the resolution pipeline that needs the GPU packages).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dsv4convert.engines import SGLANG_LABEL, VERSIONS
from dsv4convert.tune.problem import MoEProblem, TuneError

CONFIG_DIR_ENV = "SGLANG_MOE_CONFIG_DIR"
_CONFIG_PACKAGE = "sglang.srt.layers.moe.moe_runner.triton_utils"
_CONFIG_MODULE = f"{_CONFIG_PACKAGE}.fused_moe_triton_config"
_KERNELS_MODULE = "sglang.kernels.ops.moe.fused_moe_triton_kernels"
_QUANT_MODULE = "sglang.kernels.ops.quantization.fp8_kernel"


def _require_sglang() -> None:
    for package in ("triton", "sglang"):
        if importlib.util.find_spec(package) is None:
            raise TuneError(f"{package} is not installed: tune runs {SGLANG_LABEL}'s own Triton MoE kernel "
                            f"(pip install sglang=={VERSIONS['sglang']}; on a host without its GPU packages: --no-deps plus the "
                            "light dependencies in ci/install-sglang-cpu.sh)")


@functools.cache
def config_module():
    """``fused_moe_triton_config``, imported normally, else loaded from its file (no ``sgl_kernel``)."""
    _require_sglang()
    try:
        module = importlib.import_module(_CONFIG_MODULE)
    except ModuleNotFoundError as exc:
        if exc.name != "sgl_kernel":
            raise
        module = sys.modules.get(_CONFIG_MODULE)  # imported before the wrapper failed: complete
        if module is None:
            spec = importlib.util.find_spec(_CONFIG_PACKAGE)  # imports the parents, not triton_utils itself
            path = Path(spec.submodule_search_locations[0]) / "fused_moe_triton_config.py"
            file_spec = importlib.util.spec_from_file_location(_CONFIG_MODULE, path)
            module = importlib.util.module_from_spec(file_spec)
            sys.modules[_CONFIG_MODULE] = module
            file_spec.loader.exec_module(module)
    _publish_defaults()
    return module


@functools.cache
def kernels():
    """``fused_moe_triton_kernels``: ``invoke_fused_moe_kernel`` and ``act_and_mul_triton``."""
    _require_sglang()
    return importlib.import_module(_KERNELS_MODULE)


def _publish_defaults() -> None:
    from sglang.srt.runtime_context import get_context

    context = get_context()
    if not context.is_config_namespace_published("exec"):
        from sglang.srt.server_args import ServerArgs

        context.set_server_args(ServerArgs(model_path="dummy"))


def quantize_fp8_groups(x, group: int):
    """SGLang's Triton per-token-group FP8 quantization: (e4m3 values, float32 scales [rows, K / group]).

    On CUDA SGLang's MoE calls a JIT CUDA kernel for this; the Triton one computes the same
    values and needs no compiler or ``sgl_kernel``. It runs outside the timed kernels.
    """
    _require_sglang()
    return importlib.import_module(_QUANT_MODULE)._per_token_group_quant_8bit_raw(x, group)


def version() -> str:
    from importlib.metadata import version as dist_version

    _require_sglang()
    return dist_version("sglang")


def shipped_root() -> Path:
    """The folder SGLang reads when ``SGLANG_MOE_CONFIG_DIR`` is unset (it holds ``configs/``)."""
    return Path(config_module().__file__).resolve().parent


def triton_folder() -> str:
    """``triton_X_Y_Z``: the folder SGLang looks in first, for the Triton that runs here."""
    _require_sglang()
    import triton

    parts = triton.__version__.split(".")
    if not all(part.isdigit() for part in parts):
        # SGLang parses every triton_* folder name as integers when a lookup misses.
        raise TuneError(f"Triton {triton.__version__} is not a release version: a configs/triton_* folder named "
                        "after it would break SGLang's config lookup for every other shape")
    return "triton_" + "_".join(parts)


def device_name() -> str:
    """The device name as SGLang reads it (``get_device_name``), before it replaces spaces."""
    name = config_module().get_device_name()
    if not name:
        raise TuneError("SGLang sees no GPU here (get_device_name() is None): tune on the GPU that will serve")
    return name


def file_name(problem: MoEProblem, *, down: bool = False) -> str:
    """SGLang's own name of the config file for this problem (``..._down.json`` for the down projection)."""
    return config_module().get_config_file_name(problem.experts, problem.lookup_n, problem.dtype,
                                                 problem.block_shape, down_moe=down)


@contextlib.contextmanager
def _config_dir(root: Path | None) -> Iterator[None]:
    """SGLang's lookup with ``SGLANG_MOE_CONFIG_DIR`` = ``root`` (unset: the shipped folder), uncached."""
    saved = os.environ.get(CONFIG_DIR_ENV)
    module = config_module()
    logger = logging.getLogger(module.__name__)
    level = logger.level
    if root is None:
        os.environ.pop(CONFIG_DIR_ENV, None)
    else:
        os.environ[CONFIG_DIR_ENV] = str(root)
    module.get_moe_configs.cache_clear()
    logger.setLevel(logging.ERROR)  # "Using default config" / "Fallback to triton version" are expected here
    try:
        yield
    finally:
        logger.setLevel(level)
        module.get_moe_configs.cache_clear()
        if saved is None:
            os.environ.pop(CONFIG_DIR_ENV, None)
        else:
            os.environ[CONFIG_DIR_ENV] = saved


def lookup(problem: MoEProblem, root: Path | None, *, down: bool = False) -> dict[int, dict] | None:
    """What ``get_moe_configs`` finds for this problem under ``root`` (None: SGLang's shipped files).

    With ``down``, SGLang itself falls back to the up-projection file when no ``_down`` file exists.
    """
    block_n, block_k = problem.block_shape or (0, 0)
    with _config_dir(root):
        found = config_module().get_moe_configs(problem.experts, problem.lookup_n, problem.dtype, block_n, block_k,
                                                per_channel_quant=False, down_moe=down)
    return None if found is None else {int(m): dict(cfg) for m, cfg in found.items()}


def default_config(problem: MoEProblem, batch_size: int) -> dict[str, Any]:
    """``get_default_config``: the tiles SGLang runs when it finds no file (the ``Using default`` warning)."""
    return dict(config_module().get_default_config(batch_size, problem.experts, problem.lookup_n, problem.hidden,
                                                   problem.topk, problem.dtype, False, problem.block_shape))


def nearest(configs: dict[int, dict], batch_size: int) -> dict:
    """The entry SGLang picks from a config file for a batch of ``batch_size`` tokens (nearest key)."""
    return configs[min(configs, key=lambda m: abs(m - batch_size))]


def served_configs(problem: MoEProblem, root: Path | None, batch_size: int) -> tuple[dict, dict]:
    """(up, down) tile configs a server with ``SGLANG_MOE_CONFIG_DIR=root`` runs for ``batch_size`` tokens.

    ``try_get_optimal_moe_config`` (needs the ``triton_utils`` package, i.e. ``sgl_kernel`` on CUDA)
    where it imports; else the same rule from ``get_moe_configs``: the nearest entry, the default
    without a file, the down file's entry with the up file's ``BLOCK_SIZE_M`` (one alignment serves
    both GEMMs), the up entry without a down file. Tests check the two agree.
    """
    try:
        from sglang.srt.layers.moe.moe_runner.triton_utils import try_get_optimal_moe_config
    except ModuleNotFoundError as exc:
        if exc.name != "sgl_kernel":
            raise
        return _served_configs_from_files(problem, root, batch_size)
    w1 = (problem.experts, 2 * problem.intermediate, problem.hidden)  # only E and w2's N choose the file
    w2 = (problem.experts, problem.hidden, problem.lookup_n)
    with _config_dir(root):
        up, (down, _) = try_get_optimal_moe_config(w1, w2, problem.topk, problem.dtype, batch_size,
                                                   block_shape=problem.block_shape, return_down_config=True)
    return dict(up), dict(down if down is not None else up)


def _served_configs_from_files(problem: MoEProblem, root: Path | None, batch_size: int) -> tuple[dict, dict]:
    ups = lookup(problem, root)
    up = nearest(ups, batch_size) if ups else default_config(problem, batch_size)
    downs = lookup(problem, root, down=True)
    down = dict(nearest(downs, batch_size)) if downs else dict(up)
    down["BLOCK_SIZE_M"] = up["BLOCK_SIZE_M"]
    return dict(up), down
