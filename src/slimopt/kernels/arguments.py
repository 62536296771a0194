"""What the fused steps take besides plain tensors: a moment as its stored parts, storage and
lookup tables, a ternary moment left to the caller to encode in passes, and the steps' scalars
as one cached tensor."""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from slimopt.codecs.base import Storage
from slimopt.memory import untracked

# One moment as the fused steps take it: its stored parts by name, their storage, its lookup
# tables (empty but for blocks).
Moment = tuple[dict[str, Tensor], Storage, tuple[Tensor, ...]]

# A ternary moment a compiled step leaves to its caller to encode in passes
# (``slimopt.codecs.storage``): its new value, its stream of draws, its stored parts and its storage.
Deferred = tuple[Tensor, Tensor, dict[str, Tensor], Storage]


@functools.lru_cache(maxsize=256)
def scalars(values: tuple[float, ...], device: torch.device) -> Tensor:
    """``values`` as an fp32 tensor on ``device``, each rounded once from double precision,
    cached: shared by every parameter with the same scalars (read only), one host-to-device
    copy per group and step, not one per parameter."""
    with untracked():  # a cache shared by the steps, not memory of one
        return torch.tensor(values, dtype=torch.float32).to(device, non_blocking=True)
