"""serve launches DeepSeek-V4.1 (#53): every dry-run command SGLang 0.5.23's own resolution accepts on sm_90/sm_100/
sm_120 (``model_hook.py`` runs ``validate_deepseek_v41_features``), DSPARK from the checkpoint's drafter, the Engram
placement fit chooses, and what SGLang refuses named before launch in one line (SGLang refusing it too)."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import pytest
import sglang_oracle as sgl
from conftest import V41_VARIANTS

from dsv4convert.cli import main
from dsv4convert.engines.sglang import ENGRAM_PLACEMENTS
from dsv4convert.engines.sglang.memory_v41 import attention_backend
from dsv4convert.engines.sglang.server import ENGRAM_ENV

V41_CONFIG = Path(__file__).parent / "data" / "deepseek-v4.1-flash-config.json"


def dry_run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["serve", "--dry-run", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def servers(out: str) -> list[tuple[dict[str, str], list[str]]]:
    """(environment, launch_server arguments) of each SGLang server line of a plan."""
    found = []
    for line in out.splitlines():
        if "sglang.launch_server" in line:
            words = shlex.split(line)
            start = words.index("sglang.launch_server")
            env = dict(w.split("=", 1) for w in words[:start - 2] if "=" in w)
            found.append((env, words[start + 1:]))
    return found


@pytest.mark.parametrize("family", ["sm90", "sm100", "sm120"])
def test_single_server_resolves_with_dspark_as_sglang_would(capsys, tiny_v41, family):
    code, out, _ = dry_run(capsys, "--model", str(tiny_v41), "--gpu-family", family, "--gpus", "0,1")
    assert code == 0
    ((env, argv),) = servers(out)
    resolved = sgl.resolve_server_args(argv, gpu=family, env=env).resolved_dict()
    # DSPARK verifies the block and its anchor; the FP4 experts get SGLang's own runner on every family.
    assert (resolved["speculative_algorithm"], resolved["speculative_num_draft_tokens"]) == ("DSPARK", 6)
    assert resolved["moe_runner_backend"] == "flashinfer_mxfp4"
    assert "--moe-runner-backend" not in argv and "--mem-fraction-static" not in argv   # SGLang's defaults, as fit
    assert "# engram: gpu, fit's choice" in out and env.get("SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE") is None


def test_the_attention_backend_fit_assumes_is_sglangs(capsys, tiny_v41, monkeypatch):
    """One GPU on sm_100: FlashMLA's mega kernels (V4.1's KV layout); TP > 1 without PD: flashmla. (SGLang asks
    ``utils.common.is_sm100_supported`` apart from the platform facts the oracle fakes: answered as sm_100.)"""
    import sglang.srt.utils.common as common

    from dsv4convert.engines.sglang.server import server_v41

    monkeypatch.setattr(common, "is_sm100_supported", lambda *a, **k: True)

    for gpus in ("0", "0,1"):
        _, out, _ = dry_run(capsys, "--model", str(tiny_v41), "--gpu-family", "sm100", "--gpus", gpus, "--no-mtp")
        ((env, argv),) = servers(out)
        resolved = sgl.resolve_server_args(argv, gpu="sm100", env=env).resolved_dict()
        ours = attention_backend(server_v41(str(tiny_v41), "sm100", tp=len(gpus.split(","))))
        assert resolved["dsv4_attn_backend"] == ours == ("flashmla_mega" if gpus == "0" else "flashmla")


def test_pd_with_dspark_resolves_as_sglang_would(capsys, tiny_v41):
    """SGLang wants Mooncake or NIXL for V4.1's DSpark under PD; mooncake_tcp (no RDMA here) is Mooncake to it."""
    pd = ("--model", str(tiny_v41), "--gpu-family", "sm100", "--pd", "--prefill-gpus", "0,1", "--decode-gpus", "2,3")
    for backend in ("mooncake_tcp", "nixl"):
        code, out, _ = dry_run(capsys, *pd, "--transfer-backend", backend)
        assert code == 0
        planned = servers(out)
        assert len(planned) == 2
        for (env, argv), role in zip(planned, ("prefill", "decode")):
            resolved = sgl.resolve_server_args(argv, gpu="sm100", env=env).resolved_dict()
            assert resolved["disaggregation_mode"] == role and resolved["speculative_algorithm"] == "DSPARK"


@pytest.mark.parametrize("extra,feature", [(("--pp-size", "2"), "pipeline parallelism"),
                                           (("--pipeline-parallel-size", "2"), "pipeline parallelism"),
                                           (("--enable-two-batch-overlap",), "two-batch overlap"),
                                           (("--enable-hisparse",), "HiSparse"),
                                           (("--speculative-algorithm", "EAGLE", "--speculative-eagle-topk", "1",
                                             "--speculative-num-steps", "1", "--speculative-num-draft-tokens", "2"),
                                            "speculative decoding other than")])
def test_what_sglang_refuses_is_one_error_line_before_launch(capsys, tiny_v41, extra, feature):
    code, out, err = dry_run(capsys, "--model", str(tiny_v41), "--gpu-family", "sm90", "--gpus", "0,1", "--", *extra)
    assert code == 2 and out == "" and err.startswith("error:") and err.count("\n") == 1
    assert "validate_deepseek_v41_features" in err
    # SGLang's own validation refuses the same launch.
    _, plain, _ = dry_run(capsys, "--model", str(tiny_v41), "--gpu-family", "sm90", "--gpus", "0,1", "--no-mtp")
    ((env, argv),) = servers(plain)
    with pytest.raises(ValueError, match=f"DeepSeek-V4.1 does not support {feature}"):
        sgl.resolve_server_args([*argv, *extra], gpu="sm90", env=env)


def test_engram_placements_set_sglangs_own_variables(capsys, tiny_v41):
    from sglang.srt.environ import envs

    assert tuple(ENGRAM_ENV) == ENGRAM_PLACEMENTS
    for placement in ENGRAM_PLACEMENTS:
        code, out, _ = dry_run(capsys, "--model", str(tiny_v41), "--gpu-family", "sm120", "--gpus", "0,1",
                               "--engram", placement)
        ((env, argv),) = servers(out)
        assert code == 0 and f"# engram: {placement} (--engram" in out
        for name, value in ENGRAM_ENV[placement].items():
            assert env[name] == value and hasattr(envs, name)
        with sgl._scoped_environ(env):
            host = envs.SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE.get()
            layout = envs.SGLANG_DSV41_ENGRAM_HOST_TABLE_LAYOUT.get()
        assert host == (placement != "gpu") and layout in ("shared", "per_rank")
        if host:
            assert layout == placement.removeprefix("host-").replace("-", "_")
        sgl.resolve_server_args(argv, gpu="sm120", env=env)


def test_fits_choice_for_the_release_on_rtx_pro_6000(capsys, tmp_path):
    """The real config: TP8 keeps the tables on the GPUs; PD 4+4 fits with no placement (fit's table says why)."""
    (tmp_path / "config.json").write_text(V41_CONFIG.read_text())
    code, out, _ = dry_run(capsys, "--model", str(tmp_path), "--gpu-family", "sm120", "--gpus", "0,1,2,3,4,5,6,7")
    assert code == 0 and "# engram: gpu, fit's choice on RTX PRO 6000" in out
    code, out, err = dry_run(capsys, "--model", str(tmp_path), "--gpu-family", "sm120", "--pd", "--prefill-gpus",
                             "0,1,2,3", "--decode-gpus", "4,5,6,7")
    assert code == 2 and out == "" and "no Engram placement fits every server" in err and err.count("\n") == 1


def test_vllm_equivalents(capsys, tiny_v41):
    base = ("--model", str(tiny_v41), "--gpu-family", "sm90", "--gpus", "0,1", "--engine", "vllm")
    code, out, _ = dry_run(capsys, *base)
    assert code == 0 and "--engram-config" not in out and "vLLM's default, EngramConfig.cpu_offload" in out
    assert json.loads(shlex.split(out.splitlines()[1])[-1]) == {"method": "dspark", "num_speculative_tokens": 5}
    code, out, _ = dry_run(capsys, *base, "--engram", "gpu")
    assert code == 0 and json.loads(shlex.split(out.splitlines()[0])[-1]) == {"cpu_offload": False}
    code, _, err = dry_run(capsys, *base, "--engram", "host-shared")
    assert code == 2 and "dp_shared_memory" in err


def test_recall_check_reads_the_nested_config_through_the_release(tiny_v41, tmp_path, capsys, monkeypatch):
    """``serve --check recall`` on a V4.1 checkpoint against the stand-in server: index_topk, the window and the
    candidate level's reach come from ``text_config`` (through ``models.registry``), the report records them with the
    farthest needle, which the grid puts past both; --indexer-topk is refused by name (SGLang captures ratio-4 layers
    only, and V4.1 has none)."""
    import argparse

    from test_serve_process import STANDIN_SERVER, free_port

    from dsv4convert.serve import checks
    from dsv4convert.serve import cli as serve_cli
    from dsv4convert.serve.launch import Command
    from dsv4convert.serve.process import ProcessGroup, ServeError

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    text = json.loads((tiny_v41 / "config.json").read_text())["text_config"]
    reach = text["candidate_topk_blocks"] * text["candidate_block_size"]
    parser = argparse.ArgumentParser()
    serve_cli.add_parser(parser.add_subparsers())

    def args(*extra: str) -> argparse.Namespace:
        return parser.parse_args(["serve", "--model", str(tiny_v41), "--out", str(tmp_path / "run"), "--check",
                                  "recall", "--lengths", "1024", "--depths", "0,0.5", "--trials", "1", *extra])

    with pytest.raises(ServeError, match="--indexer-topk: SGLang returns the top-k of ratio-4"):
        checks.run_recall(args("--indexer-topk"), "http://127.0.0.1:1", {"variant": "native"})
    port = free_port()
    (tmp_path / "run" / "logs").mkdir(parents=True)
    with ProcessGroup(tmp_path / "run" / "logs", stop_grace=2.0, echo=lambda line: None) as group:
        server = group.start(Command("server", (sys.executable, str(STANDIN_SERVER), "--port", str(port)), {},
                                     f"http://127.0.0.1:{port}", (port,)))
        group.wait_healthy(server, 60.0, poll=0.1)
        path = checks.run_recall(args(), server.command.url, {"model": str(tiny_v41), "variant": "native"})
    saved = json.loads(path.read_text())
    assert saved["reach"]["index_topk"] == text["index_topk"] and saved["reach"]["candidate_reach"] == reach
    assert saved["reach"]["sliding_window"] == text["sliding_window"]
    assert saved["reach"]["farthest_needle"] > max(reach, text["sliding_window"])
    assert len(saved["trials"]) == 2 and "note:" not in capsys.readouterr().err


def test_the_release_recall_grid_reaches_past_the_window_and_the_candidate_level():
    """The release's config: a 128-token window and a candidate level reaching 2,048 x 8 = 16,384 tokens; the
    default grid (1K..128K, depths 0..100%) puts needles past both, and a grid that does not is told so."""
    from dsv4convert.models.registry import attention_reach_of_config
    from dsv4convert.serve import recall
    from dsv4convert.serve.defaults import DEFAULT_DEPTHS, DEFAULT_LENGTHS

    reach = attention_reach_of_config(json.loads(V41_CONFIG.read_text()), str(V41_CONFIG))
    assert (reach.sliding_window, reach.candidate_reach, reach.index_topk) == (128, 16_384, 512)
    assert recall.indexer_layer_ids(reach.compress_ratios, len(reach.compress_ratios)) == []
    assert max(DEFAULT_LENGTHS) * (1 - min(DEFAULT_DEPTHS)) > reach.candidate_reach
    assert recall.reach_lines(reach, 20_000) == []
    (line,) = recall.reach_lines(reach, 4_096)
    assert "candidate level's reach (16,384 tokens)" in line
    assert len(recall.reach_lines(reach, 100)) == 2


def test_vllms_v41_commands_resolve_through_vllms_own_parser(capsys, tiny_v41):
    """``serve --engine vllm --dry-run`` on a V4.1 checkpoint: both commands (with and without the drafter), with
    vLLM's default Engram placement and with ``--engram gpu``, go through vLLM 0.33.0's ``vllm serve`` parser,
    ``validate_parsed_serve_args`` and ``create_engine_config`` on CPU (``vllm_oracle``, resolve only): the DSpark
    draft resolves to ``DSparkV41DraftModel`` (``config/speculative.py`` for model_type deepseek_v41) with the
    block's tokens, and ``EngramConfig.cpu_offload`` is what the placement says."""
    import vllm_oracle as vllm

    asked, expected = [], []
    for engram, offload in (("auto", True), ("gpu", False)):
        code, out, _ = dry_run(capsys, "--model", str(tiny_v41), "--gpu-family", "sm100", "--gpus", "0,1",
                               "--engine", "vllm", "--engram", engram)
        assert code == 0
        for prefix, draft in (("# server: ", False), ("# with the drafter: ", True)):
            (line,) = [line for line in out.splitlines() if line.startswith(prefix)]
            words = shlex.split(line.removeprefix(prefix))
            assert words[:3] == ["vllm", "serve", str(tiny_v41)]
            asked.append(vllm.request_v41(tiny_v41, words[3:], gpu="sm100", resolve_only=True))
            expected.append((offload, draft))
    for answer, (offload, draft) in zip(vllm.run(asked), expected):
        assert "raised" not in answer, answer.get("traceback", answer.get("raised"))
        resolved = answer["resolved"]
        assert resolved["engram_cpu_offload"] is offload
        assert (resolved["tensor_parallel_size"], resolved["enable_expert_parallel"]) == (2, True)
        if draft:
            assert (resolved["speculative_method"], resolved["num_speculative_tokens"]) == ("dspark", 5)
            assert resolved["draft_architectures"] == ["DSparkV41DraftModel"]
        else:
            assert resolved["speculative_method"] is None


# The MoE runner SGLang 0.5.23's own resolution gives each V4.1 variant's experts under serve's environment
# (arg_groups/model_overrides/deepseek_v4.py::_deepseek_v4_overrides): FP4 experts flashinfer_mxfp4, ModelOpt's hybrid
# flashinfer_trtllm_routed, the rest SGLang's per-method default ("auto").
RUNNERS = {"nvfp4": "flashinfer_trtllm_routed", "fp8": "auto", "bf16": "auto", "w4a16": "auto"}


@pytest.mark.parametrize("variant", V41_VARIANTS)
def test_every_converted_variant_launches_as_sglang_resolves_it(capsys, v41_outputs, variant):
    """``serve --dry-run`` on each V4.1 output ``convert`` writes, on each family: the variant ``fit --model`` reads,
    SGLang's own resolution of the command (DSPARK, the runner for its experts, ``is_fp4_experts`` as its loader will
    see it under the command's environment), the Engram placement sized from the output's own tensors; where SGLang
    has no kernel for it (ModelOpt's NVFP4 hybrid off sm_100) one error line, exit 2, nothing printed."""
    from dsv4convert.engines.sglang.quant_config import v41_family_problem

    model = v41_outputs[variant]
    for family in ("sm90", "sm100", "sm120"):
        code, out, err = dry_run(capsys, "--model", str(model), "--gpu-family", family, "--gpus", "0,1")
        if v41_family_problem(variant, family):
            assert code == 2 and out == "" and err.startswith("error:") and err.count("\n") == 1
            assert f"this DeepSeek-V4.1 {variant} checkpoint on {family}" in err and "flashinfer_trtllm_routed" in err
            continue
        assert code == 0 and "# engram: gpu, fit's choice" in out, err
        ((env, argv),) = servers(out)
        resolved = sgl.resolve_server_args(argv, gpu=family, env=env).resolved_dict()
        assert (resolved["speculative_algorithm"], resolved["moe_runner_backend"]) == ("DSPARK", RUNNERS[variant])
        assert sgl.is_fp4_experts(model, gpu=family, env=env) is (variant == "nvfp4")
    family = "sm100" if variant == "nvfp4" else "sm90"
    code, out, _ = dry_run(capsys, "--model", str(model), "--gpu-family", family, "--pd", "--prefill-gpus", "0",
                           "--decode-gpus", "1")
    planned = servers(out)
    assert code == 0 and len(planned) == 2
    for (env, argv), role in zip(planned, ("prefill", "decode")):
        resolved = sgl.resolve_server_args(argv, gpu=family, env=env).resolved_dict()
        assert resolved["disaggregation_mode"] == role and resolved["moe_runner_backend"] == RUNNERS[variant]


def test_the_engram_placement_is_sized_for_the_variant(capsys, tmp_path):
    """The release's config, and the same config as each conversion rewrites it (no shards: planned from config.json
    as ``fit --config`` plans that variant): on 8x RTX PRO 6000 the release keeps its tables on the GPUs at TP8, while
    BF16 (1 TB of weights) fits in no placement, named with fit's numbers; NVFP4 is sized on 8x B200."""
    from dsv4convert.engines.config import v41_config

    release = json.loads(V41_CONFIG.read_text())
    answers = {}
    for variant, family in (("bf16", "sm120"), ("nvfp4", "sm100"), ("w4a16", "sm120")):
        (tmp_path / variant).mkdir()
        (tmp_path / variant / "config.json").write_text(json.dumps(v41_config(release, variant, "sglang")[0]))
        answers[variant] = dry_run(capsys, "--model", str(tmp_path / variant), "--gpu-family", family, "--gpus",
                                   "0,1,2,3,4,5,6,7")
    code, out, err = answers["bf16"]
    assert code == 2 and out == "" and "no Engram placement fits every server" in err and err.count("\n") == 1
    assert "fit --config" in err
    for variant, card in (("nvfp4", "B200"), ("w4a16", "RTX PRO 6000")):
        code, out, err = answers[variant]
        assert code == 0 and f"fit's choice on {card}" in out, err


def test_vllm_commands_for_every_converted_variant(capsys, v41_outputs):
    """``--engine vllm --dry-run`` on each V4.1 output: NVFP4 and BF16 resolve through vLLM 0.33.0's own parser and
    engine config (the draft as ``DSparkV41DraftModel``); FP8 experts in 32x32 blocks and compressed-tensors W4A16,
    which vLLM does not load, are one error line naming why."""
    import vllm_oracle as vllm

    asked = []
    for variant in V41_VARIANTS:
        code, out, err = dry_run(capsys, "--model", str(v41_outputs[variant]), "--gpu-family", "sm100", "--gpus",
                                 "0,1", "--engine", "vllm")
        if variant in ("fp8", "w4a16"):
            assert code == 2 and out == "" and err.count("\n") == 1
            assert f"does not load this DeepSeek-V4.1 {variant} checkpoint" in err
            assert ("FP8 MoE" if variant == "fp8" else "compressed-tensors") in err
            continue
        assert code == 0
        for prefix in ("# server: ", "# with the drafter: "):
            (line,) = [line for line in out.splitlines() if line.startswith(prefix)]
            words = shlex.split(line.removeprefix(prefix))
            asked.append(vllm.request_v41(v41_outputs[variant], words[3:], gpu="sm100", resolve_only=True))
    answers = vllm.run(asked)
    assert len(answers) == 4
    for answer, draft in zip(answers, (False, True, False, True)):
        assert "raised" not in answer, answer.get("traceback", answer.get("raised"))
        assert answer["resolved"]["engram_cpu_offload"] is True
        if draft:
            assert answer["resolved"]["draft_architectures"] == ["DSparkV41DraftModel"]
        else:
            assert answer["resolved"]["speculative_method"] is None
