"""How SGLang sizes GPU memory for DeepSeek-V4: pure arithmetic, no I/O.

Every function restates one piece of SGLang's own code (file and function named in its docstring;
paths relative to ``python/sglang/`` of the pinned wheel); ``tests/test_fit.py`` runs those SGLang
functions on the CPU and compares. Inputs are one server's settings as ``serve`` launches it
(:class:`dsv4convert.engines.sglang.server.Server`), the model's dimensions, and the tensors it loads.
Units: bytes unless a name says MiB; a GPU's size is what ``nvidia-smi`` reports, in MiB, which is what
SGLang's ``get_device_memory_capacity`` reads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dsv4convert.engines import SGLANG_LABEL, Gpu
from dsv4convert.engines.memory import (
    ESTIMATED,
    MIB,
    RUNTIME_OVERHEAD_MIB,
    KvGeometry,
    LoadRules,
    ServerFit,
    weights_per_rank,
)
from dsv4convert.engines.served import ServedModel
from dsv4convert.engines.sglang.numerics import Serving
from dsv4convert.engines.sglang.server import Server
from dsv4convert.models.deepseek_v4.layout import Drafter

# srt/arg_groups/deepseek_v4_hook.py apply_deepseek_v4_defaults; model_overrides/deepseek_v4.py.
V4_MAX_RUNNING_REQUESTS = 256
V4_PAGE_SIZE = 256
V4_SWA_FULL_TOKENS_RATIO = 0.1   # set before kv_cache_hook records it as explicit: ratio sizing, not cap mode
# kernels/ops/attention/dsv4/kv_layout.py KVLayout.V4 (SGLANG_DSV4_KV_LAYOUT defaults to "v4"): 448 FP8 nope
# + 64 BF16 rope = 576 data bytes, 8 scale bytes; a page is padded to a multiple of the 576-byte TMA row.
V4_KV_DATA_BYTES = 576
V4_KV_SCALE_BYTES = 8
V4_KV_PAGE_ALIGN = 576
COMPRESS_STATE_DTYPE_BYTES = 4   # SGLANG_DSV4_COMPRESS_STATE_DTYPE=float32


# ---------------------------------------------------------------------------------------------
# The memory fraction: srt/arg_groups/memory_hook.py handle_gpu_memory_settings, reserve_for_graph_mb.

@dataclass(frozen=True)
class MemoryFraction:
    """SGLang's default ``mem_fraction_static`` for a server, with every reserve term (MiB)."""

    gpu_mib: int
    default: float
    used: float                   # the launch's --mem-fraction-static, else the default
    chunked_prefill_size: int
    decode_max_bs: int
    activation_tokens: int
    terms_mib: dict[str, float]   # constant, activations, parallel, graphs (before the floor)
    reserved_mib: float           # after the 10 GiB floor


def _capacity_defaults(gpu_mib: float, tp: int) -> tuple[int, int]:
    """(chunked_prefill_size, decode graph max batch) by GPU memory, as handle_gpu_memory_settings sets them."""
    if gpu_mib < 20 * 1024:
        return 2048, 8
    if gpu_mib < 35 * 1024:
        return 4096, 48 if tp < 4 else 160
    if gpu_mib < 60 * 1024:
        return 4096, 32 if tp < 4 else 160
    if gpu_mib < 160 * 1024:
        return 8192, 256 if tp < 4 else 512
    return 16384, 512


def memory_fraction(server: Server, gpu_mib: int) -> MemoryFraction:
    """``handle_gpu_memory_settings``: the reserve for activations and CUDA graphs, and the fraction left.

    V4 turns the prefill CUDA graph off (no prefill-graph term) and sets max_running_requests only
    after this runs, so an unset limit counts as the decode graph's max batch here. V4's post-capture
    KV sizing is off (``overrides.py post_capture_kv_sizing_planned``), so the full reserve applies.
    """
    chunked, max_bs = _capacity_defaults(gpu_mib, server.tp)
    chunked = server.chunked_prefill_size or chunked
    if server.cuda_graph_max_bs_decode is not None:
        max_bs = server.cuda_graph_max_bs_decode
    elif server.max_running_requests is not None and max_bs > server.max_running_requests:
        max_bs = server.max_running_requests
    if server.role == "decode":
        running = server.max_running_requests or max_bs
        activation = max(running * (server.draft_tokens or 1), 2048)
    else:
        activation = max(chunked, 2048)
    terms = {"constant": 512.0, "activations": activation * 1.5, "parallel": server.tp / 8 * 1024,
             "decode_graphs": 0.0 if server.role == "prefill" else max_bs * 2.0}
    reserved = sum(terms.values())
    if gpu_mib > 60 * 1024:
        reserved = max(reserved, 10 * 1024)
    default = round((gpu_mib - reserved) / gpu_mib, 3)
    used = server.mem_fraction_static if server.mem_fraction_static is not None else default
    return MemoryFraction(gpu_mib, default, used, chunked, max_bs, activation, terms, reserved)


# ---------------------------------------------------------------------------------------------
# The V4 KV pool: srt/model_executor/pool_configurator.py DSV4PoolConfigurator.

@dataclass(frozen=True)
class KvCost:
    """Bytes one full-pool token costs per rank, the fixed per-request state, and each term."""

    bytes_per_full_token: float
    bytes_per_swa_token: float
    fixed_bytes: int                   # the ratio-128 compressor state ring of every request slot
    terms: dict[str, float]            # per full token, before the MTP inflation
    mtp_inflation: float


def v4_page_bytes(tokens_per_page: int) -> int:
    """``KVLayout.V4.page_bytes``: 584-byte entries, the page padded to a multiple of 576 bytes."""
    raw = tokens_per_page * (V4_KV_DATA_BYTES + V4_KV_SCALE_BYTES)
    return -(-raw // V4_KV_PAGE_ALIGN) * V4_KV_PAGE_ALIGN


def paged_kv_bytes_per_token(ratio: int, page_size: int = V4_PAGE_SIZE) -> float:
    """``_get_paged_kv_bytes_per_token``: a ratio-r cache holds page_size / r entries per page."""
    per_page = page_size // ratio if ratio else page_size
    return v4_page_bytes(per_page) / per_page


def indexer_bytes_per_token(index_head_dim: int) -> int:
    """``deepseek_v4_memory_pool.get_dsv4_indexer_bytes_per_token``, FP8 (NVIDIA keeps it for the FP4 indexer)."""
    return index_head_dim + index_head_dim // 128 * 4


def ring_size(ratio: int, mtp: bool) -> int:
    """``get_compress_state_ring_size``: rows per request of a compressor's state ring."""
    if ratio == 4:
        return 16 if mtp else 8
    return 256 if mtp else 128


def request_slots(server: Server) -> int:
    """``_get_num_req_slots``; PD decode adds ``disaggregation_decode_extra_slots`` (pd_disaggregation_hook.py:
    2x an explicit running limit of 32 or less, else 0)."""
    running = server.max_running_requests or V4_MAX_RUNNING_REQUESTS
    extra = 0
    if server.role == "decode" and server.max_running_requests is not None and server.max_running_requests <= 32:
        extra = 2 * server.max_running_requests
    return running + extra + 1


def kv_cost(geometry: KvGeometry, server: Server, page_size: int = V4_PAGE_SIZE) -> KvCost:
    """``DSV4PoolConfigurator.__init__``/``_get_bytes_per_swa_token``/``_get_bytes_per_full_token``/
    ``_get_c128_state_fixed_bytes`` on CUDA with the flashmla backend (no unified or trtllm pool)."""
    n = geometry.layers_by_ratio
    n4, n128 = n.get(4, 0), n.get(128, 0)
    ring4, ring128 = ring_size(4, server.mtp), ring_size(128, server.mtp)
    state4 = 2 * 2 * (geometry.head_dim + geometry.index_head_dim) * COMPRESS_STATE_DTYPE_BYTES
    swa_kv = paged_kv_bytes_per_token(0, page_size) * geometry.num_layers
    swa_state = ring4 / page_size * state4 * n4
    per_swa = swa_kv + swa_state
    terms = {
        "sliding_window_kv": V4_SWA_FULL_TOKENS_RATIO * swa_kv,
        "ratio4_compressor_state": V4_SWA_FULL_TOKENS_RATIO * swa_state,
        "ratio4_kv": n4 * paged_kv_bytes_per_token(4, page_size) / 4,
        "ratio4_indexer": n4 * indexer_bytes_per_token(geometry.index_head_dim) / 4,
        "ratio128_kv": n128 * paged_kv_bytes_per_token(128, page_size) / 128,
    }
    inflation = (geometry.num_layers + 1) / geometry.num_layers if server.mtp else 1.0
    rows = request_slots(server) * ring128 + ring128 + 1
    fixed = math.ceil(rows / 128) * 128 * 2 * geometry.head_dim * COMPRESS_STATE_DTYPE_BYTES * n128
    return KvCost(sum(terms.values()) * inflation, per_swa * inflation, fixed, terms, inflation)


def kv_tokens(available_bytes: int, cost: KvCost, page_size: int = V4_PAGE_SIZE) -> tuple[int, int]:
    """``DSV4PoolConfigurator.calculate_pool_sizes``: (full-pool tokens, sliding-window tokens), whole pages."""
    for_tokens = max(available_bytes - cost.fixed_bytes, 0)
    full = int(for_tokens / cost.bytes_per_full_token) // page_size * page_size
    return full, int(full * V4_SWA_FULL_TOKENS_RATIO) // page_size * page_size


# ---------------------------------------------------------------------------------------------
# Weights per rank: srt/models/deepseek_v4.py and the quant methods' create_weights.

# ---------------------------------------------------------------------------------------------
# The budget: srt/mem_cache/kv_cache_configurator.py _profile_available_bytes.

@dataclass(frozen=True)
class Budget:
    pre_load_bytes: int           # free memory before the weights load
    weights_bytes: int            # target + draft
    available_bytes: int          # the KV pool's budget (may be negative: does not load)
    min_mem_fraction_static: float  # SGLang's "minimum viable" fraction, rounded up as it prints it


def budget(gpu_mib: int, mem_fraction_static: float, weights_bytes: int,
           overhead_mib: int = RUNTIME_OVERHEAD_MIB) -> Budget:
    """``available = free_after_load - free_before_load * (1 - mem_fraction_static)``; SGLang refuses to
    start below ``1 - free_after_load / free_before_load`` and prints it rounded up to 3 decimals."""
    pre = (gpu_mib - overhead_mib) * MIB
    after = pre - weights_bytes
    available = int(after - pre * (1 - mem_fraction_static))
    if pre <= 0 or mem_fraction_static <= 0:   # a GPU its runtime and reserve already fill: nothing is left
        return Budget(pre, weights_bytes, min(available, 0), 1.0)
    minimum = 1 - after / pre
    return Budget(pre, weights_bytes, available, math.ceil(minimum * 1000) / 1000)


def load_rules(model: ServedModel, server: Server) -> LoadRules:
    """How SGLang stores these tensors under this server: ``wo_a`` as BF16 where the FP8 wo_a GEMM is off, the
    NVFP4 MoE method's second copy of its block scales except under TRT-LLM (sm_100's runner), and MXFP4 expert
    scales as F32 in the TRT-LLM MXFP4 method (the variant's rules name it)."""
    serving = Serving.of(server, model.config.get("quantization_config") or {})
    trtllm = server.moe_runner_backend is None and server.gpu_family == "sm100"
    rules = server.rules
    mxfp4 = tuple(4 if method == "Mxfp4FlashinferTrtllmMoEMethod" else 1      # it holds E8M0 scales as F32
                  for method in (rules.moe_method, rules.draft_moe_method))
    dspark = server.drafter is Drafter.DSPARK
    return LoadRules(wo_a_bf16=serving.wo_a() is None, nvfp4_scale_copies=1 if trtllm else 2, mxfp4_scale_bytes=mxfp4,
                     draft_wo_a_bf16=dspark, confidence_head_bytes=confidence_head_bytes(server) if dspark else 2)


def confidence_head_bytes(server: Server) -> int:
    """``models/deepseek_v4_dspark.py::build_dspark_v4_confidence_head``: an F32 head, built only when
    ``SGLANG_RAGGED_VERIFY_MODE`` is not ``static`` (its default, ``environ.py``); otherwise dropped at load."""
    return 0 if server.env.get("SGLANG_RAGGED_VERIFY_MODE", "static") == "static" else 4


def draft_kv_bytes(server: Server, swa_tokens: int, stages: int, page_size: int = V4_PAGE_SIZE) -> int:
    """The draft worker's own V4 pool (``kv_cache_configurator.py::_build_dsv4_kv_pool``, ``_derive_pool_sizes``):
    every draft layer is sliding-window only (compress ratio 0) and holds the target's SWA token count; EAGLE's
    NextN draft has one layer, DSPARK one per stage. SGLang budgets one draft layer whatever the algorithm
    (:func:`kv_cost`'s inflation), so a DSPARK draft's other stages come out of the reserve (derived from the
    code; not run on a GPU)."""
    if not server.mtp:
        return 0
    return int(swa_tokens * stages * paged_kv_bytes_per_token(0, page_size))


def size_server(model: ServedModel, gpu: Gpu, server: Server, *, context: int | None = None) -> ServerFit:
    """One SGLang server ``server`` loading ``model`` on ``gpu``: weights per rank, memory fraction, KV tokens."""
    weights = weights_per_rank(model.tensors, server.tp, load_rules(model, server))
    fraction = memory_fraction(server, gpu.mib)
    loaded = weights.target + (weights.draft if server.mtp else 0)
    held = budget(gpu.mib, fraction.used, loaded)
    cost = kv_cost(model.geometry, server)
    full, swa = kv_tokens(held.available_bytes, cost)
    stages = model.draft_blocks if server.drafter is Drafter.DSPARK else 1
    draft_kv = draft_kv_bytes(server, swa, stages)
    budgeted = int(full * cost.bytes_per_full_token * (1 - 1 / cost.mtp_inflation))
    running = min(server.max_running_requests or V4_MAX_RUNNING_REQUESTS, full // 2)
    needed = max(context or V4_PAGE_SIZE, V4_PAGE_SIZE)
    fits = held.available_bytes > 0 and full >= needed
    short = 0 if fits else int(cost.fixed_bytes + needed * cost.bytes_per_full_token - held.available_bytes)
    return ServerFit(
        role=server.role, gpu=gpu.name, tp=server.tp, mtp=server.mtp, weights_bytes_per_rank=loaded,
        draft_weights_bytes_per_rank=weights.draft if server.mtp else 0, mem_fraction_static=fraction.used,
        default_mem_fraction_static=fraction.default, reserved_mib=fraction.reserved_mib,
        reserve_terms_mib=fraction.terms_mib, kv_bytes_per_token=cost.bytes_per_full_token, kv_terms=cost.terms,
        fixed_state_bytes=cost.fixed_bytes, available_kv_bytes=held.available_bytes, kv_tokens=full,
        swa_tokens=swa, max_running_requests=max(running, 0),
        requests_at_context=min(full // context, running) if context else None,
        min_mem_fraction_static=held.min_mem_fraction_static, fits=fits, shortfall_bytes=max(short, 0),
        estimated=ESTIMATED, engine=SGLANG_LABEL.lower(), drafter=server.drafter.value if server.mtp else None,
        draft_tokens=server.draft_tokens, draft_kv_bytes=draft_kv, draft_kv_budgeted_bytes=budgeted if server.mtp else 0)
