"""A unit's stored moments: decoded to fp32 and encoded back by its plan's codecs (whole, or by
slices of rows), written from values another format or another process count saved, and read
as ``decoded_state`` gives them."""

from __future__ import annotations

from collections.abc import Iterable, MutableMapping
from typing import Any

import torch
from torch import Tensor

from slimopt.codecs import state_key
from slimopt.codecs.slicing import matrix_shape
from slimopt.core.plan import MomentStorage, Plan
from slimopt.core.seeds import LOAD_STREAM, rounding_generator
from slimopt.core.state import KEPT, is_basis_key, started
from slimopt.projection import Basis, projected_shape

State = MutableMapping[str, Any]


def decode_all(storage: MomentStorage, state: State, shape: torch.Size) -> dict[str, Tensor]:
    """The fp32 value of every moment stored by ``storage`` (``Plan.storage``); ``shape`` is the
    moments' (local) shape."""
    moments = {}
    keys = storage.keys
    for key, codec in storage.codecs.items():
        stored = {}
        for part, name in keys[key].items():
            stored[part] = state.get(name)
            if stored[part] is None:  # a moment the rule does not keep (Adafactor's first without beta1)
                break
        else:
            moments[key] = codec.decode(stored, shape)
    return moments


def encode(
    storage: MomentStorage,
    state: State,
    moments: dict[str, Tensor],
    generator: torch.Generator | None,
) -> None:
    """Store each of the rule's ``moments`` (by key) as ``storage`` says (``Plan.storage``),
    drawing stochastic roundings from ``generator`` in the moments' order."""
    codecs, keys = storage.codecs, storage.keys
    for key, value in moments.items():
        for part, stored in codecs[key].encode(value, generator).items():
            state[keys[key][part]] = stored


def stored_parts(state: State, key: str, parts: Iterable[str]) -> dict[str, Tensor]:
    """The stored tensors of moment ``key``, by part."""
    return {part: state[state_key(key, part)] for part in parts}


def store(plan: Plan, state: State, moments: dict[str, Tensor]) -> None:
    """Encode ``moments`` (as ``decoded`` gives them) with the plan's storage format into a
    state whose stored tensors have been removed."""
    storages = {key: plan.storage(plan.layout(value.shape)) for key, value in moments.items()}
    generator = rounding_generator(plan, state, next(iter(storages.values())), LOAD_STREAM)
    row_storages = plan.row_storages() if plan.by_row_slices else {}
    for key, value in moments.items():
        if key in row_storages:
            for part, stored in row_storages[key].encode_all(value, generator).items():
                state[state_key(key, part)] = stored
        elif key in plan.rule.moment_kinds:
            encode(storages[key], state, {key: value}, generator)
        else:
            state[key] = value


def decoded(
    plan: Plan, state: State, values: torch.Size, rows: int | None, basis: Basis | None
) -> dict[str, Tensor]:
    """The fp32 value of every moment in ``state``, stored by the plan's format for values of
    shape ``values``: this process's, or a saved shard's (a checkpoint written by another
    number of processes) of a parameter split by rows with ``rows`` rows in all (None: not
    split); ``basis``: the unit's, for a projected one. Adafactor's factored statistics are
    returned as stored."""
    if not started(state):
        return {}
    moment_parts = set()
    shape = projected_shape(matrix_shape(values), basis) if plan.projected else values
    if plan.stored_by_row_slices(values):
        moments = {}
        for key, storage in plan.row_storages(values).items():
            moments[key] = storage.decode_all(stored_parts(state, key, storage.sizes)).view(shape)
            moment_parts |= {state_key(key, part) for part in storage.sizes}
    else:
        storage = plan.storage(shape if rows is None else torch.Size((rows, *shape[1:])))
        moments = decode_all(storage, state, shape)
        for key, codec in storage.codecs.items():
            moment_parts |= {state_key(key, part) for part in codec.parts}
    for key, value in state.items():  # the rule's own statistics (Adafactor's factored ones)
        if (
            isinstance(value, Tensor)
            and key not in moment_parts
            and key not in KEPT
            and not is_basis_key(key)
        ):
            moments[key] = value
    return moments


def stacked(decoded: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    """The experts' ``decoded`` moments stacked along a first dimension. An expert not updated
    yet (no tokens routed to it, no basis yet) has the zero moments its first update would
    start from."""
    like = next((d for d in decoded if d), {})
    return {
        key: torch.stack([d[key] if d else torch.zeros_like(value) for d in decoded])
        for key, value in like.items()
    }
