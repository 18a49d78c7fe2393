"""Draft acceptance: does the checkpoint's ``mtp.*`` draft really draft?

With SGLang's speculative decoding (EAGLE over the preview's MTP block, DSPARK over 0731's DSpark
drafter) the draft proposes tokens and the model verifies them;
a broken draft (head or embedding not loaded, wrong expert kernel) still serves correct text,
only slowly: every proposal is rejected and each verify step yields one token. So the check
sends prompts whose continuations are predictable (counting, a passage being copied), greedy,
and reads the acceptance SGLang itself computes per request, in ``meta_info`` of ``/generate``
(``TokenizerManager._calculate_spec_decoding_metrics`` in SGLang 0.5.23):

* ``spec_verify_ct``: verify steps; ``completion_tokens``: tokens generated;
* accepted length = ``completion_tokens / spec_verify_ct`` (accepted drafts plus the bonus
  token per step: 1.0 means no draft token was ever accepted);
* ``spec_num_correct_drafts / spec_num_proposed_drafts``: the draft acceptance rate;
* ``spec_correct_drafts_histogram[k]``: verify steps that accepted exactly ``k`` drafts
  (``ScheduleBatch.Req.update_spec_correct_drafts_histogram``). Drafts are accepted as a prefix, so
  draft position ``j`` was accepted in every step that accepted ``k >= j``: the histogram gives the
  acceptance per draft position, which for DSPARK's block of drafts tells a drafter that only gets its
  first token right from one that holds up across the block.

Over all prompts the accepted length is ``sum(completion_tokens) / sum(spec_verify_ct)``, as
SGLang's own test kit aggregates it. SGLang's server-wide figure, ``internal_states[i]
.avg_spec_accept_length`` of ``GET /server_info`` (``InternalStateManager._add_speculative``,
the same ratio over everything the server decoded), is recorded beside it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsv4convert.errors import FormatError

# SGLang's DeepSeek-V4-Flash CI gate with the same balanced preset (test_deepseek_v4_flash_fp8_h200.py).
MAX_NEW_TOKENS = 256

_PASSAGE_A = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk. He trimmed the wick, "
    "polished the great lens until it shone, and wrote the state of the sea in a leather book. "
    "Ships passed far out on the water, and none of them ever knew his name."
)
_PASSAGE_B = (
    "To make bread, mix flour, water, salt and yeast in a large bowl. Knead the dough for ten "
    "minutes, cover it with a cloth, and let it rise until it has doubled in size. Shape the loaf, "
    "let it rise once more, and bake it in a hot oven until the crust is brown."
)


@dataclass(frozen=True)
class MtpPrompt:
    name: str
    text: str
    expected_start: str  # how a working model continues (informational: tells a broken model from a broken draft)


PROMPTS = (
    MtpPrompt("counting", "Count from 1 to 300, separated by commas.\n1, 2, 3, 4, 5, 6, 7, 8,", " 9, 10, 11, 12"),
    MtpPrompt("alphabet", "The alphabet written out twenty times, one per line:\n"
              + "A B C D E F G H I J K L M N O P Q R S T U V W X Y Z\n" * 2 + "A B C D", " E F G H"),
    MtpPrompt("weekdays", "Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday, Monday, Tuesday,",
              " Wednesday, Thursday"),
    MtpPrompt("times-table", "The seven times table:\n7 x 1 = 7\n7 x 2 = 14\n7 x 3 = 21\n", "7 x 4 = 28"),
    MtpPrompt("copy-lighthouse", f"Passage:\n{_PASSAGE_A}\n\nThe same passage, copied exactly:\n{_PASSAGE_A[:40]}",
              _PASSAGE_A[40:70]),
    MtpPrompt("copy-bread", f"Recipe:\n{_PASSAGE_B}\n\nThe same recipe, copied exactly:\n{_PASSAGE_B[:36]}",
              _PASSAGE_B[36:66]),
    MtpPrompt("squares", "squares = [1, 4, 9, 16, 25, 36,", " 49, 64, 81"),
    MtpPrompt("months", "January, February, March, April, May, June, July,", " August, September"),
)


def bos_text(model: Path) -> str:
    """The model's BOS token as text (``tokenizer_config.json``), prefixed to every prompt as DeepSeek's format does."""
    try:
        config = json.loads((model / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return ""
    bos = config.get("bos_token")
    return (bos.get("content") if isinstance(bos, dict) else bos) or ""


def request(prompt: MtpPrompt, bos: str = "", max_new_tokens: int = MAX_NEW_TOKENS) -> dict[str, Any]:
    return {"text": bos + prompt.text, "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens}}


def _count(meta: dict[str, Any], key: str) -> int | None:
    value = meta.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


@dataclass(frozen=True)
class MtpSample:
    prompt: str
    output: str
    completion_tokens: int
    verify_steps: int | None  # None: SGLang reported no speculative decoding for this request
    correct_drafts: int | None
    proposed_drafts: int | None
    as_expected: bool
    histogram: tuple[int, ...] = ()   # verify steps per accepted-draft count (SGLang's, when it reports one)

    @property
    def accept_length(self) -> float | None:
        return self.completion_tokens / self.verify_steps if self.verify_steps else None

    def to_json(self) -> dict[str, Any]:
        return {"prompt": self.prompt, "output": self.output, "completion_tokens": self.completion_tokens,
                "spec_verify_ct": self.verify_steps, "spec_num_correct_drafts": self.correct_drafts,
                "spec_num_proposed_drafts": self.proposed_drafts, "accept_length": self.accept_length,
                "spec_correct_drafts_histogram": list(self.histogram), "continuation_as_expected": self.as_expected}


def parse_response(prompt: MtpPrompt, response: dict[str, Any]) -> MtpSample:
    text, meta = response.get("text"), response.get("meta_info")
    if not isinstance(text, str) or not isinstance(meta, dict):
        raise FormatError(f"/generate answered {prompt.name!r} without text and meta_info: {sorted(response)}")
    completion = _count(meta, "completion_tokens")
    if completion is None:
        raise FormatError(f"/generate's meta_info for {prompt.name!r} has no completion_tokens: {sorted(meta)}")
    return MtpSample(prompt.name, text, completion, _count(meta, "spec_verify_ct") or None,
                     _count(meta, "spec_num_correct_drafts"), _count(meta, "spec_num_proposed_drafts"),
                     text.strip().startswith(prompt.expected_start.strip()), _histogram(prompt, meta))


def _histogram(prompt: MtpPrompt, meta: dict[str, Any]) -> tuple[int, ...]:
    value = meta.get("spec_correct_drafts_histogram")
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                                              for v in value):
        raise FormatError(f"/generate's spec_correct_drafts_histogram for {prompt.name!r} is not a list of counts: "
                          f"{str(value)[:80]}")
    return tuple(value)


def position_acceptance(histogram: Sequence[int]) -> list[dict[str, float]]:
    """Per draft position ``j`` (1 = the first drafted token): the share of verify steps that accepted it
    (``reached``), and the share of those that reached ``j - 1`` that also accepted ``j`` (``conditional``)."""
    steps = sum(histogram)
    rows, before = [], steps
    for j in range(1, len(histogram)):
        reached = sum(histogram[j:])
        rows.append({"position": j, "reached": reached / steps if steps else 0.0,
                     "conditional": reached / before if before else 0.0})
        before = reached
    return rows


def _merged(histograms: Sequence[Sequence[int]]) -> list[int]:
    merged = [0] * max((len(h) for h in histograms), default=0)
    for histogram in histograms:
        for k, count in enumerate(histogram):
            merged[k] += count
    return merged


def summarize(samples: Sequence[MtpSample], server_accept_lengths: Sequence[float] = ()) -> dict[str, Any]:
    drafted = [s for s in samples if s.verify_steps]
    tokens = sum(s.completion_tokens for s in drafted)
    steps = sum(s.verify_steps for s in drafted)
    counted = [s for s in drafted if s.correct_drafts is not None and s.proposed_drafts]
    histogram = _merged([s.histogram for s in drafted])
    return {
        "accept_length": tokens / steps if steps else None,
        "accept_rate": (sum(s.correct_drafts for s in counted) / sum(s.proposed_drafts for s in counted)
                        if counted else None),
        "correct_drafts": sum(s.correct_drafts for s in counted),
        "proposed_drafts": sum(s.proposed_drafts for s in counted),
        "prompts": len(samples),
        "prompts_with_spec_stats": len(drafted),
        "continuations_as_expected": sum(s.as_expected for s in samples),
        "server_avg_spec_accept_length": list(server_accept_lengths),
        "per_prompt": {s.prompt: s.accept_length for s in samples},
        "correct_drafts_histogram": histogram,
        "per_position": position_acceptance(histogram),
    }


def server_accept_lengths(server_info: dict[str, Any]) -> list[float]:
    """``avg_spec_accept_length`` of every scheduler (one per DP rank) in ``/server_info``."""
    states = server_info.get("internal_states")
    if not isinstance(states, list):
        return []
    return [float(s["avg_spec_accept_length"]) for s in states
            if isinstance(s, dict) and isinstance(s.get("avg_spec_accept_length"), (int, float))]


def failures(summary: dict[str, Any], min_accept: float) -> list[str]:
    """Why the draft fails the check (empty: it passes)."""
    if summary["accept_length"] is None:
        return [("SGLang reported no speculative decoding for any prompt (meta_info has no spec_verify_ct): the "
                 "server is not running the draft; was it started with --speculative-algorithm (EAGLE for the "
                 "preview's MTP block, DSPARK for a DSpark drafter)?")]
    if summary["accept_length"] < min_accept:
        rate = summary["accept_rate"]
        said = (f"{summary['correct_drafts']} of {summary['proposed_drafts']} draft tokens accepted ({rate:.0%})"
                if rate is not None else "draft acceptance not reported")
        broken = (" -- the draft is broken (is mtp.* loaded? see the 'Some weights are not initialized' "
                  "warnings above)") if summary["correct_drafts"] == 0 else ""
        return [f"mean accepted length {summary['accept_length']:.2f} < --min-accept {min_accept:.2f}: {said}{broken}"]
    return []


def run_prompts(generate: Callable[[dict[str, Any]], dict[str, Any]], bos: str = "",
                echo: Callable[[str], None] = print, prompts: Sequence[MtpPrompt] = PROMPTS) -> list[MtpSample]:
    samples = []
    for prompt in prompts:
        sample = parse_response(prompt, generate(request(prompt, bos)))
        length = "n/a " if sample.accept_length is None else f"{sample.accept_length:4.2f}"
        drafts = (f"{sample.correct_drafts}/{sample.proposed_drafts} drafts accepted"
                  if sample.proposed_drafts else "no draft statistics")
        echo(f"mtp {prompt.name:16} accepted length {length} ({drafts}); "
             f"continuation {'as expected' if sample.as_expected else 'NOT as expected'}")
        samples.append(sample)
    return samples


def compare_lines(base: dict[str, Any], other: dict[str, Any]) -> list[str]:
    """Rows ``label, base, other`` for the side-by-side table (values may be None)."""
    rows = [("accepted length (all prompts)", base["accept_length"], other["accept_length"]),
            ("draft acceptance rate", base["accept_rate"], other["accept_rate"])]
    base_positions = {row["position"]: row["reached"] for row in base.get("per_position", [])}
    for row in other.get("per_position", []):
        rows.append((f"draft position {row['position']} accepted", base_positions.get(row["position"]),
                     row["reached"]))
    for name, value in other["per_prompt"].items():
        if name in base["per_prompt"]:
            rows.append((f"accepted length {name}", base["per_prompt"][name], value))
    lines = []
    for label, old, new in rows:
        delta = "n/a" if old is None or new is None else f"{new - old:+.3f}"
        lines.append(f"{label:34} {_fmt(old):>10} {_fmt(new):>10} {delta:>10}")
    return lines


def default_compare_report(model: Path) -> Path:
    """Where ``compare`` writes its report for the variant ``model`` when not told otherwise."""
    return model.parent / f"{model.name}-compare" / "compare.json"


def read_expected(path: Path) -> dict[str, Any]:
    """The DSpark figures ``compare`` expects of a variant: its ``compare.json`` (or the directory holding it)."""
    path = path / "compare.json" if path.is_dir() else path
    try:
        report = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise FormatError(f"cannot read the compare report: {exc}", file=path) from None
    draft = report.get("dspark") if isinstance(report, dict) else None
    if not isinstance(draft, dict) or "expected_accept_length" not in draft or "positions" not in draft:
        raise FormatError("has no DSpark section (dspark.expected_accept_length): compare it with a DSpark drafter "
                          "and without --no-mtp", file=path)
    return {"report": str(path), "variant": (report.get("variant") or {}).get("path"),
            "text": (report.get("data") or {}).get("source"),
            "accept_length": draft["expected_accept_length"]["variant"],
            "per_position": [p["accepted"]["variant"] for p in draft["positions"]]}


def against_expected(summary: dict[str, Any], expected: dict[str, Any]) -> tuple[list[str], dict[str, Any]]:
    """The server's measured acceptance against ``compare``'s expected figures for this variant: which is lower,
    by how much (accepted length per verify step, then each draft position's acceptance)."""
    measured = summary["accept_length"]
    rows = [("accepted length", measured, expected["accept_length"])]
    # SGLang's histogram ends at the most drafts a step accepted (Req.update_spec_correct_drafts_histogram): the
    # positions past it were never accepted.
    reached = {row["position"]: row["reached"] for row in summary.get("per_position", [])}
    never = 0.0 if summary.get("correct_drafts_histogram") else None
    rows += [(f"draft position {j} accepted", reached.get(j, never), value)
             for j, value in enumerate(expected["per_position"], start=1)]
    lines, record = [], []
    for label, server, offline in rows:
        if server is None or offline is None:
            lines.append(f"mtp: {label}: server {_fmt(server)}, compare expects {_fmt(offline)}")
            record.append({"what": label, "server": server, "expected": offline, "lower": None, "by": None})
            continue
        lower = "equal" if server == offline else ("server" if server < offline else "compare")
        by = abs(server - offline)
        relative = f" ({by / max(server, offline):.0%} of the higher)" if max(server, offline) > 0 else ""
        said = ("the same" if lower == "equal" else
                f"the server is lower by {by:.3f}{relative}" if lower == "server" else
                f"compare's expectation is lower by {by:.3f}{relative}")
        lines.append(f"mtp: {label}: server {server:.3f}, compare expects {offline:.3f}: {said}")
        record.append({"what": label, "server": server, "expected": offline, "lower": lower, "by": by})
    return lines, {**expected, "rows": record}


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"
