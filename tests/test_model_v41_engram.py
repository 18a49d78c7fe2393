"""dsv4convert.model.v41.engram against SGLang 0.5.23's own ``srt/layers/engram.py``, run on the CPU.

Everything the module restates runs in SGLang on a CPU through its torch paths, and is compared here:
``EngramHasher.forward`` (extend from position 0 for a batch of requests, then decode steps through its history;
``_torch_hash_ids``, ``hash_windows``, ``compute_engram_hash_ids``), ``compute_hash_multipliers`` and
``EngramLayout``, ``EngramEmbedding``'s lookup (``_owned_rows``: FP8 rows times their E8M0 scales, BF16 out),
``engram_gate`` and ``Engram.forward``. What does not run here is SGLang's GPU kernels for the same steps
(``kernels/ops/embeddings/engram_hash``, ``engram_gather``, ``engram_gate``), which the module does not restate.
SGLang's ``Engram`` is built with a one-rank ``get_parallel`` (tp_size 1), its table unsharded.

The tokenizer is ``synth``'s tiny V4.1 one (``build_tokenizer``), wrapped as transformers' fast tokenizer, as
SGLang's ``get_tokenizer`` returns it; the configs are the tiny-v41 preset's and the release's (its primes,
near 16M, and its layer ids 1 and 14; the compressed vocabulary set to the tiny tokenizer's).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

from dsv4convert.formats.fp8_block import dequantize_fp8_block
from dsv4convert.model.v41.engram import (
    Engram,
    EngramEmbedding,
    EngramHasher,
    column_bounds,
    dequantize_rows,
    engram_gate,
    engram_image_token_id,
    hash_multipliers,
)
from dsv4convert.models.deepseek_v41.config import read_config
from dsv4convert.models.deepseek_v41.presets import TINY
from dsv4convert.models.deepseek_v41.synth import build_tokenizer

RELEASE_CONFIG = Path(__file__).parent / "data" / "deepseek-v4.1-flash-config.json"
PAD = TINY["text_config"]["engram_pad_token_id"]
IMAGE = TINY["image_token_id"]


@pytest.fixture(scope="module")
def sgl():
    import sglang.srt.layers.engram as engram

    return engram


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(TINY["text_config"]["vocab_size"])


@pytest.fixture(scope="module")
def cfg():
    return read_config(TINY)


@pytest.fixture(scope="module")
def release_cfg(cfg):
    return dataclasses.replace(read_config(json.loads(RELEASE_CONFIG.read_text())),
                               engram_compressed_vocab_size=cfg.engram_compressed_vocab_size)


def _layout(sgl, cfg):
    return sgl.EngramLayout.from_config(SimpleNamespace(**{
        key: getattr(cfg, key) for key in ("engram_layer_ids", "engram_max_ngram_size", "engram_n_heads",
                                           "engram_vocab_size", "engram_num_embeddings", "engram_head_dim")}))


def _sglang_hasher(sgl, cfg, tokenizer, image_token_id):
    from transformers import PreTrainedTokenizerFast

    hasher = sgl.EngramHasher(_layout(sgl, cfg), PreTrainedTokenizerFast(tokenizer_object=tokenizer), PAD,
                              cfg.engram_compressed_vocab_size)
    hasher.image_token_id = image_token_id
    return hasher


def _sequences(vocab: int, image: int | None) -> list[torch.Tensor]:
    """Lengths below, at and above the largest n-gram (4), the pad token itself among the ids, and with an image
    token: a run of them inside a sequence, one at position 0 and one last."""
    gen = torch.Generator().manual_seed(7)
    seqs = [torch.randint(0, vocab, (n,), generator=gen) for n in (1, 2, 3, 4, 5, 23, 40)]
    seqs[5][[3, 9]] = PAD
    if image is not None:
        seqs[4][0] = image
        seqs[5][10:14] = image
        seqs[6][[0, 7, 39]] = image
    return seqs


def _sglang_hash(sgl, hasher, seqs: list[torch.Tensor], prefill: list[int]) -> list[torch.Tensor]:
    """SGLang's hash ids of each sequence: its first ``prefill`` tokens in one extend batch of every request, the
    rest in decode steps (each request, while it has tokens left), through the hasher's own history."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    hasher.init_history(len(seqs), "cpu")
    lens = [min(p, len(s)) for s, p in zip(seqs, prefill)]
    starts = torch.tensor([0, *lens[:-1]]).cumsum(0)
    batch = SimpleNamespace(forward_mode=ForwardMode.EXTEND, req_pool_indices=torch.arange(len(seqs)),
                            extend_seq_lens=torch.tensor(lens), extend_start_loc=starts, extend_seq_lens_cpu=lens,
                            positions=torch.cat([torch.arange(n) for n in lens]), engram_history=None,
                            out_cache_loc=None, spec_info=None)
    out = hasher(torch.cat([s[:n] for s, n in zip(seqs, lens)]), batch)
    hashes = [[h] for h in out.split(lens)]
    for step in range(max(len(s) - n for s, n in zip(seqs, lens))):
        live = [i for i, (s, n) in enumerate(zip(seqs, lens)) if n + step < len(s)]
        batch = SimpleNamespace(forward_mode=ForwardMode.DECODE, req_pool_indices=torch.tensor(live),
                                positions=torch.tensor([lens[i] + step for i in live]), out_cache_loc=None,
                                spec_info=None)
        out = hasher(torch.stack([seqs[i][lens[i] + step] for i in live]), batch)
        for i, row in zip(live, out):
            hashes[i].append(row[None])
    return [torch.cat(h) for h in hashes]


@pytest.mark.parametrize("image", [None, IMAGE], ids=["text", "image"])
@pytest.mark.parametrize("which", ["tiny", "release"])
def test_hash_ids_are_sglangs(sgl, tokenizer, cfg, release_cfg, which, image):
    config = cfg if which == "tiny" else release_cfg
    ours = EngramHasher.from_tokenizer(config, tokenizer, pad_token_id=PAD, image_token_id=image)
    theirs = _sglang_hasher(sgl, config, tokenizer, image)
    assert torch.equal(ours.multipliers, theirs.multipliers)
    assert torch.equal(ours.primes, theirs.primes) and torch.equal(ours.offsets, theirs.offsets)
    assert ours.pad_id == theirs.pad_id and torch.equal(ours.token_map, theirs.token_map)
    seqs = _sequences(len(ours.token_map), image)
    expected = _sglang_hash(sgl, theirs, seqs, prefill=[1, 2, 2, 4, 3, 11, 40])
    for seq, want in zip(seqs, expected):
        got = ours(seq)
        assert got.shape == (len(seq), len(config.engram_layer_ids),
                             (config.engram_max_ngram_size - 1) * config.engram_n_heads)
        assert torch.equal(got, want)
    # A batch [B, T] hashes each row as that sequence alone.
    batch = torch.stack([seqs[5], seqs[6][:23]])
    assert torch.equal(ours(batch), torch.stack([ours(seqs[5]), ours(seqs[6][:23])]))


def test_each_hash_column_stays_in_its_prime_segment(tokenizer, release_cfg):
    """Column c of layer k lands in [bounds[c], bounds[c + 1]) of that layer's table, whose last bound is the
    config's engram_num_embeddings; an image token hashes as a window of pads (the pad token at position 0)."""
    hasher = EngramHasher.from_tokenizer(release_cfg, tokenizer, pad_token_id=PAD, image_token_id=IMAGE)
    ids = hasher(torch.randint(0, len(hasher.token_map), (4, 64), generator=torch.Generator().manual_seed(3)))
    for k, rows in enumerate(release_cfg.engram_num_embeddings):
        bounds = column_bounds([int(p) for p in hasher.primes[k].flatten()])
        assert bounds[-1] == rows
        low, high = torch.tensor(bounds[:-1]), torch.tensor(bounds[1:])
        assert bool(((ids[..., k, :] >= low) & (ids[..., k, :] < high)).all())
    assert torch.equal(hasher(torch.tensor([5, IMAGE]))[1], hasher(torch.tensor([PAD]))[0])


def test_multipliers_are_odd_and_seeded_by_layer_id(sgl, release_cfg):
    got = hash_multipliers(release_cfg.engram_layer_ids, 4, release_cfg.engram_compressed_vocab_size)
    assert torch.equal(got, sgl.compute_hash_multipliers(release_cfg.engram_layer_ids, 4,
                                                         release_cfg.engram_compressed_vocab_size))
    assert bool((got % 2 == 1).all()) and not torch.equal(got[0], got[1])


def test_image_token_only_with_a_vision_tower(cfg):
    assert engram_image_token_id(cfg, IMAGE) == IMAGE
    assert engram_image_token_id(dataclasses.replace(cfg, vision=None), IMAGE) is None


def _fp8_table(rows: int, dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random E4M3 rows (no NaN code) and E8M0 scales around 1."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (rows, dim), generator=gen, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x3C
    scales = torch.randint(120, 135, (rows, dim // 32), generator=gen, dtype=torch.uint8)
    return codes.view(torch.float8_e4m3fn), scales.view(torch.float8_e8m0fnu)


def _sglang_engram(sgl, cfg, layer_id: int, image_token_id):
    config = SimpleNamespace(rms_norm_eps=1e-6, hidden_size=cfg.hidden_size, hc_mult=cfg.hc_mult)
    with mock.patch.object(sgl, "get_parallel", lambda: SimpleNamespace(tp_size=1, tp_rank=0)):
        return sgl.Engram(config, layer_id, _layout(sgl, cfg), image_token_id=image_token_id)


@pytest.fixture(scope="module")
def engram_case(sgl, tokenizer, cfg):
    """SGLang's Engram for tiny-v41's layer 2 with random weights (FP8 table, BF16 wkv and gate weights), ours
    loaded from its state dict, and hash ids of two sequences with image tokens."""
    layer = cfg.engram_layer_ids[1]
    theirs = _sglang_engram(sgl, cfg, layer, IMAGE)
    gen = torch.Generator().manual_seed(11)
    weight, scale = _fp8_table(*theirs.embed.weight.shape, seed=5)
    theirs.embed.weight.data, theirs.embed.scale.data = weight, scale
    theirs.wkv.weight.data = (torch.randn(theirs.wkv.weight.shape, generator=gen) * 0.02).bfloat16()
    for p in (theirs.q_weight, theirs.k_weight):
        p.data = (1 + 0.5 * torch.randn(p.shape, generator=gen)).bfloat16()
    ours = Engram.from_config(cfg, layer, eps=1e-6, image_token_id=IMAGE, fp8_table=True, dtype=torch.bfloat16)
    ours.load_state_dict(theirs.state_dict())
    input_ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=gen)
    input_ids[0, 5:9] = IMAGE
    hasher = EngramHasher.from_tokenizer(cfg, tokenizer, pad_token_id=PAD, image_token_id=IMAGE)
    hash_ids = hasher(input_ids)[..., ours.layer_hash_index, :]
    x = torch.randn(2, 24, cfg.hc_mult, cfg.hidden_size, generator=gen)
    return SimpleNamespace(theirs=theirs, ours=ours, input_ids=input_ids, hash_ids=hash_ids, x=x)


def test_fp8_rows_dequantize_as_sglangs_lookup(engram_case):
    case = engram_case
    want = case.theirs.embed(case.hash_ids.flatten(0, 1))
    assert want.dtype == torch.bfloat16
    assert torch.equal(case.ours.embed(case.hash_ids).flatten(0, 1), want)
    weight, scale = case.ours.embed.weight, case.ours.embed.scale
    assert torch.equal(dequantize_rows(weight, scale), dequantize_fp8_block(weight, scale, block=(1, 32)))
    # Dequantized once into a trainable table, the lookup is the same float32 rows.
    fp8 = EngramEmbedding.from_fp8(weight, scale.view(torch.uint8), dtype=torch.float32)
    table = EngramEmbedding.from_fp8(weight, scale, keep_fp8=False, dtype=torch.float32)
    assert fp8.fp8 and not table.fp8 and table.weight.requires_grad
    assert torch.equal(table(case.hash_ids), fp8(case.hash_ids))


def test_engram_forward_is_sglangs(engram_case):
    """SGLang's Engram takes [T, hc, dim] and the layer's hash ids [T, n_hash_cols]; ours any leading dims."""
    case = engram_case
    x = case.x.bfloat16()
    want = torch.stack([case.theirs(x[b], case.hash_ids[b], None, input_ids=case.input_ids[b]) for b in range(2)])
    got = case.ours(x, case.hash_ids, case.input_ids)
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    image = case.input_ids == IMAGE
    assert torch.equal(got[image], x[image]) and not torch.equal(got[~image], x[~image])


def test_engram_gate_is_sglangs_in_float32_and_float64(sgl, engram_case):
    case = engram_case
    gen = torch.Generator().manual_seed(2)
    hc, dim = case.x.shape[-2:]
    kv = torch.randn(*case.x.shape[:-2], (hc + 1) * dim, generator=gen)
    q, k = 1 + torch.randn(2, hc, dim, generator=gen)
    want = torch.stack([sgl.engram_gate(case.x[b], kv[b], q, k, 1e-20, 1e-6, case.input_ids[b], IMAGE)
                        for b in range(2)])
    torch.testing.assert_close(engram_gate(case.x, kv, q, k, 1e-20, input_ids=case.input_ids,
                                           image_token_id=IMAGE), want, rtol=0, atol=0)
    got64 = engram_gate(case.x.double(), kv.double(), q.double(), k.double(), 1e-20)
    assert got64.dtype == torch.float64
    torch.testing.assert_close(got64.float(), sgl.engram_gate(case.x.flatten(0, 1), kv.flatten(0, 1), q, k, 1e-20,
                                                              1e-6).view_as(case.x), rtol=1e-5, atol=1e-5)


def test_gradients_reach_the_table_and_the_gate(cfg, engram_case):
    """Trained with a float table: gradients reach exactly the rows looked up, wkv, q_weight and k_weight, and
    nothing reaches the inputs of an image row but its own streams."""
    torch.manual_seed(0)
    engram = Engram.from_config(cfg, cfg.engram_layer_ids[1], eps=1e-6, image_token_id=IMAGE)
    with torch.no_grad():
        engram.q_weight.normal_(1, 0.5)
    x = engram_case.x.clone().requires_grad_(True)
    out = engram(x, engram_case.hash_ids, engram_case.input_ids)
    upstream = torch.randn_like(out)
    (out * upstream).sum().backward()
    touched = torch.zeros(engram.embed.num_embeddings, dtype=torch.bool)
    text = engram_case.input_ids != IMAGE
    touched[engram_case.hash_ids[text].flatten()] = True
    row_grad = engram.embed.weight.grad.abs().sum(-1)
    assert bool((row_grad[touched] > 0).all()) and bool((row_grad[~touched] == 0).all())
    for p in (engram.wkv.weight, engram.q_weight, engram.k_weight):
        assert p.grad is not None and bool(p.grad.isfinite().all()) and bool(p.grad.abs().sum() > 0)
    image = ~text
    assert torch.equal(x.grad[image], upstream[image]) and bool(x.grad.isfinite().all())
