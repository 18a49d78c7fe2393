"""compare --recall: the shared needle prompts, teacher-forced retrieval against transformers' own greedy
generate, the indexer hook against transformers' full forward, top-k overlap, the ablation rows, the CLI.

The model is the tiny preset with index_topk 64 (selection threshold 4 * 64 + 4 = 260 tokens: the first prompt
length whose answer query leaves an entry out, so prompts of a few hundred tokens straddle it) and 32 indexer heads (no exact score ties; see tests/test_model_forward.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers_oracle import load

from dsv4convert.cli import main
from dsv4convert.compare.lockstep import Batch, LockstepEngine
from dsv4convert.compare.recall import (
    RecallOptions,
    TopkObserver,
    ablation_verdict,
    build_grid,
    diagnose,
    overlap,
    verdict,
)
from dsv4convert.compare.report import render_recall_markdown
from dsv4convert.compare.run import CompareOptions, build_plan, run
from dsv4convert.model.text import load_tokenizer
from dsv4convert.needle import (
    default_lengths,
    needle_entries,
    parse_lengths,
    recall_grid,
    selection_threshold,
    shortest_prompt,
)
from dsv4convert.serve.recall import RecallSweep
from dsv4convert.synth import preset_config, synthesize

LENGTHS = [259, 301]        # the longest fully selected prompt and one past the threshold, residues 3 and 1
THRESHOLD = 4 * 64 + 4


@pytest.fixture(scope="module")
def k64(tmp_path_factory) -> dict[str, Path]:
    config = preset_config("tiny")
    config["index_topk"], config["index_n_heads"] = 64, 32
    root = tmp_path_factory.mktemp("k64")
    src = synthesize(root / "src", config, seed=4)
    assert main(["to-nvfp4", "--src", str(src), "--dst", str(root / "nvfp4"), "--no-progress"]) == 0
    return {"native": src, "nvfp4": root / "nvfp4"}


def recall(base: Path, variant: Path, **kw) -> dict:
    options = dict(lengths=LENGTHS, depths=(0.5,))
    opts = CompareOptions(base=str(base), variant=str(variant), chunk=100, progress=False,
                          recall=RecallOptions(**{**options, **kw.pop("recall", {})}), **kw)
    return run(build_plan(opts))["recall"]


def test_default_grid_straddles_the_threshold_and_covers_every_residue():
    assert selection_threshold(512) == 2052 and selection_threshold(64) == THRESHOLD   # V4-Flash; the tiny k64
    lengths = default_lengths(2052)
    assert lengths == [1024, 2047, 2051, 2052, 2178, 4093, 8192, 16383, 32766, 65533, 131072]
    assert {n % 4 for n in lengths} == {0, 1, 2, 3}
    # A small model asks for half to 8 x its threshold: still both sides of it, exactly, every residue.
    small = default_lengths(132, longest=8 * 132)
    assert small == [64, 127, 131, 132, 138, 253, 512, 1023] and {n % 4 for n in small} == {0, 1, 2, 3}
    tiny = default_lengths(THRESHOLD, shortest=200)
    assert min(tiny) >= 200 and {n % 4 for n in tiny} == {0, 1, 2, 3} and {THRESHOLD - 1, THRESHOLD} <= set(tiny)
    assert parse_lengths("2K, 4099,128k") == [2048, 4099, 131072]
    with pytest.raises(ValueError, match="not a token count"):
        parse_lengths("2M")
    # Entry w of a CSA layer pools windows w-1 and w: a needle at tokens 9..13 is in entries 2, 3 and 4.
    assert list(needle_entries((9, 14))) == [2, 3, 4]


def test_compare_builds_the_prompts_serve_sends(k64):
    tokenizer = load_tokenizer(k64["native"])
    sent = []
    RecallSweep(lengths=LENGTHS, depths=(0.1, 0.9), trials=2, seed=3).run(
        tokenizer, lambda payload: sent.append(payload["input_ids"]) or {"text": "0"})
    grid = build_grid(tokenizer, json.loads((k64["native"] / "config.json").read_text()),
                      RecallOptions(lengths=LENGTHS, depths=(0.1, 0.9), trials=2, seed=3))
    assert [p.input_ids for p in grid.prompts] == sent == [p.input_ids for p in
                                                          recall_grid(tokenizer, LENGTHS, (0.1, 0.9), 2, 3)]
    for prompt, (b, r) in zip(grid.prompts, grid.where):
        ids, (start, end) = grid.batches[b].ids[r].tolist(), grid.batches[b].answers[r]
        assert len(prompt.input_ids) == prompt.length == start and ids[:start] == prompt.input_ids
        assert tokenizer.decode(ids[start:end]) == prompt.needle.value
    assert shortest_prompt(tokenizer) <= min(LENGTHS)


@torch.no_grad()
def test_teacher_forced_retrieval_is_greedy_generation(k64):
    """Prompt + the tokens transformers' own greedy ``generate`` continues it with: the engine must call
    that answer retrieved, and score exactly those tokens' log-probabilities."""
    model, _ = load(k64["native"])
    tokenizer = load_tokenizer(k64["native"])
    prompt = recall_grid(tokenizer, [301], [0.5], 1, 0)[0]
    ids = torch.tensor([prompt.input_ids])
    generated = model.generate(ids, max_new_tokens=5, do_sample=False)[0, len(prompt.input_ids):].tolist()
    full = torch.tensor([prompt.input_ids + generated])
    start, end = len(prompt.input_ids), len(prompt.input_ids) + len(generated)
    plan = build_plan(CompareOptions(base=str(k64["native"]), variant=str(k64["native"]), random_tokens=True,
                                     tokens=64, seq_len=64, numerics="weights", progress=False))
    needle_answer = tokenizer.encode(prompt.needle.value, add_special_tokens=False)
    with_needle = torch.tensor([prompt.input_ids + needle_answer])
    batches = [Batch(full, answers=[(start, end)]), Batch(with_needle, answers=[(start, start + len(needle_answer))])]
    result = LockstepEngine([plan.base, plan.variant], batches, device=plan.device, dtype=plan.dtype, chunk=128,
                            mtp=False, progress=False).run()
    (retrieved, logp), = result.retrieval["base"][0]
    assert retrieved
    log_probs = torch.log_softmax(model(full).logits[0].double(), -1)
    want = sum(float(log_probs[start - 1 + j, t]) for j, t in enumerate(generated))
    assert logp == pytest.approx(want, abs=1e-4)
    (needle_retrieved, _), = result.retrieval["base"][1]
    assert needle_retrieved == (generated[:len(needle_answer)] == needle_answer)


@torch.no_grad()
def test_indexer_hook_sees_what_transformers_computes(k64):
    """The observer's picks for the reference equal the indexer outputs of one full transformers forward."""
    model, _ = load(k64["native"])
    plan = build_plan(CompareOptions(base=str(k64["native"]), variant=str(k64["native"]), numerics="weights",
                                     chunk=100, progress=False, recall=RecallOptions(lengths=[301], depths=(0.5,))))
    batch = plan.grid.batches[0]
    want = {}
    handles = [layer.self_attn.compressor.indexer.register_forward_hook(
        lambda m, a, out, i=i: want.__setitem__(f"layers.{i}", out[0]))
        for i, layer in enumerate(model.model.layers) if hasattr(layer.self_attn, "compressor")
        and hasattr(layer.self_attn.compressor, "indexer")]
    model(batch.ids)
    for h in handles:
        h.remove()

    class Keep(TopkObserver):
        seen: dict = {}

        def finished(self, block, track, b, rows, local):
            if self._calls and track.label == "base":
                k = max(c.shape[-1] for c in self._calls)
                Keep.seen[block] = torch.cat([torch.nn.functional.pad(c, (0, k - c.shape[-1]), value=-1)
                                              for c in self._calls], dim=1)[0]
            super().finished(block, track, b, rows, local)

    observer = Keep(plan.grid, "base")
    LockstepEngine(plan.tracks[:1], plan.batches, device=plan.device, dtype=plan.dtype, chunk=100, mtp=False,
                   progress=False, observers=[observer]).run()
    assert want.keys() == Keep.seen.keys() == {"layers.2", "layers.4"}
    for block, picks in want.items():
        # Sets per row (the order of equal scores aside), chunked through the cache vs the single shot.
        got = Keep.seen[block]
        assert torch.equal(got.sort(-1).values, picks.sort(-1).values), block
        assert (overlap(picks[THRESHOLD - 1:], got[THRESHOLD - 1:]) == 1).all()


def test_a_checkpoint_against_itself_overlaps_fully_and_counts_only_rows_past_the_threshold(k64):
    r = recall(k64["native"], k64["native"], recall={"local": True})
    variant = r["tracks"]["variant"]
    assert all(layer["overlap_local"]["mean"] == 1.0 for layer in variant["layers"])
    assert all(layer["overlap_free_running"]["mean"] == layer["overlap_free_running"]["min"] == 1.0
               for layer in variant["layers"])
    # Only sparse rows count: of each prompt + answer, the positions from 259 (= threshold - 1) on.
    tokenizer = load_tokenizer(k64["native"])
    totals = [t["length"] + len(tokenizer.encode(t["value"], add_special_tokens=False)) for t in variant["trials"]]
    assert variant["layers"][0]["overlap_free_running"]["rows"] == sum(max(0, n - (THRESHOLD - 1)) for n in totals) > 0
    assert r["verdicts"][0].startswith("variant: recall matches base at every length")
    assert r["diagnosis"]["kind"] == "none" and r["diagnosis"] == r["diagnoses"]["variant"]
    assert variant["layers"][0]["prompts_past"] == 1 and variant["layers"][0]["needle_selected_rate_past"] is not None
    assert [sorted(t["needle_ranks"]) for t in variant["trials"]] == [["layers.2", "layers.4"]] * len(LENGTHS)
    assert [t["retrieved"] for t in variant["trials"]] == [t["retrieved"] for t in r["tracks"]["base"]["trials"]]


def test_noise_floor_runs_one_prompt_per_length_and_leaves_the_other_tracks_alone(k64):
    depths = (0.1, 0.5, 0.9)
    some = recall(k64["native"], k64["nvfp4"], recall={"depths": depths})
    every = recall(k64["native"], k64["nvfp4"], recall={"depths": depths, "noise_floor": "all"})
    noise = some["noise_floor"]
    assert noise == every["noise_floor"] and noise.startswith("base, chunk ")
    ran = some["tracks"][noise]["trials"]
    assert [(t["length"], t["depth"]) for t in ran] == [(length, 0.5) for length in LENGTHS]
    assert some["tracks"][noise]["prompts"] == len(LENGTHS) and every["tracks"][noise]["prompts"] == 6
    # The noise track on its prompts is what it is when it runs every prompt; base and variant do not change.
    assert ran == [t for t in every["tracks"][noise]["trials"] if t["depth"] == 0.5]
    for label in ("base", "variant"):
        assert some["tracks"][label] == every["tracks"][label]
    for a, b in zip(some["tracks"][noise]["layers"], every["tracks"][noise]["layers"]):
        assert 0 < a["overlap_free_running"]["rows"] < b["overlap_free_running"]["rows"]
        assert a["needle_selected_rate"] is not None


def test_ablation_rows_switch_on_one_part_each_and_a_lossless_cast_starts_at_the_base(k64):
    r = recall(k64["native"], k64["nvfp4"], gpu_family="sm120", moe_runner_backend="flashinfer_cutlass",
               recall={"ablate": True, "lengths": [301]})
    labels = list(r["tracks"])
    assert labels[0] == "base: weights only" and r["reference"] == labels[0]
    for prefix in ("base: ", "variant: "):
        rows = [r["tracks"][label]["numerics"] for label in labels if label.startswith(prefix) and "chunk" not in label]
        assert [row["label"] for row in rows] == [
            "weights only", "weights + activations", "weights + activations + fp8 kv cache",
            "weights + activations + fp8 kv cache + fp8 indexer", "weights + activations + fp8 kv cache + fp4 indexer"]
        parts = [(row["activations"], row["kv_cache"], row["indexer"]) for row in rows]
        for before, after in zip(parts, parts[1:]):
            assert sum(a != b for a, b in zip(before, after)) == 1, (before, after)
    lossless = r["tracks"]["variant: weights only"]
    assert lossless["answer_positions"]["kld"]["mean"] == 0.0
    assert all(layer["overlap_free_running"]["min"] == 1.0 for layer in lossless["layers"])
    served = r["tracks"]["variant: + FP8 indexer (served)"]
    assert served["answer_positions"]["kld"]["mean"] > 0.0          # W4A4 under flashinfer_cutlass
    assert len(r["verdicts"]) == 3 and r["verdicts"][1].startswith("base: ")


def test_cli_writes_the_recall_report_and_refuses_bad_requests(k64, tmp_path, capsys):
    report = tmp_path / "report"
    base = ["compare", "--base", str(k64["native"]), "--variant", str(k64["nvfp4"]), "--no-progress"]
    assert main(base + ["--recall", "--lengths", "259,301", "--depths", "0.5", "--report", str(report)]) == 0
    out = capsys.readouterr().out
    assert "variant: recall matches base" in out
    assert {p.name for p in report.iterdir()} == {"recall.json", "compare.md", "needle_heatmaps.png",
                                                  "needle_rank.png", "topk_overlap.png"}
    md = (report / "compare.md").read_text()
    assert "## Needle accuracy per length" in md and "noise floor" in md and "layers.2" in md and "## Diagnosis" in md
    for extra, message in ((["--lengths", "300"], "--lengths, --depths, --ablate, --local and --noise-floor belong to --recall"),
                           (["--recall", "--random-tokens"], "--recall builds its own needle prompts"),
                           (["--recall", "--lengths", "40"], "cannot hold the template")):
        assert main(base + extra) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and message in err and "\n" not in err, err
    with pytest.raises(SystemExit):
        main(base + ["--recall", "--depths", "1.5"])
    assert "depths must be numbers in [0, 1]" in capsys.readouterr().err


# --- diagnose: hand-built summaries (threshold 132, CSA layers 1 and 3; three depths at 131, 132 and 264) ---

T = 132
LAYERS = ("layers.1", "layers.3")
PROMPTS = [(length, depth) for length in (T - 1, T, 2 * T) for depth in (0.1, 0.5, 0.9)]


def hand_track(lost=(), dropped=None, local=None, free=1.0, prompts=None):
    """A track of the summary: ``lost`` prompt indices not retrieved, ``dropped[layer]`` the prompts whose needle
    that layer's indexer does not select, ``local[layer]`` its mean local top-k overlap (None: no local pass)."""
    dropped, local = dropped or {}, local or {}
    ran = range(len(PROMPTS)) if prompts is None else prompts
    trials = [{"prompt": i, "length": PROMPTS[i][0], "depth": PROMPTS[i][1], "retrieved": i not in lost,
               "needle_ranks": {layer: None if i in dropped.get(layer, ()) else 3 for layer in LAYERS}} for i in ran]
    cells = [{"length": t["length"], "depth": t["depth"], "accuracy": float(t["retrieved"]), "trials": 1} for t in trials]
    overlap = lambda mean, p1=None: {"rows": 0 if mean is None else 100, "mean": mean,
                                     "p1": p1 if p1 is not None else mean, "min": mean}
    layers = [{"layer": layer, "needle_selected_rate": None, "needle_median_rank": None,
               "overlap_local": overlap(local.get(layer)), "overlap_free_running": overlap(free)} for layer in LAYERS]
    return {"numerics": {"label": "served"}, "trials": trials, "cells": cells, "layers": layers,
            "accuracy": sum(t["retrieved"] for t in trials) / len(trials)}


def hand_summary(variant: dict, noise_mean=0.99, noise_p1=0.97) -> dict:
    noise = hand_track(prompts=[1, 4, 7])
    for layer in noise["layers"]:
        layer["overlap_free_running"] = {"rows": 100, "mean": noise_mean, "p1": noise_p1, "min": noise_p1}
    return {"threshold": T, "reference": "base", "subject": "variant", "noise_floor": "base, chunk 69",
            "csa_layers": list(LAYERS),
            "tracks": {"base": hand_track(), "variant": variant, "base, chunk 69": noise}}


PAST = [3, 4, 5, 6, 7, 8]        # the prompts of 132 and 264 tokens


def test_diagnose_names_the_indexer_of_the_layer_that_drops_the_needle():
    # layers.1's indexer crushed: it drops the needle in 5 of the 6 prompts past the threshold, which are lost;
    # its local overlap is far under the noise floor; layers.3 keeps selecting it.
    variant = hand_track(lost=PAST[:5], dropped={"layers.1": PAST[:5]}, local={"layers.1": 0.12, "layers.3": 1.0})
    s = hand_summary(variant)
    d = diagnose(s, "base", "variant")
    assert (d["kind"], d["layer"], d["first_lost_length"], d["lost_prompts_past"]) == ("indexer", "layers.1", T, 5)
    first = d["layers"][0]
    assert first["selected_rate_past"] == pytest.approx(1 / 6) and first["reference_selected_rate_past"] == 1.0
    assert first["dropped_in_lost"] == 5 and first["local_under_noise_floor"] is True
    assert d["layers"][1]["dropped_in_lost"] == 0 and d["layers"][1]["local_under_noise_floor"] is False
    v = verdict(s, "base", "variant")
    assert "from 132 on (past the 132-token selection threshold)" in v          # length == threshold is past
    assert "stops being selected by layers.1's indexer" in v and "0.12 against the noise floor's 0.99" in v
    # Without the local pass the same selection loss cannot be told from damage upstream of layers.1.
    blind = hand_summary(hand_track(lost=PAST[:5], dropped={"layers.1": PAST[:5]}))
    d = diagnose(blind, "base", "variant")
    assert (d["kind"], d["layer"]) == ("unlocalized", "layers.1") and "--local" in d["sentence"]
    # A local overlap at the noise floor (above its 1st percentile) does not make an indexer fault.
    at_floor = hand_summary(hand_track(lost=PAST[:5], dropped={"layers.1": PAST[:5]},
                                       local={"layers.1": 0.98, "layers.3": 1.0}))
    assert diagnose(at_floor, "base", "variant")["kind"] == "after_selection"


def test_diagnose_puts_an_attention_fault_after_selection():
    # The needle stays selected by every layer (layers.1's attention damaged): after selection.
    s = hand_summary(hand_track(lost=PAST, local={"layers.1": 1.0, "layers.3": 1.0}))
    d = diagnose(s, "base", "variant")
    assert (d["kind"], d["reason"], d["layer"]) == ("after_selection", "still_selected", None)
    assert "after selection (attention or the layers after it), not the indexer" in verdict(s, "base", "variant")
    # layers.3 fed the damaged stream drops the needle, but its own top-k on base's input matches base: not it.
    s = hand_summary(hand_track(lost=PAST, dropped={"layers.3": PAST[:4]}, local={"layers.1": 1.0, "layers.3": 0.995},
                                free=0.4))
    d = diagnose(s, "base", "variant")
    assert (d["kind"], d["reason"]) == ("after_selection", "damaged_input")
    assert d["layers"][1]["dropped_in_lost"] == 4 and d["layers"][1]["local_under_noise_floor"] is False
    # An indexer that diverges a little (under the noise floor, over DEPARTED_OVERLAP) and drops the needle in
    # fewer than half of the lost prompts is not blamed...
    s = hand_summary(hand_track(lost=PAST, dropped={"layers.1": PAST[:2]}, local={"layers.1": 0.9, "layers.3": 1.0}))
    assert diagnose(s, "base", "variant")["reason"] == "still_selected"
    # ... one whose picks depart from base's (the organism's randomized indexer keeps the needle's value but
    # drops the entries the model relies on) is, though the needle's own entries survive.
    s = hand_summary(hand_track(lost=PAST, dropped={"layers.1": PAST[:2]}, local={"layers.1": 0.3, "layers.3": 1.0}))
    d = diagnose(s, "base", "variant")
    assert (d["kind"], d["reason"], d["layer"]) == ("indexer", "departs", "layers.1")
    assert verdict(s, "base", "variant").endswith(": the indexer")


def test_diagnose_without_a_loss_and_with_a_loss_below_the_threshold():
    s = hand_summary(hand_track(local={"layers.1": 0.5, "layers.3": 1.0}))
    d = diagnose(s, "base", "variant")
    assert (d["kind"], d["first_lost_length"], d["lost_prompts_past"]) == ("none", None, 0)
    assert verdict(s, "base", "variant").startswith("variant: recall matches base at every length to 264")
    # Lost at 131 tokens, where every indexer keeps every entry: never the indexer, whatever it does past it.
    s = hand_summary(hand_track(lost=[0, 4, 5], dropped={"layers.1": [4, 5]}, local={"layers.1": 0.1, "layers.3": 1.0}))
    d = diagnose(s, "base", "variant")
    assert (d["kind"], d["reason"], d["first_lost_length"], d["past_threshold"]) == (
        "after_selection", "below_threshold", T - 1, False)
    assert "from 131 on (below the 132-token selection threshold)" in verdict(s, "base", "variant")


def test_ablation_verdict_diagnoses_the_first_row_that_breaks():
    s = hand_summary(hand_track())
    s["tracks"]["variant: + FP8 indexer"] = hand_track(lost=PAST[:5], dropped={"layers.3": PAST[:5]},
                                                       local={"layers.1": 1.0, "layers.3": 0.2})
    s["tracks"]["variant: FP4 indexer"] = hand_track(lost=PAST)
    v = ablation_verdict(s, "base", ["variant", "variant: + FP8 indexer", "variant: FP4 indexer"])
    assert v.startswith("recall first breaks at 'variant: + FP8 indexer' (from 132 on)")
    assert "layers.3's indexer" in v
    md = render_recall_markdown({"variant": {"path": "v"}, "base": {"path": "b"}, "data": {"prompts": 9},
                                 "seconds": {}, "peak_device_bytes": 0,
                                 "recall": {**s, "verdicts": [v], "diagnosis": diagnose(s, "base", "variant: + FP8 indexer"),
                                            "lengths": [T - 1, T, 2 * T], "depths": [0.1, 0.5, 0.9]}})
    assert "## Diagnosis" in md and "**variant: the indexer, layers.3** (dropped_and_diverges)" in md
