"""The selection threshold: the first prompt length at which the lightning indexer's top-k leaves a compressed
entry out, ``4 * index_topk + 4`` (dsv4convert.needle.selection_threshold).

Shown on transformers' own ``DeepseekV4Indexer`` (random weights, index_topk 8: threshold 36): at 35 tokens
every query keeps every causal entry, at 36 the last query (the one that predicts the answer's first token)
leaves one out. SGLang 0.5.23 computes the same lengths; its kernels need a GPU, so the lines that say so are
pinned in its installed source.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from dsv4convert.model.blocks import hf_config
from dsv4convert.needle import CSA_RATIO, selection_threshold
from dsv4convert.synth import preset_config

TOPK = 8


@pytest.fixture(scope="module")
def indexer():
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Indexer

    config = preset_config("tiny")
    config.update(index_topk=TOPK, index_n_heads=8, hidden_size=64, q_lora_rank=32)
    hf = hf_config(config)
    torch.manual_seed(0)
    module = DeepseekV4Indexer(hf).eval()
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.2)
    return module, hf


@torch.no_grad()
def picks_of(indexer, length: int) -> list[set[int]]:
    """Per query row, the compressed entries the indexer keeps (its -1 sentinels dropped)."""
    module, hf = indexer
    g = torch.Generator().manual_seed(length)
    hidden = torch.randn(1, length, hf.hidden_size, generator=g)
    q_residual = torch.randn(1, length, hf.q_lora_rank, generator=g)
    out = module(hidden, q_residual, torch.arange(length).unsqueeze(0), None, 0)[0]
    return [{int(i) for i in row if i >= 0} for row in out]


def test_transformers_indexer_keeps_every_entry_below_the_threshold_and_drops_one_at_it(indexer):
    threshold = selection_threshold(TOPK)
    assert threshold == 36
    for length in (threshold - 1, threshold):
        rows = picks_of(indexer, length)
        for t, picked in enumerate(rows):
            causal = set(range((t + 1) // CSA_RATIO))       # every entry the query at t may choose from
            if t < threshold - 1:
                assert picked == causal, (length, t)
            else:                                           # a sparse row: top-k of more than k entries
                assert len(picked) == TOPK and picked < causal and len(causal - picked) == 1, (length, t)
    # The answer query of a threshold-long prompt is the first to leave an entry out; one token shorter, none.
    assert picks_of(indexer, threshold)[-1] != set(range(threshold // CSA_RATIO))
    assert picks_of(indexer, threshold - 1)[-1] == set(range((threshold - 1) // CSA_RATIO))


def test_v4_flash_threshold_and_the_sparse_rows():
    assert selection_threshold(512) == 2052        # V4-Flash: index_topk 512
    assert selection_threshold(32) == 132 and selection_threshold(64) == 260
    threshold = selection_threshold(512)
    for t in range(4096):                          # the row at position t chooses among (t + 1) // 4 entries
        assert ((t + 1) // 4 > 512) == (t >= threshold - 1)
    # The answer's first token comes from row L - 1 of an L-token prompt: L // 4 entries.
    assert 2051 // 4 == 512 and 2052 // 4 == 513


def test_sglang_computes_the_same_lengths():
    """The lines of SGLang 0.5.23 that selection_threshold follows (its kernels need a GPU: pinned as source)."""
    spec = importlib.util.find_spec("sglang")
    assert spec is not None and spec.submodule_search_locations, "SGLang 0.5.23 is part of the test environment"
    root = Path(spec.submodule_search_locations[0])
    metadata = (root / "kernels/ops/attention/dsv4/metadata_kernel.py").read_text()
    backend = (root / "srt/layers/attention/deepseek_v4_backend.py").read_text()
    indexer = (root / "srt/layers/attention/dsv4/indexer.py").read_text()
    assert "c4_seq_lens_raw = seq_len // 4" in metadata                       # the ratio-4 candidates: (t+1) // 4
    assert "c_seq_lens = core_attn_metadata.c4_topk_lengths_raw" in backend  # what the indexer is given
    assert "topk_lengths_clamp1 = (seq_lens_casual // compress_ratio)" in backend   # ratios 1 and 2 alike
    assert "seq_lens_casual = seq_lens[:, None] + torch.arange(\n            -qo_len + 1, 1" in backend  # t + 1
    assert "needs_sequential = seq_lens <= TOPK" in indexer                   # all of them, in order, up to k
