"""``synth``'s V4.1 presets: the release's config (``tests/data/deepseek-v4.1-flash-config.json``) at toy sizes, every
key kept and every tensor kind present. Plain data (no torch), so that ``synth --help`` lists them.

``tiny-v41``: 6 layers with ratio-0 layers (0, 1), KV sources at both ratios (2 at ratio 2, 4 at ratio 1) and the
layers that reuse them (3, 5), index sources 2, 4, 5 (5 an index source without a compressor, as the release's 24),
the candidate source 4 (the ratio-1 KV source, as the release's 20), Engram on a ratio-0 layer and on a KV source
(1, 2, as the release's 1 and 14), a 3-stage DSpark drafter with 4 experts, a 2-layer vision tower. Sizes keep the
engines' constraints: hidden and expert sizes multiples of 128 (SGLang's MXFP4 MoE), every FP8 dimension a
multiple of 32 (vLLM's MXFP8 scale loader), ``engram_head_dim`` a multiple of 32 (1 x 32 row scales), the
release's ``head_dim`` 512 and ``qk_rope_head_dim`` 64 (vLLM's ``models/deepseek_v41/compressor.py::
DeepseekCompressor`` asserts both).
``engram_num_embeddings`` is derived (SGLang's prime layout: about 3,000 rows per table), and
``engram_compressed_vocab_size`` is what SGLang's ``layers/engram.py::build_compressed_token_map`` computes for
the tokenizer ``synth`` writes beside it (``tests/test_v41_synth.py`` checks both with SGLang's own code).
"""

from __future__ import annotations

from dsv4convert.models.deepseek_v41.config import engram_primes

_ENGRAM = {"engram_layer_ids": [1, 2], "engram_max_ngram_size": 4, "engram_vocab_size": 500, "engram_n_heads": 2,
           "engram_head_dim": 64}
_VOCAB = 512
# The tokenizer's last 16 ids are added special tokens (placeholders), as the release's image token sits among
# its last ids (129264 of 129280).
ADDED_TOKENS = 16

TINY: dict = {
    "architectures": ["DeepseekV41ForCausalLM"],
    "model_type": "deepseek_v41",
    "dtype": "bfloat16",
    "transformers_version": "5.6.0",
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 2,
    "image_token_id": _VOCAB - ADDED_TOKENS,
    "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32],
                            "scale_fmt": "ue8m0", "expert_dtype": "fp4"},
    "text_config": {
        "model_type": "deepseek_v41_text",
        "vocab_size": _VOCAB,
        "hidden_size": 256,
        "moe_intermediate_size": 128,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 512,
        "qk_rope_head_dim": 64,
        "q_lora_rank": 128,
        "o_lora_rank": 64,
        "o_groups": 2,
        "hidden_act": "silu",
        "swiglu_limit": 10.0,
        "rms_norm_eps": 1e-20,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "tie_word_embeddings": False,
        "max_position_embeddings": 1048576,
        "rope_theta": 10000,
        "rope_scaling": {"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                         "original_max_position_embeddings": 65536},
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc",
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.5,
        "sliding_window": 8,
        "compress_ratios": [0, 0, 2, 2, 1, 1, 0, 0, 0],
        "compress_rope_theta": 160000,
        "kv_source_layer_ids": [2, 4],
        "index_source_layer_ids": [2, 4, 5],
        "index_n_heads": 4,
        "index_head_dim": 128,
        "index_topk": 8,
        "candidate_source_layer_id": 4,
        "candidate_topk_blocks": 8,
        "candidate_block_size": 8,
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-06,
        **_ENGRAM,
        "engram_num_embeddings": [sum(layer) for layer in engram_primes(
            len(_ENGRAM["engram_layer_ids"]), _ENGRAM["engram_max_ngram_size"], _ENGRAM["engram_n_heads"],
            _ENGRAM["engram_vocab_size"])],
        "engram_pad_token_id": 2,
        "engram_compressed_vocab_size": 406,
        "num_nextn_predict_layers": 3,
        "dspark_block_size": 5,
        "dspark_noise_token_id": _VOCAB - ADDED_TOKENS + 1,
        "dspark_target_layer_ids": [3, 4, 5],
        "dspark_markov_rank": 32,
        "dspark_n_routed_experts": 4,
        "dspark_num_experts_per_tok": 2,
    },
    "vision_config": {
        "model_type": "deepseek_v41_vision",
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 2,
        "intermediate_size": 128,
        "patch_size": 14,
        "rope_theta": 10000,
        "downsample_ratio": 3,
        "max_image_tokens": 1024,
        "min_pixels": 295936,
        "max_wh_ratio": None,
    },
}

PRESETS: dict[str, dict] = {"tiny-v41": TINY}

# The V4.1 organism (``dsv4convert/organism/v41.py``, docs/organism.md): the tiny preset's six layers and roles (ratio 0,
# 0, 2, 2, 1, 1; KV sources 2 and 4 reused by 3 and 5; index sources 2, 4, 5; candidate source 4, so layer 5 selects
# through both levels; Engram on 1 and 2), sized so that needles lie far past what the sliding window, the fine
# top-k and the candidate blocks can cover at once: 32 tokens of window, a top-k of 32 entries among 8 candidate
# blocks of 8 (64 entries, 64 tokens at ratio 1), prompts of 56 to 1,024 tokens. Its tokenizer is the V4 organism's
# (``dsv4convert/data/organism/tokenizer.json``: 1,024 ids, digits one per token), which normalises to 883 ids for
# the Engram hash. No vision tower and no DSpark drafter (the trainer makes neither). Not a ``synth`` preset: it
# names weights that only ``python -m dsv4convert.organism.v41`` makes (random ones would be no organism).
_ORGANISM_ENGRAM = {"engram_layer_ids": [1, 2], "engram_max_ngram_size": 3, "engram_vocab_size": 8192,
                    "engram_n_heads": 2, "engram_head_dim": 64}
ORGANISM_V41: dict = {
    "architectures": ["DeepseekV41ForCausalLM"],
    "model_type": "deepseek_v41",
    "dtype": "bfloat16",
    "transformers_version": "5.6.0",
    "bos_token_id": 0,
    "eos_token_id": 1,
    "quantization_config": TINY["quantization_config"],
    "text_config": {
        **{k: v for k, v in TINY["text_config"].items() if not k.startswith(("dspark_", "engram_"))},
        "vocab_size": 1024,
        "sliding_window": 32,
        "compress_ratios": [0, 0, 2, 2, 1, 1],
        "index_topk": 32,
        "candidate_topk_blocks": 8,
        "candidate_block_size": 8,
        **_ORGANISM_ENGRAM,
        "engram_num_embeddings": [sum(layer) for layer in engram_primes(
            len(_ORGANISM_ENGRAM["engram_layer_ids"]), _ORGANISM_ENGRAM["engram_max_ngram_size"],
            _ORGANISM_ENGRAM["engram_n_heads"], _ORGANISM_ENGRAM["engram_vocab_size"])],
        "engram_pad_token_id": 1,
        "engram_compressed_vocab_size": 883,
        "num_nextn_predict_layers": 0,
    },
}
ORGANISM_PRESETS: dict[str, dict] = {"organism-v41": ORGANISM_V41}

# ``synth --config <V4.1 config.json> --num-layers N``'s default rows per Engram table: about 4.2M rows of 264 bytes
# (1.1 GB) instead of the release's 384M (101 GB). Each real-size layer is 7.3 GB on top (its 384 MXFP4 experts).
DEFAULT_ENGRAM_ROWS = 1 << 22
