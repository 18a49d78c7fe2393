"""Recall prompts and scoring, indexer top-k decoding, bench_serving JSONL parsing, reports and compare."""

from __future__ import annotations

import base64
import json
import re
import struct

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

import sglang_oracle as sgl
from dsv4convert.errors import FormatError
from dsv4convert import needle as needles
from dsv4convert.needle import Needle, PromptTemplate, value_entries
from dsv4convert.serve import recall, report, speed
from dsv4convert.serve.defaults import DEFAULT_CONCURRENCIES
from dsv4convert.serve.recall import RecallSweep

TEMPLATE = PromptTemplate()


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    """A real (fast) tokenizer built offline: one token per word and per digit, the chat markers special."""
    words = set(re.findall(r"[A-Za-z]+|[^\sA-Za-z0-9]", needles.FILLER + " ".join(needles.NEEDLE_KEYS)
                           + Needle("x", "0").sentence + Needle("x", "0").question))
    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(sorted(words | set("0123456789")))}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Whitespace(), pre_tokenizers.Digits(individual_digits=True)]
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    fast.add_special_tokens({"additional_special_tokens": ["<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "</think>"]})
    return fast


@pytest.mark.parametrize("length", [256, 1000, 1024, 4099])
@pytest.mark.parametrize("depth", [0.0, 0.37, 1.0])
def test_prompt_has_exact_length_and_needle_where_asked(tokenizer, length, depth):
    needle = Needle("the iron bridge", "4071935")
    prompt = needles.build_prompt(tokenizer, length, depth, needle, TEMPLATE)
    assert len(prompt.input_ids) == length
    start, end = prompt.needle_span
    assert prompt.input_ids[start:end] == tokenizer.encode(needle.sentence, add_special_tokens=False)
    prefix = tokenizer.encode(TEMPLATE.prefix, add_special_tokens=False)
    closing = tokenizer.encode(needle.question + TEMPLATE.suffix, add_special_tokens=False)
    assert prompt.input_ids[: len(prefix)] == prefix and prompt.input_ids[-len(closing):] == closing
    haystack = length - len(prefix) - len(closing) - (end - start)
    assert start - len(prefix) == round(depth * haystack)
    assert "4071935" not in tokenizer.decode(prompt.input_ids[:start] + prompt.input_ids[end:]).replace(" ", "")


def test_prompt_refuses_impossible_requests(tokenizer):
    with pytest.raises(ValueError, match="cannot hold"):
        needles.build_prompt(tokenizer, 20, 0.5, Needle("the iron bridge", "4071935"))
    with pytest.raises(ValueError, match="depth"):
        needles.build_prompt(tokenizer, 1024, 1.5, Needle("the iron bridge", "4071935"))


@pytest.mark.parametrize(("output", "correct"), [
    ("4071935", True), (" The number is 4,071,935.", True), ("4071935</s>", True),
    ("40719350", False), ("7654321 then 4071935", False), ("I do not know.", False), ("", False),
])
def test_answer_scoring(output, correct):
    assert needles.answer_is_correct(output, Needle("k", "4071935")) is correct


def _b64(values: list[int]) -> str:
    return base64.b64encode(struct.pack(f"<{len(values)}i", *values)).decode()


def test_indexer_topk_decoding_and_needle_ranks():
    # 3 positions x 2 layers x 4 indices, written out by hand; -1 pads unused slots.
    values = [0, 1, 2, 3, 9, 9, 9, 9,
              4, 5, 6, 7, 8, 8, 8, 8,
              1, 3, 2, -1, 0, 1, -1, -1]
    topk = recall.decode_indexer_topk(_b64(values), num_layers=2, topk=4)
    assert topk.shape == (3, 2, 4) and topk[1, 0, 2] == 6 and topk[2, 1, 3] == -1
    # Needle tokens 9..13: entries 2..4 hold them (entry w pools tokens 4(w-1) .. 4w+3); no value found in it.
    sentence = value_entries(list(range(20)), (9, 14), [99])
    assert sentence == [(2, 3, 4)]
    assert recall.needle_block_ranks(topk, 2, sentence) == [1, None]
    assert recall.needle_block_ranks(topk, 0, sentence) == [2, None]
    # A value at tokens 10..11 needs entry 2 or 3 (token 10) and entry 2 or 3 (token 11): row 1 has neither.
    value = value_entries(list(range(20)), (9, 14), [10, 11])
    assert value == [(2, 3), (2, 3)]
    assert recall.needle_block_ranks(topk, 2, value) == [1, None]
    assert recall.needle_block_ranks(topk, 1, value) == [None, None]
    with pytest.raises(FormatError, match="query row 3 is outside"):
        recall.needle_block_ranks(topk, 3, sentence)
    with pytest.raises(FormatError, match="not a whole number of positions"):
        recall.decode_indexer_topk(_b64(values[:-1]), num_layers=2, topk=4)
    with pytest.raises(FormatError, match="not valid base64"):
        recall.decode_indexer_topk("not base64!", num_layers=2, topk=4)


def test_indexer_layers_of_the_real_model(real_config):
    layers = recall.indexer_layer_ids(real_config["compress_ratios"], real_config["num_hidden_layers"])
    assert len(layers) == 21 and layers[:3] == [2, 4, 6] and layers[-1] == 42


def fake_server(tokenizer, layers: int, topk: int, forget_above: int):
    """A /generate that finds the needle in the prompt text, forgets it past ``forget_above`` tokens,
    and reports, in every layer but the last, a stray entry then the entries holding the value's digits
    (one per token; entry w holds token p when w = p // 4) as selected."""

    def generate(payload: dict) -> dict:
        ids = payload["input_ids"]
        text = tokenizer.decode(ids).replace(" ", "")
        value = re.search(r"secretnumberfor[a-z]+is(\d+)", text).group(1)
        answer = value if len(ids) <= forget_above else "1234567"
        digits = tokenizer.encode(value, add_special_tokens=False)
        start = next(i for i in range(len(ids)) if ids[i:i + len(digits)] == digits)
        cover = sorted({p // 4 for p in range(start, start + len(digits))})
        rows = []
        for _ in range(len(ids) + 3 - 1):  # SGLang: (prompt + generated tokens - 1) positions; say 3 generated
            for layer in range(layers):
                picks = [cover[0] + 1000, *cover] if layer < layers - 1 else []
                rows.extend((picks + [-1] * topk)[:topk])
        return {"text": answer, "meta_info": {"indexer_topk": _b64(rows)}}

    return generate


def test_sweep_summary_heatmap_and_compare(tokenizer, tmp_path):
    sweep = RecallSweep(lengths=[128, 256], depths=[0.0, 0.5, 1.0], trials=2, indexer_topk=True,
                        indexer_layers=3, index_topk=4)
    trials = sweep.run(tokenizer, fake_server(tokenizer, 3, 4, forget_above=128))
    # Seven one-token digits lie in two or three entries: the value is covered at rank 2 or 3 (after the stray).
    assert len(trials) == 12 and all(t.ranks[0] == t.ranks[1] in (2, 3) and t.ranks[2] is None for t in trials)
    summary = recall.summarize(trials, layer_ids=[2, 4, 6])
    assert summary["accuracy"] == 0.5
    assert {(c["length"], c["accuracy"]) for c in summary["cells"]} == {(128, 1.0), (256, 0.0)}
    layers = [(e["layer"], e["selected_rate"]) for e in summary["indexer_layers"]]
    assert layers == [(2, 1.0), (4, 1.0), (6, 0.0)]
    assert 2 <= summary["indexer_layers"][0]["median_rank"] <= 3 and summary["indexer_layers"][2]["median_rank"] is None
    assert summary["indexer_layers"][0]["selected_when_wrong"] == 1.0

    meta = {"model": "base", "variant": "native"}
    base = report.write_report(tmp_path / "base.json", "recall", meta, {"summary": summary, "trials": [t.to_json() for t in trials]})
    report.write_heatmap(summary, tmp_path / "recall.png", "stand-in")
    assert (tmp_path / "recall.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    better = RecallSweep(lengths=[128, 256], depths=[0.0, 0.5, 1.0], trials=2).run(
        tokenizer, fake_server(tokenizer, 3, 4, forget_above=10**6))
    other = report.write_report(tmp_path / "other.json", "recall", {"model": "nvfp4", "variant": "nvfp4"},
                                {"summary": recall.summarize(better), "trials": []})
    lines = report.compare(report.read_report(tmp_path / "base.json"), other)
    assert any(line.startswith("accuracy (all cells)") and line.split()[-3:] == ["0.500", "1.000", "+0.500"] for line in lines)
    assert any(line.startswith("accuracy 256 @ 50%") and line.split()[-1] == "+1.000" for line in lines)
    assert not any(line.startswith("accuracy 128") for line in lines)  # unchanged cells are not listed
    assert base["kind"] == "recall"


def test_sweep_demands_indexer_topk_when_requested(tokenizer):
    sweep = RecallSweep(lengths=[128], depths=[0.5], trials=1, indexer_topk=True, indexer_layers=3, index_topk=4)
    with pytest.raises(FormatError, match="no indexer_topk"):
        sweep.run(tokenizer, lambda payload: {"text": "1", "meta_info": {}})
    assert sweep.request(needles.build_prompt(tokenizer, 128, 0.5, Needle("k", "1")))["return_indexer_topk"] is True


# Two records as `bench_serving --output-file` appends them (keys per sglang-contract.md section 8),
# written by hand, with extra keys the parser must ignore.
BENCH_JSONL = "\n".join(json.dumps(record) for record in [
    {"backend": "sglang", "dataset_name": "random-ids", "request_rate": "inf", "max_concurrency": 1,
     "random_input_len": 1024, "random_output_len": 256, "random_range_ratio": 1.0, "duration": 61.5,
     "completed": 8, "total_input_tokens": 8192, "total_output_tokens": 2048, "request_throughput": 0.13,
     "input_throughput": 133.2, "output_throughput": 33.3, "total_throughput": 166.5,
     **{f"{s}_{m}_ms": v for m, base in (("ttft", 180.0), ("tpot", 29.0), ("itl", 28.5), ("e2e_latency", 7600.0))
        for s, v in (("mean", base), ("median", base * 0.98), ("std", base * 0.1), ("p90", base * 1.2),
                     ("p95", base * 1.3), ("p99", base * 1.5))},
     "concurrency": 0.99, "accept_length": None},
    {"backend": "sglang", "dataset_name": "random-ids", "max_concurrency": 16, "random_input_len": 8192,
     "random_output_len": 512, "duration": 120.25, "completed": 128, "output_throughput": 545.0,
     **{f"{s}_{m}_ms": v for m, base in (("ttft", 2400.0), ("tpot", 31.0), ("itl", 30.0), ("e2e_latency", 18000.0))
        for s, v in (("mean", base), ("median", base), ("p99", base * 2))}},
]) + "\n"


def test_bench_jsonl_parsing():
    first, second = speed.parse_bench_jsonl(BENCH_JSONL, "speed.jsonl")
    assert first.case == speed.BenchCase(1024, 256, 1) and first.completed == 8
    assert first.output_throughput == 33.3 and first.latencies_ms["median_ttft_ms"] == pytest.approx(176.4)
    assert first.latencies_ms["p99_itl_ms"] == pytest.approx(42.75)
    assert second.case == speed.BenchCase(8192, 512, 16) and second.duration_s == 120.25
    assert second.to_json()["median_tpot_ms"] == 31.0


@pytest.mark.parametrize(("text", "message"), [
    ('{"max_concurrency": 1}\n', r"speed.jsonl:1: .*no numeric 'random_input_len'"),
    ("not json\n", r"speed.jsonl:1: not JSON"),
    ("[1, 2]\n", "must be a JSON object"),
    (BENCH_JSONL.replace('"output_throughput": 545.0', '"output_throughput": null'), r"speed.jsonl:2: .*output_throughput"),
])
def test_bench_jsonl_rejects_bad_records(text, message):
    with pytest.raises(FormatError, match=message):
        speed.parse_bench_jsonl(text, "speed.jsonl")


def test_bench_args_parse_with_sglang_benchmark_cli():
    case = speed.BenchCase(8192, 512, 16)
    args = speed.bench_args(case, host="127.0.0.1", port=8000, model="/models/nvfp4", output_file="s.jsonl", pd_separated=True)
    parsed = sgl.parse_bench_args(args)
    assert parsed.dataset_name == "random-ids" and parsed.random_range_ratio == 1.0
    assert (parsed.random_input_len, parsed.random_output_len, parsed.max_concurrency) == (8192, 512, 16)
    assert parsed.pd_separated and parsed.num_prompts == case.num_prompts and parsed.output_file == "s.jsonl"
    assert len(speed.bench_cases(speed.DEFAULT_SHAPES, DEFAULT_CONCURRENCIES)) == 12
    with pytest.raises(SystemExit):
        sgl.parse_bench_args([*args, "--no-such-bench-flag"])


def test_speed_compare_and_report_errors(tmp_path):
    results = [r.to_json() for r in speed.parse_bench_jsonl(BENCH_JSONL)]
    faster = [dict(r, output_throughput=r["output_throughput"] * 2) for r in results]
    base = report.write_report(tmp_path / "a.json", "speed", {"model": "a"}, {"results": results})
    other = report.write_report(tmp_path / "b.json", "speed", {"model": "b"}, {"results": faster})
    lines = report.compare(base, other)
    assert any(line.startswith("in 1024 out 256 c1 tok/s") and line.endswith("+33.3") for line in lines)
    recall_report = {"kind": "recall", "meta": {}, "summary": {"accuracy": 1.0, "cells": []}}
    with pytest.raises(FormatError, match="cannot compare"):
        report.compare(base, recall_report)
    (tmp_path / "bad.json").write_text('{"kind": "other"}')
    with pytest.raises(FormatError, match="not a dsv4convert serve report"):
        report.read_report(tmp_path / "bad.json")
