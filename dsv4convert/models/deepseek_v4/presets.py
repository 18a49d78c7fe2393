"""DeepSeek-V4's presets: ``dsv4convert synth``'s model sizes for tests and examples and the model organism's
architecture (``synth.preset_config`` puts them over the release's config). Plain data, so that ``synth --help``
lists them without loading torch."""

# Presets keep every structural feature of the real model (ratio 0/4/128 layers, hash
# layers, an MTP block, several shards) at sizes a 2-core CI machine converts in seconds.
# Linear dims stay multiples of 128, as in the real model (FP8 blocks are 128x128).
PRESETS: dict[str, dict] = {
    "tiny": {
        "vocab_size": 512,
        "hidden_size": 256,
        "moe_intermediate_size": 128,
        "num_hidden_layers": 5,
        "num_hash_layers": 3,
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
        "index_topk": 4,
        "sliding_window": 8,
        "compress_ratios": [0, 0, 4, 128, 4, 0],
    },
    "small": {
        "vocab_size": 2048,
        "hidden_size": 512,
        "moe_intermediate_size": 256,
        "num_hidden_layers": 8,
        "num_hash_layers": 3,
        "num_attention_heads": 8,
        "head_dim": 128,
        "qk_rope_head_dim": 64,
        "q_lora_rank": 256,
        "o_lora_rank": 128,
        "o_groups": 4,
        "n_routed_experts": 32,
        "num_experts_per_tok": 4,
        "index_n_heads": 8,
        "index_head_dim": 128,
        "index_topk": 16,
        "sliding_window": 32,
        "compress_ratios": [0, 0, 4, 128, 4, 128, 4, 0, 0],
    },
}

# The model organism's architecture (dsv4convert/organism/config.py, docs/organism.md): every block kind of
# DeepSeek-V4-Flash at about 7M parameters; ``index_topk`` 64 puts the selection threshold at 260 tokens.
ORGANISM: dict = {
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
