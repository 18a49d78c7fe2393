"""Per-layer error of a converted checkpoint against its source.

Every linear module present in both checkpoints is dequantized on both sides and
compared (relative Frobenius error, SNR, cosine, max abs error, bit-exactness), and the
converted weight is also run through the fused dequant-GEMM kernel on probe activations,
against an FP32 matmul with the source weight: the math a server runs. Modules that
share a shape and formats (the routed experts of one layer and projection) are stacked
and go through one grouped launch per chunk, so a layer costs a handful of launches.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import asdict, dataclass
from typing import Callable, Iterator

import torch

from dsv4convert import kernels
from dsv4convert.checkpoint import Checkpoint
from dsv4convert.formats import Format, error_metrics, linear_storage, spec
from dsv4convert.inspection import Inspection
from dsv4convert.models.deepseek_v4.layout import linear_shapes
from dsv4convert.models.deepseek_v4.layout import Role, classify, try_classify


@dataclass
class ModuleError:
    module: str
    role: str
    block: str | None
    source_format: str
    format: str
    exact: bool
    rel_fro: float
    snr_db: float
    cosine: float
    max_abs: float
    output_snr_db: float

    def as_dict(self) -> dict:
        d = asdict(self)
        for key in ("snr_db", "output_snr_db"):
            if math.isinf(d[key]):
                d[key] = "inf"
        return d


def probe_activations(experts: int, tokens: int, k: int, *, seed: int, device: torch.device) -> torch.Tensor:
    """Synthetic BF16 activations [E, M, K]: Gaussian with a few outlier channels, as LLM inputs have."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(experts, tokens, k, generator=g)
    outliers = torch.randperm(k, generator=g)[: max(1, k // 64)]
    x[..., outliers] *= 8.0
    return x.to(device=device, dtype=torch.bfloat16)


class _ByModule:
    """A checkpoint's linear tensors read by the release's ``module.param`` names, whatever name an engine reads
    them under in this checkpoint (a DSpark Markov head made for vLLM: engines/vllm/quant_config.py::MARKOV_NAMES)."""

    def __init__(self, ckpt: Checkpoint):
        self.ckpt = ckpt
        self.names = {f"{i.module}.{i.param}": name for name in ckpt.tensors
                      if (i := try_classify(name)) is not None and f"{i.module}.{i.param}" != name}

    def __contains__(self, name: str) -> bool:
        return self.names.get(name, name) in self.ckpt.tensors

    def entry(self, name: str):
        return self.ckpt.entry(self.names.get(name, name))

    def read(self, name: str) -> torch.Tensor:
        return self.ckpt.read(self.names.get(name, name))


def _stack(ckpt: _ByModule, modules: list[str], suffixes: tuple[str, ...], device) -> tuple[torch.Tensor, ...]:
    return tuple(torch.stack([ckpt.read(f"{m}.{s}") for m in modules]).to(device) for s in suffixes)


def _dense(ckpt: _ByModule, fmt: Format, params: dict, modules: list[str], device, backend) -> torch.Tensor:
    """Float32 [E, N, K] weights of ``modules`` stored as ``fmt`` with ``params`` (an FP8 module's block),
    dequantized in one launch (the kernels take every format with kernel operands; a dense one is read as it is)."""
    operands = spec(fmt).kernel_params
    if not operands:
        return torch.stack([ckpt.read(f"{m}.weight") for m in modules]).to(device).float()
    return kernels.dequantize(fmt.value, *_stack(ckpt, modules, operands, device), block=params.get("fp8_block"),
                              out_dtype=torch.float32, backend=backend, name=modules[0]).float()


def _outputs(ckpt: _ByModule, fmt: Format, params: dict, modules: list[str], x: torch.Tensor, device,
             backend) -> torch.Tensor:
    operands = spec(fmt).kernel_params
    if not operands:
        w = torch.stack([ckpt.read(f"{m}.weight") for m in modules]).to(device)
        return torch.bmm(x, w.transpose(1, 2)).float()
    return kernels.grouped_gemm(fmt.value, x, *_stack(ckpt, modules, operands, device), block=params.get("fp8_block"),
                                backend=backend, name=modules[0]).float()


def _same_bytes(a: _ByModule, b: _ByModule, module: str, fmt: Format, shape: tuple[int, int], params: dict) -> bool:
    for p in linear_storage(fmt, *shape, **params):
        name = f"{module}.{p.suffix}"
        if name in a and a.entry(name).dtype != b.entry(name).dtype:
            return False
        if name in a and not torch.equal(a.read(name).reshape(-1).view(torch.uint8),
                                                 b.read(name).reshape(-1).view(torch.uint8)):
            return False
    return True


def module_groups(dst: Inspection, src: Inspection) -> Iterator[tuple[tuple, list[str]]]:
    """Modules to compare, grouped so that each group is one stacked launch."""
    groups: dict[tuple, list[str]] = defaultdict(list)
    for module, out in dst.modules.items():
        ref = src.modules.get(module)
        if ref is None or out.format is None or ref.format is None:
            continue
        info = classify(f"{module}.weight")
        key = (info.block, info.role, info.proj, ref.format, out.format,
               tuple(sorted(out.params.items())))
        if info.role is not Role.ROUTED_EXPERT:
            key += (module,)
        groups[key].append(module)
    yield from groups.items()


def layer_errors(dst: Checkpoint, src: Checkpoint, dst_info: Inspection, src_info: Inspection, *,
                 shapes: dict[str, tuple[int, int]] | None = None, device: str = "cpu", backend: kernels.Backend = "auto",
                 tokens: int = 8, chunk_bytes: int = 1 << 30,
                 progress: Callable[[int], None] | None = None) -> list[ModuleError]:
    """Errors of every linear module of ``dst`` against ``src`` (see the module docstring).

    ``backend="auto"`` means the Triton kernels on a GPU and their torch references on the CPU
    (Triton's CPU interpreter is a test harness, far too slow for a whole checkpoint). ``shapes``: every linear's
    logical shape (default: the layout's, from ``dst_info``'s config).
    """
    shapes = shapes if shapes is not None else linear_shapes(dst_info.config)
    dev = torch.device(device)
    dst, src = _ByModule(dst), _ByModule(src)
    if backend == "auto" and dev.type != "cuda":
        backend = "torch"
    results: list[ModuleError] = []
    for key, modules in module_groups(dst_info, src_info):
        block, role, _proj, src_fmt, dst_fmt = key[:5]
        n, k = shapes[modules[0]]
        per_module = n * k * 4 * 3
        step = max(1, chunk_bytes // per_module)
        for start in range(0, len(modules), step):
            chunk = modules[start : start + step]
            params = (src_info.modules[chunk[0]].params, dst_info.modules[chunk[0]].params)
            if src_fmt is dst_fmt and all(_same_bytes(src, dst, m, dst_fmt, (n, k), params[1]) for m in chunk):
                results += [ModuleError(m, role.value, block, src_fmt.value, dst_fmt.value, True, 0.0, math.inf,
                                        1.0, 0.0, math.inf) for m in chunk]
            else:
                results += _compare_chunk(dst, src, chunk, role, block, (src_fmt, dst_fmt), params, dev, backend,
                                          tokens, k)
            if progress:
                progress(len(chunk))
    return results


def _compare_chunk(dst, src, chunk, role, block, fmts, params, dev, backend, tokens, k) -> list[ModuleError]:
    (src_fmt, dst_fmt), (src_params, dst_params) = fmts, params
    reference = _dense(src, src_fmt, src_params, chunk, dev, backend)
    converted = _dense(dst, dst_fmt, dst_params, chunk, dev, backend)
    x = probe_activations(len(chunk), tokens, k, seed=len(chunk) * 7919 + k, device=dev)
    y_ref = torch.bmm(x.float(), reference.transpose(1, 2))
    y = _outputs(dst, dst_fmt, dst_params, chunk, x, dev, backend)
    out = []
    for i, module in enumerate(chunk):
        m = error_metrics(reference[i], converted[i], name=module)
        o = error_metrics(y_ref[i], y[i], name=module)
        exact = bool(torch.equal(reference[i], converted[i]))
        out.append(ModuleError(module, role.value, block, src_fmt.value, dst_fmt.value, exact, m.rel_fro, m.snr_db,
                               m.cosine, m.max_abs, o.snr_db))
    return out
