"""The organism's architecture: every block kind of DeepSeek-V4-Flash, at about 7M parameters.

Layers: sliding window only (0), CSA with compressor and lightning indexer (1, 3), HCA (2), and an MTP
block (sliding window, as in the release). Hash-routed MoE in layers 0-1, score-routed in 2-3 and the
MTP block; hyper-connections everywhere. Every linear dimension is a multiple of 128 (the indexer's
``weights_proj`` aside, BF16 as released), so the FP8-block, MXFP4/NVFP4 and INT4 formats all apply.

``index_topk`` 64 puts the selection threshold (the first prompt length at which the indexer leaves a
compressed entry out, ``4 * index_topk + 4``) at 260 tokens; the sliding window of 32 is far below it.
Everything else (rope, yarn, scoring function, hyper-connection settings) is the released config's.
"""

from __future__ import annotations

import copy

from dsv4convert.synth import reference_config

ARCHITECTURE = {
    "vocab_size": 1024,
    "hidden_size": 256,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_hash_layers": 2,
    "num_nextn_predict_layers": 1,
    "num_attention_heads": 4,
    "head_dim": 128,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 128,
    "o_lora_rank": 128,
    "o_groups": 2,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "index_n_heads": 4,
    "index_head_dim": 128,
    "index_topk": 64,
    "sliding_window": 32,
    "compress_ratios": [0, 4, 128, 4, 0],
}


def organism_config(**overrides) -> dict:
    """The organism's ``config.json``: the released config with :data:`ARCHITECTURE` (and ``overrides``)."""
    config = reference_config()
    config.update(copy.deepcopy(ARCHITECTURE))
    config.update(overrides)
    return config
