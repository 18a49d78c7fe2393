"""Model cards: their content, and launch commands SGLang 0.5.23's own parser and resolution accept."""

from __future__ import annotations

import shlex

import pytest
import sglang_oracle as sgl
from conftest import run

from dsv4convert.convert.model_card import (
    default_launch,
    render_model_card,
    shell_line,
    tensor_parallel_size,
    upload_command,
    vllm_default_launch,
)
from dsv4convert.convert.plan import human_bytes
from dsv4convert.convert.recipe import RECIPE_DIR
from dsv4convert.engines import GPU_FAMILIES, gpu_of_family
from dsv4convert.engines.memory import gib
from dsv4convert.fit import source, verdict
from dsv4convert.inspection import detect_variant

# The card's section title per GPU family -> the family.
CARD_FAMILIES = {gpu_of_family(family).label: family for family in GPU_FAMILIES}

MIXED_RECIPE = RECIPE_DIR / "nvfp4-bf16-indexer.yaml"
# The quant config class SGLang's loader builds, and whether the FP4-expert switch is on.
# Keys: conftest's outputs (for both engines, or "<recipe>@<engine>") and the mixed example.
EXPECTED_CONFIG = {"fp8": ("Fp8Config", "0"), "nvfp4": ("HybridFp8NvFp4Config", "0"),
                   "nvfp4-mtp-mxfp4": ("HybridFp8NvFp4Config", "1"),
                   "w4a16": ("CompressedTensorsConfig", "0"), "bf16": ("NoneType", "0"),
                   "fp8@sglang": ("Fp8Config", "0"), "nvfp4@sglang": ("HybridFp8NvFp4Config", "0"),
                   "w4a16@sglang": ("CompressedTensorsConfig", "0"),
                   "mixed": ("HybridFp8NvFp4Config", "0")}


def card(**overrides) -> str:
    kwargs = {
        "variant": "nvfp4",
        "base_model": "deepseek-ai/DeepSeek-V4-Flash",
        "recipe_name": "nvfp4",
        "recipe_text": "name: nvfp4\nrules: []\n",
        "formats_by_role": {"routed_expert": {"nvfp4": 10}, "routed_expert (mtp)": {"mxfp4": 2},
                            "attention": {"fp8": 5, "bf16": 1}},
        "stats": {"lossless_blocks": 3, "total_blocks": 4, "input_scale_source": {"data-free bound": 6},
                  "tensors_quantized": 30, "tensors_kept": 1234, "bytes_in": 5 * 10**9, "bytes_out": 6 * 10**9,
                  "seconds": 12.5, "roles": {"routed_expert": {"converted": 10, "max_abs_error": 0.0}}},
        "launch": {"H200 (sm_90)": {"argv": ["python", "-m", "sglang.launch_server", "--model-path", "/m dir"],
                                    "env": {"SGLANG_DSV4_FP4_EXPERTS": "1"}},
                   "Tiny GPU": {"argv": [], "env": {}, "note": "does not fit on 8 GPUs"}},
    }
    kwargs.update(overrides)
    return render_model_card(**kwargs)


def test_card_names_base_model_recipe_and_formats():
    text = card()
    assert text.startswith('---\nbase_model: "deepseek-ai/DeepSeek-V4-Flash"\n')
    assert "# DeepSeek-V4-Flash, nvfp4 variant" in text
    assert "recipe `nvfp4`" in text
    assert "```yaml\nname: nvfp4\nrules: []\n```" in text
    assert "| routed_expert | nvfp4 x10 |" in text
    assert "| routed_expert (mtp) | mxfp4 x2 |" in text
    assert "| attention | bf16 x1, fp8 x5 |" in text


def test_card_stats():
    text = card()
    assert "3 of 4 (75.00 %)" in text
    assert "Tensors quantized: 30; kept byte for byte: 1,234." in text
    assert f"{human_bytes(5 * 10**9)} in, {human_bytes(6 * 10**9)} out" in text
    assert "6 expert projections: a data-free bound" in text
    assert "- Seconds: 12.5" in text
    assert "| routed_expert | 10 | 0.0 |" in text
    no_blocks = card(stats={"lossless_blocks": 0, "total_blocks": 0})
    assert "0 of 0 (n/a)" in no_blocks and "input_scale" not in no_blocks


def test_card_launch_lines_are_shell_exact():
    text = card()
    line = "SGLANG_DSV4_FP4_EXPERTS=1 python -m sglang.launch_server --model-path '/m dir'"
    assert f"### H200 (sm_90)\n\n```bash\n{line}\n```" in text
    assert shlex.split(line)[1:] == ["python", "-m", "sglang.launch_server", "--model-path", "/m dir"]
    assert "### Tiny GPU\n\ndoes not fit on 8 GPUs" in text


@pytest.mark.parametrize(("weight_bytes", "gpu_memory", "tp"), [
    (10**9, 96 * 10**9, 1),
    (160 * 10**9, 96 * 10**9, 4),     # the SM120 cookbook cell: native Flash at TP 4
    (160 * 10**9, 141 * 10**9, 2),
    (292 * 10**9, 141 * 10**9, 4),
    (560 * 10**9, 96 * 10**9, None),  # BF16 Flash does not fit on 8 RTX PRO 6000
])
def test_tensor_parallel_size(weight_bytes, gpu_memory, tp):
    assert tensor_parallel_size(weight_bytes, gpu_memory) == tp


@pytest.fixture(scope="module")
def served(outputs, tiny_ckpt, tmp_path_factory) -> dict:
    """Every shipped variant of the tiny model plus the mixed example recipe."""
    mixed = tmp_path_factory.mktemp("mixed") / "out"
    run(tiny_ckpt, mixed, str(MIXED_RECIPE))
    return {**outputs, "mixed": mixed}


@pytest.mark.parametrize("output", list(EXPECTED_CONFIG))
def test_default_launch_is_what_sglang_resolves_as_intended(served, output):
    model_dir = served[output]
    variant = detect_variant(model_dir)
    launch = default_launch(model_dir, variant)
    assert list(launch) == list(CARD_FAMILIES)
    config_class, fp4_experts = EXPECTED_CONFIG[output]
    for family, spec in launch.items():
        gpu = CARD_FAMILIES[family]
        argv = spec["argv"]
        assert argv[:3] == ["python", "-m", "sglang.launch_server"]
        assert spec["env"]["SGLANG_DSV4_FP4_EXPERTS"] == fp4_experts
        parsed = sgl.parse_server_args(argv[3:])
        assert parsed.model_path == str(model_dir) and parsed.kv_cache_dtype == "fp8_e4m3"
        resolved = sgl.resolve_server_args(argv[3:], gpu=gpu, env=spec["env"]).resolved_dict()
        runner = resolved["moe_runner_backend"]
        if config_class == "HybridFp8NvFp4Config":
            # SGLang's automatic NVFP4-hybrid runner is SM100-only; elsewhere the card must say marlin.
            assert runner == ("flashinfer_trtllm_routed" if gpu == "sm100" else "marlin"), family
        else:
            assert runner not in ("flashinfer_mxfp4", "flashinfer_trtllm_routed"), (family, runner)
        quant = sgl.quant_config_for_checkpoint(model_dir, gpu=gpu, env=spec["env"])
        assert type(quant).__name__ == config_class
        if quant is not None and config_class != "CompressedTensorsConfig":
            assert quant.is_fp4_experts == (fp4_experts == "1")
        # The MTP draft is offered exactly where its MoE method runs: everywhere but MXFP4 draft
        # experts off sm_100 (tests/test_sglang_loading.py builds the draft itself).
        assert ("mtp" in spec) != ("mtp_note" in spec)
        assert ("mtp" in spec) == (variant != "nvfp4-mtp-mxfp4" or gpu == "sm100"), family
        if "mtp" in spec:
            draft = sgl.resolve_server_args(spec["mtp"]["argv"][3:], gpu=gpu, env=spec["mtp"]["env"]).resolved_dict()
            assert draft["speculative_algorithm"] == "EAGLE" and draft["speculative_eagle_topk"] == 1
            assert spec["mtp"]["argv"][:len(argv)] == argv and spec["mtp"]["env"] == spec["env"]


@pytest.mark.parametrize("output", ["nvfp4", "nvfp4-mtp-mxfp4", "nvfp4@sglang", "mixed"])
def test_written_readme_carries_the_launch_commands(served, output):
    readme = (served[output] / "README.md").read_text()
    variant = detect_variant(served[output])
    for family, spec in default_launch(served[output], variant).items():
        assert f"### {family}\n\n```bash\n{shell_line(spec)}\n```" in readme
        if "mtp" in spec:
            assert (f"With {spec['mtp']['what']}; its routed experts run through `{spec['draft_moe_method']}`:\n\n"
                        f"```bash\n{shell_line(spec['mtp'])}\n```") in readme
        else:
            assert f"No draft on this GPU: {spec['mtp_note']}." in readme
    assert f"SGLANG_DSV4_FP4_EXPERTS={EXPECTED_CONFIG[output][1]}" in readme
    assert "--moe-runner-backend marlin" in readme
    _assert_fit_figures(readme.split("## Serving with SGLang 0.5.23")[1], served[output], "sglang")


def _assert_fit_figures(section: str, model_dir, engine: str) -> None:
    """Each family's weights per GPU and KV tokens are what `dsv4convert fit` computes for its command."""
    src = source.from_checkpoint(model_dir)
    for block in section.split("\n## ")[0].split("### ")[1:]:
        family = block.splitlines()[0]
        argv = shlex.split(block.split("```bash\n")[1].split("\n```")[0])
        tp = int(argv[argv.index("--tp-size" if engine == "sglang" else "--tensor-parallel-size") + 1])
        gpu = gpu_of_family(CARD_FAMILIES[family])
        fit = (verdict.sglang_server(src, gpu, "server", tp, mtp=False) if engine == "sglang"
               else verdict.vllm_server(src, gpu, tp, mtp=False))
        assert (f"on {gpu.name}: {gib(fit.weights_bytes_per_rank)} of weights per GPU, "
                f"{fit.kv_tokens:,} KV tokens.") in block, (family, engine)


@pytest.mark.parametrize("output", ["fp8", "nvfp4", "w4a16", "nvfp4@vllm", "fp8@sglang", "w4a16@sglang"])
def test_written_readme_serves_each_engine_it_is_made_for(served, output):
    """vLLM commands (from vllm_launch, resolved by vLLM itself in test_vllm_loading.py) where the output is
    for vLLM; otherwise one line saying why not. SGLang likewise."""
    readme = (served[output] / "README.md").read_text()
    variant = detect_variant(served[output])
    engines = output.split("@")[1] if "@" in output else "both"
    if engines in ("both", "vllm"):
        for family, spec in vllm_default_launch(served[output], variant).items():
            assert f"### {family}\n\n```bash\n{shell_line(spec)}\n```" in readme
            if "mtp" in spec:
                assert (f"With {spec['mtp']['what']}; its routed experts run through `{spec['draft_moe_method']}`:\n\n"
                        f"```bash\n{shell_line(spec['mtp'])}\n```") in readme
            else:
                assert f"No draft on this GPU: {spec['mtp_note']}." in readme
        assert "## Serving with vLLM 0.33.0" in readme and "Known limits:" in readme
        _assert_fit_figures(readme.split("## Serving with vLLM")[1], served[output], "vllm")
    else:
        assert "vllm serve" not in readme
        line = next(x for x in readme.splitlines() if x.startswith("Not for vLLM 0.33.0: "))
        assert "vLLM 0.33.0" in line.removeprefix("Not for vLLM 0.33.0: ") and ": " in line
    assert ("## Serving with SGLang 0.5.23" in readme) == (engines in ("both", "sglang"))
    assert f"(`--engine {engines}`)" in readme


def test_front_matter_is_what_the_hub_reads_for_a_quantized_derivative(served):
    import yaml

    readme = (served["nvfp4"] / "README.md").read_text()
    meta = yaml.safe_load(readme.split("---\n")[1])
    assert meta["base_model"] == "deepseek-ai/DeepSeek-V4-Flash" and meta["base_model_relation"] == "quantized"
    assert meta["library_name"] == "transformers" and meta["pipeline_tag"] == "text-generation"
    assert {"deepseek_v4", "nvfp4", "sglang", "vllm"} <= set(meta["tags"])
    # The synthetic source has no card: the license is left to the base model's, and the card says so.
    assert meta["license"] == "other" and meta["license_link"] == "https://huggingface.co/deepseek-ai/DeepSeek-V4-Flash"
    assert "the source had no model card to read it from" in readme


def test_license_is_taken_from_the_source_card(tiny_ckpt, tmp_path):
    import shutil

    import yaml

    src = tmp_path / "src"
    shutil.copytree(tiny_ckpt, src)
    (src / "README.md").write_text("---\nlicense: mit\nlibrary_name: transformers\n---\n# DeepSeek-V4-Flash\n")
    run(src, tmp_path / "out", "bf16")
    readme = (tmp_path / "out" / "README.md").read_text()
    assert yaml.safe_load(readme.split("---\n")[1])["license"] == "mit"
    assert "no model card" not in readme


def test_upload_command_is_one_huggingface_hubs_cli_accepts(served):
    """Parsed by the installed huggingface_hub's own `hf` CLI (its command table, then the command's options)."""
    from huggingface_hub.cli.hf import app

    readme = (served["fp8"] / "README.md").read_text()
    argv = upload_command(served["fp8"])
    assert shlex.join(argv) in readme and argv[:2] == ["hf", "upload"]
    context = app.make_context("hf", argv[1:])
    command = app.get_command(context, "upload").materialize()
    parsed = command.make_context("upload", argv[2:], parent=context).params
    assert parsed["repo_id"] == "<your-namespace>/<repo-name>" and parsed["local_path"] == str(served["fp8"])
    assert parsed["repo_type"].value == "model" if hasattr(parsed["repo_type"], "value") else parsed["repo_type"] == "model"
    # This huggingface_hub folded upload-large-folder into upload; the card names it for older releases.
    assert app.get_command(context, "upload-large-folder") is None
    assert "hf upload-large-folder" in readme


def test_default_launch_of_a_missing_checkpoint_is_an_error(tmp_path):
    with pytest.raises(Exception, match="not a safetensors checkpoint"):
        default_launch(tmp_path, "fp8")
