"""The shipped model organism's provenance as a report, and a retrain of it compared with it (CPU).

The organism (``dsv4convert/data/organism``) was trained on one GPU by ``dsv4convert train-organism``;
its ``organism.json`` records the command, commit, seed, device, seconds, the training curve (losses and
teacher-forced recall per length every ``eval_every`` steps) and the written checkpoint's recall by length
and depth. This script renders it, and, with ``--retrain``, a second run of the same command replayed
with ``--steps`` (the step count the provenance records) beside it: recall side by side and, when the
retrain's checkpoint is there, every stored tensor compared bitwise and every dequantized weight
(:func:`dsv4convert.organism.export.load_release`) compared in float. Run from the repository root::

    python bench/organism.py --retrain /path/to/retrain            # a checkpoint directory (or its organism.json)

Writes ``<out>.md``, ``<out>.json`` and ``<out>-curve.png`` (``--out``, default
``bench/results/organism-h200``). Nothing here needs a GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import report  # noqa: E402

SHIPPED = ROOT / "dsv4convert/data/organism"
PROVENANCE = "organism.json"
CURVE_COLUMNS = [("step", "step", "{:d}"), ("seconds", "s", "{:.1f}"), ("loss", "loss", "{:.3f}"),
                 ("lm", "LM loss", "{:.4f}"), ("mtp", "MTP loss", "{:.4f}"), ("indexer_kl", "indexer KL", "{:.3f}"),
                 ("answer_ce", "answer CE", "{:.4f}"), ("answer_token_accuracy", "answer token acc.", "{:.1%}")]


def selection_figures(config: dict, settings: dict) -> dict:
    """The organism's selection threshold (``needle.selection_threshold``), 8x it, and the training length."""
    from dsv4convert.needle import CSA_RATIO, selection_threshold

    threshold = selection_threshold(int(config["index_topk"]))
    return {"index_topk": int(config["index_topk"]), "ratio": CSA_RATIO, "threshold": threshold,
            "eight_times_threshold": 8 * threshold, "training_max_length": int(settings["max_length"]),
            "sliding_window": int(config["sliding_window"])}


def read_provenance(path: Path) -> tuple[dict, Path | None]:
    """(provenance, checkpoint directory or None) from a checkpoint directory or an organism.json."""
    path = Path(path)
    if path.is_dir():
        return json.loads((path / PROVENANCE).read_text()), path
    checkpoint = path.parent if (path.parent / "model.safetensors.index.json").exists() else None
    return json.loads(path.read_text()), checkpoint


def compare_weights(shipped: Path, retrain: Path) -> dict:
    """Every stored tensor bitwise (the bytes of the release format: FP8 codes and scales, MXFP4 nibbles and
    scales, BF16, F32, I64), and every dequantized weight of the two models in float32."""
    import torch
    from safetensors import safe_open

    from dsv4convert.organism.export import load_release

    def stored(root: Path) -> dict:
        index = json.loads((root / "model.safetensors.index.json").read_text())["weight_map"]
        out = {}
        for shard in sorted(set(index.values())):
            with safe_open(str(root / shard), framework="pt") as f:
                for name in f.keys():
                    out[name] = f.get_tensor(name)
        return out

    files = {p.name: (p.read_bytes() == (retrain / p.name).read_bytes()) if (retrain / p.name).exists() else None
             for p in sorted(shipped.iterdir()) if p.is_file() and p.name != PROVENANCE}
    a, b = stored(shipped), stored(retrain)
    if a.keys() != b.keys():
        raise SystemExit(f"the two checkpoints store different tensors: {sorted(a.keys() ^ b.keys())[:8]}")
    stored_rows = []
    for name in sorted(a):
        x, y = a[name], b[name]
        same_shape = x.shape == y.shape and x.dtype == y.dtype
        xb = x.contiguous().view(torch.uint8).flatten() if same_shape else None
        yb = y.contiguous().view(torch.uint8).flatten() if same_shape else None
        identical = bool(same_shape and torch.equal(xb, yb))
        stored_rows.append({"name": name, "dtype": str(x.dtype).removeprefix("torch."), "numel": x.numel(),
                            "identical": identical,
                            "bytes_differing": None if not same_shape else int((xb != yb).sum())})
    sa = load_release(shipped).native_state()
    sb = load_release(retrain).native_state()
    float_rows = []
    for name in sorted(sa):
        x, y = sa[name].double(), sb[name].double()
        diff = (x - y).abs()
        scale = x.abs().max().item()
        norm = x.norm().item()
        float_rows.append({
            "name": name, "numel": x.numel(), "identical": bool(torch.equal(sa[name], sb[name])),
            "elements_differing": int((sa[name] != sb[name]).sum()),
            "max_abs_diff": diff.max().item(),
            "max_abs_diff_over_max_abs": diff.max().item() / scale if scale else 0.0,
            "rel_l2": (x - y).norm().item() / norm if norm else 0.0,
        })
    return {
        "files_identical": files,
        "stored": {"tensors": len(stored_rows), "identical": sum(r["identical"] for r in stored_rows),
                   "rows": stored_rows},
        "dequantized": {"tensors": len(float_rows), "identical": sum(r["identical"] for r in float_rows),
                        "max_rel_l2": max(r["rel_l2"] for r in float_rows),
                        "max_abs_diff_over_max_abs": max(r["max_abs_diff_over_max_abs"] for r in float_rows),
                        "rows": float_rows},
    }


def pct(value: float) -> str:
    return f"{100 * value:.0f}%" if value in (0.0, 1.0) else f"{100 * value:.1f}%"


def plot(out: Path, shipped: dict, retrain: dict | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = list(shipped["curve"][0]["recall"])
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7.5), sharex=True)
    colors = plt.cm.viridis([i / max(1, len(lengths) - 1) for i in range(len(lengths))])
    for run, style, label in ((shipped, "-", "shipped"), (retrain, "--", "retrain")):
        if run is None:
            continue
        seconds = [p["seconds"] for p in run["curve"]]
        for color, length in zip(colors, lengths):
            top.plot(seconds, [100 * p["recall"][length] for p in run["curve"]], style, color=color, marker=".",
                     label=f"{length} tokens" if run is shipped else None)
        bottom.plot(seconds, [p["loss"] for p in run["curve"]], style, color="black", marker=".",
                    label=f"loss ({label})")
        bottom.plot(seconds, [p["answer_ce"] for p in run["curve"]], style, color="tab:red", marker=".",
                    label=f"answer CE ({label})")
    top.set_ylabel("teacher-forced recall (%)")
    top.set_ylim(-3, 103)
    top.legend(fontsize=8, ncol=3, title="eval length" + (" (solid: shipped, dashed: retrain)" if retrain else ""),
               title_fontsize=8)
    top.grid(alpha=0.3)
    top.set_title(f"organism training on {shipped['device']}: {shipped['steps']} steps, seed {shipped['seed']}")
    bottom.set_yscale("log")
    bottom.set_ylabel("loss (mean since last eval)")
    bottom.set_xlabel("training seconds")
    bottom.legend(fontsize=8)
    bottom.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def curve_table(run: dict) -> list[str]:
    lengths = list(run["curve"][0]["recall"])
    head = [c[1] for c in CURVE_COLUMNS] + [f"recall {n}" for n in lengths]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for point in run["curve"]:
        cells = [fmt.format(point[key]) if key in point else "" for key, _, fmt in CURVE_COLUMNS]
        cells += [pct(point["recall"][n]) for n in lengths]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def dips(run: dict) -> list[str]:
    """A sentence on the points where the mean recall fell by more than 20 points from the previous one."""
    means = [(p["step"], sum(p["recall"].values()) / len(p["recall"])) for p in run["curve"]]
    falls = [(step, before, after) for (_, before), (step, after) in zip(means, means[1:]) if before - after > 0.2]
    if not falls:
        return []
    return ["Recall is not monotone in training: " + "; ".join(
        f"at step {step} the mean over lengths fell from {before:.0%} to {after:.0%}" for step, before, after in falls)
        + f" (on {3 * run['settings']['eval_trials']} needles per length); at the last point it is "
        f"{means[-1][1]:.0%}.", ""]


def release_table(runs: list[tuple[str, dict]]) -> list[str]:
    depths = list(next(iter(runs[0][1]["release_recall"]["by_length_and_depth"].values())))
    head = ["length"] + [f"{label}: depth {d}" for label, _ in runs for d in depths] + \
        [f"{label}: all" for label, _ in runs]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for length in runs[0][1]["release_recall"]["by_length_and_depth"]:
        cells = [length]
        for _, run in runs:
            cells += [pct(run["release_recall"]["by_length_and_depth"][length][d]) for d in depths]
        for _, run in runs:
            row = run["release_recall"]["by_length_and_depth"][length]
            cells.append(pct(sum(row.values()) / len(row)))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--organism", type=Path, default=SHIPPED, help="the shipped organism (directory)")
    parser.add_argument("--retrain", type=Path,
                        help="a retrain of it: its checkpoint directory, or its organism.json (recall only)")
    parser.add_argument("--note", default="", help="a sentence on how the retrain was run (into its section)")
    parser.add_argument("--out", default=str(ROOT / "bench/results/organism-h200"))
    args = parser.parse_args()

    shipped, _ = read_provenance(args.organism)
    config = json.loads((args.organism / "config.json").read_text())
    figures = selection_figures(config, shipped["settings"])
    retrain, retrain_dir = read_provenance(args.retrain) if args.retrain else (None, None)
    weights = compare_weights(args.organism, retrain_dir) if retrain_dir is not None else None
    png = Path(f"{args.out}-curve.png")
    png.parent.mkdir(parents=True, exist_ok=True)
    plot(png, shipped, retrain)

    s = shipped["settings"]
    trials = shipped["release_recall"]["trials_per_cell"]
    lengths = list(shipped["release_recall"]["by_length_and_depth"])
    md = [
        f"# The model organism on the {shipped['device']}: training curve and the written checkpoint's recall",
        "",
        f"- device: {shipped['device']} (one GPU); torch {shipped['torch']}, transformers {shipped['transformers']}, "
        f"{shipped['tool']}",
        f"- commit `{shipped['commit']}`; seed {shipped['seed']}",
        f"- command: `{shipped['command']}`",
        f"- {shipped['parameters']:,} parameters ({shipped['parameters'] / 1e6:.2f}M); {shipped['steps']} steps of "
        f"{s['tokens_per_step']:,} tokens (prompts of {s['min_length']}-{s['max_length']} tokens, "
        f"{s['needle_fraction']:.0%} needle rows), {s['dense_steps']} dense indexer steps then every "
        f"{s['dense_every']}th; {shipped['training_seconds']} s of training"
        f"{' (hit the time limit)' if shipped['hit_time_limit'] else ''}, {shipped['total_seconds']} s with "
        f"writing and measuring the checkpoint",
        f"- provenance: `dsv4convert/data/organism/organism.json`; rendered by `python bench/organism.py"
        f"{' --retrain ' + str(args.retrain) if args.retrain else ''}`; raw: `{Path(args.out).name}.json`",
        "",
        f"Recall is teacher-forced: a needle counts when every one of its {7} answer tokens is the argmax "
        f"given the true tokens before it (`organism.train.recall_by_length`), with the checkpoint's own top-k. "
        f"The selection threshold is {figures['threshold']} tokens (index_topk {figures['index_topk']}: "
        f"{figures['ratio']}*{figures['index_topk']}+{figures['ratio']}, `needle.selection_threshold`): "
        f"below it the indexer's top-k holds every compressed entry and its choices cannot matter; 259 is the "
        f"last length under it, 260 the first at it. 8x the threshold is {figures['eight_times_threshold']}; "
        f"4096 is past the training length ({figures['training_max_length']} tokens), so recall there is "
        f"extrapolation.",
        "",
        f"## Training curve (every {s['eval_every']} steps)",
        "",
        f"Losses are means over the steps since the previous point; recall is on {s['eval_trials']} fresh needles "
        f"at each of depths 0.1, 0.5, 0.9 ({3 * s['eval_trials']} per length), of the float32 model in training "
        f"(not the written checkpoint). Loss is the total (LM with answer tokens weighted {s['answer_weight']:g}x "
        f"+ {s['mtp_weight']:g} MTP + indexer KL summed over the CSA layers + the two aids), so the KL dominates it.",
        "",
        *curve_table(shipped),
        "",
        *dips(shipped),
        f"![recall and loss over time]({png.name})",
        "",
        f"## The written checkpoint (FP8 128x128 linears, MXFP4 experts), read back and dequantized",
        "",
        f"{trials} fresh needles per cell (seeded apart from the curve's).",
        "",
        *release_table([("shipped", shipped)]),
        "",
    ]
    result = {"shipped": shipped, "selection": figures}
    if retrain is not None:
        r = retrain
        same_settings = {k: v for k, v in s.items() if k != "steps"} == \
            {k: v for k, v in r["settings"].items() if k != "steps"} and s["steps"] == r["steps"]
        cells = [(n, d, shipped["release_recall"]["by_length_and_depth"][n][d],
                  r["release_recall"]["by_length_and_depth"][n][d])
                 for n in lengths for d in shipped["release_recall"]["by_length_and_depth"][n]]
        curve_same = [p["recall"] == q["recall"] for p, q in zip(shipped["curve"], r["curve"])]
        untimed = (lambda point: {k: v for k, v in point.items() if k != "seconds"})
        curve_exact = len(shipped["curve"]) == len(r["curve"]) and all(
            untimed(p) == untimed(q) for p, q in zip(shipped["curve"], r["curve"]))
        md += [
            "## Reproduction: the same training replayed on an H200",
            "",
            f"- retrain: {r['device']}, commit `{r['commit']}`, torch {r['torch']}, transformers {r['transformers']}",
            f"- command: `{r['command']}` (the step count the shipped provenance records, replayed; "
            f"settings {'identical' if same_settings else 'NOT identical'} to the shipped run's)",
            f"- {r['steps']} steps in {r['training_seconds']} s of training (shipped: {shipped['steps']} in "
            f"{shipped['training_seconds']} s), {r['total_seconds']} s in all (shipped {shipped['total_seconds']} s)"
            f"{'; hit the time limit' if r['hit_time_limit'] else ''}",
            "- provenance: `organism-retrain-h200.json`",
            *([f"- {args.note}"] if args.note else []),
            "",
            "Written checkpoint's recall, side by side:",
            "",
            *release_table([("shipped", shipped), ("retrain", r)]),
            "",
            f"Cells that differ: {sum(a != b for _, _, a, b in cells)} of {len(cells)}. "
            f"Training-curve recall identical at {sum(curve_same)} of {len(curve_same)} points; final loss "
            f"{shipped['curve'][-1]['loss']:.4f} (shipped) / {r['curve'][-1]['loss']:.4f} (retrain), answer CE "
            f"{shipped['curve'][-1]['answer_ce']:.4f} / {r['curve'][-1]['answer_ce']:.4f}. Every curve figure but "
            f"the seconds (all losses to the 4 decimals recorded, every recall) "
            f"{'is the same in both runs' if curve_exact else 'is NOT the same in both runs'}.",
            "",
        ]
        curve_rows = ["| step | s (shipped / retrain) | loss | answer CE | recall 130..2080 shipped | retrain |",
                      "|---|---|---|---|---|---|"]
        for p, q in zip(shipped["curve"], r["curve"]):
            curve_rows.append(
                f"| {p['step']} | {p['seconds']} / {q['seconds']} | {p['loss']:.4f} / {q['loss']:.4f} | "
                f"{p['answer_ce']:.4f} / {q['answer_ce']:.4f} | "
                f"{' '.join(pct(v) for v in p['recall'].values())} | "
                f"{' '.join(pct(v) for v in q['recall'].values())} |")
        md += ["Training curve, side by side:", "", *curve_rows, ""]
        result["retrain"] = r
        result["reproduction"] = {"same_settings": same_settings,
                                  "release_cells_differing": sum(a != b for _, _, a, b in cells),
                                  "release_cells": len(cells), "curve_points_recall_identical": sum(curve_same),
                                  "curve_points": len(curve_same), "curve_identical_but_seconds": curve_exact}
        if weights is not None:
            st, dq = weights["stored"], weights["dequantized"]
            worst = sorted(dq["rows"], key=lambda row: -row["rel_l2"])[:8]
            md += [
                "Weights (the retrain's checkpoint against the shipped one):",
                "",
                f"- stored tensors (release format, bytes): **{st['identical']} of {st['tensors']} bitwise identical**",
                "- files other than organism.json, byte for byte: " + ", ".join(
                    f"{name} {'identical' if same else 'different' if same is not None else 'missing'}"
                    for name, same in weights["files_identical"].items()),
                f"- dequantized weights (float32, `load_release(...).native_state()`): {dq['identical']} of "
                f"{dq['tensors']} identical; largest relative L2 difference ||a-b||/||a|| {dq['max_rel_l2']:.3g}, "
                f"largest max|a-b| / max|a| {dq['max_abs_diff_over_max_abs']:.3g}",
                "",
            ]
            if dq["identical"] < dq["tensors"]:
                md += ["Largest differences (relative L2):", "",
                       "| tensor | elements | elements differing | max abs diff | max abs diff / max abs | rel L2 |",
                       "|---|---|---|---|---|---|"]
                md += [f"| `{w['name']}` | {w['numel']:,} | {w['elements_differing']:,} | {w['max_abs_diff']:.3g} | "
                       f"{w['max_abs_diff_over_max_abs']:.3g} | {w['rel_l2']:.3g} |" for w in worst]
                md.append("")
            result["reproduction"]["weights"] = weights
        md += ["What it shows: " + verdict(shipped, r, weights, cells), ""]
    report.write(args.out, result, "\n".join(md))
    return 0


def verdict(shipped: dict, retrain: dict, weights: dict | None, cells: list) -> str:
    differing = sum(a != b for _, _, a, b in cells)
    if weights is not None and weights["stored"]["identical"] == weights["stored"]["tensors"]:
        auto = "--steps" not in shipped["command"].split()
        return ("the retrain wrote a checkpoint whose every stored byte equals the shipped one's, so on one H200 "
                f"with torch {retrain['torch']} and transformers {retrain['transformers']} the run replays exactly "
                "from its seed and the step count its provenance records"
                + (" (the shipped run chose that count itself from its first 30 steps' speed; the replay passed "
                   "it with --steps, and nothing before the choice depends on it)" if auto else "")
                + (f", at commit {retrain['commit']} as at {shipped['commit']}"
                   if retrain["commit"] != shipped["commit"] else "")
                + ". The order of the GPU's floating-point atomics did not change a bit in this pair of runs; "
                "that is one observation, not a guarantee (the trainer promises bitwise determinism only on a CPU; "
                "another GPU model, driver, torch or transformers may round differently). Only the wall-clock "
                f"figures differ: {retrain['training_seconds']} s of training against {shipped['training_seconds']} s.")
    weight_note = ""
    if weights is not None:
        weight_note = (f" {weights['stored']['identical']} of {weights['stored']['tensors']} stored tensors are "
                       f"bitwise identical and the dequantized weights differ by up to "
                       f"{weights['dequantized']['max_rel_l2']:.2g} in relative L2,")
    return (f"the retrain is not bitwise identical to the shipped organism:{weight_note} as expected of a GPU run "
            f"whose floating-point atomics (scatter-adds in the backward pass) land in a different order; "
            f"differences from the first such step compound over {retrain['steps']} steps. What a seed and step "
            f"count do reproduce is the model's behaviour: {len(cells) - differing} of {len(cells)} recall "
            f"cells of the written checkpoint are equal ({differing} differ), in "
            f"{retrain['training_seconds']} s against {shipped['training_seconds']} s.")


if __name__ == "__main__":
    raise SystemExit(main())
