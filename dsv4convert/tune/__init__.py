"""``dsv4convert tune``: SGLang's Triton fused-MoE tile configs for this GPU and this checkpoint's shapes.

Data flows one way: the checkpoint's expert format and shapes (``problem``) -> the candidate
tiles this GPU can hold (``space``) -> each candidate run through SGLang's own kernel, checked
against SGLang's default config and timed (``workload``, ``search``) -> JSON files named and
placed as SGLang 0.5.23 looks them up, merged with the files it ships (``output``).
``sglang_moe`` is the one module that imports SGLang. Nothing here imports torch or SGLang at
package import, so ``serve`` can use ``output.tuned_config_env`` cheaply.
"""
