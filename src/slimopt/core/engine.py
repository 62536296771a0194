"""The engine of one slimopt optimizer (``optimizer.engine``): what a step does, and what it
does for one parameter, in the pieces a caller that updates parameters one at a time needs.

``slimopt.layerwise`` calls the per-parameter pieces from its hooks (``needs_whole_gradient``,
``gradient_in_space`` or ``refreshed_basis`` and ``basis``, then ``apply_update``); loading
and distributed checkpoints read and write the stored moments and bases through it. The engine
keeps what the optimizer holds besides torch.optim's defaults, state and groups: each unit's
``Plan``, each parameter's place and row sharding, the experts' views, the process group that
shares refreshes, the fused updates' device flags not yet read and the probes around calls.
A copy of the optimizer (``copy.deepcopy``, pickle) starts with a new engine.

Every method takes a parameter (or an expert's view, from ``units``) and its param group;
gradients are this process's values (the local rows of an FSDP2 DTensor).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from contextlib import AbstractContextManager, nullcontext
from functools import partial
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.utils.weak import WeakIdKeyDictionary

from slimopt import kernels
from slimopt.core import basis as stored_basis
from slimopt.core import moments, units
from slimopt.core.packed import PackedGradients
from slimopt.core.plan import Place, Plan, PlanContext, make_plan
from slimopt.core.record import Update, keep_raw
from slimopt.core.refresh import agreed, refresh_due, refresh_when_due
from slimopt.core.state import STEP
from slimopt.core.tensors import as_matrix, real, values
from slimopt.core.update import apply, apply_together, combined, decide
from slimopt.finite import Decisions, all_finite
from slimopt.projection import Basis, project
from slimopt.sharding import RowSharding, local_view, row_sharding, whole_norm

# What ``watch`` accepts: the phases whose calls a probe is wrapped around.
PHASES = ("refresh", "update")


class Engine:
    """The engine of ``optimizer``, whose ``rule_of(group)`` names each group's update rule; see
    the module docstring. Its ``state`` and ``param_groups`` are read at every use (torch.optim's
    ``load_state_dict`` replaces both). The engine holds its optimizer weakly: no reference
    cycle, so deleting an optimizer frees its state at once, not at the next garbage collection
    (gigabytes of GPU memory)."""

    def __init__(self, optimizer: Optimizer) -> None:
        self._optimizer: Any = weakref.proxy(optimizer)
        self._owner = type(optimizer).__name__
        self._places: dict[Tensor, Place] | None = None
        self._given_places: Mapping[Tensor, Place] = {}
        self._plans: dict[Tensor, dict[int | None, Plan]] = {}
        self._shardings: dict[Tensor, RowSharding | None] = {}  # DTensors split by rows
        # Each expert's view (from ``units``): its parameter and index, for as long as it lives.
        self._experts: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.refresh_group: Any = None  # spread_refreshes: the processes that share refresh work
        self.decisions = Decisions()  # fused updates under finite flags not yet read (slimopt.finite)
        self._probes: dict[str, Callable[[], AbstractContextManager[Any]]] = {}
        self._fused_policy = kernels.FusedPolicy()
        # Gradients holding projections a gradient sync packed there (slimopt.distributed.grad_sync).
        self.packed_gradients = PackedGradients()

    def step(self) -> None:
        """Update every parameter that has a gradient (``optimizer.step()`` without its closure)."""
        decisions = self.decisions
        if decisions.waiting:
            self.settle_skips()
        ready, fuses = self._ready()
        # Only fused steps compile: the reference path needs neither the settings nor batches.
        probe = self._probes.get("update", nullcontext)
        with kernels.compile_settings() if fuses else nullcontext():
            if fuses:
                ready = apply_together(ready, decisions)
            for update in drained(ready):
                with probe():
                    apply(update, decisions)
        if decisions.waiting:
            decisions.close_step()
            if decisions.on_host():
                self.settle_skips()

    def follow(self) -> None:
        """The step of parameters another process updates, for a process that needs only their
        bases (ZeRO-1's non-owners under projected gradient sync, ``slimopt.distributed``): each
        projected unit's basis refreshed when due and its step counted, as its owner's step
        does from the same synchronized gradient, without moments or weights."""
        ready, _ = self._ready()
        for update in ready:
            verdict = update.verdict
            if bool(verdict):  # a flag left on the device is read here: nothing waits on it
                update.state[STEP] += 1
            else:
                units.skip(update.plan, update.state, "non-finite gradient")

    def _ready(self) -> tuple[list[Update], bool]:
        """This step's updates of the parameters with a gradient that go on to their rule: found
        finite (a non-finite one is counted as skipped), in the space the rule sees (bases
        refreshed when due), a projected one's verdict decided again; and whether any of them
        takes the fused step."""
        packed = self.packed_gradients
        pending = []
        for group in self._optimizer.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = local_view(p.grad)
                shapes = packed.take(p) if packed.unread else None
                if not group["experts"]:
                    pending.append(self._update(p, group, grad, shapes[0] if shapes else None))
                    continue
                views = self.units(p, group)
                shapes = shapes or [None] * len(views)
                for unit, part, shape in zip(views, units.split(grad, group), shapes, strict=True):
                    pending.append(self._update(unit, group, part, shape))
        # Whether each gradient is finite is decided for all parameters at once (slimopt.finite):
        # on the host in one read for the reference path, on the device for the fused path.
        ready, projected, first, fuses = [], [], [], False
        for update, verdict in zip(pending, decide(pending), strict=True):
            update.verdict = verdict
            if verdict is False:
                units.skip(update.plan, update.state, "non-finite gradient")
            elif self._into_space(update):
                ready.append(update)
                fuses = fuses or update.plan.fusable
                if update.basis is not None:
                    projected.append(update)
                    first.append(verdict)
        # A finite gradient can overflow when projected: projected ones are decided again.
        if projected:
            for update, verdict in zip(projected, combined(first, decide(projected)), strict=True):
                update.verdict = verdict
        return ready, fuses

    def settle_skips(self) -> None:
        """Count the fused updates that a device flag skipped as not taken, as the reference
        path counts a skipped step (it neither advances the step nor ages the moments)."""
        for update in self.decisions.skipped():
            units.unstep(update.plan, update.state)

    def units(self, tensor: Tensor, group: dict[str, Any]) -> list[Tensor]:
        """What an update of ``tensor`` (a parameter of ``group``) works on: the tensor itself,
        or in a group with ``experts`` one view per expert (along the first dimension), each
        updated as a 2-D parameter with its own state (``state_of``)."""
        views = units.split(tensor, group)
        if group["experts"]:
            for index, view in enumerate(views):
                self._experts[view] = (tensor, index)
        return views

    def state_of(self, unit: Tensor) -> MutableMapping[str, Any]:
        """The state of ``unit`` (from ``units``): a parameter's own, or an expert's part of its
        parameter's (the keys that start with ``expert{index}.``)."""
        param, index = self._experts.get(unit, (unit, None))
        return units.state_of(self._optimizer.state, param, index)

    def plan_of(self, unit: Tensor, group: dict[str, Any] | None = None) -> Plan:
        """The ``Plan`` of ``unit`` (a parameter, or an expert from ``units``) of ``group`` (found
        when None), worked out once and kept until its layout changes. Raises ``KeyError`` for a
        tensor that is not a parameter of this optimizer."""
        param, index = self._experts.get(unit, (unit, None))
        group = self.group_of(param) if group is None else group
        plans = self._plans.setdefault(param, {})
        plan = plans.get(index)
        if plan is None or not plan.current(group):
            plan = plans[index] = make_plan(unit, param, index, group, self._context())
        return plan

    def group_of(self, param: Tensor) -> dict[str, Any]:
        """The param group ``param`` belongs to; raises ``KeyError`` for a tensor that is not a
        parameter of this optimizer."""
        for group in self._optimizer.param_groups:
            if any(p is param for p in group["params"]):
                return group
        raise KeyError(f"tensor {tuple(param.shape)} is not a parameter of this optimizer")

    def sharding_of(self, param: Tensor) -> RowSharding | None:
        """How ``param`` is split by rows (found by a collective the first time), or None."""
        if param not in self._shardings:
            self._shardings[param] = row_sharding(param)
        return self._shardings[param]

    def places(self) -> dict[Tensor, Place]:
        """Each parameter's place in the model (``slimopt.core.plan.Place``): its ordinal, among
        projected matrices too, which seed its draws and stagger its refreshes."""
        if self._places is None:
            self._places = units.places(self._optimizer.param_groups, self._given_places)
        return self._places

    def keep_places(self, places: Mapping[Tensor, Place]) -> None:
        """Give these parameters their places in a larger model (ZeRO-1's process holds some of
        the whole model's parameters: it draws and staggers as one that holds all of them)."""
        self._given_places = places
        self.replan()

    @property
    def fused_policy(self) -> kernels.FusedPolicy:
        """This optimizer's fused path by device (``kernels.FusedPolicy``: auto mode and its
        give-up after a failed compile, the Triton kernels, non-finite flags on the device)."""
        return self._fused_policy

    def use_fused_policy(self, policy: kernels.FusedPolicy) -> None:
        """Run the fused path by ``policy`` from now on (every unit planned anew)."""
        self._fused_policy = policy
        self.replan()

    def _context(self) -> PlanContext:
        return PlanContext(self._optimizer.rule_of, self.sharding_of, self._place_of, self._fused_policy)

    def _place_of(self, param: Tensor) -> Place:
        return self.places()[param]

    def replan(self) -> None:
        """Forget every plan and place: the groups or the state changed (``load_state_dict``)."""
        self._places = None
        self._plans = {}

    def watch(self, phase: str, probe: Callable[[], AbstractContextManager[Any]]) -> None:
        """Wrap every call of ``phase`` ("refresh": a basis refresh; "update": one unit's update,
        outside the small tensors' grouped step) in the context ``probe()`` returns (the memory
        planner measures each call's temporaries so). Raises ``ValueError`` for another phase."""
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}; valid: {', '.join(PHASES)}")
        self._probes[phase] = probe

    def _probe(self, phase: str) -> AbstractContextManager[Any]:
        return self._probes.get(phase, nullcontext)()

    def projects(self, param: Tensor, group: dict[str, Any]) -> bool:
        """Whether ``param`` is projected (a non-empty tensor of two or more dimensions in a
        group with ``rank``)."""
        return self.plan_of(param, group).projected

    def gradient_norm(self, param: Tensor, grad: Tensor) -> Tensor:
        """The fp32 norm of the whole of ``param``'s gradient, of which ``grad`` is this
        process's part (all-reduced over the processes that hold the rest, under FSDP2)."""
        return whole_norm(grad, self.sharding_of(param))

    def needs_whole_gradient(self, param: Tensor, group: dict[str, Any]) -> bool:
        """Whether this step of ``param`` needs its whole gradient: it is not projected, its basis
        is refreshed from this step's gradient, or its group scales it (APOLLO's ``scale_type``)."""
        plan = self.plan_of(param, group)
        return not plan.projected or plan.scales_gradient or refresh_due(plan, self.state_of(param))

    def unit_gradients(
        self, param: Tensor, group: dict[str, Any], grad: Tensor
    ) -> list[tuple[Tensor, Tensor]]:
        """Each unit of ``param`` (``units``) with its part of ``grad``."""
        return list(zip(self.units(param, group), units.split(grad, group), strict=True))

    def projection_to_sync(self, unit: Tensor, group: dict[str, Any], grad: Tensor) -> Tensor | None:
        """The fp32 projection of ``grad`` into ``unit``'s basis, which a step of ``unit`` would
        read, for processes to synchronize instead of ``grad`` (``slimopt.distributed.grad_sync``);
        None when this step needs the whole gradient (``needs_whole_gradient``) or ``unit`` has no
        basis yet."""
        if self.needs_whole_gradient(unit, group):
            return None
        basis = self.basis(unit, group)
        return None if basis is None else project(as_matrix(grad), basis)

    def basis(self, param: Tensor, group: dict[str, Any]) -> Basis | None:
        """The fp32 basis of a projected ``param`` (decoded from its storage, or drawn from its
        seed for ``proj_method="random"``), or None."""
        return stored_basis.basis(self.plan_of(param, group), self.state_of(param))

    def refreshed_basis(self, param: Tensor, group: dict[str, Any], grad: Tensor) -> Basis | None:
        """The basis of a projected ``param`` for this step, refreshed from ``grad`` first when
        its refresh is due (None: no basis could be computed yet)."""
        return self._refreshed_basis(self._update(param, group, grad))

    def gradient_in_space(
        self, param: Tensor, group: dict[str, Any], grad: Tensor
    ) -> tuple[Tensor, Basis | None] | None:
        """The gradient the rule sees and the basis it lives in (None: unprojected).

        A projected gradient is fp32; an unprojected one keeps its dtype (the update converts
        it a slice of rows at a time). Refreshes the basis of a projected matrix first when its
        refresh is due. Returns None (the update is skipped) when no basis could be computed yet.
        """
        update = self._update(param, group, grad)
        return (update.grad, update.basis) if self._into_space(update) else None

    def apply_update(
        self,
        param: Tensor,
        group: dict[str, Any],
        grad: Tensor,
        basis: Basis | None,
        finite: bool | Tensor | None = None,
        *,
        raw: Tensor | None = None,
    ) -> None:
        """Run the rule on ``grad`` (already in the basis' space) and update ``param``; skip the
        update when ``grad`` is not finite (``finite``: already decided by the caller, possibly
        as a flag on the device for the fused path; None: decided here). ``raw``: ``param``'s
        own gradient, which a group with ``scale_type`` (APOLLO) needs (``ValueError`` without
        it)."""
        update = self._update(param, group, grad)
        keep_raw(update, raw)
        update.basis = basis
        update.verdict = agreed(update.plan, all_finite(grad)) if finite is None else finite
        with self._probe("update"):
            apply(update, self.decisions)

    def _update(
        self, unit: Tensor, group: dict[str, Any], grad: Tensor, packed: torch.Size | None = None
    ) -> Update:
        """The record of an update of ``unit`` by ``grad``, its state started; ``packed``: the
        shape of the synchronized projection ``grad`` holds at its start instead of a gradient
        (``packed_gradients``), already in the unit's basis."""
        plan = self.plan_of(unit, group)
        state = units.state_of(self._optimizer.state, plan.param, plan.expert)
        if not state:
            units.start(plan, state, self._owner)
        update = Update(plan, unit, state, grad, None)
        if packed is not None:
            update.grad = grad.reshape(-1)[: packed.numel()].view(packed)
            update.basis = stored_basis.basis(plan, state)
        return update

    def _refreshed_basis(self, update: Update) -> Basis | None:
        """``update``'s basis, refreshed from its gradient first when the refresh is due (the one
        place a basis is refreshed); None when none could be computed yet."""
        probe = partial(self._probe, "refresh")
        refresh_when_due(update.plan, update.state, update.grad, self.refresh_group, probe)
        return stored_basis.basis(update.plan, update.state)

    def _into_space(self, update: Update) -> bool:
        """Put ``update``'s gradient into the space the rule sees (``gradient_in_space``); False
        when the update is skipped (no basis could be computed yet)."""
        if update.grad.is_sparse:
            raise RuntimeError(f"{self._owner} does not support sparse gradients")
        if update.basis is not None:  # a synchronized projection (``packed_gradients``)
            return True
        if not update.plan.projected:
            if not update.plan.values_are_unit:
                update.grad = real(update.grad)
            return True
        basis = self._refreshed_basis(update)
        if basis is None:
            # Not a non-finite gradient (an all-zero one, an expert no token reached): warned
            # about, not counted in nonfinite_skips.
            units.warn(update.plan, update.state, "no projection basis could be computed yet; update skipped")
            return False
        keep_raw(update, update.grad)
        update.grad, update.basis = project(as_matrix(update.grad), basis), basis
        return True

    def decoded(self, param: Tensor) -> dict[str, Tensor]:
        """The fp32 value of every moment of ``param`` (``optimizer.decoded_state``)."""
        plan = self.plan_of(param)
        if plan.expert is not None:
            return moments.decoded(plan, self.state_of(param), param.shape, None, self._basis_of(plan, param))
        if plan.group["experts"]:  # each expert's, stacked along the first dimension
            return moments.stacked([self.decoded(unit) for unit in self.units(param, plan.group)])
        rows = None if plan.sharding is None else plan.sharding.rows
        state = self._optimizer.state.get(param, {})
        return moments.decoded(plan, state, values(param).shape, rows, self._basis_of(plan, param))

    def decoded_saved(
        self,
        param: Tensor,
        state: dict[str, Any],
        shard: tuple[torch.Size, int | None],
        storage: dict[str, Any],
    ) -> dict[str, Tensor]:
        """``decoded`` of a saved ``state`` of ``param`` (its moments; its basis is the one
        loaded already) stored with the ``storage`` options (``states``, ``block_size``, …):
        ``shard`` is the shape of the values it was saved for and the parameter's row count
        when another number of processes split it (None: not split), as
        ``slimopt.distributed.checkpoint`` reads them."""
        plan = make_plan(param, param, None, {**self.group_of(param), **storage}, self._context())
        shape, rows = shard
        return moments.decoded(plan, state, shape, rows, self._basis_of(plan, param))

    def _basis_of(self, plan: Plan, unit: Tensor) -> Basis | None:
        return stored_basis.basis(plan, self.state_of(unit)) if plan.projected else None

    def store_moments(self, unit: Tensor, decoded: dict[str, Tensor]) -> None:
        """Encode ``decoded`` moments (as ``decoded`` gives them) in this optimizer's storage
        format into the state of ``unit``, whose stored moments have been removed
        (``slimopt.core.loading``, distributed checkpoints)."""
        moments.store(self.plan_of(unit), self.state_of(unit), decoded)

    def store_basis(self, unit: Tensor, basis: Basis) -> None:
        """Store ``basis`` as the basis of ``unit`` in its group's ``basis_states`` format."""
        stored_basis.store_basis(self.plan_of(unit), self.state_of(unit), basis)


def drained(updates: list[Update]) -> Iterator[Update]:
    """``updates`` in order, each let go of by the list as it is handed out: an update's fp32
    gradient (a whole matrix's, for a rule that is not elementwise on bf16 weights) is freed once
    it is applied, not kept until the step ends."""
    updates.reverse()
    while updates:
        yield updates.pop()
