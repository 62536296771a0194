"""Python calls one ``optimizer.step()`` makes: the second step of one 256×256 fp32 parameter on the
reference path (``fused=False``), counted with ``sys.setprofile``: calls into the optimizer's own
package (slimopt, or ``torch/optim`` for torch's AdamW), the files they are in, how often the
running code switches file, and the functions called most.

    python -m benchmarks.step_calls [--optimizer adamw8bit] [--rank 32] [--top 8]
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections import Counter
from pathlib import Path
from types import FrameType
from typing import Any

import torch

import slimopt

OPTIMIZERS = ("torch_adamw", "adamw", "adamw8bit", "galore_adamw", "galore_adamw8bit", "adamw_ternary")
SLIMOPT = str(Path(slimopt.__file__).parent)
TORCH_OPTIM = str(Path(torch.optim.__file__).parent)


def build(name: str, rank: int) -> torch.optim.Optimizer:
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256, bias=False)
    model.weight.grad = torch.randn(256, 256)
    if name == "torch_adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    options: dict[str, Any] = {"rank": rank} if name.startswith("galore") else {}
    return slimopt.build_optimizer(model, name, lr=1e-3, fused=False, **options)


def count_calls(optimizer: torch.optim.Optimizer, package: str) -> list[tuple[str, str]]:
    """(file, function) of every Python call into ``package`` during one ``step()``."""
    calls: list[tuple[str, str]] = []

    def profile(frame: FrameType, event: str, _: object) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(package):
            calls.append((frame.f_code.co_filename[len(package) + 1 :], frame.f_code.co_name))

    sys.setprofile(profile)
    try:
        optimizer.step()
    finally:
        sys.setprofile(None)
    return calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--optimizer", choices=OPTIMIZERS, nargs="+", default=list(OPTIMIZERS))
    parser.add_argument("--rank", type=int, default=32, help="GaLore's rank (default 32)")
    parser.add_argument("--top", type=int, default=0, help="also list the N functions called most")
    args = parser.parse_args()
    if args.rank < 1 or args.top < 0:
        parser.error(f"--rank must be positive and --top not negative, got {args.rank} and {args.top}")
    print("| optimizer | calls | files | file switches | moment_codec calls |")
    print("|---|---|---|---|---|")
    for name in args.optimizer:
        optimizer = build(name, args.rank)
        optimizer.step()
        calls = count_calls(optimizer, TORCH_OPTIM if name == "torch_adamw" else SLIMOPT)
        files = [file for file, _ in calls]
        switches = sum(1 for before, after in itertools.pairwise(files) if before != after)
        codec = sum(1 for _, function in calls if function == "moment_codec")
        print(f"| {name} | {len(calls)} | {len(set(files))} | {switches} | {codec} |")
        for (file, function), count in Counter(calls).most_common(args.top):
            print(f"|   {file}:{function} | {count} | | | |")


if __name__ == "__main__":
    main()
