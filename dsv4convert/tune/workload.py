"""One TP rank's MoE on the device, run through SGLang's own kernels the way its fused MoE runs them.

SGLang's ``_fused_moe_kernel_sequence`` (``srt/layers/moe/moe_runner/triton_utils/fused_moe.py``)
is: align the routed tokens per expert to ``BLOCK_SIZE_M``; the gate/up GEMM
(``invoke_fused_moe_kernel``, top-k rows per token); the clamped SiLU-and-multiply
(``act_and_mul_triton``, ``swiglu_limit``); the down GEMM, multiplying by the routing weights.
With a ``USE_TMA`` down config the first GEMM writes its rows in expert-sorted order, and the
down GEMM reads them, and the weights, through TMA descriptors. This module runs exactly those
launches with SGLang's launcher and a given pair of tile configs, on random weights of the
checkpoint's shapes and format (kernel speed does not depend on the values), so that
``search`` can check and time each GEMM alone and ``compare`` the whole sequence.

Two steps are ours: the alignment (SGLang's is a CUDA kernel from ``sglang-kernel``; this one
produces the same buffers in torch, outside the timed region) and the activations'
quantization, done with SGLang's Triton quantizer instead of its JIT CUDA one (also outside).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from dsv4convert.tune import sglang_moe
from dsv4convert.tune.device import Device
from dsv4convert.tune.problem import MoEProblem
from dsv4convert.tune.space import Tile

# Routings a timing cycles through: at small batches each activates other experts, so the weights
# come from memory as in a real forward (every layer has its own), not from L2.
ROUTINGS = 8
# Two configs differ only in the fp32 accumulation order before the BF16 output rounding (2^-8
# relative); a wrong tiling (a skipped block, another expert's rows) is off by O(1).
TOLERANCE = 2e-2
# The whole sequence also requantizes the activations to FP8 between the GEMMs: where the first GEMM's
# rounding differs, a value can land one FP8 step away.
SEQUENCE_TOLERANCE = 5e-2


@dataclass(frozen=True)
class Alignment:
    """SGLang's ``moe_align_block_size`` output for one routing and one ``BLOCK_SIZE_M``."""

    sorted_ids: torch.Tensor      # [capacity] int32: token-slot ids grouped by expert, padded with numel
    expert_ids: torch.Tensor      # [capacity / BLOCK_SIZE_M] int32: each row block's expert (-1 past the end)
    padded: torch.Tensor          # [1] int32: rows used, a multiple of BLOCK_SIZE_M


def align(topk_ids: torch.Tensor, block_m: int, experts: int) -> Alignment:
    """The routed token slots grouped by expert, each group padded to ``block_m`` rows.

    Buffer sizes follow SGLang's (they set the kernel's grid): ``numel * block_m`` rows for
    fewer slots than experts + 1, else ``numel + (experts + 1) * (block_m - 1)``, rounded up to 4.
    """
    flat = topk_ids.flatten().long()
    numel = flat.numel()
    capacity = numel * block_m if numel < experts + 1 else numel + (experts + 1) * (block_m - 1)
    capacity = (capacity + 3) // 4 * 4
    counts = torch.bincount(flat, minlength=experts)
    padded = (counts + block_m - 1) // block_m * block_m
    starts = torch.cumsum(padded, 0) - padded
    order = torch.sort(flat, stable=True).indices
    expert_of = flat[order]
    rank = torch.arange(numel, device=flat.device) - (torch.cumsum(counts, 0) - counts)[expert_of]
    sorted_ids = torch.full((capacity,), numel, dtype=torch.int32, device=flat.device)
    sorted_ids[starts[expert_of] + rank] = order.to(torch.int32)
    expert_ids = torch.full(((capacity + block_m - 1) // block_m,), -1, dtype=torch.int32, device=flat.device)
    blocks = torch.repeat_interleave(torch.arange(experts, device=flat.device), padded // block_m)
    expert_ids[: blocks.numel()] = blocks.to(torch.int32)
    return Alignment(sorted_ids, expert_ids, padded.sum().reshape(1).to(torch.int32))


@dataclass
class Weights:
    """Both projections of every local expert, in the layout SGLang's Triton MoE method keeps."""

    w13: torch.Tensor
    w2: torch.Tensor
    w13_scale: torch.Tensor | None
    w2_scale: torch.Tensor | None


def random_weights(problem: MoEProblem, device: str, seed: int) -> Weights:
    """Random experts of the problem's shapes and format (FP8 e4m3 + float32 scales per the problem's blocks;
    INT4 as uint8 pairs [E, N, K/2] + BF16 group scales, as ``CompressedTensorsWNA16TritonMoE``
    converts them; BF16), generated one expert at a time to bound the temporary memory."""
    gen = torch.Generator(device=device).manual_seed(seed)
    e, h, i = problem.experts, problem.hidden, problem.intermediate
    dtype = problem.dtype
    rows, cols = problem.fp8_block

    def matrix(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        out = []
        scales = []
        for _ in range(e):
            if dtype == "fp8_w8a8":
                out.append(torch.randn(n, k, generator=gen, device=device).to(torch.float8_e4m3fn))
                scales.append(torch.exp2(torch.randint(-9, -6, (n // rows, k // cols), generator=gen,
                                                       device=device).float()))
            elif dtype == "int4_w4a16":
                out.append(torch.randint(0, 256, (n, k // 2), generator=gen, device=device, dtype=torch.uint8))
                scales.append((torch.rand(n, k // problem.group_size, generator=gen, device=device) * 0.02
                               + 0.005).to(torch.bfloat16))
            else:
                out.append((torch.randn(n, k, generator=gen, device=device) * 0.05).to(torch.bfloat16))
        return torch.stack(out), (torch.stack(scales) if scales else None)

    w13, w13_scale = matrix(2 * i, h)
    w2, w2_scale = matrix(h, i)
    return Weights(w13, w2, w13_scale, w2_scale)


@dataclass
class Batch:
    """``batch_size`` tokens with ``ROUTINGS`` routings, and the buffers the kernels write."""

    problem: MoEProblem
    weights: Weights
    hidden: torch.Tensor
    routings: list[tuple[torch.Tensor, torch.Tensor]]   # (topk_ids int32, topk_weights float32) per routing
    a1: torch.Tensor                                    # the first GEMM's input (FP8-quantized for FP8)
    a1_scale: torch.Tensor | None
    _alignments: dict = field(default_factory=dict)
    _down_inputs: dict = field(default_factory=dict)
    _buffers: dict = field(default_factory=dict)

    @property
    def size(self) -> int:
        return self.hidden.shape[0]

    @property
    def rows(self) -> int:
        return self.size * self.problem.topk

    def alignment(self, routing: int, block_m: int) -> Alignment:
        key = (routing, block_m)
        if key not in self._alignments:
            self._alignments[key] = align(self.routings[routing][0], block_m, self.problem.experts)
        return self._alignments[key]

    def sorted_rows(self, block_m: int) -> int:
        """Rows of the expert-sorted intermediate a TMA down GEMM reads (SGLang's ``total_tokens``)."""
        return self.rows + min(self.rows, self.problem.experts + 1) * (block_m - 1)

    def up(self, tile: Tile, routing: int, out: torch.Tensor, *, c_sorted: bool = False) -> torch.Tensor:
        """The gate/up GEMM: ``out`` [rows (or sorted rows), 2I] in BF16."""
        p, w = self.problem, self.weights
        a = self.alignment(routing, tile.block_m)
        topk_ids, topk_weights = self.routings[routing]
        sglang_moe.kernels().invoke_fused_moe_kernel(
            self.a1, w.w13, None, out, self.a1_scale, w.w13_scale, None, topk_weights, topk_ids, a.sorted_ids,
            a.expert_ids, a.padded, False, p.topk, tile.kernel_config(), **_flags(p),
            c_sorted=c_sorted, b_use_tma=tile.use_tma, filter_expert=True)
        return out

    def token_order(self, sorted_out: torch.Tensor, block_m: int, routing: int) -> torch.Tensor:
        """Rows a gate/up GEMM wrote in expert-sorted order (``c_sorted``), back in token-slot order."""
        ids = self.alignment(routing, block_m).sorted_ids[: self.sorted_rows(block_m)].long()
        valid = ids < self.rows
        out = torch.empty(self.rows, sorted_out.shape[1], dtype=sorted_out.dtype, device=sorted_out.device)
        out[ids[valid]] = sorted_out[: ids.numel()][valid]
        return out

    def activate(self, gate_up: torch.Tensor, tile: Tile, routing: int, *, sorted_layout: bool) -> torch.Tensor:
        """SGLang's clamped SiLU-and-multiply of the gate/up rows (V4's ``swiglu_limit``)."""
        out = torch.empty(gate_up.shape[0], self.problem.intermediate, dtype=torch.bfloat16, device=gate_up.device)
        a = self.alignment(routing, tile.block_m)
        sglang_moe.kernels().act_and_mul_triton(gate_up, out, tile.kernel_config(), self.routings[routing][0],
                                                a.expert_ids, sorted_layout, "silu",
                                                swiglu_limit=self.problem.swiglu_limit)
        return out

    def quantize_down_input(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.problem.kernel.fp8_activations:
            return sglang_moe.quantize_fp8_groups(x, self.problem.fp8_block[1])
        return x, None

    def down_input(self, reference_up: Tile, routing: int, tile: Tile) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The down GEMM's input for ``tile``: the activated output of the reference gate/up GEMM, in
        token order, or in ``tile``'s expert-sorted order for a TMA tile (padding rows zero)."""
        key = (routing, tile.block_m if tile.use_tma else None)
        if key in self._down_inputs:
            return self._down_inputs[key]
        dense_key = (routing, None)
        if dense_key not in self._down_inputs:
            gate_up = self.up(reference_up, routing, torch.empty_like(self.up_output()))
            act = self.activate(gate_up, reference_up, routing, sorted_layout=False)
            self._down_inputs[dense_key] = self.quantize_down_input(act)
        if tile.use_tma:
            dense, dense_scale = self._down_inputs[dense_key]
            ids = self.alignment(routing, tile.block_m).sorted_ids[: self.sorted_rows(tile.block_m)].long()
            valid = ids < self.rows
            rows = torch.where(valid, ids, 0)
            gathered = dense[rows].view(torch.uint8) * valid[:, None].to(torch.uint8)
            scale = None if dense_scale is None else dense_scale[rows] * valid[:, None]
            self._down_inputs[key] = (gathered.view(dense.dtype).contiguous(), scale)
        return self._down_inputs[key]

    def down(self, tile: Tile, routing: int, a2: torch.Tensor, a2_scale: torch.Tensor | None,
             out: torch.Tensor) -> torch.Tensor:
        """The down GEMM, weighted by the routing: ``out`` [tokens, topk, H] in BF16."""
        p, w = self.problem, self.weights
        a = self.alignment(routing, tile.block_m)
        topk_ids, topk_weights = self.routings[routing]
        sglang_moe.kernels().invoke_fused_moe_kernel(
            a2, w.w2, None, out, a2_scale, w.w2_scale, None, topk_weights, topk_ids, a.sorted_ids, a.expert_ids,
            a.padded, True, 1, tile.kernel_config(), **_flags(p),
            a_use_tma=tile.use_tma, b_use_tma=tile.use_tma, filter_expert=True, router_topk=p.topk)
        return out

    def buffer(self, name: str, *shape: int) -> torch.Tensor:
        """A BF16 output buffer, allocated once (kernels overwrite it; a timed graph allocates nothing)."""
        key = (name, shape)
        if key not in self._buffers:
            self._buffers[key] = torch.empty(shape, dtype=torch.bfloat16, device=self.hidden.device)
        return self._buffers[key]

    def up_output(self, rows: int | None = None) -> torch.Tensor:
        return self.buffer("up", rows or self.rows, 2 * self.problem.intermediate)

    def down_output(self) -> torch.Tensor:
        return self.buffer("down", self.size, self.problem.topk, self.problem.hidden)

    def sequence(self, up: Tile, down: Tile, routing: int) -> torch.Tensor:
        """SGLang's whole kernel sequence for one routing with these two configs (as a server runs
        them; the down config's ``BLOCK_SIZE_M`` is the up config's, one alignment serves both)."""
        tma = down.use_tma
        gate_up = self.up_output(self.sorted_rows(up.block_m) if tma else None)
        self.up(up, routing, gate_up, c_sorted=tma)
        a2, a2_scale = self.quantize_down_input(self.activate(gate_up, up, routing, sorted_layout=tma))
        return self.down(down, routing, a2, a2_scale, self.down_output())


    def gemms(self, up: Tile, down: Tile, routing: int, reference_up: Tile) -> torch.Tensor:
        """The two GEMMs of ``sequence`` alone, the down one on the activated output of ``reference_up``
        (what ``compare`` times: the part of the sequence the configs choose)."""
        tma = down.use_tma
        self.up(up, routing, self.up_output(self.sorted_rows(up.block_m) if tma else None), c_sorted=tma)
        a2, a2_scale = self.down_input(reference_up, routing, down)
        return self.down(down, routing, a2, a2_scale, self.down_output())


def _flags(problem: MoEProblem) -> dict:
    import triton.language as tl

    return {"compute_type": tl.bfloat16, "use_fp8_w8a8": problem.dtype == "fp8_w8a8",
            "use_int8_w8a8": False, "use_int8_w8a16": False, "use_int4_w4a16": problem.dtype == "int4_w4a16",
            "per_channel_quant": False, "block_shape": problem.block_shape}


def make_batch(problem: MoEProblem, weights: Weights, batch_size: int, device: str, seed: int,
               routings: int = ROUTINGS) -> Batch:
    """Random tokens and ``routings`` routings of ``top-k`` distinct experts each (uniform, as a
    balanced router gives), with weights that sum to one per token."""
    gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + batch_size)
    hidden = torch.randn(batch_size, problem.hidden, generator=gen, device=device).to(torch.bfloat16)
    routed = []
    for _ in range(routings):
        ids = torch.rand(batch_size, problem.experts, generator=gen, device=device).topk(problem.topk).indices
        weights_ = torch.rand(batch_size, problem.topk, generator=gen, device=device) + 0.1
        routed.append((ids.to(torch.int32), weights_ / weights_.sum(-1, keepdim=True)))
    if problem.kernel.fp8_activations:
        a1, a1_scale = sglang_moe.quantize_fp8_groups(hidden, problem.fp8_block[1])
    else:
        a1, a1_scale = hidden, None
    return Batch(problem, weights, hidden, routed, a1, a1_scale)


def relative_error(out: torch.Tensor, reference: torch.Tensor) -> float:
    """Largest difference, as a fraction of the reference's largest magnitude."""
    out, reference = out.float(), reference.float()
    scale = reference.abs().max().item()
    return (out - reference).abs().max().item() / (scale if scale > 0 else 1.0)


@functools.cache
def _timer():
    import triton.testing

    return triton.testing.do_bench_cudagraph


def time_us(run, device: Device, rep_ms: int, calls: int) -> float:
    """Median microseconds of one of the ``calls`` launches ``run`` makes: Triton's CUDA-graph
    benchmark on a GPU (no launch overhead), one wall-clock pass in the interpreter (meaningless
    there; tests never compare it)."""
    if not device.timed:
        import time

        start = time.perf_counter()
        run()
        return (time.perf_counter() - start) * 1e6 / calls
    return _timer()(run, rep=rep_ms, return_mode="median") * 1e3 / calls
