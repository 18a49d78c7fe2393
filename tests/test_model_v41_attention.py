"""DeepSeek-V4.1's attention (``dsv4convert/model/v41/attention.py``, ``indexer.py``) against SGLang 0.5.23's own torch
code on the CPU, and its properties.

Against SGLang, with our random weights copied into SGLang's modules: ``rope.py::precompute_freqs_cis`` and
``dsv41_sparse.py::rope_tail``; ``DeepseekV41Compressor.project``/``pool_pairs``/``finish``; ``DeepseekV41Indexer``
``index_keys``/``queries``/``head_weights``/``scores`` (with the FP4 round trips); and the selections as
``v41_indexer/full_topk.py::FullTopKIndexer._torch_prefill`` and ``dense_blocks.py::DenseBlocksBackend``
``_torch_publish_prefill``/``_torch_consume_prefill`` write them, run on a one-request prefill whose index-K pool
is a stand-in holding the keys SGLang's own ``index_keys`` made. FlashMLA's sparse attention with a sink and the
pool writes run only on a GPU; the attention is tested against a hand-written per-token sink softmax instead,
with every visible compressed entry selected (``index_topk`` above their count), and by properties: causality,
and a layer that reuses a KV source reads that source's compressed KV and no other's.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dsv4convert.model.v41.attention import Attention, Compressor, V41KVState, rotate
from dsv4convert.models.deepseek_v41.config import read_config
from dsv4convert.models.deepseek_v41.presets import TINY

LENGTH = 37   # odd: ratio 2 leaves a trailing unpaired token; > 2 candidate blocks of 8 at ratio 1


def _config(**changes):
    """tiny-v41 (layers 0, 1 window only; 2 KV and index source at ratio 2, 3 reusing it; 4 KV, index and candidate
    source at ratio 1; 5 reusing 4 and a candidate consumer), with ``changes``."""
    return dataclasses.replace(read_config(TINY), **changes)


CONFIG = _config(candidate_topk_blocks=2, index_topk=6)


def _layers(config, dtype=torch.float64, seed=0, fake_quant=True):
    torch.manual_seed(seed)
    layers = [Attention(config, i, fake_quant=fake_quant, dtype=dtype) for i in range(config.num_hidden_layers)]
    for layer in layers:
        for name, p in layer.named_parameters():
            with torch.no_grad():
                if name.endswith("norm.weight"):
                    p.uniform_(0.5, 1.5)
                else:
                    p.normal_(0.0, 0.5 if name == "attn_sink" else 0.06)
    return layers


def _run(layers, x):
    state, outs = V41KVState(), []
    for layer in layers:
        outs.append(layer(x, state))
    return outs, state


def _x(batch=2, length=LENGTH, dtype=torch.float64, seed=1):
    return torch.randn(batch, length, CONFIG.hidden_size, generator=torch.Generator().manual_seed(seed), dtype=dtype)


# ---------- against SGLang ----------

def test_rope_is_sglangs():
    from sglang.kernels.ops.attention.dsv4.rope import precompute_freqs_cis
    from sglang.srt.layers.attention.dsv4.dsv41_sparse import rope_tail

    m = CONFIG.math
    y = m.rope_scaling
    for layer in (0, 2):
        attn = Attention(CONFIG, layer)
        theirs = precompute_freqs_cis(m.qk_rope_head_dim, 300, y.original_max_position_embeddings if layer else 0,
                                      attn.rope_base, y.factor, y.beta_fast, y.beta_slow)
        ours = attn.rope(300, torch.device("cpu"))
        assert torch.equal(ours, theirs)
    assert not torch.equal(Attention(CONFIG, 0).rope(300, torch.device("cpu")), ours)   # theta and YaRN differ
    x = torch.randn(1, 300, 3, 512)
    want = rope_tail(x[0], ours, 64)
    torch.testing.assert_close(rotate(x, ours, 64)[0], want, rtol=0, atol=2e-6)
    torch.testing.assert_close(rotate(rotate(x, ours, 64), ours, 64, inverse=True), x, rtol=0, atol=2e-5)


@pytest.mark.parametrize("ratio", [1, 2])
def test_compressor_is_sglangs(ratio):
    from sglang.srt.layers.attention.dsv4.dsv41_sparse import DeepseekV41Compressor

    torch.manual_seed(ratio)
    ours = Compressor(CONFIG, ratio, dtype=torch.bfloat16)
    theirs = DeepseekV41Compressor(CONFIG.hidden_size, CONFIG.head_dim, ratio, CONFIG.math.rms_norm_eps,
                                   fused_compress=False)
    with torch.no_grad():
        for p in ours.parameters():
            p.normal_(0.0, 0.05)
        ours.norm.weight.uniform_(0.5, 1.5)
        theirs.load_state_dict({k: v.clone() for k, v in ours.state_dict().items()})
    x = torch.randn(LENGTH, CONFIG.hidden_size).to(torch.bfloat16)
    kv, score = theirs.project(x)
    if ratio == 2:   # each odd position pooled with its predecessor (_low_ratio_compress_torch)
        n = LENGTH // 2
        kv = theirs.pool_pairs(kv[:2 * n].view(n, 2, -1), score[:2 * n].view(n, 2, -1))
    want = theirs.finish(kv)
    got = ours.latent(x.unsqueeze(0))[0]
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == (LENGTH // ratio, CONFIG.head_dim)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def _sglang_indexer(ours, layer_id):
    """SGLang's ``DeepseekV41Indexer`` with ``ours``' weights (its linears as plain modules: one rank, no TP)."""
    from sglang.srt.layers.attention.dsv4.dsv41_sparse import DeepseekV41Indexer, RMSNorm

    class Linear(torch.nn.Linear):   # ReplicatedLinear's (output, bias) return
        def forward(self, x):
            return super().forward(x), None

    cfg = CONFIG
    theirs = DeepseekV41Indexer.__new__(DeepseekV41Indexer)
    torch.nn.Module.__init__(theirs)
    theirs.n_heads = theirs.n_local_heads = cfg.index_n_heads
    theirs.index_head_dim, theirs.rope_head_dim, theirs.index_topk = cfg.index_head_dim, 64, cfg.index_topk
    theirs.owns_k = layer_id in cfg.kv_source_layer_ids
    theirs.is_candidate_source = layer_id == cfg.candidate_source_layer_id
    theirs.uses_candidates = 0 <= cfg.candidate_source_layer_id < layer_id
    theirs.candidate_topk_blocks, theirs.candidate_block_size = cfg.candidate_topk_blocks, cfg.candidate_block_size
    theirs.softmax_scale = cfg.index_head_dim ** -0.5
    theirs.weights_proj_hip_max_tokens = theirs.weights_proj_small_max_m = -1
    theirs.wq_b = Linear(cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim, bias=False)
    theirs.weights_proj = Linear(cfg.hidden_size, cfg.index_n_heads, bias=False)
    if theirs.owns_k:
        theirs.wk = torch.nn.Linear(cfg.head_dim, cfg.index_head_dim, bias=False)
        theirs.k_norm = RMSNorm(cfg.index_head_dim, cfg.math.rms_norm_eps)
    theirs.load_state_dict({k: v.clone() for k, v in ours.state_dict().items()})
    return theirs


def _float32_run():
    layers = _layers(CONFIG, dtype=torch.float32)
    x = _x(batch=1, dtype=torch.float32)
    _, state = _run(layers, x)
    return layers, x, state


def test_indexer_is_sglangs():
    layers, x, state = _float32_run()
    attn = layers[2]
    theirs = _sglang_indexer(attn.indexer, 2)
    table = attn.rope(LENGTH, x.device)
    latent = attn.compressor.latent(x)[0]
    entries = table[::2][:latent.shape[0]]
    torch.testing.assert_close(state.index_keys[2][0], theirs.index_keys(latent, entries), rtol=0, atol=0)
    q_latent = attn.q_norm(attn.wq_a(x))
    q = attn.indexer.queries(q_latent, lambda t: rotate(t, table, 64))[0]
    torch.testing.assert_close(q, theirs.queries(q_latent[0], table), rtol=0, atol=0)
    w = attn.indexer.head_weights(x)[0]
    torch.testing.assert_close(w, theirs.head_weights(x[0]), rtol=0, atol=0)
    torch.testing.assert_close(attn.indexer.scores(q, state.index_keys[2][0], w),
                               theirs.scores(q, state.index_keys[2][0], w), rtol=1e-6, atol=1e-6)


class _Pool:
    """The index-K pool as ``prefill_requests`` reads it: slot ``j`` holds compressed entry ``j``'s key."""

    def __init__(self, keys):
        self.keys = keys

    def get_low_ratio_index_k_dequant(self, layer_id, slots):
        return self.keys[slots]


def _prefill_inputs(layers, layer_id, x, state):
    from sglang.srt.layers.attention.dsv4.v41_indexer.types import PrefillInputs

    attn = layers[layer_id]
    return PrefillInputs(
        indexer=_sglang_indexer(attn.indexer, layer_id), layer_id=layer_id, compress_ratio=attn.ratio,
        freqs_cis=attn.rope(LENGTH, x.device), x=x[0], q_lora=attn.q_norm(attn.wq_a(x))[0],
        positions=torch.arange(LENGTH), req_rows=torch.zeros(LENGTH, dtype=torch.int64),
        req_pool_indices=torch.zeros(1, dtype=torch.int64),
        k_slots=torch.arange(LENGTH // attn.ratio), index_plans=None, kv_page_table=torch.zeros(1, 1),
        seq_lens_cpu=[LENGTH], rows_per_request=[LENGTH], rows_per_request_device=torch.tensor([LENGTH]),
        out_raw_indices=torch.full((LENGTH, CONFIG.index_topk), -1, dtype=torch.int32), out_page_indices=None)


def _as_sets(indices):
    return [sorted(i for i in row.tolist() if i >= 0) for row in indices]


def test_selections_are_sglangs_torch_paths():
    from sglang.srt.layers.attention.dsv4.v41_indexer.dense_blocks import DenseBlocksBackend
    from sglang.srt.layers.attention.dsv4.v41_indexer.full_topk import FullTopKIndexer

    layers, x, state = _float32_run()
    with torch.no_grad():
        keys = {}
        for s in (2, 4):
            ratio = layers[s].ratio
            entries = layers[s].rope(LENGTH, x.device)[::ratio][:LENGTH // ratio]
            keys[s] = _sglang_indexer(layers[s].indexer, s).index_keys(layers[s].compressor.latent(x)[0], entries)

        full = _prefill_inputs(layers, 2, x, state)   # before the candidate source: the full top-k
        FullTopKIndexer(token_to_kv_pool=_Pool(keys[2]), req_to_token=None, use_deep_gemm_prefill=False,
                        use_deep_gemm_decode=False)._torch_prefill(full)
        assert _as_sets(full.out_raw_indices) == _as_sets(state.selections[2][0])

        blocks = DenseBlocksBackend(token_to_kv_pool=_Pool(keys[4]), req_to_token=None,
                                    candidate_topk_blocks=CONFIG.candidate_topk_blocks,
                                    candidate_block_size=CONFIG.candidate_block_size, use_deep_gemm_prefill=False)
        source = _prefill_inputs(layers, 4, x, state)
        published = blocks._torch_publish_prefill(source)
        assert _as_sets(published.blocks) == _as_sets(state.candidate_blocks[0])
        assert _as_sets(source.out_raw_indices) == _as_sets(state.selections[4][0])

        consumer = _prefill_inputs(layers, 5, x, state)   # reads layer 4's keys, within its blocks
        blocks._torch_consume_prefill(consumer, published)
        assert _as_sets(consumer.out_raw_indices) == _as_sets(state.selections[5][0])

    # the candidate level restricts: late rows see 4 blocks of 8 and keep 2, the last always among them
    last = state.candidate_blocks[0, -1].tolist()
    assert len(last) == 2 and (LENGTH - 1) // 8 in last
    assert all(-1 < e // 8 in last or e == -1 for e in state.selections[5][0, -1].tolist())
    assert state.selections[5][0, -1].tolist() != state.selections[4][0, -1].tolist()


# ---------- properties ----------

def test_causal_prefixes_give_the_same_outputs():
    """With every visible entry selected: under a smaller top-k, equal index scores (the FP4 round trips and the
    ReLU make exact ties common) may be broken differently by a different sequence length, in SGLang too."""
    layers = _layers(_config(index_topk=LENGTH, candidate_topk_blocks=64))
    x = _x()
    full, _ = _run(layers, x)
    for length in (1, 2, 9, 20, 27):
        prefix, _ = _run(layers, x[:, :length])
        for layer, (got, want) in enumerate(zip(prefix, full)):
            torch.testing.assert_close(got, want[:, :length], rtol=0, atol=1e-12, msg=f"layer {layer}, {length}")


def _perturbed(layers, layer):
    with torch.no_grad():
        layers[layer].compressor.wkv.weight.add_(0.05)


def test_a_reusing_layer_reads_its_sources_compressed_kv_only():
    x = _x()
    base, state = _run(_layers(CONFIG), x)
    assert CONFIG.kv_source_of(3) == 2 and CONFIG.kv_source_of(5) == 4
    assert {s for s in state.compressed} == {2, 4} and _layers(CONFIG)[3].compressor is None

    layers = _layers(CONFIG)
    _perturbed(layers, 2)
    moved, _ = _run(layers, x)
    assert not torch.allclose(moved[3], base[3], atol=1e-6)
    for layer in (0, 1, 4, 5):
        torch.testing.assert_close(moved[layer], base[layer], rtol=0, atol=0)

    layers = _layers(CONFIG)
    _perturbed(layers, 4)
    moved, _ = _run(layers, x)
    assert not torch.allclose(moved[5], base[5], atol=1e-6)
    for layer in (0, 1, 2, 3):
        torch.testing.assert_close(moved[layer], base[layer], rtol=0, atol=0)

    layers = _layers(CONFIG)   # layer 5 attends over exactly state.compressed[4]
    state = V41KVState()
    for layer in layers[:5]:
        layer(x, state)
    state.compressed[4] = state.compressed[4] * 0.5
    assert not torch.allclose(layers[5](x, state), base[5], atol=1e-6)


def _dense_reference(attn, x, compressed):
    """Per query ``t``: sink softmax over raw tokens ``t - window + 1 .. t`` and compressed entries
    ``j < (t + 1) // ratio``, scaled by ``head_dim^-0.5``; then the inverse RoPE, ``wo_a`` per group, ``wo_b``."""
    table = attn.rope(x.shape[1], x.device)
    q = rotate(attn.wq_b(attn.q_norm(attn.wq_a(x))).unflatten(-1, (attn.n_heads, attn.head_dim)), table, 64)
    kv = rotate(attn.kv_norm(attn.wkv(x)), table, 64)
    rows = []
    for t in range(x.shape[1]):
        keys = kv[:, max(0, t - attn.window + 1):t + 1]
        if compressed is not None:
            keys = torch.cat([keys, compressed[:, :(t + 1) // attn.ratio]], dim=1)
        logits = torch.einsum("bhd,bsd->bhs", q[:, t], keys) * attn.head_dim ** -0.5
        norm = torch.logsumexp(torch.cat([logits, attn.attn_sink.double().expand(x.shape[0], -1)[..., None]], -1), -1)
        rows.append(torch.einsum("bhs,bsd->bhd", torch.exp(logits - norm[..., None]), keys))
    o = rotate(torch.stack(rows, dim=1), table, 64, inverse=True).reshape(x.shape[0], x.shape[1], attn.groups, -1)
    o = torch.einsum("btgd,grd->btgr", o, attn.wo_a.weight.view(attn.groups, attn.o_lora_rank, -1))
    return attn.wo_b(o.flatten(-2))


def test_with_every_entry_selected_the_sparse_attention_is_dense():
    config = _config(index_topk=LENGTH, candidate_topk_blocks=64)
    layers = _layers(config)
    x = _x()
    outs, state = _run(layers, x)
    for layer in range(config.num_hidden_layers):
        source = config.kv_source_of(layer)
        want = _dense_reference(layers[layer], x, None if source is None else state.compressed[source])
        torch.testing.assert_close(outs[layer], want, rtol=0, atol=1e-12, msg=f"layer {layer}")
    # and a top-k below the visible count changes the compressed layers only
    sparse, _ = _run(_layers(CONFIG), x)
    for layer in range(config.num_hidden_layers):
        assert torch.equal(sparse[layer], outs[layer]) == (config.ratio(layer) == 0), layer


def test_bf16_runs_and_trains():
    layers = _layers(CONFIG, dtype=torch.bfloat16)
    x = _x(dtype=torch.bfloat16).requires_grad_()
    outs, _ = _run(layers, x)
    assert all(o.dtype == torch.bfloat16 and torch.isfinite(o).all() for o in outs)
    sum(o.float().square().sum() for o in outs).backward()
    for name in ("wq_a.weight", "wkv.weight", "wo_b.weight", "attn_sink", "compressor.wkv.weight",
                 "compressor.wgate.weight"):
        grad = layers[2].get_parameter(name).grad
        assert grad is not None and grad.abs().sum() > 0, name
    assert layers[2].indexer.wq_b.weight.grad is None   # the selection is discrete


def test_parameters_are_the_checkpoints_names():
    from dsv4convert.models.deepseek_v41.inventory import layer_inventory

    config = read_config(TINY)
    for layer in range(config.num_hidden_layers):
        want = {s.name.removeprefix(f"layers.{layer}.attn.") for s in layer_inventory(config, layer)
                if s.name.startswith(f"layers.{layer}.attn.") and not s.name.endswith("scale")}
        got = {name for name, _ in Attention(config, layer, dtype=torch.bfloat16).named_parameters()}
        assert got == want, layer
