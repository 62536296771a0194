"""Exact accounting of optimizer memory."""

from __future__ import annotations

from torch import Tensor
from torch.optim import Optimizer


def state_nbytes(optimizer: Optimizer) -> int:
    """Return the bytes of every tensor in ``optimizer.state``: moments or their codes, scales,
    factored statistics and projection bases (padding of the last quantization block included).
    Step counters and other Python numbers are not counted."""
    return sum(
        value.numel() * value.element_size()
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, Tensor)
    )
