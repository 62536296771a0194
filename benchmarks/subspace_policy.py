"""How a projection option changes convergence: by default the moment policy when the GaLore
basis changes (keep, reset or rotate); ``--option basis_states --values fp32 bf16 int8`` compares
how the bases are stored.

Trains a small byte-level LLaMA on tinyshakespeare with GaLoreAdamW for each value and seed and
prints the validation loss at the end (mean over the seeds) as a markdown table.

    python benchmarks/subspace_policy.py [--steps 400] [--seeds 0 1] [--corpus PATH]
                                         [--option NAME --values A B …] [--dims 128 344 4 4] [--rank 16]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from slimopt import build_optimizer
from slimopt.train.data import BYTE_VOCAB, read_bytes, sample_batch
from slimopt.train.models import build_llama

DEFAULT_CORPUS = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare.txt"


@torch.no_grad()
def validation_loss(model: torch.nn.Module, tokens: torch.Tensor, batches: int = 20) -> float:
    generator = torch.Generator().manual_seed(1234)
    losses = []
    for _ in range(batches):
        batch = sample_batch(tokens, 16, 128, generator)
        losses.append(model(input_ids=batch, labels=batch).loss.item())
    return statistics.mean(losses)


def run(
    option: dict[str, str], seed: int, steps: int, train: torch.Tensor, val: torch.Tensor, dims, rank
) -> float:
    torch.manual_seed(seed)
    model = build_llama(tuple(dims), BYTE_VOCAB, max_seq_len=128)
    optimizer = build_optimizer(model, "galore_adamw", lr=1e-2, rank=rank, update_proj_gap=50, **option)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda t: min(1.0, (t + 1) / (steps // 10)))
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        batch = sample_batch(train, 16, 128, generator)
        model(input_ids=batch, labels=batch).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
    return validation_loss(model, val)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS)
    parser.add_argument("--option", default="on_subspace_change", help="a GaLoreAdamW projection option")
    parser.add_argument("--values", nargs="+", default=["keep", "reset", "rotate"])
    parser.add_argument(
        "--dims", type=int, nargs=4, default=[128, 344, 4, 4], help="hidden intermediate heads layers"
    )
    parser.add_argument("--rank", type=int, default=16)
    args = parser.parse_args()
    tokens = read_bytes(args.corpus)
    split = int(0.9 * tokens.numel())
    train, val = tokens[:split], tokens[split:]
    print(f"| {args.option} | validation loss per seed | mean | seconds |")
    print("|---|---|---|---|")
    for value in args.values:
        start = time.perf_counter()
        losses = [
            run({args.option: value}, seed, args.steps, train, val, args.dims, args.rank)
            for seed in args.seeds
        ]
        per_seed = ", ".join(f"{loss:.4f}" for loss in losses)
        elapsed = time.perf_counter() - start
        print(f"| {value} | {per_seed} | {statistics.mean(losses):.4f} | {elapsed:.0f} |", flush=True)


if __name__ == "__main__":
    main()
