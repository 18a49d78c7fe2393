"""Every tensor of every variant through SGLang 0.5.23's own model and ``load_weights``, per GPU family.

For each variant of the tiny synthetic model as made for both engines (the default: fp8 with F32
expert scales, nvfp4 with BF16 or MXFP4 MTP experts, w4a16 with BF16 linears, bf16) and as made for
SGLang alone (``--engine sglang``: fp8 with E8M0 scales, nvfp4 with FP8 MTP experts, w4a16 with FP8
linears), and each GPU family we serve (sm_90, sm_100, sm_120), the launch command and environment
of the model card (``default_launch``, i.e. the engine rules ``serve`` launches with) go through SGLang's
own resolution, ``ModelConfig``, ``_get_quantization_config`` and model construction; SGLang's
default loader then streams the checkpoint into ``DeepseekV4ForCausalLM.load_weights``, and into
the ``DeepseekV4ForCausalLMNextN`` draft with the card's MTP flags (``sglang_oracle.load_checkpoint``).

Then, independently of SGLang, every checkpoint tensor must be found where the model needs it
(``landings``, our statement of sglang-loading.md sections 1-2): bit-exactly, or converted the
way SGLang converts (E8M0 scales to F32, BF16 norms to F32, I64 to I32/BF16, and ``wo_a``
dequantized to BF16 where the FP8 wo_a GEMM is off, compared with our own dequantizer). A tensor
with no place is dropped, one whose place holds other bytes was cast or overwritten, and a raise
names its tensor. Per parameter element, the sentinel loads say whether loading wrote it: every
element must be written (but the parameters no checkpoint fills, ``sglang_oracle.NEVER_LOADED``)
and every written element must be some tensor's place. SGLang's own "not initialized" warning is
per parameter and misses partial holes; the negative cases below show it.

What is faked, because a CPU machine lacks it (``sglang_oracle._cpu_host_fakes``, ``_load_weights``):

* platform facts (CUDA, the SM version, Blackwell or not) through SGLang's own ``override_platform``,
  and ``torch.cuda.get_device_capability``, which compressed-tensors' scheme check calls directly:
  CPU torch has no CUDA device to ask;
* DeepGEMM availability (``deep_gemm_wrapper.ENABLE_JIT_DEEPGEMM``/``DEEPGEMM_SCALE_UE8M0``), computed
  at import from the CUDA device and the installed ``deep_gemm``, set as on a GPU host with the
  wheel's sgl-deep-gemm (sm_90: JIT with F32 scales; sm_100: UE8M0; sm_120: off): it decides
  whether resolution keeps the FP8 ``wo_a`` GEMM, i.e. whether ``wo_a`` loads FP8 or BF16;
* ``deepseek_v4._FP8_WO_A_GEMM``, read from the environment at import: re-read after resolution
  wrote ``SGLANG_OPT_FP8_WO_A_GEMM``, as the server's scheduler process, which imports the model
  later, sees it;
* tensor placement: SGLang's own ``CpuSRTPlatform`` answers ``current_platform.get_device()``
  (host memory; SGLang's platform without an accelerator raises);
* the rotary embedding's import-time ``_is_cuda``: on a CPU host it imports vLLM's rope kernel
  (not installed), on a CUDA host V4's rope needs no kernel import; the rope has no parameters;
* the process groups are SGLang's own TP/PP/EP groups over a one-rank gloo world (nothing faked,
  but one rank: TP 1, the tiny checkpoints' card command);
* GPU-only work after the loading loop: ``_prewarm_mhc_kernels`` (TileLang/CUDA JIT prewarm and
  a barrier) is skipped, and on sm_100 DeepGEMM's ``transform_sf_into_required_layout`` (the FP8
  wo_a scale layout) is an identity stub; parameters are compared as ``load_weights`` wrote them,
  just before its ``post_load_weights`` (which still runs).

Not covered: SGLang's import-time ``_is_cuda`` is False here, so it builds its non-CUDA decoder
class (``DeepseekV4PlatformDecoderLayer``) and no CUDA streams: execution plumbing, with the same
parameters from the same quant methods; and ``process_weights_after_loading`` (Marlin repacks,
FlashInfer shuffles, swizzles: GPU kernels) is not run.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import sglang_oracle as sgl
import torch
from conftest import write_plain_checkpoint

from dsv4convert.checkpoint import Checkpoint
from dsv4convert.convert.model_card import default_launch
from dsv4convert.engines import GPU_FAMILIES, gpu_of_family
from dsv4convert.engines.sglang.rules import variant_rules
from dsv4convert.formats import dequantize_fp8_block, e8m0_scale_to_float32
from dsv4convert.inspection import detect_variant
from dsv4convert.models.deepseek_v4.layout import Role, classify

FAMILIES = {family: gpu_of_family(family).label for family in GPU_FAMILIES}
# conftest's outputs: the shipped recipes for both engines, and "<recipe>@sglang" where SGLang's own layout differs.
VARIANTS = ("fp8", "nvfp4", "nvfp4-mtp-mxfp4", "w4a16", "bf16", "fp8@sglang", "nvfp4@sglang", "w4a16@sglang")
LANDED, CONVERTED, CONSUMED = "landed", "converted", "consumed"
GOOD = (LANDED, CONVERTED, CONSUMED)


# ---------------------------------------------------------------------------------------------
# Where each checkpoint tensor must be in SGLang's model (sglang-loading.md sections 1 and 2).

@dataclass(frozen=True)
class Landing:
    param: str
    index: tuple
    expected: torch.Tensor | None  # None: consumed by another tensor's conversion (see `how`)
    how: str


@dataclass(frozen=True)
class Verdict:
    tensor: str
    model: str        # "target" or "draft"
    outcome: str      # landed | converted | consumed | dropped | wrong | raised
    detail: str = ""


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _exact(convert):
    def checked(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
        out = convert(t, dtype)
        return out if torch.equal(out.to(t.dtype), t) else None
    return checked


# (checkpoint dtype, parameter dtype) -> how SGLang's copy_ converts, exactly; anything else is a cast.
CONVERSIONS = {
    (torch.float8_e8m0fnu, torch.float32): ("E8M0 scales to F32", lambda t, _d: e8m0_scale_to_float32(t)),
    (torch.bfloat16, torch.float32): ("BF16 to F32", lambda t, _d: t.float()),
    (torch.int64, torch.int32): ("I64 to I32", _exact(lambda t, d: t.to(d))),
    (torch.int64, torch.bfloat16): ("I64 to BF16", _exact(lambda t, d: t.to(d))),
    (torch.uint8, torch.int8): ("U8 bits as I8", lambda t, d: t.view(d)),
    (torch.int8, torch.uint8): ("I8 bits as U8", lambda t, d: t.view(d)),
}


def _sglang_param_name(name: str, loaded: sgl.LoadedModel, layers: int) -> str:
    """The parameter name SGLang's remap gives ``name`` in this model (the draft's decoder moved)."""
    remapped = sgl.sglang_name(name, num_hidden_layers=layers)
    if not loaded.draft:
        return remapped
    rest = remapped.removeprefix(f"model.layers.{layers}.")
    if rest.startswith(("e_proj.", "h_proj.", "enorm.", "hnorm.", "hc_head_", "shared_head.")):
        return f"model.{rest}"
    return f"model.decoder.{rest}"


def _rows(start: int, count: int) -> tuple:
    return (slice(start, start + count),)


def landings(name: str, ckpt: Checkpoint, loaded: sgl.LoadedModel) -> list[Landing] | str | None:
    """Where ``name`` must be in ``loaded``; None if it belongs to the other model, or why there is no place."""
    if name.startswith("mtp.") != loaded.draft:
        return None
    info = classify(name)
    layers = ckpt.config["num_hidden_layers"]
    target = _sglang_param_name(name, loaded, layers)
    tensor = ckpt.read(name)
    params = loaded.params
    block = target.rsplit(".", 1)[0]
    if info.role is Role.ROUTED_EXPERT:
        return _expert_landing(info, tensor, target, loaded)
    if info.role is Role.SHARED_EXPERT and info.proj in ("w1", "w3"):
        fused = target.replace(".gate_proj.", ".gate_up_proj.").replace(".up_proj.", ".gate_up_proj.")
        half = params[fused].shape[0] // 2 if fused in params else 0
        return _direct(fused, tensor, loaded, _rows(0 if info.proj == "w1" else half, half))
    if info.module.endswith(("attn.wq_a", "attn.wkv")) and ".compressor." not in name:
        fused = target.replace(".wq_a.", ".wqkv_a.").replace(".wkv.", ".wqkv_a.")
        if fused in params:  # SGLANG_OPT_FUSE_WQA_WKV: rows of wq_a, then wkv
            q_rows = ckpt.entry(name.replace(".wkv.", ".wq_a.")).shape[0]
            rows = _rows(0, q_rows) if ".wq_a." in name else _rows(q_rows, tensor.shape[0])
            return _direct(fused, tensor, loaded, rows)
    if info.role in (Role.COMPRESSOR, Role.INDEXER_COMPRESSOR) and info.module.endswith((".wkv", ".wgate")):
        fused = block.rsplit(".", 1)[0] + ".wkv_gate.weight"
        kv_rows = ckpt.entry(name.replace(".wgate.", ".wkv.")).shape[0]
        rows = _rows(0, kv_rows) if ".wkv." in name else _rows(kv_rows, tensor.shape[0])
        return _direct(fused, tensor, loaded, rows)
    if info.param == "ape" and tensor.shape[0] == 4:
        # Compressor.load_ape_weight: overlapping (ratio-4) windows' two halves stacked as rows.
        halves = torch.chunk(tensor, 2, dim=-1)
        return [Landing(target, (), torch.cat(halves, dim=0).view(tensor.shape[0], -1),
                        "converted: ratio-4 APE halves stacked by Compressor.load_ape_weight")]
    if info.module.endswith("attn.wo_a") and f"{info.module}.scale" in ckpt.tensors and not loaded.wo_a_fp8:
        weight = target.replace(".weight_scale_inv", ".weight")
        if info.param == "scale":
            return [Landing(weight, (), None, "consumed: wo_a dequantized to BF16 with it")]
        dequantized = dequantize_fp8_block(tensor, ckpt.read(f"{info.module}.scale"), block=(128, 128)).to(torch.bfloat16)
        return [Landing(weight, (), dequantized,
                        "converted: FP8 wo_a dequantized to BF16, the FP8 wo_a GEMM being off")]
    return _direct(target, tensor, loaded, ())


def _value(tensor: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor | None, str]:
    if tensor.dtype == dtype:
        return tensor, LANDED
    how = CONVERSIONS.get((tensor.dtype, dtype))
    if how is None:
        return None, f"cast: SGLang's copy_ converts {tensor.dtype} values into its {dtype} parameter (no scale)"
    converted = how[1](tensor, dtype)
    if converted is None:
        return None, f"cast: {tensor.dtype} values not exact in {dtype}"
    return converted, f"converted: {how[0]}"


def _direct(param: str, tensor: torch.Tensor, loaded: sgl.LoadedModel, index: tuple) -> list[Landing] | str:
    if param not in loaded.params:
        return f"no parameter {param}: SGLang drops it"
    expected, how = _value(tensor, loaded.params[param].dtype)
    if expected is None:
        return [Landing(param, index, tensor, how)]
    return [Landing(param, index, expected, how)]


def _expert_landing(info, tensor: torch.Tensor, target: str, loaded: sgl.LoadedModel) -> list[Landing] | str:
    """FusedMoE.weight_loader: per-expert rows of w13 (w1 and w3 halves) or w2, per-tensor slots."""
    from sglang.srt.layers.moe.fused_moe_triton.layer import _weight_layout_method

    prefix = target.split(".mlp.experts.")[0] + ".mlp.experts"
    suffix = target.rsplit(".", 1)[1]
    param = f"{prefix}.{'w2' if info.proj == 'w2' else 'w13'}_{suffix}"
    if param not in loaded.params:
        return f"no parameter {param}: SGLang drops it silently"
    data = loaded.params[param][info.expert]
    layer = loaded.model.get_submodule(prefix)
    e = info.expert
    if suffix in ("input_scale", "weight_shape"):  # _load_single_value: the whole per-expert row
        expected, how = _value(tensor, data.dtype)
        return [Landing(param, (e,), (expected if expected is not None else tensor).expand(data.shape), how)]
    if suffix == "weight_scale_2":  # ModelOpt per-tensor: w13 column 0 for w1, 1 for w3
        index = (e,) if info.proj == "w2" else (e, 0 if info.proj == "w1" else 1)
        return _direct(param, tensor.reshape(()), loaded, index)
    transposed = bool(getattr(loaded.model.get_parameter(param), "is_transposed", False))
    value = tensor.t() if transposed else tensor
    if info.proj == "w2":
        return _direct(param, value, loaded, (e,))
    dim = 1 if transposed else 0
    half = data.shape[dim] // 2
    up_first = getattr(_weight_layout_method(layer), "load_up_proj_weight_first", False)
    start = 0 if (info.proj == "w1") != up_first else half
    rows = slice(start, start + half)
    return _direct(param, value, loaded, (e, rows) if dim == 0 else (e, slice(None), rows))


# ---------------------------------------------------------------------------------------------
# Verdicts per tensor, and per parameter element.

@dataclass
class Report:
    verdicts: list[Verdict]
    holes: list[str]    # parameter elements nothing wrote that some tensor should have
    strays: list[str]   # elements written that are no tensor's place

    def bad(self) -> list[Verdict]:
        return [v for v in self.verdicts if v.outcome not in GOOD]

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for v in self.verdicts:
            key = f"{v.outcome} ({v.detail.split(': ', 1)[1]})" if v.outcome == CONVERTED else v.outcome
            out[key] = out.get(key, 0) + 1
        return out


def _never_loaded(param: str, loaded: sgl.LoadedModel) -> bool:
    return any(p in param for p in sgl.NEVER_LOADED) or (loaded.draft and param in sgl.DRAFT_SHARED)


def check(ckpt: Checkpoint, models: dict[str, sgl.LoadedModel]) -> Report:
    """Every checkpoint tensor's outcome in the target and draft, and every parameter element's."""
    verdicts: list[Verdict] = []
    places = {role: {n: torch.zeros(p.shape, dtype=torch.bool) for n, p in m.params.items()}
              for role, m in models.items()}
    for role, loaded in models.items():
        if loaded.error is not None:
            error = f"{type(loaded.error).__name__}: {loaded.error}"
            verdicts.append(Verdict(loaded.error_tensor or "?", role, "raised", error))
    for name in ckpt.tensors:
        if any(m.error is not None and name.startswith("mtp.") == m.draft for m in models.values()):
            continue  # its model raised: the raise is the verdict
        found = [(role, landings(name, ckpt, m)) for role, m in models.items()]
        found = [(role, result) for role, result in found if result is not None]
        if not found:
            verdicts.append(Verdict(name, "-", "dropped", "neither the target nor the draft loads it"))
            continue
        for role, result in found:
            loaded = models[role]
            if isinstance(result, str):
                reached = loaded.reached.get(name, set())
                verdicts.append(Verdict(name, role, "dropped" if not reached else "wrong",
                                        result if not reached else f"{result}, yet it reached {sorted(reached)}"))
                continue
            verdicts.append(_verdict(name, role, loaded, result, places[role]))
    holes, strays = [], []
    for role, loaded in models.items():
        if loaded.error is not None:
            continue
        for param, written in loaded.written.items():
            place = places[role][param]
            if _never_loaded(param, loaded):
                if written.any():
                    strays.append(f"{role} {param}: {int(written.sum())} elements written, none expected")
                continue
            if (~written).any():
                holes.append(f"{role} {param}: {int((~written).sum())} of {written.numel()} elements never written")
            if (written & ~place).any():
                stray = int((written & ~place).sum())
                strays.append(f"{role} {param}: {stray} elements written outside every tensor's place")
    return Report(verdicts, holes, strays)


def _verdict(name: str, role: str, loaded: sgl.LoadedModel, result: list[Landing], place: dict) -> Verdict:
    outcome, details = LANDED, []
    for landing in result:
        region = loaded.params[landing.param][landing.index]
        written = loaded.written[landing.param][landing.index]
        place[landing.param][landing.index] = True
        if landing.expected is None:
            outcome, details = CONSUMED, [landing.how]
            continue
        if not written.any():
            return Verdict(name, role, "dropped", f"nothing written at {landing.param}{_fmt(landing.index)}")
        if not written.all():
            return Verdict(name, role, "wrong", f"{int((~written).sum())} elements of "
                                                f"{landing.param}{_fmt(landing.index)} never written")
        if landing.how.startswith("cast"):
            return Verdict(name, role, "wrong", f"{landing.how} ({landing.param})")
        if region.shape != landing.expected.shape or region.dtype != landing.expected.dtype:
            return Verdict(name, role, "wrong", f"{landing.param}{_fmt(landing.index)} is {region.dtype} "
                                                f"{list(region.shape)}, the tensor {landing.expected.dtype} "
                                                f"{list(landing.expected.shape)}")
        if not torch.equal(_bits(region), _bits(landing.expected)):
            return Verdict(name, role, "wrong", f"{landing.param}{_fmt(landing.index)} holds other values "
                                                "(overwritten by another tensor, or converted differently)")
        if landing.how != LANDED:
            outcome, details = CONVERTED, [landing.how.removeprefix("converted: ")]
    return Verdict(name, role, outcome, ": ".join([outcome, *details]) if details else "")


def _fmt(index: tuple) -> str:
    def one(i):
        return f"{i.start or ''}:{i.stop or ''}" if isinstance(i, slice) else str(i)
    return f"[{', '.join(one(i) for i in index)}]" if index else ""


# ---------------------------------------------------------------------------------------------
# The matrix: each variant's model-card commands on each GPU family.

@pytest.fixture(scope="module")
def checkpoints(outputs) -> dict[str, Path]:
    """The tiny model converted by every shipped recipe (conftest's ``outputs``)."""
    return {variant: outputs[variant] for variant in VARIANTS}


@dataclass
class Served:
    ckpt: Checkpoint
    spec: dict
    models: dict[str, sgl.LoadedModel]
    report: Report


@pytest.fixture(scope="module")
def served(checkpoints):
    """SGLang's target and draft for one (variant, family), built and loaded once per module."""
    cache: dict[tuple[str, str], Served] = {}

    def get(variant: str, gpu: str) -> Served:
        if (variant, gpu) not in cache:
            model_dir = checkpoints[variant]
            spec = default_launch(model_dir, detect_variant(model_dir))[FAMILIES[gpu]]
            assert spec["argv"][:3] == ["python", "-m", "sglang.launch_server"]
            # Where the card offers no MTP command the draft is built with the same flags anyway, to
            # show what SGLang would make of it.
            draft_argv = spec["mtp"]["argv"][3:] if "mtp" in spec else [*spec["argv"][3:], *sgl.EAGLE_ARGS]
            draft_env = spec["mtp"]["env"] if "mtp" in spec else spec["env"]
            models = {"target": sgl.load_checkpoint(model_dir, spec["argv"][3:], gpu=gpu, env=spec["env"]),
                      "draft": sgl.load_checkpoint(model_dir, draft_argv, gpu=gpu, env=draft_env, draft=True)}
            ckpt = Checkpoint.open(model_dir)
            cache[variant, gpu] = Served(ckpt, spec, models, check(ckpt, models))
        return cache[variant, gpu]

    return get


@pytest.mark.parametrize("gpu", list(FAMILIES))
@pytest.mark.parametrize("variant", VARIANTS)
def test_every_tensor_lands_where_sglang_needs_it(served, variant, gpu):
    s = served(variant, gpu)
    target, draft = s.models["target"], s.models["draft"]
    assert target.error is None and draft.error is None, (target.error, draft.error)
    assert s.report.bad() == [] and s.report.holes == [] and s.report.strays == []
    # SGLang's own iterator produced every tensor of the index, and each has exactly one verdict.
    assert sorted(target.yielded) == sorted(draft.yielded) == sorted(s.ckpt.tensors)
    assert sorted(v.tensor for v in s.report.verdicts) == sorted(s.ckpt.tensors)
    # SGLang's own warning names only parameters no checkpoint fills (W4A16's act-order indices).
    for loaded in (target, draft):
        assert all(_never_loaded(p, loaded) for p in loaded.not_initialized), loaded.not_initialized
        assert loaded.not_found == []
    counts = s.report.counts()
    assert counts[LANDED] > len(s.ckpt.tensors) // 2
    e8m0 = any(entry.dtype == "F8_E8M0" for entry in s.ckpt.tensors.values())
    assert (counts.get("converted (E8M0 scales to F32)", 0) > 0) == e8m0 == (variant not in ("bf16", "w4a16"))


@pytest.mark.parametrize("gpu", list(FAMILIES))
@pytest.mark.parametrize("variant", VARIANTS)
def test_moe_methods_and_wo_a_are_what_serve_states(served, variant, gpu):
    s = served(variant, gpu)
    layout = detect_variant(s.ckpt.root)
    defaults = variant_rules(layout, gpu)
    target, draft = s.models["target"], s.models["draft"]
    assert set(target.moe_methods.values()) == {defaults.moe_method}
    assert len(target.moe_methods) == s.ckpt.config["num_hidden_layers"]
    assert draft.moe_methods == {"model.decoder.mlp.experts": defaults.draft_moe_method}
    assert s.spec["draft_moe_method"] == defaults.draft_moe_method
    # The card offers the draft exactly where its method runs: MXFP4 draft experts go to a
    # TRT-LLM kernel only sm_100 has; the nvfp4 recipe's FP8 draft runs on SGLang's Triton FP8 MoE.
    assert ("mtp" in s.spec) == (draft.moe_methods["model.decoder.mlp.experts"] != "Mxfp4FlashinferTrtllmMoEMethod"
                                 or gpu == "sm100")
    fp8_config = layout in ("fp8", "nvfp4", "nvfp4-mtp-mxfp4", "nvfp4-mtp-bf16")
    assert target.wo_a_fp8 == draft.wo_a_fp8 == (fp8_config and gpu == "sm100")


def test_conversions_are_the_ones_sglang_makes(served):
    """On sm_120 wo_a is dequantized to BF16 at load; on sm_100 (FP8 wo_a GEMM) it stays FP8."""
    for gpu, how in (("sm120", "FP8 wo_a dequantized to BF16, the FP8 wo_a GEMM being off"), ("sm100", None)):
        verdicts = {v.tensor: v for v in served("fp8", gpu).report.verdicts}
        weight, scale = verdicts["layers.1.attn.wo_a.weight"], verdicts["layers.1.attn.wo_a.scale"]
        if how is None:
            assert (weight.outcome, scale.outcome) == (LANDED, CONVERTED), (weight, scale)
        else:
            assert weight.detail == f"{CONVERTED}: {how}" and scale.outcome == CONSUMED
    nvfp4 = {v.tensor: v for v in served("nvfp4@sglang", "sm120").report.verdicts}
    assert nvfp4["layers.1.ffn.experts.0.w1.weight"].outcome == LANDED
    assert nvfp4["layers.1.ffn.experts.0.w1.weight_scale_2"].outcome == LANDED
    assert nvfp4["mtp.0.ffn.experts.0.w1.scale"].detail == f"{CONVERTED}: E8M0 scales to F32"
    assert nvfp4["layers.2.attn.compressor.norm.weight"].detail == f"{CONVERTED}: BF16 to F32"
    assert nvfp4["layers.2.attn.compressor.ape"].detail.startswith(f"{CONVERTED}: ratio-4 APE halves stacked")
    assert nvfp4["layers.3.attn.compressor.ape"].outcome == LANDED  # ratio 128: no overlap
    assert nvfp4["layers.0.ffn.gate.tid2eid"].detail == f"{CONVERTED}: I64 to I32"
    w4a16 = {v.tensor: v for v in served("w4a16", "sm90").report.verdicts}
    assert w4a16["layers.1.ffn.experts.0.w3.weight_packed"].outcome == LANDED  # transposed into w13
    assert w4a16["layers.1.ffn.experts.0.w3.weight_shape"].detail == f"{CONVERTED}: I64 to BF16"
    assert w4a16["layers.1.attn.wo_a.weight"].outcome == LANDED  # BF16 for both engines: no dequantization
    both = {v.tensor: v for v in served("nvfp4", "sm90").report.verdicts}
    assert both["mtp.0.ffn.experts.0.w1.weight"].outcome == LANDED  # BF16 draft experts, unquantized MoE
    fp8 = {v.tensor: v for v in served("fp8", "sm90").report.verdicts}
    assert fp8["layers.1.ffn.experts.0.w1.scale"].outcome == LANDED  # F32 block scales, as SGLang holds them


# ---------------------------------------------------------------------------------------------
# Negative cases: checkpoints with one planted fault. SGLang loads most of them without an error
# or a warning that names the damage; the check above and ``validate`` must both name it.

def tamper(src: Path, dst: Path, edit, card_edit=None) -> Path:
    """A copy of ``src`` whose tensors ``edit`` changed (one shard; the small files kept)."""
    ckpt = Checkpoint.open(src)
    tensors = {name: ckpt.read(name) for name in ckpt.tensors}
    edit(tensors)
    write_plain_checkpoint(dst, [tensors])
    for path in ckpt.small_files():
        shutil.copy(path, dst / path.name)
    if card_edit is not None:
        (dst / "README.md").write_text(card_edit((dst / "README.md").read_text()))
    return dst


def _renamed_scale(t):
    t["layers.1.ffn.experts.3.w1.weight_scale"] = t.pop("layers.1.ffn.experts.3.w1.scale")


def _missing_scale_2(t):
    del t["layers.2.ffn.experts.5.w3.weight_scale_2"]


def _bf16_weight(t):
    name = "layers.1.ffn.experts.0.w2.weight"
    t[name] = torch.full(t[name].shape, 0.5, dtype=torch.bfloat16)


def _differing_input_scales(t):
    t["layers.3.ffn.experts.6.w3.input_scale"] = t["layers.3.ffn.experts.6.w3.input_scale"] * 2


def _differing_scale_2(t):
    t["layers.3.ffn.experts.1.w3.weight_scale_2"] = t["layers.3.ffn.experts.1.w3.weight_scale_2"] * 2


def _extra_suffix(t):
    t["layers.1.ffn.experts.2.w2.input_scale"] = torch.tensor(1.0)


def _scale_without_weight(t):
    del t["layers.2.ffn.experts.4.w1.weight"]


def _mixed_wq_a_wkv(t):
    t["layers.1.attn.wq_a.weight"] = dequantize_fp8_block(t["layers.1.attn.wq_a.weight"],
                                                          t.pop("layers.1.attn.wq_a.scale"), block=(128, 128)).to(torch.bfloat16)


def _no_edit(t):
    pass


@dataclass(frozen=True)
class Fault:
    variant: str
    edit: Callable[[dict[str, torch.Tensor]], None]
    sglang: tuple[str | tuple[str, ...], str] | None  # (tensor or tensors, outcome) of SGLang's load; None: all land
    hole: str | None                # the parameter SGLang leaves partly unwritten
    validate: tuple[str, ...]       # what `validate`'s integrity problems name, in order
    draft: bool = False             # load the MTP draft rather than the target
    card_edit: Callable[[str], str] | None = None
    env: tuple = ()                 # environment overrides for SGLang (what a wrong card would set)


FAULTS = {
    "renamed expert scale": Fault("fp8", _renamed_scale, ("layers.1.ffn.experts.3.w1.weight_scale", "dropped"),
                                  "model.layers.1.mlp.experts.w13_weight_scale_inv",
                                  ("layers.1.ffn.experts.3.w1.weight_scale", "layers.1.ffn.experts.3.w1.scale")),
    "missing weight_scale_2": Fault("nvfp4", _missing_scale_2, None, "model.layers.2.mlp.experts.w13_weight_scale_2",
                                    ("layers.2.ffn.experts.5.w3.weight_scale_2",)),
    "BF16 expert weight in FP8": Fault("fp8", _bf16_weight, ("layers.1.ffn.experts.0.w2.weight", "wrong"), None,
                                       ("layers.1.ffn.experts.0.w2.weight",)),
    # both halves write one w13_input_scale slot: the one that lands last wins, and SGLang's multi-thread shard
    # loading decides which (seen both ways on a loaded 2-core machine), so the verdict names either half
    "differing w1/w3 input_scale": Fault("nvfp4", _differing_input_scales,
                                         (("layers.3.ffn.experts.6.w1.input_scale",
                                           "layers.3.ffn.experts.6.w3.input_scale"), "wrong"), None,
                                         ("layers.3.ffn.experts.6.w3.input_scale",)),
    # SGLang keeps both weight_scale_2 columns; only its sm_90/sm_120 runners then use w1's for both.
    "differing w1/w3 weight_scale_2": Fault("nvfp4", _differing_scale_2, None, None,
                                            ("layers.3.ffn.experts.1.w3.weight_scale_2",)),
    "expert suffix the format has no parameter for": Fault(
        "fp8", _extra_suffix, ("layers.1.ffn.experts.2.w2.input_scale", "dropped"), None,
        ("layers.1.ffn.experts.2.w2.input_scale",)),
    "scale without its weight": Fault("fp8", _scale_without_weight, None, "model.layers.2.mlp.experts.w13_weight",
                                      ("layers.2.ffn.experts.4.w1.weight",)),
    # SGLang raises where it concatenates the pair (a BF16 wq_a with an FP8 wkv).
    "mixed-dtype wq_a/wkv": Fault("fp8", _mixed_wq_a_wkv, ("layers.1.attn.w", "raised"), None,
                                  ("layers.1.attn.wq_a.weight", "layers.1.attn.wq_a.scale")),
    # A card telling SGLang the FP8 draft experts are FP4: the draft then fails on some MTP expert
    # tensor (which one first depends on SGLang's loader threads).
    "model card with the wrong SGLANG_DSV4_FP4_EXPERTS": Fault(
        "nvfp4@sglang", _no_edit, ("mtp.0.ffn.experts.", "raised"), None, ("README.md",), draft=True,
        card_edit=lambda text: text.replace("SGLANG_DSV4_FP4_EXPERTS=0", "SGLANG_DSV4_FP4_EXPERTS=1"),
        env=(("SGLANG_DSV4_FP4_EXPERTS", "1"),)),
}


@pytest.fixture(scope="module")
def faulty(checkpoints, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("faulty")
    return {name: tamper(checkpoints[f.variant], root / f"fault{i}", f.edit, f.card_edit)
            for i, (name, f) in enumerate(FAULTS.items())}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_planted_faults_are_caught(checkpoints, faulty, fault):
    f = FAULTS[fault]
    gpu = "sm120"
    spec = default_launch(checkpoints[f.variant], detect_variant(checkpoints[f.variant]))[FAMILIES[gpu]]  # its card
    spec = spec["mtp"] if f.draft else spec
    argv = [str(faulty[fault]) if arg == str(checkpoints[f.variant]) else arg for arg in spec["argv"][3:]]
    loaded = sgl.load_checkpoint(faulty[fault], argv, gpu=gpu, env={**spec["env"], **dict(f.env)}, draft=f.draft)
    report = check(Checkpoint.open(faulty[fault]), {"draft" if f.draft else "target": loaded})
    bad = [v for v in report.bad() if v.model != "-"]  # "-": tensors of the model not loaded here
    if f.sglang is None or f.sglang[1] != "raised":
        assert loaded.error is None  # SGLang loads it ...
        assert all(_never_loaded(p, loaded) for p in loaded.not_initialized)  # ... and its warning sees no hole
    if f.sglang is None:
        assert bad == []
    else:  # exactly one verdict, naming the planted tensor
        assert len(bad) == 1 and bad[0].tensor.startswith(f.sglang[0]) and bad[0].outcome == f.sglang[1], bad
    if loaded.error is None:
        assert [h.split(":")[0] for h in report.holes] == ([f"target {f.hole}"] if f.hole else [])
        assert report.strays == []


@pytest.mark.parametrize("fault", list(FAULTS))
def test_validate_names_what_sglang_would_do(faulty, fault):
    from dsv4convert.inspection import inspect_checkpoint
    from dsv4convert.validate.integrity import check_integrity

    ckpt = Checkpoint.open(faulty[fault])
    problems = check_integrity(ckpt, inspect_checkpoint(ckpt)).problems
    assert [p.split(": ", 1)[0] for p in problems] == list(FAULTS[fault].validate), problems


@pytest.mark.parametrize("variant", VARIANTS)
def test_validate_passes_every_clean_variant_and_states_its_env(checkpoints, variant):
    from dsv4convert.inspection import inspect_checkpoint
    from dsv4convert.validate.integrity import check_integrity

    ckpt = Checkpoint.open(checkpoints[variant])
    integrity = check_integrity(ckpt, inspect_checkpoint(ckpt))
    layout = detect_variant(checkpoints[variant])
    assert integrity.problems == []
    assert integrity.fp4_experts.needed == variant_rules(layout, "sm120").env["SGLANG_DSV4_FP4_EXPERTS"]
    # What validate says SGLang's probe concludes is what SGLang's ModelConfig concludes with the
    # variable unset: right only for fp8 (F8_E4M3) and nvfp4-mtp-mxfp4 (U8, and MXFP4 draft experts).
    assert integrity.fp4_experts.probe_fp4 == sgl.is_fp4_experts(checkpoints[variant]) == (layout != "fp8")
