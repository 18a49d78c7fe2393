"""``compare``: plan (both checkpoints, the data, each side's numerics), check, estimate, run, report.

Everything a run needs is checked before the first layer is read: both checkpoints match the
DeepSeek-V4 layout and the same model config (quantization aside), the text tokenizes with the
base's tokenizer into at least one sequence, and each side's numerics follow from its launch.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from dsv4convert import __version__, dtypes
from dsv4convert.checkpoint import Checkpoint
from dsv4convert.compare import DEFAULT_ANCHORS, DEFAULT_GPU_FAMILY
from dsv4convert.compare.dspark import anchor_stride, draft_components
from dsv4convert.compare.eta import Eta, Work, duration
from dsv4convert.compare.dspark import summarize as summarize_drafts
from dsv4convert.compare.lockstep import HEAD_POSITIONS, Batch, LockstepEngine, Side, Track
from dsv4convert.compare.numerics import Numerics, served, serving_for, weights_only
from dsv4convert.compare.recall import (
    Grid,
    RecallOptions,
    TopkObserver,
    ablation_rows,
    ablation_verdict,
    build_grid,
    diagnose,
    noise_chunk,
    noise_rows,
    summarize,
    verdict,
)
from dsv4convert.devices import resolve_device
from dsv4convert.distributed import World
from dsv4convert.engines.sglang.quant_config import sglang_topk_group
from dsv4convert.errors import DSV4Error
from dsv4convert.inspection import Inspection, inspect_checkpoint
from dsv4convert.models.deepseek_v4.configs import DRAFTER_WIRING
from dsv4convert.models.deepseek_v4.layout import ModelConfig, linear_shapes, native_inventory, try_classify
from dsv4convert.models.deepseek_v4.names import in_draft
from dsv4convert.models.deepseek_v41.config import V41Config
from dsv4convert.model.blocks import COMPUTE_DTYPES, WeightSource
from dsv4convert.model.text import load_tokenizer, read_documents, tokenize

# Config keys that describe how weights are stored, not the model: they may differ between sides.
STORAGE_KEYS = frozenset({"quantization_config", "torch_dtype", "dtype", "transformers_version", "expert_dtype"})
NUMERICS = ("served", "weights")


@dataclass
class CompareOptions:
    base: str
    variant: str
    texts: list[Path] = field(default_factory=list)
    random_tokens: bool = False          # uniform random ids (synthetic models, smoke tests): no text needed
    ids: torch.Tensor | None = None      # token ids [sequences, seq_len] already made (automix's held-out windows)
    tokens: int = 65536
    seq_len: int = 4096
    numerics: str = "served"
    base_numerics: str | None = None     # default: as --numerics
    engine: str = "sglang"
    gpu_family: str = DEFAULT_GPU_FAMILY
    moe_runner_backend: str | None = None
    fp4_indexer: bool = False
    device: str = "cpu"
    dtype: str | None = None             # default: bfloat16 on a GPU, float32 on the CPU
    chunk: int = 2048
    batch_size: int = 1
    mtp: bool = True
    draft_anchors: int = DEFAULT_ANCHORS  # DSpark draft blocks per run (anchors over every sequence)
    seed: int = 0
    progress: bool = True
    recall: RecallOptions | None = None  # needle prompts instead of text (``compare --recall``)


@dataclass
class Plan:
    options: CompareOptions
    tracks: list[Track]             # the reference first
    variant: Track                  # the variant as it is served (the comparison's subject)
    batches: list[Batch]
    device: torch.device
    dtype: torch.dtype
    estimate: dict
    data: dict
    grid: Grid | None = None        # the needle prompts of a recall run
    world: World = World()          # the ranks sharing the work (torch.distributed)

    @property
    def base(self) -> Track:
        return self.tracks[0]


def _open(path: str, label: str) -> tuple[Checkpoint, Inspection]:
    ckpt = Checkpoint.open(path)
    inspection = inspect_checkpoint(ckpt)
    if not inspection.ok:
        first = inspection.first_problem()
        raise DSV4Error(f"{label} checkpoint does not match the DeepSeek-V4 layout its config.json describes "
                        f"({first})", file=ckpt.root)
    return ckpt, inspection


def _engine_fix(key: str, base: dict, variant: dict) -> bool:
    """A key the converter writes as an engine would set it itself: ``topk_group`` = ``n_group``, SGLang 0.5.23's
    V4 fix in ``ModelConfig.__init__``, which ``routed_experts_quant_method`` (a mixed checkpoint states it) skips
    (engines/sglang/quant_config.py)."""
    return (key == "topk_group" and base.get(key) is None and variant.get(key) == sglang_topk_group(base)
            and "routed_experts_quant_method" in (variant.get("quantization_config") or {}))


def check_same_model(base: Checkpoint, variant: Checkpoint) -> None:
    """The two sides must be one model stored two ways: every config key but the storage ones agrees."""
    keys = (set(base.config) | set(variant.config)) - STORAGE_KEYS - DRAFTER_WIRING
    for key in sorted(keys):
        if base.config.get(key) != variant.config.get(key) and not _engine_fix(key, base.config, variant.config):
            raise DSV4Error(f"not a variant of the base model: config key {key!r} is {variant.config.get(key)!r} "
                            f"here and {base.config.get(key)!r} in {base.root / 'config.json'}",
                            file=variant.root / "config.json")


# Text a base may ship beside its weights for a first comparison (the organism does: text in its language that no
# training batch and no test reads); --text always wins.
HELDOUT_TEXT = "heldout.txt"


def token_ids(opts: CompareOptions, base: Checkpoint, cfg: ModelConfig) -> tuple[torch.Tensor, dict]:
    """``[sequences, seq_len]`` ids from the user's text (base tokenizer), the base's held-out text, or random ids."""
    if opts.seq_len < 2:
        raise DSV4Error(f"--seq-len must be at least 2, got {opts.seq_len}")
    if opts.tokens < opts.seq_len:
        raise DSV4Error(f"--tokens {opts.tokens} is less than one sequence of --seq-len {opts.seq_len}")
    wanted = opts.tokens // opts.seq_len
    if opts.ids is not None:
        if opts.texts or opts.random_tokens:
            raise DSV4Error("give token ids, --text or --random-tokens, not more than one")
        return opts.ids, {"source": "token ids given by the caller", "sequences": opts.ids.shape[0],
                          "seq_len": opts.ids.shape[1]}
    if opts.random_tokens:
        if opts.texts:
            raise DSV4Error("give --text or --random-tokens, not both")
        generator = torch.Generator().manual_seed(opts.seed)
        ids = torch.randint(0, cfg.vocab_size, (wanted, opts.seq_len), generator=generator)
        return ids, {"source": f"random token ids (seed {opts.seed})", "sequences": wanted, "seq_len": opts.seq_len}
    texts = list(opts.texts)
    if not texts and (base.root / HELDOUT_TEXT).is_file():
        texts = [base.root / HELDOUT_TEXT]
        print(f"compare: no --text given; using the held-out text the base ships ({texts[0]})", file=sys.stderr)
    if not texts:
        raise DSV4Error("no data: give --text FILE (UTF-8 text, or JSONL with a \"text\" field); the text is the "
                        "user's own, nothing is downloaded")
    docs = [doc for path in texts for doc in read_documents(path)]
    ids = tokenize(base.root, docs)
    if ids.numel() and int(ids.max()) >= cfg.vocab_size:
        raise DSV4Error(f"the tokenizer produced id {int(ids.max())} but the model has {cfg.vocab_size} tokens "
                        "(a tokenizer of another model?)", file=base.root)
    available = ids.numel() // opts.seq_len
    if available < 1:
        raise DSV4Error(f"the text holds {ids.numel()} tokens, less than one sequence of --seq-len {opts.seq_len}",
                        file=texts[0])
    if available < wanted:
        print(f"compare: the text holds {ids.numel()} tokens: {available} sequences of {opts.seq_len} instead of "
              f"{wanted}", file=sys.stderr)
    count = min(wanted, available)
    return ids[: count * opts.seq_len].view(count, opts.seq_len).clone(), {
        "source": [str(p) for p in texts], "sequences": count, "seq_len": opts.seq_len,
        "text_tokens": ids.numel()}


def _numerics(kind: str, inspection: Inspection, ckpt: Checkpoint, opts: CompareOptions) -> Numerics:
    if kind not in NUMERICS:
        raise DSV4Error(f"--numerics must be one of {', '.join(NUMERICS)}, got {kind!r}")
    serving = serving_for(inspection, ckpt.config, engine=opts.engine, gpu_family=opts.gpu_family,
                          moe_runner_backend=opts.moe_runner_backend, fp4_indexer=opts.fp4_indexer,
                          model=str(ckpt.root))
    return served(serving) if kind == "served" else weights_only(serving)


def build_plan(opts: CompareOptions, world: World = World()) -> Plan:
    base_ckpt, base_info = _open(opts.base, "base")
    variant_ckpt, variant_info = _open(opts.variant, "variant")
    check_same_model(base_ckpt, variant_ckpt)
    if opts.chunk < 1 or opts.batch_size < 1:
        raise DSV4Error(f"--chunk and --batch-size must be at least 1, got {opts.chunk} and {opts.batch_size}")
    device = world.device(str(resolve_device(opts.device)))
    dtype_name = opts.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    if dtype_name not in COMPUTE_DTYPES:
        raise DSV4Error(f"--dtype must be one of {', '.join(COMPUTE_DTYPES)}, got {dtype_name!r}")
    dtype = COMPUTE_DTYPES[dtype_name]
    cfg = base_info.config
    if opts.draft_anchors < 1:
        raise DSV4Error(f"--draft-anchors must be at least 1, got {opts.draft_anchors}")
    base = Side("base", base_ckpt, base_info, WeightSource(base_ckpt, base_info, device, dtype))
    variant = Side("variant", variant_ckpt, variant_info, WeightSource(variant_ckpt, variant_info, device, dtype))
    base_numerics = _numerics(opts.base_numerics or opts.numerics, base_info, base_ckpt, opts)
    variant_numerics = _numerics(opts.numerics, variant_info, variant_ckpt, opts)
    grid = None
    if opts.recall is None:
        ids, data = token_ids(opts, base_ckpt, cfg)
        batches = [Batch(ids)]
        tracks = [Track("base", base, base_numerics), Track("variant", variant, variant_numerics, local=True)]
        subject = tracks[1]
    else:
        if opts.texts or opts.random_tokens:
            raise DSV4Error("--recall builds its own needle prompts: leave out --text and --random-tokens")
        grid = build_grid(load_tokenizer(base_ckpt.root), base_ckpt.config, opts.recall)
        batches = grid.batches
        tracks, subject = recall_tracks(base, variant, base_numerics, variant_numerics, opts, grid)
        data = {"source": "needle prompts (dsv4convert.needle)", "prompts": len(grid.prompts),
                "lengths": sorted({p.length for p in grid.prompts}), "depths": list(opts.recall.depths),
                "trials": opts.recall.trials, "seed": opts.recall.seed, "selection_threshold": grid.threshold,
                "sequences": len(grid.prompts), "seq_len": max(b.ids.shape[1] for b in batches)}
    longest = max(b.ids.shape[1] for b in batches)
    tokens = sum(b.ids.numel() for b in batches)
    track_tokens = sum(tokens if t.rows is None else sum(batches[b].ids.shape[1] for b, _ in t.rows) for t in tracks)
    estimate = estimate_resources(cfg, longest, track_tokens, dtype, opts,
                                  (base_ckpt, variant_ckpt))
    return Plan(opts, tracks, subject, batches, device, dtype, estimate, data, grid, world)


def recall_tracks(base: Side, variant: Side, base_numerics: Numerics, variant_numerics: Numerics,
                  opts: CompareOptions, grid: Grid) -> tuple[list[Track], Track]:
    """A recall run's tracks: the reference, the variant as served (also run on the reference's input),
    the noise floor (the reference in other query chunks, on the prompts ``--noise-floor`` names) and,
    with ``ablate``, every ablation row."""
    noise = noise_chunk(opts.chunk, grid.threshold)
    rows = noise_rows(grid, opts.recall.noise_floor)
    local = opts.recall.local
    if not opts.recall.ablate:
        tracks = [Track("base", base, base_numerics), Track("variant", variant, variant_numerics, local=local),
                  Track(f"base, chunk {noise}", base, base_numerics, chunk=noise, rows=rows)]
        return tracks, tracks[1]
    if base_numerics.serving is None or variant_numerics.serving is None:
        raise DSV4Error("--ablate needs the served numerics of both sides")
    fp4 = base_numerics.serving.major != 9          # SGLang refuses the FP4 indexer on sm90
    base_rows = ablation_rows(served(base_numerics.serving), fp4_allowed=fp4)
    variant_rows = ablation_rows(served(variant_numerics.serving), fp4_allowed=fp4)
    reference = Track(f"base: {base_rows[0][0]}", base, base_rows[0][1])
    tracks = [reference] + [Track(f"base: {name}", base, n) for name, n in base_rows[1:]]
    tracks += [Track(f"variant: {name}", variant, n, local=local and name.endswith("(served)"))
               for name, n in variant_rows]
    tracks.append(Track(f"{reference.label}, chunk {noise}", base, reference.numerics, chunk=noise, rows=rows))
    subject = next(t for t in tracks if t.label.startswith("variant: ") and t.label.endswith("(served)"))
    return tracks, subject


def estimate_resources(cfg: ModelConfig, seq: int, track_tokens: int, dtype: torch.dtype, opts: CompareOptions,
                       ckpts: tuple[Checkpoint, Checkpoint]) -> dict:
    """Peak device and host memory and the bytes read, from the layout alone (before anything runs):
    ``seq`` the longest sequence, ``track_tokens`` the tokens of every track together (each runs its own)."""
    item = torch.empty((), dtype=dtype).element_size()
    shapes = linear_shapes(cfg)
    per_block: dict[str, int] = {}
    for spec in native_inventory(cfg):
        info = spec.info
        if info.block is None:
            continue
        if info.module in shapes and info.param in ("weight", "scale"):
            if info.param == "weight":
                n, k = shapes[info.module]
                per_block[info.block] = per_block.get(info.block, 0) + n * k * item
            continue
        per_block[info.block] = per_block.get(info.block, 0) + dtypes.nbytes(spec.dtype, spec.shape)
    layer = max(per_block.values(), default=0)
    chunk = min(opts.chunk, seq)
    pool = seq // 4 if any(r == 4 for r in cfg.compress_ratios) else seq // 128
    window = cfg.sliding_window
    rows = opts.batch_size
    attention = 3 * rows * cfg.num_attention_heads * chunk * (chunk + window + pool) * item
    indexer = 2 * rows * chunk * cfg.index_n_heads * pool * 4
    streams = rows * chunk * cfg.hc_mult * cfg.hidden_size * item * 8
    head = 2 * cfg.vocab_size * cfg.hidden_size * item + 4 * HEAD_POSITIONS * cfg.vocab_size * 8
    device = max(layer + attention + indexer + streams, head)
    # Each track's input and output streams, and the stored bytes of two blocks read ahead (one being built).
    host = 2 * track_tokens * cfg.hc_mult * cfg.hidden_size * item + 2 * max(_largest_block(c) for c in ckpts)
    read = sum(e.nbytes for c in ckpts for e in c.tensors.values())
    estimate = {"peak_device_bytes": int(device), "peak_host_bytes": int(host), "bytes_to_read": int(read),
                "largest_layer_bytes": int(layer), "chunk": chunk}
    if cfg.dspark is not None and opts.mtp and opts.recall is None:
        estimate["dspark"] = draft_estimate(cfg, track_tokens // 2, seq, item, opts.draft_anchors,
                                            max(v for k, v in per_block.items() if in_draft(k)))
    return estimate


def draft_estimate(cfg: ModelConfig | V41Config, tokens: int, seq: int, item: int, anchors: int,
                   stage_bytes: int) -> dict:
    """What the DSpark pass adds (two tracks: base and variant; either release's config, both give ``dspark``,
    ``hidden_size``, ``hc_mult`` and ``vocab_size``): the anchors, the host memory of the target
    features (each side's and the base's at the variant's layers), ``main_x`` and the draft streams (in, out, the
    local pass's), and the device memory of a stage with both heads and a chunk of draft logits."""
    d = cfg.dspark
    stride = anchor_stride(tokens // seq, seq, d.block_size, anchors)
    blocks = (tokens // seq) * len(range(1, seq - d.block_size + 1, stride))
    rows = blocks * d.block_size
    features = 3 * tokens * cfg.hidden_size * d.stages * item + 2 * tokens * cfg.hidden_size * item
    streams = 5 * rows * cfg.hc_mult * cfg.hidden_size * item
    heads = 2 * cfg.vocab_size * (2 * d.markov_rank * 4 + cfg.hidden_size * item)
    return {"blocks": blocks, "stride": stride, "block_size": d.block_size, "stages": d.stages, "draft_rows": rows,
            "host_bytes": int(features + streams), "device_bytes": int(stage_bytes + heads + 64 * 1024 ** 2)}


def _largest_block(ckpt: Checkpoint) -> int:
    """Stored bytes of the checkpoint's largest block (``layers.N`` / ``mtp.N``)."""
    sizes: dict[str, int] = {}
    for name, entry in ckpt.tensors.items():
        info = try_classify(name)
        if info is not None and info.block is not None:
            sizes[info.block] = sizes.get(info.block, 0) + entry.nbytes
    return max(sizes.values(), default=0)


def work_of(plan: Plan) -> Work:
    """The plan's work as the expected-time line counts it: every track's tokens through every block (twice for a
    track also run on the reference's input), every track's output head, and a DSpark pass's stages."""
    cfg = plan.base.side.inspection.config
    mtp = plan.options.mtp and plan.grid is None
    blocks = [b for b in cfg.block_prefixes() if b.startswith("layers.") or (mtp and cfg.dspark is None)]
    tokens = sum(b.ids.numel() for b in plan.batches)
    per_track = [(tokens if t.rows is None else sum(plan.batches[b].ids.shape[1] for b, _ in t.rows),
                  2 if t.local else 1) for t in plan.tracks]
    block_tokens = sum(n * passes for n, passes in per_track)
    layer_tokens = len(blocks) * block_tokens
    draft = plan.estimate.get("dspark")
    if draft:     # each track's stages, the base's rounding floor, the local tracks' again on the base's input
        layer_tokens += draft["draft_rows"] * draft["stages"] * (sum(passes for _, passes in per_track) + 1)
    longest = max(b.ids.shape[1] for b in plan.batches)
    return Work(layer_tokens, sum(n for n, _ in per_track), longest // 2, block_tokens)


def expected(plan: Plan) -> Eta:
    """The expected-time line's model of this plan, at this device's measured GEMM rate."""
    return Eta("compare", plan.base.side.inspection.config, work_of(plan), plan.device, plan.dtype)


def run(plan: Plan, eta: Eta | None = None) -> dict | None:
    """Run the plan; returns ``compare.json``'s content on rank 0 (None on the other ranks). ``eta``, announced
    by the caller, is refined once the first block has run."""
    t0 = time.perf_counter()
    o = plan.options
    if plan.grid is not None:
        return run_recall(plan, eta)
    engine = LockstepEngine(plan.tracks, plan.batches, device=plan.device, dtype=plan.dtype,
                            chunk=o.chunk, batch_size=o.batch_size, mtp=o.mtp, progress=o.progress, world=plan.world,
                            draft_anchors=o.draft_anchors, first_block=eta.refine if eta else None)
    result = engine.run()
    if result is None:
        return None
    return {
        "tool": f"dsv4convert {__version__}",
        "base": side_record(plan.base),
        "variant": side_record(plan.variant),
        "data": plan.data,
        "settings": {"device": str(plan.device), "dtype": str(plan.dtype).replace("torch.", ""), "chunk": o.chunk,
                     "batch_size": o.batch_size, "mtp": o.mtp},
        "distributed": {**plan.world.describe(result.tokens_per_rank),
                        "peak_device_bytes_per_rank": result.peak_device_bytes_per_rank},
        "output": result.output["variant"].summary(),
        "mtp_draft_agreement": result.mtp,
        "dspark": dspark_section(plan, engine, result),
        "blocks": [{"block": b.block, "free_running": b.free_running["variant"], "local": b.local["variant"],
                    "seconds": b.seconds} for b in result.blocks],
        "seconds": {**result.seconds, "wall": round(time.perf_counter() - t0, 3)},
        "peak_device_bytes": result.peak_device_bytes,
        "estimate": plan.estimate,
        "_kld_values": result.output["variant"].kld_values(),
    }


def dspark_section(plan: Plan, engine: LockstepEngine, result) -> dict | None:
    """``compare.json``'s ``dspark``: None unless both sides bundle a DSpark drafter and ``--no-mtp`` is off."""
    if engine.draft is None:
        return None
    d = engine.draft
    return summarize_drafts(result.dspark, plan.base.label, plan.variant.label,
                            draft_components(engine.cfg.dspark.stages), stride=d.stride, block_size=d.block_size,
                            ids=d.ids)


def side_record(track: Track) -> dict:
    return {"path": str(track.side.ckpt.root), "variant": track.side.inspection.variant,
            "numerics": track.numerics.describe()}


def run_recall(plan: Plan, eta: Eta | None = None) -> dict | None:
    """A recall run; returns ``recall.json``'s content (the report writes compare.md from it too)."""
    t0 = time.perf_counter()
    o = plan.options
    observer = TopkObserver(plan.grid, plan.base.label)
    engine = LockstepEngine(plan.tracks, plan.batches, device=plan.device, dtype=plan.dtype, chunk=o.chunk,
                            batch_size=o.batch_size, mtp=False, progress=o.progress, observers=[observer],
                            world=plan.world, first_block=eta.refine if eta else None)
    result = engine.run()
    if result is None:
        return None
    summary = summarize(plan.grid, plan.tracks, result.retrieval, observer)
    for track in plan.tracks[1:]:
        summary["tracks"][track.label]["answer_positions"] = result.output[track.label].summary()
    ref = plan.base.label
    noise = next(t.label for t in plan.tracks if t.chunk is not None)
    summary["reference"], summary["subject"], summary["noise_floor"] = ref, plan.variant.label, noise
    summary["diagnoses"] = {label: diagnose(summary, ref, label) for label in summary["tracks"]
                            if label not in (ref, noise)}
    summary["diagnosis"] = summary["diagnoses"][plan.variant.label]
    summary["verdicts"] = [verdict(summary, ref, plan.variant.label)]
    if o.recall.ablate:
        for prefix in ("base: ", "variant: "):
            rows = [t.label for t in plan.tracks[1:] if t.label.startswith(prefix) and t.chunk is None]
            summary["verdicts"].append(prefix.rstrip(": ") + ": " + ablation_verdict(summary, ref, rows))
    return {"tool": f"dsv4convert {__version__}", "base": side_record(plan.base), "variant": side_record(plan.variant),
            "data": plan.data,
            "settings": {"device": str(plan.device), "dtype": str(plan.dtype).replace("torch.", ""), "chunk": o.chunk,
                         "batch_size": o.batch_size, "ablate": o.recall.ablate},
            "distributed": {**plan.world.describe(result.tokens_per_rank),
                        "peak_device_bytes_per_rank": result.peak_device_bytes_per_rank},
            "recall": summary, "blocks": [{"block": b.block, "seconds": b.seconds} for b in result.blocks],
            "seconds": {**result.seconds, "wall": round(time.perf_counter() - t0, 3)},
            "peak_device_bytes": result.peak_device_bytes, "estimate": plan.estimate}


# A recall run longer than this gets the options that keep it short beside the hint.
LONG_SECONDS = 600.0


def recall_time(plan: Plan, eta: Eta, result: dict) -> str:
    """How long the hinted ``--recall`` would take here, at the rate this run measured; past LONG_SECONDS,
    the lengths and depth that keep it short (the two lengths straddling the selection threshold, one depth)."""
    rate = eta.flops / max(result["seconds"]["wall"], 1e-9)

    def seconds(recall: RecallOptions) -> tuple[float, object]:
        recall_plan = build_plan(replace(plan.options, texts=[], random_tokens=False, recall=recall, progress=False))
        cfg = recall_plan.base.side.inspection.config
        return Eta("compare", cfg, work_of(recall_plan), recall_plan.device, recall_plan.dtype, rate).seconds, \
            recall_plan.grid

    try:
        full, grid = seconds(RecallOptions())
    except DSV4Error as exc:
        return f"; its time could not be estimated: {exc}"
    said = f": expected {duration(full)} on this device at this run's rate"
    if full <= LONG_SECONDS:
        return said
    lengths = sorted(sorted({p.length for p in grid.prompts}, key=lambda n: abs(n - grid.threshold))[:2])
    quick, _ = seconds(RecallOptions(lengths=lengths, depths=(0.5,)))
    return (f"{said}; --lengths {','.join(map(str, lengths))} --depths 0.5, the two lengths nearest the selection "
            f"threshold at one depth, takes {duration(quick)}")
