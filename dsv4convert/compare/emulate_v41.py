"""Installing SGLang's activation quantization on one DeepSeek-V4.1 block (a layer or a DSpark stage), and taking it
off: V4.1's counterpart of :mod:`.emulate`.

The block stays :mod:`dsv4convert.model.v41`'s own; each linear whose input SGLang quantizes gets a forward
pre-hook that replaces its input by the dequantized values (a pure function of
:mod:`dsv4convert.formats.activations`), so every pass that runs the block's modules (free-running, local, the culprit
pass's components) computes with the served numerics. Which scheme applies to which linear is the engine's rule
(:class:`~dsv4convert.engines.sglang.numerics.V41Serving`), read off the stored format:

* dense linears stored FP8 in 32 x 32 blocks (the attention's ``wq_a``, ``wkv``, ``wq_b``, ``wo_b``, the indexer's
  ``wq_b``, the shared expert, the Engram ``wkv``): their input per 1 x 32 token group
  (:meth:`V41Serving.dense_scale_format`); ``wo_a``, the compressor, the indexer's ``weights_proj``/``wk`` and the
  router are BF16 GEMMs;
* routed experts (``ffn.experts.E.w1/w3`` input, ``w2`` input: ``_apply_gate``'s output in SGLang's fused MoE) by
  :meth:`Serving.expert_scheme` for the stored format: per-token-group FP8 (Triton ``Fp8MoEMethod``), MXFP8
  (``flashinfer_mxfp4`` on sm100/sm120, the NVFP4 hybrid's MXFP4 DSpark stages), NVFP4 W4A4 with the layer's largest
  ``input_scale`` (``flashinfer_trtllm_routed``). Every scheme is per token, so quantizing each expert's rows
  apart gives what the fused kernel's one quantization of the routed input gives.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
from torch import nn

from dsv4convert.compare.emulate import Installed, on_input, token_groups
from dsv4convert.engines.sglang.numerics import V41Serving
from dsv4convert.errors import DSV4Error
from dsv4convert.formats.activations import mxfp8_activations, nvfp4_activations
from dsv4convert.model.v41.weights import WeightSource
from dsv4convert.model.v41.dspark import dspark_of
from dsv4convert.models.deepseek_v4.names import DSparkNames, in_draft

ROUTED = re.compile(r"^ffn\.experts\.(\d+)\.(w[123])$")

Quantize = Callable[[torch.Tensor], torch.Tensor]


def quantizer(scheme: str, group: int, name: str) -> Quantize:
    """The dense or FP8-expert scheme ``scheme`` (``mxfp8``, ``ue8m0``, ``float32``) as a function of the input."""
    if scheme == "mxfp8":
        return lambda x: mxfp8_activations(x, name=name)
    return token_groups(scheme, group, name)


def install(block: nn.Module, block_name: str, serving: V41Serving | None, source: WeightSource) -> Installed:
    """Put ``serving``'s activation quantization on ``block`` (built from ``source`` as ``block_name``: ``layers.N``
    or ``mtp.S``); nothing with ``serving`` None (``--numerics weights``)."""
    installed = Installed()
    if serving is None:
        return installed
    group = source.fp8_block[1]
    linears = {path: m for path, m in block.named_modules() if isinstance(m, nn.Linear)}
    experts: dict[str, list[tuple[int, str, nn.Linear]]] = {}
    for path, module in linears.items():
        fmt, _ = source.stored_format(f"{block_name}.{path}", tuple(module.weight.shape))
        routed = ROUTED.match(path)
        if routed:
            scheme = serving.expert_scheme(fmt, is_mtp=in_draft(block_name))
            if scheme is not None:
                experts.setdefault(scheme, []).append((int(routed[1]), routed[2], module))
            continue
        scheme = serving.dense_scheme(path, fmt)
        if scheme is not None:
            quantize = quantizer(scheme, group, f"{block_name}.{path}")
            installed.hook(module.register_forward_pre_hook(on_input(quantize)))
    for scheme, modules in experts.items():
        _experts(scheme, modules, block_name, source, group, installed)
    return installed


def install_entry(entry: nn.Module, serving: V41Serving | None, source: WeightSource) -> Installed:
    """A DSpark drafter's ``main_proj``: a ``ReplicatedLinear`` built with the quant config
    (``models/deepseek_v4_dspark.py``), so a W8A8 block GEMM when stored FP8."""
    installed = Installed()
    if serving is None:
        return installed
    name = DSparkNames(dspark_of(source.cfg).stages).entry_proj
    fmt, _ = source.stored_format(name, tuple(entry.main_proj.weight.shape))
    scheme = serving.dense_scheme(name, fmt)
    if scheme is not None:
        installed.hook(entry.main_proj.register_forward_pre_hook(on_input(quantizer(scheme, source.fp8_block[1],
                                                                                     name))))
    return installed


def _experts(scheme: str, modules: list[tuple[int, str, nn.Linear]], block_name: str, source: WeightSource,
             group: int, installed: Installed) -> None:
    name = f"{block_name}.ffn.experts"
    if scheme == "fp8":          # Fp8MoEMethod, Triton: sglang_per_token_group_quant_fp8(A, block_k), float32 scales
        fc1 = fc2 = token_groups("float32", group, name)
    elif scheme == "mxfp8":
        fc1 = fc2 = quantizer("mxfp8", group, name)
    elif scheme == "nvfp4":
        w13, w2 = (_largest_input_scale(source, block_name, modules, projections) for projections in
                   (("w1", "w3"), ("w2",)))
        fc1 = lambda x: nvfp4_activations(x, w13, name=f"{name} (w1/w3 input)")  # noqa: E731
        fc2 = lambda x: nvfp4_activations(x, w2, name=f"{name} (w2 input)")  # noqa: E731
    else:
        raise DSV4Error(f"{name}: no emulation for expert activations {scheme!r}")
    for _, proj, module in modules:
        installed.hook(module.register_forward_pre_hook(on_input(fc2 if proj == "w2" else fc1)))


def _largest_input_scale(source: WeightSource, block_name: str, modules: list[tuple[int, str, nn.Linear]],
                         projections: tuple[str, ...]) -> torch.Tensor:
    """The NVFP4 runner's global activation scale: the largest ``input_scale`` over the layer's experts
    (``modelopt_quant.py::ModelOptNvFp4FusedMoEMethod.process_weights_after_loading``: ``w13_input_scale.max()``,
    ``w2_input_scale.max()``)."""
    values = []
    for e in sorted({e for e, _, _ in modules}):
        for proj in projections:
            tensor = f"{block_name}.ffn.experts.{e}.{proj}.input_scale"
            if tensor not in source.ckpt.tensors:
                raise DSV4Error("NVFP4 expert without its input_scale: the W4A4 activations cannot be emulated",
                                file=source.ckpt.root, tensor=tensor)
            values.append(source.ckpt.read(tensor).float().reshape(()))
    return torch.stack(values).max().to(source.device)
