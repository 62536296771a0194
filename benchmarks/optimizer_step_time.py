"""Median ``optimizer.step()`` time of registry optimizers on llama_9m (vocabulary 4096, batch
4×128), 2 threads, steps 6–25 of 25: a check that a refactoring of the core leaves step time
alone. Run it against two commits side by side (``PYTHONPATH=<worktree>/src``), alternating.

    .venv/bin/python benchmarks/optimizer_step_time.py adamw,galore_adamw8bit,adamw_ternary,taco
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import slimopt
from slimopt.models import build_llama


def median_step_seconds(name: str, steps: int = 25, warmup: int = 5) -> float:
    torch.manual_seed(0)
    model = build_llama("llama_9m", 4096, max_seq_len=128)
    options = {"rank": 64} if "galore" in name else {}
    optimizer = slimopt.build_optimizer(model, name, lr=1e-3, **options)
    batch = torch.randint(0, 4096, (4, 128))
    seconds = []
    for _ in range(steps):
        model(input_ids=batch, labels=batch).loss.backward()
        began = time.perf_counter()
        optimizer.step()
        seconds.append(time.perf_counter() - began)
        optimizer.zero_grad()
    return statistics.median(seconds[warmup:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("optimizers", help="comma-separated registry names")
    args = parser.parse_args()
    torch.set_num_threads(2)
    for name in args.optimizers.split(","):
        print(f"{name}: {median_step_seconds(name) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
