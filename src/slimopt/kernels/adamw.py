"""The fused AdamW step: the rule of ``slimopt.rules.adamw`` with its moments' storage, written
once as a function of the stored tensors and compiled with ``torch.compile`` (``adamw_step``),
the small tensors' step of many tensors in one call (``adamw_steps``), and the step's scalars
(``hyperparameters``). Moments are decoded and encoded by ``slimopt.codecs.storage``, as the
Adafactor step does. On CUDA the hand-written Triton kernels take the same arguments
(``triton_adamw``, ``triton_ternary``, ``triton_multi_tensor``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from slimopt.codecs import storage as formats
from slimopt.codecs.base import Storage, store
from slimopt.codecs.plain import round_to_bf16
from slimopt.kernels.arguments import Deferred, scalars

# Both moments' stored parts by name, their storages, and their lookup tables (empty but for
# blocks), as the compiled step and the Triton kernels take them.
Moments = tuple[dict[str, Tensor], dict[str, Tensor]]
Storages = tuple[Storage, Storage]
Tables = tuple[tuple[Tensor, ...], tuple[Tensor, ...]]


def hyperparameters(
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    age: int,
    scale: float,
    device: Any,
) -> Tensor:
    """The step's scalars as one fp32 tensor on ``device``, each computed in double precision
    and rounded once, as the reference path's Python floats are when an operation takes them.
    The tensor is shared by every parameter with the same scalars (read only): one host-to-device
    copy per group and step, not one per parameter."""
    beta1, beta2 = (float(beta) for beta in betas)
    lr, eps, weight_decay = float(lr), float(eps), float(weight_decay)
    values = (
        1 - beta1,
        beta2,
        1 - beta2,
        eps,
        1 - beta1**age,
        (1 - beta2**age) ** 0.5,
        1 - lr * weight_decay,
        -lr * scale,
    )
    return scalars(values, torch.device(device))


def adamw_steps(
    grads: list[Tensor],
    moments: list[Moments],
    hypers: Tensor,
    weights: list[Tensor],
    keeps: list[Tensor | None],
) -> None:
    """``slimopt.kernels.adamw_steps``' compiled part."""
    storages = (Storage(), Storage())
    for index, (grad, pair, target, keep) in enumerate(zip(grads, moments, weights, keeps, strict=True)):
        adamw_step(grad.view(-1).float(), pair, storages, ((), ()), hypers[index], target.view(-1), (), keep)


def adamw_step(
    grad: Tensor,
    moments: Moments,
    storages: Storages,
    tables: Tables,
    hyper: Tensor,
    weights: Tensor | None,
    seeds: tuple[Tensor, ...],
    keep: Tensor | None,
) -> tuple[Tensor | None, tuple[Deferred, ...]]:
    """``slimopt.kernels.adamw_step``'s compiled part: it returns the direction (None with
    ``weights``) and, for each ternary moment, its new value, stream, stored parts and storage,
    which the caller encodes in phases."""
    new1, beta2, new2, eps, correction1, correction2_sqrt, decay, alpha = hyper.unbind()
    streams = iter(seeds)
    grad_shape = shape = grad.shape
    numel, padding = grad.numel(), 0
    if storages[0].kind == "blockwise" and storages[0].block_size == storages[1].block_size:
        # Both moments in blocks of one size: the whole step in blocks × block_size, where the
        # per-block scales broadcast along rows.
        shape = formats.blocks_shape(moments[0], storages[0])
        padding = shape.numel() - numel
        grad = torch.nn.functional.pad(grad.reshape(-1), (0, padding)).view(shape)
    exp_avg, exp_avg_sq = (
        formats.decode(parts, storage, table, shape)
        for parts, storage, table in zip(moments, storages, tables, strict=True)
    )
    # The reference rule's operations, in its order (slimopt.rules.adamw).
    exp_avg = torch.lerp(exp_avg, grad, new1)  # new1, new2: the weights of the new gradient
    exp_avg_sq = exp_avg_sq * beta2 + new2 * grad * grad
    direction = exp_avg / (exp_avg_sq.sqrt() / correction2_sqrt + eps) / correction1
    if padding:
        # The reference encodes the moment padded with zeros; a decoded padding need not be zero
        # (the 4-bit second-moment map has no zero), so it is cleared before the block scales.
        real = (torch.arange(shape.numel(), device=grad.device) < numel).view(shape)
        exp_avg, exp_avg_sq = exp_avg * real, exp_avg_sq * real
        direction = direction.reshape(-1)[:numel]
    direction = direction.reshape(grad_shape)
    deferred = []
    for value, parts, storage, table in zip((exp_avg, exp_avg_sq), moments, storages, tables, strict=True):
        seed = next(streams) if storage.stochastic else None
        if storage.kind == "ternary":
            deferred.append((value, seed, parts, storage))  # the caller encodes it in phases
        else:
            formats.encode_into(value, parts, storage, table, seed, keep)
    if weights is None:
        return direction if keep is None else torch.where(keep, direction, 0.0), tuple(deferred)
    target = weights.float() * decay + alpha * direction
    if weights.dtype == torch.bfloat16:
        target = round_to_bf16(target, next(streams, None))
    store(weights, target, keep)
    return None, tuple(deferred)
