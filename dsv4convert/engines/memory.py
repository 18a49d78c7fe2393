"""GPU memory terms both engines share: what a rank holds of each tensor, the KV geometry, a server's verdict.

Pure arithmetic, no I/O. Each engine's own sizing (:mod:`dsv4convert.engines.sglang.memory`,
:mod:`dsv4convert.engines.vllm.memory`) restates its code function by function; a GPU's size is what
``nvidia-smi`` reports, in MiB, which is what both engines read. Units: bytes unless a name says MiB.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

from dsv4convert.engines import SGLANG_LABEL
from dsv4convert.models.deepseek_v4.layout import Role, TensorInfo, classify

MIB = 1 << 20
GIB = 1 << 30

# Memory the CUDA context, NCCL and SGLang's communicators take before the weights load (estimated:
# not in SGLang's code; it measures free memory instead). The KV budget counts from what is left.
RUNTIME_OVERHEAD_MIB = 1536

ESTIMATED = (f"free memory before loading = GPU total - {RUNTIME_OVERHEAD_MIB} MiB (CUDA context, NCCL, "
             "communicators); SGLang measures it at startup",)


@dataclass(frozen=True)
class KvGeometry:
    """What the V4 pool's size depends on, from config.json."""

    layers_by_ratio: dict[int, int]   # backbone attention layers per compress ratio (0, 4, 128)
    head_dim: int                     # 512: qk_nope 448 + rope 64
    index_head_dim: int               # 128

    @property
    def num_layers(self) -> int:
        return sum(self.layers_by_ratio.values())


@dataclass(frozen=True)
class Tensor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    copies: int = 1   # identical tensors of the full model it stands for (a compact plan, source.planned)


@dataclass(frozen=True)
class LoadRules:
    """How the loader stores what the file holds, for one launch (from ``compare.numerics.Serving``)."""

    wo_a_bf16: bool            # the FP8 wo_a GEMM is off: wo_a is dequantized to BF16 at load
    nvfp4_scale_copies: int    # 2 where the NVFP4 MoE method also allocates ``*_blockscale_swizzled`` (not TRT-LLM)
    mxfp4_scale_bytes: tuple[int, int] = (1, 1)   # per E8M0 MXFP4 expert scale (target, draft): 4 where held as F32
    draft_wo_a_bf16: bool = False     # the draft's wo_a is BF16 whatever the target does (SGLang's DSpark stages)
    draft_wkv_copies: int = 1         # 2 where the draft keeps a second copy of each wkv (vLLM's context_wkv_proj)
    confidence_head_bytes: int = 2    # per element of a DSpark confidence head: 0 where it is not built, 4 as F32


# Attention projections each TP rank holds a slice of; wq_a and wkv (fused wqkv_a) are replicated.
_SPLIT_ATTENTION = (".attn.wq_b", ".attn.wo_a", ".attn.wo_b")
_SPLIT_ROLES = {Role.EMBED, Role.HEAD, Role.ROUTED_EXPERT, Role.SHARED_EXPERT}


@dataclass
class RankBytes:
    """Bytes one TP rank holds for the target model and for the MTP draft, and per role."""

    target: int = 0
    draft: int = 0
    by_role: dict[str, int] = field(default_factory=dict)


def _stored_bytes(tensor: Tensor, info: TensorInfo, module_scale_dtype: str | None, rules: LoadRules) -> int:
    """What the loader stores for one file tensor (before any TP split)."""
    elements = math.prod(tensor.shape) if tensor.shape else 1
    wo_a_bf16 = rules.wo_a_bf16 or (rules.draft_wo_a_bf16 and info.is_mtp)
    if info.module.endswith(".attn.wo_a") and wo_a_bf16 and module_scale_dtype is not None:
        return 0 if info.param == "scale" else elements * 2          # dequantized to BF16, scale consumed
    if info.module.endswith("confidence_head.proj"):
        return elements * rules.confidence_head_bytes
    copies = rules.draft_wkv_copies if info.is_mtp and info.module.endswith(".attn.wkv") else 1
    if info.param == "scale" and tensor.dtype == "F8_E8M0" and module_scale_dtype == "fp8":
        return elements * 4 * copies                                    # FP8 block scales load as F32
    if info.param == "scale" and tensor.dtype == "F8_E8M0" and module_scale_dtype == "mxfp4":
        return elements * rules.mxfp4_scale_bytes[info.is_mtp]
    if info.param == "tid2eid":
        return elements * 4                                             # I64 routing table loads as I32
    if info.param == "weight_scale" and tensor.dtype == "F8_E4M3" and info.role is Role.ROUTED_EXPERT:
        return tensor.nbytes * rules.nvfp4_scale_copies
    return tensor.nbytes * copies


def classified(tensors: Iterable[Tensor]) -> list[tuple[Tensor, TensorInfo]]:
    """Each tensor with its role and module (classify once; a model has ~90,000 tensors)."""
    return [(t, classify(t.name)) for t in tensors]


def weights_per_rank(tensors: list[tuple[Tensor, TensorInfo]], tp: int, rules: LoadRules) -> RankBytes:
    """Bytes one of ``tp`` ranks holds: split modules divided, replicated ones whole, as the loader stores them.

    Routed experts split their intermediate dimension under TP, or whole experts under EP: the same
    bytes per rank. The MTP draft (``mtp.*``) shares the target's embedding and head.
    """
    kinds = {info.module: {"F8_E4M3": "fp8", "I8": "mxfp4"}.get(t.dtype) for t, info in tensors
             if info.param == "weight"}
    out = RankBytes()
    for tensor, info in tensors:
        scale_kind = kinds.get(info.module)
        stored = _stored_bytes(tensor, info, scale_kind, rules)
        split = info.role in _SPLIT_ROLES or info.module.endswith(_SPLIT_ATTENTION)
        per_rank = (stored // tp if split else stored) * tensor.copies
        if info.is_mtp:
            out.draft += per_rank
        else:
            out.target += per_rank
        out.by_role[info.role.value] = out.by_role.get(info.role.value, 0) + per_rank
    return out


@dataclass(frozen=True)
class ServerFit:
    """Everything ``fit`` reports for one server (the JSON keys are these field names)."""

    role: str
    gpu: str
    tp: int
    mtp: bool
    weights_bytes_per_rank: int
    draft_weights_bytes_per_rank: int
    mem_fraction_static: float
    default_mem_fraction_static: float
    reserved_mib: float
    reserve_terms_mib: dict
    kv_bytes_per_token: float
    kv_terms: dict
    fixed_state_bytes: int
    available_kv_bytes: int
    kv_tokens: int
    swa_tokens: int
    max_running_requests: int
    requests_at_context: int | None
    min_mem_fraction_static: float
    fits: bool
    shortfall_bytes: int
    estimated: tuple[str, ...]
    engine: str = SGLANG_LABEL.lower()
    drafter: str | None = None           # the draft served (mtp or dspark), None without one
    draft_tokens: int | None = None      # tokens verified per step
    draft_kv_bytes: int = 0              # the draft's own cache as the engine allocates it, per rank
    draft_kv_budgeted_bytes: int = 0     # what the engine's KV sizing set aside for it

    @property
    def draft_kv_unbudgeted_bytes(self) -> int:
        """Draft cache the engine allocates beyond what its sizing set aside (taken from the reserve)."""
        return max(self.draft_kv_bytes - self.draft_kv_budgeted_bytes, 0)

    def as_dict(self) -> dict:
        return asdict(self)




def gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"
