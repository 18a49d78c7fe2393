"""``dsv4convert demo``: the model organism's story, in about a minute on a laptop CPU.

The organism (docs/organism.md) is a 7.4M-parameter DeepSeek-V4 shipped with the tool and trained to retrieve
needles far past its top-k window, so every number the tool prints about it can be checked against a known
truth. The demo writes it (its held-out text ships with it), converts it to fp8, nvfp4 and w4a16 and validates
each against it, compares each with it at the model's output on the held-out text (KLD, same top-1) and in needle
retrieval from half its selection threshold to 8x it (``compare --recall``), then zeroes one CSA layer's indexer head
weights in a copy and checks that ``compare --recall --local`` names that layer's indexer. One table; exit 0
when every check passed and the fault was named.
"""

from __future__ import annotations

import contextlib
import json
import math
import textwrap
import time
from pathlib import Path

from dsv4convert.checkpoint import Checkpoint
from dsv4convert.compare import DEFAULT_GPU_FAMILY
from dsv4convert.compare.recall import RecallOptions, accuracy_by_length, verdict
from dsv4convert.compare.run import CompareOptions, build_plan, run
from dsv4convert.convert.execute import ConvertOptions, convert
from dsv4convert.convert.plan import human_bytes
from dsv4convert.convert.recipe import load_recipe
from dsv4convert.engines import SGLANG_LABEL
from dsv4convert.needle import selection_threshold
from dsv4convert.organism.export import write_organism
from dsv4convert.organism.faults import Fault, inject
from dsv4convert.validate.cli import validate

VARIANTS = ("fp8", "nvfp4", "w4a16")
# SGLang's numerics on the GPU family users serve on, for both sides of every comparison: a number is what
# switching the served checkpoint changes (a weights-only base would charge its own rounding to the variant).
NUMERICS, GPU_FAMILY = "served", DEFAULT_GPU_FAMILY
TEXT_TOKENS, TEXT_SEQ_LEN = 1024, 512    # held-out text: two sequences (the file holds about 15K tokens)
ANSWER_TOKENS = 7                        # one per digit: prompts up to threshold - 7 are fully covered
DEPTH = 0.5                              # one needle per length, mid depth: the grid's time is the demo's minute
# Its head weights zeroed, every entry scores the same and top-k keeps an arbitrary set: needles are kept below
# the threshold (top-k leaves nothing out there) and lost past it, where the indexer decides.
FAULT = Fault("indexer-crushed", 3)
WIDTH = 110                              # the table's width: the verdict and the footnote wrap to it


def recall_lengths(threshold: int) -> list[int]:
    """Half the threshold, the longest fully covered prompt, the threshold, then 2x, 4x and 8x it."""
    return [threshold // 2, threshold - ANSWER_TOKENS, threshold, 2 * threshold, 4 * threshold, 8 * threshold]


def text_fidelity(base: Path, variant: Path, text: Path) -> dict:
    """KLD mean and same top-1 at the model's output on the held-out text."""
    out = run(build_plan(CompareOptions(base=str(base), variant=str(variant), texts=[text], tokens=TEXT_TOKENS,
                                        seq_len=TEXT_SEQ_LEN, numerics=NUMERICS, gpu_family=GPU_FAMILY, mtp=False,
                                        progress=False)))["output"]
    return {"kld": out["kld"]["mean"], "same_top1": out["same_top1"]}


def recall(base: Path, variant: Path, lengths: list[int], *, local: bool = False) -> dict:
    """``compare --recall``'s summary (tracks, diagnosis) of ``variant`` against ``base``."""
    opts = CompareOptions(base=str(base), variant=str(variant), numerics=NUMERICS, gpu_family=GPU_FAMILY,
                          progress=False, recall=RecallOptions(lengths=lengths, depths=(DEPTH,), local=local))
    return run(build_plan(opts))["recall"]


def run_demo(workdir: Path) -> list[dict]:
    """The demo; returns the table's rows: the base, each variant, then the fault (its ``diagnosis``, ``verdict``)."""
    t0 = time.monotonic()

    def step(message: str) -> None:
        print(f"[{time.monotonic() - t0:5.1f} s] {message}", flush=True)

    workdir.mkdir(parents=True, exist_ok=True)
    src = write_organism(workdir / "organism", overwrite=True)
    text = src / "heldout.txt"   # shipped with it: text in its language that no training batch read
    threshold = selection_threshold(int(json.loads((src / "config.json").read_text())["index_topk"]))
    lengths = recall_lengths(threshold)
    rows = [{"variant": "base", "bytes": Checkpoint.open(src).total_bytes, "dst": str(src)}]
    step(f"wrote the organism ({human_bytes(rows[0]['bytes'])}, selection threshold {threshold} tokens) to {src}, "
         "with its held-out text")
    for variant in VARIANTS:
        dst = workdir / variant
        with open(workdir / f"{variant}-convert.log", "w") as log, contextlib.redirect_stdout(log):
            result = convert(ConvertOptions(src=str(src), dst=dst, recipe=load_recipe(variant), overwrite=True,
                                            progress=False))
            check = validate(dst, against=src, report_dir=workdir / f"{variant}-validation", progress=False)
        s = result.stats
        fidelity = text_fidelity(src, dst, text)
        summary = recall(src, dst, lengths)
        rows[0].setdefault("recall", accuracy_by_length(summary["tracks"]["base"]))   # the same in every run
        rows.append({
            "variant": variant,
            "bytes": Checkpoint.open(dst).total_bytes,
            "lossless": (s["lossless_blocks"] / s["total_blocks"]) if s["total_blocks"] else None,
            "worst_snr_db": check.summary["worst_snr_db"],
            "passed": check.summary["passed"],
            **fidelity,
            "recall": accuracy_by_length(summary["tracks"]["variant"]),
            "verdict": verdict(summary, "base", "variant").replace("variant:", f"{variant}:", 1),
            "dst": str(dst),
        })
        step(f"{variant}: converted, validated ({'ok' if check.summary['passed'] else 'FAILED'}), compared")
    dst = inject(src, workdir / f"fault-{FAULT.kind}-layers.{FAULT.layer}", FAULT, overwrite=True)
    summary = recall(src, dst, lengths, local=True)
    rows.append({"variant": "fault", "fault": FAULT.describe(),
                 "recall": accuracy_by_length(summary["tracks"]["variant"]), "diagnosis": summary["diagnosis"],
                 "verdict": verdict(summary, "base", "variant").replace("variant:", "fault:", 1), "dst": str(dst)})
    step(f"fault ({FAULT.describe()}): compare --recall --local")
    print_table(rows, lengths, threshold)
    print(f"\nworkdir {workdir}: the checkpoints, <variant>-validation/validate.md, <variant>-convert.log; "
          f"total {time.monotonic() - t0:.0f} s")
    return rows


def print_table(rows: list[dict], lengths: list[int], threshold: int) -> None:
    """The table, the verdicts of what loses needles, and what the numbers mean."""
    cells = "".join(f"{n:>6d}" for n in lengths)
    print(f"\n{'':72s}recall (%) by prompt length")
    print(f"{'variant':8s} {'size':>9s} {'lossless':>9s} {'worst SNR':>10s} {'check':>6s} {'KLD':>10s} "
          f"{'same top-1':>11s}  {cells}")
    for r in rows:
        recalled = "".join(f"{100 * r['recall'][n]:6.0f}" for n in lengths)
        if r["variant"] == "fault":
            print(f"{'fault':8s} {r['fault']:62s}  {recalled}")
            continue
        lossless = "-" if r.get("lossless") is None else f"{100 * r['lossless']:.2f}%"
        snr = "-" if "worst_snr_db" not in r else ("exact" if math.isinf(r["worst_snr_db"])
                                                     else f"{r['worst_snr_db']:.1f} dB")
        check = "-" if "passed" not in r else ("ok" if r["passed"] else "FAIL")
        kld = "-" if "kld" not in r else f"{r['kld']:.4g}"
        top1 = "-" if "same_top1" not in r else f"{100 * r['same_top1']:.1f}%"
        print(f"{r['variant']:8s} {human_bytes(r['bytes']):>9s} {lossless:>9s} {snr:>10s} {check:>6s} {kld:>10s} "
              f"{top1:>11s}  {recalled}")
    base = rows[0]["recall"]
    for r in rows[1:]:
        if r["variant"] == "fault" or any(r["recall"][n] < base[n] for n in lengths):
            print("\n" + textwrap.fill(r["verdict"], WIDTH))
    print("\n" + textwrap.fill(
        "size: on disk; lossless: MXFP4 blocks kept bit-exact; worst SNR and check: validate against the organism. "
        f"KLD (nats per token, mean) and same top-1 on {TEXT_TOKENS} tokens of held-out text, and recall (one "
        f"needle per length at depth {DEPTH}, its answer teacher-forced): each side with the numerics {SGLANG_LABEL} "
        f"serves it with on {GPU_FAMILY}, the base too. There the base's and nvfp4's experts run W4A16 and fp8's "
        "FP8 experts W8A8, so fp8 reads KLD > 0 though its weights are lossless (--numerics weights: exactly 0). "
        f"The fault is a known truth: below the {threshold}-token selection threshold every indexer keeps every "
        f"entry, past it layers.{FAULT.layer}'s zeroed indexer decides. A 7.4M-parameter organism's magnitudes say "
        "nothing about the 284B model's: the point is that the instrument reads known faults right "
        "(docs/organism.md).", WIDTH))


def demo_passed(rows: list[dict]) -> bool:
    """Every variant validated, and the injected fault diagnosed as its layer's indexer."""
    fault = rows[-1]["diagnosis"]
    return (all(r["passed"] for r in rows if "passed" in r)
            and (fault["kind"], fault["layer"]) == ("indexer", f"layers.{FAULT.layer}"))
