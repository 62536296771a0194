"""Checks of hyperparameter values shared by the update rules and the optimizer shell.

A value that is not a number (None, a string, a bool) or is not finite gives the same message
as one out of range, naming the key and the value, instead of a ``TypeError`` from a comparison
or NaN weights later. A 0-d tensor counts as a number (torch.optim takes a tensor ``lr``).
"""

from __future__ import annotations

import math
from typing import Any

from torch import Tensor


def number(value: Any) -> float | None:
    """``value`` as a float when it is a finite real number (a 0-d real tensor included), else
    None (bools, None and strings are not numbers here)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, Tensor):
        if value.numel() != 1 or value.is_complex() or not value.dtype.is_floating_point:
            return None
        value = value.item()
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def number_error(key: str, value: Any, *, minimum: float = 0.0, strict: bool = False) -> list[str]:
    """One message when ``value`` is not a finite number ``>= minimum`` (``> minimum`` with
    ``strict``), else none."""
    found = number(value)
    if found is not None and (found > minimum if strict else found >= minimum):
        return []
    bound = f"> {minimum:g}" if strict else f">= {minimum:g}"
    return [f"{key} must be a finite number {bound}, got {value!r}"]


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
