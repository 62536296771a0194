"""Projection refresh and optimizer step timings on LLaMA-shaped matrices.

(a) one refresh of a 1024×2752 gradient at rank 256 and of every projected matrix of a LLaMA
preset, exact SVD vs slimopt's warm-started subspace method; (b) one optimizer step over all the
preset's parameters, torch.optim.AdamW(foreach=True) vs slimopt's adamw and galore_adamw.

    python benchmarks/refresh_speed.py [--model llama_60m] [--rank 128] [--device cpu] [--no-step]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from slimopt import GaLoreAdamW, state_nbytes
from slimopt.models import LLAMA_PRESETS
from slimopt.projection import compute_basis, sides

VOCAB = 32000


def timed(fn: Callable[[], object], device: str, repeats: int) -> float:
    """Median seconds of ``repeats`` calls after one warm-up call."""
    fn()
    samples = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def gradient_like(shape: tuple[int, int], device: str) -> torch.Tensor:
    """A gradient with a decaying spectrum plus noise, as training gradients have."""
    rows, cols = shape
    k = min(rows, cols)
    left = torch.linalg.qr(torch.randn(rows, k, device=device)).Q
    right = torch.linalg.qr(torch.randn(cols, k, device=device)).Q
    spectrum = torch.arange(1, k + 1, device=device, dtype=torch.float32) ** -1.0
    return (left * spectrum) @ right.T + 1e-3 * torch.randn(rows, cols, device=device)


def refresh_times(shape: tuple[int, int], rank: int, device: str, repeats: int) -> tuple[float, float]:
    grad = gradient_like(shape, device)
    uses = sides(shape, "std")
    generator = torch.Generator().manual_seed(0)
    previous = compute_basis(grad + 0.1 * gradient_like(shape, device), rank, uses, "svd")
    exact = timed(lambda: compute_basis(grad, rank, uses, "svd"), device, max(1, repeats // 3))
    warm = timed(lambda: compute_basis(grad, rank, uses, "subspace", previous, generator), device, repeats)
    return exact, warm


def llama_matrices(preset: str) -> dict[tuple[int, int], int]:
    """Shape → count of the projected (attention and MLP) matrices of a preset."""
    shape = LLAMA_PRESETS[preset]
    hidden, layers = shape.hidden, shape.layers
    key_values = hidden // shape.heads * (shape.kv_heads or shape.heads)  # grouped-query attention
    counts: dict[tuple[int, int], int] = {}
    for matrix, count in (
        ((hidden, hidden), 2 * layers),  # queries, output
        ((key_values, hidden), 2 * layers),  # keys, values
        ((shape.intermediate, hidden), 2 * layers),  # gate, up
        ((hidden, shape.intermediate), layers),  # down
    ):
        counts[matrix] = counts.get(matrix, 0) + count
    return counts


def llama_parameters(preset: str, device: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(projected matrices, other parameters) of a preset, with random gradients attached."""
    hidden = LLAMA_PRESETS[preset].hidden
    projected = [
        torch.randn(shape, device=device) * 0.02
        for shape, count in llama_matrices(preset).items()
        for _ in range(count)
    ]
    layers = LLAMA_PRESETS[preset].layers
    other = [torch.randn(VOCAB, hidden, device=device) * 0.02 for _ in range(2)]
    other += [torch.ones(hidden, device=device) for _ in range(2 * layers + 1)]
    for p in projected + other:
        p.requires_grad_()
        p.grad = torch.randn_like(p) * 1e-3
    return projected, other


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama_60m", choices=list(LLAMA_PRESETS))
    parser.add_argument("--rank", type=int, default=128)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--no-step", action="store_true", help="time only the refreshes")
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"device {args.device}, torch {torch.__version__}, {torch.get_num_threads()} threads\n")

    exact, warm = refresh_times((1024, 2752), 256, args.device, args.repeats)
    print("| refresh of one 1024×2752 gradient, rank 256 | seconds |")
    print("|---|---|")
    print(f'| exact SVD (`proj_method="svd"`) | {exact:.4f} |')
    print(f'| warm subspace (`proj_method="subspace"`) | {warm:.4f} |')
    print(f"| speed-up | {exact / warm:.1f}× |\n")

    total_exact = total_warm = 0.0
    for shape, count in llama_matrices(args.model).items():
        exact, warm = refresh_times(shape, args.rank, args.device, max(3, args.repeats // 3))
        total_exact += count * exact
        total_warm += count * warm
    matrices = sum(llama_matrices(args.model).values())
    print(f"| refresh of all {matrices} projected matrices of {args.model}, rank {args.rank} | seconds |")
    print("|---|---|")
    print(f"| exact SVD | {total_exact:.2f} |")
    print(f"| warm subspace | {total_warm:.2f} |")
    print(f"| speed-up | {total_exact / total_warm:.1f}× |\n")

    if args.no_step:
        return
    projected, other = llama_parameters(args.model, args.device)
    every = projected + other
    candidates = {
        "torch.optim.AdamW(foreach=True)": torch.optim.AdamW(every, lr=1e-3, foreach=True),
        "slimopt adamw": GaLoreAdamW(every, lr=1e-3),
        f"slimopt galore_adamw r{args.rank} (between refreshes)": GaLoreAdamW(
            [{"params": projected, "rank": args.rank, "update_proj_gap": 10**9}, {"params": other}], lr=1e-3
        ),
    }
    print(f"| optimizer step over all {args.model} parameters | seconds | state MiB |")
    print("|---|---|---|")
    for name, optimizer in candidates.items():
        seconds = timed(optimizer.step, args.device, args.repeats)
        print(f"| {name} | {seconds:.4f} | {state_nbytes(optimizer) / 2**20:.1f} |")


if __name__ == "__main__":
    main()
