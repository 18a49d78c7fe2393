"""The organism's tokenizer: a byte-level BPE trained with the ``tokenizers`` library on the organism's
own text (its language, the needle builder's haystack, keys and questions), digits split one per token.

Digits one per token make every needle answer seven tokens long: ``compare --recall`` checks a
multi-token answer the way it does on the real model (teacher-forced, every answer token the
argmax). The chat-template markers the needle builder writes (``PromptTemplate``) are special tokens,
so a prompt is the same token sequence the real model's template gives, in miniature.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from dsv4convert.needle import FILLER, NEEDLE_KEYS, Needle, PromptTemplate
from dsv4convert.organism.language import documents, vocabulary_text

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
SPECIAL_TOKENS = (BOS, EOS, "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>")
TOKENIZER_CONFIG = {
    "add_bos_token": False,
    "add_eos_token": False,
    "bos_token": BOS,
    "eos_token": EOS,
    "pad_token": EOS,
    "clean_up_tokenization_spaces": False,
    "model_max_length": 1048576,
    "tokenizer_class": "PreTrainedTokenizerFast",
}


def training_text(seed: int) -> list[str]:
    """What the BPE merges are learned from: the language, the haystack, every needle key and question."""
    template = PromptTemplate()
    needles = [Needle(key, "1234567") for key in NEEDLE_KEYS]
    return [*documents(seed, 400), FILLER * 4, vocabulary_text(), "0 1 2 3 4 5 6 7 8 9",
            *(n.sentence + n.question for n in needles), template.prefix + template.suffix]


def build_tokenizer(vocab_size: int, seed: int = 0) -> Tokenizer:
    """A byte-level BPE of exactly ``vocab_size`` tokens (ids 0 and 1 are BOS and EOS, as in DeepSeek-V4)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(training_text(seed), trainer=trainer)
    if tokenizer.get_vocab_size() != vocab_size:
        # Too little text for the requested merges: pad with unused tokens so ids match the embedding.
        tokenizer.add_tokens([f"<｜unused{i}｜>" for i in range(vocab_size - tokenizer.get_vocab_size())])
    return tokenizer
