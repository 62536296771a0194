"""Bytes of optimizer state per parameter and optimizer-step time for every storage format,
side by side with bitsandbytes AdamW8bit, torchao AdamW8bit / AdamW4bit and torch's Adafactor,
in one run; slimopt's formats with a fused step (``slimopt.kernels``) run both ways,
``fused=False`` and ``True``.

Parameters are the projected matrices plus embedding, head and norms of a LLaMA preset with
random gradients; times are medians after warm-up steps (torchao compiles on its first step).

    python -m benchmarks.state_storage [--model llama_60m] [--rank 128] [--device cpu] [--only TEXT ...]

``--interleave`` builds the selected optimizers side by side and steps them in turn, one step
each per round: every row then sees the same state of a shared machine, and the table adds each
row's median time over the first row's (put torch's AdamW first) with the spread of that ratio
over the rounds.
"""

from __future__ import annotations

import argparse
import gc
import resource
import statistics
import time
from collections.abc import Callable

import torch

from benchmarks.refresh_speed import llama_parameters, timed
from slimopt import build_optimizer
from slimopt.models import LLAMA_PRESETS
from slimopt.train.bench import state_bytes


class _Params(torch.nn.Module):
    """Wraps loose tensors so build_optimizer can select the projected ones by name."""

    def __init__(self, projected: list[torch.Tensor], other: list[torch.Tensor]) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList()
        for weight in projected:
            linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
            linear.weight = torch.nn.Parameter(weight, requires_grad=True)
            self.blocks.append(linear)
        self.rest = torch.nn.ParameterList([torch.nn.Parameter(p, requires_grad=True) for p in other])


def parameters_with_gradients(model: str, device: str) -> torch.nn.Module:
    """The projected matrices, embedding, head and norms of LLaMA preset ``model`` on ``device``,
    seeded, each with a random gradient: what every row of this benchmark steps."""
    torch.manual_seed(0)
    module = _Params(*llama_parameters(model, device))
    for p in module.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    return module


def candidates(rank: int) -> dict[str, Callable[[torch.nn.Module], torch.optim.Optimizer]]:
    import bitsandbytes as bnb
    from torchao.optim import AdamW4bit, AdamW8bit

    return {
        "torch.optim.AdamW(foreach=True)": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, foreach=True),
        "bitsandbytes AdamW8bit": lambda m: bnb.optim.AdamW8bit(m.parameters(), lr=1e-3),
        "torchao AdamW8bit": lambda m: AdamW8bit(m.parameters(), lr=1e-3),
        "torchao AdamW4bit": lambda m: AdamW4bit(m.parameters(), lr=1e-3),
        "torch.optim.Adafactor(foreach=True)": lambda m: torch.optim.Adafactor(
            m.parameters(), lr=1e-3, foreach=True
        ),
        **{
            f"slimopt {name}{' ' + label if label else ''} (fused={fused})": (
                lambda m, name=name, options=options, fused=fused: build_optimizer(
                    m, name, lr=1e-3, fused=fused, **options
                )
            )
            for name, label, options in (
                ("adamw", "", {}),
                ("adamw8bit", "", {}),
                ("adamw4bit", "", {}),
                ("galore_adamw8bit", f"r{rank}", {"rank": rank, "update_proj_gap": 10**9}),
                ("adamw_ternary", "", {}),
                ("galore_adamw_ternary", f"r{rank}", {"rank": rank, "update_proj_gap": 10**9}),
                ("adafactor", "", {}),
                ("adafactor", "int8 beta1=0.9", {"states": "int8", "beta1": 0.9}),
            )
            for fused in (False, True)
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama_60m", choices=list(LLAMA_PRESETS))
    parser.add_argument("--rank", type=int, default=128)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--only", nargs="+", metavar="TEXT", help="only the rows whose name contains one")
    parser.add_argument("--interleave", action="store_true", help="step the rows in turn (see above)")
    args = parser.parse_args()
    print(
        f"device {args.device}, torch {torch.__version__}, {torch.get_num_threads()} threads, {args.model}\n"
    )
    if args.interleave:
        interleaved(args)
        return
    print("| optimizer | state bytes/param | step seconds | minor page faults/step |")
    print("|---|---|---|---|")
    for name, make in candidates(args.rank).items():
        if args.only and not any(text in name for text in args.only):
            continue
        model = parameters_with_gradients(args.model, args.device)
        count = sum(p.numel() for p in model.parameters())
        optimizer = make(model)
        optimizer.step()  # creates the state (and compiles, for torchao)
        # Fresh pages from the allocator explain much of the spread between runs on the CPU.
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        seconds = timed(optimizer.step, args.device, args.repeats)
        faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / (args.repeats + 1)
        print(f"| {name} | {state_bytes(optimizer) / count:.3f} | {seconds:.3f} | {faults:.0f} |", flush=True)
        del model, optimizer
        gc.collect()


def interleaved(args: argparse.Namespace) -> None:
    """The selected rows built side by side and stepped in turn (``--interleave``)."""
    rows = []
    for name, make in candidates(args.rank).items():
        if args.only and not any(text in name for text in args.only):
            continue
        model = parameters_with_gradients(args.model, args.device)
        optimizer = make(model)
        optimizer.step()  # creates the state (and compiles)
        optimizer.step()
        rows.append((name, model, optimizer, [], []))
    for _ in range(args.repeats):
        for _, _, optimizer, seconds, faults in rows:
            if args.device == "cuda":
                torch.cuda.synchronize()
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            start = time.perf_counter()
            optimizer.step()
            if args.device == "cuda":
                torch.cuda.synchronize()
            seconds.append(time.perf_counter() - start)
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    first = rows[0][3]
    print(
        f"| optimizer | state bytes/param | step seconds | × {rows[0][0]} (rounds: min–max) "
        "| minor page faults/step |"
    )
    print("|---|---|---|---|---|")
    for name, model, optimizer, seconds, faults in rows:
        count = sum(p.numel() for p in model.parameters())
        ratios = [mine / theirs for mine, theirs in zip(seconds, first, strict=True)]
        print(
            f"| {name} | {state_bytes(optimizer) / count:.3f} | {statistics.median(seconds):.3f} | "
            f"{statistics.median(seconds) / statistics.median(first):.2f} "
            f"({min(ratios):.2f}–{max(ratios):.2f}) | {statistics.mean(faults):.0f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
