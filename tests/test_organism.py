"""The known-truth suite: every verdict of ``compare``, ``--recall`` and ``--ablate`` read on the shipped organism
(a DeepSeek-V4 trained to retrieve needles, dsv4convert/data/organism) against faults this suite injects itself.

The organism's selection threshold is 4 * 64 + 4 = 260 tokens; its answers are 7 tokens (one per digit), so
prompts up to 253 tokens are fully covered for every answer query. The grid runs from half the threshold to
8x it at three depths. Each fault damages one part of one layer in a copy of the checkpoint
(dsv4convert/organism/faults.py), and each test checks what the tool says against what was done.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from dsv4convert.cli import main
from dsv4convert.compare.recall import RecallOptions, accuracy_by_length, verdict
from dsv4convert.compare.report import render_recall_markdown
from dsv4convert.compare.run import CompareOptions, build_plan, run
from dsv4convert.model.blocks import OutputHead, WeightSource, build_layer, hf_config
from dsv4convert.model.forward import BlockRunner
from dsv4convert.needle import build_prompt, make_needle, selection_threshold
from dsv4convert.organism.export import load_release, write_organism, write_release
from dsv4convert.organism.faults import Fault, inject
from dsv4convert.organism.tokenizer import build_tokenizer
from dsv4convert.organism.train import TokenizerAdapter, TrainSettings, train
from dsv4convert.synth import ORGANISM_DIR

THRESHOLD = 260
COVERED = 253                                   # the longest prompt whose 7 answer queries all keep every entry
GRID = [130, COVERED, THRESHOLD, 520, 1040, 2080]   # half the threshold .. 8x it
TEXT = ORGANISM_DIR / "heldout.txt"


@pytest.fixture(scope="module")
def organism(tmp_path_factory) -> Path:
    return write_organism(tmp_path_factory.mktemp("organism") / "base")


@pytest.fixture(scope="module")
def faults(organism, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("faults")
    cases = {"indexer-crushed": Fault("indexer-crushed", 3), "indexer-randomized": Fault("indexer-randomized", 1),
             "attention": Fault("attention", 3), "experts": Fault("experts", 2)}
    return {name: inject(organism, root / name, fault) for name, fault in cases.items()}


def recall(base: Path, variant: Path, lengths=GRID, depths=(0.1, 0.5, 0.9), local: bool = True, **kw) -> dict:
    """compare --recall, weights only unless ``numerics`` says otherwise; the local pass localizes faults."""
    numerics = kw.pop("numerics", "weights")
    opts = CompareOptions(base=str(base), variant=str(variant), numerics=numerics, progress=False, chunk=2048,
                          recall=RecallOptions(lengths=list(lengths), depths=tuple(depths), local=local, **kw))
    return run(build_plan(opts))


def text_compare(base: Path, variant: Path, numerics: str = "weights", tokens: int = 4096) -> dict:
    return run(build_plan(CompareOptions(base=str(base), variant=str(variant), texts=[TEXT], tokens=tokens,
                                         seq_len=1024, numerics=numerics, progress=False)))


def test_the_shipped_organism_is_what_its_provenance_says():
    provenance = json.loads((ORGANISM_DIR / "organism.json").read_text())
    config = json.loads((ORGANISM_DIR / "config.json").read_text())
    assert selection_threshold(config["index_topk"]) == THRESHOLD
    assert provenance["device"] and provenance["seed"] == 0 and provenance["steps"] == provenance["settings"]["steps"]
    assert not provenance["hit_time_limit"] and provenance["training_seconds"] <= 600
    assert sum(p.stat().st_size for p in ORGANISM_DIR.iterdir()) <= 10 * 1024**2
    recalled = provenance["release_recall"]["by_length_and_depth"]
    assert min(v for length, cells in recalled.items() if int(length) <= 8 * THRESHOLD for v in cells.values()) >= 0.95


def test_the_first_length_at_which_top_k_leaves_an_entry_out_is_4k_plus_4(organism):
    """On the organism's own indexers: a 259-token prompt's answer query keeps all 64 causal entries, a 260-token
    prompt's leaves exactly one of 65 out (not 4 * 64 + sliding window = 288)."""
    model = load_release(organism)
    tokenizer = TokenizerAdapter(build_tokenizer_from(organism))
    picks: list[torch.Tensor] = []
    hooks = [ix.register_forward_hook(lambda _m, _a, out: picks.append(out)) for ix in model.indexers()]
    try:
        for length in (THRESHOLD - 1, THRESHOLD):
            ids = build_prompt(tokenizer, length, 0.5, make_needle(random.Random(0))).input_ids
            with torch.no_grad():
                model(torch.tensor([ids]), mtp=False)
    finally:
        for h in hooks:
            h.remove()
    for layer_picks, length in zip((picks[:2], picks[2:]), (THRESHOLD - 1, THRESHOLD)):
        for p in layer_picks:
            answer_query = set(p[0, length - 1].tolist()) - {-1}
            causal = set(range(length // 4))
            assert answer_query <= causal
            assert len(causal - answer_query) == (0 if length < THRESHOLD else 1)


def build_tokenizer_from(path: Path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path / "tokenizer.json"))


@pytest.fixture(scope="module")
def crushed(faults, organism) -> dict:
    """The full grid, base against the crushed indexer, with the local pass: its base track is the base's own
    retrieval (every track runs its own forward passes; the variant's never feed the base's), so one run
    answers both the base's and the fault's tests (the grid's 2080-token prompts are most of its time)."""
    return recall(organism, faults["indexer-crushed"])["recall"]


def test_base_retrieves_from_half_to_eight_times_the_threshold(crushed):
    track = crushed["tracks"]["base"]
    assert {c["length"] for c in track["cells"]} == set(GRID)
    assert {len([c for c in track["cells"] if c["length"] == n]) for n in GRID} == {3}     # three depths
    assert all(c["accuracy"] >= 0.95 for c in track["cells"]), track["cells"]
    # Both CSA layers select every entry holding the needle's value in every prompt past the threshold, among
    # their first picks (the value spans two or three entries, so covering it takes ranks 0 and 1).
    assert len(track["layers"]) == 2
    for layer in track["layers"]:
        assert layer["needle_selected_rate_past"] == 1.0 and layer["needle_median_rank_past"] <= 2


@pytest.mark.parametrize("recipe", ["fp8", "nvfp4"])
def test_lossless_conversions_have_zero_kld_and_identical_recall(organism, recipe, tmp_path):
    dst = tmp_path / recipe
    assert main([f"to-{recipe}", "--src", str(organism), "--dst", str(dst), "--no-progress"]) == 0
    kld = text_compare(organism, dst)["output"]["kld"]
    assert kld["mean"] == 0.0 and max(kld["percentiles"].values()) == 0.0
    result = recall(organism, dst, lengths=[COVERED, 1040], depths=(0.5,), local=False)["recall"]
    base, variant = result["tracks"]["base"]["trials"], result["tracks"]["variant"]["trials"]
    assert [t["retrieved"] for t in base] == [t["retrieved"] for t in variant] and all(t["retrieved"] for t in base)
    assert [t["answer_logprob"] for t in base] == [t["answer_logprob"] for t in variant]
    assert result["diagnosis"]["kind"] == "none"        # the same model read twice: no fault found


@pytest.mark.parametrize("name, layer", [("indexer-crushed", "layers.3"), ("indexer-randomized", "layers.1")])
def test_an_indexer_fault_loses_needles_only_past_the_threshold_and_is_named(request, faults, organism, name, layer):
    """The crushed indexer on the full grid (shared with the base's test); the randomized one up to 4x the
    threshold, where it already loses a needle the base finds (8x adds no case, and its 2080-token prompts
    are most of a grid's time)."""
    lengths = GRID if name == "indexer-crushed" else [n for n in GRID if n <= 4 * THRESHOLD]
    result = (request.getfixturevalue("crushed") if name == "indexer-crushed"
              else recall(organism, faults[name], lengths=lengths)["recall"])
    base, mine = (accuracy_by_length(result["tracks"][t]) for t in ("base", "variant"))
    assert list(mine) == lengths
    assert all(mine[n] == base[n] for n in lengths if n <= COVERED), (name, mine)
    assert any(mine[n] < base[n] for n in lengths if n >= THRESHOLD), (name, mine)
    d = result["diagnosis"]
    assert (d["kind"], d["layer"]) == ("indexer", layer), (name, d["sentence"])
    assert verdict(result, "base", "variant").endswith(": the indexer")
    local = {e["layer"]: e["overlap_local"] for e in d["layers"]}
    assert min(local, key=local.get) == layer and max(local.values()) > 0.99


def test_a_grid_that_never_reaches_the_threshold_has_no_sparse_rows_to_compare(faults, organism):
    """Below the threshold every indexer keeps every entry: even a crushed indexer reads the same, and there
    is no overlap to summarize (a grid of such prompts once crashed the summary)."""
    result = recall(organism, faults["indexer-crushed"], lengths=[130], depths=(0.5,))["recall"]
    assert result["diagnosis"]["kind"] == "none"
    assert all(layer["overlap_local"]["rows"] == 0 for layer in result["tracks"]["variant"]["layers"])


def test_an_attention_fault_loses_selected_needles_and_is_not_blamed_on_the_indexer(faults, organism):
    result = recall(organism, faults["attention"], lengths=[130, COVERED, 1040], depths=(0.5,))["recall"]
    assert result["tracks"]["variant"]["accuracy"] < result["tracks"]["base"]["accuracy"]
    d = result["diagnosis"]
    assert d["kind"] == "after_selection" and d["layer"] is None
    assert all(layer["needle_selected_rate"] == 1.0 for layer in result["tracks"]["variant"]["layers"])
    assert "not the indexer" in verdict(result, "base", "variant")


def test_expert_damage_keeps_recall_and_points_at_its_layer(faults, organism, tmp_path):
    result = recall(organism, faults["experts"], lengths=[COVERED, 1040, 2080], depths=(0.5,))["recall"]
    assert result["diagnosis"]["kind"] == "none"
    assert result["tracks"]["variant"]["accuracy"] == result["tracks"]["base"]["accuracy"] == 1.0
    # As a user types it: no --text (the organism ships its held-out text), --device auto.
    report = tmp_path / "report"
    assert main(["compare", "--base", str(organism), "--variant", str(faults["experts"]), "--numerics", "weights",
                 "--tokens", "4096", "--seq-len", "1024", "--report", str(report), "--no-progress"]) == 0
    text = json.loads((report / "compare.json").read_text())
    assert text["data"]["source"] == [str(organism / "heldout.txt")] and text["data"]["sequences"] == 4
    assert text["output"]["kld"]["mean"] > 1e-3
    local = {b["block"]: b["local"]["relative_error"] for b in text["blocks"]}
    assert max(local, key=local.get) == "layers.2"
    assert all(error == 0.0 for block, error in local.items() if block != "layers.2")


def test_every_ablation_row_runs_on_the_organism_with_its_effect_in_the_report(organism, tmp_path):
    dst = tmp_path / "nvfp4"
    assert main(["to-nvfp4", "--src", str(organism), "--dst", str(dst), "--no-progress"]) == 0
    result = recall(organism, dst, lengths=[COVERED, 1040], depths=(0.5,), local=False, ablate=True, numerics="served")
    rows = ["weights only", "+ activations", "+ FP8 KV cache", "+ FP8 indexer (served)", "FP8 -> FP4 indexer"]
    tracks = result["recall"]["tracks"]
    for side in ("base", "variant"):
        for row in rows:
            track = tracks[f"{side}: {row}"]
            assert len(track["trials"]) == 2 and track["layers"]
    report = render_recall_markdown(result)
    for row in rows:
        assert f"variant: {row}" in report
    assert len(result["recall"]["verdicts"]) == 3


def test_trainer_is_deterministic_and_its_model_is_the_one_compare_runs(tmp_path):
    """Two tiny CPU runs from one seed give identical weights; the release-format checkpoint they write, run
    block by block the way compare runs it, gives the logits the trainer's own module gives for it."""
    from dsv4convert.organism.cli import TINY
    from dsv4convert.organism.config import organism_config

    config, tokenizer = organism_config(), build_tokenizer(1024)
    settings = TrainSettings(**{**TINY, "steps": 3, "eval_every": 3})
    first, second = (train(config, tokenizer, settings, device=torch.device("cpu"), log=lambda _: None)
                     for _ in range(2))
    a, b = first.model.native_state(), second.model.native_state()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    dst = write_release(tmp_path / "tiny", first.model, config, tokenizer, {"test": True})
    released = load_release(dst)
    ids = torch.randint(0, 1024, (1, 300), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = released(ids).logits
        got = _compare_engine_logits(dst, ids)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4 * want.abs().max())


def _compare_engine_logits(path: Path, ids: torch.Tensor) -> torch.Tensor:
    """The backbone's logits through model/blocks.py and model/forward.py, block by block, as compare runs it."""
    from dsv4convert.checkpoint import Checkpoint
    from dsv4convert.inspection import inspect_checkpoint

    ckpt = Checkpoint.open(path)
    inspection = inspect_checkpoint(ckpt)
    source = WeightSource(ckpt, inspection, torch.device("cpu"), torch.float32)
    config = hf_config(ckpt.config)
    runner = BlockRunner(config, torch.device("cpu"), torch.float32, chunk=128)
    streams = torch.nn.functional.embedding(ids, source.tensor("embed.weight"))
    streams = streams.unsqueeze(2).expand(-1, -1, inspection.config.hc_mult, -1).contiguous()
    for i in range(inspection.config.num_hidden_layers):
        streams = runner(build_layer(source, config, inspection.config, f"layers.{i}"), streams, ids)
    return OutputHead(source, config)(streams)
