"""Multi-process training: parameters that FSDP2 shards by rows, the collectives they need, and
ZeRO-1 (``zero_redundancy_optimizer``).

FSDP2 (``torch.distributed.fsdp.fully_shard``) turns each parameter into a DTensor split by rows
(``Shard(0)``) over a 1-D device mesh, unevenly when the rows do not divide. slimopt updates the
local shard: elementwise rules need nothing else; a projected matrix keeps its right basis (r×n)
on every process and its moments by rows, so projecting and projecting back stay local, and a
refresh all-reduces n×k sketches instead of gathering the m×n gradient
(``slimopt.projection.compute_basis``). Decisions every process must take alike (skip a step,
keep a basis) are agreed on with one all-reduce.

Under DDP every process holds the whole averaged gradient and would find every basis itself;
``spread_refreshes`` makes one process (by turns) compute each basis and broadcast it (r×n or
m×r, never the gradient), so the refresh work is divided and the run stays bit-identical.

Under ZeRO-1 each process's optimizer holds a part of the parameters; what seeds a parameter's
random draws and staggers its refreshes is its place in the whole model, stamped on it by
``zero_redundancy_optimizer``, so the run equals a one-process one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from slimopt.collectives import all_reduce, broadcast

# How a multi-process run shares the work (``slimopt train --distributed``, ``slimopt memory``).
STRATEGIES = ("ddp", "zero1", "fsdp2")


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

    def all_agree(self, flag: bool) -> bool:
        """Whether ``flag`` holds on every process of the group."""
        vote = torch.tensor([0 if flag else 1], dtype=torch.int64)
        return int(all_reduce(vote, self.group)) == 0


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
    chunk = -(-rows // count)
    offset = min(place * chunk, rows)
    local = param.to_local().shape[0]
    if local != min(chunk, rows - offset):
        raise ValueError(
            f"parameter {tuple(param.shape)}: process {place} of {count} holds {local} rows, not the "
            f"{min(chunk, rows - offset)} of torch.chunk's split; slimopt needs that layout"
        )
    return RowSharding(mesh.get_group(), rows, offset)


def spread_refreshes(optimizer: Any, group: Any = None) -> None:
    """Under DDP (every process holds the same averaged gradients), divide the projection
    refreshes of a slimopt ``optimizer`` among the processes of ``group`` (default: all): the
    i-th projected matrix's basis is computed by process i mod N and broadcast to the others.
    The bases, and so the run, are bit-identical to every process computing them.

    Raises ``TypeError`` for an optimizer that is not slimopt's, ``RuntimeError`` outside a
    process group, and ``ValueError`` for parameters FSDP2 splits (their refreshes are already
    shared: each process sketches its own rows)."""
    from slimopt.optimizer import GaLoreOptimizer

    if not isinstance(optimizer, GaLoreOptimizer):
        raise TypeError(f"spread_refreshes needs a slimopt optimizer, got {type(optimizer).__name__}")
    if not initialized():
        raise RuntimeError("spread_refreshes needs a torch.distributed process group (torchrun)")
    split = [tuple(p.shape) for g in optimizer.param_groups for p in g["params"] if split_by_rows(p)]
    if split:
        raise ValueError(
            f"parameters {split[:3]} are split by FSDP2, whose refreshes each process already shares "
            "(sketches of its own rows); spread_refreshes is for DDP"
        )
    optimizer._refresh_group = group if group is not None else torch.distributed.group.WORLD


def compute_on_owner(
    compute: Callable[[], Any], ordinal: int, sides: tuple[bool, bool], grad: Tensor, rank: int, group: Any
) -> Any:
    """The basis ``compute()`` returns, computed only by process ``ordinal`` mod N of ``group``
    and broadcast to the others, which allocate its ``sides`` for the m×n ``grad`` at ``rank``.
    Raises ``RuntimeError`` on every process when the owner's computation failed."""
    from slimopt.projection import Basis

    place = torch.distributed.get_rank(group)
    owner = ordinal % torch.distributed.get_world_size(group)
    source = torch.distributed.get_global_rank(group, owner)
    basis, failure = None, ""
    if place == owner:
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
    return Basis(*factors)


def zero_redundancy_optimizer(model: nn.Module, name: str, *, lr: float | None, **options: Any) -> Any:
    """``torch.distributed.optim.ZeroRedundancyOptimizer`` over slimopt optimizer ``name``, with
    the param groups ``slimopt.build_optimizer`` makes for ``model`` (same arguments). Each
    process updates, and computes the bases of, only the parameters it owns; ZeRO broadcasts them.

    Every parameter is stamped with its place in the whole model first, so random draws and
    refresh staggering do not depend on which process owns it. Raises what ``build_optimizer``
    raises."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from slimopt.optimizer import IDENTITY
    from slimopt.registry import OPTIMIZERS, build_optimizer, resolve_name

    whole = build_optimizer(model, name, lr=lr, **options)  # no state yet: groups and places only
    for param, identity in whole._param_ordinals().items():
        setattr(param, IDENTITY, identity)
    groups = [{**group, "params": list(group["params"])} for group in whole.param_groups]
    cls = OPTIMIZERS[resolve_name(name)].cls
    hyper = {key: value for key, value in whole.defaults.items() if key != "differentiable"}
    return ZeroRedundancyOptimizer(groups, optimizer_class=cls, **hyper)
