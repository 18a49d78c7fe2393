"""bench/convert_v41.py: its disk plan for real-size V4.1 layers, its shard timeline, and its extrapolation to the
release (40 layers, 3 DSpark stages, two 101 GB Engram tables), on made-up timings: no timing is measured here."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

GB = 1e9


@pytest.fixture(scope="module")
def bench():
    path = Path(__file__).resolve().parent.parent / "bench" / "convert_v41.py"
    spec = importlib.util.spec_from_file_location("bench_convert_v41", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def release(bench) -> dict:
    return json.loads(bench.RELEASE_CONFIG.read_text())


def test_the_plan_fits_55_gb_and_leaves_out_bf16_at_two_layers(bench, release):
    from dsv4convert.models.deepseek_v41.presets import DEFAULT_ENGRAM_ROWS

    plan = bench.plan(release, [2, 1], DEFAULT_ENGRAM_ROWS, list(bench.VARIANTS), [1], 55)
    full = plan["full_model"]
    assert (full["layers"], full["dspark_stages"], full["engram_tables"]) == (40, 3, 2)
    assert full["bytes"]["total"] == 510_286_023_000 and full["bytes"]["engram_table"] == 202_758_032_400
    one, two = plan["counts"]
    assert (one["layers"], two["layers"]) == (1, 2)
    # real-size layers: ~7.4 GB each, one scaled Engram table (1.1 GB) in both sources
    assert 7.3 * GB < two["source"]["layer"] - one["source"]["layer"] < 7.5 * GB
    assert one["source"]["engram_table"] == two["source"]["engram_table"] < 1.2 * GB
    assert one["source"]["dspark"] == two["source"]["dspark"] == 0
    # BF16 writes ~3.8x the MXFP4 experts: 60 GB at two layers, more than the disk with its source
    assert two["outputs"]["bf16"] > 55 * GB - two["source"]["total"]
    assert [(r["variant"], r["workers"]) for r in two["left_out"]] == [("bf16", 1)]
    assert "55" in two["left_out"][0]["why"]
    assert [r["variant"] for r in one["runs"]] == ["nvfp4", "fp8", "bf16", "w4a16"] and not one["left_out"]
    for count in plan["counts"]:
        biggest = max([count["source"]["total"], *(count["outputs"][r["variant"]] for r in count["runs"])])
        assert count["peak_disk_bytes"] == count["source"]["total"] + biggest <= 55 * GB
    lines = "\n".join(bench.plan_lines(plan, free=60 * GB))
    assert "bf16/w1 (source + output" in lines and "40 layers + 3 DSpark stages + 2 Engram tables" in lines


def test_the_timeline_splits_a_run_by_its_shards(bench):
    kinds = {"a": ["other", 100], "b": ["layer", 700], "c": ["layer", 710], "d": ["other", 50],
             "e": ["engram_table", 110]}
    row = {"started_unix": 1000.0, "seconds": 30.0,
           "shard_mtimes": {"e": 1029.0, "a": 1003.0, "b": 1010.0, "c": 1018.0, "d": 1019.0}}
    t = bench.timeline(row, kinds)
    assert t["other"] == {"seconds": pytest.approx(4.0), "bytes": 150}   # start-up + a, then d
    assert t["layer"] == {"seconds": pytest.approx(15.0), "bytes": 1410}
    assert t["engram_table"] == {"seconds": pytest.approx(10.0), "bytes": 110}
    assert t["after_last_shard_seconds"] == pytest.approx(1.0)


def _row(layers: int, variant: str, workers: int, seconds: float, *, cpu: float = 0.0, layer_s: float | None = None,
         engram_s: float | None = None) -> dict:
    """A run on a source of 5 GB of other tensors, ``layers`` 7 GB layers and a 1 GB Engram table."""
    row = {"layers": layers, "variant": variant, "workers": workers, "seconds": seconds, "cpu_user_seconds": cpu,
           "cpu_system_seconds": 0.0, "source_bytes": int((6 + 7 * layers) * GB), "engram_bytes": int(GB)}
    if engram_s is not None:
        row["timeline"] = {"layer": {"seconds": layer_s or 0.0, "bytes": int(7 * layers * GB)},
                           "engram_table": {"seconds": engram_s, "bytes": int(GB)}}
    return row


FULL = {"bytes": {"total": int(485 * GB), "engram_table": int(200 * GB)}}   # 5 GB + 40 x 7 GB + 200 GB of tables


def test_the_release_is_layers_by_their_cost_plus_the_engram_tables_at_their_rate(bench):
    runs = [_row(1, "cp", 1, 15.0), _row(2, "cp", 1, 24.0),
            {**_row(1, "cp-engram", 1, 1.0), "source_bytes": int(GB)},
            {**_row(1, "check-engram", 1, 1.4), "source_bytes": int(GB), "inner_seconds": 1.25},
            _row(1, "nvfp4", 1, 30.0, layer_s=14.0, engram_s=2.0),
            _row(2, "nvfp4", 1, 50.0, layer_s=28.0, engram_s=2.0),
            _row(1, "bf16", 1, 60.0, layer_s=35.0, engram_s=3.0),                        # one count only (disk)
            _row(1, "fp8", 1, 40.0, layer_s=20.0, engram_s=1.5), _row(2, "fp8", 1, 65.0, layer_s=45.0, engram_s=1.5),
            _row(1, "fp8", 4, 20.0, cpu=40.0), _row(2, "fp8", 4, 22.0, cpu=80.0)]        # wall hides the layer
    out = bench.extrapolate(runs, FULL, cores=2)
    to_go = (285 - 12) / 7                                                               # 39 layer-equivalents
    assert out["layer_equivalents_to_go"] == pytest.approx(to_go)
    assert out["engram_bytes_to_go"] == int(199 * GB)
    s = out["seconds"]
    assert s["cp/w1"] == pytest.approx(15 + to_go * 9 + 199 * 1.0, abs=0.1)            # cp's own copy of the table
    # one worker: the layer shards' own difference (28 - 14 s), not the wall's (50 - 30 s: start-up noise in it)
    assert s["nvfp4/w1"] == pytest.approx(30 + to_go * 14 + 199 * 2.0, abs=0.1)
    assert s["bf16/w1"] == pytest.approx(60 + to_go * 35 + 199 * 3.0, abs=0.1)         # 5 s/GB x 7 GB per layer
    assert s["fp8/w4"] == pytest.approx(20 + to_go * 20 + 199 * 1.5, abs=0.1)          # CPU 40 s / 2 cores
    assert out["ratio_to_cp"]["nvfp4/w1"] == pytest.approx(s["nvfp4/w1"] / s["cp/w1"], abs=0.01)
    per = out["per_layer"]
    assert "timeline" in per["bf16/w1"]["basis"] and per["bf16/w1"]["wall_seconds_difference"] is None
    assert per["fp8/w4"]["basis"] == "CPU difference / 2"
    assert "layer shards' difference" in per["nvfp4/w1"]["basis"] and per["nvfp4/w1"]["wall_seconds_difference"] == 20
    assert per["fp8/w4"]["engram_gb_per_s"] == pytest.approx(1 / 1.5, abs=0.01)          # the one-worker run's table
    # one more cold read and check of the tables to go, at the check's own rate (its process start-up left out)
    assert out["seconds_if_reread"]["nvfp4/w1"] == pytest.approx(s["nvfp4/w1"] + 199 * 1.25, abs=0.1)
    assert "cp/w1" not in out["seconds_if_reread"]
    assert per["nvfp4/w1"]["timeline_seconds"] == pytest.approx(14.0)                  # the cross-check beside it
    assert "39.0 layer-equivalents" in out["method"] and "The DSpark stages count as layer bytes" in out["method"]


def test_one_count_without_a_timeline_gives_no_figure(bench):
    out = bench.extrapolate([_row(1, "cp", 1, 15.0)], FULL, cores=2)
    assert out["seconds"] == {} and out["method"].startswith("none")


def test_dry_run_prints_the_plan_and_writes_nothing(bench, tmp_path, monkeypatch, capsys):
    work = tmp_path / "work"
    monkeypatch.setattr("sys.argv", ["convert_v41.py", "--dry-run", "--work", str(work), "--out-dir",
                                     str(tmp_path / "out")])
    bench.main()
    out = capsys.readouterr().out
    assert "Disk plan" in out and "| 2 | 19.68 |" in out and "GB free at --work" in out
    assert not work.exists() and not (tmp_path / "out").exists()
