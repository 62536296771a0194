"""Writes into the weights: ``w ← w·(1 − lr·wd) − lr·scale·direction`` in fp32, rounded once
into the stored dtype (to nearest, or stochastically for bf16), for a whole matrix or the rows
of a projected one (its direction projected back a slice at a time)."""

from __future__ import annotations

import torch
from torch import Tensor

from slimopt.codecs.plain import round_to_bf16_stochastically
from slimopt.projection import Basis, add_projected_back, project_back
from slimopt.rules.taco import OneSparse


def update_weights(
    weights: Tensor,
    direction: Tensor | OneSparse,
    lr: float | Tensor,
    scale: float,
    weight_decay: float,
    generator: torch.Generator | None = None,
) -> None:
    """``w ← w·(1 − lr·wd) − lr·scale·direction`` in fp32, rounded once into ``weights``: to
    nearest, or, when ``generator`` is given (for bf16 ``weights`` only), stochastically."""
    target = weights if weights.dtype == torch.float32 else weights.float()
    if weight_decay != 0:
        target.mul_(1 - lr * weight_decay)
    if isinstance(direction, OneSparse):  # TACO's: one entry per column
        direction.add_to(target, alpha=-lr * scale)
    elif isinstance(lr, Tensor):  # a step size computed on the device, without a host sync
        target.sub_(direction.mul_(lr * scale))
    else:
        target.add_(direction, alpha=-lr * scale)
    if target is weights:
        return
    if generator is not None:
        weights.copy_(round_to_bf16_stochastically(target, generator))
    else:
        weights.copy_(target)


def update_weights_projected(
    weights: Tensor,
    direction: Tensor,
    basis: Basis,
    rows: slice,
    lr: float | Tensor,
    scale: float,
    weight_decay: float,
    generator: torch.Generator | None = None,
    keep: Tensor | None = None,
) -> None:
    """``update_weights`` of ``rows`` of a projected matrix, with the direction projected back
    into them by one ``addmm_`` (no rows×n temporary); rounded once into bf16 ``weights``.
    ``keep``: the fused step's device flag; where False the direction is zero, and the decay
    is skipped too, so the weights stay as they are."""
    part = weights[rows]
    if isinstance(lr, Tensor):  # a step size on the device: addmm_ takes only numbers
        update_weights(part, project_back(direction, basis, rows), lr, scale, weight_decay, generator)
        return
    target = part if part.dtype == torch.float32 else part.float()
    if weight_decay != 0:
        decay = 1 - lr * weight_decay
        target.mul_(decay if keep is None else torch.where(keep, decay, 1.0))
    add_projected_back(target, direction, basis, rows, alpha=-lr * scale)
    if target is part:
        return
    part.copy_(target if generator is None else round_to_bf16_stochastically(target, generator))
