"""Tile configurations per architecture, and a once-per-process check of each one.

A small hand-made table, not an autotuner: each entry was picked for the DeepSeek-V4-Flash
shapes (expert 2048x4096 / 4096x2048, wq_b 32768x1024, 8192x8192) and a batch size bucket.
Triton has miscompiled plausible configs before (an MXFP4 split-K kernel with
``num_stages=3`` returned wrong sums on sm_90), so :func:`verified` runs every config once
against the torch reference before it is trusted, and callers fall back to the safe config
when a check fails.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass

# Shared memory a block may use, in bytes (sm_120 allows 99 KB per block; Hopper ~227 KB).
SHARED_MEMORY_LIMIT = {"sm_90": 227 * 1024, "sm_120": 99 * 1024, "fallback": 99 * 1024, "interpreter": 1 << 30}


# Weight-only variants: "tile" decodes a [BLOCK_N, BLOCK_K] tile in K order (interleaving the two
# nibbles of each byte) in FP32 for one dot; "halves" keeps even and odd K as two half tiles decoded
# with BF16 pair arithmetic, splits the activations instead, and puts the weights on the dot's left
# (wgmma at M <= 16). An earlier even/odd variant gathered one scale per byte and read the
# activations with stride 2, and was 3-6x slower; with broadcast scales "halves" is 1.3-2.2x faster
# than "tile" at M <= 16 on the H200 (bench/results/kernels-sweep-h200.json). Split-K in the table
# is a maximum: launch.py halves it while the grid already fills the GPU. On sm_90 and sm_120
# "halves" decodes four code bytes per inline-PTX block (launch.asm_decode_runs_on): on the H200
# 15-20% faster for E2M1 on the large matrices, within 5% for INT4 and on one expert. The sm_120
# entry is sized by calculation (no such GPU here): ~80 KB estimated, 34 KB as compiled, of 99 KB.
# On sm_90, what the GEMVs below do not serve at M <= 16 (a launch of 2^25 weights or more at 9-16
# tokens, K not a multiple of 128) runs "planes" (triton_kernels.weight_only_planes_kernel: whole int32 code words
# decoded per nibble plane, one dot per K tile, split-K reduced inside the launch); 128x256 tiles
# with 8 warps were the best single choice over the four shapes in bench/gemv_sweep.py on the
# H200 (on 8192^2 INT4 a 64x512 tile with 4 warps was 16% slower at M=1 and 42% slower at M=16,
# where every tile re-reads the activations; 256-wide tiles and 4 stages were no better). Its 128
# registers per thread are the limit for two 8-warp programs per SM: an E2M1 decode that needed
# 142 was 25% slower. sm_120 keeps "halves": planes is untested there.
# On sm_90, M = 1 runs "gemv" (triton_gemv.weight_only_gemv_kernel: CUDA cores, whole rows per
# program, each code word's scaled dot product in one inline-PTX block): 8 rows x 1024 K, 4 warps
# was the best single tile over the four shapes in bench/gemv_sweep.py on the H200 (16 x 1024 was
# 0-6% faster on 8192^2, 1-19% slower on one expert; bench/results/gemv-h200-cudacore.md);
# launch.py gives rows of fewer than two K tiles (wq_b, K=1024) 32 x 256 tiles. At M = 4 an
# earlier GEMV measured 1.3-3x slower than planes (every decoded weight is multiplied four times on
# CUDA cores), so M >= 2 stays on tensor cores.
# On sm_90, 2 <= M <= 16 runs "mma" (triton_gemv.weight_only_mma_kernel: each warp streams 16 rows
# of W as the A operand of mma.sync, 8 or 16 tokens as B, fed lane by lane: no tiles, no shared
# memory in the loop); launch._fit_mma sizes its K shares and rows per program to the launch, and
# the code words are loaded two chunks ahead (num_stages). On the H200 (bench/results/mma-rows-h200.md,
# side by side with the earlier kernel, whose warps took 8 rows of W as B and the tokens as A): at
# M = 4-8 1.06-1.41x faster than planes on 8192^2 and wq_b; over 64 stacked experts at 8 tokens
# each 1.19-1.22x for E2M1, 0.93x for INT4; on one expert 0.90-1.01x the earlier kernel, which it
# replaces. At M = 16 it serves launches under 2^25 weights (one expert: 1.04-1.21x planes);
# bigger ones run planes (the prototype was 0.56-1.02x planes there, 0.62-0.85x over 64 experts).

@dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    group_m: int = 1  # row tiles that share a column sweep (L2 reuse of the weights at large M)
    variant: str = "tile"  # weight-only: "tile" (interleaved K), "halves" (even/odd K, swapped dot), "planes", "gemv", "mma"

    def shared_memory_bytes(self, weight_bits: int, activation_bytes: int = 2) -> int:
        """Pipelined operand buffers plus one staging tile for the dequantized weights.

        An estimate of what Triton allocates: ``num_stages`` copies of the activation tile and the
        packed weight tile, and one BF16 (or FP8) weight tile after in-register dequantization.
        """
        per_stage = self.block_m * self.block_k * activation_bytes + self.block_n * self.block_k * weight_bits // 8
        staged_weight = self.block_n * self.block_k * activation_bytes
        return self.num_stages * per_stage + staged_weight


@dataclass(frozen=True)
class ElementwiseConfig:
    block_rows: int
    block_cols: int
    num_warps: int = 4


# (largest tokens-per-expert this entry serves, config); the last entry catches everything bigger.
GemmTable = tuple[tuple[int, GemmConfig], ...]

_WEIGHT_ONLY: dict[str, GemmTable] = {
    "sm_90": (
        (1, GemmConfig(1, 8, 1024, split_k=1, num_warps=4, num_stages=1, variant="gemv")),
        (8, GemmConfig(8, 16, 128, split_k=1, num_warps=8, num_stages=2, variant="mma")),
        (16, GemmConfig(16, 16, 128, split_k=1, num_warps=8, num_stages=2, variant="mma")),
        (16, GemmConfig(16, 128, 256, split_k=8, num_warps=8, num_stages=3, variant="planes")),
        (64, GemmConfig(64, 64, 128, split_k=2, num_warps=4, num_stages=4)),
        (1 << 62, GemmConfig(128, 128, 64, split_k=1, num_warps=8, num_stages=4)),
    ),
    "sm_120": (
        (16, GemmConfig(16, 64, 256, split_k=4, num_warps=4, num_stages=3, variant="halves")),
        (64, GemmConfig(64, 64, 64, split_k=1, num_warps=4, num_stages=3)),
        (1 << 62, GemmConfig(128, 64, 64, split_k=1, num_warps=8, num_stages=3)),
    ),
    "fallback": ((1 << 62, GemmConfig(32, 64, 64, split_k=1, num_warps=4, num_stages=2)),),
    "interpreter": ((1 << 62, GemmConfig(16, 32, 64, split_k=1, num_warps=4, num_stages=1)),),
}

# FP8 block, M > 64 on sm_90 (H200, M=4096; a first one-off sweep of 20 variants, then
# bench/kernels.py --sweep, _sweep_fp8): the
# exact two-level accumulation (every 128-wide K slice's dot scaled into an FP32 accumulator, as
# DeepSeek's kernels and SGLang's run it) is best as "tma": TMA operand loads, 64x128 tiles,
# 4 warps, 3 stages (three CTAs per SM), measured 64-76% of row-wise torch._scaled_mm including
# the activation quantization; the earlier 64x128 pointer-load kernel 50-54%. FAST_ACCUM_FP8
# below ("tma_rescale": the accumulator rescaled between K blocks and fed to the dot, so the sum
# runs in the tensor core's reduced-precision FP8 accumulation, like use_fast_accum=True) measured
# 70-75% then (69-76% since the default's group_m=64: no longer faster), and its error grows with K
# (1.7e-3 -> 2.6e-3 at K=8192), so it is benchmarked, never the default: the validator must run
# the numerics a server runs. M <= 16 (bench/kernels.py _sweep_fp8_small,
# H200): the 16x64 tile left one expert's 2048 rows 32 programs; 16x32 tiles split 4 ways over K (halved
# by launch._fit_split_k where the grid fills the GPU) took expert_w1_w3 M=4/16 from 18.0/18.4 to
# 11.0/11.3 us and expert_w2 from 11.3/11.4 to 11.2/10.6 us.
# M > 64, the order of the programs (session 5, H200, M=4096): sweeping all 64 row tiles of one
# 128-column strip before the next (group_m=64: consecutive programs share one strip of weights)
# instead of 8 row tiles at a time took square_8192 from 69% to 78% of row-wise _scaled_mm,
# expert_w2 70% -> 76%, wq_b 76% -> 84%, expert_w1_w3 66% -> 70% (its 1024 tiles are 2.6 waves
# of 3 CTAs x 132 SMs; bench/results/kernels-h200.json, sweep). Wider or taller tiles (64x256,
# 128x128 with 8 warps, 128x64) were slower at every shape. Session 9 rounded the outputs in
# hardware (1.01-1.08x at M=4096, bench/results/fp8-epilogue-h200.md; now 68-98%) and swept the
# tiles again: 64x256 (4 or 8 warps), 128x128 and 128x256 (8 warps) were 0.47-0.89x this one.
_FP8_GEMM: dict[str, GemmTable] = {
    "sm_90": (
        (16, GemmConfig(16, 32, 128, split_k=4, num_warps=4, num_stages=4)),
        (64, GemmConfig(64, 64, 128, split_k=1, num_warps=4, num_stages=4)),
        (1 << 62, GemmConfig(64, 128, 128, split_k=1, num_warps=4, num_stages=3, group_m=64, variant="tma")),
    ),
    "sm_120": (
        (64, GemmConfig(32, 64, 128, split_k=1, num_warps=4, num_stages=3)),
        (1 << 62, GemmConfig(128, 64, 128, split_k=1, num_warps=8, num_stages=3)),
    ),
    "fallback": ((1 << 62, GemmConfig(32, 64, 128, split_k=1, num_warps=4, num_stages=2)),),
    "interpreter": ((1 << 62, GemmConfig(16, 32, 128, split_k=1, num_warps=4, num_stages=1)),),
}

# sm_90, M > 64, E8M0 weight scales only: faster, less exact (see above); bench/kernels.py times it.
FAST_ACCUM_FP8 = GemmConfig(128, 128, 128, split_k=1, num_warps=8, num_stages=3, group_m=16,
                                  variant="tma_rescale")

# Safe configs: no split-K, shallow pipelines, small tiles that fit every architecture.
SAFE_WEIGHT_ONLY = GemmConfig(32, 64, 64, split_k=1, num_warps=4, num_stages=2)
SAFE_FP8 = GemmConfig(32, 64, 128, split_k=1, num_warps=4, num_stages=2)

# Dequantization tiles (rows x columns per program), per format family. FP8: bench/kernels.py
# --sweep on the H200, nine tiles within 3% of each other on average (16 x 256: 85%, and the
# best worst case, 78%). 4-bit: the same sweep (session 5) put 2 x 1024
# with 2 warps first on average over 15 cases (expert, wq_b, 8192^2, and 256 stacked experts): 80%
# of copy bandwidth against 74% for the old 16 x 256; the stacked experts went from 79% to 89%
# (mxfp4), 76% to 88% (nvfp4), 79% to 89% (int4). sm_120 and the fallback take 4 x
# 1024 with 4 warps (second on the H200, 128-thread programs), unmeasured there.
_DEQUANT_TILES = {
    "fp8": {
        "sm_90": ElementwiseConfig(16, 256, num_warps=4),
        "sm_120": ElementwiseConfig(32, 256, num_warps=8),
        "fallback": ElementwiseConfig(16, 256, num_warps=4),
        "interpreter": ElementwiseConfig(16, 64, num_warps=4),
    },
    "4bit": {
        "sm_90": ElementwiseConfig(2, 1024, num_warps=2),
        "sm_120": ElementwiseConfig(4, 1024, num_warps=4),
        "fallback": ElementwiseConfig(4, 1024, num_warps=4),
        "interpreter": ElementwiseConfig(16, 64, num_warps=4),
    },
}

GEMM_TABLES: dict[str, dict[str, GemmTable]] = {"weight_only": _WEIGHT_ONLY, "fp8": _FP8_GEMM}
SAFE_GEMM: dict[str, GemmConfig] = {"weight_only": SAFE_WEIGHT_ONLY, "fp8": SAFE_FP8}


def gemm_config(kind: str, arch: str, tokens_per_expert: int) -> GemmConfig:
    """The table entry for ``kind`` (``weight_only`` or ``fp8``) at this batch size."""
    for max_tokens, config in GEMM_TABLES[kind][arch]:
        if tokens_per_expert <= max_tokens:
            return config
    raise AssertionError("every table ends with a catch-all entry")


def next_gemm_config(kind: str, arch: str, config: GemmConfig) -> GemmConfig:
    """The entry after ``config`` in its table: what a problem the entry does not serve runs instead."""
    table = [entry for _, entry in GEMM_TABLES[kind][arch]]
    return table[table.index(config) + 1]


def dequant_config(arch: str, fmt: str) -> ElementwiseConfig:
    """The dequantization tile for ``fmt`` (``fp8`` or a 4-bit format) on ``arch``."""
    return _DEQUANT_TILES["fp8" if fmt == "fp8" else "4bit"][arch]


_verdicts: dict[Hashable, bool] = {}
_verdict_lock = threading.Lock()


def verified(key: Hashable, check: Callable[[], bool]) -> bool:
    """Run ``check`` the first time ``key`` is seen in this process and remember its verdict."""
    with _verdict_lock:
        if key not in _verdicts:
            _verdicts[key] = bool(check())
        return _verdicts[key]


def verdicts() -> dict[Hashable, bool]:
    """A copy of every verdict so far (the benchmark records them)."""
    with _verdict_lock:
        return dict(_verdicts)
