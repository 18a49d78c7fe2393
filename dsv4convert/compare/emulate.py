"""Installing a side's served numerics on one transformers decoder layer, and taking them off.

The layer stays transformers' own; the server's rounding goes in at the tensors it applies to, by
forward hooks (and one instance-level wrapper of the experts' gate), each a pure function of
:mod:`dsv4convert.formats.activations` / :mod:`dsv4convert.formats.kv_cache`:

* dense linears stored FP8 that SGLang runs as W8A8 block GEMMs: their input, per 1x128 token group
  (``wo_a`` only where SGLang keeps it FP8; the compressor, the indexer's ``weights_proj`` and the
  router are built unquantized and stay as they are);
* routed experts: the expert input (one quantization serves every expert: the scale is per token,
  or for NVFP4 the layer's largest ``input_scale``) and the down-projection input (``_apply_gate``'s
  output), by the scheme ``Serving.expert_scheme`` names for the block's stored format;
* the FP8 KV cache: the attention's and the compressors' normalized KV entries as stored (448 FP8
  dims in tiles of 64 with UE8M0 scales, the RoPE dims in BF16);
* the indexer cache: the indexer's queries and compressed keys, rotated, quantized FP8 or FP4 and
  rotated back, right where transformers scores them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from torch import nn

from dsv4convert.compare.numerics import Numerics
from dsv4convert.errors import DSV4Error
from dsv4convert.formats import Format
from dsv4convert.formats.activations import fp8_token_groups, mxfp8_activations, nvfp4_activations
from dsv4convert.formats.kv_cache import indexer_fp4, indexer_fp8, kv_cache_fp8
from dsv4convert.model.blocks import LINEAR_PATHS, MtpEntry, WeightSource
from dsv4convert.models.deepseek_v4.names import DSparkNames, in_draft

Quantize = Callable[[torch.Tensor], torch.Tensor]

# Dense linears SGLang builds with quant_config=None (docs/served-numerics.md): never W8A8.
UNQUANTIZED = frozenset({"attn.compressor.wkv", "attn.compressor.wgate", "attn.indexer.weights_proj",
                         "attn.indexer.compressor.wkv", "attn.indexer.compressor.wgate", "ffn.gate"})


class Installed:
    """The hooks and wrappers put on one layer; ``remove`` restores it."""

    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []

    def hook(self, handle) -> None:
        self._undo.append(handle.remove)

    def wrap(self, owner: object, name: str, replacement: Callable) -> None:
        """Set an instance attribute (shadowing the class's method) until ``remove``."""
        missing = object()
        previous = vars(owner).get(name, missing)
        setattr(owner, name, replacement)

        def undo() -> None:
            if previous is missing:
                delattr(owner, name)
            else:
                setattr(owner, name, previous)
        self._undo.append(undo)

    def remove(self) -> None:
        while self._undo:
            self._undo.pop()()


def on_input(quantize: Callable[[torch.Tensor], torch.Tensor]):
    def pre_hook(module: nn.Module, args: tuple):
        return (quantize(args[0]), *args[1:])
    return pre_hook


def _on_output(quantize: Callable[[torch.Tensor], torch.Tensor]):
    def hook(module: nn.Module, args: tuple, output: torch.Tensor):
        return quantize(output)
    return hook


def _token_groups(scale_format: str, source: WeightSource, name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """A W8A8 block linear's input quantization: one scale per token and per weight block's columns
    (SGLang 0.5.23 ``layers/quantization/fp8_utils.py::cutlass_w8a8_block_fp8_linear_with_fallback``:
    ``per_token_group_quant_fp8(input_2d, block_size[1])``)."""
    return token_groups(scale_format, source.fp8_block[1], name)


def token_groups(scale_format: str, group: int, name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """Per-token-group FP8 of a linear's input in 1 x ``group`` slices, refusing a width the kernel refuses."""
    def quantize(x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] % group:
            raise DSV4Error(f"{name}: input width {x.shape[-1]} is not a multiple of {group}; SGLang's W8A8 "
                            "block GEMM cannot take it")
        return fp8_token_groups(x, group, scale_format=scale_format, name=name)
    return quantize


def install(layer: nn.Module, block: str, numerics: Numerics, source: WeightSource,
            entry: MtpEntry | None = None, *, dspark_stage: bool = False) -> Installed:
    """Put ``numerics`` on ``layer`` (built for ``block`` from ``source``) and on an MTP block's ``entry``.
    A DSpark stage's ``wo_a`` is always a BF16 GEMM (SGLang 0.5.23 ``models/deepseek_v4_dspark.py::
    DSparkAttention.__init__``: ``wo_a_fp8=False``, the FP8 weight dequantized at load)."""
    installed = Installed()
    serving = numerics.serving
    if serving is None or not (numerics.activations or numerics.kv_cache or numerics.indexer):
        return installed
    if numerics.activations:
        _dense(layer, block, serving, source, installed, entry, dspark_stage)
        _experts(layer, block, serving, source, installed)
    if numerics.kv_cache:
        rope = layer.self_attn.config.qk_rope_head_dim
        installed.hook(layer.self_attn.kv_norm.register_forward_hook(
            _on_output(lambda kv: kv_cache_fp8(kv, rope_dim=rope, name=f"{block}.attn.kv"))))
        compressor = getattr(layer.self_attn, "compressor", None)
        if compressor is not None:
            installed.hook(compressor.kv_norm.register_forward_hook(_on_output(
                lambda kv: kv_cache_fp8(kv, rope_dim=rope, bf16_source=True, name=f"{block}.attn.compressor.kv"))))
    if numerics.indexer:
        _indexer(layer, block, numerics.indexer, installed)
    return installed


def install_dspark_entry(entry: nn.Module, numerics: Numerics, source: WeightSource, installed: Installed) -> None:
    """A DSpark drafter's ``main_proj`` stored FP8 runs as a W8A8 block GEMM like every quantized dense linear
    (SGLang 0.5.23 ``models/deepseek_v4_dspark.py``: a ``ReplicatedLinear`` built with the ``quant_config``)."""
    name = DSparkNames.entry_proj
    if numerics.serving is None or not numerics.activations or source.format_of(name) is not Format.FP8:
        return
    quantize = _token_groups(numerics.serving.dense_scale_format(), source, name)
    installed.hook(entry.main_proj.register_forward_pre_hook(on_input(quantize)))


def _dense(layer: nn.Module, block: str, serving, source: WeightSource, installed: Installed,
           entry: MtpEntry | None, dspark_stage: bool) -> None:
    dense = serving.dense_scale_format()
    for suffix, path in LINEAR_PATHS.items():
        if source.format_of(f"{block}.{suffix}") is not Format.FP8 or suffix in UNQUANTIZED:
            continue
        scale_format = dense
        if suffix == "attn.wo_a":
            scale_format = None if dspark_stage else serving.wo_a()
            if scale_format is None:
                continue        # dequantized to BF16 at load: a BF16 GEMM
        target = layer.get_submodule(path.rsplit(".", 1)[0])
        installed.hook(target.register_forward_pre_hook(on_input(_token_groups(scale_format, source, f"{block}.{suffix}"))))
    if entry is not None:
        fmts = {source.format_of(f"{block}.{p}") for p in ("e_proj", "h_proj")}
        if fmts == {Format.FP8}:
            installed.wrap(entry, "quantize", _token_groups(dense, source, f"{block}.e_proj/h_proj"))


def _experts(layer: nn.Module, block: str, serving, source: WeightSource, installed: Installed) -> None:
    first = source.format_of(f"{block}.ffn.experts.0.w1")
    if first is None:
        return
    scheme = serving.expert_scheme(first, is_mtp=in_draft(block))
    if scheme is None:
        return
    experts = layer.mlp.experts
    fc1, fc2 = expert_quantizers(scheme, source.fp8_block[1], f"{block}.ffn.experts",
                                 lambda: layer_input_scales(source.stored_tensor, block, range(experts.num_experts),
                                                            source.ckpt.root, source.device))
    installed.hook(experts.register_forward_pre_hook(on_input(fc1)))
    gate = experts._apply_gate
    installed.wrap(experts, "_apply_gate", lambda gate_up: fc2(gate(gate_up)))


def expert_quantizers(scheme: str, group: int, name: str,
                      input_scales: Callable[[], tuple[torch.Tensor, torch.Tensor]]) -> tuple[Quantize, Quantize]:
    """The routed experts' activation quantization by ``Serving.expert_scheme``'s ``scheme``, either release: (the
    experts' input, the down projection's input). ``fp8``: per-token-group FP8 in 1 x ``group`` slices, float32
    scales (``Fp8MoEMethod``, Triton); ``mxfp8``; ``nvfp4``: W4A4 with the layer's largest ``input_scale`` for each
    (``input_scales()``, read only then)."""
    if scheme in ("fp8", "mxfp8"):
        quantize = (token_groups("float32", group, name) if scheme == "fp8"
                    else lambda x: mxfp8_activations(x, name=name))
        return quantize, quantize
    if scheme == "nvfp4":
        w13, w2 = input_scales()
        return (lambda x: nvfp4_activations(x, w13, name=f"{name} (w1/w3 input)"),
                lambda x: nvfp4_activations(x, w2, name=f"{name} (w2 input)"))
    raise DSV4Error(f"{name}: no emulation for expert activations {scheme!r}")


def layer_input_scales(read: Callable[[str], torch.Tensor | None], block: str, experts: Iterable[int], root: Path,
                       device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The NVFP4 runners' global activation scales: the largest ``input_scale`` over the layer's ``experts``, for the
    expert input (w1 and w3) and for the down projection (w2) (``modelopt_quant.py::ModelOptNvFp4FusedMoEMethod.
    process_weights_after_loading``: ``w13_input_scale.max()``, ``w2_input_scale.max()``). ``read`` gives a stored
    tensor or None."""
    experts = list(experts)

    def largest(projections: tuple[str, ...]) -> torch.Tensor:
        values = []
        for e in experts:
            for proj in projections:
                name = f"{block}.ffn.experts.{e}.{proj}.input_scale"
                value = read(name)
                if value is None:
                    raise DSV4Error("NVFP4 expert without its input_scale: the W4A4 activations cannot be emulated",
                                    file=root, tensor=name)
                values.append(value.float().reshape(()))
        return torch.stack(values).max().to(device)
    return largest(("w1", "w3")), largest(("w2",))


def _indexer(layer: nn.Module, block: str, kind: str, installed: Installed) -> None:
    compressor = getattr(layer.self_attn, "compressor", None)
    indexer = getattr(compressor, "indexer", None)
    if indexer is None:
        return                  # sliding-window and HCA layers have no indexer
    quantize = {"fp8": indexer_fp8, "fp4": indexer_fp4}[kind]
    memo: dict[str, object] = {}

    def new_sequence(module, args):
        position_ids = args[2]
        if int(position_ids.reshape(-1)[0]) == 0:
            memo.clear()

    def scored(module, args):
        q, keys, hidden = args
        # The pool only grows (transformers' cache appends): quantize each stored key once, as the server does.
        done = memo.get("keys")
        start = 0 if done is None or done.shape[:-2] != keys.shape[:-2] else done.shape[-2]
        fresh = (quantize(keys[..., start:, :], out_dtype=torch.float32, name=f"{block}.attn.indexer keys")
                 if keys.shape[-2] > start else None)
        pool = fresh if start == 0 else (done if fresh is None else torch.cat([done, fresh], dim=-2))
        memo["keys"] = pool
        # The scorer computes in float32; the rotated-back values are not BF16 numbers, so keep them float32.
        return quantize(q, out_dtype=torch.float32, name=f"{block}.attn.indexer queries"), pool, hidden

    installed.hook(indexer.register_forward_pre_hook(new_sequence))
    installed.hook(indexer.scorer.register_forward_pre_hook(scored))
