"""The ``torch.optim.Optimizer`` shell: update rule × GaLore projection × state storage.

The shell keeps param groups, ``step()``, ``state_dict`` / ``load_state_dict`` and
``decoded_state``; its engine (``optimizer.engine``, ``slimopt.core.engine``) does the work
from each unit's ``Plan``. The math lives in ``slimopt.rules``, the basis in
``slimopt.projection`` and the stored form of the moments in ``slimopt.codecs``. A param group
is projected iff it has a ``rank`` key (galore-torch's convention); its parameters with two or
more dimensions are projected (conv kernels are flattened to ``shape[0] × rest``), 1-D ones get
the plain rule. All arithmetic is fp32 whatever the parameter dtype.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import torch
from torch import Tensor
from torch.optim import Optimizer

from slimopt.core import loading
from slimopt.core.docstrings import optimizer_sections
from slimopt.core.engine import Engine
from slimopt.core.hyperparameters import constructor_defaults, fill_rule_defaults
from slimopt.core.plan import path_of
from slimopt.options import (
    PROJECTION_DEFAULTS,
    STORAGE_DEFAULTS,
    group_errors,
    sharding_errors,
)
from slimopt.rules import RULES, UpdateRule


class SlimoptOptimizer(Optimizer):
    """Base shell of every slimopt optimizer: subclasses choose the update rule and its
    hyperparameter defaults."""

    rule: ClassVar[UpdateRule]
    default_states: ClassVar[str] = "fp32"
    # The quantization block size of its groups (None: the storage format's own).
    default_block_size: ClassVar[int | None] = None
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
        self._start_engine()
        super().__init__(params, {**defaults, "rule": None, **self.option_defaults(), **options})

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A documented subclass's docstring ends with its arguments and options
        (``slimopt.core.docstrings``), with the subclass's own defaults."""
        super().__init_subclass__(**kwargs)
        if cls.__doc__:
            cls.__doc__ = inspect.cleandoc(cls.__doc__) + "\n\n" + optimizer_sections(cls)

    @classmethod
    def option_defaults(cls) -> dict[str, Any]:
        """The defaults of every projection and storage option for this optimizer's groups."""
        storage = {**STORAGE_DEFAULTS, "states": cls.default_states, "block_size": cls.default_block_size}
        return {**PROJECTION_DEFAULTS, **cls.projection_defaults, **storage}

    def _start_engine(self) -> None:
        """The engine, and the layer-wise handle (None: stepping normally); a copy
        (``copy.deepcopy``, pickle) starts with new ones."""
        self.engine = Engine(self)
        self._layerwise: Any = None

    def __getstate__(self) -> dict[str, Any]:
        """torch.optim's picklable state; device flags of skipped steps not yet read are
        counted first, so the copy's counts are the original's."""
        self.engine.settle_skips()
        return super().__getstate__()

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Restore a pickled or deep-copied optimizer; it is not in layer-wise mode (the hooks
        belong to the original) and computes every basis itself (``spread_refreshes`` is not
        carried over: a process group cannot be copied). torch.optim's ``load_state_dict`` calls
        this too, on an optimizer that keeps its own."""
        super().__setstate__(state)
        if not hasattr(self, "engine"):  # a copy, not a load_state_dict
            self._start_engine()

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
        self.engine.replan()
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
            path_of(group, [self.engine.plan_of(p, group) for p in group["params"] if p.numel()])
            for group in self.param_groups
        ]

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Take one optimization step.

        In layer-wise mode the updates run inside backward: a step pre-hook of the layer-wise handle
        ends a half-accumulated optimizer step early, and refuses a closure.

        Args:
            closure: re-evaluates the model and returns the loss (optional, as in torch.optim).

        Returns:
            The closure's loss, or None.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.engine.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero (or set to None) the gradients, as ``torch.optim.Optimizer`` does; any of them
        holding a synchronized projection (``slimopt.distributed.sync_gradients``) holds a
        gradient again."""
        self.engine.packed_gradients.clear()
        super().zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """The ``torch.optim`` state dict of this optimizer.

        Returns:
            ``state`` (each parameter's moments, bases and counters, by parameter index) and
            ``param_groups``, as ``torch.optim.Optimizer.state_dict`` has them.

        Raises:
            RuntimeError: halfway through a layer-wise accumulation, whose partial sums it could not
                hold (save between optimizer steps).
        """
        self.engine.settle_skips()
        return super().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict of this optimizer, of one storing moments otherwise, or of AdamW's.

        AdamW's is ``torch.optim.AdamW``'s. Moments keep this optimizer's storage (re-encoded
        where the saved format differs). Every state tensor keeps its saved dtype:
        ``torch.optim.Optimizer`` would cast fp32 moments and bases of bf16 parameters to bf16
        and break exact resumption.

        Args:
            state_dict: from ``state_dict()`` of this optimizer or a compatible one.

        Raises:
            ValueError: the state dict projects differently, comes from another update rule, or holds
                hyperparameters this optimizer rejects; or it is loaded between a backward that
                synchronized projections (``slimopt.distributed.sync_gradients``) and its step.
        """
        if self.engine.packed_gradients.unread:
            raise ValueError(
                "gradients hold projections into the current bases (projected gradient sync), which "
                "a load would replace: load before backward, or call zero_grad() first"
            )
        self.engine.settle_skips()  # counts of the steps before; the loaded ones replace them
        loading.load_state_dict(self, state_dict)

    @property
    def layerwise_handle(self) -> Any:
        """The active ``slimopt.layerwise`` handle, or None."""
        return self._layerwise

    def attach_layerwise(self, handle: Any) -> None:
        """Let a ``slimopt.layerwise`` handle hook the param groups added from now on (None:
        stepping normally again); the handle calls this itself."""
        self._layerwise = handle

    def decoded_state(self, param: Tensor) -> dict[str, Tensor]:
        """The fp32 value of every moment of ``param``, whatever its storage format.

        Args:
            param: a parameter of this optimizer.

        Returns:
            Each moment by state key (``exp_avg``, ``exp_avg_sq``, …). Unprojected moments have the
            parameter's shape (its real pairs, ``shape + (2,)``, for a complex parameter); a projected
            matrix's are in its rank-r space (``projected_shape``). Adafactor's factored statistics
            are as stored. Empty before the parameter's first update.

        Raises:
            KeyError: a tensor that is not a parameter of this optimizer.
        """
        return self.engine.decoded(param)


# The base class's name until it served more than GaLore.
GaLoreOptimizer = SlimoptOptimizer
