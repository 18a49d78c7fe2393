"""SGLang: its rules, server settings, quant config, numerics, memory sizing and mixes, one module each.

Here only what the command line offers without loading torch.
"""

# The --disaggregation-transfer-backend values `serve --pd --transfer-backend` offers (serve/launch.py checks a choice).
TRANSFER_BACKENDS = ("mooncake", "mooncake_tcp", "nixl")
