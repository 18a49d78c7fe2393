"""DeepSeek-V4.1's whole text model (``dsv4convert/model/v41/forward.py``) on tiny-v41, by its properties.

SGLang's own full model (``models/deepseek_v4.py::DeepseekV4Model`` with ``is_dsv41``) does not run on a CPU: its
attention is FlashMLA's sparse kernel over CUDA KV pools (``deepseek_v4_backend.py``), its hyper-connection post
asks for a published parallel config (``deepseek_v4_mhc.post``) and its layer loop reads CUDA-graph and
residual-batch state. Each piece it assembles is tested against SGLang's torch code in its own test file
(``test_model_v41_attention.py``, ``_block.py``, ``_engram.py``); the assembly is tested here by what it must
satisfy: the resident model (weights dequantized here, independently of the loader) and the layer-streaming
runner give the same logits on the release and on its exact BF16 conversion; a prefix's logits do not depend on
what follows; an Engram table reaches the positions whose n-grams hash into the rows changed, from its own layer
on and not before; the lagged hyper-connection order is the one run (V4's unlagged order gives other logits);
gradients reach every parameter but the indexer's and the routing biases; the runner holds one layer at a time.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import weakref

import pytest
import torch

from dsv4convert.checkpoint import Checkpoint
from dsv4convert.formats import dequantize_fp8_block, dequantize_mxfp4
from dsv4convert.model.v41.engram import dequantize_rows
from dsv4convert.model.v41.forward import V41Block, V41Model, V41Runner
from dsv4convert.model.v41.hyper import HyperConnection, broadcast, collapse

TEXT = ("embed.", "layers.", "norm.", "head.")
LENGTH = 24


def _dequantized(root) -> dict[str, torch.Tensor]:
    """The text model's tensors in float32, decoded here from how the release stores them (FP8 32 x 32 blocks,
    MXFP4 experts, Engram rows with per-32 scales) or as stored (BF16, float32)."""
    ckpt = Checkpoint.open(root)
    out = {}
    for name in ckpt.tensors:
        if not name.startswith(TEXT) or name.endswith(".scale"):
            continue
        t = ckpt.read(name)
        scale = name.removesuffix("weight") + "scale"
        if name.endswith("engram.embed.weight"):
            t = dequantize_rows(t, ckpt.read(scale).view(torch.float8_e8m0fnu))
        elif t.dtype == torch.float8_e4m3fn:
            t = dequantize_fp8_block(t, ckpt.read(scale), block=(32, 32))
        elif t.dtype == torch.int8:
            t = dequantize_mxfp4(t, ckpt.read(scale))
        out[name] = t.float()
    return out


@pytest.fixture(scope="module")
def runner(tiny_v41):
    return V41Runner(tiny_v41, "cpu", torch.float32)


@pytest.fixture(scope="module")
def token_map(runner):
    return runner.hasher.token_map.tolist()


@pytest.fixture(scope="module")
def state(tiny_v41):
    return _dequantized(tiny_v41)


def _model(cfg, token_map, state, dtype=torch.float32) -> V41Model:
    model = V41Model(cfg, token_map, dtype)
    model.load_state_dict(state)   # strict: every parameter named as the checkpoint, every tensor used
    return model


def _ids(vocab: int, batch: int = 2, length: int = LENGTH, seed: int = 0) -> torch.Tensor:
    # below the tiny tokenizer's added tokens (the image token among them)
    return torch.randint(3, vocab - 32, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_state_dict_keys_are_the_checkpoints_names(tiny_v41, runner, token_map):
    names = {n for n in Checkpoint.open(tiny_v41).tensors if n.startswith(TEXT) and not n.endswith(".scale")}
    assert set(V41Model(runner.cfg, token_map).state_dict()) == names


@pytest.mark.parametrize("variant", ["release", "bf16"])
def test_resident_and_streamed_models_agree(variant, tiny_v41, v41_outputs, runner, token_map, state):
    """The BF16 conversion of FP8 and MXFP4 weights with E8M0 scales is exact: equal logits, not close ones."""
    model = _model(runner.cfg, token_map, state).eval()
    streamed = runner if variant == "release" else V41Runner(v41_outputs[variant], "cpu", torch.float32)
    ids = _ids(runner.cfg.vocab_size)
    with torch.no_grad():
        want = model(ids)
    got = streamed.forward(ids)
    assert torch.isfinite(want.logits).all() and want.logits.std() > 0
    assert torch.equal(got.logits, want.logits)
    assert torch.equal(streamed.logits(ids), want.logits)
    assert set(got.captured) == set(runner.cfg.dspark.target_layer_ids) == set(want.captured)
    for layer in got.captured:
        assert torch.equal(got.captured[layer], want.captured[layer])
    assert set(got.kv.selections) == set(runner.cfg.index_source_layer_ids)
    assert torch.equal(got.kv.candidate_blocks, want.kv.candidate_blocks)
    for layer, chosen in got.kv.selections.items():
        assert torch.equal(chosen, want.kv.selections[layer])


@pytest.fixture(scope="module")
def wide(runner, token_map, state):
    """float64, every visible compressed entry selected: under a smaller top-k, equal index scores may be broken
    differently at another sequence length (``test_model_v41_attention.py``), which is not a causality leak."""
    cfg = dataclasses.replace(runner.cfg, index_topk=LENGTH, candidate_topk_blocks=LENGTH)
    return _model(cfg, token_map, state, torch.float64).eval()


@torch.no_grad()
def test_a_prefix_gives_the_same_logits(wide):
    ids = _ids(wide.cfg.vocab_size, seed=1)
    full = wide(ids, capture=range(wide.cfg.num_hidden_layers))
    for length in (1, 7, 16):
        prefix = wide(ids[:, :length], capture=range(wide.cfg.num_hidden_layers))
        torch.testing.assert_close(prefix.logits, full.logits[:, :length], rtol=0, atol=1e-10)
        for layer, feature in prefix.captured.items():
            torch.testing.assert_close(feature, full.captured[layer][:, :length], rtol=0, atol=1e-10)


@torch.no_grad()
def test_an_engram_table_reaches_the_positions_that_hash_into_it(wide):
    """Zero the rows of Engram layer 2's table that position ``p`` reads and no earlier position does: the logits
    and every layer's stream state before ``p`` stay; at ``p`` the logits change, and the streams change from
    layer 2's Engram on (its DSpark capture point, after the Engram) but not at layers 0 and 1."""
    ids, p = _ids(wide.cfg.vocab_size, batch=1, seed=2), 13
    layer = 2
    index = wide.cfg.engram_layer_ids.index(layer)
    rows = wide.hasher(ids)[0, :, index]                       # [T, n_hash_cols]
    fresh = sorted(set(rows[p].tolist()) - set(rows[:p].flatten().tolist()))
    assert fresh
    changed = copy.deepcopy(wide)
    changed.layers[layer].engram.embed.weight[fresh] = 0
    layers = range(wide.cfg.num_hidden_layers)
    before, after = wide(ids, capture=layers), changed(ids, capture=layers)
    torch.testing.assert_close(after.logits[:, :p], before.logits[:, :p], rtol=0, atol=1e-10)
    assert (after.logits[:, p] - before.logits[:, p]).abs().max() > 1e-3
    for i in layers:
        torch.testing.assert_close(after.captured[i][:, :p], before.captured[i][:, :p], rtol=0, atol=1e-10)
        moved = (after.captured[i][:, p] - before.captured[i][:, p]).abs().max()
        assert (moved > 1e-6) == (i >= layer), i


def _views(block: V41Block) -> dict[str, HyperConnection]:
    """hyper.py's HyperConnection holding ``block``'s native-named hyper-connection parameters."""
    views = {}
    for sub in ("attn", "ffn"):
        hc = HyperConnection(block.attn_norm.weight.shape[0], block.hc_mult, sinkhorn_iters=block.sinkhorn_iters,
                             hc_eps=block.hc_eps, rms_eps=block.rms_eps, dtype=block.attn_norm.weight.dtype)
        hc.fn, hc.base, hc.scale = (getattr(block, f"hc_{sub}_{p}") for p in ("fn", "base", "scale"))
        hc.norm = getattr(block, f"{sub}_norm")
        views[sub] = hc
    return views


def _by_hand(model: V41Model, ids: torch.Tensor, lagged: bool) -> torch.Tensor:
    """The model's layer loop written out with hyper.py's HyperConnection: ``lagged`` collapses each sublayer's
    input with the previous sublayer's ``pre`` (V4.1); otherwise with its own mix of its own input (V4)."""
    from dsv4convert.model.v41.attention import V41KVState

    hash_ids = model.hasher(ids)
    streams, pre, kv = broadcast(model.embed(ids), model.cfg.hc_mult), None, V41KVState()
    for block in model.layers:
        streams = block.with_engram(streams, hash_ids, ids)
        views = _views(block)
        for sub, body in (("attn", lambda x: block.attn(x, kv)), ("ffn", block.ffn)):
            hc = views[sub]
            streams, pre = hc(streams, pre if lagged else hc.mix(streams)[0], body)
    return model.head(model.norm(collapse(streams, pre)))


@torch.no_grad()
def test_the_hyper_connections_run_lagged(wide):
    ids = _ids(wide.cfg.vocab_size, seed=3)
    logits = wide(ids).logits
    torch.testing.assert_close(_by_hand(wide, ids, lagged=True), logits, rtol=0, atol=1e-12)
    assert (_by_hand(wide, ids, lagged=False) - logits).abs().max() > 1e-3


def test_gradients_reach_every_parameter_but_the_indexers_and_the_routing_biases(runner, token_map):
    """The indexer only selects (discrete), ``gate.bias`` only chooses experts, ``gate.bias_vl`` serves image
    tokens only; an expert no token chose gets no gradient either (recorded from the routers)."""
    torch.manual_seed(0)
    model = V41Model(runner.cfg, token_map)
    chosen: dict[str, set[int]] = {}
    for name, module in model.named_modules():
        if name.endswith("ffn.gate"):
            module.register_forward_hook(
                lambda m, args, out, name=name: chosen.setdefault(name, set()).update(out[1].flatten().tolist()))
    out = model(_ids(runner.cfg.vocab_size, seed=4))
    torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), _ids(runner.cfg.vocab_size, seed=5).flatten()
                                      ).backward()
    none = {n for n, p in model.named_parameters() if p.grad is None or not p.grad.any()}
    idle = {n for n, _ in model.named_parameters()
            if ".ffn.experts." in n and int(n.split(".ffn.experts.")[1].split(".")[0])
            not in chosen[n.split(".experts.")[0] + ".gate"]}
    want = {n for n, _ in model.named_parameters()
            if ".attn.indexer." in n or n.endswith(("ffn.gate.bias", "ffn.gate.bias_vl"))} | idle
    assert any(".attn.indexer." in n for n in want) and len(idle) < len(want) // 2
    assert none == want


def test_the_runner_holds_one_layer_at_a_time(runner):
    """Every layer the runner loaded is freed before it loads the next (weak references), and each holds only its
    own layer's parameters."""
    alive: list[weakref.ref] = []
    load = runner.load_block

    def tracked(layer_id: int) -> V41Block:
        gc.collect()
        assert not [r for r in alive if r() is not None], layer_id
        block = load(layer_id)
        assert block.layer_id == layer_id and not any(p.is_meta for p in block.parameters())
        alive.append(weakref.ref(block))
        return block

    runner.load_block = tracked
    try:
        runner.logits(_ids(runner.cfg.vocab_size, length=8))
    finally:
        del runner.load_block
    assert len(alive) == runner.cfg.num_hidden_layers


def test_an_engram_table_is_read_by_the_rows_the_sequences_look_up(tiny_v41):
    """The runner reads only the rows its begun sequences hash to (a release table is 101 GB), equal to the whole
    table's lookup; a hash id whose row was not gathered is an error, never another row."""
    runner = V41Runner(tiny_v41, "cpu", torch.float32)
    ids = _ids(runner.cfg.vocab_size, length=12)
    run = runner.begin(ids)
    layer = runner.cfg.engram_layer_ids[0]
    block = runner.load_block(layer)
    table = block.engram.embed
    hashed = run.hash_ids[..., block.engram.layer_hash_index, :]
    assert torch.equal(table.row_ids, torch.unique(hashed))
    assert 0 < table.weight.shape[0] == table.row_ids.numel() < table.num_embeddings
    ckpt = Checkpoint.open(tiny_v41)
    whole = dequantize_rows(ckpt.read(f"layers.{layer}.engram.embed.weight"),
                            ckpt.read(f"layers.{layer}.engram.embed.scale").view(torch.float8_e8m0fnu))
    assert torch.equal(table(hashed), whole[hashed])
    missing = next(i for i in range(table.num_embeddings) if i not in set(table.row_ids.tolist()))
    with pytest.raises(RuntimeError, match="outside the rows gathered"):
        table(torch.tensor([missing]))
