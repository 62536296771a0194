"""Muon (Jordan et al. 2024, "Muon: an optimizer for hidden layers"), with ``torch.optim.Muon``'s
conventions: a momentum buffer (an exponential average of the gradients), Nesterov's look-ahead,
the update orthogonalized by a quintic Newton–Schulz iteration run in bf16, and a step size
adjusted to the matrix's shape; weight decay is decoupled (the optimizer shell applies it, at
the unadjusted rate, as torch does).

Orthogonalizing needs the whole matrix, so the rule is not elementwise: a matrix is never
updated by slices of rows, and a matrix split by rows across processes (FSDP2) is orthogonalized
by one of them (``sharded_direction``). Its one moment, the momentum buffer, is stored like any
first moment (fp32, bf16, int8, int4 or ternary codes; ``slimopt.codecs``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import Tensor

from slimopt.checks import number, number_error, required_lr_errors

# torch.optim.Muon's coefficients of the quintic iteration (a, b, c), steps and eps.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
ADJUST_LR_FNS = ("original", "match_rms_adamw")
# torch refuses more steps than this "for computational efficiency"; so does slimopt.
MAX_NS_STEPS = 100


def orthogonalized(
    matrix: Tensor, coefficients: tuple[float, float, float], steps: int, eps: float
) -> Tensor:
    """The bf16 Newton–Schulz approximation of ``matrix``'s orthogonal factor (U Vᵀ of its SVD,
    singular values driven towards 1), as ``torch.optim.Muon`` computes it: normalized by its
    Frobenius norm (at least ``eps``), on the wide orientation, ``steps`` quintic iterations.
    A stack of matrices (batch × rows × columns) is orthogonalized matrix by matrix in batched
    products: as one matrix at a time but for the order of the fp32 sums, which can round a
    near-tie to the other bf16 neighbour; the iteration carries that on, most in matrices of two
    or three rows (on the CPU: most stacks bit for bit, thin ones within 1% relative)."""
    ortho = iterated(normalized_wide(matrix, eps), coefficients, steps)
    return ortho.mT if is_tall(matrix) else ortho


def iterated(ortho: Tensor, coefficients: tuple[float, float, float], steps: int) -> Tensor:
    """``steps`` quintic iterations from ``ortho`` (``normalized_wide``: bf16, wide, a matrix or
    a stack of them), each three products whose scaling and sum are rounded once."""
    a, b, c = coefficients
    add_product = torch.baddbmm if ortho.dim() == 3 else torch.addmm
    for _ in range(steps):
        gram = ortho @ ortho.mT
        update = add_product(gram, gram, gram, beta=b, alpha=c)
        ortho = add_product(ortho, update, ortho, beta=a)
    return ortho


def is_tall(matrix: Tensor) -> bool:
    """Whether ``matrix`` (or each of a stack) has more rows than columns: the iteration runs on
    its transpose, whose products are smaller."""
    return matrix.size(-2) > matrix.size(-1)


def normalized_wide(matrix: Tensor, eps: float) -> Tensor:
    """Where the iteration starts: ``matrix`` (or each of a stack) in bf16 on its wide
    orientation (a tall one's transpose, as a view), divided by its Frobenius norm, at least
    ``eps``."""
    ortho = matrix.bfloat16()
    # A stack's norms each as its matrix alone would have it.
    norms = torch.stack([one.norm() for one in ortho]).view(-1, 1, 1) if ortho.dim() == 3 else ortho.norm()
    # Divided in place in a copy, not in the caller's bf16 matrix.
    ortho = ortho.div(norms.clamp(min=eps)) if ortho is matrix else ortho.div_(norms.clamp(min=eps))
    return ortho.mT if is_tall(matrix) else ortho


def shape_ratio(shape: tuple[int, int], adjust_lr_fn: str | None) -> float:
    """How much the learning rate is scaled for an update of ``shape`` (A × B): Keller Jordan's
    √max(1, A/B) ("original", and None), or Moonshot's 0.2·√max(A, B) ("match_rms_adamw"), which
    gives the update AdamW's RMS, so that AdamW's learning rate and weight decay carry over."""
    rows, cols = shape
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    return math.sqrt(max(1, rows / cols))


class MuonRule:
    """Muon's momentum buffer and orthogonalized direction, scaled by ``shape_ratio``."""

    moment_kinds: ClassVar[dict[str, str]] = {"momentum_buffer": "linear"}
    elementwise: ClassVar[bool] = False
    reads_own_dtype: ClassVar[bool] = False
    factored_keys: ClassVar[tuple[str, ...]] = ()
    fused: ClassVar[str | None] = "muon"
    # torch.optim.Muon's defaults.
    defaults: ClassVar[dict[str, Any]] = {
        "momentum": 0.95,
        "nesterov": True,
        "ns_coefficients": NS_COEFFICIENTS,
        "eps": 1e-7,
        "ns_steps": 5,
        "adjust_lr_fn": None,
        # slimopt's: weights stored in × out (``Conv1D``), whose shape the adjustment reads reversed.
        "transposed": False,
    }
    help: ClassVar[dict[str, str]] = {
        "momentum": "decay rate of the momentum buffer",
        "nesterov": "use Nesterov momentum",
        "ns_coefficients": "coefficients of the quintic Newton–Schulz iteration",
        "eps": "added to the momentum's norm before the iteration divides by it",
        "ns_steps": "Newton–Schulz iterations per step",
        "adjust_lr_fn": "how the step size follows a matrix's shape: None or 'original' "
        "(√max(1, m/n)), 'match_rms_adamw' (0.2 √max(m, n))",
        "transposed": "weights stored in × out (transformers' Conv1D), read as out × in",
    }

    def validate(self, group: dict[str, Any]) -> list[str]:
        errors = required_lr_errors(group["lr"], "Muon") + number_error("eps", group["eps"], strict=True)
        momentum = number(group["momentum"])
        if momentum is None or not 0 <= momentum < 1:
            errors.append(f"momentum must be a number in [0, 1), got {group['momentum']!r}")
        for flag in ("nesterov", "transposed"):
            if not isinstance(group[flag], bool):
                errors.append(f"{flag} must be True or False, got {group[flag]!r}")
        steps = group["ns_steps"]
        if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps < MAX_NS_STEPS:
            errors.append(f"ns_steps must be an integer from 1 to {MAX_NS_STEPS - 1}, got {steps!r}")
        coefficients = group["ns_coefficients"]
        if (
            not isinstance(coefficients, (tuple, list))
            or len(coefficients) != 3
            or any(number(value) is None for value in coefficients)
        ):
            errors.append(f"ns_coefficients must be three finite numbers (a, b, c), got {coefficients!r}")
        if group["adjust_lr_fn"] is not None and group["adjust_lr_fn"] not in ADJUST_LR_FNS:
            valid = f"{', '.join(ADJUST_LR_FNS)} or None (original)"
            errors.append(f"unknown adjust_lr_fn {group['adjust_lr_fn']!r}; valid: {valid}")
        # A group with ``experts`` holds stacked matrices, each orthogonalized on its own.
        dims = 3 if group.get("experts") else 2
        others = [tuple(p.shape) for p in group["params"] if p.dim() != dims]
        if others:
            errors.append(
                f"Muon orthogonalizes matrices, and parameters {others[:3]} are not "
                f"{'stacked matrices (3-D)' if dims == 3 else '2-D'}: give them a group with "
                "rule='adamw' (build_optimizer does)"
            )
        return errors

    def init_state(self, grad: Tensor, group: dict[str, Any], *, projected: bool) -> dict[str, Tensor]:
        return {"momentum_buffer": torch.zeros_like(grad)}

    def direction(self, grad: Tensor, state: dict[str, Tensor], age: int, group: dict[str, Any]) -> Tensor:
        update = self._momentum_step(grad, state, group)
        return self._scaled(self._orthogonalized(update, group), update.shape, group)

    def sharded_direction(
        self,
        grad: Tensor,
        state: dict[str, Tensor],
        group: dict[str, Any],
        on_owner: Callable[[Tensor, Callable[[Tensor], Tensor]], Tensor],
        shape: tuple[int, int],
    ) -> Tensor:
        """``direction`` for this process's rows (``grad``) of a matrix of ``shape`` split by
        rows: the momentum advanced here, elementwise; the step, in the bf16 the iteration
        starts from, orthogonalized whole by ``on_owner(rows, compute)`` (one process's
        ``compute`` of the gathered matrix, its rows returned to each). The same arithmetic as
        ``direction`` on the whole matrix."""
        update = self._momentum_step(grad, state, group).bfloat16()
        ortho = on_owner(update, lambda whole: self._orthogonalized(whole, group))
        return self._scaled(ortho, shape, group)

    def _momentum_step(self, grad: Tensor, state: dict[str, Tensor], group: dict[str, Any]) -> Tensor:
        momentum = group["momentum"]
        buffer = state["momentum_buffer"]
        buffer.lerp_(grad, 1 - momentum)
        return grad.lerp(buffer, momentum) if group["nesterov"] else buffer

    def _orthogonalized(self, update: Tensor, group: dict[str, Any]) -> Tensor:
        return orthogonalized(update, tuple(group["ns_coefficients"]), group["ns_steps"], group["eps"])

    def _scaled(self, ortho: Tensor, shape: tuple[int, ...], group: dict[str, Any]) -> Tensor:
        # The step's shape adjustment, which torch applies to the learning rate of the step (not
        # of the weight decay): the same product, rounded in another order.
        return ortho.float().mul_(self.ratio(shape, group))

    def ratio(self, shape: tuple[int, ...], group: dict[str, Any]) -> float:
        """``shape_ratio`` of an update of ``shape`` (as the rule sees it) in ``group``."""
        shape = tuple(shape[::-1] if group["transposed"] else shape)
        return shape_ratio(shape, group["adjust_lr_fn"])

    def bias_correction(self, group: dict[str, Any], age: int) -> float:
        return 1.0

    def step_size(self, group: dict[str, Any], weights: Tensor, step: int) -> float:
        # A tensor learning rate is read as a number, as torch.optim.Muon reads it: a bf16
        # iteration would turn the other rounding of a tensor product into other bits of every
        # later step.
        lr = group["lr"]
        return lr.item() if isinstance(lr, Tensor) else lr
