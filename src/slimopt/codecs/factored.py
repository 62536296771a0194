"""Factored storage of a non-negative matrix: row and column means (Adafactor's statistics).

Decoding gives the rank-1 matrix ``row_i · col_j / mean(row)``, whose row and column means are
the stored ones, so decode → EMA update → encode is exactly Adafactor's factored moving average.
A positive element makes its row and column means positive, so it never decodes to zero.
Means saturate at ``FLOAT32_MAX / max(m, n)``, so neither an overflowing sum nor decoding (at
most m times a column mean) ever gives infinity or NaN.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from slimopt.checks import FLOAT32_MAX
from slimopt.codecs.base import Storage


class FactoredCodec:
    """(m + n) fp32 numbers for an m×n non-negative matrix."""

    parts = ("row", "col")
    storage = Storage("factored")

    def encode(self, value: Tensor, generator: torch.Generator | None = None) -> dict[str, Tensor]:
        row, col = means(value.float())
        return {"row": row, "col": col}

    def decode(self, stored: Mapping[str, Tensor], shape: torch.Size) -> Tensor:
        return product(stored["row"], stored["col"])


def means(value: Tensor) -> tuple[Tensor, Tensor]:
    """The stored row and column means of the fp32 ``value``, saturated."""
    ceiling = FLOAT32_MAX / max(value.shape[-1], value.shape[-2])
    return value.mean(dim=-1).clamp_(max=ceiling), value.mean(dim=-2).clamp_(max=ceiling)


def product(row: Tensor, col: Tensor) -> Tensor:
    """The rank-1 matrix whose row and column means are ``row`` and ``col``."""
    total = row.mean(dim=-1, keepdim=True)
    return (row / torch.where(total > 0, total, 1.0)).unsqueeze(-1) * col.unsqueeze(-2)
