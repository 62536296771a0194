"""Units of an update and their counters: one view per expert of a stacked parameter and its
part of the parameter's state (``ExpertState``), each parameter's place in the model, the
counters a unit's state starts with, and the warnings that name a unit. Which view is which
expert is the engine's to remember (``slimopt.core.engine``)."""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any

from torch import Tensor

from slimopt.core.plan import Place, Plan
from slimopt.core.state import MOMENT_STEP, REFRESH_OFFSET, SEED, SKIPS, STEP
from slimopt.options import is_projected, sharding_errors
from slimopt.sharding import split_by_rows


def split(tensor: Tensor, group: dict[str, Any]) -> list[Tensor]:
    """``tensor`` (a parameter of ``group``, or its gradient) as the units of its update: itself,
    or in a group with ``experts`` one view per expert along the first dimension."""
    if not group["experts"]:
        return [tensor]
    return [tensor.detach()[index] for index in range(tensor.shape[0])]


def state_of(state: dict[Tensor, Any], param: Tensor, expert: int | None) -> MutableMapping[str, Any]:
    """The state of ``param`` in an optimizer's ``state``, or of its expert ``expert``: that
    expert's part of the parameter's (the keys that start with ``expert{index}.``)."""
    if expert is None:
        return state[param]
    return ExpertState(state[param], expert)


class ExpertState(MutableMapping[str, Any]):
    """One expert's state, kept in its parameter's state under keys prefixed ``expert{index}.``:
    a state dict holds one flat dict per parameter, as torch.optim's does."""

    def __init__(self, state: dict[str, Any], index: int) -> None:
        self._state = state
        self._prefix = f"expert{index}."

    def __getitem__(self, key: str) -> Any:
        return self._state[self._prefix + key]

    def __setitem__(self, key: str, value: Any) -> None:
        self._state[self._prefix + key] = value

    def __delitem__(self, key: str) -> None:
        del self._state[self._prefix + key]

    def __iter__(self) -> Iterator[str]:
        return (key[len(self._prefix) :] for key in list(self._state) if key.startswith(self._prefix))

    def __len__(self) -> int:
        return sum(1 for _ in self)


def places(param_groups: list[dict[str, Any]], given: Mapping[Tensor, Place]) -> dict[Tensor, Place]:
    """Each parameter's ``Place``, or the one ``given`` for it (ZeRO-1 gives each the whole
    model's, so that a process that holds some of the parameters draws as one that holds all)."""
    projected = [p for g in param_groups for p in g["params"] if is_projected(p, g)]
    projected_index = {p: i for i, p in enumerate(projected)}
    every = [p for g in param_groups for p in g["params"]]
    return {
        p: given.get(p) or Place(i, projected_index.get(p, 0), max(len(projected), 1))
        for i, p in enumerate(every)
    }


def start(plan: Plan, state: MutableMapping[str, Any], owner: str) -> None:
    """Start the counters of a unit's first update in its empty ``state``: its step, skips, seed
    and refresh offset. Raises ``ValueError`` for a parameter split by rows in a way ``owner``
    (the optimizer's name) cannot update."""
    if split_by_rows(plan.param):
        # Checked at construction too; here for parameters split afterwards (accelerate's
        # FSDP2 puts the sharded parameters into an optimizer built before prepare()).
        errors = sharding_errors({**plan.group, "params": [plan.param]}, plan.rule, owner)
        if errors:
            raise ValueError("; ".join(errors))
    state[STEP] = 0
    state[SKIPS] = 0
    state[SEED] = plan.seed
    if plan.projected:
        place, gap = plan.place, plan.group["update_proj_gap"]
        offset = (place.projected_ordinal * gap) // place.projected_count
        state[REFRESH_OFFSET] = offset if plan.group["stagger"] else 0


def advance(state: MutableMapping[str, Any]) -> int:
    """Count one more step of ``state``; return the age of its moments."""
    state[STEP] += 1
    state[MOMENT_STEP] += 1
    return state[MOMENT_STEP]


def unstep(plan: Plan, state: MutableMapping[str, Any]) -> None:
    """Take back the count of a step that a non-finite gradient skipped, and report it."""
    state[STEP] -= 1
    state[MOMENT_STEP] -= 1
    skip(plan, state, "non-finite gradient")


def skip(plan: Plan, state: MutableMapping[str, Any], reason: str) -> None:
    """Count a skipped update of the unit and warn."""
    state[SKIPS] += 1
    warn(plan, state, f"{reason}; update skipped")


def warn(plan: Plan, state: MutableMapping[str, Any], message: str) -> None:
    warnings.warn(f"slimopt: {plan.label} at step {state[STEP]}: {message}", RuntimeWarning, stacklevel=4)
