"""The V4.1 known-truth suite: what ``compare``, ``compare --recall`` and ``--ablate`` say on the shipped V4.1 organism
(dsv4convert/data/organism-v41, trained to retrieve needles through its two-level indexer and to keep n-gram facts in
its Engram tables, with its trained DSpark drafter) against faults this suite injects itself, one tensor each.

The organism's roles (models/deepseek_v41/presets.py::ORGANISM_V41): compress ratios 0, 0, 2, 2, 1, 1; KV sources 2
and 4 (layer 3 reads 2's compressed KV, layer 5 reads 4's); index sources 2, 4, 5, the candidate source 4 (8 blocks
of 8 entries: 64 tokens at ratio 1), so layer 5's indexer is the fine level among 4's candidate blocks; Engram on
layers 1 and 2; a 32-token sliding window. A needle 256 or 512 tokens back is reached only through the indexers.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer
from test_compare_v41 import _permuted_rows, _redrawn, _with_tensor_changed

from dsv4convert.cli import main
from dsv4convert.organism.dspark import draft_acceptance, heldout_rows
from dsv4convert.organism.dspark_v41 import load_assembled
from dsv4convert.synth import ORGANISM_V41_DIR, ORGANISM_V41_DSPARK_DIR

TEXT = ["--text", str(ORGANISM_V41_DIR / "heldout.txt"), "--tokens", "1024", "--seq-len", "512", "--no-progress"]
WITHIN, PAST = 48, [256, 512]          # a prompt the window and candidate blocks cover; prompts far past both
RECALL = ["--recall", "--lengths", ",".join(map(str, [WITHIN, *PAST])), "--depths", "0.1,0.5,0.9", "--no-progress"]
CANDIDATE_REACH = 64


@pytest.fixture(scope="module")
def organism(tmp_path_factory) -> Path:
    dst = tmp_path_factory.mktemp("organism-v41") / "base"
    assert main(["synth", "--preset", "organism-v41", "--drafter", "dspark", "--dst", str(dst)]) == 0
    return dst


def _fault(organism: Path, tmp_path: Path, name: str, change=None) -> Path:
    names = [name, name.removesuffix(".weight") + ".scale"] if change is _permuted_rows else [name]
    return _with_tensor_changed(organism, tmp_path / "broken", names, change or _redrawn(name))


def _text(base: Path, variant: Path, report: Path, *extra: str) -> dict:
    assert main(["compare", "--base", str(base), "--variant", str(variant), "--report", str(report), *TEXT,
                 *extra]) == 0
    return json.loads((report / "compare.json").read_text())


def _recall(base: Path, variant: Path, report: Path, *extra: str) -> dict:
    assert main(["compare", "--base", str(base), "--variant", str(variant), "--report", str(report), *RECALL,
                 *extra]) == 0
    return json.loads((report / "recall.json").read_text())


def _other_components_exact(result: dict, culprit: str) -> None:
    """The fault is charged to its own part alone, never to the layers that read its output."""
    moved = [c["component"] for c in result["v41"]["components"] if c["relative_error"] > 0]
    assert moved == [culprit], moved


def test_the_shipped_organism_and_drafter_are_what_their_provenance_says():
    trained = json.loads((ORGANISM_V41_DIR / "organism-v41.json").read_text())
    release = trained["release"]
    assert trained["device"].startswith("NVIDIA") and trained["training_seconds"] < 600
    for length, measured in release["recall"].items():
        assert measured["recall"] == 1.0 and set(measured["value_selected"].values()) == {1.0}, length
    assert max(map(int, release["recall"])) >= 16 * CANDIDATE_REACH
    engram = release["engram_ablation"]   # removing Engram forgets the n-gram facts
    assert engram["fact_accuracy"] > 0.95 and engram["fact_accuracy_without_engram"] < 0.5
    assert engram["text_kld"] > 0.1 and release["runner_vs_stored_model_max_logit_difference"] == 0
    drafter = json.loads((ORGANISM_V41_DSPARK_DIR / "dspark.json").read_text())
    needle = drafter["acceptance"]["needle"]
    assert needle["expected_accept_length"] > 4.0, needle


@pytest.mark.parametrize("recipe", ["to-fp8", "to-bf16"])
def test_lossless_conversions_read_kld_zero_and_the_same_drafts(organism, recipe, tmp_path):
    """Lossless in weights (``--numerics weights``): served, each layout quantizes its activations its own way
    (:func:`test_served_activation_quantization_costs_kld_where_weights_read_none`)."""
    variant = tmp_path / recipe
    assert main([recipe, "--src", str(organism), "--dst", str(variant), "--no-progress"]) == 0
    result = _text(organism, variant, tmp_path / "text", "--numerics", "weights")
    assert result["output"]["kld"]["mean"] == 0.0 and result["output"]["same_top1"] == 1.0
    assert result["v41"]["culprit"]["kind"] == "none"
    draft = result["dspark"]
    assert draft["moved"] == [], draft["moved"]
    length = draft["expected_accept_length"]
    assert length["base"] == length["variant"] > 1.0          # trained drafts, the same ones
    for p in draft["positions"]:
        assert p["agreement"]["base"] == p["agreement"]["variant"] and p["kld"] == 0.0
    if recipe == "to-fp8":
        recall = _recall(organism, variant, tmp_path / "recall", "--numerics", "weights")
        tracks = recall["recall"]["tracks"]
        assert tracks["base"]["accuracy"] == tracks["variant"]["accuracy"] == 1.0
        assert recall["recall"]["diagnosis"]["kind"] == "none"


def test_served_activation_quantization_costs_kld_where_weights_read_none(organism, tmp_path):
    """to-nvfp4 keeps the release's MXFP4 codes (lossless in weights: KLD 0 weights only), but on sm100 SGLang runs
    its experts W4A4 (``flashinfer_trtllm_routed``: NVFP4 activations with the layer's largest data-free
    ``input_scale``) where the release's take MXFP8 (``flashinfer_mxfp4``): served, it reads KLD > 0, charged to
    the MoE experts."""
    variant = tmp_path / "to-nvfp4"
    assert main(["to-nvfp4", "--src", str(organism), "--dst", str(variant), "--no-progress"]) == 0
    weights = _text(organism, variant, tmp_path / "weights", "--gpu-family", "sm100", "--numerics", "weights",
                    "--no-mtp")
    assert weights["output"]["kld"]["mean"] == 0.0 and weights["v41"]["culprit"]["kind"] == "none"
    served = _text(organism, variant, tmp_path / "served", "--gpu-family", "sm100", "--no-mtp")
    assert served["output"]["kld"]["mean"] > 0 and served["v41"]["culprit"]["kind"] == "moe", served["v41"]["culprit"]
    assert served["variant"]["numerics"]["activations"] is True


def test_a_broken_candidate_level_loses_needles_past_its_reach_and_is_named(organism, tmp_path):
    broken = _fault(organism, tmp_path, "layers.4.attn.indexer.weights_proj.weight")
    recall = _recall(organism, broken, tmp_path / "recall", "--ablate")
    prompts = recall["prompts"]
    assert all(p["retrieved"]["base"] for p in prompts)
    lost = [p for p in prompts if not p["retrieved"]["variant"]]
    assert {p["length"] for p in lost} <= set(PAST) and {p["length"] for p in lost} == set(PAST)
    # every needle lost is one the variant's candidate blocks no longer hold, and the base's blocks bring it back
    assert all(not p["kept"]["variant"]["candidate"] for p in lost)
    assert all(p["retrieved"]["variant with the base's candidate blocks"] for p in prompts)
    diagnosis = recall["recall"]["diagnosis"]
    assert diagnosis["kind"] == "candidate" and "the candidate level" in diagnosis["sentence"]
    text = _text(organism, broken, tmp_path / "text", "--no-mtp")
    culprit = text["v41"]["culprit"]
    assert (culprit["kind"], culprit["layer"], culprit["level"]) == ("indexer", 4, "candidate"), culprit
    _other_components_exact(text, culprit["component"])


def test_a_broken_fine_indexer_loses_needles_and_is_named(organism, tmp_path):
    broken = _fault(organism, tmp_path, "layers.5.attn.indexer.weights_proj.weight")
    recall = _recall(organism, broken, tmp_path / "recall", "--ablate")
    prompts = recall["prompts"]
    lost = [p for p in prompts if p["retrieved"]["base"] and not p["retrieved"]["variant"]]
    assert {p["length"] for p in lost} >= set(PAST)
    # the candidate level still holds every lost needle: the fine selection of layer 5 dropped it
    assert all(p["kept"]["variant"]["candidate"] and not p["kept"]["variant"]["fine"]["5"] for p in lost
               if p["length"] in PAST)
    assert not any(p["retrieved"]["variant with the base's candidate blocks"] for p in lost if p["length"] in PAST)
    assert all(p["retrieved"]["variant with the base's candidate blocks and fine selections"] for p in prompts)
    diagnosis = recall["recall"]["diagnosis"]
    assert diagnosis["kind"] == "fine" and "layers.5" in diagnosis["sentence"], diagnosis
    text = _text(organism, broken, tmp_path / "text", "--no-mtp")
    culprit = text["v41"]["culprit"]
    assert (culprit["kind"], culprit["layer"], culprit["level"]) == ("indexer", 5, "fine"), culprit
    _other_components_exact(text, culprit["component"])


def test_permuted_engram_rows_cost_kld_and_are_named(organism, tmp_path):
    broken = _fault(organism, tmp_path, "layers.1.engram.embed.weight", _permuted_rows)
    result = _text(organism, broken, tmp_path / "text")
    culprit = result["v41"]["culprit"]
    assert (culprit["kind"], culprit["layer"]) == ("engram", 1), culprit
    _other_components_exact(result, culprit["component"])
    assert result["output"]["kld"]["mean"] > 0.01 and result["output"]["same_top1"] < 0.99
    # the drafter reads the backbone's features: its drafts move, and the verdict blames the backbone, not a stage
    draft = result["dspark"]
    assert draft["expected_accept_length"]["variant"] < draft["expected_accept_length"]["base"]
    assert draft["verdict"]["component"] == "backbone"


def test_a_broken_kv_source_compressor_is_named_by_its_source_layer(organism, tmp_path):
    broken = _fault(organism, tmp_path, "layers.2.attn.compressor.wkv.weight")
    result = _text(organism, broken, tmp_path / "text", "--no-mtp")
    culprit = result["v41"]["culprit"]
    assert (culprit["kind"], culprit["layer"]) == ("compressor", 2), culprit
    assert culprit["read_by"] == [2, 3] and "KV-source layer 2" in culprit["sentence"]
    _other_components_exact(result, culprit["component"])
    assert result["blocks"][3]["free_running"]["relative_error"] > 0   # layer 3 reads its KV, and is not named
    assert result["output"]["kld"]["mean"] > 0


def test_a_broken_drafter_stage_costs_acceptance_and_is_named(organism, tmp_path):
    broken = _fault(organism, tmp_path, "mtp.1.attn.wq_b.weight")
    result = _text(organism, broken, tmp_path / "text")
    assert result["output"]["kld"]["mean"] == 0.0 and result["v41"]["culprit"]["kind"] == "none"
    draft = result["dspark"]
    assert draft["verdict"]["component"] == "mtp.1", draft["verdict"]
    assert draft["expected_accept_length"]["variant"] < draft["expected_accept_length"]["base"] - 0.1


def test_automix_on_the_organism_ranks_the_layouts_by_their_served_numerics(organism, tmp_path):
    """Every layout measured under SGLang's served numerics (sm120 by default) against the release's weights: BF16,
    whose activations SGLang leaves unquantized, is closest (its only rounding the FP4 KV and indexer every layout
    shares), and is chosen within 40 MB; the release (UE8M0 token groups, MXFP8 experts) and FP8 (float32 token
    groups in its experts), lossless in weights, are not; INT4's weight loss adds to the release's numerics. The
    chosen layout is delivered with the Engram tables byte for byte."""
    text = ["--text", str(ORGANISM_V41_DIR / "heldout.txt"), "--tokens", "1024", "--select-tokens", "1024",
            "--verify-tokens", "1024", "--seq-len", "512", "--no-progress"]
    dst = tmp_path / "mix"
    assert main(["automix", "--src", str(organism), "--dst", str(dst), "--size", "40M", *text]) == 0
    record = json.loads((tmp_path / "mix-automix" / "automix.json").read_text())
    kld = {r["variant"]: r["kld"] for r in record["measured"]}
    assert set(kld) == {"native", "fp8", "bf16", "w4a16"}
    assert 0 < kld["bf16"] < min(kld["native"], kld["fp8"]) and kld["bf16"] < kld["native"] / 10
    assert kld["w4a16"] > kld["native"]
    assert record["chosen"] == "bf16"
    engram = [f"layers.{i}.engram.embed.{k}" for i in (1, 2) for k in ("weight", "scale")]
    for name in engram:
        tensors = []
        for path in (organism, dst):
            shard = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"][name]
            with safe_open(path / shard, "pt") as f:
                tensors.append(f.get_tensor(name))
        assert torch.equal(tensors[0].view(torch.uint8), tensors[1].view(torch.uint8)), name


def test_the_shipped_drafters_acceptance_is_what_the_cpu_recomputes(organism):
    """The drafter's acceptance on the held-out rows its provenance names, recomputed here from the assembled checkpoint
    read back, is what ``dspark.json`` says (measured on an H100: float32 there and here differ only in rounding,
    which may flip a near-tie or two)."""
    provenance = json.loads((ORGANISM_V41_DSPARK_DIR / "dspark.json").read_text())
    target, drafter = load_assembled(organism, torch.device("cpu"))
    tokenizer = Tokenizer.from_file(str(organism / "tokenizer.json"))
    rows = heldout_rows(tokenizer, (organism / "heldout.txt").read_text(encoding="utf-8"),
                        provenance["measured_on"]["heldout_sequences"])
    got = draft_acceptance(drafter, target, rows)
    want = provenance["acceptance"]["heldout"]
    assert got["blocks"] == want["blocks"] > 1000
    assert got["agreement"] == pytest.approx(want["agreement"], abs=2e-3)
    assert got["accepted"] == pytest.approx(want["accepted"], abs=2e-3)
    assert got["expected_accept_length"] == pytest.approx(want["expected_accept_length"], abs=1e-2)
    assert want["accepted"][0] > 0.5
