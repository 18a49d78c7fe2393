"""Triton kernels against their torch references.

Without a GPU the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``, set here
before the kernels are first imported) on small shapes; with a GPU the same tests run compiled.
Dequantization and quantization must match bit for bit; GEMMs to BF16 rounding (formats.md §7).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from dsv4convert import kernels  # noqa: E402
from dsv4convert.errors import DSV4Error, FormatError  # noqa: E402
from dsv4convert.kernels import configs, launch, reference  # noqa: E402
from dsv4convert.kernels.operands import quantized_weight  # noqa: E402
from dsv4convert.kernels.samples import random_activations, random_weight  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
GEMM_TOLERANCE = 3e-3
V4_BLOCK = (128, 128)    # DeepSeek-V4's FP8 block; V4.1's is 32x32 (test_fp8_blocks_*)

# (format, group size, scale format): every weight encoding the kernels read.
WEIGHT_CASES = [
    ("fp8", 128, "ue8m0"),
    ("fp8", 128, "float32"),
    ("mxfp4", 32, "ue8m0"),
    ("nvfp4", 16, "ue8m0"),
    ("int4", 128, "ue8m0"),
    ("int4", 32, "ue8m0"),
]
CASE_IDS = [f"{f}-g{g}-{s}" for f, g, s in WEIGHT_CASES]


def _block(fmt: str, block: tuple[int, int] = V4_BLOCK) -> tuple[int, int] | None:
    return block if fmt == "fp8" else None


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _weight(fmt: str, group: int, scale_fmt: str, n: int, k: int, *, experts: int | None = None, seed: int = 0,
            block: tuple[int, int] = V4_BLOCK):
    return random_weight(fmt, n, k, experts=experts, group_size=group, block=_block(fmt, block), scale_fmt=scale_fmt,
                         device=DEVICE, generator=_generator(seed))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.uint8)


def _relative_error(reference_out: torch.Tensor, out: torch.Tensor) -> float:
    return launch.relative_error(reference_out, out)


def test_kernels_run_here():
    assert kernels.kernels_available(DEVICE)


@pytest.mark.parametrize("fmt,group,scale_fmt", WEIGHT_CASES, ids=CASE_IDS)
def test_dequantize_matches_formats_bit_for_bit(fmt, group, scale_fmt):
    # 200 rows: ragged against every row tile and against FP8's 128-row blocks.
    tensors = _weight(fmt, group, scale_fmt, 200, 384)
    for out_dtype in (torch.bfloat16, torch.float32):
        got = kernels.dequantize(fmt, *tensors, block=_block(fmt), out_dtype=out_dtype, backend="triton")
        want = kernels.dequantize(fmt, *tensors, block=_block(fmt), out_dtype=out_dtype, backend="torch")
        assert got.dtype == out_dtype and got.shape == (200, 384)
        assert torch.equal(_bits(got), _bits(want))


@pytest.mark.parametrize("fmt,group,scale_fmt", WEIGHT_CASES[::2] + [WEIGHT_CASES[3]], ids=CASE_IDS[::2] + [CASE_IDS[3]])
def test_dequantize_stack_of_experts_in_one_launch(fmt, group, scale_fmt):
    tensors = _weight(fmt, group, scale_fmt, 72, 256, experts=3, seed=1)
    got = kernels.dequantize(fmt, *tensors, block=_block(fmt), backend="triton")
    want = kernels.dequantize(fmt, *tensors, block=_block(fmt), backend="torch")
    assert got.shape == (3, 72, 256)
    assert torch.equal(_bits(got), _bits(want))


def test_nvfp4_global_scale_is_applied_per_expert():
    weight, weight_scale, _ = _weight("nvfp4", 16, "ue8m0", 32, 64, experts=2)
    global_scale = torch.tensor([1.0, 0.5], device=DEVICE)
    got = kernels.dequantize("nvfp4", weight, weight_scale, global_scale, out_dtype=torch.float32, backend="triton")
    assert torch.equal(got[1], kernels.dequantize("nvfp4", weight[1], weight_scale[1], global_scale[1],
                                                  out_dtype=torch.float32, backend="triton"))
    assert torch.equal(got[0] * 0.5, kernels.dequantize("nvfp4", weight[0], weight_scale[0], global_scale[1],
                                                        out_dtype=torch.float32, backend="triton"))


def test_activation_quantization_matches_reference_bit_for_bit():
    x = random_activations(37, 320, device=DEVICE, generator=_generator(2))  # ragged last group
    x[3] = 0  # all-zero token: eps floor
    for pow2 in (True, False):
        q, scale = kernels.quantize_activations_fp8(x, group=128, pow2_scale=pow2, backend="triton")
        q_ref, scale_ref = reference.quantize_activations_fp8(x, group=128, pow2_scale=pow2)
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
        assert torch.equal(scale, scale_ref)
        assert scale.shape == (37, 3)
        assert bool((torch.frexp(scale)[0] == 0.5).all()) == pow2


# DeepSeek-V4.1's 32x32 blocks beside V4's 128x128: the kernels take the block as a constexpr, so each runs
# against the formats-module reference with both (small shapes, ragged against either block).
FP8_BLOCKS = [(32, 32), (128, 128)]


@pytest.mark.parametrize("block", FP8_BLOCKS, ids=lambda b: f"{b[0]}x{b[1]}")
def test_fp8_blocks_dequantize_bit_for_bit(block):
    for experts, n in ((None, 200), (3, 96)):   # 96 rows: whole 32-blocks, ragged 128-blocks (one launch per expert)
        tensors = _weight("fp8", 128, "ue8m0", n, 384, experts=experts, seed=40, block=block)
        assert tensors[1].shape[-2:] == (-(-n // block[0]), 384 // block[1])
        got = kernels.dequantize("fp8", *tensors, block=block, out_dtype=torch.float32, backend="triton")
        want = kernels.dequantize("fp8", *tensors, block=block, out_dtype=torch.float32, backend="torch")
        assert torch.equal(got, want)


@pytest.mark.parametrize("block", FP8_BLOCKS, ids=lambda b: f"{b[0]}x{b[1]}")
def test_fp8_blocks_activation_groups_are_the_block_columns(block):
    x = random_activations(9, 320, device=DEVICE, generator=_generator(41))   # ragged last group for both
    q, scale = kernels.quantize_activations_fp8(x, group=block[1], backend="triton")
    q_ref, scale_ref = reference.quantize_activations_fp8(x, group=block[1])
    assert scale.shape == (9, -(-320 // block[1]))
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(scale, scale_ref)


@pytest.mark.parametrize("block", FP8_BLOCKS, ids=lambda b: f"{b[0]}x{b[1]}")
@pytest.mark.parametrize("cfg", [configs.GemmConfig(16, 32, 128, split_k=2, num_warps=4, num_stages=1),
                                 configs.GemmConfig(16, 64, 128, num_warps=4, num_stages=1, group_m=2)],
                         ids=["split-k", "grouped-order"])
def test_fp8_blocks_grouped_gemm_matches_reference(block, cfg):
    tensors = _weight("fp8", 128, "ue8m0", 96, 320, experts=2, seed=42, block=block)
    weight = quantized_weight("fp8", tensors, block=block)
    x = random_activations(13, 320, device=DEVICE, generator=_generator(43))
    offsets = torch.tensor([0, 11, 13], dtype=torch.int32, device=DEVICE)
    y = launch.grouped_gemm(weight, x, offsets, cfg=cfg)
    assert _relative_error(reference.grouped_gemm(weight, x, offsets), y) < GEMM_TOLERANCE


def test_fp8_tile_keeps_within_one_row_of_weight_blocks():
    one = quantized_weight("fp8", _weight("fp8", 128, "ue8m0", 64, 64, block=(32, 32)), block=(32, 32))
    v4 = quantized_weight("fp8", _weight("fp8", 128, "ue8m0", 256, 128), block=V4_BLOCK)
    wide = configs.GemmConfig(16, 256, 128)
    assert launch._fp8_tile(wide, v4) == (128, 2)          # two 128-row halves, as before
    assert launch._fp8_tile(wide, one) == (32, 1)          # narrowed to one 32-row block
    assert launch._fp8_tile(dataclasses.replace(wide, block_n=64), one) == (32, 2)


def test_e4m3_rounding_ties_carries_and_subnormals():
    # With amax 448 the power-of-two scale is 1, so each code is e4m3(x) itself.
    values = torch.tensor([7.9375, 25.0, 27.0, -34.0, 0.01171875, 2.0**-10, 3 * 2.0**-10, -2.0**-11,
                           -0.0, 1.0625, 232.0, 440.0, 2.0**-6 - 2.0**-12, 0.3, -5.5e-3, 447.0])
    x = torch.zeros(2, 128)
    x[:, 0] = 448.0
    x[0, 1:1 + values.numel()] = values
    x[1, 1:] = torch.randn(127, generator=_generator(3)) * 30
    x = x.to(torch.float32).to(DEVICE)
    q, scale = kernels.quantize_activations_fp8(x.to(torch.bfloat16).float().bfloat16(), group=128, backend="triton")
    assert torch.equal(scale, torch.ones_like(scale))
    want = x.to(torch.bfloat16).float().to(torch.float8_e4m3fn)
    assert torch.equal(q.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("fmt,group,scale_fmt", WEIGHT_CASES, ids=CASE_IDS)
def test_gemm_matches_fp32_reference(fmt, group, scale_fmt):
    tensors = _weight(fmt, group, scale_fmt, 96, 512, seed=4)
    x = random_activations(5, 512, device=DEVICE, generator=_generator(5))
    y = kernels.gemm(fmt, x, *tensors, block=_block(fmt), backend="triton")
    weight = quantized_weight(fmt, tensors, block=_block(fmt))
    want = reference.grouped_gemm(weight, x, torch.tensor([0, 5], device=DEVICE))
    assert y.dtype == torch.bfloat16 and y.shape == (5, 96)
    assert _relative_error(want, y) < GEMM_TOLERANCE


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4", "nvfp4", "int4"])
def test_grouped_gemm_token_ranges_and_probe_batch(fmt):
    tensors = _weight(fmt, 128, "ue8m0", 64, 256, experts=4, seed=6)
    weight = quantized_weight(fmt, tensors, block=_block(fmt))
    offsets = torch.tensor([0, 3, 3, 20, 21], device=DEVICE)  # expert 1 gets no tokens
    x = random_activations(21, 256, device=DEVICE, generator=_generator(7))
    y = kernels.grouped_gemm(fmt, x, *tensors, block=_block(fmt), expert_offsets=offsets, backend="triton")
    assert _relative_error(reference.grouped_gemm(weight, x, offsets), y) < GEMM_TOLERANCE

    probe = random_activations(4 * 6, 256, device=DEVICE, generator=_generator(8)).reshape(4, 6, 256)
    y_probe = kernels.grouped_gemm(fmt, probe, *tensors, block=_block(fmt), backend="triton")
    assert y_probe.shape == (4, 6, 64)
    probe_offsets = torch.arange(5, device=DEVICE) * 6
    want = reference.grouped_gemm(weight, probe.reshape(24, 256), probe_offsets).reshape(4, 6, 64)
    for expert in range(4):
        assert _relative_error(want[expert], y_probe[expert]) < GEMM_TOLERANCE


@pytest.mark.parametrize("fmt", ["mxfp4", "fp8"])
def test_split_k_config_sums_every_slice(fmt):
    tensors = _weight(fmt, 32, "ue8m0", 64, 512, experts=2, seed=9)
    weight = quantized_weight(fmt, tensors, block=_block(fmt))
    x = random_activations(19, 512, device=DEVICE, generator=_generator(10))
    offsets = torch.tensor([0, 17, 19], dtype=torch.int32, device=DEVICE)
    cfg = configs.GemmConfig(16, 32, 128, split_k=3, num_warps=4, num_stages=1)
    y = launch.grouped_gemm(weight, x, offsets, cfg=cfg)
    assert _relative_error(reference.grouped_gemm(weight, x, offsets), y) < GEMM_TOLERANCE


# Per kernel: its tile (width, K) and (K, split-K, variant) cases. K=384 leaves the last split past K
# (masked path); for planes K=512 takes pre-permuted activations and split-K meets in the launch;
# the GEMV owns whole rows (no split-K), K=384 ends in half a 256-wide tile.
SPLIT_K_CASES = {
    "tile": (32, 128, ((512, 2, "tile"), (384, 2, "tile"), (384, 1, "tile"))),
    "halves": (64, 128, ((512, 2, "halves"), (384, 2, "halves"), (384, 1, "halves"))),
    "planes": (64, 128, ((512, 2, "planes_xperm"), (384, 2, "planes"), (256, 1, "planes"))),
    "gemv": (32, 256, ((512, 1, "gemv"), (384, 1, "gemv"))),
    # two row groups of 16 x two K shares of 128-wide chunks (4 warps), 16 tokens (two B operands):
    # K=512 two chunks per share, K=256 one
    "mma": (32, 128, ((512, 1, "mma"), (256, 1, "mma"))),
}


@pytest.mark.parametrize("kernel", list(SPLIT_K_CASES))
@pytest.mark.parametrize("fmt,group", [("int4", 128), ("int4", 32), ("nvfp4", 16), ("mxfp4", 32)])
def test_weight_only_split_k_ragged_experts_match_reference(fmt, group, kernel):
    # Two experts with ragged token counts, split-K, N not a multiple of the tile.
    block_n, block_k, cases = SPLIT_K_CASES[kernel]
    for k, split_k, variant in cases:
        weight = quantized_weight(fmt, _weight(fmt, group, "ue8m0", 80, k, experts=2, seed=12), block=_block(fmt))
        x = random_activations(21, k, device=DEVICE, generator=_generator(13))
        offsets = torch.tensor([0, 17, 21], dtype=torch.int32, device=DEVICE)
        block_m = 1 if kernel == "gemv" else 16  # the GEMV runs one token per program
        cfg = configs.GemmConfig(block_m, block_n, block_k, split_k=split_k, num_warps=4, num_stages=1, variant=variant)
        y = launch.grouped_gemm(weight, x, offsets, cfg=cfg)
        assert _relative_error(reference.grouped_gemm(weight, x, offsets), y) < GEMM_TOLERANCE, (k, split_k)
        if kernel == "planes" and split_k > 1:  # tickets handed back at zero; the sum order is fixed
            assert not bool(launch._tickets(y.device, 1).any())
            assert torch.equal(y.view(torch.int16), launch.grouped_gemm(weight, x, offsets, cfg=cfg).view(torch.int16))


@pytest.mark.parametrize("cfg", [
    configs.GemmConfig(16, 64, 256, split_k=1, num_warps=4, num_stages=3, variant="halves"),
    configs.GemmConfig(16, 128, 256, split_k=1, num_warps=8, num_stages=3, variant="planes"),
    configs.GemmConfig(16, 128, 256, split_k=2, num_warps=8, num_stages=3, variant="planes_xperm"),
    configs.GemmConfig(1, 16, 1024, split_k=1, num_warps=4, num_stages=1, variant="gemv"),
    configs.GemmConfig(8, 16, 128, split_k=1, num_warps=8, num_stages=2, variant="mma"),
    configs.GemmConfig(16, 32, 128, split_k=1, num_warps=4, num_stages=1, variant="mma"),
], ids=lambda cfg: f"{cfg.variant}-m{cfg.block_m}")
@pytest.mark.parametrize("fmt,group", [("int4", 128), ("int4", 32), ("nvfp4", 16), ("mxfp4", 32)])
def test_asm_decode_matches_the_triton_decode(fmt, group, cfg, monkeypatch):
    # Both round (code * scale) to BF16 once; NVFP4's 2^118 / 2^8 split of the scale is exact. The GEMV's
    # per-word sums are the same FP32 operations both ways, but Triton lays the two paths' registers out
    # differently, so its final cross-thread sum may add them in another order: one BF16 step at most.
    if not launch.asm_decode_runs_on(torch.device(DEVICE)):
        pytest.skip("the inline-PTX decode runs compiled on sm_90 / sm_120 only")
    weight = quantized_weight(fmt, _weight(fmt, group, "ue8m0", 256, 2048, experts=2, seed=22), block=_block(fmt))
    x = random_activations(20, 2048, device=DEVICE, generator=_generator(23))
    offsets = torch.tensor([0, 16, 20], dtype=torch.int32, device=DEVICE)
    with_asm = launch.grouped_gemm(weight, x, offsets, cfg=cfg).view(torch.int16)
    monkeypatch.setattr(launch, "asm_decode_runs_on", lambda device: False)
    portable = launch.grouped_gemm(weight, x, offsets, cfg=cfg).view(torch.int16)
    if cfg.variant in ("gemv", "mma"):
        steps = (with_asm.int() - portable.int()).abs()
        assert int(steps.max()) <= 1 and float((steps > 0).float().mean()) < 0.05
    else:
        assert torch.equal(with_asm, portable)


@pytest.mark.parametrize("cfg", [configs.GemmConfig(1, 16, 256, num_warps=4, num_stages=1, variant="gemv"),
                                 configs.GemmConfig(8, 16, 128, num_warps=8, num_stages=2, variant="mma")],
                         ids=lambda cfg: cfg.variant)
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.float32])
def test_gemvs_read_int4_scales_of_every_float_dtype(scale_dtype, cfg):
    # compressed-tensors may store INT4 scales as FP16 or FP32: both GEMVs' PTX loads each dtype itself.
    packed, scale = _weight("int4", 32, "ue8m0", 40, 1024, seed=24)
    weight = quantized_weight("int4", (packed, scale.to(scale_dtype)))
    x = random_activations(3, 1024, device=DEVICE, generator=_generator(25))
    offsets = torch.tensor([0, 3], dtype=torch.int32, device=DEVICE)
    y = launch.grouped_gemm(weight, x, offsets, cfg=cfg)
    assert _relative_error(reference.grouped_gemm(weight, x, offsets), y) < GEMM_TOLERANCE


def test_gemv_takes_activations_at_any_address():
    # A row slice of a bigger buffer may start 2 bytes past a 16-byte boundary; the GEMV's PTX loads
    # each word's activations as one 16-byte vector, so the launcher hands it an aligned copy.
    weight = quantized_weight("nvfp4", _weight("nvfp4", 16, "ue8m0", 48, 512, seed=26))
    storage = random_activations(1, 3 * 512 + 1, device=DEVICE, generator=_generator(27)).flatten()
    x = storage[1:].view(3, 512)
    assert x.data_ptr() % 16 != 0
    offsets = torch.tensor([0, 3], dtype=torch.int32, device=DEVICE)
    cfg = configs.GemmConfig(1, 16, 256, num_warps=4, num_stages=1, variant="gemv")
    y = launch.grouped_gemm(weight, x, offsets, cfg=cfg)
    assert _relative_error(reference.grouped_gemm(weight, x, offsets), y) < GEMM_TOLERANCE


def test_mma_takes_tokens_in_eights_and_refuses_what_it_cannot_tile():
    # BLOCK_M = 8 fills one B operand (tokens 0-7 of a tile); 11 tokens need a second token tile.
    weight = quantized_weight("nvfp4", _weight("nvfp4", 16, "ue8m0", 40, 1024, experts=2, seed=28))
    x = random_activations(14, 1024, device=DEVICE, generator=_generator(29))
    offsets = torch.tensor([0, 11, 14], dtype=torch.int32, device=DEVICE)
    cfg = configs.GemmConfig(8, 16, 128, num_warps=8, num_stages=2, variant="mma")
    y = launch.grouped_gemm(weight, x, offsets, cfg=cfg)
    assert _relative_error(reference.grouped_gemm(weight, x, offsets), y) < GEMM_TOLERANCE
    # eight K shares of 128-wide chunks do not divide K=512: an error, not a partial sum
    short = quantized_weight("nvfp4", _weight("nvfp4", 16, "ue8m0", 40, 512, seed=30))
    with pytest.raises(DSV4Error, match="multiple of 1024"):
        launch.grouped_gemm(short, x[:, :512], offsets[:2], cfg=cfg)


def test_both_gemvs_pick_their_ptx_by_format_and_scale_dtype():
    from dsv4convert.kernels.triton_gemv import _GEMV_WORD_DOT_VARIANTS, word_dot_variant

    assert _GEMV_WORD_DOT_VARIANTS[word_dot_variant("int4", "bfloat16")] == ("int4", "bf16")
    assert _GEMV_WORD_DOT_VARIANTS[word_dot_variant("int4", "float32")] == ("int4", "f32")
    assert _GEMV_WORD_DOT_VARIANTS[word_dot_variant("nvfp4", "float8_e4m3fn")] == ("nvfp4", "e4m3")
    assert _GEMV_WORD_DOT_VARIANTS[word_dot_variant("mxfp4", "uint8")] == ("mxfp4", "e8m0")
    with pytest.raises(KeyError):  # no PTX loads FP64 scales
        word_dot_variant("int4", "float64")


def test_mma_fits_its_k_shares_and_rows_or_hands_over_to_the_next_entry():
    cfg = configs.GemmConfig(8, 16, 128, num_warps=8, num_stages=2, variant="mma")
    fit = lambda n, k, experts=1, tile=cfg: launch._fit_mma(  # noqa: E731
        tile, quantized_weight("int4", _weight("int4", 128, "ue8m0", n, k, experts=experts)))
    # one expert, K=4096: 32 chunks in 8 shares of 16 rows (8 warps, 1024 in the launch)
    assert fit(2048, 4096) == cfg
    # K=2048: 16 chunks, at least four per share; programs keep 4 warps
    assert fit(4096, 2048) == dataclasses.replace(cfg, num_warps=4)
    # K=1024 over 2048 row groups (wq_b): 2 shares would make 4096 warps, so 32 rows x 2 shares
    assert fit(32768, 1024) == dataclasses.replace(cfg, block_n=32, num_warps=4)
    # K=384: three chunks, so one share: 4 row groups of 16 per program
    assert fit(64, 384) == dataclasses.replace(cfg, block_n=64, num_warps=4)
    # stacked experts: 2048 row groups take 2 shares (32 rows per program), 4096 take one (64 rows)
    assert fit(512, 2048, experts=64) == dataclasses.replace(cfg, block_n=32, num_warps=4)
    assert fit(1024, 1024, experts=64) == dataclasses.replace(cfg, block_n=64, num_warps=4)
    # K not a multiple of 128: not served
    assert launch._fit_mma(cfg, quantized_weight("int4", _weight("int4", 32, "ue8m0", 64, 160))) is None
    # 16 tokens per tile: one expert is served, a launch of 2^25 weights runs the planes kernel
    wide = dataclasses.replace(cfg, block_m=16)
    assert fit(2048, 4096, tile=wide) == wide
    assert fit(8192, 4096, tile=wide) is None
    assert fit(8192, 4096) is not None
    table = [entry for _, entry in configs.GEMM_TABLES["weight_only"]["sm_90"]]
    mma = [entry for entry in table if entry.variant == "mma"]
    assert [entry.block_m for entry in mma] == [8, 16]
    assert configs.gemm_config("weight_only", "sm_90", 16) == mma[1]
    assert configs.next_gemm_config("weight_only", "sm_90", mma[0]) == mma[1]
    assert configs.next_gemm_config("weight_only", "sm_90", mma[1]).variant == "planes"


def test_split_k_is_reduced_when_the_grid_fills_the_gpu():
    if DEVICE != "cuda":
        pytest.skip("split-K fitting counts the GPU's SMs")
    cfg = configs.GemmConfig(16, 64, 256, split_k=4, variant="halves")
    one = quantized_weight("int4", _weight("int4", 128, "ue8m0", 2048, 4096))
    many = quantized_weight("int4", _weight("int4", 128, "ue8m0", 1024, 256, experts=64))  # 1024 tiles
    assert launch._fit_split_k(cfg, one, 1).split_k == 4
    assert launch._fit_split_k(cfg, many, 16).split_k == 1
    # planes: at most 2 programs per SM and two K tiles per slice; activations permuted for big matrices
    planes = configs.GemmConfig(16, 128, 256, split_k=8, num_warps=8, variant="planes")
    assert launch._fit_split_k(planes, one, 1) == dataclasses.replace(planes, split_k=8)
    assert launch._fit_split_k(planes, many, 16).split_k == 1
    big = quantized_weight("int4", _weight("int4", 128, "ue8m0", 8192, 4096))
    assert launch._fit_split_k(planes, big, 1).variant == "planes"
    assert launch._fit_split_k(planes, big, 16).variant == "planes_xperm"
    # gemv: 8 x 1024 tiles, and 32 x 256 for rows of fewer than two 1024-wide K tiles
    gemv = configs.GemmConfig(1, 8, 1024, num_warps=4, num_stages=1, variant="gemv")
    assert launch._fit_split_k(gemv, big, 1) == gemv
    assert launch._fit_split_k(gemv, one, 1) == gemv
    short = quantized_weight("int4", _weight("int4", 128, "ue8m0", 4096, 1024))
    assert launch._fit_split_k(gemv, short, 1) == dataclasses.replace(gemv, block_n=32, block_k=256)
    # FP8 block: narrow split tiles for one expert; twice as wide, unsplit, where those fill the GPU
    fp8 = configs.GemmConfig(16, 32, 128, split_k=4, num_stages=4)
    expert = quantized_weight("fp8", _weight("fp8", 128, "ue8m0", 2048, 4096), block=V4_BLOCK)
    assert launch._fit_split_k(fp8, expert, 4) == fp8
    wide = quantized_weight("fp8", _weight("fp8", 128, "ue8m0", 32768, 1024), block=V4_BLOCK)
    assert launch._fit_split_k(fp8, wide, 4) == dataclasses.replace(fp8, block_n=64, split_k=1)


def test_fp8_block_gemm_with_grouped_tile_order():
    tensors = _weight("fp8", 128, "ue8m0", 160, 256, seed=14)
    weight = quantized_weight("fp8", tensors, block=V4_BLOCK)
    x = random_activations(70, 256, device=DEVICE, generator=_generator(15))
    offsets = torch.tensor([0, 70], dtype=torch.int32, device=DEVICE)
    cfg = configs.GemmConfig(16, 32, 128, num_warps=4, num_stages=1, group_m=3)  # 5 row tiles: a ragged group
    y = launch.grouped_gemm(weight, x, offsets, cfg=cfg)
    assert _relative_error(reference.grouped_gemm(weight, x, offsets), y) < GEMM_TOLERANCE


def test_fp8_block_gemm_256_wide_tiles_ragged_n_and_k():
    # Two experts, N = 384 (the second tile's upper half lies past N), K = 320 (a partial K block).
    tensors = _weight("fp8", 128, "float32", 384, 320, experts=2, seed=16)
    weight = quantized_weight("fp8", tensors, block=V4_BLOCK)
    x = random_activations(37, 320, device=DEVICE, generator=_generator(17))
    offsets = torch.tensor([0, 21, 37], dtype=torch.int32, device=DEVICE)
    for cfg in (configs.GemmConfig(16, 256, 128, num_warps=4, num_stages=1, group_m=2),
                configs.GemmConfig(16, 256, 128, split_k=2, num_warps=4, num_stages=1)):
        y = launch.grouped_gemm(weight, x, offsets, cfg=cfg)
        assert _relative_error(reference.grouped_gemm(weight, x, offsets), y) < GEMM_TOLERANCE, cfg


class _IntegerRounding:
    """Launches ``kernel`` as the launcher does, but with the integer BF16 rounding (HW_ROUND=False)."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.kernel[grid](*args, **{**kwargs, "HW_ROUND": False})


def test_fp8_block_gemm_hardware_rounding_is_the_integer_rounding(monkeypatch):
    # Compiled, the FP8 GEMM rounds its outputs with the hardware conversion; it must give the same
    # bits as the integer round-to-nearest-even the interpreter runs (a truncating conversion would
    # differ in about half the outputs). The table's config at M > 64, two ragged experts.
    if launch.interpreting():
        pytest.skip("the hardware rounding runs compiled only (the interpreter's conversion truncates)")
    weight = quantized_weight("fp8", _weight("fp8", 128, "ue8m0", 384, 512, experts=2, seed=24), block=V4_BLOCK)
    x = random_activations(200, 512, device=DEVICE, generator=_generator(25))
    offsets = torch.tensor([0, 130, 200], dtype=torch.int32, device=DEVICE)
    hardware = launch.grouped_gemm(weight, x, offsets)
    monkeypatch.setattr(launch, "fp8_block_gemm_kernel", _IntegerRounding(launch.fp8_block_gemm_kernel))
    integer = launch.grouped_gemm(weight, x, offsets)
    assert torch.equal(_bits(hardware), _bits(integer))
    assert _relative_error(reference.grouped_gemm(weight, x, offsets), hardware) < GEMM_TOLERANCE


@pytest.mark.parametrize("scale_fmt", ["ue8m0", "float32"])
def test_fp8_block_gemm_rescaled_accumulator(scale_fmt):
    # variant "rescale": with E8M0 weight scales the accumulator is rescaled between K blocks and fed
    # to the dot; float32 scales keep the scale-after-dot path. Ragged experts, K blocks and split-K.
    tensors = _weight("fp8", 128, scale_fmt, 160, 640, experts=2, seed=18)
    if scale_fmt == "ue8m0":
        tensors[1].view(torch.uint8)[0, 0, 2] = 0  # 2^-127: clamped for the ratios, must not overflow
    weight = quantized_weight("fp8", tensors, block=V4_BLOCK)
    x = random_activations(50, 640, device=DEVICE, generator=_generator(19))
    x[7] *= 1000.0  # one token's scales far from the others'
    offsets = torch.tensor([0, 30, 50], dtype=torch.int32, device=DEVICE)
    for split_k in (1, 2):
        cfg = configs.GemmConfig(16, 32, 128, split_k=split_k, num_warps=4, num_stages=1, variant="rescale")
        y = launch.grouped_gemm(weight, x, offsets, cfg=cfg)
        assert _relative_error(reference.grouped_gemm(weight, x, offsets), y) < GEMM_TOLERANCE, cfg


def test_table_configs_pass_their_check_on_this_device():
    arch = launch.arch_of(torch.device(DEVICE))
    for kind, table in configs.GEMM_TABLES.items():
        for _, cfg in table[arch]:
            fmt = "fp8" if kind == "fp8" else "mxfp4"
            for block in (FP8_BLOCKS if fmt == "fp8" else [None]):
                assert launch._config_passes(fmt, 32, block, cfg, torch.device(DEVICE)), (kind, cfg, block)


def test_failing_config_falls_back_to_safe_config(monkeypatch):
    tensors = _weight("int4", 128, "ue8m0", 32, 256, seed=11)
    weight = quantized_weight("int4", tensors)
    checked = []

    def reject_all_but_safe(fmt, group, block, cfg, device):
        checked.append(cfg)
        return cfg == configs.SAFE_WEIGHT_ONLY

    monkeypatch.setattr(launch, "_config_passes", reject_all_but_safe)
    monkeypatch.setattr(configs, "_verdicts", {})
    assert launch.checked_config(weight, 4) == configs.SAFE_WEIGHT_ONLY
    assert launch.checked_config(weight, 4) == configs.SAFE_WEIGHT_ONLY
    assert len(checked) == 2  # each verdict is computed once and cached
    monkeypatch.setattr(launch, "_config_passes", lambda *args: False)
    monkeypatch.setattr(configs, "_verdicts", {})
    with pytest.raises(DSV4Error, match="passed its check"):
        launch.checked_config(weight, 4)


def test_sm120_configs_fit_its_shared_memory():
    limit = configs.SHARED_MEMORY_LIMIT["sm_120"]
    for kind, table in configs.GEMM_TABLES.items():
        for _, cfg in table["sm_120"]:
            bits, act_bytes = (8, 1) if kind == "fp8" else (4, 2)
            assert cfg.shared_memory_bytes(bits, act_bytes) <= limit, (kind, cfg)
        assert table["sm_120"][-1][0] >= 1 << 40  # a catch-all entry ends every table
    assert configs.gemm_config("weight_only", "sm_90", 1).split_k >= 1


def test_bad_inputs_are_refused():
    packed, scale = _weight("mxfp4", 32, "ue8m0", 32, 128)
    with pytest.raises(FormatError, match="scale shape"):
        kernels.dequantize("mxfp4", packed, scale[:, :-1])
    with pytest.raises(FormatError, match="unknown weight format"):
        kernels.dequantize("fp6", packed, scale)
    with pytest.raises(FormatError, match="float8_e4m3fn"):
        kernels.dequantize("fp8", packed, scale, block=V4_BLOCK)
    fp8 = _weight("fp8", 128, "ue8m0", 64, 64)
    with pytest.raises(FormatError, match="needs the block"):
        kernels.dequantize("fp8", *fp8)
    with pytest.raises(FormatError, match="32x32 blocks"):
        kernels.dequantize("fp8", *fp8, block=(32, 32))
    with pytest.raises(FormatError, match="applies to fp8"):
        kernels.dequantize("mxfp4", packed, scale, block=V4_BLOCK)
    with pytest.raises(FormatError, match="channels"):
        kernels.gemm("mxfp4", torch.zeros(2, 64, dtype=torch.bfloat16, device=DEVICE), packed, scale)
    stacked = _weight("mxfp4", 32, "ue8m0", 32, 128, experts=2)
    x = torch.zeros(4, 128, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(FormatError, match="grouped_gemm"):
        kernels.gemm("mxfp4", x, *stacked)
    with pytest.raises(FormatError, match="expert_offsets"):
        kernels.grouped_gemm("mxfp4", x, *stacked, expert_offsets=torch.tensor([0, 3, 2]))
    with pytest.raises(FormatError, match="probe batch"):
        kernels.grouped_gemm("mxfp4", x, *stacked)
    with pytest.raises(ValueError, match="backend"):
        kernels.dequantize("mxfp4", packed, scale, backend="cuda")


def test_package_falls_back_to_torch_without_triton():
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "from dsv4convert import kernels\n"
        "from dsv4convert.kernels._runtime import triton_installed\n"
        "triton_installed.cache_clear()\n"
        "import importlib.util\n"
        "assert not kernels.kernels_available('cpu')\n"
        "codes = torch.tensor([[0x21, 0xF8]], dtype=torch.uint8)\n"
        "scale = torch.tensor([[128]], dtype=torch.uint8)\n"
        "w = kernels.dequantize('mxfp4', torch.cat([codes] * 8, 1), scale, out_dtype=torch.float32)\n"
        "assert w[0, :4].tolist() == [1.0, 2.0, -0.0, -12.0], w[0, :4]\n"
        "try:\n"
        "    kernels.dequantize('mxfp4', torch.cat([codes] * 8, 1), scale, backend='triton')\n"
        "except Exception as e:\n"
        "    assert 'not installed' in str(e), e\n"
        "else:\n"
        "    raise AssertionError('backend=triton must fail without triton')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr
