"""Gradient synchronization under DDP that sends what the optimizer reads: a GaLore-projected
matrix's projection, not its whole gradient.

Between two refreshes a projected matrix's basis P is the same on every process, so the projection
of the averaged gradient is the average of the projections, Pᵀ(Σ Gᵢ)/N = Σ (PᵀGᵢ)/N: all-reducing
the r×n projection instead of the m×n gradient is exact up to the order of the sums. The DDP
communication hook of ``sync_gradients`` all-reduces, in one collective per bucket of gradients,
the projections of the matrices whose basis stays at this step and the whole gradients of the
rest: unprojected parameters, and a matrix whose basis is refreshed from this step's gradient
(the SVD or subspace iteration needs all of it) or that has none yet.

A synchronized projection comes back packed into the start of its parameter's ``.grad``, the rest
zeros (``slimopt.core.packed``): its norm is the projection's, so a global-norm clip
(``torch.nn.utils.clip_grad_norm_``) clips by the norm of what the optimizer reads, and an AMP
grad scaler's unscaling and a finiteness check see what the optimizer will read. The optimizer
reads it from there, without projecting again. Such a ``.grad`` is not a gradient in the
parameter's shape: one step reads it, and a backward into a ``.grad`` that still holds one (a
second synchronized backward before the step, or the next one without ``zero_grad()``) raises.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from slimopt.codecs.slicing import matrix_shape
from slimopt.collectives import all_reduce_async
from slimopt.projection import Basis, projected_shape, sides

# What ``sync_gradients`` (``slimopt train --grad-sync``) accepts: "projected" all-reduces the
# projections of GaLore-projected matrices between refreshes, "full" every whole gradient (as
# DDP does, counted), "auto" projected where an optimizer projects gradients, else full.
GRAD_SYNCS = ("auto", "full", "projected")


def projected_sync_error(name: str, *, projects: bool, scales: bool) -> str | None:
    """Why optimizer ``name`` cannot synchronize projections, or None: some of its groups
    ``projects`` gradients GaLore's way (a ``rank``, no ``scale_type``). ``scales``: some group
    scales the raw gradient by a projected direction (APOLLO's ``scale_type``)."""
    if projects:
        return None
    if scales:
        return f"{name} scales each raw gradient by its projected direction (APOLLO), so it needs them whole"
    if name.lower() == "taco":
        return "taco sketches each whole gradient, so it needs them whole"
    return f"{name} projects no gradient, so it needs them whole"


def optimizer_sync_error(optimizer: Any, groups: list[dict[str, Any]] | None = None) -> str | None:
    """``projected_sync_error`` of a slimopt ``optimizer``, from its param groups (or ``groups``:
    a ZeRO-1 optimizer's, of every process's parameters)."""
    groups = optimizer.param_groups if groups is None else groups
    return projected_sync_error(
        type(optimizer).__name__,
        projects=any("rank" in group and group.get("scale_type") is None for group in groups),
        scales=any("rank" in group and group.get("scale_type") is not None for group in groups),
    )


@dataclass(frozen=True)
class SyncBytes:
    """The bytes one process all-reduces for a step's gradients under DDP (those of every
    trainable parameter): ``full`` every gradient whole; with projected sync ``steady`` at a
    step that refreshes no basis, and ``per_step`` on average (each projected matrix whole
    once every ``update_proj_gap`` steps, at its refresh); both None where the optimizer needs
    whole gradients."""

    full: int
    steady: int | None
    per_step: float | None


def step_bytes(model: nn.Module, optimizer: Any) -> SyncBytes:
    """``SyncBytes`` of training ``model`` with the slimopt ``optimizer`` (built on the meta
    device will do: only shapes are read)."""
    projects = optimizer_sync_error(optimizer) is None
    engine = optimizer.engine
    groups = {p: g for g in optimizer.param_groups for p in g["params"]}
    full = steady = 0
    per_step = 0.0
    for param in model.parameters():
        if not param.requires_grad:
            continue
        size = param.element_size()
        full += param.numel() * size
        group = groups.get(param)
        units = [] if group is None or not projects else engine.unit_gradients(param, group, param)
        if not units:
            steady += param.numel() * size
            per_step += param.numel() * size
        for unit, _ in units:
            whole = unit.numel() * size
            plan = engine.plan_of(unit, group)
            if not plan.projected or plan.scales_gradient:
                steady += whole
                per_step += whole
                continue
            projected, gap = _projected_numel(plan) * size, group["update_proj_gap"]
            steady += projected
            per_step += whole / gap + projected * (gap - 1) / gap
    return SyncBytes(full, steady if projects else None, per_step if projects else None)


def _projected_numel(plan: Any) -> int:
    """The elements of a projected unit's gradient in its basis (``projection.projected_shape``
    of the factors its ``proj_type`` uses)."""
    shape = matrix_shape(plan.shape)
    uses = sides(shape, plan.group["proj_type"])
    factors = (
        torch.empty(f.shape, device="meta") if used else None
        for f, used in zip(plan.basis_storage, uses, strict=True)
    )
    return projected_shape(shape, Basis(*factors)).numel()


class GradientSync:
    """The state of one DDP model's communication hook (``sync_gradients``): the mode it runs
    ("projected" or "full"), the process group, each parameter's engine and group in the slimopt
    optimizers of this process (under ZeRO-1 the local one and its follower), and the bytes this
    process has all-reduced for gradients (``sent``; ``take_sent``: since the last read)."""

    def __init__(self, optimizers: list[Any], mode: str, group: Any) -> None:
        self.mode = mode
        self.group = group
        self.units = {p: (o.engine, g) for o in optimizers for g in o.param_groups for p in g["params"]}
        self.sent = 0
        self._unread = 0

    def take_sent(self) -> int:
        """The bytes all-reduced since the last call (a training step's, read after it)."""
        sent, self._unread = self._unread, 0
        return sent

    def reduce(self, bucket: Any) -> torch.futures.Future:
        """The hook's work for one DDP bucket: one all-reduce of what each of its gradients
        contributes, averaged over the processes, written back into the bucket."""
        pieces: list[Tensor] = []
        writes: list[tuple[Tensor, torch.Size | None]] = []
        packed = []
        for param, grad in zip(bucket.parameters(), bucket.gradients(), strict=True):
            shapes = self._contribute(param, grad, pieces, writes)
            if any(shape is not None for shape in shapes):
                packed.append((param, shapes))
        whole = not packed
        flat = bucket.buffer() if whole else torch.cat(pieces)
        flat.div_(torch.distributed.get_world_size(self.group))
        sent = flat.numel() * flat.element_size()
        self.sent += sent
        self._unread += sent
        for param, shapes in packed:
            self.units[param][0].packed_gradients.pack(param, shapes)

        def written_back(future: torch.futures.Future) -> Tensor:
            if not whole:
                _unpack(future.value()[0], writes)
            return bucket.buffer()

        return all_reduce_async(flat, self.group).then(written_back)

    def _contribute(
        self,
        param: Tensor,
        grad: Tensor,
        pieces: list[Tensor],
        writes: list[tuple[Tensor, torch.Size | None]],
    ) -> list[torch.Size | None]:
        """Add what ``param``'s gradient ``grad`` (a view of the bucket) sends, unit by unit
        (each expert of a stacked parameter on its own): its projection where its step does
        not need it whole, else itself. Returns the projections' shapes (None: whole)."""
        if param not in self.units or self.mode == "full":
            pieces.append(grad.reshape(-1))
            writes.append((grad, None))
            return [None]
        engine, group = self.units[param]
        shapes: list[torch.Size | None] = []
        for unit, part in engine.unit_gradients(param, group, grad):
            projected = engine.projection_to_sync(unit, group, part)
            sent = part if projected is None else projected.to(part.dtype)
            pieces.append(sent.reshape(-1))
            writes.append((part, None if projected is None else projected.shape))
            shapes.append(writes[-1][1])
        return shapes


def _unpack(reduced: Tensor, writes: list[tuple[Tensor, torch.Size | None]]) -> None:
    """Write the all-reduced pieces into their gradients: a whole gradient as it is, a
    projection packed into the start of its gradient, the rest zeros."""
    offset = 0
    for grad, shape in writes:
        size = grad.numel() if shape is None else shape.numel()
        piece = reduced[offset : offset + size]
        offset += size
        if shape is None:
            grad.copy_(piece.view_as(grad))
            continue
        flat = grad.view(-1)
        flat[:size].copy_(piece)
        flat[size:].zero_()


# Unannotated: DDP checks a hook's annotations against its own classes, which postponed
# annotations are not.
def _hook(state: GradientSync, bucket):
    return state.reduce(bucket)


def _before_backward(engine: Any, param: Tensor) -> Callable[[Tensor], None]:
    def check(_: Tensor) -> None:
        engine.packed_gradients.before_backward(param)

    return check


def sync_gradients(model: nn.Module, optimizer: Any, mode: str = "auto", group: Any = None) -> GradientSync:
    """Synchronize a DDP model's gradients by slimopt's communication hook.

    ``model`` is a ``DistributedDataParallel`` whose parameters the slimopt ``optimizer`` updates
    (or [zero_redundancy_optimizer][slimopt.distributed.zero_redundancy_optimizer]'s ZeRO-1
    optimizer). Call it on every process, once per model, before the first backward (DDP takes
    one communication hook). Projected sync is exact up to the order of the sums; under ZeRO-1 it
    makes every process keep every projected matrix's basis.

    Args:
        model: the ``DistributedDataParallel`` model.
        optimizer: its slimopt optimizer, or ZeRO-1 over one.
        mode: ``"projected"`` all-reduces the projections of GaLore-projected matrices between
            their refreshes, ``"full"`` every whole gradient as DDP does, ``"auto"`` projected
            where the optimizer projects gradients, else full.
        group: DDP's process group (None: all processes).

    Returns:
        The hook's state, a [GradientSync][slimopt.distributed.grad_sync.GradientSync], which
        counts the bytes it sends.

    Raises:
        TypeError: a model that is not DDP, or an optimizer that is not slimopt's.
        ValueError: an unknown ``mode``, or ``"projected"`` with an optimizer that needs whole
            gradients (unprojected ones, APOLLO's scaling, TACO), naming why.
    """
    from slimopt.distributed.zero import SlimoptZeroRedundancyOptimizer
    from slimopt.optimizers import SlimoptOptimizer

    if mode not in GRAD_SYNCS:
        raise ValueError(f"unknown gradient sync {mode!r}; valid: {', '.join(GRAD_SYNCS)}")
    if not isinstance(model, nn.parallel.DistributedDataParallel):
        raise TypeError(f"sync_gradients needs a DistributedDataParallel model, got {type(model).__name__}")
    zero = isinstance(optimizer, SlimoptZeroRedundancyOptimizer)
    if not zero and not isinstance(optimizer, SlimoptOptimizer):
        raise TypeError(f"sync_gradients needs a slimopt optimizer, got {type(optimizer).__name__}")
    error = optimizer_sync_error(optimizer.optim if zero else optimizer, optimizer.param_groups)
    if mode == "projected" and error is not None:
        raise ValueError(f"projected gradient sync: {error}; use full")
    chosen = "full" if mode == "full" or error else "projected"
    if zero and chosen == "projected":
        optimizer.follow_bases()
    state = GradientSync(optimizer.local_optimizers() if zero else [optimizer], chosen, group)
    model.register_comm_hook(state, _hook)
    if chosen == "projected":
        for param, (engine, _) in state.units.items():
            if param.requires_grad:
                param.register_hook(_before_backward(engine, param))
    return state
