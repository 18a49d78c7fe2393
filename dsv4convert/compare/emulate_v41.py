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
from torch import nn

from dsv4convert.compare.emulate import (
    Installed,
    Quantize,
    expert_quantizers,
    layer_input_scales,
    on_input,
    token_groups,
)
from dsv4convert.engines.sglang.numerics import V41Serving
from dsv4convert.formats.activations import mxfp8_activations
from dsv4convert.model.v41.weights import WeightSource
from dsv4convert.model.v41.dspark import dspark_of
from dsv4convert.models.deepseek_v4.names import DSparkNames, in_draft

ROUTED = re.compile(r"^ffn\.experts\.(\d+)\.(w[123])$")



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
    """One scheme's experts of a block: each expert's ``w1``/``w3`` input and ``w2`` input (:func:`.emulate.
    expert_quantizers`, the NVFP4 scale over the experts the block holds)."""
    fc1, fc2 = expert_quantizers(
        scheme, group, f"{block_name}.ffn.experts",
        lambda: layer_input_scales(lambda n: source.ckpt.read(n) if n in source.ckpt.tensors else None, block_name,
                                   sorted({e for e, _, _ in modules}), source.ckpt.root, source.device))
    for _, proj, module in modules:
        installed.hook(module.register_forward_pre_hook(on_input(fc2 if proj == "w2" else fc1)))
