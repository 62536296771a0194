"""Memory of one process of a multi-process run (DDP, ZeRO-1, FSDP2), from a one-process plan.

The planner measures one process's step exactly (``slimopt.planner``) and records each
parameter's bytes. What a strategy changes is then known parameter by parameter:

- **DDP** keeps everything, and its gradient buckets from the first backward on: the gradients
  are views of them (``gradient_as_bucket_view``, as ``slimopt train`` wraps), so they are one
  copy of every gradient that lives through the whole step, forward included.
- **ZeRO-1** (``ZeroRedundancyOptimizer``) adds the buckets and keeps the optimizer state and
  bases of the parameters it owns, assigned as ZeRO does: largest first, each to the process
  holding the fewest elements so far.
- **FSDP2** keeps this process's rows (``torch.chunk``'s split: process 0 holds the most) of
  every weight, gradient and moment; projection bases (r×n, on the unsplit side) whole. While a
  unit (a decoder layer, or the model's own embeddings and head) runs, the other processes'
  rows of its weights are gathered: the largest unit's, (N−1)/N of it.

Activations and temporaries are one process's (the micro-batch is per process). The result is
for process 0, the one holding the most.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from slimopt.core.state import is_basis_key
from slimopt.distributed import STRATEGIES
from slimopt.sharding import chunk_rows

# A decoder layer is one FSDP2 unit (``fully_shard`` per layer, then the model).
LAYER = re.compile(r"(.*\.layers\.\d+)\.")


@dataclass(frozen=True)
class ParameterBytes:
    """What one parameter holds between steps, in bytes; ``rows`` is its first dimension,
    ``group`` and ``position`` its place in the optimizer's param groups."""

    name: str
    group: int
    position: int
    rows: int
    numel: int
    weight: int
    gradient: int
    states: int
    basis: int

    @property
    def unit(self) -> str:
        """The FSDP2 unit it belongs to: its decoder layer, or the model (embeddings, head)."""
        match = LAYER.match(self.name)
        return match.group(1) if match else ""


def parameter_bytes(model: nn.Module, optimizer: Any) -> list[ParameterBytes]:
    """Each trainable parameter of ``model`` with its bytes in ``optimizer``'s state (of a
    ``ZeroRedundancyOptimizer``: this process's part)."""
    state_of = getattr(optimizer, "optim", optimizer).state
    places = {
        param: (index, position)
        for index, group in enumerate(optimizer.param_groups)
        for position, param in enumerate(group["params"])
    }
    result = []
    for name, param in model.named_parameters():
        if param not in places:
            continue
        state = state_of.get(param, {})
        tensors = [(key, v) for key, v in state.items() if isinstance(v, Tensor)]
        basis = sum(v.numel() * v.element_size() for key, v in tensors if is_basis_key(key))
        states = sum(v.numel() * v.element_size() for _, v in tensors) - basis
        weight = param.numel() * param.element_size()
        rows = param.shape[0] if param.dim() else 1
        gradient = weight if param.requires_grad else 0
        result.append(
            ParameterBytes(name, *places[param], rows, param.numel(), weight, gradient, states, basis)
        )
    return result


def per_process(
    at_peak: dict[str, int],
    parameters: list[ParameterBytes],
    strategy: str,
    processes: int,
    *,
    every_basis: bool = False,
) -> dict[str, int]:
    """The terms of a one-process peak (``MemoryPlan.at_peak``) for process 0 of ``processes``
    under ``strategy``, with ``communication`` (buckets, gathered layers) and ``peak`` added,
    and ``state_between_steps``: the optimizer state and bases process 0 keeps between steps.
    ``every_basis``: a ZeRO-1 process keeps every matrix's basis, not only its own (projected
    gradient sync: ``slimopt.distributed.grad_sync``).

    Raises ``ValueError`` for an unknown strategy or a count below 1."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown distributed strategy {strategy!r}; valid: {', '.join(STRATEGIES)}")
    if isinstance(processes, bool) or not isinstance(processes, int) or processes < 1:
        raise ValueError(f"processes must be a positive integer, got {processes!r}")
    totals = {
        key: sum(getattr(p, key) for p in parameters) for key in ("weight", "gradient", "states", "basis")
    }
    terms = dict(at_peak)
    kept = totals["states"] + totals["basis"]
    if strategy in ("ddp", "zero1"):
        terms["communication"] = totals["gradient"]
    if strategy == "zero1":
        owned = _zero_partition(parameters, processes)[0]
        bases = totals["basis"] if every_basis else sum(p.basis for p in owned)
        kept = sum(p.states for p in owned) + bases
        _scale(terms, "optimizer_states", sum(p.states for p in owned), totals["states"])
        _scale(terms, "projection_bases", bases, totals["basis"])
    if strategy == "fsdp2":
        share = {p.name: chunk_rows(p.rows, processes) / p.rows for p in parameters}
        kept = sum(p.states * share[p.name] + p.basis for p in parameters)
        _scale(terms, "weights", sum(p.weight * share[p.name] for p in parameters), totals["weight"])
        for term, key in (("gradients", "gradient"), ("optimizer_states", "states")):
            _scale(terms, term, sum(getattr(p, key) * share[p.name] for p in parameters), totals[key])
        _scale(
            terms,
            "accumulation_buffers",
            sum(p.gradient * share[p.name] for p in parameters),
            totals["gradient"],
        )
        units: dict[str, list[ParameterBytes]] = {}
        for p in parameters:
            units.setdefault(p.unit, []).append(p)
        largest = max(sum(p.weight for p in unit) for unit in units.values())
        terms["communication"] = largest * (processes - 1) / processes
    terms["peak"] = sum(terms.values())
    return {key: int(value) for key, value in terms.items()} | {"state_between_steps": int(kept)}


def _scale(terms: dict[str, Any], term: str, part: float, whole: int) -> None:
    """Scale ``terms[term]`` by ``part / whole`` (the share of it this process holds)."""
    terms[term] = terms.get(term, 0) * (part / whole) if whole else terms.get(term, 0)


def _zero_partition(parameters: list[ParameterBytes], processes: int) -> list[list[ParameterBytes]]:
    """ZeroRedundancyOptimizer's assignment: group by group, largest first, each parameter to
    the process with the fewest elements so far (the first of equals)."""
    owned: list[list[ParameterBytes]] = [[] for _ in range(processes)]
    sizes = [0] * processes
    for group in sorted({p.group for p in parameters}):
        members = sorted((p for p in parameters if p.group == group), key=lambda p: p.position)
        for param in sorted(members, key=lambda p: p.numel, reverse=True):
            rank = sizes.index(min(sizes))
            owned[rank].append(param)
            sizes[rank] += param.numel
    return owned
