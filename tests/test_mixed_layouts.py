"""Every mixed layout automix's menu admits converts, and loads in SGLang 0.5.23 and vLLM 0.33.0 as intended.

For each family ``dsv4convert.automix.menu.menu`` admits for some ``--engine`` and GPU family, a recipe
mixes it per layer on the tiny synthetic model (``module`` rules: layers.0 the family's last choice, so
SGLang's probe of the first routed expert would be misled; layers.1 its second; the rest its main
format; layers.4's attention, indexer and shared experts BF16 where linears are per layer, ``wo_a``
kept where it is one format for the model), and the converter writes it. Layouts that store the
same bytes for several engine choices are converted once, for the widest.

Then, with the engines' own code (``sglang_oracle``, ``vllm_oracle``, as in test_sglang_loading.py and
test_vllm_loading.py):

* SGLang, per GPU family the menu admits the layout on: the model card's command resolves to the MoE
  runner the menu assumes, SGLang's ``ModelConfig`` and quant config give every layer and the draft the
  intended expert format and every config linear its format, and ``is_fp4_experts`` is right with
  ``SGLANG_DSV4_FP4_EXPERTS`` unset (``routed_experts_quant_method``) with ``topk_group == n_group``;
* SGLang's real model and loader (target and MTP draft), once per distinct loading behaviour (the
  MoE methods and runner the card gives, and sm_100's FP8 ``wo_a`` GEMM): every tensor lands
  (``test_sglang_loading.check``), every layer gets the intended MoE method;
* vLLM's real model and loader on sm_90 for the layouts made for vLLM (one vLLM process): every
  tensor lands, every layer and linear gets the intended method; the card's commands resolve on
  sm_100 and sm_120;
* ``validate``'s integrity check passes every layout;
* the facts in SGLang's code the menu's exclusions rest on (the MoE runners each method builds).

SGLang loads on sm_90 under a MXFP4 family build ``Mxfp4FlashinferCutlassMoEMethod``, which asks
``is_flashinfer_available()``: answered True, as on a GPU host with the wheel's ``flashinfer_python``.
"""

from __future__ import annotations

import contextlib
import inspect
import re
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import pytest
import sglang_oracle as sgl
import vllm_oracle as vllm
from conftest import run
from test_sglang_loading import FAMILIES, _never_loaded, check, tamper
from test_vllm_loading import LINEAR_METHOD, _vllm_module

from dsv4convert.automix.menu import Family, menu
from dsv4convert.checkpoint import Checkpoint
from dsv4convert.convert.model_card import default_launch, vllm_default_launch
from dsv4convert.engines import GPU_FAMILIES, SGLANG, VLLM, engines_for
from dsv4convert.engines.mixes import CANDIDATES
from dsv4convert.engines.sglang.rules import variant_rules
from dsv4convert.formats import Format
from dsv4convert.inspection import inspect_checkpoint
from dsv4convert.models.deepseek_v4.layout import Role, classify
from dsv4convert.variants import served_like

LAYERS = 5  # the tiny preset's backbone
CARD = FAMILIES  # GPU family -> the model card's name for it


# ---------------------------------------------------------------------------------------------
# The layouts: every family the menu admits, converted once per distinct stored layout.

@dataclass
class Layout:
    name: str
    family: Family
    engine: str                      # the --engine it is converted for
    sglang: list[str]                # GPU families SGLang serves it on, per the menu
    vllm: bool

    @property
    def experts(self) -> dict[int, Format]:
        """Backbone layer -> its routed experts' format."""
        e = self.family.experts
        return {0: e[-1], 1: e[1] if len(e) > 1 else e[0], **{layer: e[0] for layer in range(2, LAYERS)}}

    @property
    def mtp(self) -> Format:
        return self.family.mtp_experts or Format.MXFP4


def _layouts() -> list[Layout]:
    found: dict[tuple, Layout] = {}
    for choice in ("both", SGLANG, VLLM):  # the widest first: it is the one converted
        for gpu in GPU_FAMILIES:
            for family in menu(choice, gpu)[0]:
                fp8 = Format.FP8 in family.experts or family.mtp_experts is Format.FP8
                engines = engines_for(choice)
                # FP8 expert scales are F32 wherever vLLM reads the output: otherwise the bytes are the same.
                key = (family.config, family.experts, family.mtp_experts, family.linears,
                       (VLLM in engines) if fp8 else None)
                if key not in found:
                    found[key] = Layout(f"{family.name}@{choice}", family, choice, [], False)
                layout = found[key]
                if SGLANG in engines and gpu not in layout.sglang:
                    layout.sglang.append(gpu)
                layout.vllm |= VLLM in engines
    return list(found.values())


LAYOUTS = {layout.name: layout for layout in _layouts()}


def _rule(fmt: Format | None, what: str) -> str:
    if fmt is Format.MXFP4:
        return f"    format: keep\n    reason: {what} as released (MXFP4)"
    if fmt is Format.BF16:
        return f"    format: bf16\n    reason: {what} in BF16"
    return f"    format: {fmt.value}"


def recipe_text(layout: Layout) -> str:
    family = layout.family
    lines = [f"name: mixed-{family.config}", "rules:"]
    for layer, fmt in layout.experts.items():
        lines += [f"  - match: {{role: routed_expert, mtp: false, module: 'layers\\.{layer}\\..*'}}",
                  _rule(fmt, f"layers.{layer} experts")]
    lines += ["  - match: {role: routed_expert, mtp: true}", _rule(layout.mtp, "MTP experts")]
    if family.linears_per_layer:
        keep = "".join(f"(?!{re.escape(m)}$)" for m in family.model_wide_linears)
        lines += [f"  - match: {{role: [attention, indexer, shared_expert], module: 'layers\\.4\\.{keep}.*'}}",
                  "    format: bf16\n    reason: one layer's linears in BF16"]
    lines += ["  - match: {role: [attention, indexer, shared_expert, mtp_projection]}",
              "    format: keep\n    reason: FP8 as released" if family.linears[0] is Format.FP8 else
              "    format: bf16\n    reason: the family's linears are BF16",
              "  - match: {role: [router, norm, hyper_connection, attn_sink, compressor, indexer_compressor, "
              "indexer_weights_proj, embed, head]}",
              "    format: keep\n    reason: not a per-layer choice"]
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def converted(tiny_ckpt, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mixed")
    out = {}
    for i, (name, layout) in enumerate(LAYOUTS.items()):
        recipe = root / f"recipe{i}.yaml"
        recipe.write_text(recipe_text(layout))
        out[name] = root / f"out{i}"
        run(tiny_ckpt, out[name], str(recipe), engine=layout.engine)
    return out


def _expected_format(layout: Layout, module: str) -> Format:
    """What the recipe stores for a linear module (native name)."""
    info = classify(module + ".weight")
    if info.role is Role.ROUTED_EXPERT:
        return layout.mtp if info.is_mtp else layout.experts[int(info.block.split(".")[1])]
    family = layout.family
    if info.role in (Role.ATTENTION, Role.INDEXER, Role.SHARED_EXPERT, Role.MTP_PROJECTION):
        local = module[len(info.block) + 1:]
        if family.linears[0] is Format.BF16 or (
                family.linears_per_layer and info.block == "layers.4" and info.role is not Role.MTP_PROJECTION
                and local not in family.model_wide_linears):
            return Format.BF16
        return Format.FP8
    return Format.BF16


def test_the_layouts_cover_every_admitted_family():
    """Each (engine, GPU family, family) of the menu is one of the layouts, and each layout is converted for
    an engine choice that includes every engine it is served by."""
    for choice in ("both", SGLANG, VLLM):
        for gpu in GPU_FAMILIES:
            for family in menu(choice, gpu)[0]:
                matches = [lay for lay in LAYOUTS.values() if (lay.family.config, lay.family.experts,
                           lay.family.mtp_experts, lay.family.linears) == (family.config, family.experts,
                                                                            family.mtp_experts, family.linears)]
                assert any((SGLANG not in engines_for(choice) or gpu in lay.sglang)
                           and (VLLM not in engines_for(choice) or lay.vllm) for lay in matches), (choice, gpu, family)
    for layout in LAYOUTS.values():
        assert (bool(layout.sglang), layout.vllm) == (SGLANG in engines_for(layout.engine),
                                                      VLLM in engines_for(layout.engine)), layout.name


def test_every_layout_converts_as_the_recipe_says_and_validates(converted):
    from dsv4convert.validate.integrity import check_integrity

    for name, path in converted.items():
        layout = LAYOUTS[name]
        ckpt = Checkpoint.open(path)
        inspection = inspect_checkpoint(ckpt)
        stored = {m: info.format for m, info in inspection.modules.items() if info.format is not None}
        wrong = {m: (f, _expected_format(layout, m)) for m, f in stored.items() if f != _expected_format(layout, m)}
        assert wrong == {}, (name, sorted(wrong.items())[:4])
        integrity = check_integrity(ckpt, inspection)
        assert integrity.problems == [], (name, integrity.problems)
        assert integrity.engines == engines_for(layout.engine)


# ---------------------------------------------------------------------------------------------
# SGLang: config-level answers on every admitted GPU family, real loads once per loading behaviour.

_SCHEME = {Format.NVFP4: "nvfp4", Format.FP8: "fp8", Format.MXFP4: "mxfp4", Format.BF16: "unquantized",
           Format.INT4: "wna16"}


def _spec(path: Path, gpu: str) -> dict:
    ckpt = Checkpoint.open(path)
    inspection = inspect_checkpoint(ckpt)
    return default_launch(path, inspection.variant, opened=(ckpt, inspection))[CARD[gpu]]


def _like(layout: Layout) -> str:
    """The shipped variant whose serving rules the card applies (``served_like`` reads the experts only)."""
    formats = {f"layers.{layer}.ffn.experts.0.w1": (fmt, {}) for layer, fmt in layout.experts.items()}
    formats["mtp.0.ffn.experts.0.w1"] = (layout.mtp, {})
    return served_like("mixed", formats)


def _sglang_method(layout: Layout, fmt: Format, gpu: str, like: str, draft: bool) -> str:
    """The MoE method SGLang must build for experts stored ``fmt`` in this layout."""
    if fmt is Format.MXFP4 and layout.family.config.startswith("nvfp4"):
        return "Mxfp4FlashinferTrtllmMoEMethod"   # HybridFp8NvFp4Config, is_fp4_experts
    if fmt in (Format.MXFP4, Format.INT4):        # the whole-model family's own method on this GPU
        defaults = variant_rules(like, gpu)
        return defaults.draft_moe_method if draft else defaults.moe_method
    return {Format.NVFP4: "ModelOptNvFp4FusedMoEMethod", Format.FP8: "Fp8MoEMethod",
            Format.BF16: "UnquantizedFusedMoEMethod"}[fmt]


@pytest.mark.parametrize("name", [n for n, lay in LAYOUTS.items() if lay.sglang])
def test_sglang_reads_every_layer_as_intended_on_every_admitted_gpu(converted, name):
    layout = LAYOUTS[name]
    path = converted[name]
    config = Checkpoint.open(path).config
    fp4 = Format.MXFP4 in (*layout.experts.values(), layout.mtp)
    for gpu in layout.sglang:
        spec = _spec(path, gpu)
        assert spec["env"]["SGLANG_DSV4_FP4_EXPERTS"] == ("1" if fp4 else "0")
        resolved = sgl.resolve_server_args(spec["argv"][3:], gpu=gpu, env=spec["env"]).resolved_dict()
        if layout.family.config.startswith("nvfp4"):  # the runner the menu's exclusions are about
            assert resolved["moe_runner_backend"] == ("flashinfer_trtllm_routed" if gpu == "sm100" else "marlin")
        quant = sgl.quant_config_for_checkpoint(path, gpu=gpu, env=spec["env"])
        for layer, fmt in layout.experts.items():
            assert sgl.moe_scheme_for(quant, f"model.layers.{layer}.mlp.experts") == _SCHEME[fmt], (gpu, layer)
        assert sgl.moe_scheme_for(quant, "model.decoder.mlp.experts") == _SCHEME[layout.mtp]
        for module in (m for m in inspect_checkpoint(Checkpoint.open(path)).modules
                       if classify(m + ".weight").role in (Role.ATTENTION, Role.INDEXER, Role.SHARED_EXPERT)):
            want = "fp8" if _expected_format(layout, module) is Format.FP8 else "unquantized"
            prefix = sgl.module_prefix(module + ".weight", num_hidden_layers=LAYERS)
            assert sgl.linear_scheme_for(quant, prefix) == want, (gpu, module, prefix)
    # Without the variable, SGLang's ModelConfig must not guess from layers.0 (routed_experts_quant_method),
    # and must still route V4 ungrouped (topk_group == n_group, which that key's presence skips setting).
    from sglang.srt.configs.model_config import ModelConfig

    mixed = len(set(layout.experts.values())) > 1
    with sgl._scoped_environ({}), sgl.override_platform(**sgl.platform_facts(layout.sglang[0])):
        model_config = ModelConfig(str(path))
    quant_config = config.get("quantization_config", {})
    if quant_config.get("quant_method") == "fp8":
        assert ("routed_experts_quant_method" in quant_config) == mixed
        if mixed:  # (uniform backbones keep the card's variable; test_sglang_loading shows the probe there)
            assert model_config.is_fp4_experts == fp4
    assert model_config.hf_config.topk_group == model_config.hf_config.n_group


def _signature(layout: Layout, gpu: str, like: str) -> tuple:
    """What decides how SGLang loads a layout on a GPU family: the card's runner and methods, and sm_100's
    FP8 wo_a GEMM (DeepGEMM UE8M0)."""
    d = variant_rules(like, gpu)
    methods = tuple(_sglang_method(layout, f, gpu, like, False) for f in layout.experts.values())
    return d.moe_runner_backend, methods, _sglang_method(layout, layout.mtp, gpu, like, True), gpu == "sm100"


def _sglang_loads() -> list[tuple[str, str]]:
    """One (layout, GPU family) per distinct loading behaviour. Layouts of one family that differ only in
    what the shipped variants' loads already cover (E8M0 vs F32 FP8 expert scales; compressed-tensors'
    FP8 vs BF16 linears) share the behaviours out between them."""
    groups: dict[tuple, list[str]] = {}
    for name, layout in LAYOUTS.items():
        if layout.sglang:
            f = layout.family
            groups.setdefault((f.config, f.experts, f.mtp_experts), []).append(name)
    loads: list[tuple[str, str]] = []
    for names in groups.values():
        taken: set[tuple] = set()
        count = dict.fromkeys(names, 0)
        for name in names:
            for gpu in LAYOUTS[name].sglang:
                sig = _signature(LAYOUTS[name], gpu, _like(LAYOUTS[name]))
                if sig in taken:
                    continue
                taken.add(sig)
                owner = min((n for n in names if gpu in LAYOUTS[n].sglang), key=lambda n: count[n])
                count[owner] += 1
                loads.append((owner, gpu))
    return loads


SGLANG_LOADS = _sglang_loads()


@contextlib.contextmanager
def _gpu_host():
    """FlashInfer is installed with SGLang's wheel on a GPU host (Mxfp4FlashinferCutlassMoEMethod checks)."""
    import sglang.srt.layers.quantization.mxfp4_flashinfer_cutlass_moe as cutlass

    with mock.patch.object(cutlass, "is_flashinfer_available", lambda: True):
        yield


@contextlib.contextmanager
def _trtllm_swaps_w1_w3():
    """FusedMoE's weight loader swaps the w1/w3 halves of w13 for Fp8MoEMethod and UnquantizedFusedMoEMethod
    under the TRT-LLM runners (srt/layers/moe/fused_moe_triton/layer.py, ``shard_id`` remapped when
    ``use_flashinfer_trtllm_moe``): the landing check reads it as the method's up-first layout."""
    import sglang.srt.layers.moe.fused_moe_triton.layer as fused
    from sglang.srt.layers.quantization.fp8 import Fp8MoEMethod
    from sglang.srt.layers.quantization.unquant import UnquantizedFusedMoEMethod

    original = fused._weight_layout_method

    def layout_method(layer):
        method = original(layer)
        if getattr(layer, "use_flashinfer_trtllm_moe", False) and isinstance(method, (Fp8MoEMethod,
                                                                                      UnquantizedFusedMoEMethod)):
            return mock.Mock(load_up_proj_weight_first=True)
        return method

    with mock.patch.object(fused, "_weight_layout_method", layout_method):
        yield


@pytest.fixture(scope="module")
def sglang_loaded(converted):
    """SGLang's target and draft for each (layout, GPU family) of ``_sglang_loads``, loaded once."""
    cache: dict[tuple[str, str], tuple] = {}

    def get(name: str, gpu: str):
        if (name, gpu) not in cache:
            path = converted[name]
            spec = _spec(path, gpu)
            draft_argv = spec["mtp"]["argv"][3:] if "mtp" in spec else spec["argv"][3:]
            draft_env = spec["mtp"]["env"] if "mtp" in spec else spec["env"]
            with _gpu_host():
                models = {"target": sgl.load_checkpoint(path, spec["argv"][3:], gpu=gpu, env=spec["env"]),
                          "draft": sgl.load_checkpoint(path, draft_argv, gpu=gpu, env=draft_env, draft=True)}
            ckpt = Checkpoint.open(path)
            with _trtllm_swaps_w1_w3():
                cache[name, gpu] = ckpt, spec, models, check(ckpt, models)
        return cache[name, gpu]

    return get


@pytest.mark.parametrize("name,gpu", SGLANG_LOADS, ids=[f"{n}-{g}" for n, g in SGLANG_LOADS])
def test_every_tensor_lands_and_every_layer_gets_its_method_in_sglang(sglang_loaded, name, gpu):
    layout = LAYOUTS[name]
    ckpt, spec, models, report = sglang_loaded(name, gpu)
    target, draft = models["target"], models["draft"]
    assert target.error is None and draft.error is None, (target.error, draft.error)
    assert report.bad() == [] and report.holes == [] and report.strays == [], (report.bad()[:3], report.holes[:3])
    assert sorted(v.tensor for v in report.verdicts) == sorted(ckpt.tensors)
    assert sorted(target.yielded) == sorted(draft.yielded) == sorted(ckpt.tensors)
    for loaded in (target, draft):
        assert all(_never_loaded(p, loaded) for p in loaded.not_initialized), loaded.not_initialized
        assert loaded.not_found == []
    like = _like(layout)
    assert target.moe_methods == {f"model.layers.{layer}.mlp.experts": _sglang_method(layout, fmt, gpu, like, False)
                                  for layer, fmt in layout.experts.items()}
    assert draft.moe_methods == {"model.decoder.mlp.experts": _sglang_method(layout, layout.mtp, gpu, like, True)}
    assert spec["draft_moe_method"] == draft.moe_methods["model.decoder.mlp.experts"]


def test_sglang_loads_cover_every_behaviour():
    """Every (layout, GPU family) the menu admits either is loaded or shares its loading behaviour with one
    that is, in its family."""
    loaded = {(LAYOUTS[n].family.config, LAYOUTS[n].family.experts, LAYOUTS[n].family.mtp_experts,
               _signature(LAYOUTS[n], g, _like(LAYOUTS[n]))) for n, g in SGLANG_LOADS}
    for layout in LAYOUTS.values():
        f = layout.family
        for gpu in layout.sglang:
            assert (f.config, f.experts, f.mtp_experts, _signature(layout, gpu, _like(layout))) in loaded
    assert len(SGLANG_LOADS) < sum(len(lay.sglang) for lay in LAYOUTS.values())


def test_sglang_cannot_load_one_bf16_wo_a_beside_fp8_ones(converted, tmp_path):
    """Why every SGLang family keeps wo_a one format for the model (menu ``model_wide_linears``, the
    converter's refusal): SGLang's loader asserts on a checkpoint with one BF16 wo_a."""
    import torch

    from dsv4convert.formats import dequantize_fp8_block

    name = next(n for n, lay in LAYOUTS.items() if lay.engine == SGLANG and lay.family.config == "fp8")
    source = converted[name]

    def bf16_wo_a(tensors):
        tensors["layers.1.attn.wo_a.weight"] = dequantize_fp8_block(
            tensors["layers.1.attn.wo_a.weight"], tensors.pop("layers.1.attn.wo_a.scale"), block=(128, 128)).to(torch.bfloat16)

    broken = tamper(source, tmp_path / "bf16-wo-a", bf16_wo_a)
    spec = _spec(source, "sm90")
    argv = [str(broken) if arg == str(source) else arg for arg in spec["argv"][3:]]
    loaded = sgl.load_checkpoint(broken, argv, gpu="sm90", env=spec["env"])
    assert isinstance(loaded.error, AssertionError) and "layers.1.attn.wo_a.scale is missing" in str(loaded.error)


# ---------------------------------------------------------------------------------------------
# vLLM: one process for every layout made for it, started beside SGLang's loads.

_VLLM_METHOD = {Format.NVFP4: "ModelOptNvFp4FusedMoE", Format.MXFP4: "Mxfp4MoEMethod", Format.FP8: "Fp8MoEMethod",
                Format.BF16: "UnquantizedFusedMoEMethod", Format.INT4: "CompressedTensorsWNA16MoEMethod"}


@pytest.fixture(scope="module")
def vllm_answers(converted) -> dict[tuple, dict]:
    """One vLLM process answers every question of this module (its import and first build are most of it)."""
    asked: dict[tuple, dict] = {}
    for name, layout in LAYOUTS.items():
        if not layout.vllm:
            continue
        path = converted[name]
        ckpt = Checkpoint.open(path)
        inspection = inspect_checkpoint(ckpt)
        card = vllm_default_launch(path, inspection.variant, opened=(ckpt, inspection))
        for gpu in ("sm100", "sm120"):
            asked[(name, gpu, "resolve")] = vllm.request(path, card[CARD[gpu]]["argv"][3:], gpu=gpu, resolve_only=True)
        argv = card[CARD["sm90"]]["mtp"]["argv"][3:]
        asked[(name, "sm90", "target")] = vllm.request(path, argv, gpu="sm90")
        asked[(name, "sm90", "draft")] = vllm.request(path, argv, gpu="sm90", draft=True)
    keys = list(asked)
    return dict(zip(keys, vllm.run([asked[k] for k in keys])))


def _ok(answer: dict) -> dict:
    assert "raised" not in answer, answer.get("traceback", answer.get("raised"))
    return answer


@pytest.mark.parametrize("name", [n for n, lay in LAYOUTS.items() if lay.vllm])
def test_every_tensor_lands_and_every_module_gets_its_method_in_vllm(converted, vllm_answers, name):
    layout = LAYOUTS[name]
    answers = vllm_answers
    target, draft = _ok(answers[(name, "sm90", "target")]), _ok(answers[(name, "sm90", "draft")])
    assert target["error"] is None and draft["error"] is None, (target["error"], draft["error"])
    ckpt = Checkpoint.open(converted[name])
    names = set(ckpt.tensors)
    mtp = {n for n in names if n.startswith("mtp.")}
    assert set(target["tensors"]) == names and set(draft["tensors"]) == mtp
    assert {n: v for n, v in target["tensors"].items() if n not in mtp and v != "landed"} == {}
    assert {n: v for n, v in draft["tensors"].items() if v != "landed"} == {}
    assert target["unwritten"] == {} and target["replaced"] == {} and draft["replaced"] == {}
    assert set(draft["unwritten"]) == {p for p in draft["params"] if p.endswith(vllm.DRAFT_SHARED)}
    moe = {m: v for m, v in target["methods"].items() if m.endswith(".ffn.experts.routed_experts")}
    assert moe == {f"model.layers.{layer}.ffn.experts.routed_experts": _VLLM_METHOD[fmt]
                   for layer, fmt in layout.experts.items()}
    assert {v for m, v in draft["methods"].items() if m.endswith(".ffn.experts.routed_experts")} == {
        _VLLM_METHOD[layout.mtp]}
    assert target["resolved"]["expert_dtype"] == ("fp8" if layout.family.config == "fp8" else None)
    methods = {**target["methods"], **draft["methods"]}
    for module, info in inspect_checkpoint(ckpt).modules.items():
        if info.format is None or ".ffn.experts." in module or info.role.value in ("embed", "head"):
            continue
        got = methods.get(_vllm_module(module, LAYERS))
        assert got == LINEAR_METHOD[_expected_format(layout, module).value], (module, got)
    for gpu in ("sm100", "sm120"):  # the card's commands on the other families, resolved by vLLM
        resolved = _ok(answers[(name, gpu, "resolve")])["resolved"]
        assert resolved["quant_config"] == target["resolved"]["quant_config"] and resolved["kv_cache_dtype"] == "fp8"


# ---------------------------------------------------------------------------------------------
# The menu itself, and the facts in SGLang's code its exclusions rest on.

def test_menu_per_engine_and_gpu_family():
    def names(engine: str, gpu: str) -> list[str]:
        return [f.name for f in menu(engine, gpu)[0]]

    assert names("sglang", "sm90") == names("sglang", "sm120") == ["nvfp4+bf16", "fp8+bf16", "mxfp4+bf16", "int4+bf16"]
    assert names("sglang", "sm100") == ["nvfp4+fp8", "nvfp4+mxfp4", "fp8+bf16", "mxfp4+bf16", "int4+bf16"]
    for gpu in GPU_FAMILIES:
        assert names("vllm", gpu) == ["nvfp4+bf16", "nvfp4+mxfp4+bf16", "fp8+bf16", "mxfp4+bf16", "int4+bf16"]
    assert names("both", "sm90") == names("both", "sm120") == ["nvfp4+bf16", "fp8+bf16", "mxfp4+bf16", "int4+bf16"]
    assert names("both", "sm100") == ["nvfp4", "nvfp4+mxfp4", "fp8+bf16", "mxfp4+bf16", "int4+bf16"]
    for gpu in GPU_FAMILIES:
        by_engine = {e: {f.config: f for f in menu(e, gpu)[0]} for e in ("sglang", "vllm", "both")}
        for config, both in by_engine["both"].items():  # "both" is the intersection
            for engine in ("sglang", "vllm"):
                one = by_engine[engine][config]
                assert set(both.experts) <= set(one.experts) and set(both.linears) <= set(one.linears)
        int4 = by_engine["both"]["int4"]
        assert int4.linears == (Format.BF16,) and not int4.linears_per_layer
        assert by_engine["sglang"]["int4"].linears == (Format.FP8, Format.BF16)
        assert all(f.model_wide_linears == ("attn.wo_a",) for f in by_engine["sglang"].values() if f.linears_per_layer)
        assert all(f.model_wide_linears == () for f in by_engine["vllm"].values())
        assert set(CANDIDATES) >= set(by_engine["vllm"])
    excluded = {e.name: e.reason for e in menu("sglang", "sm90")[1]}
    assert "Fp8MoEMethod.create_moe_runner" in excluded["nvfp4+fp8+bf16: fp8 experts"]
    assert "SM100" in excluded["nvfp4+mxfp4+bf16"]
    assert "swiglu" in {e.name: e.reason for e in menu("sglang", "sm100")[1]}["nvfp4+fp8+bf16: bf16 experts"]
    assert "per-expert formats" in excluded


def test_the_runner_facts_the_menu_rests_on():
    """SGLang's own methods, under the runners the launch uses: Fp8MoEMethod gets no Marlin runner (and its
    forward has no Marlin path), the unquantized method a Triton one under Marlin and a TRT-LLM one under
    flashinfer_trtllm_routed, whose BF16 kernel call is given no SwiGLU clamp while the FP8 one is."""
    import sglang.srt.layers.moe.moe_runner.flashinfer_trtllm as trtllm
    from sglang.srt.layers.moe.moe_runner.base import MoeRunnerConfig
    from sglang.srt.layers.moe.utils import MoeRunnerBackend, resolve_moe_runner_backend
    from sglang.srt.layers.quantization.fp8 import Fp8Config, Fp8MoEMethod
    from sglang.srt.layers.quantization.unquant import UnquantizedFusedMoEMethod
    from sglang.srt.runtime_context import get_flags

    fp8_config = Fp8Config(is_checkpoint_fp8_serialized=True, activation_scheme="dynamic", weight_block_size=[128, 128])
    runners = {}
    moe = get_flags().moe
    saved = moe.runner_backend
    try:
        for backend in ("marlin", "flashinfer_trtllm_routed", "flashinfer_cutlass"):
            moe.runner_backend = resolve_moe_runner_backend(backend)
            fp8, bf16 = Fp8MoEMethod(fp8_config), UnquantizedFusedMoEMethod(False, backend == "flashinfer_trtllm_routed")
            fp8.create_moe_runner(None, MoeRunnerConfig())
            bf16.create_moe_runner(None, MoeRunnerConfig())
            runners[backend] = (fp8.runner and fp8.runner.runner_backend, bf16.runner.runner_backend)
    finally:
        moe.runner_backend = saved
    assert runners["marlin"] == (None, MoeRunnerBackend.TRITON)
    assert runners["flashinfer_trtllm_routed"] == (MoeRunnerBackend.FLASHINFER_TRTLLM_ROUTED,) * 2
    assert runners["flashinfer_cutlass"][0] == MoeRunnerBackend.TRITON  # not the launch; see the menu docstring
    assert "self.runner.runner_backend" in inspect.getsource(Fp8MoEMethod.apply)
    assert "marlin" not in inspect.getsource(Fp8MoEMethod.apply).lower()
    bf16_call = inspect.getsource(trtllm.fused_experts_none_to_flashinfer_trtllm_bf16)
    assert "clamp" not in bf16_call and "swiglu" not in bf16_call
    assert "gemm1_clamp_limit" in inspect.getsource(trtllm.fused_experts_none_to_flashinfer_trtllm_fp8)
