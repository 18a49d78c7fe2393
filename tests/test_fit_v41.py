"""``dsv4convert fit`` for DeepSeek-V4.1-Flash against SGLang 0.5.23's own code, run on the CPU.

* The KV pool: SGLang's ``DSV4PoolConfigurator`` built for the server fit sizes (published as a scheduler
  publishes it) over SGLang's ``ModelConfig`` of the release's config (flattened by SGLang's own
  ``normalize_deepseek_v41_config``): bytes per full token, per sliding-window slot, the request-cap SWA pool, the
  ratio-2 pair state and the tokens ``calculate_pool_sizes`` gives must equal fit's. ``is_sm100_supported`` and the
  device capability answer the family (a CPU has none), so SGLang picks its own attention backend and KV layout.
* ``collect_sources_by_ratio``, ``KVLayout.page_bytes``, ``EngramLayout.column_bounds`` and ``shard_range``: SGLang's
  functions called on the same inputs.
* The users' question (8x RTX PRO 6000, TP8 or PD 4+4, Engram tables on GPU or host): the verdicts the figures imply.
"""

from __future__ import annotations

import json
from pathlib import Path
from dataclasses import replace
from types import SimpleNamespace
from unittest import mock

import pytest

from dsv4convert.cli import main
from dsv4convert.engines import EngineError, memory
from dsv4convert.engines.sglang import memory as v4
from dsv4convert.engines.sglang import memory_v41 as sizing
from dsv4convert.fit import source_v41, v41, verdict

CONFIG_PATH = Path(__file__).resolve().parent / "data" / "deepseek-v4.1-flash-config.json"
CONFIG = json.loads(CONFIG_PATH.read_text())


@pytest.fixture(scope="module")
def plan() -> source_v41.PlannedV41:
    return source_v41.planned(CONFIG, str(CONFIG_PATH))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("v41")
    (directory / "config.json").write_text(json.dumps(CONFIG))
    return directory


def _sglang_pool(server, family: str, model_dir: Path):
    """SGLang's DSV4PoolConfigurator for this server over its ModelConfig of the V4.1 config, the resolved args, and
    the pools it sizes in 40 GiB (SM100's probe answered for the family: it picks V4.1's KV layouts)."""
    import sglang_oracle as sgl

    argv = server.argv()
    argv[argv.index("--model-path") + 1] = str(model_dir)
    with mock.patch("sglang.srt.utils.common.is_sm100_supported", lambda *_a, **_k: family == "sm100"), \
            sgl.pool_configurator(argv, family, server.env) as (pool, resolved):
        available = 40 * memory.GIB
        return pool, resolved, available, pool.calculate_pool_sizes(available, resolved["page_size"])


# (family, role, TP, DSpark draft): SM100's mega backend (PD, TP 1) and its V4 fallback (TP > 1 without PD), SM90,
# SM120; with the drafter on each layout and role.
LAUNCHES = [("sm100", "decode", 4, False), ("sm100", "prefill", 4, False), ("sm100", "server", 1, False),
            ("sm100", "server", 8, False), ("sm90", "server", 8, False), ("sm120", "prefill", 4, False),
            ("sm120", "decode", 4, False), ("sm120", "server", 8, False), ("sm100", "decode", 4, True),
            ("sm100", "prefill", 4, True), ("sm120", "server", 8, True)]


@pytest.mark.parametrize("family,role,tp,mtp", LAUNCHES)
def test_kv_pool_is_sglangs(family: str, role: str, tp: int, mtp: bool, plan, model_dir: Path) -> None:
    """With the DSpark drafter SGLang's own configurator runs under ``--speculative-algorithm DSPARK``: the
    (layers + 1) / layers inflation, the wider ratio-2 ring and the request cap's per-token eviction terms."""
    from sglang.srt.runtime_context import restore_context, snapshot_context

    gpu = next(g for g in verdict.GPUS.values() if g.family == family)
    server = v41.launch(gpu, role, tp, "gpu", None, plan=plan, mtp=mtp)
    state = snapshot_context()
    try:
        pool, resolved, available, theirs = _sglang_pool(server, family, model_dir)
        c2 = pool._get_c2_state_fixed_bytes(resolved["max_running_requests"])
    finally:
        restore_context(state)
    assert resolved["speculative_algorithm"] == ("DSPARK" if mtp else None)
    ours = sizing.kv_cost(plan.config, server, resolved["chunked_prefill_size"])
    assert pool.bytes_per_full_token == ours.bytes_per_full_token
    assert pool.bytes_per_swa_token == ours.bytes_per_swa_token
    assert pool.swa_cap_tokens == ours.swa_tokens == theirs.swa_max_total_num_tokens
    assert pool.ring_sizes[2] == sizing.c2_ring_size(server) == (8 if mtp else 2)   # block 5: 6 tokens verified, 2 + 6 <= 8
    assert c2 == sizing.c2_state_fixed_bytes(server, plan.config.head_dim, 3)
    assert pool._get_swa_fixed_bytes() + c2 == pytest.approx(ours.fixed_bytes, abs=1)
    assert sizing.kv_tokens(available, ours) == theirs.full_max_total_num_tokens
    # The reference's figures, from SGLang's own code: 890 B on the V4.1 layouts, 1,632.5 B on V4's (x 41/40 with
    # the one draft layer SGLang budgets).
    assert pool.bytes_per_full_token == pytest.approx({"v41": 890, "v4": 1632.5}[ours.layout]
                                                      * (41 / 40 if mtp else 1), rel=1e-12)
    assert (ours.layout == "v41") == (family == "sm100" and (role != "server" or tp == 1))


def test_sources_pages_and_engram_shards_are_sglangs(plan) -> None:
    from sglang.kernels.ops.attention.dsv4.kv_layout import KVLayout
    from sglang.srt.layers.engram import EngramLayout, shard_range
    from sglang.srt.mem_cache.deepseek_v4_memory_pool import collect_sources_by_ratio

    cfg = plan.config
    layers = cfg.num_hidden_layers
    assert sizing.sources_by_ratio(cfg.compress_ratios, cfg.kv_source_layer_ids, layers) == \
        collect_sources_by_ratio(cfg.compress_ratios, cfg.kv_source_layer_ids, range(layers))
    for name in sizing.KV_LAYOUTS:
        for tokens in (1, 2, 64, 128, 256):
            assert sizing.page_bytes(name, tokens) == KVLayout(name).page_bytes(tokens), (name, tokens)
    layout = EngramLayout.from_config(SimpleNamespace(**CONFIG["text_config"]))
    bounds = sizing.column_bounds(cfg)
    assert bounds == [layout.column_bounds(i) for i in range(len(cfg.engram_layer_ids))]
    for tp in (1, 2, 4, 8, 16):
        for rows, b in zip(cfg.engram_num_embeddings, bounds):
            assert [sizing.shard_range(rows, b, r, tp) for r in range(tp)] == \
                [shard_range(rows, b, r, tp) for r in range(tp)]
    with pytest.raises(ValueError, match="disagrees"):
        sizing.shard_range(cfg.engram_num_embeddings[0] + 1, bounds[0], 0, 8)


def test_weights_follow_sglangs_load_rules(plan) -> None:
    """wo_a is BF16 at runtime (twice its FP8 bytes, its scale dropped); the tables are counted apart; a split
    module is divided by TP and a replicated one is not."""
    gpu = verdict.GPUS["rtx-pro-6000"]
    one, eight = (sizing.weights_per_rank(plan.tensors, v41.launch(gpu, "server", tp, "gpu", None)) for tp in (1, 8))
    wo_a = [s for s in plan.tensors if s.name.startswith("layers.") and ".attn.wo_a." in s.name]
    fp8 = sum(s.nbytes for s in wo_a if s.name.endswith(".weight"))
    assert one.by_role["attention"] - eight.by_role["attention"] * 8 < 0   # wq_a/wkv are replicated
    assert sum(sizing.stored_bytes(s, "attention", v41.launch(gpu, "server", 1, "gpu", None)) for s in wo_a) == 2 * fp8
    assert one.engram_tables == sum(s.nbytes for s in plan.tensors if ".engram.embed." in s.name)
    assert eight.by_role["routed_expert"] * 8 == pytest.approx(one.by_role["routed_expert"], rel=1e-9)
    assert eight.by_role["vision"] == one.by_role["vision"] > 0


# (family, TP): sm_120's CUTLASS MXFP4 method (raw E8M0 expert scales; hidden and per-rank intermediate sizes must be
# multiples of 128, so TP 1 on the tiny model) and sm_100's TRT-LLM method (F32 expert scales) at TP 4.
WEIGHT_BUILDS = [("sm120", 1), ("sm100", 4)]


@pytest.mark.parametrize("family,tp", WEIGHT_BUILDS)
def test_weights_per_rank_are_sglangs_model(family: str, tp: int, tiny_v41: Path) -> None:
    """SGLang's own V4.1 model (vision tower included) and its DSpark draft, built on the meta device as rank 0 of
    ``--tp-size tp`` (``sglang_oracle.rank_parameters``: SGLang's layers shard by SGLang's TP size): their
    parameter bytes equal fit's for the tiny V4.1, byte for byte: the backbone with the Engram tables' GPU shard,
    and the draft (which shares the target's embedding and head, and builds no ``gate.bias_vl`` nor, under the
    static verify mode, its confidence head)."""
    import sglang_oracle as sgl
    import sglang_v41_oracle as sgl41

    tiny = source_v41.planned(json.loads((tiny_v41 / "config.json").read_text()), str(tiny_v41))
    gpu = next(g for g in verdict.GPUS.values() if g.family == family)
    server = replace(v41.launch(gpu, "server", tp, "gpu", None, plan=tiny, mtp=True), model=str(tiny_v41))
    fit = sizing.size_server(tiny.config, tiny.tensors, gpu, server)
    theirs = {}
    with sgl41.v41_host_fakes(family):
        for draft in (False, True):
            params = sgl.rank_parameters(tiny_v41, server.argv(), gpu=family, tp=tp, env=server.environment(),
                                         draft=draft)
            theirs[draft] = sum(p.numel() * p.element_size() for p in params.values())
    assert fit.draft_weights_bytes_per_rank == theirs[True]
    assert fit.weights_bytes_per_rank - fit.draft_weights_bytes_per_rank == theirs[False]


def test_a_wrong_weight_rule_is_caught(tiny_v41: Path) -> None:
    """The check above can fail: the vision norms counted as stored in the file (BF16), or the indexer's wq_b split
    like the attention's, change the bytes."""
    tiny = source_v41.planned(json.loads((tiny_v41 / "config.json").read_text()), str(tiny_v41))
    server = v41.launch(verdict.GPUS["b200"], "server", 4, "gpu", None)
    right = sizing.weights_per_rank(tiny.tensors, server).target
    with mock.patch.object(sizing, "_SPLIT_ATTENTION", (*sizing._SPLIT_ATTENTION, ".indexer.wq_b.")):
        assert sizing.weights_per_rank(tiny.tensors, server).target != right
    norm = next(s for s in tiny.tensors if s.name == "vision.norm.weight")
    assert sizing.stored_bytes(norm, "vision", server) == 2 * norm.nbytes


@pytest.fixture(scope="module")
def users(plan) -> dict:
    """8x RTX PRO 6000: TP8, or PD 4+4, with each Engram placement."""
    gpu = verdict.GPUS["rtx-pro-6000"]
    return {(tp, role, placement): v41.size(plan, gpu, role, tp, placement, context=65536)
            for tp, launch_roles in ((8, ("server",)), (4, ("prefill", "decode")))
            for role in launch_roles for placement in sizing.ENGRAM_PLACEMENTS}


def test_users_question_engram_placement(users, plan) -> None:
    gpu = verdict.GPUS["rtx-pro-6000"]
    table = sizing.engram_placement(plan.config, 8, "gpu").table_bytes
    assert table == sum(s.nbytes for s in plan.tensors if ".engram.embed." in s.name)
    for (tp, role, placement), fit in users.items():
        gpu_row = users[(tp, role, "gpu")]
        if placement == "gpu":
            # The tables' shard is on every GPU: at least 1/TP of them, nothing in host memory.
            assert fit.engram_gpu_bytes_per_rank >= table // tp and not fit.engram_host_bytes_per_server
        else:
            assert fit.weights_bytes_per_rank == gpu_row.weights_bytes_per_rank - gpu_row.engram_gpu_bytes_per_rank
            assert fit.engram_host_bytes_per_server == table
            assert fit.engram_host_bytes_per_process == (table if placement == "host-shared"
                                                         else gpu_row.engram_gpu_bytes_per_rank)
            assert fit.kv_tokens >= gpu_row.kv_tokens
        # A verdict is what its budget implies: the fixed pools and one request's pages must fit after the weights.
        budget = v4.budget(gpu.mib, fit.mem_fraction_static, fit.weights_bytes_per_rank).available_bytes
        assert fit.fits == (budget > fit.fixed_bytes and fit.kv_tokens >= 65536)
    # PD 4+4 with the tables on the GPUs: a rank's weights exceed its whole card, so neither server loads.
    for role in ("prefill", "decode"):
        fit = users[(4, role, "gpu")]
        assert fit.weights_bytes_per_rank > gpu.mib * memory.MIB and not fit.fits


def test_fit_command_for_a_v41_config(capsys) -> None:
    argv = ["fit", "--config", str(CONFIG_PATH), "--gpu", "rtx-pro-6000", "--count", "8", "--tp", "8",
            "--context", "65536", "--json"]
    code = main(argv)
    out = json.loads(capsys.readouterr().out)
    servers = out["servers"]
    assert {s["engram"] for s in servers} == set(sizing.ENGRAM_PLACEMENTS)
    assert code == (0 if any(s["fits"] for s in servers) else 1)
    assert out["engram_table_bytes"] == sum(CONFIG["text_config"]["engram_head_dim"] * 33 // 32 * rows
                                            for rows in CONFIG["text_config"]["engram_num_embeddings"])
    assert "assumes" in out and any(line.startswith("drafter none") for line in out["assumes"])


# ---------------------------------------------------------------------------------------------------- vLLM 0.33.0

_VLLM_V41 = """
import json, sys, torch
from types import SimpleNamespace
from unittest import mock
from vllm.v1.kv_cache_interface import CircularBufferSpec, MLAAttentionSpec, SlidingWindowMLASpec
from vllm.models.deepseek_v41 import attention
from vllm.models.deepseek_v41.common import engram
from vllm.platforms import current_platform
text = json.loads(sys.argv[1])["text_config"]
out = {"indexer": attention._indexer_k_cache_head_dim(text["index_head_dim"], False), "pages": {}}
for major in (9, 10, 12):
    with mock.patch.object(type(current_platform), "is_device_capability_family",
                           lambda self, family, *a, **k: family // 10 == major, create=True):
        mxfp8 = attention._use_v41_mxfp8_kv_record()
    swa = 528 if mxfp8 else 584                              # DeepseekV4Attention.__init__
    align = 512 if mxfp8 else 576
    for dtype in (("fp8_ds_mla", "nvfp4_ds_mla") if mxfp8 else ("fp8_ds_mla",)):
        compressed = 288 if dtype == "nvfp4_ds_mla" else swa
        pages = {"sliding_window": SlidingWindowMLASpec(block_size=32, num_kv_heads=1, max_tp_shards=1,
                    head_size=512, dtype=torch.uint8, sliding_window=text["sliding_window"], cache_dtype_str=dtype,
                    state_content_bytes=swa, alignment=align, model_version="deepseek_v4").page_size_bytes}
        for ratio in (1, 2):
            pages[f"ratio{ratio}_kv"] = MLAAttentionSpec(block_size=256, num_kv_heads=1, head_size=512,
                dtype=torch.uint8, tokens_per_state=ratio, cache_dtype_str=dtype, alignment=align,
                model_version="deepseek_v4", state_content_bytes=compressed).page_size_bytes
            pages[f"ratio{ratio}_indexer"] = MLAAttentionSpec(block_size=256, num_kv_heads=1,
                head_size=out["indexer"], dtype=torch.uint8, tokens_per_state=ratio, alignment=align).page_size_bytes
        pages["ratio2_compressor_state"] = CircularBufferSpec(block_size=8, num_kv_heads=1, head_size=2 * 512,
                                                              head_size_v=0, dtype=torch.float32).page_size_bytes
        out["pages"][f"{major}/{dtype}"] = pages
layout = engram.EngramLayout(SimpleNamespace(**text))
out["heads"] = [[p for order in layer for p in order] for layer in layout.primes]
out["shards"] = {}
props = SimpleNamespace(multi_processor_count=132)
torch.set_default_device("meta")
for tp in (1, 2, 4, 8):
    for rank in range(tp):
        with mock.patch.object(engram, "get_tensor_model_parallel_world_size", lambda: tp), \\
                mock.patch.object(engram, "get_tensor_model_parallel_rank", lambda: rank), \\
                mock.patch.object(engram, "get_engram_dp_size", lambda: 1), \\
                mock.patch.object(torch.accelerator, "current_device_index", lambda: 0), \\
                mock.patch.object(torch.cuda, "get_device_properties", lambda *a: props):
            rows = [engram.ParallelEngramEmbedding(n, text["engram_head_dim"], tuple(h)).part_num_embeddings
                    for n, h in zip(text["engram_num_embeddings"], out["heads"])]
        out["shards"][f"{tp}/{rank}"] = rows
print("V41 " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def vllm_v41() -> dict:
    """vLLM 0.33.0's own V4.1 cache spec classes, built with the arguments V4.1's layers pass for the release's
    config (its ``_use_v41_mxfp8_kv_record`` asked per family), its indexer K width, ``EngramLayout``'s buckets and
    ``ParallelEngramEmbedding``'s rows per rank (built on the meta device as rank r of TP t)."""
    import os
    import subprocess

    import vllm_oracle

    done = subprocess.run([str(vllm_oracle.vllm_python()), "-c", _VLLM_V41, json.dumps(CONFIG)], capture_output=True,
                          text=True, check=True, env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"})
    return json.loads(done.stdout.split("V41 ", 1)[1])


def test_vllm_v41_cache_pages_are_vllms(vllm_v41, plan) -> None:
    """The page of every cache fit counts, per family and packed record, equals vLLM's spec class's; on SM100 the
    mega-attention TP (nvfp4_ds_mla) and FlashMLA's (fp8_ds_mla) both. Per token the release's growing caches cost
    1,050 B under nvfp4_ds_mla (288 B compressed records, 132 B FP8 index keys), 1,650 B under fp8_ds_mla with V4.1's
    528 B records (SM100, FlashMLA) and 1,797.75 B under V4's 584 B ones."""
    from dsv4convert.engines.vllm import memory_v41 as vsz

    assert vllm_v41["indexer"] == vsz.indexer_entry_bytes(plan.config.index_head_dim) == 132
    cases = {"9/fp8_ds_mla": ("sm90", "flashmla"), "10/fp8_ds_mla": ("sm100", "flashmla"),
             "10/nvfp4_ds_mla": ("sm100", "flashmla_mega"), "12/fp8_ds_mla": ("sm120", "flashinfer_sm120")}
    assert set(cases) == set(vllm_v41["pages"])
    for key, (family, attention) in cases.items():
        records = vsz.kv_records(family, attention)
        specs = {s.name: s for s in vsz.cache_specs(plan.config, records, block_size=256)}
        assert records.cache_dtype == key.split("/")[1]
        assert {n: s.page_bytes for n, s in specs.items()} == vllm_v41["pages"][key], key
        per_token = sum(s.bytes_per_token for s in specs.values())
        assert per_token == {"nvfp4_ds_mla": 1050, "fp8_ds_mla": 1797.75 if family != "sm100" else 1650}[
            records.cache_dtype], key
    tp8 = vsz.attention_class("sm100", 8, plan.config)
    assert tp8 == "flashmla_mega" and vsz.attention_class("sm90", 8, plan.config) == "flashmla"


def test_vllm_v41_engram_shards_are_vllms(vllm_v41, plan) -> None:
    """Hash-head buckets and each rank's rows equal vLLM's ``EngramLayout`` and ``ParallelEngramEmbedding``; the
    host bytes per server are every rank's shard (the head buckets, not the table's padding rows)."""
    from dsv4convert.engines.vllm import memory_v41 as vsz

    cfg = plan.config
    assert vsz.engram_head_sizes(cfg) == vllm_v41["heads"]
    for key, rows in vllm_v41["shards"].items():
        tp, rank = map(int, key.split("/"))
        assert [vsz.engram_shard_rows(h, tp, rank) for h in vsz.engram_head_sizes(cfg)] == rows, key
    host = vsz.engram_placement(cfg, 8, "host-per-rank")
    row = cfg.engram_head_dim * 33 // 32
    assert host.host_bytes_per_server == sum(map(sum, vllm_v41["heads"])) * row <= host.table_bytes
    assert host.gpu_bytes_per_rank == 0 and vsz.engram_placement(cfg, 8, "gpu").host_bytes_per_server == 0
    with pytest.raises(EngineError, match="without any"):
        vsz.engram_shard_rows(vllm_v41["heads"][0][:3], 4, 0)


def test_vllm_v41_weights_are_vllms_model(tiny_v41: Path) -> None:
    """vLLM's own V4.1 model and DSpark draft built for the tiny V4.1 (TP 1, sm_100): the bytes of their one-byte
    parameters (FP8 weights, per-row 32x32 scales, MXFP4 experts, the Engram rows and scales) equal fit's restatement,
    and their element counts match the file's under fit's rules (the CPU build keeps some BF16 tensors in F32)."""
    import math

    import vllm_oracle

    from dsv4convert.engines.vllm import memory_v41 as vsz
    from dsv4convert.models.deepseek_v41.inventory import role_of

    text = json.loads((tiny_v41 / "config.json").read_text())["text_config"]
    dspark = json.dumps({"method": "dspark", "num_speculative_tokens": text["dspark_block_size"]})
    argv = ["--kv-cache-dtype", "fp8", "--block-size", "256"]
    target, draft = vllm_oracle.run([vllm_oracle.request_v41(tiny_v41, argv, gpu="sm100"),
                                     vllm_oracle.request_v41(tiny_v41, [*argv, "--speculative-config", dspark],
                                                             gpu="sm100", draft=True)])
    tiny = source_v41.planned(json.loads((tiny_v41 / "config.json").read_text()), str(tiny_v41))
    one_byte = {"F8_E4M3", "F8_E8M0", "I8", "U8"}

    def ours(draft_part: bool) -> tuple[int, int]:
        specs = [s for s in tiny.tensors if s.name.startswith("mtp.") == draft_part]
        stored = [(s, vsz.stored_bytes(s, role_of(s.name))) for s in specs]
        f32 = [s.dtype == "F32" or s.name.startswith("image_") or ".confidence_head." in s.name for s, _ in stored]
        return (sum(b for s, b in stored if s.dtype in one_byte),
                sum(b if s.dtype in one_byte else b // (4 if wide else 2) for (s, b), wide in zip(stored, f32)))

    def theirs(report: dict, aliased: set[str]) -> tuple[int, int]:
        params = [(n, d, math.prod(s)) for n, (d, s) in report["params"].items() if n not in aliased]
        return (sum(e for _, d, e in params if d in ("float8_e4m3fn", "uint8", "int8")), sum(e for *_, e in params))

    assert ours(False) == theirs(target, set())
    assert ours(True) == theirs(draft, {"model.embed_tokens.weight", "lm_head.weight"})


def test_fit_vllm_for_a_v41_config(capsys) -> None:
    """Every variant vLLM loads sized in both Engram placements, fp8 and w4a16 named as refused with vLLM's reason;
    the tables in host memory free each GPU their shard."""
    argv = ["fit", "--config", str(CONFIG_PATH), "--gpu", "b200", "--count", "8", "--tp", "4", "--engine", "vllm",
            "--context", "65536", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert {(s["variant"], s["engram"]) for s in out["servers"]} == {
        (v, p) for v in ("native", "nvfp4", "bf16") for p in ("host-per-rank", "gpu")}
    assert {r["variant"] for r in out["not_served"]} == {"fp8", "w4a16"}
    assert "FP8 MoE" in next(r["why"] for r in out["not_served"] if r["variant"] == "fp8")
    rows = {(s["variant"], s["engram"]): s for s in out["servers"]}
    native, on_gpu = rows["native", "host-per-rank"], rows["native", "gpu"]
    assert native["kv_bytes_per_token"] == 1050 and native["kv_layout"].startswith("nvfp4_ds_mla")
    assert on_gpu["weights_bytes_per_rank"] - native["weights_bytes_per_rank"] == on_gpu["engram_gpu_bytes_per_rank"]
    assert native["engram_host_bytes_per_process"] == on_gpu["engram_gpu_bytes_per_rank"] > 0
    assert native["kv_tokens"] > on_gpu["kv_tokens"]
    assert any("cpu_offload" in a for a in out["assumes"]) and out["estimated"]


def test_fit_model_v41_both_engines(tiny_v41: Path, v41_outputs: dict[str, Path], tmp_path: Path, capsys) -> None:
    """``fit --model`` on the tiny V4.1 and on its conversions (headers only): the variant is the checkpoint's, vLLM
    refuses the FP8-expert one in one error line, and a config that lies about its experts is named."""
    import shutil

    for engine in ("sglang", "vllm"):
        assert main(["fit", "--model", str(tiny_v41), "--gpu", "b200", "--count", "1", "--tp", "1", "--engine",
                     engine, "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["engine"] == engine and out["servers"] and all(s["fits"] for s in out["servers"])
    nvfp4, fp8 = v41_outputs["nvfp4"], v41_outputs["fp8"]
    capsys.readouterr()
    assert main(["fit", "--model", str(nvfp4), "--gpu", "b200", "--count", "1", "--tp", "1", "--engine", "vllm",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {s["variant"] for s in out["servers"]} == {str(nvfp4)} and not out["not_served"]
    assert main(["fit", "--model", str(fp8), "--gpu", "b200", "--count", "1", "--tp", "1", "--engine", "sglang",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["variant"] == "fp8"
    assert main(["fit", "--model", str(fp8), "--gpu", "b200", "--count", "1", "--tp", "1", "--engine", "vllm"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not load this fp8 checkpoint" in err[0] and "FP8 MoE" in err[0]
    fp8 = shutil.copytree(fp8, tmp_path / "fp8")   # the session's output is not changed
    config = json.loads((fp8 / "config.json").read_text())
    config["quantization_config"]["expert_dtype"] = "fp4"
    (fp8 / "config.json").write_text(json.dumps(config))
    assert main(["fit", "--model", str(fp8), "--gpu", "b200", "--count", "1", "--tp", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "F8_E4M3" in err and "native variant" in err
