"""Every command `serve` plans is accepted by SGLang 0.5.23's own parsers (and resolution) per variant."""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path

import pytest
import sglang_oracle as sgl

from dsv4convert.engines import EngineError
from dsv4convert.engines.sglang.rules import variant_rules
from dsv4convert.models.deepseek_v4.layout import Drafter
from dsv4convert.serve import cli as serve_cli
from dsv4convert.serve.launch import (
    MOONCAKE_TCP_COST,
    SERVED_VARIANTS,
    Command,
    LaunchError,
    LaunchOptions,
    choose_transfer_backend,
    plan_pd,
    plan_role,
    plan_single,
)

MTP_ARGS = sgl.EAGLE_ARGS
from dsv4convert.serve.topology import Gpu, Topology

FAMILIES = ("sm90", "sm100", "sm120")
EXPERT_SCHEME = {"native": "mxfp4", "fp8": "fp8", "nvfp4": "nvfp4", "nvfp4-mtp-mxfp4": "nvfp4", "nvfp4-mtp-bf16": "nvfp4",
                 "w4a16": "wna16",
                 "bf16": "unquantized"}

# The user's host: 8x RTX PRO 6000, GPUs 0-3 on NUMA node 0, 4-7 on node 1.
USER_HOST = Topology(
    gpus=tuple(Gpu(i, f"00000000:{i:02X}:00.0", "RTX PRO 6000", (12, 0), i // 4) for i in range(8)),
    node_cpus={0: "0-31", 1: "32-63"},
    numactl="/usr/bin/numactl",
)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory, real_config) -> dict[str, Path]:
    """One directory per variant holding only its config.json (what SGLang resolution reads)."""
    dirs = {}
    for variant in SERVED_VARIANTS:
        directory = tmp_path_factory.mktemp(variant)
        (directory / "config.json").write_text(json.dumps(sgl.variant_config(variant, real_config)))
        dirs[variant] = directory
    return dirs


def pd_plan(model: Path, variant: str, family: str, **overrides) -> list[Command]:
    options = LaunchOptions(model=str(model), variant=variant, gpu_family=family, **overrides)
    return plan_pd(options, USER_HOST, [0, 1, 2, 3], [4, 5, 6, 7])


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("variant", SERVED_VARIANTS)
def test_every_planned_command_parses(model_dirs, variant, family):
    model = model_dirs[variant]
    extra = ("--dist-init-addr", "10.0.0.1:5000", "--nnodes", "2", "--node-rank", "0")
    multi = LaunchOptions(model=str(model), variant=variant, gpu_family=family, host="0.0.0.0", extra_args=extra,
                          transfer_backend="mooncake", ib_devices=("mlx5_0", "mlx5_1"))
    commands = [
        *pd_plan(model, variant, family),
        *pd_plan(model, variant, family, transfer_backend="nixl", indexer_topk=True),
        # The MTP draft where its MoE method runs (elsewhere serve refuses it: test_mtp_* below).
        *pd_plan(model, variant, family, mtp=variant_rules(variant, family).serves_draft,
                 enable_metrics=True),
        *plan_single(LaunchOptions(model=str(model), variant=variant, gpu_family=family), USER_HOST, list(range(8))),
        *plan_role(multi, None, "prefill", [0, 1, 2, 3]),
        *plan_role(multi, None, "router", [], "http://10.0.0.1:30000", "http://10.0.0.2:30001"),
    ]
    for command in commands:
        if command.role == "router":
            router = sgl.parse_router_args(list(command.sglang_args))
            assert router.pd_disaggregation
            assert command.argv[-len(command.sglang_args):] == command.sglang_args
        else:
            args = sgl.parse_server_args(list(command.sglang_args))
            assert args.model_path == str(model) and args.kv_cache_dtype == "fp8_e4m3"
            assert command.argv[-len(command.sglang_args):] == command.sglang_args
            assert command.argv[-len(command.sglang_args) - 2:-len(command.sglang_args)] == ("-m", "sglang.launch_server")


@pytest.mark.parametrize("variant", SERVED_VARIANTS)
def test_pd_on_user_host_resolves_as_sglang_would(model_dirs, variant):
    prefill, decode, router = pd_plan(model_dirs[variant], variant, "sm120")
    resolved = {}
    for command in (prefill, decode):
        resolved[command.role] = sgl.resolve_server_args(list(command.sglang_args), gpu="sm120", env=command.env).resolved_dict()
        assert resolved[command.role]["disaggregation_mode"] == command.role
        assert resolved[command.role]["tp_size"] == 4
    assert resolved["prefill"]["disaggregation_bootstrap_port"] == resolved["decode"]["disaggregation_bootstrap_port"]
    assert resolved["prefill"]["nccl_port"] != resolved["decode"]["nccl_port"]
    # SGLang's automatic choice for the NVFP4 hybrid is SM100-only; the plan must override it here.
    assert resolved["decode"]["moe_runner_backend"] != "flashinfer_trtllm_routed"
    assert prefill.argv[:3] == ("/usr/bin/numactl", "--cpunodebind=0", "--membind=0")
    assert decode.argv[:3] == ("/usr/bin/numactl", "--cpunodebind=1", "--membind=1")
    assert (prefill.env["CUDA_VISIBLE_DEVICES"], decode.env["CUDA_VISIBLE_DEVICES"]) == ("0,1,2,3", "4,5,6,7")
    routed = sgl.parse_router_args(list(router.sglang_args))
    assert routed.prefill_urls == [(prefill.url, resolved["prefill"]["disaggregation_bootstrap_port"])]
    assert routed.decode_urls == [decode.url]


@pytest.mark.parametrize("variant", SERVED_VARIANTS)
def test_variant_env_makes_sglang_read_the_experts_right(real_config, variant):
    env = variant_rules(variant, "sm120").env
    qc = sgl.quant_config_from_checkpoint_config(sgl.variant_config(variant, real_config), env=env)
    assert sgl.moe_scheme_for(qc, "model.layers.10.mlp.experts") == EXPERT_SCHEME[variant]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("variant", SERVED_VARIANTS)
def test_mtp_flags_only_where_the_draft_runs(model_dirs, variant, family):
    options = LaunchOptions(model=str(model_dirs[variant]), variant=variant, gpu_family=family, mtp=True)
    defaults = variant_rules(variant, family)
    if variant == "nvfp4-mtp-mxfp4" and family != "sm100":
        assert not defaults.serves_draft and defaults.draft_moe_method == "Mxfp4FlashinferTrtllmMoEMethod"
        with pytest.raises(LaunchError, match="no MTP draft .* SM100 kernel; convert with to-nvfp4 --mtp-experts bf16"):
            plan_single(options, None, [0, 1, 2, 3])
        with pytest.raises(LaunchError, match="no MTP draft"):
            pd_plan(model_dirs[variant], variant, family, mtp=True)
        return
    for command in (*plan_single(options, None, [0, 1, 2, 3]), *pd_plan(model_dirs[variant], variant, family, mtp=True)):
        if command.role == "router":
            continue
        args = list(command.sglang_args)
        start = args.index(MTP_ARGS[0])
        assert tuple(args[start:start + len(MTP_ARGS)]) == MTP_ARGS
        resolved = sgl.resolve_server_args(list(command.sglang_args), gpu=family, env=command.env).resolved_dict()
        assert resolved["speculative_algorithm"] == "EAGLE" and resolved["speculative_num_draft_tokens"] == 2
        if variant == "nvfp4":  # FP8 draft experts: Fp8MoEMethod has no Marlin path, Triton runs everywhere
            assert resolved["speculative_moe_runner_backend"] == "triton"


def test_nvfp4_runner_per_family(model_dirs):
    for family, expected in (("sm90", "marlin"), ("sm120", "marlin"), ("sm100", "flashinfer_trtllm_routed")):
        server = plan_single(LaunchOptions(model=str(model_dirs["nvfp4"]), variant="nvfp4", gpu_family=family), None, [0, 1, 2, 3])[0]
        resolved = sgl.resolve_server_args(list(server.sglang_args), gpu=family, env=server.env).resolved_dict()
        assert resolved["moe_runner_backend"] == expected, family


def test_indexer_topk_sets_attention_dp(model_dirs):
    prefill = pd_plan(model_dirs["fp8"], "fp8", "sm120", indexer_topk=True)[0]
    resolved = sgl.resolve_server_args(list(prefill.sglang_args), gpu="sm120", env=prefill.env).resolved_dict()
    assert resolved["enable_return_indexer_topk"] and resolved["attn_dp_size"] == 4


@pytest.mark.parametrize("variant", [v for v in SERVED_VARIANTS if variant_rules(v, "sm120").serves_draft])
def test_mtp_and_metrics_resolve_as_sglang_would(model_dirs, variant):
    """--check mtp: SGLang's EAGLE over the checkpoint's own MTP layers, on both PD servers; --metrics.
    (nvfp4-mtp-mxfp4 has no draft on sm120: test_mtp_flags_only_where_the_draft_runs.)"""
    for command in pd_plan(model_dirs[variant], variant, "sm120", mtp=True, enable_metrics=True)[:2]:
        resolved = sgl.resolve_server_args(list(command.sglang_args), gpu="sm120", env=command.env).resolved_dict()
        assert resolved["speculative_algorithm"] == "EAGLE" and resolved["enable_metrics"] is True
        assert (resolved["speculative_num_steps"], resolved["speculative_eagle_topk"],
                resolved["speculative_num_draft_tokens"]) == (1, 1, 2)  # the balanced preset
        assert resolved["speculative_draft_model_path"] == str(model_dirs[variant])  # the draft is mtp.* itself
    plain = sgl.resolve_server_args(list(pd_plan(model_dirs[variant], variant, "sm120")[1].sglang_args), gpu="sm120")
    assert plain.resolved_dict()["speculative_algorithm"] is None and plain.resolved_dict()["enable_metrics"] is False


def test_check_mtp_adds_the_preset_unless_the_user_chose_one(capsys, model_dirs):
    model = str(model_dirs["fp8"])
    common = ("--model", model, "--variant", "fp8", "--gpu-family", "sm90", "--gpus", "0,1", "--check", "mtp", "--dry-run")
    assert serve_cli.run(cli_args(*common)) == 0
    server = capsys.readouterr().out.splitlines()[1]
    assert "--speculative-algorithm EAGLE --speculative-num-steps 1 --speculative-eagle-topk 1 " \
           "--speculative-num-draft-tokens 2" in server
    assert serve_cli.run(cli_args(*common, "--", "--speculative-algorithm", "EAGLE", "--speculative-num-steps", "3",
                                  "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4")) == 0
    server = capsys.readouterr().out.splitlines()[1]
    assert server.count("--speculative-algorithm") == 1 and server.endswith("--speculative-num-draft-tokens 4")
    words = shlex.split(server)
    parsed = sgl.parse_server_args(words[words.index("sglang.launch_server") + 1:])
    assert (parsed.speculative_num_steps, parsed.speculative_num_draft_tokens) == (3, 4)


def test_mooncake_tcp_fallback_and_ib():
    assert choose_transfer_backend(None, ()) == ("mooncake_tcp", MOONCAKE_TCP_COST)
    assert choose_transfer_backend("mooncake", ()) == ("mooncake_tcp", MOONCAKE_TCP_COST)
    assert choose_transfer_backend(None, ("mlx5_0",)) == ("mooncake", None)
    assert choose_transfer_backend("nixl", ()) == ("nixl", None)
    with pytest.raises(LaunchError, match="unknown transfer backend"):
        choose_transfer_backend("rdma", ())
    ib = pd_plan(Path("m"), "fp8", "sm90", transfer_backend="mooncake", ib_devices=("mlx5_0", "mlx5_1"))
    assert "--disaggregation-ib-device" in ib[0].sglang_args and "mlx5_0,mlx5_1" in ib[0].sglang_args


def test_bad_plans_are_refused():
    options = LaunchOptions(model="m", variant="fp8", gpu_family="sm120")
    with pytest.raises(LaunchError, match="overlap"):
        plan_pd(options, USER_HOST, [0, 1, 2, 3], [3, 4, 5, 6])
    with pytest.raises(LaunchError, match="both 30000"):
        plan_pd(LaunchOptions(model="m", variant="fp8", gpu_family="sm120", decode_port=30000), USER_HOST, [0], [1])
    with pytest.raises(EngineError, match="no serving rules for variant 'mixed'"):
        variant_rules("mixed", "sm120")
    with pytest.raises(EngineError, match="expected one of sm90, sm100, sm120"):
        variant_rules("fp8", "hopper")
    with pytest.raises(LaunchError, match="needs --prefill-url"):
        plan_role(options, None, "router", [])


def cli_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve_cli.add_parser(parser.add_subparsers())
    return parser.parse_args(["serve", *argv])


def test_cli_dry_run_prints_commands(capsys, model_dirs):
    args = cli_args("--model", str(model_dirs["nvfp4"]), "--variant", "nvfp4", "--gpu-family", "sm120", "--pd",
                    "--prefill-gpus", "0,1,2,3", "--decode-gpus", "4,5,6,7", "--dry-run", "--", "--log-level", "debug")
    assert serve_cli.run(args) == 0
    out = capsys.readouterr()
    lines = [line for line in out.out.splitlines() if not line.startswith("#")]
    assert len(lines) == 3 and "sglang_router.launch_router" in lines[2]
    assert all(line.endswith("--log-level debug") for line in lines[:2])
    assert "--moe-runner-backend marlin" in lines[0]
    assert "mooncake_tcp" in out.err  # no RDMA device here: the warning says what it costs


def test_cli_refuses_inconsistent_flags(model_dirs):
    model = str(model_dirs["fp8"])
    with pytest.raises(LaunchError, match="belongs to --check recall"):
        serve_cli.run(cli_args("--model", model, "--variant", "fp8", "--indexer-topk", "--dry-run"))
    with pytest.raises(LaunchError, match="--compare needs --check"):
        serve_cli.run(cli_args("--model", model, "--variant", "fp8", "--compare", "r.json", "--dry-run"))
    with pytest.raises(LaunchError, match="single-server form"):
        serve_cli.run(cli_args("--model", model, "--variant", "fp8", "--pd", "--check", "recall", "--indexer-topk", "--dry-run"))
    with pytest.raises(LaunchError, match="belong to the --pd form"):
        serve_cli.run(cli_args("--model", model, "--variant", "fp8", "--gpu-family", "sm120", "--prefill-gpus", "0", "--dry-run"))
    with pytest.raises(LaunchError, match="--gpus is for the single-server form"):
        serve_cli.run(cli_args("--model", model, "--variant", "fp8", "--gpu-family", "sm120", "--pd", "--gpus", "0,1", "--dry-run"))
    with pytest.raises(SystemExit):
        cli_args("--model", model, "--prefill-gpus", "0,0")


def test_router_role_needs_no_gpus(capsys, model_dirs):
    args = cli_args("--model", str(model_dirs["fp8"]), "--variant", "fp8", "--pd", "--role", "router", "--dry-run",
                    "--prefill-url", "http://10.0.0.1:30000", "--decode-url", "http://10.0.0.2:30001")
    assert serve_cli.run(args) == 0
    command = capsys.readouterr().out.splitlines()[1]
    assert "--prefill http://10.0.0.1:30000 8998 --decode http://10.0.0.2:30001" in command


def test_registered_in_dsv4convert_cli(capsys, model_dirs):
    from dsv4convert.cli import main

    model = str(model_dirs["w4a16"])
    assert main(["serve", "--model", model, "--variant", "w4a16", "--gpu-family", "sm90", "--gpus", "0,1", "--dry-run"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == "# server: serves http://127.0.0.1:8000"
    assert printed[1].startswith("CUDA_VISIBLE_DEVICES=0,1 SGLANG_DSV4_FP4_EXPERTS=0 ")
    assert main(["serve", "--model", model, "--variant", "w4a16", "--gpu-family", "sm90", "--dry-run",
                 "--pd", "--prefill-gpus", "0", "--decode-gpus", "0"]) == 2
    assert "overlap" in capsys.readouterr().err


DATA = Path(__file__).resolve().parents[1] / "dsv4convert" / "data"


def _config_only(directory: Path, config: str) -> Path:
    """A checkpoint directory holding only a released config.json (what serve --variant reads for the draft)."""
    directory.mkdir()
    (directory / "config.json").write_text((DATA / config).read_text())
    return directory


def _dry_run(capsys, model: str, variant: str, family: str, *argv: str) -> tuple[str, str]:
    """The server command and the plan's draft line of ``serve --dry-run``."""
    assert serve_cli.run(cli_args("--model", model, "--variant", variant, "--gpu-family", family, "--gpus", "0,1",
                                  "--dry-run", *argv)) == 0
    out = capsys.readouterr().out.splitlines()
    return next(line for line in out if "sglang.launch_server" in line), \
        next(line for line in out if line.startswith("# draft: "))


def test_the_plan_serves_the_released_drafter_by_default_and_says_so(capsys, tmp_path):
    """0731's DSpark drafter and the preview's MTP block are served without --mtp where SGLang runs them; the plan
    says so and why, and says why not under --no-mtp, where the draft cannot run, and without a drafter."""
    dspark = str(_config_only(tmp_path / "dspark", "deepseek-v4-flash-0731-config.json"))
    command, draft = _dry_run(capsys, dspark, "fp8", "sm90")
    assert "--speculative-algorithm DSPARK" in command and "served by --speculative-algorithm DSPARK" in draft
    assert "the default" in draft and "--no-mtp" in draft
    command, draft = _dry_run(capsys, dspark, "fp8", "sm90", "--no-mtp")
    assert "--speculative" not in command and "not served (--no-mtp" in draft
    assert not variant_rules("nvfp4", "sm120", Drafter.DSPARK).serves_draft
    command, draft = _dry_run(capsys, dspark, "nvfp4", "sm120")
    assert "--speculative" not in command
    assert draft.endswith(f"not served: {variant_rules('nvfp4', 'sm120', Drafter.DSPARK).mtp_note}")
    preview = str(_config_only(tmp_path / "preview", "deepseek-v4-flash-config.json"))
    assert "--speculative-algorithm EAGLE" in _dry_run(capsys, preview, "fp8", "sm90")[0]
    with pytest.raises(LaunchError, match="--no-mtp: --check mtp measures the drafter"):
        serve_cli.run(cli_args("--model", dspark, "--variant", "fp8", "--check", "mtp", "--no-mtp", "--dry-run"))


def test_the_draft_line_gives_compares_expected_acceptance(capsys, tmp_path):
    model = _config_only(tmp_path / "v", "deepseek-v4-flash-0731-config.json")
    report = tmp_path / "v-compare" / "compare.json"
    report.parent.mkdir()
    report.write_text(json.dumps({"dspark": {"expected_accept_length": {"variant": 2.375},
                                             "positions": [{"accepted": {"variant": 0.9}}]}}))
    for flag in ((), ("--no-mtp",)):
        draft = _dry_run(capsys, str(model), "fp8", "sm90", *flag)[1]
        assert draft.endswith(f"compare expects 2.38 tokens accepted per verify step ({report})")


def test_the_printed_model_path_is_absolute(capsys, tmp_path, monkeypatch):
    _config_only(tmp_path / "rel", "deepseek-v4-flash-config.json")
    monkeypatch.chdir(tmp_path)
    command = _dry_run(capsys, "rel", "fp8", "sm90")[0]
    assert f"--model-path {tmp_path / 'rel'} " in command and "--model-path rel " not in command


def test_help_is_grouped_and_under_100_lines(capsys):
    with pytest.raises(SystemExit):
        cli_args("--help")
    text = capsys.readouterr().out
    lines = text.splitlines()
    assert len(lines) <= 100, len(lines)
    headings = [line for line in lines if line and not line.startswith(" ") and line.endswith(":")]
    assert [h.split(" (")[0].rstrip(":") for h in headings][:5] == \
        ["options", "what to launch", "topology", "checks", "--check accuracy"]
    assert "engine passthrough:" in headings
    what = text.split("what to launch:")[1].split("topology")[0]
    assert "--mtp, --no-mtp" in what and "--model DIR" in what
