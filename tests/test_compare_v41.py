"""``compare`` on DeepSeek-V4.1 checkpoints (``dsv4convert/compare/v41.py``) on tiny-v41 (random weights).

Lossless conversions read KLD 0 and top-1 1.0 through the CLI; a fault injected in one tensor of a copy of the
checkpoint is named by the culprit pass (an Engram table's rows, a KV source's compressor named by the source
layer, the candidate-level indexer, a fine indexer); ``--recall``'s per-level readout is the selection sets of
V41KVState at the answer query; ``--ablate``'s rows hand the variant the base's choice of a level; ``--dry-run``
prints the cost line. tiny-v41: KV sources 2 (ratio 2) and 4 (ratio 1), index sources 2, 4, 5, the candidate
source 4 (so 5 is a fine indexer among 4's candidate blocks, 2 a fine indexer before the candidate level), Engram
on 1 and 2.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dsv4convert.cli import main
from dsv4convert.compare.recall import RecallOptions
from dsv4convert.compare.run import CompareOptions
from dsv4convert.compare.v41 import (
    ABLATIONS,
    Lockstep,
    substitute_levels,
    build_plan,
    diagnose_levels,
    answer_queries,
    needle_kept,
    run_recall,
)
from dsv4convert.model.v41.attention import V41KVState
from dsv4convert.model.v41.forward import V41Runner

TOKENS = ["--random-tokens", "--tokens", "96", "--seq-len", "48", "--no-progress"]


def _with_tensor_changed(src: Path, dst: Path, names: list[str], change) -> Path:
    """A copy of ``src`` with the tensors ``names`` (in one shard) replaced by ``change(dict of them)``."""
    shutil.copytree(src, dst)
    weight_map = json.loads((dst / "model.safetensors.index.json").read_text())["weight_map"]
    shard = dst / weight_map[names[0]]
    with safe_open(shard, "pt") as f:
        tensors = {n: f.get_tensor(n) for n in f.keys()}
        metadata = f.metadata()
    tensors.update(change({n: tensors[n] for n in names}))
    save_file(tensors, shard, metadata=metadata)
    return dst


def _redrawn(name: str):
    def change(t):
        w = t[name]
        g = torch.Generator().manual_seed(1)
        return {name: (torch.randn(w.shape, generator=g) * w.float().std()).to(w.dtype)}
    return change


def _permuted_rows(t):
    weight, scale = (n for n in sorted(t) if n.endswith(".weight")), (n for n in sorted(t) if n.endswith(".scale"))
    w, s = next(weight), next(scale)
    perm = torch.randperm(t[w].shape[0], generator=torch.Generator().manual_seed(0))
    return {w: t[w][perm].contiguous(), s: t[s][perm].contiguous()}


def _compare(base: Path, variant: Path, report: Path, *extra: str) -> dict:
    assert main(["compare", "--base", str(base), "--variant", str(variant), "--report", str(report), *TOKENS,
                 *extra]) == 0
    return json.loads((report / "compare.json").read_text())


@pytest.mark.parametrize("variant", ["fp8", "bf16"])
def test_lossless_conversions_read_kld_zero(variant, tiny_v41, v41_outputs, tmp_path, capsys):
    """Weights only: the conversions are lossless. Served, they are not the release's numerics (FP8 experts' float32
    token groups against MXFP8, BF16's unquantized activations: tests/test_compare_v41_served.py)."""
    result = _compare(tiny_v41, v41_outputs[variant], tmp_path / "report", "--numerics", "weights")
    out = result["output"]
    assert out["kld"]["mean"] == 0.0 and out["same_top1"] == 1.0 and out["positions"] == 2 * 47
    assert result["v41"]["culprit"]["kind"] == "none"
    assert all(b["local"]["relative_error"] == 0 and b["free_running"]["relative_error"] == 0
               for b in result["blocks"])
    assert result["variant"]["variant"] == variant and result["release"] == "DeepSeek-V4.1-Flash"
    assert "culprit: none" in capsys.readouterr().out
    assert "## Culprit (DeepSeek-V4.1)" in (tmp_path / "report" / "compare.md").read_text()


FAULTS = {   # the tensors broken -> (kind, layer, level)
    "engram table rows": (["layers.1.engram.embed.weight", "layers.1.engram.embed.scale"], _permuted_rows,
                          ("engram", 1, None)),
    "KV-source compressor": (["layers.2.attn.compressor.wkv.weight"], _redrawn("layers.2.attn.compressor.wkv.weight"),
                             ("compressor", 2, None)),
    "candidate-level indexer": (["layers.4.attn.indexer.weights_proj.weight"],
                                _redrawn("layers.4.attn.indexer.weights_proj.weight"), ("indexer", 4, "candidate")),
    "fine indexer": (["layers.5.attn.indexer.weights_proj.weight"],
                     _redrawn("layers.5.attn.indexer.weights_proj.weight"), ("indexer", 5, "fine")),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_an_injected_fault_is_named(fault, tiny_v41, tmp_path):
    names, change, (kind, layer, level) = FAULTS[fault]
    broken = _with_tensor_changed(tiny_v41, tmp_path / "broken", names, change)
    result = _compare(tiny_v41, broken, tmp_path / "report", "--numerics", "weights")
    culprit = result["v41"]["culprit"]
    assert (culprit["kind"], culprit["layer"], culprit.get("level")) == (kind, layer, level), culprit
    by_name = {c["component"]: c for c in result["v41"]["components"]}
    # every other component is exact: the fault is charged to its part alone, not to the layers reading its output
    assert [n for n, c in by_name.items() if c["relative_error"] > 0] == [culprit["component"]]
    if kind == "compressor":
        assert culprit["read_by"] == [2, 3] and "KV-source layer 2" in culprit["sentence"]
        assert result["blocks"][3]["free_running"]["relative_error"] > 0   # layer 3 reads it, and is not named
    assert result["output"]["kld"]["mean"] > 0


def test_recall_reads_each_level_from_the_kv_state(tiny_v41, tmp_path):
    """The per-level readout of a needle prompt is the candidate blocks and fine selections a plain forward leaves
    in V41KVState at each answer query for the value token it writes; --ablate's rows carry the base's candidate
    blocks (and selections)."""
    broken = _with_tensor_changed(tiny_v41, tmp_path / "broken", ["layers.4.attn.indexer.weights_proj.weight"],
                                  _redrawn("layers.4.attn.indexer.weights_proj.weight"))
    opts = CompareOptions(base=str(tiny_v41), variant=str(broken), device="cpu", progress=False, numerics="weights",
                          recall=RecallOptions(lengths=[200], depths=(0.3,), ablate=True))
    plan = build_plan(opts)
    assert plan.grid.reach == 64 and plan.grid.thresholds == {2: 18, 4: 9, 5: 9}
    result = run_recall(plan)
    prompt = plan.grid.prompts[0]
    ids = plan.grid.batches[0]
    first, positions = len(prompt.input_ids) - 1, plan.grid.positions[0]
    assert plan.grid.aligned[0] and prompt.needle_span[0] <= positions[0] < positions[-1] < prompt.needle_span[1]
    queries = [first + j for j in range(len(positions))]     # answer query j writes value token j
    assert answer_queries(plan.grid, 0) == queries
    for side, label in ((tiny_v41, "base"), (broken, "variant")):
        kv = V41Runner(side, "cpu", torch.float32).forward(ids, capture=()).kv
        cand = [p // 8 in set(kv.candidate_blocks[0, q].tolist()) for q, p in zip(queries, positions)]
        hits = {s: [p // (2 if s == 2 else 1) in set(kv.selections[s][0, q].tolist())
                    for q, p in zip(queries, positions)] for s in (2, 4, 5)}
        kept = result["prompts"][0]["kept"][label]
        assert kept["candidate_fraction"] == sum(cand) / len(cand)
        assert kept["fine_fraction"] == {s: sum(h) / len(h) for s, h in hits.items()}, (label, kept)
        assert kept["fine"] == {s: all(h) for s, h in hits.items()}
        assert kept == needle_kept(plan.cfg, kv, 0, queries, positions)
    # the readout itself: each query needs only its own token's entry; one query whose selection lacks it is a miss
    S, n = ids.shape[1], len(positions)
    own = torch.zeros(1, S, 1, dtype=torch.int64)
    for q, p in zip(queries, positions):
        own[0, q, 0] = p
    wrong = own.clone()
    wrong[0, queries[-1], 0] = positions[0]          # the last query holds the first token's entry, not its own
    kv = V41KVState(candidate_blocks=own // 8, selections={4: own, 5: wrong})
    read = needle_kept(plan.cfg, kv, 0, queries, positions)
    assert read["candidate"] and read["fine"] == {4: True, 5: False}
    assert read["fine_fraction"][5] == (n - 1) / n
    # the whole value at the first query alone, as a tokenizer that merges digits is read
    assert not needle_kept(plan.cfg, kv, 0, [first] * n, positions)["fine"][4]
    rows = list(ABLATIONS)
    kept = result["prompts"][0]["kept"]
    assert kept[rows[0]]["candidate_fraction"] == kept["base"]["candidate_fraction"]
    assert kept[rows[1]]["fine_fraction"] == kept["base"]["fine_fraction"]
    # the ablation rows' states: the base's candidate blocks, then the base's fine selections too
    engine = Lockstep(plan, [ids], {"variant": None, **{r: substitute_levels(ABLATIONS[r]) for r in rows}}, measure=False)
    with torch.no_grad():
        engine.run()
    base_kv, variant_kv = engine.base_runs[0].kv, engine.runs["variant"][0].kv
    one, both = engine.runs[rows[0]][0].kv, engine.runs[rows[1]][0].kv
    assert not torch.equal(variant_kv.candidate_blocks, base_kv.candidate_blocks)   # the broken candidate level
    assert torch.equal(one.candidate_blocks, base_kv.candidate_blocks)
    assert not torch.equal(one.selections[4], base_kv.selections[4])   # its own fine pick at the source layer
    assert all(torch.equal(both.selections[s], base_kv.selections[s]) for s in (2, 4, 5))
    assert set(result["recall"]["tracks"]) == {"base", "variant", *rows}
    assert result["recall"]["diagnosis"]["kind"] in ("none", "candidate", "fine", "after_selection")


def test_dry_run_prints_the_cost_line(tiny_v41, v41_outputs, capsys):
    assert main(["compare", "--base", str(tiny_v41), "--variant", str(v41_outputs["bf16"]), *TOKENS,
                 "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "compare: expected ~" in out and "GFLOP" in out and "dry run: nothing run" in out
    assert "estimated peak device memory" in out


def test_a_variant_the_engine_does_not_run_on_the_family_is_refused(tiny_v41, v41_outputs, capsys):
    """NVFP4 V4.1 runs on SGLang's sm_100 only (engines/sglang/quant_config.py::v41_family_problem)."""
    assert main(["compare", "--base", str(tiny_v41), "--variant", str(v41_outputs["nvfp4"]), *TOKENS,
                 "--gpu-family", "sm90", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "sm90" in err


def _prompt(retrieved: dict, base_fine: dict, variant_fine: dict, base_cand=True, variant_cand=True) -> dict:
    return {"retrieved": retrieved,
            "kept": {"base": {"candidate": base_cand, "fine": base_fine},
                     "variant": {"candidate": variant_cand, "fine": variant_fine}}}


def test_the_level_that_lost_the_needle_is_named():
    """diagnose_levels: by the selections (base kept, variant dropped), and with --ablate by the first row that
    retrieves the needle again."""
    one, both = list(ABLATIONS)
    lost = {"base": True, "variant": False, one: False, both: False}
    assert diagnose_levels([_prompt({**lost, "variant": True}, {4: True}, {4: True})], ablate=False)["kind"] == "none"
    cand = diagnose_levels([_prompt({**lost, one: True}, {4: True, 5: True}, {4: True, 5: True}, variant_cand=False)],
                           ablate=True)
    assert cand["kind"] == "candidate" and cand["by_selection"] == {"candidate": 1} and cand["by_ablation"] == {
        "candidate": 1}
    fine = diagnose_levels([_prompt({**lost, both: True}, {4: True, 5: True}, {4: True, 5: False})], ablate=True)
    assert fine["kind"] == "fine" and fine["layer"] == "layers.5" and fine["by_ablation"] == {"fine": 1}
    after = diagnose_levels([_prompt(lost, {4: True}, {4: True})], ablate=False)
    assert after["kind"] == "after_selection" and "after selection" in after["sentence"]


def test_the_served_numerics_are_charged_to_the_parts_that_round(tiny_v41, tmp_path):
    """The base against itself, weights only against served: SGLang's FP4 round trips (indexer queries and keys,
    stored compressed KV) move the indexers and compressors, its activation quantization every attention (FP8
    ``wq_a``/``wkv``/``wq_b``/``wo_b``) and MoE (MXFP8 experts, FP8 shared expert). The Engram ``wkv`` is an FP8
    linear too, but its input is the table's rows, E4M3 with one UE8M0 scale per 32: re-quantized per 32 with
    UE8M0 scales they come back exactly, so the Engram layers do not move; nor does the BF16 head."""
    result = _compare(tiny_v41, tiny_v41, tmp_path / "report", "--base-numerics", "weights")
    moved = {c["component"] for c in result["v41"]["components"] if c["relative_error"] > 0}
    fp4 = {"layers.2.attn.compressor", "layers.4.attn.compressor", "layers.2.attn.indexer", "layers.4.attn.indexer",
           "layers.5.attn.indexer"}
    activations = {f"layers.{i}.{part}" for i in range(6) for part in ("attn", "ffn")}
    assert moved == fp4 | activations
    assert result["base"]["numerics"]["indexer"] is None and result["variant"]["numerics"]["indexer"] == "fp4"
    assert result["base"]["numerics"]["activations"] is False and result["variant"]["numerics"]["activations"]
