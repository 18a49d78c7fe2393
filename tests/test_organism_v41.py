"""The V4.1 organism's trainer, geometry, release export and Engram ablation (dsv4convert/organism/v41.py), on a CPU.

A few steps of the tiny settings: not a model that retrieves (that takes the GPU run docs/organism.md describes),
the pipeline that makes one.
"""

from __future__ import annotations

import copy
import dataclasses
import random

import pytest
import torch

from dsv4convert.checkpoint import Checkpoint
from dsv4convert.model.v41.forward import V41Runner
from dsv4convert.models.deepseek_v41 import release
from dsv4convert.models.deepseek_v41.config import read_config
from dsv4convert.models.deepseek_v41.presets import ORGANISM_PRESETS, ORGANISM_V41, PRESETS
from dsv4convert.models.deepseek_v41.tokenizer import compressed_token_map
from dsv4convert.needle import build_prompt, make_needle
from dsv4convert.organism.train import TokenizerAdapter
from dsv4convert.organism.v41 import (
    RELEASE_LENGTHS,
    TINY,
    RunnerWithoutEngram,
    V41Settings,
    as_stored,
    build_model,
    coverage,
    engram_kld,
    heldout_rows,
    lm_loss,
    model_logits,
    organism_config,
    organism_tokenizer,
    train,
    write_release,
)

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tokenizer():
    return organism_tokenizer()


def _train(tokenizer, seed: int = 0):
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)      # as the trainer runs on a CPU
    try:
        settings = V41Settings(**{**TINY, "seed": seed})
        return train(organism_config(), tokenizer, settings, device=CPU, log=lambda line: None)
    finally:
        torch.use_deterministic_algorithms(before)


@pytest.fixture(scope="module")
def trained(tokenizer):
    return _train(tokenizer)


@pytest.fixture(scope="module")
def heldout(tokenizer):
    return heldout_rows(tokenizer, 2, 96, CPU)


def test_the_preset_is_a_v41_config_whose_tokenizer_hashes_as_it_says(tokenizer):
    cfg = read_config(ORGANISM_V41)
    assert compressed_token_map(tokenizer)[1] == cfg.engram_compressed_vocab_size
    assert cfg.vocab_size == tokenizer.get_vocab_size()
    assert "organism-v41" in ORGANISM_PRESETS and "organism-v41" not in PRESETS   # synth draws no random organism


def test_needles_lie_beyond_what_window_top_k_and_candidates_cover(tokenizer):
    cfg = read_config(ORGANISM_V41)
    reach = coverage(cfg)
    # the release's structure: KV sources reused by later layers, and a ratio-1 index layer after the candidate
    # source, which selects among the candidate blocks (the two-level path)
    reusers = [layer for layer in reach.covered if layer not in cfg.kv_source_layer_ids]
    assert reusers and all(cfg.kv_source_of(layer) < layer for layer in reusers)
    consumers = [layer for layer in cfg.index_source_layer_ids if layer > cfg.candidate_source_layer_id
                 and cfg.ratio(layer) == cfg.ratio(cfg.candidate_source_layer_id)]
    assert consumers
    settings = V41Settings()
    candidate_tokens = cfg.candidate_topk_blocks * cfg.candidate_block_size * cfg.ratio(cfg.candidate_source_layer_id)
    assert settings.max_length >= 8 * max(reach.longest_covered, candidate_tokens, cfg.sliding_window)
    adapter, rng = TokenizerAdapter(tokenizer), random.Random(0)
    for length in [n for n in RELEASE_LENGTHS if n >= 4 * reach.longest_covered]:
        for depth in (0.1, 0.5):
            prompt = build_prompt(adapter, length, depth, make_needle(rng))
            query = length - 1                                   # the first answer token's query
            distance = query - (prompt.needle_span[1] - 1)       # to the needle's last token
            assert distance > cfg.sliding_window + reach.longest_covered
            for layer in reach.covered:                          # every compressed layer must choose
                ratio = cfg.ratio(layer)
                visible = (query + 1) // ratio
                assert visible > cfg.index_topk and length > reach.covered[layer]
                if layer in consumers:
                    assert visible > cfg.candidate_topk_blocks * cfg.candidate_block_size


def test_training_is_deterministic_and_lowers_the_loss(tokenizer, trained, heldout):
    fresh = build_model(organism_config(), tokenizer, seed=0, initializer_range=V41Settings().initializer_range)
    assert lm_loss(trained.model, heldout) < lm_loss(fresh, heldout) - 0.05
    assert trained.steps_run == TINY["steps"] and trained.curve[-1]["step"] == TINY["steps"]
    again = _train(tokenizer)
    first, second = trained.model.state_dict(), again.model.state_dict()
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert dataclasses.asdict(again.settings) == dataclasses.asdict(trained.settings)


def test_the_written_release_loads_through_the_runner_with_the_models_logits(tokenizer, trained, heldout, tmp_path):
    dst = write_release(tmp_path / "organism-v41", trained.model, organism_config(), tokenizer, {"test": True})
    ckpt = Checkpoint.open(dst)
    cfg = read_config(ckpt.config)
    release.check_checkpoint(cfg, ckpt.tensors.values())        # every planned tensor, dtype and shape
    assert release.check_tokenizer(dst, cfg) == cfg.engram_compressed_vocab_size
    assert ckpt.entry("layers.0.attn.wq_b.scale").dtype == "F8_E8M0"
    assert tuple(ckpt.entry("layers.0.attn.wq_b.scale").shape) == (4 * 512 // 32, 128 // 32)   # 32 x 32 blocks
    table = ckpt.entry("layers.1.engram.embed.scale")
    assert table.dtype == "F8_E8M0" and tuple(table.shape) == (cfg.engram_num_embeddings[0], 64 // 32)
    assert ckpt.entry("layers.0.ffn.experts.0.w1.weight").dtype == "I8"
    assert (dst / "heldout.txt").is_file() and (dst / "organism-v41.json").is_file()
    stored = as_stored(trained.model)
    runner = V41Runner(dst, CPU, torch.float32)
    got, want = runner.logits(heldout), stored(heldout, capture=()).logits
    assert torch.allclose(got, want, rtol=0, atol=1e-5), float((got - want).abs().max())
    # the stored formats are not the float model: the export really rounds
    assert not torch.equal(trained.model(heldout, capture=()).logits, want)
    ablated = engram_kld(runner.logits, RunnerWithoutEngram(dst, CPU, torch.float32).logits, heldout, tokenizer)
    assert ablated["text_kld"] > 0


def test_the_engram_ablation_is_zero_for_the_same_model_and_positive_without_engram(tokenizer, trained, heldout):
    model = trained.model
    same = engram_kld(model_logits(model), model_logits(copy.deepcopy(model)), heldout, tokenizer)
    assert same["text_kld"] == 0.0 and same["fact_positions"] > 0 and same["fact_kld"] == 0.0
    removed = engram_kld(model_logits(model), model_logits(model, engram=False), heldout, tokenizer)
    assert removed["text_kld"] > 0 and removed["fact_kld"] > 0
    assert all(block.engram is not None for block in model.layers if block.layer_id in model.cfg.engram_layer_ids)
