"""How far layer-wise updates are from ``optimizer.step()``, and from the stepping run itself with
the micro-batches summed in reverse order (a change of rounding only).

    python -m benchmarks.layerwise_equivalence [--steps 20] [--accumulation 4]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

import slimopt
from slimopt.models import build_llama
from slimopt.train.data import BYTE_VOCAB, read_bytes

CORPUS = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare.txt"
NAMES = ["adamw", "galore_adamw", "galore_adamw8bit", "galore_adamw_ternary"]


def train(name: str, batches: list[torch.Tensor], k: int, mode: str) -> list[torch.Tensor]:
    """Parameters after training; ``mode`` is "stepping", "reversed" or "layerwise"."""
    torch.manual_seed(0)
    model = build_llama((64, 172, 4, 2), BYTE_VOCAB, max_seq_len=128)
    projection = {"rank": 8, "update_proj_gap": 5} if name.startswith("galore") else {}
    optimizer = slimopt.build_optimizer(model, name, lr=3e-3, **projection)
    handle = slimopt.layerwise(optimizer, k) if mode == "layerwise" else None
    for step in range(len(batches) // k):
        group = batches[step * k : (step + 1) * k]
        for batch in reversed(group) if mode == "reversed" else group:
            (model(input_ids=batch, labels=batch).loss / k).backward()
        if handle is None:
            optimizer.step()
            optimizer.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def max_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--accumulation", type=int, default=4)
    args = parser.parse_args()
    tokens = read_bytes(CORPUS)
    generator = torch.Generator().manual_seed(0)
    count = args.steps * args.accumulation
    starts = torch.randint(0, len(tokens) - 32, (count, 4), generator=generator)
    batches = [torch.stack([tokens[s : s + 32] for s in row]) for row in starts]
    k = args.accumulation
    columns = [
        "k = 1: layer-wise vs stepping",
        f"k = {k}: layer-wise vs stepping",
        f"k = {k}: reversed vs stepping",
    ]
    print("| optimizer | " + " | ".join(columns) + " |")
    print("|---|---|---|---|")
    for name in NAMES:
        single = max_difference(
            train(name, batches[: args.steps], 1, "layerwise"),
            train(name, batches[: args.steps], 1, "stepping"),
        )
        stepping = train(name, batches, k, "stepping")
        layered = max_difference(train(name, batches, k, "layerwise"), stepping)
        reordered = max_difference(train(name, batches, k, "reversed"), stepping)
        print(f"| {name} | {single:.2g} | {layered:.2g} | {reordered:.2g} |", flush=True)


if __name__ == "__main__":
    main()
