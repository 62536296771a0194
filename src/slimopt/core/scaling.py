"""APOLLO's update (Zhu et al., arXiv 2412.05270): the rule runs in the projected space only to
measure how it would rescale the gradient, and that rescaling is applied to the raw gradient.

With ``R`` the projected gradient and ``R̃`` the rule's direction from it (AdamW's bias-corrected
``m̂ / (√v̂ + eps)``), the raw gradient ``G`` is scaled by ``‖R̃‖ / ‖R‖`` per channel
(``scale_type="channel"``: per row of ``G`` when the basis is on the right and ``R`` is m×r, per
column when it is on the left) or for the whole tensor (``"tensor"``). Fira's norm-growth
limiter (``norm_growth_limit`` γ) then keeps the scaled gradient's norm from growing by more than
γ per step (measured, as apollo-torch measures it, before the rule's bias correction), and the
weights move by ``lr · √scale`` times it: apollo-torch's ``scale``, so that APOLLO-Mini's
``scale=128`` multiplies by √128 as in the paper. The 1e-8 in the denominators is
apollo-torch's. No temporary of the matrix's size is made in fp32: the scaled gradient's norm
comes from per-slice norms and the weights are written a slice of rows at a time.
"""

from __future__ import annotations

import math
from collections.abc import MutableMapping
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from slimopt.codecs.slicing import row_slices, slices_to_update
from slimopt.core.plan import Plan
from slimopt.core.state import LIMITER
from slimopt.core.weights import WeightStep, update_weights
from slimopt.projection import Basis

EPS = 1e-8
# The norm of the last scaled gradient the limiter let through, a 0-d fp32 tensor.


def scaling_factor(plan: Plan, grad: Tensor, direction: Tensor, basis: Basis) -> Tensor:
    """``‖direction‖ / (‖grad‖ + 1e-8)`` per channel (m×1 for a right basis, 1×n for a left one)
    or for the whole tensor (0-d), of the projected ``grad`` and the rule's ``direction``; the
    norms are the whole tensor's when it is split by rows across processes."""
    if plan.group["scale_type"] == "tensor":
        squares = torch.stack([direction.square().sum(), grad.square().sum()])
        if plan.sharding is not None:
            plan.sharding.all_reduce(squares)
        return squares[0].sqrt() / (squares[1].sqrt() + EPS)
    dim = 1 if basis.left is None else 0  # the projected side, which each channel sums over
    ratio = torch.linalg.vector_norm(direction, dim=dim, keepdim=True)
    return ratio.div_(torch.linalg.vector_norm(grad, dim=dim, keepdim=True).add_(EPS))


def limited(plan: Plan, state: MutableMapping[str, Any], raw: Tensor, factor: Tensor, age: int) -> Tensor:
    """``factor`` divided by Fira's limiter: ``max(n / (last + 1e-8), γ) / γ`` where ``n`` is
    ``‖raw·factor‖`` without the rule's bias correction at moment age ``age`` (apollo-torch
    applies that correction in its step size, after the limiter) and ``last`` the ``n`` the
    previous step let through (kept in the state); unchanged on the first step, while every
    step before let through a zero gradient, or without ``norm_growth_limit``. On the device:
    no host synchronisation.

    Limiting starts from the first non-zero scaled gradient, where apollo-torch starts from the
    first step: a matrix whose first gradient is zero (LoRA's A, whose B starts at zero; an
    expert no token reached) would otherwise grow from 1e-8 by γ per step, frozen for about
    ln(‖g‖ / 1e-8) / ln γ steps (1,800 at γ = 1.01)."""
    limit = plan.group["norm_growth_limit"]
    if limit is None:
        return factor
    norm = _scaled_norm(plan, raw, factor) / plan.rule.bias_correction(plan.group, age)
    last = state.get(LIMITER)
    if last is None:
        state[LIMITER] = norm
        return factor
    ratio = (norm / (last + EPS)).clamp_(min=limit).div_(limit)
    limiter = torch.where(last > 0, ratio, torch.ones_like(ratio))
    state[LIMITER] = norm / limiter
    return factor / limiter


def _scaled_norm(plan: Plan, raw: Tensor, factor: Tensor) -> Tensor:
    """``‖raw · factor‖`` in fp32, a slice of rows at a time, over every process's rows."""
    squares = torch.zeros((), dtype=torch.float32, device=raw.device)
    for rows in row_slices(*raw.shape):
        squares += (raw[rows].float() * _rows_of(factor, rows)).square().sum()
    if plan.sharding is not None:
        plan.sharding.all_reduce(squares)
    return squares.sqrt()


def write_scaled(weights: Tensor, raw: Tensor, factor: Tensor, step: WeightStep) -> None:
    """``w ← w·(1 − lr·wd) − lr·√scale·raw·factor``, a slice of rows at a time (``step.scale``
    is the group's ``scale``; its square root is taken here)."""
    write = replace(step, scale=math.sqrt(step.scale))
    for _, rows in slices_to_update(*weights.shape, meta=weights.is_meta):
        update_weights(weights[rows], raw[rows].float() * _rows_of(factor, rows), write.of_rows(rows))


def _rows_of(factor: Tensor, rows: slice) -> Tensor:
    """The part of ``factor`` (0-d, m×1 or 1×n) that multiplies ``rows`` of the gradient."""
    return factor[rows] if factor.dim() and factor.shape[0] > 1 else factor
