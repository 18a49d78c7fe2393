"""DeepSeek-V4.1's Engram: hashed n-gram memory, gated into every hyper-connection stream.

Restated from SGLang 0.5.23 ``srt/layers/engram.py`` (each function names the one it restates) and from how
``srt/models/deepseek_v4.py::DeepseekV4Model._forward_layers_hc_pre_from_prev`` calls it:

* **The hash runs once per forward, before layer 0**, on the input ids (image placeholders already read as
  ``image_token_id``: ``DeepseekV4ForCausalLM.prepare_language_model_inputs``), for every Engram layer at once:
  ``hash_ids [T, n_engram_layers, n_hash_cols]``. Token ``t``'s window is itself and its ``max_ngram_size - 1``
  predecessors, each mapped to its compressed id (``models/deepseek_v41/tokenizer.py``); look-back past the
  sequence start, and (with a vision tower) at or beyond an image token, reads the compressed pad token instead.
  Column ``(k - 2) * n_heads + h`` is the k-gram's hash bucketed into its (k, h) prime-sized segment of the
  layer's table. :class:`EngramHasher` computes it for whole sequences from position 0 (a prefill).
* **Engram runs at the top of its layer**, before the attention's hyper-connection: ``engram(state.residual,
  hash_ids[:, engram.layer_hash_index], input_ids=input_ids)`` replaces the residual streams ``R [T, hc_mult,
  hidden]`` (after the previous layer's FFN post); ``state.with_residual`` keeps ``pre``, the stream weights the
  previous sublayer computed, so the attention input is ``pre`` (from the pre-Engram residual) applied to the
  post-Engram streams, and everything after (the attention's own mix, DSpark's capture) reads the post-Engram
  streams. :class:`Engram` adds one gated value to each of the ``hc_mult`` streams, each with its own gate.

DeepSeek's own ``inference/engram.py`` was not found in any corpus. The transformers PR-branch code (PR #48721,
``modeling_deepseek_v41.py``: ``DeepseekV41Engram``, ``DeepseekV41NgramHashState``) agrees on every rule here;
it writes image rows as a gate of 0 where SGLang keeps ``x``, the same value, and marks image tokens in a
position-indexed history where SGLang clamps each window with a cumulative max, the same windows.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from dsv4convert.errors import CheckpointError
from dsv4convert.models.deepseek_v41.config import V41Config, engram_primes
from dsv4convert.models.deepseek_v41.tokenizer import compressed_token_map

ROW_SCALE_BLOCK = 32      # one E8M0 scale per 32 values of a row (SGLang kernels/ops/quantization/fp4_fake_quant.py)
GATE_CLAMP = 1e-6         # the gate's |dot| floor before its square root (SGLang layers/engram.py::Engram.__init__)
HASH_SEED = 10007         # a layer's multipliers come from np.random.default_rng(HASH_SEED * layer_id)


def hash_multipliers(layer_ids: Sequence[int], max_ngram_size: int, compressed_vocab_size: int) -> torch.Tensor:
    """``[n_engram_layers, max_ngram_size]`` int64: one odd multiplier per (layer, look-back), from a per-layer
    NumPy generator, bounded so a compressed id times it fits int64 (SGLang ``layers/engram.py::
    compute_hash_multipliers``). The layer ids seed it, so renumbering the Engram layers rehashes every table."""
    bound = max(1, (np.iinfo(np.int64).max // compressed_vocab_size) // 2)
    rows = [np.random.default_rng(HASH_SEED * layer).integers(low=0, high=bound, size=(max_ngram_size,),
                                                               dtype=np.int64) * 2 + 1 for layer in layer_ids]
    return torch.from_numpy(np.stack(rows))


def column_bounds(segments: Sequence[int]) -> tuple[int, ...]:
    """Prefix sums of one layer's prime-sized segments in the hash's (n-gram size, head) column order: hash
    column ``c`` owns table rows ``[bounds[c], bounds[c + 1])`` and the last bound is the table's row count
    (SGLang ``layers/engram.py::EngramLayout.column_bounds``; ``shard_range`` asserts the last)."""
    bounds = [0]
    for prime in segments:
        bounds.append(bounds[-1] + prime)
    return tuple(bounds)


def engram_image_token_id(cfg: V41Config, image_token_id: int) -> int | None:
    """The token Engram treats as an image (blocks the look-back at it, leaves its row ungated): the config's
    ``image_token_id`` when the model has a vision tower, else none (SGLang ``models/deepseek_v4.py::
    _engram_image_token_id``)."""
    return image_token_id if cfg.vision is not None and cfg.vision.num_hidden_layers > 0 else None


def ngram_windows(input_ids: torch.Tensor, max_ngram_size: int,
                  image_token_id: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's window for whole sequences that start at position 0: ``tokens [..., T, n]`` holds token
    ``t - s`` in column ``s`` and ``blocked [..., T, n]`` marks look-back past the start, and with an image
    token every column from the first image on (SGLang ``layers/engram.py::EngramHasher._torch_hash_ids`` in
    extend mode from position 0, then ``hash_windows``). Right padding is harmless (a hash reads only
    predecessors); left padding is not."""
    length = input_ids.shape[-1]
    source = (torch.arange(length, device=input_ids.device)[:, None]
              - torch.arange(max_ngram_size, device=input_ids.device)[None, :])          # [T, n]
    tokens = input_ids.to(torch.int64)[..., source.clamp_min(0)]
    blocked = (source < 0).expand(tokens.shape)
    if image_token_id is not None:
        blocked = (blocked | (tokens == image_token_id)).to(torch.int32).cummax(-1).values.bool()
    return tokens, blocked


def hash_windows(tokens: torch.Tensor, blocked: torch.Tensor, pad_id: int, token_map: torch.Tensor,
                 multipliers: torch.Tensor, primes: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Row ids ``[..., T, n_engram_layers, (n - 1) * n_heads]`` of windows ``tokens``/``blocked [..., T, n]``:
    blocked columns read ``pad_id`` (a compressed id), the others their compressed id; each is multiplied by
    its layer's look-back multiplier, the products XOR-ed column by column (after column ``i`` the running
    value is the ``(i + 1)``-gram's hash), each hash taken modulo its n-gram size's per-head primes and moved
    to its segment's first row (SGLang ``layers/engram.py::compute_engram_hash_ids``)."""
    compressed = torch.where(blocked, pad_id, token_map[tokens])
    products = compressed.unsqueeze(-2) * multipliers                    # [..., T, L, n]
    rolling, hashes = products[..., 0], []
    for i in range(1, tokens.shape[-1]):
        rolling = torch.bitwise_xor(rolling, products[..., i])
        hashes.append(rolling.unsqueeze(-1) % primes[:, i - 1])          # [..., T, L, n_heads]
    return torch.cat(hashes, dim=-1) + offsets


class EngramHasher(nn.Module):
    """Hash ids of every Engram layer for whole sequences (SGLang ``layers/engram.py::EngramHasher``, its torch
    path for a prefill from position 0). Its tables are non-persistent buffers: they follow ``.to(device)`` and
    stay out of the state dict.

    ``token_map`` maps each token id to its compressed id (``compressed_token_map`` of the checkpoint's
    tokenizer); ``pad_token_id`` is the config's ``engram_pad_token_id`` (a token id); ``image_token_id`` is
    :func:`engram_image_token_id`'s answer. ``forward(input_ids [..., T])`` gives ``[..., T, n_engram_layers,
    n_hash_cols]`` int64 row ids, ``n_hash_cols = (engram_max_ngram_size - 1) * engram_n_heads``; column ``j``
    of Engram layer ``k`` indexes that layer's table directly."""

    token_map: torch.Tensor
    multipliers: torch.Tensor
    primes: torch.Tensor
    offsets: torch.Tensor

    def __init__(self, cfg: V41Config, token_map: Sequence[int], *, pad_token_id: int,
                 image_token_id: int | None = None):
        super().__init__()
        if not cfg.engram_layer_ids:
            raise CheckpointError("the config has no Engram layers ('engram_layer_ids' is empty)",
                                  tensor="text_config.engram_layer_ids")
        compressed = max(token_map) + 1
        if compressed != cfg.engram_compressed_vocab_size:
            raise CheckpointError(f"the tokenizer normalises to {compressed:,} distinct tokens but "
                                  f"engram_compressed_vocab_size is {cfg.engram_compressed_vocab_size:,}; every hash "
                                  f"multiplier depends on it", tensor="text_config.engram_compressed_vocab_size")
        if not 0 <= pad_token_id < len(token_map):
            raise CheckpointError(f"engram_pad_token_id {pad_token_id} is not one of the tokenizer's "
                                  f"{len(token_map):,} ids", tensor="text_config.engram_pad_token_id")
        self.max_ngram_size = cfg.engram_max_ngram_size
        self.pad_id = token_map[pad_token_id]
        self.image_token_id = image_token_id
        layers = len(cfg.engram_layer_ids)
        segments = engram_primes(layers, cfg.engram_max_ngram_size, cfg.engram_n_heads, cfg.engram_vocab_size)
        self.register_buffer("token_map", torch.tensor(token_map, dtype=torch.int64), persistent=False)
        self.register_buffer("multipliers", hash_multipliers(cfg.engram_layer_ids, cfg.engram_max_ngram_size,
                                                             compressed), persistent=False)
        self.register_buffer("primes", torch.tensor(segments, dtype=torch.int64).view(
            layers, cfg.engram_max_ngram_size - 1, cfg.engram_n_heads), persistent=False)
        self.register_buffer("offsets", torch.tensor([column_bounds(s)[:-1] for s in segments],
                                                     dtype=torch.int64), persistent=False)

    @classmethod
    def from_tokenizer(cls, cfg: V41Config, tokenizer, *, pad_token_id: int,
                       image_token_id: int | None = None) -> EngramHasher:
        """From a ``tokenizers.Tokenizer`` (the checkpoint's ``tokenizer.json``)."""
        return cls(cfg, compressed_token_map(tokenizer)[0], pad_token_id=pad_token_id,
                   image_token_id=image_token_id)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        tokens, blocked = ngram_windows(input_ids, self.max_ngram_size, self.image_token_id)
        return hash_windows(tokens, blocked, self.pad_id, self.token_map, self.multipliers, self.primes,
                            self.offsets)


def _gather(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``table[ids]``, through the raw bytes for one-byte dtypes (every device indexes uint8)."""
    if table.element_size() == 1:
        return table.view(torch.uint8)[ids].view(table.dtype)
    return table[ids]


def dequantize_rows(rows: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 values of FP8 E4M3 rows ``[..., dim]`` with their E8M0 scales ``[..., dim / 32]``, one per 32
    consecutive values (SGLang ``layers/engram.py::EngramEmbedding._owned_rows``, its torch path; exact: an
    E4M3 value times a power of two)."""
    values = rows.float().unflatten(-1, (-1, ROW_SCALE_BLOCK)) * scales.float().unsqueeze(-1)
    return values.flatten(-2)


class EngramEmbedding(nn.Module):
    """One Engram layer's table ``[num_embeddings, dim]``, looked up by hash id (SGLang ``layers/engram.py::
    EngramEmbedding``, one rank holding every row).

    Two storages, the checkpoint's names either way: ``fp8=False`` holds ``weight`` as a float parameter of
    ``dtype`` (trainable); ``fp8=True`` holds the checkpoint's ``weight`` (float8_e4m3fn) and ``scale``
    (float8_e8m0fnu, ``[num_embeddings, dim / 32]``) as buffers and dequantizes only the rows looked up, in
    float32, then rounds them to ``dtype`` (SGLang's lookup gives BF16, its model dtype): the only storage that
    fits the release's 384M-row tables. :meth:`from_fp8` builds either from FP8 rows and scales.
    ``forward(hash_ids [...])`` gives ``[..., dim]``."""

    weight: torch.Tensor
    scale: torch.Tensor

    def __init__(self, num_embeddings: int, dim: int, *, fp8: bool = False, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None):
        super().__init__()
        if dim % ROW_SCALE_BLOCK:
            raise CheckpointError(f"an Engram row of {dim} values does not split into 1 x {ROW_SCALE_BLOCK} scale "
                                  f"blocks", tensor="engram.embed.weight")
        self.num_embeddings, self.dim, self.fp8, self.dtype = num_embeddings, dim, fp8, dtype
        if fp8:
            self.register_buffer("weight", torch.zeros(num_embeddings, dim, dtype=torch.float8_e4m3fn,
                                                       device=device))
            self.register_buffer("scale", torch.full((num_embeddings, dim // ROW_SCALE_BLOCK), 1.0,
                                                     dtype=torch.float8_e8m0fnu, device=device))
        else:
            self.weight = nn.Parameter(torch.empty(num_embeddings, dim, dtype=dtype, device=device))
            nn.init.normal_(self.weight)

    @classmethod
    def from_fp8(cls, weight: torch.Tensor, scale: torch.Tensor, *, keep_fp8: bool = True,
                 dtype: torch.dtype = torch.float32) -> EngramEmbedding:
        """From a checkpoint's ``engram.embed.weight`` (F8_E4M3) and ``engram.embed.scale`` (F8_E8M0 or its raw
        bytes): kept in FP8 (``keep_fp8``, dequantized per lookup) or dequantized whole into a trainable
        ``dtype`` parameter."""
        rows, dim = weight.shape
        if weight.dtype != torch.float8_e4m3fn or scale.shape != (rows, dim // ROW_SCALE_BLOCK) \
                or scale.dtype not in (torch.float8_e8m0fnu, torch.uint8):
            raise CheckpointError(f"an Engram table is float8_e4m3fn [rows, dim] with float8_e8m0fnu scales "
                                  f"[rows, dim / {ROW_SCALE_BLOCK}], got {weight.dtype} {list(weight.shape)} and "
                                  f"{scale.dtype} {list(scale.shape)}", tensor="engram.embed")
        scale = scale.view(torch.float8_e8m0fnu)
        table = cls(rows, dim, fp8=keep_fp8, dtype=dtype, device=torch.device("meta"))
        if keep_fp8:
            table.weight, table.scale = weight, scale
        else:
            table.weight = nn.Parameter(dequantize_rows(weight, scale).to(dtype))
        return table

    row_ids: torch.Tensor | None = None    # the table's rows this instance holds, sorted (None: every row)

    @classmethod
    def gathered(cls, weight_rows: torch.Tensor, scale_rows: torch.Tensor, row_ids: torch.Tensor, num_embeddings: int,
                 *, dtype: torch.dtype = torch.float32) -> EngramEmbedding:
        """FP8 rows ``row_ids`` (sorted, unique) of a ``num_embeddings``-row table, read from the checkpoint
        alone: a forward over the ids they came from looks them up as the whole table would, and never holds a
        release table (101 GB, 384M rows) whole."""
        table = cls.from_fp8(weight_rows, scale_rows, keep_fp8=True, dtype=dtype)
        table.num_embeddings, table.row_ids = num_embeddings, row_ids
        return table

    def _local(self, hash_ids: torch.Tensor) -> torch.Tensor:
        """``hash_ids`` as positions among :attr:`row_ids`; an id whose row was not gathered is an error, never
        another row's value."""
        local = torch.searchsorted(self.row_ids, hash_ids.contiguous()).clamp_max(self.row_ids.numel() - 1)
        if not torch.equal(self.row_ids[local], hash_ids):
            raise RuntimeError("an Engram hash id outside the rows gathered for this forward (gather the rows of "
                               "every sequence before loading the layer)")
        return local

    def forward(self, hash_ids: torch.Tensor) -> torch.Tensor:
        if self.row_ids is not None:
            hash_ids = self._local(hash_ids)
        if self.fp8:
            return dequantize_rows(_gather(self.weight, hash_ids), _gather(self.scale, hash_ids)).to(self.dtype)
        return F.embedding(hash_ids, self.weight)


def engram_gate(x: torch.Tensor, kv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                clamp_value: float = GATE_CLAMP, input_ids: torch.Tensor | None = None,
                image_token_id: int | None = None) -> torch.Tensor:
    """``x [..., hc_mult, dim]`` plus, in every stream, its gate times the shared value (SGLang
    ``layers/engram.py::engram_gate``, its torch path). ``kv [..., (hc_mult + 1) * dim]`` is one key per stream,
    then the value. Per (token, stream): the stream and its key are each RMS-normalised over ``dim`` (not over
    the streams jointly), their dot product weighted by ``q_weight * k_weight`` and scaled by ``dim ** -0.5``,
    and the gate is the sigmoid of that dot's signed square root, ``|dot|`` floored at ``clamp_value``. Computed
    in float32 (float64 for float64 inputs) and rounded to ``x``'s dtype; rows whose ``input_ids`` entry is
    ``image_token_id`` keep ``x``."""
    hc_mult, dim = x.shape[-2:]
    work = torch.promote_types(x.dtype, torch.float32)
    key, value = kv.split([hc_mult * dim, dim], dim=-1)
    key = key.to(work).unflatten(-1, (hc_mult, dim))
    weight = q_weight.to(work) * k_weight.to(work)
    h = x.to(work)
    rstd = torch.rsqrt(h.square().mean(-1) + eps) * torch.rsqrt(key.square().mean(-1) + eps)
    dot = (h * weight * key).sum(-1) * rstd * dim ** -0.5
    gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(clamp_value).sqrt(), dot))
    out = (h + gate.unsqueeze(-1) * value.to(work).unsqueeze(-2)).to(x.dtype)
    if input_ids is not None and image_token_id is not None:
        out = torch.where((input_ids == image_token_id)[..., None, None], x, out)
    return out


class Engram(nn.Module):
    """One Engram layer (SGLang ``layers/engram.py::Engram``), parameters named as in the checkpoint's
    ``layers.N.engram.*``: ``embed`` (:class:`EngramEmbedding`: ``embed.weight``, in FP8 also ``embed.scale``),
    ``wkv.weight [(hc_mult + 1) * hidden, n_hash_cols * head_dim]`` (no bias; the checkpoint stores it FP8 in
    32 x 32 blocks, dequantized by whoever loads it), ``q_weight`` and ``k_weight [hc_mult, hidden]`` (ones at
    construction, as SGLang makes them; used only as their product).

    ``forward(x [..., hc_mult, hidden], hash_ids [..., n_hash_cols], input_ids [...] | None)`` returns the new
    residual streams, ``x``'s shape and dtype: the looked-up rows, flattened, through ``wkv`` (in its dtype)
    give one key per stream and one value; :func:`engram_gate` adds the gated value to every stream. ``hash_ids``
    is this layer's slice of :class:`EngramHasher`'s output, ``[..., layer_hash_index, :]``."""

    def __init__(self, *, hidden_size: int, hc_mult: int, num_embeddings: int, n_hash_cols: int, head_dim: int,
                 eps: float, layer_hash_index: int = 0, image_token_id: int | None = None, fp8_table: bool = False,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None):
        super().__init__()
        self.layer_hash_index = layer_hash_index
        self.image_token_id = image_token_id
        self.eps = eps
        self.embed = EngramEmbedding(num_embeddings, head_dim, fp8=fp8_table, dtype=dtype, device=device)
        self.wkv = nn.Linear(n_hash_cols * head_dim, hidden_size * (hc_mult + 1), bias=False, dtype=dtype,
                             device=device)
        self.q_weight = nn.Parameter(torch.ones(hc_mult, hidden_size, dtype=dtype, device=device))
        self.k_weight = nn.Parameter(torch.ones(hc_mult, hidden_size, dtype=dtype, device=device))

    @classmethod
    def from_config(cls, cfg: V41Config, layer_id: int, *, eps: float, image_token_id: int | None = None,
                    fp8_table: bool = False, dtype: torch.dtype = torch.float32,
                    device: torch.device | str | None = None) -> Engram:
        """Engram layer ``layer_id`` of ``cfg``; ``eps`` is the config's ``rms_norm_eps`` and ``image_token_id``
        :func:`engram_image_token_id`'s answer."""
        index = cfg.engram_layer_ids.index(layer_id)
        return cls(hidden_size=cfg.hidden_size, hc_mult=cfg.hc_mult, num_embeddings=cfg.engram_num_embeddings[index],
                   n_hash_cols=(cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads, head_dim=cfg.engram_head_dim,
                   eps=eps, layer_hash_index=index, image_token_id=image_token_id, fp8_table=fp8_table,
                   dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, hash_ids: torch.Tensor, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        kv = self.wkv(self.embed(hash_ids).flatten(-2).to(self.wkv.weight.dtype))
        return engram_gate(x, kv, self.q_weight, self.k_weight, self.eps, GATE_CLAMP, input_ids, self.image_token_id)
