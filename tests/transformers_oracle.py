"""transformers' own DeepSeek-V4 implementation as a test oracle (an implementation we did not write).

``load`` reads a checkpoint directory the way transformers does: native FP8/MXFP4 tensors are
dequantized by transformers' FineGrainedFP8 loader, plain BF16 checkpoints load as they are.
The model is then cast to float32, which is exact for every stored format here: transformers
keeps some modules in FP32 and others in BF16 depending on the load path, and a model whose
modules disagree on dtype does not run, while one in float32 computes the same way for every
checkpoint, so logits of two checkpoints are equal exactly when their weights are.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoTokenizer, DeepseekV4ForCausalLM, FineGrainedFP8Config


def load(path: Path) -> tuple[DeepseekV4ForCausalLM, dict]:
    quantized = "quantization_config" in json.loads((Path(path) / "config.json").read_text())
    kwargs = {"quantization_config": FineGrainedFP8Config(dequantize=True)} if quantized else {}
    model, info = DeepseekV4ForCausalLM.from_pretrained(
        path, dtype=torch.bfloat16, output_loading_info=True, **kwargs)
    return model.float().eval(), info


def prompt_ids(path: Path, text: str = "The quick brown fox jumps over the lazy dog. 0123456789") -> torch.Tensor:
    return AutoTokenizer.from_pretrained(path)(text, return_tensors="pt").input_ids


@torch.no_grad()
def logits(path: Path, ids: torch.Tensor) -> torch.Tensor:
    model, _ = load(path)
    return model(ids).logits.float()
