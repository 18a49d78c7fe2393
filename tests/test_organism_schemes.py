"""The 4-bit expert schemes on the organism (a trained DeepSeek-V4, dsv4convert/data/organism), judged by KLD
against the base on its held-out text, stored weights only (``compare --numerics weights``: the W4A16 serving
path): the relations bench/w4a16_kld.py found with a clear margin (bench/results/w4a16-kld-organism-cpu.md),
here on the text's first 512 tokens.

The organism's per-position KLD is heavy-tailed (a handful of positions carry most of the mean, and on these 511
positions the searched group-32 scales' mean is *above* amax's, for one position), so the assertions are on the
typical position: the median KLD and the share of positions where one scheme's KLD is below the other's
(measured on 3,069 positions: median ratio 0.36-0.55 per sequence for group 32 / 128 and 0.21-0.39 for the search
/ amax at group 32, lower at 77 % and 86 % of the positions; on these 511: 0.42, 0.22, 76 %, 87 %)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dsv4convert.cli import main
from dsv4convert.compare.run import CompareOptions, build_plan, run
from dsv4convert.organism.export import write_organism
from dsv4convert.synth import ORGANISM_DIR

TEXT = ORGANISM_DIR / "heldout.txt"


@pytest.fixture(scope="module")
def organism(tmp_path_factory) -> Path:
    return write_organism(tmp_path_factory.mktemp("organism") / "base")


def kld(base: Path, variant: Path, tokens: int = 512) -> tuple[dict, torch.Tensor]:
    """KLD summary and per-position values on the held-out text's first tokens - 1 scored positions, weights only."""
    result = run(build_plan(CompareOptions(base=str(base), variant=str(variant), texts=[TEXT], tokens=tokens,
                                           seq_len=tokens, numerics="weights", mtp=False, progress=False)))
    values = result.pop("_kld_values").double()
    assert result["output"]["positions"] == values.numel() == tokens - 1
    return result["output"]["kld"], values


def w4a16(organism: Path, dst: Path, group: int, rule: str) -> tuple[dict, torch.Tensor]:
    args = ["to-w4a16", "--group-size", str(group), "--scale-rule", rule]
    assert main([*args, "--src", str(organism), "--dst", str(dst), "--no-progress"]) == 0
    return kld(organism, dst)


def test_fp8_is_lossless_and_int4_group_32_searched_loses_least(organism, tmp_path):
    assert main(["to-fp8", "--src", str(organism), "--dst", str(tmp_path / "fp8"), "--no-progress"]) == 0
    fp8, _ = kld(organism, tmp_path / "fp8", tokens=128)   # exact: any text shows it
    assert fp8["mean"] == 0.0 and max(fp8["percentiles"].values()) == 0.0

    g32, v32 = w4a16(organism, tmp_path / "g32-mse", 32, "mse")
    g128, v128 = w4a16(organism, tmp_path / "g128-mse", 128, "mse")
    amax, vamax = w4a16(organism, tmp_path / "g32-amax", 32, "amax")
    assert 0.0 < g32["mean"] and 0.0 < g32["percentiles"]["50"]
    # group 32 against group 128, both searched: the typical position loses about half as much
    assert g32["percentiles"]["50"] < 0.6 * g128["percentiles"]["50"], (g32["percentiles"], g128["percentiles"])
    assert (v32 < v128).double().mean() >= 0.65
    # the searched scales against amax / 7.5 at group 32: about a fifth at the median
    assert g32["percentiles"]["50"] < 0.4 * amax["percentiles"]["50"], (g32["percentiles"], amax["percentiles"])
    assert (v32 < vamax).double().mean() >= 0.75
