"""SGLang 0.5.23's DeepSeek-V4.1 model as a test oracle: ``sglang_oracle.load_checkpoint`` on a V4.1 checkpoint.

Test helper only. SGLang runs V4.1 in its V4 class (``models/deepseek_v4.py::DeepseekV4ForCausalLM``, ``is_dsv41``:
``configs/deepseek_v41.py::normalize_deepseek_v41_config`` flattens the nested config and renames the
architecture), so :func:`sglang_oracle.load_checkpoint` builds it and runs its own loader and ``load_weights``
with everything that module fakes for a CPU host. V4.1 asks the host two more questions, answered here as a GPU
host of that family would (../shared/reference/v41-flash.md section 9); no load path is replaced:

* FlashInfer's presence, in the two MXFP4 MoE methods (``mxfp4_flashinfer_cutlass_moe.py``,
  ``mxfp4_flashinfer_trtllm_moe.py``): the auto MoE runner for V4.1's MXFP4 experts is ``flashinfer_mxfp4`` on
  sm_90, sm_100 and sm_120, and ``Mxfp4FlashinferCutlassMoEMethod.__init__`` refuses to build without FlashInfer
  (the kernels it would run are not called while loading);
* ``dsv41_sparse.py::fused_low_ratio_compress_supported`` (CUDA capability >= 10: the ratio-2 compressor's
  ``wkv`` and ``wgate`` load fused into ``wkv_gate``), which asks ``torch.cuda`` directly: CPU torch says no
  CUDA, so it is answered from the family's capability.

The Engram hasher is SGLang's own, built with the model from the checkpoint's ``tokenizer.json`` (its compressed
vocabulary must match ``engram_compressed_vocab_size`` or SGLang refuses the model).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from unittest import mock

import sglang_oracle as sgl


@contextlib.contextmanager
def v41_host_fakes(gpu: str) -> Iterator[None]:
    """What building SGLang's V4.1 model asks a CPU host beyond V4's questions, answered as on ``gpu``."""
    import sglang.srt.layers.attention.deepseek_v4_backend as backend
    import sglang.srt.layers.quantization.mxfp4_flashinfer_cutlass_moe as cutlass
    import sglang.srt.layers.quantization.mxfp4_flashinfer_trtllm_moe as trtllm
    from sglang.srt.layers.attention.dsv4 import dsv41_sparse

    fused = sgl.GPU_FACTS[gpu]["major"] >= 10
    with contextlib.ExitStack() as stack:
        for module in (cutlass, trtllm):
            stack.enter_context(mock.patch.object(module, "is_flashinfer_available", lambda: True))
        for module in (dsv41_sparse, backend):
            stack.enter_context(mock.patch.object(module, "fused_low_ratio_compress_supported", lambda: fused))
        yield


def load_checkpoint(model_dir: str | os.PathLike[str], *, gpu: str, env: Mapping[str, str] | None = None,
                    argv: list[str] | None = None) -> sgl.LoadedModel:
    """SGLang's V4.1 target model (vision tower included) built for ``--model-path model_dir`` on ``gpu`` and
    loaded from ``model_dir`` twice (sentinel fills: ``written`` says per element whether loading wrote it)."""
    with v41_host_fakes(gpu):
        return sgl.load_checkpoint(model_dir, ["--model-path", str(model_dir), *(argv or [])], gpu=gpu, env=env)


DSPARK_ARGS = ["--speculative-algorithm", "DSPARK"]  # V4.1's only speculative algorithm (validate_deepseek_v41_features)


def load_draft(model_dir: str | os.PathLike[str], *, gpu: str, env: Mapping[str, str] | None = None) -> sgl.LoadedModel:
    """SGLang's V4.1 DSpark draft (``DeepseekV4ForCausalLMDSpark`` on the V4.1 config, as
    ``--speculative-algorithm DSPARK`` builds it) loaded from ``model_dir``'s ``mtp.*`` tensors, like
    :func:`load_checkpoint`."""
    with v41_host_fakes(gpu):
        return sgl.load_checkpoint(model_dir, ["--model-path", str(model_dir), *DSPARK_ARGS], gpu=gpu, env=env,
                                   draft=True)
