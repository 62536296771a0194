"""Byte-level text data: the simplest tokenizer, used by tests and benchmarks."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

BYTE_VOCAB = 256


def read_bytes(path: str | Path) -> Tensor:
    """Return the file's bytes as a 1-D int64 token tensor (vocabulary of 256)."""
    return torch.frombuffer(bytearray(Path(path).read_bytes()), dtype=torch.uint8).long()


def sample_batch(tokens: Tensor, batch_size: int, seq_len: int, generator: torch.Generator) -> Tensor:
    """Return ``batch_size`` random windows of ``seq_len`` tokens, shape (batch, seq_len)."""
    starts = torch.randint(0, tokens.numel() - seq_len, (batch_size,), generator=generator)
    return torch.stack([tokens[s : s + seq_len] for s in starts.tolist()])
