"""Adafactor (Shazeer & Stern 2018) in the Hugging Face formulation: factored second moment for
matrices, optional first moment, update clipping, relative step size.

Two deliberate differences from galore-torch's GaLoreAdafactor:

- In a projected space the second moment is kept whole (r×n), not factored. The projected state
  is already small, and factoring it on top of the low-rank projection would approximate twice.
  Unprojected matrices keep the factored row/column statistics.
- The first moment averages the clipped direction before the learning rate is applied, so it is
  independent of the schedule and can be rotated with the basis like Adam's.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, ClassVar, NamedTuple

import torch
from torch import Tensor

from slimopt.checks import FLOAT32_MAX, number, number_error
from slimopt.codecs.slicing import fp32_row_slices, slices_to_update


def rms(tensor: Tensor) -> Tensor:
    """The root mean square of ``tensor``'s elements, as a 0-d fp32 tensor (float64 values are
    summed in float64: ``vector_norm`` does not narrow)."""
    wide = tensor.dtype == torch.float64
    norm = torch.linalg.vector_norm(tensor, dtype=None if wide else torch.float32)
    return norm.float() / math.sqrt(tensor.numel())


def rms_by_rows(matrix: Tensor, values: Callable[[slice], Tensor] | None = None) -> Tensor:
    """``rms`` of ``matrix`` (m×n), or of the m×n matrix whose rows ``values`` gives, read a
    slice of rows at a time (``slices_to_update``): no fp32 copy of the whole matrix. The same
    number as ``rms`` of the whole for one slice; for several, the norms of the slices are
    combined (fp32 rounding apart, the same)."""
    if matrix.numel() == 0:
        return rms(matrix)
    norms = []
    for _, rows in slices_to_update(*matrix.shape, meta=matrix.is_meta):
        part = matrix[rows] if values is None else values(rows)
        wide = part.dtype == torch.float64
        norms.append(torch.linalg.vector_norm(part, dtype=None if wide else torch.float32))
    norm = norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms))
    return norm.float() / math.sqrt(matrix.numel())


# A matrix's factored second moment: the means of its squared gradient by row and by column.
ROW_KEY, COLUMN_KEY = "exp_avg_sq_row", "exp_avg_sq_col"


def squared_gradient(grad: Tensor, eps: float | Tensor, count: int | None = None) -> Tensor:
    """``grad² + eps``, bounded so that no mean of it overflows: a finite gradient above ~1e19
    (its square is inf) would otherwise turn every statistic of its rows and columns to NaN.
    ``count``: the elements of the whole gradient when ``grad`` is a slice of it."""
    return grad.square().add_(eps).clamp_(max=FLOAT32_MAX / max(count or grad.numel(), 1))


class FactoredDirection(NamedTuple):
    """Adafactor's direction of a matrix with factored statistics and no first moment, kept as
    its parts: ``grad`` (m×n, its own dtype) times ``row_factor`` (m×1) and ``column_factor``
    (1×n), divided by the clipping ``divisor``; each slice of rows is computed as it is added to
    the weights (``add_to``), so no m×n fp32 update exists."""

    grad: Tensor
    row_factor: Tensor
    column_factor: Tensor
    divisor: Tensor | None = None

    def rows_of(self, rows: slice) -> Tensor:
        """The direction's ``rows``, in fp32 (a new tensor)."""
        update = self.row_factor[rows] * self.column_factor * self.grad[rows].float()
        return update if self.divisor is None else update.div_(self.divisor)

    def add_to(self, weights: Tensor, alpha: float | Tensor, first_row: int = 0) -> None:
        """Add alpha · direction to ``weights``, the matrix's rows from ``first_row`` (in place)."""
        update = self.rows_of(slice(first_row, first_row + weights.shape[0]))
        if isinstance(alpha, Tensor):  # a step size on the device (scale_parameter)
            weights.add_(update.mul_(alpha))
        else:
            weights.add_(update, alpha=alpha)


class AdafactorRule:
    """Adafactor direction ``clip(g / √v̂)`` with optional momentum."""

    moment_kinds: ClassVar[dict[str, str]] = {"exp_avg": "linear", "exp_avg_sq": "square"}
    elementwise: ClassVar[bool] = False  # factored statistics and RMS clipping span the tensor
    reads_own_dtype: ClassVar[bool] = True  # a matrix by slices of rows; the rest in fp32
    factored_keys: ClassVar[tuple[str, ...]] = (ROW_KEY, COLUMN_KEY)
    fused: ClassVar[str | None] = "adafactor"
    # Hyperparameters of the rule besides lr and weight_decay, with transformers' defaults;
    # relative_step None: True exactly when lr is None.
    defaults: ClassVar[dict[str, Any]] = {
        "eps": (1e-30, 1e-3),
        "clip_threshold": 1.0,
        "decay_rate": -0.8,
        "beta1": None,
        "scale_parameter": True,
        "relative_step": None,
        "warmup_init": False,
    }
    help: ClassVar[dict[str, str]] = {
        "eps": "(ε₁, ε₂): added to the squared gradient, and the smallest weight RMS scale_parameter uses",
        "clip_threshold": "the largest root mean square of the update before it is scaled down",
        "decay_rate": "exponent of the second moment's decay rate, 1 − step^decay_rate",
        "beta1": "decay rate of a first moment (None: no first moment is kept)",
        "scale_parameter": "scale the step size by the root mean square of the weights",
        "relative_step": "a step size of min(1e-2, 1/√step) (None: exactly when lr is None)",
        "warmup_init": "with relative_step, a step size of min(1e-6 · step, 1/√step)",
    }

    def validate(self, group: dict[str, Any]) -> list[str]:
        errors = []
        lr, relative = group["lr"], group["relative_step"]
        if lr is None and not relative:
            errors.append("lr is required when relative_step is False")
        if lr is not None and relative:
            errors.append("a manual lr cannot be combined with relative_step=True")
        if lr is not None:
            errors += number_error("lr", lr)
        if group["warmup_init"] and not relative:
            errors.append("warmup_init=True requires relative_step=True")
        beta1 = group["beta1"]
        if beta1 is not None and (number(beta1) is None or not 0.0 <= beta1 < 1.0):
            errors.append(f"beta1 must be None or in [0, 1), got {beta1!r}")
        if number(group["decay_rate"]) is None or not group["decay_rate"] < 0.0:
            errors.append(f"decay_rate must be < 0, got {group['decay_rate']!r}")
        errors += number_error("clip_threshold", group["clip_threshold"], strict=True)
        eps = group["eps"]
        if not (
            isinstance(eps, (tuple, list))
            and len(eps) == 2
            and all(number(e) is not None and e >= 0 for e in eps)
        ):
            errors.append(f"eps must be a pair of non-negative floats, got {eps!r}")
        return errors

    def init_state(self, grad: Tensor, group: dict[str, Any], *, projected: bool) -> dict[str, Tensor]:
        state = {}
        fp32 = {"dtype": torch.float32}
        if group["beta1"] is not None:
            state["exp_avg"] = torch.zeros_like(grad, **fp32)
        if grad.dim() >= 2 and not projected:
            state[ROW_KEY] = grad.new_zeros(grad.shape[:-1], **fp32)
            state[COLUMN_KEY] = grad.new_zeros(grad.shape[:-2] + grad.shape[-1:], **fp32)
        else:
            state["exp_avg_sq"] = torch.zeros_like(grad, **fp32)
        return state

    def direction(
        self, grad: Tensor, state: dict[str, Tensor], age: int, group: dict[str, Any]
    ) -> Tensor | FactoredDirection:
        """The update direction; for a matrix with factored statistics and no first moment a
        ``FactoredDirection``, the gradient read a slice of rows at a time in fp32."""
        weight = math.pow(age, group["decay_rate"])  # 1 - beta2_t, with beta2_t = 1 - t^decay_rate
        if grad.dim() == 2 and ROW_KEY in state and "exp_avg" not in state:
            return _factored_direction(grad, state, weight, group)
        grad = grad.float()
        squared = squared_gradient(grad, group["eps"][0])
        if ROW_KEY in state:
            row, col = state[ROW_KEY], state[COLUMN_KEY]
            row.lerp_(squared.mean(dim=-1), weight)
            col.lerp_(squared.mean(dim=-2), weight)
            row_factor = (row / row.mean(dim=-1, keepdim=True)).rsqrt_().unsqueeze(-1)
            update = row_factor * col.unsqueeze(-2).rsqrt() * grad
        else:
            exp_avg_sq = state["exp_avg_sq"]
            exp_avg_sq.lerp_(squared, weight)
            update = exp_avg_sq.rsqrt() * grad
        update.div_((rms(update) / group["clip_threshold"]).clamp_(min=1.0))
        if "exp_avg" in state:
            state["exp_avg"].lerp_(update, 1 - group["beta1"])
            update = state["exp_avg"].clone()
        return update

    def bias_correction(self, group: dict[str, Any], age: int) -> float:
        return 1.0

    def step_size(self, group: dict[str, Any], weights: Tensor, step: int) -> float | Tensor:
        size = self.unscaled_step_size(group, step)
        if group["scale_parameter"]:
            # A 0-d tensor: reading the RMS on the host would synchronize a GPU once per parameter.
            return rms_by_rows(weights).clamp_(min=group["eps"][1]).mul_(size)
        return size

    def unscaled_step_size(self, group: dict[str, Any], step: int) -> float:
        """The step size before ``scale_parameter``'s factor (the weights' RMS): ``lr``, or the
        relative step size of step ``step``."""
        if group["relative_step"]:
            ceiling = 1e-6 * step if group["warmup_init"] else 1e-2
            return min(ceiling, 1.0 / math.sqrt(step))
        return group["lr"]


def _factored_direction(
    grad: Tensor, state: dict[str, Tensor], weight: float, group: dict[str, Any]
) -> FactoredDirection:
    """``AdafactorRule.direction`` of an m×n matrix with factored statistics and no first
    moment, its gradient read a slice of rows at a time in fp32: one pass for the row and column
    means of the squared gradient, one for the update's RMS (the clipping). The same arithmetic
    as the whole matrix's (its column means summed slice by slice)."""
    rows, cols = grad.shape
    row_means = grad.new_empty(rows, dtype=torch.float32)
    column_sums = grad.new_zeros(cols, dtype=torch.float32)
    for start, part in fp32_row_slices(grad):
        squared = squared_gradient(part, group["eps"][0], grad.numel())
        row_means[start : start + part.shape[0]] = squared.mean(dim=-1)
        column_sums += squared.sum(dim=-2)
    row, col = state[ROW_KEY], state[COLUMN_KEY]
    row.lerp_(row_means, weight)
    col.lerp_(column_sums.div_(rows), weight)
    row_factor = (row / row.mean(dim=-1, keepdim=True)).rsqrt_().unsqueeze(-1)
    unclipped = FactoredDirection(grad, row_factor, col.unsqueeze(-2).rsqrt())
    divisor = (rms_by_rows(grad, unclipped.rows_of) / group["clip_threshold"]).clamp_(min=1.0)
    return unclipped._replace(divisor=divisor)
