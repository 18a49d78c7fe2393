"""to-w4a16's INT4 options end to end: group 32 / 128, the scale search, amax / 7.5 bit for bit.

Checked against compressed-tensors 0.18.0 (its compressor and decompressor), not our own code.
"""

from __future__ import annotations

import json

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from compressed_tensors.quantization.utils import calculate_qparams
from conftest import SHARD

from dsv4convert.checkpoint import Checkpoint
from dsv4convert.cli import main
from dsv4convert.convert.modules import dequantize_source
from dsv4convert.formats import Format
from dsv4convert.models.deepseek_v4.layout import Role, classify


def _scheme(group_size: int) -> QuantizationScheme:
    return QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=4, type="int", symmetric=True, strategy="group", group_size=group_size))


def _expert_modules(ckpt: Checkpoint) -> list[str]:
    return sorted({classify(n).module for n in ckpt.tensors if classify(n).role is Role.ROUTED_EXPERT})


def _convert(src, dst, *extra: str) -> None:
    assert main(["to-w4a16", "--src", str(src), "--dst", str(dst), "--no-progress",
                 "--max-shard-size", str(SHARD), *extra]) == 0


def _int4(ckpt: Checkpoint, module: str) -> dict[str, torch.Tensor]:
    return {p: ckpt.read(f"{module}.{p}") for p in ("weight_packed", "weight_scale", "weight_shape")}


def test_amax_rule_at_group_128_is_compressed_tensors_round_to_nearest(tiny_ckpt, tmp_path):
    """``--group-size 128 --scale-rule amax`` writes what compressed-tensors' own compressor writes
    for the dequantized source with its own amax / 7.5 scales: the pre-search output, bit for bit."""
    _convert(tiny_ckpt, tmp_path / "out", "--group-size", "128", "--scale-rule", "amax")
    source, out = Checkpoint.open(tiny_ckpt), Checkpoint.open(tmp_path / "out")
    for module in _expert_modules(source):
        w = dequantize_source(Format.MXFP4, {p: source.read(f"{module}.{p}") for p in ("weight", "scale")}, module, {})
        groups = w.unflatten(-1, (w.shape[1] // 128, 128))
        scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), _scheme(128).weights)
        theirs = PackedQuantizationCompressor.compress({"weight": w, "weight_scale": scale.to(torch.bfloat16)},
                                                       _scheme(128))
        ours = _int4(out, module)
        assert torch.equal(ours["weight_packed"], theirs["weight_packed"]), module
        assert torch.equal(ours["weight_scale"], scale.to(torch.bfloat16)), module


def test_default_is_group_32_with_searched_scales_never_worse_than_amax(tiny_ckpt, tmp_path):
    _convert(tiny_ckpt, tmp_path / "default")
    _convert(tiny_ckpt, tmp_path / "explicit", "--group-size", "32", "--scale-rule", "mse")
    _convert(tiny_ckpt, tmp_path / "amax", "--group-size", "32", "--scale-rule", "amax")
    source = Checkpoint.open(tiny_ckpt)
    default, explicit, amax = (Checkpoint.open(tmp_path / d) for d in ("default", "explicit", "amax"))
    (group,) = json.loads((tmp_path / "default" / "config.json").read_text())["quantization_config"][
        "config_groups"].values()
    assert group["weights"]["group_size"] == 32
    better = 0
    for module in _expert_modules(source):
        ours = _int4(default, module)
        assert all(torch.equal(ours[p], _int4(explicit, module)[p]) for p in ours), module
        n, k = ours["weight_shape"].tolist()
        assert ours["weight_scale"].shape == (n, k // 32)
        w = dequantize_source(Format.MXFP4, {p: source.read(f"{module}.{p}") for p in ("weight", "scale")}, module, {})
        decoded = dequantize_source(Format.INT4, ours, module, {})
        theirs = PackedQuantizationCompressor.decompress(ours, _scheme(32))["weight"]   # q * scale in BF16
        assert torch.equal(theirs, decoded.to(theirs.dtype)), module                      # CT decodes our bytes
        baseline = dequantize_source(Format.INT4, _int4(amax, module), module, {})
        searched_error = (w - decoded).double().square().reshape(n, k // 32, 32).sum(-1)
        amax_error = (w - baseline).double().square().reshape(n, k // 32, 32).sum(-1)
        assert bool((searched_error <= amax_error).all()), module  # per group
        better += int(searched_error.sum() < amax_error.sum())
    assert better == len(_expert_modules(source))


def test_int4_options_are_part_of_the_resume_signature(tiny_ckpt, tmp_path, capsys):
    _convert(tiny_ckpt, tmp_path / "out")
    code = main(["to-w4a16", "--src", str(tiny_ckpt), "--dst", str(tmp_path / "out"), "--resume", "--no-progress",
                 "--max-shard-size", str(SHARD), "--group-size", "128"])
    assert code == 2 and "--resume refused" in capsys.readouterr().err


def test_int4_sources_are_regrouped_or_keep_their_group_in_the_config(tiny_ckpt, tmp_path):
    _convert(tiny_ckpt, tmp_path / "g128", "--group-size", "128")
    _convert(tmp_path / "g128", tmp_path / "g32")     # INT4 at 128 -> requantized at 32
    ckpt = Checkpoint.open(tmp_path / "g32")
    module = _expert_modules(ckpt)[0]
    n, k = ckpt.read(f"{module}.weight_shape").tolist()
    assert ckpt.tensors[f"{module}.weight_scale"].shape == (n, k // 32)
    keep = tmp_path / "keep.yaml"
    keep.write_text("name: keep\nrules:\n  - match: {}\n    format: keep\n    reason: a copy\n")
    assert main(["convert", "--recipe", str(keep), "--src", str(tmp_path / "g32"), "--dst", str(tmp_path / "copy"),
                 "--no-progress"]) == 0
    (group,) = json.loads((tmp_path / "copy" / "config.json").read_text())["quantization_config"][
        "config_groups"].values()
    assert group["weights"]["group_size"] == 32   # what the kept experts are stored with


@pytest.mark.parametrize("params, message", [
    ("{scale_rule: minmax}", "rules[0].params.scale_rule"),
    ("{group_size: 32, scale_rule: amax, colour: red}", "unknown key"),
])
def test_bad_int4_params_name_the_path(tiny_ckpt, tmp_path, capsys, params, message):
    path = tmp_path / "recipe.yaml"
    path.write_text(f"name: x\nrules:\n  - match: {{role: routed_expert}}\n    format: int4\n    params: {params}\n"
                    "  - match: {}\n    format: keep\n    reason: the rest as in the source\n")
    code = main(["convert", "--recipe", str(path), "--src", str(tiny_ckpt), "--dst", str(tmp_path / "o"),
                 "--dry-run", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "recipe.yaml" in err, err


def test_scale_rule_is_refused_on_fp8(tiny_ckpt, tmp_path, capsys):
    path = tmp_path / "recipe.yaml"
    path.write_text("name: x\nrules:\n  - match: {role: routed_expert}\n    format: fp8\n    params: {scale_rule: mse}\n"
                    "  - match: {}\n    format: keep\n    reason: the rest as in the source\n")
    code = main(["convert", "--recipe", str(path), "--src", str(tiny_ckpt), "--dst", str(tmp_path / "o"),
                 "--dry-run", "--no-progress"])
    assert code == 2 and "rules[0].params" in capsys.readouterr().err


def test_help_explains_the_int4_options(capsys):
    with pytest.raises(SystemExit):
        main(["to-w4a16", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--group-size {32,128}" in text and "--scale-rule {mse,amax}" in text
    assert "amax/7.5" in text
