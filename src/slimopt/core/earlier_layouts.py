"""Ternary moments saved in a layout slimopt no longer writes, on their way into
``load_state_dict``: refused where they cannot be read, re-encoded where they can.

- **Digits in element order** (parts ``codes`` beside ``exponents``, before ternary digits ran
  down columns): refused, with the way to carry the run over.
- **Stacked experts scaled as experts × (rows·columns)** (a 3-D moment with one row scale per
  expert, before ``slimopt.codecs.ternary.scaled_shape`` gave each expert's rows and columns
  scales; a stack stored by slices was sliced as 2-D matrices, its second moment int4 where it is
  factored per expert now). That layout is today's storage of the same moment viewed as the
  experts × (rows·columns) matrix, so it is decoded that way and encoded in today's layout (a
  new stochastic rounding of the first moment, drawn from the unit's seed). A parameter split
  across processes is refused instead, with the way to carry it over.
"""

from __future__ import annotations

from typing import Any

import torch

from slimopt.codecs import moment_codec, moment_formats, state_key
from slimopt.codecs.rows import row_sliced_storage
from slimopt.codecs.slicing import sliced
from slimopt.codecs.ternary import MIN_SCALED_LENGTH
from slimopt.core.state import SEED
from slimopt.sharding import is_sharded

# How to bring a state dict that cannot be read over: decoded by the slimopt that wrote it, it
# loads as fp32 moments, which the loading optimizer encodes in its own layout.
CARRY_OVER = (
    "To carry the run over, load it with the slimopt that saved it into an optimizer with "
    "states='fp32' and save again: this optimizer loads that state dict and encodes its moments "
    "as ternary"
)


def carried_over(optimizer: Any, state_dict: dict[str, Any]) -> dict[str, Any]:
    """``state_dict`` with every stacked ternary moment of the earlier layout in today's; raises
    ``ValueError`` for ternary moments in element order, and for earlier stacked moments of a
    parameter split across processes. ``optimizer``: the loading slimopt optimizer."""
    params = iter([p for group in optimizer.param_groups for p in group["params"]])
    state = dict(state_dict["state"])
    for group in state_dict["param_groups"]:
        rule = optimizer.rule_of(group)
        second_ternary = moment_formats(group["states"])[1] == "ternary"
        factored = {key for key, kind in rule.moment_kinds.items() if kind == "square" and second_ternary}
        for param_id in group["params"]:
            param = next(params)
            saved = state.get(param_id, {})
            _refuse_element_order(param_id, saved)
            # A projected parameter's moments are matrices of the subspace (each expert's own).
            if "rank" in group or param.dim() != 3 or param.is_complex():
                continue
            by_slices = rule.elementwise and sliced(param.shape)
            if not _earlier(saved, param.shape, factored if by_slices else set()):
                continue
            if is_sharded(param):
                raise ValueError(
                    f"parameter {param_id} {tuple(param.shape)}: its ternary moments were saved in "
                    "the layout of stacked experts from before their moments were scaled by rows "
                    "and columns. " + CARRY_OVER
                )
            state[param_id] = _restored(saved, param.shape, group, rule.moment_kinds, by_slices)
    return {**state_dict, "state": state}


def _refuse_element_order(param_id: Any, saved: dict[str, Any]) -> None:
    for key in saved:
        moment = key.removesuffix(".codes")
        if key != moment and f"{moment}.exponents" in saved:
            raise ValueError(
                f"parameter {param_id}: its ternary moment {moment!r} was saved in the layout of "
                f"slimopt before ternary digits ran down columns ({key!r}; now {moment}.trits). " + CARRY_OVER
            )


def _earlier(saved: dict[str, Any], shape: torch.Size, factored: set[str]) -> bool:
    """Whether the state of a 3-D parameter of ``shape`` (E × m × n) holds a ternary moment stored
    as the E × (m·n) matrix: today a first moment keeps a row scale per row of each expert (E·m,
    where that layout kept E) and a column scale per column n (where it kept m·n), and the
    ``factored`` moments (the second moments of a stack stored by slices, in the ternary format)
    of experts of at least 32×32 are factored per expert, where its slices had int4 codes."""
    experts, rows, cols = shape
    if rows == 1:  # E × 1 × n: the two layouts are one
        return False
    for key, value in saved.items():
        moment, _, part = key.rpartition(".")
        if f"{moment}.trits" in saved:
            if part == "row" and value.numel() == experts:
                return True
            if part == "col" and f"{moment}.row" not in saved and value.numel() == rows * cols:
                return True
        elif part == "codes" and moment in factored and min(rows, cols) >= MIN_SCALED_LENGTH:
            return True
    return False


def _restored(
    saved: dict[str, Any], shape: torch.Size, group: dict[str, Any], kinds: dict[str, str], by_slices: bool
) -> dict[str, Any]:
    """``saved`` with each moment of the rule decoded in the earlier layout and encoded in today's:
    by slices of the E × (m·n) matrix (``by_slices``), else the first moments as that matrix."""
    experts, rows, cols = shape
    flat = torch.Size((experts, rows * cols))
    states, block_size = group["states"], group["block_size"]
    generator = torch.Generator().manual_seed(int(saved.get(SEED, 0)))
    restored = dict(saved)
    for moment, kind in kinds.items():
        if by_slices:
            before, today = (
                row_sliced_storage(states, kind, flat, block_size),
                row_sliced_storage(states, kind, shape, block_size),
            )
            parts = {part: saved.get(state_key(moment, part)) for part in before.sizes}
            if any(value is None for value in parts.values()):
                continue
            value = before.decode_all(parts).view(shape)
            encoded = today.encode_all(value, generator)
        else:
            if kind != "linear":  # second moments were chosen by the 3-D shape already
                continue
            codec = moment_codec(states, kind, flat, block_size)
            parts = {part: saved.get(state_key(moment, part)) for part in codec.parts}
            if any(value is None for value in parts.values()):
                continue
            value = codec.decode(parts, flat).view(shape)
            encoded = moment_codec(states, kind, shape, block_size).encode(value, generator)
        for part in parts:
            del restored[state_key(moment, part)]
        restored |= {state_key(moment, part): tensor for part, tensor in encoded.items()}
    return restored
