"""How vLLM 0.33.0 sizes GPU and host memory for DeepSeek-V4.1-Flash: pure arithmetic, no I/O.

Paths are relative to vLLM's package (``vllm/``); ``tests/test_fit_v41.py`` builds vLLM's own spec classes and
Engram embedding with the arguments V4.1's layers pass and compares. The KV budget is V4's
(:func:`dsv4convert.engines.vllm.memory.kv_budget`: ``gpu_memory_utilization`` x total minus the weights; the
profiled activation peak and CUDA graphs need a GPU). What V4.1 changes:

* the attention class per family (``models/deepseek_v41/nvidia/model.py::_select_dsv4_attn_cls``) decides the
  packed records ``--kv-cache-dtype fp8`` resolves to (:func:`kv_records`);
* only the KV-source layers own a compressed cache and an indexer K cache (``attention.py::DeepseekV4Attention.
  get_kv_cache_spec``, ``DeepseekV4IndexerCache``); the sliding-window caches and the compressor rings are
  per request, not per token (:func:`cache_specs`);
* the Engram tables: each rank's hash-head shard, in pinned host memory by default (``config/engram.py::
  EngramConfig.cpu_offload``) or on the GPU (:func:`engram_placement`);
* the weights each rank holds, as vLLM's V4.1 loader stores them (:func:`weights_per_rank`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from dsv4convert.engines import EngineError, Gpu, gpu_family_major
from dsv4convert.engines.memory import RUNTIME_OVERHEAD_MIB
from dsv4convert.engines.sglang.memory_v41 import ServerFitV41
from dsv4convert.engines.vllm.memory import ESTIMATES as V4_ESTIMATES
from dsv4convert.engines.vllm.memory import GPU_MEMORY_UTILIZATION, CacheSpec, _page, kv_budget
from dsv4convert.engines.vllm.server import BLOCK_SIZE
from dsv4convert.models.deepseek_v4.layout import TensorSpec
from dsv4convert.models.deepseek_v41.config import V41Config, engram_primes
from dsv4convert.models.deepseek_v41.inventory import role_of

# models/deepseek_v41/common/ops/fused_layout.py WV_GROUP_SIZE: heads per wo_a group mega attention needs.
WV_GROUP_SIZE = 8
# attention.py DeepseekV4Attention.__init__: DeepseekV4SWACache(block_size=32).
SWA_BLOCK_SIZE = 32
# config/engram.py EngramConfig: cpu_offload=True (pinned host memory, UVA lookups), else the GPU.
ENGRAM_PLACEMENTS = ("host-per-rank", "gpu")
ENGRAM_SCALE_BLOCK = 32   # common/engram.py ParallelEngramEmbedding(block_size=32): one uint8 E8M0 scale per 32
# What V4's vLLM sizing leaves open holds for V4.1 (the free memory, the profiled peak, the one block pool); the
# weights are V4.1's own rules, checked against vLLM's model built at TP 1 only.
ESTIMATES = (*V4_ESTIMATES[:3],
             "weights per rank: vLLM's V4.1 split rules (attention, Engram wkv, vocabulary, shared experts and the "
             "vision tower's linears by TP, whole experts by EP) over the file's bytes (32x32 block scales repeated "
             "per row); vLLM's model is checked per rank at TP 1 only")


def attention_class(gpu_family: str, tp: int, cfg: V41Config) -> str:
    """``_select_dsv4_attn_cls`` with no ``--attention-backend``: FlashInfer's SM120 class on sm_12x; on SM100 mega
    attention where ``DeepseekV4MegaAttnAttention.is_available_for`` holds (TP divides heads and ``o_groups``, leaving
    ``WV_GROUP_SIZE`` heads per group; the kernel built in, as vLLM's CUDA wheels ship it); FlashMLA otherwise."""
    major = gpu_family_major(gpu_family)
    if major == 12:
        return "flashinfer_sm120"
    heads, groups = cfg.num_attention_heads, cfg.o_groups
    if major == 10 and not heads % tp and not groups % tp and groups // tp:
        local_heads, local_groups = heads // tp, groups // tp
        if not local_heads % WV_GROUP_SIZE and local_heads // local_groups == WV_GROUP_SIZE:
            return "flashmla_mega"
    return "flashmla"


@dataclass(frozen=True)
class KvRecords:
    """The packed records one rank's V4.1 caches use (``DeepseekV4Attention.__init__``)."""

    cache_dtype: str          # what --kv-cache-dtype fp8 resolves to: fp8_ds_mla or nvfp4_ds_mla
    swa_bytes: int            # sliding-window record per token
    compressed_bytes: int     # compressed record per state
    alignment: int            # page alignment of every packed page


def kv_records(gpu_family: str, attention: str) -> KvRecords:
    """``_resolve_dsv4_kv_cache_dtype``: ``fp8`` becomes the class's ``packed_kv_cache_dtype`` (``nvfp4_ds_mla`` for
    mega attention, ``fp8_ds_mla`` for FlashMLA and FlashInfer's SM120 class, both ``use_fp8_ds_mla_layout``).
    ``_use_v41_mxfp8_kv_record``: V4.1's MXFP8 record (528 B, 512-byte pages) on SM100 only, V4's 584 B with
    576-byte pages elsewhere; ``nvfp4_ds_mla`` stores the compressed cache as 288 B NVFP4 records."""
    mxfp8 = gpu_family_major(gpu_family) == 10
    dtype = "nvfp4_ds_mla" if attention == "flashmla_mega" else "fp8_ds_mla"
    swa = 528 if mxfp8 else 584
    return KvRecords(dtype, swa, 288 if dtype == "nvfp4_ds_mla" else swa, 512 if mxfp8 else 576)


def indexer_entry_bytes(index_head_dim: int, fp4: bool = False) -> int:
    """``attention.py::_indexer_k_cache_head_dim``: 128 FP8 + a 4-byte scale per 128 (the default: ``indexer_kv_dtype``
    auto resolves to fp8, ``v1/attention/backends/mla/indexer.py::dsa_indexer_uses_fp4``), or MXFP4 + E8M0 scales."""
    if fp4:
        return index_head_dim // 2 + index_head_dim // 32
    return index_head_dim + index_head_dim // 128 * 4


def compressor_ring_rows(num_speculative_tokens: int) -> int:
    """``compressor.py::CompressorStateCache.__init__``: drafts + bonus token + the previous row, as a power of two
    >= 8."""
    return max(8, 1 << (num_speculative_tokens + 2 - 1).bit_length())


def kv_sources(cfg: V41Config) -> dict[int, int]:
    """Compress ratio -> backbone layers that own a compressed and an indexer K cache (``is_kv_source``)."""
    out: dict[int, int] = {}
    for layer in cfg.kv_source_layer_ids:
        if layer < cfg.num_hidden_layers and cfg.compress_ratios[layer]:
            out[cfg.compress_ratios[layer]] = out.get(cfg.compress_ratios[layer], 0) + 1
    return dict(sorted(out.items()))


def cache_specs(cfg: V41Config, records: KvRecords, *, block_size: int, draft_layers: int = 0,
                num_speculative_tokens: int = 0) -> list[CacheSpec]:
    """Every cache V4.1 registers on one rank (all replicated: one KV head): a sliding-window cache per layer and
    DSpark stage (``DeepseekV4SWACache.get_kv_cache_spec``), per KV source its compressed cache
    (``DeepseekV4Attention.get_kv_cache_spec``: ``block_size / ratio`` records a page) and indexer K cache
    (``DeepseekV4IndexerCache.get_kv_cache_spec``, the same alignment), and per ratio-2 source a compressor ring
    (``CompressorStateCache``: ``CircularBufferSpec``, one block of F32 (kv, score) rows per request)."""
    index_entry = indexer_entry_bytes(cfg.index_head_dim)
    specs = [CacheSpec("sliding_window", cfg.num_hidden_layers + draft_layers, SWA_BLOCK_SIZE, 1,
                       _page(SWA_BLOCK_SIZE, records.swa_bytes, records.alignment), cfg.sliding_window)]
    for ratio, layers in kv_sources(cfg).items():
        states = block_size // ratio
        specs += [CacheSpec(f"ratio{ratio}_kv", layers, block_size, ratio,
                            _page(states, records.compressed_bytes, records.alignment), None),
                  CacheSpec(f"ratio{ratio}_indexer", layers, block_size, ratio,
                            _page(states, index_entry, records.alignment), None)]
        if ratio > 1:
            rows = compressor_ring_rows(num_speculative_tokens)
            specs.append(CacheSpec(f"ratio{ratio}_compressor_state", layers, rows, 1, rows * 2 * cfg.head_dim * 4,
                                   rows))
    return specs


# ---------------------------------------------------------------------------------------------
# The Engram tables: models/deepseek_v41/common/engram.py ParallelEngramEmbedding.

def engram_head_sizes(cfg: V41Config) -> list[list[int]]:
    """Per Engram layer, the prime-sized bucket of each (n-gram size, head) pair in order (``EngramLayout``)."""
    return engram_primes(len(cfg.engram_layer_ids), cfg.engram_max_ngram_size, cfg.engram_n_heads,
                         cfg.engram_vocab_size)


def engram_shard_rows(head_sizes: list[int], tp: int, rank: int) -> int:
    """``ParallelEngramEmbedding.__init__`` (one DP rank): ``ceil(heads / tp)`` whole hash heads per rank, its rows
    their buckets; vLLM refuses a TP that leaves a rank without heads."""
    per = -(-len(head_sizes) // tp)
    if (tp - 1) * per >= len(head_sizes):
        raise EngineError(f"vLLM 0.33.0 shards the Engram tables by whole hash heads and leaves ranks without any at "
                          f"TP {tp}: {len(head_sizes)} heads over {tp} shards (common/engram.py::"
                          "ParallelEngramEmbedding.__init__)")
    return sum(head_sizes[rank * per:(rank + 1) * per])


@dataclass(frozen=True)
class EngramShards:
    """Where one vLLM server's Engram tables live (bytes): the largest rank's shard on its GPU or in pinned host
    memory, and every rank's together."""

    placement: str
    gpu_bytes_per_rank: int
    host_bytes_per_rank: int
    host_bytes_per_server: int
    table_bytes: int          # as the checkpoint holds them


def engram_placement(cfg: V41Config, tp: int, placement: str) -> EngramShards:
    """``host-per-rank`` (``cpu_offload``, the default): each rank's process pins its own shard, nothing on the GPU;
    ``gpu`` (``--engram-config '{"cpu_offload":false}'``): the shard in GPU memory. The shards together hold the
    head buckets (a table's rows past them are never loaded)."""
    if placement not in ENGRAM_PLACEMENTS:
        raise ValueError(f"Engram placement {placement!r}: vLLM has {', '.join(ENGRAM_PLACEMENTS)}")
    row = cfg.engram_head_dim + cfg.engram_head_dim // ENGRAM_SCALE_BLOCK
    ranks = [sum(engram_shard_rows(sizes, tp, r) for sizes in engram_head_sizes(cfg)) * row for r in range(tp)]
    table = sum(cfg.engram_num_embeddings) * row
    if placement == "gpu":
        return EngramShards(placement, max(ranks), 0, 0, table)
    return EngramShards(placement, 0, max(ranks), sum(ranks), table)


# ---------------------------------------------------------------------------------------------
# Weights per rank: models/deepseek_v41/nvidia/model.py, attention.py, common/engram.py, nvidia/dspark.py,
# models/deepseek_v4/common/vision.py; --enable-expert-parallel at TP > 1 (serve's launch).

# ColumnParallelLinear wq_b, wo_a; RowParallelLinear wo_b; engram.wkv (ColumnParallelLinear: not sequence parallel,
# which needs a mega MoE backend or DP); VocabParallelEmbedding/ParallelLMHead; shared experts; routed experts
# (whole experts per rank under EP). Replicated: fused_wqa_wkv, the indexer (ReplicatedLinear), the compressor,
# the router, hc_*, norms. The vision tower's attention and MLP and the aligner are TP linears (QKVParallelLinear,
# MergedColumnParallelLinear, RowParallelLinear): their weights split, biases and norms counted whole.
_SPLIT_ROLES = ("embed", "head", "routed_expert", "routed_expert (mtp)", "shared_expert")
_SPLIT_NAMES = (".attn.wq_b.", ".attn.wo_a.", ".attn.wo_b.", ".engram.wkv.")
_SPLIT_VISION = (".attn.wqkv.weight", ".attn.wo.weight", ".mlp.w1.weight", ".mlp.w2.weight")


@dataclass
class RankWeightsV41:
    """Bytes one TP rank holds: the backbone (Engram tables apart), the tables as the checkpoint holds them, the
    DSpark draft, per role."""

    target: int = 0
    engram_tables: int = 0
    draft: int = 0
    by_role: dict[str, int] = field(default_factory=dict)


def stored_bytes(spec: TensorSpec, role: str) -> int:
    """What vLLM stores for one file tensor before any TP split. A 32x32 FP8 linear's E8M0 block scale is repeated
    over its 32 rows into a per-row uint8 ``weight_scale`` (``quantization/modelopt.py::KMxfp8Static.
    get_scale_weight_loader``; ``wo_a`` included: it stays FP8); MXFP4 expert and Engram scales stay raw E8M0 bytes
    (``Mxfp4MoEMethod``, ``ParallelEngramEmbedding``). The image tokens are F32 parameters (``nvidia/vl_model.py``),
    the DSpark confidence head an F32 linear (``nvidia/dspark.py::DSparkConfidenceHead``), and each layer's F32
    ``attn_sink`` is padded to the attention kernel's head count, at least 64 (``attention.py::make_attention_sink``
    with ``nvidia/flashmla.py::get_padded_num_q_heads``)."""
    elements = math.prod(spec.shape) if spec.shape else 1
    if role == "attn_sink":
        return max(elements, 64) * 4
    if spec.dtype == "F8_E8M0" and spec.name.endswith(".scale") and role not in (
            "routed_expert", "routed_expert (mtp)", "engram_table"):
        return spec.nbytes * 32
    if spec.name.startswith("image_") or ".confidence_head." in spec.name:
        return elements * 4
    return spec.nbytes


def _split(spec: TensorSpec, role: str) -> bool:
    if spec.name.startswith(("vision.blocks.", "aligner.")):
        return spec.name.endswith(_SPLIT_VISION) or (spec.name.startswith("aligner.")
                                                     and spec.name.endswith(".weight"))
    return role in _SPLIT_ROLES or any(s in spec.name for s in _SPLIT_NAMES)


def weights_per_rank(specs: Iterable[TensorSpec], tp: int) -> RankWeightsV41:
    """Bytes one of ``tp`` ranks holds of a V4.1 checkpoint (the Engram tables counted apart: their place is
    :func:`engram_placement`'s). The DSpark stages (``mtp.*``) alias the target's embedding and head
    (``DSparkDeepseekV4ForCausalLM.has_own_embed_tokens = False``)."""
    out = RankWeightsV41()
    for spec in specs:
        role = role_of(spec.name)
        stored = stored_bytes(spec, role)
        if role == "engram_table":
            out.engram_tables += stored
            continue
        per_rank = stored // tp if _split(spec, role) else stored
        if spec.name.startswith("mtp."):
            out.draft += per_rank
        else:
            out.target += per_rank
        out.by_role[role] = out.by_role.get(role, 0) + per_rank
    return out


def size_server(cfg: V41Config, tensors: Iterable[TensorSpec], gpu: Gpu, tp: int, placement: str, *,
                context: int | None = None, mtp: bool = False) -> ServerFitV41:
    """One vLLM server of ``tp`` GPUs holding ``tensors`` with the Engram tables at ``placement``, as far as vLLM's
    code sizes it without a GPU (:data:`ESTIMATES`)."""
    if mtp and cfg.dspark is None:
        raise EngineError("--mtp: this DeepSeek-V4.1 config announces no DSpark drafter (no dspark_* keys)")
    weights = weights_per_rank(tensors, tp)
    engram = engram_placement(cfg, tp, placement)
    draft = weights.draft if mtp else 0
    on_gpu = weights.target + engram.gpu_bytes_per_rank + draft
    attention = attention_class(gpu.family, tp, cfg)
    records = kv_records(gpu.family, attention)
    spec_tokens = cfg.dspark.block_size if mtp else 0
    specs = cache_specs(cfg, records, block_size=BLOCK_SIZE,
                                    draft_layers=cfg.dspark.stages if mtp else 0, num_speculative_tokens=spec_tokens)
    per_token = sum(spec.bytes_per_token for spec in specs)
    available = kv_budget(gpu.mib, GPU_MEMORY_UTILIZATION, on_gpu, RUNTIME_OVERHEAD_MIB)
    tokens = max(int(available / per_token) // BLOCK_SIZE * BLOCK_SIZE, 0)
    needed = max(context or BLOCK_SIZE, BLOCK_SIZE)
    minimum = (on_gpu + (RUNTIME_OVERHEAD_MIB << 20)) / (gpu.mib << 20)
    return ServerFitV41(
        role="server", tp=tp, engram=placement, kv_layout=f"{records.cache_dtype} ({attention})",
        weights_bytes_per_rank=on_gpu, engram_gpu_bytes_per_rank=engram.gpu_bytes_per_rank,
        engram_host_bytes_per_server=engram.host_bytes_per_server,
        engram_host_bytes_per_process=engram.host_bytes_per_rank,
        mem_fraction_static=GPU_MEMORY_UTILIZATION, min_mem_fraction_static=math.ceil(minimum * 1000) / 1000,
        kv_bytes_per_token=per_token, kv_terms={s.name: s.bytes_per_token for s in specs if s.bytes_per_token},
        swa_tokens=0, fixed_bytes=0, available_kv_bytes=available, kv_tokens=tokens,
        requests_at_context=tokens // context if context else None, fits=tokens >= needed,
        drafter="dspark" if mtp else None, draft_tokens=spec_tokens + 1 if mtp else None,
        draft_weights_bytes_per_rank=draft)
