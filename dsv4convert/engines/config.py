"""The quantization config of an output made for one or both engines, and which engines can load it.

SGLang's config (:mod:`dsv4convert.engines.sglang.quant_config`) is the base of every output; where vLLM
is asked for too, vLLM's refusals run first and its keys are added on top
(:mod:`dsv4convert.engines.vllm.quant_config`), and ``producer.engines`` records the engines the output was
made and checked for.
"""

from __future__ import annotations

from dsv4convert import __version__
from dsv4convert.engines import ENGINES, GPU_FAMILIES, SGLANG, VLLM, choice_of, engines_for
from dsv4convert.engines.sglang import quant_config as sglang
from dsv4convert.engines.stored import StoredFormats, analyse
from dsv4convert.engines.vllm import quant_config as vllm
from dsv4convert.errors import RecipeError
from dsv4convert.formats import Format

ModuleFormats = dict[str, tuple[Format, dict]]


def _problems(stored: StoredFormats) -> dict[str, tuple[str, str] | None]:
    """Per engine: None if it loads what is stored, else (module, reason)."""
    try:
        sglang.check(stored)
        sglang_problem = None
    except RecipeError as exc:
        sglang_problem = (exc.tensor or "", exc.detail)
    return {VLLM: vllm.vllm_problem(stored), SGLANG: sglang_problem}   # vLLM's first, as refusals name them


def servable_engines(source_config: dict, module_formats: ModuleFormats) -> dict[str, str | None]:
    """Per engine: None if it can load these stored formats, else ``module: reason``."""
    problems = _problems(analyse(source_config, module_formats))
    return {e: (f"{p[0]}: {p[1]}" if p[0] else p[1]) if (p := problems[e]) else None for e in ENGINES}


def build_quant_config(source_config: dict, module_formats: ModuleFormats, *,
                       engines: tuple[str, ...] = (SGLANG,)) -> tuple[dict, dict[str, dict]]:
    """The output's ``config.json`` and extra JSON files (name -> object) for what is stored.

    ``module_formats`` maps every linear module (native name, e.g. ``layers.3.ffn.experts.7.w1``)
    to its stored format and parameters (``group_size`` for INT4, ``fp8_scale_dtype`` for FP8).
    Raises ``RecipeError`` naming the engine and a module when an engine of ``engines`` could not
    load the combination.
    """
    stored = analyse(source_config, module_formats)
    problems = [p for e, p in _problems(stored).items() if e in engines and p]
    if problems:
        first = problems[0][0]
        reasons = [reason if module == first else f"{module}: {reason}" for module, reason in problems]
        raise RecipeError(f"--engine {choice_of(engines)}: {'; and '.join(reasons)}", tensor=first or None)
    config, extra = sglang.quant_config(source_config, stored, sglang=SGLANG in engines)
    if VLLM in engines:
        vllm.add_keys(config, extra, stored, source_config["num_hidden_layers"])
    if tuple(engines) != (SGLANG,) and "quantization_config" in config:
        producer = {"name": "dsv4convert", "version": __version__}
        config["quantization_config"].setdefault("producer", producer)["engines"] = list(engines)
    return config, extra


def output_module(module: str, engines: tuple[str, ...]) -> str:
    """A module's name in an output made for ``engines``: the release's, or vLLM's where its loader reads another
    (both engines then read that one)."""
    return vllm.vllm_module_name(module) if VLLM in engines else module


def v41_config(source_config: dict, variant: str, asked: str | None) -> tuple[dict, tuple[str, ...], str | None]:
    """A DeepSeek-V4.1 output's ``config.json`` (the release's, ``text_config`` and ``vision_config`` as they are,
    only ``quantization_config`` rewritten for ``variant``: SGLang's, which vLLM must read the same way), the engines
    it is for, and a note where the default could not be both. An engine asked for (``asked``: sglang, vllm, both)
    that cannot load the variant is refused, naming it."""
    qc = sglang.v41_quant_config(source_config.get("quantization_config") or {}, variant)
    problem = vllm.v41_problem(qc, variant)
    engines, note = (ENGINES, None) if asked is None else (engines_for(asked), None)
    if problem and VLLM in engines:
        if asked is not None:
            raise RecipeError(f"--engine {asked}: {problem}")
        engines, note = (SGLANG,), f"engine: sglang only ({problem})"
    written = {**qc, "producer": {"name": "dsv4convert", "version": __version__, "engines": list(engines)}} \
        if qc is not None else None
    config = {k: (written if k == "quantization_config" else v) for k, v in
              {**source_config, "quantization_config": None}.items()}
    if written is None:
        del config["quantization_config"]
    return config, engines, note


def v41_variant_of(config: dict) -> str:
    """The V4.1 variant a checkpoint's ``quantization_config`` describes (:func:`v41_config`'s inverse): the release
    (MXFP4 experts), fp8 (``expert_dtype`` fp8), nvfp4 (ModelOpt's hybrid: ``moe_quant_algo`` NVFP4), w4a16
    (compressed-tensors) or bf16 (none at all). ``fit --model``, ``serve`` and ``validate`` read a checkpoint's variant
    here, and ``fit`` checks it against the experts' stored dtype."""
    qc = config.get("quantization_config")
    if qc is None:
        return "bf16"
    if qc.get("quant_method") == "compressed-tensors":
        return "w4a16"
    if str(qc.get("moe_quant_algo") or "").upper() == "NVFP4":
        return "nvfp4"
    return "fp8" if qc.get("expert_dtype") == "fp8" else "native"


def v41_families(variant: str) -> dict[str, dict[str, str | None]]:
    """Per engine and GPU family: None where the engine runs a V4.1 ``variant`` there, else why not."""
    return {SGLANG: {f: sglang.v41_family_problem(variant, f) for f in GPU_FAMILIES},
            VLLM: {f: vllm.v41_family_problem(variant, f) for f in GPU_FAMILIES}}
