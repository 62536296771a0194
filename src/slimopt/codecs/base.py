"""What every state format provides (``Codec``), how its stored tensors are named, and how a
compiled step sees it (``Storage``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor


@dataclass(frozen=True)
class Storage:
    """How one moment is stored, as a compiled step needs to know it (lookup tables are passed
    as tensors): the format, and for blocks their size and code width, for ternary storage
    which scale vectors it keeps."""

    kind: str = "fp32"  # fp32, bf16, blockwise, ternary or factored
    block_size: int = 0
    bits: int = 8
    row_scale: bool = False
    col_scale: bool = False

    @property
    def stochastic(self) -> bool:
        """Whether encoding draws random numbers (stochastic rounding)."""
        return self.kind in ("bf16", "ternary")


class Codec(Protocol):
    """Stored form of one moment."""

    parts: tuple[str, ...]  # names of the stored tensors; "" is the moment's own key
    # The format as ``slimopt.codecs.storage`` and the fused steps read it (and whether encode
    # draws random numbers: ``storage.stochastic``).
    storage: Storage

    def encode(self, value: Tensor, generator: torch.Generator | None = None) -> dict[str, Tensor]:
        """Return the stored tensors for an fp32 ``value``."""

    def decode(self, stored: Mapping[str, Tensor], shape: torch.Size) -> Tensor:
        """Return the fp32 moment of ``shape`` from its stored tensors."""


def store(target: Tensor, value: Tensor, keep: Tensor | None) -> None:
    """``target`` ← ``value``, unless the one-element bool ``keep`` is False (then unchanged)."""
    target.copy_(value if keep is None else torch.where(keep, value, target))


def state_key(moment: str, part: str) -> str:
    """The optimizer-state key of one stored tensor of ``moment`` (e.g. ``exp_avg.codes``)."""
    return f"{moment}.{part}" if part else moment
