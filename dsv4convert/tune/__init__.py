"""``dsv4convert tune``: SGLang's Triton fused-MoE tile configs for this GPU and this checkpoint's shapes.

Data flows one way: the checkpoint's expert format and shapes (``problem``) -> the candidate
tiles this GPU can hold (``space``) -> each candidate run through SGLang's own kernel, checked
against SGLang's default config and timed (``workload``, ``search``) -> JSON files named and
placed as SGLang 0.5.23 looks them up, merged with the files it ships (``output``).
``sglang_moe`` is the one module that imports SGLang. Nothing here imports torch or SGLang at
package import, so ``serve`` can use ``output.tuned_config_env`` cheaply.
"""

# SGLang's own tuner's default batch sizes (benchmark/kernels/fused_moe_triton/common_utils.py); `tune --help` shows
# them without loading torch.
DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256, 512, 1024, 1536, 2048, 3072, 4096)
