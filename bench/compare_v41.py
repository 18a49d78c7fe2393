"""``dsv4convert compare`` on DeepSeek-V4.1-Flash: real-size layers, extrapolated to the release, against reading both.

For each layer count N (default 1 and 2), in turn (each count's checkpoints deleted before the next: the 2-layer pair
is 52 GB):

1. ``synth``: ``dsv4convert synth --config <V4.1 config> --num-layers N --engram-rows R --drafter none --workers W``
   (``bench/convert_v41.py``'s sources: the first N-1 layers and the release's layer 14, renumbered; 7.4 GB per layer,
   embedding, head and vision tower at real size, one Engram table scaled to about R rows: 1.1 GB by default, the
   release's are 101 GB each);
2. ``convert``: ``dsv4convert to-fp8 --engine sglang --workers W`` (MXFP4 -> FP8 experts, exact; the V4.1 converter
   refuses ``--device``: it runs on the CPU);
3. ``read``: ``cat`` of both checkpoints' files to /dev/null, the bytes a comparison reads at least. Nothing is
   dropped from the page cache first (``--evict``: ``posix_fadvise(DONTNEED)`` first, as ``bench/convert.py``):
   both checkpoints were just written and fit in memory, so cat and compare read them from the page cache, the
   release's 1.3 TB would come from the disk (``fincore``'s resident fraction is recorded before each read);
4. ``compare``: ``dsv4convert compare --device D`` of the variant against the base on ``--random-tokens`` for each
   ``--shapes`` entry (sequences x tokens), each in its own process: wall, CPU, peak host RSS of the process tree
   (polled, ``bench/convert.py::PeakRSS``), compare.json's engine seconds (read, forward, metrics) and peak GPU
   memory; the process runs compare through ``--probe``, which times each layer's read (both blocks built) and
   forward (base, variant, local and culprit passes) with a device sync at each edge.

The release (40 layers: 2 sliding-window, 38 compressed) is extrapolated from the 1 -> 2 layer runs two ways, each
beside the per-layer costs it rests on:

* **difference**: ``bench/convert.py::layer_costs`` of the process walls: t(1) + (the release's layer bytes of both
  checkpoints, less the 1-layer pair's) / the added layer's bytes x the wall the 2-layer run adds. The layer it adds
  is the release's layer 0 (ratio 0: sliding window only, no compressor, no indexer), the cheapest kind: a low figure;
* **by kind** (the headline): t(2) + the read seconds per byte the 2-layer run adds x the layer bytes to go + per
  layer to go its kind's forward: ratio 0 at the forward the 2-layer run adds, compressed at the probe's forward of
  layer 14 in the 2-layer run (warm: layer 0 ran first), an Engram layer, KV source, index source and candidate
  source at once, so an upper bound for the 37 other compressed layers.

The Engram tables (2 per checkpoint, 101 GB each) are not scaled with the layers. ``compare/v41.py`` reads a table
by the rows its sequences hash to (``model/v41/forward.py::V41Runner.load_block``: ``tokens x (max n-gram - 1) x
heads`` rows per table at most, megabytes), as in the measured runs, so both figures count nothing more for them
than t(N) holds. The DSpark stages (3, 7.9 GB in the base) are left out (``--drafter none``): the figure is
compare's text model, ``--no-mtp``'s (``compare/v41.py`` compares the drafter otherwise, a pass of its own that
``--dry-run``'s cost line counts and this benchmark does not time); the vision tower is not compared by
``compare/v41.py``: no cost is counted for either; the read time of both checkpoints counts every byte of both (the
goal's measure) and, beside it, the bytes compare reads.

    python bench/compare_v41.py --work "$PWD/.cmp-bench-work" --out-dir "$OUT" --deadline-s 480   # H200
    python bench/compare_v41.py --dry-run                                                            # the plan
    python bench/compare_v41.py --config tiny-v41 --device cpu --shapes 1x64 --work /tmp/w --out-dir /tmp/o  # smoke
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.convert import GB, REPO, PeakRSS, _commit, _machine, evict, layer_costs, resident_fraction  # noqa: E402
from bench.convert_v41 import RELEASE_CONFIG, _fs, inventory_bytes, kind_of, plan  # noqa: E402

GOAL_RATIO = 1.5       # issue #55: compare's whole-model time within 1.5x the time to read both checkpoints
VARIANT = "fp8"        # exact (MXFP4 codes -> FP8 128x128), the variant SGLang serves on sm90
# Guesses for --dry-run and the deadline before anything is measured (after the first count: its own times, scaled
# by bytes). synth draws a real-size layer on one core in about 30 s (synth --help).
ASSUMED = {"synth_fixed_s": 15.0, "synth_s_per_layer": 40.0, "convert_fixed_s": 10.0, "convert_gb_per_s_per_worker":
           0.35, "cat_gb_per_s": 2.0, "compare_fixed_s": 30.0, "compare_read_gb_per_s": 3.0,
           "compare_forward_s_per_layer_per_8k_tokens": 4.0}


# --------------------------------------------------------------------------------------------- configs, bytes


def load_config(spec: str | Path) -> dict:
    """A V4.1 config.json, or a ``synth`` preset's name (``tiny-v41``: smoke tests)."""
    from dsv4convert.models.deepseek_v41.presets import PRESETS

    return json.loads(json.dumps(PRESETS[str(spec)])) if str(spec) in PRESETS else json.loads(Path(spec).read_text())


def layer_roles(config: dict) -> list[dict]:
    """Per backbone layer: its compress ratio, kind (``sliding``: ratio 0, else ``compressed``) and roles."""
    from dsv4convert.models.deepseek_v41.config import read_config

    cfg = read_config(config, "bench config")
    out = []
    for i in range(cfg.num_hidden_layers):
        roles = [name for name, ids in (("Engram", cfg.engram_layer_ids), ("KV source", cfg.kv_source_layer_ids),
                                        ("index source", cfg.index_source_layer_ids)) if i in ids]
        if i == cfg.candidate_source_layer_id:
            roles.append("candidate source")
        out.append({"layer": i, "ratio": cfg.ratio(i), "kind": "sliding" if cfg.ratio(i) == 0 else "compressed",
                    "roles": roles})
    return out


def by_kind(names_bytes) -> dict[str, int]:
    """Bytes by ``convert_v41.kind_of`` (layer, engram_table, dspark, other) and in all."""
    out = {"layer": 0, "engram_table": 0, "dspark": 0, "other": 0}
    for name, nbytes in names_bytes:
        out[kind_of(name)] += nbytes
    out["total"] = sum(out.values())
    return out


def checkpoint_bytes(path: Path) -> dict[str, int]:
    from dsv4convert.checkpoint import Checkpoint

    return by_kind((e.name, e.nbytes) for e in Checkpoint.open(path).tensors.values())


def release(config: dict) -> dict:
    """The extrapolation's target: the config's layers by kind, both checkpoints' bytes by kind (the variant's from
    ``convert/v41.py::expected_outputs``), the Engram tables and what a run gathers of them."""
    from dsv4convert import dtypes
    from dsv4convert.convert.v41 import expected_outputs
    from dsv4convert.models.deepseek_v41.config import read_config

    cfg = read_config(config, "bench config")
    roles = layer_roles(config)
    base = inventory_bytes(config)
    variant = by_kind((n, dtypes.nbytes(d, s)) for n, (d, s) in expected_outputs(cfg, VARIANT).items())
    return {"layers": cfg.num_hidden_layers, "kinds": {k: sum(r["kind"] == k for r in roles)
                                                        for k in ("sliding", "compressed")},
            "dspark_stages": cfg.dspark.stages if cfg.dspark else 0, "engram_tables": len(cfg.engram_layer_ids),
            "engram_rows_per_token": (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads,
            "engram_rows": list(cfg.engram_num_embeddings),
            "engram_row_bytes": base["engram_table"] / max(1, sum(cfg.engram_num_embeddings)),
            "base_bytes": base, "variant_bytes": variant}


def both(record: dict, kind: str) -> int:
    return record["base_bytes"][kind] + record["variant_bytes"][kind]


# ------------------------------------------------------------------------------------------------ the plan


def shapes_of(text: str) -> list[tuple[int, int]]:
    return [tuple(int(x) for x in s.lower().split("x")) for s in text.split(",")]


def expected_seconds(count: dict, shapes: list[tuple[int, int]], workers: int, synth_workers: int) -> dict:
    """Guessed seconds of each stage at one layer count (``ASSUMED``)."""
    a, n = ASSUMED, count["layers"]
    src, out = count["source"]["total"], count["outputs"][VARIANT]
    exp = {"synth": a["synth_fixed_s"] + a["synth_s_per_layer"] * math.ceil(n / max(1, synth_workers)),
           "convert": a["convert_fixed_s"] + src / GB / (a["convert_gb_per_s_per_worker"] * min(workers, n + 1)),
           "read": (src + out) / GB / a["cat_gb_per_s"]}
    for s, t in shapes:
        exp[f"compare {s}x{t}"] = (a["compare_fixed_s"] + (src + out) / GB / a["compare_read_gb_per_s"]
                                   + n * a["compare_forward_s_per_layer_per_8k_tokens"] * s * t / 8192)
    return {k: round(v, 1) for k, v in exp.items()}


def plan_lines(p: dict, rel: dict, expected: dict, free: int | None) -> list[str]:
    b, v = rel["base_bytes"], rel["variant_bytes"]
    lines = [f"Release (the target): {rel['layers']} layers ({rel['kinds']['sliding']} sliding-window, "
             f"{rel['kinds']['compressed']} compressed) + {rel['dspark_stages']} DSpark stages (left out: --no-mtp's figure) + "
             f"{rel['engram_tables']} Engram tables; base {b['total'] / GB:.1f} GB (layers {b['layer'] / GB:.1f}, "
             f"Engram tables {b['engram_table'] / GB:.1f}, DSpark {b['dspark'] / GB:.1f}, embedding/head/vision "
             f"{b['other'] / GB:.1f}), to-{VARIANT} {v['total'] / GB:.1f} GB (layers {v['layer'] / GB:.1f})", "",
             f"Plan (one count at a time, deleted after; Engram tables of --engram-rows {p['engram_rows']:,}"
             + (f"; {free / GB:.1f} GB free at --work" if free is not None else "") + "):", "",
             f"| layers | base GB | of it Engram GB | to-{VARIANT} GB | peak disk GB | expected s (guess) |",
             "|---|---|---|---|---|---|"]
    for c in p["counts"]:
        e = expected[c["layers"]]
        lines.append(f"| {c['layers']} | {c['source']['total'] / GB:.2f} | {c['source']['engram_table'] / GB:.2f} | "
                     f"{c['outputs'][VARIANT] / GB:.2f} | {(c['source']['total'] + c['outputs'][VARIANT]) / GB:.1f} | "
                     + ", ".join(f"{k} {v:.0f}" for k, v in e.items()) + f"; all {sum(e.values()):.0f} |")
    total = sum(sum(e.values()) for e in expected.values())
    lines += ["", f"Expected in all: about {total / 60:.1f} min (guessed rates: {ASSUMED})"]
    return lines


def predict_chain(stage: str, n: int, planned: list[dict], done: dict, expected: dict, first: tuple[int, int]) -> float:
    """Predicted seconds of ``stage`` at ``n`` layers plus, for synth and convert, the rest of the chain a figure
    needs (synth, convert, the first shape's compare): each stage at the last count it ran, scaled by both
    checkpoints' bytes, else the plan's guess (``expected``)."""
    def nbytes(count: dict) -> int:
        return count["source"]["total"] + count["outputs"][VARIANT]

    measured: dict[str, tuple[float, int]] = {}
    for count in planned:                  # in order: the latest count's time wins
        rec = done.get(str(count["layers"]), {})
        for name, row in [*rec.get("stages", {}).items(),
                          *((f"compare {k}", v) for k, v in rec.get("compare", {}).items())]:
            measured[name] = (row["seconds"], nbytes(count))
    count = next(c for c in planned if c["layers"] == n)
    chain = [stage]
    if stage in ("synth", "convert"):
        chain += [s for s in ("convert", f"compare {first[0]}x{first[1]}") if s != stage]
    total = 0.0
    for name in chain:
        if name in measured:
            seconds, at = measured[name]
            total += seconds * nbytes(count) / at
        else:
            total += expected[n][name]
    return total


# ------------------------------------------------------------------------------------- the per-layer probe


def probe(out: Path, argv: list[str]) -> int:
    """``dsv4convert <argv>`` with each layer's read (both blocks built) and forward (every micro-batch's passes)
    timed, a device sync at each edge; ``out``: ``{layer: {"read": s, "forward": s}}``."""
    import torch

    from dsv4convert.cli import main as cli
    from dsv4convert.compare import v41
    from dsv4convert.model.v41.forward import V41Runner

    layers: dict[int, dict[str, float]] = {}

    def sync():
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()

    def timer(key: str, fn):
        def wrapped(self, i, *rest):
            sync()
            t0 = time.perf_counter()
            value = fn(self, i, *rest)
            sync()
            part = layers.setdefault(int(i), {"read": 0.0, "forward": 0.0})
            part[key] += time.perf_counter() - t0
            return value
        return wrapped

    V41Runner.load_block = timer("read", V41Runner.load_block)
    v41.Lockstep._layer = timer("forward", v41.Lockstep._layer)
    try:
        return cli(argv)
    finally:
        out.write_text(json.dumps({str(k): {p: round(s, 3) for p, s in v.items()} for k, v in sorted(layers.items())}))


# ------------------------------------------------------------------------------------------------ running


def timed_process(cmd: list[str], *, discard: bool = False) -> dict:
    """Run ``cmd``: wall and CPU seconds, peak RSS of the process tree, the output's tail (``discard``: stdout to
    /dev/null); raises on failure."""
    cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL if discard else subprocess.PIPE,
                            stderr=subprocess.PIPE if discard else subprocess.STDOUT, text=True, errors="replace")
    rss = PeakRSS(proc.pid)
    output, errors = proc.communicate()
    output = (output or "") + (errors or "")
    seconds = time.monotonic() - t0
    rss.stop()
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode:
        raise RuntimeError(f"failed ({proc.returncode}): {shlex.join(cmd)}\n{output[-3000:]}")
    return {"command": shlex.join(cmd), "seconds": round(seconds, 2), "peak_rss_total": rss.peak_total,
            "peak_rss_single": rss.peak_single, "cpu_user_seconds": round(cpu1.ru_utime - cpu0.ru_utime, 2),
            "cpu_system_seconds": round(cpu1.ru_stime - cpu0.ru_stime, 2), "output_tail": output[-1500:]}


def _fractions(values: list) -> list:
    """Resident fractions (fincore counts whole pages: a small file reads a little over 1)."""
    return [None if v is None else round(min(v, 1.0), 3) for v in values]


def dsv4(*args: str) -> list[str]:
    return [sys.executable, "-m", "dsv4convert", *args]


def run_count(count: dict, args: argparse.Namespace, config_path: Path, work: Path, result: dict, due) -> None:
    """Every stage at one layer count (``due(stage, n)``: whether it may start), results saved after each."""
    n = count["layers"]
    rec = result["counts"].setdefault(str(n), {"layers": n, "roles": layer_roles(count["config"]), "stages": {},
                                               "compare": {}})
    base, variant = work / f"base-{n}", work / f"{VARIANT}-{n}"
    need, free = count["source"]["total"] + count["outputs"][VARIANT], shutil.disk_usage(work).free
    if need > free:
        result["skipped"].append(f"L={n}: its checkpoints need {need / GB:.1f} GB, {free / GB:.1f} GB free at --work")
        return
    try:
        if not due("synth", n):
            return
        rec["stages"]["synth"] = timed_process(dsv4(
            "synth", "--config", str(config_path), "--num-layers", str(n), "--engram-rows", str(args.engram_rows),
            "--drafter", "none", "--workers", str(args.synth_workers), "--dst", str(base), "--overwrite"))
        rec["base_bytes"] = checkpoint_bytes(base)
        save(result, args)
        if not due("convert", n):
            return
        rec["stages"]["convert"] = timed_process(dsv4(
            f"to-{VARIANT}", "--engine", "sglang", "--src", str(base), "--dst", str(variant), "--workers",
            str(args.workers), "--no-progress", "--overwrite"))
        rec["variant_bytes"] = checkpoint_bytes(variant)
        save(result, args)
        files = sorted(str(p) for d in (base, variant) for p in d.iterdir() if p.is_file())
        if due("read", n):
            resident = [evict(d) if args.evict else resident_fraction(d) for d in (base, variant)]
            row = timed_process(["cat", *files], discard=True)     # to /dev/null
            row["resident_fraction_before"] = _fractions(resident)
            row["bytes"] = sum(Path(f).stat().st_size for f in files)
            rec["stages"]["read"] = row
            save(result, args)
        for s, t in shapes_of(args.shapes):
            shape = f"{s}x{t}"
            if not due(f"compare {shape}", n):
                continue
            resident = [evict(d) if args.evict else resident_fraction(d) for d in (base, variant)]
            report, layers = work / f"report-{n}-{shape}", work / f"layers-{n}-{shape}.json"
            row = timed_process([sys.executable, str(Path(__file__).resolve()), "--probe", str(layers), "compare",
                                 "--base", str(base), "--variant", str(variant), "--random-tokens", "--tokens",
                                 str(s * t), "--seq-len", str(t), "--batch-size", str(args.batch_size),
                                 "--device", args.device, "--gpu-family", args.gpu_family, "--no-progress",
                                 "--report", str(report)])
            out = json.loads((report / "compare.json").read_text())
            row.update(resident_fraction_before=_fractions(resident), layers=json.loads(layers.read_text()),
                       result={k: out.get(k) for k in ("seconds", "peak_device_bytes", "settings", "data")},
                       estimate={k: out["estimate"][k] for k in ("seconds", "peak_device_bytes", "peak_host_bytes",
                                                                 "bytes_to_read")},
                       output={"kld_mean": out["output"]["kld"]["mean"], "same_top1": out["output"]["same_top1"]},
                       culprit=out["v41"]["culprit"].get("sentence"))
            rec["compare"][shape] = row
            args.out_dir.mkdir(parents=True, exist_ok=True)
            shutil.copy(report / "compare.md", args.out_dir / f"compare-v41-{args.name}-L{n}-{shape}-report.md")
            save(result, args)
    except RuntimeError as error:          # a failed command: recorded, the next count still runs
        rec["error"] = str(error)[-3000:]
        result["skipped"].append(f"the rest of L={n}: {str(error).splitlines()[0]}")
        print(error, file=sys.stderr, flush=True)
    finally:
        for d in (base, variant):
            shutil.rmtree(d, ignore_errors=True)


# ------------------------------------------------------------------------------------------- extrapolation


def kind_counts(roles: list[dict]) -> dict[str, int]:
    return {k: sum(r["kind"] == k for r in roles) for k in ("sliding", "compressed")}


def extrapolate(counts: dict, rel: dict, shape: str) -> dict:
    """The release's seconds for one shape from the runs at two layer counts (module docstring), each figure beside
    the per-layer costs it rests on, and its ratio to reading both checkpoints at cat's measured rate."""
    runs = sorted((c for c in counts.values() if shape in c.get("compare", {})), key=lambda c: c["layers"])
    out: dict = {"shape": shape, "method": None}
    if len(runs) < 2:
        out["method"] = f"none: {shape} ran at {len(runs)} layer count(s); the per-layer cost needs two"
        return out
    lo, hi = runs[0], runs[-1]
    # the engine's wall (compare.json: inside the run, after the imports and the plan), not the process's: the first
    # process pays the imports' first compile and the page cache's misses on the libraries
    rows = [{"variant": shape, "workers": 1, "layers": c["layers"],
             "seconds": c["compare"][shape]["result"]["seconds"]["wall"],
             "cpu_user_seconds": c["compare"][shape]["cpu_user_seconds"],
             "cpu_system_seconds": c["compare"][shape]["cpu_system_seconds"], "source_bytes": both(c, "layer")}
            for c in (lo, hi)]
    costs = layer_costs(rows, 1)
    cost = costs["per_layer"][f"{shape}/w1"]
    added = hi["layers"] - lo["layers"]
    layer_bytes = costs["layer_bytes"]
    rel_layers = rel["base_bytes"]["layer"] + rel["variant_bytes"]["layer"]
    to_go = (rel_layers - both(lo, "layer")) / layer_bytes
    difference = lo["compare"][shape]["seconds"] + to_go * cost["used_seconds"]

    e_lo, e_hi = lo["compare"][shape]["result"]["seconds"], hi["compare"][shape]["result"]["seconds"]
    read_per_byte = (e_hi["read"] - e_lo["read"]) / (both(hi, "layer") - both(lo, "layer"))
    added_kinds = {k: v - kind_counts(lo["roles"])[k] for k, v in kind_counts(hi["roles"]).items()}
    forward: dict[str, dict] = {}
    for kind, k in added_kinds.items():
        if k == added:     # every added layer is of this kind: the forward it adds, warm-up cancelled
            forward[kind] = {"seconds": (e_hi["forward"] - e_lo["forward"]) / added,
                             "basis": f"forward the {hi['layers']}-layer run adds, per layer"}
    probe = hi["compare"][shape].get("layers") or {}
    for kind in ("sliding", "compressed"):
        if kind in forward:
            continue
        warm = [probe[str(r["layer"])]["forward"] for r in hi["roles"] if r["kind"] == kind and r["layer"] > 0
                and str(r["layer"]) in probe]
        first = [probe[str(r["layer"])]["forward"] for r in hi["roles"] if r["kind"] == kind and str(r["layer"])
                 in probe]
        if warm:
            layer = next(r for r in hi["roles"] if r["kind"] == kind and r["layer"] > 0)
            forward[kind] = {"seconds": statistics.median(warm), "basis": f"probe, L={hi['layers']} layers."
                             f"{layer['layer']} (ratio {layer['ratio']}: {', '.join(layer['roles']) or 'no role'}), "
                             "warm: an upper bound for its kind where it holds every role"}
        elif first:
            forward[kind] = {"seconds": statistics.median(first), "basis": "probe, first layer of the run (warm-up "
                             "included): an upper bound"}
        else:
            forward[kind] = {"seconds": e_hi["forward"] / hi["layers"], "basis": "the run's forward per layer"}
    hi_kinds = kind_counts(hi["roles"])
    kind_to_go = {k: rel["kinds"][k] - hi_kinds[k] for k in hi_kinds}
    read_to_go = read_per_byte * (rel_layers - both(hi, "layer"))
    by_kinds = hi["compare"][shape]["seconds"] + read_to_go + sum(kind_to_go[k] * forward[k]["seconds"]
                                                                 for k in kind_to_go)
    # Engram tables: gathered by row in the measured runs as on the release (counted: nothing more)
    tables_both = rel["base_bytes"]["engram_table"] + rel["variant_bytes"]["engram_table"]
    s, t = (int(x) for x in shape.split("x"))
    gathered = min(max(rel["engram_rows"], default=0), s * t * rel["engram_rows_per_token"]) * rel["engram_row_bytes"]
    # reading both checkpoints at cat's measured rate (the highest count's, else the lowest's)
    reads = [c["stages"]["read"] for c in (hi, lo) if "read" in c["stages"]]
    rate = reads[0]["bytes"] / reads[0]["seconds"] if reads and reads[0]["seconds"] > 0 else None
    whole_both = rel["base_bytes"]["total"] + rel["variant_bytes"]["total"]
    compared_both = whole_both - tables_both - rel["base_bytes"]["dspark"] - rel["variant_bytes"]["dspark"]
    read_all = whole_both / rate if rate else None
    out.update(
        lo=lo["layers"], hi=hi["layers"], layer_bytes_both=layer_bytes, layer_equivalents_to_go=round(to_go, 2),
        per_layer={"difference_wall_seconds": round(cost["used_seconds"], 3), "basis": cost["basis"],
                   "read_seconds_per_gb": round(read_per_byte * GB, 4),
                   "forward": {k: {**v, "seconds": round(v["seconds"], 3)} for k, v in forward.items()}},
        seconds={"difference": round(difference, 1), "by_kind": round(by_kinds, 1)},
        by_kind_parts={"t_hi": hi["compare"][shape]["seconds"], "read_to_go": round(read_to_go, 1),
                       "forward_to_go": {k: round(kind_to_go[k] * forward[k]["seconds"], 1) for k in kind_to_go},
                       "layers_to_go": kind_to_go},
        engram={"tables_bytes_both": tables_both, "measured_table_bytes_both": both(hi, "engram_table"),
                "gathered_bytes_per_table_at_most": gathered},
        read_both={"cat_gb_per_s": round(rate / GB, 3) if rate else None, "bytes": whole_both,
                   "seconds": round(read_all, 1) if read_all else None, "compared_bytes": compared_both,
                   "compared_seconds": round(compared_both / rate, 1) if rate else None},
        ratio={k: round(v / read_all, 2) for k, v in (("difference", difference), ("by_kind", by_kinds))}
        if read_all else {})
    out["goal_met"] = out["ratio"].get("by_kind", math.inf) <= GOAL_RATIO if read_all else None
    out["method"] = (f"difference: t(L={lo['layers']}) + {to_go:.1f} layer-equivalents of bytes x the engine wall "
                     f"the L={hi['layers']} run adds (release layer 0, ratio 0: a low figure); by kind: t(L="
                     f"{hi['layers']}) + the layer bytes to go x the read seconds per byte the L={hi['layers']} run "
                     f"adds + per layer to go its kind's forward (Engram tables: rows gathered, nothing more counted; "
                     f"DSpark stages (left out: --no-mtp's figure) and vision tower: not counted)")
    return out


# ------------------------------------------------------------------------------------------------- report


def _gb(x) -> str:
    return "" if x is None else f"{x / GB:.2f}"


def _gib(x) -> str:
    return "" if x is None else f"{x / 2**30:.1f}"


def markdown(result: dict) -> str:
    m = result["machine"]
    rel = result["release"]
    lines = [f"# `dsv4convert compare` on DeepSeek-V4.1-Flash, real-size layers ({result['device']})", "",
             f"- machine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB"
             + (f", {m['gpu']} ({_gib(m.get('gpu_memory_bytes'))} GiB)" if "gpu" in m else ""),
             f"- torch {m['torch']}, python {m['python']}; commit `{result['commit']}`"
             + (f" (DSV4_COMMIT {result['commit_env']})" if result.get("commit_env") else ""),
             f"- command: `{result['command']}`; scratch {result['work_fs']}",
             f"- variant: `to-{VARIANT} --engine sglang` (exact: KLD 0 expected); compare `--gpu-family "
             f"{result['gpu_family']} --random-tokens --batch-size {result['batch_size']}`",
             f"- Engram tables scaled to --engram-rows {result['engram_rows']:,} (the release's: 384M rows, 101 GB "
             "each); DSpark drafter left out (`--drafter none`): the text model's figure, compare --no-mtp's",
             "- page cache: " + ("posix_fadvise(DONTNEED) on both checkpoints before cat and each compare" if
                                 result["evict"] else "nothing dropped: both checkpoints were just written and fit "
                                 "in memory, so cat and compare read them from the page cache (resident fractions "
                                 "below); the release's would come from the disk"), ""]
    if result["skipped"]:
        lines += ["Not run (`--deadline-s`): " + "; ".join(result["skipped"]), ""]
    lines += ["| layers | synth s | to-fp8 s (workers) | base GB | variant GB | cat s | cat GB/s | resident before cat |",
              "|---|---|---|---|---|---|---|---|"]
    for c in result["counts"].values():
        st = c["stages"]
        rd = st.get("read")
        rate = f"{rd['bytes'] / GB / rd['seconds']:.2f}" if rd and rd["seconds"] > 0 else ""
        lines.append(f"| {c['layers']} | {st['synth']['seconds'] if 'synth' in st else ''} | "
                     f"{st['convert']['seconds'] if 'convert' in st else ''} ({result['workers']}) | "
                     f"{_gb(c.get('base_bytes', {}).get('total'))} | {_gb(c.get('variant_bytes', {}).get('total'))} | "
                     f"{rd['seconds'] if rd else ''} | {rate} | "
                     f"{' / '.join(map(str, rd['resident_fraction_before'])) if rd else ''} |")
    lines += ["", "Compare runs (each its own process; engine seconds from compare.json):", "",
              "| layers | shape | wall s | engine read s | forward s | metrics s | peak host RSS GB | peak GPU GiB "
              "(estimate) | KLD mean | same top-1 | per layer: read / forward s | resident before |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in result["counts"].values():
        for shape, r in c["compare"].items():
            e = r["result"]["seconds"]
            per = "; ".join(f"layers.{i} (ratio {c['roles'][int(i)]['ratio']}) {v['read']:.2f} / {v['forward']:.2f}"
                            for i, v in r["layers"].items())
            lines.append(f"| {c['layers']} | {shape} | {r['seconds']} | {e.get('read', 0):.2f} | "
                         f"{e.get('forward', 0):.2f} | {e.get('metrics', 0):.2f} | {r['peak_rss_total'] / GB:.1f} | "
                         f"{_gib(r['result']['peak_device_bytes'])} ({_gib(r['estimate']['peak_device_bytes'])}) | "
                         f"{r['output']['kld_mean']:.3g} | {r['output']['same_top1']:.4f} | {per} | "
                         f"{' / '.join(map(str, r['resident_fraction_before']))} |")
    for shape, x in result["extrapolation"].items():
        lines += ["", f"## Release, {shape} tokens", ""]
        if x["method"].startswith("none"):
            lines.append(x["method"])
            continue
        p, rb, en = x["per_layer"], x["read_both"], x["engram"]
        lines += [f"Method: {x['method']}.", "",
                  f"Per-layer costs: engine wall the L={x['hi']} run adds {p['difference_wall_seconds']} s per "
                  f"{x['layer_bytes_both'] / GB:.2f} GB of both checkpoints' layer bytes; read "
                  f"{p['read_seconds_per_gb']} s/GB; forward "
                  + "; ".join(f"{k} {v['seconds']} s ({v['basis']})" for k, v in p["forward"].items()) + ".", "",
                  f"- by kind (headline): **{x['seconds']['by_kind'] / 60:.1f} min** = t(L={x['hi']}) "
                  f"{x['by_kind_parts']['t_hi']} s + read to go {x['by_kind_parts']['read_to_go']} s + forward to go "
                  + ", ".join(f"{x['by_kind_parts']['layers_to_go'][k]} {k} {v} s"
                              for k, v in x["by_kind_parts"]["forward_to_go"].items()),
                  f"- difference (every layer at the added ratio-0 layer's wall: low): "
                  f"{x['seconds']['difference'] / 60:.1f} min",
                  f"- Engram tables ({en['tables_bytes_both'] / GB:.0f} GB in both): counted as gathered rows "
                  f"(at most {_gb(en['gathered_bytes_per_table_at_most'])} GB per table for this shape), as "
                  "compare reads them",
                  f"- reading both checkpoints ({rb['bytes'] / GB:.0f} GB, every byte) at cat's "
                  f"{rb['cat_gb_per_s']} GB/s: {rb['seconds']} s; without the Engram tables and DSpark stages "
                  f"({rb['compared_bytes'] / GB:.0f} GB): {rb['compared_seconds']} s",
                  f"- ratio to reading both: by kind **{x['ratio'].get('by_kind')}x**, difference "
                  f"{x['ratio'].get('difference')}x; goal at most {GOAL_RATIO}x -> "
                  f"{'met' if x['goal_met'] else 'MISSED' if x['goal_met'] is False else 'unknown'}"]
    lines += ["", "Plan:", "", *plan_lines(result["plan"], rel, result["expected"], None)]
    return "\n".join(lines) + "\n"


def save(result: dict, args: argparse.Namespace) -> None:
    """Both files, from what has run so far (after every stage: a stopped benchmark keeps what it measured)."""
    result["extrapolation"] = {f"{s}x{t}": extrapolate(result["counts"], result["release"], f"{s}x{t}")
                               for s, t in shapes_of(args.shapes)}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = args.out_dir / f"compare-v41-{args.name}"
    plan_copy = {**result["plan"], "counts": [{k: v for k, v in c.items() if k != "config"}
                                              for c in result["plan"]["counts"]]}
    stem.with_suffix(".json").write_text(json.dumps({**result, "plan": plan_copy}, indent=1) + "\n")
    stem.with_suffix(".md").write_text(markdown(result))


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--probe":
        return probe(Path(sys.argv[2]), sys.argv[3:])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(RELEASE_CONFIG),
                   help="a V4.1 config.json or a synth preset (tiny-v41: smoke tests); default: the release's")
    p.add_argument("--layers", type=int, nargs="+", default=[1, 2], help="layer counts (default 1 2)")
    p.add_argument("--shapes", default="1x8192", help="sequences x tokens per comparison, comma-separated")
    p.add_argument("--device", default="cuda", help="compare --device (default cuda)")
    p.add_argument("--gpu-family", default="sm90", help="compare --gpu-family (default sm90: H100/H200)")
    p.add_argument("--batch-size", type=int, default=1, help="compare --batch-size (default 1)")
    p.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1), help="to-fp8 --workers")
    p.add_argument("--synth-workers", type=int, default=os.cpu_count() or 1, help="synth --workers (default: cores)")
    from dsv4convert.models.deepseek_v41.presets import DEFAULT_ENGRAM_ROWS

    p.add_argument("--engram-rows", type=int, default=DEFAULT_ENGRAM_ROWS,
                   help=f"synth --engram-rows (default {DEFAULT_ENGRAM_ROWS:,}: 1.1 GB per table)")
    p.add_argument("--evict", action="store_true", help="drop both checkpoints from the page cache before cat and "
                   "each compare (default: drop nothing)")
    p.add_argument("--deadline-s", type=float, help="skip a stage predicted to end past this many seconds after "
                   "the start (the rest of a count's synth-convert-compare chain must fit too)")
    p.add_argument("--work", type=Path, default=Path(".cmp-bench-work"), help="scratch directory")
    p.add_argument("--out-dir", type=Path, default=REPO / "bench" / "results")
    p.add_argument("--name", help="results: <out-dir>/compare-v41-<name>.json and .md (default: the device type)")
    p.add_argument("--dry-run", action="store_true", help="print the plan, disk and expected time; write nothing")
    args = p.parse_args()
    args.name = args.name or ("h200" if args.device.startswith("cuda") else args.device)
    t_start = time.monotonic()
    config = load_config(args.config)
    the_plan = plan(config, args.layers, args.engram_rows, [VARIANT], [args.workers], 1e6)
    rel = release(config)
    shapes = shapes_of(args.shapes)
    expected = {c["layers"]: expected_seconds(c, shapes, args.workers, args.synth_workers) for c in the_plan["counts"]}
    work = args.work.resolve()
    probe_dir = work if work.exists() else next(q for q in work.parents if q.exists())
    free = shutil.disk_usage(probe_dir).free
    print("\n".join(plan_lines(the_plan, rel, expected, free)), flush=True)
    peak = max(c["source"]["total"] + c["outputs"][VARIANT] for c in the_plan["counts"])
    if args.dry_run:
        fits = "fits" if peak <= free else "does NOT fit"
        print(f"dry run: peak disk {peak / GB:.1f} GB {fits} the {free / GB:.1f} GB free at {work}; nothing written")
        return 0
    if peak > free:
        print(f"warning: the plan's peak {peak / GB:.1f} GB does not fit the {free / GB:.1f} GB free at {work}: a count "
              "that does not fit when it starts is skipped", flush=True)
    work.mkdir(parents=True, exist_ok=True)
    # byte-compile first (not timed): a fresh copy of the repository would otherwise compile in the first stages
    subprocess.run([sys.executable, "-m", "compileall", "-q", "-j", "0", str(REPO / "dsv4convert")], check=False)
    config_path = work / "config.json"
    config_path.write_text(json.dumps(config))
    machine = _machine(args.device)
    if args.device.startswith("cuda"):
        import torch

        if torch.cuda.is_available():
            machine["gpu_memory_bytes"] = torch.cuda.get_device_properties(0).total_memory
    result: dict = {"machine": machine, "commit": _commit(), "commit_env": os.environ.get("DSV4_COMMIT"),
                    "command": shlex.join(sys.argv), "device": args.device, "work_fs": _fs(work),
                    "gpu_family": args.gpu_family, "batch_size": args.batch_size, "workers": args.workers,
                    "engram_rows": args.engram_rows, "evict": args.evict, "assumed": ASSUMED, "skipped": [],
                    "plan": the_plan, "expected": expected, "release": rel, "counts": {}}
    def due(stage: str, n: int) -> bool:
        elapsed = time.monotonic() - t_start
        seconds = predict_chain(stage, n, the_plan["counts"], result["counts"], expected, shapes[0])
        if args.deadline_s is None or elapsed + seconds <= args.deadline_s:
            return True
        result["skipped"].append(f"{stage} at L={n} (it and the rest of its count's synth-convert-compare chain "
                                 f"predicted to take {seconds:.0f} s, {elapsed:.0f} s in, deadline "
                                 f"{args.deadline_s:.0f} s)")
        return False

    try:
        for count in the_plan["counts"]:
            run_count(count, args, config_path, work, result, due)
    finally:
        save(result, args)
    print(markdown(result))
    print(f"wrote {args.out_dir / f'compare-v41-{args.name}'}.json and .md; {time.monotonic() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
