"""The ``torch.optim.Optimizer`` shell that composes an update rule with a GaLore projection.

The shell keeps param groups, step counts, the refresh schedule and ``state_dict``; the math
lives in ``slimopt.rules`` and the basis in ``slimopt.projection``. A param group is projected
iff it has a ``rank`` key (galore-torch's convention); its parameters with two or more
dimensions are projected (conv kernels are flattened to ``shape[0] × rest``), 1-D ones get the
plain rule. All arithmetic is fp32 whatever the parameter dtype.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import torch
from torch import Tensor
from torch.optim import Optimizer

from slimopt.projection import PROJ_METHODS, PROJ_TYPES, Basis, compute_basis, project, project_back
from slimopt.projection import rotate as rotate_moment
from slimopt.projection import sides as projection_sides
from slimopt.rules import AdafactorRule, AdamWRule, UpdateRule

SUBSPACE_POLICIES = ("keep", "reset", "rotate")

PROJECTION_DEFAULTS: dict[str, Any] = {
    "update_proj_gap": 200,
    "scale": 0.25,
    "proj_type": "std",
    "proj_method": "subspace",
    "on_subspace_change": "rotate",
    "stagger": True,
}


class GaLoreOptimizer(Optimizer):
    """Base shell: subclasses choose the update rule and its hyperparameter defaults."""

    rule: ClassVar[UpdateRule]

    def __init__(
        self, params: Iterable[Tensor] | Iterable[dict[str, Any]], defaults: dict[str, Any], projection: dict
    ) -> None:
        unknown = sorted(set(projection) - set(PROJECTION_DEFAULTS) - {"rank"})
        if unknown:
            raise TypeError(
                f"unknown option(s) {', '.join(unknown)}; valid projection options: "
                f"rank, {', '.join(PROJECTION_DEFAULTS)}"
            )
        if projection.get("rank") is None:
            projection.pop("rank", None)
        self._ordinals: dict[Tensor, tuple[int, int, int]] | None = None
        super().__init__(params, {**defaults, **PROJECTION_DEFAULTS, **projection})

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group (see ``torch.optim.Optimizer``); raises ``ValueError`` for bad hyperparameters."""
        super().add_param_group(param_group)
        index = len(self.param_groups) - 1
        group = self.param_groups[index]
        errors = self.rule.validate(group) + _weight_decay_errors(group) + _projection_errors(group)
        if errors:
            self.param_groups.pop()
            raise ValueError(f"param group {index}: " + "; ".join(errors))
        self._ordinals = None

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Take one optimization step; ``closure`` re-evaluates the loss and returns it."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    self._update(param, group)
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict, keeping every state tensor in its saved dtype.

        ``torch.optim.Optimizer`` casts floating state to the parameter dtype, which would turn
        fp32 moments and bases of bf16 parameters into bf16 and break exact resumption.
        """
        saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        saved_state = state_dict["state"]
        super().load_state_dict(state_dict)
        params = [p for group in self.param_groups for p in group["params"]]
        for saved_id, param in zip(saved_ids, params, strict=True):
            for key, value in saved_state.get(saved_id, {}).items():
                if isinstance(value, Tensor):
                    self.state[param][key] = value.to(device=param.device, copy=True)
        self._ordinals = None

    def _update(self, param: Tensor, group: dict[str, Any]) -> None:
        if param.grad.is_sparse:
            raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
        state = self.state[param]
        if not state:
            self._init_state(param, group, state)
        projected = "rank" in group and param.dim() >= 2
        grad = param.grad.float()
        basis = None
        if projected:
            grad = grad.reshape(param.shape[0], -1)
            if self._refresh_due(state, group):
                self._refresh(param, grad, state, group)
            basis = Basis(state.get("basis_left"), state.get("basis_right"))
            if basis.left is None and basis.right is None:
                self._skip(param, state, "no projection basis could be computed yet")
                return
            grad = project(grad, basis)
        if not _all_finite(grad):
            self._skip(param, state, "non-finite gradient")
            return
        if "moment_step" not in state:
            state.update(self.rule.init_state(grad, group, projected=projected))
            state["moment_step"] = 0
        state["step"] += 1
        state["moment_step"] += 1
        age = state["moment_step"]
        direction = self.rule.direction(grad, state, age, group)
        scale = 1.0
        if basis is not None:
            direction = project_back(direction, basis).view(param.shape)
            scale = group["scale"]
        weights = param if param.dtype == torch.float32 else param.float()
        lr = self.rule.step_size(group, weights, age)
        if group["weight_decay"] != 0:
            weights.mul_(1 - lr * group["weight_decay"])
        weights.add_(direction, alpha=-lr * scale)
        if weights is not param:
            param.copy_(weights)

    def _init_state(self, param: Tensor, group: dict[str, Any], state: dict[str, Any]) -> None:
        ordinal, projected_ordinal, projected_count = self._param_ordinals()[param]
        state["step"] = 0
        state["nonfinite_skips"] = 0
        if "rank" in group and param.dim() >= 2:
            state["seed"] = ordinal
            gap = group["update_proj_gap"]
            state["refresh_offset"] = (projected_ordinal * gap) // projected_count if group["stagger"] else 0

    def _param_ordinals(self) -> dict[Tensor, tuple[int, int, int]]:
        """Map each parameter to (ordinal, ordinal among projected matrices, projected count)."""
        if self._ordinals is None:
            projected = [p for g in self.param_groups if "rank" in g for p in g["params"] if p.dim() >= 2]
            projected_index = {p: i for i, p in enumerate(projected)}
            every = [p for g in self.param_groups for p in g["params"]]
            self._ordinals = {
                p: (i, projected_index.get(p, 0), max(len(projected), 1)) for i, p in enumerate(every)
            }
        return self._ordinals

    @staticmethod
    def _refresh_due(state: dict[str, Any], group: dict[str, Any]) -> bool:
        if "basis_left" not in state and "basis_right" not in state:
            return True
        return (state["step"] - state["refresh_offset"]) % group["update_proj_gap"] == 0

    def _refresh(self, param: Tensor, grad: Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        """Replace the basis of ``param``; on failure keep the old one and warn."""
        old = Basis(state.get("basis_left"), state.get("basis_right"))
        has_old = old.left is not None or old.right is not None
        if not _all_finite(grad):
            self._warn(param, state, "non-finite gradient at a projection refresh; keeping the old basis")
            return
        generator = None
        if group["proj_method"] == "subspace":
            # Seeded by parameter and step, so a resumed run draws the same random directions.
            generator = torch.Generator()
            generator.manual_seed(state["seed"] * 1_000_003 + state["step"])
        try:
            new = compute_basis(
                grad,
                group["rank"],
                projection_sides(tuple(grad.shape), group["proj_type"]),
                group["proj_method"],
                old if has_old else None,
                generator,
            )
        except RuntimeError as error:
            self._warn(param, state, f"projection refresh failed ({error}); keeping the old basis")
            return
        if not all(_all_finite(b) for b in new if b is not None):
            self._warn(param, state, "projection refresh produced non-finite values; keeping the old basis")
            return
        if has_old and "moment_step" in state:
            self._carry_moments(state, old, new, group["on_subspace_change"])
        for key, factor in (("basis_left", new.left), ("basis_right", new.right)):
            if factor is not None:
                state[key] = factor

    def _carry_moments(self, state: dict[str, Any], old: Basis, new: Basis, policy: str) -> None:
        moments = [key for key in self.rule.moment_kinds if key in state]
        if policy == "rotate":
            for key in moments:
                squared = self.rule.moment_kinds[key] == "square"
                state[key] = rotate_moment(state[key], old, new, squared=squared)
        elif policy == "reset":
            for key in moments:
                state[key].zero_()
            state["moment_step"] = 0

    def _skip(self, param: Tensor, state: dict[str, Any], reason: str) -> None:
        state["nonfinite_skips"] += 1
        self._warn(param, state, f"{reason}; update skipped")

    def _warn(self, param: Tensor, state: dict[str, Any], message: str) -> None:
        ordinal = self._param_ordinals()[param][0]
        warnings.warn(
            f"slimopt: parameter {ordinal} {tuple(param.shape)} at step {state['step']}: {message}",
            RuntimeWarning,
            stacklevel=4,
        )


def _all_finite(tensor: Tensor) -> bool:
    """Whether every element is finite. A sum is finite only if all elements are, and costs a
    fraction of ``isfinite().all()``; the exact test runs only when the sum overflows or is NaN."""
    return bool(tensor.sum().isfinite()) or bool(torch.isfinite(tensor).all())


def _projection_errors(group: dict[str, Any]) -> list[str]:
    if "rank" not in group:
        return []
    errors = []
    rank, gap = group["rank"], group["update_proj_gap"]
    if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
        errors.append(f"rank must be a positive integer, got {rank!r}")
    if isinstance(gap, bool) or not isinstance(gap, int) or gap <= 0:
        errors.append(f"update_proj_gap must be a positive integer, got {gap!r}")
    if not isinstance(group["scale"], (int, float)) or not group["scale"] > 0:
        errors.append(f"scale must be a positive number, got {group['scale']!r}")
    for key, valid in (
        ("proj_type", PROJ_TYPES),
        ("proj_method", PROJ_METHODS),
        ("on_subspace_change", SUBSPACE_POLICIES),
    ):
        if group[key] not in valid:
            errors.append(f"unknown {key} {group[key]!r}; valid: {', '.join(valid)}")
    return errors


def _weight_decay_errors(group: dict[str, Any]) -> list[str]:
    wd = group["weight_decay"]
    return [] if wd >= 0 else [f"weight_decay must be >= 0, got {wd!r}"]


class GaLoreAdamW(GaLoreOptimizer):
    """AdamW whose param groups with a ``rank`` key run in a GaLore low-rank subspace.

    Groups without ``rank`` reproduce ``torch.optim.AdamW``. Projection options (per group, or
    as keyword defaults here): ``rank``, ``update_proj_gap`` (200), ``scale`` (0.25),
    ``proj_type`` ({"std", "reverse_std", "left", "right", "full"}, "std"), ``proj_method``
    ({"subspace", "svd"}, "subspace"), ``on_subspace_change`` ({"keep", "reset", "rotate"},
    "rotate") and ``stagger`` (True: spread refreshes over the gap).
    """

    rule = AdamWRule()

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        **projection: Any,
    ) -> None:
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults, projection)


class GaLoreAdafactor(GaLoreOptimizer):
    """Adafactor (Hugging Face formulation) with GaLore projection for groups with ``rank``.

    ``lr=None`` uses Adafactor's relative step size. Projected matrices keep a whole second
    moment in the r×n space; unprojected matrices keep factored row/column statistics.
    Projection options as for :class:`GaLoreAdamW`.
    """

    rule = AdafactorRule()

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float | None = None,
        eps: tuple[float, float] = (1e-30, 1e-3),
        clip_threshold: float = 1.0,
        decay_rate: float = -0.8,
        beta1: float | None = None,
        weight_decay: float = 0.0,
        scale_parameter: bool = True,
        relative_step: bool | None = None,
        warmup_init: bool = False,
        **projection: Any,
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
        super().__init__(params, defaults, projection)
