"""Bytes a GaLore refresh sends under FSDP2, against gathering the gradient.

Two CPU processes (gloo) hold a ``rows``×``cols`` linear weight split by rows (``fully_shard``);
``galore_adamw`` with a right basis of rank ``rank`` takes three steps with a refresh every
second step: step 1 finds the first basis (cold: range finder with two power iterations), step 2
only projects, step 3 refreshes warm (old basis plus a 32-column sketch). Every all-reduce and
all-gather started inside ``optimizer.step()`` is counted with its tensor's bytes. A gathered
gradient would be rows×cols×4 bytes on every process.

    python -m benchmarks.refresh_traffic [--rows 4096] [--cols 11008] [--rank 1024]
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import slimopt
from benchmarks.processes import free_port

WORLD = 2


def _count(results: dict[str, int], key: str):
    original = {name: getattr(dist, name) for name in ("all_reduce", "all_gather_into_tensor", "all_gather")}

    def wrap(name):
        def counted(tensor, *args, **kwargs):
            results[key] += tensor.numel() * tensor.element_size()
            return original[name](tensor, *args, **kwargs)

        return counted

    for name in original:
        setattr(dist, name, wrap(name))
    return original


def _worker(rank: int, port: int, rows: int, cols: int, rank_r: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    os.environ |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.manual_seed(0)
    layer = torch.nn.Linear(cols, rows, bias=False)
    fully_shard(layer, mesh=init_device_mesh("cpu", (WORLD,)))
    optimizer = slimopt.GaLoreAdamW(
        [{"params": [layer.weight], "rank": rank_r, "update_proj_gap": 2, "proj_type": "right"}],
        lr=1e-3,
        stagger=False,
    )
    sent = {}
    for step, label in enumerate(("cold refresh", "step without refresh", "warm refresh")):
        inputs = torch.randn(64, cols, generator=torch.Generator().manual_seed(step))
        layer(inputs).square().mean().backward()
        sent[label] = 0
        original = _count(sent, label)
        try:
            optimizer.step()
        finally:
            for name, function in original.items():
                setattr(dist, name, function)
        optimizer.zero_grad()
    if rank == 0:
        gathered = rows * cols * 4
        title = f"{rows}×{cols}, rank {rank_r}, 2 processes"
        print(f"| {title} | bytes all-reduced by each process | vs gathering |")
        print("|---|---|---|")
        for label, count in sent.items():
            print(f"| {label} | {count:,} ({count / 2**20:.1f} MiB) | {count / gathered:.3f} |")
        print(f"| gathering the gradient instead | {gathered:,} ({gathered / 2**20:.1f} MiB) | 1.000 |")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--cols", type=int, default=11008)
    parser.add_argument("--rank", type=int, default=1024)
    args = parser.parse_args()
    mp.spawn(_worker, args=(free_port(), args.rows, args.cols, args.rank), nprocs=WORLD, join=True)


if __name__ == "__main__":
    main()
