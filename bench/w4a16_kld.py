"""W4A16 group size and scale rule judged by the model: KLD against the base on the same text.

Weight SNR (``bench/w4a16_quality.py``) says how far each expert's INT4 weights are from the MXFP4
source; this says what that does to the model's next-token distribution. On a synthetic model
(``dsv4convert synth --preset small`` by default: 8 layers, 32 experts of 256 x 512, the real
layout), each INT4 scheme (group 32 / 128 x ``mse`` / ``amax``) is converted with ``to-w4a16`` and
compared with the base by ``dsv4convert compare --numerics weights`` (both sides' weights as
stored, BF16 activations: the W4A16 serving path) on the same UTF-8 text, tokenized with the
checkpoint's tokenizer. Reported per scheme: mean KLD +- SE and its 99th percentile, same top-1,
perplexity ratio, and the routed experts' bytes against the output size.

A synthetic model's weights are random, so absolute KLDs say little about the real model; the
ratios between schemes on the same text are the point. For the real model, run ``compare`` with
``--device cuda`` on the converted checkpoints (docs/w4a16.md).

    python bench/w4a16_kld.py --work /tmp/w4a16-kld --text README.md --text docs/compare.md
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.convert import _machine  # noqa: E402
from dsv4convert.checkpoint import Checkpoint  # noqa: E402

SCHEMES = [(32, "mse"), (32, "amax"), (128, "mse"), (128, "amax")]


def _run(*args: str) -> float:
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "dsv4convert", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"dsv4convert {' '.join(args)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return time.monotonic() - start


def _expert_bytes(path: Path) -> tuple[int, int]:
    """(routed-expert bytes, all tensor bytes) of a checkpoint, from its headers."""
    tensors = Checkpoint.open(path).tensors
    experts = sum(e.nbytes for name, e in tensors.items() if ".ffn.experts." in name)
    return experts, sum(e.nbytes for e in tensors.values())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--text", action="append", required=True, help="UTF-8 text (repeatable)")
    parser.add_argument("--preset", default="small", choices=["tiny", "small"])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--out", default="bench/results/w4a16-kld-cpu")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    base = args.work / "base"
    seconds = {"synth": _run("synth", "--preset", args.preset, "--dst", str(base), "--overwrite")}
    rows = []
    for group, rule in SCHEMES:
        name = f"g{group}-{rule}"
        dst, report_dir = args.work / name, args.work / f"{name}-compare"
        seconds[f"convert {name}"] = _run("to-w4a16", "--src", str(base), "--dst", str(dst), "--overwrite",
                                          "--group-size", str(group), "--scale-rule", rule, "--no-progress")
        seconds[f"compare {name}"] = _run(
            "compare", "--base", str(base), "--variant", str(dst), "--numerics", "weights",
            *[x for t in args.text for x in ("--text", t)], "--tokens", str(args.tokens), "--seq-len",
            str(args.seq_len), "--device", args.device, "--no-progress", "--report", str(report_dir))
        result = json.loads((report_dir / "compare.json").read_text())
        experts, total = _expert_bytes(dst)
        rows.append({"group_size": group, "scale_rule": rule, "output": result["output"],
                     "tokens": result["output"]["positions"], "expert_bytes": experts, "tensor_bytes": total})
    write_report(rows, seconds, args)
    return 0


def write_report(rows: list[dict], seconds: dict, args: argparse.Namespace) -> None:
    machine = _machine(args.device)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip() or "-"
    command = "python " + " ".join(sys.argv)
    lines = ["# W4A16 schemes judged by the model: KLD against the base on the same text", "",
             f"- machine: {machine['cpu']}, {machine['cores']} cores, {machine['memory_gib']} GiB; torch "
             f"{machine['torch']}", f"- commit `{commit}`", f"- command: `{command}`",
             f"- model: `dsv4convert synth --preset {args.preset}` (random weights, the real layout); text "
             f"{', '.join(args.text)}, {rows[0]['tokens']} scored positions in sequences of {args.seq_len}; "
             "`compare --numerics weights` (W4A16 serving: INT4 weights, BF16 activations)", "",
             "| group | scale rule | mean KLD (nats) | KLD p99 | same top-1 | PPL ratio | expert bytes | output bytes |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        o = r["output"]
        kld = o["kld"]
        lines.append(f"| {r['group_size']} | {r['scale_rule']} | {kld['mean']:.5f} +- {kld['standard_error']:.5f} | "
                     f"{kld['percentiles']['99']:.4f} | {100 * o['same_top1']:.2f}% | {o['perplexity']['ratio']:.4f} | "
                     f"{r['expert_bytes'] / 1e6:.2f} MB | {r['tensor_bytes'] / 1e6:.2f} MB |")
    by = {(r["group_size"], r["scale_rule"]): r["output"]["kld"]["mean"] for r in rows}
    lines += ["", f"KLD of group 32 against group 128 (both searched): {by[(32, 'mse')] / by[(128, 'mse')]:.2f}x; "
                  f"the search against amax / 7.5 at group 32: {by[(32, 'mse')] / by[(32, 'amax')]:.2f}x, at group "
                  f"128: {by[(128, 'mse')] / by[(128, 'amax')]:.2f}x.", ""]
    result = {"machine": machine, "commit": commit, "command": command, "seconds": seconds, "schemes": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(f"{args.out}.json").write_text(json.dumps(result, indent=1))
    Path(f"{args.out}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
