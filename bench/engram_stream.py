"""DeepSeek-V4.1's Engram tables carried byte for byte: peak memory as the table grows, against ``cp``.

The release's two Engram tables are 101 GB each (FP8 rows + 1x32 E8M0 scales, a shard each); every variant must
carry them unchanged (both engines hard-code FP8 rows). A converter keeps a tensor by handing the writer its
source bytes (``convert/modules.py::_copied``: :class:`~dsv4convert.checkpoint.SourceBytes` to
``ShardWriter.write``), which copies them file to file through a bounded staging area. This measures that path on
tables of growing size, each made with the code ``synth --config <V4.1 config.json> --num-layers 1 --engram-rows
R`` uses (``models/deepseek_v41/synth.py::scaled_config``, then only the table's shard is written), and for each
size, in one run, on a cold source (evicted from the page cache, ``bench/convert.py::timed``):

* ``carry``: the table's shard written by ``ShardWriter`` from ``SourceBytes`` (the converter's keep path), fsynced;
* ``cp + sync`` of the same shard;
* ``read whole``: the shard's tensors read into memory and held (``checkpoint.read_tensor``), what not streaming
  costs.

Peak RSS is the process's (polled every 50 ms). ``carry`` is the writer's copy alone: a V4.1 converter first reads
a kept table through its NaN check (``convert/v41.py::_produce``), then copies it; ``bench/convert_v41.py`` times
real-size layers converted end to end, the table's shard included, against ``cp``. Results:
``<out-dir>/engram-stream-<name>.json`` and ``.md``.

    python bench/engram_stream.py --gb 0.5 1 2 4 --work /tmp/engram-bench
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.convert import GB, REPO, _commit, _machine, timed  # noqa: E402
from dsv4convert.checkpoint import PlannedTensor, ShardWriter, SourceBytes, atomic_write_json  # noqa: E402
from dsv4convert.checkpoint.reader import read_header, read_tensor  # noqa: E402
from dsv4convert.models.deepseek_v41.config import read_config  # noqa: E402
from dsv4convert.models.deepseek_v41.inventory import native_groups, role_of  # noqa: E402
from dsv4convert.models.deepseek_v41.synth import scaled_config, write_group  # noqa: E402

RELEASE_CONFIG = REPO / "tests" / "data" / "deepseek-v4.1-flash-config.json"
ROW_BYTES = 256 + 8   # FP8 codes + E8M0 scales per row


def make_table(dst: Path, gigabytes: float) -> dict:
    """The Engram table ``synth --config <release> --num-layers 1 --engram-rows R`` writes, R for ``gigabytes``,
    alone in ``dst/table.safetensors``."""
    config = scaled_config(json.loads(RELEASE_CONFIG.read_text()), 1, int(gigabytes * GB / ROW_BYTES),
                           drafter=False)
    cfg = read_config(config)
    group = next(g for g in native_groups(cfg) if all(role_of(s.name) == "engram_table" for s in g))
    dst.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with ShardWriter(dst / "table.safetensors", [PlannedTensor(s.name, s.dtype, s.shape) for s in group]) as writer:
        write_group(writer, group, cfg, seed=0)
    atomic_write_json(dst / "config.json", config)
    return {"rows": group[0].shape[0], "bytes": sum(s.nbytes for s in group),
            "synth_seconds": round(time.monotonic() - t0, 1)}


def carry(src: Path, dst: Path) -> None:
    """The converter's keep path: every tensor of ``src`` handed to the writer as its source bytes."""
    header = read_header(src)
    entries = sorted(header.entries.values(), key=lambda e: e.start)
    dst.mkdir(parents=True, exist_ok=True)
    with ShardWriter(dst / src.name, [PlannedTensor(e.name, e.dtype, e.shape) for e in entries]) as writer:
        for e in entries:
            writer.write(e.name, SourceBytes(e, e.dtype, e.shape))


def read_whole(src: Path, dst: Path) -> None:
    """What not streaming costs: every tensor of ``src`` read into memory (``checkpoint.read_tensor``) and held."""
    dst.mkdir(parents=True, exist_ok=True)
    tensors = [read_tensor(e) for e in read_header(src).entries.values()]
    (dst / "bytes").write_text(str(sum(t.numel() * t.element_size() for t in tensors)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gb", type=float, nargs="+", default=[0.5, 1, 2, 4], help="table sizes in GB")
    p.add_argument("--work", type=Path, help="where the tables and copies go (required but for --carry/--read-whole)")
    p.add_argument("--out-dir", type=Path, default=REPO / "bench" / "results")
    p.add_argument("--name", default="cpu")
    p.add_argument("--carry", nargs=2, type=Path, metavar=("SRC", "DST"), help=argparse.SUPPRESS)
    p.add_argument("--read-whole", nargs=2, type=Path, metavar=("SRC", "DST"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.carry:
        return carry(*args.carry)
    if args.read_whole:
        return read_whole(*args.read_whole)
    if args.work is None:
        p.error("--work is required")
    me = [sys.executable, str(Path(__file__).resolve())]
    rows = []
    for gigabytes in args.gb:
        src = args.work / f"src-{gigabytes:g}"
        table = make_table(src, gigabytes)
        shard, out = src / "table.safetensors", args.work / "out"
        for label, cmd, sync in (("carry (ShardWriter, SourceBytes)", [*me, "--carry", str(shard), str(out)], False),
                                 ("cp + sync", ["sh", "-c", f"mkdir {shlex.quote(str(out))} && cp "
                                                f"{shlex.quote(str(shard))} {shlex.quote(str(out))}/"], True),
                                 ("read whole (read_tensor)", [*me, "--read-whole", str(shard), str(out)], False)):
            row = timed(cmd, src, out, then_sync=sync)
            rows.append({"table_gb": gigabytes, **table, "copy": label, **row})
            print(f"{gigabytes:g} GB {label}: {row['seconds']} s, peak RSS {row['peak_rss_single'] / 2**20:.0f} MiB",
                  flush=True)
        shutil.rmtree(src)
    result = {"machine": _machine("cpu"), "commit": _commit(), "command": shlex.join(sys.argv), "runs": rows}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = args.out_dir / f"engram-stream-{args.name}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [f"# Engram table carried byte for byte vs cp ({result['machine']['cpu']}, {result['machine']['cores']} "
             f"cores, {result['machine']['memory_gib']} GiB)", "",
             f"- commit `{result['commit']}`; command: `{result['command']}`",
             "- tables made by `synth --config <V4.1 config.json> --num-layers 1 --engram-rows R`'s code; source "
             "evicted from the page cache before every run; peak RSS of the process, polled every 50 ms", "",
             "| table GB | rows | copy | seconds | GB/s | peak RSS MiB | CPU user s | CPU sys s |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['bytes'] / GB:.2f} | {r['rows']:,} | {r['copy']} | {r['seconds']} | "
                     f"{r['bytes'] / GB / r['seconds']:.2f} | {r['peak_rss_single'] / 2**20:.0f} | "
                     f"{r['cpu_user_seconds']} | {r['cpu_system_seconds']} |")
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {stem}.json and .md")


if __name__ == "__main__":
    main()
