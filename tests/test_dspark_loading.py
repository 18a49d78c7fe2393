"""A DSpark drafter (DeepSeek-V4-Flash-0731) converted by every shipped recipe, through SGLang 0.5.23's and
vLLM 0.33.0's real DSpark draft models and loaders on CPU.

One tiny DSpark source (``synth.with_dspark(preset_config("tiny"))``: three sliding-window stages, a Markov
head, a confidence head) is converted once by each shipped recipe for ``--engine both`` and, where the layout
differs, for one engine. Then, for each output:

* the drafter is kept losslessly: every ``mtp.*`` module decodes to the source's values, except where the
  format is lossy (INT4 experts; NVFP4 never reaches a stage), so a tensor that lands exactly below holds
  the source's values;
* SGLang (``sglang_oracle.load_checkpoint`` with ``--speculative-algorithm DSPARK``) builds
  ``DeepseekV4ForCausalLMDSpark`` and loads the output twice with sentinels: every ``mtp.*`` tensor is found
  where that model needs it, bit-exactly or converted exactly the way SGLang converts (test_sglang_loading's
  landing rules), in its own stage; every parameter element is written but the KV scales (and W4A16's act-order
  indices); the confidence head alone is dropped, by design, under the default
  ``SGLANG_RAGGED_VERIFY_MODE=static`` (and lands under ``compact``); each stage's MoE method is the one
  ``engines.sglang.rules.variant_rules`` names for the draft;
* vLLM (``vllm_oracle``, ``{"method":"dspark"}``, Model Runner V2) builds ``DSparkDeepseekV4ForCausalLM`` and
  every ``mtp.*`` tensor lands with exact values; nothing is unwritten but the embedding and LM head vLLM
  aliases from the target; ``model.context_wkv_proj`` is fed from the stages' ``wkv`` alone.

And the engine behaviour the converter and ``serve`` rely on: both targets load a DSpark checkpoint and drop
``mtp.*``; vLLM raises on the release's own Markov names (hence ``markov_w1``/``markov_w2`` in outputs for
vLLM); SGLang under EAGLE silently builds the NextN draft instead (hence DSPARK); a DSpark draft's experts run
on the target's MoE runner.

Kept lean (CI is at its time limit): one vLLM process answers the module's vLLM questions; GPU families only
where the engine behaves differently. The DSpark draft's parameters (names, dtypes,
shapes) are the same on sm_90, sm_100 and sm_120 for every output here, and its MoE method differs only for
W4A16 (sm_100's Triton WNA16 MoE) and MXFP4 draft experts (their TRT-LLM method runs on sm_100 only): so each
SGLang output is loaded on sm_90, W4A16 also on sm_100, the MXFP4 draft on sm_100 alone. vLLM's quant methods
do not depend on the family (test_vllm_loading.py): its drafts are built on sm_90.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import sglang_oracle as sgl
import torch
import vllm_oracle as vllm
from conftest import run

# The places SGLang's loaders put a checkpoint tensor (FusedMoE.weight_loader, fused rows, copy_'s exact
# conversions) and the per-tensor verdicts are test_sglang_loading's; only the name remap differs here.
from test_sglang_loading import (
    CONSUMED,
    GOOD,
    LANDED,
    Landing,
    Report,
    Verdict,
    _direct,
    _expert_landing,
    _rows,
    _verdict,
    check,
    tamper,
)

from dsv4convert.checkpoint import Checkpoint
from dsv4convert.convert.model_card import default_launch, vllm_default_launch
from dsv4convert.engines import gpu_of_family
from dsv4convert.engines.sglang.rules import variant_rules
from dsv4convert.engines.vllm.server import VLLM_MOE_METHODS
from dsv4convert.formats import Format, dequantize_fp8_block, spec
from dsv4convert.inspection import WEIGHT_PARAMS, detect_variant, inspect_checkpoint
from dsv4convert.models.deepseek_v4.layout import Drafter, Role, classify
from dsv4convert.models.deepseek_v4.configs import with_dspark
from dsv4convert.synth import preset_config, synthesize

RECIPES = ("fp8", "nvfp4", "nvfp4-mtp-mxfp4", "w4a16", "bf16")
# "<recipe>@<engine>": outputs whose layout differs when made for one engine (conftest.ENGINE_OUTPUTS).
ONE_ENGINE = {"fp8@sglang": ("fp8", "sglang"), "nvfp4@sglang": ("nvfp4", "sglang"),
              "w4a16@sglang": ("w4a16", "sglang"), "nvfp4@vllm": ("nvfp4", "vllm")}
# Outputs SGLang loads -> the families its DSpark draft behaves differently on (module docstring).
SGLANG_CELLS = {"fp8": ("sm90",), "fp8@sglang": ("sm90",), "bf16": ("sm90",), "nvfp4": ("sm90",),
                "nvfp4@sglang": ("sm90",), "w4a16": ("sm90", "sm100"), "w4a16@sglang": ("sm90",),
                "nvfp4-mtp-mxfp4": ("sm100",)}
# Outputs made for vLLM (nvfp4@vllm is nvfp4-mtp-mxfp4's layout: test_nvfp4_for_vllm_alone_is_...).
VLLM_OUTPUTS = ("fp8", "nvfp4", "nvfp4-mtp-mxfp4", "w4a16", "bf16")
LOSSY = (Format.INT4, Format.NVFP4)
STATIC_DROPPED = "mtp.2.confidence_head.proj.weight"  # the tiny drafter's last stage is mtp.2


def _family(gpu: str) -> str:
    return gpu_of_family(gpu).label


# ---------------------------------------------------------------------------------------------
# The source and its conversions, made once.

@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """The tiny DSpark checkpoint. No path here may contain "dspark": vLLM turns a draft whose path does into
    a DSpark one whatever was asked (config/speculative.py::SpeculativeConfig.__post_init__)."""
    return synthesize(tmp_path_factory.mktemp("drafter") / "src", with_dspark(preset_config("tiny")), seed=0)


@pytest.fixture(scope="module")
def outputs(source, tmp_path_factory) -> dict[str, Path]:
    """The source converted by every shipped recipe for both engines, and for one engine where that differs;
    plus "native-w1w2": the source with only its Markov head renamed as outputs for vLLM name it."""
    root = tmp_path_factory.mktemp("drafter-variants")
    made = {}
    for name, (recipe, engine) in {**{r: (r, "both") for r in RECIPES}, **ONE_ENGINE}.items():
        made[name] = root / name
        run(source, made[name], recipe, engine=engine)
    made["native-w1w2"] = tamper(source, root / "native-w1w2", _markov_w1_w2)
    return made


def _markov_w1_w2(tensors: dict[str, torch.Tensor]) -> None:
    for old, new in (("embed", "markov_w1"), ("head", "markov_w2")):
        tensors[f"mtp.2.markov_head.{new}.weight"] = tensors.pop(f"mtp.2.markov_head.{old}.weight")


# ---------------------------------------------------------------------------------------------
# vLLM: one process answers the module.

def _vllm_card(output: Path, gpu: str) -> dict:
    """The model card's ``vllm serve`` commands for ``output`` on ``gpu``."""
    ckpt = Checkpoint.open(output)
    card = vllm_default_launch(output, detect_variant(output), opened=(ckpt, inspect_checkpoint(ckpt)))[_family(gpu)]
    assert card["argv"][:3] == ["vllm", "serve", str(output)]
    return card


def _dspark_config(source: Path) -> str:
    """``--speculative-config`` for the DSpark draft, num_speculative_tokens the config's block size: vLLM's
    bundled form requires it (config/speculative.py::SpeculativeConfig._verify_args)."""
    config = json.loads((source / "config.json").read_text())
    return json.dumps({"method": "dspark", "num_speculative_tokens": config["dspark_block_size"]}, separators=(",", ":"))


@pytest.fixture(scope="module")
def vllm_answers(outputs, source) -> dict[tuple[str, str], dict]:
    """Every vLLM question of the module, answered by one vLLM process (its import costs ~25 s): the card's
    command with a DSpark draft for each output made for vLLM; the card's target and MTP commands for fp8; the
    release's own checkpoint (it has no card: fp8's flags) and its Markov-renamed copy."""
    dspark = ["--speculative-config", _dspark_config(source)]
    card = {name: _vllm_card(outputs[name], "sm90") for name in VLLM_OUTPUTS}
    for name in VLLM_OUTPUTS:   # the card's draft command is the DSpark one
        assert card[name]["mtp"]["argv"] == [*card[name]["argv"], *dspark], name
    asked = {(name, "draft"): vllm.request(outputs[name], card[name]["mtp"]["argv"][3:], gpu="sm90", draft=True)
             for name in VLLM_OUTPUTS}
    asked[("fp8", "target")] = vllm.request(outputs["fp8"], [*card["fp8"]["argv"][3:], *dspark], gpu="sm90")
    mtp = ["--speculative-config", json.dumps({"method": "mtp", "num_speculative_tokens": 1})]
    asked[("fp8", "mtp")] = vllm.request(outputs["fp8"], [*card["fp8"]["argv"][3:], *mtp], gpu="sm90", draft=True)
    for name, path in (("native", source), ("native-w1w2", outputs["native-w1w2"])):
        asked[(name, "draft")] = vllm.request(path, [*card["fp8"]["argv"][3:], *dspark], gpu="sm90", draft=True)
    keys = list(asked)
    return dict(zip(keys, vllm.run([asked[k] for k in keys])))


def _ok(answer: dict) -> dict:
    assert "raised" not in answer, answer.get("traceback", answer.get("raised"))
    return answer


# ---------------------------------------------------------------------------------------------
# SGLang: where each checkpoint tensor must be in DeepseekV4ForCausalLMDSpark.

def landings(name: str, ckpt: Checkpoint, loaded: sgl.LoadedModel) -> list[Landing] | str | None:
    """Where ``name`` must be in the DSpark draft; None for the target's tensors, or why it has no place.

    The parameter name is SGLang's own ``DeepseekV4ForCausalLMDSpark._remap_dspark_weight_name``
    (``stages.{s}.`` + the V4 renames, ``markov_head.markov_w1/w2``; None for the confidence head when none is
    built); the stage each one lands in is checked separately (``_outside_its_stage``).
    """
    if not name.startswith("mtp."):
        return None
    target = loaded.model._remap_dspark_weight_name(name)
    if target is None:
        return "SGLang's _remap_dspark_weight_name maps it to nothing"
    info = classify(name)
    tensor = ckpt.read(name)
    if info.role is Role.ROUTED_EXPERT:
        return _expert_landing(info, tensor, target, loaded)
    if info.role is Role.SHARED_EXPERT and info.proj in ("w1", "w3"):
        # DEEPSEEK_V4_STACKED_PARAMS_MAPPING: w1 then w3 rows of gate_up_proj.
        fused = target.replace(".gate_proj.", ".gate_up_proj.").replace(".up_proj.", ".gate_up_proj.")
        half = loaded.params[fused].shape[0] // 2 if fused in loaded.params else 0
        return _direct(fused, tensor, loaded, _rows(0 if info.proj == "w1" else half, half))
    if info.module.endswith("attn.wo_a") and f"{info.module}.scale" in ckpt.tensors and not loaded.wo_a_fp8:
        # DSparkAttention builds wo_a BF16 (wo_a_fp8=False); load_weights first runs
        # deepseek_v4.py::_dequant_fp8_wo_a_streaming, which consumes the scale.
        weight = target.replace(".weight_scale_inv", ".weight")
        if info.param == "scale":
            return [Landing(weight, (), None, "consumed: wo_a dequantized to BF16 with it")]
        dequantized = dequantize_fp8_block(tensor, ckpt.read(f"{info.module}.scale"), block=(128, 128)).to(torch.bfloat16)
        return [Landing(weight, (), dequantized, "converted: FP8 wo_a dequantized to BF16 (DSpark's wo_a is BF16)")]
    return _direct(target, tensor, loaded, ())


def _never_loaded(param: str) -> bool:
    return any(p in param for p in (*sgl.DSPARK_NEVER_LOADED, *sgl.NEVER_LOADED))


def check_draft(ckpt: Checkpoint, loaded: sgl.LoadedModel, where=landings) -> Report:
    """Every ``mtp.*`` tensor's verdict in the DSpark draft, and every parameter element's (``where``: the
    places of one tensor, :func:`landings` or a model release's refinement of it)."""
    places = {n: torch.zeros(p.shape, dtype=torch.bool) for n, p in loaded.params.items()}
    verdicts: list[Verdict] = []
    for name in ckpt.tensors:
        result = where(name, ckpt, loaded)
        if result is None:
            continue
        if isinstance(result, str):
            reached = loaded.reached.get(name, set())
            verdicts.append(Verdict(name, "draft", "dropped" if not reached else "wrong", result))
            continue
        verdicts.append(_verdict(name, "draft", loaded, result, places))
    holes, strays = [], []
    for param, written in loaded.written.items():
        if _never_loaded(param):
            if written.any():
                strays.append(f"{param}: {int(written.sum())} elements written, none expected")
            continue
        if (~written).any():
            holes.append(f"{param}: {int((~written).sum())} of {written.numel()} elements never written")
        if (written & ~places[param]).any():
            strays.append(f"{param}: {int((written & ~places[param]).sum())} elements written outside every place")
    return Report(verdicts, holes, strays)


def _outside_its_stage(loaded: sgl.LoadedModel) -> dict[str, list[str]]:
    """``mtp.{s}`` tensors written anywhere but stage ``s`` (the heads, one per drafter, aside)."""
    wrong = {}
    for name, params in loaded.reached.items():
        if name.startswith("mtp.") and ".markov_head." not in name and ".confidence_head." not in name:
            outside = sorted(p for p in params if not p.startswith(f"stages.{name.split('.')[1]}."))
            if outside:
                wrong[name] = outside
    return wrong


def dspark_launch(output: Path, gpu: str) -> tuple[list[str], dict[str, str]]:
    """The card's draft launch on ``gpu`` (``--speculative-algorithm DSPARK``: SGLang derives the rest,
    arg_groups/speculative_hook.py::_handle_dspark: steps and top-k 1, draft tokens dspark_block_size + 1, the
    draft path the model's own). Where the card offers none (serve refuses the draft there), the card's launch
    with the DSPARK flags added, so the loader is still asked what it would build."""
    card = default_launch(output, detect_variant(output))[_family(gpu)]
    if "mtp" in card:
        assert "DSPARK" in card["mtp"]["argv"]
        return card["mtp"]["argv"][3:], card["mtp"]["env"]
    return [*card["argv"][3:], "--speculative-algorithm", "DSPARK", "--speculative-moe-runner-backend", "triton"], \
        card["env"]


@dataclass
class Drafted:
    ckpt: Checkpoint
    argv: list[str]
    loaded: sgl.LoadedModel
    report: Report


@pytest.fixture(scope="module")
def drafted(outputs):
    """SGLang's DSpark draft for one (output, family), built and loaded once per module."""
    cache: dict[tuple[str, str, tuple], Drafted] = {}

    def get(output: str, gpu: str, env: tuple = ()) -> Drafted:
        if (output, gpu, env) not in cache:
            argv, card_env = dspark_launch(outputs[output], gpu)
            loaded = sgl.load_checkpoint(outputs[output], argv, gpu=gpu, env={**card_env, **dict(env)}, draft=True)
            ckpt = Checkpoint.open(outputs[output])
            cache[output, gpu, env] = Drafted(ckpt, argv, loaded, check_draft(ckpt, loaded))
        return cache[output, gpu, env]

    return get


CELLS = [(output, gpu) for output, families in SGLANG_CELLS.items() for gpu in families]


# ---------------------------------------------------------------------------------------------
# The outputs keep the drafter.

def _by_module(ckpt: Checkpoint) -> dict[str, dict[str, str]]:
    """``mtp.*`` tensor names by module and parameter (the Markov head under its release name either way)."""
    modules: dict[str, dict[str, str]] = {}
    for name in ckpt.tensors:
        if name.startswith("mtp."):
            info = classify(name)
            modules.setdefault(info.module, {})[info.param] = name
    return modules


def _formats(ckpt: Checkpoint) -> dict[str, tuple[Format, dict]]:
    """The stored format and params of each linear (inspect knows none for norms, hyper-connections, sinks)."""
    return {m: (f.format, f.params) for m, f in inspect_checkpoint(ckpt).modules.items() if f.format is not None}


@pytest.mark.parametrize("output", [*RECIPES, *ONE_ENGINE])
def test_outputs_keep_the_drafter_losslessly(source, outputs, output):
    """Each ``mtp.*`` module of an output decodes to the source's values (its other tensors: the same
    bytes), but where the format is lossy; the loads below compare what the engines hold with the output."""
    src, out = Checkpoint.open(source), Checkpoint.open(outputs[output])
    src_formats, out_formats = _formats(src), _formats(out)
    src_modules, out_modules = _by_module(src), _by_module(out)
    assert set(out_modules) == set(src_modules)
    compared, differ = 0, []
    for module, params in out_modules.items():
        fmt, fmt_params = out_formats.get(module, (None, {}))
        if fmt in LOSSY:
            continue
        weights = {p: out.read(n) for p, n in params.items() if p in WEIGHT_PARAMS} if fmt is not None else {}
        if weights:
            theirs = {p: src.read(n) for p, n in src_modules[module].items() if p in WEIGHT_PARAMS}
            mine = spec(fmt).decode(weights, f"{module}.weight", fmt_params)
            src_fmt, src_params = src_formats[module]
            if not torch.equal(mine, spec(src_fmt).decode(theirs, f"{module}.weight", src_params)):
                differ.append(module)
            compared += 1
        for param, name in params.items():
            if param not in weights:
                if not torch.equal(out.read(name), src.read(src_modules[module][param])):
                    differ.append(name)
                compared += 1
    assert differ == [] and compared > len(out_modules) // 2


# ---------------------------------------------------------------------------------------------
# SGLang's DSpark draft.

@pytest.mark.parametrize(("output", "gpu"), CELLS)
def test_sglang_dspark_draft_loads_every_tensor(drafted, output, gpu):
    d = drafted(output, gpu)
    loaded = d.loaded
    assert type(loaded.model).__name__ == "DeepseekV4ForCausalLMDSpark" and loaded.error is None, loaded.error
    assert loaded.model.num_stages == len(d.ckpt.config["dspark_target_layer_ids"]) == 3
    assert loaded.model.confidence_head is None  # SGLANG_RAGGED_VERIFY_MODE=static, SGLang's default
    mtp = sorted(n for n in d.ckpt.tensors if n.startswith("mtp."))
    # SGLang's own iterator produced every tensor; each mtp.* one has exactly one verdict.
    assert sorted(loaded.yielded) == sorted(d.ckpt.tensors)
    assert sorted(v.tensor for v in d.report.verdicts) == mtp
    assert [(v.tensor, v.outcome) for v in d.report.bad()] == [(STATIC_DROPPED, "dropped")]
    assert d.report.holes == [] and d.report.strays == []
    # Every other mtp.* tensor reached a parameter of its own stage; wo_a's scale went into wo_a's dequantization.
    unreached = [n for n in mtp if not loaded.reached.get(n)]
    consumed = [v.tensor for v in d.report.verdicts if v.outcome == CONSUMED]
    assert sorted(unreached) == sorted([STATIC_DROPPED, *consumed]), unreached
    assert _outside_its_stage(loaded) == {}
    assert loaded.not_found == [] and loaded.not_initialized == set()
    assert sum(v.outcome == LANDED for v in d.report.verdicts) > len(mtp) // 2


@pytest.mark.parametrize(("output", "gpu"), CELLS)
def test_sglang_dspark_stage_moe_methods_follow_the_rules(drafted, output, gpu):
    d = drafted(output, gpu)
    rules = variant_rules(detect_variant(d.ckpt.root), gpu, Drafter.DSPARK)
    assert d.loaded.moe_methods == {f"stages.{s}.mlp.experts": rules.draft_moe_method for s in range(3)}
    assert d.loaded.wo_a_fp8 is False  # DSparkAttention.__init__: wo_a_fp8=False on every family


def test_sglang_confidence_head_lands_under_compact_verify(drafted):
    """models/deepseek_v4_dspark.py::build_dspark_v4_confidence_head builds the head (F32 [1, H+R]) unless
    SGLANG_RAGGED_VERIFY_MODE is static; then the BF16 tensor lands converted, and nothing is dropped."""
    d = drafted("fp8", "sm90", (("SGLANG_RAGGED_VERIFY_MODE", "compact"),))
    assert d.loaded.error is None and d.loaded.model.confidence_head is not None
    assert d.report.bad() == [] and d.report.holes == [] and d.report.strays == []
    verdict = next(v for v in d.report.verdicts if v.tensor == STATIC_DROPPED)
    assert verdict.outcome in GOOD and verdict.detail == "converted: BF16 to F32"
    assert d.loaded.reached[STATIC_DROPPED] == {"confidence_head.proj.weight"}


def test_sglang_dspark_experts_run_on_the_target_runner(drafted):
    """The DSpark worker builds its draft outside ``speculative_moe_backend_context`` (see
    ``sglang_oracle._draft_build_scopes``): ``--speculative-moe-runner-backend triton``, which the rules give the
    NVFP4 hybrid's FP8 draft experts, does not reach them; they get the target's marlin, for which
    ``Fp8MoEMethod.create_moe_runner`` (layers/quantization/fp8.py) builds no runner."""
    assert not variant_rules("nvfp4", "sm90", Drafter.DSPARK).serves_draft   # why serve refuses this draft
    d = drafted("nvfp4@sglang", "sm90")
    assert d.argv[d.argv.index("--moe-runner-backend") + 1] == "marlin"
    assert d.argv[d.argv.index("--speculative-moe-runner-backend") + 1] == "triton"
    assert set(d.loaded.moe_methods.values()) == {"Fp8MoEMethod"}
    assert set(d.loaded.moe_runners.values()) == {"marlin"}
    assert all(d.loaded.model.get_submodule(m).quant_method.runner is None for m in d.loaded.moe_methods)


def test_sglang_target_loads_a_dspark_checkpoint_without_its_drafter(outputs):
    """DeepseekV4ForCausalLM.load_weights skips mtp.*: every backbone tensor lands, no mtp.* one reaches it."""
    argv, env = dspark_launch(outputs["fp8"], "sm90")
    target = sgl.load_checkpoint(outputs["fp8"], argv, gpu="sm90", env=env)
    assert type(target.model).__name__ == "DeepseekV4ForCausalLM" and target.error is None, target.error
    report = check(Checkpoint.open(outputs["fp8"]), {"target": target})
    assert [v for v in report.bad() if v.model != "-"] == [] and report.holes == [] and report.strays == []
    assert {v.tensor for v in report.bad()} == {n for n in target.yielded if n.startswith("mtp.")}
    assert not any(n.startswith("mtp.") for n in target.reached)


def test_sglang_eagle_on_a_dspark_checkpoint_builds_the_nextn_draft(outputs):
    """Why serve must launch DSPARK (and refuses EAGLE): EAGLE on a DSpark output makes
    configs/model_config.py::ModelConfig._config_draft_model build DeepseekV4ForCausalLMNextN, which loads all
    stages into its one decoder and leaves the MTP block's own projections and norms unwritten, with a warning
    and no error."""
    card = default_launch(outputs["fp8@sglang"], detect_variant(outputs["fp8@sglang"]))[_family("sm90")]
    eagle = [*card["argv"][3:], *sgl.EAGLE_ARGS]
    draft = sgl.load_checkpoint(outputs["fp8@sglang"], eagle, gpu="sm90", env=card["env"], draft=True)
    assert type(draft.model).__name__ == "DeepseekV4ForCausalLMNextN" and draft.error is None
    assert {p.rsplit(".", 1)[0] for p in draft.not_initialized} >= {"model.e_proj", "model.h_proj", "model.enorm",
                                                                     "model.hnorm"}
    assert {"model.decoder.main_proj.weight", "model.decoder.markov_head.embed.weight"} <= set(draft.not_found)
    # The three stages' tensors all land in the NextN draft's single decoder.
    assert draft.reached["mtp.0.attn.wq_b.weight"] == draft.reached["mtp.2.attn.wq_b.weight"]


# ---------------------------------------------------------------------------------------------
# vLLM's DSpark draft.

def _moe(answer: dict) -> set[str]:
    return {method for module, method in answer["methods"].items() if module.endswith(".ffn.experts.routed_experts")}


@pytest.mark.parametrize("output", VLLM_OUTPUTS)
def test_vllm_dspark_draft_loads_every_tensor(vllm_answers, outputs, output):
    draft = _ok(vllm_answers[(output, "draft")])
    assert draft["model_class"] == "DSparkDeepseekV4ForCausalLM" and draft["error"] is None, draft["error"]
    resolved = draft["resolved"]
    assert (resolved["speculative_method"], resolved["model_runner"]) == ("dspark", "v2")
    assert resolved["draft_architectures"] == ["DSparkDraftModel"]
    names = set(Checkpoint.open(outputs[output]).tensors)
    mtp = {n for n in names if n.startswith("mtp.")}
    assert set(draft["tensors"]) == names
    assert {n: v for n, v in draft["tensors"].items() if n in mtp and v != "landed"} == {}
    assert {v for n, v in draft["tensors"].items() if n not in mtp} == {"dropped"}
    # Only what load_dspark_model aliases from the target stays unwritten.
    assert set(draft["unwritten"]) == {"model.embed_tokens.weight", "lm_head.weight"}, draft["unwritten"]
    assert draft["replaced"] == {}
    # _duplicate_context_wkv_weights: every stage's wkv, and nothing else, fills the fused context projection.
    context = {n for n, params in draft["reached"].items() if any(p.startswith("model.context_wkv_proj.")
                                                                  for p in params)}
    assert context == {n for n in mtp if ".attn.wkv." in n} and len(context) >= 3
    assert draft["reached"]["mtp.2.markov_head.markov_w1.weight"] == ["model.markov_head.markov_w1.weight"]
    assert _moe(draft) == {VLLM_MOE_METHODS[detect_variant(outputs[output])][1]}


def test_vllm_target_loads_a_dspark_checkpoint_without_its_drafter(vllm_answers, outputs):
    """nvidia/model.py::_make_deepseek_v4_weights_mapper maps "mtp." to None."""
    target = _ok(vllm_answers[("fp8", "target")])
    assert target["model_class"] == "DeepseekV4ForCausalLM" and target["error"] is None, target["error"]
    names = set(Checkpoint.open(outputs["fp8"]).tensors)
    assert set(target["tensors"]) == names
    assert {v for n, v in target["tensors"].items() if n.startswith("mtp.")} == {"dropped"}
    assert {v for n, v in target["tensors"].items() if not n.startswith("mtp.")} == {"landed"}
    assert target["unwritten"] == {} and target["replaced"] == {}


def test_vllm_mtp_method_cannot_load_a_dspark_drafter(vllm_answers):
    """Why a DSpark checkpoint's card says {"method":"dspark"}: the preview's method mtp builds DeepSeekV4MTP (models/deepseek_v4/nvidia/mtp.py), which has no parameter for a stage's main_norm."""
    mtp = _ok(vllm_answers[("fp8", "mtp")])
    assert mtp["resolved"]["speculative_method"] == "mtp" and mtp["model_class"] == "DeepSeekV4MTP"
    assert mtp["error"] == "KeyError: 'model.layers.5.mtp_block.main_norm.weight'"
    assert mtp["error_tensor"] == "mtp.0.main_norm.weight"


def test_vllm_needs_markov_w1_w2_names(vllm_answers):
    """models/deepseek_v4/nvidia/dspark.py::_remap_dspark_name keeps markov_head.embed/head, for which the model
    has no parameter (it has markov_w1/markov_w2): the release's names raise, the same checkpoint renamed loads."""
    native = _ok(vllm_answers[("native", "draft")])
    assert native["error"] == "KeyError: 'model.markov_head.embed.weight'"
    assert native["error_tensor"] == "mtp.2.markov_head.embed.weight"
    renamed = _ok(vllm_answers[("native-w1w2", "draft")])
    assert renamed["error"] is None
    assert {v for n, v in renamed["tensors"].items() if n.startswith("mtp.")} == {"landed"}
    assert set(renamed["unwritten"]) == {"model.embed_tokens.weight", "lm_head.weight"}


def test_nvfp4_for_vllm_alone_is_the_mtp_mxfp4_layout(outputs):
    """Why nvfp4@vllm is not loaded: its tensors are nvfp4-mtp-mxfp4's, its config differs only in the producer."""
    alone, both = Checkpoint.open(outputs["nvfp4@vllm"]), Checkpoint.open(outputs["nvfp4-mtp-mxfp4"])
    assert {n: (e.dtype, e.shape) for n, e in alone.tensors.items()} == {
        n: (e.dtype, e.shape) for n, e in both.tensors.items()}
    configs = [json.loads((c.root / "config.json").read_text()) for c in (alone, both)]
    for config in configs:
        del config["quantization_config"]["producer"]["engines"]
    assert configs[0] == configs[1]
