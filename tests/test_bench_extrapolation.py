"""bench/convert.py's full-model figure never rests on a difference the worker count hides (#51).

With as many workers as layer shards, one more layer costs ~0 s of wall time (its shard runs beside the others);
the old extrapolation multiplied that ~0 by the layers to go and printed 0.6 minutes for a model whose single
layer took 140 s. The figure now rests on the work each added layer costs (CPU seconds, which no worker count
hides) or on a one-worker wall difference, and says which.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def bench_convert():
    path = Path(__file__).resolve().parent.parent / "bench" / "convert.py"
    spec = importlib.util.spec_from_file_location("bench_convert", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _row(layers: int, variant: str, workers: int, seconds: float, cpu: float, layer_bytes: int) -> dict:
    return {"layers": layers, "variant": variant, "workers": workers, "seconds": seconds,
            "cpu_user_seconds": cpu, "cpu_system_seconds": 0.0, "source_bytes": 2_000_000_000 + layers * layer_bytes}


def test_hidden_layer_difference_does_not_make_the_model_free(bench_convert):
    layer = 3_600_000_000
    runs = [_row(1, "w4a16", 4, 140.0, 300.0, layer), _row(2, "w4a16", 4, 141.0, 600.0, layer),   # wall hides it
            _row(1, "w4a16", 1, 150.0, 300.0, layer), _row(2, "w4a16", 1, 290.0, 590.0, layer)]
    out = bench_convert.extrapolate(runs, cores=16)
    full_bytes = out["full_model_bytes"]
    to_go = (full_bytes - (2_000_000_000 + layer)) / layer
    four = out["per_layer"]["w4a16/w4"]
    assert four["wall_seconds_difference"] == pytest.approx(1.0)
    assert four["used_seconds"] == pytest.approx(300.0 / 4) and "CPU" in four["basis"]
    assert out["seconds"]["w4a16/w4"] == pytest.approx(140.0 + to_go * 75.0, abs=0.1)
    one = out["per_layer"]["w4a16/w1"]
    assert one["used_seconds"] == pytest.approx(140.0) and "wall" in one["basis"]
    assert out["seconds"]["w4a16/w1"] == pytest.approx(150.0 + to_go * 140.0, abs=0.1)
    # the per-layer cost the figure rests on is printed beside it
    row = next(line for line in bench_convert.extrapolation_lines(out) if line.startswith("| w4a16/w4 |"))
    assert "| 75.0 | CPU difference / 4 | 1.0 | 300.0 |" in row


def test_one_layer_count_gives_no_figure(bench_convert):
    out = bench_convert.extrapolate([_row(1, "fp8", 2, 50.0, 80.0, 10)], cores=2)
    assert out["seconds"] == {} and "two counts" in out["method"]


def test_workers_beyond_the_cores_share_the_cores(bench_convert):
    runs = [_row(1, "fp8", 8, 40.0, 100.0, 1000), _row(2, "fp8", 8, 41.0, 180.0, 1000)]
    out = bench_convert.extrapolate(runs, cores=2)
    assert out["per_layer"]["fp8/w8"]["used_seconds"] == pytest.approx(80.0 / 2)
