"""``compare`` on DeepSeek-V4.1 under SGLang's served numerics: the activation quantization
(``compare/emulate_v41.py``, rules in ``engines/sglang/numerics.py::V41Serving``) on tiny-v41.

Each hook's output is the :mod:`dsv4convert.formats.activations` function of the module's real input, captured on a
forward; the scale rule for V4.1's 32-wide groups is SGLang's own Triton kernel's (run under the interpreter); the
release against itself reads KLD 0, the NVFP4 hybrid on sm100 and BF16 read KLD > 0 served where weights read 0,
and the report no longer lists what is emulated.
"""

from __future__ import annotations

import importlib
import json
import sys
import types
from pathlib import Path

import pytest
import torch

from dsv4convert.checkpoint import Checkpoint
from dsv4convert.cli import main
from dsv4convert.compare import emulate_v41
from dsv4convert.compare.run import CompareOptions
from dsv4convert.compare.v41 import NOT_EMULATED, build_plan, serving_of
from dsv4convert.engines.sglang.numerics import V41_UNQUANTIZED
from dsv4convert.formats.activations import fp8_token_groups, mxfp8_activations, nvfp4_activations, round_e4m3
from dsv4convert.model.v41.weights import WeightSource

from test_compare_v41 import TOKENS

LAYER = 2            # a KV and index source with an Engram layer: compressor, indexer and Engram all present
WATCHED = ("attn.wq_a", "attn.wo_b", "attn.indexer.wq_b", "ffn.shared_experts.w2", "engram.wkv",
           "attn.indexer.weights_proj", "attn.wkv")


def _inputs(path: Path, family: str) -> tuple[dict, dict, dict]:
    """Layer :data:`LAYER`'s linears' inputs on a served forward of 2 x 48 random tokens: as computed (before the
    hook), as the GEMM takes them (after it), and each routed expert's (``w1``/``w2``) both ways."""
    plan = build_plan(CompareOptions(base=str(path), variant=str(path), random_tokens=True, tokens=96, seq_len=48,
                                     device="cpu", progress=False, gpu_family=family, mtp=False))
    side = plan.base
    run = side.runner.begin(plan.ids)
    raw: dict[str, torch.Tensor] = {}
    taken: dict[str, torch.Tensor] = {}
    for i in range(plan.cfg.num_hidden_layers):
        block = side.runner.load_block(i)
        watched = {}
        if i == LAYER:
            watched = {p: m for p, m in block.named_modules() if p in WATCHED or p.endswith((".w1", ".w2"))
                       and p.startswith("ffn.experts.")}
            for p, m in watched.items():
                m.register_forward_pre_hook(lambda mod, args, p=p: raw.setdefault(p, args[0].detach().clone()))
        emulate_v41.install(block, f"layers.{i}", side.serving, side.runner.source)
        for p, m in watched.items():
            m.register_forward_pre_hook(lambda mod, args, p=p: taken.setdefault(p, args[0].detach().clone()))
        run.layer(block)
    return raw, taken, {"serving": side.serving, "source": side.runner.source}


def test_the_release_on_sm100_quantizes_dense_linears_mxfp8_and_experts_mxfp8(tiny_v41):
    """sm100: ``_deepseek_v4_overrides`` picks ``flashinfer_cutedsl`` for V4.1's 32x32 UE8M0 linears, served as
    MXFP8 (``fp8_utils.py::can_serve_block_fp8_as_mxfp8``, ``flashinfer_mxfp8_blockscaled_linear``:
    ``flashinfer_mxfp8_quantize(.., alignment=32)``); the MXFP4 experts run ``flashinfer_mxfp4``'s TRT-LLM MoE with
    MXFP8 activations (``mxfp4_flashinfer_trtllm_moe.py::Mxfp4FlashinferTrtllmMoEMethod``). ``wo_a``, the compressor
    and the indexer's ``weights_proj`` are BF16 GEMMs (``deepseek_v4.py::wo_a_fp8_gemm_enabled``: 128x128 only;
    ``dsv41_sparse.py``: ``quant_config=None``; the ratio-2 compressor projects in float32 through ``F.linear``,
    which no hook sees: ``Compressor.project``)."""
    raw, taken, _ = _inputs(tiny_v41, "sm100")
    for path in ("attn.wq_a", "attn.wo_b", "attn.indexer.wq_b", "ffn.shared_experts.w2", "engram.wkv", "attn.wkv"):
        assert torch.equal(taken[path], mxfp8_activations(raw[path], name=path)), path
    assert torch.equal(taken["attn.indexer.weights_proj"], raw["attn.indexer.weights_proj"])
    experts = [p for p in raw if p.startswith("ffn.experts.")]
    assert experts and {p.rsplit(".", 1)[1] for p in experts} == {"w1", "w2"}
    for path in experts:
        assert torch.equal(taken[path], mxfp8_activations(raw[path])), path
    assert any(not torch.equal(taken[p], raw[p]) for p in experts)


def test_the_release_on_sm90_quantizes_ue8m0_token_groups_and_leaves_experts_w4a16(tiny_v41):
    """sm90: native block-32 DeepGEMM with ``act_scale_ue8m0`` (``fp8_utils.py::dispatch_w8a8_block_fp8_linear``,
    ``deepgemm_w8a8_block_fp8_linear_with_fallback``: ``sglang_per_token_group_quant_fp8(x, 32, scale_ue8m0=True)``);
    ``flashinfer_mxfp4`` on sm90 is W4A16 (``Mxfp4FlashinferCutlassMoEMethod``: "SM90 uses W4A16")."""
    raw, taken, _ = _inputs(tiny_v41, "sm90")
    for path in ("attn.wq_a", "attn.wo_b", "ffn.shared_experts.w2"):
        assert torch.equal(taken[path], fp8_token_groups(raw[path], 32, scale_format="ue8m0", name=path)), path
        assert not torch.equal(taken[path], raw[path])
    assert all(torch.equal(taken[p], raw[p]) for p in raw if p.startswith("ffn.experts."))


def test_w4a16_quantizes_float32_token_groups(v41_outputs):
    """W4A16's FP8 linears come through ``CompressedTensorsConfig``'s ``linear_fp8_config``, which
    ``compressed_tensors.py::CompressedTensorsConfig.from_config`` builds without ``scale_fmt``: no
    ``act_scale_ue8m0``, so float32 scales (sm100: ``triton_w8a8_block_fp8_linear``'s ``per_token_group_quant_fp8``);
    its INT4 experts are weight-only (Marlin / WNA16 Triton)."""
    raw, taken, _ = _inputs(v41_outputs["w4a16"], "sm100")
    for path in ("attn.wq_a", "ffn.shared_experts.w2"):
        assert torch.equal(taken[path], fp8_token_groups(raw[path], 32, scale_format="float32", name=path)), path
    assert all(torch.equal(taken[p], raw[p]) for p in raw if p.startswith("ffn.experts."))


def test_fp8_experts_take_float32_token_groups_of_32(v41_outputs):
    """FP8 experts in 32x32 blocks: ``Fp8MoEMethod``'s Triton runner (auto without all-to-all:
    ``Fp8MoEMethod.is_deepgemm_moe_runner_backend_enabled`` false), whose ``invoke_fused_moe_kernel`` quantizes both
    GEMMs' inputs with ``sglang_per_token_group_quant_fp8(A, block_k)``: float32 scales, ``block_k`` 32."""
    raw, taken, _ = _inputs(v41_outputs["fp8"], "sm100")
    experts = [p for p in raw if p.startswith("ffn.experts.")]
    assert experts
    for path in experts:
        assert torch.equal(taken[path], fp8_token_groups(raw[path], 32, scale_format="float32")), path


@pytest.mark.parametrize("variant, family, dense, experts, stages", [
    ("native", "sm90", "ue8m0", None, None), ("native", "sm100", "mxfp8", "mxfp8", "mxfp8"),
    ("native", "sm120", "ue8m0", "mxfp8", "mxfp8"), ("fp8", "sm120", "ue8m0", "fp8", "fp8"),
    ("nvfp4", "sm100", "mxfp8", "nvfp4", "mxfp8"), ("w4a16", "sm90", "float32", None, None),
    ("bf16", "sm100", None, None, None)])
def test_the_v41_rules_per_variant_and_family(variant, family, dense, experts, stages, tiny_v41, v41_outputs):
    """``V41Serving`` per variant and family (docs/served-numerics.md, "DeepSeek-V4.1"): the dense FP8 linears'
    scheme, the backbone's experts' and the DSpark stages' (the NVFP4 hybrid keeps its stages MXFP4:
    ``HybridFp8NvFp4Config.get_quant_method``, ``Mxfp4FlashinferTrtllmMoEMethod``); ``wo_a`` never FP8."""
    ckpt = Checkpoint.open(tiny_v41 if variant == "native" else v41_outputs[variant])
    serving = serving_of("served", family, variant, ckpt)
    source = WeightSource(ckpt, "cpu", torch.float32)
    shape = tuple(ckpt.entry("layers.0.attn.wq_a.weight").shape)
    fmt, _ = source.stored_format("layers.0.attn.wq_a", shape)
    assert serving.dense_scheme("attn.wq_a", fmt) == dense
    assert all(serving.dense_scheme(s, fmt) is None for s in V41_UNQUANTIZED) and serving.wo_a() is None
    expert = {}
    for block in ("layers.0", "mtp.0"):
        module = f"{block}.ffn.experts.0.w2"
        fmt, _ = source.stored_format(module, (source.cfg.hidden_size, source.cfg.moe_intermediate_size))
        expert[block] = serving.expert_scheme(fmt, is_mtp=block == "mtp.0")
    assert (expert["layers.0"], expert["mtp.0"]) == (experts, stages)


def test_nvfp4_experts_take_w4a4_with_the_layers_largest_input_scale(v41_outputs):
    """The NVFP4 hybrid on sm100 (``flashinfer_trtllm_routed``): ``nvfp4_activations`` with
    ``max_e w13_input_scale`` on the expert input and ``max_e w2_input_scale`` on the down projection's
    (``modelopt_quant.py::ModelOptNvFp4FusedMoEMethod.process_weights_after_loading``)."""
    raw, taken, ctx = _inputs(v41_outputs["nvfp4"], "sm100")
    ckpt = ctx["source"].ckpt
    n = ctx["source"].cfg.n_routed_experts
    scale = {proj: max(float(ckpt.read(f"layers.{LAYER}.ffn.experts.{e}.{w}.input_scale"))
                       for e in range(n) for w in proj) for proj in (("w1", "w3"), ("w2",))}
    experts = [p for p in raw if p.startswith("ffn.experts.")]
    assert experts
    for path in experts:
        proj = ("w2",) if path.endswith("w2") else ("w1", "w3")
        assert torch.equal(taken[path], nvfp4_activations(raw[path], scale[proj])), path
    assert torch.equal(taken["attn.wq_a"], mxfp8_activations(raw["attn.wq_a"]))   # dense: the release's rule


def test_the_ue8m0_rule_is_sglangs_own_kernels(monkeypatch):
    """SGLang's Triton per-token-group kernel (``kernels/ops/quantization/fp8_kernel.py::
    _per_token_group_quant_8bit_raw``, column-major with ``scale_ue8m0``: ``exp2(ceil(log2(amax / 448)))``), run on
    the CPU by Triton's interpreter, picks the scale :func:`fp8_token_groups` uses for groups of 32: our values are
    E4M3(x / s) * s with SGLang's ``s``. (The interpreter's own FP8 cast loses a mantissa carry, so the codes are
    re-rounded by torch's cast.) ``deep_gemm`` only re-lays the scales out; a stand-in keeps them as computed."""
    monkeypatch.setitem(sys.modules, "deep_gemm",
                        types.SimpleNamespace(transform_sf_into_required_layout=lambda x_s, **kw: x_s))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    fp8_kernel = importlib.import_module("sglang.kernels.ops.quantization.fp8_kernel")
    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 2, 256)
    _, s = fp8_kernel._per_token_group_quant_8bit_raw(x, 32, column_major_scales=True, scale_ue8m0=True)
    s = s.reshape(8, 8, 1)
    expected = (round_e4m3(x.view(8, 8, 32) / s) * s).reshape(8, 256)
    assert torch.equal(fp8_token_groups(x, 32, scale_format="ue8m0", out_dtype=torch.float32), expected)


def _compare(base: Path, variant: Path, report: Path, *extra: str) -> dict:
    assert main(["compare", "--base", str(base), "--variant", str(variant), "--report", str(report), *TOKENS,
                 "--no-mtp", *extra]) == 0
    return json.loads((report / "compare.json").read_text())


@pytest.mark.threads(1, 2)    # exactly 0 at any thread count: both sides quantize the same inputs in lockstep
def test_the_release_against_itself_reads_kld_zero_served(tiny_v41, tmp_path):
    result = _compare(tiny_v41, tiny_v41, tmp_path / "report")
    assert result["output"]["kld"]["mean"] == 0.0 and result["v41"]["culprit"]["kind"] == "none"
    numerics = result["variant"]["numerics"]
    assert numerics["activations"] is True and numerics["not_emulated"] == list(NOT_EMULATED)
    assert not any("activation" in line for line in numerics["not_emulated"])
    assert numerics["serving"]["dense_fp8_activation_scales"].endswith("per 1x32 token group")
    markdown = (tmp_path / "report" / "compare.md").read_text()
    assert "sliding window's FP8 KV cache" in markdown and "per-token-group" not in markdown


def test_nvfp4_on_sm100_reads_kld_served_and_none_weights_only(tiny_v41, v41_outputs, tmp_path):
    """The NVFP4 conversion keeps the release's MXFP4 codes: weights only it reads KLD 0; served on sm100 its
    experts' W4A4 activations (against the release's MXFP8) cost KLD, charged to an MoE."""
    variant = v41_outputs["nvfp4"]
    weights = _compare(tiny_v41, variant, tmp_path / "weights", "--gpu-family", "sm100", "--numerics", "weights")
    assert weights["output"]["kld"]["mean"] == 0.0
    served = _compare(tiny_v41, variant, tmp_path / "served", "--gpu-family", "sm100")
    assert served["output"]["kld"]["mean"] > 0 and served["v41"]["culprit"]["kind"] == "moe"


def test_bf16_served_differs_from_the_release(tiny_v41, v41_outputs, tmp_path):
    """BF16 carries no quantization config: none of its activations are quantized, the release's are."""
    result = _compare(tiny_v41, v41_outputs["bf16"], tmp_path / "report")
    assert result["output"]["kld"]["mean"] > 0
    assert result["variant"]["numerics"]["activations"] is True    # served, though nothing of it quantizes
    moved = {c["component"] for c in result["v41"]["components"] if c["relative_error"] > 0}
    assert {f"layers.{i}.ffn" for i in range(6)} <= moved and {f"layers.{i}.attn" for i in range(6)} <= moved
