"""How vLLM sizes GPU memory for DeepSeek-V4, as far as its code determines it without a GPU.

Paths are relative to vLLM's package. The KV budget is ``gpu_memory_utilization`` x total memory minus
what the worker measures (``v1/worker/gpu_worker.py determine_available_memory``: the weights, a
profiled dummy forward's activation peak, non-torch memory, and by default the CUDA graphs' estimate):
only the first term and the weights are computed here. The caches are V4's own specs (each layer's
``get_kv_cache_spec``), page bytes as ``v1/kv_cache_interface.py`` pads them; ``tests/test_fit.py``
builds vLLM's spec classes with the same arguments and compares.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from dsv4convert.engines import VLLM_LABEL, EngineError, Gpu
from dsv4convert.engines.memory import (
    ESTIMATED,
    RUNTIME_OVERHEAD_MIB,
    KvGeometry,
    LoadRules,
    ServerFit,
    weights_per_rank,
)
from dsv4convert.engines.served import ServedModel
from dsv4convert.engines.vllm.server import vllm_launch
from dsv4convert.models.deepseek_v4.layout import Drafter

# config/cache.py CacheConfig.gpu_memory_utilization; the vLLM launch (engines/vllm/server.py) sets none.
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


ESTIMATES = (
    ESTIMATED[0].replace("SGLang", "vLLM"),
    "not subtracted: the activation peak of vLLM's profiled dummy forward and its CUDA graph memory estimate "
    "(v1/worker/gpu_worker.py determine_available_memory measures both on the GPU): KV tokens are an upper bound",
    "KV tokens = budget / the growing caches' bytes per token; vLLM packs V4's mixed-page caches into one block "
    "pool (v1/core/kv_cache_planning.py), whose padding and per-request sliding-window and state blocks are not "
    "restated",
    "weights per rank: fit's split rules (attention and vocabulary by TP, whole experts by EP) over the file's "
    "bytes (FP8 block scales as F32, wo_a kept FP8); vLLM's model is not built per rank to check them",
)
# vLLM keeps wo_a FP8 and holds one copy of NVFP4 block scales.
LOAD_RULES = LoadRules(wo_a_bf16=False, nvfp4_scale_copies=1)
# A DSpark drafter (models/deepseek_v4/nvidia/dspark.py): context_wkv_proj holds a second copy of every stage's
# wkv (_duplicate_context_wkv_weights), and the confidence head is an F32 ReplicatedLinear
# (qwen3_dspark.py::DSparkConfidenceHead).
DSPARK_LOAD_RULES = LoadRules(wo_a_bf16=False, nvfp4_scale_copies=1, draft_wkv_copies=2, confidence_head_bytes=4)


def size_server(model: ServedModel, gpu: Gpu, tp: int, *, mtp: bool, context: int | None = None) -> ServerFit:
    """One vLLM server as its launch starts it (TP with expert parallelism, FP8 KV cache, whole blocks, the
    default ``gpu_memory_utilization``), as far as vLLM's code sizes it without a GPU."""
    config = model.model_config
    dspark = config.drafter is Drafter.DSPARK
    plan = vllm_launch("MODEL", model.variant, gpu.family, tp,   # raises if vLLM cannot load it
                       drafter=config.drafter if model.has_draft else Drafter.NONE,
                       dspark_block_size=config.dspark.block_size if dspark else None)
    if mtp and plan.mtp_argv is None:
        raise EngineError(f"no draft with vLLM here: {plan.mtp_note}")
    weights = weights_per_rank(model.tensors, tp, DSPARK_LOAD_RULES if dspark else LOAD_RULES)
    loaded = weights.target + (weights.draft if mtp else 0)
    block = plan.block_size
    # Each DSpark stage has its own sliding-window cache layer (dspark.py get_draft_kv_cache_layer_names).
    draft_layers = (model.draft_blocks if dspark else 1) if mtp else 0
    specs = cache_specs(model.geometry, window=int(model.config.get("sliding_window", 128)), block_size=block,
                        packed=packed_layout(gpu.family), draft_layers=draft_layers)
    per_token = sum(spec.bytes_per_token for spec in specs)
    available = kv_budget(gpu.mib, GPU_MEMORY_UTILIZATION, loaded, RUNTIME_OVERHEAD_MIB)
    if per_token:
        tokens = max(int(available / per_token) // block * block, 0)
    else:   # only window and state caches (no compressed layer): the context does not grow them
        tokens = int(model.config.get("max_position_embeddings", 0)) if available > 0 else 0
    needed = max(context or block, block)
    fits = tokens >= needed
    minimum = (loaded + (RUNTIME_OVERHEAD_MIB << 20)) / (gpu.mib << 20)
    return ServerFit(
        role="server", gpu=gpu.name, tp=tp, mtp=mtp, weights_bytes_per_rank=loaded,
        draft_weights_bytes_per_rank=weights.draft if mtp else 0, mem_fraction_static=GPU_MEMORY_UTILIZATION,
        default_mem_fraction_static=GPU_MEMORY_UTILIZATION, reserved_mib=0.0, reserve_terms_mib={},
        kv_bytes_per_token=per_token, kv_terms={spec.name: spec.bytes_per_token for spec in specs if spec.bytes_per_token},
        fixed_state_bytes=0, available_kv_bytes=available, kv_tokens=tokens, swa_tokens=0, max_running_requests=0,
        requests_at_context=tokens // context if context else None,
        min_mem_fraction_static=math.ceil(minimum * 1000) / 1000, fits=fits,
        shortfall_bytes=0 if fits else int(needed * per_token - available), estimated=ESTIMATES,
        engine=VLLM_LABEL.lower(), drafter=config.drafter.value if mtp else None,
        draft_tokens=json.loads(plan.mtp_argv[-1])["num_speculative_tokens"] + 1 if mtp else None)
