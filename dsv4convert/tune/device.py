"""The GPU a tune runs on: what SGLang names it, and what its blocks can hold."""

from __future__ import annotations

from dataclasses import dataclass

from dsv4convert.kernels._runtime import family_of_capability, interpreting
from dsv4convert.kernels.configs import SHARED_MEMORY_LIMIT
from dsv4convert.tune.problem import TuneError


@dataclass(frozen=True)
class Device:
    """One GPU (or, in tests, Triton's interpreter standing in for one)."""

    name: str
    capability: tuple[int, int]
    shared_memory: int        # bytes of shared memory one block may use (opt-in)
    torch_device: str = "cuda:0"

    @property
    def family(self) -> str:
        return family_of_capability(self.capability[0])

    @property
    def has_tma(self) -> bool:
        """Hopper and later have the tensor memory accelerator SGLang's ``USE_TMA`` configs use."""
        return self.capability >= (9, 0)

    @property
    def timed(self) -> bool:
        """Whether kernel times mean anything here (not in the interpreter)."""
        return self.torch_device != "cpu"

    def describe(self) -> str:
        return (f"{self.name} (sm_{self.capability[0]}{self.capability[1]}, "
                f"{self.shared_memory // 1024} KB shared memory per block)")


def shared_memory_of(capability: tuple[int, int], reported: int | None) -> int:
    """What the driver reports (``shared_memory_per_block_optin``), else the family's known limit
    (sm_120: 99 KB, sm_90/sm_100: 227 KB)."""
    return int(reported) if reported else SHARED_MEMORY_LIMIT[family_of_capability(capability[0])]


def detect() -> Device:
    """CUDA device 0, the one SGLang's ``get_device_name()`` names its config files after."""
    import torch

    if interpreting():
        raise TuneError("TRITON_INTERPRET is set: tune times SGLang's kernels on the GPU that will serve them")
    if not torch.cuda.is_available():
        raise TuneError("no CUDA GPU here: tune times SGLang's kernels on the GPU that will serve them; run it "
                        "there (CUDA_VISIBLE_DEVICES picks which)")
    props = torch.cuda.get_device_properties(0)
    capability = (props.major, props.minor)
    return Device(name=torch.cuda.get_device_name(0), capability=capability,
                  shared_memory=shared_memory_of(capability, getattr(props, "shared_memory_per_block_optin", None)))
