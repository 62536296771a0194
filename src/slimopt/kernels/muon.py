"""The fused Muon step of a batch of matrices of one shape, one group and one storage format: the
rule of ``slimopt.rules.muon`` with its momentum's storage, in three calls for the whole batch.

1. ``momentum_steps`` (compiled): each matrix's momentum buffer decoded, advanced and encoded
   (``slimopt.codecs.storage``, as the AdamW step does), and its step (Nesterov's look-ahead, or
   the buffer) turned into where the iteration starts (``rules.muon.normalized_wide``).
2. The Newton–Schulz iteration (``rules.muon.iterated``) in torch's products, on the CPU matrix
   by matrix, elsewhere on the stacked batch; or the Triton kernels of ``triton_newton_schulz``.
3. ``write_weights`` (compiled): each matrix's weights decayed and stepped by its orthogonalized
   update scaled to its shape, rounded once into how they are stored.

Batched, a GPU runs a model's many small matrices as a few large products; compiled, the
elementwise work around the products is two passes over memory instead of one per operation.
"""

from __future__ import annotations

import torch
from torch import Tensor

from slimopt.codecs import storage as formats
from slimopt.codecs.base import Storage, store
from slimopt.codecs.plain import round_to_bf16
from slimopt.kernels.arguments import Deferred, scalars
from slimopt.rules.muon import normalized_wide


def hyperparameters(
    momentum: float, lr: float, weight_decay: float, ratio: float, device: torch.device
) -> Tensor:
    """The step's scalars as one fp32 tensor on ``device``, each computed in double precision and
    rounded once, as the reference path's Python floats are: the momentum, the new gradient's
    weight in the buffer, the weights' decay, the step's sign and size and the shape's ratio
    (``rules.muon.shape_ratio``)."""
    momentum, lr = float(momentum), float(lr)
    values = (momentum, 1 - momentum, 1 - lr * float(weight_decay), -lr, float(ratio))
    return scalars(values, torch.device(device))


def momentum_steps(
    grads: list[Tensor],
    moments: list[dict[str, Tensor]],
    storage: Storage,
    table: tuple[Tensor, ...],
    hyper: Tensor,
    seeds: list[Tensor | None],
    keeps: list[Tensor | None],
    nesterov: bool,
    eps: float,
) -> tuple[list[Tensor], tuple[Deferred, ...]]:
    """The compiled first part: each gradient's momentum buffer (stored parts ``moments[i]``,
    all in ``storage``) advanced and written back unless ``keeps[i]`` is False, and each step
    where the iteration starts (``rules.muon.normalized_wide``: bf16, wide, divided by its norm,
    at least ``eps``), in a list: stacking them in the compiled loops measured twice as slow as
    the whole step eagerly. Ternary buffers are returned instead, to be encoded in passes (as
    ``adamw.adamw_step`` returns them)."""
    momentum, new = hyper[0], hyper[1]
    steps, deferred = [], []
    for grad, parts, seed, keep in zip(grads, moments, seeds, keeps, strict=True):
        grad = grad.float()
        # The reference rule's operations, in its order (MuonRule._momentum_step).
        buffer = torch.lerp(formats.decode(parts, storage, table, grad.shape), grad, new)
        steps.append(normalized_wide(torch.lerp(grad, buffer, momentum) if nesterov else buffer, eps))
        if storage.kind == "ternary":
            deferred.append((buffer, seed, parts, storage))
        else:
            formats.encode_into(buffer, parts, storage, table, seed, keep)
    return steps, tuple(deferred)


def write_weights(
    weights: list[Tensor],
    ortho: Tensor | list[Tensor],
    hyper: Tensor,
    seeds: list[Tensor | None],
    keeps: list[Tensor | None],
) -> None:
    """The compiled last part: ``weights[i]`` (fp32 or bf16, rounded to nearest or, with a
    seed, stochastically) ← w·(1 − lr·wd) − lr·ratio·``ortho[i]`` (on the wide orientation,
    transposed back for a tall matrix), unless ``keeps[i]`` is False."""
    decay, alpha, ratio = hyper[2], hyper[3], hyper[4]
    for target, update, seed, keep in zip(weights, ortho, seeds, keeps, strict=True):
        if update.shape != target.shape:
            update = update.mT
        value = target.float() * decay + alpha * (update.float() * ratio)
        if target.dtype == torch.bfloat16:
            value = round_to_bf16(value, seed)
        store(target, value, keep)
