"""Checks of hyperparameter values shared by the update rules and the optimizer shell.

A value that is not a number (None, a string, a bool) or is not finite gives the same message
as one out of range, naming the key and the value, instead of a ``TypeError`` from a comparison
or NaN weights later. Finite means finite in float32, the precision every update is computed in:
1e300 would turn into inf (and the weights into NaN) on its way into the first fp32 tensor. A
0-d tensor counts as a number (torch.optim takes a tensor ``lr``).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

# The largest magnitude a float32 holds (3.4e38): every hyperparameter meets fp32 tensors.
FLOAT32_MAX = torch.finfo(torch.float32).max


def number(value: Any) -> float | None:
    """``value`` as a float when it is a real number finite in float32 (a 0-d real tensor
    included), else None (bools, None, strings, inf, NaN and 1e300 are not numbers here)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, Tensor):
        if value.numel() != 1 or value.is_complex() or not value.dtype.is_floating_point:
            return None
        value = value.item()
    if not isinstance(value, (int, float)) or abs(value) > FLOAT32_MAX or not math.isfinite(value):
        return None
    return float(value)


def beyond_float32(value: Any) -> str:
    """A note for a message about ``value`` when it is a finite Python number that float32
    does not hold (`` (beyond float32's range, ±3.4e+38)``), else nothing."""
    real = isinstance(value, (int, float)) and not isinstance(value, bool)
    if real and FLOAT32_MAX < abs(value) < math.inf:
        return f" (beyond float32's range, ±{FLOAT32_MAX:.1e})"
    return ""


def number_error(key: str, value: Any, *, minimum: float = 0.0, strict: bool = False) -> list[str]:
    """One message when ``value`` is not a finite number ``>= minimum`` (``> minimum`` with
    ``strict``), else none."""
    found = number(value)
    if found is not None and (found > minimum if strict else found >= minimum):
        return []
    bound = f"> {minimum:g}" if strict else f">= {minimum:g}"
    return [f"{key} must be a finite number {bound}, got {value!r}{beyond_float32(value)}"]


def betas_errors(betas: Any, *, one_allowed: bool = False) -> list[str]:
    """One message per problem with ``betas``: not a pair, or a member outside [0, 1) ([0, 1]
    with ``one_allowed``), else none."""
    interval = "[0, 1]" if one_allowed else "[0, 1)"
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
        return [f"betas must be a pair of floats in {interval}, got {betas!r}"]
    return [
        f"betas[{i}] must be in {interval}, got {beta!r}"
        for i, beta in enumerate(betas)
        if number(beta) is None or not (0.0 <= beta <= 1.0 if one_allowed else 0.0 <= beta < 1.0)
    ]


def required_lr_errors(lr: Any, rule: str) -> list[str]:
    """One message when ``lr`` is None (``rule`` has no relative step size, as Adafactor has) or
    not a finite number >= 0, else none."""
    if lr is None:
        return [f"lr is required: {rule} has no relative step size (lr=None)"]
    return number_error("lr", lr)
