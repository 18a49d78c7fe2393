"""DeepSeek-V4.1-Flash's conversions on real-size layers against ``cp`` of the same bytes, extrapolated to the release.

For each layer count N (default 1 and 2) a source is synthesized with ``dsv4convert synth --config <V4.1 config>
--num-layers N --engram-rows R --drafter none`` (the first N-1 layers and the release's layer 14, renumbered: 7.4-7.6
GB each, mostly MXFP4 experts; one Engram table of about R rows; embedding, head and vision tower at real size). The
layers are renumbered, so the 1-layer source is not a prefix of the 2-layer one: each is synthesized, used and deleted
in turn (its shards written side by side, ``synth --workers``). Then, on that source, in one run: ``cp -r`` + ``sync``,
every ``to-*`` variant with each worker count (``to-fp8`` and ``to-w4a16`` with ``--engine sglang``: the variants
only SGLang runs), a cold read of the Engram table's shard with the converters' NaN check
(``convert/modules.py::check_source_finite``, timed inside its process), ``cp`` + ``sync`` of that shard alone, and
``cp -r`` + ``sync`` again. Each command
runs as its own process on a cold source (``bench/convert.py::timed``: the source evicted from the page cache), its
output deleted after it is measured, so the disk holds one source and one output at a time; a run whose source and
output would not fit ``--max-disk-gb`` is left out, and the plan, printed first (``--dry-run``: only the plan), says
which.

Recorded per run as ``bench/convert.py`` records it (wall, CPU, disk I/O, peak RSS of the process tree, output bytes)
and, with one worker, the shard timeline: the converter writes one output shard per source shard, in order, each
renamed into place when complete, so the shards' modification times split the run into the once-per-run start-up,
the layer shards and the Engram table's shard.

The release is extrapolated from what the worker count cannot hide (``bench/convert.py::layer_costs``) in two
parts, because the Engram tables are copied byte for byte whatever the variant and are 40 % of the release:

* everything but the Engram tables (the 40 layers, the 3 DSpark stages, embedding, head, vision tower: 307.5 GB) as
  ``t(N_lo) + (its bytes - the N_lo source's) / per-layer bytes x per-layer seconds``, the per-layer seconds the
  one-worker wall difference between the counts (more workers: the CPU difference / min(workers, cores)); where a
  variant ran at one count only (``to-bf16`` at 2 layers writes 56 GB, more than the disk), the layer shards'
  seconds per byte in its one-worker timeline;
* the Engram tables (202.8 GB) less the source's table, at the seconds per byte the variant's own run took for the
  table's shard (its timeline; the median over the counts), ``cp``'s at its copy of the table's shard. A converter
  reads a kept table twice, the NaN check and then the copy (``convert/v41.py::_produce``); a 1.1 GB table's second
  read comes from the page cache, the release's 101 GB tables' may not, so the figure is also given with one more
  cold read and check of the tables (``if re-read``).

    python bench/convert_v41.py --work /scratch --out-dir bench/results --name cpu-h200host
    python bench/convert_v41.py --dry-run
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.convert import GB, REPO, _commit, _machine, layer_costs, timed  # noqa: E402
from dsv4convert import dtypes  # noqa: E402
from dsv4convert.checkpoint import Checkpoint  # noqa: E402
from dsv4convert.checkpoint.reader import read_header  # noqa: E402
from dsv4convert.convert.modules import check_source_finite  # noqa: E402
from dsv4convert.convert.v41 import expected_outputs  # noqa: E402
from dsv4convert.models.deepseek_v41.config import read_config  # noqa: E402
from dsv4convert.models.deepseek_v41.inventory import native_groups, role_of  # noqa: E402
from dsv4convert.models.deepseek_v41.presets import DEFAULT_ENGRAM_ROWS  # noqa: E402
from dsv4convert.models.deepseek_v41.synth import scaled_config  # noqa: E402

RELEASE_CONFIG = REPO / "tests" / "data" / "deepseek-v4.1-flash-config.json"
# the variants, each with the engine flags it is made with (fp8 and w4a16: SGLang alone runs them, docs/v41.md)
VARIANTS = {"nvfp4": [], "fp8": ["--engine", "sglang"], "bf16": [], "w4a16": ["--engine", "sglang"]}
CP, CP_ENGRAM, CHECK_ENGRAM = "cp", "cp-engram", "check-engram"


def kind_of(name: str) -> str:
    """What a tensor counts as here: the Engram table, a backbone layer's, a DSpark stage's, or other."""
    if role_of(name) == "engram_table":
        return "engram_table"
    return "layer" if name.startswith("layers.") else "dspark" if name.startswith("mtp.") else "other"


def inventory_bytes(config: dict) -> dict[str, int]:
    """A V4.1 config's native bytes by :func:`kind_of`, and in all."""
    out = {"engram_table": 0, "layer": 0, "dspark": 0, "other": 0}
    for group in native_groups(read_config(config, "bench config")):
        for spec in group:
            out[kind_of(spec.name)] += spec.nbytes
    out["total"] = sum(out.values())
    return out


def full_model(config: dict) -> dict:
    """What the extrapolation scales to: the config's release (40 layers, 3 DSpark stages, two Engram tables)."""
    cfg = read_config(config, "bench config")
    return {"layers": cfg.num_hidden_layers, "dspark_stages": cfg.dspark.stages if cfg.dspark else 0,
            "engram_tables": len(cfg.engram_layer_ids), "bytes": inventory_bytes(config)}


def plan(config: dict, layers: list[int], engram_rows: int, variants: list[str], workers: list[int],
         max_disk_gb: float) -> dict:
    """Per layer count: the source's bytes, each variant's output bytes (``convert/v41.py::expected_outputs``), the
    runs that fit ``max_disk_gb`` with the source (and those left out, with why), and the peak disk."""
    counts = []
    for n in sorted(layers):
        scaled = scaled_config(config, n, engram_rows, drafter=False)
        cfg = read_config(scaled, "bench config")
        source = inventory_bytes(scaled)
        outputs = {v: sum(dtypes.nbytes(dtype, shape) for dtype, shape in expected_outputs(cfg, v).values())
                   for v in variants}
        runs, left_out = [], []
        for variant in variants:
            need = source["total"] + outputs[variant]
            for w in workers:
                if need > max_disk_gb * GB:
                    left_out.append({"variant": variant, "workers": w, "why": f"source + output {need / GB:.1f} GB > "
                                     f"--max-disk-gb {max_disk_gb:g}"})
                else:
                    runs.append({"variant": variant, "workers": w})
        peak = source["total"] + max([source["total"], *(outputs[r["variant"]] for r in runs)])
        counts.append({"layers": n, "config": scaled, "source": source, "outputs": outputs, "runs": runs,
                       "left_out": left_out, "peak_disk_bytes": peak})
    return {"counts": counts, "full_model": full_model(config), "engram_rows": engram_rows,
            "max_disk_bytes": int(max_disk_gb * GB)}


def plan_lines(p: dict, free: int | None = None) -> list[str]:
    full = p["full_model"]
    b = full["bytes"]
    lines = [f"Release (the extrapolation's target): {full['layers']} layers + {full['dspark_stages']} DSpark stages + "
             f"{full['engram_tables']} Engram tables = {b['total'] / GB:.1f} GB: layers {b['layer'] / GB:.1f}, DSpark "
             f"{b['dspark'] / GB:.1f}, Engram tables {b['engram_table'] / GB:.1f}, embedding/head/vision "
             f"{b['other'] / GB:.1f}", "",
             f"Disk plan (one source and one output at a time, each output deleted once measured; limit "
             f"{p['max_disk_bytes'] / GB:.0f} GB" + (f", {free / GB:.1f} GB free at --work" if free is not None
                                                     else "") + f"; Engram tables of --engram-rows "
             f"{p['engram_rows']:,}):", "",
             "| layers | source GB | of it Engram GB | " + " | ".join(f"{v} out GB" for v in
                                                                     p["counts"][0]["outputs"]) +
             " | peak disk GB | runs | left out |",
             "|---|---|---|" + "---|" * len(p["counts"][0]["outputs"]) + "---|---|---|"]
    for c in p["counts"]:
        runs = ", ".join(f"{r['variant']}/w{r['workers']}" for r in c["runs"])
        out = "; ".join(f"{r['variant']}/w{r['workers']} ({r['why']})" for r in c["left_out"]) or "none"
        lines.append(f"| {c['layers']} | {c['source']['total'] / GB:.2f} | {c['source']['engram_table'] / GB:.2f} | " +
                     " | ".join(f"{v / GB:.2f}" for v in c["outputs"].values()) +
                     f" | {c['peak_disk_bytes'] / GB:.1f} | cp, {runs}, check-engram, cp-engram, cp | {out} |")
    return lines


def check_table(shard: Path, dst: Path) -> None:
    """The converter's first pass over a kept tensor (``convert/v41.py::_produce``: ``check_source_finite``, then the
    copy): every tensor of ``shard`` read and checked for NaN; its seconds (after start-up) go to ``dst/seconds``."""
    t0 = time.monotonic()
    for entry in read_header(shard).entries.values():
        check_source_finite(entry)
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "seconds").write_text(str(time.monotonic() - t0))


def shard_mtimes(dst: Path) -> dict:
    """When each output shard was last written (``timed``'s ``after``: read before the output is deleted)."""
    return {"shard_mtimes": {p.name: p.stat().st_mtime for p in dst.glob("model-*.safetensors")}}


def shard_kinds(src: Path) -> dict[str, list]:
    """Each source shard's kind (:func:`kind_of` of its tensors; 'mixed' if they differ) and tensor bytes."""
    kinds: dict[str, set] = {}
    sizes: dict[str, int] = {}
    for entry in Checkpoint.open(src).tensors.values():
        kinds.setdefault(entry.path.name, set()).add(kind_of(entry.name))
        sizes[entry.path.name] = sizes.get(entry.path.name, 0) + entry.nbytes
    return {name: [k.pop() if len(k) == 1 else "mixed", sizes[name]] for name, k in kinds.items()}


def timeline(row: dict, kinds: dict[str, list]) -> dict:
    """A one-worker conversion split by its shards' completion times: seconds and source bytes per kind ('other'
    includes the start-up before the first shard), and the seconds after the last shard (config, index)."""
    out: dict = {}
    previous = row["started_unix"]
    for name, mtime in sorted(row["shard_mtimes"].items(), key=lambda item: item[1]):
        kind, nbytes = kinds[name]
        part = out.setdefault(kind, {"seconds": 0.0, "bytes": 0})
        part["seconds"] += mtime - previous
        part["bytes"] += nbytes
        previous = mtime
    out["after_last_shard_seconds"] = row["started_unix"] + row["seconds"] - previous
    return out


def _median_rate(rows: list[dict], kind: str) -> float | None:
    """Median seconds per byte of ``kind``'s shards over one-worker runs' timelines."""
    rates = [r["timeline"][kind]["seconds"] / r["timeline"][kind]["bytes"] for r in rows
             if r.get("timeline") and r["timeline"].get(kind, {}).get("bytes")]
    return statistics.median(rates) if rates else None


def _layer_shard_difference(rows: list[dict], lo: int, hi: int) -> float | None:
    """Seconds one more layer adds to the layer shards of one-worker runs' timelines (median at each count), or
    None where a count has no timeline."""
    at = {n: [r["timeline"]["layer"]["seconds"] for r in rows if r["layers"] == n and r.get("timeline")]
          for n in (lo, hi)}
    if hi <= lo or not at[lo] or not at[hi]:
        return None
    return (statistics.median(at[hi]) - statistics.median(at[lo])) / (hi - lo)


def extrapolate(runs: list[dict], full: dict, cores: int | None = None) -> dict:
    """The release's seconds per command (module docstring): everything but the Engram tables from the per-layer
    cost (``layer_costs``, else the one-worker timeline's layer rate), plus the Engram tables to go at the table's
    measured rate; each figure beside what it rests on, and its ratio to ``cp``'s."""
    b = full["bytes"]
    full_rest, full_engram = b["total"] - b["engram_table"], b["engram_table"]
    main = [r for r in runs if r["variant"] not in (CP_ENGRAM, CHECK_ENGRAM)]
    out: dict = {"full_model": full, "method": None, "seconds": {}, "per_layer": {}, "ratio_to_cp": {},
                 "seconds_if_reread": {}}
    if not main:
        out["method"] = "none: nothing ran"
        return out
    costs = layer_costs(main, cores, counted=lambda r: r["source_bytes"] - r["engram_bytes"])
    lo = costs["lo"]
    lo_rows = [r for r in main if r["layers"] == lo]
    lo_rest, lo_engram = lo_rows[0]["source_bytes"] - lo_rows[0]["engram_bytes"], lo_rows[0]["engram_bytes"]
    timed_lo = [r["timeline"]["layer"]["bytes"] / r["layers"] for r in lo_rows if r.get("timeline")]
    layer_bytes = costs["layer_bytes"] or (statistics.median(timed_lo) if timed_lo else None)
    if layer_bytes is None:
        out["method"] = f"none: one layer count (L={lo}) and no one-worker timeline to give a layer's cost"
        return out
    to_go = (full_rest - lo_rest) / layer_bytes
    engram_to_go = full_engram - lo_engram
    cp_engram = [r["seconds"] / r["source_bytes"] for r in runs if r["variant"] == CP_ENGRAM]
    check = [r["inner_seconds"] / r["source_bytes"] for r in runs if r["variant"] == CHECK_ENGRAM]
    out.update(lo=lo, hi=costs["hi"], layer_bytes=layer_bytes, layer_equivalents_to_go=to_go,
               engram_bytes_to_go=engram_to_go)
    out["method"] = (f"t(L={lo}) + {to_go:.1f} layer-equivalents ({(full_rest - lo_rest) / GB:.1f} GB: the release "
                     f"without its Engram tables, less the L={lo} source's, over {layer_bytes / GB:.2f} GB per layer) "
                     f"x per-layer seconds + {engram_to_go / GB:.1f} GB of Engram tables to go x the table's seconds "
                     f"per byte in the command's own run (cp: its copy of the table's shard). Per-layer seconds: the "
                     f"one-worker layer shards' time difference between L={lo} and L={costs['hi']} in the shard "
                     f"timeline (cp: its wall difference); more workers: the CPU-seconds "
                     f"difference / min(workers, {costs['cores']} cores); a command run at one count only: its layer "
                     f"shards' seconds per byte in the one-worker timeline. The DSpark stages count as layer bytes. "
                     f"A converter reads a kept table twice (the NaN check, then the copy): the scaled table's second "
                     f"read comes from the page cache; 'if re-read' adds a cold read and check of the tables to go "
                     f"(the check-engram run's rate), for when the release's 101 GB tables do not stay cached")
    commands = sorted({(r["variant"], r["workers"]) for r in main}, key=lambda k: (k[0] != CP, k))
    for variant, workers in commands:
        name = f"{variant}/w{workers}"
        mine = [r for r in main if (r["variant"], r["workers"]) == (variant, workers)]
        one_worker = [r for r in main if (r["variant"], r["workers"]) == (variant, 1)]
        layer_rate = _median_rate(one_worker, "layer")
        cost = dict(costs["per_layer"].get(name, {}))
        shards = _layer_shard_difference(one_worker, lo, costs["hi"]) if workers == 1 and variant != CP else None
        if cost and shards is not None:
            # the layer shards' own time: the wall difference also holds the start-up's noise (one run's 16 s
            # against the other's 9 s gave nvfp4 1.3 s per layer, below cp's 6.2, against 16 s in its timeline)
            cost["used_seconds"] = shards
            cost["basis"] = f"one-worker layer shards' difference between L={lo} and L={costs['hi']} (start-up excluded)"
        if not cost:
            lo_mine = [r["seconds"] for r in mine if r["layers"] == lo]
            if not lo_mine or layer_rate is None:
                continue
            cost = {"lo_seconds": statistics.median(lo_mine), "wall_seconds_difference": None,
                    "cpu_seconds_difference": None, "used_seconds": layer_rate * layer_bytes,
                    "basis": f"one-worker timeline at L={lo} (layer shards' seconds per byte)"}
        if variant == CP:
            engram_rate = statistics.median(cp_engram) if cp_engram else None
        else:
            engram_rate = _median_rate(one_worker, "engram_table")
        if engram_rate is None:
            continue
        cost["timeline_seconds"] = None if layer_rate is None or variant == CP else layer_rate * layer_bytes
        cost["engram_gb_per_s"] = 1 / engram_rate / GB if engram_rate else None
        cost["engram_seconds"] = engram_to_go * engram_rate
        reread = None if variant == CP or not check else engram_to_go * statistics.median(check)
        seconds = cost.pop("lo_seconds") + to_go * cost["used_seconds"] + cost["engram_seconds"]
        out["per_layer"][name] = {k: v if v is None or isinstance(v, str) else round(v, 2) for k, v in cost.items()}
        out["seconds"][name] = round(seconds, 1)
        if reread is not None:
            out["seconds_if_reread"][name] = round(seconds + reread, 1)
    base = out["seconds"].get(f"{CP}/w1")
    if base:
        out["ratio_to_cp"] = {k: round(v / base, 2) for k, v in out["seconds"].items()}
    return out


def _cell(value, fmt: str = "{}") -> str:
    return "" if value is None else fmt.format(value)


def markdown(result: dict) -> str:
    m = result["machine"]
    lines = ["# DeepSeek-V4.1-Flash conversions vs cp, real-size layers (cpu)", "",
             f"- machine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB; scratch {result['work_fs']}",
             f"- torch {m['torch']}, python {m['python']}; commit `{result['commit']}`",
             f"- command: `{result['command']}`",
             "- page cache: posix_fadvise(DONTNEED) on every source file before each timed command; each output "
             "deleted after it is measured",
             f"- synth (`--workers {result['synth_workers']}`): " +
             ", ".join(f"L={n}: {s} s" for n, s in result["synth_seconds"].items()), ""]
    lines += plan_lines(result["plan"]) + [""]
    if result["skipped"]:
        lines += ["Not run (`--deadline-s`): " + "; ".join(result["skipped"]), ""]
    lines += ["Every run, in the order it ran (x cp: against the mean of the `cp -r` runs of that layer count):", "",
              "| layers | source GB | command | workers | seconds | GB/s | x cp | CPU user s | CPU sys s | "
              "disk read GB | disk written GB | peak RSS total GB | largest process GB | output GB | load 1m |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["runs"]:
        disk = [_cell(r[k] and r[k] / GB, "{:.2f}") for k in ("disk_read_bytes", "disk_written_bytes")]
        lines.append(f"| {r['layers']} | {r['source_bytes'] / GB:.2f} | {r['variant']} | {r['workers']} | "
                     f"{r['seconds']:.1f} | {_cell(r['seconds'] and r['source_bytes'] / GB / r['seconds'], '{:.3f}')} "
                     f"| "
                     f"{_cell(r.get('ratio_to_cp'))} "
                     f"| {r['cpu_user_seconds']} | {r['cpu_system_seconds']} | {disk[0]} | {disk[1]} | "
                     f"{r['peak_rss_total'] / GB:.3f} | {r['peak_rss_single'] / GB:.3f} | {r['output_bytes'] / GB:.2f} "
                     f"| {r['load_avg_1m_before']} |")
    timed_rows = [r for r in result["runs"] if r.get("timeline")]
    if timed_rows:
        lines += ["", "One-worker shard timeline (seconds; GB/s of source bytes): start-up and embedding/head/vision "
                  "shards, the layer shards, the Engram table's shard, and the config and index after the last shard:",
                  "", "| layers | command | start-up + other s | layer shards s | layer GB/s | Engram shard s | "
                  "Engram GB/s | after last shard s |", "|---|---|---|---|---|---|---|---|"]
        for r in timed_rows:
            t = r["timeline"]
            parts = [t.get(k, {"seconds": 0.0, "bytes": 0}) for k in ("other", "layer", "engram_table")]
            rate = [f"{p['bytes'] / GB / p['seconds']:.2f}" if p["seconds"] > 0 else "" for p in parts]
            lines.append(f"| {r['layers']} | {r['variant']} | {parts[0]['seconds']:.1f} | {parts[1]['seconds']:.1f} | "
                         f"{rate[1]} | {parts[2]['seconds']:.2f} | {rate[2]} | {t['after_last_shard_seconds']:.1f} |")
    ex = result["extrapolation"]
    lines += ["", f"Full model ({ex['full_model']['bytes']['total'] / GB:.1f} GB), {ex['method']}:", "",
              "| command | minutes | x cp | per-layer s (used) | basis | wall s difference per layer | "
              "CPU s difference per layer | timeline per-layer s | Engram GB/s | Engram tables min | minutes if re-read |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, seconds in ex["seconds"].items():
        c = ex["per_layer"][name]
        lines.append(f"| {name} | {seconds / 60:.1f} | {_cell(ex['ratio_to_cp'].get(name))} | {c['used_seconds']} | "
                     f"{c['basis']} | {_cell(c['wall_seconds_difference'])} | {_cell(c['cpu_seconds_difference'])} | "
                     f"{_cell(c['timeline_seconds'])} | {_cell(c['engram_gb_per_s'], '{:.2f}')} | "
                     f"{c['engram_seconds'] / 60:.1f} | "
                     f"{_cell(ex['seconds_if_reread'].get(name) and ex['seconds_if_reread'][name] / 60, '{:.1f}')} |")
    return "\n".join(lines) + "\n"


def finish(result: dict, runs: list[dict], cores: int, args: argparse.Namespace) -> None:
    """Ratios, extrapolation and both files, from what has run so far (after every run: a stopped benchmark keeps
    what it measured)."""
    for row in runs:
        cps = [r["seconds"] for r in runs if r["variant"] == CP and r["layers"] == row["layers"]]
        row["ratio_to_cp"] = round(row["seconds"] / statistics.mean(cps), 2) \
            if cps and row["variant"] not in (CP_ENGRAM, CHECK_ENGRAM) else None
    result["runs"] = runs
    result["extrapolation"] = extrapolate(runs, result["plan"]["full_model"], cores)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = args.out_dir / f"convert-v41-{args.name}"
    plan_copy = {**result["plan"], "counts": [{k: v for k, v in c.items() if k != "config"}
                                              for c in result["plan"]["counts"]]}
    stem.with_suffix(".json").write_text(json.dumps({**result, "plan": plan_copy}, indent=2) + "\n")
    stem.with_suffix(".md").write_text(markdown(result))


def _fs(path: Path) -> str:
    """The file system holding ``path`` (type, device), from /proc/mounts."""
    best = ("", "?", "?")
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            device, mount, kind = line.split()[:3]
            if str(path).startswith(mount.rstrip("/") + "/") or str(path) == mount:
                best = max(best, (mount, kind, device), key=lambda b: len(b[0]))
    except OSError:
        pass
    return f"{best[1]} ({best[2]} on {best[0]})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", type=Path, default=RELEASE_CONFIG, help="the V4.1 config.json (default: the release's)")
    p.add_argument("--layers", type=int, nargs="+", default=[1, 2], help="layer counts (default 1 2)")
    p.add_argument("--workers", type=int, nargs="+", default=[1], help="converter worker counts (default 1)")
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    p.add_argument("--engram-rows", type=int, default=DEFAULT_ENGRAM_ROWS,
                   help=f"synth --engram-rows (default {DEFAULT_ENGRAM_ROWS:,}: 1.1 GB)")
    p.add_argument("--synth-workers", type=int, default=os.cpu_count() or 1, help="synth --workers (default: cores)")
    p.add_argument("--max-disk-gb", type=float, default=55.0,
                   help="leave out a run whose source and output exceed this (default 55)")
    p.add_argument("--deadline-s", type=float,
                   help="skip a step predicted (from its time at the other layer count, scaled by bytes) to end past "
                        "this many seconds after the start")
    p.add_argument("--work", type=Path, default=Path("bench-convert-v41-work"), help="scratch directory")
    p.add_argument("--out-dir", type=Path, default=REPO / "bench" / "results")
    p.add_argument("--name", default="cpu", help="results: <out-dir>/convert-v41-<name>.json and .md")
    p.add_argument("--dry-run", action="store_true", help="print the plan and the expected bytes; write nothing")
    p.add_argument("--check-table", nargs=2, type=Path, metavar=("SHARD", "DST"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.check_table:
        return check_table(*args.check_table)
    t_start = time.monotonic()
    config = json.loads(args.config.read_text())
    the_plan = plan(config, args.layers, args.engram_rows, args.variants, args.workers, args.max_disk_gb)
    work = args.work.resolve()
    probe = work if work.exists() else next(q for q in work.parents if q.exists())
    free = shutil.disk_usage(probe).free
    print("\n".join(plan_lines(the_plan, free)), flush=True)
    peak = max(c["peak_disk_bytes"] for c in the_plan["counts"])
    if args.dry_run:
        return
    if peak > free:
        raise SystemExit(f"error: the plan's peak {peak / GB:.1f} GB does not fit the {free / GB:.1f} GB free at "
                         f"{work}")
    work.mkdir(parents=True, exist_ok=True)
    cores = os.cpu_count() or 1
    result: dict = {"machine": _machine("cpu"), "commit": _commit(), "command": shlex.join(sys.argv),
                    "work_fs": _fs(work), "synth_workers": args.synth_workers, "synth_seconds": {}, "skipped": [],
                    "plan": the_plan}
    runs: list[dict] = []
    measured: dict[tuple, tuple[float, int]] = {}   # (step) -> (seconds, bytes) at the last count it ran

    def due(step: tuple, n: int, nbytes: int) -> bool:
        """Whether ``step`` may run at ``n`` layers before the deadline (predicted from its time at the other
        count, scaled by bytes)."""
        if args.deadline_s is None or step not in measured:
            return True
        seconds, at = measured[step]
        if time.monotonic() - t_start + seconds * nbytes / at <= args.deadline_s:
            return True
        result["skipped"].append(f"{'/w'.join(map(str, step))} at L={n} (predicted past the deadline)")
        return False

    for count in the_plan["counts"]:
        n, source = count["layers"], count["source"]
        if not due(("synth",), n, source["total"]):
            break
        src = work / f"src-{n}"
        t0 = time.monotonic()
        synth = subprocess.run([sys.executable, "-m", "dsv4convert", "synth", "--config", str(args.config),
                                "--num-layers", str(n), "--engram-rows", str(args.engram_rows), "--drafter", "none",
                                "--workers", str(args.synth_workers), "--dst", str(src), "--overwrite"],
                               capture_output=True, text=True)
        if synth.returncode:
            raise SystemExit(f"synth failed ({synth.returncode}):\n{(synth.stdout + synth.stderr)[-3000:]}")
        result["synth_seconds"][n] = round(time.monotonic() - t0, 1)
        print(f"{synth.stdout.strip()} in {result['synth_seconds'][n]} s", flush=True)
        measured[("synth",)] = (time.monotonic() - t0, source["total"])
        kinds = shard_kinds(src)
        engram_shard = next(name for name, (kind, _) in kinds.items() if kind == "engram_table")
        base = {"layers": n, "source_bytes": source["total"], "engram_bytes": source["engram_table"]}

        def cp() -> None:
            if due((CP,), n, source["total"]):
                row = timed(["cp", "-r", str(src), str(work / "cp-out")], src, work / "cp-out", then_sync=True)
                record(row | base | {"variant": CP, "workers": 1}, (CP,))

        def record(row: dict, step: tuple) -> None:
            measured[step] = (row["seconds"], row["source_bytes"])
            runs.append(row)
            finish(result, runs, cores, args)
            print(f"L={n} {row['variant']} w={row['workers']}: {row['seconds']} s, peak RSS "
                  f"{row['peak_rss_total'] / GB:.2f} GB", flush=True)

        cp()
        for planned in count["runs"]:
            variant, workers = planned["variant"], planned["workers"]
            if not due((variant, workers), n, source["total"]):
                continue
            cmd = [sys.executable, "-m", "dsv4convert", f"to-{variant}", *VARIANTS[variant], "--src", str(src),
                   "--dst", str(work / "out"), "--workers", str(workers), "--no-progress"]
            row = timed(cmd, src, work / "out", after=shard_mtimes) | base | {"variant": variant, "workers": workers}
            if workers == 1:
                row["timeline"] = timeline(row, kinds)
            record(row, (variant, workers))
        if due((CHECK_ENGRAM,), n, source["engram_table"]):
            out = work / "check-engram-out"
            row = timed([sys.executable, str(Path(__file__).resolve()), "--check-table", str(src / engram_shard),
                         str(out)], src, out, after=lambda d: {"inner_seconds": float((d / "seconds").read_text())})
            record(row | base | {"variant": CHECK_ENGRAM, "workers": 1, "source_bytes": source["engram_table"]},
                   (CHECK_ENGRAM,))
        if due((CP_ENGRAM,), n, source["engram_table"]):
            out = work / "cp-engram-out"
            row = timed(["sh", "-c", f"mkdir {shlex.quote(str(out))} && cp {shlex.quote(str(src / engram_shard))} "
                         f"{shlex.quote(str(out))}/"], src, out, then_sync=True)
            record(row | base | {"variant": CP_ENGRAM, "workers": 1, "source_bytes": source["engram_table"]},
                   (CP_ENGRAM,))
        cp()
        shutil.rmtree(src)
    finish(result, runs, cores, args)
    print(markdown(result))
    print(f"wrote {args.out_dir / f'convert-v41-{args.name}'}.json and .md; {time.monotonic() - t_start:.0f} s")


if __name__ == "__main__":
    main()
