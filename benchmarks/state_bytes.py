"""Optimizer state per parameter of every registry name: ``slimopt.state_nbytes`` after one step
of a 2048×2048 weight (projected names at rank 512), the numbers of the optimizer table on the
manual's home page and in the README, drawn as a bar chart.

    python -m benchmarks.state_bytes [--plot docs/assets/state_bytes.png]

prints the table and writes the plot (log scale: AdamW's 8 bytes to APOLLO-Mini's 0.004).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from slimopt import GaLoreAdamW, state_nbytes
from slimopt.registry import OPTIMIZERS

SIZE, RANK = 2048, 512


def bytes_per_param(states: str | None, rank: int | None, cls: type = GaLoreAdamW, **options: Any) -> float:
    """``state_nbytes`` per parameter after one step of ``cls`` on a 2048×2048 weight, with
    ``states`` (None: the class's own), in a group of ``rank`` (None: unprojected)."""
    weight = torch.zeros(SIZE, SIZE, requires_grad=True)
    group = {"params": [weight]} if rank is None else {"params": [weight], "rank": rank}
    optimizer = cls([group], lr=1e-3, **({} if states is None else {"states": states}), **options)
    weight.grad = torch.randn(SIZE, SIZE, generator=torch.Generator().manual_seed(0))
    optimizer.step()
    return state_nbytes(optimizer) / weight.numel()


def measured() -> dict[str, float]:
    """Bytes per parameter of each registry name, as ``build_optimizer`` configures its matrices
    (the name's own rank and options for APOLLO-Mini, rank 512 for the other projected names)."""
    found = {}
    for name, spec in OPTIMIZERS.items():
        rank = (spec.rank or RANK) if spec.projected else None
        found[name] = bytes_per_param(None, rank, spec.cls, **dict(spec.options))
    return found


def plot(values: dict[str, float], path: Path) -> None:
    """A horizontal bar per name, largest first, on a log scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ordered = sorted(values.items(), key=lambda item: item[1])
    figure, axis = plt.subplots(figsize=(8, 0.28 * len(ordered) + 1.2))
    axis.barh([name for name, _ in ordered], [value for _, value in ordered], color="tab:blue")
    for row, (_, value) in enumerate(ordered):
        axis.text(value * 1.08, row, f"{value:.3f}", va="center", fontsize=8)
    axis.set_xscale("log")
    axis.set_xlim(min(values.values()) / 2, max(values.values()) * 4)
    axis.set_xlabel(f"state bytes per parameter ({SIZE}×{SIZE} weight, projected at rank {RANK})")
    axis.grid(axis="x", alpha=0.3)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plot", default="runs/state_bytes.png")
    args = parser.parse_args(argv)
    values = measured()
    print("| name | bytes per parameter |\n|---|---|")
    for name, value in values.items():
        print(f"| `{name}` | {value:.3f} |")
    plot(values, Path(args.plot))
    return values


if __name__ == "__main__":
    main()
