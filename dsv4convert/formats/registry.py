"""The format registry: one spec per weight format, and the one name each format has everywhere.

A :class:`FormatSpec` answers everything the rest of the tool asks about a format, so no feature
branches on the format itself: how a linear ``W[N, K]`` is stored (suffixes, dtypes, shapes) and
recognised, how it decodes to float, how it is made from each source format, its bytes, the operands
the kernels take and which calibration a conversion to it can use. The specs live in
:mod:`dsv4convert.formats.specs` (one registered class per format, as compressed-tensors registers
its compressors); adding a format is one class there (docs/architecture.md, "add a weight format").

Pure: no file I/O. A spec that keeps a source tensor's bytes (NVFP4 keeps MXFP4's codes) says so with
:class:`Passthrough`, and reads the few bytes it needs through the ``read_codes`` callable it is given.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Callable, ClassVar

import torch

from dsv4convert.dtypes import nbytes
from dsv4convert.errors import FormatError
from dsv4convert.format_names import Format  # the one name each format has (a leaf: the CLI reads it)


class Calibration(str, Enum):
    """What measured data a conversion to a format can use."""

    ACTIVATION_AMAX = "activation amax"   # NVFP4's input_scale: a calibration file, another checkpoint, or a bound
    HESSIAN = "hessian"                   # INT4 by GPTQ: the layer inputs' Hessians (optional)


@dataclass(frozen=True)
class StoredParam:
    """One tensor of a module in a format: the suffix after the module name, its dtype and shape."""

    suffix: str
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Passthrough:
    """An output tensor whose bytes are the source parameter ``param``'s, reinterpreted as ``dtype``."""

    param: str
    dtype: str | None = None


@dataclass
class EncodeInput:
    """What making one module in a format may use: the source (its format and the tensors read of it), the
    target's parameters, and the calibration and partner a format asks for."""

    source: Format
    tensors: dict[str, torch.Tensor]           # the source's weight params, except the passthrough ones
    params: dict                               # the target's (group_size, scale_rule, scale_dtype, fp8_block)
    name: str                                  # the module (errors name ``<name>.weight``)
    partner: dict[str, torch.Tensor] = field(default_factory=dict)   # the fused partner's source tensors
    input_scale: torch.Tensor | None = None    # Calibration.ACTIVATION_AMAX
    hessian: torch.Tensor | None = None        # Calibration.HESSIAN (None: round to nearest)
    read_codes: Callable[[list[int], int], torch.Tensor] | None = None  # (byte offsets, length) of a passthrough
    passthrough_shape: tuple[int, ...] | None = None                     # that passthrough's torch shape
    source_params: dict = field(default_factory=dict)   # the source's stored params (an FP8 source's fp8_block)


@dataclass
class Encoded:
    """A module made in a format: ``(suffix, tensor or passthrough)`` in storage order, and what stayed exact."""

    tensors: list[tuple[str, torch.Tensor | Passthrough]]
    report: object | None = None               # formats.transcode.ExactnessReport for lossless transcodes


class FormatSpec:
    """Everything one weight format is; subclasses set the class attributes and implement the methods."""

    format: ClassVar[Format]
    weight_params: ClassVar[tuple[str, ...]]          # the suffixes it stores, in storage order
    kernel_params: ClassVar[tuple[str, ...]] = ()     # the operands the Triton kernels take, in order (): dense
    bits_per_weight: ClassVar[int]                    # bits of one stored weight element (scales aside)
    calibration: ClassVar[Calibration | None] = None  # the measured data a conversion to it can use
    recipe_target: ClassVar[bool] = True              # a recipe may ask for it (MXFP4 is only kept as released)
    recipe_params: ClassVar[dict[str, dict]] = {}     # the params a recipe may give it: name -> JSON schema
    recipe_defaults: ClassVar[dict] = {}              # and their defaults
    fused_partner: ClassVar[bool] = False             # fused w1/w3 pairs share its global scales

    def storage(self, n: int, k: int, *, group_size: int = 128, fp8_scale_dtype: str = "F8_E8M0",
                fp8_block: tuple[int, int] | None = None, dense_dtype: str = "BF16") -> list[StoredParam]:
        """The tensors a linear ``W[n, k]`` is stored as (each spec reads the keywords that apply to it; FP8's
        ``fp8_block`` is the release's and has no default)."""
        raise NotImplementedError

    def storage_keywords(self, stored: dict[str, tuple[str, tuple[int, ...]]], n: int, k: int, *,
                         fp8_block: tuple[int, int] | None = None, name: str | None = None) -> dict | None:
        """The :meth:`storage` keywords ``stored`` (suffix -> dtype, shape) would have been written with, or None
        when it cannot be this format; :func:`detect_format` then compares the whole storage. ``fp8_block`` is
        the release's, for storage that does not say its own; ``name`` is the module errors name."""
        return {}

    def params(self, keywords: dict) -> dict:
        """What a quantization config describes of a stored module (INT4's ``group_size``, FP8's
        ``fp8_scale_dtype`` and ``fp8_block``), from its storage keywords."""
        return {}

    def decode(self, tensors: dict[str, torch.Tensor], name: str, params: dict) -> torch.Tensor:
        """The float32 weight ``[N, K]`` of a module stored in this format with ``params`` (:meth:`params`)."""
        raise NotImplementedError

    def encode(self, inputs: EncodeInput) -> Encoded:
        """This format's tensors for a module stored in ``inputs.source``."""
        raise FormatError(f"no conversion from {inputs.source.value} to {self.format.value}",
                          tensor=f"{inputs.name}.weight")

    def applicable(self, n: int, k: int, source: Format, params: dict) -> str | None:
        """Why a ``[n, k]`` linear stored in ``source`` cannot be made in this format with ``params``, or None."""
        return None

    def unchanged(self, source: Format, source_dtypes: dict[str, str], source_params: dict, params: dict) -> bool:
        """Whether making this format from ``source`` with ``params`` writes the source's bytes unchanged."""
        return source is self.format

    def passthrough(self, source: Format) -> frozenset[str]:
        """Source parameters whose bytes the output keeps (copied file to file, never read)."""
        return frozenset()

    def partner_params(self, source: Format) -> frozenset[str] | None:
        """The fused partner's source parameters a conversion from ``source`` reads (None: no partner)."""
        return None


REGISTRY: dict[Format, FormatSpec] = {}


def register(cls: type[FormatSpec]) -> type[FormatSpec]:
    """Class decorator: the one spec of ``cls.format``."""
    if cls.format in REGISTRY:
        raise ValueError(f"format {cls.format.value} is registered twice")
    REGISTRY[cls.format] = cls()
    return cls


def spec(fmt: Format | str) -> FormatSpec:
    """The spec of a format (or of its name)."""
    try:
        return REGISTRY[Format(fmt)]
    except (KeyError, ValueError):
        raise FormatError(f"unknown weight format {fmt!r}; expected one of "
                          f"{', '.join(f.value for f in REGISTRY)}") from None


def linear_storage(fmt: Format, n: int, k: int, **keywords) -> list[StoredParam]:
    """The tensors (suffix after the module name, dtype, shape) a linear ``W[n, k]`` needs in ``fmt``."""
    return spec(fmt).storage(n, k, **keywords)


def detect_format(stored: dict[str, tuple[str, tuple[int, ...]]], n: int, k: int, *,
                  fp8_block: tuple[int, int] | None = None, name: str | None = None) -> tuple[Format, dict] | None:
    """Which format a module's stored tensors (suffix -> dtype, shape) are in, given its logical shape
    ``[n, k]``: (format, its recipe parameters) when they match one format's storage exactly, else None.

    An FP8 module's block is read from its shapes, ``fp8_block`` (the release's) where they leave it open;
    FormatError naming ``name`` where neither decides."""
    for fmt, one in REGISTRY.items():
        keywords = one.storage_keywords(stored, n, k, fp8_block=fp8_block, name=name)
        if keywords is None:
            continue
        expected = {p.suffix: (p.dtype, p.shape) for p in one.storage(n, k, **keywords)}
        if expected == stored:
            return fmt, one.params(keywords)
    return None


def stored_params(fmt: Format, stored: dict[str, tuple[str, tuple[int, ...]]], n: int, k: int, *,
                  fp8_block: tuple[int, int] | None = None, name: str | None = None) -> dict:
    """:meth:`FormatSpec.params` of a module stored as ``stored`` (suffix -> dtype, shape) in ``fmt``."""
    one = spec(fmt)
    return one.params(one.storage_keywords(stored, n, k, fp8_block=fp8_block, name=name) or {})


def stored_bytes(fmt: Format, n: int, k: int, **keywords) -> int:
    """Bytes a linear ``W[n, k]`` takes in ``fmt``."""
    return sum(nbytes(p.dtype, p.shape) for p in linear_storage(fmt, n, k, **keywords))


def recipe_targets() -> tuple[Format, ...]:
    """The formats a recipe may ask for."""
    return tuple(fmt for fmt, one in REGISTRY.items() if one.recipe_target)


def calibrated_by(kind: Calibration) -> frozenset[Format]:
    """The formats whose conversion uses ``kind`` of calibration."""
    return frozenset(fmt for fmt, one in REGISTRY.items() if one.calibration is kind)
