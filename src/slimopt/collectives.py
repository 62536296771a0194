"""Tensor collectives as slimopt issues them: on the device the process group's backend takes.

NCCL takes only CUDA tensors, gloo CPU ones. A flag or a vote built on the host
(``torch.tensor([...])``) works under gloo and crashes under NCCL, so every tensor slimopt hands
to a collective goes through ``to_group_device`` here: ``all_reduce`` and ``broadcast`` are the
only two slimopt uses, and the only places that call ``torch.distributed`` for a tensor.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


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
    torch.distributed.all_reduce(placed, op=op or torch.distributed.ReduceOp.SUM, group=group)
    if placed is not tensor:
        tensor.copy_(placed)
    return tensor


def broadcast(tensor: Tensor, source: int, group: Any = None) -> Tensor:
    """``tensor`` of the process of global rank ``source`` on every process of ``group`` (in
    place, on the group's device for the collective), and returned."""
    placed = to_group_device(tensor, group)
    torch.distributed.broadcast(placed, src=source, group=group)
    if placed is not tensor:
        tensor.copy_(placed)
    return tensor
