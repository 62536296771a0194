"""A projected unit's basis refresh: when it is due (every ``update_proj_gap`` steps, staggered),
how the new basis is found (``slimopt.projection.compute_basis``, by one process under
``spread_refreshes``), when the old one is kept instead, and what happens to the moments stored
in the old basis (``on_subspace_change``). A random projection is drawn anew instead
(``redraw``): it needs no gradient."""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import Tensor

from slimopt import projection
from slimopt.codecs.slicing import matrix_shape
from slimopt.core import seeds
from slimopt.core.basis import basis, draw_basis, has_basis, store_basis
from slimopt.core.moments import decode_all, encode
from slimopt.core.plan import Plan
from slimopt.core.seeds import SUBSPACE_CHANGE_STREAM, rounding_generator
from slimopt.core.state import MOMENT_STEP, REFRESH_OFFSET, STEP, started
from slimopt.core.tensors import as_matrix
from slimopt.core.units import warn
from slimopt.finite import all_finite
from slimopt.projection import Basis, projected_shape
from slimopt.sharding import compute_on_owner

State = MutableMapping[str, Any]


def refresh_due(plan: Plan, state: State) -> bool:
    """Whether the unit's basis is refreshed at this step: it has none of its group's kind yet
    (stored factors, or a random projection's draw), or its staggered gap has come round."""
    if not has_basis(plan, state):
        return True
    return (state[STEP] - state[REFRESH_OFFSET]) % plan.group["update_proj_gap"] == 0


def agreed(plan: Plan, flag: bool) -> bool:
    """``flag``, agreed on by every process holding a shard of the unit (all of them true)."""
    return flag if plan.sharding is None else plan.sharding.all_agree(flag)


def refresh_when_due(
    plan: Plan, state: State, grad: Tensor, refresh_group: Any, probe: Callable[[], AbstractContextManager]
) -> None:
    """Refresh the unit's basis when due: draw a random projection anew, or find one from the
    gradient ``grad`` (its fp32 copy made outside ``probe()``, the context a refresh runs in:
    it is not the refresh's workspace)."""
    if not refresh_due(plan, state):
        return
    if plan.group["proj_method"] == "random":
        redraw(plan, state)
        return
    matrix = as_matrix(grad).float()
    with probe():
        refresh(plan, state, matrix, refresh_group)


def refresh(plan: Plan, state: State, grad: Tensor, refresh_group: Any) -> None:
    """Replace the basis of the unit from its fp32 matrix gradient ``grad``; when the gradient
    is non-finite or all zero, or the decomposition fails, keep the old one and warn.
    ``refresh_group``: the processes sharing refreshes (``spread_refreshes``), or None."""
    old = basis(plan, state)
    if not agreed(plan, all_finite(grad)):
        warn(plan, state, "non-finite gradient at a projection refresh; keeping the old basis")
        return
    if not grad.is_meta and agreed(plan, not bool(grad.any())):
        # Its singular vectors would be arbitrary: a random basis, and moments rotated away.
        # Without an old basis the update is skipped, and says so.
        if old is not None:
            warn(plan, state, "all-zero gradient at a projection refresh; keeping the old basis")
        return
    try:
        new = _compute(plan, state, grad, old, refresh_group)
    except RuntimeError as error:
        warn(plan, state, f"projection refresh failed ({error}); keeping the old basis")
        return
    if not all(all_finite(b) for b in new if b is not None):
        warn(plan, state, "projection refresh produced non-finite values; keeping the old basis")
        return
    if old is not None and started(state):
        carry_moments(plan, state, projected_shape(grad.shape, old), old, new)
    store_basis(plan, state, new)


def redraw(plan: Plan, state: State) -> None:
    """Draw the unit's random projection anew (``proj_method="random"``); the moments stored in
    the old one follow the group's ``on_subspace_change`` ("keep", APOLLO's, or "reset")."""
    carried = plan.group["on_subspace_change"] != "keep" and started(state)
    old = basis(plan, state) if carried else None
    draw_basis(plan, state)
    if old is not None:
        new = basis(plan, state)
        carry_moments(plan, state, projected_shape(matrix_shape(plan.values_shape), old), old, new)


def _compute(plan: Plan, state: State, grad: Tensor, old: Basis | None, refresh_group: Any) -> Basis:
    group = plan.group
    generator = None
    if group["proj_method"] == "subspace":
        # Seeded by unit and step, so a resumed run draws the same random directions.
        generator = seeds.seeded_generator(torch.device("cpu"), seeds.step_seed(state))
    sides = projection.sides(matrix_shape(plan.shape), group["proj_type"])

    def compute() -> Basis:
        method = group["proj_method"]
        return projection.compute_basis(grad, group["rank"], sides, method, old, generator, plan.sharding)

    if refresh_group is not None and plan.sharding is None:
        owner = plan.place.projected_ordinal
        return Basis(*compute_on_owner(compute, owner, sides, grad, group["rank"], refresh_group))
    return compute()


def carry_moments(plan: Plan, state: State, shape: torch.Size, old: Basis, new: Basis) -> None:
    """Apply the group's ``on_subspace_change`` policy to the moments stored in ``old``'s basis
    (``shape``: the moments' local shape)."""
    policy = plan.group["on_subspace_change"]
    if policy == "keep":
        return
    storage = plan.storage(plan.layout(shape))
    generator = rounding_generator(plan, state, storage, SUBSPACE_CHANGE_STREAM)
    moments = decode_all(storage, state, shape)
    for key, value in moments.items():
        if policy == "rotate":
            squared = plan.rule.moment_kinds[key] == "square"
            moments[key] = projection.rotate(value, old, new, squared=squared)
        else:
            moments[key] = torch.zeros_like(value)
    encode(storage, state, moments, generator)
    if policy == "reset":
        state[MOMENT_STEP] = 0
