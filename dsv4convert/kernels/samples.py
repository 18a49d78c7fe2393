"""Random quantized weights that reach every code and a realistic spread of scales.

Drawing the codes and scales directly (rather than quantizing a Gaussian) exercises every
nibble, negative zero, and mixed scale exponents in every tile, which is what a bit-exact
kernel check needs. Used by the config self-check, the tests and the benchmark.
"""

from __future__ import annotations

import torch

from dsv4convert.formats.fp8_block import Block, scale_grid


def _stack(shape: tuple[int, ...], experts: int | None) -> tuple[int, ...]:
    return shape if experts is None else (experts, *shape)


def random_weight(fmt: str, n: int, k: int, *, experts: int | None = None, group_size: int = 128,
                  block: Block | None = None, scale_fmt: str = "ue8m0", device: torch.device | str = "cpu",
                  generator: torch.Generator | None = None) -> tuple[torch.Tensor, ...]:
    """The tensors of ``fmt`` (as :func:`dsv4convert.kernels.operands.quantized_weight` takes them; ``fp8`` in
    ``block``, (rows, cols))."""
    def ints(low: int, high: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.randint(low, high, _stack(shape, experts), generator=generator, dtype=dtype).to(device)

    def uniform(shape: tuple[int, ...]) -> torch.Tensor:
        return torch.rand(_stack(shape, experts), generator=generator).to(device)

    if fmt == "fp8":
        codes = (torch.randn(_stack((n, k), experts), generator=generator) * 64).clamp(-448, 448)
        grid = scale_grid(n, k, block)
        if scale_fmt == "ue8m0":
            scale = ints(112, 128, grid, torch.uint8).view(torch.float8_e8m0fnu)
        else:
            scale = uniform(grid) * 1e-3 + 1e-5
        return codes.to(torch.float8_e4m3fn).to(device), scale
    if fmt == "mxfp4":
        return ints(-128, 128, (n, k // 2), torch.int8), ints(118, 128, (n, k // 32), torch.uint8).view(
            torch.float8_e8m0fnu)
    if fmt == "nvfp4":
        weight_scale = (uniform((n, k // 16)) * 400 + 0.01).to(torch.float8_e4m3fn)
        global_scale = uniform(()) * 1e-4 + 1e-5
        return ints(0, 256, (n, k // 2), torch.uint8), weight_scale, global_scale.float()
    if fmt == "int4":
        packed = ints(-(2**31), 2**31 - 1, (n, k // 8), torch.int64).to(torch.int32)
        scale = (uniform((n, k // group_size)) * 0.02 + 1e-4).to(torch.bfloat16)
        return packed, scale
    raise ValueError(f"unknown format {fmt!r}")


def random_activations(tokens: int, k: int, *, device: torch.device | str = "cpu",
                       generator: torch.Generator | None = None) -> torch.Tensor:
    """BF16 activations with a few large channels, as real hidden states have."""
    x = torch.randn(tokens, k, generator=generator)
    x[:, :: max(k // 8, 1)] *= 8
    return x.to(torch.bfloat16).to(device)
