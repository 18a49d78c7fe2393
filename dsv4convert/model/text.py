"""Token windows from the user's text: a local text or JSONL file, tokenized with the checkpoint's own tokenizer.

``calibrate`` and ``compare`` read their data this way. Nothing is downloaded: the tokenizer is
loaded from the checkpoint directory (``local_files_only``). Documents are tokenized one by one
(the tokenizer adds its BOS to each), concatenated, and cut into consecutive windows of
``seq_len`` tokens; the first ``num_sequences`` are the main set and the next ``holdout`` are kept
apart (calibration's held-out error report).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from dsv4convert.errors import DSV4Error

MAX_DATA_BYTES = 4 * 1024**3
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def read_documents(path: Path) -> list[str]:
    """``.jsonl``: one JSON object per line with a ``"text"`` string (or a bare string); else the whole file."""
    path = Path(path)
    try:
        if path.stat().st_size > MAX_DATA_BYTES:
            raise DSV4Error(f"text file is larger than {MAX_DATA_BYTES} bytes", file=path)
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DSV4Error("text file not found", file=path) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise DSV4Error(f"cannot read the text file ({exc})", file=path) from None
    if path.suffix != ".jsonl":
        docs = [text] if text.strip() else []
    else:
        docs = []
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DSV4Error(f"line {number} is not JSON ({exc.msg})", file=path) from None
            doc = record.get("text") if isinstance(record, dict) else record
            if not isinstance(doc, str):
                raise DSV4Error(f"line {number} has no \"text\" string", file=path)
            if doc.strip():
                docs.append(doc)
    if not docs:
        raise DSV4Error("the file holds no text", file=path)
    return docs


def load_tokenizer(checkpoint_dir: Path):
    """The checkpoint's own tokenizer, from its directory only (nothing is downloaded)."""
    from transformers import AutoTokenizer

    if not any((Path(checkpoint_dir) / name).is_file() for name in TOKENIZER_FILES):
        raise DSV4Error(f"no tokenizer in the checkpoint (none of {', '.join(TOKENIZER_FILES)}); copy the "
                        "base model's tokenizer files beside its weights", file=checkpoint_dir)
    # DeepSeek-V4.1's config.json names a model_type no transformers release knows (deepseek_v41); the tokenizer
    # does not depend on it, so transformers' "model of type ... to instantiate a model of type ``" warning is noise.
    config_log = logging.getLogger("transformers.configuration_utils")
    level = config_log.level
    config_log.setLevel(logging.ERROR)
    try:
        return AutoTokenizer.from_pretrained(checkpoint_dir, local_files_only=True)
    except (OSError, ValueError) as exc:
        detail = " ".join(str(exc).split())   # transformers' messages span lines; errors here are one line
        raise DSV4Error(f"cannot load the checkpoint's tokenizer ({detail})", file=checkpoint_dir) from None
    finally:
        config_log.setLevel(level)


def tokenize(checkpoint_dir: Path, docs: list[str]) -> torch.Tensor:
    """All documents' token ids, concatenated (int64 [T])."""
    tokenizer = load_tokenizer(checkpoint_dir)
    ids = [torch.tensor(tokenizer(doc)["input_ids"], dtype=torch.int64) for doc in docs]
    return torch.cat(ids)


def token_windows(checkpoint_dir: Path, data: Path, *, num_sequences: int, seq_len: int,
                  holdout: int = 0, vocab_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(main ids [num_sequences, seq_len], held-out ids [holdout, seq_len])."""
    if num_sequences < 1 or seq_len < 2 or holdout < 0:
        raise DSV4Error(f"need --num-sequences >= 1 and --seq-len >= 2, got {num_sequences} and {seq_len}")
    ids = tokenize(checkpoint_dir, read_documents(data))
    if vocab_size is not None and ids.numel() and int(ids.max()) >= vocab_size:
        raise DSV4Error(f"the tokenizer produced id {int(ids.max())} but the model has {vocab_size} tokens",
                        file=checkpoint_dir)
    need = (num_sequences + holdout) * seq_len
    if ids.numel() < need:
        raise DSV4Error(f"{ids.numel()} tokens, but {num_sequences} + {holdout} held-out sequences of "
                        f"{seq_len} need {need}: give more text or fewer/shorter sequences", file=data)
    windows = ids[:need].view(num_sequences + holdout, seq_len)
    return windows[:num_sequences].clone(), windows[num_sequences:].clone()
