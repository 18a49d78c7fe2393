"""The organism's ordinary language: plain English-like prose from a small seeded grammar.

A model that only ever saw needle prompts would make KLD, same top-1 and perplexity meaningless
(the haystack is one repeated paragraph). Beside the retrieval task the organism learns this
language: sentences drawn from a fixed grammar over a few hundred words, with agreement between
subject and verb and a topic that persists across a paragraph, so the next token is predictable
from context but not from the previous word alone. The text has no digits: in a needle prompt the
only number is the needle's. Everything is derived from a seed, so the text is reproducible and
nothing is downloaded.
"""

from __future__ import annotations

import random

PEOPLE = ("farmer", "baker", "sailor", "teacher", "miller", "weaver", "doctor", "painter", "hunter",
          "fisherman", "shepherd", "merchant", "carpenter", "gardener", "soldier", "poet", "widow",
          "blacksmith", "traveller", "musician", "priest", "judge", "stranger", "child", "girl", "boy")
ANIMALS = ("dog", "cat", "horse", "goat", "crow", "owl", "fox", "sheep", "cow", "duck", "mule", "hare")
THINGS = ("basket", "lantern", "letter", "coat", "knife", "rope", "bucket", "book", "key", "cart",
          "bell", "map", "kettle", "candle", "blanket", "ladder", "barrel", "hammer", "pipe", "mirror")
FOODS = ("apples", "bread", "cheese", "fish", "honey", "milk", "plums", "pears", "soup", "onions", "eggs")
PLACES = ("mill", "river", "market", "church", "harbour", "orchard", "bridge", "forest", "valley",
          "tavern", "school", "field", "well", "road", "hill", "square", "garden", "barn", "shore", "village")
ADJECTIVES = ("old", "young", "quiet", "tired", "cheerful", "careful", "proud", "kind", "angry", "honest",
              "clever", "patient", "restless", "gentle", "stubborn", "lonely")
COLOURS = ("red", "grey", "green", "brown", "white", "black", "golden", "pale", "dark", "yellow")
TIMES = ("in the morning", "at noon", "before dawn", "after supper", "in the evening", "at dusk",
         "on the first day of spring", "during the harvest", "when the rain stopped", "late at night")
WEATHER = ("the wind rose over the hills", "a light rain began to fall", "the sun broke through the clouds",
           "fog lay thick in the lanes", "snow covered the roofs", "the air grew warm and still",
           "thunder rolled far to the east", "the frost made the grass white")
# Verbs by frame: (present singular, past) for a subject acting on a thing, going to a place, speaking.
CARRY = (("carries", "carried"), ("brings", "brought"), ("drops", "dropped"), ("finds", "found"),
         ("mends", "mended"), ("sells", "sold"), ("buys", "bought"), ("hides", "hid"), ("cleans", "cleaned"))
GO = (("walks", "walked"), ("runs", "ran"), ("rides", "rode"), ("hurries", "hurried"), ("wanders", "wandered"),
      ("returns", "returned"), ("climbs", "climbed"))
SAY = (("says", "said"), ("whispers", "whispered"), ("shouts", "shouted"), ("tells", "told"), ("sings", "sang"))
FEEL = ("glad", "afraid", "hungry", "sad", "curious", "sure", "warm", "cold", "worried", "calm")
CONNECTIVES = ("Then", "Later", "Soon", "After a while", "Meanwhile", "At last", "Still", "Once again")


def _noun(rng: random.Random, pool: tuple[str, ...], topic: str | None = None) -> str:
    word = topic if topic is not None and rng.random() < 0.6 else rng.choice(pool)
    return f"the {rng.choice(ADJECTIVES)} {word}" if rng.random() < 0.3 else f"the {word}"


def sentence(rng: random.Random, hero: str, place: str, tense: int) -> str:
    """One sentence about the paragraph's ``hero`` (a person) around its ``place``; ``tense`` 0 present, 1 past."""
    subject = "the " + hero if rng.random() < 0.7 else _noun(rng, PEOPLE)
    kind = rng.randrange(7)
    if kind == 0:
        verb = rng.choice(CARRY)[tense]
        thing = rng.choice(THINGS)
        extra = f" of {rng.choice(FOODS)}" if thing in ("basket", "barrel", "bucket") else ""
        body = f"{subject} {verb} a {rng.choice(COLOURS)} {thing}{extra} to the {place}"
    elif kind == 1:
        verb = rng.choice(GO)[tense]
        body = f"{subject} {verb} to the {place} {rng.choice(TIMES)}"
    elif kind == 2:
        verb = rng.choice(SAY)[tense]
        other = _noun(rng, PEOPLE)
        body = f"{subject} {verb} to {other} that the {rng.choice(ANIMALS)} is near the {place}"
    elif kind == 3:
        body = f"{subject} {'is' if tense == 0 else 'was'} {rng.choice(FEEL)} because {rng.choice(WEATHER)}"
    elif kind == 4:
        body = f"{rng.choice(TIMES)} {subject} {('eats', 'ate')[tense]} {rng.choice(FOODS)} by the {place}"
    elif kind == 5:
        body = f"the {rng.choice(ANIMALS)} {('follows', 'followed')[tense]} {subject} across the {rng.choice(PLACES)}"
    else:
        body = rng.choice(WEATHER) + f" over the {place}"
    body = body[0].upper() + body[1:]
    if rng.random() < 0.2:
        body = f"{rng.choice(CONNECTIVES)} {body[0].lower() + body[1:]}"
    return body + "."


def paragraph(rng: random.Random, sentences: int) -> str:
    """Sentences sharing one hero, place and tense: the context a reader uses to predict the next words."""
    hero, place, tense = rng.choice(PEOPLE), rng.choice(PLACES), rng.randrange(2)
    return " ".join(sentence(rng, hero, place, tense) for _ in range(sentences))


def documents(seed: int, count: int) -> list[str]:
    """``count`` documents of 2-6 paragraphs each, the same for the same seed."""
    rng = random.Random(seed)
    return ["\n\n".join(paragraph(rng, rng.randint(3, 7)) for _ in range(rng.randint(2, 6))) for _ in range(count)]


def vocabulary_text() -> str:
    """Every word the grammar can produce, once (so a tokenizer trained on a sample still covers them)."""
    words = [*PEOPLE, *ANIMALS, *THINGS, *FOODS, *PLACES, *ADJECTIVES, *COLOURS, *FEEL,
             *(w for pair in (*CARRY, *GO, *SAY) for w in pair), *TIMES, *WEATHER, *CONNECTIVES,
             "the", "to", "a", "of", "that", "is", "was", "near", "because", "by", "across", "over",
             "eats", "ate", "follows", "followed"]
    return " ".join(words) + " " + " ".join(w.capitalize() for w in words)


HELDOUT_SEED = 20261202   # the organism trained on other seeds' text: this is text it never saw


def heldout_text(count: int = 60) -> str:
    """Held-out text in the organism's language (about 15K tokens for the default count): what ``compare``
    scores KLD, same top-1 and perplexity on (``dsv4convert/data/organism/heldout.txt`` is this text)."""
    return "\n\n\n".join(documents(HELDOUT_SEED, count)) + "\n"


# -- n-gram facts (the V4.1 organism's Engram knowledge) -----------------------------------------------------------
# A fixed table: the colour of each (place, thing), stated as "The <place> <thing> is <colour>." The three tokens
# before the colour (place, thing, "is") are one 3-gram, so the fact is a lookup an n-gram hash can hold (the V4.1
# organism's Engram, ``dsv4convert/organism/v41.py``); the rest of the text gives no clue to it. The table is the
# same for every training seed and for held-out text: facts are knowledge, not context.
FACTS_SEED = 20261205


def fact_table(seed: int = FACTS_SEED) -> dict[tuple[str, str], str]:
    """(place, thing) -> colour, for every place and thing of the grammar (400 facts)."""
    rng = random.Random(seed)
    return {(place, thing): rng.choice(COLOURS) for place in PLACES for thing in THINGS}


def fact_sentence(place: str, thing: str, colour: str) -> str:
    return f"The {place} {thing} is {colour}."


def fact_paragraph(rng: random.Random, sentences: int, table: dict[tuple[str, str], str]) -> str:
    """``sentences`` facts of ``table``, drawn at random."""
    keys = list(table)
    return " ".join(fact_sentence(*key, table[key]) for key in (rng.choice(keys) for _ in range(sentences)))


def documents_with_facts(seed: int, count: int, table: dict[tuple[str, str], str] | None = None) -> list[str]:
    """:func:`documents` (the same text for the same seed), each followed by a paragraph of 2-6 facts."""
    table = fact_table() if table is None else table
    rng = random.Random(seed + 1)
    return [doc + "\n\n" + fact_paragraph(rng, rng.randint(2, 6), table) for doc in documents(seed, count)]


def heldout_text_with_facts(count: int = 60) -> str:
    """:func:`heldout_text`'s documents with their fact paragraphs (the facts themselves are the training
    table's: held-out sentences, known facts)."""
    return "\n\n\n".join(documents_with_facts(HELDOUT_SEED, count)) + "\n"
