"""Tokenizers for training: a byte-level BPE trained on the training split (cached on disk), or
any Hugging Face tokenizer; and packing of token streams into fixed-length sequences."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

END_OF_TEXT = "<|endoftext|>"
BPE_FORMAT = "byte-bpe-v1"  # part of the cache key: change it when the training recipe changes


@dataclass
class TextTokenizer:
    """A tokenizer reduced to what training needs."""

    backend: Any  # tokenizers.Tokenizer or a transformers tokenizer
    vocab_size: int
    eos_id: int
    description: str

    def encode(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text."""
        if hasattr(self.backend, "encode_batch"):
            return [encoding.ids for encoding in self.backend.encode_batch(texts)]
        return [self.backend(text, add_special_tokens=False)["input_ids"] for text in texts]


def default_cache_dir() -> Path:
    """``$SLIMOPT_CACHE`` or ``~/.cache/slimopt``."""
    return Path(os.environ.get("SLIMOPT_CACHE", Path.home() / ".cache" / "slimopt"))


def bpe_tokenizer(
    train_texts: list[str], vocab_size: int = 8192, cache_dir: Path | None = None
) -> TextTokenizer:
    """A byte-level BPE of ``vocab_size`` trained on ``train_texts``; trained once per distinct
    corpus and size, then loaded from ``cache_dir/tokenizers``."""
    from tokenizers import Tokenizer

    digest = hashlib.sha256(f"{BPE_FORMAT}\0{vocab_size}".encode())
    for text in train_texts:
        digest.update(text.encode("utf-8"))
        digest.update(b"\0")
    path = (cache_dir or default_cache_dir()) / "tokenizers" / f"{digest.hexdigest()[:24]}.json"
    if path.exists():
        backend = Tokenizer.from_file(str(path))
    else:
        backend = train_bpe(train_texts, vocab_size)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".tmp")
        backend.save(str(partial))
        partial.replace(path)  # atomic: a crash never leaves a half-written cache entry
    return TextTokenizer(backend, backend.get_vocab_size(), backend.token_to_id(END_OF_TEXT), f"bpe:{path}")


def train_bpe(texts: list[str], vocab_size: int) -> Any:
    """A byte-level BPE ``tokenizers.Tokenizer`` trained on ``texts`` to ``vocab_size`` tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer=trainer)
    return backend


def pretrained_tokenizer(name_or_path: str) -> TextTokenizer:
    """A Hugging Face tokenizer by local path or hub name. Raises ``ValueError`` if it cannot load."""
    from transformers import AutoTokenizer

    try:
        backend = AutoTokenizer.from_pretrained(name_or_path)
    except (OSError, ValueError) as error:
        raise ValueError(f"cannot load tokenizer {name_or_path!r}: {error}") from error
    eos = backend.eos_token_id if backend.eos_token_id is not None else backend.sep_token_id
    if eos is None:
        raise ValueError(f"tokenizer {name_or_path!r} has no end-of-sequence token to separate documents")
    return TextTokenizer(backend, len(backend), eos, f"hf:{name_or_path}")


def pack(token_lists: list[list[int]], seq_len: int, eos_id: int) -> Tensor:
    """Concatenate the documents, each followed by ``eos_id``, and cut the stream into rows of
    ``seq_len`` tokens (the incomplete tail is dropped). Raises ``ValueError`` when the stream is
    shorter than one row."""
    stream = [token for tokens in token_lists for token in (*tokens, eos_id)]
    rows = len(stream) // seq_len
    if rows == 0:
        raise ValueError(f"{len(stream)} tokens do not fill one sequence of {seq_len}")
    return torch.tensor(stream[: rows * seq_len], dtype=torch.long).view(rows, seq_len)
