"""What SGLang 0.5.23's loader would silently do with a checkpoint, named tensor by tensor.

SGLang's DeepSeek-V4 loader forgives in ways that leave a served model wrong without an error
(sglang-loading.md sections 1-2; tests/test_sglang_loading.py runs SGLang's real loader on the
faults below). Every routed expert of a layer is one FusedMoE with one quant method, so:

* an expert tensor whose suffix names no parameter of that method is dropped without a log line;
* an expert tensor of another dtype is converted by a plain ``copy_`` (BF16 into an FP8
  parameter: values cast, no scale);
* a missing expert tensor leaves its slice of the layer's parameter unset, and SGLang's own
  "Some weights are not initialized" warning, per parameter, stays silent while other experts
  fill the rest;
* w1 and w3 share one ``input_scale`` slot per expert (the later one wins), and SGLang's sm_90 and
  sm_120 NVFP4 runners use w1's ``weight_scale_2`` for both.

Also: a scale without its weight, and ``wq_a``/``wkv`` pairs of different dtypes (SGLang fuses
them into ``wqkv_a`` and fails). Last, the ``SGLANG_DSV4_FP4_EXPERTS`` value the checkpoint needs:
SGLang decides whether routed experts are FP4 by one header probe, which finds nothing for W4A16
and BF16 (and then assumes FP4), and sees the NVFP4 backbone's U8 when the MTP draft's experts
are FP8.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from dataclasses import dataclass

import torch

from dsv4convert.checkpoint import Checkpoint
from dsv4convert.engines.sglang.quant_config import serving_env
from dsv4convert.engines.sglang.rules import EXPERT_METHOD
from dsv4convert.errors import DSV4Error
from dsv4convert.formats import Format, detect_format, linear_storage
from dsv4convert.inspection import WEIGHT_PARAMS, Inspection
from dsv4convert.models.deepseek_v4.layout import linear_shapes

_EXPERT = re.compile(r"^(?P<module>(?P<block>(?:layers|mtp)\.\d+)\.ffn\.experts\.(?P<expert>\d+)\.(?P<proj>w[123]))"
                     r"\.(?P<suffix>[^.]+)$")
# SGLang's routed-expert layout probe (model_loader/weight_utils.py::probe_routed_expert_weight_dtype).
_PROBE_KEY = re.compile(r"\.experts\.\d+\.(?:w[123]|down_proj|up_proj|gate_proj)\.weight$")
_PROBE_FP4 = {"U8": True, "I8": True, "F4": True, "F8_E4M3": False}
# Stored dtypes SGLang's copy_ keeps exactly for a parameter of the expected one.
_SAME_BITS = {frozenset({"U8", "I8"}), frozenset({"F8_E8M0", "F32"})}
_ENV = "SGLANG_DSV4_FP4_EXPERTS"


@dataclass(frozen=True)
class Fp4ExpertsSetting:
    """The ``SGLANG_DSV4_FP4_EXPERTS`` value a checkpoint needs, and what SGLang guesses without it."""

    needed: str                 # "0" or "1"
    probe_tensor: str | None    # the tensor SGLang's probe reads (None: no routed-expert ``.weight``)
    probe_dtype: str | None
    probe_fp4: bool             # what SGLang concludes when the variable is unset (True when it cannot tell)

    def describe(self) -> str:
        """In the user's terms: what the variable tells SGLang, the value this checkpoint needs and why, and what
        SGLang would do with it unset (the note validate prints and the model-card check quotes)."""
        fp4 = self.needed == "1"
        layout = ("MXFP4 (SGLang's FP4 expert path)" if fp4
                  else "not MXFP4 (FP8, NVFP4, INT4 or BF16: SGLang's other expert paths)")
        read = (f"from the dtype of {self.probe_tensor} ({self.probe_dtype})" if self.probe_tensor
                else "with no routed-expert '.weight' tensor to read, so it assumes FP4")
        guess = "FP4" if self.probe_fp4 else "not FP4"
        outcome = ("the wrong expert path for these weights" if self.probe_fp4 != fp4 else
                   "right here, but `serve` and the model card set it anyway so the launch does not rest on a guess")
        return (f"{_ENV} tells SGLang whether the routed experts are stored as MXFP4; this checkpoint's are "
                f"{layout}, so serve with {_ENV}={self.needed}. Left unset, SGLang guesses {read}: {guess}, "
                f"{outcome}")


def fp4_experts_setting(ckpt: Checkpoint, formats: dict[str, tuple[Format, dict]]) -> Fp4ExpertsSetting | None:
    """None when the stored formats cannot be served at all (the config check says why)."""
    try:
        needed = serving_env(ckpt.config, formats)[_ENV]
    except DSV4Error:
        return None
    probe = next((name for name in ckpt.tensors if _PROBE_KEY.search(name)), None)
    dtype = ckpt.tensors[probe].dtype if probe else None
    fp4 = _PROBE_FP4.get(dtype) if dtype else None
    return Fp4ExpertsSetting(needed, probe, dtype, True if fp4 is None else fp4)


def model_card_problems(ckpt: Checkpoint, setting: Fp4ExpertsSetting) -> list[str]:
    """Launch lines of the checkpoint's README.md model card that would serve it with the wrong setting."""
    card = ckpt.root / "README.md"
    if not card.is_file():
        return []
    wanted = f"{_ENV}={setting.needed}"
    lines = [line.strip() for line in card.read_text(encoding="utf-8", errors="replace").splitlines()
             if "sglang.launch_server" in line and wanted not in line.split()]
    if not lines:
        return []
    return [f"README.md: {len(lines)} launch command(s) of the model card lack {wanted} ({setting.describe()}), "
            f"e.g. {lines[0][:160]}"]


def sglang_load_problems(ckpt: Checkpoint, inspection: Inspection) -> tuple[list[str], set[str]]:
    """Problems SGLang would not report, each naming its tensor, and the modules they cover."""
    shapes = linear_shapes(inspection.config)
    problems: list[str] = []
    covered: set[str] = set()
    for block, modules in _expert_modules(ckpt).items():
        problems += _expert_block(block, modules, shapes, inspection.fp8_block, covered)
    problems += _partial_modules(ckpt, shapes, covered)
    problems += _fused_pairs(ckpt, inspection)
    problems += _shared_w1_w3_scalars(ckpt, inspection)
    return problems, covered


def _expert_modules(ckpt: Checkpoint) -> dict[str, dict[str, dict[str, tuple[str, tuple[int, ...]]]]]:
    blocks: dict[str, dict[str, dict]] = defaultdict(lambda: defaultdict(dict))
    for name, entry in ckpt.tensors.items():
        m = _EXPERT.match(name)
        if m:
            blocks[m["block"]][m["module"]][m["suffix"]] = (entry.dtype, entry.shape)
    return blocks


def _block_format(modules: dict, shapes: dict, fp8_block: tuple[int, int]) -> tuple[Format, dict] | None:
    """The format most of a layer's experts are stored in: the one FusedMoE method SGLang builds."""
    found = Counter()
    params: dict[Format, dict] = {}
    for module, stored in modules.items():
        detected = detect_format({s: v for s, v in stored.items() if s in WEIGHT_PARAMS}, *shapes[module],
                                 fp8_block=fp8_block, name=module) if module in shapes else None
        if detected:
            found[detected[0]] += 1
            params.setdefault(detected[0], detected[1])
    if not found:
        return None
    fmt = found.most_common(1)[0][0]
    return fmt, params[fmt]


def _expert_block(block: str, modules: dict, shapes: dict, fp8_block: tuple[int, int], covered: set[str]) -> list[str]:
    chosen = _block_format(modules, shapes, fp8_block)
    if chosen is None:
        return []
    fmt, params = chosen
    method = EXPERT_METHOD[fmt]
    problems = []
    for module, stored in sorted(modules.items()):
        if module not in shapes:
            continue
        expected = {p.suffix: (p.dtype, p.shape) for p in linear_storage(fmt, *shapes[module], **params)}
        proj = module.rsplit(".", 1)[1]
        group = "w2" if proj == "w2" else "w13"
        expert = module.split(".")[-2]
        for suffix, (dtype, shape) in sorted(stored.items()):
            name = f"{module}.{suffix}"
            if suffix not in expected:
                target = "weight_scale_inv" if suffix == "scale" else suffix
                problems.append(f"{name}: the {fmt.value} experts of {block} ({method}) have no {group}_{target} "
                                "parameter; SGLang drops this tensor without a log line")
            elif dtype != expected[suffix][0] and frozenset({dtype, expected[suffix][0]}) not in _SAME_BITS:
                problems.append(f"{name}: {dtype} where {fmt.value} experts store {expected[suffix][0]}; SGLang "
                                f"copies it into its {group}_{suffix} parameter with a plain copy_, converting "
                                "the values (no scale applied) without a warning")
            elif tuple(shape) != tuple(expected[suffix][1]):
                problems.append(f"{name}: shape {list(shape)} where {list(expected[suffix][1])} is needed; SGLang "
                                "fails to load it, or zero-pads it silently when only the rows are short")
            else:
                continue
            covered.add(module)
        for suffix in sorted(set(expected) - set(stored)):
            partial = " while its scales are there (a partial module)" if suffix in ("weight", "weight_packed") \
                and set(stored) & {"scale", "weight_scale"} else ""
            problems.append(f"{module}.{suffix}: missing{partial}; SGLang leaves expert {expert}'s {proj} slice of "
                            f"{group}_{'weight_scale_inv' if suffix == 'scale' else suffix} unset, and its own "
                            "'not initialized' warning stays silent while other experts fill the parameter")
            covered.add(module)
    return problems


def _partial_modules(ckpt: Checkpoint, shapes: dict, covered: set[str]) -> list[str]:
    """Dense linears holding a scale but no weight (experts are covered per block)."""
    problems = []
    stored_by_module: dict[str, set[str]] = defaultdict(set)
    for name in ckpt.tensors:
        module, _, suffix = name.rpartition(".")
        stored_by_module[module].add(suffix)
    for module in shapes:
        if ".ffn.experts." in module or module in covered:
            continue
        stored = stored_by_module.get(module, set())
        scales = sorted(stored & {"scale", "weight_scale", "weight_scale_2", "input_scale"})
        if scales and not stored & {"weight", "weight_packed"}:
            problems.append(f"{module}.{scales[0]}: a scale without {module}.weight; SGLang loads the scale and "
                            "leaves the weight unset")
            covered.add(module)
    return problems


def _fused_pairs(ckpt: Checkpoint, inspection: Inspection) -> list[str]:
    """wq_a and wkv, which SGLang concatenates into wqkv_a (SGLANG_OPT_FUSE_WQA_WKV, on by default)."""
    problems = []
    for block in inspection.config.block_prefixes():
        for suffix in ("weight", "scale"):
            q, kv = f"{block}.attn.wq_a.{suffix}", f"{block}.attn.wkv.{suffix}"
            if q not in ckpt.tensors and kv not in ckpt.tensors:
                continue
            dq = ckpt.tensors[q].dtype if q in ckpt.tensors else "absent"
            dkv = ckpt.tensors[kv].dtype if kv in ckpt.tensors else "absent"
            if dq != dkv:
                problems.append(f"{q}: {dq} while {kv} is {dkv}; SGLang fuses the two into wqkv_a and fails "
                                "(mixed FP8 dtypes cannot be concatenated; a missing partner trips an assert)")
    return problems


def _shared_w1_w3_scalars(ckpt: Checkpoint, inspection: Inspection) -> list[str]:
    """NVFP4 experts: w1 and w3 must share weight_scale_2 and input_scale."""
    problems = []
    for module, info in inspection.modules.items():
        if info.format is not Format.NVFP4 or not module.endswith(".w1"):
            continue
        partner = module[:-1] + "3"
        for suffix, consequence in (
            ("input_scale", "SGLang keeps one input_scale per expert for w1 and w3 and the later one wins"),
            ("weight_scale_2", "SGLang's sm_90/sm_120 NVFP4 runners (Marlin, FlashInfer CUTLASS) apply w1's to "
                               "both halves"),
        ):
            a, b = f"{module}.{suffix}", f"{partner}.{suffix}"
            if a not in ckpt.tensors or b not in ckpt.tensors:
                continue
            va, vb = ckpt.read(a), ckpt.read(b)
            if not torch.equal(va.reshape(-1), vb.reshape(-1)):
                problems.append(f"{b}: {float(vb.reshape(-1)[0]):.6g} differs from {a} "
                                f"({float(va.reshape(-1)[0]):.6g}); {consequence}")
    return problems
