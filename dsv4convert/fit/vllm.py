"""How vLLM 0.33.0 sizes GPU memory for DeepSeek-V4, as far as its code determines it without a GPU.

Paths are relative to vLLM's package. The KV budget is ``gpu_memory_utilization`` x total memory minus
what the worker measures (``v1/worker/gpu_worker.py determine_available_memory``: the weights, a
profiled dummy forward's activation peak, non-torch memory, and by default the CUDA graphs' estimate):
only the first term and the weights are computed here. The caches are V4's own specs (each layer's
``get_kv_cache_spec``), page bytes as ``v1/kv_cache_interface.py`` pads them; ``tests/test_fit.py``
builds vLLM's spec classes with the same arguments and compares.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dsv4convert.fit.sizing import KvGeometry

# config/cache.py CacheConfig.gpu_memory_utilization; serve's vLLM launch (serve/vllm_launch.py) sets none.
GPU_MEMORY_UTILIZATION = 0.92
# v1/attention/backends/mla/sparse_swa.py DeepseekV4SWACache: 64-token blocks, 584 packed bytes per token
# (448 FP8 nope + 128 BF16 rope + 8 scale bytes), pages padded to 576 bytes (fp8_ds_mla).
SWA_BLOCK_SIZE = 64
PACKED_BYTES_PER_STATE = 584
PACKED_ALIGNMENT = 576
PLAIN_ALIGNMENT = 512          # FlashInfer sparse (plain FP8 rows): 512-byte pages
INDEXER_QUANT_BLOCK = 128      # models/deepseek_v4/attention.py DeepseekV4Indexer: 128 FP8 + 4-byte scale per 128
STATE_BYTES = 4                # compressor.py CompressorStateCache: float32 state rows


@dataclass(frozen=True)
class CacheSpec:
    """One kind of per-layer cache vLLM allocates for V4, per rank (every V4 cache is replicated: max_tp_shards=1)."""

    name: str
    layers: int
    block_size: int               # tokens (or state rows) per block
    tokens_per_state: int         # tokens one stored entry covers (the compress ratio)
    page_bytes: int               # one block of one layer, padded
    sliding_window: int | None    # None: grows with the context (a full-attention spec)

    @property
    def bytes_per_token(self) -> float:
        """Bytes one more token of context costs across these layers (0 for window and state caches)."""
        return 0.0 if self.sliding_window else self.layers * self.page_bytes / self.block_size


def _page(states: int, state_bytes: int, alignment: int) -> int:
    """``AttentionSpec.page_size_bytes`` after ``_apply_alignment_padding`` (one head, no separate V)."""
    return -(-states * state_bytes // alignment) * alignment


def packed_layout(gpu_family: str) -> bool:
    """Whether V4's attention uses the fp8_ds_mla packed layout: FlashMLA's (sm_90, sm_100); sm_120 runs the
    FlashInfer sparse class (``models/deepseek_v4/nvidia/flashinfer_sparse.py``, ``use_fp8_ds_mla_layout = False``)
    with plain FP8 rows."""
    return gpu_family != "sm120"


def cache_specs(geometry: KvGeometry, *, window: int, block_size: int, packed: bool,
                draft_layers: int = 0) -> list[CacheSpec]:
    """Every cache the V4 model registers (``get_kv_cache_spec`` of ``DeepseekV4SWACache``, the attention
    layer's compressed cache, ``DeepseekV4IndexerCache``, ``CompressorStateCache``), with ``--kv-cache-dtype fp8``.
    The MTP draft's layers (``draft_layers``) hold a sliding-window cache only (their compress ratio is 1)."""
    n4, n128 = geometry.layers_by_ratio.get(4, 0), geometry.layers_by_ratio.get(128, 0)
    align = PACKED_ALIGNMENT if packed else PLAIN_ALIGNMENT
    entry = PACKED_BYTES_PER_STATE if packed else geometry.head_dim       # plain: one FP8 byte per element
    index_entry = geometry.index_head_dim + geometry.index_head_dim // INDEXER_QUANT_BLOCK * 4

    def state(ratio: int, head_dim: int) -> int:
        """CompressorStateCache: state_dim = 2 x coff x head_dim float32 (kv and score), 4 or 8 rows a block."""
        rows = 4 if ratio == 4 else 8
        return _page(rows, 2 * (1 + (ratio == 4)) * head_dim * STATE_BYTES, align)

    specs = [CacheSpec("sliding_window", geometry.num_layers + draft_layers, SWA_BLOCK_SIZE, 1,
                       _page(SWA_BLOCK_SIZE, entry, align), window)]
    if n4:
        specs += [CacheSpec("ratio4_kv", n4, block_size, 4, _page(block_size // 4, entry, align), None),
                  CacheSpec("ratio4_indexer", n4, block_size, 4, _page(block_size // 4, index_entry, align), None),
                  CacheSpec("ratio4_compressor_state", n4, 4, 1, state(4, geometry.head_dim), 8),
                  CacheSpec("ratio4_indexer_compressor_state", n4, 4, 1, state(4, geometry.index_head_dim), 8)]
    if n128:
        specs += [CacheSpec("ratio128_kv", n128, block_size, 128, _page(block_size // 128, entry, align), None),
                  CacheSpec("ratio128_compressor_state", n128, 8, 1, state(128, geometry.head_dim), 128)]
    return specs


def kv_budget(gpu_mib: int, utilization: float, weights_bytes: int, overhead_mib: int) -> int:
    """``request_memory`` (ceil(total x utilization)) minus the weights and the estimated non-torch memory;
    the profiled activation peak and CUDA graph estimate are not subtracted (they need the GPU)."""
    return math.ceil((gpu_mib << 20) * utilization) - weights_bytes - (overhead_mib << 20)
