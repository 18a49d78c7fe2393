"""GPU quantize/transcode kernels against the CPU formats functions, bit for bit.

The converters' ``--device cuda`` path must write the very bytes the CPU path writes, and
report the same exactness. Without a GPU the kernels run under Triton's interpreter
(``TRITON_INTERPRET=1``, set before the kernels are first imported); with one, compiled.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from dsv4convert import formats, kernels  # noqa: E402
from dsv4convert.errors import FormatError  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
V4_BLOCK = (128, 128)
# DeepSeek-V4.1's 32x32 FP8 blocks beside V4's: the kernels take the block as a constexpr.
FP8_BLOCKS = pytest.mark.parametrize("block", [(32, 32), V4_BLOCK], ids=["32x32", "128x128"])


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _awkward_weight(n: int, k: int, seed: int) -> torch.Tensor:
    """Gaussian weights plus the cases rounding gets wrong: zero, tiny, power-of-two and huge blocks."""
    w = torch.randn(n, k, generator=_generator(seed)) * 0.02
    w[:16, :128] = 0.0                      # an all-zero block / group
    w[16:32, :128] *= 1e-36                 # scales near float32's subnormal range
    w[32, 5] = 448.0 * 2.0**-8              # amax exactly 448 * 2^k: the scale must not round up
    w[40:48, 128:] *= 3e4                   # large values next to small ones
    w[50, 7] = -0.0
    return w.to(DEVICE)


@FP8_BLOCKS
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("scale_fmt", ["ue8m0", "float32"])
def test_fp8_block_quantize_matches_formats(dtype, scale_fmt, block):
    w = _awkward_weight(200, 336, seed=1).to(dtype)  # ragged against 32x32 and 128x128 blocks both ways
    got_weight, got_scale = kernels.quantize("fp8", w, block=block, scale_fmt=scale_fmt, backend="triton")
    want_weight, want_scale = formats.quantize_fp8_block(w, block=block, scale_fmt=scale_fmt)
    assert got_weight.dtype == torch.float8_e4m3fn and got_scale.dtype == want_scale.dtype
    assert got_weight.shape == (200, 336) and got_scale.shape == (-(-200 // block[0]), -(-336 // block[1]))
    assert torch.equal(_bytes(got_weight), _bytes(want_weight))
    assert torch.equal(_bytes(got_scale), _bytes(want_scale))


def test_fp8_block_quantize_other_block_sizes_match_formats():
    w = _awkward_weight(96, 160, seed=2)
    for block in ((64, 64), (32, 128), (96, 96)):  # 96 is not a power of two: handled by the formats function
        got = kernels.quantize("fp8", w, block=block, backend="triton")
        want = formats.quantize_fp8_block(w, block=block)
        assert torch.equal(_bytes(got[0]), _bytes(want[0])) and torch.equal(_bytes(got[1]), _bytes(want[1]))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_quantize_refuses_non_finite_weights(bad):
    w = _awkward_weight(64, 256, seed=3)
    w[63, 255] = bad
    for scale_fmt in ("ue8m0", "float32"):
        with pytest.raises(FormatError, match="NaN or Inf"):
            kernels.quantize("fp8", w, block=V4_BLOCK, scale_fmt=scale_fmt, backend="triton")
    with pytest.raises(FormatError, match="NaN or Inf"):
        kernels.quantize("int4", w.bfloat16(), backend="triton")


def _int4_weight(dtype: torch.dtype, group_size: int) -> torch.Tensor:
    w = _awkward_weight(72, 256, seed=4).cpu()   # edited on the CPU (the generator's device), then moved
    # Quotients that land exactly on .5 after the BF16 scale: round half to even must decide them.
    w[60, :group_size] = torch.arange(group_size, dtype=torch.float32).remainder(16).sub(7.5) * 0.25
    w[61, :group_size] = 0.0
    w[61, 3] = -5.0                       # a lone outlier: the search puts it on -8
    w[62] = w[62].sign() * 2.0 ** torch.randint(-3, 3, (256,), generator=_generator(8)).float()  # power-of-two grid
    return w.to(DEVICE, dtype)


def _assert_same_int4(got: formats.Int4Weight, want: formats.Int4Weight) -> None:
    assert isinstance(got, formats.Int4Weight)
    assert got.weight_packed.dtype == torch.int32 and got.weight_packed.shape == want.weight_packed.shape
    assert torch.equal(got.weight_packed.cpu(), want.weight_packed.cpu())
    assert torch.equal(got.weight_scale.view(torch.int16).cpu(), want.weight_scale.view(torch.int16).cpu())
    assert torch.equal(got.weight_shape.cpu(), want.weight_shape.cpu())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("group_size", [32, 128])
@pytest.mark.parametrize("scale_rule", ["mse", "amax"])
def test_int4_quantize_matches_formats(dtype, group_size, scale_rule):
    """The kernel, and the formats function on this device, write the CPU path's bytes."""
    w = _int4_weight(dtype, group_size)
    cpu = formats.quantize_int4_weight(w.cpu(), group_size=group_size, scale_rule=scale_rule)
    got = kernels.quantize("int4", w, group_size=group_size, scale_rule=scale_rule, backend="triton")
    _assert_same_int4(got, cpu)
    assert got.weight_packed.shape == (72, 32)
    _assert_same_int4(formats.quantize_int4_weight(w, group_size=group_size, scale_rule=scale_rule), cpu)
    if scale_rule == "mse":  # the search chose other scales than amax / 7.5 here, so the test tests it
        amax = formats.quantize_int4_weight(w.cpu(), group_size=group_size, scale_rule="amax")
        assert (cpu.weight_scale != amax.weight_scale).float().mean() > 0.3


def test_int4_search_on_mxfp4_experts_matches_the_cpu_path():
    """Real-size-like MXFP4-decoded weights (every row exponent, outlier columns, a zero block)."""
    from dsv4convert.synth import realistic_mxfp4

    packed, scale = realistic_mxfp4(64, 512, _generator(9))
    w = formats.dequantize_mxfp4(packed, scale)
    for group_size in (32, 128):
        cpu = formats.quantize_int4_weight(w, group_size=group_size, scale_rule="mse")
        on_device = w.to(DEVICE)
        _assert_same_int4(kernels.quantize("int4", on_device, group_size=group_size, backend="triton"), cpu)
        _assert_same_int4(formats.quantize_int4_weight(on_device, group_size=group_size), cpu)


@pytest.mark.parametrize("scale_rule", ["mse", "amax"])
def test_int4_refuses_scales_that_round_to_zero(scale_rule):
    w = torch.full((4, 128), 2.0**-133, dtype=torch.bfloat16, device=DEVICE)  # amax / 7.5 rounds to BF16 zero
    with pytest.raises(FormatError, match="positive"):
        formats.quantize_int4_weight(w, scale_rule=scale_rule)
    with pytest.raises(FormatError, match="positive"):
        kernels.quantize("int4", w, scale_rule=scale_rule, backend="triton")
    with pytest.raises(FormatError, match="scale rule"):
        kernels.quantize("int4", w, scale_rule="rms", backend="triton")


def _mxfp4(n: int, k: int, seed: int, low: int = 118, high: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    gen = _generator(seed)
    packed = torch.randint(-128, 128, (n, k // 2), generator=gen, dtype=torch.int8)
    scale = torch.randint(low, high, (n, k // 32), generator=gen, dtype=torch.uint8)
    return packed, scale


def _spread_mxfp4() -> tuple[torch.Tensor, torch.Tensor]:
    """Scales that leave NVFP4's window below and above, tiles spanning > 14 binades, zero blocks."""
    packed, scale = _mxfp4(256, 512, seed=5)
    scale[0, :4] = 90         # far below the rest: inexact in both transcodes
    scale[1, 0] = 0           # E8M0 byte 0, ModelOpt's zero-block sentinel
    scale[2, 3] = 100
    packed[2, 48:64] = 0      # ... an outside block whose codes are all zero stays exact
    scale[3, 2] = 100
    packed[3, 32:48] = torch.tensor([0x08, 0x80] * 8, dtype=torch.uint8).view(torch.int8)  # only negative zeros
    scale[130, 9] = 140       # far above: sets the global and tile exponents
    return packed.to(DEVICE), scale.view(torch.float8_e8m0fnu).to(DEVICE)


def test_mxfp4_to_nvfp4_matches_formats_with_report():
    packed, scale = _spread_mxfp4()
    got, got_report = kernels.transcode_mxfp4("nvfp4", packed, scale, backend="triton")
    want, want_report = formats.mxfp4_to_nvfp4(packed, scale)
    assert got.weight.data_ptr() == packed.data_ptr()  # codes are shared, never copied
    assert torch.equal(_bytes(got.weight_scale), _bytes(want.weight_scale))
    assert torch.equal(got.weight_scale_2, want.weight_scale_2) and got.weight_scale_2.dtype == torch.float32
    assert got_report == want_report
    assert 0 < got_report.blocks_exact < got_report.blocks_total and got_report.max_abs_error > 0
    for exponent in (-20, 5):  # a shared w1/w3 exponent, both sides of this tensor's own
        got, got_report = kernels.transcode_mxfp4("nvfp4", packed, scale, global_exponent=exponent, backend="triton")
        want, want_report = formats.mxfp4_to_nvfp4(packed, scale, global_exponent=exponent)
        assert torch.equal(_bytes(got.weight_scale), _bytes(want.weight_scale)) and got_report == want_report


def test_mxfp4_transcodes_of_realistic_scales_are_exact():
    packed, scale = _mxfp4(128, 256, seed=6)
    packed, scale = packed.to(DEVICE), scale.to(DEVICE)  # raw uint8 scale bytes are accepted too
    _, report = kernels.transcode_mxfp4("nvfp4", packed, scale, backend="triton")
    assert report.exact and report == formats.mxfp4_to_nvfp4(packed, scale)[1]
    weight, tile_scale, report = kernels.transcode_mxfp4("fp8", packed, scale, block=V4_BLOCK, backend="triton")
    want_weight, want_scale, want_report = formats.mxfp4_to_fp8_block(packed, scale, block=V4_BLOCK)
    assert report.exact and report == want_report
    assert torch.equal(_bytes(weight), _bytes(want_weight)) and torch.equal(_bytes(tile_scale), _bytes(want_scale))


@FP8_BLOCKS
def test_mxfp4_to_fp8_block_matches_formats_with_report(block):
    packed, scale = _spread_mxfp4()
    weight, tile_scale, report = kernels.transcode_mxfp4("fp8", packed, scale, block=block, backend="triton")
    want_weight, want_scale, want_report = formats.mxfp4_to_fp8_block(packed, scale, block=block)
    assert tile_scale.shape == (256 // block[0], 512 // block[1]) and report.blocks_total == tile_scale.numel()
    assert weight.dtype == torch.float8_e4m3fn and tile_scale.dtype == torch.float8_e8m0fnu
    assert torch.equal(_bytes(weight), _bytes(want_weight))
    assert torch.equal(_bytes(tile_scale), _bytes(want_scale))
    assert report == want_report
    assert 0 < report.blocks_exact < report.blocks_total and report.elements_exact < report.elements_total


def test_transcode_bad_inputs_are_refused():
    packed, scale = _spread_mxfp4()
    nan_scale = scale.view(torch.uint8).clone()
    nan_scale[0, 0] = 255
    for target, block in (("nvfp4", None), ("fp8", V4_BLOCK)):
        with pytest.raises(FormatError, match="NaN byte"):
            kernels.transcode_mxfp4(target, packed, nan_scale, block=block, backend="triton")
        with pytest.raises(FormatError, match="scale shape"):
            kernels.transcode_mxfp4(target, packed, scale[:, :-1], block=block, backend="triton")
    with pytest.raises(FormatError, match="K of 128"):
        kernels.transcode_mxfp4("fp8", packed[:, :48], scale[:, :3], block=V4_BLOCK, backend="triton")
    with pytest.raises(FormatError, match="needs its block"):
        kernels.transcode_mxfp4("fp8", packed, scale, backend="triton")
    with pytest.raises(FormatError, match="needs the block"):
        kernels.quantize("fp8", torch.zeros(16, 16, device=DEVICE))
    with pytest.raises(FormatError, match="normal range"):
        kernels.transcode_mxfp4("nvfp4", packed, scale, global_exponent=200, backend="triton")
    with pytest.raises(FormatError, match="NVFP4 transcode only"):
        kernels.transcode_mxfp4("fp8", packed, scale, global_exponent=0, block=V4_BLOCK, backend="triton")
    with pytest.raises(FormatError, match="transcodes to"):
        kernels.transcode_mxfp4("int4", packed, scale)
    with pytest.raises(FormatError, match="writes"):
        kernels.quantize("nvfp4", torch.zeros(16, 16, device=DEVICE))
    with pytest.raises(FormatError, match="2-D"):
        kernels.quantize("fp8", torch.zeros(2, 16, 16, device=DEVICE), block=V4_BLOCK, backend="triton")


def test_torch_backend_is_the_formats_function():
    w = _awkward_weight(64, 128, seed=7)
    got = kernels.quantize("int4", w, backend="torch")
    assert torch.equal(got.weight_packed, formats.quantize_int4_weight(w).weight_packed)


@pytest.mark.parametrize("options", [[], ["--group-size", "128", "--scale-rule", "amax"], ["--group-size", "128"]])
def test_to_w4a16_on_the_gpu_writes_the_cpu_bytes(tiny_ckpt, tmp_path, options):
    """The converter end to end, --device cuda against the CPU: every tensor byte for byte."""
    if DEVICE != "cuda":
        pytest.skip("--device cuda needs a CUDA GPU (the numerics are compared above on the CPU)")
    from dsv4convert.checkpoint import Checkpoint
    from dsv4convert.cli import main

    outputs = {}
    for device in ("cpu", "cuda"):
        dst = tmp_path / device
        assert main(["to-w4a16", "--src", str(tiny_ckpt), "--dst", str(dst), "--device", device, "--no-progress",
                     *options]) == 0
        ckpt = Checkpoint.open(dst)
        outputs[device] = {name: _bytes(ckpt.read(name)) for name in ckpt.tensors}
    assert outputs["cpu"].keys() == outputs["cuda"].keys()
    assert all(torch.equal(outputs["cpu"][n], outputs["cuda"][n]) for n in outputs["cpu"])
