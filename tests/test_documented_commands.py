"""Every ``dsv4convert`` command the README and ``docs/*.md`` show parses with the tool's own parser (issue 45), so a
renamed flag, a dropped required input or a value the tool no longer takes fails here, naming the doc and line.

What is read, and how:

* **Examples** are command lines in code blocks (fenced, or indented four spaces): from the word ``dsv4convert``
  followed by a command (or an option: ``--version``) on, backslash continuations joined, a ``# comment`` and
  anything after a shell operator (``&&``, ``&``, ``|``, ``;``, ``>``) cut off, whatever leads up to it
  (``host A:``, ``torchrun ... -m``, ``pip install ... &&``) ignored. A comment line that is itself such a command
  (an alternative the doc offers, ``# dsv4convert automix ...``) is an example too. Optional groups ``[...]`` are
  included. An example is parsed whole, as written, by ``build_parser().parse_args``: every flag exists (spelled in
  full: the abbreviations argparse would accept are refused), every required input is given, every value is
  valid. An example that elides arguments with a lone ``...`` (``compare ... --dry-run``) is read as a fragment.
* **Fragments** are inline code spans, in prose and tables, that start with ``dsv4convert COMMAND`` or with
  ``COMMAND --flag`` (how the prose names a command by the flags it is about). Their synopsis notation is read:
  ``[...]`` optional groups and ``(...)`` groups included, a lone ``|`` between groups dropped, and a value
  written ``a|b`` (``a\\|b`` in a table) is each of its alternatives. A fragment is checked flag by flag: every flag
  exists, spelled in full, and every value written after one is a value it takes (parsed by the same parser: its
  type and its choices). Required inputs are not asked of a fragment, and placeholders stand for values rather
  than being ones: upper-case metavariables (``SRC``, ``DIR``, ``N``, ``SIZE``), ``MiB``, ``<...>``, and any word
  holding ``...``.
* The examples in each command's ``--help`` (its epilog) are examples too, a ``(remark)`` after one cut off.

Everything is parsed in this process (no command runs: ``parse_args`` only), in well under a second.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

from dsv4convert.cli import build_parser
from dsv4convert.errors import DSV4Error

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_OPERATORS = {"&&", "&", "||", "|", ";", ">", ">>", "2>", "2>&1", "<"}
PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*$|^MiB$|\.\.\.")
REMARK = re.compile(r"\s{2,}\(.*$")      # "dsv4convert fit ...   (every shipped variant)" in an epilog
SPAN = re.compile(r"`([^`]+)`")


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


PARSER = build_parser()
COMMANDS = _subparsers(PARSER)
RELAXED = build_parser()          # a fragment names some flags, not every required input
for _sub in _subparsers(RELAXED).values():
    for _action in _sub._actions:
        _action.required = False
for _sub in (*COMMANDS.values(), *_subparsers(RELAXED).values()):
    _sub.allow_abbrev = False     # argparse would take --dry for --dry-run; a doc spells a flag in full


@dataclass
class Documented:
    where: str          # README.md:199
    words: list[str]    # from the command on (without "dsv4convert")
    example: bool       # parsed whole; else a fragment, checked flag by flag


def _code_block_lines(lines: list[str]) -> dict[int, str]:
    """Every line of a code block by number: fenced (the fences too), or indented four spaces after a blank line."""
    found, fenced, indented, previous_blank = {}, False, False, True
    for number, line in enumerate(lines, 1):
        if line.lstrip().startswith("```"):
            fenced, indented = not fenced, False
            found[number] = ""
            continue
        indented = line.startswith("    ") and (indented or previous_blank) and not fenced
        previous_blank = not line.strip()
        if fenced or indented:
            found[number] = line.strip()
    return found


def _code_lines(block_lines: dict[int, str]) -> list[tuple[int, str]]:
    """(first line number, text) of each code line, backslash continuations joined."""
    out, pending = [], None
    for number, text in block_lines.items():
        start, text = (pending[0], f"{pending[1]} {text}") if pending else (number, text)
        pending = (start, text[:-1]) if text.endswith("\\") else None
        if pending is None:
            out.append((start, text))
    return out


def _command_words(text: str) -> list[str] | None:
    """The words from the command name on, when ``text`` runs ``dsv4convert COMMAND`` (else None)."""
    if not re.search(r"(^|\s)dsv4convert\s+(-|[a-z])", text):
        return None
    words = shlex.split(text, comments=True)
    for i, word in enumerate(words[:-1]):
        if word == "dsv4convert" and (words[i + 1] in COMMANDS or words[i + 1].startswith("-")):
            rest = words[i + 1:]
            end = next((j for j, w in enumerate(rest) if w in SHELL_OPERATORS), len(rest))
            return rest[:end]
    return None


def documented() -> list[Documented]:
    found = []
    for doc in DOCS:
        lines = doc.read_text(encoding="utf-8").splitlines()
        name = doc.relative_to(ROOT).as_posix()
        in_code = _code_block_lines(lines)
        for number, text in _code_lines(in_code):
            text = text.lstrip("#").strip() if text.startswith("#") else text
            words = _command_words(text)
            if words is not None:
                words = [w.strip("[]") for w in words if w.strip("[]")]
                found.append(Documented(f"{name}:{number}", words, example="..." not in words))
        prose = "\n".join("" if number in in_code else line for number, line in enumerate(lines, 1))
        for match in SPAN.finditer(prose):        # a span may wrap onto the next line
            words = re.sub(r"<[^>]*>", "<...>", match.group(1)).replace("\\|", "|").split()
            if words[:1] == ["dsv4convert"]:
                words = words[1:]
            elif not (len(words) > 1 and words[1].startswith("--")):
                continue
            if words and words[0] in COMMANDS:
                number = prose.count("\n", 0, match.start()) + 1
                found.append(Documented(f"{name}:{number}", words, example=False))
    return found


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> str | None:
    """argparse's error for ``argv`` (None when it parses; --help and --version count as parsing)."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            parser.parse_args(argv)
    except SystemExit as exc:
        return None if exc.code == 0 else (err.getvalue().strip().splitlines() or ["exit 2"])[-1]
    except DSV4Error as exc:       # a type= that raises the tool's own error (parse_size)
        return f"error: {exc}"
    return None


def _fragment_errors(words: list[str]) -> list[str]:
    """Each flag of a fragment exists; each value written after one is one it takes."""
    command, errors = words[0], []
    options = COMMANDS[command]._option_string_actions
    words = [w.strip("[]()") for w in words[1:]]
    words = [w for w in words if w and w != "|"]
    i = 0
    while i < len(words):
        flag, _, inline = words[i].partition("=")
        i += 1
        if flag == "--":
            break
        if not flag.startswith("-"):
            continue                                    # a positional, or a placeholder for one
        action = options.get(flag)
        if action is None:
            errors.append(f"{command} has no option {flag}")
            continue
        value = inline or None
        if value is None and action.nargs != 0 and i < len(words) and not words[i].startswith("-"):
            value, i = words[i], i + 1
        if value is None or PLACEHOLDER.search(value):
            continue
        for alternative in value.split("|"):
            error = _parse(RELAXED, [command, flag, alternative])
            if error:
                errors.append(f"{flag} {alternative}: {error}")
    return errors


def help_examples() -> list[Documented]:
    """The example lines of every command's ``--help`` epilog."""
    found = []
    for name, sub in COMMANDS.items():
        lines = (sub.epilog or "").splitlines()
        joined, pending = [], ""
        for line in lines:
            pending += " " + line.strip()
            if pending.endswith("\\"):
                pending = pending[:-1]
                continue
            joined.append(pending.strip())
            pending = ""
        for text in joined:
            words = _command_words(REMARK.sub("", text))
            if words is not None:
                found.append(Documented(f"dsv4convert {name} --help", words, example=True))
    return found


DOCUMENTED = documented()


def test_the_docs_show_commands():
    """The extraction itself: it finds the README's walkthrough, its command table and the docs' examples."""
    where = {d.where.split(":")[0] for d in DOCUMENTED}
    assert {"README.md", "docs/serve.md", "docs/fit.md", "docs/compare.md", "docs/organism.md"} <= where
    assert sum(d.example for d in DOCUMENTED) >= 40 and sum(not d.example for d in DOCUMENTED) >= 60
    assert {d.words[0] for d in DOCUMENTED} >= set(COMMANDS)      # every command is shown somewhere


@pytest.mark.parametrize("doc", sorted({d.where.split(":")[0] for d in DOCUMENTED}))
def test_every_documented_command_parses(doc):
    failures = []
    for d in DOCUMENTED:
        if d.where.split(":")[0] != doc:
            continue
        errors = [_parse(PARSER, d.words)] if d.example else _fragment_errors(d.words)
        failures += [f"{d.where}: dsv4convert {' '.join(d.words)}\n    {e}" for e in errors if e]
    assert not failures, "\n".join(failures)


def test_every_help_example_parses():
    examples = help_examples()
    assert {e.where for e in examples} >= {f"dsv4convert {c} --help" for c in ("fit", "automix", "serve", "tune")}
    failures = [f"{e.where}: dsv4convert {' '.join(e.words)}\n    {error}" for e in examples
                if (error := _parse(PARSER, e.words))]
    assert not failures, "\n".join(failures)
