"""The 4-bit expert schemes judged by the model: KLD against the base on the same text.

Weight SNR (``bench/w4a16_quality.py``) says how far each expert's INT4 weights are from the MXFP4
source; this says what that does to the model's next-token distribution. The base is the
**organism** by default (``dsv4convert synth --preset organism``: the ~7M-parameter DeepSeek-V4
trained on needle prompts and a small English-like language, dsv4convert/data/organism), scored on
held-out text in its own language (``dsv4convert/data/organism/heldout.txt``), so its KLDs mean
something; ``--preset tiny|small`` still measures on a random synthetic model (whose KLDs only
rank schemes). Variants:

* the four INT4 schemes, ``to-w4a16 --group-size 32|128 --scale-rule mse|amax``;
* ``to-nvfp4`` (experts NVFP4: served W4A4 on sm120 through flashinfer, W4A16 through Marlin on sm90);
* ``to-fp8``, the lossless anchor (its experts' MXFP4 values are exact in FP8: weights KLD exactly 0).

Each variant is compared with the base twice on the same positions, through ``dsv4convert compare``
(in process: the same ``build_plan``/``run`` the CLI calls):

* ``--numerics weights``: both sides' stored weights, BF16/float activations (the W4A16 serving path);
* ``--numerics served --base-numerics weights --gpu-family sm120``: the variant as SGLang 0.5.23 computes
  it on an RTX PRO 6000 (``Serving.expert_scheme`` and ``served`` in dsv4convert/compare/numerics.py),
  against the ideal base; the exact numerics of each side are written into the JSON.

Reported per variant and measurement: mean KLD +- SE, its 99th percentile, same top-1, perplexity
ratio, and the routed experts' bytes; then paired differences (the same positions, so the SE of the
per-position difference, not of each mean) for the comparisons that decide the defaults.

    python bench/w4a16_kld.py --work /tmp/w4a16-kld        # organism, its held-out text, 14 x 1024 tokens
    python bench/w4a16_kld.py --work /tmp/kld --preset small --text README.md --seq-len 512 \\
        --out bench/results/w4a16-kld-cpu                   # the old random-model measurement
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.convert import _machine  # noqa: E402
from dsv4convert.checkpoint import Checkpoint  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
HELDOUT = REPO / "dsv4convert" / "data" / "organism" / "heldout.txt"
# name, converter arguments (or the variant whose checkpoint it serves differently), what its routed experts store
VARIANTS = [
    ("g32-mse", ["to-w4a16", "--group-size", "32", "--scale-rule", "mse"], "INT4 g32, searched scales (default)"),
    ("g32-amax", ["to-w4a16", "--group-size", "32", "--scale-rule", "amax"], "INT4 g32, amax / 7.5"),
    ("g128-mse", ["to-w4a16", "--group-size", "128", "--scale-rule", "mse"], "INT4 g128, searched scales"),
    ("g128-amax", ["to-w4a16", "--group-size", "128", "--scale-rule", "amax"], "INT4 g128, amax / 7.5 (old default)"),
    ("nvfp4", ["to-nvfp4"], "NVFP4 (E2M1, FP8 scale per 16)"),
    # the same checkpoint served with flashinfer's CUTLASS runner: W4A4 on sm120 (serve launches Marlin there)
    ("nvfp4-w4a4", "nvfp4", "NVFP4, `--moe-runner-backend flashinfer_cutlass`"),
    ("fp8", ["to-fp8"], "FP8 E4M3, 128x128 blocks (lossless anchor)"),
]
MEASUREMENTS = {"weights": {"numerics": "weights"},
                "served": {"numerics": "served", "base_numerics": "weights", "gpu_family": "sm120"}}
# (a, b): paired KLD difference a - b, per measurement
PAIRS = [("g32-mse", "g128-mse"), ("g32-amax", "g128-amax"), ("g32-mse", "g32-amax"), ("g128-mse", "g128-amax"),
         ("nvfp4-w4a4", "g32-mse"), ("nvfp4-w4a4", "g128-mse"), ("nvfp4-w4a4", "nvfp4"), ("nvfp4", "g32-mse"),
         ("nvfp4-w4a4", "fp8"), ("nvfp4", "fp8"), ("g32-mse", "fp8")]


def _convert(args: list[str], src: Path, dst: Path) -> float:
    from dsv4convert.cli import main as cli

    start = time.monotonic()
    log = io.StringIO()
    with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        code = cli([*args, "--src", str(src), "--dst", str(dst), "--overwrite", "--no-progress"])
    if code != 0:
        raise RuntimeError(f"dsv4convert {' '.join(args)} failed ({code}):\n{log.getvalue()[-3000:]}")
    return time.monotonic() - start


def _compare(base: Path, variant: Path, texts: list[Path], args: argparse.Namespace, measurement: str,
             report: Path, **overrides):
    """``dsv4convert compare`` in process; returns (compare.json's content, the per-position KLDs)."""
    import torch

    if args.reuse and (report / "compare.json").exists() and (report / "kld.pt").exists():
        return json.loads((report / "compare.json").read_text()), torch.load(report / "kld.pt")
    from dsv4convert.compare.run import CompareOptions, build_plan, run
    from dsv4convert.checkpoint import atomic_write_json

    opts = CompareOptions(base=str(base), variant=str(variant), texts=list(texts), tokens=args.tokens,
                          seq_len=args.seq_len, device=args.device, progress=False, **MEASUREMENTS[measurement], **overrides)
    result = run(build_plan(opts))
    kld = result.pop("_kld_values").double()
    report.mkdir(parents=True, exist_ok=True)
    atomic_write_json(report / "compare.json", result)
    torch.save(kld, report / "kld.pt")
    return result, kld


def _expert_bytes(path: Path) -> tuple[int, int]:
    """(routed-expert bytes, all tensor bytes) of a checkpoint, from its headers."""
    tensors = Checkpoint.open(path).tensors
    experts = sum(e.nbytes for name, e in tensors.items() if ".ffn.experts." in name)
    return experts, sum(e.nbytes for e in tensors.values())


def _served_experts(result: dict) -> str:
    """The served variant's expert numerics on its serving settings, in words."""
    from dsv4convert.checkpoint import Checkpoint as Ckpt
    from dsv4convert.compare.numerics import Serving
    from dsv4convert.inspection import inspect_checkpoint
    from dsv4convert.models.deepseek_v4.layout import Role

    side = result["variant"]
    serving = side["numerics"]["serving"]
    fmt = next(m.format for m in inspect_checkpoint(Ckpt.open(side["path"])).modules.values()
               if m.role is Role.ROUTED_EXPERT and not m.is_mtp and m.format is not None)
    rule = Serving(engine=serving["engine"], gpu_family=serving["gpu_family"], variant=serving["variant_rules"],
                   moe_runner_backend=serving["moe_runner_backend"], fp8_gemm_backend=serving["fp8_gemm_backend"],
                   kv_cache_dtype=serving["kv_cache_dtype"], fp4_indexer=serving["fp4_indexer"],
                   ue8m0_checkpoint=False, fp8_wo_a=False, server_args=())
    scheme = rule.expert_scheme(fmt, is_mtp=False)
    weights = {"int4": "W4", "nvfp4": "W4", "mxfp4": "W4", "fp8": "W8", "bf16": "W16"}[fmt.value]
    acts = {None: "A16", "fp8": "A8 (FP8 token groups)", "mxfp8": "A8 (MXFP8)", "nvfp4": "A4 (NVFP4)"}[scheme]
    return f"{fmt.value} {weights}{acts}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--text", action="append", type=Path,
                        help="UTF-8 text (repeatable; default: the organism's held-out text)")
    parser.add_argument("--preset", default="organism", choices=["organism", "tiny", "small"])
    parser.add_argument("--tokens", type=int, default=14336)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--variants", default=",".join(v[0] for v in VARIANTS),
                        help="comma-separated subset of " + ", ".join(v[0] for v in VARIANTS))
    parser.add_argument("--out", default=None, help="default: bench/results/w4a16-kld-{organism-,}cpu")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--reuse", action="store_true",
                        help="keep the checkpoints and compare results already in --work (rewrite the report only)")
    args = parser.parse_args()
    args.text = args.text or [HELDOUT]
    args.out = args.out or f"bench/results/w4a16-kld-{'organism-' if args.preset == 'organism' else ''}cpu"
    args.work.mkdir(parents=True, exist_ok=True)
    base = args.work / "base"
    start = time.monotonic()
    if args.reuse and (base / "model.safetensors.index.json").exists():
        pass
    elif args.preset == "organism":
        from dsv4convert.organism.export import write_organism

        write_organism(base, overwrite=True)
    else:
        from dsv4convert.cli import main as cli

        cli(["synth", "--preset", args.preset, "--dst", str(base), "--overwrite"])
    seconds = {"synth": round(time.monotonic() - start, 2)}
    wanted = args.variants.split(",")
    rows, klds, copied = [], {}, set()
    for name, convert, experts in VARIANTS:
        if name not in wanted:
            continue
        same = next((r for r in rows if r["variant"] == convert), None) if isinstance(convert, str) else None
        if isinstance(convert, str) and same is None:
            continue
        dst = args.work / (convert if same else name)
        if same is None and not (args.reuse and (dst / "model.safetensors.index.json").exists()):
            seconds[f"convert {name}"] = round(_convert(convert, base, dst), 2)
        expert_bytes, total = _expert_bytes(dst)
        row = {"variant": name, "command": same["command"] if same else ["dsv4convert", *convert],
               "experts": experts, "expert_bytes": expert_bytes, "tensor_bytes": total}
        runner = {"moe_runner_backend": "flashinfer_cutlass"} if same else {}
        for measurement in MEASUREMENTS:
            if same and measurement == "weights":   # stored weights are the other row's: the same measurement
                row[measurement] = same[measurement]
                klds[(name, measurement)] = klds[(convert, measurement)]
                copied.add((name, measurement))
                continue
            start = time.monotonic()
            result, kld = _compare(base, dst, args.text, args, measurement, args.work / f"{name}-{measurement}",
                                   **(runner if measurement == "served" else {}))
            seconds[f"compare {name} {measurement}"] = result["seconds"]["wall"] if args.reuse else round(
                time.monotonic() - start, 2)
            klds[(name, measurement)] = kld
            row[measurement] = {"output": result["output"], "numerics": {"base": result["base"]["numerics"],
                                                                         "variant": result["variant"]["numerics"]},
                                "served_experts": _served_experts(result)}
            o = result["output"]
            print(f"{name} {measurement}: KLD {o['kld']['mean']:.6g} +- {o['kld']['standard_error']:.2g}, "
                  f"same top-1 {100 * o['same_top1']:.2f}% ({seconds[f'compare {name} {measurement}']} s)",
                  flush=True)
        rows.append(row)
    pairs = []
    for a, b in PAIRS:
        for measurement in MEASUREMENTS:
            if (a, measurement) in klds and (b, measurement) in klds and not {(a, measurement), (b, measurement)} & copied:
                d = klds[(a, measurement)] - klds[(b, measurement)]
                mean_b = float(klds[(b, measurement)].mean())
                pairs.append({"a": a, "b": b, "numerics": measurement, "mean_difference": float(d.mean()),
                              "standard_error": float(d.std() / math.sqrt(d.numel())),
                              "ratio": float(klds[(a, measurement)].mean()) / mean_b if mean_b else None,
                              "a_lower_fraction": float((d < 0).double().mean()),
                              "median_ratio": (float(klds[(a, measurement)].median()) / float(klds[(b, measurement)].median())
                                               if float(klds[(b, measurement)].median()) else None),
                              "positions": d.numel()})
    write_report(rows, pairs, seconds, args)
    return 0


def _kld(o: dict) -> str:
    k = o["kld"]
    return f"{k['mean']:.5f} +- {k['standard_error']:.5f}"


def write_report(rows: list[dict], pairs: list[dict], seconds: dict, args: argparse.Namespace) -> None:
    machine = _machine(args.device)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip() or "-"
    command = "python " + " ".join(sys.argv)
    first = rows[0]["weights"]["output"]
    if args.preset == "organism":
        model = ("`dsv4convert synth --preset organism` (the trained ~7M-parameter organism, dsv4convert/data/organism: "
                 "4 layers + MTP, 8 routed experts of 128 x 256 per layer, MXFP4 experts, FP8 dense)")
    else:
        model = f"`dsv4convert synth --preset {args.preset}` (random weights, the real layout: KLDs only rank schemes)"
    texts = ", ".join(str(t.relative_to(REPO) if t.resolve().is_relative_to(REPO) else t) for t in args.text)
    served = rows[0]["served"]["numerics"]["variant"]
    lines = ["# 4-bit expert schemes judged by the model: KLD against the base on the same text", "",
             f"- machine: {machine['cpu']}, {machine['cores']} cores, {machine['memory_gib']} GiB; torch "
             f"{machine['torch']}", f"- commit `{commit}`", f"- command: `{command}`",
             f"- model: {model}", f"- text: {texts}, {first['positions']} scored positions in sequences of "
             f"{args.seq_len}, the same positions for every row (float32 on {args.device})",
             "- **weights**: `compare --numerics weights`: both sides' stored weights, activations unquantized "
             "(the W4A16 serving path)",
             "- **served**: `compare --numerics served --base-numerics weights --gpu-family sm120`: the variant as "
             f"SGLang 0.5.23 computes it on sm120 ({served['label']}; KV cache {served['serving']['kv_cache_dtype']}, "
             "FP8 indexer cache; the W8A8 dense linears with float32 1x128 activation scales where the variant stores "
             "them FP8: the fp8 and nvfp4 variants, not w4a16, which stores them BF16), against the base's weights; "
             "the routed experts' numerics are in the table", "",
             "| variant | routed experts | served experts (sm120) | weights: mean KLD (nats) | median | same top-1 | "
             "PPL ratio | served: mean KLD (nats) | median | same top-1 | PPL ratio | KLD max (weights / served) | "
             "expert bytes |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        w, s = r["weights"]["output"], r["served"]["output"]
        lines.append(f"| {r['variant']} | {r['experts']} | {r['served']['served_experts']} | {_kld(w)} | "
                     f"{w['kld']['percentiles']['50']:.2e} | {100 * w['same_top1']:.2f}% | {w['perplexity']['ratio']:.4f} | "
                     f"{_kld(s)} | {s['kld']['percentiles']['50']:.2e} | {100 * s['same_top1']:.2f}% | "
                     f"{s['perplexity']['ratio']:.4f} | "
                     f"{w['kld']['percentiles']['100']:.3f} / {s['kld']['percentiles']['100']:.3f} | "
                     f"{r['expert_bytes'] / 1e6:.3f} MB |")
    lines += ["", "Paired differences on the same positions (a - b; SE of the per-position difference; "
                  "'a lower' = share of positions where a's KLD is below b's):", "",
              "| a | b | numerics | mean KLD a / b | mean a - b (nats) | SE | median KLD a / b | a lower |",
              "|---|---|---|---|---|---|---|---|"]
    for p in pairs:
        ratio = f"{p['ratio']:.3f}x" if p["ratio"] is not None else "-"
        median = f"{p['median_ratio']:.3f}x" if p["median_ratio"] is not None else "-"
        lines.append(f"| {p['a']} | {p['b']} | {p['numerics']} | {ratio} | {p['mean_difference']:+.5f} | "
                     f"{p['standard_error']:.5f} | {median} | {100 * p['a_lower_fraction']:.1f}% |")
    lines += ["", f"Time (s): {json.dumps(seconds)}", ""]
    result = {"machine": machine, "commit": commit, "command": command, "preset": args.preset,
              "texts": [str(t) for t in args.text], "tokens": args.tokens, "seq_len": args.seq_len,
              "seconds": seconds, "variants": rows, "pairs": pairs}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(f"{args.out}.json").write_text(json.dumps(result, indent=1))
    Path(f"{args.out}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
