"""DeepSeek-V4's names of its drafter: the draft blocks (``mtp.*``: the preview's MTP blocks, a DSpark drafter's
stages) and a DSpark drafter's own modules. The one place they are written outside ``engines/``
(tests/test_architecture.py); light, with no torch, since the variants' catalogue that every command line
loads asks it."""

from __future__ import annotations

from dataclasses import dataclass

# Every block of the drafter (the preview's MTP blocks, a DSpark drafter's stages) is named under this prefix.
DRAFT_PREFIX = "mtp."


def draft_block(index: int) -> str:
    """The name of draft block ``index``: the preview's MTP block or a DSpark drafter's stage."""
    return f"{DRAFT_PREFIX}{index}"


def in_draft(name: str) -> bool:
    """Whether a block, module or tensor name lies in the drafter (``mtp.*``)."""
    return name.startswith(DRAFT_PREFIX)


@dataclass(frozen=True)
class DSparkNames:
    """The release names of a DSpark drafter's own modules, beyond its stages' decoder blocks (the one place they
    are written): stage 0's projection of the target's hidden states, the last stage's norm, hyper-connection
    head, Markov head (SGLang's ``markov_w1``/``markov_w2``, vLLM's alias names) and confidence head."""

    stages: int

    entry_proj = "mtp.0.main_proj"
    entry_norm = "mtp.0.main_norm"
    ENTRY_LOCAL = ("main_proj", "main_norm")          # the modules' names within stage 0
    # Every name of a DSpark module within its stage, the Markov head's vLLM aliases included: no code outside
    # models/ and engines/ writes one (tests/test_architecture.py).
    LOCAL = (*ENTRY_LOCAL, "markov_head", "markov_w1", "markov_w2", "confidence_head")

    @staticmethod
    def stage(index: int) -> str:
        return draft_block(index)

    @property
    def last(self) -> str:
        return draft_block(self.stages - 1)

    @property
    def norm(self) -> str:
        return f"{self.last}.norm"

    @property
    def markov_embed(self) -> str:
        return f"{self.last}.markov_head.embed"

    @property
    def markov_head(self) -> str:
        return f"{self.last}.markov_head.head"

    @property
    def markov_head_alias(self) -> str:
        """vLLM's name for :attr:`markov_head` (``markov_w2``), which a checkpoint may store instead."""
        return f"{self.last}.markov_head.markov_w2"

    @property
    def confidence(self) -> str:
        return f"{self.last}.confidence_head.proj"
