"""The ``torch.optim.Optimizer`` shell: update rule × GaLore projection × state storage.

The shell keeps param groups, step counts, the refresh schedule and ``state_dict``; the math
lives in ``slimopt.rules``, the basis in ``slimopt.projection`` and the stored form of the
moments in ``slimopt.codecs``. Each step decodes one parameter's moments to fp32, runs the rule
and encodes them again. A param group is projected
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

from slimopt.codecs import STATE_FORMATS, moment_codec, state_key
from slimopt.codecs.rows import row_sliced_storage, row_slices, sliced
from slimopt.projection import (
    PROJ_METHODS,
    PROJ_TYPES,
    Basis,
    compute_basis,
    project,
    project_back,
    projected_shape,
)
from slimopt.projection import rotate as rotate_moment
from slimopt.projection import sides as projection_sides
from slimopt.rules import AdafactorRule, AdamWRule, UpdateRule

SUBSPACE_POLICIES = ("keep", "reset", "rotate")
# How a projection basis is stored: entries of orthonormal vectors lose little to 8 bits.
BASIS_STATES = ("fp32", "bf16", "int8")
BASIS_KEYS = ("basis_left", "basis_right")

PROJECTION_DEFAULTS: dict[str, Any] = {
    "update_proj_gap": 200,
    "scale": 0.25,
    "proj_type": "std",
    "proj_method": "subspace",
    "on_subspace_change": "rotate",
    "stagger": True,
    "basis_states": "fp32",
}

STORAGE_DEFAULTS: dict[str, Any] = {"states": "fp32", "block_size": None}


class GaLoreOptimizer(Optimizer):
    """Base shell: subclasses choose the update rule and its hyperparameter defaults."""

    rule: ClassVar[UpdateRule]
    default_states: ClassVar[str] = "fp32"

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        defaults: dict[str, Any],
        options: dict[str, Any],
    ) -> None:
        valid = ["rank", *PROJECTION_DEFAULTS, *STORAGE_DEFAULTS]
        unknown = sorted(set(options) - set(valid))
        if unknown:
            raise TypeError(f"unknown option(s) {', '.join(unknown)}; valid options: {', '.join(valid)}")
        if options.get("rank") is None:
            options.pop("rank", None)
        self._ordinals: dict[Tensor, tuple[int, int, int]] | None = None
        self._layerwise: Any = None  # the active slimopt.layerwise handle
        storage = {**STORAGE_DEFAULTS, "states": self.default_states}
        super().__init__(params, {**defaults, **PROJECTION_DEFAULTS, **storage, **options})

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group (see ``torch.optim.Optimizer``); raises ``ValueError`` for bad hyperparameters."""
        super().add_param_group(param_group)
        index = len(self.param_groups) - 1
        group = self.param_groups[index]
        errors = (
            self.rule.validate(group)
            + _weight_decay_errors(group)
            + _storage_errors(group)
            + _projection_errors(group)
        )
        if errors:
            self.param_groups.pop()
            raise ValueError(f"param group {index}: " + "; ".join(errors))
        self._ordinals = None

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
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    self._update(param, group)
        return loss

    def state_dict(self) -> dict[str, Any]:
        """The ``torch.optim`` state dict; raises ``RuntimeError`` halfway through a layer-wise
        accumulation, whose partial sums it could not hold."""
        handle = getattr(self, "_layerwise", None)
        if handle is not None and handle.pending:
            raise RuntimeError(
                f"layer-wise accumulation is at micro-batch {handle.micro_step} of "
                f"{handle.accumulation_steps}: save between optimizer steps"
            )
        return super().state_dict()

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
        prepared = self._gradient_in_space(param, group, param.grad)
        if prepared is not None:
            self._apply_update(param, group, *prepared)

    def _projects(self, param: Tensor, group: dict[str, Any]) -> bool:
        return "rank" in group and param.dim() >= 2

    def _needs_full_gradient(self, param: Tensor, group: dict[str, Any]) -> bool:
        """Whether this step of ``param`` needs its whole gradient: it is not projected, or its
        basis is refreshed from this step's gradient."""
        return not self._projects(param, group) or self._refresh_due(self.state[param], group)

    def _basis(self, param: Tensor, group: dict[str, Any]) -> Basis | None:
        """The fp32 basis of a projected ``param`` (decoded from its storage), or None."""
        state = self.state[param]
        factors = []
        for key, shape in zip(BASIS_KEYS, self._basis_shapes(param, group), strict=True):
            codec = moment_codec(group["basis_states"], "linear", shape)
            stored = {part: state.get(state_key(key, part)) for part in codec.parts}
            present = all(value is not None for value in stored.values())
            factors.append(codec.decode(stored, shape) if present else None)
        return None if factors == [None, None] else Basis(*factors)

    @staticmethod
    def _basis_shapes(param: Tensor, group: dict[str, Any]) -> tuple[torch.Size, torch.Size]:
        rows, cols = _as_matrix(param).shape
        rank = min(group["rank"], rows, cols)
        return torch.Size((rows, rank)), torch.Size((rank, cols))

    def _store_basis(self, param: Tensor, group: dict[str, Any], basis: Basis) -> None:
        state = self.state[param]
        generator = None
        if group["basis_states"] == "bf16":  # stochastic rounding, seeded like the refresh
            generator = torch.Generator(device="cpu" if param.is_meta else param.device)
            generator.manual_seed(_step_seed(state))
        for key, factor, shape in zip(BASIS_KEYS, basis, self._basis_shapes(param, group), strict=True):
            if factor is not None:
                codec = moment_codec(group["basis_states"], "linear", shape)
                for part, stored in codec.encode(factor, generator).items():
                    state[state_key(key, part)] = stored

    def _gradient_in_space(
        self, param: Tensor, group: dict[str, Any], grad: Tensor
    ) -> tuple[Tensor, Basis | None] | None:
        """The gradient the rule sees and the basis it lives in (None: unprojected).

        A projected gradient is fp32; an unprojected one keeps its dtype (the update converts
        it a slice of rows at a time). Refreshes the basis of a projected matrix first when its
        refresh is due. Returns None (the update is skipped) when no basis could be computed yet.
        """
        if grad.is_sparse:
            raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
        state = self.state[param]
        if not state:
            self._init_state(param, group, state)
        if not self._projects(param, group):
            return grad, None
        basis = self._refreshed_basis(param, group, grad)
        if basis is None:
            self._skip(param, state, "no projection basis could be computed yet")
            return None
        return project(grad.reshape(param.shape[0], -1), basis), basis

    def _refreshed_basis(self, param: Tensor, group: dict[str, Any], grad: Tensor) -> Basis | None:
        """The basis of a projected ``param`` for this step, refreshed from ``grad`` first when
        its refresh is due (None: no basis could be computed yet)."""
        state = self.state[param]
        if not state:
            self._init_state(param, group, state)
        if self._refresh_due(state, group):
            self._refresh(param, grad.reshape(param.shape[0], -1).float(), state, group)
        return self._basis(param, group)

    def _apply_update(self, param: Tensor, group: dict[str, Any], grad: Tensor, basis: Basis | None) -> None:
        """Run the rule on ``grad`` (already in the basis' space) and update ``param``."""
        state = self.state[param]
        if not _all_finite(grad):
            self._skip(param, state, "non-finite gradient")
            return
        if basis is None and self.rule.elementwise and sliced(param.shape):
            self._apply_by_row_slices(param, group, grad)
            return
        grad = grad.float()
        generator = self._rounding_generator(param, state, group, grad.shape)
        if "moment_step" not in state:
            for key, value in self.rule.init_state(grad, group, projected=basis is not None).items():
                if key in self.rule.moment_kinds:
                    self._encode(state, key, value, group, generator)
                else:
                    state[key] = value
            state["moment_step"] = 0
        age = self._advance(state)
        moments = self._decode_all(state, group, grad.shape)
        direction = self.rule.direction(grad, {**state, **moments}, age, group)
        for key, value in moments.items():
            self._encode(state, key, value, group, generator)
        lr = self.rule.step_size(group, param, age)
        weights = _as_matrix(param)
        if basis is None:
            _update_weights(weights, _as_matrix(direction), lr, 1.0, group["weight_decay"])
            return
        # Back-projected a slice of rows at a time: no full-size fp32 update of a large matrix.
        for rows in row_slices(*weights.shape):
            _update_weights(
                weights[rows], project_back(direction, basis, rows), lr, group["scale"], group["weight_decay"]
            )

    def _apply_by_row_slices(self, param: Tensor, group: dict[str, Any], grad: Tensor) -> None:
        """An elementwise rule on a large unprojected matrix, one slice of rows at a time; its
        moments are stored by slices (``slimopt.codecs.rows``)."""
        state = self.state[param]
        weights, grad = _as_matrix(param), _as_matrix(grad)
        storages = {
            key: row_sliced_storage(group["states"], kind, *weights.shape, group["block_size"])
            for key, kind in self.rule.moment_kinds.items()
        }
        first = "moment_step" not in state
        if first:
            for key, storage in storages.items():
                for part, tensor in storage.allocate(param.device).items():
                    state[state_key(key, part)] = tensor
            state["moment_step"] = 0
        stored = {
            key: {part: state[state_key(key, part)] for part in storage.sizes}
            for key, storage in storages.items()
        }
        generator = self._rounding_generator(param, state, group, grad.shape)
        age = self._advance(state)
        lr = self.rule.step_size(group, param, age)
        for index, rows in enumerate(row_slices(*weights.shape)):
            slice_grad = grad[rows].float()
            if first:
                moments = self.rule.init_state(slice_grad, group, projected=False)
            else:
                moments = {key: storage.decode(stored[key], index) for key, storage in storages.items()}
            direction = self.rule.direction(slice_grad, moments, age, group)
            for key, storage in storages.items():
                storage.encode(stored[key], index, moments[key], generator)
            _update_weights(weights[rows], direction, lr, 1.0, group["weight_decay"])

    @staticmethod
    def _advance(state: dict[str, Any]) -> int:
        """Count one more step of ``state``; return the age of its moments."""
        state["step"] += 1
        state["moment_step"] += 1
        return state["moment_step"]

    def _init_state(self, param: Tensor, group: dict[str, Any], state: dict[str, Any]) -> None:
        ordinal, projected_ordinal, projected_count = self._param_ordinals()[param]
        state["step"] = 0
        state["nonfinite_skips"] = 0
        state["seed"] = ordinal
        if self._projects(param, group):
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
        if not any(key.split(".")[0] in BASIS_KEYS for key in state):
            return True
        return (state["step"] - state["refresh_offset"]) % group["update_proj_gap"] == 0

    def _refresh(self, param: Tensor, grad: Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        """Replace the basis of ``param``; on failure keep the old one and warn."""
        old = self._basis(param, group)
        has_old = old is not None
        if not _all_finite(grad):
            self._warn(param, state, "non-finite gradient at a projection refresh; keeping the old basis")
            return
        generator = None
        if group["proj_method"] == "subspace":
            # Seeded by parameter and step, so a resumed run draws the same random directions.
            generator = torch.Generator()
            generator.manual_seed(_step_seed(state))
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
            self._carry_moments(state, group, projected_shape(grad.shape, old), old, new)
        self._store_basis(param, group, new)

    def _carry_moments(
        self, state: dict[str, Any], group: dict[str, Any], shape: torch.Size, old: Basis, new: Basis
    ) -> None:
        """Apply the group's ``on_subspace_change`` policy to the moments stored in ``old``'s basis."""
        policy = group["on_subspace_change"]
        if policy == "keep":
            return
        generator = self._rounding_generator(None, state, group, shape)
        for key, value in self._decode_all(state, group, shape).items():
            if policy == "rotate":
                squared = self.rule.moment_kinds[key] == "square"
                value = rotate_moment(value, old, new, squared=squared)
            else:
                value = torch.zeros_like(value)
            self._encode(state, key, value, group, generator)
        if policy == "reset":
            state["moment_step"] = 0

    def _decode_all(
        self, state: dict[str, Any], group: dict[str, Any], shape: torch.Size
    ) -> dict[str, Tensor]:
        """The fp32 value of every stored moment of the rule; ``shape`` is the moments' shape."""
        moments = {}
        for key, kind in self.rule.moment_kinds.items():
            codec = moment_codec(group["states"], kind, shape, group["block_size"])
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
    ) -> None:
        codec = moment_codec(group["states"], self.rule.moment_kinds[key], value.shape, group["block_size"])
        for part, stored in codec.encode(value, generator).items():
            state[state_key(key, part)] = stored

    def _rounding_generator(
        self, param: Tensor | None, state: dict[str, Any], group: dict[str, Any], shape: torch.Size
    ) -> torch.Generator | None:
        """A generator for stochastic rounding, seeded by parameter and step so that a resumed
        run rounds exactly as an uninterrupted one; None when no codec of the group draws."""
        codecs = [moment_codec(group["states"], kind, shape) for kind in set(self.rule.moment_kinds.values())]
        if not any(codec.stochastic for codec in codecs):
            return None
        device = param.device if param is not None else _state_device(state)
        generator = torch.Generator(device="cpu" if device.type == "meta" else device)
        # Odd seeds: the plain step seed belongs to the projection refresh.
        generator.manual_seed(_step_seed(state) * 2 + 1)
        return generator

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


def _step_seed(state: dict[str, Any]) -> int:
    """A seed unique to this parameter and step, so a resumed run draws what an uninterrupted
    one would."""
    return state["seed"] * 1_000_003 + state["step"]


def _as_matrix(tensor: Tensor) -> Tensor:
    """A 2-D view: ``shape[0] × rest`` (one row for a vector or a scalar)."""
    return tensor.view(tensor.shape[0], -1) if tensor.dim() >= 2 else tensor.view(1, -1)


def _update_weights(
    weights: Tensor, direction: Tensor, lr: float | Tensor, scale: float, weight_decay: float
) -> None:
    """``w ← w·(1 − lr·wd) − lr·scale·direction`` in fp32, rounded once into ``weights``."""
    target = weights if weights.dtype == torch.float32 else weights.float()
    if weight_decay != 0:
        target.mul_(1 - lr * weight_decay)
    if isinstance(lr, Tensor):  # a step size computed on the device, without a host sync
        target.sub_(direction.mul_(lr * scale))
    else:
        target.add_(direction, alpha=-lr * scale)
    if target is not weights:
        weights.copy_(target)


def _state_device(state: dict[str, Any]) -> torch.device:
    return next(v.device for v in state.values() if isinstance(v, Tensor))


def _storage_errors(group: dict[str, Any]) -> list[str]:
    errors = []
    if group["states"] not in STATE_FORMATS:
        errors.append(f"unknown states {group['states']!r}; valid: {', '.join(STATE_FORMATS)}")
    size = group["block_size"]
    if size is not None and (
        isinstance(size, bool) or not isinstance(size, int) or size < 4 or size & (size - 1)
    ):
        errors.append(
            f"block_size must be a power of two >= 4 (or None for the format's default), got {size!r}"
        )
    return errors


def _all_finite(tensor: Tensor) -> bool:
    """Whether every element is finite. A sum is finite only if all elements are, and costs a
    fraction of ``isfinite().all()``; the exact test runs only when the sum overflows or is NaN.
    A meta tensor (the memory planner's dry run) has no values and counts as finite."""
    if tensor.is_meta:
        return True
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
        ("basis_states", BASIS_STATES),
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
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
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
        eps: tuple[float, float] = (1e-30, 1e-3),
        clip_threshold: float = 1.0,
        decay_rate: float = -0.8,
        beta1: float | None = None,
        weight_decay: float = 0.0,
        scale_parameter: bool = True,
        relative_step: bool | None = None,
        warmup_init: bool = False,
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


AdamW8bit = GaLoreAdamW8bit
