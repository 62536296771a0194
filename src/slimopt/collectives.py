"""Tensor collectives as slimopt issues them: on the device the process group's backend takes,
and counted.

NCCL takes only CUDA tensors, gloo CPU ones. A flag or a vote built on the host
(``torch.tensor([...])``) works under gloo and crashes under NCCL, so every tensor slimopt hands
to a collective goes through ``to_group_device`` here: ``all_reduce`` (also started without
waiting, ``all_reduce_async``), ``broadcast``, ``gather`` and ``scatter`` are the only
collectives slimopt uses, and these the only places that call ``torch.distributed`` for a
tensor. Each counts the bytes of the tensors it hands over, by kind of collective
(``sent_bytes``): an all-reduce of n bytes counts n, whatever its algorithm sends on the wire (a
ring sends 2(N − 1)/N · n from each of N processes); a gather counts each process's part, a
scatter the parts the source hands out.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch import Tensor

# Bytes handed to each kind of collective by this process since it started ("all_reduce",
# "broadcast", "gather", "scatter"); read the difference around what is measured.
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


def gather(tensor: Tensor, destination: int, group: Any = None) -> list[Tensor] | None:
    """Every process's ``tensor`` (one shape on all of them) on the process of global rank
    ``destination``, in the group's order; None on the others."""
    placed = to_group_device(tensor, group)
    _count("gather", placed)
    receiving = torch.distributed.get_rank() == destination
    count = torch.distributed.get_world_size(group)
    parts = [to_group_device(torch.empty_like(tensor), group) for _ in range(count)] if receiving else None
    torch.distributed.gather(placed, parts, dst=destination, group=group)
    return None if parts is None else [part.to(tensor.device) for part in parts]


def scatter(like: Tensor, parts: list[Tensor] | None, source: int, group: Any = None) -> Tensor:
    """This process's part of ``parts``, which the process of global rank ``source`` holds (one
    per process of ``group``, in its order, each shaped as ``like``; None elsewhere)."""
    received = to_group_device(torch.empty_like(like), group)
    placed = None if parts is None else [to_group_device(part, group) for part in parts]
    for part in placed or []:
        _count("scatter", part)
    torch.distributed.scatter(received, placed, src=source, group=group)
    return received.to(like.device)
