"""Needle-in-a-haystack prompts: the one builder ``serve --check recall`` and ``compare --recall`` share.

Prompts are token-id lists built with the model's own tokenizer to an exact length, the needle at a
stated depth; the grid's lengths follow from the checkpoint's sparse attention. A CSA layer compresses
``ratio`` tokens into an entry and the query at position ``t`` (0-based) chooses the top ``index_topk``
of its ``(t + 1) // ratio`` entries (those overlapping the sliding window included). So top-k holds
every entry of every query of a prompt up to ``ratio * index_topk + ratio - 1`` tokens (2,051 for
V4-Flash), and the first prompt whose answer query leaves an entry out has ``ratio * index_topk +
ratio`` tokens (2,052): :func:`selection_threshold`. Past it, recall depends on what the indexer picks.
The default grid straddles that threshold and covers every prompt length modulo 4 (engine bugs have
depended on ``len % 4``).
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

DEFAULT_DEPTHS = (0.1, 0.5, 0.9)
CSA_RATIO = 4  # compress ratio of the layers that have an indexer

# Haystack text written for this tool: plain, repetitive prose with no numbers in it, so the
# only number in a prompt is the needle's.
FILLER = (
    "The river moved slowly past the old mill, and the afternoon light lay across the water. "
    "A farmer walked along the bank with a basket of apples and stopped to watch the ducks. "
    "Clouds gathered over the hills in the west, grey at the edges and white in the middle. "
    "In the village the baker was closing his shop, and children ran home along the lane. "
    "Somewhere a dog barked twice, then the evening settled into its usual quiet rhythm. "
)
NEEDLE_KEYS = (
    "the blue lighthouse", "the copper kettle", "the silent orchard", "the northern gate",
    "the paper lantern", "the marble staircase", "the hidden garden", "the iron bridge",
    "the velvet curtain", "the glass observatory", "the winter harbour", "the amber window",
)


class Tokenizer(Protocol):
    """What a needle prompt needs from a tokenizer (a ``transformers`` tokenizer satisfies it)."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


@dataclass(frozen=True)
class PromptTemplate:
    """Text around the user turn; the default is DeepSeek's chat format with thinking off."""

    prefix: str = "<｜begin▁of▁sentence｜><｜User｜>"
    suffix: str = "<｜Assistant｜></think>"


@dataclass(frozen=True)
class Needle:
    key: str
    value: str

    @property
    def sentence(self) -> str:
        return f" The secret number for {self.key} is {self.value}. "

    @property
    def question(self) -> str:
        return f"\n\nWhat is the secret number for {self.key}? Reply with the number only."


@dataclass(frozen=True)
class RecallPrompt:
    input_ids: list[int]
    needle: Needle
    needle_span: tuple[int, int]  # token positions [start, end) of the needle sentence
    length: int
    depth: float


def make_needle(rng: random.Random) -> Needle:
    return Needle(rng.choice(NEEDLE_KEYS), str(rng.randrange(1_000_000, 10_000_000)))


def _encode(tokenizer: Tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def build_prompt(
    tokenizer: Tokenizer, length: int, depth: float, needle: Needle, template: PromptTemplate = PromptTemplate()
) -> RecallPrompt:
    """A prompt of exactly ``length`` tokens with the needle ``depth`` (0..1) of the way into the haystack."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"needle depth must be within [0, 1], got {depth}")
    prefix, needle_ids = _encode(tokenizer, template.prefix), _encode(tokenizer, needle.sentence)
    closing = _encode(tokenizer, needle.question) + _encode(tokenizer, template.suffix)
    budget = length - len(prefix) - len(needle_ids) - len(closing)
    if budget < 0:
        raise ValueError(f"{length} tokens cannot hold the template, needle and question ({length - budget} tokens)")
    filler = _encode(tokenizer, FILLER)
    haystack = (filler * (budget // len(filler) + 1))[:budget]
    offset = round(depth * budget)
    start = len(prefix) + offset
    ids = prefix + haystack[:offset] + needle_ids + haystack[offset:] + closing
    return RecallPrompt(ids, needle, (start, start + len(needle_ids)), length, depth)


def shortest_prompt(tokenizer: Tokenizer, template: PromptTemplate = PromptTemplate()) -> int:
    """The fewest tokens any needle prompt takes (template, the longest needle sentence and question)."""
    fixed = len(_encode(tokenizer, template.prefix)) + len(_encode(tokenizer, template.suffix))
    return fixed + max(len(_encode(tokenizer, n.sentence)) + len(_encode(tokenizer, n.question))
                       for n in (Needle(key, "9" * 7) for key in NEEDLE_KEYS))


def recall_grid(tokenizer: Tokenizer, lengths: Sequence[int], depths: Sequence[float], trials: int, seed: int,
                template: PromptTemplate = PromptTemplate()) -> list[RecallPrompt]:
    """Every prompt of a sweep, in order: lengths, then depths, then trials, one seeded needle each."""
    rng = random.Random(seed)
    return [build_prompt(tokenizer, length, depth, make_needle(rng), template)
            for length in lengths for depth in depths for _ in range(trials)]


def answer_ids(tokenizer: Tokenizer, needle: Needle) -> list[int]:
    """The tokens a correct greedy answer starts with: the number itself."""
    return _encode(tokenizer, needle.value)


def answer_is_correct(output: str, needle: Needle) -> bool:
    """Exact retrieval: the first number in the answer is the needle's value."""
    match = re.search(r"\d+", output.replace(",", ""))
    return match is not None and match.group(0) == needle.value


def selection_threshold(index_topk: int, ratio: int = CSA_RATIO) -> int:
    """The first prompt length at which the indexer's top-k leaves a compressed entry out: ``ratio * index_topk
    + ratio`` (2,052 for V4-Flash's 512; 132 for 32, 260 for 64).

    The answer's first token is predicted by the query at position ``L - 1`` of an ``L``-token prompt, and
    the query at position ``t`` chooses among all ``(t + 1) // ratio`` compressed entries, so that query
    keeps every entry while ``L // ratio <= index_topk``, i.e. up to ``L = ratio * index_topk + ratio - 1``;
    within a prompt, the row at position ``t`` is sparse iff ``t >= threshold - 1``. Both engines agree:

    * transformers 5.19.0, ``models/deepseek_v4/modeling_deepseek_v4.py::DeepseekV4Indexer.forward``:
      ``causal_threshold = (position_ids + 1) // self.compress_rate`` masks the later entries, then
      ``index_scores.topk(min(self.index_topk, compressed_len))``;
    * SGLang 0.5.23: the ratio-4 indexer's lengths are ``c4_seq_lens_raw = seq_len // 4`` of the causal
      length ``seq_lens_casual`` (``t + 1``; ``kernels/ops/attention/dsv4/metadata_kernel.py::
      _init_compressed_attn_metadata_kernel``, read by ``srt/layers/attention/deepseek_v4_backend.py::
      init_forward_metadata_indexer``; ratios 1 and 2 the same in ``_low_ratio_compression_metadata``:
      ``seq_lens_casual // compress_ratio``), and ``srt/layers/attention/dsv4/indexer.py::
      _topk_transform_vectorized`` takes every entry in order when ``needs_sequential = seq_lens <= TOPK``.

    The sliding window plays no part: entries overlapping it are candidates like any other.
    """
    return ratio * index_topk + ratio


def default_lengths(threshold: int, shortest: int = 1, longest: int | None = None, answer_tokens: int = 1) -> list[int]:
    """The default needle grid around ``threshold`` (:func:`selection_threshold`), ascending:

    * ``threshold - answer_tokens`` (the longest prompt whose every answer query, teacher-forced, keeps every
      entry: the last one sits ``answer_tokens - 1`` positions further) and ``threshold`` (the first whose
      first answer query leaves one out), exactly;
    * ``threshold + threshold // 16`` (at least ``threshold + 4``), a little further past, and the powers of
      two from about half the threshold up to ``longest`` (default 64 x the threshold: 1K .. 128K for
      V4-Flash; a small model can ask for ``8 * threshold``), each lowered by its index mod 4 among them,
      so that with the two exact lengths (residues 3 and 0) every residue mod 4 is there (engine bugs
      have depended on ``len % 4``).

    Lengths under ``shortest`` (what a prompt needs at least) are dropped. V4-Flash (threshold 2052): 1024,
    2047, 2051, 2052, 2178, 4093, 8192, 16383, 32766, 65533, 131072.
    """
    if longest is None:
        longest = 64 * threshold
    top = 2 ** int(math.log2(max(longest, 1)))
    powers = {2**k for k in range(int(math.log2(max(threshold // 2, 1))), int(math.log2(top)) + 1)}
    others = sorted(b for b in powers | {threshold + max(threshold // 16, 4)} if b - 3 >= shortest and b <= longest)
    lowered = [b - i % 4 for i, b in enumerate(others)]
    exact = [n for n in (threshold - answer_tokens, threshold) if n >= shortest and n <= longest]
    return sorted(set(lowered) | set(exact))


def parse_lengths(text: str) -> list[int]:
    """``"2K,4099,128K"`` -> token counts (K = 1024)."""
    out = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        match = re.fullmatch(r"(\d+)([kK]?)", part)
        if not match:
            raise ValueError(f"length {part!r} is not a token count (like 4096 or 4K)")
        out.append(int(match.group(1)) * (1024 if match.group(2) else 1))
    if not out:
        raise ValueError("no lengths given")
    return out


def fully_covered(length: int, answer_tokens: int, threshold: int) -> bool:
    """Whether every query that writes a teacher-forced answer after an ``length``-token prompt keeps every
    compressed entry (the last one, at position ``length + answer_tokens - 2``, sees
    ``(length + answer_tokens - 1) // 4`` entries): below this, the indexer's choices cannot matter."""
    return length + answer_tokens <= threshold


def value_entries(input_ids: Sequence[int], span: tuple[int, int], answer: Sequence[int],
                  ratio: int = CSA_RATIO) -> list[tuple[int, ...]]:
    """For each answer token, the compressed entries holding it inside the needle sentence (entry ``w`` holds
    tokens ``ratio*(w-1) .. ratio*w + ratio - 1``, :func:`needle_entries`): the value is visible to a query when
    each of these groups has a selected entry. Where the answer's tokens do not appear as such in the needle
    (a tokenizer that merges the number with its neighbours), one group: every entry of the needle."""
    positions = value_positions(input_ids, span, answer)
    if positions is not None:
        return [(p // ratio, p // ratio + 1) for p in positions]
    return [tuple(needle_entries(span, ratio))]


def value_positions(input_ids: Sequence[int], span: tuple[int, int], answer: Sequence[int]) -> list[int] | None:
    """The prompt positions of the answer's tokens inside the needle sentence, or None where they do not appear
    as such (a tokenizer that merges the number with its neighbours)."""
    start, end = span
    sentence, answer = list(input_ids[start:end]), list(answer)
    for i in range(len(sentence) - len(answer) + 1):
        if answer and sentence[i:i + len(answer)] == answer:
            return list(range(start + i, start + i + len(answer)))
    return None


def value_rank(picks: Sequence[int], groups: Sequence[Sequence[int]]) -> int | None:
    """The rank in one query's top-k list (``picks``, -1 for an empty slot) by which every group of
    :func:`value_entries` has a selected entry, i.e. by which the whole value is visible; None when some
    answer token has no selected entry holding it."""
    rank = {int(entry): r for r, entry in enumerate(picks) if entry >= 0}
    worst = 0
    for group in groups:
        found = [rank[w] for w in group if w in rank]
        if not found:
            return None
        worst = max(worst, min(found))
    return worst


def needle_entries(span: tuple[int, int], ratio: int = CSA_RATIO) -> range:
    """Compressed entries of a CSA layer that hold part of the needle. In transformers' ``DeepseekV4``
    entry ``w`` pools window ``w`` (tokens ``ratio*w .. ratio*w + ratio - 1``, the Cb half) with the
    previous window (the Ca half), so it covers tokens ``ratio*(w-1) .. ratio*w + ratio - 1``."""
    start, end = span
    return range(start // ratio, (end - 1) // ratio + 2)
