"""What every state format provides (``Codec``) and how its stored tensors are named."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import torch
from torch import Tensor


class Codec(Protocol):
    """Stored form of one moment."""

    parts: tuple[str, ...]  # names of the stored tensors; "" is the moment's own key
    stochastic: bool  # whether encode draws random numbers

    def encode(self, value: Tensor, generator: torch.Generator | None = None) -> dict[str, Tensor]:
        """Return the stored tensors for an fp32 ``value``."""

    def decode(self, stored: Mapping[str, Tensor], shape: torch.Size) -> Tensor:
        """Return the fp32 moment of ``shape`` from its stored tensors."""


def state_key(moment: str, part: str) -> str:
    """The optimizer-state key of one stored tensor of ``moment`` (e.g. ``exp_avg.codes``)."""
    return f"{moment}.{part}" if part else moment
