"""The tile configurations worth timing for a problem on a GPU.

Two rounds, so that a short time budget still covers the usual winners: first the tile shapes
(``BLOCK_SIZE_M/N/K``, warps, pipeline stages), most plausible first; then, around each batch
size's best shapes, the launch order (``GROUP_SIZE_M``), TMA and deeper pipelines (at decode
batch sizes the GEMMs stream expert weights from memory, and the winners of the first round sit at
its deepest pipeline: more loads in flight per SM). The grid is sized by the GPU:
a tile whose pipeline buffers alone exceed the block's shared memory (99 KB on sm_120, 227 KB on
Hopper) is left out before it is compiled, and one Triton still finds too large is skipped when
it is launched (``search``).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace
from typing import Any

from dsv4convert.tune.device import Device
from dsv4convert.tune.problem import MoEProblem

# Triton's launch defaults, which apply where a SGLang config leaves warps or stages out.
TRITON_DEFAULT_WARPS = 4
TRITON_DEFAULT_STAGES = 3
GROUP_SIZES = (1, 16, 32, 64)
GRID_STAGES = (3, 4, 2, 5)
DEEPER_STAGES = 3      # the second round's extra pipeline depths past a best shape's
MAX_STAGES = 8


@dataclass(frozen=True, order=True)
class Tile:
    """One SGLang fused-MoE kernel config (a value of the JSON files' batch-size map)."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int | None = None
    num_stages: int | None = None
    use_tma: bool = False

    @classmethod
    def from_sglang(cls, config: dict[str, Any]) -> Tile:
        return cls(config["BLOCK_SIZE_M"], config["BLOCK_SIZE_N"], config["BLOCK_SIZE_K"], config["GROUP_SIZE_M"],
                   config.get("num_warps"), config.get("num_stages"), bool(config.get("USE_TMA", False)))

    def to_sglang(self) -> dict[str, Any]:
        """The JSON entry SGLang reads (``USE_TMA`` only where set, as SGLang's tuner writes it)."""
        out: dict[str, Any] = {"BLOCK_SIZE_M": self.block_m, "BLOCK_SIZE_N": self.block_n,
                               "BLOCK_SIZE_K": self.block_k, "GROUP_SIZE_M": self.group_m}
        if self.num_warps is not None:
            out["num_warps"] = self.num_warps
        if self.num_stages is not None:
            out["num_stages"] = self.num_stages
        if self.use_tma:
            out["USE_TMA"] = True
        return out

    def kernel_config(self) -> dict[str, Any]:
        """What SGLang passes to the kernel launch: the entry without ``USE_TMA`` (it pops it)."""
        out = self.to_sglang()
        out.pop("USE_TMA", None)
        return out

    def label(self) -> str:
        warps = self.num_warps or TRITON_DEFAULT_WARPS
        stages = self.num_stages or TRITON_DEFAULT_STAGES
        return (f"{self.block_m}x{self.block_n}x{self.block_k} g{self.group_m} w{warps} s{stages}"
                + (" tma" if self.use_tma else ""))


def shared_memory_floor(tile: Tile, problem: MoEProblem) -> int:
    """Bytes of shared memory the tile's pipeline needs at least: ``stages - 1`` buffers of the A and B
    tiles (what Triton 3.8 allocates on sm_120; Hopper's wgmma path takes a full ``stages``)."""
    a_bytes, b_bytes = problem.kernel.activation_bytes, problem.weight_bytes
    stages = tile.num_stages or TRITON_DEFAULT_STAGES
    return int((stages - 1) * (tile.block_m * tile.block_k * a_bytes + tile.block_k * tile.block_n * b_bytes))


def fits(tile: Tile, problem: MoEProblem, device: Device) -> bool:
    return shared_memory_floor(tile, problem) <= device.shared_memory


def _block_ks(problem: MoEProblem) -> tuple[int, ...]:
    """The kernel's BLOCK_SIZE_K values; for FP8 those that divide the block's columns (its scales step once per
    BLOCK_SIZE_K), else the columns alone."""
    if not problem.kernel.fp8_activations:
        return problem.kernel.block_k
    cols = problem.fp8_block[1]
    return tuple(k for k in problem.kernel.block_k if cols % k == 0) or (cols,)


def shape_grid(problem: MoEProblem, device: Device) -> tuple[list[Tile], int]:
    """First round: the tile shapes (``GROUP_SIZE_M`` 1, no TMA) that fit, most plausible first,
    and how many were left out for shared memory."""
    grid = []
    for bm, bn, bk, warps, stages in itertools.product((16, 32, 64, 128), (64, 128, 32, 256), _block_ks(problem),
                                                       (4, 8), GRID_STAGES):
        if warps == 8 and bm * bn < 64 * 64:
            continue  # eight warps on a tile this small leave most threads one or two values
        grid.append(Tile(bm, bn, bk, 1, warps, stages))
    fitting = [t for t in grid if fits(t, problem, device)]
    preferred_k = _block_ks(problem)[0]

    def plausibility(t: Tile) -> tuple:
        return (abs(math.log2(t.block_n / 64)) + abs(t.num_stages - 3) + (t.num_warps != 4) + (t.block_k != preferred_k),
                t.block_m, t.block_n, t.block_k, t.num_warps, t.num_stages)

    return sorted(fitting, key=plausibility), len(grid) - len(fitting)


def refinements(tile: Tile, problem: MoEProblem, device: Device, *, tma: bool) -> list[Tile]:
    """Second round around one good shape: the other launch orders, TMA where this GPU and SGLang's
    kernel support it (FP8 only: the down projection's TMA path reads FP8 activations), and up to
    ``DEEPER_STAGES`` deeper pipelines (those that fit the GPU's shared memory)."""
    orders = [replace(tile, group_m=g) for g in GROUP_SIZES]
    stages = tile.num_stages or TRITON_DEFAULT_STAGES
    deeper = [replace(tile, num_stages=s) for s in range(stages + 1, min(stages + DEEPER_STAGES, MAX_STAGES) + 1)]
    variants = orders + deeper
    if tma and device.has_tma and problem.kernel.fp8_activations:
        # TMA of the shape itself first: it changes more than the launch order does.
        variants = [replace(tile, use_tma=True)] + [v for pair in zip(variants, (replace(v, use_tma=True)
                                                                               for v in variants)) for v in pair]
    unique = list(dict.fromkeys(variants))
    return [v for v in unique if v != tile and fits(v, problem, device)]


def worth_timing(tile: Tile, problem: MoEProblem, batch_size: int) -> bool:
    """Skip row tiles far taller than the tokens one expert gets at this batch size (on average
    ``batch * topk / E``): their extra rows are padding SGLang's alignment adds and masks."""
    per_expert = max(1.0, batch_size * problem.topk / problem.experts)
    return tile.block_m <= max(16, 4 * 2 ** math.ceil(math.log2(per_expert)))
