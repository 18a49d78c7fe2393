"""Synthetic DeepSeek-V4.1-Flash checkpoints in the release's exact native format, with its tokenizer's stand-in.

Every tensor :func:`~dsv4convert.models.deepseek_v41.inventory.native_groups` plans is written, one shard per group
(each Engram table a shard of its own, as the release stores them), with realistic values derived from (seed,
name) alone (:mod:`dsv4convert.models.synth_values`): FP8 E4M3 linears quantized in the config's 32 x 32 blocks
with E8M0 scales, MXFP4 experts drawn in stored form, BF16/F32 elsewhere. One tensor is in memory at a time; an
Engram table is written in chunks of :data:`ENGRAM_CHUNK_ROWS` rows, its E4M3 codes and its 1 x 32 E8M0 row
scales drawn apart (each chunk from (seed, name, chunk)), so that a real-size table (384M rows) never is.

Both engines build the Engram hasher when they build the model and refuse it unless the tokenizer beside the
weights normalises to ``engram_compressed_vocab_size`` ids (SGLang ``layers/engram.py::EngramHasher``, vLLM
``models/deepseek_v41/common/engram.py::NgramHashState``), so a fast ``tokenizer.json`` of exactly
``vocab_size`` tokens ships with the weights: a byte-level BPE trained deterministically on a fixed text
(mixed case, accents, CJK and emoji, so that the normalisation merges ids and keeps partial-byte tokens apart),
its last :data:`~dsv4convert.models.deepseek_v41.presets.ADDED_TOKENS` ids added special tokens.
"""

from __future__ import annotations

import copy
import json
import os
import random
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context
from pathlib import Path

import torch
from tqdm import tqdm

from dsv4convert.checkpoint import PlannedTensor, ShardWriter, atomic_write_json, write_index
from dsv4convert.checkpoint.writer import empty_destination, shard_name
from dsv4convert.errors import DSV4Error
from dsv4convert.formats.fp8_block import quantize_fp8_block
from dsv4convert.formats.numerics import E4M3_MAX, ceil_log2, exp2_float32, exponent_to_e8m0
from dsv4convert.models.deepseek_v4.layout import TensorSpec
from dsv4convert.models.deepseek_v41.config import V41Config, engram_primes, read_config
from dsv4convert.models.deepseek_v41.inventory import native_groups, role_of
from dsv4convert.models.deepseek_v41.presets import ADDED_TOKENS
from dsv4convert.models.deepseek_v41.tokenizer import compressed_token_map
from dsv4convert.models.synth_values import generator_for, realistic_matrix, realistic_mxfp4

# Rows per Engram chunk: 16 MiB of codes at the release's 256-wide rows. Part of the values' definition (each
# chunk has its own generator), so fixed.
ENGRAM_CHUNK_ROWS = 1 << 16
ENGRAM_BLOCK = 32  # one E8M0 scale per 32 elements of a row (SGLang layers/engram.py::FP8_BLOCK_SIZE)
BOS, EOS, PAD = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"
TOKENIZER_CONFIG = {
    "add_bos_token": False,
    "add_eos_token": False,
    "bos_token": BOS,
    "eos_token": EOS,
    "pad_token": PAD,
    "clean_up_tokenization_spaces": False,
    "model_max_length": 1048576,
    "tokenizer_class": "PreTrainedTokenizerFast",
}
_WORDS = ("the river mill painter ladder fisherman owl square evening plums supper dusk snow roof village fox "
          "carpenter miller rain light night morning bread water stone bridge garden window lantern harbour "
          "café naïve résumé façade über straße fjord ångström 北京 東京 数学 🙂").split()


def engram_code_chunk(rows: int, dim: int, gen: torch.Generator) -> torch.Tensor:
    """E4M3 codes of ``rows`` embedding rows: heavy-tailed values, each 1 x 32 block scaled so its largest
    element lands in [224, 448] (224 where it rounds down) as DeepSeek's ceil(log2(amax / 448)) rule leaves it."""
    w = torch.randn(rows, dim, generator=gen) * torch.exp(0.5 * torch.randn(rows, dim, generator=gen))
    blocks = w.reshape(rows, dim // ENGRAM_BLOCK, ENGRAM_BLOCK)
    amax = blocks.abs().amax(dim=2, keepdim=True).clamp(min=1e-30)
    scaled = blocks / exp2_float32(ceil_log2(amax / E4M3_MAX))
    return scaled.reshape(rows, dim).to(torch.float8_e4m3fn)


def engram_scale_chunk(rows: int, dim: int, gen: torch.Generator) -> torch.Tensor:
    """E8M0 row-block scales: a row's values around 0.05 (its exponent shifted over five binades per row and by
    up to one per block)."""
    base = -13                                              # 448 * 2**-13 ~ 0.055
    row = torch.randint(-2, 3, (rows, 1), generator=gen, dtype=torch.int32)
    block = (0.5 * torch.randn(rows, dim // ENGRAM_BLOCK, generator=gen)).round().clamp(-1, 1).to(torch.int32)
    return exponent_to_e8m0(base + row + block)


def _engram_chunks(spec: TensorSpec, seed: int) -> Iterator[torch.Tensor]:
    rows, width = spec.shape
    draw = engram_scale_chunk if spec.dtype == "F8_E8M0" else engram_code_chunk
    dim = width * ENGRAM_BLOCK if spec.dtype == "F8_E8M0" else width
    for i, start in enumerate(range(0, rows, ENGRAM_CHUNK_ROWS)):
        yield draw(min(ENGRAM_CHUNK_ROWS, rows - start), dim, generator_for(seed, f"{spec.name}#{i}"))


def _plain(spec: TensorSpec, gen: torch.Generator) -> torch.Tensor:
    """A BF16/F32 tensor with values of its kind: norms near 1, mHC as V4's, small biases, realistic matrices."""
    name, shape, role = spec.name, spec.shape, role_of(spec.name)
    if name.endswith(("norm.weight", "norm1.weight", "norm2.weight")):
        t = 1.0 + 0.1 * torch.randn(shape, generator=gen)
    elif role == "hyper_connection":
        scale = 0.02 if name.endswith("_fn") else 0.1 if name.endswith("_base") else None
        t = scale * torch.randn(shape, generator=gen) if scale else 1.0 + 0.05 * torch.randn(shape, generator=gen)
    elif role == "attn_sink":
        t = 0.5 * torch.randn(shape, generator=gen)
    elif name.endswith((".bias", ".bias_vl")):
        t = 0.02 * torch.randn(shape, generator=gen)
    elif role == "embed" or len(shape) != 2:
        t = torch.randn(shape, generator=gen)
    else:
        t = realistic_matrix(shape[0], shape[1], gen)
    return t.to(torch.float32 if spec.dtype == "F32" else torch.bfloat16)


def write_group(writer: ShardWriter, group: list[TensorSpec], cfg: V41Config, seed: int) -> int:
    """Write one planned group's tensors in order (a quantized weight's scale right after it); their bytes."""
    pending: dict[str, torch.Tensor] = {}
    written = 0
    for spec in group:
        if role_of(spec.name) == "engram_table":
            writer.write_rows(spec.name, _engram_chunks(spec, seed))
            written += spec.nbytes
            continue
        if spec.name in pending:
            tensor = pending.pop(spec.name)
        elif spec.dtype == "F8_E4M3":
            module = spec.name.removesuffix(".weight")
            weight, pending[f"{module}.scale"] = quantize_fp8_block(
                realistic_matrix(*spec.shape, generator_for(seed, spec.name), zero_block=cfg.fp8_block[0]),
                block=cfg.fp8_block, name=spec.name)
            tensor = weight
        elif spec.dtype == "I8":
            module = spec.name.removesuffix(".weight")
            tensor, pending[f"{module}.scale"] = realistic_mxfp4(spec.shape[0], spec.shape[1] * 2,
                                                                 generator_for(seed, spec.name))
        else:
            tensor = _plain(spec, generator_for(seed, spec.name))
        writer.write(spec.name, tensor)
        written += spec.nbytes
    if pending:
        raise DSV4Error(f"scales planned without their weights: {sorted(pending)}")
    return written


def scaled_config(config: dict, num_layers: int | None, engram_rows: int, *, drafter: bool = True) -> dict:
    """``config`` (a real V4.1 config) cut to ``num_layers`` real-size layers with Engram tables of about
    ``engram_rows`` rows, for benchmarks (``num_layers`` None: all); every shape but the tables' rows is the
    release's.

    The layers kept are the first ``num_layers - 1`` and the first layer that is an Engram layer, a KV source and
    an index source at once (the release's layer 14: its table, compressor with gate, both indexer halves), so
    that one layer already holds every tensor kind; with ``num_layers`` past it, simply the first
    ``num_layers``. They are renumbered in order, each keeping its compress ratio and roles; the candidate source
    is the release's if kept, else the last index source kept; the DSpark drafter (unless ``drafter`` is False)
    drafts from the last layers kept. The tables' rows are derived, as the engines hash into them (SGLang
    ``layers/engram.py::EngramLayout``): ``engram_vocab_size`` becomes ``engram_rows`` over the table's
    (n-gram size, head) segments, and ``engram_num_embeddings`` the primes' sums it gives."""
    cfg = read_config(config, "synth config")
    n = cfg.num_hidden_layers
    num_layers = n if num_layers is None else num_layers
    if not 1 <= num_layers <= n:
        raise DSV4Error(f"--num-layers must be between 1 and {n}, got {num_layers}")
    segments = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
    if engram_rows < 2 * segments:
        raise DSV4Error(f"--engram-rows must be at least {2 * segments} (one prime-sized segment of 2 rows or more "
                        f"per n-gram size and head), got {engram_rows}")
    richest = next((layer for layer in cfg.engram_layer_ids
                    if layer in cfg.kv_source_layer_ids and layer in cfg.index_source_layer_ids), None)
    kept = list(range(num_layers)) if richest is None or richest < num_layers else \
        [*range(num_layers - 1), richest]
    new = {old: i for i, old in enumerate(kept)}
    config = copy.deepcopy(config)
    text = config["text_config"]
    stages = cfg.dspark.stages if cfg.dspark and drafter else 0
    text["num_hidden_layers"] = num_layers
    text["compress_ratios"] = [cfg.ratio(layer) for layer in kept] + [0] * stages
    for key in ("kv_source_layer_ids", "index_source_layer_ids", "engram_layer_ids"):
        text[key] = [new[layer] for layer in getattr(cfg, key) if layer in new]
    text["candidate_source_layer_id"] = new.get(cfg.candidate_source_layer_id, (text["index_source_layer_ids"]
                                                                                or [0])[-1])
    vocab = min(cfg.engram_vocab_size, engram_rows // segments)
    text["engram_vocab_size"] = vocab
    text["engram_num_embeddings"] = [sum(p) for p in engram_primes(len(text["engram_layer_ids"]),
                                                                   cfg.engram_max_ngram_size, cfg.engram_n_heads,
                                                                   vocab)]
    if cfg.dspark and not drafter:
        for key in [k for k in text if k.startswith("dspark_")]:
            del text[key]
        text["num_nextn_predict_layers"] = 0
    elif cfg.dspark:
        if num_layers < stages:
            raise DSV4Error(f"the DSpark drafter drafts from {stages} layers: --num-layers {stages} or more, or "
                            f"--drafter none")
        text["dspark_target_layer_ids"] = list(range(num_layers - stages, num_layers))
    read_config(config, "synth config (scaled)")
    return config


def training_text(seed: int) -> list[str]:
    """The tokenizer's training text: sentences of a fixed word list, capitalised, sometimes upper-cased."""
    rng = random.Random(seed)
    lines = []
    for _ in range(400):
        line = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 12)))
        line = line[0].upper() + line[1:]
        lines.append((line.upper() if rng.random() < 0.1 else line) + rng.choice([".", "!", "?", ",\n", ":\t"]))
    return lines


def build_tokenizer(vocab_size: int, seed: int = 0):
    """A fast tokenizer of exactly ``vocab_size`` ids: BOS, EOS, PAD (ids 0-2, as the release's config gives
    them), a byte-level BPE, then :data:`ADDED_TOKENS` added special tokens. Deterministic (the BPE trainer breaks
    ties by pair order)."""
    try:
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError:
        raise DSV4Error("a V4.1 checkpoint ships a tokenizer, built with the 'tokenizers' package: "
                        "pip install -e '.[compare]'") from None
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - ADDED_TOKENS, special_tokens=[BOS, EOS, PAD],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(training_text(seed), trainer=trainer)
    if tokenizer.get_vocab_size() != vocab_size - ADDED_TOKENS:
        raise DSV4Error(f"the tokenizer's text yields {tokenizer.get_vocab_size()} tokens, not the "
                        f"{vocab_size - ADDED_TOKENS} vocab_size {vocab_size} needs before its added tokens")
    tokenizer.add_special_tokens([AddedToken(f"<｜place▁holder▁no▁{i}｜>", special=True, normalized=False)
                                  for i in range(ADDED_TOKENS)])
    return tokenizer


def crafted_tokenizer(vocab_size: int, compressed_size: int):
    """A fast tokenizer of exactly ``vocab_size`` ids that normalises to exactly ``compressed_size`` (what the
    Engram hasher counts, :func:`~dsv4convert.models.deepseek_v41.tokenizer.compressed_token_map`), for configs
    too large to train a BPE for (the release's 129,280 ids): BOS, EOS, PAD, the 256 byte-level tokens (the
    partial UTF-8 ones keyed raw), a few that normalise alike (case, accents, spaces, full-width forms), then
    distinct lower-case words ``w0``, ``w1``, ... and their upper-case twins, which add ids but no keys."""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    except ImportError:
        raise DSV4Error("a V4.1 checkpoint ships a tokenizer, built with the 'tokenizers' package: "
                        "pip install -e '.[compare]'") from None
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)

    def encoded(text: str) -> str:
        return "".join(_byte_char(b) for b in text.encode("utf-8"))

    fixed = [BOS, EOS, PAD] + [_byte_char(b) for b in range(256)]
    fixed += [encoded(t) for t in (" the", "The", "THE", " café", "cafe", "ｗｏｒｄ", "word", "\n\n", " \t",
                                   "北京")]
    fixed = list(dict.fromkeys(fixed))

    def build(tokens: list[str]):
        tokenizer = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[]))
        tokenizer.pre_tokenizer = byte_level
        tokenizer.decoder = decoders.ByteLevel()
        return tokenizer

    base = compressed_token_map(build(fixed))[1]
    words = compressed_size - base
    twins = vocab_size - len(fixed) - words
    if words < 0 or twins < 0 or twins > words:
        raise DSV4Error(f"no crafted tokenizer has {vocab_size:,} ids normalising to {compressed_size:,} (its fixed "
                        f"{len(fixed)} tokens give {base} keys; vocab_size must be between {len(fixed) + words:,} "
                        f"and {len(fixed) + 2 * words:,})")
    tokens = fixed + [f"w{i}" for i in range(words)] + [f"W{i}" for i in range(twins)]
    return build(tokens)


def _byte_char(b: int) -> str:
    """The byte-level alphabet's character for byte ``b`` (GPT-2's bytes_to_unicode)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    return chr(b) if b in printable else chr(256 + sum(1 for c in range(b) if c not in printable))


def _write_shard(path: Path, group: list[TensorSpec], cfg: V41Config, seed: int) -> int:
    """One inventory group as one shard (in a worker process too: the values depend on (seed, name) alone)."""
    with ShardWriter(path, [PlannedTensor(s.name, s.dtype, s.shape) for s in group],
                     metadata={"format": "pt"}) as writer:
        return write_group(writer, group, cfg, seed)


def synthesize(dst: Path, config: dict, *, seed: int = 0, overwrite: bool = False, progress: bool = False,
               workers: int = 1) -> Path:
    """Write ``config``'s native V4.1 checkpoint into ``dst``: one shard per inventory group, the index, the
    config as given, the tokenizer (seeded like the weights; a crafted one of the config's vocabulary and
    compressed size where a BPE trained on synth's text cannot reach its vocabulary). ``workers`` > 1 writes that
    many shards at once in spawned processes, the same bytes: drawing MXFP4 experts runs on one core (about 30 s per
    real-size 7.3 GB layer on a 2-core VM), so benchmarks (``bench/convert_v41.py``) write their layers side by
    side."""
    dst = Path(dst)
    cfg = read_config(config, "synth config")
    if cfg.fp8_block[0] != cfg.fp8_block[1]:
        raise DSV4Error(f"synth writes square FP8 blocks; weight_block_size is {list(cfg.fp8_block)}")
    try:                                                    # before anything is written: it may refuse
        tokenizer = build_tokenizer(cfg.vocab_size, seed)
    except DSV4Error:
        tokenizer = crafted_tokenizer(cfg.vocab_size, cfg.engram_compressed_vocab_size)
    empty_destination(dst, overwrite=overwrite)
    groups = native_groups(cfg)
    total = sum(spec.nbytes for group in groups for spec in group)
    names = [shard_name(i + 1, len(groups)) for i in range(len(groups))]
    weight_map = {s.name: name for name, group in zip(names, groups) for s in group}
    with tqdm(total=total, unit="B", unit_scale=True, desc="synth", disable=not progress) as bar:
        if workers <= 1 or len(groups) == 1:
            for name, group in zip(names, groups):
                bar.update(_write_shard(dst / name, group, cfg, seed))
        else:
            workers = min(workers, len(groups))
            with ProcessPoolExecutor(workers, mp_context=get_context("spawn"), initializer=torch.set_num_threads,
                                     initargs=(max(1, (os.cpu_count() or 1) // workers),)) as pool:
                largest_first = sorted(zip(names, groups), key=lambda ng: -sum(s.nbytes for s in ng[1]))
                for done in as_completed([pool.submit(_write_shard, dst / name, group, cfg, seed)
                                          for name, group in largest_first]):
                    bar.update(done.result())
    atomic_write_json(dst / "config.json", config)
    atomic_write_json(dst / "tokenizer_config.json", TOKENIZER_CONFIG)
    atomic_write_json(dst / "tokenizer.json", json.loads(tokenizer.to_str()))
    write_index(dst, weight_map, total)
    return dst
