"""Seeds of a unit's random draws: stochastic rounding of states and weights, a refresh's
random sketch and a random projection, derived from the unit's seed and step so a resumed run
draws what an uninterrupted one would."""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

import torch

from slimopt.core.plan import MomentStorage, Plan
from slimopt.core.state import SEED, STEP

# Random streams of stochastic rounding within one step of one unit.
UPDATE_STREAM, SUBSPACE_CHANGE_STREAM, LOAD_STREAM, BASIS_STREAM = 0, 1, 2, 3
STREAM_STRIDE = 0x9E3779B9  # ⌊2³²/φ⌋, odd


def rounding_seed(state: MutableMapping[str, Any], stream: int) -> int:
    """The seed of a stream of rounding draws of this unit and step.

    Update seeds are odd (the plain step seed belongs to the projection refresh's sketch). The
    CPU generator (mt19937) keeps only the low 32 bits of a seed, so streams differ there: an odd
    multiple of ⌊2³²/φ⌋ makes a subspace change's seeds even, never an update's."""
    return step_seed(state) * 2 + 1 + stream * STREAM_STRIDE


def step_seed(state: MutableMapping[str, Any]) -> int:
    """A seed unique to this unit and step."""
    return state[SEED] * 1_000_003 + state[STEP]


def draw_seed(state: MutableMapping[str, Any], draw: int) -> int:
    """The seed of the random projection this unit drew at step ``draw`` (``proj_method="random"``):
    every step draws it again from this seed."""
    return state[SEED] * 1_000_003 + draw


def rounding_generator(
    plan: Plan, state: MutableMapping[str, Any], storage: MomentStorage, stream: int = UPDATE_STREAM
) -> torch.Generator | None:
    """A generator for stochastic rounding of the states stored by ``storage`` (``Plan.storage``)
    and of the weights, when they are rounded stochastically, seeded by unit, step and
    ``stream``; None when nothing draws.

    Roundings of one step that follow each other (moments carried to a new basis, then
    updated) must draw from different streams: the same uniform numbers twice would make
    the pair biased."""
    if not storage.draws:
        return None
    return seeded_generator(plan.param.device, rounding_seed(state, stream))


def seeded_generator(device: torch.device, seed: int) -> torch.Generator:
    """A generator on ``device`` (the CPU for the meta device, which draws nothing) seeded with
    ``seed``."""
    generator = torch.Generator(device="cpu" if device.type == "meta" else device)
    return generator.manual_seed(seed)
