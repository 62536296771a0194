"""What synchronizing optimizer state costs in each storage format: distributed checkpoints.

For each optimizer, 2 gloo processes train a LLaMA preset for two steps (random tokens) under
FSDP2 (TACO, which needs whole matrices, under DDP), then write a distributed checkpoint
(``slimopt.distributed.checkpoint.save``) and read it back into a new model and optimizer on the
same 2 processes; one process then reads it alone (resharding 2 → 1). Measured:

- the optimizer's bytes per parameter in the checkpoint (every ``optimizer/`` tensor of its DCP
  metadata: moments, bases, counters, groups);
- the write and the read time on 2 processes (the slower process's; median of ``--repeats``);
- the bytes the one process reads to reshard (``rchar`` of ``/proc/self/io`` around the load:
  every byte its reads return) and its time;
- the same checkpoint's optimizer bytes for LLaMA-7B, from the planner's state on the meta
  device (``slimopt memory``'s count: moments, bases and counters, without the groups' few
  kilobytes of JSON).

    python -m benchmarks.state_sync [--model llama_20m] [--optimizers adamw,adamw8bit,...]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.processes import free_port

OPTIMIZERS = (
    "adamw", "adamw8bit", "adamw4bit", "adamw_ternary", "galore_adamw8bit", "apollo_mini", "taco",
)  # fmt: skip
# Projected matrices keep their basis on the side FSDP2 does not split.
OPTIONS = {"galore_adamw8bit": {"proj_type": "right"}, "apollo_mini": {"proj_type": "right"}}
WHOLE_MATRICES = {"taco": "ddp"}  # what cannot train under FSDP2, and the strategy it takes
WORLD = 2


def _model(preset: str, vocab: int, strategy: str) -> torch.nn.Module:
    from slimopt.models import build_llama

    torch.manual_seed(0)
    model = build_llama(preset, vocab, max_seq_len=64)
    if strategy == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    return model


def _trained(name: str, preset: str, vocab: int, strategy: str, steps: int) -> tuple:
    import slimopt

    model = _model(preset, vocab, strategy)
    wrapped = torch.nn.parallel.DistributedDataParallel(model) if strategy == "ddp" else model
    optimizer = slimopt.build_optimizer(model, name, lr=1e-3, **OPTIONS.get(name, {}))
    for step in range(steps):
        batch = torch.randint(0, vocab, (2, 64), generator=torch.Generator().manual_seed(step))
        wrapped(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def _slowest(seconds: float) -> float:
    """The largest of every process's ``seconds``."""
    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value)


def _worker(rank: int, port: int, args: argparse.Namespace, out: str) -> None:
    from slimopt.distributed import checkpoint

    os.environ |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        for name in args.optimizers:
            strategy = WHOLE_MATRICES.get(name, "fsdp2")
            model, optimizer = _trained(name, args.model, args.vocab, strategy, steps=2)
            writes, reads = [], []
            for repeat in range(args.repeats):
                directory = Path(out) / f"{name}-{repeat}"
                dist.barrier()
                began = time.perf_counter()
                checkpoint.save(directory, model, optimizer)
                writes.append(_slowest(time.perf_counter() - began))
                fresh_model, fresh = _trained(name, args.model, args.vocab, strategy, steps=0)
                dist.barrier()
                began = time.perf_counter()
                checkpoint.load(directory, fresh_model, fresh)
                reads.append(_slowest(time.perf_counter() - began))
            if rank == 0:
                (Path(out) / f"{name}.times").write_text(
                    f"{strategy} {statistics.median(writes)} {statistics.median(reads)}"
                )
    finally:
        dist.destroy_process_group()
        os._exit(0)


def _read_bytes() -> int:
    """Bytes this process's reads have returned so far (``rchar``)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        key, _, value = line.partition(":")
        if key == "rchar":
            return int(value)
    raise RuntimeError("no rchar in /proc/self/io")


def _optimizer_bytes(directory: Path) -> int:
    """Bytes of every ``optimizer/`` tensor of the DCP checkpoint ``directory``."""
    import torch.distributed.checkpoint as dcp

    saved = dcp.FileSystemReader(directory).read_metadata().state_dict_metadata
    return sum(
        meta.size.numel() * meta.properties.dtype.itemsize
        for key, meta in saved.items()
        if key.startswith("optimizer/") and hasattr(meta, "size")
    )


def _reshard(name: str, args: argparse.Namespace, directory: Path) -> tuple[float, int]:
    """Seconds and bytes read to load the 2-process checkpoint ``directory`` into one process."""
    from slimopt.distributed import checkpoint

    model, optimizer = _trained(name, args.model, args.vocab, "none", steps=0)
    before, began = _read_bytes(), time.perf_counter()
    checkpoint.load(directory, model, optimizer)
    return time.perf_counter() - began, _read_bytes() - before


def _llama_7b_bytes(name: str) -> float:
    """The optimizer's bytes per parameter for LLaMA-7B (the planner's count of its state)."""
    from slimopt.planner import plan_memory

    plan = plan_memory("llama_7b", name, **OPTIONS.get(name, {}))
    kept = plan.persistent["optimizer_states"] + plan.persistent["projection_bases"]
    return kept / plan.parameters


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama_20m", help="LLaMA preset (default llama_20m)")
    parser.add_argument("--vocab", type=int, default=8192, help="vocabulary (default 8192)")
    parser.add_argument("--optimizers", default=",".join(OPTIMIZERS), help="comma-separated names")
    parser.add_argument("--repeats", type=int, default=3, help="writes and reads per optimizer (default 3)")
    parser.add_argument("--no-7b", action="store_true", help="skip the LLaMA-7B column (it plans each row)")
    args = parser.parse_args(argv)
    args.optimizers = [name.strip() for name in args.optimizers.split(",") if name.strip()]
    unknown = [name for name in args.optimizers if name not in OPTIMIZERS]
    if unknown or args.repeats < 1:
        parser.error(f"--optimizers takes {', '.join(OPTIMIZERS)}; --repeats a positive count")
    rows = []
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_worker, args=(free_port(), args, out), nprocs=WORLD, start_method="spawn")
        parameters = sum(p.numel() for p in _model(args.model, args.vocab, "none").parameters())
        for name in args.optimizers:
            strategy, write, read = (Path(out) / f"{name}.times").read_text().split()
            directory = Path(out) / f"{name}-0"
            reshard_s, reshard_bytes = _reshard(name, args, directory)
            rows.append(
                {
                    "optimizer": name,
                    "strategy": strategy,
                    "bytes_per_parameter": _optimizer_bytes(directory) / parameters,
                    "write_s": float(write),
                    "read_s": float(read),
                    "reshard_s": reshard_s,
                    "reshard_read_bytes": reshard_bytes,
                    "llama_7b_bytes_per_parameter": None if args.no_7b else _llama_7b_bytes(name),
                }
            )
    reference = rows[0]
    print(f"{args.model} ({parameters:,} parameters), {WORLD} gloo processes, median of {args.repeats}")
    print(
        "| optimizer | strategy | optimizer bytes / parameter | × AdamW | write s | read s | "
        "reshard 2 → 1: MB read | s | LLaMA-7B optimizer GB |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        seven = row["llama_7b_bytes_per_parameter"]
        print(
            f"| {row['optimizer']} | {row['strategy']} | {row['bytes_per_parameter']:.3f} | "
            f"{row['bytes_per_parameter'] / reference['bytes_per_parameter']:.3f} | {row['write_s']:.3f} | "
            f"{row['read_s']:.3f} | {row['reshard_read_bytes'] / 1e6:.1f} | {row['reshard_s']:.3f} | "
            + ("–" if seven is None else f"{seven * 6.74e9 / 1e9:.1f}")
            + " |"
        )
    return rows


if __name__ == "__main__":
    main()
