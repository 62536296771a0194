"""Multi-process runs of ``slimopt train`` under ``torchrun``: the process group, each process's
part of the data, and the model and optimizer of each strategy.

    torchrun --nproc_per_node 2 -m slimopt.cli train --distributed fsdp2 --optimizer galore_adamw8bit

- ``ddp``: ``DistributedDataParallel``; every process holds the whole model and optimizer, and
  computes 1/N of the projection refreshes (``slimopt.distributed.spread_refreshes``).
- ``zero1``: DDP, with the optimizer state split over the processes
  (``slimopt.distributed.zero_redundancy_optimizer``).
- ``fsdp2``: ``fully_shard`` on every decoder layer and on the model; parameters, gradients and
  optimizer state are split by rows; checkpoints are written by every process
  (``slimopt.distributed.checkpoint``).

``--batch-size`` stays the global batch: each micro-step takes ``micro × processes`` rows in
the run's order and each process keeps its own ``micro`` of them, so N processes train on the
very batches one process would.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from slimopt.collectives import all_reduce
from slimopt.distributed import STRATEGIES
from slimopt.sharding import barrier


@dataclass
class Parallel:
    """This process's place in the run: ``strategy`` None means one process."""

    strategy: str | None = None
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        """Whether this process writes the run's files and shows progress."""
        return self.rank == 0

    @property
    def sharded_checkpoints(self) -> bool:
        """Whether checkpoints are written by every process (DCP) rather than by the first."""
        return self.strategy == "fsdp2"

    def first_then_others(self, work: Any) -> Any:
        """``work()`` on the first process, then on the others (which find its caches)."""
        if self.main:
            result = work()
            barrier()
            return result
        barrier()
        return work()

    def sum(self, values: list[float]) -> list[float]:
        """``values`` summed over the processes (one all-reduce)."""
        if self.strategy is None:
            return values
        return all_reduce(torch.tensor(values, dtype=torch.float64)).tolist()

    def gather(self, value: Any) -> list[Any]:
        """``value`` of every process, in rank order."""
        if self.strategy is None:
            return [value]
        values: list[Any] = [None] * self.world
        dist.all_gather_object(values, value)
        return values

    def take(self, rows: Tensor) -> Tensor:
        """This process's part of a micro-batch of ``micro × world`` rows."""
        micro = len(rows) // self.world
        return rows[self.rank * micro : (self.rank + 1) * micro]

    def device(self, name: str) -> torch.device:
        """The device of ``--device`` for this process (its own GPU under torchrun)."""
        from slimopt.train.config import resolve_device

        device = resolve_device(name)
        if device.type == "cuda" and self.strategy is not None:
            device = torch.device("cuda", self.local_rank)
            torch.cuda.set_device(device)
        return device

    def wrap(self, model: nn.Module) -> nn.Module:
        """The model as the strategy trains it (the same module for FSDP2, which shards it in
        place; a DDP wrapper otherwise)."""
        if self.strategy is None:
            return model
        if self.strategy == "fsdp2":
            from torch.distributed.fsdp import fully_shard

            for layer in model.model.layers:
                fully_shard(layer)
            return fully_shard(model)
        device_ids = [self.local_rank] if next(model.parameters()).is_cuda else None
        # Gradients as views of DDP's buckets: one copy of them, not two.
        return nn.parallel.DistributedDataParallel(model, device_ids=device_ids, gradient_as_bucket_view=True)

    def optimizer(self, model: nn.Module, name: str, lr: float, options: dict[str, Any]) -> Any:
        """The optimizer of ``model`` (unwrapped) for this strategy."""
        from slimopt.distributed import spread_refreshes, zero_redundancy_optimizer
        from slimopt.registry import OPTIMIZERS, build_optimizer, resolve_name

        if self.strategy == "zero1":
            return zero_redundancy_optimizer(model, name, lr=lr, **options)
        optimizer = build_optimizer(model, name, lr=lr, **options)
        if self.strategy == "ddp" and OPTIMIZERS[resolve_name(name)].projected:
            spread_refreshes(optimizer)  # each process finds 1/N of the bases; bit-identical
        return optimizer

    def sync_gradients(self, wrapped: nn.Module, optimizer: Any, mode: str) -> Any:
        """slimopt's gradient sync (``slimopt.distributed.grad_sync``) on the DDP model
        ``wrapped`` by ``mode``, counting the bytes it sends (DDP and ZeRO-1); None where the
        strategy synchronizes otherwise (one process, FSDP2's reduce-scatter)."""
        from slimopt.distributed.grad_sync import sync_gradients

        if self.strategy not in ("ddp", "zero1"):
            return None
        return sync_gradients(wrapped, optimizer, mode)

    def no_sync(self, wrapped: nn.Module) -> Any:
        """A context in which a backward accumulates gradients without synchronizing them: all
        but the last micro-batch of a step (DDP's ``no_sync``; nothing to skip otherwise)."""
        if self.strategy in ("ddp", "zero1"):
            return wrapped.no_sync()
        return contextlib.nullcontext()

    def close(self) -> None:
        if self.strategy is not None and dist.is_initialized():
            dist.destroy_process_group()


def start_run(strategy: str | None, device_name: str) -> Parallel:
    """Join the process group ``torchrun`` describes in the environment, or stay one process.

    Under torchrun with more than one process the strategy defaults to DDP; "none" is one
    process. Raises ``ValueError`` for an unknown strategy, one asked for outside torchrun, and
    "none" under torchrun with several processes (each would train the whole run alone)."""
    if strategy is not None and strategy not in ("none", *STRATEGIES):
        raise ValueError(f"unknown --distributed {strategy!r}; valid: none, {', '.join(STRATEGIES)}")
    launched = "WORLD_SIZE" in os.environ and "RANK" in os.environ
    world = int(os.environ["WORLD_SIZE"]) if launched else 1
    if strategy == "none":
        if world > 1:
            raise ValueError(
                f"--distributed none trains in one process, but torchrun started {world}: run "
                "slimopt train without torchrun, or choose --distributed ddp, zero1 or fsdp2"
            )
        return Parallel()
    if not launched:
        if strategy is not None:
            raise ValueError(
                f"--distributed {strategy} runs under torchrun: torchrun --nproc_per_node N -m slimopt.cli "
                "train ... (or --distributed none for one process)"
            )
        return Parallel()
    if world == 1 and strategy is None:
        return Parallel()
    cuda = device_name == "cuda" or (device_name == "auto" and torch.cuda.is_available())
    dist.init_process_group("nccl" if cuda else "gloo")
    return Parallel(strategy or "ddp", dist.get_rank(), world, int(os.environ.get("LOCAL_RANK", 0)))
