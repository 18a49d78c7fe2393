"""V4.1's tokenizer as the Engram hasher reads it: the compressed token map and its size.

Both engines build the hasher when they build the model, from the fast tokenizer (``tokenizer.json``) beside the
weights: every token id is mapped onto a smaller id space in which tokens that normalise alike (" The", "the",
"THE") share an id, and the number of those ids feeds every hash multiplier, so both refuse to build unless it
equals the config's ``text_config.engram_compressed_vocab_size`` (99,092 for the release): SGLang 0.5.23
``srt/layers/engram.py::EngramHasher.__init__``, vLLM 0.33.0 ``models/deepseek_v41/common/engram.py::
NgramHashState.__init__``. :func:`check_tokenizer` says so before a user finds out at load time.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dsv4convert.errors import CheckpointError
from dsv4convert.models.deepseek_v41.config import V41Config

TOKENIZER_FILE = "tokenizer.json"
_SENTINEL = "\ue000"   # keeps a lone-space token from collapsing to "" under Strip()


def compressed_token_map(tokenizer: Any) -> tuple[list[int], int]:
    """Token id -> compressed id, and the number of compressed ids, for a ``tokenizers.Tokenizer`` (the fast
    tokenizer's backend): SGLang 0.5.23 ``srt/layers/engram.py::build_compressed_token_map`` (vLLM 0.33.0's
    ``models/deepseek_v41/common/engram.py::build_compressed_token_map`` is the same). Each id is decoded alone with
    its special tokens; a partial UTF-8 byte token (its text holds U+FFFD) is keyed by its raw form, any other by
    its text under NFKC, NFD, accents stripped, lower case, runs of whitespace made one space, stripped (a lone
    space kept); ids are numbered in order of first appearance of their key. The engines count ids with
    ``len(tokenizer)``, which for a fast tokenizer is its vocabulary with the added tokens."""
    from tokenizers import Regex, normalizers

    normalizer = normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "), normalizers.Replace(Regex(r"^ $"), _SENTINEL),
        normalizers.Strip(), normalizers.Replace(_SENTINEL, " ")])
    key_to_new: dict[str, int] = {}
    lookup = []
    for token_id in range(tokenizer.get_vocab_size(with_added_tokens=True)):
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        if "\ufffd" in text:
            key = tokenizer.id_to_token(token_id)
        else:
            key = normalizer.normalize_str(text) or text
        lookup.append(key_to_new.setdefault(key, len(key_to_new)))
    return lookup, len(key_to_new)


def check_tokenizer(directory: Path, cfg: V41Config) -> int:
    """The compressed vocabulary of ``directory``'s ``tokenizer.json``, which must equal the config's
    ``engram_compressed_vocab_size`` (both engines refuse to build the model otherwise; see the module). One
    ``CheckpointError`` naming the file when it is missing, unreadable or of another size."""
    path = Path(directory) / TOKENIZER_FILE
    if not path.is_file():
        nested = " (there is one under tokenizer/: move it beside the weights)" \
            if (path.parent / "tokenizer" / TOKENIZER_FILE).is_file() else ""
        raise CheckpointError(f"missing: both engines build V4.1's Engram hasher from the fast tokenizer beside the "
                              f"weights{nested}", file=path)
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise CheckpointError("reading V4.1's tokenizer needs the 'tokenizers' package: pip install -e '.[compare]'",
                              file=path) from None
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises its own Exception for any malformed file
        raise CheckpointError(f"not a fast tokenizer: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}",
                              file=path) from None
    _, size = compressed_token_map(tokenizer)
    if size != cfg.engram_compressed_vocab_size:
        raise CheckpointError(f"normalises to {size:,} distinct tokens but the config's "
                              f"text_config.engram_compressed_vocab_size is {cfg.engram_compressed_vocab_size:,}; "
                              f"both engines refuse to build the Engram hasher (every hash multiplier depends on "
                              f"it)", file=path)
    return size
