"""Optimizer-step time of one matrix with a random gradient: the fused loops of one storage
format without a model around them (min and median over many steps, after three that create
the state and compile).

    python -m benchmarks.one_matrix_step [--optimizer adamw8bit] [--shape 8192 512] [--steps 60]

Page faults of fresh temporaries are part of a step's time; to leave them out, run with
``GLIBC_TUNABLES=glibc.malloc.mmap_threshold=1073741824:glibc.malloc.trim_threshold=4294967296``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import slimopt

OPTIMIZERS = ("torch_adamw", "adamw", "adamw8bit", "adamw4bit", "adamw_ternary")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw8bit")
    parser.add_argument("--shape", type=int, nargs=2, default=(8192, 512), metavar=("ROWS", "COLS"))
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    if min(args.shape) < 1 or args.steps < 1:
        parser.error(f"--shape and --steps must be positive, got {args.shape} and {args.steps}")
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(args.shape))
    weight.grad = torch.randn(args.shape)
    if args.optimizer == "torch_adamw":
        optimizer = torch.optim.AdamW([weight], lr=1e-3, foreach=True)
    else:
        model = torch.nn.ParameterList([weight])
        optimizer = slimopt.build_optimizer(model, args.optimizer, lr=1e-3, fused=True)
    for _ in range(3):
        optimizer.step()
    seconds = []
    for _ in range(args.steps):
        start = time.perf_counter()
        optimizer.step()
        seconds.append(time.perf_counter() - start)
    shape = "×".join(map(str, args.shape))
    print(
        f"{args.optimizer} {shape}: min {min(seconds) * 1e3:.2f} ms, "
        f"median {statistics.median(seconds) * 1e3:.2f} ms over {args.steps} steps"
    )


if __name__ == "__main__":
    main()
