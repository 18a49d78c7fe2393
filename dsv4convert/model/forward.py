"""Running one block over whole sequences, the way transformers' model runs it, in query chunks.

transformers' DeepSeek-V4 attention is eager: a single-shot forward of S tokens materializes
``[B, heads, S, S + S/4]`` scores (about 0.48 GiB·(S/1K)² per CSA layer), so long inputs go
through the layer ``chunk`` queries at a time with the layer's own cache
(``DeepseekV4CSACache``/``DeepseekV4HCACache``/sliding window, from ``DynamicCache(config)``),
exactly as ``model(x[:, s:s + c], past_key_values=cache)`` prefills: the sliding-window keys,
the compressors' buffers and overlap state and the compressed pools carry across chunks.
tests/test_model_forward.py checks that the result equals the single-shot forward.

Positions and masks are transformers' own (``DeepseekV4RotaryEmbedding``,
``create_sliding_window_causal_mask`` asked for this layer's cache), so nothing here decides
what a query may see.
"""

from __future__ import annotations

import torch
from transformers import DeepseekV4Config
from transformers.cache_utils import DynamicCache
from transformers.masking_utils import create_sliding_window_causal_mask
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4DecoderLayer, DeepseekV4RotaryEmbedding


class Positions:
    """Rotary tables for query positions, built by transformers (one table per chunk shape and offset)."""

    def __init__(self, config: DeepseekV4Config, device: torch.device, dtype: torch.dtype):
        self.config, self.device, self.dtype = config, device, dtype
        self.rotary = DeepseekV4RotaryEmbedding(config, device=device)
        self._cache: dict[tuple[int, int, int], dict] = {}

    def kwargs(self, batch: int, start: int, length: int, cache: DynamicCache | None, layer_index: int) -> dict:
        """``position_embeddings``, ``position_ids`` and the attention mask for queries ``[start, start+length)``."""
        probe = torch.zeros((batch, length, 1), dtype=self.dtype, device=self.device)
        position_ids = torch.arange(start, start + length, device=self.device).unsqueeze(0)
        key = (batch, start, length)
        if key not in self._cache:
            self._cache = {key: {t: self.rotary(probe, position_ids=position_ids, layer_type=t)
                                 for t in ("main", "compress")}}
        mask = create_sliding_window_causal_mask(config=self.config, inputs_embeds=probe, attention_mask=None,
                                                 past_key_values=cache, position_ids=position_ids,
                                                 layer_idx=layer_index if cache is not None else None)
        return {"position_embeddings": self._cache[key], "position_ids": position_ids, "attention_mask": mask}


class BlockRunner:
    """Pushes sequences' hyper-connection streams ``[B, S, hc_mult, hidden]`` through one decoder layer.

    ``chunk``: queries per forward (None: the whole sequence at once, no cache, as calibration's
    2K-token windows run). Inputs may live on the host (pinned for speed); each chunk is moved to
    the device, and outputs are written into ``out`` (any device) so that long sequences never need
    more device memory than one chunk's activations plus the layer's cache.
    """

    def __init__(self, config: DeepseekV4Config, device: torch.device, dtype: torch.dtype, chunk: int | None = None):
        if chunk is not None and chunk < 1:
            raise ValueError(f"chunk must be at least 1, got {chunk}")
        self.config, self.device, self.chunk = config, device, chunk
        self.positions = Positions(config, device, dtype)

    @torch.no_grad()
    def __call__(self, layer: DeepseekV4DecoderLayer, streams: torch.Tensor, input_ids: torch.Tensor,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        batch, seq = streams.shape[:2]
        if out is None:
            out = torch.empty_like(streams, device=self.device)
        chunk = seq if self.chunk is None else min(self.chunk, seq)
        cache = DynamicCache(config=self.config) if chunk < seq else None
        for start in range(0, seq, chunk):
            end = min(start + chunk, seq)
            kwargs = self.positions.kwargs(batch, start, end - start, cache, layer.layer_idx)
            hidden = streams[:, start:end].to(self.device, non_blocking=True)
            ids = input_ids[:, start:end].to(self.device, non_blocking=True)
            result = layer(hidden, input_ids=ids, past_key_values=cache, **kwargs)
            out[:, start:end].copy_(result, non_blocking=True)
        return out
