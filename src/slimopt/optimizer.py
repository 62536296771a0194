"""The ``torch.optim.Optimizer`` shell: update rule × GaLore projection × state storage.

The shell keeps param groups, step counts, the refresh schedule and ``state_dict``; the math
lives in ``slimopt.rules``, the basis in ``slimopt.projection`` and the stored form of the
moments in ``slimopt.codecs``. Each step decodes one parameter's moments to fp32, runs the rule
and encodes them again. A param group is projected
iff it has a ``rank`` key (galore-torch's convention); its parameters with two or more
dimensions are projected (conv kernels are flattened to ``shape[0] × rest``), 1-D ones get the
plain rule. All arithmetic is fp32 whatever the parameter dtype.

What ``step()`` does for one parameter is a small public API (``gradient_in_space``, then
``apply_update``, with ``projects``, ``needs_whole_gradient``, ``refreshed_basis``, ``basis`` and
``gradient_norm``): ``slimopt.layerwise`` calls the same methods from its hooks, one parameter
at a time.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Iterator, MutableMapping
from contextlib import contextmanager
from typing import Any, ClassVar

import torch
from torch import Tensor
from torch.optim import Optimizer

from slimopt import kernels, loading
from slimopt.codecs import MIN_COMPRESSED_NUMEL, moment_codec, state_key
from slimopt.codecs.draws import stream_seed
from slimopt.codecs.plain import round_to_bf16_stochastically
from slimopt.codecs.rows import RowSlicedStorage, matrix_shape, row_sliced_storage, sliced, slices_to_update
from slimopt.distributed import (
    RowSharding,
    compute_on_owner,
    local_view,
    placement_error,
    row_sharding,
    split_by_rows,
)
from slimopt.finite import Decisions, all_finite, decided_on_device, finite_flags
from slimopt.finite import read as finite_read
from slimopt.options import (
    PROJECTION_DEFAULTS,
    STORAGE_DEFAULTS,
    group_errors,
    is_projected,
)
from slimopt.projection import (
    PROJ_TYPES,
    Basis,
    add_projected_back,
    compute_basis,
    project,
    project_back,
    projected_shape,
)
from slimopt.projection import rotate as rotate_moment
from slimopt.projection import sides as projection_sides
from slimopt.rules import RULES, AdafactorRule, AdamWRule, TACORule, UpdateRule
from slimopt.rules.taco import TACO_DEFAULTS, OneSparse

# Random streams of stochastic rounding within one step of one parameter.
UPDATE_STREAM, SUBSPACE_CHANGE_STREAM, LOAD_STREAM, BASIS_STREAM = 0, 1, 2, 3
STREAM_STRIDE = 0x9E3779B9  # ⌊2³²/φ⌋, odd
# The attribute a parameter carries its place in the whole model under (see _param_ordinals).
IDENTITY = "_slimopt_identity"
# What _fused_step returns when auto mode could not compile the fused step.
NOT_COMPILED = object()
BASIS_KEYS = ("basis_left", "basis_right")


class GaLoreOptimizer(Optimizer):
    """Base shell: subclasses choose the update rule and its hyperparameter defaults."""

    rule: ClassVar[UpdateRule]
    default_states: ClassVar[str] = "fp32"
    # Hyperparameters of another rule that this optimizer's constructor takes for its groups of
    # that rule (TACO's betas and eps, for its AdamW fallback), by rule name.
    rule_defaults: ClassVar[dict[str, tuple[str, ...]]] = {}

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
        self._reset_private()
        storage = {**STORAGE_DEFAULTS, "states": self.default_states}
        super().__init__(params, {**defaults, "rule": None, **PROJECTION_DEFAULTS, **storage, **options})

    def _reset_private(self) -> None:
        """What the shell keeps besides torch.optim's defaults, state and groups: caches and
        links to this process's run, which a copy (``copy.deepcopy``, pickle) starts without."""
        self._ordinals: dict[Tensor, tuple[int, int, int]] | None = None
        self._shardings: dict[Tensor, RowSharding | None] = {}  # DTensors split by rows
        self._layerwise: Any = None  # the active slimopt.layerwise handle
        self._refresh_group: Any = None  # spread_refreshes: the processes that share refresh work
        self._decisions = Decisions()  # fused updates under finite flags not yet read (slimopt.finite)

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

        A group whose ``rule`` is not this optimizer's own takes that rule's defaults for the
        hyperparameters it does not set (``rule_defaults``), and this optimizer's ``lr`` and
        ``weight_decay``."""
        rule = param_group.get("rule")
        if rule in RULES and type(RULES[rule]) is not type(self.rule):
            for key, value in RULES[rule].defaults.items():
                if key not in self.rule_defaults.get(rule, ()):
                    param_group.setdefault(key, value)
        super().add_param_group(param_group)
        index = len(self.param_groups) - 1
        group = self.param_groups[index]
        if group.get("relative_step", False) is None:  # Adafactor's: relative exactly without an lr
            group["relative_step"] = group["lr"] is None
        errors = self._group_errors(group)
        if errors:
            self.param_groups.pop()
            raise ValueError(f"param group {index}: " + "; ".join(errors))
        self._ordinals = None
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

    def _group_errors(self, group: dict[str, Any]) -> list[str]:
        """One message per invalid setting of a complete param group."""
        if group.get("rule") is not None and group["rule"] not in RULES:
            valid = ", ".join(RULES)
            return [f"unknown rule {group['rule']!r}; valid: {valid} (or None: the optimizer's own)"]
        rule, owner = self.rule_of(group), type(self).__name__
        return group_errors(group, rule, owner) + _sharding_errors(group, rule, owner)

    def _fused(self, param: Tensor, group: dict[str, Any]) -> bool:
        """Whether ``param`` takes the fused step (``slimopt.kernels``): always with
        ``fused=True``, never with False, and with None (auto) on CUDA where one exists."""
        choice = group["fused"]
        if choice is False or param.is_meta:
            return False
        if choice is True:
            return True
        return (
            kernels.auto_available(param.device.type)
            and kernels.unsupported(self.rule_of(group), group, param) is None
        )

    @property
    def fused_path(self) -> list[str]:
        """Per param group, the path its updates take: "fused" or "reference" (why, for auto)."""
        paths = []
        for group in self.param_groups:
            params = [p for p in group["params"] if p.numel()]
            if params and all(self._fused(p, group) for p in params):
                paths.append("fused")
            elif group["fused"] is False:
                paths.append("reference (fused=False)")
            else:
                reasons = {kernels.unsupported(self.rule_of(group), group, p) for p in params} - {None}
                if not reasons and kernels.auto_failure():
                    reasons = {f"the fused step did not compile: {kernels.auto_failure()}"}
                devices = {p.device.type for p in params}
                why = (
                    "; ".join(sorted(reasons))
                    if reasons
                    else f"auto fuses on CUDA, parameters on {', '.join(sorted(devices))}"
                )
                paths.append(f"reference ({why})")
        return paths

    def _sharding(self, param: Tensor) -> RowSharding | None:
        """How ``param`` is split by rows (a collective the first time), or None."""
        if _expert_of(param) is not None:  # experts of split parameters are refused
            return None
        if param not in self._shardings:
            self._shardings[param] = row_sharding(param)
        return self._shardings[param]

    def _layout(self, param: Tensor, shape: torch.Size) -> torch.Size:
        """The shape that chooses the storage format of a moment of local ``shape``: the global
        one for a parameter split by rows, so every process stores it alike."""
        sharding = self._sharding(param)
        return shape if sharding is None else torch.Size((sharding.rows, *shape[1:]))

    def _agreed(self, param: Tensor, flag: bool) -> bool:
        """``flag``, agreed on by every process holding a shard of ``param`` (all of them true)."""
        sharding = self._sharding(param)
        return flag if sharding is None else sharding.all_agree(flag)

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
            (unit, g, grad)
            for g in self.param_groups
            for p in g["params"]
            if p.grad is not None
            for unit, grad in zip(self.units(p, g), self.units(local_view(p.grad), g), strict=True)
        ]
        decisions = self._decide([(p, g, grad) for p, g, grad in pending])
        ready = []
        for (param, group, grad), finite in zip(pending, decisions, strict=True):
            state = self.state_of(param)
            if not state:
                self._init_state(param, group, state)
            if finite is False:
                self._skip(param, state, "non-finite gradient")
                continue
            prepared = self.gradient_in_space(param, group, grad)
            if prepared is not None:
                ready.append((param, group, *prepared, finite))
        # A finite gradient can overflow when projected: projected ones are decided again.
        projected = [index for index, entry in enumerate(ready) if entry[3] is not None]
        again = self._decide([ready[i][:3] for i in projected])
        decisions = [entry[4] for entry in ready]
        for i, second in zip(projected, _both(decisions, projected, again), strict=True):
            decisions[i] = second
        with kernels.compile_settings():
            updates = list(zip(ready, decisions, strict=True))
            for (param, group, grad, basis, _), finite in self._apply_small_together(updates):
                self.apply_update(param, group, grad, basis, finite=finite)
        self._decisions.close_step()
        if self._decisions.on_host():
            self._settle_skips()
        return loss

    def _decide(self, entries: list[tuple[Tensor, dict[str, Any], Tensor]]) -> list[bool | Tensor]:
        """For each (parameter, group, gradient), whether the gradient is finite: a bool read on
        the host, or for a parameter on the fused path a flag left on the device (the fused
        step masks its writes with it; ``_settle_skips`` counts it later)."""
        flags = finite_flags([(p, _real(grad)) for p, _, grad in entries], self._sharding_group)
        on_device = [self._decides_on_device(p, g) for p, g, _ in entries]
        read = iter(finite_read([f for f, device in zip(flags, on_device, strict=True) if not device]))
        return [
            flag if device and flag is not None else True if device else next(read)
            for flag, device in zip(flags, on_device, strict=True)
        ]

    def _decides_on_device(self, param: Tensor, group: dict[str, Any]) -> bool:
        """Whether a step of ``param`` takes its non-finite decision on the device: on the fused
        path on a device of ``finite.DECIDED_ON_DEVICE``, once its state exists (a first step
        creates the state on the host)."""
        return (
            decided_on_device(param.device)
            and self._fused(param, group)
            and "moment_step" in self.state_of(param)
        )

    def _sharding_group(self, param: Tensor) -> Any:
        sharding = self._sharding(param)
        return None if sharding is None else sharding.group

    def _settle_skips(self) -> None:
        """Count the fused updates that a device flag skipped as not taken, as the reference
        path counts a skipped step (it neither advances the step nor ages the moments)."""
        for param in self._decisions.skipped():
            self._unstep(param, self.state_of(param))

    def _unstep(self, param: Tensor, state: dict[str, Any]) -> None:
        """Take back the count of a step that a non-finite gradient skipped, and report it."""
        state["step"] -= 1
        state["moment_step"] -= 1
        self._skip(param, state, "non-finite gradient")

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
        ``torch.optim.AdamW`` (see ``slimopt.loading``); moments keep this optimizer's storage.

        Raises ``ValueError`` when the state dict projects differently, comes from another
        update rule, or holds hyperparameters this optimizer rejects. Every state tensor keeps
        its saved dtype: ``torch.optim.Optimizer`` would cast fp32 moments and bases of bf16
        parameters to bf16 and break exact resumption.
        """
        self._settle_skips()  # counts of the steps before; the loaded ones replace them
        # torch.optim's hooks, run here around slimopt's own checks and conversions: a pre hook
        # may rewrite the state dict before it is checked, a post hook sees the loaded state.
        state_dict = state_dict.copy()
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            rewritten = hook(self, state_dict)
            state_dict = state_dict if rewritten is None else rewritten
        state_dict = loading.prepared(self, state_dict)
        pairs = zip(state_dict["param_groups"], self.param_groups, strict=True)
        for index, (saved, current) in enumerate(pairs):
            errors = self._group_errors({**saved, "params": current["params"]})
            if errors:
                raise ValueError(f"param group {index} of the state dict: " + "; ".join(errors))
        loading.check_state_keys(self, state_dict)
        storage = [{key: group[key] for key in loading.STORAGE_KEYS} for group in self.param_groups]
        saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        saved_state = state_dict["state"]
        with _hooks_set_aside(self):
            super().load_state_dict(state_dict)
        params = [p for group in self.param_groups for p in group["params"]]
        for saved_id, param in zip(saved_ids, params, strict=True):
            for key, value in saved_state.get(saved_id, {}).items():
                if isinstance(value, Tensor):
                    self.state[param][key] = value.to(device=param.device, copy=True)
        self._ordinals = None
        loading.restore_storage(self, storage)
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)

    # The per-parameter API: what step() does for one parameter, in the pieces a caller that
    # updates parameters one at a time needs (slimopt.layerwise does so inside backward). Each
    # takes the parameter and its param group; gradients are this process's values (the local
    # rows of an FSDP2 DTensor).

    def units(self, tensor: Tensor, group: dict[str, Any]) -> list[Tensor]:
        """What an update of ``tensor`` (a parameter of ``group``, or its gradient) works on:
        the tensor itself, or in a group with ``experts`` one view per expert (along the first
        dimension), each updated as a 2-D parameter with its own state (``state_of``)."""
        if not group["experts"]:
            return [tensor]
        views = []
        for index in range(tensor.shape[0]):
            view = tensor.detach()[index]
            view._slimopt_expert = (tensor, index)
            views.append(view)
        return views

    def state_of(self, unit: Tensor) -> MutableMapping[str, Any]:
        """The state of ``unit`` (from ``units``): a parameter's own, or an expert's part of its
        parameter's (the keys that start with ``expert{index}.``)."""
        expert = _expert_of(unit)
        if expert is None:
            return self.state[unit]
        return ExpertState(self.state[expert[0]], expert[1])

    def _ordinal_of(self, unit: Tensor) -> tuple[int, int, int]:
        """``_param_ordinals`` of ``unit``, an expert taking its parameter's."""
        expert = _expert_of(unit)
        return self._param_ordinals()[unit if expert is None else expert[0]]

    def projects(self, param: Tensor, group: dict[str, Any]) -> bool:
        """Whether ``param`` is projected (a non-empty tensor of two or more dimensions in a
        group with ``rank``)."""
        return is_projected(param, group)

    def gradient_norm(self, param: Tensor, grad: Tensor) -> Tensor:
        """The fp32 norm of the whole of ``param``'s gradient, of which ``grad`` is this
        process's part (all-reduced over the processes that hold the rest, under FSDP2)."""
        squared = torch.linalg.vector_norm(grad, dtype=torch.float32).square()
        sharding = self._sharding(param)
        if sharding is not None:
            sharding.all_reduce(squared)
        return squared.sqrt()

    @property
    def layerwise_handle(self) -> Any:
        """The active ``slimopt.layerwise`` handle, or None."""
        return self._layerwise

    def attach_layerwise(self, handle: Any) -> None:
        """Route ``step()`` and ``state_dict()`` through a ``slimopt.layerwise`` handle (None:
        back to normal stepping); the handle calls this itself."""
        self._layerwise = handle

    def needs_whole_gradient(self, param: Tensor, group: dict[str, Any]) -> bool:
        """Whether this step of ``param`` needs its whole gradient: it is not projected, or its
        basis is refreshed from this step's gradient."""
        return not self.projects(param, group) or self._refresh_due(self.state_of(param), group)

    def basis(self, param: Tensor, group: dict[str, Any]) -> Basis | None:
        """The fp32 basis of a projected ``param`` (decoded from its storage), or None."""
        state = self.state_of(param)
        factors = []
        for key, shape in zip(BASIS_KEYS, self._basis_shapes(param, group), strict=True):
            codec = moment_codec(group["basis_states"], "linear", shape)
            stored = {part: state.get(state_key(key, part)) for part in codec.parts}
            present = all(value is not None for value in stored.values())
            factors.append(codec.decode(stored, shape) if present else None)
        return None if factors == [None, None] else Basis(*factors)

    @staticmethod
    def _basis_shapes(param: Tensor, group: dict[str, Any]) -> tuple[torch.Size, torch.Size]:
        rows, cols = matrix_shape(param.shape)
        rank = min(group["rank"], rows, cols)
        return torch.Size((rows, rank)), torch.Size((rank, cols))

    def _store_basis(self, param: Tensor, group: dict[str, Any], basis: Basis) -> None:
        state = self.state_of(param)
        generator = None
        if group["basis_states"] == "bf16":  # stochastic rounding, seeded by parameter and step
            generator = torch.Generator(device="cpu" if param.is_meta else param.device)
            generator.manual_seed(_rounding_seed(state, BASIS_STREAM))
        for key, factor, shape in zip(BASIS_KEYS, basis, self._basis_shapes(param, group), strict=True):
            if factor is not None:
                codec = moment_codec(group["basis_states"], "linear", shape)
                for part, stored in codec.encode(factor, generator).items():
                    state[state_key(key, part)] = stored

    def gradient_in_space(
        self, param: Tensor, group: dict[str, Any], grad: Tensor
    ) -> tuple[Tensor, Basis | None] | None:
        """The gradient the rule sees and the basis it lives in (None: unprojected).

        A projected gradient is fp32; an unprojected one keeps its dtype (the update converts
        it a slice of rows at a time). Refreshes the basis of a projected matrix first when its
        refresh is due. Returns None (the update is skipped) when no basis could be computed yet.
        """
        if grad.is_sparse:
            raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
        state = self.state_of(param)
        if not state:
            self._init_state(param, group, state)
        if not self.projects(param, group):
            return _real(grad), None
        basis = self.refreshed_basis(param, group, grad)
        if basis is None:
            # Not a non-finite gradient (an all-zero one, an expert no token reached): warned
            # about, not counted in nonfinite_skips.
            self._warn(param, state, "no projection basis could be computed yet; update skipped")
            return None
        return project(_as_matrix(grad), basis), basis

    def refreshed_basis(self, param: Tensor, group: dict[str, Any], grad: Tensor) -> Basis | None:
        """The basis of a projected ``param`` for this step, refreshed from ``grad`` first when
        its refresh is due (None: no basis could be computed yet)."""
        state = self.state_of(param)
        if not state:
            self._init_state(param, group, state)
        if self._refresh_due(state, group):
            self._refresh(param, _as_matrix(grad).float(), state, group)
        return self.basis(param, group)

    def apply_update(
        self,
        param: Tensor,
        group: dict[str, Any],
        grad: Tensor,
        basis: Basis | None,
        finite: bool | Tensor | None = None,
    ) -> None:
        """Run the rule on ``grad`` (already in the basis' space) and update ``param``; skip the
        update when ``grad`` is not finite (``finite``: already decided by the caller, as
        ``step()`` does for all parameters at once, possibly as a flag on the device for the
        fused path; None: decided here)."""
        state = self.state_of(param)
        if finite is None:
            finite = self._agreed(param, all_finite(grad))
        keep = finite if isinstance(finite, Tensor) else None
        if keep is not None and not self._decides_on_device(param, group):
            finite, keep = bool(keep), None
        if finite is False:
            self._skip(param, state, "non-finite gradient")
            return
        if self._by_row_slices(param, group):
            self._apply_by_row_slices(param, group, grad, keep)
            return
        grad, layout, generator, age = self._begin(param, group, state, grad, basis)
        if self._fused(param, group) and self._fused_update(
            param, group, state, grad, basis, layout, age, generator, keep
        ):
            if keep is not None:
                self._decisions.record(param, keep)
            return
        self._reference_update(param, group, state, grad, basis, layout, age, generator, keep)

    def _reference_update(
        self,
        param: Tensor,
        group: dict[str, Any],
        state: dict[str, Any],
        grad: Tensor,
        basis: Basis | None,
        layout: torch.Size,
        age: int,
        generator: torch.Generator | None,
        keep: Tensor | None,
    ) -> None:
        """``apply_update``'s work through the reference path, after ``_begin`` (``keep``: a
        device flag the fused step would have masked by, when it did not compile)."""
        if keep is not None and not bool(keep):  # the fused step did not compile: decide here
            self._unstep(param, state)
            return
        moments = self._decode_all(state, group, grad.shape, layout)
        direction = self.rule_of(group).direction(grad, {**state, **moments}, age, group)
        for key, value in moments.items():
            self._encode(state, key, value, group, generator, layout)
        with _matrix_of(param) as weights:
            lr = self.rule_of(group).step_size(group, weights, state["step"])
            decay = group["weight_decay"]
            rounding = generator if _rounds_stochastically(param, group) else None
            if basis is None:
                _update_weights(weights, _as_matrix(direction), lr, 1.0, decay, rounding)
                return
            # Back-projected a slice of rows at a time: no full-size fp32 update of a large matrix.
            for _, rows in slices_to_update(*weights.shape, meta=weights.is_meta):
                _update_weights_projected(
                    weights, direction, basis, rows, lr, group["scale"], decay, rounding
                )

    def _begin(
        self,
        param: Tensor,
        group: dict[str, Any],
        state: dict[str, Any],
        grad: Tensor,
        basis: Basis | None,
        *,
        own_dtype: bool = False,
    ) -> tuple[Tensor, torch.Size, torch.Generator | None, int]:
        """An update's start: the fp32 gradient (in its own dtype with ``own_dtype``: for a
        step that reads bf16 itself), contiguous so that moments created like it and the
        direction have a 2-D view; the moments' layout; the rounding generator; the moments'
        age, counted (the moments created on the first update)."""
        grad = (grad if own_dtype else grad.float()).contiguous()
        layout = self._layout(param, grad.shape)
        generator = self._rounding_generator(param, state, group, layout)
        if "moment_step" not in state:
            rule = self.rule_of(group)
            for key, value in rule.init_state(grad.float(), group, projected=basis is not None).items():
                if key in rule.moment_kinds:
                    self._encode(state, key, value, group, generator, layout)
                else:
                    state[key] = value
            state["moment_step"] = 0
        return grad, layout, generator, self._advance(state)

    def _apply_small_together(
        self, updates: list[tuple[tuple[Any, ...], bool | Tensor]]
    ) -> list[tuple[tuple[Any, ...], bool | Tensor]]:
        """Update the small tensors among ``updates`` ((parameter, group, gradient, basis, _),
        decision) that ``_together`` admits in one ``kernels.adamw_steps`` call per device;
        return the others, in their order."""
        batches: dict[torch.device, list[tuple[tuple[Any, ...], bool | Tensor]]] = {}
        rest = []
        for update in updates:
            (param, group, _, basis, _), finite = update
            decided = finite is True or (isinstance(finite, Tensor) and self._decides_on_device(param, group))
            if decided and self._together(param, group, basis):
                batches.setdefault(param.device, []).append(update)
            else:
                rest.append(update)
        for batch in batches.values():
            if len(batch) < 2:
                rest += batch
            else:
                self._update_together(batch)
        return rest

    def _together(self, param: Tensor, group: dict[str, Any], basis: Basis | None) -> bool:
        """Whether ``param`` joins the grouped fused step (``kernels.adamw_steps``): unprojected,
        under ``MIN_COMPRESSED_NUMEL`` elements (so its moments are fp32 in every storage
        format), AdamW on the fused path, weights rounded to nearest."""
        if basis is not None or param.numel() >= MIN_COMPRESSED_NUMEL or param.is_complex():
            return False
        if not isinstance(self.rule_of(group), AdamWRule) or not self._fused(param, group):
            return False
        return not _rounds_stochastically(param, group) and _values(param).is_contiguous()

    def _update_together(self, batch: list[tuple[tuple[Any, ...], bool | Tensor]]) -> None:
        """``apply_update``'s work for every entry of ``batch`` in one ``kernels.adamw_steps``
        call. Where it does not compile (on CUDA: the Triton kernel) auto mode gives up the
        fused step, as ``_fused_step`` does, and updates the batch through the reference path;
        ``fused=True`` raises."""
        grads, moments, hypers, weights, keeps, begun = [], [], [], [], [], []
        for (param, group, grad, _, _), finite in batch:
            state = self.state_of(param)
            grad, layout, generator, age = self._begin(param, group, state, grad, None, own_dtype=True)
            values = _values(param)
            rule, step = self.rule_of(group), state["step"]
            hypers.append(kernels.adamw_hyperparameters(rule, group, values, step, age, grad.device))
            stored = self._stored_moments(state, group, layout, grad.device)
            moments.append(tuple(parts for parts, _, _ in stored.values()))
            grads.append(grad)
            weights.append(values)
            keeps.append(finite if isinstance(finite, Tensor) else None)
            begun.append((param, group, state, layout, age, generator))
        try:
            kernels.adamw_steps(grads, moments, torch.stack(hypers), weights, keeps)
        except kernels.compile_failures() as error:
            if any(group["fused"] is True for _, group, *_ in begun):
                raise
            _give_up_auto(error, stacklevel=5)
            entries = zip(begun, grads, keeps, strict=True)
            for (param, group, state, layout, age, generator), grad, keep in entries:
                self._reference_update(param, group, state, grad.float(), None, layout, age, generator, keep)
            return
        for ((param, _, _, _, _), _), keep in zip(batch, keeps, strict=True):
            if keep is not None:
                self._decisions.record(param, keep)

    def _fused_update(
        self,
        param: Tensor,
        group: dict[str, Any],
        state: dict[str, Any],
        grad: Tensor,
        basis: Basis | None,
        layout: torch.Size,
        age: int,
        generator: torch.Generator | None,
        keep: Tensor | None,
    ) -> bool:
        """``apply_update``'s work through the fused step, masked by the device flag ``keep``
        when there is one; False (nothing changed) when auto mode could not compile it, so the
        reference path takes over."""
        step = state["step"]
        with _matrix_of(param) as weights:
            moments = self._stored_moments(state, group, layout, grad.device)
            factored = _raw_factored(state)
            matrix = _as_matrix(grad)
            if basis is None:  # moments and weights in one fused step
                done = self._fused_step(group, matrix, moments, factored, age, step, weights, generator, keep)
                return done is not NOT_COMPILED
            direction = self._fused_step(group, matrix, moments, factored, age, step, None, generator, keep)
            if direction is NOT_COMPILED:
                return False
            lr = self.rule_of(group).step_size(group, weights, step)
            rounding = generator if _rounds_stochastically(param, group) else None
            decay = group["weight_decay"]
            for _, rows in slices_to_update(*weights.shape, meta=False):
                _update_weights_projected(
                    weights, direction, basis, rows, lr, group["scale"], decay, rounding, keep
                )
        return True

    def _moment_codecs(self, group: dict[str, Any], layout: torch.Size) -> dict[str, Any]:
        """The codec of each moment of the rule, by key, for storage chosen by ``layout``."""
        return {
            key: moment_codec(group["states"], kind, layout, group["block_size"])
            for key, kind in self.rule_of(group).moment_kinds.items()
        }

    def _stored_moments(
        self, state: dict[str, Any], group: dict[str, Any], layout: torch.Size, device: torch.device
    ) -> dict[str, kernels.Moment]:
        """Each moment of the rule that ``state`` holds, in the rule's order, as the fused step
        takes it: its stored parts, their ``Storage`` and its lookup tables (blocks only)."""
        return {
            key: _fused_moment(codec, _stored_parts(state, key, codec.parts), device)
            for key, codec in self._moment_codecs(group, layout).items()
            if state_key(key, codec.parts[0]) in state
        }

    def _fused_step(
        self,
        group: dict[str, Any],
        grad: Tensor,
        moments: dict[str, kernels.Moment],
        factored: tuple[Tensor, Tensor] | None,
        age: int,
        step: int,
        weights: Tensor | None,
        generator: torch.Generator | None,
        keep: Tensor | None = None,
    ) -> Tensor | None:
        """The rule's step through ``slimopt.kernels`` on the matrix ``grad``: ``moments``
        (``_stored_moments``, updated in place), Adafactor's raw ``factored`` statistics and
        ``weights`` (a contiguous matrix, updated in place, by the step size of the parameter's
        step ``step``), or, without weights, the direction returned. Stochastic roundings draw
        from ``generator`` in the reference path's order: the moments', then the weights'."""
        device = grad.device
        draws = sum(storage.stochastic for _, storage, _ in moments.values())
        draws += weights is not None and _rounds_stochastically(weights, group)
        seeds = tuple(stream_seed(generator, device) for _ in range(draws))
        rule, grad = self.rule_of(group), grad.contiguous()
        try:
            return kernels.fused_step(rule, group, grad, moments, factored, age, step, weights, seeds, keep)
        except kernels.compile_failures() as error:
            if group["fused"] is True:
                raise
            _give_up_auto(error, stacklevel=5)
            return NOT_COMPILED

    def _by_row_slices(self, param: Tensor, group: dict[str, Any], shape: torch.Size | None = None) -> bool:
        """Whether an update of ``param`` (and its moments' storage) goes by slices of rows;
        ``shape``: the values' shape, if not this process's (a saved shard's)."""
        shape = _values(param).shape if shape is None else shape
        return not self.projects(param, group) and self.rule_of(group).elementwise and sliced(shape)

    def _apply_by_row_slices(
        self, param: Tensor, group: dict[str, Any], grad: Tensor, keep: Tensor | None = None
    ) -> None:
        """An elementwise rule on a large unprojected matrix, one slice of rows at a time; its
        moments are stored by slices (``slimopt.codecs.rows``). ``keep``: as ``_fused_update``'s."""
        with _matrix_of(param) as weights:
            self._update_by_row_slices(param, weights, group, _as_matrix(grad), keep)

    def _update_by_row_slices(
        self, param: Tensor, weights: Tensor, group: dict[str, Any], grad: Tensor, keep: Tensor | None
    ) -> None:
        state = self.state_of(param)
        storages = self._row_storages(param, group)
        first = "moment_step" not in state
        if first:
            for key, storage in storages.items():
                for part, tensor in storage.allocate(param.device, _values(param).shape).items():
                    state[state_key(key, part)] = tensor
            state["moment_step"] = 0
        stored = {key: _stored_parts(state, key, storage.sizes) for key, storage in storages.items()}
        generator = self._rounding_generator(param, state, group, self._layout(param, grad.shape))
        age = self._advance(state)
        lr = self.rule_of(group).step_size(group, weights, state["step"])
        rounding = generator if _rounds_stochastically(param, group) else None
        fused, device = not first and self._fused(param, group), grad.device
        for index, rows in slices_to_update(*weights.shape, meta=weights.is_meta):
            slice_grad = grad[rows].float()
            if fused:
                moments = {
                    key: _fused_moment(storage.codecs[index][0], storage.parts(stored[key], index), device)
                    for key, storage in storages.items()
                }
                done = self._fused_step(
                    group, slice_grad, moments, None, age, state["step"], weights[rows], generator, keep
                )
                if done is not NOT_COMPILED:
                    continue
                fused = False
            if keep is not None:
                # The fused step did not compile: decide on the host (earlier slices were masked).
                if not bool(keep):
                    self._unstep(param, state)
                    return
                keep = None
            if first:
                moments = self.rule_of(group).init_state(slice_grad, group, projected=False)
            else:
                moments = {key: storage.decode(stored[key], index) for key, storage in storages.items()}
            direction = self.rule_of(group).direction(slice_grad, moments, age, group)
            for key, storage in storages.items():
                storage.encode(stored[key], index, moments[key], generator)
            _update_weights(weights[rows], direction, lr, 1.0, group["weight_decay"], rounding)
        if keep is not None:
            self._decisions.record(param, keep)

    def _row_storages(
        self, param: Tensor, group: dict[str, Any], shape: torch.Size | None = None
    ) -> dict[str, RowSlicedStorage]:
        """The slice-by-slice layout of each moment of a matrix updated by slices of rows
        (``shape``: as for ``_by_row_slices``)."""
        rows, cols = matrix_shape(_values(param).shape if shape is None else shape)
        return {
            key: row_sliced_storage(group["states"], kind, rows, cols, group["block_size"])
            for key, kind in self.rule_of(group).moment_kinds.items()
        }

    def decoded_state(self, param: Tensor) -> dict[str, Tensor]:
        """The fp32 value of every moment of ``param``, whatever its storage format.

        Unprojected moments have the parameter's shape (its real pairs, ``shape + (2,)``, for a
        complex parameter); a projected matrix's are in its rank-r space (``projected_shape``).
        Adafactor's factored statistics are returned as stored. Empty before the parameter's
        first update; raises ``KeyError`` for a tensor that is not a parameter of this optimizer.
        """
        group = self._group_of(param)
        if _expert_of(param) is not None:
            return self._decoded(param, group, self.state_of(param), param.shape, None)
        if group["experts"]:  # each expert's, stacked along the first dimension
            decoded = [self.decoded_state(unit) for unit in self.units(param, group)]
            # An expert not updated yet (no tokens routed to it, no basis yet) has the zero
            # moments its first update would start from.
            like = next((d for d in decoded if d), {})
            return {
                key: torch.stack([d[key] if d else torch.zeros_like(value) for d in decoded])
                for key, value in like.items()
            }
        sharding = self._sharding(param)
        rows = None if sharding is None else sharding.rows
        return self._decoded(param, group, self.state.get(param, {}), _values(param).shape, rows)

    def _decoded(
        self,
        param: Tensor,
        group: dict[str, Any],
        state: dict[str, Any],
        values: torch.Size,
        rows: int | None,
    ) -> dict[str, Tensor]:
        """``decoded_state`` of ``state``, stored by ``group``'s format for values of shape
        ``values``: this process's, or a saved shard's (a checkpoint written by another number
        of processes) of a parameter split by rows with ``rows`` rows in all (None: not split)."""
        if "moment_step" not in state:
            return {}
        moment_parts = set()
        if self.projects(param, group):
            shape = projected_shape(matrix_shape(values), self.basis(param, group))
        else:
            shape = values
        if self._by_row_slices(param, group, values):
            moments = {}
            for key, storage in self._row_storages(param, group, values).items():
                moments[key] = storage.decode_all(_stored_parts(state, key, storage.sizes)).view(shape)
                moment_parts |= {state_key(key, part) for part in storage.sizes}
        else:
            layout = shape if rows is None else torch.Size((rows, *shape[1:]))
            moments = self._decode_all(state, group, shape, layout)
            for key, codec in self._moment_codecs(group, layout).items():
                moment_parts |= {state_key(key, part) for part in codec.parts}
        for key, value in state.items():  # the rule's own statistics (Adafactor's factored ones)
            if isinstance(value, Tensor) and key not in moment_parts and key.split(".")[0] not in BASIS_KEYS:
                moments[key] = value
        return moments

    def _store_moments(self, param: Tensor, group: dict[str, Any], moments: dict[str, Tensor]) -> None:
        """Encode ``moments`` (as ``decoded_state`` gives them) with ``group``'s storage format
        into a state whose stored tensors have been removed."""
        state = self.state_of(param)
        layouts = {key: self._layout(param, value.shape) for key, value in moments.items()}
        generator = self._rounding_generator(param, state, group, next(iter(layouts.values())), LOAD_STREAM)
        storages = self._row_storages(param, group) if self._by_row_slices(param, group) else {}
        for key, value in moments.items():
            if key in storages:
                for part, stored in storages[key].encode_all(value, generator).items():
                    state[state_key(key, part)] = stored
            elif key in self.rule_of(group).moment_kinds:
                self._encode(state, key, value, group, generator, layouts[key])
            else:
                state[key] = value

    def _group_of(self, param: Tensor) -> dict[str, Any]:
        expert = _expert_of(param)
        param = param if expert is None else expert[0]
        for group in self.param_groups:
            if any(p is param for p in group["params"]):
                return group
        raise KeyError(f"tensor {tuple(param.shape)} is not a parameter of this optimizer")

    @staticmethod
    def _advance(state: dict[str, Any]) -> int:
        """Count one more step of ``state``; return the age of its moments."""
        state["step"] += 1
        state["moment_step"] += 1
        return state["moment_step"]

    def _init_state(self, param: Tensor, group: dict[str, Any], state: dict[str, Any]) -> None:
        if split_by_rows(param):
            # Checked at construction too; here for parameters split afterwards (accelerate's
            # FSDP2 puts the sharded parameters into an optimizer built before prepare()).
            errors = _sharding_errors({**group, "params": [param]}, self.rule_of(group), type(self).__name__)
            if errors:
                raise ValueError("; ".join(errors))
        ordinal, projected_ordinal, projected_count = self._ordinal_of(param)
        expert = _expert_of(param)
        state["step"] = 0
        state["nonfinite_skips"] = 0
        # Each expert of a stacked parameter draws its own numbers.
        state["seed"] = ordinal if expert is None else ordinal + (expert[1] + 1) * EXPERT_SEED_STRIDE
        if self.projects(param, group):
            gap = group["update_proj_gap"]
            state["refresh_offset"] = (projected_ordinal * gap) // projected_count if group["stagger"] else 0

    def _param_ordinals(self) -> dict[Tensor, tuple[int, int, int]]:
        """Map each parameter to (ordinal, ordinal among projected matrices, projected count):
        they seed its random draws and stagger its refreshes. A parameter that carries
        ``IDENTITY`` (``slimopt.distributed.zero_redundancy_optimizer`` stamps the whole model's
        on each) keeps those, so a process that holds some of the parameters draws as one that
        holds all of them."""
        if self._ordinals is None:
            projected = [p for g in self.param_groups for p in g["params"] if is_projected(p, g)]
            projected_index = {p: i for i, p in enumerate(projected)}
            every = [p for g in self.param_groups for p in g["params"]]
            self._ordinals = {
                p: getattr(p, IDENTITY, (i, projected_index.get(p, 0), max(len(projected), 1)))
                for i, p in enumerate(every)
            }
        return self._ordinals

    @staticmethod
    def _refresh_due(state: dict[str, Any], group: dict[str, Any]) -> bool:
        if not any(key.split(".")[0] in BASIS_KEYS for key in state):
            return True
        return (state["step"] - state["refresh_offset"]) % group["update_proj_gap"] == 0

    def _refresh(self, param: Tensor, grad: Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        """Replace the basis of ``param``; when the gradient is non-finite or all zero, or the
        decomposition fails, keep the old one and warn."""
        old = self.basis(param, group)
        has_old = old is not None
        if not self._agreed(param, all_finite(grad)):
            self._warn(param, state, "non-finite gradient at a projection refresh; keeping the old basis")
            return
        if not grad.is_meta and self._agreed(param, not bool(grad.any())):
            # Its singular vectors would be arbitrary: a random basis, and moments rotated away.
            # Without an old basis the update is skipped, and says so.
            if has_old:
                self._warn(param, state, "all-zero gradient at a projection refresh; keeping the old basis")
            return
        generator = None
        if group["proj_method"] == "subspace":
            # Seeded by parameter and step, so a resumed run draws the same random directions.
            generator = torch.Generator()
            generator.manual_seed(_step_seed(state))
        sides = projection_sides(matrix_shape(param.shape), group["proj_type"])

        def compute() -> Basis:
            sharding = self._sharding(param)
            return compute_basis(grad, group["rank"], sides, group["proj_method"], old, generator, sharding)

        try:
            if self._refresh_group is not None and self._sharding(param) is None:
                owner = self._ordinal_of(param)[1]
                new = compute_on_owner(compute, owner, sides, grad, group["rank"], self._refresh_group)
            else:
                new = compute()
        except RuntimeError as error:
            self._warn(param, state, f"projection refresh failed ({error}); keeping the old basis")
            return
        if not all(all_finite(b) for b in new if b is not None):
            self._warn(param, state, "projection refresh produced non-finite values; keeping the old basis")
            return
        if has_old and "moment_step" in state:
            self._carry_moments(param, state, group, projected_shape(grad.shape, old), old, new)
        self._store_basis(param, group, new)

    def _carry_moments(
        self,
        param: Tensor,
        state: dict[str, Any],
        group: dict[str, Any],
        shape: torch.Size,
        old: Basis,
        new: Basis,
    ) -> None:
        """Apply the group's ``on_subspace_change`` policy to the moments stored in ``old``'s basis
        (``shape``: the moments' local shape)."""
        policy = group["on_subspace_change"]
        if policy == "keep":
            return
        layout = self._layout(param, shape)
        generator = self._rounding_generator(param, state, group, layout, SUBSPACE_CHANGE_STREAM)
        for key, value in self._decode_all(state, group, shape, layout).items():
            if policy == "rotate":
                squared = self.rule_of(group).moment_kinds[key] == "square"
                value = rotate_moment(value, old, new, squared=squared)
            else:
                value = torch.zeros_like(value)
            self._encode(state, key, value, group, generator, layout)
        if policy == "reset":
            state["moment_step"] = 0

    def _decode_all(
        self, state: dict[str, Any], group: dict[str, Any], shape: torch.Size, layout: torch.Size
    ) -> dict[str, Tensor]:
        """The fp32 value of every stored moment of the rule; ``shape`` is the moments' (local)
        shape, ``layout`` the shape the storage format is chosen by (``_layout``)."""
        moments = {}
        for key, codec in self._moment_codecs(group, layout).items():
            stored = {part: state.get(state_key(key, part)) for part in codec.parts}
            if all(value is not None for value in stored.values()):
                moments[key] = codec.decode(stored, shape)
        return moments

    def _encode(
        self,
        state: dict[str, Any],
        key: str,
        value: Tensor,
        group: dict[str, Any],
        generator: torch.Generator | None,
        layout: torch.Size,
    ) -> None:
        kind = self.rule_of(group).moment_kinds[key]
        codec = moment_codec(group["states"], kind, layout, group["block_size"])
        for part, stored in codec.encode(value, generator).items():
            state[state_key(key, part)] = stored

    def _rounding_generator(
        self,
        param: Tensor,
        state: dict[str, Any],
        group: dict[str, Any],
        layout: torch.Size,
        stream: int = UPDATE_STREAM,
    ) -> torch.Generator | None:
        """A generator for stochastic rounding of the states (and of ``param``'s values, when it
        is bf16 and its group rounds stochastically), seeded by parameter, step and ``stream`` so
        that a resumed run rounds exactly as an uninterrupted one; None when nothing draws.

        Roundings of one step that follow each other (moments carried to a new basis, then
        updated) must draw from different streams: the same uniform numbers twice would make
        the pair biased."""
        kinds = set(self.rule_of(group).moment_kinds.values())
        codecs = [moment_codec(group["states"], kind, layout) for kind in kinds]
        if not _rounds_stochastically(param, group) and not any(codec.stochastic for codec in codecs):
            return None
        device = param.device
        generator = torch.Generator(device="cpu" if device.type == "meta" else device)
        generator.manual_seed(_rounding_seed(state, stream))
        return generator

    def _skip(self, param: Tensor, state: dict[str, Any], reason: str) -> None:
        state["nonfinite_skips"] += 1
        self._warn(param, state, f"{reason}; update skipped")

    def _warn(self, param: Tensor, state: dict[str, Any], message: str) -> None:
        ordinal = self._ordinal_of(param)[0]
        expert = _expert_of(param)
        which = f"parameter {ordinal}" + ("" if expert is None else f" expert {expert[1]}")
        warnings.warn(
            f"slimopt: {which} {tuple(param.shape)} at step {state['step']}: {message}",
            RuntimeWarning,
            stacklevel=4,
        )


# Experts' seeds: their parameter's ordinal plus a multiple of this (more than any model's
# parameter count, and odd, so the low 32 bits of the seeds differ too).
EXPERT_SEED_STRIDE = 100_003


def _sharding_errors(group: dict[str, Any], rule: UpdateRule, owner: str) -> list[str]:
    """DTensors split by rows are updated shard by shard, which is exact for an elementwise
    rule, and for a projection whose basis is on the unsplit side (right, r×n) found by the
    subspace method from all-reduced sketches."""
    errors = [error for p in group["params"] if (error := placement_error(p)) is not None]
    split = [p for p in group["params"] if split_by_rows(p)]
    if errors or not split:
        return errors
    if group["experts"]:
        return [
            f"experts=True: parameters {[tuple(p.shape) for p in split]} are split by rows "
            "(FSDP2), so no process holds whole experts to project; shard them by experts "
            "outside FSDP2, or leave them out of the experts group"
        ]
    if not rule.elementwise:
        return [
            f"{owner} needs whole-tensor statistics (RMS, factored means), but "
            f"parameters {[tuple(p.shape) for p in split]} are split by rows; use an AdamW "
            "optimizer under FSDP2"
        ]
    projected = [p for p in split if is_projected(p, group)]
    if projected and group["proj_method"] != "subspace":
        errors.append(
            f"proj_method={group['proj_method']!r} needs whole gradients, but parameters "
            f"{[tuple(p.shape) for p in projected]} are split by rows; use proj_method='subspace'"
        )
    left = [
        tuple(p.shape)
        for p in projected
        if group["proj_type"] in PROJ_TYPES and projection_sides(matrix_shape(p.shape), group["proj_type"])[0]
    ]
    if left:
        errors.append(
            f"proj_type={group['proj_type']!r} puts the basis of {left} on the rows, which are split "
            "across processes; use proj_type='right' (basis r×n, replicated) under FSDP2"
        )
    return errors


@contextmanager
def _hooks_set_aside(optimizer: Optimizer) -> Iterator[None]:
    """``optimizer`` without its load_state_dict hooks for a while (``load_state_dict`` runs
    them itself, around its own checks)."""
    pre, post = (
        optimizer._optimizer_load_state_dict_pre_hooks,
        optimizer._optimizer_load_state_dict_post_hooks,
    )
    optimizer._optimizer_load_state_dict_pre_hooks = type(pre)()
    optimizer._optimizer_load_state_dict_post_hooks = type(post)()
    try:
        yield
    finally:
        optimizer._optimizer_load_state_dict_pre_hooks = pre
        optimizer._optimizer_load_state_dict_post_hooks = post


def _give_up_auto(error: Exception, stacklevel: int) -> None:
    """Auto mode's answer to a fused step that did not compile: the reference path from now on
    (it promised only the fastest exact path, and the reference path is one), with a warning."""
    cause = getattr(error, "inner_exception", error)
    reason = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
    kernels.give_up_auto(reason)
    warnings.warn(
        f"slimopt: the fused step did not compile ({reason}); fused=None uses the reference path from now on",
        RuntimeWarning,
        stacklevel=stacklevel,
    )


def _expert_of(unit: Tensor) -> tuple[Tensor, int] | None:
    """(parameter, expert index) of a view made by ``GaLoreOptimizer.units``, else None."""
    return getattr(unit, "_slimopt_expert", None)


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


def _both(first: list[bool | Tensor], indices: list[int], second: list[bool | Tensor]) -> list[bool | Tensor]:
    """For each index, ``first[index]`` and the matching ``second`` decision combined: host
    bools by ``and``, device flags in one vector operation for all of them (not one per
    parameter)."""
    pairs = [(first[i], flag) for i, flag in zip(indices, second, strict=True)]
    on_device = [k for k, (a, b) in enumerate(pairs) if isinstance(a, Tensor) and isinstance(b, Tensor)]
    combined: list[bool | Tensor] = [
        False if a is False or b is False else b if a is True else a for a, b in pairs
    ]
    if on_device:
        vector = torch.stack([pairs[k][0] for k in on_device]) & torch.stack([pairs[k][1] for k in on_device])
        for position, k in enumerate(on_device):
            combined[k] = vector[position]
    return combined


def decoded_state(optimizer: GaLoreOptimizer, param: Tensor) -> dict[str, Tensor]:
    """The fp32 moments of ``param`` in ``optimizer``, whatever their storage format: in the
    parameter's shape, or a projected matrix's rank-r space (see
    ``GaLoreOptimizer.decoded_state``)."""
    return optimizer.decoded_state(param)


def _rounding_seed(state: dict[str, Any], stream: int) -> int:
    """The seed of a stream of rounding draws of this parameter and step.

    Update seeds are odd (the plain step seed belongs to the projection refresh's sketch). The
    CPU generator (mt19937) keeps only the low 32 bits of a seed, so streams differ there: an odd
    multiple of ⌊2³²/φ⌋ makes a subspace change's seeds even, never an update's."""
    return _step_seed(state) * 2 + 1 + stream * STREAM_STRIDE


def _step_seed(state: dict[str, Any]) -> int:
    """A seed unique to this parameter and step, so a resumed run draws what an uninterrupted
    one would."""
    return state["seed"] * 1_000_003 + state["step"]


def _values(param: Tensor) -> Tensor:
    """The values an update works on: this process's shard of a DTensor, as real pairs if complex
    (an alias of the parameter)."""
    return _real(local_view(param))


def _real(tensor: Tensor) -> Tensor:
    """A complex tensor as real pairs (``torch.view_as_real``, as torch.optim does), else itself."""
    return torch.view_as_real(tensor) if tensor.is_complex() else tensor


def _as_matrix(tensor: Tensor) -> Tensor:
    """``tensor`` as ``shape[0] × rest`` (one row for a vector or a scalar): a view where the
    layout allows one, else a copy. A ``OneSparse`` direction (TACO's, of a matrix) is one already."""
    return tensor if isinstance(tensor, OneSparse) else tensor.reshape(matrix_shape(tensor.shape))


@contextmanager
def _matrix_of(param: Tensor) -> Iterator[Tensor]:
    """A writable ``shape[0] × rest`` view of ``param``'s values (of its real pairs, if complex).
    A parameter whose layout has no such view (channels_last) is updated in a contiguous copy
    that is written back at the end."""
    values = _values(param)
    if values.is_contiguous():
        yield _as_matrix(values)
        return
    copy = values.contiguous()
    yield _as_matrix(copy)
    values.copy_(copy)


def _rounds_stochastically(param: Tensor, group: dict[str, Any]) -> bool:
    return group["param_rounding"] == "stochastic" and param.dtype == torch.bfloat16


def _update_weights(
    weights: Tensor,
    direction: Tensor | OneSparse,
    lr: float | Tensor,
    scale: float,
    weight_decay: float,
    generator: torch.Generator | None = None,
) -> None:
    """``w ← w·(1 − lr·wd) − lr·scale·direction`` in fp32, rounded once into ``weights``: to
    nearest, or, when ``generator`` is given (for bf16 ``weights`` only), stochastically."""
    target = weights if weights.dtype == torch.float32 else weights.float()
    if weight_decay != 0:
        target.mul_(1 - lr * weight_decay)
    if isinstance(direction, OneSparse):  # TACO's: one entry per column
        direction.add_to(target, alpha=-lr * scale)
    elif isinstance(lr, Tensor):  # a step size computed on the device, without a host sync
        target.sub_(direction.mul_(lr * scale))
    else:
        target.add_(direction, alpha=-lr * scale)
    if target is weights:
        return
    if generator is not None:
        weights.copy_(round_to_bf16_stochastically(target, generator))
    else:
        weights.copy_(target)


def _update_weights_projected(
    weights: Tensor,
    direction: Tensor,
    basis: Basis,
    rows: slice,
    lr: float | Tensor,
    scale: float,
    weight_decay: float,
    generator: torch.Generator | None = None,
    keep: Tensor | None = None,
) -> None:
    """``_update_weights`` of ``rows`` of a projected matrix, with the direction projected back
    into them by one ``addmm_`` (no rows×n temporary); rounded once into bf16 ``weights``.
    ``keep``: the fused step's device flag; where False the direction is zero, and the decay
    is skipped too, so the weights stay as they are."""
    part = weights[rows]
    if isinstance(lr, Tensor):  # a step size on the device: addmm_ takes only numbers
        _update_weights(part, project_back(direction, basis, rows), lr, scale, weight_decay, generator)
        return
    target = part if part.dtype == torch.float32 else part.float()
    if weight_decay != 0:
        decay = 1 - lr * weight_decay
        target.mul_(decay if keep is None else torch.where(keep, decay, 1.0))
    add_projected_back(target, direction, basis, rows, alpha=-lr * scale)
    if target is part:
        return
    part.copy_(target if generator is None else round_to_bf16_stochastically(target, generator))


def _fused_moment(codec: Any, parts: dict[str, Tensor], device: torch.device) -> kernels.Moment:
    """A moment as the fused step takes it: stored ``parts``, their ``Storage`` and the codec's
    lookup tables (blocks only)."""
    storage = kernels.storage_of(codec)
    return parts, storage, codec.tables(device) if storage.kind == "blockwise" else ()


def _raw_factored(state: dict[str, Any]) -> tuple[Tensor, Tensor] | None:
    """Adafactor's row and column statistics where it keeps them unencoded (a matrix's
    factored second moment), else None."""
    if "exp_avg_sq_row" not in state:
        return None
    return state["exp_avg_sq_row"], state["exp_avg_sq_col"]


def _stored_parts(state: dict[str, Any], key: str, parts: Iterable[str]) -> dict[str, Tensor]:
    """The stored tensors of moment ``key``, by part."""
    return {part: state[state_key(key, part)] for part in parts}


class GaLoreAdamW(GaLoreOptimizer):
    """AdamW whose param groups with a ``rank`` key run in a GaLore low-rank subspace.

    Groups without ``rank`` reproduce ``torch.optim.AdamW``. Projection options (per group, or
    as keyword defaults here): ``rank``, ``update_proj_gap`` (200), ``scale`` (0.25),
    ``proj_type`` ({"std", "reverse_std", "left", "right", "full"}, "std"), ``proj_method``
    ({"subspace", "svd"}, "subspace"), ``on_subspace_change`` ({"keep", "reset", "rotate"},
    "rotate"), ``stagger`` (True: spread refreshes over the gap) and ``basis_states`` ({"fp32",
    "bf16", "int8"}, "fp32": how the basis is stored). Storage options (per group too):
    ``states`` ({"fp32", "bf16", "int8", "int4", "ternary"}) and ``block_size`` (a power of two;
    None for the format's default).
    """

    rule = AdamWRule()

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = AdamWRule.defaults["betas"],
        eps: float = AdamWRule.defaults["eps"],
        weight_decay: float = 1e-2,
        **options: Any,
    ) -> None:
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults, options)


class GaLoreAdafactor(GaLoreOptimizer):
    """Adafactor (Hugging Face formulation) with GaLore projection for groups with ``rank``.

    ``lr=None`` uses Adafactor's relative step size. Projected matrices keep a whole second
    moment in the r×n space; unprojected matrices keep factored row/column statistics.
    Projection and storage options as for :class:`GaLoreAdamW`.
    """

    rule = AdafactorRule()

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float | None = None,
        eps: tuple[float, float] = AdafactorRule.defaults["eps"],
        clip_threshold: float = AdafactorRule.defaults["clip_threshold"],
        decay_rate: float = AdafactorRule.defaults["decay_rate"],
        beta1: float | None = AdafactorRule.defaults["beta1"],
        weight_decay: float = 0.0,
        scale_parameter: bool = AdafactorRule.defaults["scale_parameter"],
        relative_step: bool | None = AdafactorRule.defaults["relative_step"],
        warmup_init: bool = AdafactorRule.defaults["warmup_init"],
        **options: Any,
    ) -> None:
        defaults = {
            "lr": lr,
            "eps": eps,
            "clip_threshold": clip_threshold,
            "decay_rate": decay_rate,
            "beta1": beta1,
            "weight_decay": weight_decay,
            "scale_parameter": scale_parameter,
            "relative_step": lr is None if relative_step is None else relative_step,
            "warmup_init": warmup_init,
        }
        super().__init__(params, defaults, options)


class GaLoreAdamW8bit(GaLoreAdamW):
    """GaLoreAdamW with block-wise 8-bit moments (``states="int8"``); without ``rank`` groups it
    is a plain 8-bit AdamW, exported as ``AdamW8bit``."""

    default_states = "int8"


class AdamW4bit(GaLoreAdamW):
    """AdamW with 4-bit moments (``states="int4"``); groups with ``rank`` are projected."""

    default_states = "int4"


class AdamWTernary(GaLoreAdamW):
    """AdamW with a ternary first moment and a factored second moment (``states="ternary"``);
    groups with ``rank`` are projected."""

    default_states = "ternary"


class TACO(GaLoreOptimizer):
    """TACO: each matrix moves by one entry per column (its largest, ±m/n; ``slimopt.rules.taco``),
    taken from a per-column sketch of the gradient history (``k`` slots, ``beta``). Its groups
    take 2-D weights in ``nn.Linear``'s out × in layout (``transposed=True``: in × out);
    embeddings, the output head and vectors go to fallback groups with ``rule="adamw"`` (and
    AdamW's ``betas`` and ``eps``), as ``build_optimizer(model, "taco")`` arranges. Storage
    options apply to the fallback groups' moments.
    """

    rule = TACORule()
    rule_defaults: ClassVar[dict[str, tuple[str, ...]]] = {"adamw": ("betas", "eps")}

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 3e-3,  # the best rate most often in benchmarks/taco.py (1e-3 to 1e-2)
        k: int = TACO_DEFAULTS["k"],
        beta: float = TACO_DEFAULTS["beta"],
        sketch_values: str = TACO_DEFAULTS["sketch_values"],
        history: str = TACO_DEFAULTS["history"],
        transposed: bool = TACORule.defaults["transposed"],
        betas: tuple[float, float] = AdamWRule.defaults["betas"],
        eps: float = AdamWRule.defaults["eps"],
        weight_decay: float = 0.0,
        **options: Any,
    ) -> None:
        defaults = {
            "lr": lr,
            "k": k,
            "beta": beta,
            "sketch_values": sketch_values,
            "history": history,
            "transposed": transposed,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
        }
        super().__init__(params, defaults, options)


AdamW8bit = GaLoreAdamW8bit
