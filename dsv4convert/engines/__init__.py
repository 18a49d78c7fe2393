"""What each serving engine does with a checkpoint, for the version this tool is pinned to: one home.

Everything the tool knows about SGLang and vLLM lives here, one package per engine, each rule citing the
engine's own file::function: which MoE method runs a format on which GPU family and what the engine refuses
(``rules``), the quantization config it reads (``quant_config``), one server's settings as an object that
renders its command line (``server``), the numerics it serves (``numerics``, SGLang), how it sizes GPU
memory (``memory``) and which per-layer mixes it serves (``mixes``). Features (convert, fit, compare, automix,
serve, validate) read these objects and never parse an engine's command line back.

Following a new engine release: pin the version below, re-read the files each rule cites, and change the
rules and their tests; nothing outside ``engines/`` names an engine's internals (docs/architecture.md).

This module holds what both share: the engines' names and pinned versions, the ``--engine`` choices, and the
GPU families and cards the tool serves on.
"""

from __future__ import annotations

from dataclasses import dataclass

from dsv4convert.errors import DSV4Error

SGLANG, VLLM = "sglang", "vllm"
ENGINES = (SGLANG, VLLM)
# The versions every rule here follows, written once.
VERSIONS = {SGLANG: "0.5.23", VLLM: "0.33.0"}
LABELS = {SGLANG: f"SGLang {VERSIONS[SGLANG]}", VLLM: f"vLLM {VERSIONS[VLLM]}"}
SGLANG_LABEL, VLLM_LABEL = LABELS[SGLANG], LABELS[VLLM]
CHOICES = (SGLANG, VLLM, "both")
NO_DRAFT = "this checkpoint has no MTP draft (made without one, or converted with --no-mtp)"
DEFAULT_CHOICE = "both"


class EngineError(DSV4Error):
    """A choice no engine rule covers: an unknown engine, GPU family or variant."""


def engines_for(choice: str | None) -> tuple[str, ...]:
    """``sglang``/``vllm``/``both`` (None: the default) as the engines an output must load in."""
    choice = choice or DEFAULT_CHOICE
    if choice not in CHOICES:
        raise EngineError(f"unknown engine {choice!r}; expected one of {', '.join(CHOICES)}")
    return ENGINES if choice == "both" else (choice,)


def choice_of(engines: tuple[str, ...] | list[str]) -> str:
    """The ``--engine`` value naming exactly these engines."""
    found = tuple(e for e in ENGINES if e in engines)
    return "both" if found == ENGINES else found[0]


# ---------------------------------------------------------------------------------- GPU families and cards

GPU_FAMILIES = ("sm90", "sm100", "sm120")
# The architecture each family names (what a user knows their card by).
ARCHITECTURES = {"sm90": "Hopper", "sm100": "Blackwell datacenter", "sm120": "Blackwell workstation"}


@dataclass(frozen=True)
class Gpu:
    """One GPU model: the family whose engine rules apply, and its memory as nvidia-smi reports it (MiB)."""

    name: str
    family: str
    mib: int

    @property
    def label(self) -> str:
        return f"{self.name} ({self.family[:-1].replace('sm', 'sm_')}{self.family[-1]})"


# The card each family is served on (nvidia-smi's memory.total, what both engines read).
GPUS: dict[str, Gpu] = {
    "rtx-pro-6000": Gpu("RTX PRO 6000", "sm120", 97887),
    "h200": Gpu("H200", "sm90", 143771),
    "b200": Gpu("B200", "sm100", 183359),
}


def gpu_family_major(gpu_family: str) -> int:
    """The compute capability's major number of a family (sm90 -> 9, sm100 -> 10, sm120 -> 12)."""
    if gpu_family not in GPU_FAMILIES:
        raise EngineError(f"unknown GPU family {gpu_family!r}; expected one of {', '.join(GPU_FAMILIES)}")
    return int(gpu_family[2:-1])


def gpu_of_family(gpu_family: str) -> Gpu:
    """The card the tool serves a family on."""
    gpu_family_major(gpu_family)
    return next(gpu for gpu in GPUS.values() if gpu.family == gpu_family)


def family_label(gpu_family: str) -> str:
    """A family in a user's terms: ``H200-class Hopper``."""
    return f"{gpu_of_family(gpu_family).name}-class {ARCHITECTURES[gpu_family]}"
