"""`dsv4convert tune`: SGLang 0.5.23's own Triton fused-MoE kernel, its config names and lookup, on CPU.

Kernels run in Triton's interpreter on the tiny synthetic checkpoints, on a GPU faked as an RTX
PRO 6000 (sm_120, 99 KB of shared memory per block): SGLang's ``get_device_name`` answers that
name (on CPU it returns None) and ``tune.device.detect`` returns that device. Interpreter times
mean nothing, so no test looks at which config won; they check what was run, what was written,
and that SGLang's own loader reads it back.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import os

import pytest
import torch

from dsv4convert.cli import main
from dsv4convert.formats import Format
from dsv4convert.synth import preset_config
from dsv4convert.tune import device as device_module
from dsv4convert.tune import output, run, search, sglang_moe, space, workload
from dsv4convert.tune.device import Device
from dsv4convert.tune.problem import MoEProblem, TuneError
from dsv4convert.tune.space import Tile

RTX = "NVIDIA RTX PRO 6000 Blackwell Server Edition"
SM120 = Device(RTX, (12, 0), 99 * 1024, "cpu")


@contextlib.contextmanager
def fake_gpu(mp: pytest.MonkeyPatch, gpu: Device = SM120):
    mp.setattr(device_module, "detect", lambda: gpu)
    mp.setattr(sglang_moe.config_module(), "get_device_name", lambda device_id=0: gpu.name)
    yield gpu


@pytest.fixture
def gpu(monkeypatch):
    with fake_gpu(monkeypatch) as faked:
        yield faked


def cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def fp8_tune(outputs, tmp_path_factory):
    """One real tune of the tiny FP8 checkpoint through the CLI: batch sizes 1 and 4, two shapes, two refinements."""
    out = tmp_path_factory.mktemp("tune") / "moe-configs"
    with pytest.MonkeyPatch.context() as mp, fake_gpu(mp):
        code, stdout, stderr = cli("tune", "--model", str(outputs["fp8"]), "--tp", "1", "--batch-sizes", "1,4",
                                   "--out", str(out), "--max-candidates", "2")
        assert code == 0, stderr
        problem = MoEProblem.from_checkpoint(outputs["fp8"], 1)
        names = [sglang_moe.config_module().get_config_file_name(8, 128, "fp8_w8a8", [128, 128], down_moe=down)
                 for down in (False, True)]
    return {"out": out, "stdout": stdout, "problem": problem, "names": names,
            "folder": sglang_moe.triton_folder()}


def tuned_table(fp8_tune, index: int) -> dict[int, dict]:
    path = fp8_tune["out"] / "configs" / fp8_tune["folder"] / fp8_tune["names"][index]
    return {int(m): cfg for m, cfg in json.loads(path.read_text()).items()}


# --- what is tuned -------------------------------------------------------------------------------------


def test_problem_read_from_each_checkpoint(outputs):
    fp8 = MoEProblem.from_checkpoint(outputs["fp8"], 1)
    assert (fp8.dtype, fp8.block_shape, fp8.experts, fp8.hidden, fp8.intermediate, fp8.topk, fp8.lookup_n) == \
        ("fp8_w8a8", [128, 128], 8, 256, 128, 2, 128)
    assert fp8.swiglu_limit == 10.0
    int4 = MoEProblem.from_checkpoint(outputs["w4a16"], 1)
    # The Triton W4A16 layout packs two values a byte: SGLang names the file after w2's packed N = I / 2.
    # The w4a16 recipe's group 32.
    assert (int4.dtype, int4.block_shape, int4.lookup_n, int4.group_size) == ("int4_w4a16", [0, 32], 64, 32)
    bf16 = MoEProblem.from_checkpoint(outputs["bf16"], 2)
    assert (bf16.dtype, bf16.block_shape, bf16.intermediate) == (None, None, 64)


def test_file_names_are_sglangs(gpu, outputs):
    name = gpu.name.replace(" ", "_")
    problems = {fmt: MoEProblem.from_checkpoint(outputs[v], 1) for fmt, v in (("fp8", "fp8"), ("int4", "w4a16"),
                                                                              ("bf16", "bf16"))}
    assert sglang_moe.file_name(problems["fp8"]) == f"E=8,N=128,device_name={name},dtype=fp8_w8a8,block_shape=[128, 128].json"
    assert sglang_moe.file_name(problems["fp8"], down=True).endswith("block_shape=[128, 128]_down.json")
    assert sglang_moe.file_name(problems["int4"]) == f"E=8,N=64,device_name={name},dtype=int4_w4a16.json"
    assert sglang_moe.file_name(problems["bf16"]) == f"E=8,N=128,device_name={name}.json"


def test_real_model_at_tp4_is_the_shipped_h200_shape(monkeypatch):
    problem = MoEProblem.from_config(preset_config("tiny") | _real_moe_fields(), Format.FP8, 4)
    with fake_gpu(monkeypatch, Device("NVIDIA H200", (9, 0), 227 * 1024, "cpu")):
        assert sglang_moe.file_name(problem) == "E=256,N=512,device_name=NVIDIA_H200,dtype=fp8_w8a8,block_shape=[128, 128].json"
        assert sglang_moe.lookup(problem, None) is not None  # SGLang ships one (triton_3_6_0), so the bench compares


def _real_moe_fields() -> dict:
    from dsv4convert.synth import reference_config

    real = reference_config()
    return {k: real[k] for k in ("hidden_size", "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok")}


def test_nvfp4_and_native_refused_with_the_reason(outputs, tiny_ckpt):
    code, _, err = cli("tune", "--model", str(outputs["nvfp4"]), "--tp", "1")
    assert code == 2
    assert err.splitlines() == [err.strip()] and err.startswith(f"error: {outputs['nvfp4']}: the routed experts are NVFP4")
    assert "never with its Triton fused-MoE kernel" in err
    code, _, err = cli("tune", "--model", str(tiny_ckpt), "--tp", "1")
    assert code == 2 and err.startswith(f"error: {tiny_ckpt}: the routed experts are MXFP4")
    assert "dsv4convert to-fp8" in err


def test_bad_inputs_are_one_line_errors(gpu, outputs, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    fp8 = str(outputs["fp8"])
    cases = [
        (["--model", str(tmp_path / "missing" / "model"), "--tp", "1"], str(tmp_path / "missing" / "model")),
        (["--model", str(broken), "--tp", "1"], str(broken / "config.json")),
        (["--model", fp8, "--tp", "3"], "does not split into 3 tensor-parallel ranks"),
        (["--model", fp8, "--tp", "2"], "needs to be a multiple of 128"),
        (["--model", fp8, "--tp", "1", "--out", str(a_file)], f"{a_file}: exists and is not a folder"),
        (["--model", fp8, "--tp", "1", "--out", str(foreign)], f"{foreign}: exists, is not empty"),
    ]
    for argv, expected in cases:
        code, _, err = cli("tune", *argv, "--out", str(tmp_path / "out")) if "--out" not in argv else cli("tune", *argv)
        assert code == 2, argv
        assert len(err.strip().splitlines()) == 1 and err.startswith("error: ") and expected in err, (argv, err)
    assert not (tmp_path / "out").exists()
    assert (foreign / "notes.txt").read_text() == "mine" and a_file.read_text() == "x"


def test_dry_run_plans_and_writes_nothing(gpu, outputs, tmp_path):
    code, out, _ = cli("tune", "--model", str(outputs["fp8"]), "--tp", "1", "--out", str(tmp_path / "o"), "--dry-run")
    assert code == 0 and not (tmp_path / "o").exists()
    assert f"writes {tmp_path / 'o' / 'configs' / sglang_moe.triton_folder()}" in out
    assert "need more shared memory than a block has" in out and "on NVIDIA RTX PRO 6000" in out


# --- the search ----------------------------------------------------------------------------------------


def test_search_runs_end_to_end_and_writes_sglangs_files(fp8_tune):
    out, folder = fp8_tune["out"], fp8_tune["folder"]
    for name in fp8_tune["names"]:
        assert (out / "configs" / folder / name).is_file()
    for index in (0, 1):
        table = tuned_table(fp8_tune, index)
        assert sorted(table) == [1, 4]
        for cfg in table.values():
            assert set(cfg) - {"USE_TMA"} == {"BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M",
                                             "num_warps", "num_stages"}
    up, down = tuned_table(fp8_tune, 0), tuned_table(fp8_tune, 1)
    assert all(up[m]["BLOCK_SIZE_M"] == down[m]["BLOCK_SIZE_M"] for m in up)  # one alignment serves both GEMMs
    stdout = fp8_tune["stdout"]
    assert "| batch | default us | tuned us |" in stdout and "serve with: dsv4convert serve" in stdout


def test_every_timed_candidate_matches_sglangs_default_config(fp8_tune):
    log = json.loads((fp8_tune["out"] / "tune-logs" / fp8_tune["names"][0]).read_text())
    trials = log["trials"]
    timed = [t for t in trials if t["us"] is not None]
    assert len(timed) >= 16 and {t["round"] for t in timed} == {"baseline", "shapes", "refine", "confirm"}
    assert all(t["status"] == "ok" and t["error"] <= workload.TOLERANCE for t in timed)
    assert any(t["config"].get("USE_TMA") for t in timed)  # sm_120 has TMA: the second round tried it
    default = sglang_moe.config_module().get_default_config(1, 8, 128, 256, 2, "fp8_w8a8", False, [128, 128])
    for m in (1, 4):
        for gemm in ("up", "down"):
            assert any(t["config"] == default and t["batch_size"] == m and t["gemm"] == gemm and t["round"] == "baseline"
                       for t in timed)
    for choice in log["choices"]:  # what was written was timed, at that batch size, for that GEMM
        for gemm in ("up", "down"):
            assert any(t["config"] == choice[gemm] and t["batch_size"] == choice["batch_size"] and t["gemm"] == gemm
                       for t in timed)
    assert all(row["error_vs_default"] <= workload.SEQUENCE_TOLERANCE for row in log["compare"])


def test_sglangs_loader_reads_the_tuned_files_back(fp8_tune, monkeypatch):
    from sglang.srt.layers.moe.moe_runner.triton_utils import try_get_optimal_moe_config

    up, down = tuned_table(fp8_tune, 0), tuned_table(fp8_tune, 1)
    monkeypatch.setenv("SGLANG_MOE_CONFIG_DIR", str(fp8_tune["out"]))
    with fake_gpu(monkeypatch):
        module = sglang_moe.config_module()
        module.get_moe_configs.cache_clear()
        try:
            assert module.get_moe_configs(8, 128, "fp8_w8a8", 128, 128) == up
            for m, expected in ((1, 1), (4, 4), (2, 1), (3, 4), (1000, 4)):
                config, (down_config, _) = try_get_optimal_moe_config(
                    (8, 256, 256), (8, 256, 128), 2, "fp8_w8a8", m, block_shape=[128, 128], return_down_config=True)
                assert config == up[expected] and down_config == down[expected]
        finally:
            module.get_moe_configs.cache_clear()
        for m in (1, 2, 3, 4, 1000):  # the rule the GPU bench uses without sglang-kernel agrees with SGLang's
            assert sglang_moe._served_configs_from_files(fp8_tune["problem"], fp8_tune["out"], m) == \
                sglang_moe.served_configs(fp8_tune["problem"], fp8_tune["out"], m)


def test_served_rule_agrees_with_sglang_on_the_shipped_h200_files(monkeypatch):
    """SGLang's shipped H200 pair for V4 at TP4 (a 3-entry up file, a TMA down file): nearest entry,
    down BLOCK_SIZE_M forced to the up one."""
    problem = MoEProblem.from_config(preset_config("tiny") | _real_moe_fields(), Format.FP8, 4)
    with fake_gpu(monkeypatch, Device("NVIDIA H200", (9, 0), 227 * 1024, "cpu")):
        for m in (1, 16, 64, 256, 384, 2048):
            up, down = sglang_moe.served_configs(problem, None, m)
            assert (up, down) == sglang_moe._served_configs_from_files(problem, None, m)
            assert down["BLOCK_SIZE_M"] == up["BLOCK_SIZE_M"] and down.get("USE_TMA") is True


def test_merged_folder_holds_every_shipped_file(fp8_tune):
    shipped = sglang_moe.shipped_root() / "configs"
    merged = fp8_tune["out"] / "configs"
    tuned = {f"{fp8_tune['folder']}/{name}" for name in fp8_tune["names"]}
    assert output.shipped_files(merged) == output.shipped_files(shipped) | tuned
    for relative in output.shipped_files(shipped):
        assert (merged / relative).read_bytes() == (shipped / relative).read_bytes(), relative
    manifest = json.loads((fp8_tune["out"] / output.MANIFEST).read_text())
    assert manifest["sglang"] == sglang_moe.version() and manifest["shipped_files"] == len(output.shipped_files(shipped))
    assert set(manifest["tuned"]) == {f"configs/{t}" for t in tuned}
    assert all(not entry["replaced_shipped"] and entry["batch_sizes"] == [1, 4] for entry in manifest["tuned"].values())


def test_w4a16_tune_is_read_back_under_its_packed_name(outputs, monkeypatch, tmp_path):
    from sglang.srt.layers.moe.moe_runner.triton_utils import try_get_optimal_moe_config

    problem = MoEProblem.from_checkpoint(outputs["w4a16"], 1)
    with fake_gpu(monkeypatch) as gpu:
        outcome = run.tune(problem, gpu, tmp_path / "int4", batch_sizes=[2], budget_s=600, source="w4a16",
                           max_candidates=1, progress=False, compare_rounds=1)
        written = json.loads(outcome.written[0].read_text())
        assert outcome.written[0].name.endswith("dtype=int4_w4a16.json")
        assert all(t.error <= workload.TOLERANCE for t in outcome.result.trials if t.us is not None)
        monkeypatch.setenv("SGLANG_MOE_CONFIG_DIR", str(tmp_path / "int4"))
        sglang_moe.config_module().get_moe_configs.cache_clear()
        try:  # the runtime's w2 is [E, H, I/2] uint8: SGLang looks up N = 64
            config = try_get_optimal_moe_config((8, 256, 128), (8, 256, 64), 2, "int4_w4a16", 2, block_shape=[0, 128])
        finally:
            sglang_moe.config_module().get_moe_configs.cache_clear()
        assert config == written["2"]


def test_kernel_sequence_matches_a_torch_moe(outputs):
    """The harness runs SGLang's kernels as its MoE does: each step against plain torch math, TMA included."""
    problem = MoEProblem.from_checkpoint(outputs["fp8"], 1)
    weights = workload.random_weights(problem, "cpu", seed=1)
    batch = workload.make_batch(problem, weights, 3, "cpu", seed=1, routings=1)
    default = Tile.from_sglang(sglang_moe.default_config(problem, 3))
    small, small_tma = Tile(16, 64, 128, 1, 4, 3), Tile(16, 64, 128, 1, 4, 3, use_tma=True)

    def dequant(w, s, rows=128):
        return w.float() * s.repeat_interleave(rows, -2).repeat_interleave(128, -1) if w.dim() == 3 else \
            w.float() * s.repeat_interleave(128, -1)

    ids, route = batch.routings[0]
    experts = ids.flatten().long()
    x = dequant(batch.a1, batch.a1_scale).repeat_interleave(2, 0)  # one row per (token, expert) slot
    gate_up = torch.einsum("tk,tnk->tn", x, dequant(weights.w13, weights.w13_scale)[experts])
    for tile in (default, small_tma):
        up = batch.up(tile, 0, batch.up_output()).clone()
        assert workload.relative_error(up, gate_up) < workload.TOLERANCE, tile
        # Written expert-sorted (beside a TMA down config, as the search times it), then put back in token order.
        rows = torch.full((batch.sorted_rows(tile.block_m), up.shape[1]), float("nan"), dtype=torch.bfloat16)
        sorted_up = batch.up(tile, 0, rows, c_sorted=True)
        assert torch.equal(batch.token_order(sorted_up, tile.block_m, 0), up), tile
    gate, up_half = up.float().chunk(2, dim=-1)
    gate, up_half = gate.clamp(max=10.0), up_half.clamp(-10.0, 10.0)  # DeepSeek-V4's swiglu_limit
    act = batch.activate(up, default, 0, sorted_layout=False)
    assert workload.relative_error(act, (gate * torch.sigmoid(gate)).to(torch.bfloat16).float() * up_half) < 1e-2
    a2, a2_scale = batch.quantize_down_input(act)
    expected = torch.einsum("tk,tnk->tn", dequant(a2, a2_scale), dequant(weights.w2, weights.w2_scale)[experts])
    expected = (expected * route.flatten()[:, None]).view(3, 2, -1)
    assert workload.relative_error(batch.down(default, 0, a2, a2_scale, batch.down_output()), expected) < workload.TOLERANCE
    sorted_a2, sorted_scale = batch.down_input(default, 0, small_tma)  # expert-sorted rows, read through TMA
    assert workload.relative_error(batch.down(small_tma, 0, sorted_a2, sorted_scale, batch.down_output()),
                                   expected) < workload.TOLERANCE
    # The whole sequence, and with a TMA down config (the gate/up GEMM then writes expert-sorted rows).
    assert torch.equal(batch.sequence(default, default, 0), batch.down(default, 0, a2, a2_scale, batch.down_output()))
    tma_sequence = batch.sequence(small, small_tma, 0).clone()
    assert workload.relative_error(tma_sequence, batch.sequence(default, default, 0)) < workload.SEQUENCE_TOLERANCE
    # What `compare` times: the same two GEMMs, the down one on the default config's activations.
    assert torch.equal(batch.gemms(default, default, 0, default), batch.sequence(default, default, 0))
    assert workload.relative_error(batch.gemms(small, small_tma, 0, default), tma_sequence) < workload.SEQUENCE_TOLERANCE


def test_alignment_is_sglangs_layout():
    ids = torch.tensor([[2, 3], [1, 2], [1, 3]], dtype=torch.int32)
    a = workload.align(ids, 4, 4)
    assert a.padded.tolist() == [12]  # three experts used, each padded to 4 rows
    assert a.sorted_ids.tolist()[:12] == [2, 4, 6, 6, 0, 3, 6, 6, 1, 5, 6, 6]  # slots of experts 1, 2, 3; pad = 6
    assert a.expert_ids.tolist()[:3] == [1, 2, 3] and set(a.expert_ids.tolist()[3:]) <= {-1}
    assert a.sorted_ids.numel() == 24  # SGLang's numel + (experts + 1) * (BLOCK_M - 1) = 21, rounded up to 4
    one = workload.align(torch.tensor([[0, 5]], dtype=torch.int32), 16, 8)
    assert one.sorted_ids.numel() == 32 and one.padded.tolist() == [32]  # fewer slots than experts: numel * BLOCK_M


def test_shared_memory_wrong_outputs_and_budget(outputs, monkeypatch):
    """A tile too big for the GPU is skipped at launch, a tile whose output differs is dropped, and
    the search goes on; with the budget spent it stops after SGLang's own configs."""
    from triton.runtime.errors import OutOfResources

    problem = MoEProblem.from_checkpoint(outputs["fp8"], 1)
    small = Device(RTX, (12, 0), 64 * 1024, "cpu")
    shapes, left_out = space.shape_grid(problem, small)
    too_big, wrong = [t for t in shapes if space.worth_timing(t, problem, 1)][:2]
    original = workload.Batch.up

    def up(self, tile, routing, out, *, c_sorted=False):
        if tile == too_big:
            raise OutOfResources(120_000, small.shared_memory, "shared memory")
        result = original(self, tile, routing, out, c_sorted=c_sorted)
        return result.mul_(1.5) if tile == wrong else result

    monkeypatch.setattr(workload.Batch, "up", up)
    with fake_gpu(monkeypatch, small):
        result = search.run_search(problem, small, [1], budget_s=600, max_candidates=3, progress=False)
    status = {(t.gemm, t.tile): t.status for t in result.trials}
    assert status[("up", too_big)] == "shared-memory" and status[("up", wrong)] == "wrong"
    assert status[("down", too_big)] == "ok" and status[("down", wrong)] == "ok"
    assert result.choices[1].up not in (too_big, wrong)
    assert left_out == result.left_out_for_shared_memory > 0
    assert all(space.shared_memory_floor(t.tile, problem) <= small.shared_memory for t in result.trials
               if t.round != "baseline")

    ticks = iter([0.0] + [1e9] * 1000)
    with fake_gpu(monkeypatch, small):
        stopped = search.run_search(problem, small, [1], budget_s=60, progress=False, clock=lambda: next(ticks))
    assert stopped.stopped_by_budget and stopped.shapes_tried == 0
    default = Tile.from_sglang(sglang_moe.default_config(problem, 1))
    assert (stopped.choices[1].up, stopped.choices[1].down) == (default, default)


@pytest.mark.parametrize("rival_time, shipped_kept", [(10.0 * (1 - search.SHIPPED_MARGIN / 4), True),
                                                      (10.0 * (1 - 4 * search.SHIPPED_MARGIN), False)])
def test_shipped_entries_are_kept_unless_beaten_by_the_margin(outputs, monkeypatch, rival_time, shipped_kept):
    """Within ``SHIPPED_MARGIN`` of the shipped pair a tuned pair is timing noise: the shipped entries are
    written unchanged (so the tuned folder is never slower than SGLang's own file); a clear win replaces them."""
    problem = MoEProblem.from_checkpoint(outputs["fp8"], 1)
    shapes = [t for t in space.shape_grid(problem, SM120)[0] if space.worth_timing(t, problem, 1)]
    shipped = shapes[0]
    rival = next(t for t in shapes[1:] if t.block_m == shipped.block_m)
    monkeypatch.setattr(sglang_moe, "lookup", lambda problem, root, down=False: {1: shipped.to_sglang()})
    monkeypatch.setattr(sglang_moe, "served_configs", lambda problem, root, m: (shipped.to_sglang(),) * 2)
    speed = {shipped: 10.0, rival: rival_time}
    monkeypatch.setattr(search._Search, "time", lambda self, gemm, tile, batch, rep_ms: speed.get(tile, 50.0))
    monkeypatch.setattr(search._Search, "time_pair",
                        lambda self, up, down, batch, rep_ms: speed.get(up, 50.0) + speed.get(down, 50.0))
    with fake_gpu(monkeypatch):
        # The shapes up to the rival (the sweep's order): every other candidate times 50, so more of them would only
        # run the interpreter's correctness checks again.
        result = search.run_search(problem, SM120, [1], budget_s=600, max_candidates=shapes.index(rival) + 1,
                                   progress=False)
    choice = result.choices[1]
    assert (choice.up, choice.down) == ((shipped, shipped) if shipped_kept else (rival, rival))
    confirmed = {(t.gemm, t.tile) for t in result.trials if t.round == "confirm"}
    assert {("up", shipped), ("down", shipped)} <= confirmed  # the shipped entries were re-timed with the finalists
    assert choice.pair_us == (20.0 if shipped_kept else 2 * rival_time)  # the pair's time together decided


def test_compare_times_identical_configs_once(outputs, monkeypatch, tmp_path):
    """Where the tuned folder serves the shipped entries, the kernels are the same launches: one timing, ratio 1."""
    from dsv4convert.tune import compare

    problem = MoEProblem.from_checkpoint(outputs["fp8"], 1)
    tile = Tile.from_sglang(sglang_moe.default_config(problem, 1))
    other = next(t for t in space.shape_grid(problem, SM120)[0] if t.block_m == 16 and t != tile)
    monkeypatch.setattr(sglang_moe, "lookup", lambda problem, root, down=False: {1: other.to_sglang()})
    monkeypatch.setattr(sglang_moe, "served_configs", lambda problem, root, m: (other.to_sglang(),) * 2)
    timed = []
    monkeypatch.setattr(compare, "time_us", lambda run, device, rep_ms, calls: timed.append(run) or 7.0 + len(timed))
    with fake_gpu(monkeypatch):
        weights = workload.random_weights(problem, "cpu", 0)
        batches = {1: workload.make_batch(problem, weights, 1, "cpu", 0, routings=1)}
        rows = compare.compare(problem, SM120, batches, tmp_path, rounds=2)
    row = rows[0]
    assert row["same_as"] == {"tuned": "shipped"} and len(timed) == 4  # default and shipped, two rounds each
    assert row["tuned"]["rounds_us"] == row["shipped"]["rounds_us"] and row["speedup_vs_shipped"] == 1.0
    assert row["default"]["rounds_us"] != row["shipped"]["rounds_us"]
    assert "(the shipped entries)" in compare.table(rows)[2]


def test_search_space_is_sized_by_the_gpu(outputs):
    problem = MoEProblem.from_checkpoint(outputs["fp8"], 1)
    hopper = Device("NVIDIA H200", (9, 0), 227 * 1024, "cpu")
    sm120, sm120_left_out = space.shape_grid(problem, SM120)
    sm90, _ = space.shape_grid(problem, hopper)
    assert set(sm120) < set(sm90) and sm120_left_out > 0
    assert all(space.shared_memory_floor(t, problem) <= 99 * 1024 for t in sm120)
    assert any(space.shared_memory_floor(t, problem) > 99 * 1024 for t in sm90)
    assert device_module.shared_memory_of((12, 0), None) == 99 * 1024  # by capability when the driver says nothing
    assert device_module.shared_memory_of((12, 0), 101376) == 101376
    tile = sm120[0]
    assert any(v.use_tma for v in space.refinements(tile, problem, SM120, tma=True))
    deeper = [v for v in space.refinements(tile, problem, hopper, tma=True) if v.num_stages > tile.num_stages]
    assert {v.num_stages for v in deeper} == set(range(tile.num_stages + 1, tile.num_stages + space.DEEPER_STAGES + 1))
    assert all(space.fits(v, problem, SM120) for v in space.refinements(sm120[-1], problem, SM120, tma=True))
    ampere = Device("NVIDIA A100", (8, 0), 163 * 1024, "cpu")
    assert not any(v.use_tma for v in space.refinements(tile, problem, ampere, tma=True))
    int4 = MoEProblem.from_checkpoint(outputs["w4a16"], 1)
    assert not any(v.use_tma for v in space.refinements(space.shape_grid(int4, SM120)[0][0], int4, SM120, tma=True))


# --- the output folder and serving ---------------------------------------------------------------------


def test_write_is_atomic_merges_own_folders_and_replaces_shipped(tmp_path, monkeypatch):
    shipped = tmp_path / "shipped" / "configs"
    (shipped / "triton_3_8_0").mkdir(parents=True)
    (shipped / "triton_3_8_0" / "E=1,N=2,device_name=X.json").write_text('{"1": {"BLOCK_SIZE_M": 64}}')
    (shipped / "README.md").write_text("shipped")
    name = "triton_3_8_0/E=1,N=2,device_name=X.json"
    cfg = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1}
    out = tmp_path / "out"
    kwargs = {"shipped_configs": shipped, "entries": {name: {"model": "m"}}, "sglang_version": "0.5.23",
              "triton_version": "3.8.0"}

    calls = []
    real = output.atomic_write_json

    def failing(path, obj):
        calls.append(path)
        if path.name == output.MANIFEST:
            raise OSError("disk full")
        real(path, obj)

    monkeypatch.setattr(output, "atomic_write_json", failing)
    with pytest.raises(TuneError, match="disk full"):
        output.write_tuned(out, files={name: {1: cfg}}, **kwargs)
    assert not out.exists() and list(tmp_path.iterdir()) == [tmp_path / "shipped"]  # nothing half-written left
    monkeypatch.setattr(output, "atomic_write_json", real)

    output.write_tuned(out, files={name: {1: cfg}}, **kwargs)
    assert (out / "configs" / "README.md").read_text() == "shipped"
    assert json.loads((out / "configs" / name).read_text()) == {"1": cfg}  # the shipped file of that name replaced
    output.write_tuned(out, files={name: {8: {**cfg, "BLOCK_SIZE_M": 32}}}, **kwargs)  # a later tune adds sizes
    assert sorted(json.loads((out / "configs" / name).read_text())) == ["1", "8"]
    entry = json.loads((out / output.MANIFEST).read_text())["tuned"][f"configs/{name}"]
    assert entry["replaced_shipped"] and entry["batch_sizes"] == [1, 8]
    with pytest.raises(TuneError, match="SGLang 0.5.23's shipped configs"):
        output.write_tuned(out, files={name: {1: cfg}}, **{**kwargs, "sglang_version": "0.5.24"})


def test_serve_sets_sglang_moe_config_dir_for_every_server(fp8_tune, tmp_path, real_config):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(real_config))
    base = ["serve", "--model", str(model), "--variant", "fp8", "--gpu-family", "sm120", "--dry-run"]
    code, out, _ = cli(*base, "--pd", "--prefill-gpus", "0,1,2,3", "--decode-gpus", "4,5,6,7",
                       "--tuned-configs", str(fp8_tune["out"]))
    commands = [line for line in out.splitlines() if not line.startswith("#")]
    assert code == 0 and len(commands) == 3
    assignment = f"SGLANG_MOE_CONFIG_DIR={fp8_tune['out'].resolve()}"
    assert all(assignment in line for line in commands[:2]) and assignment not in commands[2]
    code, out, err = cli(*base, "--gpus", "0,1,2,3", "--tuned-configs", str(tmp_path))
    assert code == 2 and err.strip() == (f"error: {tmp_path}: no configs/triton_*/ folder inside: SGLang's MoE config "
                                         "lookup would fail on it (make one with `dsv4convert tune --out DIR`)")


def test_block_fp8_gemm_configs_have_no_override_path(monkeypatch, tmp_path):
    """Why tune leaves SGLang's block-FP8 GEMM configs alone: 0.5.23 reads them from its own folder only."""
    from sglang.kernels.ops.gemm import fp8_kernel

    monkeypatch.setattr(fp8_kernel, "get_device_name", lambda device_id=0: "NVIDIA H200")
    name = "N=1536,K=7168,device_name=NVIDIA_H200,dtype=fp8_w8a8,block_shape=[128, 128].json"
    for folder in (tmp_path, tmp_path / "configs", tmp_path / "configs" / sglang_moe.triton_folder()):
        folder.mkdir(exist_ok=True)
        (folder / name.replace("N=1536", "N=1664")).write_text('{"1": {}}')
    monkeypatch.setenv("SGLANG_MOE_CONFIG_DIR", str(tmp_path))
    fp8_kernel.get_w8a8_block_fp8_configs.cache_clear()
    try:
        assert fp8_kernel.get_w8a8_block_fp8_configs(1536, 7168, 128, 128)  # the shipped file, from SGLang's folder
        assert fp8_kernel.get_w8a8_block_fp8_configs(1664, 7168, 128, 128) is None  # ours is never looked at
    finally:
        fp8_kernel.get_w8a8_block_fp8_configs.cache_clear()
    assert os.environ["SGLANG_MOE_CONFIG_DIR"] == str(tmp_path)


def test_model_cards_say_how_to_use_tuned_configs(outputs):
    fp8 = (outputs["fp8"] / "README.md").read_text()
    assert "## Tuned MoE kernel configs" in fp8 and "dsv4convert tune --model" in fp8
    assert "SGLANG_MOE_CONFIG_DIR=" in fp8 and "--tuned-configs" in fp8
    assert "--moe-runner-backend triton" in (outputs["w4a16"] / "README.md").read_text()
    assert "Not applicable" in (outputs["nvfp4"] / "README.md").read_text()


@functools.cache
def _bench_tune():
    """``bench/tune.py`` as a module (the bench folder is scripts, not a package), loaded once."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "bench" / "tune.py"
    spec = importlib.util.spec_from_file_location("bench_tune", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_script_runs_on_tiny_shapes_and_renders_its_json_again(monkeypatch, tmp_path):
    bench = _bench_tune()
    with fake_gpu(monkeypatch, Device("NVIDIA H200", (9, 0), 227 * 1024, "cpu")):
        assert bench.main(["--config", "tiny", "--out", str(tmp_path / "run"), "--batch-sizes", "1,4",
                           "--time-budget", "0.02", "--rounds", "1"]) == 0
    record = json.loads((tmp_path / "run.json").read_text())
    assert [row["batch_size"] for row in record["compare"]] == [1, 4]
    assert all(row["error_vs_default"] <= workload.SEQUENCE_TOLERANCE for row in record["compare"])
    assert len(list((tmp_path / "run-configs").iterdir())) == 2  # the up file and the _down file
    first = (tmp_path / "run.md").read_text()
    assert "| 1 |" in first and "| 4 |" in first and "Memory roofline: not measured (no GPU)." in first

    assert bench.main(["--render", str(tmp_path / "run.json"), "--out", str(tmp_path / "again")]) == 0
    again = (tmp_path / "again.md").read_text().splitlines()
    rendered = [line for line in again if "rendered again from the run's JSON" in line]
    assert rendered and "`bench/tune.py --render run.json`" in rendered[0]
    assert [line for line in again if line not in rendered] == first.splitlines()


def test_bench_roofline_takes_the_fastest_read_and_bounds_the_decode_mean():
    bench = _bench_tune()
    rows = [{"batch_size": m, "default": {"us": d}, "tuned": {"us": t}} for m, d, t in ((1, 30.0, 20.0),
                                                                                         (128, 500.0, 400.0))]
    moved = {1: 30e6, 128: 1500e6}
    rates = {"read_bytes_per_s": 3e12, "copy_bytes_per_s": 4e12}
    floors = {1: 15.0, 128: 300.0}             # 2 TB/s and 5 TB/s over the experts' bytes
    roof = bench.roofline(rows, moved, rates, floors)
    assert roof["expert_read_bytes_per_s"] == pytest.approx(5e12) and roof["bytes_per_s"] == pytest.approx(5e12)
    one = roof["per_batch"][1]
    assert one["least_us"] == pytest.approx(6.0) and one["tuned_of_least"] == pytest.approx(0.3)
    assert one["tuned_of_read"] == pytest.approx(0.75) and one["default_over_read"] == pytest.approx(2.0)
    # only batch size 1 is a decode batch size (1-64)
    assert roof["decode_mean_bound_vs_default"] == pytest.approx(5.0)
    assert roof["decode_mean_read_bound_vs_default"] == pytest.approx(2.0)

    without = bench.roofline(rows, moved, rates, None)   # no read floor: the faster 4 GiB rate, no floor columns
    assert without["bytes_per_s"] == pytest.approx(4e12) and without["per_batch"][128]["read_us"] is None
    assert without["decode_mean_read_bound_vs_default"] is None


def test_bench_read_floor_kernel_reads_exactly_the_listed_experts():
    import numpy as np

    bench = _bench_tune()
    kernel = bench._read_kernel()
    words = torch.randint(-2**31, 2**31 - 1, (6, 4 * bench.READ_WORDS), dtype=torch.int32,
                          generator=torch.Generator().manual_seed(0))
    ids = torch.tensor([4, 0, 3], dtype=torch.int32)
    xors = torch.empty(64, dtype=torch.int32)
    want = np.bitwise_xor.reduce(words[ids.long()].numpy(), axis=1)
    for chunk in (bench.READ_WORDS, 2 * bench.READ_WORDS):
        assert np.array_equal(bench.experts_xor(kernel, words, ids, xors, chunk), want)
    words[0, 5] ^= 1                          # one bit of a listed expert: the kernel sees it
    assert not np.array_equal(bench.experts_xor(kernel, words, ids, xors, bench.READ_WORDS), want)


def test_bench_read_floor_reads_each_routings_experts_in_two_launches(monkeypatch):
    """The GPU-only floor in the interpreter: timing stubbed to count what one timed call launches."""
    bench = _bench_tune()
    problem = MoEProblem.from_config(preset_config("tiny"), Format.FP8, 1)
    weights = workload.random_weights(problem, "cpu", 0)
    batches = {m: workload.make_batch(problem, weights, m, "cpu", 0, routings=2) for m in (1, 4)}
    monkeypatch.setattr(bench, "READ_CHUNKS", (bench.READ_WORDS * 4, bench.READ_WORDS * 8))  # the tiny experts' sizes
    launches, read = [], bench.read_experts

    def counted(kernel, tensor, ids, xors, chunk):
        launches.append(ids.numel())
        read(kernel, tensor, ids, xors, chunk)

    monkeypatch.setattr(bench, "read_experts", counted)

    def timed(run, gpu, rep_ms, calls):
        launches.clear()
        run()
        return float(sum(launches)) / calls   # experts read per routing, as the "time"

    monkeypatch.setattr(bench.workload, "time_us", timed)
    floors = bench.read_floors(batches, Device("NVIDIA H200", (9, 0), 227 * 1024, "cuda:0"))
    for m, batch in batches.items():
        distinct = [int(ids.unique().numel()) for ids, _ in batch.routings]
        assert floors[m] == 2 * sum(distinct) / len(distinct)   # both projections of each routing's experts
    assert bench.read_floors(batches, Device("interpreter", (9, 0), 227 * 1024, "cpu")) is None


def test_the_fp8_block_is_the_problems():
    """#52: the problem carries its release's FP8 block (V4's 128x128 from its config; V4.1's 32x32 given here):
    SGLang's block_shape, the BLOCK_SIZE_K values tried, the workload's scales and activation groups."""
    import dataclasses

    v4 = MoEProblem.from_config(preset_config("tiny") | _real_moe_fields(), Format.FP8, 4)
    assert v4.fp8_block == (128, 128) and v4.block_shape == [128, 128] and space._block_ks(v4) == (128, 64)
    v41 = dataclasses.replace(v4, fp8_block=(32, 32), experts=2, hidden=64, intermediate=64)
    assert v41.block_shape == [32, 32] and space._block_ks(v41) == (32,)
    assert "32x32 blocks" in v41.describe()
    weights = workload.random_weights(v41, "cpu", seed=1)
    assert tuple(weights.w13_scale.shape) == (2, 2 * 64 // 32, 64 // 32)
    assert tuple(weights.w2_scale.shape) == (2, 64 // 32, 64 // 32)
    with pytest.raises(TuneError, match=r"weight_block_size is \[32, 32\]"):
        MoEProblem.from_config(preset_config("tiny") | _real_moe_fields()
                               | {"quantization_config": {"weight_block_size": [32, 32]}}, Format.FP8, 4)
