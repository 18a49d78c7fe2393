"""Conversion wall time against ``cp`` of the same bytes, peak memory, full-model extrapolation.

Synthesizes real-size DeepSeek-V4-Flash layers (``dsv4convert synth --config <real config>
--num-layers N --no-mtp``; about 3.6 GB per layer shard, plus 1 GB each for the embedding
and the head), then, for each layer count, times in one run: ``cp -r`` of the source
followed by ``sync`` (our converter fsyncs every shard, so cp must land on disk too), and
every ``to-*`` command with each worker count, as a separate process. Before every timed
command the source's pages are evicted from the page cache with
``posix_fadvise(DONTNEED)`` (``/proc/sys/vm/drop_caches`` needs root), so cp and the
converters all read a cold source; ``fincore`` reports how much stayed resident.

Smaller layer counts are made from the largest synthesized one by hard-linking its
embedding, first layers and head shards under a new index and config: ``synth`` derives
every tensor from (seed, name) alone, so these are the bytes ``synth --num-layers N`` would
write (only the shard file names differ).

With ``--repeat R`` the converters run R rounds, each bracketed by cp runs (cp, round 1,
cp, round 2, ..., cp): a shared disk's throughput drifts by tens of percent within minutes,
so each converter run is compared with the mean of the two cp runs around it, and the summary
gives the median ratio over the rounds with its range.

Recorded per run: wall seconds, source GB/s, that ratio to cp, CPU seconds (user and
system, of the command and its children), the bytes the source's disk read and wrote
(``/proc/diskstats``; other processes' I/O counts too), peak RSS (sum over the process tree,
and the largest single process, polled every 50 ms with psutil), output bytes, and the
machine load average. Results go to ``<out-dir>/convert-<device>.json`` and ``.md``; the full
46-shard model is extrapolated from the per-layer difference between layer counts of the
median times.

    python bench/convert.py --layers 1 2                         # CPU, all variants, 1 and 2 workers
    python bench/convert.py --layers 1 2 --variants nvfp4 --workers 1 --repeat 3
    python bench/convert.py --layers 1 --device cuda --workers 1
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import shlex
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from dsv4convert.checkpoint import Checkpoint, atomic_write_json
from dsv4convert.checkpoint.writer import write_index
from dsv4convert.models.deepseek_v4.layout import ModelConfig, native_groups
from dsv4convert.models.deepseek_v4.configs import with_num_layers
from dsv4convert.synth import REFERENCE_CONFIG_PATH, reference_config

REPO = Path(__file__).resolve().parent.parent
VARIANTS = ("nvfp4", "fp8", "w4a16", "bf16")
GB = 1e9


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _commit() -> str:
    dirty = _git("status", "--porcelain", "--", "dsv4convert", "bench/convert.py")
    return _git("rev-parse", "HEAD") + ("-dirty" if dirty else "")


def _machine(device: str) -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    info = {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
            "python": platform.python_version(), "platform": platform.platform()}
    import torch

    info["torch"] = torch.__version__
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def _size(root: Path) -> int:
    return sum(p.stat().st_size for p in _files(root))


def evict(root: Path) -> float | None:
    """Drop ``root``'s pages from the page cache; returns the fraction still resident (None: unknown)."""
    os.sync()
    for path in _files(root):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return resident_fraction(root)


def resident_fraction(root: Path) -> float | None:
    """The fraction of ``root``'s shards' bytes in the page cache (``fincore``; None: unknown)."""
    if shutil.which("fincore") is None:
        return None
    shards = [str(p) for p in _files(root) if p.suffix == ".safetensors"]
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES,SIZE", *shards],
                         capture_output=True, text=True)
    if out.returncode:
        return None
    resident = total = 0
    for line in out.stdout.split("\n"):
        if line.strip():
            res, size = line.split()
            resident, total = resident + int(res), total + int(size)
    return resident / total if total else 0.0


class PeakRSS:
    """Polls a process tree's resident memory: peak of the sum, and of the largest process."""

    def __init__(self, pid: int, interval: float = 0.05):
        self.root = psutil.Process(pid)
        self.interval = interval
        self.peak_total = self.peak_single = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.is_set():
            try:
                procs = [self.root, *self.root.children(recursive=True)]
            except psutil.NoSuchProcess:
                return
            sizes = []
            for proc in procs:
                try:
                    sizes.append(proc.memory_info().rss)
                except psutil.NoSuchProcess:
                    continue
            if sizes:
                self.peak_total = max(self.peak_total, sum(sizes))
                self.peak_single = max(self.peak_single, max(sizes))
            self._stop.wait(self.interval)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def disk_bytes(path: Path) -> tuple[int, int] | None:
    """Bytes read and written so far by the block device holding ``path`` (None: not found)."""
    dev = os.stat(path).st_dev
    major, minor = os.major(dev), os.minor(dev)
    try:
        lines = Path("/proc/diskstats").read_text().splitlines()
    except OSError:
        return None
    stats = {(int(f[0]), int(f[1])): f for f in (line.split() for line in lines)}
    fields = stats.get((major, minor))
    if fields is None:  # a file system on no block device (tmpfs, overlay)
        return None
    return int(fields[5]) * 512, int(fields[9]) * 512


def timed(cmd: list[str], src: Path, dst: Path, *, then_sync: bool = False,
          after: Callable[[Path], dict] | None = None) -> dict:
    """Run ``cmd`` on a cold ``src`` into a fresh ``dst``; wall and CPU time, disk I/O, peak RSS, output size, and
    what ``after`` finds in ``dst`` (before it is deleted)."""
    if dst.exists():
        shutil.rmtree(dst)
    resident = evict(src)
    load = os.getloadavg()[0]
    cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    disk0 = disk_bytes(src)
    started, t0 = time.time(), time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    rss = PeakRSS(proc.pid)
    output, _ = proc.communicate()
    if then_sync and proc.returncode == 0:
        os.sync()
    seconds = time.monotonic() - t0
    disk1 = disk_bytes(src)
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    rss.stop()
    if proc.returncode:
        raise SystemExit(f"command failed ({proc.returncode}): {shlex.join(cmd)}\n{output[-3000:]}")
    row = {"command": shlex.join(cmd), "seconds": round(seconds, 2), "peak_rss_total": rss.peak_total,
           "peak_rss_single": rss.peak_single, "output_bytes": _size(dst), "load_avg_1m_before": round(load, 2),
           "cpu_user_seconds": round(cpu1.ru_utime - cpu0.ru_utime, 2),
           "cpu_system_seconds": round(cpu1.ru_stime - cpu0.ru_stime, 2),
           "disk_read_bytes": None if disk0 is None else disk1[0] - disk0[0],
           "disk_written_bytes": None if disk0 is None else disk1[1] - disk0[1],
           "source_resident_fraction_before": None if resident is None else round(resident, 4),
           "started_unix": started, **(after(dst) if after else {})}
    shutil.rmtree(dst)
    return row


def synthesize(dst: Path, layers: int) -> float:
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-m", "dsv4convert", "synth", "--config", str(REFERENCE_CONFIG_PATH),
                    "--num-layers", str(layers), "--no-mtp", "--dst", str(dst), "--overwrite"], check=True)
    return time.monotonic() - t0


def derive_prefix(full: Path, dst: Path, layers: int) -> None:
    """A ``layers``-layer checkpoint made of hard links to ``full``'s embedding, first layers and head."""
    link_checkpoint(full, dst, with_num_layers(reference_config(), layers, mtp=False))


def link_checkpoint(full: Path, dst: Path, config: dict) -> Path:
    """The checkpoint ``config`` describes, made of hard links into ``full``'s shards (which must hold every tensor
    it names), with its small files copied."""
    wanted = {spec.name for group in native_groups(ModelConfig.from_dict(config)) for spec in group}
    ckpt = Checkpoint.open(full)
    missing = sorted(wanted - set(ckpt.tensors))
    if missing:
        raise SystemExit(f"{full} lacks {missing[0]} (and {len(missing) - 1} more)")
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    weight_map = {}
    for name in wanted:
        entry = ckpt.tensors[name]
        weight_map[name] = entry.path.name
        if not (dst / entry.path.name).exists():
            os.link(entry.path, dst / entry.path.name)
    for small in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        if (full / small).exists():
            shutil.copy(full / small, dst / small)
    atomic_write_json(dst / "config.json", config)
    write_index(dst, weight_map, sum(ckpt.tensors[n].nbytes for n in wanted))
    return dst


def full_model_bytes() -> tuple[int, int]:
    groups = native_groups(ModelConfig.from_dict(reference_config()))
    return sum(s.nbytes for g in groups for s in g), len(groups)


def run(args: argparse.Namespace) -> dict:
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    top = max(args.layers)
    full_src = args.source.resolve() if args.source else work / f"src-{top}"
    result: dict = {"machine": _machine(args.device), "commit": _commit(), "command": shlex.join(sys.argv),
                    "device": args.device, "cold_cache": "posix_fadvise(DONTNEED) on every source file before "
                    "each timed command", "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "runs": []}
    if args.source is None:
        result["synth_seconds"] = {top: round(synthesize(full_src, top), 1)}
    if ModelConfig.from_dict(Checkpoint.open(full_src).config).num_hidden_layers != top:
        raise SystemExit(f"{full_src} does not hold {top} layers")
    for layers in sorted(args.layers):
        src = full_src if layers == top else work / f"src-{layers}"
        if layers != top:
            derive_prefix(full_src, src, layers)
        source_bytes = _size(src)
        def cp() -> dict:
            return timed(["cp", "-r", str(src), str(work / "cp-out")], src, work / "cp-out", then_sync=True)

        cps = [cp()]   # cp around every round of converters: the machine's load and disk drift
        conversions = []
        for round_ in range(args.repeat):
            for variant in args.variants:
                for workers in args.workers:
                    cmd = [sys.executable, "-m", "dsv4convert", f"to-{variant}", "--src", str(src), "--dst",
                           str(work / "out"), "--workers", str(workers), "--no-progress", "--device", args.device]
                    row = timed(cmd, src, work / "out")
                    row.update(variant=variant, workers=workers, round=round_)
                    conversions.append(row)
                    save(args, result | {"partial_runs": conversions})
                    print(f"L={layers} {variant} w={workers} round {round_}: {row['seconds']} s, "
                          f"peak RSS {row['peak_rss_total'] / GB:.2f} GB", flush=True)
            cps.append(cp())
        for round_, row in enumerate(cps):
            row.update(variant="cp", workers=1, round=round_)
        for row in cps + conversions:
            if row["variant"] == "cp":
                around = [c["seconds"] for c in cps]
            else:
                around = [cps[row["round"]]["seconds"], cps[row["round"] + 1]["seconds"]]
            row.update(layers=layers, source_bytes=source_bytes,
                       source_gb_per_s=round(source_bytes / GB / row["seconds"], 3),
                       ratio_to_cp=round(row["seconds"] / statistics.mean(around), 2))
            result["runs"].append(row)
        if layers != top:
            shutil.rmtree(src)
    result["summary"] = summarize(result["runs"])
    result["extrapolation"] = extrapolate(result["runs"], os.cpu_count())
    if args.source is None and not args.keep_source:
        shutil.rmtree(full_src)
    return result


def layer_costs(runs: list[dict], cores: int | None = None, counted=lambda row: row["source_bytes"]) -> dict:
    """What one more layer costs each command (``variant/wN``), from what the worker count cannot hide.

    The converter runs one shard per worker: with as many workers as layer shards, the wall time of one more
    layer is about 0 (its shard runs beside the others), and the difference between layer counts, multiplied by
    the layers to go, says nothing. What no worker count hides is the work: the CPU seconds (user + system,
    the process tree) each added layer costs. So for every command the per-layer cost is the difference between
    the lowest and highest layer counts of the median CPU seconds (and, with one worker, of the wall seconds too):
    the one-worker wall difference where one worker ran, else the CPU difference shared by ``min(workers, cores)``
    busy processes (a bound its disk may not meet: ``basis`` says which). ``counted`` gives the bytes of a row's
    source that layers are made of (the per-layer bytes are its difference between the counts). Returns the counts
    (``lo``, ``hi``; equal where one count ran: no costs), ``lo_bytes``, ``layer_bytes`` and per command its median
    seconds at ``lo`` and its per-layer cost."""
    cores = cores or os.cpu_count() or 1
    wall: dict[tuple[str, int], dict[int, list[float]]] = {}
    cpu: dict[tuple[str, int], dict[int, list[float]]] = {}
    source_bytes: dict[int, int] = {}
    for row in runs:
        key = (row["variant"], row["workers"])
        wall.setdefault(key, {}).setdefault(row["layers"], []).append(row["seconds"])
        cpu.setdefault(key, {}).setdefault(row["layers"], []).append(
            row.get("cpu_user_seconds", 0.0) + row.get("cpu_system_seconds", 0.0))
        source_bytes[row["layers"]] = counted(row)
    counts = sorted(source_bytes)
    lo, hi = counts[0], counts[-1]
    out = {"lo": lo, "hi": hi, "lo_bytes": source_bytes[lo], "cores": cores, "per_layer": {},
           "layer_bytes": (source_bytes[hi] - source_bytes[lo]) / (hi - lo) if hi > lo else None}
    if hi == lo:
        return out
    for (variant, workers), by_count in wall.items():
        if lo not in by_count or hi not in by_count:
            continue
        median = {layers: statistics.median(values) for layers, values in by_count.items()}
        median_cpu = {layers: statistics.median(values) for layers, values in cpu[variant, workers].items()}
        cpu_per_layer = (median_cpu[hi] - median_cpu[lo]) / (hi - lo)
        wall_per_layer = (median[hi] - median[lo]) / (hi - lo)
        if workers == 1 or variant == "cp":
            per_layer, basis = wall_per_layer, "one-worker wall difference"
        else:
            per_layer, basis = cpu_per_layer / min(workers, cores), f"CPU difference / {min(workers, cores)}"
        out["per_layer"][f"{variant}/w{workers}"] = {
            "lo_seconds": median[lo], "wall_seconds_difference": wall_per_layer,
            "cpu_seconds_difference": cpu_per_layer, "used_seconds": per_layer, "basis": basis}
    return out


def extrapolate(runs: list[dict], cores: int | None = None) -> dict:
    """Full-model seconds per (variant, workers): ``t(L_lo) + layers to go (by bytes) x per-layer wall``, the
    per-layer wall from :func:`layer_costs` (what the worker count cannot hide). Each estimate prints the
    per-layer cost it rests on."""
    full_bytes, shards = full_model_bytes()
    costs = layer_costs(runs, cores)
    out: dict = {"full_model_bytes": full_bytes, "full_model_shards": shards, "method": None, "seconds": {},
                 "per_layer": {}}
    lo, hi = costs["lo"], costs["hi"]
    if hi == lo:
        out["method"] = (f"none: one layer count (L={lo}) cannot separate the per-layer cost from the "
                         f"once-per-run cost; run --layers with two counts")
        return out
    # the layers still to convert, counted in bytes (the drafter and the last layers weigh what they weigh)
    layers_to_go = (full_bytes - costs["lo_bytes"]) / costs["layer_bytes"]
    out["method"] = (f"t(L={lo}) + {layers_to_go:.1f} layer-equivalents of bytes x per-layer wall; per-layer wall = "
                     f"the one-worker wall "
                     f"difference between L={lo} and L={hi}, or, for more workers, the CPU-seconds difference / "
                     f"min(workers, {costs['cores']} cores)")
    for name, cost in costs["per_layer"].items():
        out["per_layer"][name] = {k: v if k == "basis" else round(v, 2) for k, v in cost.items() if k != "lo_seconds"}
        out["seconds"][name] = round(cost["lo_seconds"] + layers_to_go * cost["used_seconds"], 1)
    return out


def extrapolation_lines(ex: dict) -> list[str]:
    """The full-model table, each figure beside the per-layer cost it rests on."""
    lines = ["", f"Full model ({ex['full_model_shards']} shards, {ex['full_model_bytes'] / GB:.1f} GB), "
             f"{ex['method']}:", "", "| command | minutes | per-layer wall s (used) | basis | "
             "wall s difference per layer | CPU s difference per layer |", "|---|---|---|---|---|---|"]
    for key, seconds in ex["seconds"].items():
        cost = ex["per_layer"][key]
        lines.append(f"| {key} | {seconds / 60:.1f} | {cost['used_seconds']} | {cost['basis']} | "
                     f"{cost['wall_seconds_difference']} | {cost['cpu_seconds_difference']} |")
    return lines


def summarize(runs: list[dict]) -> list[dict]:
    """Per layer count, command and worker count: the median ratio to cp over the rounds, and its range."""
    groups: dict[tuple[int, str, int], list[dict]] = {}
    for row in runs:
        groups.setdefault((row["layers"], row["variant"], row["workers"]), []).append(row)
    out = []
    for (layers, variant, workers), rows in groups.items():
        ratios = [r["ratio_to_cp"] for r in rows]
        out.append({"layers": layers, "variant": variant, "workers": workers, "runs": len(rows),
                    "median_seconds": round(statistics.median(r["seconds"] for r in rows), 2),
                    "median_ratio_to_cp": round(statistics.median(ratios), 2),
                    "min_ratio_to_cp": min(ratios), "max_ratio_to_cp": max(ratios),
                    "median_cpu_seconds": round(statistics.median(r["cpu_user_seconds"] + r["cpu_system_seconds"]
                                                                  for r in rows), 1)})
    return out


def _gb(value: int | None) -> str:
    return "" if value is None else f"{value / GB:.2f}"


def markdown(result: dict) -> str:
    m = result["machine"]
    lines = [f"# Conversion vs cp ({result['device']})", "",
             f"- machine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB" + (f", {m['gpu']}" if "gpu" in m else ""),
             f"- torch {m['torch']}, python {m['python']}; commit `{result['commit']}`",
             f"- command: `{result['command']}`",
             f"- page cache: {result['cold_cache']}",
             f"- OMP_WAIT_POLICY: {result.get('omp_wait_policy') or 'unset'}", ""]
    if "synth_seconds" in result:
        lines += [f"- synth: {result['synth_seconds']} s", ""]
    lines += ["Median over the rounds (each converter run against the mean of the cp runs just before and "
              "after it; cp against the mean of all its runs):", "",
              "| layers | command | workers | runs | median seconds | median x cp | range x cp | median CPU s |",
              "|---|---|---|---|---|---|---|---|"]
    for r in result["summary"]:
        lines.append(f"| {r['layers']} | {r['variant']} | {r['workers']} | {r['runs']} | {r['median_seconds']:.1f} | "
                     f"{r['median_ratio_to_cp']:.2f} | {r['min_ratio_to_cp']:.2f}-{r['max_ratio_to_cp']:.2f} | "
                     f"{r['median_cpu_seconds']} |")
    lines += ["", "Every run, in the order it ran:", "",
              "| layers | source GB | command | workers | round | seconds | GB/s | x cp | CPU user s | CPU sys s | "
              "disk read GB | disk written GB | peak RSS total GB | largest process GB | output GB | load 1m |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(result["runs"], key=lambda r: (r["layers"], r["round"], r["variant"] != "cp")):
        lines.append(f"| {r['layers']} | {r['source_bytes'] / GB:.2f} | {r['variant']} | {r['workers']} | "
                     f"{r['round']} | {r['seconds']:.1f} | {r['source_gb_per_s']:.3f} | {r['ratio_to_cp']:.2f} | "
                     f"{r['cpu_user_seconds']} | {r['cpu_system_seconds']} | {_gb(r['disk_read_bytes'])} | "
                     f"{_gb(r['disk_written_bytes'])} | {r['peak_rss_total'] / GB:.3f} | "
                     f"{r['peak_rss_single'] / GB:.3f} | {r['output_bytes'] / GB:.2f} | {r['load_avg_1m_before']} |")
    lines += extrapolation_lines(result["extrapolation"])
    return "\n".join(lines) + "\n"


def save(args: argparse.Namespace, result: dict) -> None:
    """Write the JSON (after every run too, so an interrupted benchmark keeps what it measured)."""
    name = args.name or ("cpu" if args.device == "cpu" else args.device.split(":")[0])
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"convert-{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    if "extrapolation" in result:
        (args.out_dir / f"convert-{name}.md").write_text(markdown(result))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, nargs="+", default=[1, 2], help="layer counts to convert (default 1 2)")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="worker counts (default 1 2)")
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--device", default="cpu", help="--device of the converters (cpu, cuda)")
    p.add_argument("--repeat", type=int, default=1,
                   help="rounds of converter runs, each followed by a cp run (default 1: cp, converters, cp)")
    p.add_argument("--work", type=Path, default=Path("bench-convert-work"), help="scratch directory")
    p.add_argument("--source", type=Path, help="reuse a checkpoint made by synth with max(--layers) layers and --no-mtp")
    p.add_argument("--keep-source", action="store_true", help="keep the synthesized source")
    p.add_argument("--out-dir", type=Path, default=REPO / "bench" / "results")
    p.add_argument("--name", help="results file stem after 'convert-' (default: the device type)")
    args = p.parse_args()
    result = run(args)
    save(args, result)
    print(markdown(result))


if __name__ == "__main__":
    main()
