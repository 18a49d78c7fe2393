"""``compare``'s reports: ``compare.json`` for machines, ``compare.md`` for people, two PNGs.

The Markdown leads with the headline numbers (llama.cpp's KLD set, same top-1, Δp, perplexity
ratio, expected acceptance), then the MTP draft's agreement per side, the layers ranked by the
error they add on their own (*local*), and what each side's numerics were.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from dsv4convert.checkpoint import atomic_write_bytes, atomic_write_json
from dsv4convert.engines import SGLANG_LABEL


def _num(x: float | None, digits: int = 4) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if x == 0:
        return "0"
    return f"{x:.{digits}g}" if abs(x) < 1e-3 or abs(x) >= 1e4 else f"{x:.{digits}f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.2f}%"


def render_markdown(result: dict) -> str:
    out = result["output"]
    kld, dp, ppl = out["kld"], out["delta_p"], out["perplexity"]
    base, variant = result["base"], result["variant"]
    lines = [
        f"# compare: {variant['path']} against {base['path']}",
        "",
        f"{result['data']['sequences']} sequences of {result['data']['seq_len']} tokens "
        f"({out['positions']} positions scored); base numerics: {base['numerics']['label']}, "
        f"variant numerics: {variant['numerics']['label']}; {result['tool']}.",
        "",
        "| metric | value |",
        "|---|---|",
        f"| mean KLD (base \u2016 variant), nats | {_num(kld['mean'])} \u00b1 {_num(kld['standard_error'])} |",
        "| KLD max / 99.9% / 99% / 95% / 90% / median | "
        + " / ".join(_num(kld["percentiles"][p]) for p in ("100", "99.9", "99", "95", "90", "50")) + " |",
        f"| same top-1 | {_pct(out['same_top1'])} |",
        f"| \u0394p of the reference token: mean / RMS | {_pct(dp['mean'])} / {_pct(dp['rms'])} |",
        f"| \u0394p 99% / 1% | {_pct(dp['percentiles']['99'])} / {_pct(dp['percentiles']['1'])} |",
        f"| perplexity base / variant (ratio) | {_num(ppl['base'])} / {_num(ppl['variant'])} ({_num(ppl['ratio'])}) |",
        f"| expected acceptance \u03a3 min(p, q) | {_pct(out['expected_acceptance'])} |",
        "",
    ]
    if result["mtp_draft_agreement"].get("base"):
        lines += ["## MTP draft", "",
                  "How often the draft's top-1 is its own main model's next top-1 (what speculative decoding accepts):",
                  "", "| block | base | variant |", "|---|---|---|"]
        for block, value in result["mtp_draft_agreement"]["base"].items():
            lines.append(f"| {block} | {_pct(value)} | {_pct(result['mtp_draft_agreement']['variant'][block])} |")
        lines.append("")
    if result.get("dspark"):
        lines += dspark_lines(result["dspark"])
    if result.get("v41"):
        lines += v41_lines(result["v41"], (variant["numerics"].get("not_emulated") or []))
    lines += ["## Layers, by the error each adds on its own", "",
              "*local*: the variant's block fed the base's input; *free-running*: each side on its own streams "
              "(the drift a user gets). Relative error of the output streams, and cosine.", "",
              "| block | local rel. error | local cosine | free-running rel. error | free-running cosine |",
              "|---|---|---|---|---|"]
    for b in sorted(result["blocks"], key=lambda b: -b["local"]["relative_error"]):
        lines.append(f"| {b['block']} | {_num(b['local']['relative_error'])} | {_num(b['local']['cosine'], 6)} | "
                     f"{_num(b['free_running']['relative_error'])} | {_num(b['free_running']['cosine'], 6)} |")
    lines += ["", "## Numerics of each side", "", "| | base | variant |", "|---|---|---|"]
    sb, sv = base["numerics"], variant["numerics"]
    for key in ("activations", "kv_cache", "indexer"):
        lines.append(f"| {key} | {sb[key]} | {sv[key]} |")
    for key in ("gpu_family", "variant_rules", "moe_runner_backend", "fp8_gemm_backend", "kv_cache_dtype",
                "dense_fp8_activation_scales", "wo_a"):
        lines.append(f"| {key} | {(sb['serving'] or {}).get(key, '-')} | {(sv['serving'] or {}).get(key, '-')} |")
    lines += ["", f"What each setting emulates, and the {SGLANG_LABEL} code it follows: docs/served-numerics.md.",
              "", *_time_lines(result)]
    return "\n".join(lines)


def dspark_lines(d: dict) -> list[str]:
    """The DSpark section: per draft position, the length SGLang counts, each component's local error, the verdict."""
    a = d["anchors"]
    lines = ["## DSpark draft", "", f"**{d['verdict']['sentence']}.**", "",
             f"{a['blocks']} blocks of {d['block_size']} drafts, anchored "
             + (f"every {a['stride']} positions" if a["stride"] > 1 else "at every position") + f" from "
             f"{a['first']}; each side drafts as SGLang does (greedy, each Markov step on the previous draft) and is "
             "checked against its own target's greedy tokens. KLD: KL(base \u2016 variant) of the draft distribution, "
             f"both conditioned on {d['draft_conditioned_on']}. Noise floor: 3 standard errors of the paired "
             "per-block difference. Target layers: base "
             f"{d['target_layer_ids']['base']}, variant {d['target_layer_ids']['variant']}.", "",
             "| position | KLD | agreement base | variant | accepted base | variant | noise floor (accepted) | "
             "confidence predicted / measured base | variant | Brier base | variant |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in d["positions"]:
        ag, ac, c = p["agreement"], p["accepted"], p["confidence"]
        lines.append(f"| {p['position']} | {_num(p['kld'])} | {_pct(ag['base'])} | {_pct(ag['variant'])} | "
                     f"{_pct(ac['base'])} | {_pct(ac['variant'])} | {_pct(ac['noise_floor'])} | "
                     f"{_pct(c['base']['predicted'])} / {_pct(c['base']['measured'])} | "
                     f"{_pct(c['variant']['predicted'])} / {_pct(c['variant']['measured'])} | "
                     f"{_num(c['base']['brier'])} | {_num(c['variant']['brier'])} |")
    length = d["expected_accept_length"]
    lines += ["", f"Expected accepted length (accepted drafts + the bonus token per verify step, as SGLang's "
              f"spec_accept_length counts it): base {_num(length['base'])}, variant {_num(length['variant'])} "
              f"(difference {length['delta']:+.4f}, noise floor {_num(length['noise_floor'])}).", "",
              "Each component of the variant's drafter on the base's inputs (*local*) and on its own (*free-running*),"
              " relative error against the base's:", "", "| component | local rel. error | free-running rel. error |",
              "|---|---|---|"]
    for c in d["components"]:
        lines.append(f"| {c['component']} | {_num((c['local'] or {}).get('relative_error'))} | "
                     f"{_num((c['free_running'] or {}).get('relative_error'))} |")
    return lines + [""]


def v41_lines(v: dict, not_emulated: list[str]) -> list[str]:
    """DeepSeek-V4.1's culprit section (compare/v41.py): the component named, then every component of the variant
    on the base's same component's input, by local error."""
    lines = ["## Culprit (DeepSeek-V4.1)", "", f"**{v['culprit']['sentence']}.**", "",
             "Each component of the variant run on the exact input the base's same component received (an error is "
             "charged to the part whose weights differ, never to the layers that read its output). The candidate "
             f"level is the indexer of layers.{v['candidate_source_layer_id']}; every other index source's indexer is "
             "the fine level; a compressor is named by its KV-source layer.", "",
             "| component | kind | local rel. error | cosine | fine selection overlap | candidate block overlap |",
             "|---|---|---|---|---|---|"]
    for c in v["components"]:
        kind = c["kind"] + (f" ({c['level']} level)" if c.get("level") else "")
        lines.append(f"| {c['component']} | {kind} | {_num(c['relative_error'])} | {_num(c['cosine'], 6)} | "
                     f"{_pct(c.get('selection_overlap'))} | {_pct(c.get('candidate_overlap'))} |")
    lines += ["", f"Not compared: {v['not_compared']}."]
    if not_emulated:
        lines += ["", "Served numerics not emulated on DeepSeek-V4.1: " + "; ".join(not_emulated) + "."]
    return lines + [""]


def _save(fig, path: Path, *, tight: bool = True) -> Path:
    import matplotlib.pyplot as plt

    if tight:
        fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot(result: dict, kld: torch.Tensor, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    blocks = [b["block"] for b in result["blocks"]]
    fig, ax = plt.subplots(figsize=(max(6, len(blocks) * 0.3), 4))
    for key, label in (("free_running", "free-running"), ("local", "local")):
        values = [max(b[key]["relative_error"], 1e-12) for b in result["blocks"]]
        ax.plot(range(len(blocks)), values, marker="o", label=label)
    ax.set_yscale("log")
    ax.set_xticks(range(len(blocks)), blocks, rotation=90, fontsize=7)
    ax.set_ylabel("relative error of the block's output")
    ax.set_title("variant vs base, per block")
    ax.legend()
    paths.append(_save(fig, out_dir / "error_per_layer.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    values = kld.double().clamp_min(1e-12).log10().numpy()
    ax.hist(values, bins=60)
    ax.set_xlabel("log10 KLD per position (nats)")
    ax.set_ylabel("positions")
    ax.set_title(f"KLD distribution (mean {result['output']['kld']['mean']:.3g})")
    paths.append(_save(fig, out_dir / "kld_distribution.png"))
    return paths


def write_reports(result: dict, out_dir: Path) -> list[Path]:
    """The PNGs, ``compare.md`` and ``compare.json`` into ``out_dir``; returns the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    kld = result.pop("_kld_values")
    written = plot(result, kld, out_dir)
    atomic_write_bytes(out_dir / "compare.md", render_markdown(result).encode("utf-8"))
    atomic_write_json(out_dir / "compare.json", result)  # last: a report with its JSON is complete
    return [out_dir / "compare.json", out_dir / "compare.md", *written]


def render_recall_markdown(result: dict) -> str:
    r = result["recall"]
    ref, subject, noise = r["reference"], r["subject"], r["noise_floor"]
    lines = [f"# compare --recall: {result['variant']['path']} against {result['base']['path']}", "",
             *[f"**{v}.**" for v in r["verdicts"]], "",
             f"{result['data']['prompts']} needle prompts: lengths {r['lengths']}, depths {r['depths']}; the selection "
             f"threshold is {r['threshold']} tokens (4 x index_topk + 4): the first prompt length whose answer query "
             "has more compressed entries than index_topk to choose from, so only prompts that long or longer test "
             "the indexer's choices. Retrieval is teacher-forced: every answer token the argmax "
             "given the ones before, what greedy decoding produces. Reference: "
             f"{ref}; noise floor: {noise} (float rounding only; {_noise_prompts(r, noise)}).", "",
             "## Needle accuracy per length", "",
             "| track | " + " | ".join(str(length) for length in r["lengths"]) + " | all |",
             "|---|" + "---|" * (len(r["lengths"]) + 1)]
    for label, track in r["tracks"].items():
        per: dict[int, list[float]] = {}
        for cell in track["cells"]:
            per.setdefault(cell["length"], []).append(cell["accuracy"])
        lines.append(f"| {label} | " + " | ".join(_pct(sum(per[length]) / len(per[length])) if per.get(length) else "-"
                                                  for length in r["lengths"])
                     + f" | {_pct(track['accuracy'])} |")
    lines += ["", "## Each track against the reference", "",
              "At the answer positions: KLD and same top-1; over every CSA layer and every sparse row (position "
              "threshold - 1 and later, where top-k leaves entries out): "
              "the mean top-k overlap |A \u2229 B| / k (free-running) and its lowest layer.", "",
              "| track | numerics | KLD at answers | same top-1 | mean top-k overlap | lowest layer (overlap) | needles |",
              "|---|---|---|---|---|---|---|"]
    for label, track in r["tracks"].items():
        if label == ref:
            continue
        out = track.get("answer_positions") or {}
        means = [(layer["layer"], layer["overlap_free_running"]["mean"]) for layer in track["layers"]
                 if layer["overlap_free_running"]["mean"] is not None]
        mean = sum(m for _, m in means) / len(means) if means else None
        low = min(means, key=lambda x: x[1]) if means else None
        lines.append(f"| {label} | {track['numerics']['label']} | {_num(out.get('kld', {}).get('mean'))} | "
                     f"{_pct(out['same_top1']) if out else '-'} | {_num(mean)} | "
                     f"{f'{low[0]} ({_num(low[1])})' if low else '-'} | {_pct(track['accuracy'])} |")
    lines += ["", "## CSA layers: the needle and the indexer", "",
              f"Needle selected: how often an entry holding the needle is in the top-k of the query giving the "
              f"first answer token, over every prompt and over the prompts at or past the threshold (median rank "
              f"among the selected). Overlap against {ref}: {subject} free-running and local (with --local), and "
              f"the noise floor.", "",
              "| layer | needle selected: reference | subject | past the threshold: reference | subject | "
              "median rank: reference | subject | overlap: free | local | noise floor |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    layers = {label: {x["layer"]: x for x in t["layers"]} for label, t in r["tracks"].items()}
    for layer in r["csa_layers"]:
        a, b, n = layers[ref][layer], layers[subject][layer], layers[noise][layer]
        lines.append(f"| {layer} | {_pct(a['needle_selected_rate'])} | {_pct(b['needle_selected_rate'])} | "
                     f"{_pct(a.get('needle_selected_rate_past'))} | {_pct(b.get('needle_selected_rate_past'))} | "
                     f"{_num(a['needle_median_rank'], 3)} | {_num(b['needle_median_rank'], 3)} | "
                     f"{_num(b['overlap_free_running']['mean'])} | {_num(b['overlap_local']['mean'])} | "
                     f"{_num(n['overlap_free_running']['mean'])} |")
    if r.get("diagnosis"):
        lines += _diagnosis_lines(r["diagnosis"], subject)
    lines += ["", "Plots: needle_heatmaps.png (accuracy, depth x length, reference and subject), needle_rank.png, "
              "topk_overlap.png (per CSA layer, with the noise floor).", "",
              *_time_lines(result)]
    return "\n".join(lines)


# What each timer of the lockstep engine measures (compare/lockstep.py LockstepEngine.seconds).
_TIMERS = {"read": "reading weights (waited for)", "forward": "block forwards", "metrics": "metrics, embedding and "
           "heads", "buffers": "new host buffers", "dspark": "the DSpark drafter (stages, heads, its metrics)",
           "other": "the rest of each block", "total": "the engine's total",
           "read_in_background": "reading weights in the background (mostly hidden)", "wall": "wall clock"}


def _time_lines(result: dict) -> list[str]:
    """Where the run's time went, and its peak device memory, as a table (not a raw dict)."""
    seconds = result.get("seconds") or {}
    lines = ["## Time", "", "| | seconds |", "|---|---|"]
    lines += [f"| {_TIMERS.get(key, key.replace('_', ' '))} | {value:.2f} |" for key, value in seconds.items()
              if isinstance(value, (int, float))]
    peak = result.get("peak_device_bytes")
    lines += ["", f"Peak device memory: {'not measured (CPU run)' if peak is None else f'{peak / 2**30:.2f} GiB'}.",
              ""]
    return lines


DIAGNOSES = {
    "none": "no needle lost",
    "indexer": "the indexer",
    "after_selection": "after selection (attention or the layers after it)",
    "unlocalized": "the needle stops being selected, not localized (no local pass)",
}


def _diagnosis_lines(d: dict, subject: str) -> list[str]:
    """recall.json's ``diagnosis`` of the subject: the part named, and per CSA layer the evidence."""
    named = DIAGNOSES.get(d["kind"], d["kind"]) + (f", {d['layer']}" if d.get("layer") else "")
    head = (f"**{subject}: {named}.**" if d["kind"] == "none" else
            f"**{subject}: {named}** ({d['reason']}): {d['sentence']}.")
    lines = ["", "## Diagnosis", "", head,
             "", f"Prompts at or past the threshold that {subject} loses and the reference retrieves: "
             f"{d['lost_prompts_past']}. An indexer is named when it drops the needle's entry (the reference's kept "
             "it) in at least half of them, selects it less often than the reference, and its local top-k overlap "
             "(its layer on the reference's input) is below the noise floor's 1st percentile.", "",
             "| layer | selected past threshold: subject | reference | dropped in lost prompts | local overlap | "
             "noise floor mean / p1 | local under noise floor |", "|---|---|---|---|---|---|---|"]
    for e in d["layers"]:
        under = {None: "-", True: "yes", False: "no"}[e["local_under_noise_floor"]]
        lines.append(f"| {e['layer']} | {_pct(e['selected_rate_past'])} | {_pct(e['reference_selected_rate_past'])} | "
                     f"{e['dropped_in_lost']} | {_num(e['overlap_local'])} | {_num(e['noise_floor_mean'])} / "
                     f"{_num(e['noise_floor_p1'])} | {under} |")
    return lines


def _noise_prompts(r: dict, noise: str) -> str:
    ran, total = r["tracks"][noise].get("prompts"), len(r["tracks"][r["reference"]]["trials"])
    if ran is None or ran == total:
        return f"all {total} prompts"
    return f"{ran} of the {total} prompts: one per length, at the middle depth"


def plot_recall(result: dict, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    r = result["recall"]
    ref, subject, noise = r["reference"], r["subject"], r["noise_floor"]
    paths = []
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5), sharey=True)
    for ax, label in zip(axes, (ref, subject)):
        grid = [[0.0] * len(r["lengths"]) for _ in r["depths"]]
        for cell in r["tracks"][label]["cells"]:
            grid[r["depths"].index(cell["depth"])][r["lengths"].index(cell["length"])] = cell["accuracy"]
        image = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto", origin="lower")
        ax.set_xticks(range(len(r["lengths"])), [str(x) for x in r["lengths"]], rotation=60, fontsize=7)
        ax.set_yticks(range(len(r["depths"])), [f"{d:.0%}" for d in r["depths"]])
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("prompt tokens")
    axes[0].set_ylabel("needle depth")
    fig.colorbar(image, ax=axes, label="retrieved")
    paths.append(_save(fig, out_dir / "needle_heatmaps.png", tight=False))

    layers = r["csa_layers"]
    by = {label: {x["layer"]: x for x in t["layers"]} for label, t in r["tracks"].items()}
    fig, ax = plt.subplots(figsize=(max(6, 0.35 * len(layers)), 3.5))
    for label in (ref, subject):
        ax.plot(range(len(layers)), [by[label][x]["needle_selected_rate"] or 0 for x in layers], marker="o", label=label)
    ax.set_xticks(range(len(layers)), layers, rotation=90, fontsize=7)
    ax.set_ylabel("needle selected (answer query)")
    ax.set_ylim(-0.05, 1.05)
    ax.legend(fontsize=8)
    paths.append(_save(fig, out_dir / "needle_rank.png"))

    fig, ax = plt.subplots(figsize=(max(6, 0.35 * len(layers)), 3.5))
    for label, kind, style in ((subject, "overlap_free_running", "o-"), (subject, "overlap_local", "s--"),
                               (noise, "overlap_free_running", "^:")):
        values = [by[label][x][kind]["mean"] for x in layers]
        ax.plot(range(len(layers)), [v if v is not None else float("nan") for v in values], style,
                label=f"{label} ({kind.split('_', 1)[1].replace('_', '-')})" if label == subject else f"{label} (noise floor)")
    ax.set_xticks(range(len(layers)), layers, rotation=90, fontsize=7)
    ax.set_ylabel("top-k overlap with the reference")
    ax.set_ylim(0, 1.02)   # the whole range: a difference of 0.0002 must look like one
    ax.legend(fontsize=8)
    paths.append(_save(fig, out_dir / "topk_overlap.png"))
    return paths


def write_recall_reports(result: dict, out_dir: Path) -> list[Path]:
    """The PNGs, ``compare.md`` (the recall sections) and ``recall.json`` into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = plot_recall(result, out_dir)
    atomic_write_bytes(out_dir / "compare.md", render_recall_markdown(result).encode("utf-8"))
    atomic_write_json(out_dir / "recall.json", result)  # last: a report with its JSON is complete
    return [out_dir / "recall.json", out_dir / "compare.md", *written]
