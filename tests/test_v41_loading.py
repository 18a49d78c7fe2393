"""The tiny V4.1 (``synth --preset tiny-v41``) through SGLang 0.5.23's real V4.1 model and ``load_weights``, #53.

SGLang's ``DeepseekV4ForCausalLM`` with ``is_dsv41`` (vision tower built, Engram hasher built from the shipped
tokenizer) is built on CPU for each GPU family and loads the checkpoint through its own loader
(``sglang_v41_oracle``: what is faked and why). SGLang only warns about a tensor it has no place for and not at
all about a parameter no tensor filled, so completeness is proved here:

* every backbone and vision tensor reaches a parameter: directly (the weight loader it was handed to wrote that
  parameter), or, where SGLang builds a new tensor from two (``wq_a`` + ``wkv`` fused into ``wqkv_a``; on sm_100
  and later the ratio-2 compressor's ``wkv`` + ``wgate`` into ``wkv_gate``; ``wo_a`` dequantized to BF16 with its
  scale), by the parameter holding its bytes (our own dequantizer for ``wo_a``);
  the Engram tables land byte for byte (FP8 codes and E8M0 scales);
* every parameter element is written (sentinel loads), but the FP8 KV-cache scales no V4 checkpoint carries;
* only the DSpark drafter's ``mtp.*`` tensors are left to the draft model (not loaded here).

A checkpoint with one vision tensor removed loads without an error in SGLang; the check above names it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import sglang_oracle as sgl
import sglang_v41_oracle as v41
import torch
from conftest import V41_DROPPED
from safetensors import safe_open

from dsv4convert.formats import dequantize_fp8_block, e8m0_scale_to_float32



@pytest.fixture(scope="module")
def tiny(tiny_v41) -> Path:
    return tiny_v41


def _tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    out = {}
    for shard in sorted(set(index.values())):
        with safe_open(ckpt / shard, "pt") as f:
            out.update({name: f.get_tensor(name) for name in f.keys()})
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def unaccounted(ckpt: Path, loaded: sgl.LoadedModel) -> list[str]:
    """Checkpoint tensors found in no parameter of the target model (see the module's docstring)."""
    tensors = _tensors(ckpt)
    q_lora = json.loads((ckpt / "config.json").read_text())["text_config"]["q_lora_rank"]
    missing = []
    for name, tensor in tensors.items():
        if name.startswith("mtp."):
            continue
        module, _, kind = name.rpartition(".")
        param = f"model.{module.replace('.attn.', '.self_attn.')}"
        if name.endswith((".attn.wkv.weight", ".attn.wkv.scale")):
            fused = loaded.params[param.replace(".wkv", ".wqkv_a") + (".weight" if kind == "weight"
                                                                       else ".weight_scale_inv")]
            rows = q_lora if kind == "weight" else q_lora // 32
            want = tensor if kind == "weight" else e8m0_scale_to_float32(tensor)
            found = torch.equal(_bits(fused[rows:]), _bits(want))
        elif name.endswith((".compressor.wkv.weight", ".compressor.wgate.weight")) and \
                f"{param.rsplit('.', 1)[0]}.wkv_gate.weight" in loaded.params:   # fused where the ratio is 2 on sm_100+
            fused = loaded.params[f"{param.rsplit('.', 1)[0]}.wkv_gate.weight"]
            half = tensor.shape[0]
            part = fused[:half] if name.endswith(".wkv.weight") else fused[half:]
            found = torch.equal(_bits(part), _bits(tensor))
        elif name.endswith(".attn.wo_a.scale"):
            weight = tensors[f"{module}.weight"]
            want = dequantize_fp8_block(weight, tensor, block=(32, 32)).to(torch.bfloat16)
            found = torch.equal(_bits(loaded.params[f"{param}.weight"]), _bits(want))
        else:
            found = bool(loaded.reached.get(name))
        if not found:
            missing.append(name)
    return missing


def unwritten(loaded: sgl.LoadedModel) -> list[str]:
    never = tuple(f".{suffix}" for suffix in sgl.NEVER_LOADED)
    return [n for n, w in loaded.written.items() if not w.all() and not n.endswith(never)]


@pytest.mark.parametrize("gpu", ["sm90", "sm100", "sm120"])
def test_sglang_v41_loads_every_tensor_into_every_parameter(tiny, gpu):
    loaded = v41.load_checkpoint(tiny, gpu=gpu)
    assert loaded.error is None and loaded.not_found == [], (loaded.error, loaded.error_tensor, loaded.not_found)
    assert loaded.model.config.model_type == "deepseek_v41"
    assert any(n.startswith("vision.blocks.1.") for n in loaded.params)        # the vision tower is built
    assert unaccounted(tiny, loaded) == []
    assert unwritten(loaded) == []
    tensors = _tensors(tiny)
    for layer in (1, 2):                                                        # Engram: byte for byte
        for kind in ("weight", "scale"):
            name = f"layers.{layer}.engram.embed.{kind}"
            assert torch.equal(_bits(loaded.params[f"model.{name}"]), _bits(tensors[name])), name
    not_loaded = {n for n in loaded.yielded if not loaded.reached.get(n)}
    rebuilt = (".attn.wkv.weight", ".attn.wkv.scale", ".attn.wo_a.scale", ".compressor.wkv.weight",
               ".compressor.wgate.weight")               # value-checked by unaccounted() above
    assert {n for n in not_loaded if not n.startswith("mtp.")} <= {n for n in tensors if n.endswith(rebuilt)}


def test_a_missing_vision_tensor_loads_silently_in_sglang_and_is_named_here(tiny_v41_missing_vision):
    broken = tiny_v41_missing_vision
    loaded = v41.load_checkpoint(broken, gpu="sm90")
    assert loaded.error is None                                                 # SGLang does not object
    assert unwritten(loaded) == [V41_DROPPED]
