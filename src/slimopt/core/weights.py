"""Writes into the weights: ``w ← w·(1 − lr·wd) − lr·scale·direction`` in fp32, rounded once
into how the weights are stored — to nearest, or stochastically for bf16; bf16 with an 8-bit
correction kept in the unit's state (``param_rounding="corrected"``); int8 codes, always
stochastically (``slimopt.weight_formats``) — for a whole matrix or a slice of its rows (a
projected direction projected back a slice at a time), through the unit's matrix view
(``matrix_of``)."""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from slimopt.codecs.plain import round_to_bf16_stochastically
from slimopt.codecs.slicing import slices_to_update
from slimopt.core.plan import Plan
from slimopt.core.state import CORRECTION
from slimopt.core.tensors import values
from slimopt.projection import Basis, add_projected_back, project_back
from slimopt.rules import SparseDirection
from slimopt.weight_formats.corrected import corrected, split_
from slimopt.weight_formats.int8 import Int8Weight


@dataclass(frozen=True)
class WeightStep:
    """How one update writes the weights: step size ``lr`` (a number, or a tensor computed on
    the device), ``scale`` of the direction, ``weight_decay``, the ``generator`` of stochastic
    rounding (None: to nearest), the fused step's device flag ``keep`` and the 8-bit
    ``correction`` of bf16 weights (of the same rows as the weights written; None: none)."""

    lr: float | Tensor
    scale: float
    weight_decay: float
    generator: torch.Generator | None = None
    keep: Tensor | None = None
    correction: Tensor | None = None

    def of_rows(self, rows: slice) -> WeightStep:
        """This step for ``rows`` of the matrix it was made for."""
        return self if self.correction is None else replace(self, correction=self.correction[rows])


@contextmanager
def matrix_of(plan: Plan, unit: Tensor) -> Iterator[Tensor]:
    """A writable ``shape[0] × rest`` view of the values of ``plan``'s ``unit`` (of its real
    pairs, if complex). A unit whose layout has no such view (channels_last) is updated in a
    contiguous copy that is written back at the end."""
    own = unit if plan.values_are_unit else values(unit)
    if own.is_contiguous():
        yield own.view(plan.matrix)
        return
    copy = own.contiguous()
    yield copy.view(plan.matrix)
    own.copy_(copy)


def weight_correction(plan: Plan, state: MutableMapping[str, Any], weights: Tensor) -> Tensor:
    """The int8 correction of ``plan``'s bf16 unit in its ``state``, as the matrix ``weights``
    (the unit's matrix view). Kept in the unit's own shape, so that it splits by rows as the
    unit does; zeros, made on first use: the weights are then exactly what they hold."""
    if CORRECTION not in state:
        state[CORRECTION] = torch.zeros(plan.values_shape, dtype=torch.int8, device=weights.device)
    return state[CORRECTION].view(weights.shape)


def weight_step(
    plan: Plan,
    state: MutableMapping[str, Any],
    weights: Tensor,
    generator: torch.Generator | None,
    lr: float | Tensor,
    scale: float,
    keep: Tensor | None = None,
) -> WeightStep:
    """How an update of ``plan``'s unit (``weights``: its matrix view) writes it: the unit's
    rounding ``generator`` if its weights are rounded stochastically, its correction if kept."""
    return WeightStep(
        lr,
        scale,
        plan.group["weight_decay"],
        generator if plan.rounds_weights else None,
        keep,
        weight_correction(plan, state, weights) if plan.corrects_weights else None,
    )


def read_weights(weights: Tensor, step: WeightStep) -> Tensor:
    """The fp32 values of ``weights`` as stored (int8 codes dequantized, a bf16 weight's
    correction added): the tensor itself when it is fp32 already, else a new one."""
    if isinstance(weights, Int8Weight):
        return weights.dequantize(torch.float32)
    if step.correction is not None:
        return corrected(weights, step.correction)
    return weights if weights.dtype == torch.float32 else weights.float()


def write_weights(weights: Tensor, values: Tensor, step: WeightStep) -> None:
    """Store fp32 ``values`` (from ``read_weights``; a copy may be overwritten) into
    ``weights``: rounded once, as the module docstring says."""
    if values is weights:
        return
    if isinstance(weights, Int8Weight):
        weights.store_(values, step.generator)
    elif step.correction is not None:
        split_(weights, step.correction, values, step.generator)
    elif step.generator is not None:
        weights.copy_(round_to_bf16_stochastically(values, step.generator))
    else:
        weights.copy_(values)


def update_weights(weights: Tensor, direction: Tensor | SparseDirection, step: WeightStep) -> None:
    """``w ← w·(1 − lr·wd) − lr·scale·direction`` in fp32, rounded once into ``weights`` (a
    matrix), a slice of rows at a time (``slices_to_update``): the largest temporary is one
    slice's fp32 values, not a whole matrix dequantized."""
    for _, rows in slices_to_update(*weights.shape, meta=weights.is_meta):
        part = direction if not isinstance(direction, Tensor) else direction[rows]
        _update_rows(weights, rows, part, step.of_rows(rows))


def _update_rows(weights: Tensor, rows: slice, direction: Tensor | SparseDirection, step: WeightStep) -> None:
    """``update_weights`` of ``rows`` of ``weights``; ``direction``: those rows of a tensor, or
    a ``SparseDirection`` of the whole matrix."""
    lr, scale, part = step.lr, step.scale, weights[rows]
    target = read_weights(part, step)
    if step.weight_decay != 0:
        target.mul_(1 - lr * step.weight_decay)
    if not isinstance(direction, Tensor):  # a rule's own form (TACO's: one entry per column)
        direction.add_to(target, alpha=-lr * scale, first_row=rows.start)
    elif isinstance(lr, Tensor):  # a step size computed on the device, without a host sync
        target.sub_(direction.mul_(lr * scale))
    else:
        target.add_(direction, alpha=-lr * scale)
    write_weights(part, target, step)


def update_weights_projected(
    weights: Tensor, direction: Tensor, basis: Basis, rows: slice, step: WeightStep
) -> None:
    """``update_weights`` of ``rows`` of a projected matrix, with the direction projected back
    into them by one ``addmm_`` (no rows×n temporary); rounded once into ``weights``.
    ``step.keep``: the fused step's device flag; where False the direction is zero, and the
    decay is skipped too, so the weights stay as they are."""
    part, step = weights[rows], step.of_rows(rows)
    lr = step.lr
    if isinstance(lr, Tensor):  # a step size on the device: addmm_ takes only numbers
        update_weights(part, project_back(direction, basis, rows), step)
        return
    target = read_weights(part, step)
    if step.weight_decay != 0:
        decay = 1 - lr * step.weight_decay
        target.mul_(decay if step.keep is None else torch.where(step.keep, decay, 1.0))
    add_projected_back(target, direction, basis, rows, alpha=-lr * step.scale)
    write_weights(part, target, step)
