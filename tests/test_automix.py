"""automix: the exact knapsack, and the whole loop on the trained organism against every baseline.

The organism (``synth --preset organism``) is a trained DeepSeek-V4 whose KLDs carry signal, so the goals of
issues 38 and 46 are asserted on it as measured numbers, not on random weights: at every budget tried (the
bytes of every uniform layout and of the naive mix) automix's verified choice *measures* at most that
baseline's KLD on held-out windows, at equal or fewer bytes; every mix's measured KLD is within a factor 1.5
of what the sensitivity pass predicted; and a mix measured whole on a track of the pass measures exactly what
``compare`` measures on it once converted.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import random

import pytest
import torch

from dsv4convert.automix.solve import Option, solve, total


def _brute(groups, capacity):
    best = None
    for picked in itertools.product(*[range(len(g)) for g in groups]):
        size, cost = total(groups, list(picked))
        if size <= capacity and (best is None or (cost, size) < best[:2]):
            best = (cost, size, list(picked))
    return best


@pytest.mark.parametrize("seed", range(40))
def test_knapsack_is_exact_against_brute_force(seed):
    rng = random.Random(seed)
    groups = [[Option(str(j), rng.choice([1, 2, 3, 5, 8]) * 10, rng.random()) for j in range(rng.randint(1, 4))]
              for _ in range(rng.randint(1, 6))]
    capacity = rng.randint(10, 200)
    expected = _brute(groups, capacity)
    picked = solve(groups, capacity)
    if expected is None:
        assert picked is None
        return
    size, cost = total(groups, picked)
    assert size <= capacity
    assert cost == pytest.approx(expected[0], abs=1e-12)


def test_knapsack_scales_to_the_full_model():
    """43 layers x 4 decisions with V4-Flash-like sizes: the Pareto front stays small enough to solve at once."""
    rng = random.Random(0)
    groups = []
    for _ in range(43):
        groups.append([Option(f, b, rng.random() * s) for f, b, s in
                       (("nvfp4", 2_300, 1.0), ("fp8", 4_200, 0.3), ("bf16", 8_400, 0.0))])
        for size in (60, 8, 30):
            groups.append([Option("fp8", size, rng.random() * 0.1), Option("bf16", 2 * size, 0.0)])
    picked = solve(groups, 43 * 3_000 + 43 * 98 * 2)
    size, _ = total(groups, picked)
    assert size <= 43 * 3_000 + 43 * 98 * 2


# ------------------------------------------------------------------------------------------ on the organism

from pathlib import Path  # noqa: E402

from dsv4convert.automix import choose, verify  # noqa: E402
from dsv4convert.automix import plan as automix  # noqa: E402
from dsv4convert.automix.sensitivity import Measured  # noqa: E402
from dsv4convert.cli import main  # noqa: E402
from dsv4convert.convert.plan import build_plan  # noqa: E402
from dsv4convert.convert.recipe import parse_recipe  # noqa: E402
from dsv4convert.errors import DSV4Error  # noqa: E402
from dsv4convert.organism.export import write_organism  # noqa: E402
from dsv4convert.synth import ORGANISM_DIR  # noqa: E402

TEXT = ORGANISM_DIR / "heldout.txt"
# sm_100: NVFP4 experts are W4A4 and MXFP4 ones MXFP8 x MXFP4 there, so every format costs something measurable.
SETTINGS = dict(gpu_family="sm100", engine="sglang", tokens=3072, select_tokens=3072, verify_tokens=4096, seq_len=512,
                progress=False)
# The baselines tried (bench/results/automix-organism-cpu.md measures all of them): each shipped-variant-like
# uniform layout, and the naive mix of the NVFP4 hybrid.
BASELINES = ("uniform-nvfp4-fp8-wo_a-fp8", "uniform-fp8-bf16-wo_a-fp8", "uniform-int4-bf16-linears-fp8",
             "naive-nvfp4-fp8-wo_a-fp8")


@pytest.fixture(scope="module")
def organism(tmp_path_factory) -> Path:
    return write_organism(tmp_path_factory.mktemp("automix") / "base")


@pytest.fixture(scope="module")
def measured(organism):
    plan = automix.build(automix.AutomixOptions(src=str(organism), size=10**9, text=TEXT, **SETTINGS))
    windows = automix.windows(plan)
    return plan, automix.run_sensitivity(plan, windows.sensitivity), windows


@pytest.fixture(scope="module")
def choices(measured):
    """The verified choice at each baseline's bytes, from one selection pass."""
    plan, sensitivity, windows = measured
    baselines = dict((mix.name, mix) for _, mix in verify.baselines(plan, sensitivity))
    assert set(BASELINES) <= set(baselines), sorted(baselines)
    capacities = {name: baselines[name].bytes for name in BASELINES}
    return baselines, choose.choose_at(plan, sensitivity, capacities, windows.selection)


def test_automix_beats_every_baseline_at_its_bytes_and_predicts_within_1_5x(measured, choices):
    """On the held-out windows (measured as tracks: what compare measures, the next test checks), automix's
    verified choice at each baseline's bytes measures at most the baseline."""
    plan, sensitivity, windows = measured
    baselines, chosen = choices
    for name in BASELINES:
        choice = chosen[name]
        uniforms = [mix.name for mix in choice.candidates if mix.name.startswith("uniform-")]
        assert not name.startswith("uniform-") or name in uniforms          # the baseline itself was a candidate
        assert all(choice.kld(choice.chosen) <= choice.kld(mix) for mix in choice.candidates)
    pairs = [(baselines[name], chosen[name].chosen) for name in BASELINES]
    heldout = choose.measure_candidates(plan, [mix for pair in pairs for mix in pair], windows.heldout)
    rows = []
    for base, auto in pairs:
        base_kld, auto_kld = (heldout.mix_kld(choose.track_label(m)) for m in (base, auto))
        assert auto.bytes <= base.bytes
        assert auto_kld <= base_kld * (1 + 1e-9), (auto, auto_kld, base, base_kld)
        rows += [verify.Row(m.name, kind, m.layout.label, m.bytes, m.predicted, kld)
                 for m, kind, kld in ((base, "baseline", base_kld), (auto, "automix", auto_kld))]
    for row in rows:
        assert row.measured > 0
        assert 1 / 1.5 <= row.measured / row.predicted <= 1.5, row
    # the estimator orders mixes as the measurements do (0.92 over the 36 mixes of automix-organism-cpu.md)
    assert verify.rank_agreement(rows) >= 0.6, [(r.name, r.predicted, r.measured) for r in rows]
    # the choice is not a uniform one in disguise: somewhere it mixes formats within a layout
    assert any(len(set(chosen[name].chosen.picks.values())) > 2 for name in BASELINES)


def test_a_mix_on_a_track_measures_what_compare_measures_once_converted(measured, choices, tmp_path):
    """The selection pass measures candidates without converting them: for a mixed choice, compare of the
    converted checkpoint on a selection window gives the KLD the track measured at that window's positions."""
    plan, sensitivity, windows = measured
    _, chosen = choices
    choice = next(c for c in chosen.values() if len(set(c.chosen.picks.values())) > 2)
    row = verify.measure_row(plan, choice.chosen, "automix", sensitivity, windows.selection[:1], tmp_path)
    track = choice.selection.mixes[choose.track_label(choice.chosen)]
    assert row.measured == pytest.approx(float(track[:windows.selection.shape[1] - 1].double().mean()), rel=1e-4)


def test_the_measured_winner_is_returned_and_an_overruled_estimate_is_said(choices):
    """Selection windows where the predicted best measures worse than another candidate: the other one is
    chosen, and the verdict says it was not the predicted best and by how much, with the paired error."""
    _, chosen = choices
    mixes = next(c.candidates for c in chosen.values() if len(c.candidates) >= 2)
    predicted = min(mixes, key=lambda m: m.predicted)
    other = next(m for m in mixes if m is not predicted)
    positions = 1000
    noise = torch.linspace(0, 2e-4, positions)
    klds = {choose.track_label(m): torch.full((positions,), 5e-3) for m in mixes}
    klds[choose.track_label(predicted)] = 1e-3 + noise
    klds[choose.track_label(other)] = 9e-4 + noise.flip(0)
    selection = Measured({}, {}, {}, positions, 2, positions // 2 + 1, mixes=klds)
    choice = choose.choose(mixes, selection)
    assert choice.chosen is other and choice.predicted is predicted and choice.overruled
    verdict = choice.verdict()
    assert f"not the predicted best {predicted.name}" in verdict and "0.00010 ± 0.00000 less" in verdict
    # the family's correction: its candidates' measured over predicted KLD, pooled
    family = [m for m in mixes if m.layout.label == other.layout.label]
    factor = sum(float(klds[choose.track_label(m)].double().mean()) for m in family) / sum(m.predicted for m in family)
    assert choice.corrected(other) == pytest.approx(other.predicted * factor)
    klds[choose.track_label(other)] = 1e-3 + noise.flip(0) - 1e-7          # a gap far inside the paired error
    assert "indistinguishable" in choose.choose(mixes, dataclasses.replace(selection, mixes=klds)).verdict()


def test_the_written_recipe_says_why_and_converts(measured, organism):
    plan, sensitivity, _ = measured
    mix = plan.solve(sensitivity, capacity=9_000_000)
    text = mix.recipe(plan, sensitivity, "test").text   # what automix writes, read back as a user would
    recipe = parse_recipe(text, "automix.yaml")
    converted = build_plan(plan.ckpt, recipe, engine="sglang")
    for decision, fmt in mix.picks.items():
        for module in plan.decisions[decision]:
            assert converted.modules[module].output_format is fmt, (module, fmt)
    assert text.count("predicted KLD") == len(mix.picks)
    assert mix.bytes <= 9_000_000


def test_budget_too_small_and_missing_text_are_refused(organism, tmp_path, capsys):
    args = ["automix", "--src", str(organism), "--gpu-family", "sm100", "--no-progress"]
    assert main([*args, "--size", "1M", "--text", str(TEXT), "--dry-run"]) == 2
    assert "below the smallest mix" in capsys.readouterr().err
    assert main([*args, "--size", "9M", "--dry-run"]) == 2
    assert "--text" in capsys.readouterr().err
    assert main([*args, "--size", "9M", "--gpu", "h200", "--text", str(TEXT), "--dry-run"]) == 2
    assert "not both" in capsys.readouterr().err
    # the defaults want 24K tokens of text: the error names each flag that takes a share
    assert main([*args, "--size", "9M", "--text", str(TEXT), "--seq-len", "512", "--dry-run"]) == 2
    assert "--tokens 8192 + --select-tokens 8192 + --verify-tokens 8192 need 24576" in capsys.readouterr().err
    with pytest.raises(SystemExit) as refused:
        main([*args, "--size", "9M", "--text", str(TEXT), "--verify-top", "-1", "--dry-run"])
    assert refused.value.code == 2 and "--verify-top: must be 0 or more" in capsys.readouterr().err
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    assert main([*args, "--size", "9M", "--text", str(TEXT), "--dst", str(tmp_path / "full")]) == 2


def test_dry_run_prints_the_menu_and_the_gpu_budget(organism, capsys):
    args = ["automix", "--src", str(organism), "--gpu", "rtx-pro-6000", "--tp", "1", "--kv-tokens", "64K",
            "--text", str(TEXT), "--tokens", "4K", "--select-tokens", "4K", "--verify-tokens", "4K", "--seq-len", "512",
            "--verify-top", "3", "--dry-run", "--no-progress"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "sm120" in out and "bytes per GPU at TP 1" in out and "KV per token" in out
    assert "not on the menu: nvfp4+fp8+bf16: fp8 experts" in out   # FP8 beside NVFP4 has no Marlin runner
    # the verification's cost: its candidates, the tracks and the layer passes of its one pass
    verification = next(line for line in out.splitlines() if line.startswith("  verification:"))
    uniforms = int(verification.split(" and the ")[1].split(" uniform")[0])
    assert f"up to {3 + uniforms} tracks" in verification and f"({(3 + uniforms) * 4} layer passes" in verification
    assert "8 x 512 selection tokens" in verification
    # the dry run states the expected time of the run (#54), from its counts at this device's measured rate
    expected = [line for line in out.splitlines() if line.startswith("  automix: expected ~")]
    assert len(expected) == 1 and "for the sensitivity pass, the verification pass:" in expected[0]
    assert float(expected[0].split(" GFLOP at")[0].rsplit(" ", 1)[1]) > 0
    # a GPU given as a size needs its family, as fit's (#54): refused in one line, or read as given
    sized = [a for a in args if a != "rtx-pro-6000"]
    sized.insert(sized.index("--gpu") + 1, "98304")
    assert main(sized) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --gpu 98304: a size needs its family") and not captured.out
    assert main([*sized, "--gpu-family", "sm100"]) == 0
    head = capsys.readouterr().out.splitlines()[0]
    assert head.endswith("--engine sglang, sm100")


def test_the_expected_time_is_said_before_the_work(organism, capsys, monkeypatch):
    """A real run prints its expected time before the sensitivity pass starts (#54)."""
    seen = []

    def first_work(plan, ids, eta=None):
        seen.append(capsys.readouterr().err)
        raise DSV4Error("stopped where the work starts")

    monkeypatch.setattr(automix, "run_sensitivity", first_work)
    assert main(["automix", "--src", str(organism), "--size", "9M", "--text", str(TEXT), "--tokens", "4K",
                 "--select-tokens", "4K", "--verify-tokens", "4K", "--seq-len", "512", "--gpu-family", "sm100"]) == 2
    lines = seen[0].splitlines()
    assert len(lines) == 1 and lines[0].startswith("automix: expected ~") and "on this device (" in lines[0]
    assert "the sensitivity pass, the verification pass:" in lines[0]


def test_a_gpu_budget_binds_exactly_as_fit_counts(measured, organism):
    """--gpu b200 --tp 1 with so many KV tokens that only ~9 MB per GPU is left for weights: the chosen mix is
    within the allowance, and fit's own server check of the planned mix holds those tokens."""
    plan, sensitivity, _ = measured

    def gpu_plan(kv_tokens: int):
        opts = automix.AutomixOptions(src=str(organism), gpu="b200", tp=1, kv_tokens=kv_tokens, text=TEXT,
                                      **{k: v for k, v in SETTINGS.items() if k != "gpu_family"})
        return automix.build(opts)

    probe = gpu_plan(65536).layouts[0]
    per_token = (probe.capacity - gpu_plan(131072).layouts[0].capacity) / 65536
    kv_tokens = int(65536 + (probe.capacity - 9_000_000) / per_token)
    tight = gpu_plan(kv_tokens)
    assert 8_000_000 < tight.layouts[0].capacity < 10_000_000
    mix = tight.solve(sensitivity)
    assert mix.bytes <= mix.layout.capacity
    lines = automix.check_fit(tight, mix, sensitivity)
    assert lines and f"(asked {kv_tokens})" in lines[0]



def test_the_mix_is_written_alone_and_its_report_beside_it(measured, choices, tmp_path, capsys):
    """As the command delivers it: the model directory holds the mix alone (it is what gets uploaded), automix.md
    and .json go to DST-automix beside it, and the last line says what to do next."""
    plan, sensitivity, windows = measured
    dst = tmp_path / "mix"
    plan = dataclasses.replace(plan, options=dataclasses.replace(plan.options, dst=str(dst), report=None))
    written = verify.deliver(plan, sensitivity, dataclasses.replace(windows, heldout=windows.heldout[:1]),
                             choices[1][BASELINES[0]], {})
    assert (dst / "config.json").is_file() and (dst / "automix-recipe.yaml").is_file()   # the recipe travels with it
    assert not {"automix.md", "automix.json", "pareto.png"} & {p.name for p in dst.iterdir()}
    assert {p.parent for p in written} == {tmp_path / "mix-automix"}
    report = json.loads((tmp_path / "mix-automix" / "automix.json").read_text())
    assert report["rows"][-1]["name"] == "automix" and report["rows"][-1]["measured"] >= 0
    assert capsys.readouterr().out.rstrip().splitlines()[-1].startswith(f"next: dsv4convert validate {dst}")
