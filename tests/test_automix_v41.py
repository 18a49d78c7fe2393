"""automix on DeepSeek-V4.1 (``dsv4convert/automix/v41.py``, ``dsv4convert/engines/mixes_v41.py``) on tiny-v41.

The pinned engines' V4.1 menu is uniform layouts only: each engine's layouts per GPU family are the verdicts the
real loaders were checked against (tests/test_v41_convert.py), and the per-layer formats their quant configs take
are cited from the installed wheels' own source (read here with ``ast``, so a renamed function fails the test);
no mixed V4.1 checkpoint can be written (convert/v41.py refuses any recipe but the shipped ones). The whole loop
runs once: the layouts within a size budget measured through compare/v41.py, the least chosen, delivered, the
Engram tables byte for byte the release's.
"""

from __future__ import annotations

import ast
import hashlib
import json
import random
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open

import sglang
from dsv4convert.automix import v41
from dsv4convert.cli import main
from dsv4convert.engines import GPU_FAMILIES, SGLANG, VLLM
from dsv4convert.engines.config import v41_families
from dsv4convert.engines.mixes_v41 import PER_LAYER, UNIFORM, engine_problem, no_mix_reason, v41_menu

ENGRAM = [f"layers.{layer}.engram.embed.{kind}" for layer in (1, 2) for kind in ("weight", "scale")]
SMALL = ["--tokens", "96", "--verify-tokens", "96", "--seq-len", "48", "--no-progress"]
VLLM_PKG = Path(sys.prefix) / "vllm-overlay" / "lib" / "python3.11" / "site-packages" / "vllm"   # as vllm_oracle.py
SGLANG_PKG = Path(sglang.__file__).parent


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> Path:
    rng = random.Random(0)
    words = "the cat sat on a mat dog ran far blue red green house tree river stone".split()
    path = tmp_path_factory.mktemp("v41-automix-text") / "text.txt"
    path.write_text(" ".join(rng.choice(words) for _ in range(3000)))
    return path


def _sha(ckpt: Path, name: str) -> str:
    shard = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"][name]
    with safe_open(ckpt / shard, "pt") as f:
        return hashlib.sha256(f.get_tensor(name).contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _one_error(capsys) -> str:
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("error:"), err
    return err[0]


# ------------------------------------------------------------------------------------------------- the menu

# What each engine runs per family, read from its code and checked with its real loader (tests/test_v41_convert.py):
# SGLang's NVFP4 hybrid only on sm_100 (flashinfer_trtllm_routed); vLLM no FP8 MoE kernel for 32x32 blocks and no
# compressed-tensors config for V4.1.
EXPECTED = {(SGLANG, "sm90"): ["native", "fp8", "bf16", "w4a16"],
            (SGLANG, "sm100"): ["native", "nvfp4", "fp8", "bf16", "w4a16"],
            (SGLANG, "sm120"): ["native", "fp8", "bf16", "w4a16"],
            **{(VLLM, f): ["native", "nvfp4", "bf16"] for f in GPU_FAMILIES},
            ("both", "sm90"): ["native", "bf16"], ("both", "sm100"): ["native", "nvfp4", "bf16"],
            ("both", "sm120"): ["native", "bf16"]}


def test_the_menu_per_engine_and_family_is_the_engines_verdicts(tiny_v41):
    source = json.loads((tiny_v41 / "config.json").read_text())["quantization_config"]
    for (engine, family), want in EXPECTED.items():
        menu = v41_menu(engine, family, source)
        assert [o.variant for o in menu] == list(UNIFORM)
        assert [o.variant for o in menu if o.problem is None] == want, (engine, family)
        for o in menu:   # every exclusion is an engine's own reason: its quant-config reading or its family verdict
            engines = [SGLANG, VLLM] if engine == "both" else [engine]
            reasons = [engine_problem(e, o.variant, family, source) for e in engines]
            assert (o.problem is None) == all(r is None for r in reasons)
            if o.variant != "native":
                assert all((v41_families(o.variant)[e][family] is None) or r for e, r in zip(engines, reasons))


def _method_source(path: Path, cls: str, method: str) -> str:
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == method:
                    return ast.get_source_segment(path.read_text(), item)
    raise AssertionError(f"{path}: no {cls}.{method}")


def test_per_layer_formats_are_what_the_engines_code_takes_and_no_mix_can_be_written(tiny_v41, tmp_path, capsys):
    # The per-layer branches automix cites, in the pinned wheels' own source.
    fp8 = _method_source(SGLANG_PKG / "srt/layers/quantization/fp8.py", "Fp8Config", "get_quant_method")
    assert "ignored_layers" in fp8 and "UnquantizedFusedMoEMethod" in fp8 and "UnquantizedLinearMethod" in fp8
    hybrid = _method_source(SGLANG_PKG / "srt/layers/quantization/modelopt_quant.py", "HybridFp8NvFp4Config",
                            "get_quant_method")
    assert "is_layer_excluded" in hybrid and "Mxfp4FlashinferTrtllmMoEMethod" in hybrid and "is_fp4_experts" in hybrid
    vllm = _method_source(VLLM_PKG / "models/deepseek_v41/quant_config.py", "DeepseekV4FP8Config", "get_quant_method")
    assert all(s in vllm for s in ("ignored_layers", "UnquantizedFusedMoEMethod", "_is_nvfp4_expert_layer",
                                   "Mxfp4MoEMethod", "ModelOptNvFp4FusedMoE"))
    # vLLM claims no compressed-tensors config for V4.1 (why W4A16 is off its menu): its override in its own words.
    override = _method_source(VLLM_PKG / "models/deepseek_v41/quant_config.py", "DeepseekV4FP8Config",
                              "override_quantization_method")
    assert '("fp8", "deepseek_v4_fp8")' in override and "compressed-tensors" not in override
    roots = {SGLANG: SGLANG_PKG / "srt", VLLM: VLLM_PKG}
    for engine in (SGLANG, VLLM):   # every file::Class.method automix prints exists in that wheel
        cited = re.findall(r"(\S+\.py)::(\w+)\.(\w+)", PER_LAYER[engine])
        assert cited and all(_method_source(roots[engine] / f, c, m) for f, c, m in cited)
        assert "convert/v41.py::_shipped_variant" in no_mix_reason(engine)
    # ...but convert/v41.py writes no mixed V4.1 layout: a recipe that is not a shipped variant is refused by name.
    mixed = tmp_path / "mixed.yaml"   # one layer's experts BF16 (Fp8Config's ignored_layers), the rest as released
    mixed.write_text("name: per-layer\nrules:\n  - match: {role: routed_expert, mtp: false, module: 'layers\\.1\\.ffn"
                     "\\.experts\\..*'}\n    format: bf16\n    reason: one layer\n  - match: {}\n    format: keep\n    reason: as released\n")
    assert main(["convert", "--recipe", str(mixed), "--src", str(tiny_v41), "--dst", str(tmp_path / "m"),
                 "--no-progress"]) == 2
    assert "shipped recipes" in _one_error(capsys)
    assert not (tmp_path / "m").exists()


# ------------------------------------------------------------------------------- dry run and refused budgets


def test_dry_run_prints_the_menu_why_no_mix_and_the_expected_time(tiny_v41, text, tmp_path, capsys):
    argv = ["automix", "--src", str(tiny_v41), "--dst", str(tmp_path / "mix"), "--text", str(text), "--engine", "vllm",
            "--gpu-family", "sm100", "--size", "20M", "--dry-run", *SMALL]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "per-layer mixes: none" in out and "DeepseekV4FP8Config.get_quant_method" in out
    assert "uniform release (as shipped): 15.3 MB, within the budget" in out
    assert "uniform nvfp4:" in out and "uniform bf16: 31.5 MB, over the budget" in out
    assert "not on the menu: fp8: vLLM 0.33.0 finds no FP8 MoE kernel" in out
    assert "not on the menu: w4a16: " in out and "compressed-tensors" in out
    line = next(x for x in out.splitlines() if "automix: expected" in x)
    assert "on this device (cpu" in line and "2 compare(s) of 2 x 48 tokens" in line and "1 conversion(s)" in line
    assert not (tmp_path / "mix").exists() and not (tmp_path / "mix-automix").exists()


@pytest.mark.parametrize("budget, words", [
    (["--size", "15M"], "below the smallest DeepSeek-V4.1 layout --engine sglang serves on sm120 (release (as "
                        "shipped): 15.3 MB)"),
    (["--size", "20M", "--gpu", "h200", "--tp", "1", "--kv-tokens", "1K"], "not both"),
    (["--gpu", "h200"], "go together"),
    (["--gpu", "h200", "--tp", "1", "--kv-tokens", "100000M"], "holds 104857600000 KV tokens"),
])
def test_bad_budgets_are_one_error_line(tiny_v41, text, tmp_path, capsys, budget, words):
    argv = ["automix", "--src", str(tiny_v41), "--dst", str(tmp_path / "mix"), "--text", str(text), *budget,
            "--dry-run", *SMALL]
    assert main(argv) == 2
    assert words in _one_error(capsys)


def test_a_gpu_budget_is_fits_own_v41_sizing(tiny_v41, text, tmp_path, capsys):
    assert main(["automix", "--src", str(tiny_v41), "--text", str(text), "--gpu", "h200", "--tp", "1",
                 "--kv-tokens", "1M", "--engine", "both", "--dry-run", *SMALL]) == 0
    out = capsys.readouterr().out
    assert "per GPU on H200, TP 1, 1048576 KV tokens (fit)" in out
    assert "sglang:" in out and "vllm:" in out and "within the budget (sglang:" in out


# ------------------------------------------------------------------------------------ the choice, delivered


def test_the_least_kld_within_the_budget_is_chosen_and_delivered(tiny_v41, text, tmp_path, capsys):
    # 20 MB holds the release (15.3 MB), fp8 (18.1 MB) and w4a16 (17.2 MB), not bf16 (31.5 MB).
    dst = tmp_path / "mix"
    assert main(["automix", "--src", str(tiny_v41), "--dst", str(dst), "--text", str(text), "--size", "20M",
                 *SMALL]) == 0
    out = capsys.readouterr().out
    record = json.loads((tmp_path / "mix-automix" / "automix.json").read_text())
    measured = {r["variant"]: r for r in record["measured"]}
    assert set(measured) == {"native", "fp8", "w4a16"}            # bf16 is over the budget: not measured
    # Served numerics against the release's weights: the release's own (MXFP8 experts on sm100) read KLD > 0, and
    # FP8 experts, lossless in weights, read otherwise (float32 token groups: Fp8MoEMethod's Triton runner).
    assert measured["native"]["kld"] > 0 and measured["fp8"]["kld"] != measured["native"]["kld"]
    assert all(r["components"] for r in record["measured"])       # compare/v41's per-component pass
    least = min(record["measured"], key=lambda r: (r["kld"], r["bytes"]))
    assert record["chosen"] == least["variant"] and "automix: chosen " in out
    assert {n: _sha(dst, n) for n in ENGRAM} == {n: _sha(tiny_v41, n) for n in ENGRAM}
    assert record["heldout"]["kld"] >= 0 and "held-out tokens: mean KLD" in out
    assert not list(tmp_path.glob("automix-v41-*"))                # the scratch conversions are gone


def test_a_chosen_variant_is_delivered_as_convert_v41_writes_it(tiny_v41, v41_outputs, tmp_path):
    """The delivery of a converted layout: convert/v41.py's output moved whole (card, config, the release's bytes
    for everything the variant keeps); the Engram tables are the release's byte for byte."""
    import shutil

    plan = SimpleNamespace(ckpt=SimpleNamespace(root=tiny_v41))
    scratch = tmp_path / "scratch" / "w4a16"
    shutil.copytree(v41_outputs["w4a16"], scratch)
    dst = tmp_path / "out" / "mix"
    v41.deliver(plan, "w4a16", {"w4a16": scratch}, dst)
    assert not scratch.exists() and (dst / "README.md").exists()
    assert json.loads((dst / "config.json").read_text())["quantization_config"]["quant_method"] == "compressed-tensors"
    assert {n: _sha(dst, n) for n in ENGRAM} == {n: _sha(tiny_v41, n) for n in ENGRAM}


def test_choose_is_least_kld_then_fewest_bytes():
    rows = [v41.Measured("bf16", 30, 0.1, 0.0, 1.0, 1, ""), v41.Measured("native", 15, 0.1, 0.0, 1.0, 1, ""),
            v41.Measured("w4a16", 17, 0.5, 0.0, 1.0, 1, "")]
    assert v41.choose(rows).variant == "native"
    assert v41.choose([rows[0], rows[2]]).variant == "bf16"
