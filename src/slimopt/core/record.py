"""The record of one update of one unit: what this step brings beside the unit's ``Plan`` (its
gradient in the basis' space, the basis, the raw gradient APOLLO scales, the device flag masking
a fused step), and what ``begin`` adds (the fp32 gradient, the storage layout, the rounding
generator, the moments' age); and what an update path reports back to the dispatcher
(``Outcome``, ``NotCompiled``).
"""

from __future__ import annotations

from collections.abc import MutableMapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch
from torch import Tensor

from slimopt.codecs import state_key
from slimopt.core.moments import encode
from slimopt.core.plan import MomentStorage, Plan
from slimopt.core.seeds import rounding_generator
from slimopt.core.state import MOMENT_STEP, started
from slimopt.core.tensors import as_matrix
from slimopt.core.units import advance
from slimopt.projection import Basis


@dataclass(eq=False)
class Update:
    """One update of one unit; see the module docstring."""

    plan: Plan
    unit: Tensor  # the parameter, or an expert's view of it
    state: MutableMapping[str, Any]
    grad: Tensor  # in the basis' space (the unit's own without a basis)
    basis: Basis | None
    # The unit's own gradient as a matrix, kept beside the projected one where the group scales
    # it (APOLLO, ``slimopt.core.scaling``); else None.
    raw: Tensor | None = None
    # Whether the gradient is finite: a host bool, or a flag on the device (see ``decisions``).
    verdict: bool | Tensor = True
    keep: Tensor | None = None  # the device flag the fused step masks its writes by
    storage: MomentStorage | None = None  # how its moments are stored (``Plan.storage``)
    generator: torch.Generator | None = None
    age: int = 0


class Outcome(Enum):
    """TAKEN: written. MASKED: written under the device flag ``Update.keep`` (counted later).
    SKIPPED: not written, the step taken back (a flag read on the host said non-finite)."""

    TAKEN = "taken"
    MASKED = "masked"
    SKIPPED = "skipped"


class NotCompiled(Exception):
    """Auto mode's fused step did not compile: nothing was written, the reference path takes over."""


def keep_raw(update: Update, raw: Tensor | None) -> None:
    """Keep ``raw``, the unit's own gradient, as a matrix where its group scales it (APOLLO);
    raises ``ValueError`` when such an update has none."""
    if not update.plan.scales_gradient:
        return
    if raw is None:
        raise ValueError("a group with scale_type (APOLLO) scales the raw gradient: pass raw=")
    update.raw = as_matrix(raw)


def begin(update: Update, *, own_dtype: bool = False) -> None:
    """An update's start: the fp32 gradient (in its own dtype with ``own_dtype``: for a step
    that reads bf16 itself), contiguous so that moments created like it and the direction have a
    2-D view; how the moments are stored; the rounding generator; the moments' age, counted (the
    moments created on the first update: ``start_moments``)."""
    plan, state = update.plan, update.state
    grad = (update.grad if own_dtype else update.grad.float()).contiguous()
    storage = plan.storage(plan.layout(grad.shape))
    generator = rounding_generator(plan, state, storage)
    if not started(state):
        start_moments(update, grad, generator, storage)
    update.grad, update.storage, update.generator, update.age = grad, storage, generator, advance(state)


def start_moments(
    update: Update, grad: Tensor, generator: torch.Generator | None, storage: MomentStorage
) -> None:
    """The unit's moments as its first update finds them: the rule's initial state, encoded by
    the plan's codecs, or for a unit updated by slices of rows zeros in its sliced storage (each
    slice starts from the rule's initial state as it is updated)."""
    plan, state = update.plan, update.state
    if plan.by_row_slices:
        for key, sliced in plan.row_storages().items():
            for part, tensor in sliced.allocate(plan.param.device, plan.values_shape).items():
                state[state_key(key, part)] = tensor
    else:
        grad = grad if plan.rule.reads_own_dtype else grad.float()
        initial = plan.rule.init_state(grad, plan.group, projected=update.basis is not None)
        for key, value in initial.items():
            if key in plan.rule.moment_kinds:
                encode(storage, state, {key: value}, generator)
            else:
                state[key] = value
    state[MOMENT_STEP] = 0
