"""The vote on non-finite gradients on the CPU: ``slimopt.finite.finite_flags`` (each gradient's
sum, its extremes only where the sum is not finite) beside each gradient's extremes
(``torch.aminmax``, the vote before), on a LLaMA preset's gradients (random, all finite).

    OMP_NUM_THREADS=1 python -m benchmarks.finite_vote [--model llama_60m] [--repeats 10]

prints the median time of each vote over all gradients.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from slimopt.finite import finite_flags
from slimopt.models import LLAMA_PRESETS, build_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=list(LLAMA_PRESETS), default="llama_60m")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be a positive integer, got {args.repeats}")
    grads = [torch.randn_like(p) for p in build_model(args.model, 32000, 256).parameters()]
    votes: dict[str, Callable[[], object]] = {
        "each gradient's extremes (aminmax)": lambda: [torch.aminmax(g) for g in grads],
        "slimopt.finite.finite_flags (sums)": lambda: finite_flags(grads, [None] * len(grads)),
    }
    elements = sum(g.numel() for g in grads)
    threads = torch.get_num_threads()
    print(f"{args.model}: {len(grads)} gradients, {elements / 1e6:.1f}M elements, {threads} thread(s)")
    print()
    print("| vote | median ms |")
    print("|---|---|")
    for label, vote in votes.items():
        vote()
        seconds = []
        for _ in range(args.repeats):
            began = time.perf_counter()
            vote()
            seconds.append(time.perf_counter() - began)
        print(f"| {label} | {statistics.median(seconds) * 1000:.1f} |")


if __name__ == "__main__":
    main()
