"""What the disk gives a copy that bypasses the page cache, against ``cp``: evidence for the next writer.

On the 2-core VM the converters are bound by the kernel's page-cache work per byte (page
allocation, ext4 delayed allocation, writeback, reclaim; docs/performance.md), which ``cp`` pays
too. This times, on the same cold source and in one run, ``cp -r`` followed by ``sync`` against a
copy with ``O_DIRECT`` reads and writes (``--copy``: aligned chunks read and written by a pool of
threads, each its own chunk; the last partial block written padded, then the file truncated to its
size and fsynced), for each thread count and chunk size. Rounds alternate cp and the direct copies.
Results go to ``<out-dir>/direct-copy-<name>.json`` and ``.md``.

    python bench/direct_copy.py --source SRC --work DIR --threads 4 8 --chunk-mb 16 64 --repeat 2
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shlex
import statistics
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.convert import GB, REPO, _commit, _machine, timed  # noqa: E402

BLOCK = 4096  # O_DIRECT offsets, lengths and buffers are multiples of the logical block size


def direct_copy(src: Path, dst: Path, threads: int, chunk: int) -> None:
    """Copy every file of ``src`` into ``dst`` with O_DIRECT, ``threads`` chunks of ``chunk`` bytes in flight."""
    buffers = threading.local()

    def copy_chunk(fin: int, fout: int, offset: int) -> None:
        buf = getattr(buffers, "buf", None)
        if buf is None:
            buf = buffers.buf = mmap.mmap(-1, chunk)  # anonymous maps are page aligned
        got = os.preadv(fin, [buf], offset)
        os.pwritev(fout, [memoryview(buf)[:-(-got // BLOCK) * BLOCK]], offset)

    dst.mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(threads) as pool:
        for path in sorted(p for p in src.iterdir() if p.is_file()):
            size = path.stat().st_size
            fin = os.open(path, os.O_RDONLY | os.O_DIRECT)
            fout = os.open(dst / path.name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
            try:
                list(pool.map(lambda offset: copy_chunk(fin, fout, offset), range(0, size, chunk)))
                os.ftruncate(fout, size)
                os.fsync(fout)
            finally:
                os.close(fout)
                os.close(fin)


def run(args: argparse.Namespace) -> dict:
    src, work = args.source.resolve(), args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    out = work / "direct-copy-out"
    result = {"machine": _machine("cpu"), "commit": _commit(), "command": shlex.join(sys.argv),
              "source": str(src), "runs": []}

    def cp() -> dict:
        return timed(["cp", "-r", str(src), str(out)], src, out, then_sync=True) | {"copy": "cp + sync"}

    for round_ in range(args.repeat):
        result["runs"].append(cp() | {"round": round_})
        for threads in args.threads:
            for chunk_mb in args.chunk_mb:
                cmd = [sys.executable, __file__, "--copy", str(src), str(out), str(threads), str(chunk_mb)]
                row = timed(cmd, src, out) | {"copy": f"O_DIRECT, {threads} threads, {chunk_mb} MB chunks",
                                               "round": round_}
                result["runs"].append(row)
                print(f"round {round_} {row['copy']}: {row['seconds']} s", flush=True)
    result["runs"].append(cp() | {"round": args.repeat})
    cp_mean = statistics.mean(r["seconds"] for r in result["runs"] if r["copy"] == "cp + sync")
    for row in result["runs"]:
        row["ratio_to_cp"] = round(row["seconds"] / cp_mean, 2)
    return result


def markdown(result: dict) -> str:
    m = result["machine"]
    lines = [f"# O_DIRECT copy vs cp ({m['cpu']}, {m['cores']} cores)", "",
             f"- commit `{result['commit']}`; command: `{result['command']}`",
             f"- source: {result['source']}, evicted from the page cache before every run", "",
             "| round | copy | seconds | x mean cp | CPU user s | CPU sys s | disk read GB | disk written GB |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["runs"]:
        read = "" if r["disk_read_bytes"] is None else f"{r['disk_read_bytes'] / GB:.2f}"
        written = "" if r["disk_written_bytes"] is None else f"{r['disk_written_bytes'] / GB:.2f}"
        lines.append(f"| {r['round']} | {r['copy']} | {r['seconds']:.1f} | {r['ratio_to_cp']:.2f} | "
                     f"{r['cpu_user_seconds']} | {r['cpu_system_seconds']} | {read} | {written} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    if len(sys.argv) == 6 and sys.argv[1] == "--copy":  # one timed copy, run as its own process
        _, _, src, dst, threads, chunk_mb = sys.argv
        direct_copy(Path(src), Path(dst), int(threads), int(chunk_mb) << 20)
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--source", type=Path, required=True, help="a checkpoint directory (e.g. synth's)")
    p.add_argument("--work", type=Path, default=Path("bench-convert-work"), help="scratch directory")
    p.add_argument("--threads", type=int, nargs="+", default=[8])
    p.add_argument("--chunk-mb", type=int, nargs="+", default=[64], help="chunk sizes, MiB (multiples of 4 KiB)")
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--out-dir", type=Path, default=REPO / "bench" / "results")
    p.add_argument("--name", default="cpu")
    args = p.parse_args()
    result = run(args)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"direct-copy-{args.name}.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out_dir / f"direct-copy-{args.name}.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
