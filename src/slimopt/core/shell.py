"""The ``torch.optim.Optimizer`` shell: update rule × GaLore projection × state storage.

The shell keeps param groups, ``step()``, ``state_dict`` / ``load_state_dict`` and the public
per-parameter API; the engine beside it (``slimopt.core``) does the work from each unit's
``Plan``. The math lives in ``slimopt.rules``, the basis in ``slimopt.projection`` and the
stored form of the moments in ``slimopt.codecs``. A param group is projected iff it has a
``rank`` key (galore-torch's convention); its parameters with two or more dimensions are
projected (conv kernels are flattened to ``shape[0] × rest``), 1-D ones get the plain rule. All
arithmetic is fp32 whatever the parameter dtype.

What ``step()`` does for one parameter is a small public API (``gradient_in_space``, then
``apply_update``, with ``projects``, ``needs_whole_gradient``, ``refreshed_basis``, ``basis`` and
``gradient_norm``): ``slimopt.layerwise`` calls the same methods from its hooks, one parameter
at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, MutableMapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any, ClassVar

import torch
from torch import Tensor
from torch.optim import Optimizer

from slimopt import kernels
from slimopt.core import basis as stored_basis
from slimopt.core import loading, moments, units
from slimopt.core.hyperparameters import constructor_defaults, fill_rule_defaults
from slimopt.core.plan import Place, Plan, PlanContext, make_plan, path_of
from slimopt.core.record import Update, keep_raw
from slimopt.core.refresh import agreed, refresh_due, refresh_when_due
from slimopt.core.tensors import as_matrix, real, values
from slimopt.core.update import apply, apply_together, combined, decide
from slimopt.finite import Decisions, all_finite
from slimopt.options import PROJECTION_DEFAULTS, STORAGE_DEFAULTS, group_errors, sharding_errors
from slimopt.projection import Basis, project
from slimopt.rules import RULES, UpdateRule
from slimopt.sharding import RowSharding, local_view, row_sharding, whole_norm

# What ``watch`` accepts: the phases whose calls a probe is wrapped around.
PHASES = ("refresh", "update")


class GaLoreOptimizer(Optimizer):
    """Base shell: subclasses choose the update rule and its hyperparameter defaults."""

    rule: ClassVar[UpdateRule]
    default_states: ClassVar[str] = "fp32"
    # Hyperparameters of another rule that this optimizer's constructor takes for its groups of
    # that rule (TACO's betas and eps, for its AdamW fallback), by rule name.
    rule_defaults: ClassVar[dict[str, tuple[str, ...]]] = {}
    # Projection options whose defaults differ from ``PROJECTION_DEFAULTS`` (APOLLO's).
    projection_defaults: ClassVar[dict[str, Any]] = {}

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        defaults: dict[str, Any],
        options: dict[str, Any],
    ) -> None:
        valid = ["rank", "rule", *PROJECTION_DEFAULTS, *STORAGE_DEFAULTS]
        unknown = sorted(set(options) - set(valid))
        if unknown:
            raise TypeError(f"unknown option(s) {', '.join(unknown)}; valid options: {', '.join(valid)}")
        if options.get("rank") is None:
            options.pop("rank", None)
        defaults = constructor_defaults(
            options.get("rule"), self.rule, defaults, self.__dict__.pop("_given", None)
        )
        self._reset_private()
        storage = {**STORAGE_DEFAULTS, "states": self.default_states}
        projection = {**PROJECTION_DEFAULTS, **self.projection_defaults}
        super().__init__(params, {**defaults, "rule": None, **projection, **storage, **options})

    def _reset_private(self) -> None:
        """What the shell keeps besides torch.optim's defaults, state and groups: caches and
        links to this process's run, which a copy (``copy.deepcopy``, pickle) starts without."""
        self._places: dict[Tensor, Place] | None = None
        self._plans: dict[Tensor, dict[int | None, Plan]] = {}
        self._shardings: dict[Tensor, RowSharding | None] = {}  # DTensors split by rows
        self._layerwise: Any = None  # the active slimopt.layerwise handle
        self._refresh_group: Any = None  # spread_refreshes: the processes that share refresh work
        self._decisions = Decisions()  # fused updates under finite flags not yet read (slimopt.finite)
        self._probes: dict[str, Callable[[], AbstractContextManager[Any]]] = {}

    def __getstate__(self) -> dict[str, Any]:
        """torch.optim's picklable state; device flags of skipped steps not yet read are
        counted first, so the copy's counts are the original's."""
        self._settle_skips()
        return super().__getstate__()

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Restore a pickled or deep-copied optimizer; it is not in layer-wise mode (the hooks
        belong to the original) and computes every basis itself (``spread_refreshes`` is not
        carried over: a process group cannot be copied). torch.optim's ``load_state_dict`` calls
        this too, on an optimizer that keeps its own."""
        super().__setstate__(state)
        if not hasattr(self, "_decisions"):  # a copy, not a load_state_dict
            self._reset_private()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group (see ``torch.optim.Optimizer``); raises ``ValueError`` for bad hyperparameters.

        A group whose ``rule`` is not the constructor's (this optimizer's own, unless the
        constructor named a ``rule``) takes that rule's defaults for the hyperparameters it does
        not set (but ``rule_defaults``), and this optimizer's ``lr`` and ``weight_decay``."""
        fill_rule_defaults(param_group, RULES.get(self.defaults.get("rule"), self.rule), self.rule_defaults)
        super().add_param_group(param_group)
        index = len(self.param_groups) - 1
        group = self.param_groups[index]
        if group.get("relative_step", False) is None:  # Adafactor's: relative exactly without an lr
            group["relative_step"] = group["lr"] is None
        errors = self.errors_of(group)
        if errors:
            self.param_groups.pop()
            raise ValueError(f"param group {index}: " + "; ".join(errors))
        self.replan()
        if self._layerwise is not None:  # layer-wise mode trains the new parameters too
            try:
                self._layerwise.admit(group)
            except ValueError:
                self.param_groups.pop()
                raise

    def rule_of(self, group: dict[str, Any]) -> UpdateRule:
        """The update rule of ``group``: the one its ``rule`` names (``slimopt.rules.RULES``), or
        this optimizer's own when it names none."""
        return RULES[group["rule"]] if group.get("rule") is not None else self.rule

    def errors_of(self, group: dict[str, Any]) -> list[str]:
        """One message per invalid setting of a complete param group (none: it is valid)."""
        if group.get("rule") is not None and group["rule"] not in RULES:
            valid = ", ".join(RULES)
            return [f"unknown rule {group['rule']!r}; valid: {valid} (or None: the optimizer's own)"]
        rule, owner = self.rule_of(group), type(self).__name__
        return group_errors(group, rule, owner) + sharding_errors(group, rule, owner)

    @property
    def fused_path(self) -> list[str]:
        """Per param group, the path its updates take: "fused" or "reference" (why, for auto)."""
        return [
            path_of(group, [self.plan_of(p, group) for p in group["params"] if p.numel()])
            for group in self.param_groups
        ]

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Take one optimization step; ``closure`` re-evaluates the loss and returns it.

        In layer-wise mode the updates run inside backward: this only ends a half-accumulated
        optimizer step early (see ``slimopt.layerwise``); a closure raises ``RuntimeError``."""
        handle = getattr(self, "_layerwise", None)
        if handle is not None:
            if closure is not None:
                raise RuntimeError(
                    "this optimizer is in layer-wise mode: its updates run inside backward, so a "
                    "closure cannot be re-evaluated; call handle.remove() first"
                )
            handle.finish_step()
            return None
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._settle_skips()
        # Whether each gradient is finite is decided for all parameters at once (slimopt.finite):
        # on the host in one read for the reference path, on the device for the fused path.
        pending = [
            self._update(unit, group, grad)
            for group in self.param_groups
            for p in group["params"]
            if p.grad is not None
            for unit, grad in zip(units.units(p, group), units.units(local_view(p.grad), group), strict=True)
        ]
        ready = []
        for update, verdict in zip(pending, decide(pending), strict=True):
            update.verdict = verdict
            if verdict is False:
                units.skip(update.plan, update.state, "non-finite gradient")
            elif self._into_space(update):
                ready.append(update)
        # A finite gradient can overflow when projected: projected ones are decided again.
        projected = [update for update in ready if update.basis is not None]
        if projected:
            again = combined([update.verdict for update in projected], decide(projected))
            for update, verdict in zip(projected, again, strict=True):
                update.verdict = verdict
        with kernels.compile_settings():
            for update in apply_together(ready, self._decisions):
                with self._probe("update"):
                    apply(update, self._decisions)
        self._decisions.close_step()
        if self._decisions.on_host():
            self._settle_skips()
        return loss

    def _settle_skips(self) -> None:
        """Count the fused updates that a device flag skipped as not taken, as the reference
        path counts a skipped step (it neither advances the step nor ages the moments)."""
        for update in self._decisions.skipped():
            units.unstep(update.plan, update.state)

    def state_dict(self) -> dict[str, Any]:
        """The ``torch.optim`` state dict; raises ``RuntimeError`` halfway through a layer-wise
        accumulation, whose partial sums it could not hold."""
        self._settle_skips()
        handle = getattr(self, "_layerwise", None)
        if handle is not None and handle.pending:
            raise RuntimeError(
                f"layer-wise accumulation is at micro-batch {handle.micro_step} of "
                f"{handle.accumulation_steps}: save between optimizer steps"
            )
        return super().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict of this optimizer, of one with another storage format, or of
        ``torch.optim.AdamW`` (see ``slimopt.core.loading``); moments keep this optimizer's storage.

        Raises ``ValueError`` when the state dict projects differently, comes from another
        update rule, or holds hyperparameters this optimizer rejects. Every state tensor keeps
        its saved dtype: ``torch.optim.Optimizer`` would cast fp32 moments and bases of bf16
        parameters to bf16 and break exact resumption.
        """
        self._settle_skips()  # counts of the steps before; the loaded ones replace them
        loading.load_state_dict(self, state_dict)

    # The per-parameter API: what step() does for one parameter, in the pieces a caller that
    # updates parameters one at a time needs (slimopt.layerwise does so inside backward). Each
    # takes the parameter and its param group; gradients are this process's values (the local
    # rows of an FSDP2 DTensor).

    def units(self, tensor: Tensor, group: dict[str, Any]) -> list[Tensor]:
        """What an update of ``tensor`` (a parameter of ``group``, or its gradient) works on:
        the tensor itself, or in a group with ``experts`` one view per expert (along the first
        dimension), each updated as a 2-D parameter with its own state (``state_of``)."""
        return units.units(tensor, group)

    def state_of(self, unit: Tensor) -> MutableMapping[str, Any]:
        """The state of ``unit`` (from ``units``): a parameter's own, or an expert's part of its
        parameter's (the keys that start with ``expert{index}.``)."""
        return units.state_of(self.state, unit)

    def plan_of(self, unit: Tensor, group: dict[str, Any] | None = None) -> Plan:
        """The ``Plan`` of ``unit`` (a parameter, or an expert from ``units``) of ``group`` (found
        when None), worked out once and kept until its layout changes. Raises ``KeyError`` for a
        tensor that is not a parameter of this optimizer."""
        expert = units.expert_of(unit)
        param, index = (unit, None) if expert is None else expert
        group = self._group_of(param) if group is None else group
        plans = self._plans.setdefault(param, {})
        plan = plans.get(index)
        if plan is None or not plan.current(group):
            plan = plans[index] = make_plan(unit, param, index, group, self._plan_context())
        return plan

    def sharding_of(self, param: Tensor) -> RowSharding | None:
        """How ``param`` is split by rows (found by a collective the first time), or None."""
        if param not in self._shardings:
            self._shardings[param] = row_sharding(param)
        return self._shardings[param]

    def places(self) -> dict[Tensor, Place]:
        """Each parameter's place in the model (``slimopt.core.plan.Place``): its ordinal, among
        projected matrices too, which seed its draws and stagger its refreshes."""
        if self._places is None:
            self._places = units.places(self.param_groups)
        return self._places

    def _plan_context(self) -> PlanContext:
        return PlanContext(self.rule_of, self.sharding_of, lambda param: self.places()[param])

    def replan(self) -> None:
        """Forget every plan and place: the groups or the state changed (``load_state_dict``)."""
        self._places = None
        self._plans = {}

    def projects(self, param: Tensor, group: dict[str, Any]) -> bool:
        """Whether ``param`` is projected (a non-empty tensor of two or more dimensions in a
        group with ``rank``)."""
        return self.plan_of(param, group).projected

    def gradient_norm(self, param: Tensor, grad: Tensor) -> Tensor:
        """The fp32 norm of the whole of ``param``'s gradient, of which ``grad`` is this
        process's part (all-reduced over the processes that hold the rest, under FSDP2)."""
        return whole_norm(grad, self.sharding_of(param))

    @property
    def layerwise_handle(self) -> Any:
        """The active ``slimopt.layerwise`` handle, or None."""
        return self._layerwise

    def attach_layerwise(self, handle: Any) -> None:
        """Route ``step()`` and ``state_dict()`` through a ``slimopt.layerwise`` handle (None:
        back to normal stepping); the handle calls this itself."""
        self._layerwise = handle

    def share_refreshes(self, group: Any) -> None:
        """Compute each basis on one process of ``group`` and broadcast it (None: every process
        computes its own); ``slimopt.distributed.spread_refreshes`` checks and calls this."""
        self._refresh_group = group

    def watch(self, phase: str, probe: Callable[[], AbstractContextManager[Any]]) -> None:
        """Wrap every call of ``phase`` ("refresh": a basis refresh; "update": one unit's update,
        outside the small tensors' grouped step) in the context ``probe()`` returns (the memory
        planner measures each call's temporaries so). Raises ``ValueError`` for another phase."""
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}; valid: {', '.join(PHASES)}")
        self._probes[phase] = probe

    def _probe(self, phase: str) -> AbstractContextManager[Any]:
        probe = self._probes.get(phase)
        return nullcontext() if probe is None else probe()

    def needs_whole_gradient(self, param: Tensor, group: dict[str, Any]) -> bool:
        """Whether this step of ``param`` needs its whole gradient: it is not projected, its basis
        is refreshed from this step's gradient, or its group scales it (APOLLO's ``scale_type``)."""
        plan = self.plan_of(param, group)
        return not plan.projected or plan.scales_gradient or refresh_due(plan, self.state_of(param))

    def basis(self, param: Tensor, group: dict[str, Any]) -> Basis | None:
        """The fp32 basis of a projected ``param`` (decoded from its storage, or drawn from its
        seed for ``proj_method="random"``), or None."""
        return stored_basis.basis(self.plan_of(param, group), self.state_of(param))

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

    def refreshed_basis(self, param: Tensor, group: dict[str, Any], grad: Tensor) -> Basis | None:
        """The basis of a projected ``param`` for this step, refreshed from ``grad`` first when
        its refresh is due (None: no basis could be computed yet)."""
        plan, state = self.plan_of(param, group), self.state_of(param)
        units.start(plan, state, type(self).__name__)
        refresh_when_due(plan, state, grad, self._refresh_group, lambda: self._probe("refresh"))
        return stored_basis.basis(plan, state)

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
        update when ``grad`` is not finite (``finite``: already decided by the caller, as
        ``step()`` does for all parameters at once, possibly as a flag on the device for the
        fused path; None: decided here). ``raw``: ``param``'s own gradient, which a group with
        ``scale_type`` (APOLLO) needs (``ValueError`` without it)."""
        update = self._update(param, group, grad)
        keep_raw(update, raw)
        update.basis = basis
        update.verdict = agreed(update.plan, all_finite(grad)) if finite is None else finite
        with self._probe("update"):
            apply(update, self._decisions)

    def _update(self, unit: Tensor, group: dict[str, Any], grad: Tensor) -> Update:
        """The record of an update of ``unit`` by ``grad``, its state started."""
        plan, state = self.plan_of(unit, group), self.state_of(unit)
        units.start(plan, state, type(self).__name__)
        return Update(plan, unit, state, grad, None)

    def _into_space(self, update: Update) -> bool:
        """Put ``update``'s gradient into the space the rule sees (``gradient_in_space``); False
        when the update is skipped (no basis could be computed yet)."""
        if update.grad.is_sparse:
            raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
        if not update.plan.projected:
            update.grad = real(update.grad)
            return True
        plan, state = update.plan, update.state  # planned and started by ``_update``
        refresh_when_due(plan, state, update.grad, self._refresh_group, lambda: self._probe("refresh"))
        basis = stored_basis.basis(plan, state)
        if basis is None:
            # Not a non-finite gradient (an all-zero one, an expert no token reached): warned
            # about, not counted in nonfinite_skips.
            units.warn(update.plan, update.state, "no projection basis could be computed yet; update skipped")
            return False
        keep_raw(update, update.grad)
        update.grad, update.basis = project(as_matrix(update.grad), basis), basis
        return True

    def decoded_state(self, param: Tensor) -> dict[str, Tensor]:
        """The fp32 value of every moment of ``param``, whatever its storage format.

        Unprojected moments have the parameter's shape (its real pairs, ``shape + (2,)``, for a
        complex parameter); a projected matrix's are in its rank-r space (``projected_shape``).
        Adafactor's factored statistics are returned as stored. Empty before the parameter's
        first update; raises ``KeyError`` for a tensor that is not a parameter of this optimizer.
        """
        plan = self.plan_of(param)
        if plan.expert is not None:
            return moments.decoded(plan, self.state_of(param), param.shape, None, self._basis_of(plan, param))
        if plan.group["experts"]:  # each expert's, stacked along the first dimension
            return moments.stacked([self.decoded_state(unit) for unit in self.units(param, plan.group)])
        rows = None if plan.sharding is None else plan.sharding.rows
        state = self.state.get(param, {})
        return moments.decoded(plan, state, values(param).shape, rows, self._basis_of(plan, param))

    def decoded_saved(
        self,
        param: Tensor,
        state: dict[str, Any],
        shard: tuple[torch.Size, int | None],
        storage: dict[str, Any],
    ) -> dict[str, Tensor]:
        """``decoded_state`` of a saved ``state`` of ``param`` (its moments; its basis is the one
        loaded already) stored with the ``storage`` options (``states``, ``block_size``, …):
        ``shard`` is the shape of the values it was saved for and the parameter's row count
        when another number of processes split it (None: not split), as
        ``slimopt.distributed.checkpoint`` reads them."""
        plan = make_plan(param, param, None, {**self._group_of(param), **storage}, self._plan_context())
        shape, rows = shard
        return moments.decoded(plan, state, shape, rows, self._basis_of(plan, param))

    def _basis_of(self, plan: Plan, unit: Tensor) -> Basis | None:
        return stored_basis.basis(plan, self.state_of(unit)) if plan.projected else None

    def store_moments(self, unit: Tensor, decoded: dict[str, Tensor]) -> None:
        """Encode ``decoded`` moments (as ``decoded_state`` gives them) in this optimizer's
        storage format into the state of ``unit``, whose stored moments have been removed
        (``slimopt.core.loading``, distributed checkpoints)."""
        moments.store(self.plan_of(unit), self.state_of(unit), decoded)

    def store_basis(self, unit: Tensor, basis: Basis) -> None:
        """Store ``basis`` as the basis of ``unit`` in its group's ``basis_states`` format."""
        stored_basis.store_basis(self.plan_of(unit), self.state_of(unit), basis)

    def _group_of(self, param: Tensor) -> dict[str, Any]:
        for group in self.param_groups:
            if any(p is param for p in group["params"]):
                return group
        raise KeyError(f"tensor {tuple(param.shape)} is not a parameter of this optimizer")
