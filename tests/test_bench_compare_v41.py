"""bench/compare_v41.py: its extrapolation of compare on DeepSeek-V4.1 from 1 and 2 real-size layers to the release,
its deadline's predictions and its dry run, on made-up timings: no timing is measured here."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

GB = 1e9


@pytest.fixture(scope="module")
def bench():
    path = Path(__file__).resolve().parent.parent / "bench" / "compare_v41.py"
    spec = importlib.util.spec_from_file_location("bench_compare_v41", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def release(bench) -> dict:
    return bench.release(json.loads(bench.RELEASE_CONFIG.read_text()))


def _kinds(layer: float, table: float = 1.0, other: float = 4.0) -> dict:
    return {"layer": int(layer * GB), "engram_table": int(table * GB), "dspark": 0, "other": int(other * GB),
            "total": int((layer + table + other) * GB)}


COMPRESSED = {"ratio": 2, "kind": "compressed", "roles": ["Engram", "KV source", "index source", "candidate source"]}
SLIDING = {"ratio": 0, "kind": "sliding", "roles": []}


def _count(layers: int, wall: float, engine: dict, probe: dict, read_s: float) -> dict:
    """A count whose base layers are 7 GB and variant layers 13 GB each (20 GB of both per layer)."""
    roles = [{**COMPRESSED, "layer": 0}] if layers == 1 else [{**SLIDING, "layer": 0}, {**COMPRESSED, "layer": 1}]
    base, variant = _kinds(7 * layers), _kinds(13 * layers)
    return {"layers": layers, "roles": roles, "base_bytes": base, "variant_bytes": variant,
            "stages": {"read": {"seconds": read_s, "bytes": base["total"] + variant["total"]}},
            "compare": {"1x8192": {"seconds": wall, "cpu_user_seconds": 0.0, "cpu_system_seconds": 0.0,
                                   "layers": probe, "result": {"seconds": engine,
                                                               "peak_device_bytes": int(30 * 2**30)}}}}


def test_the_release_is_layers_by_kind_and_the_difference_beside_it(bench, release):
    assert release["layers"] == 40 and release["kinds"] == {"sliding": 2, "compressed": 38}
    assert release["engram_tables"] == 2 and release["engram_row_bytes"] == pytest.approx(264, abs=0.01)
    counts = {"1": _count(1, 60.0, {"read": 5.0, "forward": 9.0, "metrics": 2.0, "wall": 17.0},
                          {"0": {"read": 5.0, "forward": 9.0}}, read_s=10.0),
              "2": _count(2, 66.0, {"read": 9.0, "forward": 11.5, "metrics": 2.0, "wall": 23.5},
                          {"0": {"read": 4.5, "forward": 6.0}, "1": {"read": 4.5, "forward": 5.5}}, read_s=15.0)}
    x = bench.extrapolate(counts, release, "1x8192")
    rel_layers = release["base_bytes"]["layer"] + release["variant_bytes"]["layer"]
    # difference: the 1-layer process wall + layer-equivalents of bytes to go x the engine wall the 2nd layer adds
    to_go = (rel_layers - 20 * GB) / (20 * GB)
    assert x["layer_equivalents_to_go"] == pytest.approx(to_go, abs=0.01)
    assert x["per_layer"]["difference_wall_seconds"] == pytest.approx(6.5)
    assert x["seconds"]["difference"] == pytest.approx(60 + to_go * 6.5, abs=0.1)
    # by kind: read 4 s per 20 GB added; forward of the sliding layer the run adds (2.5 s, its warm-up cancelled),
    # the compressed layer's from the probe in the 2-layer run (5.5 s, warm); 1 sliding and 37 compressed to go
    read_to_go = 4.0 / (20 * GB) * (rel_layers - 40 * GB)
    assert x["per_layer"]["read_seconds_per_gb"] == pytest.approx(0.2)
    assert x["per_layer"]["forward"]["sliding"]["seconds"] == pytest.approx(2.5)
    assert x["per_layer"]["forward"]["compressed"]["seconds"] == pytest.approx(5.5)
    assert x["by_kind_parts"]["layers_to_go"] == {"sliding": 1, "compressed": 37}
    assert x["seconds"]["by_kind"] == pytest.approx(66 + read_to_go + 2.5 + 37 * 5.5, abs=0.1)
    # the Engram tables: gathered rows, as compare reads them (nothing beyond t(N))
    assert x["engram"]["gathered_bytes_per_table_at_most"] == pytest.approx(8192 * 3 * 8 * 264, rel=1e-3)
    # reading both whole checkpoints at cat's rate at 2 layers (19 + 31 GB in 15 s)
    whole = release["base_bytes"]["total"] + release["variant_bytes"]["total"]
    assert x["read_both"]["seconds"] == pytest.approx(whole / (50 * GB / 15), abs=0.1)
    assert x["ratio"]["by_kind"] == pytest.approx(x["seconds"]["by_kind"] / x["read_both"]["seconds"], abs=0.01)
    assert x["goal_met"] is (x["ratio"]["by_kind"] <= 1.5)


def test_one_count_gives_no_figure(bench, release):
    counts = {"1": _count(1, 60.0, {"read": 5.0, "forward": 9.0, "metrics": 2.0, "wall": 17.0}, {}, read_s=10.0)}
    assert bench.extrapolate(counts, release, "1x8192")["method"].startswith("none")


def test_the_deadline_predicts_the_chain_from_the_last_count_scaled_by_bytes(bench):
    planned = [{"layers": n, "source": {"total": int(b * GB)}, "outputs": {"fp8": int(b * GB)}}
               for n, b in ((1, 10), (2, 20))]
    expected = {1: {"synth": 50.0, "convert": 30.0, "read": 5.0, "compare 1x8192": 40.0},
                2: {"synth": 60.0, "convert": 35.0, "read": 8.0, "compare 1x8192": 50.0}}
    # nothing measured: the guesses; synth needs convert and the first compare after it
    assert bench.predict_chain("synth", 1, planned, {}, expected, (1, 8192)) == pytest.approx(120.0)
    assert bench.predict_chain("read", 1, planned, {}, expected, (1, 8192)) == pytest.approx(5.0)
    done = {"1": {"stages": {"synth": {"seconds": 20.0}, "convert": {"seconds": 10.0}},
                  "compare": {"1x8192": {"seconds": 30.0}}}}
    assert bench.predict_chain("synth", 2, planned, done, expected, (1, 8192)) == pytest.approx(2 * 60.0)
    assert bench.predict_chain("compare 1x8192", 2, planned, done, expected, (1, 8192)) == pytest.approx(60.0)


def test_dry_run_prints_the_plan_and_writes_nothing(bench, tmp_path, monkeypatch, capsys):
    work = tmp_path / "work"
    monkeypatch.setattr("sys.argv", ["compare_v41.py", "--dry-run", "--work", str(work), "--out-dir",
                                     str(tmp_path / "out")])
    assert bench.main() == 0
    out = capsys.readouterr().out
    assert "| 2 | 19.68 | 1.11 | 32.45 | 52.1 |" in out and "Expected in all" in out and "nothing written" in out
    assert not work.exists() and not (tmp_path / "out").exists()
