"""Writes into the weights: ``w ← w·(1 − lr·wd) − lr·scale·direction`` in fp32, rounded once
into the stored dtype (to nearest, or stochastically for bf16), for a whole matrix or the rows
of a projected one (its direction projected back a slice at a time)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from slimopt.codecs.plain import round_to_bf16_stochastically
from slimopt.projection import Basis, add_projected_back, project_back
from slimopt.rules.taco import OneSparse


@dataclass(frozen=True)
class WeightStep:
    """How one update writes the weights: step size ``lr`` (a number, or a tensor computed on
    the device), ``scale`` of the direction, ``weight_decay``, the ``generator`` of stochastic
    rounding (bf16 weights only; None: to nearest) and the fused step's device flag ``keep``."""

    lr: float | Tensor
    scale: float
    weight_decay: float
    generator: torch.Generator | None = None
    keep: Tensor | None = None


def update_weights(weights: Tensor, direction: Tensor | OneSparse, step: WeightStep) -> None:
    """``w ← w·(1 − lr·wd) − lr·scale·direction`` in fp32, rounded once into ``weights``: to
    nearest, or, with ``step.generator`` (for bf16 ``weights`` only), stochastically."""
    lr, scale = step.lr, step.scale
    target = weights if weights.dtype == torch.float32 else weights.float()
    if step.weight_decay != 0:
        target.mul_(1 - lr * step.weight_decay)
    if isinstance(direction, OneSparse):  # TACO's: one entry per column
        direction.add_to(target, alpha=-lr * scale)
    elif isinstance(lr, Tensor):  # a step size computed on the device, without a host sync
        target.sub_(direction.mul_(lr * scale))
    else:
        target.add_(direction, alpha=-lr * scale)
    if target is weights:
        return
    if step.generator is not None:
        weights.copy_(round_to_bf16_stochastically(target, step.generator))
    else:
        weights.copy_(target)


def update_weights_projected(
    weights: Tensor, direction: Tensor, basis: Basis, rows: slice, step: WeightStep
) -> None:
    """``update_weights`` of ``rows`` of a projected matrix, with the direction projected back
    into them by one ``addmm_`` (no rows×n temporary); rounded once into bf16 ``weights``.
    ``step.keep``: the fused step's device flag; where False the direction is zero, and the
    decay is skipped too, so the weights stay as they are."""
    part = weights[rows]
    lr = step.lr
    if isinstance(lr, Tensor):  # a step size on the device: addmm_ takes only numbers
        update_weights(part, project_back(direction, basis, rows), step)
        return
    target = part if part.dtype == torch.float32 else part.float()
    if step.weight_decay != 0:
        decay = 1 - lr * step.weight_decay
        target.mul_(decay if step.keep is None else torch.where(step.keep, decay, 1.0))
    add_projected_back(target, direction, basis, rows, alpha=-lr * step.scale)
    if target is part:
        return
    generator = step.generator
    part.copy_(target if generator is None else round_to_bf16_stochastically(target, generator))
