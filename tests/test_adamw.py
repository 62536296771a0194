"""GaLoreAdamW against independent references: torch.optim.AdamW for plain groups and a float64
implementation of the GaLore paper's Algorithm 2 (with each subspace-change policy) for
projected groups."""

from __future__ import annotations

import pytest
import torch

from slimopt import GaLoreAdamW

from .support import gradient, relative_error, step_on_gradients


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unprojected_groups_reproduce_torch_adamw(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    shapes = [(24, 40), (40,), (3, 5, 7)]
    ours = [torch.randn(s).to(dtype).requires_grad_() for s in shapes]
    # The reference runs in fp32 and is rounded to the parameter dtype after every step, which is
    # what fp32 arithmetic on low-precision parameters means.
    reference = [p.detach().float().clone().requires_grad_() for p in ours]
    hyper = {"lr": 3e-3, "betas": (0.8, 0.95), "eps": 1e-6, "weight_decay": 0.1}
    optimizer = GaLoreAdamW(ours, **hyper)
    torch_optimizer = torch.optim.AdamW(reference, foreach=False, **hyper)
    for step in range(50):
        for p, q, shape in zip(ours, reference, shapes, strict=True):
            g = gradient(step, shape)
            p.grad = g.to(dtype)
            q.grad = g.to(dtype).float()
        optimizer.step()
        torch_optimizer.step()
        with torch.no_grad():
            for q in reference:
                q.copy_(q.to(dtype).float())
    for p, q in zip(ours, reference, strict=True):
        assert p.dtype == dtype
        assert relative_error(p, q) <= 1e-6


def canonical(vectors: torch.Tensor, dim: int) -> torch.Tensor:
    """Flip singular vectors so that the largest-magnitude entry of each is positive."""
    index = vectors.abs().argmax(dim=dim, keepdim=True)
    return vectors * torch.sign(vectors.gather(dim, index))


def galore_reference(shape, steps, rank, gap, policy, proj_type, lr, betas, eps, wd, scale):
    """Algorithm 2 of arXiv 2403.03507 in float64 with torch.optim's eps placement."""
    torch.manual_seed(0)
    weight = torch.randn(shape, dtype=torch.float64)
    rows, cols = shape
    use_left = {"left": True, "right": False, "full": True, "std": rows < cols}[proj_type]
    use_right = {"left": False, "right": True, "full": True, "std": rows >= cols}[proj_type]
    beta1, beta2 = betas
    left = right = m = v = None
    age = 0
    for step in range(steps):
        g = gradient(step, shape).double()
        if step % gap == 0:
            u, _, vh = torch.linalg.svd(g, full_matrices=False)
            new_left = canonical(u[:, :rank], 0) if use_left else None
            new_right = canonical(vh[:rank], 1) if use_right else None
            if m is not None and policy == "reset":
                m, v, age = torch.zeros_like(m), torch.zeros_like(v), 0
            elif m is not None and policy == "rotate":
                if use_left:
                    q = new_left.T @ left
                    m, v = q @ m, (q * q) @ v
                if use_right:
                    q = new_right @ right.T
                    m, v = m @ q.T, v @ (q * q).T
            left, right = new_left, new_right
        r = g
        if use_left:
            r = left.T @ r
        if use_right:
            r = r @ right.T
        if m is None:
            m, v = torch.zeros_like(r), torch.zeros_like(r)
        age += 1
        m = beta1 * m + (1 - beta1) * r
        v = beta2 * v + (1 - beta2) * r * r
        n = (m / (1 - beta1**age)) / ((v / (1 - beta2**age)).sqrt() + eps)
        if use_left:
            n = left @ n
        if use_right:
            n = n @ right
        weight = weight * (1 - lr * wd) - lr * scale * n
    return weight


@pytest.mark.parametrize("policy", ["keep", "reset", "rotate"])
@pytest.mark.parametrize(("shape", "proj_type"), [((24, 40), "std"), ((40, 24), "std"), ((24, 40), "full")])
def test_projected_groups_match_float64_algorithm(policy, shape, proj_type) -> None:
    # eps well above fp32 round-off: at a refresh the two-sided projection of the current gradient is
    # diagonal, and Adam would blow its ~1e-7 off-diagonal round-off up to O(1) updates.
    hyper = {"lr": 1e-2, "betas": (0.9, 0.99), "eps": 1e-4, "weight_decay": 0.05}
    torch.manual_seed(0)
    weight = torch.randn(shape, dtype=torch.float64).float().requires_grad_()
    optimizer = GaLoreAdamW(
        [{"params": [weight], "rank": 6, "update_proj_gap": 10, "scale": 0.5, "proj_type": proj_type}],
        proj_method="svd",
        on_subspace_change=policy,
        stagger=False,
        **hyper,
    )
    step_on_gradients([weight], optimizer, range(30))
    expected = galore_reference(
        shape, 30, 6, 10, policy, proj_type, hyper["lr"], hyper["betas"], hyper["eps"], 0.05, scale=0.5
    )
    assert relative_error(weight.detach(), expected) <= 1e-5


def test_full_rank_basis_is_not_plain_adamw() -> None:
    """Adam is not rotation-invariant: a full-rank projected run must differ from AdamW."""
    torch.manual_seed(0)
    a = torch.randn(16, 16, requires_grad=True)
    b = a.detach().clone().requires_grad_()
    projected = GaLoreAdamW([{"params": [a], "rank": 16, "scale": 1.0}], lr=1e-2, proj_method="svd")
    plain = torch.optim.AdamW([b], lr=1e-2)
    for step in range(5):
        a.grad = gradient(step, (16, 16))
        b.grad = gradient(step, (16, 16))
        projected.step()
        plain.step()
    assert relative_error(a, b) > 1e-4
