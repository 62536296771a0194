"""Convergence smoke: GaLore trains a small LLaMA on Shakespeare as well as AdamW, and better
than the same optimizer projecting onto random subspaces of the same rank."""

from __future__ import annotations

import pytest
import torch

import slimopt.projection
from slimopt import build_optimizer
from slimopt.projection import Basis
from slimopt.train.data import sample_batch

from .conftest import tiny_llama


def final_training_loss(
    tokens: torch.Tensor,
    name: str,
    steps: int = 100,
    dims: tuple[int, int, int, int] | None = None,
    **options,
) -> float:
    """Mean training loss of the last 10 of ``steps`` steps; ``name`` is a slimopt name or
    "torch_adamw"; ``dims`` overrides the tiny LLaMA's (hidden, intermediate, heads, layers)."""
    model = tiny_llama(0) if dims is None else tiny_llama(0, dims)
    if name == "torch_adamw":
        optimizer = torch.optim.AdamW(model.parameters(), **options)
    else:
        optimizer = build_optimizer(model, name, **options)
    generator = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(steps):
        batch = sample_batch(tokens, 16, 64, generator)
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert all(torch.isfinite(p).all() for p in model.parameters())
    return sum(losses[-10:]) / 10


@pytest.fixture(scope="module")
def adamw_loss(shakespeare_tokens: torch.Tensor) -> float:
    loss = final_training_loss(shakespeare_tokens, "torch_adamw", lr=3e-3)
    assert loss < 2.6  # from ln(256) = 5.5 at the start
    return loss


def random_basis(grad: torch.Tensor, rank: int, uses: tuple[bool, bool], *args) -> Basis:
    """Orthonormal factors of the shapes compute_basis returns, spanning a random subspace."""
    generator = torch.Generator().manual_seed(int(grad.abs().sum().item() * 1000) % 2**31)
    rows, cols = grad.shape
    rank = min(rank, rows, cols)
    left = torch.linalg.qr(torch.randn(rows, rank, generator=generator)).Q if uses[0] else None
    right = torch.linalg.qr(torch.randn(cols, rank, generator=generator)).Q.T if uses[1] else None
    return Basis(left, right)


def final_training_losses(tokens: torch.Tensor, name: str, **options) -> tuple[float, float]:
    """``final_training_loss`` of a projecting optimizer, and the same when every refresh picks
    a random subspace of the same rank instead of the gradient's top one."""
    loss = final_training_loss(tokens, name, **options)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(slimopt.projection, "compute_basis", random_basis)
        return loss, final_training_loss(tokens, name, **options)


def test_galore_adamw_trains_as_well_as_adamw(shakespeare_tokens: torch.Tensor, adamw_loss: float) -> None:
    galore, random = final_training_losses(
        shakespeare_tokens, "galore_adamw", lr=1e-2, rank=8, update_proj_gap=50
    )
    assert galore <= 1.05 * adamw_loss
    # Rank 8 of 64: measured 2.427 against 2.516 for random subspaces (GaLoreAdafactor: 2.477,
    # 2.546; at rank 16 the gaps are half as large); the bound asks for half of the smaller gap.
    assert galore <= random - 0.035


def test_galore_adafactor_trains_as_well_as_adamw(
    shakespeare_tokens: torch.Tensor, adamw_loss: float
) -> None:
    loss, random = final_training_losses(
        shakespeare_tokens,
        "galore_adafactor",
        lr=1e-2,
        beta1=0.9,
        scale_parameter=False,
        rank=8,
        update_proj_gap=50,
    )
    assert loss <= 1.05 * adamw_loss
    assert loss <= random - 0.035


def validation_loss_after(tokens: torch.Tensor, name: str, **options) -> float:
    """Train a 2-layer, 128-wide byte LLaMA for 200 steps on the first 90% of the corpus and
    return its mean loss on 8 batches of the last 10%."""
    split = int(0.9 * tokens.numel())
    model = tiny_llama(0, (128, 344, 4, 2))
    if name == "torch_adamw":
        optimizer = torch.optim.AdamW(model.parameters(), **options)
    else:
        optimizer = build_optimizer(model, name, **options)
    generator = torch.Generator().manual_seed(0)
    for _ in range(200):
        batch = sample_batch(tokens[:split], 16, 64, generator)
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        losses = [
            model(
                input_ids=(batch := sample_batch(tokens[split:], 16, 64, generator)), labels=batch
            ).loss.item()
            for _ in range(8)
        ]
    return sum(losses) / len(losses)


@pytest.fixture(scope="module")
def fp32_adamw_validation_loss(shakespeare_tokens: torch.Tensor) -> float:
    return validation_loss_after(shakespeare_tokens, "torch_adamw", lr=3e-3)


@pytest.mark.slow  # a 200-step training per format: ~10 s each
@pytest.mark.parametrize(
    ("name", "tolerance"),
    [
        ("adamw8bit", 0.02),
        ("adamw4bit", 0.02),
        ("adamw_ternary", 0.04),
        ("galore_adamw8bit", 0.02),
        ("galore_adamw4bit", 0.02),
        ("galore_adamw_ternary", 0.04),
    ],
)
def test_compressed_states_train_as_well_as_fp32_adamw(
    shakespeare_tokens: torch.Tensor, fp32_adamw_validation_loss: float, name: str, tolerance: float
) -> None:
    # rank 32 keeps the projected states (32×128, 344×32) above the 4096-element fp32 threshold.
    options = {"lr": 1e-2, "rank": 32, "update_proj_gap": 50} if name.startswith("galore") else {"lr": 3e-3}
    loss = validation_loss_after(shakespeare_tokens, name, **options)
    print(f"{name}: validation loss {loss:.4f}, fp32 AdamW {fp32_adamw_validation_loss:.4f}")
    assert loss <= (1 + tolerance) * fp32_adamw_validation_loss
