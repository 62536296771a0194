"""Per-process optimizer state and peak memory under DDP, ZeRO-1 and FSDP2, against the planner.

For each strategy, process count and optimizer, N CPU processes (gloo) train the planner's model
(fp32 weights, random tokens, ``--batch`` sequences of ``--seq`` tokens per process) for two
steps. Process 0's peak is measured as ``slimopt train`` measures it on the CPU
(``slimopt.train.loop.track_memory``: every tensor live during the step),
and its optimizer state is counted exactly; beside them, ``slimopt memory``'s prediction
(``plan_memory(..., processes=N, distributed=strategy)``).

    python -m benchmarks.distributed_memory [--model llama_9m] [--processes 1,2,4]
"""

from __future__ import annotations

import argparse
import gc
import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.processes import free_port

STRATEGIES = ("ddp", "zero1", "fsdp2")
OPTIMIZERS = {"adamw": {}, "galore_adamw8bit": {"rank": 64, "proj_type": "right"}}


def _setting(args: argparse.Namespace) -> dict:
    return {
        "model": args.model,
        "batch_size": args.batch,
        "seq_len": args.seq,
        "dtype": "fp32",
        "vocab_size": args.vocab,
        "checkpointing": False,
    }


def _worker(
    rank: int, world: int, port: int, strategy: str, name: str, options: dict, args, out: str
) -> None:
    os.environ |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        _measured(rank, world, strategy, name, options, args, out)
    finally:
        # The model, wrapper and optimizer (whose collectives' work objects hold tensors) are
        # released before the process group: gloo's work destructors abort at interpreter exit
        # (SIGABRT, "terminate called without an active exception"; seen once in a CI run).
        gc.collect()
        dist.destroy_process_group()


def _measured(rank: int, world: int, strategy: str, name: str, options: dict, args, out: str) -> None:
    """Two steps of this process, its peak and state bytes saved to ``out``."""
    from slimopt.memory import state_nbytes
    from slimopt.models import build_model
    from slimopt.train.loop import track_memory
    from slimopt.train.parallel import Parallel

    torch.manual_seed(0)
    parallel = Parallel(strategy, rank, world, rank)
    model = build_model(args.model, args.vocab, args.seq, weights="fp32")
    wrapped = parallel.wrap(model)
    optimizer = parallel.optimizer(model, name, 1e-3, options)
    parallel.sync_gradients(wrapped, optimizer, "auto")  # as slimopt train synchronizes
    peak = 0
    for step in range(2):
        tracker = track_memory(model, optimizer)
        with tracker:
            generator = torch.Generator().manual_seed(step * world + rank)
            batch = torch.randint(0, args.vocab, (args.batch, args.seq), generator=generator)
            wrapped(input_ids=batch, labels=batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        peak = max(peak, tracker.peak)
    result = torch.tensor([peak, state_nbytes(optimizer)], dtype=torch.int64)
    torch.save(result, Path(out) / f"rank{rank}.pt")


def measure(strategy: str, name: str, options: dict, world: int, args) -> tuple[int, int]:
    """Process 0's (peak bytes, optimizer-state bytes) of two steps with optimizer ``name``
    (``options`` for ``build_optimizer``) in ``world`` processes."""
    with tempfile.TemporaryDirectory() as out:
        arguments = (world, free_port(), strategy, name, options, args, out)
        mp.start_processes(_worker, args=arguments, nprocs=world, start_method="spawn")
        peak, state = torch.load(Path(out) / "rank0.pt").tolist()
    return peak, state


def main() -> None:
    from slimopt.planner import plan_memory

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama_9m")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--processes", default="1,2,4")
    args = parser.parse_args()
    counts = [int(n) for n in args.processes.split(",")]
    setting = _setting(args)
    print(f"{args.model}, fp32 weights, {args.batch}×{args.seq} tokens per process, process 0, MiB")
    columns = ["state (measured)", "state (planned)", "peak (measured)", "peak (planned)"]
    print("| strategy | optimizer | processes | " + " | ".join(columns) + " |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for strategy in STRATEGIES:
        for name, options in OPTIMIZERS.items():
            for world in counts:
                peak, state = measure(strategy, name, options, world, args)
                plan = plan_memory(
                    optimizer=name, processes=world, distributed=strategy, **setting, **options
                ).per_process
                planned_state = plan["state_between_steps"]
                print(
                    f"| {strategy} | {name} | {world} | {state / 2**20:.2f} | {planned_state / 2**20:.2f} "
                    f"| {peak / 2**20:.1f} | {plan['peak'] / 2**20:.1f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
