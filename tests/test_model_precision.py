"""model/precision.py: transformers' own float32 products, unchanged below float64, and batch-invariant in float64.

* For BF16 and float32 layers the three switched classes compute exactly transformers' (bitwise equal outputs):
  every output byte and every served-numerics result stays what it was.
* In a float64 layer they compute in float64: a row's result is the same, to float64 rounding, whatever the batch
  around it and the thread count (transformers' float32 product moved a row by 2.7e-5 between a 5-row and a 14-row
  call with 2 threads on a 2-core AMD EPYC), and equal to transformers' to its float32 rounding.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
    DeepseekV4HyperConnection,
    DeepseekV4HyperHead,
    DeepseekV4IndexerScorer,
)

from dsv4convert.model.blocks import hf_config
from dsv4convert.model.precision import HyperConnection, HyperHead, IndexerScorer, at_layer_precision
from dsv4convert.synth import preset_config

pytestmark = pytest.mark.threads


def modules(dtype: torch.dtype):
    config = hf_config(preset_config("tiny"))
    torch.manual_seed(0)
    made = [DeepseekV4HyperConnection(config), DeepseekV4HyperHead(config), DeepseekV4IndexerScorer(config)]
    for module in made:
        for p in module.parameters():
            torch.nn.init.normal_(p, 0, 0.05)
    return config, [m.to(dtype) for m in made]


def inputs(config, dtype: torch.dtype, rows: int, gen: torch.Generator):
    streams = torch.randn(1, rows, config.hc_mult, config.hidden_size, generator=gen).to(dtype)
    q = torch.randn(1, rows, config.index_n_heads, config.index_head_dim, generator=gen).to(dtype)
    kv = torch.randn(1, 9, config.index_head_dim, generator=gen).to(dtype)
    hidden = torch.randn(1, rows, config.hidden_size, generator=gen).to(dtype)
    return streams, (q, kv, hidden)


def run_all(made, streams, scorer_args):
    connection, head, scorer = made
    return [*connection(streams), head(streams), scorer(*scorer_args)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_below_float64_the_classes_are_transformers_bit_for_bit(dtype, torch_threads):
    config, made = modules(dtype)
    ours = [at_layer_precision(copy.deepcopy(m)) for m in made]
    assert [type(m) for m in ours] == [HyperConnection, HyperHead, IndexerScorer]
    streams, scorer_args = inputs(config, dtype, 14, torch.Generator().manual_seed(1))
    with torch.no_grad():
        for want, got in zip(run_all(made, streams, scorer_args), run_all(ours, streams, scorer_args)):
            assert want.dtype == got.dtype and torch.equal(want, got)


def test_in_float64_a_row_does_not_depend_on_the_batch_around_it(torch_threads):
    config, made = modules(torch.float64)
    ours = [at_layer_precision(copy.deepcopy(m)) for m in made]
    streams, (q, kv, hidden) = inputs(config, torch.float64, 14, torch.Generator().manual_seed(2))
    with torch.no_grad():
        whole = run_all(ours, streams, (q, kv, hidden))
        want = run_all(made, streams, (q, kv, hidden))
        for rows in (1, 3, 5, 6, 9):
            part = run_all(ours, streams[:, -rows:], (q[:, -rows:], kv, hidden[:, -rows:]))
            for a, b in zip(part, whole):
                assert a.dtype == torch.float64
                torch.testing.assert_close(a, b[:, -rows:], rtol=0, atol=1e-12 * float(b.abs().max()))
    for a, b in zip(whole, want):      # transformers' math, its float32 products rounded
        torch.testing.assert_close(a, b.to(torch.float64), rtol=0, atol=1e-5 * float(b.abs().max()))
