"""Processes and DTensors: the process group's rank and barrier, parameters that FSDP2 splits by
rows (``RowSharding``: their layout, with the collectives they need), and a basis computed by
one process and broadcast to the others. The base that the optimizer core and the distributed
strategies (``slimopt.distributed``) both build on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from slimopt.collectives import all_reduce, broadcast, gather, scatter


def initialized() -> bool:
    """Whether this process is in a ``torch.distributed`` process group."""
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def process_rank() -> int:
    """This process's rank (0 outside a process group)."""
    return torch.distributed.get_rank() if initialized() else 0


def barrier() -> None:
    """Wait for every process of the group (nothing outside one)."""
    if initialized():
        torch.distributed.barrier()


def from_first(value: Any) -> Any:
    """Rank 0's ``value`` (any picklable object) on every process: a check only the first
    process makes then stops all of them alike."""
    if not initialized():
        return value
    shared = [value]
    torch.distributed.broadcast_object_list(shared, src=0)
    return shared[0]


def is_sharded(tensor: Tensor) -> bool:
    """Whether ``tensor`` is a DTensor (FSDP2's parameters and gradients)."""
    return type(tensor).__name__ == "DTensor"


def split_by_rows(tensor: Tensor) -> bool:
    """Whether ``tensor`` is a DTensor split across processes (``Shard``), not replicated."""
    return is_sharded(tensor) and type(tensor.placements[0]).__name__ == "Shard"


def local_view(tensor: Tensor) -> Tensor:
    """This process's part of a DTensor (an alias: writing it writes the parameter), else the
    tensor itself."""
    return tensor.to_local() if is_sharded(tensor) else tensor


@dataclass(frozen=True)
class RowSharding:
    """How a DTensor split by rows is laid out: its process group, global row count, and the
    first global row of this process's shard."""

    group: Any
    rows: int
    offset: int

    def all_reduce(self, tensor: Tensor) -> Tensor:
        """``tensor`` summed over the group (in place), identical on every process."""
        return all_reduce(tensor, self.group)

    def on_owner(self, local: Tensor, compute: Callable[[Tensor], Tensor], ordinal: int) -> Tensor:
        """This process's rows of ``compute(whole)``, where ``whole`` is the tensor of which
        ``local`` is this process's rows: the shards are gathered to one process (``ordinal``
        mod N of the group), which alone computes, and its result's rows scattered back, each
        way in ``local``'s dtype. So a whole-matrix map (Muon's orthogonalization) costs each
        process its shard sent and received, not every process the whole matrix."""
        count = torch.distributed.get_world_size(self.group)
        source = owner_rank(ordinal, self.group)
        chunk = chunk_rows(self.rows, count)  # the last processes' parts padded to it
        padded = local.new_zeros((chunk, *local.shape[1:]))
        padded[: local.size(0)] = local
        parts = gather(padded, source, self.group)
        results = None
        if parts is not None:
            whole = compute(torch.cat(parts)[: self.rows])
            padding = whole.new_zeros((chunk * count - self.rows, *whole.shape[1:]))
            results = list(torch.cat([whole, padding]).split(chunk))
        return scatter(padded, results, source, self.group)[: local.size(0)]

    def all_agree(self, flag: bool) -> bool:
        """Whether ``flag`` holds on every process of the group."""
        vote = torch.tensor([0 if flag else 1], dtype=torch.int64)
        return int(all_reduce(vote, self.group)) == 0


def whole_norm(local: Tensor, sharding: RowSharding | None) -> Tensor:
    """The fp32 norm of a tensor of which ``local`` is this process's part (all-reduced over the
    processes that hold the rest when ``sharding`` says it is split)."""
    squared = torch.linalg.vector_norm(local, dtype=torch.float32).square()
    if sharding is not None:
        sharding.all_reduce(squared)
    return squared.sqrt()


def chunk_rows(rows: int, count: int) -> int:
    """Rows per process when ``rows`` are split over ``count`` processes as ``torch.chunk`` (and
    so DTensor) splits them: ⌈rows/count⌉, the last processes fewer or none."""
    return -(-rows // count)


def owner_rank(ordinal: int, group: Any) -> int:
    """The global rank of process ``ordinal`` mod N of ``group``: the one that computes a
    result the others receive (a basis, a Muon matrix's orthogonalization), dealt in turn."""
    return torch.distributed.get_global_rank(group, ordinal % torch.distributed.get_world_size(group))


def placement_error(param: Tensor) -> str | None:
    """Why slimopt cannot update this DTensor exactly, or None (a plain tensor, a replicated
    one, or one split by rows over a 1-D mesh)."""
    if not is_sharded(param):
        return None
    (placement,) = param.placements if param.device_mesh.ndim == 1 else (None,)
    kind = type(placement).__name__
    if kind == "Replicate" or (kind == "Shard" and placement.dim == 0):
        return None
    return (
        f"parameter {tuple(param.shape)} is placed as {list(param.placements)} on a "
        f"{param.device_mesh.ndim}-D mesh; slimopt updates parameters split by rows (Shard(0), "
        "FSDP2's default) or replicated, on a 1-D mesh"
    )


def row_sharding(param: Tensor) -> RowSharding | None:
    """The ``RowSharding`` of a DTensor split by rows, else None.

    DTensor splits rows as ``torch.chunk`` does (⌈m/p⌉ rows per process, the last ones fewer or
    none), so a shard's first row follows from the process's place in the mesh, without
    communication. Raises ``ValueError`` for a shard of another size."""
    if not split_by_rows(param):
        return None
    mesh = param.device_mesh
    rows, place, count = param.shape[0], mesh.get_local_rank(), mesh.size()
    chunk = chunk_rows(rows, count)
    offset = min(place * chunk, rows)
    local = param.to_local().shape[0]
    if local != min(chunk, rows - offset):
        raise ValueError(
            f"parameter {tuple(param.shape)}: process {place} of {count} holds {local} rows, not the "
            f"{min(chunk, rows - offset)} of torch.chunk's split; slimopt needs that layout"
        )
    return RowSharding(mesh.get_group(), rows, offset)


def compute_on_owner(
    compute: Callable[[], Any], ordinal: int, sides: tuple[bool, bool], grad: Tensor, rank: int, group: Any
) -> Any:
    """The basis' two factors (left, right; None where unused) that ``compute()`` returns,
    computed only by process ``ordinal`` mod N of ``group`` and broadcast to the others, which
    allocate its ``sides`` for the m×n ``grad`` at ``rank``.
    Raises ``RuntimeError`` on every process when the owner's computation failed."""
    source = owner_rank(ordinal, group)
    basis, failure = None, ""
    if torch.distributed.get_rank() == source:
        try:
            basis = compute()
        except RuntimeError as error:
            failure = str(error)
    status = broadcast(torch.tensor([0 if failure else 1], dtype=torch.int64), source, group)
    if not int(status):
        raise RuntimeError(failure or f"it failed on process {source}, which computes this basis")
    rows, cols = grad.shape
    k = min(rank, rows, cols)
    factors = []
    for uses, factor_shape, index in ((sides[0], (rows, k), 0), (sides[1], (k, cols), 1)):
        if not uses:
            factors.append(None)
            continue
        tensor = basis[index].contiguous() if basis is not None else grad.new_empty(factor_shape)
        factors.append(broadcast(tensor, source, group))
    return factors[0], factors[1]
