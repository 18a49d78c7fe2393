"""``compare`` on DeepSeek-V4.1 checkpoints: the release or any conversion against another, through V4.1's forward.

Both sides are streamed through :class:`~dsv4convert.model.v41.forward.V41Runner`'s layers in lockstep: for each
layer, the base's block and the variant's block are built (one layer of each checkpoint resident), every
micro-batch goes through both, and they are freed before the next layer. Per layer:

* *free-running*: each side on its own streams and its own :class:`V41KVState` (the drift a user gets);
* *local*: the variant's whole layer fed the base's input (streams, lagged ``pre`` and the base's KV state);
* *components*: each part of the variant's layer run on the exact input the base's same part received (captured
  by forward hooks on the base's pass), against the base's output, so that an error is charged to the one part
  whose weights differ, never to a later part that reads its output:

  - ``layers.N.engram``: the Engram layer's contribution to the streams (its table rows, ``wkv``, the gates);
  - ``layers.S.attn.compressor``: a KV-source layer's compressed entries as stored (``Compressor.latent``, RoPE,
    the FP4 round trip where served: ``Attention.compressed_entries``), named by the SOURCE layer; the later layers that reuse its KV attend over the base's entries in their own components;
  - ``layers.N.attn.indexer``: an index-source layer's scores of every visible entry (queries from the base's
    query latent, keys from the base's compressor latent or the base's KV source's keys), its fine selection and,
    on ``candidate_source_layer_id``, the candidate blocks it publishes: the *candidate level* there, the *fine
    level* on every other index source;
  - ``layers.N.attn``: the attention itself (projections, window and selected entries, sink, output), on the
    base's compressed KV and selections;
  - ``layers.N.ffn``: the MoE (routing, routed and shared experts) on the base's input;
  - ``head``: the final norm and head on the base's last hidden states.

  The *culprit* is the component with the largest local relative error (``culprit``); when every component is
  exact but a layer's local error is not, that layer's hyper-connections and norms (``layers.N.hc``).

The output metrics are :mod:`.metrics`' (KLD set, same top-1, Δp, perplexity ratio, expected acceptance) over
every position but the last of every sequence, the report :mod:`.report`'s with a V4.1 section.

The DSpark drafter (both sides carry one, ``--no-mtp`` off): each side's target features are captured while the
backbone streams through, then :class:`~.v41_dspark.V41DraftPass` drafts with each side's stages streamed one at a
time and reports what 0731's comparison does (``compare.json``'s ``dspark``, :mod:`.dspark`'s measures and verdict).

Served numerics (``--numerics served``, the default): what ``model/v41`` restates of SGLang 0.5.23's V4.1 paths,
the FP4 round trips of the compressed KV (``fp4_fake_quant.py::fake_quant_compressed_kv``) and of the indexer's
queries and keys (``fake_quant_fp4``), which SGLang runs on every GPU family, and each side's activation
quantization (:mod:`.emulate_v41`, rules in ``engines/sglang/numerics.py::V41Serving``: the FP8 32x32 linears' 1 x 32
token groups, the routed experts' MXFP8 / NVFP4 / FP8 per stored format and family), put on every block a side
loads (:meth:`Side.block`) and so on in the free-running, local and component passes alike; the launch is the one
``serve`` makes (``engines/sglang/server.py::server_v41``: a variant SGLang refuses on the family is refused here).
Not emulated (:data:`NOT_EMULATED`): the sliding window's FP8 KV cache and the GEMMs' accumulation order.
``--numerics weights``: no round trip, no activation quantization.

``--recall`` (:func:`run_recall`): needle prompts from :mod:`dsv4convert.needle`, teacher-forced, and for each answer
query, whether the entry of the value token it writes is kept by the candidate level (in a block kept for that
query) and by each index-source layer's fine selection, read from each side's :class:`V41KVState`
(:func:`needle_kept`). ``--ablate`` re-runs the variant with the base's candidate blocks, then with the base's
candidate blocks and fine selections: the first row that retrieves what the base does names the level that lost
the needle.
"""

from __future__ import annotations

import sys
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dsv4convert import __version__
from dsv4convert.checkpoint import Checkpoint, TensorEntry, atomic_write_bytes, atomic_write_json
from dsv4convert.compare.eta import device_words, duration, gemm_rate
from dsv4convert.compare.metrics import HiddenError, OutputStats
from dsv4convert.compare.recall import overlap
from dsv4convert.compare.dspark_lines import dspark_plan_lines, dspark_result_lines
from dsv4convert.compare.report import write_reports
from dsv4convert.compare.run import CompareOptions, check_same_model, draft_estimate, token_ids
from dsv4convert.compare import emulate_v41
from dsv4convert.compare.v41_dspark import V41DraftPass
from dsv4convert.devices import resolve_device
from dsv4convert.engines import SGLANG, SGLANG_LABEL
from dsv4convert.engines.config import v41_variant_of
from dsv4convert.engines.outputs_v41 import layout_problems
from dsv4convert.engines.sglang.numerics import V41Serving
from dsv4convert.engines.sglang.server import server_v41
from dsv4convert.errors import DSV4Error
from dsv4convert.model.text import load_tokenizer
from dsv4convert.model.v41.attention import V41KVState
from dsv4convert.model.v41.forward import ForwardState, V41Block, V41Runner
from dsv4convert.models.deepseek_v4.names import DRAFT_PREFIX
from dsv4convert.models.deepseek_v41 import release as v41_release
from dsv4convert.models.deepseek_v41.config import V41Config
from dsv4convert.models.registry import release_of
from dsv4convert.needle import answer_ids, recall_grid, shortest_prompt, value_positions
from dsv4convert.sizes import human_bytes

COMPUTE = {"bfloat16": torch.bfloat16, "float32": torch.float32}
NOT_EMULATED = ("the sliding window's FP8 KV cache",
                "the GEMMs' accumulation order and BF16 intermediates inside fused kernels")


def is_v41(path: str | Path) -> bool:
    """Whether the checkpoint at ``path`` is a DeepSeek-V4.1 one, by the release registry (never a model_type)."""
    ckpt = Checkpoint.open(path)
    return release_of(ckpt.config, str(ckpt.root / "config.json")) is v41_release


# ------------------------------------------------------------------------------------------------- the plan


@dataclass
class Side:
    label: str
    ckpt: Checkpoint
    runner: V41Runner
    variant: str          # engines/config.py::v41_variant_of
    numerics: dict
    serving: V41Serving | None = None   # served numerics: the activation quantization put on each block

    def block(self, layer_id: int) -> V41Block:
        """``layers.N`` with this side's served activation quantization on (:mod:`.emulate_v41`)."""
        block = self.runner.load_block(layer_id)
        emulate_v41.install(block, f"layers.{layer_id}", self.serving, self.runner.source)
        return block


@dataclass
class V41Plan:
    options: CompareOptions
    base: Side
    variant: Side
    cfg: V41Config
    ids: torch.Tensor | None           # [sequences, seq_len] (plain compare)
    grid: "RecallGrid | None"          # the needle prompts (--recall)
    data: dict
    device: torch.device
    dtype: torch.dtype
    estimate: dict
    tracks: list[str] = field(default_factory=list)


def serving_of(kind: str, family: str, variant: str, ckpt: Checkpoint) -> V41Serving | None:
    """The SGLang launch whose numerics a side computes with (``served``: the one ``serve`` makes, ``server_v41``,
    refused where SGLang does not run ``variant`` on ``family``), or None (``weights``)."""
    if kind not in ("served", "weights"):
        raise DSV4Error(f"--numerics must be one of served, weights, got {kind!r}")
    if kind == "weights":
        return None
    try:
        server = server_v41(str(ckpt.root), family, variant=variant)
    except Exception as exc:     # EngineError: SGLang does not run this variant on this family
        raise DSV4Error(f"--gpu-family {family}: {exc}") from None
    return V41Serving.of(server, ckpt.config.get("quantization_config") or {})


def numerics_record(serving: V41Serving | None) -> dict:
    """A side's numerics, in the shape ``compare.json`` has for V4 (``label``, ``activations``, ``kv_cache``,
    ``indexer``, ``serving``), plus what is not emulated."""
    if serving is None:
        return {"label": "weights only", "activations": False, "kv_cache": False, "indexer": None, "serving": None,
                "not_emulated": []}
    record = {**serving.describe(), "moe_runner_backend": "SGLang's default for V4.1 (auto)",
              "kv_cache_dtype": "FP4 compressed entries (emulated); window FP8 (not emulated)",
              "dense_fp8_activation_scales": f"{serving.dense_scale_format()} per 1x32 token group",
              "wo_a": "bf16 (_dequant_fp8_wo_a_streaming)"}
    return {"label": "weights + activations + FP4 compressed KV + FP4 indexer", "activations": True,
            "kv_cache": "fp4 compressed", "indexer": "fp4", "serving": record, "not_emulated": list(NOT_EMULATED)}


def _side(label: str, path: str, kind: str, opts: CompareOptions, device: torch.device, dtype: torch.dtype) -> Side:
    ckpt = Checkpoint.open(path)
    if release_of(ckpt.config, str(ckpt.root / "config.json")) is not v41_release:
        raise DSV4Error(f"the {label} is not a DeepSeek-V4.1 checkpoint, the other side is: compare needs two "
                        "checkpoints of one model", file=ckpt.root / "config.json")
    variant = v41_variant_of(ckpt.config)
    check_text_layout(ckpt, variant, drafter=opts.mtp and opts.recall is None)
    serving = serving_of(kind, opts.gpu_family, variant, ckpt)
    return Side(label, ckpt, V41Runner(ckpt, device, dtype, fake_quant=kind == "served"), variant,
                numerics_record(serving), serving)


TEXT_MODEL = ("embed.", "layers.", "norm.", "head.")   # what the forward reads (no drafter, no vision tower)
DRAFTER = (DRAFT_PREFIX,)                               # what the DSpark pass reads besides


def check_text_layout(ckpt: Checkpoint, variant: str, *, drafter: bool = False) -> None:
    """The text model's tensors (and the DSpark drafter's, with ``drafter``) against what a ``variant`` output
    stores (``engines/outputs_v41.py::layout_problems``, the check ``inspect`` and ``validate`` run): the first
    problem is one error naming the file and tensor, before any layer is read."""
    cfg = v41_release.read_config(ckpt.config, str(ckpt.root / "config.json"))
    qc = ckpt.config.get("quantization_config") or {}
    group = (((qc.get("config_groups") or {}).get("group_0") or {}).get("weights") or {}).get("group_size", 32)
    for line in layout_problems(ckpt.tensors.values(), cfg, variant, group):
        parts = line.split(": ")
        name = parts[0] if parts[1].startswith("missing") else parts[1]
        if name.startswith(TEXT_MODEL + (DRAFTER if drafter else ())):
            raise DSV4Error(f"not a DeepSeek-V4.1 {variant} checkpoint compare can read: {line}", file=ckpt.root)


def build_plan(opts: CompareOptions) -> V41Plan:
    """Both checkpoints (V4.1, one model), each side's numerics, the data or the needle grid, the estimate."""
    if opts.engine != SGLANG:
        raise DSV4Error(f"--engine {opts.engine}: compare emulates {SGLANG_LABEL} only")
    if opts.batch_size < 1:
        raise DSV4Error(f"--batch-size must be at least 1, got {opts.batch_size}")
    device = resolve_device(opts.device)
    dtype_name = opts.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    if dtype_name not in COMPUTE:
        raise DSV4Error(f"--dtype must be one of {', '.join(COMPUTE)}, got {dtype_name!r}")
    dtype = COMPUTE[dtype_name]
    base = _side("base", opts.base, opts.base_numerics or opts.numerics, opts, device, dtype)
    variant = _side("variant", opts.variant, opts.numerics, opts, device, dtype)
    check_same_model(base.ckpt, variant.ckpt)
    cfg = base.runner.cfg
    ids, grid = None, None
    if opts.recall is None:
        ids, data = token_ids(opts, base.ckpt, cfg)
        tracks = ["base", "variant"]
    else:
        if opts.texts or opts.random_tokens:
            raise DSV4Error("--recall builds its own needle prompts: leave out --text and --random-tokens")
        grid = build_grid(load_tokenizer(base.ckpt.root), cfg, opts)
        data = {"source": "needle prompts (dsv4convert.needle)", "prompts": len(grid.prompts),
                "lengths": sorted({p.length for p in grid.prompts}), "depths": list(opts.recall.depths),
                "trials": opts.recall.trials, "seed": opts.recall.seed, "candidate_reach": grid.reach,
                "fine_thresholds": grid.thresholds, "sequences": len(grid.prompts),
                "seq_len": max(b.shape[1] for b in grid.batches)}
        tracks = ["base", "variant"] + (list(ABLATIONS) if opts.recall.ablate else [])
    plan = V41Plan(opts, base, variant, cfg, ids, grid, data, device, dtype, {}, tracks)
    plan.estimate = estimate(plan)
    return plan


# ------------------------------------------------------------------------------------------- cost estimate


def layer_flops_per_token(cfg: V41Config, context: int) -> float:
    """FLOPs of one token through an average V4.1 layer: the attention's linears, the routed experts it takes and
    the shared ones, the gate, attention over the window and the selected entries, the indexer's scores on
    index-source layers (about ``context / ratio`` entries), the Engram projection on Engram layers."""
    h, layers = cfg.hidden_size, cfg.num_hidden_layers
    linears = attention_linears(cfg)
    moe = 3 * h * cfg.moe_intermediate_size * (cfg.num_experts_per_tok + cfg.n_shared_experts) + h * cfg.n_routed_experts
    attention = 2 * cfg.num_attention_heads * cfg.head_dim * (min(context, cfg.sliding_window) + min(context,
                                                                                                    cfg.index_topk))
    ratios = [cfg.ratio(s) for s in cfg.index_source_layer_ids]
    indexer = sum(cfg.index_n_heads * cfg.index_head_dim * (context / r + cfg.q_lora_rank) for r in ratios) / layers
    hash_cols = cfg.engram_n_heads * (cfg.engram_max_ngram_size - 1)
    engram = len(cfg.engram_layer_ids) * (cfg.hc_mult + 1) * h * hash_cols * cfg.engram_head_dim / layers
    return 2.0 * (linears + moe + attention + indexer + engram)


def attention_linears(cfg: V41Config) -> int:
    """Multiply-adds of one token through an attention's projections (``wq_a``, ``wq_b``, ``wkv``, grouped
    ``wo_a``, ``wo_b``): a layer's and a DSpark stage's alike."""
    h = cfg.hidden_size
    return (h * cfg.q_lora_rank + cfg.q_lora_rank * cfg.num_attention_heads * cfg.head_dim + h * cfg.head_dim
            + cfg.num_attention_heads * cfg.head_dim * cfg.o_lora_rank + cfg.o_groups * cfg.o_lora_rank * h)


# Passes of each draft row through every stage and head: the base, the variant, the base again in other batches
# (the rounding floor), the variant on the base's input (local).
DRAFT_PASSES = 4


def draft_flops(cfg: V41Config, draft: dict) -> float:
    """FLOPs of the DSpark pass (:mod:`.v41_dspark`): every draft row through every stage (the attention's linears,
    the drafter's ``num_experts_per_tok`` experts and the shared one, attention over the window and the block) and
    through a head (the target's ``lm_head`` and the Markov head), :data:`DRAFT_PASSES` times."""
    h, d = cfg.hidden_size, cfg.dspark
    moe = 3 * h * cfg.moe_intermediate_size * (d.num_experts_per_tok + cfg.n_shared_experts) + h * d.n_routed_experts
    attention = 2 * cfg.num_attention_heads * cfg.head_dim * (cfg.sliding_window + d.block_size)
    stage = 2.0 * (attention_linears(cfg) + moe + attention)
    head = 2.0 * cfg.vocab_size * (h + d.markov_rank)
    return DRAFT_PASSES * draft["draft_rows"] * (d.stages * stage + head)


def drafting(plan: V41Plan) -> bool:
    """Whether the comparison drafts: both sides carry a DSpark drafter, ``--no-mtp`` is off, not ``--recall``."""
    return (plan.options.mtp and plan.grid is None and plan.base.runner.cfg.dspark is not None
            and plan.variant.runner.cfg.dspark is not None)


# Passes of each layer per token: the base, the variant, the variant on the base's input (local), and its parts
# on the base's inputs (about one more layer's work, both sides' parts).
PASSES = 4


def estimate(plan: V41Plan) -> dict:
    """Expected FLOPs and time at this device's measured GEMM rate, peak device memory (one layer of each side
    decoded in the compute dtype, the Engram table kept FP8, a micro-batch's streams, KV and indexer scores),
    host memory, bytes read."""
    cfg, item = plan.cfg, torch.empty((), dtype=plan.dtype).element_size()
    if plan.grid is None:
        seqs, longest = plan.ids.shape[0], plan.ids.shape[1]
        tokens, positions = plan.ids.numel(), plan.ids.numel()
        passes = PASSES
    else:
        seqs, longest = len(plan.grid.prompts), max(b.shape[1] for b in plan.grid.batches)
        tokens = sum(b.numel() for b in plan.grid.batches)
        positions = len(plan.grid.prompts) * max(len(a) for a in plan.grid.answers)
        passes = len(plan.tracks)
    flops = tokens * cfg.num_hidden_layers * passes * layer_flops_per_token(cfg, longest // 2) \
        + positions * 2.0 * 2 * cfg.vocab_size * cfg.hidden_size
    rate = gemm_rate(plan.device, plan.dtype, cfg.hidden_size)
    lookups = tokens * cfg.engram_n_heads * (cfg.engram_max_ngram_size - 1)   # Engram rows a table gives at most
    layer = max(_decoded_layer_bytes(s.ckpt, item, lookups) for s in (plan.base, plan.variant))
    rows = min(plan.options.batch_size, seqs)
    streams = rows * longest * cfg.hc_mult * cfg.hidden_size * item * 6
    entries = longest   # ratio 1 at most
    kv = rows * sum(entries // max(cfg.ratio(s), 1) * (cfg.head_dim + cfg.index_head_dim) * item
                    for s in cfg.kv_source_layer_ids)
    scores = 3 * rows * longest * entries * 4 + rows * cfg.num_attention_heads * min(longest, 256) * (
        cfg.sliding_window + entries) * 4 * 3
    head = cfg.vocab_size * cfg.hidden_size * item + rows * longest * cfg.vocab_size * 8 * 2
    tracks = len(plan.tracks)
    host = tracks * seqs * longest * cfg.hc_mult * cfg.hidden_size * item
    read = sum(_gathered_bytes(e, lookups) if ".engram.embed." in e.name else e.nbytes
               for s in (plan.base, plan.variant) for e in s.ckpt.tensors.values())
    out = {"gemm_rate": rate, "passes_per_layer": passes, "largest_layer_bytes": int(layer),
           "bytes_to_read": int(read)}
    peak = max(2 * layer + streams + kv + scores, head + streams)
    if drafting(plan):
        stage = max(_decoded_layer_bytes(s.ckpt, item, 0, prefix=DRAFT_PREFIX) for s in (plan.base, plan.variant))
        draft = draft_estimate(cfg, tokens, longest, item, plan.options.draft_anchors, 2 * stage)
        flops += draft_flops(cfg, draft)
        peak, host = max(peak, draft["device_bytes"]), host + draft["host_bytes"]
        out["dspark"] = draft
    return {**out, "flops": flops, "seconds": flops / rate, "peak_device_bytes": int(peak),
            "peak_host_bytes": int(host)}


def _gathered_bytes(entry: TensorEntry, lookups: int) -> int:
    """An Engram table's bytes that a forward of ``lookups`` hash ids reads: those rows at most
    (``V41Runner.load_block`` gathers them; the release's tables are 101 GB)."""
    rows = entry.shape[0] if entry.shape else 1
    return min(rows, lookups) * (entry.nbytes // max(rows, 1))


def _decoded_layer_bytes(ckpt: Checkpoint, item: int, lookups: int, prefix: str = "layers.") -> int:
    """A layer's weights as built on the device (``prefix`` ``mtp.``: a DSpark stage's): every linear decoded in the
    compute dtype (packed 4-bit codes two to a byte), scales not kept, the Engram table's looked-up rows as stored
    (FP8 rows and their scales)."""
    sizes: dict[str, int] = defaultdict(int)
    for name, entry in ckpt.tensors.items():
        if not name.startswith(prefix):
            continue
        layer = ".".join(name.split(".")[:2])
        if ".engram.embed." in name:
            sizes[layer] += _gathered_bytes(entry, lookups)
        elif name.endswith((".scale", "_scale", "_scale_2", ".input_scale", "weight_shape")):
            continue
        else:
            numel = entry.nbytes // max(1, {"F32": 4, "BF16": 2, "F16": 2, "I32": 4, "I64": 8}.get(entry.dtype, 1))
            packed = 2 if entry.dtype in ("I8", "U8") or name.endswith("weight_packed") else 1
            if name.endswith("weight_packed"):
                numel *= 4    # int32 words of eight 4-bit codes, counted as 4 bytes above
            sizes[layer] += numel * packed * item
    return max(sizes.values(), default=0)


def cost_line(plan: V41Plan) -> str:
    e = plan.estimate
    return (f"compare: expected {duration(e['seconds'])} on this device ({device_words(plan.device)}) for "
            f"{what_runs(plan)}: {e['flops'] / 1e9:.3g} GFLOP at a measured {e['gemm_rate'] / 1e9:.3g} GFLOP/s, a floor "
            "where per-call overheads dominate (small models)")


def what_runs(plan: V41Plan) -> str:
    if plan.grid is not None:
        return f"{len(plan.grid.prompts)} needle prompts x {len(plan.tracks)} tracks"
    return f"{plan.ids.shape[0]} x {plan.ids.shape[1]} tokens x {len(plan.tracks)} tracks"


def print_plan(plan: V41Plan) -> None:
    e = plan.estimate
    print(f"plan: {plan.variant.ckpt.root} (DeepSeek-V4.1 {plan.variant.variant}) against {plan.base.ckpt.root} "
          f"(DeepSeek-V4.1 {plan.base.variant})")
    if plan.grid is not None:
        d = plan.data
        print(f"  recall: {d['prompts']} needle prompts, lengths {d['lengths']}, depths {d['depths']}, "
              f"{d['trials']} trial(s); candidate reach {d['candidate_reach']} tokens")
        print(f"  tracks: {'; '.join(plan.tracks)}")
    else:
        print(f"  data: {plan.data['sequences']} sequences x {plan.data['seq_len']} tokens from {plan.data['source']}")
        for line in dspark_plan_lines(e.get("dspark"), plan.base.runner.cfg.dspark, plan.variant.runner.cfg.dspark):
            print(f"  {line}")
    print(f"  layers: {plan.cfg.num_hidden_layers}, each read once per checkpoint (one layer of each resident)"
          + ("" if plan.grid is not None else "; the variant's also on the base's input, and each of its parts on "
             "the base's part's input"))
    for side in (plan.base, plan.variant):
        n = side.numerics
        serving = n["serving"] or {}
        print(f"  {side.label}: {n['label']}; {serving.get('engine', '-')} {serving.get('gpu_family', '-')}, MoE "
              f"runner {serving.get('moe_runner_backend', '-')}")
    print(f"  device {plan.device} ({str(plan.dtype).replace('torch.', '')}): estimated peak device memory "
          f"{human_bytes(e['peak_device_bytes'])} (largest layer {human_bytes(e['largest_layer_bytes'])}, decoded), "
          f"host memory {human_bytes(e['peak_host_bytes'])}, reads {human_bytes(e['bytes_to_read'])}")
    print(f"  {cost_line(plan)}")
    print("dry run: nothing run")


# ------------------------------------------------------------------------------------------ the components


def snapshot(kv: V41KVState) -> V41KVState:
    """A copy of ``kv`` whose dicts a layer may extend without touching the original (tensors shared)."""
    return V41KVState(dict(kv.compressed), dict(kv.index_keys), kv.candidate_blocks, dict(kv.selections))


class Capture:
    """Forward hooks on a block's Engram, attention and MoE: each one's positional inputs and output."""

    PARTS = ("engram", "attn", "ffn")

    def __init__(self, block: V41Block):
        self.seen: dict[str, tuple[tuple, torch.Tensor]] = {}
        self.handles = [getattr(block, name).register_forward_hook(self._hook(name))
                        for name in self.PARTS if getattr(block, name, None) is not None]

    def _hook(self, name: str):
        def hook(module, args, output):
            self.seen[name] = (args, output)
        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def inner_inputs(block: V41Block, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """The base's inputs of its attention's inner parts: the query latent the indexer reads, the compressor's
    latent the index keys are made from (a KV source)."""
    attn = block.attn
    out = {"q_latent": attn.q_norm(attn.wq_a(x))}
    if attn.compressor is not None:
        out["latent"] = attn.compressor.latent(x)
    return out


def attention_core(attn, x: torch.Tensor, kv_after: V41KVState) -> torch.Tensor:
    """The attention of ``x`` over the compressed KV and selections already in ``kv_after`` (the base's, after its
    layer): the layer's own projections, window, sink and output, its compressor and indexer left out."""
    attn._sources = lambda *args: None     # shadows the method on this instance only
    try:
        return attn(x, snapshot(kv_after))
    finally:
        del attn._sources


def components(block: V41Block, seen: dict, inner: dict, kv_before: V41KVState,
               kv_after: V41KVState) -> dict[str, object]:
    """Each part of ``block`` on the base's captured inputs (module docstring): name -> output."""
    out: dict[str, object] = {}
    i = block.layer_id
    if block.engram is not None:
        args = seen["engram"][0]
        out[f"layers.{i}.engram"] = block.engram(*args) - args[0]
    attn = block.attn
    x = seen["attn"][0][0]
    if attn.compressor is not None:   # the entries as stored: pooled, normed, RoPE'd, FP4 round trip if served
        out[f"layers.{i}.attn.compressor"] = attn.compressed_entries(attn.compressor.latent(x),
                                                                     attn.rope(x.shape[1], x.device))
    if attn.indexer is not None and attn.indexer.is_index_source:
        if attn.indexer.owns_keys:
            keys = attn.index_keys(inner["latent"], attn.rope(x.shape[1], x.device))
        else:
            keys = kv_before.index_keys[attn.kv_source]
        out[f"layers.{i}.attn.indexer"] = attn.select(x, inner["q_latent"], keys, attn.rope(x.shape[1], x.device),
                                                      kv_before.candidate_blocks)
    out[f"layers.{i}.attn"] = attention_core(attn, x, kv_after)
    out[f"layers.{i}.ffn"] = block.ffn(*seen["ffn"][0])
    return out


@dataclass
class ComponentError:
    """A component's local error over the micro-batches: relative error (finite scores only, for an indexer) and,
    for an indexer, the fine selection's and the candidate blocks' overlap with the base's."""

    error: HiddenError = field(default_factory=HiddenError)
    selection: list[torch.Tensor] = field(default_factory=list)
    candidates: list[torch.Tensor] = field(default_factory=list)

    def add(self, reference, other) -> None:
        if isinstance(reference, tuple):     # an indexer: (scores, selection, candidates or None)
            finite = torch.isfinite(reference[0]) & torch.isfinite(other[0])
            self.error.add(reference[0][finite], other[0][finite])
            wrong = torch.isfinite(reference[0]) != torch.isfinite(other[0])
            if bool(wrong.any()):
                self.error.diff_sq += float(wrong.sum())   # a visible entry one side masks: a full miss each
            self.selection.append(overlap(reference[1].flatten(0, -2), other[1].flatten(0, -2)))
            if reference[2] is not None:
                self.candidates.append(overlap(reference[2].flatten(0, -2), other[2].flatten(0, -2)))
        else:
            self.error.add(reference, other)

    def result(self) -> dict:
        r = self.error.result()
        if self.selection:
            r["selection_overlap"] = float(torch.cat(self.selection).mean())
        if self.candidates:
            r["candidate_overlap"] = float(torch.cat(self.candidates).mean())
        return r


def describe_component(cfg: V41Config, name: str) -> dict:
    """What a component is: its kind, layer and, for an indexer, its level; for a compressor, who reads it."""
    parts = name.split(".")
    if parts[0] == "head":
        return {"component": name, "kind": "head", "layer": None}
    layer = int(parts[1])
    kind = {"engram": "engram", "ffn": "moe", "hc": "hyper-connections"}.get(parts[2]) if len(parts) == 3 else None
    if len(parts) == 3 and parts[2] == "attn":
        kind = "attention"
    if len(parts) == 4:
        kind = parts[3]
    d = {"component": name, "kind": kind, "layer": layer}
    if kind == "indexer":
        d["level"] = "candidate" if layer == cfg.candidate_source_layer_id else "fine"
    if kind == "compressor":
        d["read_by"] = [i for i in range(cfg.num_hidden_layers) if cfg.kv_source_of(i) == layer]
    return d


def culprit_sentence(c: dict) -> str:
    """The component a comparison names, in words."""
    kind, layer = c["kind"], c.get("layer")
    if kind == "indexer":
        level = "the candidate-level indexer" if c["level"] == "candidate" else "the fine indexer"
        return f"{level} of layers.{layer} ({c['component']})"
    if kind == "compressor":
        readers = ", ".join(str(i) for i in c["read_by"])
        return f"the compressor of KV-source layer {layer} ({c['component']}; its KV is read by layers {readers})"
    words = {"engram": "the Engram layer", "attention": "the attention", "moe": "the MoE experts",
             "hyper-connections": "the hyper-connections and norms", "head": "the output head"}
    return f"{words.get(kind, kind)} of layers.{layer} ({c['component']})" if layer is not None else \
        f"{words.get(kind, kind)} ({c['component']})"


def name_culprit(cfg: V41Config, comps: dict[str, dict], layers: list[dict]) -> dict:
    """The component with the largest local relative error; a layer's hyper-connections when every component is
    exact but the layer's local error is not; ``none`` when everything is exact."""
    ranked = sorted(comps.items(), key=lambda kv: -kv[1]["relative_error"])
    if ranked and ranked[0][1]["relative_error"] > 0:
        name, err = ranked[0]
        c = {**describe_component(cfg, name), **err}
        return {**c, "sentence": culprit_sentence(c)}
    moved = [b for b in layers if b["local"]["relative_error"] > 0]
    if moved:
        worst = max(moved, key=lambda b: b["local"]["relative_error"])
        c = {**describe_component(cfg, f"{worst['block']}.hc"), **worst["local"]}
        return {**c, "sentence": culprit_sentence(c)}
    return {"component": None, "kind": "none", "layer": None, "relative_error": 0.0,
            "sentence": "none: every component of the variant equals the base's"}


# ----------------------------------------------------------------------------------------- the lockstep run


Hook = Callable[[V41Block, int, ForwardState], None]


class Lockstep:
    """Base and variant tracks through the layers: per layer, the base's block and the variant's built once, every
    micro-batch through both (the base first, its parts' inputs captured), then freed."""

    def __init__(self, plan: V41Plan, batches: list[torch.Tensor], variant_tracks: dict[str, Hook | None],
                 measure: bool, capture: dict[str, tuple[int, ...]] | None = None):
        """``capture``: the layers whose DSpark feature each side's runs keep (``base``, ``variant``: the
        drafter's :meth:`~.v41_dspark.V41DraftPass.capture`); none without it."""
        self.plan, self.batches, self.measure = plan, batches, measure
        self.variant_tracks = variant_tracks
        capture = capture or {}
        self.base_runs = [plan.base.runner.begin(b, capture.get("base", ())) for b in batches]
        self.runs = {t: [plan.variant.runner.begin(b, capture.get("variant", ())) for b in batches]
                     for t in variant_tracks}
        self.free = defaultdict(HiddenError)        # layer -> variant free-running error
        self.local = defaultdict(HiddenError)
        self.comps: dict[str, ComponentError] = {}
        self.seconds = defaultdict(float)

    def run(self) -> None:
        cfg = self.plan.cfg
        bar = _progress(self.plan, cfg.num_hidden_layers)
        for i in range(cfg.num_hidden_layers):
            t0 = time.perf_counter()
            base_block = self.plan.base.block(i)
            variant_block = self.plan.variant.block(i)
            self.seconds["read"] += time.perf_counter() - t0
            t0 = time.perf_counter()
            for m, base_run in enumerate(self.base_runs):
                self._layer(i, m, base_run, base_block, variant_block)
            self.seconds["forward"] += time.perf_counter() - t0
            del base_block, variant_block
            if bar is not None:
                bar.update(1)
        if bar is not None:
            bar.close()

    def _layer(self, i: int, m: int, base_run: ForwardState, base_block: V41Block, variant_block: V41Block) -> None:
        streams_in, pre_in, kv_before = base_run.streams, base_run.pre, snapshot(base_run.kv)
        capture = Capture(base_block) if self.measure else None
        base_run.layer(base_block)
        for track, hook in self.variant_tracks.items():
            run = self.runs[track][m]
            restore = hook(variant_block, i, base_run) if hook is not None else None
            run.layer(variant_block)
            if restore is not None:
                restore()
        if capture is None:
            return
        capture.remove()
        self.free[i].add(base_run.streams, self.runs["variant"][m].streams)
        # local: the variant's whole layer on the base's input
        engrammed = variant_block.with_engram(streams_in, base_run.hash_ids, base_run.input_ids)
        local, _ = variant_block(engrammed, pre_in, snapshot(kv_before), base_run.image_mask)
        self.local[i].add(base_run.streams, local)
        del local, engrammed
        x = capture.seen["attn"][0][0]
        inner = inner_inputs(base_block, x)
        reference = components(base_block, capture.seen, inner, kv_before, base_run.kv)
        other = components(variant_block, capture.seen, inner, kv_before, base_run.kv)
        for name, value in reference.items():
            self.comps.setdefault(name, ComponentError()).add(value, other[name])

    def heads(self) -> tuple[Callable[[ForwardState, slice], torch.Tensor], Callable[[ForwardState, slice],
                                                                                      torch.Tensor]]:
        """Each side's logits of a run's positions ``rows`` (its final norm and head, built once)."""
        def head(runner: V41Runner):
            norm, weight = runner.final()
            return lambda run, rows: torch.nn.functional.linear(norm(_collapsed(run)[:, rows]), weight)
        return head(self.plan.base.runner), head(self.plan.variant.runner)


def _collapsed(run: ForwardState) -> torch.Tensor:
    """The streams collapsed with the last sublayer's ``pre`` (before the final norm), cached on the run."""
    if getattr(run, "_collapsed", None) is None:
        run._collapsed = run.hidden(lambda h: h)
    return run._collapsed


HEAD_POSITIONS = 1024   # positions per head evaluation (logits in float64 over the vocabulary in the metrics)


def _progress(plan: V41Plan, total: int, desc: str = "layers", unit: str = "layer"):
    if not plan.options.progress:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr)


def micro_batches(ids: torch.Tensor, size: int) -> list[torch.Tensor]:
    return [ids[s:s + size] for s in range(0, ids.shape[0], size)]


def run(plan: V41Plan) -> dict:
    """A plain comparison: ``compare.json``'s content (V4's shape where it applies, ``v41`` for the rest)."""
    if plan.grid is not None:
        return run_recall(plan)
    t0 = time.perf_counter()
    batches = micro_batches(plan.ids.to(plan.device), plan.options.batch_size)
    o = plan.options
    draft = None
    if drafting(plan):
        draft = V41DraftPass(plan.base.runner.source, plan.variant.runner.source, batches,
                             anchors=o.draft_anchors, chunk=o.chunk,
                             servings={"base": plan.base.serving, "variant": plan.variant.serving},
                             progress=lambda total: _progress(plan, total, "DSpark drafter", "step"))
    engine = Lockstep(plan, batches, {"variant": None}, measure=True,
                      capture=draft.capture() if draft is not None else None)
    head_error = ComponentError()
    top1: dict[str, list[torch.Tensor]] = {"base": [], "variant": []}   # each side's greedy token, every position
    with torch.no_grad():
        engine.run()
        base_head, variant_head = engine.heads()
        stats = OutputStats()
        t1 = time.perf_counter()
        for b, ids in enumerate(batches):
            base_run, variant_run = engine.base_runs[b], engine.runs["variant"][b]
            greedy: dict[str, list[torch.Tensor]] = {"base": [], "variant": []}
            for start in range(0, ids.shape[1], HEAD_POSITIONS):
                rows = slice(start, min(start + HEAD_POSITIONS, ids.shape[1]))
                reference, other = base_head(base_run, rows), variant_head(variant_run, rows)
                greedy["base"].append(reference.argmax(-1).cpu())
                greedy["variant"].append(other.argmax(-1).cpu())
                scored = min(rows.stop, ids.shape[1] - 1) - start    # positions with a next token
                if scored > 0:
                    stats.add(reference[:, :scored], other[:, :scored], ids[:, start + 1:start + 1 + scored])
                    head_error.add(reference[:, :scored], variant_head(base_run, rows)[:, :scored])
            for label, parts in greedy.items():
                top1[label].append(torch.cat(parts, dim=1))
        engine.seconds["metrics"] += time.perf_counter() - t1
        dspark = None
        if draft is not None:
            dspark = draft.summary(draft.run(engine.base_runs, engine.runs["variant"], top1))
            engine.seconds["dspark"] = draft.seconds
    cfg = plan.cfg
    blocks = [{"block": f"layers.{i}", "free_running": engine.free[i].result(), "local": engine.local[i].result()}
              for i in range(cfg.num_hidden_layers)]
    comps = {name: c.result() for name, c in engine.comps.items()}
    comps["head"] = head_error.result()
    culprit = name_culprit(cfg, comps, blocks)
    ranked = [{**describe_component(cfg, n), **e} for n, e in sorted(comps.items(),
                                                                       key=lambda kv: -kv[1]["relative_error"])]
    return {
        "tool": f"dsv4convert {__version__}",
        "release": v41_release.NAME,
        "base": side_record(plan.base), "variant": side_record(plan.variant), "data": plan.data,
        "settings": {"device": str(plan.device), "dtype": str(plan.dtype).replace("torch.", ""),
                     "batch_size": o.batch_size, "mtp": draft is not None},
        "output": stats.summary(),
        "mtp_draft_agreement": {},
        "dspark": dspark,
        "blocks": blocks,
        "v41": {"culprit": culprit, "components": ranked,
                "candidate_source_layer_id": cfg.candidate_source_layer_id,
                "kv_source_layer_ids": list(cfg.kv_source_layer_ids),
                "index_source_layer_ids": list(cfg.index_source_layer_ids),
                "engram_layer_ids": list(cfg.engram_layer_ids),
                "not_compared": "the vision tower"},
        "seconds": {**{k: round(v, 3) for k, v in engine.seconds.items()}, "wall": round(time.perf_counter() - t0, 3)},
        "peak_device_bytes": torch.cuda.max_memory_allocated(plan.device) if plan.device.type == "cuda" else None,
        "estimate": plan.estimate,
        "_kld_values": stats.kld_values(),
    }


def side_record(side: Side) -> dict:
    return {"path": str(side.ckpt.root), "variant": side.variant, "numerics": side.numerics}


# ----------------------------------------------------------------------------------------------- --recall


# --ablate's rows: the variant with the base's choice of one level, then of both (module docstring).
ABLATIONS = {"variant with the base's candidate blocks": ("candidate",),
             "variant with the base's candidate blocks and fine selections": ("candidate", "fine")}


@dataclass
class RecallGrid:
    prompts: list
    batches: list[torch.Tensor]               # one per total length: [prompts, length + answer]
    where: list[tuple[int, int]]              # prompt -> (batch, row)
    answers: list[list[int]]                  # prompt -> answer token ids
    positions: list[list[int]]                # prompt -> the prompt positions holding the needle's value
    aligned: list[bool]                       # prompt -> positions[j] is the value token answer token j writes
    reach: int                                # tokens the candidate level reaches (blocks x block size x ratio)
    thresholds: dict[int, int]                # index-source layer -> first prompt length whose answer query leaves
                                              # one of its entries out


def default_lengths(cfg: V41Config, shortest: int) -> list[int]:
    """Straddling each level's reach: the longest fine threshold, the candidate level's reach and just past it,
    then twice and four times the reach."""
    thresholds = fine_thresholds(cfg)
    reach = candidate_reach(cfg)
    lengths = {max(thresholds.values()), reach, reach + max(reach // 16, 4), 2 * reach, 4 * reach}
    return sorted(n for n in lengths if n >= shortest)


def fine_thresholds(cfg: V41Config) -> dict[int, int]:
    """Per index-source layer of ratio ``r``: ``r * index_topk + r``, the first prompt length whose answer query
    (position ``L - 1``, seeing ``L // r`` entries) leaves an entry out (``needle.selection_threshold``'s rule)."""
    return {s: cfg.ratio(s) * cfg.index_topk + cfg.ratio(s) for s in cfg.index_source_layer_ids}


def candidate_reach(cfg: V41Config) -> int:
    return cfg.candidate_topk_blocks * cfg.candidate_block_size * max(cfg.ratio(cfg.candidate_source_layer_id), 1)


def build_grid(tokenizer, cfg: V41Config, opts: CompareOptions) -> RecallGrid:
    r = opts.recall
    shortest = shortest_prompt(tokenizer)
    lengths = r.lengths or default_lengths(cfg, shortest)
    if r.trials < 1:
        raise DSV4Error(f"--trials must be at least 1, got {r.trials}")
    try:
        prompts = recall_grid(tokenizer, lengths, r.depths, r.trials, r.seed)
    except ValueError as exc:
        raise DSV4Error(f"needle grid: {exc}") from None
    rows: dict[int, list[tuple[int, list[int]]]] = defaultdict(list)
    answers, positions, aligned = [], [], []
    for i, p in enumerate(prompts):
        answer = answer_ids(tokenizer, p.needle)
        answers.append(answer)
        found = value_positions(p.input_ids, p.needle_span, answer)
        positions.append(found if found is not None else list(range(*p.needle_span)))
        aligned.append(found is not None)
        rows[len(p.input_ids) + len(answer)].append((i, p.input_ids + answer))
    batches, where = [], [(0, 0)] * len(prompts)
    for total in sorted(rows):
        for row, (i, _) in enumerate(rows[total]):
            where[i] = (len(batches), row)
        batches.append(torch.tensor([ids for _, ids in rows[total]], dtype=torch.int64))
    return RecallGrid(prompts, batches, where, answers, positions, aligned, candidate_reach(cfg),
                      fine_thresholds(cfg))


def needle_kept(cfg: V41Config, kv: V41KVState, row: int, queries: list[int], positions: list[int]) -> dict:
    """Whether the needle's value is kept, per level, from a forward's :class:`V41KVState` for batch row ``row``:
    the answer query ``queries[j]`` needs the entry of the value token at ``positions[j]`` (the query that writes
    digit ``j`` reads it: what SGLang's selection must hand that query). ``candidate``: every such entry, at the
    candidate source's ratio, lies in a block kept for its query (``candidate_blocks``); ``fine`` per index-source
    layer: every such entry, at that layer's ratio, is in its query's ``selections``; with the fraction each keeps,
    and ``in_window`` (every value token within its query's sliding window, which needs no selection)."""
    out: dict = {"in_window": all(q - p < cfg.sliding_window for q, p in zip(queries, positions))}
    c = cfg.candidate_source_layer_id
    if kv.candidate_blocks is not None:
        ratio, size = max(cfg.ratio(c), 1), cfg.candidate_block_size
        hits = [(p // ratio) // size in set(kv.candidate_blocks[row, q].tolist()) for q, p in zip(queries, positions)]
        out["candidate"], out["candidate_fraction"] = all(hits), sum(hits) / len(hits)
        out["candidate_blocks"] = sorted({(p // ratio) // size for p in positions})
    fine, fractions = {}, {}
    for s, picks in sorted(kv.selections.items()):
        ratio = max(cfg.ratio(s), 1)
        hits = [p // ratio in set(picks[row, q].tolist()) for q, p in zip(queries, positions)]
        fine[s], fractions[s] = all(hits), sum(hits) / len(hits)
    out["fine"], out["fine_fraction"] = fine, fractions
    return out


def answer_queries(grid: "RecallGrid", i: int) -> list[int]:
    """The query that needs each of prompt ``i``'s value positions: answer query ``j`` (at ``L - 1 + j``) writes
    value token ``j``; where the value was not found token for token (``positions`` is the whole needle sentence),
    the first answer query needs all of it."""
    first = len(grid.prompts[i].input_ids) - 1
    if grid.aligned[i]:
        return [first + j for j in range(len(grid.positions[i]))]
    return [first] * len(grid.positions[i])


def substitute_levels(levels: tuple[str, ...]) -> Hook:
    """A hook giving the variant's attention at index-source layers the base's choice of ``levels`` (candidate
    blocks, fine selections), installed around one layer's run and undone after it."""
    def hook(block: V41Block, layer: int, base_run: ForwardState):
        attn = block.attn
        if attn.indexer is None or not attn.indexer.is_index_source:
            return None
        original = attn._sources

        def sources(x, q_latent, table, state):
            original(x, q_latent, table, state)
            if "candidate" in levels and base_run.kv.candidate_blocks is not None:
                state.candidate_blocks = base_run.kv.candidate_blocks   # later consumers pick among the base's
            if "fine" in levels:
                state.selections[layer] = base_run.kv.selections[layer]

        attn._sources = sources

        def restore():
            del attn._sources
        return restore
    return hook


def run_recall(plan: V41Plan) -> dict:
    """``--recall``: retrieval per track, and per prompt what each level kept for the answer queries."""
    t0 = time.perf_counter()
    grid, cfg = plan.grid, plan.cfg
    tracks: dict[str, Hook | None] = {"variant": None}
    if plan.options.recall.ablate:
        tracks.update({name: substitute_levels(levels) for name, levels in ABLATIONS.items()})
    batches = [b.to(plan.device) for b in grid.batches]
    engine = Lockstep(plan, batches, tracks, measure=False)
    with torch.no_grad():
        engine.run()
        base_head, variant_head = engine.heads()
        prompts = []
        for i, p in enumerate(grid.prompts):
            b, row = grid.where[i]
            length, answer = len(p.input_ids), grid.answers[i]
            rows = slice(length - 1, length - 1 + len(answer))
            entry = {"length": p.length, "depth": p.depth, "retrieved": {}, "kept": {}}
            for label, runs, head in [("base", engine.base_runs, base_head)] + [
                    (t, engine.runs[t], variant_head) for t in tracks]:
                predicted = head(runs[b], rows)[row].argmax(-1).tolist()
                entry["retrieved"][label] = predicted == answer
                entry["kept"][label] = needle_kept(cfg, runs[b].kv, row, answer_queries(grid, i), grid.positions[i])
            prompts.append(entry)
    summary = summarize_recall(cfg, prompts, ["base", *tracks])
    summary["diagnosis"] = diagnose_levels(prompts, ablate=plan.options.recall.ablate)
    return {"tool": f"dsv4convert {__version__}", "release": v41_release.NAME,
            "base": side_record(plan.base), "variant": side_record(plan.variant), "data": plan.data,
            "settings": {"device": str(plan.device), "dtype": str(plan.dtype).replace("torch.", ""),
                         "ablate": plan.options.recall.ablate},
            "recall": summary, "prompts": prompts,
            "seconds": {**{k: round(v, 3) for k, v in engine.seconds.items()},
                        "wall": round(time.perf_counter() - t0, 3)},
            "estimate": plan.estimate}


def summarize_recall(cfg: V41Config, prompts: list[dict], tracks: list[str]) -> dict:
    """Per track: retrieval rate, and how often each level kept the needle (candidate; fine per layer)."""
    out = {}
    for t in tracks:
        kept = [p["kept"][t] for p in prompts]
        fine_layers = sorted({s for k in kept for s in k["fine"]})
        out[t] = {"accuracy": sum(p["retrieved"][t] for p in prompts) / len(prompts),
                  "candidate_kept": _rate([k.get("candidate") for k in kept]),
                  "fine_kept": {str(s): _rate([k["fine"].get(s) for k in kept]) for s in fine_layers}}
    return {"tracks": out, "candidate_source_layer_id": cfg.candidate_source_layer_id}


def _rate(values: list) -> float | None:
    seen = [v for v in values if v is not None]
    return sum(seen) / len(seen) if seen else None


def diagnose_levels(prompts: list[dict], *, ablate: bool) -> dict:
    """Which level lost the needle, over the prompts the base retrieves and the variant does not: by selection
    (the base's candidate level kept the needle and the variant's did not: ``candidate``; else a fine layer that
    did: ``fine``, naming it; else ``after_selection``) and, with ``--ablate``, by the first row that retrieves
    it again (the base's candidate blocks: ``candidate``; the base's fine selections too: ``fine``; neither:
    ``after_selection``). ``none`` when no prompt is lost."""
    lost = [p for p in prompts if p["retrieved"]["base"] and not p["retrieved"]["variant"]]
    if not lost:
        return {"kind": "none", "lost": 0, "sentence": "the variant retrieves every needle the base does"}
    votes: dict[str, int] = defaultdict(int)
    for p in lost:
        base, variant = p["kept"]["base"], p["kept"]["variant"]
        if base.get("candidate") and not variant.get("candidate"):
            votes["candidate"] += 1
            continue
        dropped = [s for s, k in base["fine"].items() if k and not variant["fine"].get(s)]
        votes[f"fine:layers.{dropped[0]}" if dropped else "after_selection"] += 1
    by_selection = max(votes, key=votes.__getitem__)
    out = {"lost": len(lost), "by_selection": dict(votes), "kind": by_selection.split(":")[0],
           "layer": by_selection.split(":")[1] if ":" in by_selection else None}
    if ablate:
        first = list(ABLATIONS)
        rows = defaultdict(int)
        for p in lost:
            if p["retrieved"][first[0]]:
                rows["candidate"] += 1
            elif p["retrieved"][first[1]]:
                rows["fine"] += 1
            else:
                rows["after_selection"] += 1
        out["by_ablation"] = dict(rows)
        out["kind"] = max(rows, key=rows.__getitem__)
    level = {"candidate": "the candidate level", "fine": "the fine level", "after_selection":
             "after selection (attention or what follows it)"}[out["kind"]]
    out["sentence"] = (f"{len(lost)} needle(s) the base retrieves are lost; the level that lost them: {level}"
                       + (f" ({out['layer']})" if out.get("layer") and out["kind"] == "fine" else ""))
    return out


# ----------------------------------------------------------------------------------------------- reports


def recall_markdown(result: dict) -> str:
    r = result["recall"]
    lines = [f"# compare --recall: {result['variant']['path']} against {result['base']['path']}", "",
             f"{result['data']['prompts']} needle prompts, lengths {result['data']['lengths']}; candidate level "
             f"at layers.{r['candidate_source_layer_id']} reaches {result['data']['candidate_reach']} tokens.", "",
             f"**{r['diagnosis']['sentence']}.**", "",
             "| track | retrieved | candidate level kept | fine level kept (per layer) |", "|---|---|---|---|"]
    for t, s in r["tracks"].items():
        fine = ", ".join(f"{k}: {_pct(v)}" for k, v in s["fine_kept"].items())
        lines.append(f"| {t} | {_pct(s['accuracy'])} | {_pct(s['candidate_kept'])} | {fine} |")
    lines += ["", "Per prompt (each answer query and the value token it writes):", "",
              "| length | depth | track | retrieved | in window | candidate | fine |", "|---|---|---|---|---|---|---|"]
    for p in result["prompts"]:
        for t, k in p["kept"].items():
            fine = ", ".join(f"{s}: {'kept' if v else 'dropped'}" for s, v in k["fine"].items())
            lines.append(f"| {p['length']} | {p['depth']} | {t} | {p['retrieved'][t]} | {k['in_window']} | "
                         f"{k.get('candidate')} | {fine} |")
    return "\n".join(lines) + "\n"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def write_recall_report(result: dict, out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out_dir / "compare.md", recall_markdown(result).encode("utf-8"))
    atomic_write_json(out_dir / "recall.json", result)
    return [out_dir / "recall.json", out_dir / "compare.md"]


def main(opts: CompareOptions, *, dry_run: bool, report: Path | None, fail_above_kld: float | None,
         fail_on_lost_needle: bool) -> int:
    """``dsv4convert compare`` on two V4.1 checkpoints (called by ``compare/cli.py``)."""
    plan = build_plan(opts)
    if dry_run:
        print_plan(plan)
        return 0
    print(cost_line(plan), file=sys.stderr, flush=True)
    root = plan.variant.ckpt.root
    out_dir = Path(report or root.parent / f"{root.name}-compare")
    if plan.grid is not None:
        result = run_recall(plan)
        write_recall_report(result, out_dir)
        r = result["recall"]
        for t, s in r["tracks"].items():
            print(f"{t}: retrieved {_pct(s['accuracy'])}, candidate level kept {_pct(s['candidate_kept'])}, fine "
                  "level kept " + ", ".join(f"layers.{k} {_pct(v)}" for k, v in s["fine_kept"].items()))
        print(f"recall: {r['diagnosis']['sentence']}")
        print(f"report: {out_dir / 'compare.md'}")
        base, variant = r["tracks"]["base"], r["tracks"]["variant"]
        return 1 if fail_on_lost_needle and variant["accuracy"] < base["accuracy"] else 0
    result = run(plan)
    write_reports(result, out_dir)
    o = result["output"]
    print(f"{opts.variant} vs {opts.base}: mean KLD {o['kld']['mean']:.6g} \u00b1 {o['kld']['standard_error']:.2g} "
          f"nats, same top-1 {100 * o['same_top1']:.2f}%, perplexity ratio {o['perplexity']['ratio']:.4f}, "
          f"expected acceptance {100 * o['expected_acceptance']:.2f}% ({o['positions']} positions)")
    print(f"  culprit: {result['v41']['culprit']['sentence']}")
    for line in dspark_result_lines(result["dspark"]):
        print(f"  {line}")
    print(f"report: {out_dir / 'compare.md'}")
    if fail_above_kld is not None and o["kld"]["mean"] > fail_above_kld:
        print(f"compare: mean KLD {o['kld']['mean']:.6g} is above --fail-above-kld {fail_above_kld}")
        return 1
    return 0
