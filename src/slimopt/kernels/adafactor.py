"""The fused Adafactor step: the rule of ``slimopt.rules.adafactor`` with its moments' storage,
written once as a function of the stored tensors and compiled with ``torch.compile``.

Adafactor is not elementwise: the factored second moment averages the squared gradient over
rows and columns, the update is clipped by its RMS over the whole tensor, and
``scale_parameter`` multiplies the step by the weights' RMS. Inductor turns these reductions and
the elementwise work around them into a few loops of one compiled function, where the reference
path runs a chain of separate operations; there is no hand-written Triton kernel for it (CUDA
gets Inductor's Triton kernels). Moments are decoded and encoded by ``slimopt.codecs.storage``,
as the AdamW step does, so every storage format the reference path has is covered.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from slimopt.codecs import storage as formats
from slimopt.codecs.base import Storage, store
from slimopt.codecs.plain import round_to_bf16
from slimopt.kernels.arguments import Deferred, Moment, scalars
from slimopt.rules.adafactor import rms, squared_gradient


def adafactor_step(
    grad: Tensor,
    moments: dict[str, Moment],
    factored: tuple[Tensor, Tensor] | None,
    hyper: Tensor,
    scale_parameter: bool,
    weights: Tensor | None,
    seeds: tuple[Tensor, ...],
    keep: Tensor | None,
) -> tuple[Tensor | None, tuple[Deferred, ...]]:
    """``slimopt.kernels.adafactor_step``'s compiled part, on the fp32 matrix ``grad``.

    ``moments``: by key (``exp_avg`` when there is momentum, ``exp_avg_sq`` unless the second
    moment is ``factored``), the stored parts, storage and lookup tables. ``factored``: the raw
    fp32 row and column statistics of an unprojected matrix, updated in place. ``hyper``:
    ``hyperparameters``; ``scale_parameter``: whether the step size is multiplied by the
    weights' RMS (taken before the update, as the rule's ``step_size`` takes it). Returns the
    direction (None with ``weights``, which are updated in place) and each ternary moment's
    new value, stream, parts and storage, which the caller encodes in phases."""
    weight, eps, weights_eps, clip, new1, weight_decay, size = hyper.unbind()
    streams = iter(seeds)
    squared = squared_gradient(grad, eps)
    if factored is not None:
        row, col = factored
        new_row = torch.lerp(row, squared.mean(dim=-1), weight)
        new_col = torch.lerp(col, squared.mean(dim=-2), weight)
        row_factor = (new_row / new_row.mean(dim=-1, keepdim=True)).rsqrt().unsqueeze(-1)
        update = row_factor * new_col.unsqueeze(-2).rsqrt() * grad
        store(row, new_row, keep)
        store(col, new_col, keep)
        new_moments = {}
    else:
        parts, storage, table = moments["exp_avg_sq"]
        exp_avg_sq = torch.lerp(_decode(parts, storage, table, grad.shape), squared, weight)
        update = exp_avg_sq.rsqrt() * grad
        new_moments = {"exp_avg_sq": exp_avg_sq}
    update = update / (rms(update) / clip).clamp(min=1.0)
    if "exp_avg" in moments:
        parts, storage, table = moments["exp_avg"]
        update = torch.lerp(_decode(parts, storage, table, grad.shape), update, new1)
        new_moments["exp_avg"] = update
    deferred = []
    # The reference path's order of stochastic draws: the moments in the rule's order (that of
    # ``moments``), then the weights.
    for key, (parts, storage, table) in moments.items():
        value = new_moments[key]
        seed = next(streams) if storage.stochastic else None
        if storage.kind == "ternary":
            deferred.append((value, seed, parts, storage))
        elif storage.kind in formats.MATRIX_KINDS:
            formats.encode_into(value, parts, storage, table, seed, keep)
        else:
            formats.encode_into(value.reshape(-1), parts, storage, table, seed, keep)
    if weights is None:
        return update if keep is None else torch.where(keep, update, 0.0), tuple(deferred)
    lr = size
    if scale_parameter:
        lr = rms(weights.float()).clamp(min=weights_eps) * size
    target = weights.float() * (1 - lr * weight_decay) - lr * update
    if weights.dtype == torch.bfloat16:
        target = round_to_bf16(target, next(streams, None))
    store(weights, target, keep)
    return None, tuple(deferred)


def _decode(
    parts: dict[str, Tensor], storage: Storage, table: tuple[Tensor, ...], shape: torch.Size
) -> Tensor:
    """A moment of ``shape``; an elementwise one decoded flat and viewed as the matrix: with
    sizes symbolic, comparing a matrix shape with the blocks' would fix them to constants."""
    if storage.kind in formats.MATRIX_KINDS:
        return formats.decode(parts, storage, table, shape)
    return formats.decode(parts, storage, table, torch.Size([shape.numel()])).view(shape)


class AdafactorScalars(NamedTuple):
    """One Adafactor step's scalars, in the order the compiled step reads them."""

    second_moment_weight: float  # age ** decay_rate
    eps_squared: float  # added to the squared gradient
    eps_rms: float  # the floor of the weights' RMS (scale_parameter)
    clip_threshold: float
    one_minus_beta1: float  # 0 without momentum
    weight_decay: float
    step_size: float  # before scale_parameter


def hyperparameters(values: AdafactorScalars, device: torch.device) -> Tensor:
    """The step's scalars as one fp32 tensor on ``device``."""
    return scalars(tuple(float(value) for value in values), device)
