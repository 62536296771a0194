"""A projected unit's basis as its state stores it: the left (m×r) and right (r×n) factors under
``basis_left`` and ``basis_right``, in the group's ``basis_states`` format; or, for a random
projection (``proj_method="random"``), only the step it was drawn at (``basis_draw``): it is
drawn again from its seed whenever it is used, so it costs no memory between updates."""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

from slimopt.codecs.slicing import matrix_shape
from slimopt.core.plan import Plan
from slimopt.core.seeds import BASIS_STREAM, draw_seed, rounding_seed, seeded_generator
from slimopt.core.state import DRAW, STEP
from slimopt.projection import Basis, random_basis, sides


def has_basis(plan: Plan, state: MutableMapping[str, Any]) -> bool:
    """Whether the unit has a basis of its group's kind: a random projection's draw, or stored
    factors (in the group's ``basis_states``: a load re-encodes bases saved in another)."""
    if plan.group["proj_method"] == "random":
        return DRAW in state
    left, right = plan.basis_storage
    return left.keys[left.codec.parts[0]] in state or right.keys[right.codec.parts[0]] in state


def basis(plan: Plan, state: MutableMapping[str, Any]) -> Basis | None:
    """The fp32 basis of a projected unit (decoded from its storage, or drawn from its seed),
    or None."""
    if plan.group["proj_method"] == "random":
        return _drawn(plan, state) if DRAW in state else None
    factors = []
    for factor in plan.basis_storage:
        stored = {}
        for part, name in factor.keys.items():
            stored[part] = state.get(name)
            if stored[part] is None:  # a side the projection does not use
                factors.append(None)
                break
        else:
            factors.append(factor.codec.decode(stored, factor.shape))
    return None if factors == [None, None] else Basis(*factors)


def draw_basis(plan: Plan, state: MutableMapping[str, Any]) -> None:
    """Make the random projection of this step the unit's basis from now on."""
    state[DRAW] = state[STEP]


def _drawn(plan: Plan, state: MutableMapping[str, Any]) -> Basis:
    generator = seeded_generator(plan.param.device, draw_seed(state, state[DRAW]))
    uses = sides(matrix_shape(plan.shape), plan.group["proj_type"])
    return random_basis(matrix_shape(plan.shape), plan.group["rank"], uses, generator, plan.param)


def store_basis(plan: Plan, state: MutableMapping[str, Any], new: Basis) -> None:
    """Store ``new`` in the group's ``basis_states`` format (bf16: rounded stochastically,
    seeded by unit and step); a random projection is drawn from its seed, so nothing is stored."""
    if plan.group["proj_method"] == "random":
        return
    generator = None
    if plan.group["basis_states"] == "bf16":
        generator = seeded_generator(plan.param.device, rounding_seed(state, BASIS_STREAM))
    for factor, storage in zip(new, plan.basis_storage, strict=True):
        if factor is not None:
            for part, stored in storage.codec.encode(factor, generator).items():
                state[storage.keys[part]] = stored
