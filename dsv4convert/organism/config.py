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

from dsv4convert.models.deepseek_v4.presets import ORGANISM
from dsv4convert.synth import reference_config


def organism_config(**overrides) -> dict:
    """The organism's ``config.json``: the released config with the architecture above (``presets.ORGANISM``) and
    ``overrides``."""
    config = reference_config()
    config.update(copy.deepcopy(ORGANISM))
    config.update(overrides)
    return config
