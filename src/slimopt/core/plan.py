"""What one unit of an update is, worked out once: the ``Plan`` of a parameter, or of one expert
of a stacked parameter, kept until its layout changes (the group's layout options, new groups,
a load, the fused step given up).

A plan holds the facts every update reads: the rule, whether the unit is projected, how it is
split across processes, the shape that chooses its storage, its moments' codecs or row slices,
the update path and why, how the weights are rounded, and its place in the model (seeds,
refresh staggering, warnings).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, NamedTuple

import torch
from torch import Tensor

from slimopt import kernels
from slimopt.codecs import Codec, moment_codec, state_key
from slimopt.codecs.rows import RowSlicedStorage, row_sliced_storage
from slimopt.codecs.slicing import matrix_shape, sliced
from slimopt.core.state import BASIS_KEYS
from slimopt.core.tensors import values
from slimopt.options import LAYOUT_OPTIONS, fused_unsupported, is_projected
from slimopt.rules import UpdateRule
from slimopt.sharding import RowSharding, is_sharded
from slimopt.weight_formats.int8 import Int8Weight

# Experts' seeds: their parameter's ordinal plus a multiple of this (more than any model's
# parameter count, and odd, so the low 32 bits of the seeds differ too).
EXPERT_SEED_STRIDE = 100_003


@dataclass(frozen=True)
class Place:
    """A parameter's place in the whole model: its ordinal, its ordinal among projected
    matrices and their count. They seed its random draws and stagger its refreshes."""

    ordinal: int
    projected_ordinal: int
    projected_count: int


class MomentStorage(NamedTuple):
    """How a unit's moments are stored for one layout: each moment's codec, the state key of
    each stored part (by moment and part), and whether an update draws random numbers."""

    codecs: dict[str, Codec]
    keys: dict[str, dict[str, str]]
    draws: bool


class FactorStorage(NamedTuple):
    """How one factor of a projected unit's basis is stored: its shape, its codec
    (``basis_states``) and the state key of each stored part (``basis_left.codes``), by part."""

    shape: torch.Size
    codec: Codec
    keys: dict[str, str]


@dataclass(frozen=True, eq=False)
class Plan:
    """What the engine needs to know about one unit; see the module docstring."""

    param: Tensor  # the whole parameter (an expert's stacked parameter)
    shape: torch.Size  # the unit's (global) shape
    expert: int | None  # the expert's index, or None for a whole parameter
    group: dict[str, Any]  # read at every update: hyperparameters may change (schedulers)
    options: tuple[Any, ...]  # the group's LAYOUT_OPTIONS when planned
    rule: UpdateRule
    projected: bool
    # Whether the update scales the raw gradient by the rule's direction in the projected space
    # (APOLLO, ``scale_type``) rather than projecting that direction back.
    scales_gradient: bool
    sharding: RowSharding | None  # how the parameter is split by rows, or None
    values_shape: torch.Size  # this process's values (real pairs of a complex parameter)
    matrix: tuple[int, int]  # the values' matrix shape (``matrix_shape``)
    # Whether the unit is its own values (neither a DTensor's shard nor complex): the update
    # works on it directly.
    values_are_unit: bool
    by_row_slices: bool  # moments stored and updated a slice of rows at a time
    fusable: bool  # whether updates take the fused step (unless auto mode gives it up)
    policy: kernels.FusedPolicy  # the optimizer's choices by device (auto mode, Triton, flags)
    flags_on_device: bool  # ``policy.flags_on`` the unit's device
    rounds_weights: bool  # weights rounded stochastically: bf16 (or its correction), int8
    corrects_weights: bool  # bf16 weights with an 8-bit correction in the state
    place: Place
    # The moments' storage by layout: worked out at a unit's first update (its layout is known
    # then), read at every later one.
    _storages: dict[torch.Size, MomentStorage] = field(default_factory=dict, repr=False)

    @property
    def fused(self) -> bool:
        """Whether updates take the fused step now: auto mode gives it up for good when a fused
        step fails to compile (``kernels.FusedPolicy``)."""
        return self.fusable and (self.group["fused"] is True or self.policy.failure is None)

    def current(self, group: dict[str, Any]) -> bool:
        """Whether this plan still holds for a unit of ``group``."""
        return group is self.group and layout_options(group) == self.options

    @property
    def seed(self) -> int:
        """The unit's own seed: each expert of a stacked parameter draws its own numbers."""
        ordinal = self.place.ordinal
        return ordinal if self.expert is None else ordinal + (self.expert + 1) * EXPERT_SEED_STRIDE

    @property
    def label(self) -> str:
        """How warnings name the unit."""
        which = f"parameter {self.place.ordinal}" + ("" if self.expert is None else f" expert {self.expert}")
        return f"{which} {tuple(self.shape)}"

    def layout(self, shape: torch.Size) -> torch.Size:
        """The shape that chooses the storage format of a moment of local ``shape``: the global
        one for a parameter split by rows, so every process stores it alike."""
        return shape if self.sharding is None else torch.Size((self.sharding.rows, *shape[1:]))

    def storage(self, layout: torch.Size) -> MomentStorage:
        """How the moments are stored for ``layout``: the codec of each moment of the rule, the
        state key of each stored part, and whether an update draws random numbers
        (stochastically rounded weights or states)."""
        known = self._storages.get(layout)
        if known is not None:
            return known
        states, block_size = self.group["states"], self.group["block_size"]
        codecs = {
            key: moment_codec(states, kind, layout, block_size)
            for key, kind in self.rule.moment_kinds.items()
        }
        keys = {key: {part: state_key(key, part) for part in codec.parts} for key, codec in codecs.items()}
        draws = self.rounds_weights or any(codec.storage.stochastic for codec in codecs.values())
        storage = self._storages[layout] = MomentStorage(codecs, keys, draws)
        return storage

    def row_storages(self, shape: torch.Size | None = None) -> dict[str, RowSlicedStorage]:
        """The slice-by-slice layout of each moment of a unit updated by slices of rows
        (``shape``: the values' shape, if not this process's: a saved shard's)."""
        group = self.group
        return {
            key: row_sliced_storage(
                group["states"], kind, self.values_shape if shape is None else shape, group["block_size"]
            )
            for key, kind in self.rule.moment_kinds.items()
        }

    @cached_property
    def basis_storage(self) -> tuple[FactorStorage, FactorStorage]:
        """How the left and the right factor of a projected unit's basis are stored (under
        ``BASIS_KEYS``)."""
        rows, cols = matrix_shape(self.shape)
        rank = min(self.group["rank"], rows, cols)
        shapes = torch.Size((rows, rank)), torch.Size((rank, cols))
        factors = []
        for key, shape in zip(BASIS_KEYS, shapes, strict=True):
            codec = moment_codec(self.group["basis_states"], "linear", shape)
            factors.append(FactorStorage(shape, codec, {part: state_key(key, part) for part in codec.parts}))
        left, right = factors
        return left, right

    def stored_by_row_slices(self, shape: torch.Size) -> bool:
        """Whether moments of values of ``shape`` (a saved shard's) are stored by row slices."""
        return not self.projected and self.rule.elementwise and sliced(shape)


def layout_options(group: dict[str, Any]) -> tuple[Any, ...]:
    return tuple(map(group.get, LAYOUT_OPTIONS))


def make_plan(
    unit: Tensor,
    param: Tensor,
    expert: int | None,
    group: dict[str, Any],
    context: PlanContext,
) -> Plan:
    """The plan of ``unit`` (``param`` itself, or its expert ``expert``) in ``group``."""
    rule = context.rule_of(group)
    shape = values(unit).shape
    projected = is_projected(unit, group)
    device_type = param.device.type
    return Plan(
        param=param,
        shape=unit.shape,
        expert=expert,
        group=group,
        options=layout_options(group),
        rule=rule,
        projected=projected,
        scales_gradient=projected and group["scale_type"] is not None,
        sharding=None if expert is not None else context.sharding(param),
        values_shape=shape,
        matrix=matrix_shape(shape),
        values_are_unit=not is_sharded(unit) and not unit.is_complex(),
        by_row_slices=not projected and rule.elementwise and sliced(shape),
        fusable=fusable(unit, group, rule, context.policy),
        policy=context.policy,
        flags_on_device=context.policy.flags_on(device_type),
        rounds_weights=isinstance(unit, Int8Weight)
        or (group["param_rounding"] != "nearest" and unit.dtype == torch.bfloat16),
        corrects_weights=corrects_weights(unit, group),
        place=context.place(param),
    )


@dataclass(frozen=True)
class PlanContext:
    """What a plan is worked out from besides the unit and its group: the optimizer's rule
    lookup, the (cached) row sharding of a parameter, its place in the model and the
    optimizer's fused policy."""

    rule_of: Callable[[dict[str, Any]], UpdateRule]
    sharding: Callable[[Tensor], RowSharding | None]
    place: Callable[[Tensor], Place]
    policy: kernels.FusedPolicy


def corrects_weights(unit: Tensor, group: dict[str, Any]) -> bool:
    """Whether ``unit``'s updates keep an 8-bit correction of its bf16 values."""
    return (
        group["param_rounding"] == "corrected"
        and unit.dtype == torch.bfloat16
        and not isinstance(unit, Int8Weight)
    )


def fusable(param: Tensor, group: dict[str, Any], rule: UpdateRule, policy: kernels.FusedPolicy) -> bool:
    """Whether ``param`` takes the fused step (``slimopt.kernels``): always with
    ``fused=True``, never with False, and with None where ``policy``'s auto mode fuses and one
    exists."""
    choice = group["fused"]
    if choice is False or param.is_meta:
        return False
    if choice is True:
        return True
    return policy.available(param.device.type) and fused_unsupported(rule, group, param) is None


def path_of(group: dict[str, Any], plans: list[Plan]) -> str:
    """The path the updates of ``group`` (its non-empty parameters' ``plans``) take: "fused",
    or "reference" with why, or "none" for a group without elements to update
    (``SlimoptOptimizer.fused_path``)."""
    if not plans:
        return "none (no elements to update)"
    if all(plan.fused for plan in plans):
        return "fused"
    if group["fused"] is False:
        return "reference (fused=False)"
    reasons = {fused_unsupported(plan.rule, plan.group, plan.param) for plan in plans} - {None}
    failure = plans[0].policy.failure  # every plan of an optimizer shares its policy
    if not reasons and failure:
        reasons = {f"the fused step did not compile: {failure}"}
    devices = {plan.param.device.type for plan in plans}
    why = (
        "; ".join(sorted(reasons))
        if reasons
        else f"auto fuses on CUDA, parameters on {', '.join(sorted(devices))}"
    )
    return f"reference ({why})"
