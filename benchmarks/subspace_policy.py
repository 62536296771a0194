"""How an optimizer option changes convergence: by default the moment policy when the GaLore
basis changes (keep, reset or rotate); ``--option basis_states --values fp32 bf16 int8`` compares
how the bases are stored, ``--optimizer adamw --option param_rounding --values nearest stochastic
--dtypes fp32 bf16`` how updates are rounded into bf16 weights.

Trains a small byte-level LLaMA on tinyshakespeare for each weight dtype, value and seed and
prints the validation loss at the end (mean over the seeds) as a markdown table.

    python benchmarks/subspace_policy.py [--steps 400] [--seeds 0 1] [--corpus PATH]
                                         [--option NAME --values A B …] [--dims 128 344 4 4] [--rank 16]
                                         [--optimizer galore_adamw] [--lr 1e-2] [--dtypes fp32 bf16]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from slimopt import build_optimizer
from slimopt.models import build_llama
from slimopt.train.data import BYTE_VOCAB, read_bytes, sample_batch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DEFAULT_CORPUS = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare.txt"


@torch.no_grad()
def validation_loss(model: torch.nn.Module, tokens: torch.Tensor, batches: int = 20) -> float:
    generator = torch.Generator().manual_seed(1234)
    losses = []
    for _ in range(batches):
        batch = sample_batch(tokens, 16, 128, generator)
        losses.append(model(input_ids=batch, labels=batch).loss.item())
    return statistics.mean(losses)


def run(option: dict[str, str], seed: int, train: torch.Tensor, val: torch.Tensor, args) -> float:
    steps = args.steps
    torch.manual_seed(seed)
    model = build_llama(tuple(args.dims), BYTE_VOCAB, max_seq_len=128).to(DTYPES[option.pop("dtype")])
    projection = {"rank": args.rank, "update_proj_gap": 50} if "galore" in args.optimizer else {}
    optimizer = build_optimizer(model, args.optimizer, lr=args.lr, **projection, **option)
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
    parser.add_argument("--optimizer", default="galore_adamw", help="a slimopt optimizer name")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=["fp32"], help="weight dtypes")
    args = parser.parse_args()
    tokens = read_bytes(args.corpus)
    split = int(0.9 * tokens.numel())
    train, val = tokens[:split], tokens[split:]
    print(f"| weights | {args.option} | validation loss per seed | mean | seconds |")
    print("|---|---|---|---|---|")
    for dtype in args.dtypes:
        for value in args.values:
            start = time.perf_counter()
            option = {args.option: value, "dtype": dtype}
            losses = [run(dict(option), seed, train, val, args) for seed in args.seeds]
            per_seed = ", ".join(f"{loss:.4f}" for loss in losses)
            elapsed = time.perf_counter() - start
            mean = statistics.mean(losses)
            print(f"| {dtype} | {value} | {per_seed} | {mean:.4f} | {elapsed:.0f} |", flush=True)


if __name__ == "__main__":
    main()
