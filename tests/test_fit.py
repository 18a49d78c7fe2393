"""``dsv4convert fit`` against SGLang 0.5.23's own code, run on the CPU.

* The memory fraction: SGLang's resolution pipeline (``handle_gpu_memory_settings``) resolves serve's
  own argv with ``get_device_memory_capacity`` answering the GPU's size; its ``mem_fraction_static``,
  with and without the launch's explicit value, must equal fit's exactly.
* The KV pool: SGLang's ``DSV4PoolConfigurator`` is built for the resolved server (published as a
  scheduler publishes it) over SGLang's ``ModelConfig`` of the real V4-Flash config; its bytes per
  token, its ratio-128 state and the tokens ``calculate_pool_sizes`` gives for fit's budget must match.
  ``select_dsv4_kv_layout`` asks ``torch.cuda``, which CPU torch cannot answer: it is patched to the
  family's capability (the page padding then comes from SGLang's ``KVLayout``).
* Weights per rank: SGLang's ``DeepseekV4ForCausalLM`` (and its NextN draft) is built on the meta
  device as rank 0 of TP 4 and 8 (``sglang_oracle.rank_parameters``: SGLang's own layers shard by
  SGLang's TP size); the parameter bytes must be within 0.5 % of fit's, for a 5-layer model of the
  real widths that holds every layer kind of V4-Flash (hash/ratio 0, hash/ratio 4, ratio 128,
  ratio 4, the MTP block), planned as ``fit`` plans it (one layer of each kind, one expert, counted;
  checked against the full plan on an 8-layer, 16-expert model). Not counted on SGLang's side, because SGLang frees them after loading: W4A16's act-order
  ``g_idx``/``g_idx_sort_indices`` (``compressed_tensors_wNa16_moe.py process_weights_after_loading``
  replaces them with empty tensors for a checkpoint without act-order) and the draft's own embedding
  and LM head (``set_embed_and_head`` gives it the target's).
* Not run: the native variant's MoE method on sm_90 and sm_100 needs FlashInfer, which a CPU
  install lacks (``Mxfp4FlashinferCutlassMoEMethod`` raises in its constructor); it is built on sm_120
  (Marlin), and its expert bytes are the file's on every family.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest
import sglang_oracle as sgl

from dsv4convert.cli import main
from dsv4convert.engines import memory
from dsv4convert.engines.served import ServedModel
from dsv4convert.engines.sglang import memory as sizing
from dsv4convert.engines.sglang.rules import variant_rules
from dsv4convert.engines.sglang.server import Server, server
from dsv4convert.engines.vllm import memory as vllm
from dsv4convert.fit import source, verdict

REAL_CONFIG = json.loads((Path(__file__).resolve().parent.parent / "dsv4convert/data/deepseek-v4-flash-config.json")
                         .read_text())
FAMILIES = {"rtx-pro-6000": "sm120", "h200": "sm90", "b200": "sm100"}
ROLES = ("prefill", "decode", "server")


def _small_config() -> dict:
    """The real widths with 5 layers: every layer kind V4-Flash has, and its MTP block."""
    return {**REAL_CONFIG, "num_hidden_layers": 5, "compress_ratios": [0, 0, 4, 128, 4, 0]}


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> dict[str, tuple[ServedModel, Path]]:
    """Each shipped variant planned for the small config, with a directory holding its config.json."""
    out = {}
    for variant in source.SHIPPED:
        src = source.planned(variant, _small_config())
        directory = tmp_path_factory.mktemp(variant)
        (directory / "config.json").write_text(json.dumps(src.config))
        out[variant] = (src, directory)
    return out


@pytest.fixture(scope="module")
def real_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("v4flash")
    (directory / "config.json").write_text(json.dumps(REAL_CONFIG))
    return directory


def _server(variant: str, family: str, role: str, tp: int, mtp: bool, model: Path) -> Server:
    return server(str(model), variant, family, role=role, tp=tp, mtp=mtp)


def _resolve(argv: list[str], gpu: verdict.Gpu, env: dict[str, str]):
    import sglang.srt.arg_groups.memory_hook as memory_hook

    with mock.patch.object(memory_hook, "get_device_memory_capacity", lambda *_a, **_k: gpu.mib):
        return sgl.resolve_server_args(argv, gpu=gpu.family, env=env).resolved_dict()["mem_fraction_static"]


@pytest.mark.parametrize("gpu_name", list(FAMILIES))
def test_memory_fraction_is_sglangs(gpu_name: str, real_dir: Path) -> None:
    gpu = verdict.GPUS[gpu_name]
    env = variant_rules("fp8", gpu.family).env
    checked = 0
    for tp in (4, 8):
        for role in ROLES:
            for mtp in (False, True):
                settings = _server("fp8", gpu.family, role, tp, mtp, real_dir)
                ours = sizing.memory_fraction(settings, gpu.mib)
                assert _resolve(settings.argv(), gpu, env) == ours.used, (role, tp, mtp)
                bare = replace(settings, mem_fraction_static=None)
                theirs = _resolve(bare.argv(), gpu, env)
                assert theirs == sizing.memory_fraction(bare, gpu.mib).default
                assert theirs == ours.default or settings.cuda_graph_max_bs_decode is not None, (role, tp, mtp)
                checked += 1
    assert checked == 12


def _sglang_pool(server_argv: list[str], gpu: verdict.Gpu, env: dict[str, str], real_dir: Path):
    """SGLang's DSV4PoolConfigurator for this server, over SGLang's ModelConfig of the real config."""
    with sgl.pool_configurator(server_argv, gpu.family, env) as (pool, _resolved):
        return pool


@pytest.mark.parametrize("gpu_name", list(FAMILIES))
def test_kv_pool_is_sglangs(gpu_name: str, real_dir: Path) -> None:
    from sglang.srt.runtime_context import restore_context, snapshot_context

    gpu = verdict.GPUS[gpu_name]
    env = variant_rules("fp8", gpu.family).env
    geometry = ServedModel.geometry.fget(SimpleNamespace(config=REAL_CONFIG))
    for tp in (4, 8):
        for role in ROLES:
            for mtp in (False, True):
                settings = _server("fp8", gpu.family, role, tp, mtp, real_dir)
                argv = settings.argv()
                ours = sizing.kv_cost(geometry, settings)
                state = snapshot_context()
                try:
                    pool = _sglang_pool(argv, gpu, env, real_dir)
                    assert pool.bytes_per_full_token == pytest.approx(ours.bytes_per_full_token, rel=1e-12)
                    assert pool._get_c128_state_fixed_bytes(sizing.V4_MAX_RUNNING_REQUESTS) == ours.fixed_bytes
                    available = int((tp * 11 + 20) * memory.GIB)     # any budget: both must split it alike
                    theirs = pool.calculate_pool_sizes(available, sizing.V4_PAGE_SIZE)
                finally:
                    restore_context(state)
                full, swa = sizing.kv_tokens(available, ours)
                assert full == pytest.approx(theirs.full_max_total_num_tokens, rel=0.01)
                assert swa == pytest.approx(theirs.swa_max_total_num_tokens, rel=0.01)


# Variant x family pairs SGLang's model builds on a CPU (native needs FlashInfer off sm_120).
BUILDS = [(v, f) for v in source.SHIPPED for f in ("sm90", "sm100", "sm120") if v != "native" or f == "sm120"]


def _sglang_bytes(params: dict, *, draft: bool) -> int:
    skipped = ("g_idx",) + (("embed_tokens.", "lm_head.") if draft else ())
    return sum(p.numel() * p.element_size() for n, p in params.items() if not any(s in n for s in skipped))


@pytest.mark.parametrize("variant,family", BUILDS)
def test_weights_per_rank_are_sglangs(variant: str, family: str, small) -> None:
    src, directory = small[variant]
    gpu = next(g for g in verdict.GPUS.values() if g.family == family)
    env = variant_rules(src.variant, family).env
    mtp = variant_rules(src.variant, family).serves_draft
    for tp in (4, 8):
        fit = verdict.sglang_server(src, gpu, "server", tp, mtp=mtp)
        argv = _server(src.variant, family, "server", tp, mtp, directory).argv()
        target = _sglang_bytes(sgl.rank_parameters(directory, argv, gpu=family, tp=tp, env=env), draft=False)
        assert fit.weights_bytes_per_rank - fit.draft_weights_bytes_per_rank == pytest.approx(target, rel=0.005)
        if mtp:
            draft = _sglang_bytes(sgl.rank_parameters(directory, argv, gpu=family, tp=tp, env=env, draft=True),
                                  draft=True)
            assert fit.draft_weights_bytes_per_rank == pytest.approx(draft, rel=0.005)


def test_a_wrong_split_rule_is_caught(small) -> None:
    """The weights check can fail: replicating wq_b instead of splitting it moves the figure past 0.5 %."""
    src, _ = small["fp8"]
    rules = sizing.load_rules(src, _server(src.variant, "sm90", "server", 4, False, Path("m")))
    right = memory.weights_per_rank(src.tensors, 4, rules).target
    with mock.patch.object(memory, "_SPLIT_ATTENTION", (".attn.wo_a", ".attn.wo_b")):
        wrong = memory.weights_per_rank(src.tensors, 4, rules).target
    assert not math.isclose(right, wrong, rel_tol=0.005)


def test_the_compact_plan_is_the_full_plan() -> None:
    """``planned`` plans one layer of each kind with one expert and counts copies: every figure fit reads
    (bytes per rank and per role at each TP and load rule, the served variant, the KV geometry) must
    equal the full plan's, for a model with two layers of most kinds and 16 experts."""
    config = {**REAL_CONFIG, "num_hidden_layers": 8, "compress_ratios": [0, 0, 4, 128, 4, 128, 4, 0, 0],
              "n_routed_experts": 16}
    for variant in source.SHIPPED:
        compact, full = source.planned(variant, config), source.planned(variant, config, compact=False)
        assert 3 * len(compact.tensors) < len(full.tensors)
        assert (compact.variant, compact.geometry) == (full.variant, full.geometry)
        for family in FAMILIES.values():
            rules = sizing.load_rules(compact, _server(compact.variant, family, "server", 4, False, Path("m")))
            assert rules == sizing.load_rules(full, _server(full.variant, family, "server", 4, False, Path("m")))
            for tp in (1, 4, 8):
                ours, theirs = (memory.weights_per_rank(s.tensors, tp, rules) for s in (compact, full))
                assert (ours.target, ours.draft, ours.by_role) == (theirs.target, theirs.draft, theirs.by_role)


_VLLM_SPECS = """
import dataclasses, json, torch
from vllm.config.cache import CacheConfig
from vllm.v1.kv_cache_interface import MLAAttentionSpec, SlidingWindowMLASpec
field = next(f for f in dataclasses.fields(CacheConfig) if f.name == "gpu_memory_utilization")
out = {"utilization": field.default.default}   # a pydantic dataclass: the field's FieldInfo
for packed in (True, False):
    # The arguments models/deepseek_v4 (attention.py, compressor.py) and sparse_swa.py pass, per layout.
    a = 576 if packed else 512
    kv = dict(dtype=torch.uint8, state_content_bytes=584) if packed else dict(dtype=torch.float8_e4m3fn)
    common = dict(num_kv_heads=1, max_tp_shards=1)
    specs = {
        "sliding_window": SlidingWindowMLASpec(block_size=64, head_size=512, sliding_window=128, alignment=a,
                                               model_version="deepseek_v4", **kv, **common),
        "ratio4_kv": MLAAttentionSpec(block_size=256, head_size=512, tokens_per_state=4, alignment=a, **kv, **common),
        "ratio128_kv": MLAAttentionSpec(block_size=256, head_size=512, tokens_per_state=128, alignment=a, **kv,
                                        **common),
        "ratio4_indexer": MLAAttentionSpec(block_size=256, head_size=132, dtype=torch.uint8, tokens_per_state=4,
                                           alignment=a, **common),
        "ratio4_compressor_state": SlidingWindowMLASpec(block_size=4, head_size=2 * 2 * 512, dtype=torch.float32,
                                                        sliding_window=8, alignment=a, **common),
        "ratio4_indexer_compressor_state": SlidingWindowMLASpec(block_size=4, head_size=2 * 2 * 128,
                                                                dtype=torch.float32, sliding_window=8, alignment=a,
                                                                **common),
        "ratio128_compressor_state": SlidingWindowMLASpec(block_size=8, head_size=2 * 512, dtype=torch.float32,
                                                          sliding_window=128, alignment=a, **common),
    }
    out[str(packed)] = {name: [s.block_size, s.page_size_bytes, getattr(s, "sliding_window", None)]
                        for name, s in specs.items()}
print("SPECS " + json.dumps(out))
"""


def test_vllm_cache_specs_are_vllms() -> None:
    """fit's V4 cache specs (block, padded page bytes, window) equal vLLM 0.33.0's own spec classes built with the
    arguments its V4 layers pass, in both layouts; its default gpu_memory_utilization likewise."""
    import subprocess

    import vllm_oracle

    done = subprocess.run([str(vllm_oracle.vllm_python()), "-c", _VLLM_SPECS], capture_output=True, text=True,
                          check=True, env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"})
    theirs = json.loads(done.stdout.split("SPECS ", 1)[1])
    assert theirs["utilization"] == vllm.GPU_MEMORY_UTILIZATION
    geometry = ServedModel.geometry.fget(SimpleNamespace(config=REAL_CONFIG))
    for packed in (True, False):
        ours = {spec.name: [spec.block_size, spec.page_bytes, spec.sliding_window]
                for spec in vllm.cache_specs(geometry, window=128, block_size=256, packed=packed)}
        assert ours == theirs[str(packed)], packed


def test_vllm_sizing(small, capsys) -> None:
    """The vLLM server: its utilization, weights as fit splits them, the growing caches' bytes per token, and
    every estimate named in the output."""
    src, _ = small["nvfp4"]
    fit = verdict.vllm_server(src, verdict.GPUS["h200"], 4, mtp=False)
    assert fit.mem_fraction_static == 0.92 and fit.engine == "vllm 0.33.0" and fit.fits
    assert fit.kv_bytes_per_token == pytest.approx(sum(fit.kv_terms.values()))
    assert main(["fit", "--engine", "vllm", "--gpu", "h200", "--tp", "8", "--json"]) == 0   # BF16 needs TP 8
    report = json.loads(capsys.readouterr().out)
    assert report["engine"] == "vllm 0.33.0" and any("activation peak" in e for e in report["estimated"])
    assert {row["variant"] for row in report["variants"]} == set(source.SHIPPED)


def test_json_has_every_figure(small, capsys, monkeypatch) -> None:
    src, directory = small["nvfp4"]
    monkeypatch.setattr(source, "from_checkpoint", lambda _model: src)
    assert main(["fit", "--model", str(directory), "--gpu", "rtx-pro-6000", "--tp", "4", "--pd", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [v["role"] for v in report["variants"]] == ["prefill", "decode"]
    for row in report["variants"]:
        for key in ("weights_bytes_per_rank", "mem_fraction_static", "kv_bytes_per_token", "kv_tokens",
                    "min_mem_fraction_static", "fits"):
            assert key in row
        assert row["fits"] is True and row["kv_tokens"] > 0


@pytest.mark.parametrize("argv,needle", [
    (["fit", "--gpu", "a100"], "--gpu 'a100'"),
    (["fit", "--gpu", "h200", "--count", "4", "--tp", "4", "--pd"], "need 8 GPUs"),
    (["fit", "--gpu", "h200", "--tp", "3"], "--tp 3"),
    (["fit", "--ep"], "--ep: fit sizes the launch serve makes"),
    (["fit", "--engine", "vllm", "--pd"], "--pd: serve starts vLLM as one server"),
    (["fit", "--gpu", "1024", "--gpu-family", "sm90"], "--gpu 1024: a 1024 MiB GPU holds nothing"),
    (["fit", "--gpu", "98304"], "--gpu 98304: a size needs its family"),
    (["fit", "--gpu", "h200", "--gpu-family", "sm120"], "--gpu h200 is H200-class Hopper"),
])
def test_bad_input_is_one_error_line(argv: list[str], needle: str, capsys) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0]


def test_a_model_that_is_not_v4_is_one_error_line(tmp_path: Path, capsys) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    (tmp_path / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    assert main(["fit", "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {tmp_path}/config.json: not a DeepSeek-V4 config")


def test_serve_refuses_what_cannot_fit(small) -> None:
    """The refusal names the server, the GPU and the shortfall; a launch that fits is not refused."""
    src, _ = small["bf16"]
    tiny = verdict.Gpu("16 GiB card", "sm90", 16384)
    why = verdict.refusal(src, tiny, verdict.launched(src, tiny, "decode", 4, mtp=False))
    assert why is not None and why.startswith("the decode server does not fit TP 4 x 16 GiB card (16384 MiB)")
    assert "short" in why
    b200 = verdict.GPUS["b200"]
    assert verdict.refusal(src, b200, verdict.launched(src, b200, "decode", 4, mtp=False)) is None


def test_a_gpu_given_as_a_size_is_sized_by_its_family(small, capsys, monkeypatch) -> None:
    """A size with --gpu-family sm120 is the RTX PRO 6000 (same KV tokens for its MiB); the same size under sm90
    rules is not (H200 rules would silently give it more KV), and the first line names the family."""
    src, directory = small["nvfp4"]
    monkeypatch.setattr(source, "from_checkpoint", lambda _model: src)

    def kv(*gpu: str) -> list[int]:
        assert main(["fit", "--model", str(directory), *gpu, "--tp", "4", "--json"]) == 0
        return [row["kv_tokens"] for row in json.loads(capsys.readouterr().out)["variants"]]

    card = verdict.GPUS["rtx-pro-6000"]
    assert kv("--gpu", str(card.mib), "--gpu-family", "sm120") == kv("--gpu", "rtx-pro-6000")
    assert kv("--gpu", str(card.mib), "--gpu-family", "sm90") != kv("--gpu", "rtx-pro-6000")
    assert main(["fit", "--model", str(directory), "--gpu", "98304", "--gpu-family", "sm120", "--tp", "4"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert "98304 MiB sm_120 GPU (RTX PRO 6000-class" in first


def test_the_table_says_what_it_shows_and_advises_only_what_fits_the_host(capsys) -> None:
    """Column names, and the fraction explained under the table (serve's 0.70 on sm_120 named); a TP that fits
    one server but not PD on --count GPUs is not offered as the fix; ``next:`` ranks exactly the variants whose
    servers all fit by KV tokens, with requests of --context and what each keeps, the release as no conversion."""
    argv = ["fit", "--gpu", "rtx-pro-6000", "--count", "8", "--tp", "4", "--pd", "--context", "65536"]
    assert main(argv) == 0   # some variants fit
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("SGLang 0.5.23 on RTX PRO 6000 (97887 MiB, sm_120)")
    assert out[1].split()[:3] == ["variant", "server", "weights/GPU"]
    rows = [line.split() for line in out[2:] if line.split()[1:2] in (["prefill"], ["decode"])]
    legend = out[2 + len(rows)]
    assert legend.startswith("fraction: --mem-fraction-static") and "serve sets 0.700" in legend
    assert all(row[4] == "0.700" for row in rows)
    fp8 = next(line for line in out if line.startswith("fp8 ") and "prefill" in line)
    assert "TP 8 would, but 2 servers of TP 8 need 16 GPUs and --count is 8" in fp8
    assert "--tp 8 fits" not in "\n".join(out)
    fitting = {row[0] for row in rows} - {row[0] for row in rows if "DOES" in row}
    ranked = out[out.index(next(line for line in out if line.startswith("next: "))) + 1:-1]
    assert {line.split()[1] for line in ranked} == fitting and {"fp8", "bf16"}.isdisjoint(fitting)
    kv = [int(line.split()[2].replace(",", "")) for line in ranked]
    assert kv == sorted(kv, reverse=True) and kv[0] == max(int(r[8].replace(",", "")) for r in rows if r[0] in fitting)
    assert all("requests of 65,536 tokens" in line for line in ranked)
    native = next(line for line in ranked if line.split()[1] == "native")
    assert "no conversion" in native and "to-native" not in "\n".join(out)
    assert "4-bit" in next(line for line in ranked if line.split()[1] == "w4a16")
