"""SGLang: its rules, server settings, quant config, numerics, memory sizing and mixes, one module each.

Here only what the command line offers without loading torch.
"""

# The --disaggregation-transfer-backend values `serve --pd --transfer-backend` offers (serve/launch.py checks a choice).
TRANSFER_BACKENDS = ("mooncake", "mooncake_tcp", "nixl")
# Where DeepSeek-V4.1's Engram tables live (`serve --engram`, `fit`): server.ENGRAM_ENV says how.
ENGRAM_PLACEMENTS = ("gpu", "host-shared", "host-per-rank")
