"""Tensor collectives as slimopt issues them: on the device the process group's backend takes,
and counted.

NCCL takes only CUDA tensors, gloo CPU ones. A flag or a vote built on the host
(``torch.tensor([...])``) works under gloo and crashes under NCCL, so every tensor slimopt hands
to a collective goes through ``to_group_device`` here: ``all_reduce`` (also started without
waiting, ``all_reduce_async``) and ``broadcast`` are the only collectives slimopt uses, and these
the only places that call ``torch.distributed`` for a tensor. Each counts the bytes of the tensors
it hands over, by kind of collective (``sent_bytes``): an all-reduce of n bytes counts n, whatever
its algorithm sends on the wire (a ring sends 2(N − 1)/N · n from each of N processes).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch import Tensor

# Bytes handed to each kind of collective by this process since it started ("all_reduce",
# "broadcast"); read the difference around what is measured.
sent_bytes: Counter[str] = Counter()


def _count(kind: str, tensor: Tensor) -> None:
    sent_bytes[kind] += tensor.numel() * tensor.element_size()


def group_device(group: Any = None) -> torch.device:
    """The device the collectives of ``group`` (default: all processes) take their tensors on:
    this process's CUDA device under NCCL, which takes nothing else, else the CPU (gloo)."""
    if torch.distributed.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def to_group_device(tensor: Tensor, group: Any = None) -> Tensor:
    """``tensor`` on ``group_device(group)``: itself when it is there already, else a copy."""
    device = group_device(group)
    return tensor if tensor.device == device else tensor.to(device)


def all_reduce(tensor: Tensor, group: Any = None, op: Any = None) -> Tensor:
    """``tensor`` reduced (``op``, default a sum) over ``group`` in place, the same on every
    process, and returned. The collective runs on the group's device (``to_group_device``), so
    a flag built on the host works under NCCL as under gloo. Every tensor collective of slimopt
    goes through this module."""
    placed = to_group_device(tensor, group)
    _count("all_reduce", placed)
    torch.distributed.all_reduce(placed, op=op or torch.distributed.ReduceOp.SUM, group=group)
    if placed is not tensor:
        tensor.copy_(placed)
    return tensor


def all_reduce_async(tensor: Tensor, group: Any = None) -> torch.futures.Future:
    """A sum of ``tensor`` over ``group`` in place, started and not waited for: the future of
    ``[tensor]`` once reduced (what DDP's communication hooks build on). The collective runs on
    the group's device, as ``all_reduce``'s does."""
    placed = to_group_device(tensor, group)
    _count("all_reduce", placed)
    future = torch.distributed.all_reduce(placed, group=group, async_op=True).get_future()
    if placed is tensor:
        return future

    def copied_back(_: torch.futures.Future) -> list[Tensor]:
        tensor.copy_(placed)
        return [tensor]

    return future.then(copied_back)


def broadcast(tensor: Tensor, source: int, group: Any = None) -> Tensor:
    """``tensor`` of the process of global rank ``source`` on every process of ``group`` (in
    place, on the group's device for the collective), and returned."""
    placed = to_group_device(tensor, group)
    _count("broadcast", placed)
    torch.distributed.broadcast(placed, src=source, group=group)
    if placed is not tensor:
        tensor.copy_(placed)
    return tensor
