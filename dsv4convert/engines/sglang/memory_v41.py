"""How SGLang sizes GPU and host memory for DeepSeek-V4.1-Flash: pure arithmetic, no I/O.

V4.1 runs in SGLang's V4 model class (``srt/models/deepseek_v4.py``, ``is_dsv41``) and V4's memory fraction
(``srt/arg_groups/memory_hook.py``, which reads no model type: :func:`dsv4convert.engines.sglang.memory.
memory_fraction` applies as is, as do V4's page size 256 and 256-request limit, ``deepseek_v4_hook.py``). What
differs, each function restating one piece of SGLang's code (paths relative to ``python/sglang/``;
``tests/test_fit_v41.py`` runs those functions on the CPU and compares):

* the KV layout: V4.1's packed layouts where the FlashMLA mega backend or ``SGLANG_DSV4_KV_LAYOUT`` selects them
  (SM100 only), V4's elsewhere (:func:`kv_layout`);
* only the KV-source layers own compressed storage, of ratio 1 and 2, each with an FP4 index key
  (:func:`sources_by_ratio`, :func:`kv_cost`);
* the sliding-window pool is sized from the request cap, not as 0.1 of the full pool: V4's
  ``swa_full_tokens_ratio`` default is not applied to V4.1 (``model_overrides/deepseek_v4.py``);
* the Engram tables: rows sharded over TP on hash-column boundaries in GPU memory, or in host memory
  (:func:`engram_placement`);
* the weights each rank stores (:func:`weights_per_rank`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

from dsv4convert.engines import Gpu, gpu_family_major
from dsv4convert.engines.sglang.memory import (
    V4_MAX_RUNNING_REQUESTS,
    V4_PAGE_SIZE,
    budget,
    confidence_head_bytes,
    memory_fraction,
)
from dsv4convert.engines.sglang.memory import request_slots as v4_request_slots
from dsv4convert.engines.sglang import ENGRAM_PLACEMENTS
from dsv4convert.engines.sglang.server import Server
from dsv4convert.models.deepseek_v4.layout import TensorSpec
from dsv4convert.models.deepseek_v41.config import V41Config, engram_primes
from dsv4convert.models.deepseek_v41.inventory import role_of

# kernels/ops/attention/dsv4/kv_layout.py KVLayout: (bytes per token = data + scales, page alignment).
KV_LAYOUTS = {"v4": (576 + 8, 576), "v41": (512 + 16, 512), "v41_fp4": (256 + 32, 256),
              "v41_new": (512 + 16, 528), "v41_fp4_new": (256 + 32, 288)}
# environ.py: SGLANG_DSV4_KV_LAYOUT's default, SGLANG_SWA_EVICTION_INTERVAL's default.
DEFAULT_KV_LAYOUT = "v4"
SWA_EVICTION_INTERVAL = 128
# mem_cache/deepseek_v4_memory_pool.py dsv41_index_page_size: 64 unless DeepGEMM's paged sparse MQA logits are
# available (128); a few pages of padding either way.
DSV41_INDEX_PAGE_SIZE = 64
# layers/engram.py FP8_BLOCK_SIZE: one E8M0 scale per 32 values of a row.
ENGRAM_SCALE_BLOCK = 32


# ---------------------------------------------------------------------------------------------
# The KV pool: mem_cache/deepseek_v4_memory_pool.py, model_executor/pool_configurator.py DSV4PoolConfigurator.

def attention_backend(server: Server) -> str:
    """``deepseek_v4_hook.py::_default_dsv4_attention_backend`` for V4.1 with an FP8 KV cache: FlashMLA's mega
    kernels on SM100, except a server without PD whose attention is tensor-parallel (TP > 1), or a KV layout set
    to V4's."""
    layout = server.env.get("SGLANG_DSV4_KV_LAYOUT")
    if (gpu_family_major(server.gpu_family) != 10 or server.kv_cache_dtype != "fp8_e4m3"
            or (server.role == "server" and server.tp > 1)
            or (layout is not None and layout.lower() not in ("auto", "v41", "v41_new"))):
        return "flashmla"
    return "flashmla_mega"


def kv_layout(server: Server) -> str:
    """``select_dsv4_kv_layout``: the main cache's layout. The mega backend forces ``v41``; otherwise
    ``SGLANG_DSV4_KV_LAYOUT`` (default ``v4``), whose ``auto`` is ``v41`` on SM100 and ``v4`` elsewhere."""
    mode = server.env.get("SGLANG_DSV4_KV_LAYOUT", DEFAULT_KV_LAYOUT).lower()
    if attention_backend(server) == "flashmla_mega" and mode != "v41_new":
        mode = "v41"
    if mode == "v4" or (mode == "auto" and gpu_family_major(server.gpu_family) != 10):
        return "v4"
    return "v41_new" if mode == "v41_new" else "v41"


def compressed_layout(main: str, ratio: int) -> str:
    """``resolve_compressed_kv_layout`` (option ``auto``): V4's main cache keeps V4 caches; beside a V4.1 one the
    ratio-1/2 latents are FP4, ratios 4/128 FP8, in the main cache's arrangement."""
    if main == "v4":
        return "v4"
    base = "v41_fp4" if ratio in (1, 2) else "v41"
    return base + "_new" if main.endswith("_new") else base


def page_bytes(layout: str, tokens: int) -> int:
    """``KVLayout.page_bytes``: a page padded to a multiple of the reader's TMA row."""
    per_token, align = KV_LAYOUTS[layout]
    return -(-tokens * per_token // align) * align


def paged_bytes_per_token(main: str, ratio: int = 0, page_size: int = V4_PAGE_SIZE) -> float:
    """``DSV4PoolConfigurator._get_paged_kv_bytes_per_token``: a ratio-r cache holds page_size / r slots a page."""
    layout = compressed_layout(main, ratio) if ratio else main
    per_page = page_size // ratio if ratio else page_size
    return page_bytes(layout, per_page) / per_page


def low_ratio_index_bytes(index_head_dim: int) -> int:
    """``get_dsv4_indexer_bytes_per_token(use_fp4_indexer=True)``: the ratio-1/2 index key, FP4 + one scale per 32."""
    return index_head_dim // 2 + index_head_dim // 32


def sources_by_ratio(ratios: Iterable[int], kv_sources: Iterable[int], layers: int) -> dict[int, list[int]]:
    """``collect_sources_by_ratio``: the layers that own compressed storage: every layer of ratio 4 or 128, and of
    ratio 1 or 2 only the KV-source layers (later layers read their source's cache)."""
    ratios, sources = list(ratios), list(kv_sources)
    out: dict[int, list[int]] = {}
    for ratio in (4, 128, 1, 2):
        owners = ([s for s in sources if s < layers and ratios[s] == ratio] if ratio in (1, 2)
                  else [i for i in range(layers) if ratios[i] == ratio])
        if owners:
            out[ratio] = owners
    return out


@dataclass(frozen=True)
class KvCostV41:
    """What one rank's V4.1 pool costs: per full-pool token, the fixed request-scoped terms, and the layout."""

    layout: str
    bytes_per_full_token: float           # compressed KV + index of the source layers (cap mode: no SWA share)
    bytes_per_swa_token: float            # one sliding-window slot across the layers
    swa_tokens: int                       # the sliding-window pool, from the request cap
    fixed_bytes: int                      # the SWA pool + the ratio-2 pair state
    terms: dict[str, float] = field(default_factory=dict)
    index_bytes: int = 0
    owners: dict[int, int] = field(default_factory=dict)   # ratio -> layers owning compressed storage
    spec_inflation: float = 1.0           # (layers + 1) / layers with a draft: the one draft layer SGLang budgets


def request_slots(server: Server) -> int:
    """``_get_num_req_slots`` (V4's rule, :func:`dsv4convert.engines.sglang.memory.request_slots`)."""
    return v4_request_slots(server)


def decode_extra_slots(server: Server) -> int:
    """``pd_disaggregation_hook.py``: a decode server's extra slots, 2x a running limit of 32 or less."""
    running = server.max_running_requests
    return 2 * running if server.role == "decode" and running is not None and running <= 32 else 0


def decode_alloc_tokens(server: Server, page_size: int = V4_PAGE_SIZE) -> int:
    """``compute_swa_request_cap``'s per-request decode allocation (overlap schedule on): a page without a draft;
    with DSPARK (one step, top-k 1) twice ``mem_cache/allocation_sizing.py::get_alloc_len_per_decode``, which is
    the draft-token count (``get_alloc_reserve_per_decode``'s double buffer)."""
    return 2 * server.draft_tokens if server.mtp else page_size


def swa_cap_tokens(server: Server, window: int, chunked_prefill_size: int, page_size: int = V4_PAGE_SIZE) -> int:
    """``_resolve_swa_cap_tokens`` with ``compute_swa_request_cap`` (overlap schedule on): the worst-case live
    window of every running request (the eviction interval once per verified token with a draft), two prefill
    chunks in flight, and headroom for the cached prefixes the radix cache keeps addressable (4 per running
    request; none on a PD decode server, whose radix cache is off: ``pd_disaggregation_hook.py``)."""
    running = server.max_running_requests or V4_MAX_RUNNING_REQUESTS
    per_request = (window + SWA_EVICTION_INTERVAL * (server.draft_tokens or 1) + page_size
                   + decode_alloc_tokens(server, page_size))
    if server.role == "decode":
        cap = per_request * running + (window + page_size) * decode_extra_slots(server)
        tails = 0
    else:
        cap = per_request * running + 2 * chunked_prefill_size + page_size
        tails = 4 * running
    return -(-(cap + tails * (window + page_size)) // page_size) * page_size


def c2_ring_size(server: Server) -> int:
    """``deepseek_v4_memory_pool.py::get_compress_state_ring_size(2, T)``: a pair (2 rows) without a draft; with
    one, the power of two above 1 + the draft-token count (the ring must outlast the verified window)."""
    return 1 << (server.draft_tokens + 1).bit_length() if server.mtp else 2


def c2_state_fixed_bytes(server: Server, head_dim: int, layers: int) -> int:
    """``_get_c2_state_fixed_bytes``: an FP32 (kv, score) pair ring per request slot, per ratio-2 source."""
    if not layers:
        return 0
    ring = c2_ring_size(server)
    rows = request_slots(server) * ring + ring + 1
    rows = -(-rows // 2) * 2
    return rows * 2 * head_dim * 4 * layers


def kv_cost(cfg: V41Config, server: Server, chunked_prefill_size: int, page_size: int = V4_PAGE_SIZE) -> KvCostV41:
    """``DSV4PoolConfigurator.__init__``/``_get_bytes_per_swa_token``/``_compressed_bytes_per_full_token``/
    ``_get_bytes_per_full_token`` for V4.1: cap mode (V4.1 sets no ``swa_full_tokens_ratio``), so a full token pays
    only the compressed caches; V4.1 has no ratio-4 layer, hence no per-slot compressor state. With the DSpark
    draft (no encoder replay, SGLang's default) both per-token figures are inflated by (layers + 1) / layers,
    one draft layer whatever the stage count (``__init__``'s ``_spec_infl``)."""
    layers = cfg.num_hidden_layers
    main = kv_layout(server)
    owners = sources_by_ratio(cfg.compress_ratios, cfg.kv_source_layer_ids, layers)
    index = low_ratio_index_bytes(cfg.index_head_dim)
    if set(owners) - {1, 2}:
        raise ValueError(f"compress ratios {sorted(set(owners) - {1, 2})}: V4's ratio-4/128 layers are not sized here")
    terms = {f"ratio{r}_kv": len(owners[r]) * paged_bytes_per_token(main, r, page_size) / r for r in sorted(owners)}
    terms.update({f"ratio{r}_index": len(owners[r]) * index / r for r in sorted(owners)})
    inflation = (layers + 1) / layers if server.mtp else 1.0
    per_swa = paged_bytes_per_token(main, 0, page_size) * layers * inflation
    swa = swa_cap_tokens(server, cfg.sliding_window, chunked_prefill_size, page_size)
    fixed = int(swa * per_swa) + c2_state_fixed_bytes(server, cfg.head_dim, len(owners.get(2, ())))
    return KvCostV41(main, sum(terms.values()) * inflation, per_swa, swa, fixed, terms, index,
                     {r: len(v) for r, v in owners.items()}, inflation)


def draft_kv_bytes(cost: KvCostV41, stages: int, page_size: int = V4_PAGE_SIZE) -> int:
    """The DSpark draft worker's own pool (``kv_cache_configurator.py::_build_dsv4_kv_pool``, ``_derive_pool_sizes``):
    one sliding-window-only layer per stage in the target's main layout, each holding the target's sliding-window
    token count (the request cap). SGLang's sizing set aside one such layer (:func:`kv_cost`'s inflation); the
    other stages come out of the activation reserve."""
    return int(cost.swa_tokens * stages * paged_bytes_per_token(cost.layout, 0, page_size))


def draft_kv_budgeted_bytes(cost: KvCostV41, full_tokens: int) -> int:
    """What the inflation set aside for the draft: the inflated share of the SWA pool and of the full tokens."""
    share = 1 - 1 / cost.spec_inflation
    return int((cost.swa_tokens * cost.bytes_per_swa_token + full_tokens * cost.bytes_per_full_token) * share)


def padding_bytes(cost: KvCostV41, full_tokens: int, page_size: int = V4_PAGE_SIZE) -> float:
    """``_get_low_ratio_kv_padding_bytes``: the reserved main page and the indexer pool's own page per source."""
    out = 0.0
    for ratio, layers in cost.owners.items():
        main = page_size * paged_bytes_per_token(cost.layout, ratio, page_size)
        index_size = (full_tokens + page_size) // ratio
        slots = -(-(index_size + DSV41_INDEX_PAGE_SIZE) // DSV41_INDEX_PAGE_SIZE) * DSV41_INDEX_PAGE_SIZE
        out += (main + (slots - full_tokens // ratio) * cost.index_bytes) * layers
    return out


def kv_tokens(available_bytes: int, cost: KvCostV41, page_size: int = V4_PAGE_SIZE) -> int:
    """``calculate_pool_sizes``: whole pages of full tokens after the fixed terms and the reserved pages."""
    for_tokens = max(available_bytes - cost.fixed_bytes, 0)
    full = int(for_tokens / cost.bytes_per_full_token) // page_size * page_size
    while full > 0 and full * cost.bytes_per_full_token + padding_bytes(cost, full, page_size) > for_tokens:
        full -= page_size
    return max(full, 0)


# ---------------------------------------------------------------------------------------------
# The Engram tables: layers/engram.py EngramEmbedding, shard_range, _HostTable.

def engram_row_bytes(cfg: V41Config) -> int:
    """One row: FP8 values and their E8M0 scales (``EngramEmbedding``)."""
    return cfg.engram_head_dim + cfg.engram_head_dim // ENGRAM_SCALE_BLOCK


def column_bounds(cfg: V41Config) -> list[tuple[int, ...]]:
    """``EngramLayout.column_bounds`` per Engram layer: prefix sums of its prime-sized hash columns."""
    out = []
    for sizes in engram_primes(len(cfg.engram_layer_ids), cfg.engram_max_ngram_size, cfg.engram_n_heads,
                               cfg.engram_vocab_size):
        bounds = [0]
        for size in sizes:
            bounds.append(bounds[-1] + size)
        out.append(tuple(bounds))
    return out


def shard_range(rows: int, bounds: tuple[int, ...], rank: int, tp: int) -> tuple[int, int]:
    """``shard_range``: a rank's rows on hash-column boundaries when the columns divide over TP, else equal rows."""
    if bounds[-1] != rows:
        raise ValueError(f"the config's table size {rows} disagrees with its primes ({bounds[-1]})")
    columns = len(bounds) - 1
    if columns % tp == 0:
        per = columns // tp
        return bounds[rank * per], bounds[(rank + 1) * per]
    return rows * rank // tp, rows * (rank + 1) // tp


@dataclass(frozen=True)
class EngramPlacement:
    """Where one server's Engram tables live and what each place holds (bytes)."""

    placement: str                 # gpu, host-shared or host-per-rank
    gpu_bytes_per_rank: int        # the largest rank's shard (gpu), else 0
    host_bytes_per_server: int     # the TP group's host memory (host-*), else 0
    host_bytes_per_process: int    # what one rank's process maps: the whole table (shared) or its shard
    table_bytes: int               # all tables, as the checkpoint holds them


def engram_placement(cfg: V41Config, tp: int, placement: str) -> EngramPlacement:
    """``EngramEmbedding.__init__``/``_init_host_table``. ``gpu`` (default): each rank's row shard in GPU memory.
    ``host-shared`` (``SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE=1``, layout ``shared``): one memfd buffer of every
    row per TP group, mapped by each rank. ``host-per-rank`` (layout ``per_rank``): each rank's process holds its
    own shard. Either host layout leaves nothing of the tables on the GPU."""
    if placement not in ENGRAM_PLACEMENTS:
        raise ValueError(f"Engram placement {placement!r}: expected one of {', '.join(ENGRAM_PLACEMENTS)}")
    row = engram_row_bytes(cfg)
    shards = [0] * tp
    for rows, bounds in zip(cfg.engram_num_embeddings, column_bounds(cfg)):
        for rank in range(tp):
            start, end = shard_range(rows, bounds, rank, tp)
            shards[rank] += (end - start) * row
    table = sum(cfg.engram_num_embeddings) * row
    if placement == "gpu":
        return EngramPlacement(placement, max(shards), 0, 0, table)
    per_process = table if placement == "host-shared" else max(shards)
    return EngramPlacement(placement, 0, table, per_process, table)


# ---------------------------------------------------------------------------------------------
# Weights per rank: srt/models/deepseek_v4.py (V4.1 paths), layers/attention/dsv4/dsv41_sparse.py,
# layers/engram.py, models/deepseek_v41_vit.py, the MXFP4 MoE methods' create_weights.

# ColumnParallelLinear wq_b, wo_a; RowParallelLinear wo_b; VocabParallelEmbedding/ParallelLMHead; shared and
# routed experts (intermediate dimension under TP). Everything else is replicated: ReplicatedLinear wqkv_a, the
# indexer's wq_b and weights_proj, engram.wkv; nn.Linear compressor and indexer wk; the router; hc_*; the vision
# tower (VisionAttention with use_data_parallel=True, nn.Linear MLP and aligner).
_SPLIT_ROLES = ("embed", "head", "routed_expert", "routed_expert (mtp)", "shared_expert")
_SPLIT_ATTENTION = (".attn.wq_b.", ".attn.wo_a.", ".attn.wo_b.")
# quantization/kv_cache.py::BaseKVCacheMethod.create_weights: an F32 k_scale and v_scale per attention layer.
KV_SCALE_BYTES = 8


@dataclass
class RankWeights:
    """Bytes one TP rank holds: the backbone (Engram tables apart), the tables' GPU shard, the draft, per role."""

    target: int = 0
    engram_tables: int = 0
    draft: int = 0
    by_role: dict[str, int] = field(default_factory=dict)


def mxfp4_scale_bytes(server: Server) -> int:
    """Bytes per E8M0 MXFP4 expert scale as stored: the ``flashinfer_mxfp4`` runner SGLang picks for FP4 experts
    (``model_overrides/deepseek_v4.py``) builds ``Mxfp4FlashinferTrtllmMoEMethod`` on SM100, which holds them as
    F32, and ``Mxfp4FlashinferCutlassMoEMethod`` on SM90/SM120 (raw bytes: ``quantization/fp8.py``)."""
    return 4 if gpu_family_major(server.gpu_family) == 10 else 1


def stored_bytes(spec: TensorSpec, role: str, server: Server) -> int:
    """What SGLang stores for one file tensor before any TP split. ``wo_a`` is dequantized to BF16 at load
    (``_dequant_fp8_wo_a_streaming``; the FP8 wo_a GEMM takes 128x128 blocks only, ``wo_a_fp8_gemm_enabled``; the
    draft's ``DSparkAttention`` builds it unquantized): twice its FP8 bytes, its scale consumed. 32x32 FP8 block
    scales load as F32 (``Fp8LinearMethod``). The Engram table's E8M0 scales stay E8M0 (``EngramEmbedding``). The
    vision tower's RMSNorm weights are F32 (``models/deepseek_v41_vit.py::_rms_norm``). Each attention layer's
    ``attn_sink`` stands also for the F32 ``k_scale``/``v_scale`` its ``RadixAttention`` gets from the FP8 config
    (``quantization/kv_cache.py::BaseKVCacheMethod.create_weights``). The DSpark draft drops ``gate.bias_vl``
    (``models/deepseek_v4_dspark.py::_remap_dspark_weight_name``) and builds its confidence head only off
    ``SGLANG_RAGGED_VERIFY_MODE=static`` (F32, :func:`~dsv4convert.engines.sglang.memory.confidence_head_bytes`)."""
    elements = math.prod(spec.shape) if spec.shape else 1
    if spec.name.startswith("mtp.") and spec.name.endswith(".gate.bias_vl"):
        return 0
    if ".confidence_head." in spec.name:
        return elements * confidence_head_bytes(server)
    if ".attn.wo_a." in spec.name and spec.dtype in ("F8_E4M3", "F8_E8M0"):
        return 0 if spec.name.endswith(".scale") else elements * 2
    if spec.name.endswith(".attn.attn_sink"):
        return spec.nbytes + KV_SCALE_BYTES
    if spec.name.startswith("vision.") and "norm" in spec.name.rsplit(".", 2)[-2]:
        return elements * 4
    if spec.dtype == "F8_E8M0" and role == "engram_table":
        return spec.nbytes
    if spec.dtype == "F8_E8M0" and role.startswith("routed_expert"):
        return elements * mxfp4_scale_bytes(server)
    if spec.dtype == "F8_E8M0":
        return elements * 4
    return spec.nbytes


def weights_per_rank(specs: Iterable[TensorSpec], server: Server) -> RankWeights:
    """Bytes one of ``server.tp`` ranks holds of the native V4.1 checkpoint (the Engram tables counted apart: their
    place is :func:`engram_placement`'s). The DSpark stages (``mtp.*``) share the target's embedding and head."""
    out = RankWeights()
    for spec in specs:
        role = role_of(spec.name)
        if role == "engram_table":
            out.engram_tables += stored_bytes(spec, role, server)
            continue
        stored = stored_bytes(spec, role, server)
        split = role in _SPLIT_ROLES or any(s in spec.name for s in _SPLIT_ATTENTION)
        per_rank = stored // server.tp if split else stored
        if spec.name.startswith("mtp."):
            out.draft += per_rank
        else:
            out.target += per_rank
        out.by_role[role] = out.by_role.get(role, 0) + per_rank
    return out


# ---------------------------------------------------------------------------------------------
# One server, sized whole: what `fit`, `serve`'s Engram placement and the model card read.

@dataclass(frozen=True)
class ServerFitV41:
    """One V4.1 server with one Engram placement (the JSON keys are these field names)."""

    role: str
    tp: int
    engram: str
    kv_layout: str
    weights_bytes_per_rank: int          # what the GPU holds: backbone (+ the tables' shard where on GPU) + draft
    engram_gpu_bytes_per_rank: int
    engram_host_bytes_per_server: int
    engram_host_bytes_per_process: int
    mem_fraction_static: float
    min_mem_fraction_static: float
    kv_bytes_per_token: float
    kv_terms: dict
    swa_tokens: int
    fixed_bytes: int
    available_kv_bytes: int
    kv_tokens: int
    requests_at_context: int | None
    fits: bool
    drafter: str | None = None           # "dspark" when the launch serves the DSpark drafter
    draft_tokens: int | None = None      # tokens verified per step
    draft_weights_bytes_per_rank: int = 0
    draft_kv_bytes: int = 0              # the draft worker's own pool (one SWA layer per stage)
    draft_kv_budgeted_bytes: int = 0     # what SGLang's sizing set aside for it (one layer's worth)

    @property
    def draft_kv_unbudgeted_bytes(self) -> int:
        """Draft cache the engine allocates beyond what its sizing set aside (taken from the activation reserve)."""
        return max(self.draft_kv_bytes - self.draft_kv_budgeted_bytes, 0)


def size_server(cfg: V41Config, tensors: Iterable[TensorSpec], gpu: Gpu, server: Server, *,
                context: int | None = None) -> ServerFitV41:
    """One V4.1 server as it will run (its role, TP, request cap, Engram placement, DSpark draft) on ``gpu``, holding
    ``tensors`` (the release planned from ``cfg``, a converted variant, or a checkpoint's headers)."""
    role, tp, placement = server.role, server.tp, server.engram or "gpu"
    weights = weights_per_rank(tensors, server)
    engram = engram_placement(cfg, tp, placement)
    draft = weights.draft if server.mtp else 0
    on_gpu = weights.target + engram.gpu_bytes_per_rank + draft
    fraction = memory_fraction(server, gpu.mib)
    held = budget(gpu.mib, fraction.used, on_gpu)
    cost = kv_cost(cfg, server, fraction.chunked_prefill_size)
    full = kv_tokens(held.available_bytes, cost)
    needed = max(context or V4_PAGE_SIZE, V4_PAGE_SIZE)
    running = server.max_running_requests or V4_MAX_RUNNING_REQUESTS
    stages = cfg.dspark.stages if server.mtp and cfg.dspark else 0
    return ServerFitV41(
        role=role, tp=tp, engram=placement, kv_layout=cost.layout, weights_bytes_per_rank=on_gpu,
        engram_gpu_bytes_per_rank=engram.gpu_bytes_per_rank,
        engram_host_bytes_per_server=engram.host_bytes_per_server,
        engram_host_bytes_per_process=engram.host_bytes_per_process, mem_fraction_static=fraction.used,
        min_mem_fraction_static=held.min_mem_fraction_static, kv_bytes_per_token=cost.bytes_per_full_token,
        kv_terms=cost.terms, swa_tokens=cost.swa_tokens, fixed_bytes=cost.fixed_bytes,
        available_kv_bytes=held.available_bytes, kv_tokens=full,
        requests_at_context=min(full // context, running) if context else None,
        fits=held.available_bytes > cost.fixed_bytes and full >= needed,
        drafter="dspark" if server.mtp else None, draft_tokens=server.draft_tokens, draft_weights_bytes_per_rank=draft,
        draft_kv_bytes=draft_kv_bytes(cost, stages) if server.mtp else 0,
        draft_kv_budgeted_bytes=draft_kv_budgeted_bytes(cost, full) if server.mtp else 0)


@dataclass(frozen=True)
class PlacementChoice:
    """The Engram placement a launch gets by default, and every placement's servers as sized."""

    placement: str | None                # None: no placement fits every server
    fits: dict[str, list[ServerFitV41]]  # placement -> its servers, in the launch's order

    def why(self) -> str:
        """The choice in a sentence, with the numbers that made it."""
        def tokens(placement: str) -> str:
            return ", ".join(f"{f.role} {f.kv_tokens:,} KV tokens" if f.fits else f"{f.role} does not fit"
                             for f in self.fits[placement])
        if self.placement is None:
            return "no Engram placement fits every server: " + "; ".join(
                f"{p}: {tokens(p)}" for p in self.fits)
        if self.placement == "gpu":
            return f"the tables fit on the GPUs, SGLang's default ({tokens('gpu')})"
        return (f"the tables do not fit on the GPUs ({tokens('gpu')}); in host memory, one buffer per TP group "
                f"(SGLang's default host layout): {tokens(self.placement)}")


def choose_placement(cfg: V41Config, tensors: Sequence[TensorSpec], gpu: Gpu, servers: Sequence[Server], *,
                     context: int | None = None) -> PlacementChoice:
    """Where ``serve`` puts the Engram tables unless told: on the GPUs (SGLang's default: no host memory, no
    lookups over PCIe) when every server of the launch fits there, else in host memory shared per TP group
    (the host table's default layout; per rank holds the same GPU memory, so it never fits where shared does not),
    else nowhere (the launch is refused with every placement's numbers)."""
    fits = {p: [size_server(cfg, tensors, gpu, replace(s, engram=p), context=context) for s in servers]
            for p in ENGRAM_PLACEMENTS}
    chosen = next((p for p in ("gpu", "host-shared") if all(f.fits for f in fits[p])), None)
    return PlacementChoice(chosen, fits)
