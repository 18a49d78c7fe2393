"""The block-streamed forward (dsv4convert/model/) against transformers' own DeepseekV4ForCausalLM.

One block at a time, in query chunks through each layer's cache, must give the logits of one
full transformers forward of the same checkpoint, at lengths that are and are not multiples of 4
(the CSA window) and of the chunk, long enough for the HCA compressor (128 tokens) and for the
indexer to choose (from 4 * index_topk + 4 tokens on: needle.selection_threshold).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dsv4convert.checkpoint import Checkpoint
from dsv4convert.inspection import inspect_checkpoint
from dsv4convert.model.blocks import OutputHead, WeightSource, build_layer, hf_config
from dsv4convert.model.forward import BlockRunner
from dsv4convert.synth import preset_config, synthesize
from transformers_oracle import load

LENGTHS = (259, 300)  # 259 % 4 == 3; both past the tiny model's HCA window (128) and its top-k threshold (4 * 4 + 4 = 20)
# The tiny model's indexer has 4 heads: all four ReLU'd scores of an entry are 0 for about one entry in
# sixteen, and top-k breaks such ties by position, which differs between a 64-entry and a 16-entry pool.
# With 32 heads (the real model has 64) an exact tie has odds of 2^-32 per entry, so the chunked
# forward is compared on a tiny model with 32 indexer heads.
TIE_FREE_INDEXER_HEADS = 32


@pytest.fixture(scope="module")
def model(tiny_ckpt):
    return load(tiny_ckpt)[0]


def weight_source(path: Path) -> tuple[WeightSource, object]:
    ckpt = Checkpoint.open(path)
    inspection = inspect_checkpoint(ckpt)
    return WeightSource(ckpt, inspection, torch.device("cpu"), torch.float32), inspection.config


@pytest.fixture(scope="module")
def source(tiny_ckpt):
    return weight_source(tiny_ckpt)


@pytest.fixture(scope="module")
def tie_free(tmp_path_factory):
    config = preset_config("tiny")
    config["index_n_heads"] = TIE_FREE_INDEXER_HEADS
    return weight_source(synthesize(tmp_path_factory.mktemp("heads32") / "src", config, seed=3))


def ids_of(length: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (2, length), generator=torch.Generator().manual_seed(seed))


def capture_topk(layers) -> tuple[dict[int, list[torch.Tensor]], list]:
    """Every CSA layer's indexer output (top-k compressed-entry indices), per call."""
    seen: dict[int, list[torch.Tensor]] = {}
    handles = []
    for layer in layers:
        indexer = getattr(getattr(layer.self_attn, "compressor", None), "indexer", None)
        if indexer is not None:
            handles.append(indexer.register_forward_hook(
                lambda module, args, out, i=layer.layer_idx: seen.setdefault(i, []).append(out.clone())))
    return seen, handles


@torch.no_grad()
def streamed_logits(source, ids: torch.Tensor, chunk: int | None) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    weights, cfg = source
    config = hf_config(weights.ckpt.config)
    runner = BlockRunner(config, torch.device("cpu"), torch.float32, chunk=chunk)
    streams = F.embedding(ids, weights.tensor("embed.weight")).unsqueeze(2).expand(-1, -1, cfg.hc_mult, -1).contiguous()
    topk = {}
    for i in range(cfg.num_hidden_layers):
        layer = build_layer(weights, config, cfg, f"layers.{i}")
        seen, handles = capture_topk([layer])
        streams = runner(layer, streams, ids)
        for h in handles:
            h.remove()
        if seen:
            topk[i] = seen[i]
    return OutputHead(weights, config)(streams), topk


def as_sets(indices: torch.Tensor, entries: int) -> torch.Tensor:
    """``[B, S, k]`` indices (-1 invalid) as a boolean ``[B, S, entries]`` membership mask."""
    mask = torch.zeros((*indices.shape[:2], entries + 1), dtype=torch.bool)
    mask.scatter_(2, torch.where(indices < 0, entries, indices), True)
    return mask[..., :entries]


@pytest.mark.parametrize("length", LENGTHS)
def test_streamed_forward_is_transformers_forward(model, source, length):
    ids = ids_of(length, source[1].vocab_size)
    want = model(ids).logits.float()
    got, _ = streamed_logits(source, ids, chunk=None)
    torch.testing.assert_close(got, want, rtol=0, atol=2e-5)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("length, chunk", [(259, 64), (259, 37), (300, 100), (300, 7)])
def test_chunked_forward_through_the_caches_is_the_single_shot_forward(tie_free, length, chunk):
    ids = ids_of(length, tie_free[1].vocab_size, seed=1)
    whole, whole_topk = streamed_logits(tie_free, ids, chunk=None)
    chunked, chunked_topk = streamed_logits(tie_free, ids, chunk=chunk)
    # Only float rounding differs (other matmul shapes; 8e-6 of the logits' scale at most, seen); a
    # different pick of the indexer or a missed cache entry moves logits by whole units.
    torch.testing.assert_close(chunked, whole, rtol=0, atol=3e-5 * float(whole.abs().max()))
    assert torch.equal(chunked.argmax(-1), whole.argmax(-1))
    assert whole_topk.keys() == chunked_topk.keys() and whole_topk
    for layer, (single,) in whole_topk.items():
        entries = length // 4
        pieces = chunked_topk[layer]
        assert len(pieces) == -(-length // chunk)
        # Each chunk's rows pick from the pool so far; padded to the full pool, the sets are the single shot's.
        got = torch.cat([as_sets(p, entries) for p in pieces], dim=1)
        assert torch.equal(got, as_sets(single, entries)), layer
        # Past the threshold the indexer really chooses: fewer entries than it could see.
        assert (got.sum(-1)[:, 200:] < torch.arange(201, length + 1) // 4).all()
