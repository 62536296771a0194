"""Text data for training: the run's corpus tokenized and packed into rows of ``seq_len``
tokens (``prepare_data``), the seeded order the training rows are served in (``Batches``, which
a single integer restores on resume), and byte-level tokens (the simplest tokenizer, used by
tests and benchmarks)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from slimopt.train.config import TrainConfig
from slimopt.train.corpus import load_corpus, split_documents
from slimopt.train.tokenizer import (
    TextTokenizer,
    bpe_tokenizer,
    default_cache_dir,
    pack,
    pretrained_tokenizer,
)

BYTE_VOCAB = 256


def read_bytes(path: str | Path) -> Tensor:
    """Return the file's bytes as a 1-D int64 token tensor (vocabulary of 256)."""
    return torch.frombuffer(bytearray(Path(path).read_bytes()), dtype=torch.uint8).long()


def sample_batch(tokens: Tensor, batch_size: int, seq_len: int, generator: torch.Generator) -> Tensor:
    """Return ``batch_size`` random windows of ``seq_len`` tokens, shape (batch, seq_len)."""
    starts = torch.randint(0, tokens.numel() - seq_len, (batch_size,), generator=generator)
    return torch.stack([tokens[s : s + seq_len] for s in starts.tolist()])


# What ``prepare_data`` returns: the tokenizer, the training rows and the validation rows.
Data = tuple[TextTokenizer, Tensor, Tensor]


class Batches:
    """Rows of packed tokens in a seeded permutation per epoch; ``position`` counts rows served,
    so it alone restores the order on resume."""

    def __init__(self, rows: Tensor, seed: int) -> None:
        self.rows, self.seed, self.position = rows, seed, 0
        self._epoch, self._order = -1, torch.empty(0, dtype=torch.long)

    def take(self, count: int) -> Tensor:
        picked = []
        for _ in range(count):
            epoch, index = divmod(self.position, len(self.rows))
            if epoch != self._epoch:
                generator = torch.Generator().manual_seed(self.seed + epoch)
                self._epoch, self._order = epoch, torch.randperm(len(self.rows), generator=generator)
            picked.append(self.rows[self._order[index]])
            self.position += 1
        return torch.stack(picked)


def prepare_data(config: TrainConfig) -> Data:
    """Tokenizer, training rows and validation rows of the configured corpus."""
    documents = load_corpus(config.data, max_documents=config.max_documents)
    train_texts, validation_texts = split_documents(documents, config.validation_fraction)
    if config.tokenizer:
        tokenizer = pretrained_tokenizer(config.tokenizer)
    else:
        tokenizer = bpe_tokenizer(train_texts, config.vocab_size, default_cache_dir())
    train_rows = pack(tokenizer.encode(train_texts), config.seq_len, tokenizer.eos_id)
    validation_rows = pack(tokenizer.encode(validation_texts), config.seq_len, tokenizer.eos_id)
    return tokenizer, train_rows, validation_rows
