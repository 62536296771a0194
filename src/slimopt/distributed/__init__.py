"""Multi-process training strategies: DDP's shared refreshes (``spread_refreshes``), ZeRO-1
(``zero_redundancy_optimizer``) and, in ``checkpoint``, distributed checkpoints; what FSDP2's row
shards need (``RowSharding``) is in ``slimopt.sharding``, below the optimizer.

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

import importlib
from typing import Any

import torch
from torch import nn

from slimopt.distributed.grad_sync import GradientSync, sync_gradients
from slimopt.sharding import initialized, split_by_rows
from slimopt.weight_formats import is_int8
from slimopt.weight_formats.int8 import INT8_ONE_PROCESS, Int8Weight

# How a multi-process run shares the work (``slimopt train --distributed``, ``slimopt memory``).
STRATEGIES = ("ddp", "zero1", "fsdp2")
# Why projected gradient sync (``grad_sync``) does not run under each other strategy.
PROJECTED_SYNC_STRATEGIES = {
    None: "projections are synchronized among DDP's processes: run under torchrun with --distributed ddp",
    "fsdp2": "FSDP2 reduce-scatters whole gradients itself (slimopt cannot hand it projections); use ddp",
}


def strategy_error(
    strategy: str | None, *, weights: str = "fp32", layerwise: bool = False, grad_sync: str = "auto"
) -> tuple[str, str] | None:
    """The setting ("weights", "layerwise" or "grad_sync") that processes sharing a run by
    ``strategy`` (None: one process) cannot train with, and why; None when they can. ``weights``
    is a ``slimopt.weight_formats`` dtype, ``grad_sync`` a ``grad_sync.GRAD_SYNCS`` mode. What
    ``slimopt train`` refuses, ``slimopt memory`` does not plan."""
    if grad_sync == "projected" and strategy not in ("ddp", "zero1"):
        return "grad_sync", PROJECTED_SYNC_STRATEGIES.get(strategy, PROJECTED_SYNC_STRATEGIES[None])
    if strategy is None:
        return None
    if is_int8(weights):
        return "weights", INT8_ONE_PROCESS
    if layerwise and strategy in ("ddp", "zero1"):
        return "layerwise", (
            "DDP averages gradients after backward, so layer-wise updates would see unaveraged "
            "ones; use fsdp2"
        )
    return None


def spread_refreshes(optimizer: Any, group: Any = None) -> None:
    """Divide the projection refreshes of a slimopt optimizer among the processes of a DDP run.

    Under DDP every process holds the same averaged gradients: the i-th projected matrix's basis is
    computed by process i mod N and broadcast to the others. The bases, and so the run, are
    bit-identical to every process computing them.

    Args:
        optimizer: a slimopt optimizer.
        group: the process group (None: all processes).

    Raises:
        TypeError: an optimizer that is not slimopt's.
        RuntimeError: no process group.
        ValueError: parameters FSDP2 splits (their refreshes are already shared: each process
            sketches its own rows), or int8 weights (they train in one process).
    """
    from slimopt.optimizers import SlimoptOptimizer

    if not isinstance(optimizer, SlimoptOptimizer):
        raise TypeError(f"spread_refreshes needs a slimopt optimizer, got {type(optimizer).__name__}")
    if not initialized():
        raise RuntimeError("spread_refreshes needs a torch.distributed process group (torchrun)")
    _refuse_int8(p for g in optimizer.param_groups for p in g["params"])
    split = [tuple(p.shape) for g in optimizer.param_groups for p in g["params"] if split_by_rows(p)]
    if split:
        raise ValueError(
            f"parameters {split[:3]} are split by FSDP2, whose refreshes each process already shares "
            "(sketches of its own rows); spread_refreshes is for DDP"
        )
    optimizer.engine.refresh_group = group if group is not None else torch.distributed.group.WORLD


def zero_redundancy_optimizer(model: nn.Module, name: str, *, lr: float | None, **options: Any) -> Any:
    """ZeRO-1: ``torch.distributed.optim.ZeroRedundancyOptimizer`` over slimopt optimizer ``name``.

    Its param groups are those [build_optimizer][slimopt.build_optimizer] makes for ``model``.
    Each process updates, and computes the bases of, only the parameters it owns; ZeRO broadcasts
    them. Each process's optimizer is given every parameter's place in the whole model, so random
    draws and refresh staggering do not depend on which process owns it. Its ``load_state_dict``
    goes through slimopt's loading.

    Args:
        model: the model (DDP's, or the module it wraps).
        name: the optimizer, as for ``build_optimizer``.
        lr: learning rate.
        **options: as for ``build_optimizer``.

    Returns:
        The ZeRO-1 optimizer.

    Raises:
        ValueError: what ``build_optimizer`` raises, and int8 weights (they train in one process).
    """
    from slimopt.distributed.zero import SlimoptZeroRedundancyOptimizer
    from slimopt.registry import OPTIMIZERS, build_optimizer, resolve_name

    _refuse_int8(model.parameters())
    whole = build_optimizer(model, name, lr=lr, **options)  # no state yet: groups and places only
    groups = [{**group, "params": list(group["params"])} for group in whole.param_groups]
    cls = OPTIMIZERS[resolve_name(name)].cls
    hyper = {key: value for key, value in whole.defaults.items() if key != "differentiable"}
    return SlimoptZeroRedundancyOptimizer(groups, whole.engine.places(), optimizer_class=cls, **hyper)


__all__ = [
    "STRATEGIES",
    "GradientSync",
    "spread_refreshes",
    "strategy_error",
    "sync_gradients",
    "zero_redundancy_optimizer",
]


def __getattr__(name: str) -> Any:
    """``slimopt.distributed.checkpoint`` after nothing but ``import slimopt``, as the manual writes
    it, without importing ``torch.distributed.checkpoint`` for every user of the optimizers."""
    if name == "checkpoint":
        return importlib.import_module("slimopt.distributed.checkpoint")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _refuse_int8(params: Any) -> None:
    """Raise ``ValueError`` when any of ``params`` is an int8 weight (``slimopt.weight_formats``)."""
    shapes = [tuple(p.shape) for p in params if isinstance(p, Int8Weight)]
    if shapes:
        raise ValueError(f"int8 weights {shapes[:3]}: {INT8_ONE_PROCESS}")
