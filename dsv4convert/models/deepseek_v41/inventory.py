"""Every tensor of DeepSeek-V4.1-Flash's native checkpoint, from its config alone.

Names are DeepSeek's own (``layers.N.attn.wq_a``, ``ffn.experts.E.w1``, ``.scale``), as both engines read them
(SGLang 0.5.23 ``models/deepseek_v4.py::DeepseekV4ForCausalLM.remap_weight_name_to_dpsk_hf_format``; vLLM 0.33.0
``models/deepseek_v41/nvidia/model.py::_make_deepseek_v4_weights_mapper``). What differs from V4:

* FP8 linears in ``fp8_block`` (32 x 32) blocks: ``.weight`` F8_E4M3 ``[out, in]``, ``.scale`` F8_E8M0
  ``[ceil(out/32), ceil(in/32)]``; routed experts MXFP4 as in V4 (I8 ``[out, in/2]`` + E8M0 ``[out, in/32]``).
* Compressed KV only on the KV-source layers (``attn.compressor.{norm,wkv}`` BF16, ``wgate`` where the ratio is
  above 1; ``attn.indexer.{k_norm,wk}`` BF16), the fine indexer's query side only on the index-source layers
  (``attn.indexer.weights_proj`` BF16, ``attn.indexer.wq_b`` FP8): SGLang's ``DeepseekV41Compressor`` and
  ``DeepseekV41Indexer`` (``layers/attention/dsv4/dsv41_sparse.py``) build those BF16, whatever the quant config.
* Engram on the Engram layers: ``engram.embed.weight`` F8_E4M3 ``[rows, head_dim]`` with one E8M0 scale per 32
  of a row (``engram.embed.scale`` ``[rows, head_dim / 32]``: ``layers/engram.py::EngramEmbedding``), ``engram.wkv``
  FP8 ``[hidden * (hc + 1), (ngram - 1) * heads * head_dim]``, ``engram.{q,k}_weight`` BF16 ``[hc, hidden]``.
* The router's ``gate.bias_vl`` (F32) beside ``gate.bias``; no hash routing (``tid2eid``), no ``hc_head_*``, no
  compressor ``ape``.
* The vision tower (``vision.*``, ``aligner.*``, ``image_{start,end,newline}``), all BF16.
* The DSpark stages ``mtp.S``: sliding-window blocks (no compressor, indexer or Engram) with
  ``dspark_n_routed_experts`` experts, ``mtp.0.main_proj``/``main_norm``, the last stage's ``norm``, Markov and
  confidence heads (no ``hc_head``).

``tests/test_models_v41.py`` plans the release's config and gets its 96,085 tensors and 510,286,023,000 bytes,
per dtype, exactly (../shared/reference/v41-flash.md section 2).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from dsv4convert.errors import CheckpointError
from dsv4convert.models import role_table
from dsv4convert.models.deepseek_v4.layout import MXFP4_GROUP, TensorSpec
from dsv4convert.models.deepseek_v41.config import V41Config


def fp8_linear(prefix: str, n: int, k: int, block: tuple[int, int]) -> list[TensorSpec]:
    return [TensorSpec(f"{prefix}.weight", "F8_E4M3", (n, k)),
            TensorSpec(f"{prefix}.scale", "F8_E8M0", (-(-n // block[0]), -(-k // block[1])))]


def mxfp4_linear(prefix: str, n: int, k: int) -> list[TensorSpec]:
    return [TensorSpec(f"{prefix}.weight", "I8", (n, k // 2)),
            TensorSpec(f"{prefix}.scale", "F8_E8M0", (n, k // MXFP4_GROUP))]


def _bf16(name: str, *shape: int) -> TensorSpec:
    return TensorSpec(name, "BF16", tuple(shape))


def _f32(name: str, *shape: int) -> TensorSpec:
    return TensorSpec(name, "F32", tuple(shape))


def _block(cfg: V41Config, p: str, experts: int) -> list[TensorSpec]:
    """What every backbone layer and DSpark stage holds: attention, router, experts, shared experts, norms, mHC."""
    h, heads, d, b = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.fp8_block
    inter, hc = cfg.moe_intermediate_size, cfg.hc_mult
    specs = [_f32(f"{p}.attn.attn_sink", heads), _bf16(f"{p}.attn.q_norm.weight", cfg.q_lora_rank),
             _bf16(f"{p}.attn.kv_norm.weight", d)]
    specs += fp8_linear(f"{p}.attn.wq_a", cfg.q_lora_rank, h, b)
    specs += fp8_linear(f"{p}.attn.wq_b", heads * d, cfg.q_lora_rank, b)
    specs += fp8_linear(f"{p}.attn.wkv", d, h, b)
    specs += fp8_linear(f"{p}.attn.wo_a", cfg.o_groups * cfg.o_lora_rank, heads * d // cfg.o_groups, b)
    specs += fp8_linear(f"{p}.attn.wo_b", h, cfg.o_groups * cfg.o_lora_rank, b)
    specs += [_bf16(f"{p}.attn_norm.weight", h), _bf16(f"{p}.ffn.gate.weight", experts, h),
              _f32(f"{p}.ffn.gate.bias", experts), _f32(f"{p}.ffn.gate.bias_vl", experts)]
    for e in range(experts):
        q = f"{p}.ffn.experts.{e}"
        specs += mxfp4_linear(f"{q}.w1", inter, h) + mxfp4_linear(f"{q}.w2", h, inter) + mxfp4_linear(f"{q}.w3", inter, h)
    shared = inter * cfg.n_shared_experts
    specs += (fp8_linear(f"{p}.ffn.shared_experts.w1", shared, h, b) + fp8_linear(f"{p}.ffn.shared_experts.w2", h, shared, b)
              + fp8_linear(f"{p}.ffn.shared_experts.w3", shared, h, b))
    specs.append(_bf16(f"{p}.ffn_norm.weight", h))
    mix = (2 + hc) * hc
    for kind in ("attn", "ffn"):
        specs += [_f32(f"{p}.hc_{kind}_fn", mix, hc * h), _f32(f"{p}.hc_{kind}_base", mix),
                  _f32(f"{p}.hc_{kind}_scale", 3)]
    return specs


def layer_inventory(cfg: V41Config, layer: int) -> list[TensorSpec]:
    """One backbone layer: the common block, then what its roles add (KV source, index source, Engram)."""
    p, h, b = f"layers.{layer}", cfg.hidden_size, cfg.fp8_block
    specs = _block(cfg, p, cfg.n_routed_experts)
    if layer in cfg.kv_source_layer_ids:
        d, i = cfg.head_dim, cfg.index_head_dim
        specs += [_bf16(f"{p}.attn.compressor.norm.weight", d), _bf16(f"{p}.attn.compressor.wkv.weight", d, h)]
        if cfg.ratio(layer) > 1:
            specs.append(_bf16(f"{p}.attn.compressor.wgate.weight", d, h))
        specs += [_bf16(f"{p}.attn.indexer.k_norm.weight", i), _bf16(f"{p}.attn.indexer.wk.weight", i, d)]
    if layer in cfg.index_source_layer_ids:
        specs.append(_bf16(f"{p}.attn.indexer.weights_proj.weight", cfg.index_n_heads, h))
        specs += fp8_linear(f"{p}.attn.indexer.wq_b", cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank, b)
    if layer in cfg.engram_layer_ids:
        specs += engram_table(cfg, layer)
        heads = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads * cfg.engram_head_dim
        specs += fp8_linear(f"{p}.engram.wkv", h * (cfg.hc_mult + 1), heads, b)
        specs += [_bf16(f"{p}.engram.q_weight", cfg.hc_mult, h), _bf16(f"{p}.engram.k_weight", cfg.hc_mult, h)]
    return specs


def engram_table(cfg: V41Config, layer: int) -> list[TensorSpec]:
    """An Engram layer's hash-embedding table: FP8 rows and their 1 x 32 E8M0 scales."""
    rows = cfg.engram_num_embeddings[cfg.engram_layer_ids.index(layer)]
    p = f"layers.{layer}.engram.embed"
    return [TensorSpec(f"{p}.weight", "F8_E4M3", (rows, cfg.engram_head_dim)),
            TensorSpec(f"{p}.scale", "F8_E8M0", (rows, cfg.engram_head_dim // 32))]


def stage_inventory(cfg: V41Config, stage: int) -> list[TensorSpec]:
    d, p, h = cfg.dspark, f"mtp.{stage}", cfg.hidden_size
    specs = _block(cfg, p, d.n_routed_experts)
    if stage == 0:
        specs += fp8_linear(f"{p}.main_proj", h, h * d.stages, cfg.fp8_block) + [_bf16(f"{p}.main_norm.weight", h)]
    if stage == d.stages - 1:
        specs += [_bf16(f"{p}.norm.weight", h), _bf16(f"{p}.markov_head.embed.weight", cfg.vocab_size, d.markov_rank),
                  _bf16(f"{p}.markov_head.head.weight", cfg.vocab_size, d.markov_rank),
                  _bf16(f"{p}.confidence_head.proj.weight", 1, h + d.markov_rank)]
    return specs


def vision_inventory(cfg: V41Config) -> list[TensorSpec]:
    """The vision tower and its aligner (SGLang builds it whenever ``vision_n_layers > 0``; vLLM always)."""
    v, h = cfg.vision, cfg.hidden_size
    if v is None:
        return []
    dim, patch = v.hidden_size, 3 * v.patch_size * v.patch_size
    specs = [_bf16("vision.patch_embed.proj.weight", dim, patch), _bf16("vision.patch_embed.proj.bias", dim)]
    for i in range(v.num_hidden_layers):
        p = f"vision.blocks.{i}"
        specs += [_bf16(f"{p}.norm1.weight", dim), _bf16(f"{p}.norm2.weight", dim),
                  _bf16(f"{p}.attn.wqkv.weight", 3 * dim, dim), _bf16(f"{p}.attn.wqkv.bias", 3 * dim),
                  _bf16(f"{p}.attn.wo.weight", dim, dim), _bf16(f"{p}.attn.wo.bias", dim),
                  _bf16(f"{p}.mlp.w1.weight", 2 * v.intermediate_size, dim),
                  _bf16(f"{p}.mlp.w2.weight", dim, v.intermediate_size)]
    merged = dim * v.downsample_ratio * v.downsample_ratio
    specs += [_bf16("vision.norm.weight", dim), _bf16("aligner.w1.weight", h, merged), _bf16("aligner.w1.bias", h),
              _bf16("aligner.w2.weight", h, h), _bf16("aligner.w2.bias", h)]
    return specs + [_bf16(f"image_{kind}", h) for kind in ("start", "end", "newline")]


def native_groups(cfg: V41Config) -> list[list[TensorSpec]]:
    """The tensors in groups a converter streams one at a time: the embedding, each layer (its Engram table a
    group of its own, as the release puts each table in a shard of its own), the final norm and head, the vision
    tower, each DSpark stage."""
    groups: list[list[TensorSpec]] = [[_bf16("embed.weight", cfg.vocab_size, cfg.hidden_size)]]
    tables = []
    for layer in range(cfg.num_hidden_layers):
        specs = layer_inventory(cfg, layer)
        table = {s.name for s in engram_table(cfg, layer)} if layer in cfg.engram_layer_ids else set()
        groups.append([s for s in specs if s.name not in table])
        tables += [[s for s in specs if s.name in table]] if table else []
    groups.append([_bf16("norm.weight", cfg.hidden_size), _bf16("head.weight", cfg.vocab_size, cfg.hidden_size)])
    groups.append(vision_inventory(cfg))
    groups += [stage_inventory(cfg, s) for s in range(cfg.dspark.stages if cfg.dspark else 0)]
    return [g for g in groups + tables if g]


def native_inventory(cfg: V41Config) -> list[TensorSpec]:
    return [spec for group in native_groups(cfg) for spec in group]


# What each tensor is, for inspect's role table and the converters' rules: first match wins.
_ROLES: list[tuple[str, str]] = [
    (r"\.engram\.embed\.", "engram_table"),
    (r"\.engram\.", "engram"),
    (r"^(vision|aligner)\.|^image_", "vision"),
    (r"\.ffn\.experts\.", "routed_expert"),
    (r"\.ffn\.shared_experts\.", "shared_expert"),
    (r"\.ffn\.gate\.", "router"),
    (r"\.attn\.compressor\.", "compressor"),
    (r"\.attn\.indexer\.wq_b\.", "indexer"),
    (r"\.attn\.indexer\.", "indexer_bf16"),
    (r"\.attn\.attn_sink$", "attn_sink"),
    (r"\.attn\.(wq_a|wq_b|wkv|wo_a|wo_b)\.", "attention"),
    (r"\.hc_", "hyper_connection"),
    (r"^mtp\.\d+\.main_proj\.", "mtp_projection"),
    (r"\.(markov_head|confidence_head)\.", "draft_head"),
    (r"^embed\.", "embed"),
    (r"^head\.", "head"),
    (r"norm\.weight$", "norm"),
]
_COMPILED = [(re.compile(pattern), role) for pattern, role in _ROLES]


def role_of(name: str) -> str:
    """A V4.1 tensor's role ("unknown" for a name the release does not have); a drafter's experts are
    ``routed_expert (mtp)``."""
    for pattern, role in _COMPILED:
        if pattern.search(name):
            return f"{role} (mtp)" if role == "routed_expert" and name.startswith("mtp.") else role
    return "unknown"


def expected_report(cfg: V41Config) -> dict:
    """``inspect --expected``'s plan of the native checkpoint: counts, bytes per group and role, every tensor."""
    groups = native_groups(cfg)
    specs = [s for g in groups for s in g]
    roles = role_table([(s.name, s.dtype, s.shape, s.nbytes) for s in specs], role_of)
    d = cfg.dspark
    drafter = (f"a DSpark drafter: {d.stages} stages (mtp.0-mtp.{d.stages - 1}) drafting blocks of {d.block_size} "
               f"from layers {', '.join(map(str, d.target_layer_ids))}, {d.n_routed_experts} experts, a "
               f"rank-{d.markov_rank} Markov head") if d else "no drafter"
    tables = next((r["bytes"] for r in roles if r["role"] == "engram_table"), 0)
    return {
        "release": "DeepSeek-V4.1-Flash",
        "variant": "native",
        "drafter": "dspark" if d else "none",
        "drafter_description": drafter,
        "fp8_block": list(cfg.fp8_block),
        "engram_table_bytes": tables,
        "tensor_count": len(specs),
        "total_bytes": sum(s.nbytes for s in specs),
        "shard_bytes": [sum(s.nbytes for s in g) for g in groups],
        "roles": roles,
        "tensors": [{"name": s.name, "dtype": s.dtype, "shape": list(s.shape)} for s in specs],
    }


def check_headers(cfg: V41Config, entries: Iterable[tuple[str, str, tuple[int, ...], str]]) -> None:
    """Refuse a native checkpoint whose headers disagree with its config, from ``(name, dtype, shape, file)``:
    one ``CheckpointError`` naming the file and tensor. An Engram table with other rows than
    ``engram_num_embeddings`` gives (both engines hash into exactly those rows: SGLang
    ``layers/engram.py::shard_range`` asserts the sum), an FP8 scale in other blocks than ``weight_block_size``
    (the release's 32 x 32; 128 x 128 is V4's, which both engines would read as 32 x 32 blocks), any other planned
    tensor of another dtype or shape. Names the plan does not have are left to the caller."""
    planned = {s.name: s for s in native_inventory(cfg)}
    for name, dtype, shape, file in entries:
        spec = planned.get(name)
        if spec is None or (spec.dtype, tuple(spec.shape)) == (dtype, tuple(shape)):
            continue
        role = role_of(name)
        if role == "engram_table" and len(shape) == 2 and shape[1] == spec.shape[1]:
            layer = int(name.split(".")[1])
            raise CheckpointError(f"has {shape[0]:,} rows but the config's text_config.engram_num_embeddings gives "
                                  f"layer {layer} {spec.shape[0]:,} (the rows SGLang and vLLM hash into)",
                                  file=file, tensor=name)
        weight = planned.get(name.removesuffix(".scale") + ".weight")
        if name.endswith(".scale") and weight is not None and weight.dtype == "F8_E4M3" and len(shape) == 2:
            n, k = weight.shape
            blocks = [b for b in (128, 64, 16) if tuple(shape) == (-(-n // b), -(-k // b))]
            block = f"{blocks[0]}x{blocks[0]} blocks" if blocks else f"shape {list(shape)}"
            raise CheckpointError(f"FP8 scales in {block}; DeepSeek-V4.1's FP8 linears have "
                                  f"{cfg.fp8_block[0]}x{cfg.fp8_block[1]} blocks (quantization_config."
                                  f"weight_block_size), scale shape {list(spec.shape)}", file=file, tensor=name)
        raise CheckpointError(f"is {dtype} {list(shape)}; the config plans {spec.dtype} {list(spec.shape)}",
                              file=file, tensor=name)
