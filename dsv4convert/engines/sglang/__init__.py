"""SGLang: its rules, server settings, quant config, numerics, memory sizing and mixes, one module each.

Here only what the command line offers without loading torch.
"""

# --disaggregation-transfer-backend values `serve --pd` may pass (server.py builds the launch with them).
TRANSFER_BACKENDS = ("mooncake", "mooncake_tcp", "nixl")
