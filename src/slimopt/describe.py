"""``describe``: what an optimizer does with each parameter, in words a person can check — which
weights are projected, at what rank and on which side (and, for APOLLO, how the raw gradient is
scaled), how their moments are stored, which
update path they take and how many bytes of state each group holds."""

from __future__ import annotations

from collections import Counter

from torch import Tensor, nn

from slimopt.codecs.slicing import matrix_shape
from slimopt.memory import storage_nbytes
from slimopt.optimizers import SlimoptOptimizer
from slimopt.projection import sides
from slimopt.sharding import split_by_rows


def _shape(tensor: Tensor) -> str:
    return "×".join(str(size) for size in tensor.shape) or "scalar"


def _side(param: Tensor, group: dict) -> str:
    rows, cols = matrix_shape(param.shape[1:] if group["experts"] else param.shape)
    left, right = sides((rows, cols), group["proj_type"])
    rank = group["rank"]
    parts = [f"left {rows}×{min(rank, rows)}"] * left + [f"right {min(rank, cols)}×{cols}"] * right
    return "basis " + " and ".join(parts) + (f" per expert ({param.shape[0]})" if group["experts"] else "")


def describe(optimizer: SlimoptOptimizer, model: nn.Module | None = None, *, parameters: bool = True) -> str:
    """A plain-text summary of ``optimizer``: its groups are what ``slimopt train`` prints first.

    Per param group: its settings, state bytes (0 before the first step creates the state) and
    update path (fused or reference, and why); then, with ``parameters``, each parameter with its
    shape and, if projected, its basis.

    Args:
        optimizer: a slimopt optimizer.
        model: names the parameters (None: numbered).
        parameters: list each parameter after its group.

    Returns:
        The summary, one line per group and parameter.

    Raises:
        TypeError: an optimizer that is not slimopt's.
    """
    if not isinstance(optimizer, SlimoptOptimizer):
        raise TypeError(f"describe takes a slimopt optimizer, got {type(optimizer).__name__}")
    names = {id(p): name for name, p in model.named_parameters()} if model is not None else {}
    paths = optimizer.fused_path
    lines = []
    ordinal = 0
    for index, (group, path) in enumerate(zip(optimizer.param_groups, paths, strict=True)):
        params = group["params"]
        projected = {id(p) for p in params if optimizer.engine.projects(p, group)}
        stored = [t for p in params for t in optimizer.state.get(p, {}).values() if isinstance(t, Tensor)]
        settings = [f"states {group['states']}", f"weight decay {group['weight_decay']:g}"]
        if projected:
            side = f"proj_type {group['proj_type']}"
            if any(split_by_rows(p) for p in params if id(p) in projected):
                side += " (rows split across processes: the basis is on the unsplit side)"
            settings[:0] = [f"rank {group['rank']}", side]
            if group["scale_type"] is not None:  # APOLLO
                limit = group["norm_growth_limit"]
                growth = "unlimited" if limit is None else f"≤ {limit:g}"
                settings[2:2] = [
                    f"{group['proj_method']} projection scaling the raw gradient per {group['scale_type']}"
                    f" (√scale {group['scale'] ** 0.5:.3g}, norm growth {growth})"
                ]
        title = group.get("name", f"group {index}")
        count = sum(p.numel() for p in params)
        lines.append(
            f"{title}: {len(params)} tensors, {count:,} parameters ({len(projected)} projected); "
            f"{', '.join(settings)}; state {storage_nbytes(stored):,} bytes; {path} path"
        )
        for param in params:
            name = names.get(id(param), f"parameter {ordinal}")
            ordinal += 1
            if not parameters:
                continue
            what = _side(param, group) if id(param) in projected else "unprojected"
            lines.append(f"  {name}  {_shape(param)}  {what}")
    kinds = Counter(p.dim() for group in optimizer.param_groups for p in group["params"])
    lines.append("tensors by dimensions: " + ", ".join(f"{dims}-D: {n}" for dims, n in sorted(kinds.items())))
    return "\n".join(lines)
