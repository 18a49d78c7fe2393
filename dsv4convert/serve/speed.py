"""Serving speed with SGLang's own ``bench_serving``, offline-safe, and its JSONL results.

``--dataset-name random-ids`` draws random token ids locally; the ``random`` dataset would
download ShareGPT. ``--random-range-ratio 1.0`` makes every prompt exactly the requested length.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import product

from dsv4convert.errors import FormatError

DEFAULT_SHAPES = ((1024, 256), (8192, 512), (32768, 512))  # (input tokens, output tokens)
METRICS = ("ttft", "tpot", "itl", "e2e_latency")
STATISTICS = ("mean", "median", "p99")


@dataclass(frozen=True)
class BenchCase:
    input_len: int
    output_len: int
    concurrency: int

    @property
    def num_prompts(self) -> int:
        """Enough requests to keep every slot busy several times over, bounded for long prompts."""
        return max(8, min(8 * self.concurrency, 256))


def bench_cases(shapes: Sequence[tuple[int, int]], concurrencies: Sequence[int]) -> list[BenchCase]:
    return [BenchCase(i, o, c) for (i, o), c in product(shapes, concurrencies)]


def bench_args(case: BenchCase, *, host: str, port: int, model: str, output_file: str, pd_separated: bool) -> list[str]:
    """Arguments for ``python -m sglang.benchmark.serving`` for one case (appends to ``output_file``)."""
    args = [
        "--backend", "sglang",
        "--host", host,
        "--port", str(port),
        "--model", model,
        "--tokenizer", model,
        "--dataset-name", "random-ids",
        "--random-input-len", str(case.input_len),
        "--random-output-len", str(case.output_len),
        "--random-range-ratio", "1.0",
        "--num-prompts", str(case.num_prompts),
        "--max-concurrency", str(case.concurrency),
        "--warmup-requests", str(min(case.concurrency, 8)),
        "--seed", "42",
        "--output-file", output_file,
    ]
    return args + (["--pd-separated"] if pd_separated else [])


@dataclass(frozen=True)
class BenchResult:
    """One JSONL record: the case it ran and its latency/throughput figures (ms, tok/s)."""

    case: BenchCase
    completed: int
    duration_s: float
    output_throughput: float
    latencies_ms: dict[str, float]

    def to_json(self) -> dict:
        return {
            "input_len": self.case.input_len, "output_len": self.case.output_len,
            "concurrency": self.case.concurrency, "completed": self.completed, "duration_s": self.duration_s,
            "output_throughput": self.output_throughput, **self.latencies_ms,
        }


def _number(record: dict, key: str, where: str) -> float:
    value = record.get(key)
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise FormatError(f"{where}: bench_serving record has no numeric {key!r}")
    return float(value)


def parse_bench_jsonl(text: str, source: str = "bench_serving output") -> list[BenchResult]:
    """Every record of a ``bench_serving --output-file`` JSONL file, in file order."""
    results = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{source}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise FormatError(f"{where}: not JSON: {exc}") from exc
        if not isinstance(record, dict):
            raise FormatError(f"{where}: a record must be a JSON object")
        case = BenchCase(
            int(_number(record, "random_input_len", where)),
            int(_number(record, "random_output_len", where)),
            int(_number(record, "max_concurrency", where)),
        )
        latencies = {
            f"{stat}_{metric}_ms": _number(record, f"{stat}_{metric}_ms", where)
            for metric, stat in product(METRICS, STATISTICS)
        }
        results.append(BenchResult(
            case, int(_number(record, "completed", where)), _number(record, "duration", where),
            _number(record, "output_throughput", where), latencies,
        ))
    return results
