"""Whether gradients are finite, decided without stalling the device.

A step computes one flag per gradient on the gradient's device: its largest magnitude is finite
(on CUDA), or its sum is, or where the sum is not, its smallest and largest elements (which cannot
overflow, as a sum can, and are NaN when any element is). Parameters on the
reference path, and every parameter on the CPU, read their flags on the host, all in one read.
Parameters on the fused path on CUDA pass theirs into the fused step, which stores nothing and
moves nothing when it is False; the host counts the step as taken and learns the decision later
(``Decisions``), at the next ``step()`` or ``state_dict()``, from a copy started asynchronously
after the step, by which time the device is long done with it. A step of the fused path on CUDA
therefore issues no synchronisation, and a skipped step ends up counted as on the reference path:
not at all.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from slimopt.collectives import all_reduce


def finite_flags(grads: list[Tensor], groups: list[Any], *, host_reads: bool = True) -> list[Tensor | None]:
    """For each gradient (real: a complex one as its real pairs), a one-element bool tensor on
    its device: whether every element is finite, agreed on (all-reduced) by the processes of its
    ``groups`` entry when that is not None (the shards of one parameter). None: nothing to
    decide (a meta, sparse or empty gradient that no other process shares). ``host_reads``:
    whether the host may read a value while computing them (False: the flags stay on the
    device, where a fused step takes them without waiting)."""
    flags: list[Tensor | None] = [None] * len(grads)
    kinds: dict[tuple[torch.device, torch.dtype], tuple[list[int], list[Tensor]]] = {}
    for index, grad in enumerate(grads):
        if not grad.is_meta and not grad.is_sparse and grad.numel():
            indices, tensors = kinds.setdefault((grad.device, grad.dtype), ([], []))
            indices.append(index)
            tensors.append(grad)
    for indices, tensors in kinds.values():
        vector = _finite(tensors, host_reads)
        for position, index in enumerate(indices):
            flags[index] = vector[position]
    shared: dict[Any, list[int]] = {}
    for index, group in enumerate(groups):
        if group is not None:
            shared.setdefault(group, []).append(index)
    for group, indices in shared.items():
        device = grads[indices[0]].device
        votes = torch.stack([_flag_or_true(flags[i], device) for i in indices]).to(torch.int32)
        agreed = all_reduce(votes, group, torch.distributed.ReduceOp.MIN).bool()
        for position, index in enumerate(indices):
            flags[index] = agreed[position]
    return flags


def all_finite(tensor: Tensor) -> bool:
    """Whether every element of ``tensor`` is finite, read on the host (a synchronisation on
    CUDA). A meta tensor (the memory planner's dry run) has no values and counts as finite."""
    if tensor.is_complex():
        tensor = torch.view_as_real(tensor)
    return tensor.is_meta or not tensor.numel() or bool(_finite([tensor], host_reads=True))


def _finite(tensors: list[Tensor], host_reads: bool) -> Tensor:
    """One bool per (non-empty) tensor of one device and dtype: whether it is all finite.

    On CUDA the tensors' infinity norms, one multi-tensor launch. On the CPU, where the host may
    read (at no cost there), each tensor's sum: a finite sum means finite elements, and only a
    tensor whose sum is not finite (a non-finite element, or an overflow) is decided by its
    extremes (``aminmax`` takes about 2.8 times as long as ``sum``, and the multi-tensor norm of
    ord=inf falls back to a slower per-tensor loop there: docs/changes.md). Elsewhere
    each tensor's extremes."""
    device = tensors[0].device.type
    if device == "cuda":
        return torch.stack(torch._foreach_norm(tensors, ord=math.inf)).isfinite()
    if device != "cpu" or not host_reads:
        return _extremes_finite(tensors)
    flags = torch.stack([tensor.sum() for tensor in tensors]).isfinite()
    if not flags.all():
        for index, finite_sum in enumerate(flags.tolist()):
            if not finite_sum:
                flags[index] = _extremes_finite([tensors[index]])[0]
    return flags


def _extremes_finite(tensors: list[Tensor]) -> Tensor:
    """Whether each tensor's smallest and largest elements are finite (they cannot overflow, as
    a sum can, and are NaN when any element is)."""
    extremes: list[Tensor] = []
    for tensor in tensors:
        extremes += torch.aminmax(tensor)
    return torch.stack(extremes).isfinite().view(-1, 2).all(dim=1)


def decisions(flags: list[Tensor | None], on_device: list[bool]) -> list[bool | Tensor]:
    """Each flag as a decision: where ``on_device`` says so the flag itself, left on its device,
    else its value read on the host, in one read per device. A None flag (nothing to decide)
    reads as True."""
    decided: list[bool | Tensor] = [True] * len(flags)
    by_device: dict[torch.device, tuple[list[int], list[Tensor]]] = {}
    for index, flag in enumerate(flags):
        if flag is None:
            continue
        if on_device[index]:
            decided[index] = flag
        else:
            indices, read = by_device.setdefault(flag.device, ([], []))
            indices.append(index)
            read.append(flag)
    for indices, read in by_device.values():
        for index, value in zip(indices, torch.stack(read).tolist(), strict=True):
            decided[index] = bool(value)
    return decided


class Decisions:
    """Flags of fused updates taken before the host knew them, and what each one updated (any
    object the caller names an update by)."""

    def __init__(self) -> None:
        self._pending: list[tuple[Any, Tensor]] = []
        self._copies: list[tuple[list[Any], Tensor, Any]] = []
        self.waiting = False  # whether any recorded flag is still to be read

    def record(self, update: Any, flag: Tensor) -> None:
        """Remember that ``update`` was taken under ``flag`` (its writes masked where False)."""
        self._pending.append((update, flag))
        self.waiting = True

    def close_step(self) -> None:
        """Start reading this step's flags: an asynchronous copy to the host on CUDA."""
        by_device: dict[torch.device, list[tuple[Any, Tensor]]] = {}
        for update, flag in self._pending:
            by_device.setdefault(flag.device, []).append((update, flag))
        self._pending = []
        for device, pairs in by_device.items():
            stacked = torch.stack([flag for _, flag in pairs])
            event = None
            if device.type == "cuda":
                stacked = stacked.to("cpu", non_blocking=True)
                event = torch.cuda.Event()
                event.record()
            self._copies.append(([update for update, _ in pairs], stacked, event))

    def skipped(self) -> list[Any]:
        """The updates whose recorded flag was False; waits
        only for the copies started by ``close_step`` (an earlier step's work)."""
        if not self.waiting:
            return []
        self.close_step()
        skipped = []
        for updates, stacked, event in self._copies:
            if event is not None:
                event.synchronize()
            skipped += [update for update, flag in zip(updates, stacked.tolist(), strict=True) if not flag]
        self._copies = []
        self.waiting = False
        return skipped

    def on_host(self) -> bool:
        """Whether every flag is already on the host (CPU tensors): reading them waits for nothing."""
        return all(event is None for _, _, event in self._copies) and all(
            flag.device.type == "cpu" for _, flag in self._pending
        )


def _flag_or_true(flag: Tensor | None, device: torch.device) -> Tensor:
    return flag if flag is not None else torch.ones((), dtype=torch.bool, device=device)
