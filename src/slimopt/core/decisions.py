"""Whether each update's gradient is finite, decided for all of a step's updates at once
(``slimopt.finite``): read on the host in one read for the reference path, left on the device
as a flag for the fused path (which masks its writes with it; ``Decisions`` counts it later)."""

from __future__ import annotations

import torch
from torch import Tensor

from slimopt import finite
from slimopt.core.record import Update
from slimopt.core.state import started
from slimopt.core.tensors import real


def decides_on_device(update: Update) -> bool:
    """Whether ``update`` takes its non-finite decision on the device: on the fused path on a
    device of ``finite.DECIDED_ON_DEVICE``, once its state exists (a first step creates the
    state on the host)."""
    plan = update.plan
    return finite.decided_on_device(plan.param.device) and plan.fused and started(update.state)


def decide(updates: list[Update]) -> list[bool | Tensor]:
    """For each update, whether its gradient is finite: a bool read on the host, or for an
    update deciding on the device a flag left there."""
    groups = [None if u.plan.sharding is None else u.plan.sharding.group for u in updates]
    flags = finite.finite_flags([real(u.grad) for u in updates], groups)
    on_device = [decides_on_device(u) for u in updates]
    read = iter(finite.read([f for f, device in zip(flags, on_device, strict=True) if not device]))
    return [
        flag if device and flag is not None else True if device else next(read)
        for flag, device in zip(flags, on_device, strict=True)
    ]


def combined(first: list[bool | Tensor], second: list[bool | Tensor]) -> list[bool | Tensor]:
    """Each pair of decisions combined: host bools by ``and``, device flags in one vector
    operation for all of them (not one per parameter)."""
    pairs = list(zip(first, second, strict=True))
    on_device = [k for k, (a, b) in enumerate(pairs) if isinstance(a, Tensor) and isinstance(b, Tensor)]
    both: list[bool | Tensor] = [
        False if a is False or b is False else b if a is True else a for a, b in pairs
    ]
    if on_device:
        vector = torch.stack([pairs[k][0] for k in on_device]) & torch.stack([pairs[k][1] for k in on_device])
        for position, k in enumerate(on_device):
            both[k] = vector[position]
    return both
