"""Closed-form primitives shared by every format: E2M1 codes, nibble packing, E8M0 exponents.

Everything here is exact integer or table arithmetic on torch tensors (any device), so the
format modules can be proven bit-exact against each other. Conventions (formats.md §1):

* E2M1 code: bit 3 is the sign, bits 2..0 index ``[0, 0.5, 1, 1.5, 2, 3, 4, 6]``.
* Two codes per byte, element ``2j`` in the low nibble and ``2j+1`` in the high nibble.
* E8M0 byte ``b`` is ``2**(b - 127)``; byte 255 is NaN and is rejected.
"""

from __future__ import annotations

import functools

import torch

from dsv4convert.errors import FormatError

E2M1_MAX = 6.0
E4M3_MAX = 448.0
# E4M3 holds 2**k exactly for k in [-9, 8] (2**-9 is its smallest subnormal).
E4M3_MIN_EXP = -9
E4M3_MAX_EXP = 8
E8M0_BIAS = 127
E8M0_NAN_BYTE = 255

E2M1_VALUES: tuple[float, ...] = (
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
    -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
)

# RNE decision thresholds on |x| (formats.md §1): crossing a ">" threshold means ties go
# down (to the even code below), crossing a ">=" threshold means ties go up.
_E2M1_ROUND_DOWN_TIES = (0.25, 1.25, 2.5, 5.0)
_E2M1_ROUND_UP_TIES = (0.75, 1.75, 3.5)


@functools.lru_cache(maxsize=None)
def e2m1_table(device: torch.device) -> torch.Tensor:
    """The 16 E2M1 values as a float32 tensor on ``device``, indexed by code."""
    return torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)


@functools.lru_cache(maxsize=None)
def e2m1_pair_table(device: torch.device) -> torch.Tensor:
    """float32 ``[256, 2]``: the (even, odd) element values of every packed byte.

    Decoding a whole byte with one gather halves the indexing work of a per-nibble decode.
    """
    byte = torch.arange(256, device=device)
    values = e2m1_table(device)
    return torch.stack([values[byte & 0xF], values[byte >> 4]], dim=-1)


def require_finite(values: torch.Tensor, name: str | None, what: str = "values") -> None:
    """Raise FormatError when ``values`` holds NaN or Inf.

    Callers pass an already reduced tensor (a block amax) where they have one: NaN and
    Inf propagate through amax, so the check costs nothing extra on the full weight.
    """
    if not bool(torch.isfinite(values).all()):
        raise FormatError(f"{what} contain NaN or Inf; refusing to quantize", tensor=name)


def encode_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round ``x`` to the nearest E2M1 code, ties to even, saturating at ±6.

    Returns uint8 codes in [0, 15]. The sign comes from the sign bit, as the hardware
    cvt and compressed-tensors do, so ``-0.1`` encodes as code 8 (negative zero).
    NaN input has no code; callers reject it before encoding.
    """
    magnitude = x.abs().float()
    codes = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for threshold in _E2M1_ROUND_DOWN_TIES:
        codes += magnitude > threshold
    for threshold in _E2M1_ROUND_UP_TIES:
        codes += magnitude >= threshold
    codes |= torch.signbit(x).to(torch.uint8) << 3
    return codes


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """float32 values of E2M1 codes (uint8, one code per element)."""
    table = e2m1_table(codes.device)
    return table.index_select(0, codes.reshape(-1).to(torch.int32)).reshape(codes.shape)


def decode_e2m1_packed(packed: torch.Tensor) -> torch.Tensor:
    """float32 ``[..., 2*B]`` values of packed bytes ``[..., B]`` (int8 or uint8)."""
    flat = packed.reshape(-1).view(torch.uint8).to(torch.int32)
    pairs = e2m1_pair_table(packed.device).index_select(0, flat)
    return pairs.reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def pack_nibbles(codes: torch.Tensor, *, name: str | None = None) -> torch.Tensor:
    """Pack 4-bit codes ``[..., K]`` into uint8 ``[..., K/2]``, even element in the low nibble."""
    if codes.shape[-1] % 2:
        raise FormatError(f"cannot pack an odd number of 4-bit codes ({codes.shape[-1]})", tensor=name)
    codes = codes.to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_nibbles`: uint8 codes ``[..., 2*B]`` from bytes ``[..., B]``."""
    packed = packed.view(torch.uint8)
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def e8m0_max_byte(scale: torch.Tensor, *, name: str | None = None) -> int:
    """The largest raw byte of an E8M0 scale (float8_e8m0fnu or uint8; 0 if empty), rejecting the
    NaN byte: 0xFF is the largest byte, so one max does both."""
    if scale.dtype not in (torch.float8_e8m0fnu, torch.uint8):
        raise FormatError(f"E8M0 scale must be float8_e8m0fnu or uint8, got {scale.dtype}", tensor=name)
    raw = scale.view(torch.uint8)
    top = int(raw.amax()) if raw.numel() else 0
    if top == E8M0_NAN_BYTE:
        raise FormatError("E8M0 scale holds the NaN byte 0xFF", tensor=name)
    return top


def e8m0_bytes(scale: torch.Tensor, *, name: str | None = None) -> torch.Tensor:
    """The raw bytes of an E8M0 scale (float8_e8m0fnu or uint8), rejecting the NaN byte."""
    e8m0_max_byte(scale, name=name)
    return scale.view(torch.uint8)


def e8m0_to_exponent(scale: torch.Tensor, *, name: str | None = None) -> torch.Tensor:
    """int32 exponents ``byte - 127`` of an E8M0 scale."""
    return e8m0_bytes(scale, name=name).to(torch.int32) - E8M0_BIAS


def exponent_to_e8m0(exponent: torch.Tensor, *, name: str | None = None) -> torch.Tensor:
    """float8_e8m0fnu holding ``2**exponent``; exponents must lie in [-127, 127]."""
    if exponent.numel() and (int(exponent.min()) < -E8M0_BIAS or int(exponent.max()) > E8M0_BIAS):
        raise FormatError(
            f"exponent range [{int(exponent.min())}, {int(exponent.max())}] is outside E8M0's [-127, 127]",
            tensor=name,
        )
    return (exponent.to(torch.int32) + E8M0_BIAS).to(torch.uint8).view(torch.float8_e8m0fnu)


def exp2_float32(exponent: torch.Tensor) -> torch.Tensor:
    """Exact float32 ``2**exponent`` for int exponents in [-149, 127], built from the bits.

    Normal powers are ``(e + 127) << 23``; below 2**-126 the single set bit moves into the
    mantissa (float32 subnormals), which E8M0 byte 0 (2**-127) needs.
    """
    e = exponent.to(torch.int32)
    normal_bits = (e + 127).clamp(min=1) << 23
    subnormal_bits = torch.ones_like(e) << (e + 149).clamp(min=0, max=22)
    return torch.where(e >= -126, normal_bits, subnormal_bits).view(torch.float32)


def e8m0_to_float(scale: torch.Tensor, *, name: str | None = None) -> torch.Tensor:
    """Exact float32 value ``2**(byte - 127)`` of an E8M0 scale (byte 0 is a float32 subnormal)."""
    return exp2_float32(e8m0_to_exponent(scale, name=name))


def divide(x: torch.Tensor, divisor: float) -> torch.Tensor:
    """``x / divisor``, correctly rounded on every device.

    On CUDA, torch turns division by a Python scalar into multiplication by its rounded
    reciprocal, which can differ in the last bit from CPU results; dividing by a 0-dim
    tensor on x's device keeps conversions bit-identical wherever they run.
    """
    return x / torch.tensor(divisor, dtype=x.dtype, device=x.device)


def ceil_log2(x: torch.Tensor) -> torch.Tensor:
    """int32 ``ceil(log2(x))`` of positive float32 ``x``, exact (no float log).

    frexp gives ``x = m * 2**e`` with m in [0.5, 1): x is a power of two exactly when
    m == 0.5, in which case ceil(log2 x) = e - 1, otherwise it is e.
    """
    mantissa, exponent = torch.frexp(x.float())
    return exponent - (mantissa == 0.5).to(torch.int32)
