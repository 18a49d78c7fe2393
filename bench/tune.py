"""``dsv4convert tune`` on the FP8 variant's MoE at TP4 (E=256, N=512 per rank, H=4096, top-6, FP8 128x128):
the tuned configs against SGLang's default config and against SGLang's shipped file for the GPU, side by side.

One run: tune (``dsv4convert.tune.run.tune``: SGLang's own kernel, a time budget) for batch sizes
1-256, write the merged config folder, then time SGLang's whole MoE kernel sequence with each
variant's configs, resolved by SGLang's lookup, in alternating rounds. Goal: >= 1.3x the default
config averaged over decode batch sizes 1-64, and no batch size slower than the shipped file.
It needs torch, Triton and ``sglang==0.5.23`` importable (``--no-deps``, no ``sglang-kernel``):
on the H200 image (Python 3.12, torch 2.11, Triton 3.6, transformers 5.17) that is the wheel, which
is cp311-only and so is unzipped (its five Rust extensions are never imported on this path), and
the light pure-Python/abi3 imports the image lacks, carried as ``.whl/tune-h200``::

    python3 -m zipfile -e .whl/tune-h200/sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl /tmp/sgl
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/tune-h200/deps/*.whl
    PYTHONPATH=/tmp/site:/tmp/sgl:. python3 bench/tune.py --out $OUT/tune-h200

(``.whl/tune-h200/deps``: annotated-types, apache-tvm-ffi, dill, ipython, msgspec, orjson, pybase64,
pydantic, pydantic-core, pyzmq, starlette, traitlets, typing-inspection; found by importing this
path in an environment holding only the image's packages.) About 7 minutes with the default budget.

writes ``<out>.json`` (every trial, every round), ``<out>.md`` (the table) and the two tuned files in
``<out>-configs/``. Beside the timings, a memory roofline: per batch size the bytes of the expert
weights its routings touch (each routing's distinct experts, both projections and their scales),
over the fastest rate the GPU read at in the same run (a 4 GiB read-only reduction, a 4 GiB
device-to-device copy, or the read floor below), is the least time any config of SGLang's kernel
can take; it bounds the speed-up over the default config that tuning can reach. Beside it the read
floor: a plain Triton streaming read of the same weights in the same two launches per routing, the
roofline once each launch's start, ramp-up and tail are paid, as the MoE's two GEMMs pay them.
``--render JSON`` rewrites the report of a stored run with the current roofline and wording.
``--config tiny`` runs the same script on the tiny synthetic shapes: ``tests/test_tune.py`` runs it
so in Triton's interpreter with a stand-in GPU (a check of the script, not of any speed).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import report  # noqa: E402
from dsv4convert.formats import Format  # noqa: E402
from dsv4convert.synth import preset_config, reference_config  # noqa: E402
from dsv4convert.tune import compare, device, run, sglang_moe, workload  # noqa: E402
from dsv4convert.tune.problem import MoEProblem  # noqa: E402
from dsv4convert.tune.workload import ROUTINGS  # noqa: E402

BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256)
GOAL_DECODE_SPEEDUP = 1.3


def memory_rate(gpu) -> dict:
    """Bytes per second the GPU moves: a reduction that only reads 4 GiB, and a copy (read + write)."""
    import torch
    import triton.testing

    if not gpu.timed:
        return {"read_bytes_per_s": None, "copy_bytes_per_s": None}
    size = 4 * 2**30
    x = torch.empty(size // 2, dtype=torch.float16, device="cuda").normal_()
    y = torch.empty_like(x)
    read = triton.testing.do_bench(lambda: torch.amax(x), rep=200, return_mode="median") * 1e-3
    copy = triton.testing.do_bench(lambda: y.copy_(x), rep=200, return_mode="median") * 1e-3
    return {"read_bytes_per_s": size / read, "copy_bytes_per_s": 2 * size / copy}


def weight_bytes(batch) -> float:
    """Mean bytes of expert weights (and block scales) one routing of ``batch`` reads: its distinct experts."""
    w = batch.weights
    per_expert = sum(t[0].numel() * t.element_size() for t in (w.w13, w.w2, w.w13_scale, w.w2_scale) if t is not None)
    distinct = [int(ids.unique().numel()) for ids, _ in batch.routings]
    return per_expert * sum(distinct) / len(distinct)


def roofline(rows: list[dict], moved: dict[int, float], rates: dict, floors: dict[int, float] | None) -> dict:
    """Per batch size the least time the weights' bytes (``moved``) allow at the fastest rate this GPU was seen
    to read at in the run (the 4 GiB reduction, the copy, or the read floor over the experts), the time a plain
    read of them in the same two launches takes (``floors``), and the bounds each puts on the decode mean."""
    floors = floors or {}
    expert_rate = max((moved[m] / (us * 1e-6) for m, us in floors.items()), default=None)
    rate = max((r for r in (rates["read_bytes_per_s"], rates["copy_bytes_per_s"], expert_rate) if r), default=None)
    out = {}
    for row in rows:
        m = row["batch_size"]
        least_us = moved[m] / rate * 1e6 if rate else None
        read_us = floors.get(m)
        out[m] = {"weight_bytes": moved[m], "least_us": least_us,
                  "tuned_of_least": least_us / row["tuned"]["us"] if least_us else None,
                  "default_over_least": row["default"]["us"] / least_us if least_us else None,
                  "read_us": read_us, "tuned_of_read": read_us / row["tuned"]["us"] if read_us else None,
                  "default_over_read": row["default"]["us"] / read_us if read_us else None}

    def decode_mean(key: str) -> float | None:
        values = [out[r["batch_size"]][key] for r in rows
                  if r["batch_size"] in compare.DECODE_BATCH_SIZES and out[r["batch_size"]][key]]
        return sum(values) / len(values) if values else None
    return {"bytes_per_s": rate, "expert_read_bytes_per_s": expert_rate, "per_batch": out,
            "decode_mean_bound_vs_default": decode_mean("default_over_least"),
            "decode_mean_read_bound_vs_default": decode_mean("default_over_read")}


READ_WORDS = 1024                       # int32 words one program loads per step (4 KB)
READ_CHUNKS = (4096, 16384, 65536)      # words per program: the floor is the fastest of these


def _read_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def read_experts(words, expert_ids, xors, words_per_expert, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        """Each program reads CHUNK words of one listed expert and stores their XOR (so no load is elided)."""
        expert = tl.load(expert_ids + tl.program_id(0)).to(tl.int64)
        start = expert * words_per_expert + tl.program_id(1) * CHUNK
        acc = tl.zeros([BLOCK], dtype=tl.int32)
        for step in range(0, CHUNK, BLOCK):
            acc ^= tl.load(words + start + step + tl.arange(0, BLOCK))
        tl.store(xors + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1), tl.xor_sum(acc, 0))
    return read_experts


def read_experts(kernel, tensor, ids, xors, chunk: int) -> None:
    """One launch: the listed experts' rows of ``tensor`` [experts, words], ``chunk`` words per program."""
    kernel[(ids.numel(), tensor.shape[1] // chunk)](tensor, ids, xors, tensor.shape[1], CHUNK=chunk, BLOCK=READ_WORDS)


def experts_xor(kernel, tensor, ids, xors, chunk: int):
    """The XOR of each listed expert's words as the read kernel computes it (one launch), on the host."""
    import numpy as np

    chunks = tensor.shape[1] // chunk
    read_experts(kernel, tensor, ids, xors, chunk)
    return np.bitwise_xor.reduce(xors[: ids.numel() * chunks].view(-1, chunks).cpu().numpy(), axis=1)


def read_floors(batches: dict, gpu) -> dict[int, float] | None:
    """Per batch size, microseconds a plain streaming read of each routing's distinct experts' FP8 weights
    takes in two launches (gate/up, then down; the block scales, under 1 % of the bytes, left out), as the
    MoE's two GEMMs launch: the floor a kernel pair reaches once launch, ramp-up and tail are counted.
    The kernel's reads are checked once against NumPy's XOR of the same words."""
    import numpy as np
    import torch

    if not gpu.timed:
        return None
    kernel = _read_kernel()
    weights = next(iter(batches.values())).weights
    experts = weights.w13.shape[0]
    tensors = [w.view(torch.int32).reshape(experts, -1) for w in (weights.w13, weights.w2)]
    if any(t.shape[1] % chunk for t in tensors for chunk in READ_CHUNKS):
        raise ValueError(f"the experts' words {[t.shape[1] for t in tensors]} do not split into {READ_CHUNKS}")
    xors = torch.empty(experts * max(t.shape[1] for t in tensors) // min(READ_CHUNKS), dtype=torch.int32,
                       device=weights.w13.device)
    experts_read = {m: [topk_ids.unique().to(torch.int32) for topk_ids, _ in batch.routings]
                    for m, batch in sorted(batches.items())}
    first = next(iter(experts_read.values()))[0]
    for tensor in tensors:
        want = np.bitwise_xor.reduce(tensor[first.long()].cpu().numpy(), axis=1)
        if not np.array_equal(experts_xor(kernel, tensor, first, xors, READ_CHUNKS[0]), want):
            raise RuntimeError("the read floor's kernel read other words than the experts' weights")
    floors = {}
    for m, ids in experts_read.items():
        floors[m] = min(workload.time_us(lambda c=chunk: [read_experts(kernel, t, i, xors, c) for i in ids for t in tensors],
                                         gpu, 20, len(ids))
                        for chunk in READ_CHUNKS)
    return floors


def markdown(record: dict) -> str:
    r, s, search = record["run"], record["summary"], record["search"]
    what = (f"{record['problem']['describe']}. The MoE's two GEMMs as SGLang launches them for each pair of configs "
            "(SGLang's `invoke_fused_moe_kernel`; the gate/up GEMM writes expert-sorted rows for a TMA down config); "
            "the activation, FP8 requantization, routing alignment and top-k sum between and around them do not depend "
            f"on the configs and are left out. Median of {record['rounds']} alternating rounds of CUDA-graph timings, "
            f"each over {ROUTINGS} routings (at small batches each activates other experts, so most weights come from "
            "HBM, as in a forward where every layer has its own), per batch size:")
    decode = s["decode_mean_speedup_vs_default"]
    goal = "met" if decode >= GOAL_DECODE_SPEEDUP else "MISSED"
    lines = [f"# `dsv4convert tune` on {r['device']}: SGLang's fused MoE, FP8 variant at TP{record['problem']['tp']}",
             "", what, "", *compare.table(record["compare"]), "", *roofline_lines(record), "",
             f"- decode batch sizes 1-64: **{decode:.2f}x** SGLang's default config (goal {GOAL_DECODE_SPEEDUP}x: {goal})"]
    if s["min_speedup_vs_shipped"] is not None:
        verdict = "none slower" if s["min_speedup_vs_shipped"] >= 1.0 else "SLOWER at some"
        lines.append(f"- against SGLang's shipped `{record['shipped_file']}`: slowest ratio "
                     f"**{s['min_speedup_vs_shipped']:.2f}x** at batch size {s['slowest_vs_shipped_batch_size']} "
                     f"({verdict} batch size)")
    else:
        lines.append("- SGLang ships no config for this GPU and shape: only the default config to compare with")
    reached = ", reached" if search["stopped_by_budget"] else ""
    lines += [
        f"- search: {search['shapes_tried']} of {search['shapes_planned']} tile shapes in {search['elapsed_s']:.0f} s "
        f"(budget {search['budget_s']:.0f} s{reached}), trials {search['trials']}; "
        f"{search['left_out_for_shared_memory']} shapes left out for shared memory",
        f"- {r['device']}, torch {r['torch']}, Triton {r['triton']}, SGLang {record['sglang']}, commit {r['commit']}",
        f"- command: `{r['command']}`",
        *([f"- this report: rendered again from the run's JSON (`bench/tune.py --render {record['rendered_from']}`), "
           "its roofline recomputed from the measurements stored there"] if record.get("rendered_from") else []),
        ("- sm_120 (RTX PRO 6000) numbers must come from the user's machine: run `dsv4convert tune` there; these "
         "are H200 numbers, and its shared memory (227 KB per block) and tensor cores differ."),
        "",
    ]
    return "\n".join(lines)


def roofline_lines(record: dict) -> list[str]:
    roof, rate = record["roofline"], record["memory_rate"]
    if not roof["bytes_per_s"]:
        return ["Memory roofline: not measured (no GPU)."]
    expert = roof["expert_read_bytes_per_s"]
    lines = [f"Memory roofline: the expert weights each routing reads, over the {roof['bytes_per_s'] / 1e12:.2f} TB/s "
             f"this GPU was seen to read at in the same run (the fastest of a 4 GiB read-only reduction, "
             f"{rate['read_bytes_per_s'] / 1e12:.2f}, a 4 GiB copy, {rate['copy_bytes_per_s'] / 1e12:.2f}, and the "
             f"read floor below over the experts' bytes{f', {expert / 1e12:.2f}' if expert else ''}): no config of "
             "SGLang's kernel can take less time.", "",
             "The read floor: a plain streaming read of the same FP8 weights in the same two launches per routing "
             "(gate/up, then down; Triton, the fastest of "
             f"{len(READ_CHUNKS)} chunk sizes, CUDA graph), i.e. the roofline once each launch's start, ramp-up and "
             "tail are paid, as SGLang's two GEMMs pay them.", "",
             "| batch | weights read MB | least us | read floor us | tuned us | tuned at % of the roofline "
             "| tuned at % of the read floor | default / least | default / read floor |",
             "|---|---|---|---|---|---|---|---|---|"]
    tuned = {row["batch_size"]: row["tuned"]["us"] for row in record["compare"]}
    for m, r in sorted(roof["per_batch"].items(), key=lambda kv: int(kv[0])):
        read = (f"{r['read_us']:.1f}", f"{100 * r['tuned_of_read']:.0f}%", f"{r['default_over_read']:.2f}x") \
            if r.get("read_us") else ("", "", "")
        lines.append(f"| {m} | {r['weight_bytes'] / 1e6:.1f} | {r['least_us']:.1f} | {read[0]} | {tuned[int(m)]:.1f} | "
                     f"{100 * r['tuned_of_least']:.0f}% | {read[1]} | {r['default_over_least']:.2f}x | {read[2]} |")
    lines.append("")
    for key, name in (("decode_mean_bound_vs_default", "the roofline"),
                      ("decode_mean_read_bound_vs_default", "the read floor")):
        bound = roof.get(key)
        if bound:
            lines.append(f"- bound on the decode mean (1-64) over the default config at {name}: **{bound:.2f}x**"
                         + (f" (below the {GOAL_DECODE_SPEEDUP}x goal)" if bound < GOAL_DECODE_SPEEDUP else ""))
    return lines


def render(source: Path, out: Path) -> int:
    """The report of a stored run, with this script's current roofline and wording (no GPU needed)."""
    record = json.loads(source.read_text())
    per_batch = {int(m): r for m, r in record["roofline"]["per_batch"].items()}
    floors = {m: r["read_us"] for m, r in per_batch.items() if r.get("read_us")}
    record["roofline"] = roofline(record["compare"], {m: r["weight_bytes"] for m, r in per_batch.items()},
                                  record["memory_rate"], floors)
    record["rendered_from"] = source.name
    report.write(str(out), record, markdown(record))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="results prefix (.json, .md and -configs/ are written)")
    p.add_argument("--time-budget", type=float, default=5.0, help="minutes of search (default 5)")
    p.add_argument("--batch-sizes", default=",".join(map(str, BATCH_SIZES)))
    p.add_argument("--rounds", type=int, default=3, help="alternating timing rounds of the comparison")
    p.add_argument("--tp", type=int, default=4)
    p.add_argument("--config", choices=("real", "tiny"), default="real", help="tiny: a CPU check of this script")
    p.add_argument("--render", metavar="JSON", help="no run: rewrite the report of an earlier run's JSON (its roofline "
                   "recomputed from the stored bytes, rates and read floors) to --out")
    args = p.parse_args(argv)
    if args.render:
        return render(Path(args.render), Path(args.out))

    config = reference_config() if args.config == "real" else preset_config("tiny")
    problem = MoEProblem.from_config(config, Format.FP8, args.tp if args.config == "real" else 1)
    gpu = device.detect()
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    out = Path(args.out)
    start = time.monotonic()
    rate = memory_rate(gpu)      # first: the tuning's own buffers are not yet allocated
    with tempfile.TemporaryDirectory() as work:
        folder = Path(work) / "moe-configs"
        outcome = run.tune(problem, gpu, folder, batch_sizes=batch_sizes, budget_s=args.time_budget * 60,
                           source=f"{args.config} config.json", compare_rounds=args.rounds)
        configs = out.parent / f"{out.name}-configs"
        configs.mkdir(parents=True, exist_ok=True)
        for path in outcome.written:
            (configs / path.name).write_bytes(path.read_bytes())
        trials = json.loads(outcome.log.read_text())["trials"]
    record = {
        "run": report.gpu_run() if gpu.timed else {"device": gpu.name, "torch": "", "triton": "", "commit": "",
                                                    "command": " ".join(sys.argv)},
        "sglang": sglang_moe.version(),
        "problem": {"describe": problem.describe(), "experts": problem.experts, "n": problem.lookup_n,
                    "hidden": problem.hidden, "topk": problem.topk, "tp": problem.tp, "dtype": problem.dtype},
        "files": list(outcome.plan.files),
        "shipped_file": outcome.plan.up_file.split("/", 1)[1] if sglang_moe.lookup(problem, None) else None,
        "replaces_shipped": outcome.plan.replaces_shipped(),
        "rounds": args.rounds,
        "search": outcome.result.summary(),
        "summary": compare.summary(outcome.rows),
        "compare": outcome.rows,
        "memory_rate": rate,
        "roofline": roofline(outcome.rows, {m: weight_bytes(b) for m, b in outcome.result.batches.items()}, rate,
                             read_floors(outcome.result.batches, gpu)),
        "choices": [c.to_json() for c in outcome.result.choices.values()],
        "trials": trials,
        "wall_s": time.monotonic() - start,
    }
    report.write(str(out), record, markdown(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
