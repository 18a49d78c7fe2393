"""Compile the launchers' Triton kernels for a GPU this machine does not have (sm_90, sm_100, sm_120).

Test helper only (not part of the package). No sm_120 GPU is at hand, and an sm_120 config that
asks for more than the 99 KB of shared memory a block may use fails only at launch. Triton
compiles for any target without a GPU (its bundled ``ptxas`` included), so this runs each
config of the table the target's GPUs get (``family_of_capability``: B200's sm_100 takes the
H200's) through the real launcher (``launch._launch``) on CPU tensors with the kernels replaced
by recorders, then compiles every recorded launch (same arguments, same constexprs, same
``num_warps``/``num_stages``) for the target, and reports what ``ptxas`` allotted, with the PTX's
barriers, global loads by width and ``mma.sync`` instructions. The
converters' ``--device cuda`` kernels (``quantize_launch``) are recorded and compiled the same way.

Runs in its own process with ``TRITON_INTERPRET`` unset (the interpreter's kernels cannot be
compiled)::

    python tests/kernel_compile.py --arch sm_120     # one JSON object per compiled launch
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import subprocess
import sys
from pathlib import Path

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    raise SystemExit("kernel_compile.py compiles kernels: run it with TRITON_INTERPRET unset")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from dsv4convert.errors import DSV4Error  # noqa: E402
from dsv4convert.kernels import configs, launch, quantize_launch  # noqa: E402
from dsv4convert.kernels._runtime import family_of_capability  # noqa: E402
from dsv4convert.kernels.operands import quantized_weight  # noqa: E402
from dsv4convert.kernels.samples import random_activations, random_weight  # noqa: E402

CAPABILITY = {"sm_90": 90, "sm_100": 100, "sm_120": 120}
FORMATS = (("int4", 128), ("int4", 32), ("nvfp4", 16), ("mxfp4", 32), ("fp8", 128))
V4_BLOCK = (128, 128)   # DeepSeek-V4's FP8 block, the one the tables were measured on
KERNELS = ("act_quant_kernel", "fp8_block_gemm_kernel", "dequant_4bit_kernel", "dequant_fp8_kernel",
           "weight_only_gemm_kernel", "weight_only_halves_kernel", "weight_only_planes_kernel",
           "weight_only_gemv_kernel", "weight_only_mma_kernel")
CONVERTER_KERNELS = ("fp8_block_quant_kernel", "int4_quant_kernel", "mxfp4_to_nvfp4_kernel", "mxfp4_to_fp8_block_kernel")
TRITON_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.uint8: "u8",
                torch.int8: "i8", torch.int16: "i16", torch.int32: "i32", torch.int64: "i64",
                torch.float64: "fp64", torch.float8_e4m3fn: "fp8e4nv", torch.float8_e8m0fnu: "u8"}


class _Recorder:
    """Stands in for a kernel in ``launch``: ``kernel[grid](*args, **kwargs)`` is recorded, not run."""

    def __init__(self, kernel, calls: list):
        self.kernel, self.calls = kernel, calls

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((self.kernel, args, kwargs))


def _signature(kernel, args: tuple, kwargs: dict) -> tuple[dict, dict, dict]:
    """Triton's (signature, constexprs, attributes) for one launch, specialized as the JIT would."""
    bound = inspect.signature(kernel.fn).bind(*args, **kwargs)
    bound.apply_defaults()
    signature, constexprs, attributes = {}, {}, {}
    for index, (name, value) in enumerate(bound.arguments.items()):
        if kernel.params[index].is_constexpr or value is None:
            signature[name], constexprs[name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + TRITON_TYPES[value.dtype]
            attributes[(index,)] = [["tt.divisibility", 16]]
        elif hasattr(value, "block_shape"):  # a TensorDescriptor
            signature[name] = f"tensordesc<{TRITON_TYPES[value.base.dtype]}{list(value.block_shape)}>"
        elif isinstance(value, float):
            signature[name] = "fp32"
        elif isinstance(value, int) and value == 1:
            signature[name], constexprs[name] = "constexpr", 1  # the JIT specializes 1
        elif isinstance(value, int):
            signature[name] = "i32" if -2**31 <= value < 2**31 else "i64"
            if value % 16 == 0:
                attributes[(index,)] = [["tt.divisibility", 16]]
        else:
            raise TypeError(f"{kernel.fn.__name__}: argument {name} of type {type(value).__name__}")
    return signature, constexprs, attributes


def _resources(cubin: bytes) -> dict:
    """Registers and local (spill) bytes per thread, from the bundled ``cuobjdump``."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"kernel-compile-{os.getpid()}.cubin"
    path.write_bytes(cubin)
    try:
        usage = subprocess.run([str(tool), "-res-usage", str(path)], capture_output=True, text=True).stdout
    finally:
        path.unlink()
    found = re.search(r"REG:(\d+).*LOCAL:(\d+)", usage)
    return {"registers": int(found[1]), "local_bytes": int(found[2])} if found else {}


def _ptx_counts(ptx: str) -> dict:
    """Barriers, and global loads by width: a layout conversion through shared memory adds barriers,
    and a mask that varies along a vector splits its loads into 32-bit ones."""
    return {"barriers": len(re.findall(r"\bbar\.sync\b", ptx)),
            "global_loads_128": len(re.findall(r"\bld\.global(?:\.nc)?\.v4\.b32\b", ptx)),
            "global_loads_32": len(re.findall(r"\bld\.global(?:\.nc)?\.b32\b", ptx)),
            "mma_sync": len(re.findall(r"\bmma\.sync\b", ptx))}


def _record_launches(family: str) -> list[tuple[str, object, object, tuple, dict]]:
    """(format, config, kernel, args, kwargs) of every launch the tables of config ``family`` make."""
    calls: list = []
    for name in KERNELS:
        setattr(launch, name, _Recorder(getattr(launch, name), calls))
    for name in CONVERTER_KERNELS:
        setattr(quantize_launch, name, _Recorder(getattr(quantize_launch, name), calls))
    launch.arch_of = lambda device: family  # the launcher's own choices follow (TMA on sm_90, ...)
    launch.asm_decode_runs_on = lambda device: True  # it asks for a CUDA device too
    launch.interpreting = lambda: False
    launches = []
    generator = torch.Generator().manual_seed(0)
    for fmt, group in FORMATS:
        block = V4_BLOCK if fmt == "fp8" else None
        weight = quantized_weight(fmt, random_weight(fmt, 256, 1024, group_size=group, block=block, generator=generator),
                                  block=block)
        kind = "fp8" if fmt == "fp8" else "weight_only"
        tables = [cfg for _, cfg in configs.GEMM_TABLES[kind][family]] + [configs.SAFE_GEMM[kind]]
        for cfg in tables:
            x = random_activations(2 * cfg.block_m, weight.k, generator=generator)
            offsets = torch.tensor([0, x.shape[0]], dtype=torch.int32)
            first = len(calls)
            launch._launch(weight, x, offsets, x.shape[0], cfg)
            launches += [(fmt, cfg, *call) for call in calls[first:]]
        first = len(calls)
        launch.dequantize(weight, torch.bfloat16)
        launches += [(fmt, configs.dequant_config(family, fmt), *call) for call in calls[first:]]
    # The converters' --device cuda kernels (fixed launch settings, no table).
    dense = torch.randn(256, 1024, generator=generator).to(torch.bfloat16)
    packed, scale = random_weight("mxfp4", 256, 1024, generator=generator)
    for convert in (lambda: quantize_launch.quantize_fp8_block(dense, block=V4_BLOCK), lambda: quantize_launch.quantize_int4_weight(dense),
                    lambda: quantize_launch.quantize_int4_weight(dense, group_size=32),
                    lambda: quantize_launch.quantize_int4_weight(dense, scale_rule="amax"),
                    lambda: quantize_launch.mxfp4_to_nvfp4(packed, scale),
                    lambda: quantize_launch.mxfp4_to_fp8_block(packed, scale, block=V4_BLOCK)):
        first = len(calls)
        try:
            convert()
        except DSV4Error:
            pass  # its checks read outputs that the recorder never wrote; the launch is recorded
        launches += [("converter", "converter", *call) for call in calls[first:]]
    return launches


def compile_all(arch: str) -> list[dict]:
    """Compile every recorded launch for ``arch``; one row per launch."""
    rows = []
    target = GPUTarget("cuda", CAPABILITY[arch], 32)
    family = family_of_capability(CAPABILITY[arch] // 10)
    for fmt, cfg, kernel, args, kwargs in _record_launches(family):
        options = {key: kwargs.pop(key) for key in ("num_warps", "num_stages") if key in kwargs}
        signature, constexprs, attributes = _signature(kernel, args, kwargs)
        compiled = triton.compile(ASTSource(kernel, signature, constexprs, attributes), target=target,
                                  options=options)
        rows.append({"arch": arch, "family": family, "format": fmt, "config": repr(cfg), "kernel": kernel.fn.__name__,
                     "shared_bytes": compiled.metadata.shared, "shared_limit": configs.SHARED_MEMORY_LIMIT[family],
                     **options, **_resources(compiled.asm["cubin"]), **_ptx_counts(compiled.asm["ptx"])})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", choices=sorted(CAPABILITY), required=True)
    args = parser.parse_args()
    for row in compile_all(args.arch):
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
