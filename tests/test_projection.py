"""Projection pieces: fast refresh quality on real gradients, signs, shapes, rotation."""

from __future__ import annotations

import pytest
import torch

from slimopt.projection import Basis, canonicalize_signs, compute_basis, project, project_back, rotate, sides
from slimopt.train.data import sample_batch

from .conftest import tiny_llama


def captured_energy(grad: torch.Tensor, basis: Basis) -> float:
    return (project(grad, basis).norm() ** 2 / grad.norm() ** 2).item()


@pytest.fixture(scope="module")
def training_gradients(shakespeare_tokens: torch.Tensor) -> dict[int, dict[str, torch.Tensor]]:
    """Gradients of every attention and MLP matrix of a small LLaMA at steps 10, 40 and 70."""
    model = tiny_llama(0, (128, 344, 4, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    snapshots = {}
    for step in range(71):
        batch = sample_batch(shakespeare_tokens, 8, 64, generator)
        model(input_ids=batch, labels=batch).loss.backward()
        if step in (10, 40, 70):
            snapshots[step] = {
                n: p.grad.clone() for n, p in model.named_parameters() if p.dim() == 2 and "layers" in n
            }
        optimizer.step()
        optimizer.zero_grad()
    return snapshots


@pytest.mark.parametrize("rank", [8, 32])
def test_fast_refresh_captures_the_energy_of_exact_svd(training_gradients, rank: int) -> None:
    generator = torch.Generator().manual_seed(0)
    for name in training_gradients[10]:
        uses = sides(tuple(training_gradients[10][name].shape), "std")
        basis = None
        for step in (10, 40, 70):  # a cold start, then two warm refreshes 30 steps apart
            grad = training_gradients[step][name]
            basis = compute_basis(grad, rank, uses, "subspace", basis, generator)
            exact = compute_basis(grad, rank, uses, "svd")
            ratio = captured_energy(grad, basis) / captured_energy(grad, exact)
            assert ratio >= 0.99, f"{name} step {step}: {ratio:.4f} of the exact energy"


@pytest.mark.parametrize("uses", [(True, False), (False, True), (True, True)])
def test_subspace_method_recovers_exact_singular_vectors(uses) -> None:
    torch.manual_seed(0)
    left = torch.linalg.qr(torch.randn(60, 60)).Q
    right = torch.linalg.qr(torch.randn(90, 60)).Q
    grad = (left * torch.logspace(0, -4, 60)) @ right.T
    exact = compute_basis(grad, 6, uses, "svd")
    fast = compute_basis(grad, 6, uses, "subspace", None, torch.Generator().manual_seed(1))
    for a, b in zip(exact, fast, strict=True):
        if a is not None:
            torch.testing.assert_close(a, b, atol=1e-3, rtol=0)


def test_signs_are_canonical() -> None:
    vectors = torch.tensor([[0.1, -0.9], [-0.8, 0.2]])
    canonicalize_signs(vectors, 0)
    torch.testing.assert_close(vectors, torch.tensor([[-0.1, 0.9], [0.8, -0.2]]))


@pytest.mark.parametrize(
    ("proj_type", "shape", "projected_shape"),
    [
        ("std", (30, 20), (30, 4)),
        ("std", (20, 30), (4, 30)),
        ("reverse_std", (30, 20), (4, 20)),
        ("reverse_std", (20, 30), (20, 4)),
        ("left", (30, 20), (4, 20)),
        ("right", (30, 20), (30, 4)),
        ("full", (30, 20), (4, 4)),
    ],
)
def test_projection_shapes_follow_galore_torch(proj_type, shape, projected_shape) -> None:
    grad = torch.randn(shape)
    basis = compute_basis(grad, 4, sides(shape, proj_type), "svd")
    low = project(grad, basis)
    assert low.shape == projected_shape
    assert project_back(low, basis).shape == shape


def test_rotation_is_exact_for_a_permuted_basis() -> None:
    torch.manual_seed(0)
    old = Basis(torch.linalg.qr(torch.randn(12, 4)).Q, None)
    new = Basis(old.left[:, [2, 0, 3, 1]], None)
    first, second = torch.randn(4, 7), torch.rand(4, 7)
    torch.testing.assert_close(rotate(first, old, new, squared=False), first[[2, 0, 3, 1]])
    torch.testing.assert_close(rotate(second, old, new, squared=True), second[[2, 0, 3, 1]])


def test_rotation_preserves_the_full_space_update() -> None:
    """With the same span, a rotated first moment maps back to the same full-size matrix."""
    torch.manual_seed(0)
    old = Basis(None, torch.linalg.qr(torch.randn(9, 3)).Q.T)
    mixing = torch.linalg.qr(torch.randn(3, 3)).Q
    new = Basis(None, mixing @ old.right)
    moment = torch.randn(5, 3)
    rotated = rotate(moment, old, new, squared=False)
    torch.testing.assert_close(project_back(rotated, new), project_back(moment, old), atol=1e-5, rtol=0)
    assert (rotate(moment.square(), old, new, squared=True) >= 0).all()


@pytest.mark.parametrize("sides", ["left", "right", "full"])
def test_projecting_back_compiles_as_it_runs_eagerly(sides) -> None:
    """torch.compile of a training step traces the optimizer too. Inductor on the CPU computes
    ``w.add_(d @ r, alpha=a)`` wrongly (17.1 off eager on 64×48, torch 2.13), the pattern an
    update projected back would be; ``add_projected_back`` is an ``addmm_``, compiled exactly."""
    from slimopt.projection import Basis, add_projected_back

    generator = torch.Generator().manual_seed(0)
    left = torch.randn(64, 8, generator=generator) if sides in ("left", "full") else None
    right = torch.randn(8, 48, generator=generator) if sides in ("right", "full") else None
    update = torch.randn(8 if left is not None else 64, 8 if right is not None else 48, generator=generator)
    weights = torch.randn(64, 48, generator=generator)
    rows = slice(8, 40)

    def step(target: torch.Tensor) -> torch.Tensor:
        add_projected_back(target[rows], update, Basis(left, right), rows, alpha=-0.37)
        return target

    eager = step(weights.clone())
    compiled = torch.compile(step)(weights.clone())
    torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-6)
    expected = weights.clone()
    if left is not None:
        back = left[rows] @ update
        back = back @ right if right is not None else back
    else:
        back = update[rows] @ right
    expected[rows] += -0.37 * back
    torch.testing.assert_close(eager, expected, rtol=1e-5, atol=1e-5)
